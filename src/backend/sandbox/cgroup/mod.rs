//! The sandbox's own cgroup: where it comes from, the limits written into
//! it ([`super::limits`]), how the sandbox's init joins it, and its removal.
//!
//! Where the cgroup comes from, in this order ([`place`]):
//!
//! 1. **cgroup v1** (hybrid hosts: `memory`, `pids`, `cpu` mounted as v1
//!    hierarchies; module `v1`): a directory `cowork-sandbox-<pid>-<n>`
//!    under the helper's own cgroup in each of those hierarchies (and
//!    `cpuacct`, for accounting), limits in `memory.limit_in_bytes` and
//!    `memory.memsw.limit_in_bytes` (swap off), `pids.max` and
//!    `cpu.cfs_quota_us`.
//! 2. **cgroup v2 through systemd** (module `systemd`): when a service
//!    manager of the helper's user is reachable (`$XDG_RUNTIME_DIR/systemd/private`,
//!    or the system manager for root), the init is started through
//!    `systemd-run --scope` with `MemoryMax`, `MemorySwapMax=0`, `TasksMax`,
//!    `CPUQuota` and `Delegate=yes`; systemd creates the scope and removes it
//!    once it is empty. A probe scope (the helper's `__cgroup-probe`) first
//!    shows what the manager grants.
//! 3. **cgroup v2 under the helper's own cgroup** (module `v2`), when that
//!    one is writable and offers the controllers (delegated, or the root of a
//!    container or VM): `cowork-sandbox-<pid>-<n>` with `memory.max`,
//!    `memory.swap.max` = 0, `pids.max` and `cpu.max`.
//!
//! In v2 the init and the agent live in the leaf [`INIT_LEAF`], so the
//! agent can give each session a child cgroup with the memory controller
//! (its `memory.events` is the exit event's `oomKillCount`); in v1 it does
//! the same in the memory hierarchy (`memory.oom_control`). What did not
//! work is reported per limit ([`Enforcement`]) and the caller sets the
//! stand-ins ([`Rlimits`]).
//!
//! A cgroup is removed when its sandbox ends; one left by a helper that was
//! killed is removed by the next helper that creates one under the same
//! parent, recognised by the dead pid in its name.
//!
//! Limits: the helper never changes a cgroup it did not create, except
//! enabling controllers for the children of its own v2 cgroup (and moving
//! itself into a leaf of it when it is alone there, as a delegated service
//! must). v1 and v2 are not mixed: on a hybrid host the v1 hierarchies are
//! used, and a controller without one is missing.

mod systemd;
mod v1;
mod v2;

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::limits::{Enforcement, Hold, Limit, Limits, Rlimits};
use super::wire::CgroupSpec;
use crate::hostfs::HostEnv;

pub use systemd::probe_main;

/// Prefix of a sandbox cgroup's name: `cowork-sandbox-<helper pid>-<n>`.
pub const NAME_PREFIX: &str = "cowork-sandbox-";

/// The v2 leaf of a sandbox cgroup that holds its init and agent: a v2
/// cgroup that gives controllers to its children must hold no process
/// itself.
pub const INIT_LEAF: &str = "init";

/// The leaf a helper that is alone in its v2 cgroup moves itself into, so
/// controllers can be enabled for its sandboxes' cgroups there.
pub const HELPER_LEAF: &str = "cowork-helper";

/// The v1 CPU bandwidth period (and v2's `cpu.max` period): 100 ms, the
/// kernel's default.
pub const CPU_PERIOD_US: u64 = 100_000;

/// How long the removal of a sandbox cgroup waits for its processes to be
/// gone (they are killed after the first failed attempt).
pub const REMOVE_TIMEOUT: Duration = Duration::from_secs(5);

/// Pause between removal attempts.
const REMOVE_RETRY: Duration = Duration::from_millis(10);

/// Test hook: makes [`place`] find no cgroup at all, with this variable's
/// name as the reason, so the fallback can be tested on a host that has
/// cgroups. Read from the helper's environment by [`crate::cli`] only (no
/// flag), which sets [`super::SandboxConfig::cgroup_disabled`].
pub const DISABLE_ENV: &str = "COWORK_TEST_SANDBOX_NO_CGROUP";

