//! `cowork-helper bench [--quick]`: starts a helper (this executable, or
//! `--helper PATH`) on a temporary socket with the sandbox backend, drives it
//! through [`crate::client`] as the desktop client does, and prints a table of
//! one-shot RPC latency, pipe throughput, spawn→exit latency, stdout
//! throughput of a 64 MiB output and the processes' peak RSS, next to the
//! targets.
//!
//! `cowork-helper bench boot` ([`boot`]) measures the boot of a real guest
//! under the VM backends instead.

pub mod boot;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::client::{Client, Pipe, Subscription};

/// Targets from the issue, and what the Node reference daemon does here.
const TARGET_SPAWN_EXIT_MS: f64 = 2.5;
const TARGET_STDOUT_MIBS: f64 = 350.0;
const TARGET_RSS_MIB: f64 = 30.0;

const STDOUT_BYTES: u64 = 64 * 1024 * 1024;

struct Opts {
    quick: bool,
    helper: Option<PathBuf>,
    keep_logs: bool,
}

fn usage() -> &'static str {
    "usage: cowork-helper bench [--quick] [--helper PATH] [--keep-logs]\n\
     Starts a helper with the sandbox backend on a temporary socket and measures\n\
     RPC latency, pipe throughput, spawn->exit latency, stdout throughput and peak RSS."
}

fn parse(args: &[String]) -> Result<Opts, String> {
    let mut o = Opts {
        quick: false,
        helper: None,
        keep_logs: false,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "bench" => {}
            "--quick" | "-quick" => o.quick = true,
            "--keep-logs" => o.keep_logs = true,
            "--helper" => o.helper = Some(it.next().ok_or("--helper needs a path")?.into()),
            s if s.starts_with("--helper=") => o.helper = Some(s["--helper=".len()..].into()),
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(o)
}

/// Entry point of the `bench` subcommand; `args` are the arguments after
/// `bench` (a leading `bench` is tolerated). Returns the process exit code.
pub fn main_with_args(args: Vec<String>) -> i32 {
    let opts = match parse(&args) {
        Ok(o) => o,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("bench: {e}");
            }
            eprintln!("{}", usage());
            return if e.is_empty() { 0 } else { 2 };
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("bench: cannot start the runtime: {e}");
            return 1;
        }
    };
    match rt.block_on(run(opts)) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("bench: {e}");
            1
        }
    }
}

/// The helper under test; killed (SIGTERM, then SIGKILL) on drop.
pub(crate) struct Helper {
    pub(crate) child: Child,
    pub(crate) dir: PathBuf,
    pub(crate) socket: PathBuf,
    pub(crate) log: PathBuf,
    keep: bool,
}

