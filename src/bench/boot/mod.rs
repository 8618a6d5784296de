//! `cowork-helper bench boot`: boots the guest image (kernel, initramfs and,
//! by default, the Debian userland disk) N times through the real `startVM`
//! path and reports where the time goes, per phase, as medians and 90th
//! percentiles (a table, or JSON with `--json`), optionally as a stacked
//! SVG timeline (`--chart`).
//!
//! Each boot starts a fresh helper (this executable, or `--helper PATH`) on
//! a temporary socket under `$TMPDIR` with `--backend kvm|qemu` and a data
//! directory kept across the backend's boots (so its session disk is
//! formatted once, by an unmeasured warm-up boot, as on a user's second
//! and later starts; `--warmup 0` measures first boots too), drives it
//! through [`crate::client`] as the desktop client does (configure,
//! subscribeEvents, startVM, one spawn of `/bin/true`, stopVM), then reads
//! the helper's log ([`log`]) for the VMM's and the agent's own timings and
//! derives the phases ([`phases`]). With `--backend both` the two backends
//! alternate run by run, and the report gives kvm/qemu ratios ([`report`]).
//! Progress goes to stderr, one line per boot.
//!
//! Limits: one boot at a time (the numbers are for an otherwise idle
//! machine; other load shows up in them); the guest image must exist
//! (`scripts/mkguestimage.sh`); the kvm backend needs a KVM that runs
//! Linux (here: inside the nested harness, see docs/testing.md). A run that
//! fails is reported with the end of its helper log and counted, and makes
//! the exit status 1; the other runs are still reported.

pub mod chart;
pub mod log;
pub mod phases;
pub mod report;

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use super::{launch_helper, HelperSpec};
use crate::client::{Pipe, Subscription};
use phases::{Backend, Phase, RunRecord};
use report::{BackendRuns, Report};

/// Default `COWORK_LOG` of the helper under test: info has every line
/// [`log`] reads (the guest console, at debug, is left out; `--helper-log
/// debug --keep-logs` keeps it for a closer look).
pub const HELPER_LOG_FILTER: &str = "info";
/// Helper log lines a failed boot's error quotes (the helper stopped, so
/// they reach past its shutdown to how the VM ended).
const FAILED_BOOT_LOG_LINES: usize = 40;
/// Profile the benchmark configures.
const PROFILE: &str = "bench-boot";
/// Session name of the first spawn.
const SESSION: &str = "bench";
/// What the first spawn runs: the cheapest program of every userland.
const FIRST_SPAWN: &str = "/bin/true";
/// How long the helper may take to bind its socket (a debug build inside
/// the nested harness runs at TCG speed).
const BIND_LIMIT: Duration = Duration::from_secs(60);

/// Which backends to boot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backends {
    /// kvm where this host's KVM runs Linux, else qemu.
    Auto,
    Kvm,
    Qemu,
    /// Both, alternating run by run.
    Both,
}

impl Backends {
    /// The backends in the order each round boots them.
    pub fn list(self) -> Vec<Backend> {
        match self {
            Backends::Auto => {
                if crate::backend::guest::kvm_for_linux().is_ok() {
                    vec![Backend::Kvm]
                } else {
                    vec![Backend::Qemu]
                }
            }
            Backends::Kvm => vec![Backend::Kvm],
            Backends::Qemu => vec![Backend::Qemu],
            Backends::Both => vec![Backend::Kvm, Backend::Qemu],
        }
    }
}

