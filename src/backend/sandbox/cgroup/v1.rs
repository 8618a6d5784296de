//! The sandbox's cgroup on a cgroup v1 (hybrid) host: one directory per
//! hierarchy (`memory`, `pids`, `cpu`, and `cpuacct` for accounting; a
//! co-mounted `cpu,cpuacct` shares one), under the helper's own cgroup in
//! each.
//!
//! Limits written: `memory.limit_in_bytes`, then
//! `memory.memsw.limit_in_bytes` to the same value (memory plus swap equal to
//! memory: no swap); without swap accounting (`memory.memsw.*` absent)
//! `memory.swappiness` 0 instead, which keeps most but not all pages out of
//! swap, so swap is reported missing unless the host has none. `pids.max`;
//! `cpu.cfs_period_us` [`CPU_PERIOD_US`] and `cpu.cfs_quota_us` that many
//! microseconds per CPU.
//!
//! Errors: [`CgroupError`]. Limits: the helper must be allowed to create
//! directories in those hierarchies (root, or an administrator's
//! delegation); a hierarchy that refuses leaves its limits missing.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use super::{
    helper_alive, read_value, remove_stale, write_file, CgroupError, Controller, HostFacts, Origin,
    SandboxCgroup, CPU_PERIOD_US,
};
use crate::backend::sandbox::limits::{Enforcement, Hold, Limit, Limits};

/// What a limit enforced here is called in reports.
const HOW: &str = "cgroup v1";

/// Creates the sandbox cgroup `name` in each hierarchy of `own` (the
/// helper's own cgroup directory per controller) and writes `limits`.
/// Fails only when no hierarchy took the cgroup; otherwise the
/// enforcement says which limits hold.
pub(super) fn create(
    own: &BTreeMap<Controller, PathBuf>,
    name: &str,
    limits: &Limits,
    facts: &HostFacts,
) -> Result<(SandboxCgroup, Enforcement), CgroupError> {
    // Co-mounted controllers share a directory.
    let mut parents: Vec<(Vec<Controller>, PathBuf)> = Vec::new();
    for (&c, dir) in own {
        match parents.iter_mut().find(|(_, d)| d == dir) {
            Some((cs, _)) => cs.push(c),
            None => parents.push((vec![c], dir.clone())),
        }
    }
    let mut notes: BTreeMap<Limit, String> = BTreeMap::new();
    let mut created = Vec::new();
    let mut first_err = None;
    for (controllers, parent) in parents {
        remove_stale(&parent, facts.pid, helper_alive);
        let dir = parent.join(name);
        match fs::create_dir(&dir) {
            Ok(()) => created.push((controllers, dir)),
            Err(source) => {
                let err = CgroupError::Create { path: dir, source };
                for l in controllers.iter().flat_map(|c| c.limits()) {
                    notes.insert(*l, err.to_string());
                }
                first_err.get_or_insert(err);
            }
        }
    }
    if created.is_empty() {
        return Err(CgroupError::Unavailable(match first_err {
            Some(e) => format!(
                "no cgroup v1 hierarchy takes the sandbox's cgroup (the helper needs root or a \
                 hierarchy delegated to its user): {e}"
            ),
            None => "no cgroup v1 hierarchy to create the sandbox's cgroup in".to_string(),
        }));
    }
    for (controllers, dir) in &created {
        for c in controllers {
            if let Err((limit, why)) = write_limits(*c, dir, limits) {
                notes.insert(limit, why);
            }
        }
    }
    let cgroup = SandboxCgroup {
        origin: Origin::V1,
        dirs: created,
    };
    let mut enforcement = verify(&cgroup.dirs, limits, facts.no_swap());
    for (limit, why) in notes {
        if !enforcement.get(limit).is_enforced() {
            enforcement.set(limit, Hold::Missing(why));
        }
    }
    Ok((cgroup, enforcement))
}

