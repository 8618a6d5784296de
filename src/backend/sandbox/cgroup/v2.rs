//! The sandbox's cgroup in the unified (v2) hierarchy, under the helper's
//! own cgroup, and the reading of any v2 cgroup's limits (also a systemd
//! scope's).
//!
//! Layout: `<own>/cowork-sandbox-<pid>-<n>` carries the limits
//! (`memory.max`, `memory.swap.max` 0, `pids.max`, `cpu.max` of
//! [`CPU_PERIOD_US`] per CPU); its leaf [`INIT_LEAF`] holds the init and the
//! agent, and the agent adds one child per session. For that the helper's
//! own cgroup must give `memory`, `pids` and `cpu` to its children
//! (`cgroup.subtree_control`), which v2 allows only in a cgroup without
//! processes of its own: the root, or one the helper is alone in, out of
//! which it then moves itself into [`HELPER_LEAF`].
//!
//! Errors: [`CgroupError`]. Limits: a cgroup shared with other processes
//! (a desktop application's scope) cannot be used; a user service manager
//! (module `systemd`) is the way there.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{
    helper_alive, read_value, remove_stale, write_file, CgroupError, Controller, HostFacts, Origin,
    SandboxCgroup, CPU_PERIOD_US, HELPER_LEAF, INIT_LEAF,
};
use crate::backend::sandbox::limits::{Enforcement, Hold, Limit, Limits};

/// Other pids of the helper's cgroup named in an error, at most.
const OTHERS_NAMED: usize = 5;

/// Creates the sandbox cgroup `name` under the helper's own v2 cgroup
/// (`own`, directory `own_dir`), with its [`INIT_LEAF`], and writes
/// `limits`.
pub(super) fn create(
    own_dir: &Path,
    own: &str,
    name: &str,
    limits: &Limits,
    facts: &HostFacts,
) -> Result<(SandboxCgroup, Enforcement), CgroupError> {
    let offered = read_value(&own_dir.join("cgroup.controllers")).unwrap_or_default();
    let offered: Vec<&str> = offered.split_whitespace().collect();
    let wanted: Vec<Controller> = Controller::LIMITING
        .into_iter()
        .filter(|c| offered.contains(&c.name()))
        .collect();
    if wanted.is_empty() {
        return Err(CgroupError::Unavailable(format!(
            "the helper's cgroup {own} offers none of the memory, pids and cpu controllers \
             (cgroup.controllers: {:?}; not delegated to it)",
            offered.join(" ")
        )));
    }
    remove_stale(own_dir, facts.pid, helper_alive);
    enable_for_children(own_dir, &wanted, facts.pid)?;
    let dir = own_dir.join(name);
    fs::create_dir(&dir).map_err(|source| create_error(own_dir, &dir, source))?;
    if let Err(source) = fs::create_dir(dir.join(INIT_LEAF)) {
        let _ = fs::remove_dir(&dir);
        return Err(CgroupError::Create {
            path: dir.join(INIT_LEAF),
            source,
        });
    }
    let mut notes = BTreeMap::new();
    let writes: [(Limit, &str, String); 4] = [
        (Limit::Memory, "memory.max", limits.memory_bytes.to_string()),
        (Limit::Swap, "memory.swap.max", "0".to_string()),
        (Limit::Processes, "pids.max", limits.pids.to_string()),
        (Limit::Cpu, "cpu.max", cpu_max(limits)),
    ];
    for (limit, file, value) in writes {
        let path = dir.join(file);
        if !path.exists() {
            // Reported by `verify` (controller or swap accounting absent).
            continue;
        }
        if let Err(e) = write_file(&path, &value) {
            notes.insert(limit, e.to_string());
        }
    }
    let cgroup = SandboxCgroup {
        origin: Origin::V2,
        dirs: vec![(Controller::LIMITING.to_vec(), dir.clone())],
    };
    let mut enforcement = verify(&Values::read(&dir), limits, facts.no_swap(), cgroup.label());
    for (limit, why) in notes {
        if !enforcement.get(limit).is_enforced() {
            enforcement.set(limit, Hold::Missing(why));
        }
    }
    for c in Controller::LIMITING {
        if !wanted.contains(&c) {
            for l in c.limits() {
                enforcement.set(
                    *l,
                    Hold::Missing(format!(
                        "the helper's cgroup {own} does not offer the {} controller (not \
                         delegated to it)",
                        c.name()
                    )),
                );
            }
        }
    }
    Ok((cgroup, enforcement))
}

/// `EACCES`/`EPERM`/`EROFS` on the helper's cgroup mean it is not ours to
/// write; anything else is a plain creation failure.
fn create_error(own_dir: &Path, dir: &Path, source: io::Error) -> CgroupError {
    match source.raw_os_error() {
        Some(libc::EACCES | libc::EPERM | libc::EROFS) => CgroupError::NotWritable {
            path: own_dir.to_path_buf(),
            source,
        },
        _ => CgroupError::Create {
            path: dir.to_path_buf(),
            source,
        },
    }
}

