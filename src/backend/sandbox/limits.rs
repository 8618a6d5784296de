//! What one sandbox may use, and how much of that the host could enforce.
//!
//! A VM backend bounds its sessions with the guest's size: the guest kernel
//! kills a memory hog at the guest's memory and a fork bomb stays inside.
//! The sandbox runs on the host's kernel, so it gets the same bounds from a
//! cgroup of its own (module `cgroup`):
//!
//! | limit | value | why |
//! | --- | --- | --- |
//! | memory | `startVM.memoryGB`, sized like the VM backends ([`crate::backend::sizing`]); default [`DEFAULT_MEMORY_MIB`] | the memory the client asked for, as a VM would have it |
//! | swap | none | a VM's memory does not spill into the host's swap either |
//! | processes (tasks, threads included) | [`PIDS_MAX`] | see the constant |
//! | CPU | `startVM.cpuCount` CPUs' worth of time, sized like the VM backends' vCPUs | as many CPUs as a VM would get |
//!
//! Where no cgroup can be had, per-process resource limits stand in
//! ([`Rlimits`]: `RLIMIT_DATA` for memory, `RLIMIT_NPROC` for processes,
//! set inside the sandbox's user namespace so the process count is the
//! sandbox's own); nothing stands in for the CPU limit or swap. Each limit's
//! state ([`Hold`]) is logged at `startVM`, one line each, and `doctor` says
//! the same.
//!
//! The agent (the sandbox's PID 1) is the OOM killer's last choice inside
//! the sandbox: the processes it spawns raise their `oom_score_adj` to
//! [`SESSION_OOM_SCORE_ADJ`] (raising needs no privilege).
//!
//! Limits: the CPU limit is a share of time (a quota per period), not a set
//! of CPUs; `RLIMIT_DATA` bounds each process, not their sum;
//! `RLIMIT_NPROC` does not bind a helper running as root (the kernel exempts
//! uid 0).

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::backend::sizing;

/// Memory of a sandbox when `startVM` does not say: 4 GiB, the size of the
/// official helper's VM, which the client's sessions are made for. Unlike a
/// VM's memory it is a ceiling, not a reservation: a sandbox that does not
/// use it costs the host nothing.
pub const DEFAULT_MEMORY_MIB: u64 = 4096;

/// Tasks (processes and threads) a sandbox may have at once: 4096. An eighth
/// of the kernel's default `pid_max` (32768; the fork bomb that prompted this
/// limit had taken 32,515 of them), close to systemd's default per-unit
/// `TasksMax` (15 % of 32768 = 4915), and what a VM of 512 MiB gets from its
/// kernel (`threads-max` = memory / 128 KiB). Far above what sessions use:
/// the CLI runs about a dozen threads, a parallel build a few hundred tasks.
/// A fork bomb stopped here holds about 0.5 GiB (about 130 KiB per task,
/// measured), inside the memory limit.
pub const PIDS_MAX: u64 = 4096;

/// `oom_score_adj` of every process the sandbox's agent spawns: the OOM
/// killer then picks a session's process before the agent (which keeps 0),
/// whatever their sizes, as long as the agent is smaller than half the
/// sandbox's memory (the adjustment counts as 500/1000 of it).
pub const SESSION_OOM_SCORE_ADJ: i32 = 500;

/// Bytes in a MiB.
const MIB: u64 = 1024 * 1024;

/// What a sandbox may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Memory of all its processes together, in bytes.
    pub memory_bytes: u64,
    /// Tasks (processes and threads) at once.
    pub pids: u64,
    /// CPUs' worth of CPU time.
    pub cpus: u32,
}

impl Limits {
    /// The limits for `startVM`'s `memoryGB` and `cpuCount`, sized as the
    /// VM backends size their guests.
    pub fn for_request(memory_gb: Option<f64>, cpu_count: Option<u32>) -> Limits {
        Limits {
            memory_bytes: sizing::memory_mib(memory_gb, DEFAULT_MEMORY_MIB) * MIB,
            pids: PIDS_MAX,
            cpus: sizing::cpu_count(cpu_count, sizing::host_cpus()),
        }
    }

    /// The memory limit in MiB (rounded down).
    pub fn memory_mib(&self) -> u64 {
        self.memory_bytes / MIB
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits::for_request(None, None)
    }
}

/// Per-process resource limits standing in for a missing cgroup; the
/// sandbox's init sets them after entering its user namespace.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rlimits {
    /// `RLIMIT_NPROC`: processes of the sandbox's user in its user namespace.
    pub nproc: Option<u64>,
    /// `RLIMIT_DATA`: each process's data (heap and private writable
    /// mappings), in bytes. Chosen over `RLIMIT_AS`, which counts address
    /// space that runtimes (V8, JavaScriptCore) reserve without using and
    /// would make them fail at start.
    pub data: Option<u64>,
}

impl Rlimits {
    /// Whether any limit is set.
    pub fn any(&self) -> bool {
        self.nproc.is_some() || self.data.is_some()
    }
}

/// One of a sandbox's limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Limit {
    Memory,
    Swap,
    Processes,
    Cpu,
}

impl Limit {
    /// Every limit, in report order.
    pub const ALL: [Limit; 4] = [Limit::Memory, Limit::Swap, Limit::Processes, Limit::Cpu];

    pub fn name(self) -> &'static str {
        match self {
            Limit::Memory => "memory",
            Limit::Swap => "swap",
            Limit::Processes => "processes",
            Limit::Cpu => "cpu",
        }
    }
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How one limit is held.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Hold {
    /// Enforced as asked; the text says how.
    Enforced(String),
    /// Not as asked; a weaker stand-in (`how`) holds instead, for `why`.
    StandIn { how: String, why: String },
    /// Not enforced at all, for the reason given.
    Missing(String),
}

