//! The processes a VM runs: `spawn` (with its mounts validated and mapped
//! into the agent's view), stdin, kill, `mountPath`, `readFile`, and the
//! host's process table, which turns the agent's output and exit messages
//! into client events (output decoded as UTF-8 across chunk boundaries).
//!
//! Egress: every spawn gets its own credential from the daemon's egress
//! proxy, under the policy of its `allowedDomains`, carried in its proxy URL
//! (`SpawnSpec.egress_proxy`, and the proxy variables of its environment,
//! see [`apply_proxy_env`]). The credential lives in the process's record
//! ([`SpawnEgress`] revokes it when dropped), so it is revoked exactly when
//! the record stops being a running process: the agent's exit message, a
//! failed spawn (the record is removed), the agent or machine going away
//! (every running record is marked exited), and [`Procs::revoke_all`] when
//! the machine is torn down. Neither the credential nor the URL is ever
//! logged (the spec's `Debug` shows environment names only).
//!
//! Credentials: the real values of `spawn.oauthToken` (or the approved
//! token) and of the credential variables of `env` never reach the agent:
//! [`substitute_credentials`] replaces each with a placeholder and binds
//! it to the spawn's proxy credential, and the proxy writes the real value
//! into requests to the API hosts (see [`crate::egress::secrets`]). The
//! spawn's `NODE_EXTRA_CA_CERTS` names the proxy's CA, which the agent
//! trusts after the hello.
//!
//! Limits: at most [`MAX_PROCESSES`] processes run per profile (spawn
//! beyond it fails with [`ProfileVmError::TooManyProcesses`];
//! [`VmConfig::max_processes`](crate::backend::VmConfig::max_processes),
//! the helper's `--max-processes`, overrides the number); exited records are kept
//! for the last [`EXITED_RECORDS`] processes; a mount of the host root is
//! refused. Output, exits and errors the agent reports for a process id the
//! host never spawned (or already forgot) are dropped, so a hostile agent
//! cannot make the table grow or send the client events for processes it
//! did not start. Connections a process
//! opened through the proxy run on after its credential is revoked (new
//! ones get 407).

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::path::Path;

use guest_agent::names::NameError;
use guest_agent::proto::{self, AgentMessage, MountMode, MountSpec, Op};
use serde_json::{json, Value};

use super::{ProfileVm, ProfileVmError, CALL_TIMEOUT};
use crate::backend::{GrantError, HostPaths};
use crate::egress::secrets::{Carrier, RealSecret, SecretCell, SpawnSecrets, Substituter};
use crate::egress::{self, Credential, EgressProxy, Policy, GUEST_PROXY_PORT};
use crate::events;
use crate::protocol::event;
use crate::utf8::Utf8Stream;
use vmm::sync::MutexExt;

/// Exited process records kept for `isProcessRunning`.
pub const EXITED_RECORDS: usize = 4096;

/// Why a session mount (a spawn's `additionalMounts` entry, or
/// `mountPath`) was refused.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    /// The mount name is not a valid name.
    #[error(transparent)]
    Name(NameError),
    #[error("mount {name:?}: mode must be ro, rw or rwd, got {mode:?}")]
    Mode { name: String, mode: String },
    /// The host path is not a valid relative path.
    #[error(transparent)]
    Path(NameError),
    #[error("mount {name:?}: host path /{rel}: {source}")]
    HostPath {
        name: String,
        rel: String,
        source: std::io::Error,
    },
    #[error("mount {name:?}: refusing to share the host root")]
    HostRoot { name: String },
    /// The backend could not make the path reachable for the guest.
    #[error("mount {name:?}: {source}")]
    Grant { name: String, source: GrantError },
}

/// Processes one profile's VM may run at once (spawns in flight count).
/// Far above what a desktop session uses (a CLI and its tools), low
/// enough that a runaway client cannot exhaust the host's (sandbox) or the
/// guest's process table or the helper's memory (a record, an egress
/// credential and output decoders per process).
pub const MAX_PROCESSES: usize = 512;

/// Environment variable of `--max-processes`, which overrides
/// [`MAX_PROCESSES`] (tests use a small number); read by [`crate::cli`]
/// into [`crate::backend::VmConfig::max_processes`].
pub const MAX_PROCESSES_ENV: &str = "COWORK_MAX_PROCESSES";

