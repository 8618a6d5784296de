//! `cowork-helper bench boot`: boots the guest image (kernel, initramfs and,
//! by default, the Debian userland disk) N times through the real `startVM`
//! path and reports where the time goes, per phase, as medians and 90th
//! percentiles (a table, or JSON with `--json`), optionally as a stacked
//! SVG timeline (`--chart`).
//!
//! Each boot starts a fresh helper (this executable, or `--helper PATH`) on
//! a temporary socket under `$TMPDIR` with `--backend kvm|qemu` and a data
//! directory kept across the boots of one series (so its session disk is
//! formatted once, by an unmeasured warm-up boot, as on a user's second
//! and later starts; `--warmup 0` measures first boots too), drives it
//! through [`crate::client`] as the desktop client does (configure,
//! subscribeEvents, startVM, one spawn of `/bin/true`, stopVM), then reads
//! the helper's log ([`log`]) for the VMM's and the agent's own timings and
//! derives the phases ([`phases`]).
//!
//! A series is one backend and one start kind (`--start cold|warm|both`,
//! default `cold`), the same for both backends: a cold series runs its
//! helpers with `--snapshot off`, so every VM boots its kernel (qemu: with
//! every device on its command line); a warm series runs them with
//! `--snapshot auto` and a snapshot directory of its own, shared by its
//! boots, and its first warm-up boot (always there, even with `--warmup
//! 0`) boots cold and takes the boot snapshot that every later boot of the
//! series restores (qemu: QEMU's device state and the RAM's data, the
//! vsock, virtio-fs and rng devices hot-plugged after the restore). Every
//! run's log must say it started as asked (`kvm vm started` or `qemu
//! started` with `start="cold"|"warm"`; a qemu restore that failed logs a
//! second, cold, `qemu started` line, and the last one counts); one that
//! did not is a failed run. Each round runs every series once, in the
//! order kvm cold, kvm warm, qemu cold, qemu warm; the report gives
//! kvm/qemu ratios of the cold series and warm/cold ratios per backend
//! ([`report`]). Progress goes to stderr, one line per boot.
//!
//! Limits: one boot at a time (the numbers are for an otherwise idle
//! machine; other load shows up in them); the guest image must exist
//! (`scripts/mkguestimage.sh`); the kvm backend needs a KVM that runs
//! Linux (here: inside the nested harness, see docs/testing.md). A warm
//! series' snapshot (guest memory with data, written under `$TMPDIR`) is
//! removed with its data directory. A run that fails is reported with the
//! end of its helper log and counted, and makes the exit status 1; the
//! other runs are still reported. A warm series whose first warm-up boot
//! took no snapshot runs nothing more: each of its runs is counted as
//! failed, with the reason (the qemu backend syncs its snapshot's files
//! while the machine runs on and logs it taken after: that boot's log is
//! read again for up to [`SNAPSHOT_LINE_WAIT`] for the line). The qemu
//! backend takes snapshots only with an image whose agent has
//! `template-console` (`scripts/mkguestimage.sh`). Resident memory once
//! connected is the helper's for kvm (the VMM and its guest memory are
//! in-process) and the QEMU process's for qemu.

pub mod chart;
pub mod log;
pub mod phases;
pub mod report;

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use super::{launch_helper, HelperSpec};
use crate::client::{Pipe, Subscription};
use phases::{Backend, Phase, RunRecord, StartKind};
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
/// How long a snapshot-taking boot's log is read again for the snapshot's
/// line (or why there is none) once its run ended without one.
pub const SNAPSHOT_LINE_WAIT: Duration = Duration::from_secs(30);
/// Pause between those reads.
const SNAPSHOT_LINE_POLL: Duration = Duration::from_millis(100);

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

/// Which start kinds to measure.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Starts {
    /// Every VM boots its kernel (the helpers' snapshots off).
    #[default]
    Cold,
    /// Every measured VM restores the boot snapshot the series' first
    /// warm-up boot took.
    Warm,
    /// A cold and a warm series per backend.
    Both,
}

