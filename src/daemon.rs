//! Daemon state and method dispatch.
//!
//! The socket path is shared by every desktop profile, so state is scoped by
//! profile: `configure` and `subscribeEvents` carry `userDataName` and
//! `userDataRoot`, which select a [`Profile`] (its own VM, processes, event
//! hub and state directory). A connection that never named a profile (the
//! client's one-shot requests) uses the most recently configured one, or the
//! `default` profile.
//!
//! Errors: a failed request is a [`DispatchError`] (the protocol's, the
//! VM's, or the dispatcher's own) up to the reply, whose `error` string
//! is its text.

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine;
use guest_agent::proto::{Op, Secret, SpawnSpec};
use serde_json::{json, Value};

use crate::backend::{BackendKind, BootOptions, VmConfig};
use crate::protocol::*;
use crate::vm::{ProfileVm, ProfileVmError, SpawnRequest};
use vmm::sync::MutexExt;

/// Name of the profile used before any `configure`.
pub const DEFAULT_PROFILE: &str = "default";

/// How long the helper's shutdown (SIGTERM, SIGINT, the client closing the
/// helper's stdin) gives its VMs to stop cleanly: the agent ends the
/// sessions, the guest remounts its session disk read-only and powers off
/// (about 1-3 s under QEMU TCG). A machine still running then is killed.
pub const SHUTDOWN_BUDGET: Duration = Duration::from_secs(6);

/// How long the shutdown then waits for the killed machines to be reaped
/// before the helper exits without them (they end with its process: QEMU
/// and the sandbox by their parent-death signal, the kvm VM with the
/// process).
pub const KILL_GRACE: Duration = Duration::from_secs(2);

/// How long a VM may run with no connected client and no subscriber
/// before it is stopped, unless `--idle-timeout` says otherwise.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(900);

/// The daemon's settings: built once by [`crate::cli`] from the command
/// line and the environment (the only place either is read) and passed
/// down as values.
#[derive(Clone, Debug)]
pub struct Settings {
    pub data_dir: PathBuf,
    pub backend: BackendKind,
    pub helper_exe: PathBuf,
    /// Stop a VM after this long without a connected client or subscriber
    /// (`--idle-timeout`); none: never.
    pub idle_timeout: Option<Duration>,
    /// Client connections served at once (`--max-connections`; default
    /// [`crate::server::MAX_CLIENT_CONNECTIONS`]).
    pub max_connections: usize,
    /// Processes per profile (`--max-processes`; default
    /// [`crate::vm::MAX_PROCESSES`]).
    pub max_processes: usize,
    /// Agent requests awaiting an answer per VM (`--max-pending-requests`;
    /// default [`crate::vm::MAX_PENDING_REQUESTS`]).
    pub max_pending_requests: usize,
    /// The API hosts whose credentials the egress proxy swaps in
    /// (`--api-host`; see [`crate::egress::intercept`]).
    pub api_hosts: Vec<String>,
    /// The upstream proxy the egress proxy dials through (the helper's
    /// `https_proxy`/`HTTPS_PROXY`); none: direct.
    pub https_proxy: Option<String>,
    /// What bypasses the upstream proxy (`no_proxy`/`NO_PROXY`).
    pub no_proxy: Option<String>,
    /// What every VM's machine gets (`--userland`, `--seccomp`,
    /// `--fs-xattr`, the image search, QEMU, the guest's log, test
    /// hooks, ...); `startVM` fills in its own fields of a copy.
    pub machine: BootOptions,
}

/// One desktop profile.
pub struct Profile {
    pub key: String,
    pub vm: Arc<ProfileVm>,
}

/// The whole daemon.
pub struct Daemon {
    pub settings: Settings,
    profiles: Mutex<HashMap<String, Arc<Profile>>>,
    last_configured: Mutex<Option<String>>,
    /// Open client connections (for the idle-VM policy).
    pub connections: AtomicUsize,
    /// The egress proxy every profile's sessions reach the network through.
    pub egress: crate::egress::EgressProxy,
}