/// Options of `bench boot` (parsed by `crate::cli`).
#[derive(Clone, Debug)]
pub struct Options {
    pub backends: Backends,
    /// Boots per backend.
    pub runs: usize,
    /// Print JSON on stdout instead of the table.
    pub json: bool,
    /// Write the stacked timeline here (SVG).
    pub chart: Option<PathBuf>,
    /// The helper to start (default: this executable).
    pub helper: Option<PathBuf>,
    /// Keep each helper's directory and log.
    pub keep_logs: bool,
    /// `startVM.memoryGB`, the same for both backends (their defaults differ).
    pub memory_gb: f64,
    /// `startVM.cpuCount` (default: the backends' common default).
    pub cpus: Option<u32>,
    /// The helper's `--userland` (`default`: the Debian userland disk).
    pub userland: String,
    /// Limit of each request (startVM, spawn, stopVM).
    pub timeout: Duration,
    /// Unmeasured boots per backend before the measured ones.
    pub warmup: usize,
    /// `COWORK_LOG` of the helpers (at least info, see [`HELPER_LOG_FILTER`]).
    pub helper_log: String,
    /// Boot nothing: report (table, JSON, chart) a document an earlier
    /// `--json` run wrote.
    pub replay: Option<PathBuf>,
}

/// Errors of one boot.
#[derive(Debug, thiserror::Error)]
pub enum BootBenchError {
    #[error("cannot start the helper: {0}")]
    Helper(String),
    #[error("{what}: {source}")]
    Client {
        what: &'static str,
        source: crate::client::ClientError,
    },
    #[error("startVM returned but isGuestConnected says {0}")]
    NotConnected(Value),
    #[error("the first spawn ended with {0}")]
    Spawn(Value),
    #[error("cannot create {path}: {source}")]
    Dir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read the helper log {path}: {source}")]
    Log {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot start the runtime: {0}")]
    Runtime(std::io::Error),
    #[error(transparent)]
    Chart(#[from] chart::ChartError),
}

fn client_err(what: &'static str) -> impl Fn(crate::client::ClientError) -> BootBenchError {
    move |source| BootBenchError::Client { what, source }
}

/// Wall-clock microseconds since the Unix epoch (the helper's log uses the
/// same clock).
fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Entry point of `bench boot`; returns the process exit code.
pub fn main(opts: Options) -> i32 {
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("bench boot: {}", BootBenchError::Runtime(e));
            return 1;
        }
    };
    let report = match &opts.replay {
        Some(path) => {
            let read = std::fs::read_to_string(path)
                .map_err(|e| e.to_string())
                .and_then(|t| serde_json::from_str::<Value>(&t).map_err(|e| e.to_string()))
                .and_then(|v| Report::from_json(&v));
            match read {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("bench boot: cannot replay {}: {e}", path.display());
                    return 2;
                }
            }
        }
        None => rt.block_on(run_all(&opts)),
    };
    if opts.json {
        match serde_json::to_string_pretty(&report.to_json()) {
            Ok(text) => println!("{text}"),
            Err(e) => {
                eprintln!("bench boot: cannot encode the report: {e}");
                return 1;
            }
        }
    } else {
        print!("{}", report.table());
    }
    let mut code = 0;
    if let Some(path) = &opts.chart {
        match chart::write_svg(&report, path) {
            Ok(()) => eprintln!("bench boot: chart written to {}", path.display()),
            Err(e) => {
                eprintln!("bench boot: {e}");
                code = 1;
            }
        }
    }
    if report.backends.iter().any(|b| !b.failures.is_empty()) {
        code = 1;
    }
    code
}

/// Data directories kept across one backend's boots; removed on drop
/// unless the logs are kept.
struct DataDirs {
    dirs: Vec<(Backend, PathBuf)>,
    keep: bool,
}

impl DataDirs {
    fn new(list: &[Backend], keep: bool) -> DataDirs {
        let dirs = list
            .iter()
            .map(|b| {
                let d = std::env::temp_dir().join(format!(
                    "cowork-bench-{}-data-{}",
                    std::process::id(),
                    b.as_str()
                ));
                (*b, d)
            })
            .collect();
        DataDirs { dirs, keep }
    }

    fn of(&self, b: Backend) -> Option<&std::path::Path> {
        self.dirs
            .iter()
            .find(|(x, _)| *x == b)
            .map(|(_, d)| d.as_path())
    }
}