/// Distinguishes the cgroups of one helper's sandboxes.
static SEQ: AtomicU64 = AtomicU64::new(0);

/// Why a cgroup could not be had or handled.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("{0}")]
    Unavailable(String),
    #[error("cannot create the cgroup {}: {source}", path.display())]
    Create { path: PathBuf, source: io::Error },
    #[error(
        "the helper's cgroup {} is not writable ({source}); it needs a cgroup delegated to \
         its user (systemd: Delegate=yes) or a user service manager to ask for one",
        path.display()
    )]
    NotWritable { path: PathBuf, source: io::Error },
    #[error(
        "the helper's cgroup {} also holds other processes ({others}), so it cannot give \
         controllers to child cgroups; a user service manager (systemd --user) would provide a \
         scope",
        path.display()
    )]
    Shared { path: PathBuf, others: String },
    #[error("cannot write {value:?} to {}: {source}", path.display())]
    Write {
        path: PathBuf,
        value: String,
        source: io::Error,
    },
    #[error("cannot remove the cgroup {}: {source}", path.display())]
    Remove { path: PathBuf, source: io::Error },
    #[error("systemd-run: {0}")]
    Systemd(String),
}

/// A controller the sandbox's cgroup uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Controller {
    Memory,
    Pids,
    Cpu,
    /// v1 only: CPU accounting, which v2's `cpu` controller includes.
    Cpuacct,
}

impl Controller {
    /// The controllers that carry a limit.
    pub const LIMITING: [Controller; 3] = [Controller::Memory, Controller::Pids, Controller::Cpu];

    pub fn name(self) -> &'static str {
        match self {
            Controller::Memory => "memory",
            Controller::Pids => "pids",
            Controller::Cpu => "cpu",
            Controller::Cpuacct => "cpuacct",
        }
    }

    /// The limits this controller carries.
    fn limits(self) -> &'static [Limit] {
        match self {
            Controller::Memory => &[Limit::Memory, Limit::Swap],
            Controller::Pids => &[Limit::Processes],
            Controller::Cpu => &[Limit::Cpu],
            Controller::Cpuacct => &[],
        }
    }
}

// ------------------------------------------------------------------ facts

/// One cgroup file system mount of `/proc/self/mountinfo`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CgroupMount {
    /// The cgroup the mount shows at its mount point (`/` unless a subtree
    /// was bind-mounted, as in some containers).
    pub root: String,
    pub point: PathBuf,
    /// v1: the controllers of the hierarchy (`name=` options left out);
    /// `None` for the v2 (unified) hierarchy.
    pub v1_controllers: Option<Vec<String>>,
}

/// The cgroup mounts in a `/proc/self/mountinfo` text.
pub fn parse_mountinfo(text: &str) -> Vec<CgroupMount> {
    text.lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let mut l = left.split(' ');
            let root = unescape_mount_field(l.nth(3)?);
            let point = PathBuf::from(unescape_mount_field(l.next()?));
            let mut r = right.split(' ');
            let fstype = r.next()?;
            let _source = r.next();
            let options = r.next().unwrap_or("");
            let v1_controllers = match fstype {
                "cgroup2" => None,
                "cgroup" => Some(
                    options
                        .split(',')
                        .filter(|o| {
                            !o.is_empty()
                                && !o.contains('=')
                                && !matches!(
                                    *o,
                                    "rw" | "ro"
                                        | "noprefix"
                                        | "clone_children"
                                        | "xattr"
                                        | "cpuset_v2_mode"
                                        | "favordynmods"
                                )
                        })
                        .map(str::to_string)
                        .collect(),
                ),
                _ => return None,
            };
            Some(CgroupMount {
                root,
                point,
                v1_controllers,
            })
        })
        .collect()
}