/// One spawn's egress credential; revoked when dropped (see the module
/// docs for when that happens).
pub(super) struct SpawnEgress {
    proxy: EgressProxy,
    cred: Credential,
}

impl SpawnEgress {
    /// Issues a credential for one spawn of `session` under `policy`, its
    /// API credentials being the placeholders of `secrets`.
    fn issue(
        proxy: &EgressProxy,
        session: &str,
        policy: Policy,
        secrets: SpawnSecrets,
    ) -> Result<Self, ProfileVmError> {
        let cred = proxy
            .issue_with_secrets(session, policy, secrets)
            .map_err(ProfileVmError::NetworkCredential)?;
        Ok(SpawnEgress {
            proxy: proxy.clone(),
            cred,
        })
    }

    /// The spawn's proxy URL (a secret: never log it).
    fn url(&self, session: &str) -> String {
        egress::proxy_url(session, &self.cred, GUEST_PROXY_PORT)
    }
}

impl Drop for SpawnEgress {
    fn drop(&mut self) {
        self.proxy.revoke(&self.cred);
    }
}

impl std::fmt::Debug for SpawnEgress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SpawnEgress(<redacted>)")
    }
}

/// The variable naming extra CAs for Node and Bun (the Claude Code CLI).
pub const NODE_EXTRA_CA_CERTS: &str = "NODE_EXTRA_CA_CERTS";

/// Replaces the real credentials of `spec` (its `oauth_token` and the
/// non-empty credential variables of its `env`) with placeholders; returns
/// the spawn's substitutions. Every OAuth token's cell goes to
/// `track_oauth`, so a later `addApprovedOauthToken` reaches it.
pub(crate) fn substitute_credentials(
    spec: &mut proto::SpawnSpec,
    track_oauth: &mut dyn FnMut(&SecretCell),
) -> Result<SpawnSecrets, ProfileVmError> {
    let mut subs = Substituter::default();
    let bad = ProfileVmError::Credentials;
    if let Some(token) = spec.oauth_token.take() {
        let cell = SecretCell::new(RealSecret::new(token.0.clone()).map_err(bad)?);
        track_oauth(&cell);
        let placeholder = subs
            .substitute(Carrier::Bearer, &token.0, cell)
            .map_err(bad)?;
        spec.oauth_token = Some(proto::Secret(placeholder));
    }
    for var in proto::CREDENTIAL_VARS {
        let Some(value) = spec.env.get_mut(var).filter(|v| !v.is_empty()) else {
            continue;
        };
        let Some(carrier) = Carrier::of_var(var) else {
            continue;
        };
        let cell = SecretCell::new(RealSecret::new(value.clone()).map_err(bad)?);
        if var == "CLAUDE_CODE_OAUTH_TOKEN" {
            track_oauth(&cell);
        }
        *value = subs.substitute(carrier, value, cell).map_err(bad)?;
    }
    Ok(subs.finish())
}

/// A process as the host knows it.
#[derive(Debug, Default)]
pub(super) struct ProcRecord {
    pub(super) session: String,
    pub(super) running: bool,
    exit_code: Option<i32>,
    stdout: Utf8Stream,
    stderr: Utf8Stream,
    /// The process's egress credential while it runs.
    egress: Option<SpawnEgress>,
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
            // Revokes the credential.
            r.egress = None;
        }
        while self.exited.len() > EXITED_RECORDS {
            if let Some(old) = self.exited.pop_front() {
                if self.map.get(&old).is_some_and(|r| !r.running) {
                    self.map.remove(&old);
                }
            }
        }
    }

    /// Processes running (or being spawned).
    pub(super) fn running_count(&self) -> usize {
        self.map.values().filter(|r| r.running).count()
    }

    /// Revokes every credential still held (the machine is gone, so no
    /// process of it can use one any more). Returns how many there were.
    pub(super) fn revoke_all(&mut self) -> usize {
        self.map
            .values_mut()
            .filter_map(|r| r.egress.take())
            .count()
    }
}

/// Entries of a `NO_PROXY` value, trimmed, empties dropped.
fn no_proxy_entries(value: &str) -> impl Iterator<Item = &str> {
    value.split(',').map(str::trim).filter(|e| !e.is_empty())
}