impl Starts {
    /// The start kinds, cold first.
    pub fn list(self) -> Vec<StartKind> {
        match self {
            Starts::Cold => vec![StartKind::Cold],
            Starts::Warm => vec![StartKind::Warm],
            Starts::Both => vec![StartKind::Cold, StartKind::Warm],
        }
    }
}

/// The series to run, in round order: backend by backend, cold first.
pub fn plan(backends: &[Backend], starts: Starts) -> Vec<(Backend, StartKind)> {
    backends
        .iter()
        .flat_map(|&b| starts.list().into_iter().map(move |kind| (b, kind)))
        .collect()
}

/// Options of `bench boot` (parsed by `crate::cli`).
#[derive(Clone, Debug)]
pub struct Options {
    pub backends: Backends,
    /// Which start kinds to measure.
    pub start: Starts,
    /// Measured boots per series.
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
    /// Unmeasured boots per series before the measured ones (a warm series
    /// has at least one: it takes the snapshot).
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
    #[error("asked for a warm start, but the helper booted cold: {0}")]
    NotWarm(String),
    #[error("asked for a cold boot, but the helper restored a boot snapshot (its log says start=\"warm\"; was --snapshot off ignored?)")]
    NotCold,
    #[error("cannot tell whether the VM started cold or warm: the helper logged no `{0}` line with a start field (a helper built before warm start?)")]
    StartUnknown(&'static str),
    #[error("the first warm-up boot took no boot snapshot: {0}")]
    NoSnapshot(String),
}

/// Checks that the helper started the VM as asked, by the `start` field
/// of its last `kvm vm started` or `qemu started` line.
pub fn check_start(
    backend: Backend,
    asked: StartKind,
    ev: &log::BootEvents,
) -> Result<(), BootBenchError> {
    match (asked, ev.start.as_deref()) {
        (StartKind::Cold, Some(log::START_COLD)) | (StartKind::Warm, Some(log::START_WARM)) => {
            Ok(())
        }
        (StartKind::Cold, Some(log::START_WARM)) => Err(BootBenchError::NotCold),
        (StartKind::Warm, Some(log::START_COLD)) => {
            Err(BootBenchError::NotWarm(match &ev.restore_failed {
                Some(e) => format!("its boot snapshot could not be restored ({e})"),
                None => "there was no boot snapshot of this machine shape".to_string(),
            }))
        }
        // A qemu helper from before its warm start always booted cold.
        (StartKind::Cold, None) if backend == Backend::Qemu => Ok(()),
        _ => Err(BootBenchError::StartUnknown(match backend {
            Backend::Kvm => log::MSG_KVM_STARTED,
            Backend::Qemu => log::MSG_QEMU_STARTED,
        })),
    }
}

/// Why a boot that was to take the boot snapshot took none (its log's
/// reason, when it gave one).
fn no_snapshot_reason(ev: &log::BootEvents) -> String {
    ev.no_snapshot.clone().unwrap_or_else(|| {
        format!(
            "the helper logged no \"{}\" line, nor why",
            log::MSG_SNAPSHOT_TAKEN
        )
    })
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
                .and_then(|v| Report::from_json(&v).map_err(|e| e.to_string()));
            match read {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("bench boot: cannot replay {}: {e}", path.display());
                    return 2;
                }
            }
        }
        None => rt.block_on(run_all(&opts, plan(&opts.backends.list(), opts.start))),
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

/// Data directories kept across one series' boots (a warm series' boot
/// snapshots live in its own); removed on drop unless the logs are kept.
struct DataDirs {
    dirs: Vec<((Backend, StartKind), PathBuf)>,
    keep: bool,
}