/// Undoes mountinfo's octal escapes (`\040` for a space and so on).
fn unescape_mount_field(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 4 <= bytes.len() {
            let oct = &bytes[i + 1..i + 4];
            if oct.iter().all(|b| (b'0'..=b'7').contains(b)) {
                let v = oct
                    .iter()
                    .fold(0u32, |acc, b| acc * 8 + u32::from(b - b'0'));
                if let Ok(v) = u8::try_from(v) {
                    out.push(v);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The cgroups of a process, from its `/proc/<pid>/cgroup`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Membership {
    /// v1 hierarchies: their controllers (as listed) and the path.
    pub v1: Vec<(Vec<String>, String)>,
    /// The v2 (unified) cgroup, the `0::` line.
    pub v2: Option<String>,
}

impl Membership {
    /// The v1 cgroup of the hierarchy holding `controller`.
    pub fn v1_path(&self, controller: &str) -> Option<&str> {
        self.v1
            .iter()
            .find(|(c, _)| c.iter().any(|n| n == controller))
            .map(|(_, p)| p.as_str())
    }
}

/// Parses a `/proc/<pid>/cgroup` text.
pub fn parse_proc_cgroup(text: &str) -> Membership {
    let mut m = Membership::default();
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        if id == "0" && controllers.is_empty() {
            m.v2 = Some(path.to_string());
        } else if !controllers.is_empty() {
            let list = controllers
                .split(',')
                .filter(|c| !c.contains('='))
                .map(str::to_string)
                .collect();
            m.v1.push((list, path.to_string()));
        }
    }
    m
}

/// The directory of cgroup `path` in a mount showing cgroup `root` at
/// `point`; `None` when the mount does not show it.
fn dir_in_mount(point: &Path, root: &str, path: &str) -> Option<PathBuf> {
    let rel = if root == "/" {
        path.trim_start_matches('/')
    } else {
        let rest = path.strip_prefix(root)?;
        if !(rest.is_empty() || rest.starts_with('/')) {
            return None;
        }
        rest.trim_start_matches('/')
    };
    if rel.split('/').any(|c| c == "..") {
        return None;
    }
    Some(if rel.is_empty() {
        point.to_path_buf()
    } else {
        point.join(rel)
    })
}

/// Which cgroup hierarchy the sandbox can use, and the helper's place in it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Layout {
    /// v1 hierarchies hold at least one of memory, pids and cpu: the
    /// helper's own cgroup directory in each hierarchy found.
    V1(BTreeMap<Controller, PathBuf>),
    /// The unified hierarchy: its mount point, the helper's cgroup path in
    /// it and that cgroup's directory.
    V2 {
        mount: PathBuf,
        own: String,
        dir: PathBuf,
    },
    /// Neither; why.
    None(String),
}

/// Finds the layout from the helper's mountinfo and cgroup texts.
pub fn detect(mountinfo: &str, proc_cgroup: &str) -> Layout {
    let mounts = parse_mountinfo(mountinfo);
    let member = parse_proc_cgroup(proc_cgroup);
    let mut v1 = BTreeMap::new();
    for c in [
        Controller::Memory,
        Controller::Pids,
        Controller::Cpu,
        Controller::Cpuacct,
    ] {
        let mount = mounts.iter().find(|m| {
            m.v1_controllers
                .as_ref()
                .is_some_and(|cs| cs.iter().any(|n| n == c.name()))
        });
        let (Some(mount), Some(path)) = (mount, member.v1_path(c.name())) else {
            continue;
        };
        if let Some(dir) = dir_in_mount(&mount.point, &mount.root, path) {
            v1.insert(c, dir);
        }
    }
    if Controller::LIMITING.iter().any(|c| v1.contains_key(c)) {
        return Layout::V1(v1);
    }
    let unified = mounts.iter().find(|m| m.v1_controllers.is_none());
    match (unified, member.v2) {
        (Some(m), Some(own)) => match dir_in_mount(&m.point, &m.root, &own) {
            Some(dir) => Layout::V2 {
                mount: m.point.clone(),
                own,
                dir,
            },
            None => Layout::None(format!(
                "the helper's cgroup {own} is outside the cgroup2 mount at {} (which shows {})",
                m.point.display(),
                m.root
            )),
        },
        (Some(m), None) => Layout::None(format!(
            "cgroup2 is mounted at {} but /proc/self/cgroup names no cgroup of the helper there",
            m.point.display()
        )),
        (None, _) => Layout::None(
            "no cgroup hierarchy with the memory, pids or cpu controller is mounted".to_string(),
        ),
    }
}

/// What the placement decides on, read from the running system by
/// [`HostFacts::read`] and made by hand in tests.
#[derive(Clone, Debug, Default)]
pub struct HostFacts {
    /// `/proc/self/mountinfo`.
    pub mountinfo: String,
    /// `/proc/self/cgroup`.
    pub proc_cgroup: String,
    pub pid: u32,
    pub euid: u32,
    /// `SwapTotal` of `/proc/meminfo`, in KiB.
    pub swap_total_kib: Option<u64>,
    /// `systemd-run`, when found on `PATH`.
    pub systemd_run: Option<PathBuf>,
    /// A service manager to ask for a scope: `Some(true)` the user's
    /// (`$XDG_RUNTIME_DIR/systemd/private`), `Some(false)` the system's (root
    /// only, `/run/systemd/private`).
    pub manager: Option<bool>,
    /// No cgroup is to be had, for this reason (the [`DISABLE_ENV`] test
    /// hook; a sandbox that could not join its cgroup, started again).
    pub disabled: Option<String>,
}

/// The system manager's private socket.
const SYSTEM_MANAGER_SOCKET: &str = "/run/systemd/private";

/// The user manager's private socket, under `$XDG_RUNTIME_DIR`.
const USER_MANAGER_SOCKET: &str = "systemd/private";

impl HostFacts {
    /// The facts of this process, with `host`'s `PATH` and
    /// `$XDG_RUNTIME_DIR`; `hook_disabled`: the [`DISABLE_ENV`] test hook
    /// is on.
    pub fn read(host: &HostEnv, hook_disabled: bool) -> HostFacts {
        let read = |p: &str| fs::read_to_string(p).unwrap_or_default();
        // SAFETY: geteuid cannot fail.
        let euid = unsafe { libc::geteuid() };
        let user_manager = host
            .runtime_dir
            .as_ref()
            .filter(|d| d.is_absolute())
            .is_some_and(|d| d.join(USER_MANAGER_SOCKET).exists());
        let manager = if user_manager {
            Some(true)
        } else if euid == 0 && Path::new(SYSTEM_MANAGER_SOCKET).exists() {
            Some(false)
        } else {
            None
        };
        HostFacts {
            mountinfo: read("/proc/self/mountinfo"),
            proc_cgroup: read("/proc/self/cgroup"),
            pid: std::process::id(),
            euid,
            swap_total_kib: host_swap_total_kib(),
            systemd_run: host.on_path("systemd-run"),
            manager,
            disabled: hook_disabled.then(disabled_by_hook),
        }
    }

    /// The host has no swap at all.
    fn no_swap(&self) -> bool {
        self.swap_total_kib == Some(0)
    }
}

/// The reason [`place`] gets when the [`DISABLE_ENV`] test hook is on.
pub fn disabled_by_hook() -> String {
    format!("no cgroup: disabled by {DISABLE_ENV} (test hook)")
}

/// This host's `SwapTotal` (`/proc/meminfo`), in KiB.
pub fn host_swap_total_kib() -> Option<u64> {
    swap_total_kib(&fs::read_to_string("/proc/meminfo").unwrap_or_default())
}

/// `SwapTotal` of a `/proc/meminfo` text, in KiB.
pub fn swap_total_kib(meminfo: &str) -> Option<u64> {
    meminfo.lines().find_map(|l| {
        let rest = l.strip_prefix("SwapTotal:")?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

// ------------------------------------------------------------------ the cgroup

/// How the sandbox's cgroup was made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// Created by the helper in the v1 hierarchies.
    V1,
    /// Created by the helper under its own v2 cgroup.
    V2,
    /// A transient scope of a systemd manager (v2); systemd removes it.
    Systemd {
        /// The `systemd-run` invocation that starts the init in the scope,
        /// without the init's own command line.
        command: Vec<String>,
        /// The unified hierarchy's mount point.
        mount: PathBuf,
    },
}

/// One sandbox's cgroup: its directories (one per v1 hierarchy, or one v2
/// directory) and how the init joins it. Removing it is the owner's job
/// ([`SandboxCgroup::remove`]); a cgroup systemd made is left to systemd.
#[derive(Debug)]
pub struct SandboxCgroup {
    origin: Origin,
    /// The directories and the controllers each one carries.
    dirs: Vec<(Vec<Controller>, PathBuf)>,
}

impl SandboxCgroup {
    /// The directory carrying `controller`.
    pub fn dir(&self, controller: Controller) -> Option<&Path> {
        self.dirs
            .iter()
            .find(|(cs, _)| cs.contains(&controller))
            .map(|(_, d)| d.as_path())
    }

    pub fn origin(&self) -> &Origin {
        &self.origin
    }

    /// The `systemd-run` command line to start the init with, for a scope.
    pub fn command_prefix(&self) -> Option<&[String]> {
        match &self.origin {
            Origin::Systemd { command, .. } => Some(command),
            _ => None,
        }
    }

    /// What the init must do to be in this cgroup.
    pub fn init_spec(&self) -> CgroupSpec {
        match &self.origin {
            Origin::V1 => CgroupSpec {
                join: self
                    .dirs
                    .iter()
                    .map(|(_, d)| d.join("cgroup.procs").to_string_lossy().into_owned())
                    .collect(),
                leaf_under_own: None,
                agent_root: self
                    .dir(Controller::Memory)
                    .map(|d| d.to_string_lossy().into_owned()),
            },
            Origin::V2 => {
                let dir = self.dirs.first().map(|(_, d)| d.clone());
                CgroupSpec {
                    join: dir
                        .iter()
                        .map(|d| {
                            d.join(INIT_LEAF)
                                .join("cgroup.procs")
                                .to_string_lossy()
                                .into_owned()
                        })
                        .collect(),
                    leaf_under_own: None,
                    agent_root: dir.map(|d| d.to_string_lossy().into_owned()),
                }
            }
            Origin::Systemd { mount, .. } => CgroupSpec {
                join: Vec::new(),
                leaf_under_own: Some(mount.to_string_lossy().into_owned()),
                agent_root: None,
            },
        }
    }

    /// A systemd scope's directory, learnt from the init's cgroup once it
    /// runs there (it has moved into [`INIT_LEAF`] by then).
    pub fn learn_scope(&mut self, init_pid: u32) {
        let Origin::Systemd { mount, .. } = &self.origin else {
            return;
        };
        let text = fs::read_to_string(format!("/proc/{init_pid}/cgroup")).unwrap_or_default();
        let Some(path) = parse_proc_cgroup(&text).v2 else {
            return;
        };
        let scope = path
            .strip_suffix(&format!("/{INIT_LEAF}"))
            .unwrap_or(&path)
            .to_string();
        if let Some(dir) = dir_in_mount(mount, "/", &scope) {
            self.dirs = vec![(Controller::LIMITING.to_vec(), dir)];
        }
    }

    /// Reads back the limits the cgroup holds.
    pub fn verify(&self, limits: &Limits, no_swap: bool) -> Enforcement {
        match &self.origin {
            Origin::V1 => v1::verify(&self.dirs, limits, no_swap),
            Origin::V2 | Origin::Systemd { .. } => match self.dirs.first() {
                Some((_, dir)) => v2::verify(&v2::Values::read(dir), limits, no_swap, self.label()),
                None => missing_all("the systemd scope's cgroup was not found"),
            },
        }
    }

    /// What a limit held here is called in reports (the directories are
    /// logged once, by [`SandboxCgroup::describe`]).
    fn label(&self) -> &'static str {
        match self.origin {
            Origin::V1 => "cgroup v1",
            Origin::V2 => "cgroup v2",
            Origin::Systemd { .. } => "systemd scope",
        }
    }

    /// For logs: the version and the directories.
    pub fn describe(&self) -> String {
        let dirs: Vec<String> = self
            .dirs
            .iter()
            .map(|(_, d)| d.display().to_string())
            .collect();
        match &self.origin {
            Origin::V1 => format!("cgroup v1 {}", dirs.join(" ")),
            Origin::V2 => format!("cgroup v2 {}", dirs.join(" ")),
            Origin::Systemd { .. } if dirs.is_empty() => "a systemd scope (cgroup v2)".into(),
            Origin::Systemd { .. } => format!("systemd scope, cgroup v2 {}", dirs.join(" ")),
        }
    }

    /// Removes the cgroup's directories (children first), killing what is
    /// left in them; waits at most [`REMOVE_TIMEOUT`]. A systemd scope is
    /// systemd's to remove once empty; only its leftovers are killed.
    pub fn remove(&self) -> Result<(), CgroupError> {
        if let Origin::Systemd { .. } = self.origin {
            for (_, dir) in &self.dirs {
                kill_all(dir);
            }
            return Ok(());
        }
        let mut first_err = None;
        for (_, dir) in &self.dirs {
            if let Err(e) = remove_tree(dir, Instant::now() + REMOVE_TIMEOUT) {
                first_err.get_or_insert(e);
            }
        }
        match first_err {
            None => Ok(()),
            Some(e) => Err(e),
        }
    }
}

/// Every limit missing for `why`.
fn missing_all(why: &str) -> Enforcement {
    let mut e = Enforcement::default();
    for l in Limit::ALL {
        e.set(l, Hold::Missing(why.to_string()));
    }
    e
}

/// Kills every process in the cgroup `dir` (v2: `cgroup.kill`, else each
/// pid of `cgroup.procs`). They are the sandbox's own.
fn kill_all(dir: &Path) {
    if fs::write(dir.join("cgroup.kill"), "1").is_ok() {
        return;
    }
    let Ok(procs) = fs::read_to_string(dir.join("cgroup.procs")) else {
        return;
    };
    for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
        if pid > 1 {
            // SAFETY: plain kill(2) of a process in the sandbox's cgroup.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

/// Removes the cgroup directory `dir` and its child cgroups, children
/// first; a cgroup that still holds processes has them killed and is
/// retried until `deadline`. A directory that is gone already is fine.
pub fn remove_tree(dir: &Path, deadline: Instant) -> Result<(), CgroupError> {
    loop {
        if let Ok(entries) = fs::read_dir(dir) {
            for e in entries.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    remove_tree(&e.path(), deadline)?;
                }
            }
        }
        match fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline => {
                kill_all(dir);
                std::thread::sleep(REMOVE_RETRY);
            }
            Err(source) => {
                return Err(CgroupError::Remove {
                    path: dir.to_path_buf(),
                    source,
                })
            }
        }
    }
}

/// The pid in a sandbox cgroup's name, `cowork-sandbox-<pid>-<n>`.
fn owner_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix(NAME_PREFIX)?;
    let (pid, n) = rest.split_once('-')?;
    n.parse::<u64>().ok()?;
    pid.parse().ok()
}

/// Whether a helper with pid `pid` may still own its cgroups: the process
/// exists and is a `cowork-helper` (a pid reused by another program is not).
fn helper_alive(pid: u32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/comm")) {
        Ok(comm) => comm.trim() == "cowork-helper",
        Err(_) => false,
    }
}