/// Puts the proxy settings of [`egress::proxy_env`] for `url` into a
/// spawn's environment, over the client's values, with two merges:
///
/// - `NO_PROXY`/`no_proxy`: the session's loopback entries first, then the
///   client's entries from either spelling (deduplicated, `*` dropped since
///   it would turn the proxy off for every program). Honouring them costs
///   no security: the guest has no route out, so a connection that bypasses
///   the proxy is captured by the agent and sent to the same policy by name,
///   or fails.
/// - `GIT_CONFIG_*`: when the client passed a well-formed list
///   (`GIT_CONFIG_COUNT=n` with every `GIT_CONFIG_KEY_i`/`VALUE_i`, i < n),
///   our entries are appended after it; otherwise ours replace it from 0.
pub(crate) fn apply_proxy_env(env: &mut BTreeMap<String, String>, url: &str) {
    let mut no_proxy: Vec<String> = Vec::new();
    let client = [env.get("NO_PROXY"), env.get("no_proxy")];
    let session = no_proxy_entries(egress::SESSION_NO_PROXY);
    for entry in session.chain(
        client
            .into_iter()
            .flatten()
            .flat_map(|v| no_proxy_entries(v)),
    ) {
        if entry != "*" && !no_proxy.iter().any(|e| e.eq_ignore_ascii_case(entry)) {
            no_proxy.push(entry.to_owned());
        }
    }
    let no_proxy = no_proxy.join(",");

    let git_base = env
        .get("GIT_CONFIG_COUNT")
        .and_then(|c| c.trim().parse::<usize>().ok())
        .filter(|&n| {
            n <= env.len()
                && (0..n).all(|i| {
                    env.contains_key(&format!("GIT_CONFIG_KEY_{i}"))
                        && env.contains_key(&format!("GIT_CONFIG_VALUE_{i}"))
                })
        })
        .unwrap_or(0);

    for (key, value) in egress::proxy_env(url) {
        if key.eq_ignore_ascii_case("NO_PROXY") {
            env.insert(key.to_owned(), no_proxy.clone());
        } else if key == "GIT_CONFIG_COUNT" {
            let ours = value.parse::<usize>().unwrap_or(0);
            env.insert(key.to_owned(), (git_base + ours).to_string());
        } else if let Some((prefix, index)) = git_indexed(key) {
            env.insert(format!("{prefix}{}", git_base + index), value);
        } else {
            env.insert(key.to_owned(), value);
        }
    }
}

/// `GIT_CONFIG_KEY_<i>` / `GIT_CONFIG_VALUE_<i>` split into prefix and `i`.
fn git_indexed(key: &str) -> Option<(&'static str, usize)> {
    ["GIT_CONFIG_KEY_", "GIT_CONFIG_VALUE_"]
        .into_iter()
        .find_map(|prefix| Some((prefix, key.strip_prefix(prefix)?.parse().ok()?)))
}

/// What `spawn` needs beyond the agent's [`proto::SpawnSpec`].
pub struct SpawnRequest {
    pub spec: proto::SpawnSpec,
    /// `additionalMounts`: name → (host path relative to `/`, mode string).
    pub mounts: Vec<(String, String, String)>,
}

