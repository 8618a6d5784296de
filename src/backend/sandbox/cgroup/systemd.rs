//! The sandbox's cgroup as a transient systemd scope (cgroup v2 hosts with a
//! service manager: a desktop user's `systemd --user`, or the system manager
//! for a helper running as root).
//!
//! The init is started as `systemd-run [--user] --scope --unit
//! cowork-sandbox-<pid>-<n> -p MemoryMax=… -p MemorySwapMax=0 -p TasksMax=…
//! -p CPUQuota=…% -p Delegate=yes [-p OOMPolicy=continue] -- <helper>
//! __sandbox-init …`: `systemd-run` asks the manager for the scope with the
//! calling process in it, waits for it, then executes the init in place
//! (same pid, descriptors kept). `Delegate=yes` lets the init move itself
//! into the leaf [`super::INIT_LEAF`] and the agent make one cgroup per session.
//! `OOMPolicy=continue` (systemd 253 and later know it for scopes, whose
//! default became `stop`) keeps the manager from stopping the whole sandbox
//! when the kernel kills one session's process. The manager removes the
//! scope once it is empty.
//!
//! Before the first sandbox, a probe scope with the same properties runs
//! the helper's `__cgroup-probe` ([`probe_main`]), which prints the limits
//! its own cgroup got: what the manager can grant (a controller it was not
//! delegated is missing there too) is then known before the init starts,
//! so the stand-ins can cover it. A successful probe is remembered for the
//! helper's lifetime.
//!
//! Errors: [`CgroupError`]. Limits: needs `systemd-run` on `PATH` and the
//! manager's private socket (`$XDG_RUNTIME_DIR/systemd/private`); no D-Bus
//! broker is needed. The manager decides the scope's slice (`app.slice` for
//! a user).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::v2::{self, Values};
use super::{detect, CgroupError, HostFacts, Layout, Origin, SandboxCgroup};
use crate::backend::sandbox::limits::{Enforcement, Limits};
use vmm::sync::MutexExt;

/// The hidden subcommand the probe scope runs.
pub const PROBE_SUBCOMMAND: &str = "__cgroup-probe";

/// How long the probe (`systemd-run` and the probe itself) may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// The first systemd version whose scopes know `OOMPolicy=` (and default it
/// to `stop`).
const OOM_POLICY_SINCE: u32 = 253;

/// Poll interval while waiting for the probe.
const PROBE_POLL: Duration = Duration::from_millis(5);

/// The longest error text kept from `systemd-run`'s stderr.
const MAX_ERROR_CHARS: usize = 300;

/// A service manager to ask for scopes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Manager {
    /// `systemd-run`.
    pub program: PathBuf,
    /// The user's manager (`--user`), else the system's.
    pub user: bool,
}

impl Manager {
    pub fn from_facts(facts: &HostFacts) -> Option<Manager> {
        Some(Manager {
            program: facts.systemd_run.clone()?,
            user: facts.manager?,
        })
    }
}

/// `systemd-run --version`'s major version, read once per program.
fn version(program: &Path) -> Option<u32> {
    static VERSIONS: Mutex<Vec<(PathBuf, Option<u32>)>> = Mutex::new(Vec::new());
    let mut cache = VERSIONS.locked();
    if let Some((_, v)) = cache.iter().find(|(p, _)| p == program) {
        return *v;
    }
    let v = Command::new(program)
        .arg("--version")
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()
        .and_then(|o| parse_version(&String::from_utf8_lossy(&o.stdout)));
    cache.push((program.to_path_buf(), v));
    v
}