/// Removes the sandbox cgroups under `parent` whose helper is gone
/// (`alive` says which pids still own theirs); returns the names removed.
pub fn remove_stale(parent: &Path, me: u32, alive: impl Fn(u32) -> bool) -> Vec<String> {
    let Ok(entries) = fs::read_dir(parent) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = owner_pid(&name) else {
            continue;
        };
        if pid == me || alive(pid) || !e.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        match remove_tree(&e.path(), Instant::now() + REMOVE_TIMEOUT) {
            Ok(()) => {
                tracing::info!(cgroup = %e.path().display(), "removed a sandbox cgroup a killed helper left behind");
                removed.push(name);
            }
            Err(err) => tracing::warn!(error = %err, "cannot remove a stale sandbox cgroup"),
        }
    }
    removed
}

/// A fresh cgroup name for this helper.
fn next_name(pid: u32) -> String {
    format!("{NAME_PREFIX}{pid}-{}", SEQ.fetch_add(1, Ordering::Relaxed))
}

/// Opens an existing control file for writing (never creates one) and
/// writes `value`.
fn write_file(path: &Path, value: &str) -> Result<(), CgroupError> {
    use std::io::Write;
    fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(path)
        .and_then(|mut f| f.write_all(value.as_bytes()))
        .map_err(|source| CgroupError::Write {
            path: path.to_path_buf(),
            value: value.to_string(),
            source,
        })
}