impl ProfileVm {
    pub(super) async fn flush_output(&self, id: &str) {
        let (out, err) = {
            let mut procs = self.procs.locked();
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

    /// Whether `id` is a process this VM runs (its spawn may be in flight).
    fn runs_process(&self, id: &str) -> bool {
        self.procs.locked().map.get(id).is_some_and(|r| r.running)
    }

    /// Routes one unsolicited agent message; `false` when it was dropped
    /// because it names a process this VM does not run.
    pub(super) async fn on_agent_message(&self, msg: AgentMessage, payload: &[u8]) -> bool {
        match msg {
            AgentMessage::Stdout { id } => return self.on_output(true, id, payload).await,
            AgentMessage::Stderr { id } => return self.on_output(false, id, payload).await,
            AgentMessage::Exit {
                id,
                exit_code,
                signal,
                oom_kill_count,
            } => {
                if !self.runs_process(&id) {
                    return false;
                }
                self.flush_output(&id).await;
                self.procs.locked().mark_exited(&id, exit_code);
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
                if !self.runs_process(&id) {
                    return false;
                }
                self.hub.publish(&event::error(&id, &message, fatal)).await;
            }
            AgentMessage::Request { id, method, params } => {
                // Guest words, quoted and escaped (no forged log lines).
                tracing::debug!(id = ?id, method = ?method, "guest request");
                self.hub
                    .publish(&event::guest_request(&id, &method, &params))
                    .await;
            }
            // The link reader handles these itself.
            AgentMessage::Hello(_)
            | AgentMessage::Quiesced { .. }
            | AgentMessage::Response { .. } => return false,
        }
        true
    }

    /// Publishes output of a running process; `false` (dropped) for any
    /// other id.
    async fn on_output(&self, stdout: bool, id: String, bytes: &[u8]) -> bool {
        let stream = if stdout { "stdout" } else { "stderr" };
        let frame = {
            let mut procs = self.procs.locked();
            let Some(rec) = procs.map.get_mut(&id).filter(|r| r.running) else {
                return false;
            };
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
        true
    }

    /// Validates a client mount and maps it into the agent's view.
    fn mount_spec(
        &self,
        host_paths: &HostPaths,
        session: &str,
        name: &str,
        host_path: &str,
        mode: &str,
    ) -> Result<MountSpec, MountError> {
        guest_agent::names::mount_name(name).map_err(MountError::Name)?;
        let mode = MountMode::parse(mode).ok_or_else(|| MountError::Mode {
            name: name.to_string(),
            mode: mode.to_string(),
        })?;
        let rel = guest_agent::names::host_relative_path(host_path).map_err(MountError::Path)?;
        let real = std::fs::canonicalize(Path::new("/").join(&rel)).map_err(|source| {
            MountError::HostPath {
                name: name.to_string(),
                rel: rel.clone(),
                source,
            }
        })?;
        let real_rel = real
            .strip_prefix("/")
            .ok()
            .and_then(|p| p.to_str())
            .filter(|p| !p.is_empty())
            .ok_or_else(|| MountError::HostRoot {
                name: name.to_string(),
            })?
            .to_string();
        Ok(MountSpec {
            session: session.to_string(),
            name: name.to_string(),
            source: host_paths
                .grant(session, name, &real_rel, mode)
                .map_err(|source| MountError::Grant {
                    name: name.to_string(),
                    source,
                })?,
            mode,
        })
    }

    pub async fn spawn(&self, req: SpawnRequest) -> Result<Value, ProfileVmError> {
        let SpawnRequest { mut spec, mounts } = req;
        guest_agent::names::session_name(&spec.name)?;
        if spec.id.is_empty() {
            return Err(ProfileVmError::EmptyId);
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
            spec.oauth_token = self.approved_token.locked().clone();
        }
        let secrets = substitute_credentials(&mut spec, &mut |cell| self.track_oauth_cell(cell))?;
        // Revoked by the record (dropped on every path that does not start
        // the process).
        let grant = SpawnEgress::issue(
            &self.cfg.egress,
            &spec.name,
            Policy::from_allowed_domains(spec.allowed_domains.as_deref()),
            secrets,
        )?;
        let url = grant.url(&spec.name);
        apply_proxy_env(&mut spec.env, &url);
        if self.cfg.egress.ca_pem().is_some() {
            spec.env
                .insert(NODE_EXTRA_CA_CERTS.into(), proto::EGRESS_CA_FILE.into());
        }
        spec.egress_proxy = Some(proto::Secret(url));
        {
            let mut procs = self.procs.locked();
            if procs.map.get(&spec.id).is_some_and(|r| r.running) {
                return Err(ProfileVmError::AlreadyRunning(spec.id.clone()));
            }
            let limit = self.cfg.max_processes;
            if procs.running_count() >= limit {
                tracing::warn!(limit, id = %spec.id, "spawn refused: process limit reached");
                return Err(ProfileVmError::TooManyProcesses { limit });
            }
            procs.map.insert(
                spec.id.clone(),
                ProcRecord {
                    session: spec.name.clone(),
                    running: true,
                    egress: Some(grant),
                    ..Default::default()
                },
            );
        }
        let id = spec.id.clone();
        tracing::info!(
            id = %id,
            session = %spec.name,
            command = %spec.command,
            allowed_domains = spec.allowed_domains.as_ref().map(Vec::len),
            "spawn"
        );
        match link.call(Op::Spawn(spec), &[], CALL_TIMEOUT).await {
            Ok((result, _)) => {
                if let Some(Value::Array(agent_failed)) = result.get("failedMounts") {
                    failed.extend(agent_failed.iter().cloned());
                }
                Ok(json!({ "failedMounts": failed }))
            }
            Err(e) => {
                let mut procs = self.procs.locked();
                if procs.map.get(&id).is_some_and(|r| r.running) {
                    procs.map.remove(&id);
                }
                Err(e)
            }
        }
    }

    pub async fn kill(&self, id: &str, signal: i32) -> Result<(), ProfileVmError> {
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
    ) -> Result<impl std::future::Future<Output = Result<(), ProfileVmError>>, ProfileVmError> {
        let link = self.connected_link()?;
        let pending = link
            .send(Op::WriteStdin { id: id.to_string() }, data)
            .await?;
        Ok(async move { pending.wait(&link, CALL_TIMEOUT).await.map(|_| ()) })
    }

    pub fn process_status(&self, id: &str) -> Value {
        let procs = self.procs.locked();
        match procs.map.get(id) {
            Some(r) if r.running => json!({"running": true}),
            Some(ProcRecord {
                exit_code: Some(c), ..
            }) => json!({"running": false, "exitCode": c}),
            _ => json!({"running": false}),
        }
    }

    fn session_of(&self, process_id: &str) -> Option<String> {
        self.procs
            .locked()
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
    ) -> Result<(), ProfileVmError> {
        let link = self.connected_link()?;
        let session = self
            .session_of(process_id)
            .ok_or_else(|| ProfileVmError::UnknownProcess(process_id.to_string()))?;
        let host_paths = self.current_host_paths().await?;
        let spec = self.mount_spec(&host_paths, &session, name, subpath, mode)?;
        link.call(Op::Mount(spec), &[], CALL_TIMEOUT)
            .await
            .map(|_| ())
    }

    pub async fn read_file(&self, session: &str, path: &str) -> Result<Vec<u8>, ProfileVmError> {
        guest_agent::names::session_name(session)?;
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
        self.procs
            .locked()
            .map
            .values()
            .filter(|r| r.running)
            .map(|r| r.session.clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    const URL: &str = "http://s1:secret@127.0.0.1:3128";

    #[test]
    fn proxy_env_overrides_the_clients_proxy_variables() {
        let mut e = env(&[
            ("HTTPS_PROXY", "http://corp:8080"),
            ("http_proxy", "http://corp:8080"),
            ("PATH", "/usr/bin"),
        ]);
        apply_proxy_env(&mut e, URL);
        for k in [
            "HTTPS_PROXY",
            "https_proxy",
            "HTTP_PROXY",
            "http_proxy",
            "ALL_PROXY",
            "all_proxy",
        ] {
            assert_eq!(e[k], URL, "{k}");
        }
        assert_eq!(e["PATH"], "/usr/bin");
        assert_eq!(e["NODE_USE_ENV_PROXY"], "1");
        assert_eq!(e["NO_PROXY"], egress::SESSION_NO_PROXY);
        assert_eq!(e["no_proxy"], egress::SESSION_NO_PROXY);
        assert_eq!(e["GIT_CONFIG_COUNT"], "1");
        assert_eq!(e["GIT_CONFIG_KEY_0"], "http.proxyAuthMethod");
        assert_eq!(e["GIT_CONFIG_VALUE_0"], "basic");
    }

    #[test]
    fn clients_no_proxy_entries_are_merged_after_the_sessions() {
        let mut e = env(&[
            ("NO_PROXY", "internal.example, localhost,*"),
            ("no_proxy", ".corp.example,INTERNAL.example,,"),
        ]);
        apply_proxy_env(&mut e, URL);
        let want = format!(
            "{},internal.example,.corp.example",
            egress::SESSION_NO_PROXY
        );
        assert_eq!(e["NO_PROXY"], want);
        assert_eq!(e["no_proxy"], want);
    }

    #[test]
    fn git_config_entries_are_appended_to_a_well_formed_client_list() {
        let mut e = env(&[
            ("GIT_CONFIG_COUNT", "2"),
            ("GIT_CONFIG_KEY_0", "user.name"),
            ("GIT_CONFIG_VALUE_0", "A"),
            ("GIT_CONFIG_KEY_1", "core.editor"),
            ("GIT_CONFIG_VALUE_1", "vi"),
        ]);
        apply_proxy_env(&mut e, URL);
        assert_eq!(e["GIT_CONFIG_COUNT"], "3");
        assert_eq!(e["GIT_CONFIG_KEY_0"], "user.name");
        assert_eq!(e["GIT_CONFIG_KEY_1"], "core.editor");
        assert_eq!(e["GIT_CONFIG_KEY_2"], "http.proxyAuthMethod");
        assert_eq!(e["GIT_CONFIG_VALUE_2"], "basic");

        // A count whose keys are missing (or garbage) is replaced from 0.
        for count in ["5", "lots", "99999999999999999999"] {
            let mut e = env(&[("GIT_CONFIG_COUNT", count), ("GIT_CONFIG_KEY_0", "x.y")]);
            apply_proxy_env(&mut e, URL);
            assert_eq!(e["GIT_CONFIG_COUNT"], "1", "{count}");
            assert_eq!(e["GIT_CONFIG_KEY_0"], "http.proxyAuthMethod");
        }
    }

    fn issue(proxy: &EgressProxy, session: &str) -> (SpawnEgress, Credential) {
        let grant = SpawnEgress::issue(
            proxy,
            session,
            Policy::Unrestricted,
            SpawnSecrets::default(),
        )
        .unwrap();
        let cred = grant.cred.clone();
        (grant, cred)
    }

    fn running(session: &str, egress: SpawnEgress) -> ProcRecord {
        ProcRecord {
            session: session.into(),
            running: true,
            egress: Some(egress),
            ..Default::default()
        }
    }

    #[test]
    fn the_url_carries_the_credential_and_debug_hides_it() {
        let proxy = EgressProxy::direct();
        let (grant, cred) = issue(&proxy, "my session");
        let url = grant.url("my session");
        assert_eq!(
            url,
            format!(
                "http://my%20session:{}@127.0.0.1:{GUEST_PROXY_PORT}",
                cred.expose()
            )
        );
        let rec = running("my session", grant);
        assert!(!format!("{rec:?}").contains(cred.expose()));
    }

    #[test]
    fn credentials_are_revoked_when_their_process_ends_or_its_record_goes() {
        let proxy = EgressProxy::direct();
        let mut procs = Procs::default();
        let (a, cred_a) = issue(&proxy, "s1");
        let (b, cred_b) = issue(&proxy, "s1");
        let (c, cred_c) = issue(&proxy, "s2");
        procs.map.insert("a".into(), running("s1", a));
        procs.map.insert("b".into(), running("s1", b));
        procs.map.insert("c".into(), running("s2", c));

        // The exit message revokes the process's credential, only its.
        procs.mark_exited("a", Some(0));
        assert!(!proxy.revoke(&cred_a), "a's credential was still live");
        // A second exit for the same id changes nothing.
        procs.mark_exited("a", Some(0));

        // A failed spawn removes its record: revoked.
        procs.map.remove("b");
        assert!(!proxy.revoke(&cred_b), "b's credential was still live");

        // The machine going away revokes what is left.
        assert_eq!(procs.revoke_all(), 1);
        assert_eq!(procs.revoke_all(), 0);
        assert!(!proxy.revoke(&cred_c), "c's credential was still live");
        assert!(procs.map["c"].running, "the record itself stays");
    }

    #[test]
    fn a_spawn_refused_before_it_starts_revokes_its_credential() {
        let proxy = EgressProxy::direct();
        let (grant, cred) = issue(&proxy, "s1");
        drop(grant);
        assert!(!proxy.revoke(&cred));
        // A live one is revocable exactly once.
        let (grant, cred) = issue(&proxy, "s1");
        assert!(proxy.revoke(&cred));
        drop(grant);
    }
}