/// Writes the limits `c` carries into `dir`; the first failure, with the
/// limit it leaves missing.
pub(super) fn write_limits(
    c: Controller,
    dir: &Path,
    limits: &Limits,
) -> Result<(), (Limit, String)> {
    let fail = |limit: Limit| move |e: CgroupError| (limit, e.to_string());
    match c {
        Controller::Memory => {
            let bytes = limits.memory_bytes.to_string();
            write_file(&dir.join("memory.limit_in_bytes"), &bytes).map_err(fail(Limit::Memory))?;
            let memsw = dir.join("memory.memsw.limit_in_bytes");
            if memsw.exists() {
                write_file(&memsw, &bytes).map_err(fail(Limit::Swap))?;
            } else {
                // Best effort without swap accounting; reported as missing.
                let _ = write_file(&dir.join("memory.swappiness"), "0");
            }
        }
        Controller::Pids => {
            write_file(&dir.join("pids.max"), &limits.pids.to_string())
                .map_err(fail(Limit::Processes))?;
        }
        Controller::Cpu => {
            write_file(&dir.join("cpu.cfs_period_us"), &CPU_PERIOD_US.to_string())
                .map_err(fail(Limit::Cpu))?;
            write_file(
                &dir.join("cpu.cfs_quota_us"),
                &cpu_quota_us(limits).to_string(),
            )
            .map_err(fail(Limit::Cpu))?;
        }
        Controller::Cpuacct => {}
    }
    Ok(())
}

/// `cpu.cfs_quota_us` for `limits`: one period per CPU.
pub fn cpu_quota_us(limits: &Limits) -> u64 {
    u64::from(limits.cpus.max(1)) * CPU_PERIOD_US
}

/// Reads back which limits the directories hold.
pub(super) fn verify(
    dirs: &[(Vec<Controller>, PathBuf)],
    limits: &Limits,
    no_swap: bool,
) -> Enforcement {
    let dir = |c: Controller| {
        dirs.iter()
            .find(|(cs, _)| cs.contains(&c))
            .map(|(_, d)| d.as_path())
    };
    let absent = |c: Controller| {
        Hold::Missing(format!(
            "no cgroup v1 {} hierarchy took the sandbox's cgroup",
            c.name()
        ))
    };
    let check = |path: PathBuf, want: u64| -> Result<(), String> {
        match read_value(&path).map(|v| v.parse::<u64>()) {
            Some(Ok(v)) if v == want => Ok(()),
            Some(Ok(v)) => Err(format!("{} reads {v}, not {want}", path.display())),
            Some(Err(_)) | None => Err(format!("{} is missing or unreadable", path.display())),
        }
    };
    let mut e = Enforcement::default();
    match dir(Controller::Memory) {
        Some(d) => {
            e.set(
                Limit::Memory,
                match check(d.join("memory.limit_in_bytes"), limits.memory_bytes) {
                    Ok(()) => Hold::Enforced(format!("{HOW} memory.limit_in_bytes")),
                    Err(why) => Hold::Missing(why),
                },
            );
            let memsw = d.join("memory.memsw.limit_in_bytes");
            e.set(
                Limit::Swap,
                if !memsw.exists() {
                    if no_swap {
                        Hold::Enforced("the host has no swap".into())
                    } else {
                        Hold::Missing(
                            "no swap accounting (memory.memsw.* absent: the kernel needs \
                             swapaccount=1); memory.swappiness 0 keeps most pages out of swap"
                                .into(),
                        )
                    }
                } else {
                    match check(memsw, limits.memory_bytes) {
                        Ok(()) => Hold::Enforced(format!("{HOW} memory.memsw.limit_in_bytes")),
                        Err(why) => Hold::Missing(why),
                    }
                },
            );
        }
        None => {
            e.set(Limit::Memory, absent(Controller::Memory));
            e.set(Limit::Swap, absent(Controller::Memory));
        }
    }
    e.set(
        Limit::Processes,
        match dir(Controller::Pids) {
            Some(d) => match check(d.join("pids.max"), limits.pids) {
                Ok(()) => Hold::Enforced(format!("{HOW} pids.max")),
                Err(why) => Hold::Missing(why),
            },
            None => absent(Controller::Pids),
        },
    );
    e.set(
        Limit::Cpu,
        match dir(Controller::Cpu) {
            Some(d) => match check(d.join("cpu.cfs_period_us"), CPU_PERIOD_US)
                .and_then(|()| check(d.join("cpu.cfs_quota_us"), cpu_quota_us(limits)))
            {
                Ok(()) => Hold::Enforced(format!("{HOW} cpu.cfs_quota_us")),
                Err(why) => Hold::Missing(why),
            },
            None => absent(Controller::Cpu),
        },
    );
    e
}