/// The version in `systemd 252 (252.38-1~deb12u1)`.
pub fn parse_version(text: &str) -> Option<u32> {
    let first = text.lines().next()?;
    first
        .strip_prefix("systemd ")?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The `systemd-run` command line (program first) that starts what follows
/// it in a scope `unit` with `limits`.
pub fn command(
    program: &Path,
    user: bool,
    version: Option<u32>,
    limits: &Limits,
    unit: &str,
) -> Vec<String> {
    let mut c = vec![program.to_string_lossy().into_owned()];
    if user {
        c.push("--user".into());
    }
    c.extend(
        [
            "--scope",
            "--quiet",
            "--collect",
            "--description=cowork-helper sandbox",
        ]
        .map(String::from),
    );
    c.push(format!("--unit={unit}"));
    let mut props = vec![
        format!("MemoryMax={}", limits.memory_bytes),
        "MemorySwapMax=0".to_string(),
        format!("TasksMax={}", limits.pids),
        format!("CPUQuota={}%", u64::from(limits.cpus.max(1)) * 100),
        "Delegate=yes".to_string(),
    ];
    if version.is_some_and(|v| v >= OOM_POLICY_SINCE) {
        props.push("OOMPolicy=continue".to_string());
    }
    for p in props {
        c.push("-p".into());
        c.push(p);
    }
    c.push("--".into());
    c
}

/// The probe scope's outcome, remembered after the first success.
static PROBED: Mutex<Vec<(bool, Enforcement)>> = Mutex::new(Vec::new());

/// Prepares a scope `name` for a sandbox with `limits`: probes the manager
/// (unless it was probed before) and returns the cgroup to start the init
/// in and what the probe scope got.
pub(super) fn prepare(
    manager: &Manager,
    limits: &Limits,
    mount: &Path,
    name: &str,
    helper_exe: &Path,
    facts: &HostFacts,
) -> Result<(SandboxCgroup, Enforcement), CgroupError> {
    let version = version(&manager.program);
    let scope_command = command(&manager.program, manager.user, version, limits, name);
    let remembered = PROBED
        .locked()
        .iter()
        .find(|(user, _)| *user == manager.user)
        .map(|(_, e)| e.clone());
    let enforcement = match remembered {
        Some(e) => e,
        None => {
            // Not a sandbox cgroup's name: stale-cgroup cleanup leaves it alone.
            let probe_unit = format!(
                "{}probe-{}",
                super::NAME_PREFIX,
                name.trim_start_matches(super::NAME_PREFIX)
            );
            let mut probe = command(&manager.program, manager.user, version, limits, &probe_unit);
            probe.push(helper_exe.to_string_lossy().into_owned());
            probe.push(PROBE_SUBCOMMAND.to_string());
            let values = run_probe(&probe)?;
            let e = v2::verify(&values, limits, facts.no_swap(), "systemd scope");
            PROBED.locked().push((manager.user, e.clone()));
            e
        }
    };
    let cgroup = SandboxCgroup {
        origin: Origin::Systemd {
            command: scope_command,
            mount: mount.to_path_buf(),
        },
        dirs: Vec::new(),
    };
    Ok((cgroup, enforcement))
}

/// Runs the probe command line; its output is the probe scope's [`Values`].
fn run_probe(argv: &[String]) -> Result<Values, CgroupError> {
    let (program, args) = argv
        .split_first()
        .ok_or_else(|| CgroupError::Systemd("empty command".into()))?;
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| CgroupError::Systemd(format!("cannot run {program}: {e}")))?;
    let deadline = Instant::now() + PROBE_TIMEOUT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(PROBE_POLL),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(CgroupError::Systemd(format!(
                    "the probe scope did not finish within {PROBE_TIMEOUT:?}"
                )));
            }
            Err(e) => return Err(CgroupError::Systemd(format!("waiting for the probe: {e}"))),
        }
    };
    let mut out = String::new();
    let mut err = String::new();
    if let Some(mut s) = child.stdout.take() {
        let _ = s.read_to_string(&mut out);
    }
    if let Some(mut s) = child.stderr.take() {
        let _ = s.read_to_string(&mut err);
    }
    if !status.success() {
        let text: String = err
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect::<Vec<_>>()
            .join(" / ")
            .chars()
            .take(MAX_ERROR_CHARS)
            .collect();
        return Err(CgroupError::Systemd(format!(
            "the manager refused a scope ({status}): {text}"
        )));
    }
    serde_json::from_str(out.trim()).map_err(|e| {
        CgroupError::Systemd(format!("the probe scope printed no limits ({e}): {out:?}"))
    })
}

/// Entry of `cowork-helper __cgroup-probe`: prints the limit files of its
/// own v2 cgroup as one JSON object (`v2::Values`); exit status 1 when it is
/// not in a v2 cgroup.
pub fn probe_main() -> i32 {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    match detect(&read("/proc/self/mountinfo"), &read("/proc/self/cgroup")) {
        Layout::V2 { dir, .. } => {
            let values = Values::read(&dir);
            match serde_json::to_string(&values) {
                Ok(json) => {
                    println!("{json}");
                    0
                }
                Err(e) => {
                    eprintln!("cowork-helper {PROBE_SUBCOMMAND}: {e}");
                    1
                }
            }
        }
        other => {
            eprintln!("cowork-helper {PROBE_SUBCOMMAND}: not in a cgroup v2 hierarchy: {other:?}");
            1
        }
    }
}