impl Drop for Helper {
    fn drop(&mut self) {
        self.stop();
        if self.keep {
            eprintln!("bench: helper log kept at {}", self.log.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

impl Helper {
    /// Stops the helper (SIGTERM, SIGKILL after 5 s) and waits for it, so
    /// its log is complete; stopping a stopped helper does nothing.
    pub(crate) fn stop(&mut self) {
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        // SAFETY: kill(2) on our own child, which try_wait says is not yet
        // reaped, so its pid is not reused.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The last 20 lines of the helper's log.
    pub(crate) fn log_tail(&self) -> String {
        self.log_tail_lines(20)
    }

    /// The last `n` lines of the helper's log.
    pub(crate) fn log_tail_lines(&self, n: usize) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

/// How to start a helper under test: which executable, its backend
/// arguments, its log filter, and where its files go.
pub(crate) struct HelperSpec<'a> {
    /// `None`: this executable.
    pub(crate) exe: Option<&'a std::path::Path>,
    /// Serving arguments after `-socket` and `--data-dir`.
    pub(crate) args: &'a [&'a str],
    /// `COWORK_LOG` of the helper.
    pub(crate) log_filter: &'a str,
    /// Keep the directory (and the log) after the helper ends.
    pub(crate) keep: bool,
    /// Suffix of the directory name (several helpers in one bench).
    pub(crate) tag: &'a str,
    /// How long the helper may take to bind its socket.
    pub(crate) bind_limit: Duration,
    /// `--data-dir` (default: a `data` directory beside the socket, removed
    /// with it).
    pub(crate) data_dir: Option<&'a std::path::Path>,
}

/// Starts a helper on a temporary socket (under `$TMPDIR`) and waits until
/// it accepts connections.
pub(crate) fn launch_helper(spec: &HelperSpec<'_>) -> Result<Helper, String> {
    let exe = match spec.exe {
        Some(p) => p.to_path_buf(),
        None => std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?,
    };
    let base =
        std::env::temp_dir().join(format!("cowork-bench-{}{}", std::process::id(), spec.tag));
    std::fs::create_dir_all(&base).map_err(|e| format!("mkdir {}: {e}", base.display()))?;
    let socket = base.join("run").join("helper.sock");
    let data = spec
        .data_dir
        .map_or_else(|| base.join("data"), std::path::Path::to_path_buf);
    let log = base.join("helper.log");
    let logf = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
    let child = Command::new(&exe)
        .arg("-socket")
        .arg(&socket)
        .arg("--data-dir")
        .arg(&data)
        .args(spec.args)
        .env("COWORK_LOG", spec.log_filter)
        .env("XDG_DATA_HOME", base.join("xdg-data"))
        .env("XDG_RUNTIME_DIR", base.join("run"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(logf)
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", exe.display()))?;
    let mut helper = Helper {
        child,
        dir: base,
        socket,
        log,
        keep: spec.keep,
    };
    let deadline = Instant::now() + spec.bind_limit;
    loop {
        if std::os::unix::net::UnixStream::connect(&helper.socket).is_ok() {
            return Ok(helper);
        }
        if let Ok(Some(st)) = helper.child.try_wait() {
            return Err(format!(
                "helper exited ({st}) before binding:\n{}",
                helper.log_tail()
            ));
        }
        if Instant::now() > deadline {
            return Err(format!(
                "helper did not bind {} within {} s",
                helper.socket.display(),
                spec.bind_limit.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn start_helper(opts: &Opts) -> Result<Helper, String> {
    launch_helper(&HelperSpec {
        exe: opts.helper.as_deref(),
        args: &["--backend", "sandbox"],
        log_filter: "warn",
        keep: opts.keep_logs,
        tag: "",
        bind_limit: Duration::from_secs(10),
        data_dir: None,
    })
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// `VmHWM` and `VmRSS` of a process in KiB.
fn mem_kib(pid: u32) -> Option<(u64, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    Some((status_kib(&s, "VmHWM:")?, status_kib(&s, "VmRSS:")?))
}

/// The value of the `name` line (`"VmRSS:"`) of a `/proc/<pid>/status`
/// text, in KiB.
pub(crate) fn status_kib(status: &str, name: &str) -> Option<u64> {
    status
        .lines()
        .find(|l| l.starts_with(name))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// CPU time (user + system) a process has used so far, in milliseconds.
fn cpu_ms(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
        return 0.0;
    };
    // After the comm: state is field 3; utime and stime are fields 14 and 15.
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11).and_then(|s| s.parse().ok()).unwrap_or(0)
        + f.get(12).and_then(|s| s.parse().ok()).unwrap_or(0);
    // SAFETY: sysconf takes no pointers.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    ticks as f64 * 1000.0 / hz
}

/// Resets a process's peak RSS (`VmHWM`) to its current RSS.
fn reset_hwm(pid: u32) {
    let _ = std::fs::write(format!("/proc/{pid}/clear_refs"), "5");
}

/// A process's name, with its first argument when that names a role
/// (`cowork-helper __agent`).
fn comm(pid: u32) -> String {
    let name = std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let role = std::fs::read(format!("/proc/{pid}/cmdline"))
        .ok()
        .and_then(|c| {
            c.split(|&b| b == 0)
                .nth(1)
                .map(|a| String::from_utf8_lossy(a).into_owned())
        })
        .filter(|a| a.starts_with("__"));
    match role {
        Some(r) => format!("{name} {r}"),
        None => name,
    }
}

/// Every descendant of `root` (by walking `/proc/*/stat` parent links).
fn descendants(root: u32) -> Vec<u32> {
    let mut parent = std::collections::HashMap::new();
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            // Fields after the parenthesised comm: state, ppid, ...
            let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
                continue;
            };
            if let Some(ppid) = rest
                .split_whitespace()
                .nth(1)
                .and_then(|s| s.parse::<u32>().ok())
            {
                parent.insert(pid, ppid);
            }
        }
    }
    let mut out = Vec::new();
    for (&pid, _) in parent.iter() {
        let mut cur = pid;
        let mut hops = 0;
        while let Some(&pp) = parent.get(&cur) {
            if pp == root {
                out.push(pid);
                break;
            }
            cur = pp;
            hops += 1;
            if hops > 64 || pp <= 1 {
                break;
            }
        }
    }
    out.sort_unstable();
    out
}

/// Peak RSS sampler: polls VmRSS of the helper and its descendants while a
/// phase runs, as a cross-check of VmHWM (and for short-lived children).
struct Sampler {
    stop: Arc<AtomicBool>,
    helper_peak: Arc<AtomicU64>,
    tree_peak: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Sampler {
    fn start(root: u32) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let helper_peak = Arc::new(AtomicU64::new(0));
        let tree_peak = Arc::new(AtomicU64::new(0));
        let (s, h, t) = (stop.clone(), helper_peak.clone(), tree_peak.clone());
        let thread = std::thread::spawn(move || {
            let mut kids = descendants(root);
            let mut n = 0u32;
            while !s.load(Ordering::Relaxed) {
                n += 1;
                if n == 20 {
                    n = 0;
                    kids = descendants(root);
                }
                let own = mem_kib(root).map(|m| m.1).unwrap_or(0);
                h.fetch_max(own, Ordering::Relaxed);
                let total: u64 = own
                    + kids
                        .iter()
                        .filter_map(|&p| mem_kib(p).map(|m| m.1))
                        .sum::<u64>();
                t.fetch_max(total, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        Sampler {
            stop,
            helper_peak,
            tree_peak,
            thread: Some(thread),
        }
    }

    fn finish(mut self) -> (u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        (
            self.helper_peak.load(Ordering::Relaxed),
            self.tree_peak.load(Ordering::Relaxed),
        )
    }
}

/// One 64 MiB stdout run: the time from sending `spawn` to the exit event,
/// and when the first byte arrived (ms), checking every byte arrived.
async fn stdout_run(
    pipe: &Pipe,
    sub: &mut Subscription,
    id: &str,
) -> Result<(Duration, f64), String> {
    let script = format!("head -c {STDOUT_BYTES} /dev/zero | tr '\\0' a");
    let t = Instant::now();
    pipe.call(
        "spawn",
        json!({"id": id, "name": "bench", "command": "/bin/sh", "args": ["-c", script], "isResume": false}),
    )
    .await
    .map_err(|err| format!("spawn 64 MiB writer: {err}"))?;
    let mut bytes = 0u64;
    let mut first: Option<Duration> = None;
    loop {
        let body = sub
            .next_raw(Duration::from_secs(60))
            .await
            .map_err(|err| format!("waiting for stdout: {err}"))?;
        // Borrowing parse: no JSON tree, no copy of the data unless escaped.
        let ev: OutputEvent =
            serde_json::from_slice(&body).map_err(|err| format!("bad event frame: {err}"))?;
        if ev.id.as_deref() != Some(id) {
            continue;
        }
        match ev.ty.as_ref() {
            "stdout" => {
                first.get_or_insert_with(|| t.elapsed());
                bytes += ev.data.map_or(0, |d| d.len()) as u64;
            }
            "exit" => break,
            _ => {}
        }
    }
    let el = t.elapsed();
    if bytes != STDOUT_BYTES {
        return Err(format!(
            "stdout run {id} received {bytes} bytes, expected {STDOUT_BYTES}"
        ));
    }
    Ok((el, first.map(ms).unwrap_or(f64::NAN)))
}

/// The fields of an event the throughput measurement needs, borrowed from
/// the frame where possible.
#[derive(serde::Deserialize)]
struct OutputEvent<'a> {
    #[serde(rename = "type", borrow)]
    ty: std::borrow::Cow<'a, str>,
    #[serde(default, borrow)]
    id: Option<std::borrow::Cow<'a, str>>,
    #[serde(default, borrow)]
    data: Option<std::borrow::Cow<'a, str>>,
}

fn is_exit_of(ev: &Value, id: &str) -> bool {
    ev.get("type").and_then(Value::as_str) == Some("exit")
        && ev.get("id").and_then(Value::as_str) == Some(id)
}

struct Row {
    what: String,
    result: String,
    target: String,
    verdict: &'static str,
}

fn row(what: &str, result: String, target: &str, ok: Option<bool>) -> Row {
    Row {
        what: what.to_string(),
        result,
        target: target.to_string(),
        verdict: match ok {
            Some(true) => "ok",
            Some(false) => "MISS",
            None => "",
        },
    }
}

async fn run(opts: Opts) -> Result<(), String> {
    let helper = start_helper(&opts)?;
    let pid = helper.child.id();
    let res = measure(&opts, &helper, pid).await;
    if res.is_err() {
        eprintln!("bench: helper log tail:\n{}", helper.log_tail());
    }
    res
}

async fn measure(opts: &Opts, helper: &Helper, pid: u32) -> Result<(), String> {
    let sock = helper.socket.clone();
    let e = |what: &'static str| move |err: crate::client::ClientError| format!("{what}: {err}");
    let profile = "bench";
    let root = helper.dir.join("profile");
    let root_s = root.to_string_lossy().into_owned();
    let pipe = Pipe::connect_profile(&sock, profile, &root_s)
        .await
        .map_err(e("configure"))?;
    let mut sub = Subscription::connect(&sock, profile, &root_s)
        .await
        .map_err(e("subscribeEvents"))?;
    let bundle = helper.dir.join("bundle");
    let _ = std::fs::create_dir_all(&bundle);
    let t0 = Instant::now();
    pipe.call("startVM", json!({"bundlePath": bundle.to_string_lossy()}))
        .await
        .map_err(e("startVM"))?;
    loop {
        let r = pipe
            .call("isGuestConnected", Value::Null)
            .await
            .map_err(e("isGuestConnected"))?;
        if r.get("connected") == Some(&Value::Bool(true)) {
            break;
        }
        if t0.elapsed() > Duration::from_secs(60) {
            return Err("guest did not connect within 60 s".into());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let boot = t0.elapsed();
    let mut rows = vec![row(
        "startVM → guest connected",
        format!("{:.1} ms", ms(boot)),
        "",
        None,
    )];

    // One-shot RPC latency.
    let n_oneshot = if opts.quick { 300 } else { 3000 };
    let mut lat = Vec::with_capacity(n_oneshot);
    for _ in 0..n_oneshot {
        let t = Instant::now();
        Client::one_shot(&sock, "isRunning", Value::Null)
            .await
            .map_err(e("one-shot isRunning"))?;
        lat.push(ms(t.elapsed()));
    }
    lat.sort_by(f64::total_cmp);
    rows.push(row(
        &format!("one-shot isRunning latency (n={n_oneshot})"),
        format!(
            "median {:.3} ms, p99 {:.3} ms",
            percentile(&lat, 0.5),
            percentile(&lat, 0.99)
        ),
        "",
        None,
    ));

    // Pipe throughput with K requests in flight.
    let in_flight = 32;
    let total = if opts.quick { 20_000 } else { 200_000 };
    let per = total / in_flight;
    let t = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..in_flight {
        let p = pipe.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..per {
                p.call("isRunning", Value::Null).await?;
            }
            Ok::<(), crate::client::ClientError>(())
        }));
    }
    for t in tasks {
        t.await
            .map_err(|j| format!("pipe worker: {j}"))?
            .map_err(e("pipe isRunning"))?;
    }
    let el = t.elapsed();
    rows.push(row(
        &format!("pipe isRunning throughput ({in_flight} in flight)"),
        format!("{:.0} req/s", (per * in_flight) as f64 / el.as_secs_f64()),
        "",
        None,
    ));

    // spawn → exit of /bin/echo.
    let n_spawn = if opts.quick { 50 } else { 200 };
    let mut lat = Vec::with_capacity(n_spawn);
    for i in 0..n_spawn {
        let id = format!("echo-{i}");
        let t = Instant::now();
        pipe.call(
            "spawn",
            json!({"id": id, "name": "bench", "command": "/bin/echo", "args": ["hi"], "isResume": false}),
        )
        .await
        .map_err(e("spawn /bin/echo"))?;
        loop {
            let ev = sub
                .next_event(Duration::from_secs(10))
                .await
                .map_err(e("waiting for exit of /bin/echo"))?;
            if is_exit_of(&ev, &id) {
                if ev.get("exitCode").and_then(Value::as_i64) != Some(0) {
                    return Err(format!("/bin/echo ended with {ev}"));
                }
                break;
            }
        }
        lat.push(ms(t.elapsed()));
    }
    lat.sort_by(f64::total_cmp);
    let median = percentile(&lat, 0.5);
    rows.push(row(
        &format!("spawn→exit /bin/echo hi (n={n_spawn})"),
        format!(
            "median {median:.2} ms, p99 {:.2} ms",
            percentile(&lat, 0.99)
        ),
        &format!("≤ {TARGET_SPAWN_EXIT_MS} ms median (Node: 11 ms)"),
        Some(median <= TARGET_SPAWN_EXIT_MS),
    ));

    // stdout throughput of 64 MiB, measured at the subscriber, with peak RSS.
    let kids = descendants(pid);
    reset_hwm(pid);
    for &k in &kids {
        reset_hwm(k);
    }
    let cpu_before: Vec<(u32, f64)> = std::iter::once(pid)
        .chain(kids.iter().copied())
        .chain(std::iter::once(std::process::id()))
        .map(|p| (p, cpu_ms(p)))
        .collect();
    let sampler = Sampler::start(pid);
    // Several runs: one 64 MiB run on a busy 2-core machine is noisy.
    let runs = if opts.quick { 1 } else { 5 };
    let mut rates = Vec::with_capacity(runs);
    let mut firsts = Vec::with_capacity(runs);
    for run in 0..runs {
        let (el, first) = stdout_run(&pipe, &mut sub, &format!("bigout-{run}")).await?;
        rates.push(STDOUT_BYTES as f64 / (1024.0 * 1024.0) / el.as_secs_f64());
        firsts.push(first);
    }
    rates.sort_by(f64::total_cmp);
    firsts.sort_by(f64::total_cmp);
    let mibs = percentile(&rates, 0.5);
    let (sampled_helper, sampled_tree) = sampler.finish();
    let cpu: Vec<String> = cpu_before
        .iter()
        .map(|&(p, before)| {
            let who = if p == pid {
                "helper".to_string()
            } else if p == std::process::id() {
                "bench client".to_string()
            } else {
                comm(p)
            };
            format!("{who} {:.0} ms", cpu_ms(p) - before)
        })
        .collect();
    rows.push(row(
        &format!("stdout 64 MiB, spawn → exit at subscriber (runs={runs})"),
        format!(
            "median {mibs:.0} MiB/s (min {:.0}, max {:.0}; first byte after {:.1} ms)",
            rates[0],
            rates[rates.len() - 1],
            percentile(&firsts, 0.5)
        ),
        &format!("≥ {TARGET_STDOUT_MIBS} MiB/s (Node: 105–136)"),
        Some(mibs >= TARGET_STDOUT_MIBS),
    ));
    rows.push(row("  CPU used during it", cpu.join(", "), "", None));
    let helper_hwm = mem_kib(pid).map(|m| m.0).unwrap_or(0);
    let helper_mib = helper_hwm as f64 / 1024.0;
    rows.push(row(
        "helper peak RSS during the stdout runs (VmHWM)",
        format!(
            "{helper_mib:.1} MiB (sampled VmRSS max {:.1} MiB)",
            sampled_helper as f64 / 1024.0
        ),
        &format!("≤ {TARGET_RSS_MIB} MiB (Node: 129–151)"),
        Some(helper_mib <= TARGET_RSS_MIB),
    ));
    for k in kids {
        let name = comm(k);
        if let Some((hwm, _)) = mem_kib(k) {
            rows.push(row(
                &format!("  child {name} (pid {k}) peak RSS"),
                format!("{:.1} MiB", hwm as f64 / 1024.0),
                "",
                None,
            ));
        }
    }
    rows.push(row(
        "  helper + children, sampled VmRSS max",
        format!("{:.1} MiB", sampled_tree as f64 / 1024.0),
        "",
        None,
    ));

    let _ = pipe.call("stopVM", Value::Null).await;
    print_table(opts, &rows);
    Ok(())
}

fn print_table(opts: &Opts, rows: &[Row]) {
    let w0 = rows
        .iter()
        .map(|r| r.what.chars().count())
        .max()
        .unwrap_or(0);
    let w1 = rows
        .iter()
        .map(|r| r.result.chars().count())
        .max()
        .unwrap_or(0);
    let w2 = rows
        .iter()
        .map(|r| r.target.chars().count())
        .max()
        .unwrap_or(0);
    println!(
        "cowork-helper bench{} (sandbox backend, {} CPUs)",
        if opts.quick { " --quick" } else { "" },
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0)
    );
    let pad = |s: &str, w: usize| format!("{s}{}", " ".repeat(w.saturating_sub(s.chars().count())));
    println!(
        "{}  {}  {}  verdict",
        pad("measurement", w0),
        pad("result", w1),
        pad("target", w2)
    );
    println!("{}", "-".repeat(w0 + w1 + w2 + 13));
    for r in rows {
        println!(
            "{}  {}  {}  {}",
            pad(&r.what, w0),
            pad(&r.result, w1),
            pad(&r.target, w2),
            r.verdict
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A helper stand-in: `sleep 30` as the child and a three-line log.
    fn sleeper(dir: &std::path::Path, keep: bool) -> Helper {
        let log = dir.join("helper.log");
        std::fs::write(&log, "one\ntwo\nthree\n").expect("write the log");
        Helper {
            child: Command::new("sleep")
                .arg("30")
                .spawn()
                .expect("spawn sleep"),
            dir: dir.to_path_buf(),
            socket: dir.join("helper.sock"),
            log,
            keep,
        }
    }

    #[test]
    fn stop_ends_the_helper_once_and_keeps_its_log_readable() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let mut h = sleeper(tmp.path(), true);
        let began = Instant::now();
        h.stop();
        assert!(
            began.elapsed() < Duration::from_secs(4),
            "SIGTERM should end sleep at once, took {:?}",
            began.elapsed()
        );
        assert!(
            matches!(h.child.try_wait(), Ok(Some(_))),
            "the child was reaped"
        );
        h.stop(); // a second stop is a no-op
        assert_eq!(h.log_tail_lines(2), "two\nthree");
        assert_eq!(h.log_tail_lines(10), "one\ntwo\nthree");
        assert_eq!(h.log_tail(), "one\ntwo\nthree");
        drop(h);
        assert!(
            tmp.path().join("helper.log").exists(),
            "keep leaves the log"
        );
    }

    #[test]
    fn drop_without_keep_removes_the_directory() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("h");
        std::fs::create_dir(&dir).expect("mkdir");
        drop(sleeper(&dir, false));
        assert!(!dir.exists());
    }
}
