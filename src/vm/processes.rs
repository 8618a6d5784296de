//! The processes a VM runs: `spawn` (with its mounts validated and mapped
//! into the agent's view), stdin, kill, `mountPath`, `readFile`, and the
//! host's process table, which turns the agent's output and exit messages
//! into client events (output decoded as UTF-8 across chunk boundaries).
//!
//! Limits: exited records are kept for the last [`EXITED_RECORDS`]
//! processes; a mount of the host root is refused.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::Path;

use guest_agent::proto::{self, AgentMessage, MountMode, MountSpec, Op};
use serde_json::{json, Value};

use super::{lock, Vm, VmError, CALL_TIMEOUT};
use crate::backend::HostPaths;
use crate::events;
use crate::protocol::event;
use crate::utf8::Utf8Stream;

/// Exited process records kept for `isProcessRunning`.
pub const EXITED_RECORDS: usize = 4096;

/// A process as the host knows it.
#[derive(Debug, Default)]
pub(super) struct ProcRecord {
    pub(super) session: String,
    pub(super) running: bool,
    exit_code: Option<i32>,
    stdout: Utf8Stream,
    stderr: Utf8Stream,
}

/// Process table shared with the link reader.
#[derive(Default)]
pub(super) struct Procs {
    pub(super) map: HashMap<String, ProcRecord>,
    exited: VecDeque<String>,
}

impl Procs {
    pub(super) fn mark_exited(&mut self, id: &str, code: Option<i32>) {
        if let Some(r) = self.map.get_mut(id) {
            if r.running {
                r.running = false;
                r.exit_code = code;
                self.exited.push_back(id.to_string());
            }
        }
        while self.exited.len() > EXITED_RECORDS {
            if let Some(old) = self.exited.pop_front() {
                if self.map.get(&old).is_some_and(|r| !r.running) {
                    self.map.remove(&old);
                }
            }
        }
    }
}

/// What `spawn` needs beyond the agent's [`proto::SpawnSpec`].
pub struct SpawnRequest {
    pub spec: proto::SpawnSpec,
    /// `additionalMounts`: name → (host path relative to `/`, mode string).
    pub mounts: Vec<(String, String, String)>,
}

impl Vm {
    pub(super) async fn flush_output(&self, id: &str) {
        let (out, err) = {
            let mut procs = lock(&self.procs);
            match procs.map.get_mut(id) {
                Some(r) => (r.stdout.finish(), r.stderr.finish()),
                None => (None, None),
            }
        };
        if let Some(s) = out {
            self.hub.publish(&event::output("stdout", id, &s)).await;
        }
        if let Some(s) = err {
            self.hub.publish(&event::output("stderr", id, &s)).await;
        }
    }

    /// Routes one unsolicited agent message.
    pub(super) async fn on_agent_message(&self, msg: AgentMessage, payload: &[u8]) {
        match msg {
            AgentMessage::Stdout { id } => self.on_output(true, id, payload).await,
            AgentMessage::Stderr { id } => self.on_output(false, id, payload).await,
            AgentMessage::Exit {
                id,
                exit_code,
                signal,
                oom_kill_count,
            } => {
                self.flush_output(&id).await;
                lock(&self.procs).mark_exited(&id, exit_code);
                tracing::debug!(id = %id, exit_code, signal = signal.as_deref(), "process exited");
                self.hub
                    .publish(&event::exit(
                        &id,
                        exit_code,
                        signal.as_deref(),
                        oom_kill_count,
                    ))
                    .await;
            }
            AgentMessage::Error { id, message, fatal } => {
                self.hub.publish(&event::error(&id, &message, fatal)).await;
            }
            AgentMessage::Request { id, method, params } => {
                tracing::debug!(id = %id, method = %method, "guest request");
                self.hub
                    .publish(&event::guest_request(&id, &method, &params))
                    .await;
            }
            AgentMessage::Hello(_) | AgentMessage::Response { .. } => {
                tracing::warn!("unexpected agent message ignored");
            }
        }
    }

    async fn on_output(&self, stdout: bool, id: String, bytes: &[u8]) {
        let stream = if stdout { "stdout" } else { "stderr" };
        let frame = {
            let mut procs = lock(&self.procs);
            let rec = procs.map.entry(id.clone()).or_default();
            let decoder = if stdout {
                &mut rec.stdout
            } else {
                &mut rec.stderr
            };
            decoder.push_with(bytes, |text| {
                (!text.is_empty()).then(|| events::output_frame(stream, &id, text))
            })
        };
        if let Some(frame) = frame {
            self.hub.publish_output(frame).await;
        }
    }

    /// Validates a client mount and maps it into the agent's view.
    fn mount_spec(
        &self,
        host_paths: &HostPaths,
        session: &str,
        name: &str,
        host_path: &str,
        mode: &str,
    ) -> Result<MountSpec, String> {
        guest_agent::names::mount_name(name).map_err(|e| e.to_string())?;
        let mode = MountMode::parse(mode)
            .ok_or_else(|| format!("mount {name:?}: mode must be ro, rw or rwd, got {mode:?}"))?;
        let rel = guest_agent::names::host_relative_path(host_path).map_err(|e| e.to_string())?;
        let real = std::fs::canonicalize(Path::new("/").join(&rel))
            .map_err(|e| format!("mount {name:?}: host path /{rel}: {e}"))?;
        let real_rel = real
            .strip_prefix("/")
            .ok()
            .and_then(|p| p.to_str())
            .filter(|p| !p.is_empty())
            .ok_or_else(|| format!("mount {name:?}: refusing to share the host root"))?
            .to_string();
        Ok(MountSpec {
            session: session.to_string(),
            name: name.to_string(),
            source: host_paths
                .grant(session, name, &real_rel, mode)
                .map_err(|e| format!("mount {name:?}: {e}"))?,
            mode,
        })
    }