/// Per-connection state.
#[derive(Default)]
pub struct Connection {
    pub profile: Mutex<Option<Arc<Profile>>>,
}

/// A directory-name-safe, collision-resistant key for a profile.
pub fn profile_key(name: Option<&str>, root: Option<&str>) -> String {
    let (name, root) = (name.unwrap_or(""), root.unwrap_or(""));
    if name.is_empty() && root.is_empty() {
        return DEFAULT_PROFILE.to_string();
    }
    let readable: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .take(40)
        .collect();
    // FNV-1a over both fields: stable across runs and releases.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in root.bytes().chain([0]).chain(name.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{readable}-{:016x}", h)
}

impl Daemon {
    pub fn new(settings: Settings) -> Arc<Daemon> {
        let egress = crate::egress::EgressProxy::new(
            crate::egress::EgressDialer::with_upstream(
                settings.https_proxy.as_deref(),
                settings.no_proxy.as_deref(),
            ),
            crate::egress::ProxyConfig {
                api_hosts: settings.api_hosts.clone(),
                ..Default::default()
            },
        );
        Arc::new(Daemon {
            settings,
            profiles: Mutex::new(HashMap::new()),
            last_configured: Mutex::new(None),
            connections: AtomicUsize::new(0),
            egress,
        })
    }

    /// Returns (creating if needed) the profile with this key.
    pub fn profile(&self, key: &str) -> Arc<Profile> {
        let mut profiles = self.profiles.locked();
        profiles
            .entry(key.to_string())
            .or_insert_with(|| {
                let cfg = VmConfig {
                    backend: self.settings.backend,
                    profile_dir: self.settings.data_dir.join("profiles").join(key),
                    helper_exe: self.settings.helper_exe.clone(),
                    egress: self.egress.clone(),
                    max_processes: self.settings.max_processes,
                    max_pending_requests: self.settings.max_pending_requests,
                };
                tracing::info!(profile = key, dir = %cfg.profile_dir.display(), "profile created");
                Arc::new(Profile {
                    key: key.to_string(),
                    vm: ProfileVm::new(cfg),
                })
            })
            .clone()
    }

    pub fn all_profiles(&self) -> Vec<Arc<Profile>> {
        self.profiles.locked().values().cloned().collect()
    }

    fn profile_for(&self, conn: &Connection) -> Arc<Profile> {
        if let Some(p) = conn.profile.locked().clone() {
            return p;
        }
        let key = self
            .last_configured
            .locked()
            .clone()
            .unwrap_or_else(|| DEFAULT_PROFILE.into());
        self.profile(&key)
    }

    /// Binds a connection to the profile named by `params`.
    pub fn select_profile(
        &self,
        conn: &Connection,
        p: &ProfileParams,
        remember: bool,
    ) -> Arc<Profile> {
        let key = profile_key(p.user_data_name.as_deref(), p.user_data_root.as_deref());
        let profile = self.profile(&key);
        *conn.profile.locked() = Some(profile.clone());
        if remember {
            *self.last_configured.locked() = Some(key);
        }
        profile
    }

    /// Stops every VM for the helper's exit, all at once: no VM starts
    /// from now on; each running machine stops as with `stopVM` (the agent
    /// ends its sessions, the guest settles its session disk and powers
    /// off), and one still running after [`SHUTDOWN_BUDGET`] is killed (one
    /// log line says so). Returns within [`SHUTDOWN_BUDGET`] +
    /// [`KILL_GRACE`].
    pub async fn shut_down(&self) {
        let deadline = Instant::now() + SHUTDOWN_BUDGET;
        let mut stops = tokio::task::JoinSet::new();
        for p in self.all_profiles() {
            stops.spawn(async move {
                let outcome = p.vm.shut_down(deadline).await;
                (p, outcome)
            });
        }
        let budget_spent = tokio::time::sleep_until(deadline.into());
        let give_up = tokio::time::sleep_until((deadline + KILL_GRACE).into());
        tokio::pin!(budget_spent, give_up);
        let mut killing = false;
        loop {
            tokio::select! {
                joined = stops.join_next() => match joined {
                    None => return,
                    Some(Ok((p, Err(e)))) => {
                        tracing::warn!(profile = %p.key, error = %e, "stopping vm failed")
                    }
                    Some(Ok((_, Ok(())))) => {}
                    Some(Err(e)) => tracing::warn!(error = %e, "stopping a vm failed (a bug)"),
                },
                _ = &mut budget_spent, if !killing => {
                    killing = true;
                    tracing::warn!(
                        vms = stops.len(),
                        budget_s = SHUTDOWN_BUDGET.as_secs(),
                        "shutdown budget spent: killing the VMs that have not stopped"
                    );
                }
                _ = &mut give_up => {
                    tracing::warn!(
                        vms = stops.len(),
                        "VMs still not reaped after the kill; exiting without them (they end with the helper)"
                    );
                    return;
                }
            }
        }
    }