/// The first line of a control file, trimmed.
fn read_value(path: &Path) -> Option<String> {
    fs::read_to_string(path)
        .ok()
        .map(|s| s.lines().next().unwrap_or("").trim().to_string())
}

// ------------------------------------------------------------------ placement

/// Where a sandbox goes and what it gets.
#[derive(Debug)]
pub struct Placement {
    /// Its cgroup; none when none could be had.
    pub cgroup: Option<SandboxCgroup>,
    /// Each limit's state (for a systemd scope: what the probe scope got;
    /// the scope itself is checked once the init runs there).
    pub enforcement: Enforcement,
    /// The stand-ins the init sets for missing limits.
    pub rlimits: Rlimits,
}

/// Finds a cgroup for a sandbox with `limits` (see the module doc for the
/// order), creating it unless systemd will, and decides the stand-ins for
/// what is missing. Blocking (file system work; the systemd probe runs a
/// process). `helper_exe` is the helper run as the systemd probe.
pub fn place(limits: &Limits, facts: &HostFacts, helper_exe: &Path) -> Placement {
    let found: Result<(SandboxCgroup, Enforcement), String> =
        if let Some(why) = &facts.disabled {
            Err(why.clone())
        } else {
            match detect(&facts.mountinfo, &facts.proc_cgroup) {
                Layout::V1(dirs) => v1::create(&dirs, &next_name(facts.pid), limits, facts)
                    .map_err(|e| e.to_string()),
                Layout::V2 { mount, own, dir } => {
                    let mut reasons = Vec::new();
                    let via_systemd = match systemd::Manager::from_facts(facts) {
                        Some(manager) => {
                            match systemd::prepare(
                                &manager,
                                limits,
                                &mount,
                                &next_name(facts.pid),
                                helper_exe,
                                facts,
                            ) {
                                Ok(found) => Some(found),
                                Err(e) => {
                                    reasons.push(e.to_string());
                                    None
                                }
                            }
                        }
                        None => None,
                    };
                    match via_systemd {
                        Some(found) => Ok(found),
                        None => v2::create(&dir, &own, &next_name(facts.pid), limits, facts)
                            .map_err(|e| {
                                reasons.push(e.to_string());
                                reasons.join("; ")
                            }),
                    }
                }
                Layout::None(why) => Err(why),
            }
        };
    let (cgroup, mut enforcement) = match found {
        Ok((cg, e)) => (Some(cg), e),
        Err(why) => (None, missing_all(&why)),
    };
    if facts.no_swap() && !enforcement.get(Limit::Swap).is_enforced() {
        enforcement.set(Limit::Swap, Hold::Enforced("the host has no swap".into()));
    }
    let rlimits = stand_ins(limits, &mut enforcement, facts.euid == 0);
    Placement {
        cgroup,
        enforcement,
        rlimits,
    }
}

/// The rlimits standing in for a missing memory or process limit, and the
/// enforcement updated to say so. `root`: `RLIMIT_NPROC` does not bind.
pub fn stand_ins(limits: &Limits, enforcement: &mut Enforcement, root: bool) -> Rlimits {
    let mut r = Rlimits::default();
    if let Hold::Missing(why) = enforcement.get(Limit::Memory) {
        r.data = Some(limits.memory_bytes);
        enforcement.set(
            Limit::Memory,
            Hold::StandIn {
                how: format!("RLIMIT_DATA {} MiB per process", limits.memory_mib()),
                why,
            },
        );
    }
    if let Hold::Missing(why) = enforcement.get(Limit::Processes) {
        if root {
            enforcement.set(
                Limit::Processes,
                Hold::Missing(format!(
                    "{why}; RLIMIT_NPROC cannot stand in: the kernel does not apply it to root"
                )),
            );
        } else {
            r.nproc = Some(limits.pids);
            enforcement.set(
                Limit::Processes,
                Hold::StandIn {
                    how: format!(
                        "RLIMIT_NPROC {} in the sandbox's user namespace",
                        limits.pids
                    ),
                    why,
                },
            );
        }
    }
    r
}

#[cfg(test)]
mod tests;