    pub async fn spawn(&self, req: SpawnRequest) -> Result<Value, VmError> {
        let SpawnRequest { mut spec, mounts } = req;
        guest_agent::names::session_name(&spec.name)
            .map_err(|e| VmError::Invalid(e.to_string()))?;
        if spec.id.is_empty() {
            return Err(VmError::Invalid("spawn: id must not be empty".into()));
        }
        let link = self.connected_link()?;
        let host_paths = self.current_host_paths().await?;
        let mut failed = Vec::new();
        for (name, path, mode) in mounts {
            match self.mount_spec(&host_paths, &spec.name, &name, &path, &mode) {
                Ok(m) => spec.mounts.push(m),
                Err(e) => {
                    tracing::warn!(session = %spec.name, mount = %name, error = %e, "mount refused");
                    failed.push(Value::String(name));
                }
            }
        }
        if spec.oauth_token.is_none() {
            spec.oauth_token = lock(&self.approved_token).clone();
        }
        {
            let mut procs = lock(&self.procs);
            if procs.map.get(&spec.id).is_some_and(|r| r.running) {
                return Err(VmError::Invalid(format!(
                    "a process with id {:?} is already running",
                    spec.id
                )));
            }
            procs.map.insert(
                spec.id.clone(),
                ProcRecord {
                    session: spec.name.clone(),
                    running: true,
                    ..Default::default()
                },
            );
        }
        let id = spec.id.clone();
        tracing::info!(id = %id, session = %spec.name, command = %spec.command, "spawn");
        match link.call(Op::Spawn(spec), &[], CALL_TIMEOUT).await {
            Ok((result, _)) => {
                if let Some(Value::Array(agent_failed)) = result.get("failedMounts") {
                    failed.extend(agent_failed.iter().cloned());
                }
                Ok(json!({ "failedMounts": failed }))
            }
            Err(e) => {
                let mut procs = lock(&self.procs);
                if procs.map.get(&id).is_some_and(|r| r.running) {
                    procs.map.remove(&id);
                }
                Err(e)
            }
        }
    }

    pub async fn kill(&self, id: &str, signal: i32) -> Result<(), VmError> {
        let link = self.connected_link()?;
        link.call(
            Op::Kill {
                id: id.to_string(),
                signal,
            },
            &[],
            CALL_TIMEOUT,
        )
        .await
        .map(|_| ())
    }

    /// Queues stdin data for a process (in call order) and returns the wait
    /// for the agent's acknowledgement, so that a connection can keep the
    /// order of pipelined writes without serialising their round trips.
    pub async fn write_stdin_ordered(
        &self,
        id: &str,
        data: &[u8],
    ) -> Result<impl std::future::Future<Output = Result<(), VmError>>, VmError> {
        let link = self.connected_link()?;
        let pending = link
            .send(Op::WriteStdin { id: id.to_string() }, data)
            .await?;
        Ok(async move { pending.wait(&link, CALL_TIMEOUT).await.map(|_| ()) })
    }

    pub fn process_status(&self, id: &str) -> Value {
        let procs = lock(&self.procs);
        match procs.map.get(id) {
            Some(r) if r.running => json!({"running": true}),
            Some(ProcRecord {
                exit_code: Some(c), ..
            }) => json!({"running": false, "exitCode": c}),
            _ => json!({"running": false}),
        }
    }

    fn session_of(&self, process_id: &str) -> Option<String> {
        lock(&self.procs)
            .map
            .get(process_id)
            .map(|r| r.session.clone())
            .filter(|s| !s.is_empty())
    }

    pub async fn mount_path(
        &self,
        process_id: &str,
        subpath: &str,
        name: &str,
        mode: &str,
    ) -> Result<(), VmError> {
        let link = self.connected_link()?;
        let session = self.session_of(process_id).ok_or_else(|| {
            VmError::Invalid(format!("mountPath: unknown process {process_id:?}"))
        })?;
        let host_paths = self.current_host_paths().await?;
        let spec = self
            .mount_spec(&host_paths, &session, name, subpath, mode)
            .map_err(VmError::Invalid)?;
        link.call(Op::Mount(spec), &[], CALL_TIMEOUT)
            .await
            .map(|_| ())
    }

    pub async fn read_file(&self, session: &str, path: &str) -> Result<Vec<u8>, VmError> {
        guest_agent::names::session_name(session).map_err(|e| VmError::Invalid(e.to_string()))?;
        let link = self.connected_link()?;
        let op = Op::ReadFile {
            session: session.to_string(),
            path: path.to_string(),
        };
        link.call(op, &[], CALL_TIMEOUT)
            .await
            .map(|(_, bytes)| bytes)
    }

    /// Sessions with a live process (the janitor must not touch them).
    pub(super) fn live_sessions(&self) -> HashSet<String> {
        lock(&self.procs)
            .map
            .values()
            .filter(|r| r.running)
            .map(|r| r.session.clone())
            .collect()
    }
}