    /// Starts one request in the connection's read loop. Whatever must keep
    /// the connection's order happens before this returns: `configure`
    /// (later requests use its profile) and the queueing of `writeStdin`
    /// data; everything else is returned as a future the caller runs
    /// concurrently, so a slow request never delays the next one.
    pub async fn begin(self: &Arc<Self>, conn: &Arc<Connection>, req: Request) -> Dispatch {
        match req.method.as_str() {
            "configure" => Dispatch::Done(self.dispatch(conn, &req).await),
            "writeStdin" => {
                let params: WriteStdinParams = match req.params() {
                    Ok(p) => p,
                    Err(e) => return Dispatch::Done(Err(e.into())),
                };
                let profile = self.profile_for(conn);
                profile.vm.touch();
                match profile
                    .vm
                    .write_stdin_ordered(&params.id, params.data.as_bytes())
                    .await
                {
                    Ok(ack) => Dispatch::Later(Box::pin(async move {
                        ack.await.map(|()| Value::Null).map_err(DispatchError::from)
                    })),
                    Err(e) => Dispatch::Done(Err(e.into())),
                }
            }
            _ => {
                let daemon = self.clone();
                let conn = conn.clone();
                Dispatch::Later(Box::pin(async move { daemon.dispatch(&conn, &req).await }))
            }
        }
    }

    /// Executes one request (everything but `subscribeEvents`).
    pub async fn dispatch(&self, conn: &Connection, req: &Request) -> Result<Value, DispatchError> {
        match req.method.as_str() {
            "configure" => {
                let params: ConfigureParams = req.params()?;
                let profile = self.select_profile(
                    conn,
                    &ProfileParams {
                        user_data_name: params.user_data_name.clone(),
                        user_data_root: params.user_data_root.clone(),
                    },
                    true,
                );
                tracing::info!(
                    profile = %profile.key,
                    session_only = params.session_only.unwrap_or(false),
                    memory_mb = params.memory_mb,
                    cpus = params.cpu_count,
                    "configured"
                );
                Ok(Value::Null)
            }
            _ => {
                let profile = self.profile_for(conn);
                profile.vm.touch();
                self.dispatch_vm(&profile, req).await
            }
        }
    }

