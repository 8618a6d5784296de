//! Boot benchmark helpers (used by `cargo bench -p vmm` and the daemon's
//! `bench` subcommand).
//!
//! - [`in_process`]: builds and runs a VM `n` times in this process and
//!   reports the median build time (config → vCPUs ready), time to the
//!   first `KVM_RUN`, and time to the guest's exit, plus this process's
//!   peak RSS growth.
//! - [`process_start_to_exit`]: spawns a command (e.g. `cowork-helper vm run
//!   --kernel tiny.elf`) `n` times and reports the median wall time from
//!   spawn to exit and the child's peak RSS (`wait4` rusage).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::exit::ExitReason;
use crate::machine::{Config, Vm, VmError};
use crate::memory::Backing;

/// Errors of the benchmark.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// Building or running the VM failed.
    #[error(transparent)]
    Vm(#[from] VmError),
    /// The guest did not reset/power off.
    #[error("benchmark guest ended with {0:?}; it must reset or power off")]
    UnexpectedExit(ExitReason),
    /// Spawning or waiting for the child failed.
    #[error("benchmark child process: {0}")]
    Process(#[source] std::io::Error),
    /// The child failed.
    #[error("benchmark child exited with status {0}")]
    ChildFailed(i32),
    /// Zero iterations.
    #[error("need at least one iteration")]
    NoIterations,
}

/// Median of a non-empty slice of durations.
pub fn median(v: &[Duration]) -> Duration {
    let mut s = v.to_vec();
    s.sort();
    s[s.len() / 2]
}

/// Result of [`in_process`].
#[derive(Debug, Clone)]
pub struct InProcessReport {
    /// Iterations run.
    pub iterations: usize,
    /// Median `Vm::build` time.
    pub build: Duration,
    /// Median time from build start to the first KVM_RUN.
    pub first_run: Duration,
    /// Median time from build start to the guest's exit.
    pub exit: Duration,
    /// Median teardown (join, close; mostly the kernel destroying the VM).
    pub teardown: Duration,
    /// Peak RSS of this process minus its RSS before the first VM, in KiB
    /// (includes the guest pages the guest touched).
    pub rss_growth_kib: u64,
    /// Each run's boot timeline as `vm run` prints it (formatted after the
    /// run, outside the measured spans; the bench prints them with
    /// `VMM_BENCH_VERBOSE`).
    pub timelines: Vec<String>,
}

/// Reads a `kB` field of /proc/self/status.
pub fn proc_status_kib(field: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// Boots `kernel` (a guest that resets or powers off by itself) with
/// `cmdline` `n` times, guest memory backed as by default
/// ([`Backing::Anonymous`], huge pages advised).
pub fn in_process(
    kernel: &Path,
    cmdline: &str,
    mem_mib: u64,
    vcpus: u8,
    n: usize,
) -> Result<InProcessReport, BenchError> {
    in_process_backed(kernel, cmdline, mem_mib, vcpus, Backing::Anonymous, n)
}

/// [`in_process`] with guest memory backed as `backing`.
pub fn in_process_backed(
    kernel: &Path,
    cmdline: &str,
    mem_mib: u64,
    vcpus: u8,
    backing: Backing,
    n: usize,
) -> Result<InProcessReport, BenchError> {
    if n == 0 {
        return Err(BenchError::NoIterations);
    }
    let rss_before = proc_status_kib("VmRSS").unwrap_or(0);
    let (mut builds, mut firsts, mut exits, mut teardowns) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut timelines = Vec::with_capacity(n);
    for _ in 0..n {
        let mut c = Config::new(kernel);
        c.mem_mib = mem_mib;
        c.vcpus = vcpus;
        c.cmdline = cmdline.to_string();
        c.memory_backing = backing;
        let mut vm = Vm::build(c)?;
        let reason = vm.run()?;
        if !matches!(reason, ExitReason::Reset | ExitReason::Shutdown) {
            return Err(BenchError::UnexpectedExit(reason));
        }
        let t = vm.timeline();
        tracing::debug!(?t, "bench iteration");
        timelines.push(crate::cli::format_timeline(t, Some(&reason)));
        builds.push(t.build);
        firsts.push(t.first_run.unwrap_or_default());
        exits.push(t.exit.unwrap_or_default());
        teardowns.push(t.teardown.unwrap_or_default());
    }
    let hwm = proc_status_kib("VmHWM").unwrap_or(0);
    Ok(InProcessReport {
        iterations: n,
        build: median(&builds),
        first_run: median(&firsts),
        exit: median(&exits),
        teardown: median(&teardowns),
        rss_growth_kib: hwm.saturating_sub(rss_before),
        timelines,
    })
}

/// Result of [`process_start_to_exit`].
#[derive(Debug, Clone)]
pub struct ProcessReport {
    /// Iterations run.
    pub iterations: usize,
    /// Median spawn → exit wall time.
    pub median: Duration,
    /// Fastest run.
    pub min: Duration,
    /// Slowest run.
    pub max: Duration,
    /// Largest peak RSS of a child, KiB.
    pub max_rss_kib: u64,
}

/// Spawns `make()` `n` times, waiting for each; every child must exit 0.
pub fn process_start_to_exit(
    make: impl Fn() -> Command,
    n: usize,
) -> Result<ProcessReport, BenchError> {
    if n == 0 {
        return Err(BenchError::NoIterations);
    }
    let mut times = Vec::with_capacity(n);
    let mut max_rss = 0u64;
    for _ in 0..n {
        let start = Instant::now();
        let child = make().spawn().map_err(BenchError::Process)?;
        let pid = child.id() as libc::pid_t;
        let mut status = 0;
        // SAFETY: zeroed rusage is a valid out-parameter for wait4.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: waits for our own child; pointers are valid for the call.
        let rc = unsafe { libc::wait4(pid, &mut status, 0, &mut ru) };
        let elapsed = start.elapsed();
        if rc < 0 {
            return Err(BenchError::Process(std::io::Error::last_os_error()));
        }
        // The child is reaped; dropping `child` does not wait again.
        drop(child);
        if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
            return Err(BenchError::ChildFailed(if libc::WIFEXITED(status) {
                libc::WEXITSTATUS(status)
            } else {
                -1
            }));
        }
        times.push(elapsed);
        max_rss = max_rss.max(ru.ru_maxrss as u64);
    }
    Ok(ProcessReport {
        iterations: n,
        median: median(&times),
        min: times.iter().copied().min().unwrap_or_default(),
        max: times.iter().copied().max().unwrap_or_default(),
        max_rss_kib: max_rss,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_process_timing() {
        let d = |ms| Duration::from_millis(ms);
        assert_eq!(median(&[d(3), d(1), d(2)]), d(2));
        let r = process_start_to_exit(|| Command::new("true"), 3).unwrap();
        assert_eq!(r.iterations, 3);
        assert!(r.min <= r.median && r.median <= r.max);
        assert!(r.max_rss_kib > 0);
        assert!(matches!(
            process_start_to_exit(|| Command::new("false"), 1),
            Err(BenchError::ChildFailed(1))
        ));
        assert!(proc_status_kib("VmRSS").unwrap() > 0);
    }
}