impl DataDirs {
    fn new(series: &[(Backend, StartKind)], keep: bool) -> DataDirs {
        let dirs = series
            .iter()
            .map(|&(b, kind)| {
                let d = std::env::temp_dir().join(format!(
                    "cowork-bench-{}-data-{}-{}",
                    std::process::id(),
                    b.as_str(),
                    kind.as_str()
                ));
                ((b, kind), d)
            })
            .collect();
        DataDirs { dirs, keep }
    }

    fn of(&self, series: (Backend, StartKind)) -> Option<&std::path::Path> {
        self.dirs
            .iter()
            .find(|(x, _)| *x == series)
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

/// The snapshot directory of a warm series, in its data directory.
const SNAPSHOT_SUBDIR: &str = "snapshots";

/// One helper run of a series: what it expects of the start and where.
struct Boot<'a> {
    backend: Backend,
    /// The series' start kind (sets the helper's `--snapshot`).
    series: StartKind,
    /// How this boot must start (a warm series' first warm-up boots cold).
    expect: StartKind,
    /// `warmup1`, `3`: names the helper's directory.
    run: String,
    data_dir: Option<&'a std::path::Path>,
}

/// What one progress line says of a run's phases.
fn progress(p: &phases::Phases, kind: StartKind) -> String {
    let show = |ph: Phase| {
        p.get(ph)
            .map_or_else(|| "absent".to_string(), |v| format!("{v:.1} ms"))
    };
    match kind {
        StartKind::Cold => format!(
            "startVM → connected {}, guest side {}, first spawn → exit {}",
            show(Phase::StartVmToConnected),
            show(Phase::KernelToHello),
            show(Phase::FirstSpawnToExit),
        ),
        StartKind::Warm => format!(
            "startVM → connected {}, restore {}, VM runs → final hello {}, first spawn → exit {}",
            show(Phase::StartVmToConnected),
            show(Phase::RestoreTotal),
            show(Phase::VmmReadyToHelloRead),
            show(Phase::FirstSpawnToExit),
        ),
    }
}

/// Boots every series `opts.runs` times, round by round, after the
/// warm-up.
async fn run_all(opts: &Options, series: Vec<(Backend, StartKind)>) -> Report {
    let data = DataDirs::new(&series, opts.keep_logs);
    let mut backends: Vec<BackendRuns> = series
        .iter()
        .map(|&(b, kind)| BackendRuns::new(b, kind))
        .collect();
    // Warm series whose snapshot boot failed: why.
    let mut broken: Vec<Option<String>> = vec![None; backends.len()];
    let warmups = |kind: StartKind| match kind {
        StartKind::Cold => opts.warmup,
        StartKind::Warm => opts.warmup.max(1),
    };
    let rounds = series.iter().map(|s| warmups(s.1)).max().unwrap_or(0);
    for i in 0..rounds {
        for (k, b) in backends.iter_mut().enumerate() {
            let count = warmups(b.start);
            if i >= count || broken[k].is_some() {
                continue;
            }
            let takes_snapshot = b.start == StartKind::Warm && i == 0;
            let boot = Boot {
                backend: b.backend,
                series: b.start,
                expect: if takes_snapshot {
                    StartKind::Cold
                } else {
                    b.start
                },
                run: format!("warmup{}", i + 1),
                data_dir: data.of((b.backend, b.start)),
            };
            let name = b.name();
            let what = if takes_snapshot {
                " (takes the boot snapshot)"
            } else {
                ""
            };
            match one_boot(opts, &boot).await {
                Ok(rec) => {
                    eprintln!(
                        "bench boot: {name} warm-up {}/{count}{what}: startVM → connected {:.1} ms (not counted)",
                        i + 1,
                        rec.start_vm_ms
                    );
                    if takes_snapshot {
                        match rec.events.snapshot_taken {
                            Some(s) => b.snapshot = Some(s),
                            None => {
                                let e = BootBenchError::NoSnapshot(no_snapshot_reason(&rec.events));
                                eprintln!("bench boot: {name}: {e}");
                                broken[k] = Some(e.to_string());
                            }
                        }
                    }
                }
                Err(e) => {
                    eprintln!(
                        "bench boot: {name} warm-up {}/{count}{what} failed (not counted): {e}",
                        i + 1
                    );
                    if takes_snapshot {
                        let first = e.lines().next().unwrap_or_default();
                        broken[k] = Some(
                            BootBenchError::NoSnapshot(format!("the boot failed: {first}"))
                                .to_string(),
                        );
                    }
                }
            }
        }
    }
    for (k, why) in broken.iter().enumerate() {
        if let Some(why) = why {
            for i in 0..opts.runs {
                backends[k]
                    .failures
                    .push(format!("run {}: not run: {why}", i + 1));
            }
        }
    }
    for i in 0..opts.runs {
        for (k, b) in backends.iter_mut().enumerate() {
            if broken[k].is_some() {
                continue;
            }
            let name = b.name();
            let boot = Boot {
                backend: b.backend,
                series: b.start,
                expect: b.start,
                run: (i + 1).to_string(),
                data_dir: data.of((b.backend, b.start)),
            };
            match one_boot(opts, &boot).await {
                Ok(rec) => {
                    let accel = match b.backend {
                        Backend::Kvm => Some("kvm".to_string()),
                        Backend::Qemu => rec.events.qemu_started.as_ref().map(|q| q.accel.clone()),
                    };
                    if accel.is_some() {
                        b.accel = accel;
                    }
                    let p = phases::phases(&rec);
                    eprintln!(
                        "bench boot: {name} {}/{}: {}",
                        i + 1,
                        opts.runs,
                        progress(&p, b.start)
                    );
                    b.runs.push(p);
                    b.rss.extend(rec.rss);
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
        notes: Vec::new(),
        backends,
    }
}

/// One boot in a fresh helper, checked to have started as `boot.expect`
/// says; the error text ends with the helper's log tail.
async fn one_boot(opts: &Options, boot: &Boot<'_>) -> Result<RunRecord, String> {
    let backend = boot.backend;
    let tag = format!(
        "-{}-{}-{}",
        backend.as_str(),
        boot.series.as_str(),
        boot.run
    );
    let snapshot_dir = boot.data_dir.map(|d| d.join(SNAPSHOT_SUBDIR));
    let snapshot_dir = snapshot_dir
        .as_deref()
        .map(|d| d.to_string_lossy().into_owned());
    let mut args = vec![
        "--backend",
        backend.as_str(),
        "--userland",
        opts.userland.as_str(),
    ];
    match (boot.series, snapshot_dir.as_deref()) {
        (StartKind::Warm, Some(dir)) => args.extend(["--snapshot", "auto", "--snapshot-dir", dir]),
        (StartKind::Warm, None) => args.extend(["--snapshot", "auto"]),
        (StartKind::Cold, _) => args.extend(["--snapshot", "off"]),
    }
    let mut helper = launch_helper(&HelperSpec {
        exe: opts.helper.as_deref(),
        args: &args,
        log_filter: &opts.helper_log,
        keep: opts.keep_logs,
        tag: &tag,
        bind_limit: BIND_LIMIT,
        data_dir: boot.data_dir,
    })
    .map_err(|e| BootBenchError::Helper(e).to_string())?;
    // The profile (and with it the session disk) must be the same across
    // the series' boots: its root lives with the kept data directory.
    let profile_root = boot
        .data_dir
        .map_or_else(|| helper.dir.join("profile"), |d| d.join("profile-root"));
    // The kvm backend's guest memory is the helper's own; QEMU's is in
    // the QEMU process.
    let rss_of = match backend {
        Backend::Kvm => RssOf::Pid(helper.child.id()),
        Backend::Qemu => RssOf::QemuOf(&helper.log),
    };
    let measured = drive(opts, &helper.socket, &helper.dir, &profile_root, rss_of).await;
    let read_log = || {
        std::fs::read_to_string(&helper.log).map_err(|source| BootBenchError::Log {
            path: helper.log.clone(),
            source,
        })
    };
    let mut log = read_log();
    // The snapshot-taking boot: the qemu backend logs its snapshot taken
    // once the files are synced, while the machine runs on.
    let takes_snapshot = boot.series == StartKind::Warm && boot.expect == StartKind::Cold;
    if takes_snapshot && measured.is_ok() {
        let deadline = Instant::now() + SNAPSHOT_LINE_WAIT;
        while let Ok(text) = &log {
            let ev = log::HelperLog(text).parse();
            if ev.snapshot_taken.is_some() || ev.no_snapshot.is_some() || Instant::now() >= deadline
            {
                break;
            }
            tokio::time::sleep(SNAPSHOT_LINE_POLL).await;
            log = read_log();
        }
    }
    let failed = |helper: &mut super::Helper, e: &dyn std::fmt::Display| {
        // Stopped first, so the tail has how its VM ended (a guest that
        // died under the spawn shows only as a closed link until then).
        helper.stop();
        format!(
            "{e}\nhelper log tail (after stopping it):\n{}",
            helper.log_tail_lines(FAILED_BOOT_LOG_LINES)
        )
    };
    match (measured, log) {
        (Ok((start_vm_sent_at, start_vm_ms, spawn_exit_ms, rss)), Ok(text)) => {
            let events = log::HelperLog(&text).parse();
            if let Err(e) = check_start(backend, boot.expect, &events) {
                return Err(failed(&mut helper, &e));
            }
            Ok(RunRecord {
                backend,
                start: boot.expect,
                start_vm_sent_at,
                start_vm_ms,
                spawn_exit_ms: Some(spawn_exit_ms),
                rss,
                events,
            })
        }
        (Err(e), _) => Err(failed(&mut helper, &e)),
        (_, Err(e)) => Err(e.to_string()),
    }
}

/// Whose resident memory [`drive`] reads once startVM answered.
enum RssOf<'a> {
    /// This process (the kvm helper).
    Pid(u32),
    /// The QEMU process the helper logging to this file started (the pid
    /// of its last `qemu started` line).
    QemuOf(&'a std::path::Path),
}

impl RssOf<'_> {
    fn read(&self) -> Option<phases::Rss> {
        let pid = match self {
            RssOf::Pid(pid) => *pid,
            RssOf::QemuOf(log) => {
                let text = std::fs::read_to_string(log).ok()?;
                log::HelperLog(&text).parse().qemu_started?.pid?
            }
        };
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        phases::Rss::of_status(&status)
    }
}

/// Drives one helper: startVM, the first spawn, stopVM. Returns the wall
/// time startVM was sent (µs), startVM's duration and spawn → exit (ms),
/// and the resident memory of process `rss_of` once startVM answered.
async fn drive(
    opts: &Options,
    socket: &std::path::Path,
    dir: &std::path::Path,
    profile_root: &std::path::Path,
    rss_of: RssOf<'_>,
) -> Result<(i64, f64, f64, Option<phases::Rss>), BootBenchError> {
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
    let rss = rss_of.read();
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
    Ok((sent_at, start_vm_ms, spawn_ms, rss))
}

#[cfg(test)]
mod tests {
    use super::log::{HelperLog, QEMU_SNAPSHOT_LOG, QEMU_WARM_LOG, SNAPSHOT_LOG, WARM_LOG};
    use super::*;

    #[test]
    fn series_are_planned_backend_by_backend_cold_first() {
        assert_eq!(
            plan(&[Backend::Kvm, Backend::Qemu], Starts::Both),
            vec![
                (Backend::Kvm, StartKind::Cold),
                (Backend::Kvm, StartKind::Warm),
                (Backend::Qemu, StartKind::Cold),
                (Backend::Qemu, StartKind::Warm),
            ]
        );
        assert_eq!(
            plan(&[Backend::Kvm], Starts::Cold),
            vec![(Backend::Kvm, StartKind::Cold)]
        );
        assert_eq!(
            plan(&[Backend::Kvm, Backend::Qemu], Starts::Warm),
            vec![
                (Backend::Kvm, StartKind::Warm),
                (Backend::Qemu, StartKind::Warm)
            ]
        );
        // qemu alone, warm: measured like kvm.
        assert_eq!(
            plan(&[Backend::Qemu], Starts::Warm),
            vec![(Backend::Qemu, StartKind::Warm)]
        );
    }

    #[test]
    fn a_run_must_have_started_as_asked() {
        let warm = HelperLog(WARM_LOG).parse();
        let cold = HelperLog(SNAPSHOT_LOG).parse();
        check_start(Backend::Kvm, StartKind::Warm, &warm).unwrap();
        check_start(Backend::Kvm, StartKind::Cold, &cold).unwrap();
        let e = check_start(Backend::Kvm, StartKind::Cold, &warm).unwrap_err();
        assert!(matches!(e, BootBenchError::NotCold), "{e}");
        let e = check_start(Backend::Kvm, StartKind::Warm, &cold).unwrap_err();
        assert_eq!(
            e.to_string(),
            "asked for a warm start, but the helper booted cold: there was no boot snapshot of this machine shape"
        );
        let mut failed = cold.clone();
        failed.restore_failed = Some("the key differs".into());
        let e = check_start(Backend::Kvm, StartKind::Warm, &failed).unwrap_err();
        assert!(
            e.to_string()
                .ends_with("its boot snapshot could not be restored (the key differs)"),
            "{e}"
        );
        let old = log::BootEvents::default();
        let e = check_start(Backend::Kvm, StartKind::Cold, &old).unwrap_err();
        assert!(matches!(e, BootBenchError::StartUnknown(_)), "{e}");
        assert!(e.to_string().contains("`kvm vm started`"), "{e}");
        // qemu: by its `qemu started` lines, the same way.
        let warm = HelperLog(QEMU_WARM_LOG).parse();
        let cold = HelperLog(QEMU_SNAPSHOT_LOG).parse();
        check_start(Backend::Qemu, StartKind::Warm, &warm).unwrap();
        check_start(Backend::Qemu, StartKind::Cold, &cold).unwrap();
        let e = check_start(Backend::Qemu, StartKind::Cold, &warm).unwrap_err();
        assert!(matches!(e, BootBenchError::NotCold), "{e}");
        // A restore that failed: its warm line, then the cold one.
        let fell_back = HelperLog(concat!(
            "2026-12-06T03:00:00.1Z  INFO qemu started pid=10 accel=\"tcg\" start=\"warm\"\n",
            "2026-12-06T03:00:00.3Z  WARN the boot snapshot cannot be restored; removed, booting cold dir=/s error=QMP: closed\n",
            "2026-12-06T03:00:00.4Z  INFO qemu started pid=11 accel=\"tcg\" start=\"cold\"\n",
        ))
        .parse();
        let e = check_start(Backend::Qemu, StartKind::Warm, &fell_back).unwrap_err();
        assert!(
            e.to_string()
                .ends_with("its boot snapshot could not be restored (QMP: closed)"),
            "{e}"
        );
        // A qemu helper from before its warm start booted cold, without
        // saying so; a warm run of it cannot be told.
        check_start(Backend::Qemu, StartKind::Cold, &old).unwrap();
        let e = check_start(Backend::Qemu, StartKind::Warm, &old).unwrap_err();
        assert!(e.to_string().contains("`qemu started`"), "{e}");
        // The snapshot boot's reason, or that there was none.
        assert!(no_snapshot_reason(&cold).contains("boot snapshot taken"));
        let mut why = cold;
        why.no_snapshot = Some("no boot snapshot: EIO".into());
        assert_eq!(no_snapshot_reason(&why), "no boot snapshot: EIO");
    }
}