    async fn dispatch_vm(&self, profile: &Profile, req: &Request) -> Result<Value, DispatchError> {
        let vm = &profile.vm;
        Ok(match req.method.as_str() {
            "createVM" => {
                let params: CreateVmParams = req.params()?;
                tracing::info!(profile = %profile.key, disk_gb = params.disk_size_gb, "createVM");
                vm.create_storage(params.disk_size_gb)?;
                Value::Null
            }
            "startVM" => {
                let params: StartVmParams = req.params()?;
                tracing::info!(profile = %profile.key, backend = vm.config().backend.as_str(), "startVM");
                let boot = BootOptions {
                    bundle_path: params.bundle_path.map(Into::into),
                    memory_gb: params.memory_gb,
                    cpu_count: params.cpu_count,
                    ..self.settings.machine.clone()
                };
                vm.start(params.api_probe_url, boot).await?;
                Value::Null
            }
            "stopVM" => {
                vm.stop().await?;
                Value::Null
            }
            "isRunning" => json!({ "running": vm.is_running() }),
            "isGuestConnected" => json!({ "connected": vm.is_guest_connected() }),
            "spawn" => {
                let params: SpawnParams = req.params()?;
                vm.spawn(spawn_request(params)).await?
            }
            "kill" => {
                let params: KillParams = req.params()?;
                let signal = match &params.signal {
                    None | Some(Value::Null) => guest_agent::signal::DEFAULT,
                    Some(Value::String(s)) => guest_agent::signal::parse(s)
                        .ok_or_else(|| DispatchError::UnknownSignal(s.clone()))?,
                    Some(Value::Number(n)) => n
                        .as_i64()
                        .and_then(|n| guest_agent::signal::parse(&n.to_string()))
                        .ok_or_else(|| DispatchError::SignalNumber(n.clone()))?,
                    Some(other) => {
                        return Err(ProtocolError::Params {
                            method: req.method.clone(),
                            detail: format!(
                                "field `signal`: expected a name or number, got {other}"
                            ),
                        }
                        .into())
                    }
                };
                vm.kill(&params.id, signal).await?;
                Value::Null
            }
            "writeStdin" => {
                let params: WriteStdinParams = req.params()?;
                vm.write_stdin_ordered(&params.id, params.data.as_bytes())
                    .await?
                    .await?;
                Value::Null
            }
            "isProcessRunning" => {
                let params: IdParams = req.params()?;
                vm.process_status(&params.id)
            }
            "sendGuestResponse" => {
                let params: GuestResponseParams = req.params()?;
                let id = match params.id {
                    Value::String(s) => s,
                    other => other.to_string(),
                };
                vm.send_guest_response(id, params.result_json, params.error)
                    .await?;
                Value::Null
            }
            "setDebugLogging" => {
                let params: DebugLoggingParams = req.params()?;
                crate::logging::set_debug(params.enabled)?;
                tracing::info!(enabled = params.enabled, "debug logging");
                Value::Null
            }
            "mountPath" => {
                let params: MountPathParams = req.params()?;
                vm.mount_path(
                    &params.process_id,
                    &params.subpath,
                    &params.mount_name,
                    &params.mode,
                )
                .await?;
                Value::Null
            }
            "readFile" => {
                let params: ReadFileParams = req.params()?;
                let bytes = vm
                    .read_file(&params.process_name, &params.file_path)
                    .await?;
                json!({ "content": base64::engine::general_purpose::STANDARD.encode(bytes) })
            }
            "getSessionsDiskInfo" => {
                let params: DiskInfoParams = req.params()?;
                vm.janitor(Op::DiskInfo {
                    low_water_bytes: params.low_water_bytes.unwrap_or(0),
                })
                .await?
            }
            "deleteSessionDirs" => {
                let params: DeleteSessionDirsParams = req.params()?;
                vm.janitor(Op::DeleteSessionDirs {
                    names: params.names,
                })
                .await?
            }
            "pruneSessionCaches" => {
                let params: PruneParams = req.params()?;
                vm.janitor(Op::PruneSessionCaches {
                    only_if_free_bytes_below: params.only_if_free_bytes_below,
                    include_session_tmp: params.include_session_tmp.unwrap_or(false),
                    session_tmp_older_than_seconds: params.session_tmp_older_than_seconds,
                })
                .await?
            }
            "installSdk" => {
                let params: InstallSdkParams = req.params()?;
                vm.install_sdk(&params.sdk_subpath, &params.version).await?
            }
            "addApprovedOauthToken" => {
                let params: TokenParams = req.params()?;
                let refreshed = vm.approve_token(params.token);
                tracing::info!(profile = %profile.key, refreshed_spawns = refreshed, "oauth token approved");
                Value::Null
            }
            "getNetworkDrives" => json!({ "drives": [] }),
            other => return Err(DispatchError::UnknownMethod(other.to_string())),
        })
    }
}