impl Hold {
    pub fn is_enforced(&self) -> bool {
        matches!(self, Hold::Enforced(_))
    }
}

/// What a sandbox got: one [`Hold`] per [`Limit`] (a limit nobody looked
/// at is missing).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Enforcement {
    holds: BTreeMap<Limit, Hold>,
}

impl Enforcement {
    pub fn set(&mut self, limit: Limit, hold: Hold) {
        self.holds.insert(limit, hold);
    }

    /// How `limit` is held.
    pub fn get(&self, limit: Limit) -> Hold {
        self.holds
            .get(&limit)
            .cloned()
            .unwrap_or_else(|| Hold::Missing("not set up".to_string()))
    }

    /// Every limit is enforced as asked.
    pub fn complete(&self) -> bool {
        Limit::ALL.iter().all(|&l| self.get(l).is_enforced())
    }

    /// The limits not enforced as asked, each with its line (stand-in or
    /// reason), in report order.
    pub fn shortfalls(&self) -> Vec<(Limit, String)> {
        Limit::ALL
            .iter()
            .filter_map(|&l| match self.get(l) {
                Hold::Enforced(_) => None,
                Hold::StandIn { how, why } => Some((l, format!("{why}; instead: {how}"))),
                Hold::Missing(why) => Some((l, format!("MISSING: {why}"))),
            })
            .collect()
    }

    /// One line: the values of the limits that hold and how.
    pub fn summary(&self, limits: &Limits) -> String {
        let value = |l: Limit| match l {
            Limit::Memory => format!("memory {} MiB", limits.memory_mib()),
            Limit::Swap => "swap off".to_string(),
            Limit::Processes => format!("{} processes", limits.pids),
            Limit::Cpu => format!(
                "{} CPU{}",
                limits.cpus,
                if limits.cpus == 1 { "" } else { "s" }
            ),
        };
        let mut parts = Vec::new();
        for l in Limit::ALL {
            match self.get(l) {
                Hold::Enforced(how) => parts.push(format!("{} ({how})", value(l))),
                Hold::StandIn { how, .. } => parts.push(format!("{} only as {how}", value(l))),
                Hold::Missing(_) => parts.push(format!("no {l} limit")),
            }
        }
        parts.join(", ")
    }

    /// Logs the summary (info) with `place` (the cgroup), then one warning
    /// per limit not enforced as asked.
    pub fn log(&self, limits: &Limits, place: &str) {
        tracing::info!(cgroup = %place, "sandbox limits: {}", self.summary(limits));
        for (limit, line) in self.shortfalls() {
            tracing::warn!("sandbox limit {limit}: {line}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_follow_the_vm_sizing() {
        let l = Limits::for_request(Some(0.5), Some(1));
        assert_eq!(l.memory_bytes, 512 * MIB);
        assert_eq!(l.memory_mib(), 512);
        assert_eq!(l.cpus, 1);
        assert_eq!(l.pids, PIDS_MAX);
        let d = Limits::for_request(None, None);
        assert_eq!(d.memory_bytes, DEFAULT_MEMORY_MIB * MIB);
        assert_eq!(
            d.cpus,
            sizing::cpu_count(None, sizing::host_cpus()),
            "the VM backends' vCPU rule"
        );
        // The VM backends' bounds apply.
        assert_eq!(
            Limits::for_request(Some(0.01), None).memory_mib(),
            sizing::MIN_MEMORY_MIB
        );
        assert_eq!(
            Limits::for_request(Some(f64::NAN), None).memory_mib(),
            DEFAULT_MEMORY_MIB
        );
        assert!(Limits::for_request(None, Some(10_000)).cpus <= sizing::host_cpus());
    }

    #[test]
    fn enforcement_reports_each_shortfall() {
        let limits = Limits {
            memory_bytes: 512 * MIB,
            pids: 4096,
            cpus: 1,
        };
        let mut e = Enforcement::default();
        assert!(!e.complete());
        e.set(Limit::Memory, Hold::Enforced("cgroup v1".into()));
        e.set(Limit::Swap, Hold::Enforced("cgroup v1".into()));
        e.set(Limit::Processes, Hold::Enforced("cgroup v1".into()));
        e.set(Limit::Cpu, Hold::Enforced("cgroup v1".into()));
        assert!(e.complete());
        assert!(e.shortfalls().is_empty());
        assert_eq!(
            e.summary(&limits),
            "memory 512 MiB (cgroup v1), swap off (cgroup v1), 4096 processes (cgroup v1), \
             1 CPU (cgroup v1)"
        );

        e.set(
            Limit::Memory,
            Hold::StandIn {
                how: "RLIMIT_DATA 512 MiB per process".into(),
                why: "no cgroup: permission denied".into(),
            },
        );
        e.set(
            Limit::Cpu,
            Hold::Missing("no cgroup: permission denied".into()),
        );
        assert!(!e.complete());
        let short = e.shortfalls();
        assert_eq!(short.len(), 2);
        assert_eq!(short[0].0, Limit::Memory);
        assert_eq!(
            short[0].1,
            "no cgroup: permission denied; instead: RLIMIT_DATA 512 MiB per process"
        );
        assert_eq!(
            short[1],
            (Limit::Cpu, "MISSING: no cgroup: permission denied".into())
        );
        let summary = e.summary(&limits);
        assert!(
            summary.contains("memory 512 MiB only as RLIMIT_DATA"),
            "{summary}"
        );
        assert!(summary.ends_with("no cpu limit"), "{summary}");
    }

    #[test]
    fn rlimits_say_when_set() {
        assert!(!Rlimits::default().any());
        assert!(Rlimits {
            nproc: Some(1),
            data: None
        }
        .any());
    }
}