impl Drop for DataDirs {
    fn drop(&mut self) {
        for (_, d) in &self.dirs {
            if self.keep {
                eprintln!("bench boot: data directory kept at {}", d.display());
            } else {
                let _ = std::fs::remove_dir_all(d);
            }
        }
    }
}

/// Boots every backend `opts.runs` times, alternating, after the warm-up.
async fn run_all(opts: &Options) -> Report {
    let list = opts.backends.list();
    let data = DataDirs::new(&list, opts.keep_logs);
    let mut backends: Vec<BackendRuns> = list
        .iter()
        .map(|&backend| BackendRuns {
            backend,
            accel: None,
            runs: Vec::new(),
            failures: Vec::new(),
        })
        .collect();
    for i in 0..opts.warmup {
        for &b in &list {
            let name = b.as_str();
            match one_boot(opts, b, &format!("warmup{}", i + 1), data.of(b)).await {
                Ok(rec) => eprintln!(
                    "bench boot: {name} warm-up {}/{}: startVM → connected {:.1} ms (not counted)",
                    i + 1,
                    opts.warmup,
                    rec.start_vm_ms
                ),
                Err(e) => eprintln!(
                    "bench boot: {name} warm-up {}/{} failed (not counted): {e}",
                    i + 1,
                    opts.warmup
                ),
            }
        }
    }
    for i in 0..opts.runs {
        for b in backends.iter_mut() {
            let name = b.backend.as_str();
            match one_boot(opts, b.backend, &(i + 1).to_string(), data.of(b.backend)).await {
                Ok(rec) => {
                    let accel = match b.backend {
                        Backend::Kvm => Some("kvm".to_string()),
                        Backend::Qemu => rec.events.qemu_started.as_ref().map(|q| q.1.clone()),
                    };
                    if accel.is_some() {
                        b.accel = accel;
                    }
                    let p = phases::phases(&rec);
                    let show = |ph: Phase| {
                        p.get(ph)
                            .map_or_else(|| "absent".to_string(), |v| format!("{v:.1} ms"))
                    };
                    eprintln!(
                        "bench boot: {name} {}/{}: startVM → connected {}, guest side {}, first spawn → exit {}",
                        i + 1,
                        opts.runs,
                        show(Phase::StartVmToConnected),
                        show(Phase::KernelToHello),
                        show(Phase::FirstSpawnToExit),
                    );
                    b.runs.push(p);
                }
                Err(e) => {
                    eprintln!("bench boot: {name} {}/{} failed: {e}", i + 1, opts.runs);
                    let first = e.lines().next().unwrap_or_default().to_string();
                    b.failures.push(format!("run {}: {first}", i + 1));
                }
            }
        }
    }
    Report {
        runs_requested: opts.runs,
        warmup: opts.warmup,
        userland: opts.userland.clone(),
        memory_gb: opts.memory_gb,
        cpus: opts.cpus.unwrap_or_else(|| {
            crate::backend::sizing::cpu_count(None, crate::backend::sizing::host_cpus())
        }),
        host_kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_string())
            .unwrap_or_default(),
        backends,
    }
}