/// How [`Daemon::begin`] left a request.
pub enum Dispatch {
    /// Already answered.
    Done(Result<Value, DispatchError>),
    /// Answered when this future completes.
    Later(Pin<Box<dyn Future<Output = Result<Value, DispatchError>> + Send>>),
}

/// Why a request failed. Its text is the reply's `error`, which only
/// [`crate::protocol::reply`] writes; the log shows the same text with its
/// causes one `source()` away.
#[derive(Debug, thiserror::Error)]
pub enum DispatchError {
    /// The request does not fit its method (a missing or mistyped field).
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// The profile's VM refused or failed the request.
    #[error(transparent)]
    ProfileVm(#[from] ProfileVmError),
    /// `kill` named a signal the helper does not know.
    #[error("kill: unknown signal {0:?}")]
    UnknownSignal(String),
    /// `kill` gave a number that is no signal.
    #[error("kill: invalid signal number {0}")]
    SignalNumber(serde_json::Number),
    /// `setDebugLogging` could not switch the log level.
    #[error(transparent)]
    Logging(#[from] crate::logging::LoggingError),
    /// No such method (the text carries both spellings clients match on).
    #[error("{}", unknown_method(.0))]
    UnknownMethod(String),
}

fn spawn_request(p: SpawnParams) -> SpawnRequest {
    let env = p
        .env
        .unwrap_or_default()
        .into_iter()
        .filter_map(|(k, v)| v.filter(|v| !v.is_empty()).map(|v| (k, v)))
        .collect();
    let mounts = p
        .additional_mounts
        .unwrap_or_default()
        .into_iter()
        .map(|(name, m)| (name, m.path, m.mode))
        .collect();
    SpawnRequest {
        spec: SpawnSpec {
            id: p.id,
            name: p.name,
            command: p.command,
            args: p.args,
            cwd: p.cwd,
            env,
            oauth_token: p.oauth_token.filter(|t| !t.is_empty()).map(Secret),
            mounts: vec![],
            is_resume: p.is_resume,
            one_shot: p.one_shot.unwrap_or(false),
            mount_skeleton_home: p.mount_skeleton_home.unwrap_or(false),
            allowed_domains: p.allowed_domains,
            // Issued by the VM at spawn time (see `vm::processes`).
            egress_proxy: None,
        },
        mounts,
    }
}

/// Counts a connection for as long as the guard lives.
pub struct ConnectionGuard(pub Arc<Daemon>);

impl ConnectionGuard {
    pub fn new(d: Arc<Daemon>) -> Self {
        d.connections.fetch_add(1, Ordering::AcqRel);
        Self(d)
    }
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profile_keys_are_stable_and_distinct() {
        assert_eq!(profile_key(None, None), "default");
        let a = profile_key(Some("Claude"), Some("/home/u/.config"));
        let b = profile_key(Some("Claude"), Some("/home/v/.config"));
        assert_ne!(a, b);
        assert_eq!(a, profile_key(Some("Claude"), Some("/home/u/.config")));
        assert!(a.starts_with("Claude-"));
        let weird = profile_key(Some("../x/y"), None);
        assert!(!weird.contains('/') && !weird.contains(".."), "{weird}");
    }

    /// The reply's `error` is the error's text: the dispatcher's own
    /// errors read as they always have (clients match on some of them).
    #[test]
    fn dispatch_errors_keep_their_texts() {
        let unknown = DispatchError::UnknownMethod("frob".into()).to_string();
        assert_eq!(unknown, "Unknown method: frob (unknown method)");
        assert_eq!(
            DispatchError::UnknownSignal("SIGFOO".into()).to_string(),
            r#"kill: unknown signal "SIGFOO""#
        );
        assert_eq!(
            DispatchError::SignalNumber(99.into()).to_string(),
            "kill: invalid signal number 99"
        );
        let reply: Value = serde_json::from_slice(&crate::protocol::reply(
            Some(&json!(4)),
            Err(DispatchError::from(ProfileVmError::NotRunning)),
        ))
        .unwrap();
        assert_eq!(
            reply,
            json!({"id": 4, "success": false, "error": "the VM is not running: call startVM first"})
        );
    }
}