/// Enables `wanted` for the children of `own_dir`. A cgroup holding
/// processes refuses (`EBUSY`) unless it is the root: when the helper is
/// alone there, it moves itself into [`HELPER_LEAF`] first.
fn enable_for_children(own_dir: &Path, wanted: &[Controller], pid: u32) -> Result<(), CgroupError> {
    let control = own_dir.join("cgroup.subtree_control");
    let enabled = read_value(&control).unwrap_or_default();
    let value = wanted
        .iter()
        .filter(|c| !enabled.split_whitespace().any(|e| e == c.name()))
        .map(|c| format!("+{}", c.name()))
        .collect::<Vec<_>>()
        .join(" ");
    if value.is_empty() {
        return Ok(());
    }
    match write_file(&control, &value) {
        Ok(()) => Ok(()),
        Err(CgroupError::Write { source, .. }) if source.raw_os_error() == Some(libc::EBUSY) => {
            move_into_leaf(own_dir, pid)?;
            write_file(&control, &value)
        }
        Err(CgroupError::Write { source, .. })
            if matches!(
                source.raw_os_error(),
                Some(libc::EACCES | libc::EPERM | libc::EROFS)
            ) =>
        {
            Err(CgroupError::NotWritable {
                path: own_dir.to_path_buf(),
                source,
            })
        }
        Err(e) => Err(e),
    }
}

/// Moves process `pid` (the helper) from `own_dir` into its leaf
/// [`HELPER_LEAF`], if no other process is in `own_dir`.
pub(super) fn move_into_leaf(own_dir: &Path, pid: u32) -> Result<(), CgroupError> {
    let procs = fs::read_to_string(own_dir.join("cgroup.procs")).unwrap_or_default();
    let others: Vec<&str> = procs
        .lines()
        .map(str::trim)
        .filter(|p| !p.is_empty() && *p != pid.to_string())
        .collect();
    if !others.is_empty() {
        let mut named = others
            .iter()
            .take(OTHERS_NAMED)
            .copied()
            .collect::<Vec<_>>()
            .join(", ");
        if others.len() > OTHERS_NAMED {
            named.push_str(&format!(" and {} more", others.len() - OTHERS_NAMED));
        }
        return Err(CgroupError::Shared {
            path: own_dir.to_path_buf(),
            others: format!("pids {named}"),
        });
    }
    let leaf = own_dir.join(HELPER_LEAF);
    match fs::create_dir(&leaf) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(source) => return Err(create_error(own_dir, &leaf, source)),
    }
    write_file(&leaf.join("cgroup.procs"), &pid.to_string())?;
    tracing::info!(
        cgroup = %leaf.display(),
        "moved the helper into a leaf of its cgroup, so its sandboxes' cgroups can have controllers"
    );
    Ok(())
}

/// `cpu.max` for `limits`: one period per CPU.
pub fn cpu_max(limits: &Limits) -> String {
    format!(
        "{} {CPU_PERIOD_US}",
        u64::from(limits.cpus.max(1)) * CPU_PERIOD_US
    )
}

/// The limit files of one v2 cgroup (absent: `None`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Values {
    /// The directory read.
    pub dir: PathBuf,
    pub memory_max: Option<String>,
    pub swap_max: Option<String>,
    pub pids_max: Option<String>,
    pub cpu_max: Option<String>,
}

impl Values {
    pub fn read(dir: &Path) -> Values {
        Values {
            dir: dir.to_path_buf(),
            memory_max: read_value(&dir.join("memory.max")),
            swap_max: read_value(&dir.join("memory.swap.max")),
            pids_max: read_value(&dir.join("pids.max")),
            cpu_max: read_value(&dir.join("cpu.max")),
        }
    }
}

/// Which limits `values` hold; `how` names the cgroup in the report.
pub(super) fn verify(values: &Values, limits: &Limits, no_swap: bool, how: &str) -> Enforcement {
    let check = |file: &str, got: &Option<String>, want: &str, controller: &str| match got {
        Some(v) if v == want => Ok(()),
        Some(v) => Err(format!("{file} reads {v:?}, not {want:?}")),
        None => Err(format!(
            "{file} is absent: the {controller} controller is not enabled for {} (not \
             delegated)",
            values.dir.display()
        )),
    };
    let hold = |r: Result<(), String>, file: &str| match r {
        Ok(()) => Hold::Enforced(format!("{how} {file}")),
        Err(why) => Hold::Missing(why),
    };
    let mut e = Enforcement::default();
    e.set(
        Limit::Memory,
        hold(
            check(
                "memory.max",
                &values.memory_max,
                &limits.memory_bytes.to_string(),
                "memory",
            ),
            "memory.max",
        ),
    );
    e.set(
        Limit::Swap,
        match (&values.swap_max, &values.memory_max) {
            (None, Some(_)) if no_swap => Hold::Enforced("the host has no swap".into()),
            (None, Some(_)) => Hold::Missing(
                "memory.swap.max is absent: the kernel keeps no swap accounting for cgroups \
                 (swapaccount=0 or CONFIG_MEMCG_SWAP off)"
                    .into(),
            ),
            _ => hold(
                check("memory.swap.max", &values.swap_max, "0", "memory"),
                "memory.swap.max",
            ),
        },
    );
    e.set(
        Limit::Processes,
        hold(
            check(
                "pids.max",
                &values.pids_max,
                &limits.pids.to_string(),
                "pids",
            ),
            "pids.max",
        ),
    );
    e.set(
        Limit::Cpu,
        hold(
            check("cpu.max", &values.cpu_max, &cpu_max(limits), "cpu"),
            "cpu.max",
        ),
    );
    e
}