/// One boot in a fresh helper; the error text ends with the helper's log
/// tail.
async fn one_boot(
    opts: &Options,
    backend: Backend,
    run: &str,
    data_dir: Option<&std::path::Path>,
) -> Result<RunRecord, String> {
    let tag = format!("-{}-{run}", backend.as_str());
    let args = [
        "--backend",
        backend.as_str(),
        "--userland",
        opts.userland.as_str(),
    ];
    let mut helper = launch_helper(&HelperSpec {
        exe: opts.helper.as_deref(),
        args: &args,
        log_filter: &opts.helper_log,
        keep: opts.keep_logs,
        tag: &tag,
        bind_limit: BIND_LIMIT,
        data_dir,
    })
    .map_err(|e| BootBenchError::Helper(e).to_string())?;
    // The profile (and with it the session disk) must be the same across
    // the backend's boots: its root lives with the kept data directory.
    let profile_root =
        data_dir.map_or_else(|| helper.dir.join("profile"), |d| d.join("profile-root"));
    let measured = drive(opts, &helper.socket, &helper.dir, &profile_root).await;
    let log = std::fs::read_to_string(&helper.log).map_err(|source| BootBenchError::Log {
        path: helper.log.clone(),
        source,
    });
    match (measured, log) {
        (Ok((start_vm_sent_at, start_vm_ms, spawn_exit_ms)), Ok(text)) => Ok(RunRecord {
            backend,
            start_vm_sent_at,
            start_vm_ms,
            spawn_exit_ms: Some(spawn_exit_ms),
            events: log::HelperLog(&text).parse(),
        }),
        (Err(e), _) => {
            // Stopped first, so the tail has how its VM ended (a guest that
            // died under the spawn shows only as a closed link until then).
            helper.stop();
            Err(format!(
                "{e}\nhelper log tail (after stopping it):\n{}",
                helper.log_tail_lines(FAILED_BOOT_LOG_LINES)
            ))
        }
        (_, Err(e)) => Err(e.to_string()),
    }
}

/// Drives one helper: startVM, the first spawn, stopVM. Returns the wall
/// time startVM was sent (µs), startVM's duration and spawn → exit (ms).
async fn drive(
    opts: &Options,
    socket: &std::path::Path,
    dir: &std::path::Path,
    profile_root: &std::path::Path,
) -> Result<(i64, f64, f64), BootBenchError> {
    let root_s = profile_root.to_string_lossy().into_owned();
    let pipe = Pipe::connect_with_timeout(socket, opts.timeout)
        .await
        .map_err(client_err("connect"))?;
    pipe.call(
        "configure",
        json!({"userDataName": PROFILE, "userDataRoot": root_s, "sessionOnly": true}),
    )
    .await
    .map_err(client_err("configure"))?;
    let mut sub = Subscription::connect(socket, PROFILE, &root_s)
        .await
        .map_err(client_err("subscribeEvents"))?;
    let bundle = dir.join("bundle");
    std::fs::create_dir_all(&bundle).map_err(|source| BootBenchError::Dir {
        path: bundle.clone(),
        source,
    })?;
    let mut params = json!({"bundlePath": bundle.to_string_lossy(), "memoryGB": opts.memory_gb});
    if let Some(c) = opts.cpus {
        params["cpuCount"] = json!(c);
    }
    let sent_at = now_us();
    let t = Instant::now();
    pipe.call("startVM", params)
        .await
        .map_err(client_err("startVM"))?;
    let start_vm_ms = ms(t.elapsed());
    let r = pipe
        .call("isGuestConnected", Value::Null)
        .await
        .map_err(client_err("isGuestConnected"))?;
    if r.get("connected") != Some(&Value::Bool(true)) {
        return Err(BootBenchError::NotConnected(r));
    }
    let id = "bench-boot-first-spawn";
    let t = Instant::now();
    pipe.call(
        "spawn",
        json!({"id": id, "name": SESSION, "command": FIRST_SPAWN, "args": [], "isResume": false}),
    )
    .await
    .map_err(client_err("spawn"))?;
    let exit = sub
        .next_matching(opts.timeout, |ev| {
            ev.get("type").and_then(Value::as_str) == Some("exit")
                && ev.get("id").and_then(Value::as_str) == Some(id)
        })
        .await
        .map_err(client_err("waiting for the first spawn's exit"))?;
    let spawn_ms = ms(t.elapsed());
    if exit.get("exitCode").and_then(Value::as_i64) != Some(0) {
        return Err(BootBenchError::Spawn(exit));
    }
    pipe.call("stopVM", Value::Null)
        .await
        .map_err(client_err("stopVM"))?;
    Ok((sent_at, start_vm_ms, spawn_ms))
}
