//! A sandbox session is bounded like a VM's (issue 23, part 2), driven
//! through the real binary over its socket with the sandbox backend:
//!
//! - a memory hog stops within the requested memory (`startVM.memoryGB`
//!   0.5; the sandbox cgroup's peak usage is at most the limit + 25 %), is
//!   killed by the OOM killer with `oomKillCount` ≥ 1 in its exit event, and
//!   the agent (PID 1, which the OOM killer picks last) and another session
//!   of the same VM answer within a second after it;
//! - a fork bomb (bounded: at most [`BOMB_FORKS`] forks, whatever the limit
//!   does) gets `EAGAIN` at `pids.max`; the host's process table grows by at
//!   most `pids.max` while it runs; killed by the client, it leaves nothing
//!   behind (process count back, no cgroup after stopVM), another session
//!   answers within a second, and a sentinel process of the test on the host
//!   is untouched;
//! - a busy loop of two threads with `cpuCount` 1 gets at most about one CPU
//!   (the cgroup's CPU usage over two seconds);
//! - the cgroup of a helper that was killed is removed by the next one;
//! - without a cgroup (a helper running as `nobody` may not create one on
//!   this host's v1 hierarchies), rlimits stand in (`RLIMIT_DATA`: the hog
//!   gets ENOMEM; `RLIMIT_NPROC`: the bomb gets EAGAIN), and the startVM log
//!   and `doctor` say which limits are missing and why, one line each.
//!
//! Where: the host's own hierarchy (cgroup v1 on the hybrid development
//! host, v2 elsewhere), and cgroup v2 in the nested harness's L1 guest
//! (`scripts/nested-run.sh`; its kernel has the unified hierarchy whole):
//! there the same checks run twice, once with the cgroup under the helper's
//! own (L1's root cgroup), once through a `systemd --user` manager started
//! in L1 (a transient scope from `systemd-run --user --scope`). The nested
//! run is skipped loudly when the harness cannot run (a failure under
//! `COWORK_NESTED_TESTS=1`).
//!
//! The host tests need root (to create cgroups here) and skip loudly
//! otherwise; they are light: at most [`BOMB_FORKS`] sleeping processes
//! (about 0.6 GiB for a few seconds), a 0.5 GiB hog, two busy threads held
//! to one CPU.

mod support;

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use cowork_helper::backend::sandbox::cgroup::{self, parse_mountinfo};
use cowork_helper::backend::sandbox::limits::PIDS_MAX;
use cowork_helper::client::{Pipe, Subscription};
use serde_json::{json, Value};
use support::daemon::{run, run_ok, uid, Daemon, Opts, Profile};
use support::helper_process::built_helper;
use support::nested;
use support::session::sh;

/// Bound for anything that takes milliseconds here (seconds in L1).
const T: Duration = Duration::from_secs(120);

/// How long another session may take to answer after a limit was hit.
const ANSWER_WITHIN: Duration = Duration::from_secs(1);

/// `startVM.memoryGB` of the hog test.
const HOG_MEMORY_GB: f64 = 0.5;

/// `startVM.memoryGB` of the fork-bomb test: room for `pids.max` sleeping
/// processes (about 150 KiB each, kernel memory included) under the limit.
const BOMB_MEMORY_GB: f64 = 1.5;

/// The fork bomb's own bound: it stops after this many forks even if no
/// limit stops it (so a broken limit cannot take this shared machine down).
const BOMB_FORKS: u64 = 5000;

/// Slack for other processes that come and go on this shared machine while
/// the process table is counted.
const PROCESS_SLACK: usize = 300;

/// How far over the memory limit the peak may be (25 %).
const PEAK_TOLERANCE: f64 = 1.25;

/// The CPU test's busy threads (`cpuCount` + 1).
const BUSY_THREADS: u32 = 2;

/// The CPU test's measuring window.
const CPU_WINDOW: Duration = Duration::from_secs(2);

/// Most CPUs' worth the CPU test accepts for `cpuCount` 1 (generous).
const CPU_MAX_SHARE: f64 = 1.3;

/// uid and gid of `nobody`.
const NOBODY: u32 = 65534;

/// Set to `v2` / `systemd` on the re-runs inside the nested harness.
const INSIDE_ENV: &str = "COWORK_SANDBOX_LIMITS_INSIDE";

/// Printed by an inner run whose checks all passed.
const INNER_OK: &str = "sandbox_limits inner: ok";

/// Prefix of the measurement lines (echoed from the nested run).
const REPORT: &str = "sandbox_limits: ";

/// Marks the fork bomb's command line, to find leftovers on the host.
const BOMB_MARK: &str = "cowork-limits-bomb";

/// The hog: 1 MiB strings until the kernel says no.
const HOG: &str = "my @a; while (1) { push @a, 'x' x 1048576 }";

/// One test at a time: they measure the machine (process counts, CPU time,
/// answer times) and must not load it together.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn is_root() -> bool {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Skips (loudly) where the helper could not make a cgroup.
fn needs_root(test: &str) -> bool {
    if is_root() {
        return true;
    }
    nested::loud_skip(test, "not root: the helper cannot create cgroups here");
    false
}

/// A helper with info logs, optionally with more environment.
fn daemon(env: &[(&str, &str)]) -> Daemon {
    let mut e = vec![("COWORK_LOG".to_string(), "info".to_string())];
    e.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    Daemon::start_with(Opts {
        env: e,
        ..Opts::default()
    })
}

/// Connects a profile, subscribes, starts its sandbox with `extra`.
async fn vm(d: &Daemon, name: &str, extra: Value) -> (Pipe, Subscription) {
    let p = Profile::new(d, name);
    let pipe = p.pipe(d).await;
    let sub = p.subscribe(d).await;
    support::daemon::start_vm(d, &pipe, extra).await;
    (pipe, sub)
}

/// Host processes (thread-group leaders) now.
fn host_processes() -> usize {
    std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter(|e| {
                    e.file_name()
                        .to_str()
                        .is_some_and(|n| n.parse::<u32>().is_ok())
                })
                .count()
        })
        .unwrap_or(0)
}

/// A process of the test outside the sandbox that must survive it.
struct Sentinel(std::process::Child);

impl Sentinel {
    fn start() -> Sentinel {
        Sentinel(
            Command::new("sleep")
                .arg("600")
                .spawn()
                .expect("start the sentinel"),
        )
    }

    fn assert_alive(&mut self) {
        assert!(
            matches!(self.0.try_wait(), Ok(None)),
            "the host's sentinel process {} was touched",
            self.0.id()
        );
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

// ------------------------------------------------------------------ the cgroup seen from the host

/// The sandbox's cgroup on the host.
#[derive(Debug, Clone)]
struct SandboxCg {
    /// v1: per controller; v2: the one directory under "unified".
    dirs: BTreeMap<String, PathBuf>,
    v2: bool,
}

impl SandboxCg {
    /// From a session's `/proc/self/cgroup` (no cgroup namespace: host
    /// paths), without the session's own leaf (`proc-…`).
    fn from_session_view(text: &str) -> SandboxCg {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
        let mounts = parse_mountinfo(&mountinfo);
        let strip = |p: &str| -> String {
            match p.rsplit_once('/') {
                Some((parent, last)) if last.starts_with("proc-") => parent.to_string(),
                _ => p.to_string(),
            }
        };
        let mut dirs = BTreeMap::new();
        let mut v2 = None;
        for line in text.lines() {
            let mut parts = line.splitn(3, ':');
            let (Some(_), Some(ctrls), Some(path)) = (parts.next(), parts.next(), parts.next())
            else {
                continue;
            };
            let path = strip(path);
            let rel = path.trim_start_matches('/');
            if ctrls.is_empty() {
                if let Some(m) = mounts.iter().find(|m| m.v1_controllers.is_none()) {
                    v2 = Some(m.point.join(rel));
                }
                continue;
            }
            for c in ctrls.split(',') {
                if !["memory", "pids", "cpu", "cpuacct"].contains(&c) {
                    continue;
                }
                if let Some(m) = mounts.iter().find(|m| {
                    m.v1_controllers
                        .as_ref()
                        .is_some_and(|cs| cs.iter().any(|n| n == c))
                }) {
                    dirs.insert(c.to_string(), m.point.join(rel));
                }
            }
        }
        if dirs.contains_key("memory") {
            SandboxCg { dirs, v2: false }
        } else {
            let dir = v2.expect("a v2 cgroup line");
            SandboxCg {
                dirs: [("unified".to_string(), dir)].into(),
                v2: true,
            }
        }
    }

    fn dir(&self, controller: &str) -> &Path {
        let key = if self.v2 { "unified" } else { controller };
        self.dirs
            .get(key)
            .unwrap_or_else(|| panic!("no {controller} cgroup: {self:?}"))
    }

    fn read(&self, controller: &str, file: &str) -> String {
        let p = self.dir(controller).join(file);
        std::fs::read_to_string(&p)
            .unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
            .trim()
            .to_string()
    }

    fn read_u64(&self, controller: &str, file: &str) -> u64 {
        let v = self.read(controller, file);
        v.parse()
            .unwrap_or_else(|_| panic!("{file} is not a number: {v:?}"))
    }

    fn memory_limit(&self) -> u64 {
        if self.v2 {
            self.read_u64("memory", "memory.max")
        } else {
            self.read_u64("memory", "memory.limit_in_bytes")
        }
    }

    /// The highest usage so far (v2 kernels before 5.19 have no
    /// `memory.peak`: then the current usage).
    fn memory_peak(&self) -> u64 {
        if self.v2 {
            let peak = self.dir("memory").join("memory.peak");
            if peak.exists() {
                self.read_u64("memory", "memory.peak")
            } else {
                self.read_u64("memory", "memory.current")
            }
        } else {
            self.read_u64("memory", "memory.max_usage_in_bytes")
        }
    }

    fn pids_current(&self) -> u64 {
        self.read_u64("pids", "pids.current")
    }

    fn pids_max(&self) -> u64 {
        self.read_u64("pids", "pids.max")
    }

    /// CPU time used, in nanoseconds.
    fn cpu_ns(&self) -> u64 {
        if self.v2 {
            let stat = self.read("cpu", "cpu.stat");
            stat.lines()
                .find_map(|l| l.strip_prefix("usage_usec "))
                .and_then(|v| v.trim().parse::<u64>().ok())
                .expect("usage_usec in cpu.stat")
                * 1000
        } else {
            self.read_u64("cpuacct", "cpuacct.usage")
        }
    }

    /// The kernel's OOM kills in the sandbox and its sessions' cgroups
    /// (v2 counts them in the sandbox's `memory.events`; v1 counts each in
    /// the victim's own cgroup only, so the sessions' are added).
    fn oom_kills(&self) -> u64 {
        let count = |file: &Path| {
            std::fs::read_to_string(file)
                .unwrap_or_default()
                .lines()
                .find_map(|l| l.strip_prefix("oom_kill "))
                .and_then(|v| v.trim().parse::<u64>().ok())
        };
        let dir = self.dir("memory");
        if self.v2 {
            return count(&dir.join("memory.events")).expect("oom_kill in memory.events");
        }
        let own = count(&dir.join("memory.oom_control")).expect("oom_kill in memory.oom_control");
        let sessions: u64 = std::fs::read_dir(dir)
            .map(|d| {
                d.flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .filter_map(|e| count(&e.path().join("memory.oom_control")))
                    .sum()
            })
            .unwrap_or(0);
        own + sessions
    }

    /// v1: the OOM kills of processes in the sandbox's cgroup itself (the
    /// agent, the init), not in its sessions' cgroups.
    fn direct_oom_kills(&self) -> u64 {
        self.read("memory", "memory.oom_control")
            .lines()
            .find_map(|l| l.strip_prefix("oom_kill "))
            .and_then(|v| v.trim().parse().ok())
            .expect("oom_kill in memory.oom_control")
    }

    /// How often the CPU quota held the sandbox back.
    fn cpu_throttled(&self) -> u64 {
        self.read("cpu", "cpu.stat")
            .lines()
            .find_map(|l| l.strip_prefix("nr_throttled "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }

    /// The swap limit as a string (v1: memsw; v2: memory.swap.max).
    fn swap_limit(&self) -> Option<String> {
        let file = if self.v2 {
            "memory.swap.max"
        } else {
            "memory.memsw.limit_in_bytes"
        };
        std::fs::read_to_string(self.dir("memory").join(file))
            .ok()
            .map(|s| s.trim().to_string())
    }

    /// None of its directories exists any more.
    fn gone(&self) -> bool {
        self.dirs.values().all(|d| !d.exists())
    }

    /// Waits (bounded) until its directories are gone.
    fn wait_gone(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if self.gone() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.gone()
    }
}

/// The sandbox's cgroup, as a session of `session` sees it.
async fn sandbox_cgroup(pipe: &Pipe, sub: &mut Subscription, session: &str) -> SandboxCg {
    let text = run_ok(pipe, sub, &uid("cg"), session, "cat /proc/self/cgroup").await;
    let cg = SandboxCg::from_session_view(&text);
    for d in cg.dirs.values() {
        assert!(d.is_dir(), "{} from {text:?}", d.display());
    }
    cg
}

/// Spawns `echo` in a session other than the one that hit the limit and
/// asserts it answers within [`ANSWER_WITHIN`]; returns how long it took.
async fn another_session_answers(pipe: &Pipe, sub: &mut Subscription) -> Duration {
    let started = Instant::now();
    let out = run(pipe, sub, sh(&uid("other"), "bystander", "echo still-here")).await;
    let took = started.elapsed();
    assert_eq!(out.stdout_str(), "still-here\n", "{out:?}");
    assert!(
        took <= ANSWER_WITHIN,
        "another session took {took:?} to answer (limit {ANSWER_WITHIN:?})"
    );
    took
}

// ------------------------------------------------------------------ bodies

/// The memory hog and what it leaves (see the module doc).
async fn hog_body(extra_env: &[(&str, &str)]) {
    let mut sentinel = Sentinel::start();
    let d = daemon(extra_env);
    let (pipe, mut sub) = vm(&d, "hog", json!({"memoryGB": HOG_MEMORY_GB, "cpuCount": 1})).await;
    let cg = sandbox_cgroup(&pipe, &mut sub, "hog").await;
    let limit = (HOG_MEMORY_GB * 1024.0 * 1024.0 * 1024.0) as u64;
    assert_eq!(cg.memory_limit(), limit, "{cg:?}");
    assert_eq!(
        cg.swap_limit().as_deref(),
        Some(
            if cg.v2 {
                "0".to_string()
            } else {
                limit.to_string()
            }
            .as_str()
        ),
        "swap off"
    );
    assert_eq!(cg.pids_max(), PIDS_MAX);
    assert!(
        d.log().contains("sandbox limits: memory 512 MiB ("),
        "the startVM log names the limits:\n{}",
        d.log()
    );

    // Sessions are the OOM killer's first choice, the agent (PID 1) its last.
    let adj = run_ok(
        &pipe,
        &mut sub,
        &uid("adj"),
        "hog",
        "cat /proc/self/oom_score_adj /proc/1/oom_score_adj",
    )
    .await;
    assert_eq!(
        adj.split_whitespace().collect::<Vec<_>>(),
        ["500", "0"],
        "{adj:?}"
    );

    let started = Instant::now();
    let out = run(
        &pipe,
        &mut sub,
        json!({"id": "hog", "name": "hog", "command": "/usr/bin/perl", "args": ["-e", HOG], "isResume": false}),
    )
    .await;
    let hog_s = started.elapsed().as_secs_f64();
    let peak = cg.memory_peak();
    let oom_kills = out.exit.get("oomKillCount").and_then(Value::as_u64);
    let enomem = out.stderr_str().contains("Out of memory");
    assert!(
        (out.signal() == Some("SIGKILL") && oom_kills >= Some(1)) || enomem,
        "the hog ends by the OOM killer (oomKillCount ≥ 1) or with ENOMEM: {:?}",
        out.exit
    );
    assert!(
        peak as f64 <= limit as f64 * PEAK_TOLERANCE,
        "peak {peak} over the limit {limit} + 25 %"
    );
    let answer = another_session_answers(&pipe, &mut sub).await;
    let r = pipe.call("isGuestConnected", Value::Null).await.unwrap();
    assert_eq!(r["connected"], true, "the agent survived");
    sentinel.assert_alive();
    println!(
        "{REPORT}hog ({}): limit {} MiB, peak {:.1} MiB ({:.0} %), exit {}, {hog_s:.1} s; \
         another session answered in {} ms",
        if cg.v2 { "v2" } else { "v1" },
        limit >> 20,
        peak as f64 / 1048576.0,
        peak as f64 * 100.0 / limit as f64,
        out.exit,
        answer.as_millis()
    );

    pipe.call("stopVM", json!({})).await.expect("stopVM");
    assert!(cg.wait_gone(T), "the cgroup is removed at stopVM: {cg:?}");
}

/// The bounded fork bomb, killed by the client (see the module doc).
async fn bomb_body(extra_env: &[(&str, &str)]) {
    let mut sentinel = Sentinel::start();
    let d = daemon(extra_env);
    let (pipe, mut sub) = vm(
        &d,
        "bomb",
        json!({"memoryGB": BOMB_MEMORY_GB, "cpuCount": 1}),
    )
    .await;
    let cg = sandbox_cgroup(&pipe, &mut sub, "bomb").await;
    assert_eq!(cg.pids_max(), PIDS_MAX);
    let before = host_processes();
    let tasks_before = cg.pids_current();

    let script = format!(
        "$| = 1; my ($n, $err) = (0, 'no error'); \
         for (1..{BOMB_FORKS}) {{ my $p = fork; if (!defined $p) {{ $err = \"$!\"; last }} \
         if ($p == 0) {{ sleep 600; exit 0 }} $n++ }} \
         print \"forked $n, then: $err\\n\"; sleep 600"
    );
    pipe.call(
        "spawn",
        json!({"id": "bomb", "name": "bomb", "command": "/usr/bin/perl",
               "args": ["-e", script, BOMB_MARK], "isResume": false}),
    )
    .await
    .expect("spawn the bomb");
    let started = Instant::now();
    let line = loop {
        let ev = sub
            .next_matching(T, |e| e["id"] == "bomb")
            .await
            .expect("the bomb reports");
        if ev["type"] == "stdout" {
            break ev["data"].as_str().unwrap_or_default().to_string();
        }
        assert_ne!(ev["type"], "exit", "the bomb ended early: {ev}");
    };
    let bomb_s = started.elapsed().as_secs_f64();
    let during = host_processes();
    let tasks = cg.pids_current();
    let forked: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.trim_end_matches(',').parse().ok())
        .unwrap_or_else(|| panic!("unexpected bomb output {line:?}"));
    assert!(
        line.contains("Resource temporarily unavailable"),
        "fork failed with EAGAIN: {line:?}"
    );
    assert!(
        forked < PIDS_MAX && forked + 64 >= PIDS_MAX,
        "the bomb stopped at pids.max ({PIDS_MAX}), after {forked} forks"
    );
    assert!(tasks <= PIDS_MAX, "{tasks} tasks over pids.max");
    assert!(
        during <= before + PIDS_MAX as usize + PROCESS_SLACK,
        "the host's process table grew from {before} to {during}, more than pids.max"
    );

    pipe.call("kill", json!({"id": "bomb", "signal": "SIGKILL"}))
        .await
        .expect("kill the bomb");
    let out = sub
        .collect_process("bomb", T)
        .await
        .expect("the bomb exits");
    assert_eq!(out.signal(), Some("SIGKILL"), "{:?}", out.exit);
    let answer = another_session_answers(&pipe, &mut sub).await;
    let deadline = Instant::now() + T;
    while cg.pids_current() > tasks_before && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let tasks_after = cg.pids_current();
    assert!(
        tasks_after <= tasks_before,
        "the bomb left tasks behind: {tasks_after} in the sandbox, {tasks_before} before"
    );
    let after = host_processes();
    assert!(
        after <= before + PROCESS_SLACK,
        "the host's process table is at {after}, was {before}"
    );
    assert!(
        support::daemon::wait_no_process(BOMB_MARK, T).is_empty(),
        "bomb processes left on the host"
    );
    sentinel.assert_alive();
    println!(
        "{REPORT}fork bomb ({}): {forked} forks then EAGAIN in {bomb_s:.1} s; tasks {tasks} \
         (pids.max {PIDS_MAX}); host processes {before} -> {during} -> {after}; another \
         session answered in {} ms",
        if cg.v2 { "v2" } else { "v1" },
        answer.as_millis()
    );

    pipe.call("stopVM", json!({})).await.expect("stopVM");
    assert!(cg.wait_gone(T), "the cgroup is removed at stopVM: {cg:?}");
    assert!(support::daemon::wait_no_process(BOMB_MARK, T).is_empty());
}

/// `cpuCount` 1 holds two busy threads to about one CPU.
async fn cpu_body(extra_env: &[(&str, &str)]) {
    let d = daemon(extra_env);
    let (pipe, mut sub) = vm(&d, "cpu", json!({"memoryGB": HOG_MEMORY_GB, "cpuCount": 1})).await;
    let cg = sandbox_cgroup(&pipe, &mut sub, "cpu").await;
    let loops = (0..BUSY_THREADS)
        .map(|_| "(while :; do :; done) &")
        .collect::<Vec<_>>()
        .join(" ");
    pipe.call("spawn", sh("busy", "cpu", &format!("{loops} wait")))
        .await
        .expect("spawn the busy loops");
    // Let them start, then measure.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (t0, c0, th0) = (Instant::now(), cg.cpu_ns(), cg.cpu_throttled());
    tokio::time::sleep(CPU_WINDOW).await;
    let (wall, used) = (t0.elapsed().as_secs_f64(), (cg.cpu_ns() - c0) as f64 / 1e9);
    let throttled = cg.cpu_throttled() - th0;
    let share = used / wall;
    pipe.call("kill", json!({"id": "busy", "signal": "SIGKILL"}))
        .await
        .expect("kill the loops");
    sub.collect_process("busy", T).await.expect("the loops end");
    assert!(
        share <= CPU_MAX_SHARE,
        "{BUSY_THREADS} busy threads used {share:.2} CPUs with cpuCount 1"
    );
    assert!(share > 0.2, "the busy loops did not run ({share:.2} CPUs)");
    println!(
        "{REPORT}cpu ({}): {BUSY_THREADS} busy threads, cpuCount 1: {share:.2} CPUs over \
         {wall:.1} s, throttled in {throttled} periods (machine load {})",
        if cg.v2 { "v2" } else { "v1" },
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .split_whitespace()
            .next()
            .unwrap_or("?")
    );
    pipe.call("stopVM", json!({})).await.expect("stopVM");
    assert!(cg.wait_gone(T));
}

/// Resident size in KiB in a `/proc/<pid>/status` text.
fn vm_rss_kib(status: &str) -> u64 {
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no VmRSS in {status}"))
}

/// A crowd of session processes, each smaller than the agent, fills the
/// sandbox's memory: the OOM killer takes them, not the agent (by size
/// alone it would take the agent first; their `oom_score_adj` decides).
async fn oom_order_body(extra_env: &[(&str, &str)]) {
    let d = daemon(extra_env);
    let (pipe, mut sub) = vm(&d, "crowd", json!({"memoryGB": HOG_MEMORY_GB})).await;
    let cg = sandbox_cgroup(&pipe, &mut sub, "crowd").await;
    let agent_kib =
        vm_rss_kib(&run_ok(&pipe, &mut sub, "agent", "crowd", "cat /proc/1/status").await);
    let perl_kib = vm_rss_kib(
        &run_ok(
            &pipe,
            &mut sub,
            "perl",
            "crowd",
            "exec perl -e 'print `cat /proc/$$/status`'",
        )
        .await,
    );
    // Each crowd process: perl holding `chunk` more KiB, below the agent.
    let chunk_kib = agent_kib.saturating_sub(perl_kib) / 2;
    let member_kib = perl_kib + chunk_kib;
    assert!(
        chunk_kib >= 1024 && member_kib < agent_kib,
        "no room for a crowd smaller than the agent: agent {agent_kib} KiB, perl {perl_kib} KiB"
    );
    let limit_kib = (HOG_MEMORY_GB * 1024.0 * 1024.0) as u64;
    let members = 2 * limit_kib / member_kib;
    let kills_before = cg.oom_kills();
    assert!(cg.v2 || cg.direct_oom_kills() == 0, "{cg:?}");
    let script = format!(
        "i=0; while [ $i -lt {members} ]; do \
         perl -e '$x = \"x\" x ({chunk_kib} * 1024); sleep 600' & i=$((i+1)); done; \
         echo spawned; wait"
    );
    pipe.call("spawn", sh("crowd", "crowd", &script))
        .await
        .expect("spawn the crowd");
    sub.next_matching(T, |e| e["id"] == "crowd" && e["type"] == "stdout")
        .await
        .expect("the crowd is spawned");
    // The last members may still be allocating.
    let deadline = Instant::now() + T;
    while cg.oom_kills() == kills_before && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let kills = cg.oom_kills() - kills_before;
    assert!(
        kills >= 1,
        "{members} processes of {member_kib} KiB did not fill the sandbox: no OOM kill \
         (peak {} KiB)",
        cg.memory_peak() >> 10
    );
    let after =
        vm_rss_kib(&run_ok(&pipe, &mut sub, "agent2", "bystander", "cat /proc/1/status").await);
    let r = pipe.call("isGuestConnected", Value::Null).await.unwrap();
    assert_eq!(r["connected"], true, "the agent survived {kills} OOM kills");
    pipe.call("kill", json!({"id": "crowd", "signal": "SIGKILL"}))
        .await
        .expect("kill the crowd");
    let out = sub
        .collect_process("crowd", T)
        .await
        .expect("the crowd ends");
    let crowd_kills = out.exit.get("oomKillCount").and_then(Value::as_u64);
    assert!(
        crowd_kills >= Some(1),
        "the crowd's exit counts its OOM kills: {:?}",
        out.exit
    );
    // Every kill was one of the crowd's: v2 counts them all in the
    // sandbox's memory.events; v1 counts each in the victim's own cgroup,
    // and the sandbox's own holds the agent and the init only.
    if cg.v2 {
        let total = cg.oom_kills() - kills_before;
        assert_eq!(Some(total), crowd_kills, "an OOM kill outside the crowd");
    } else {
        assert_eq!(
            cg.direct_oom_kills(),
            0,
            "an OOM kill of the agent or the init"
        );
    }
    println!(
        "{REPORT}OOM order ({}): {members} processes of {member_kib} KiB (agent {agent_kib} \
         KiB, then {after} KiB): {kills} OOM kills, all of sessions' processes; exit {}",
        if cg.v2 { "v2" } else { "v1" },
        out.exit
    );
    pipe.call("stopVM", json!({})).await.expect("stopVM");
    assert!(cg.wait_gone(T));
}

/// A killed helper's cgroup is removed by the next helper.
async fn stale_body(extra_env: &[(&str, &str)]) {
    let mut first = daemon(extra_env);
    let (pipe, mut sub) = vm(&first, "stale", json!({"memoryGB": HOG_MEMORY_GB})).await;
    let cg = sandbox_cgroup(&pipe, &mut sub, "stale").await;
    drop((pipe, sub));
    first.signal(libc::SIGKILL);
    first.wait_exit(T).expect("the helper ends");
    // Its sandbox dies with it (parent-death signals); the cgroup stays.
    std::thread::sleep(Duration::from_millis(300));
    assert!(!cg.gone(), "nothing removed the cgroup yet: {cg:?}");
    let second = daemon(extra_env);
    let (pipe, _sub) = vm(&second, "stale", json!({"memoryGB": HOG_MEMORY_GB})).await;
    assert!(
        cg.wait_gone(T),
        "the next helper removes the killed one's cgroup: {cg:?}"
    );
    assert!(
        second
            .log()
            .contains("removed a sandbox cgroup a killed helper left behind"),
        "{}",
        second.log()
    );
    pipe.call("stopVM", json!({})).await.expect("stopVM");
}

/// A helper ended as the client ends it (SIGTERM) removes its sandboxes'
/// cgroups on the way out.
async fn sigterm_body(extra_env: &[(&str, &str)]) {
    let mut d = daemon(extra_env);
    let (pipe, mut sub) = vm(&d, "term", json!({"memoryGB": HOG_MEMORY_GB})).await;
    let cg = sandbox_cgroup(&pipe, &mut sub, "term").await;
    pipe.call("spawn", sh("sleeper", "term", "exec sleep 600"))
        .await
        .expect("spawn");
    drop((pipe, sub));
    d.signal(libc::SIGTERM);
    d.wait_exit(T).expect("the helper exits on SIGTERM");
    assert!(
        cg.gone(),
        "the helper left its sandbox's cgroup behind: {cg:?}\n{}",
        d.log()
    );
}

// ------------------------------------------------------------------ the host's hierarchy

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_hog_is_stopped_at_the_requested_memory() {
    let _serial = SERIAL.lock().await;
    if needs_root("a_memory_hog_is_stopped_at_the_requested_memory") {
        hog_body(&[]).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_bomb_stops_at_pids_max_and_leaves_nothing() {
    let _serial = SERIAL.lock().await;
    if needs_root("a_fork_bomb_stops_at_pids_max_and_leaves_nothing") {
        bomb_body(&[]).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_oom_killer_takes_sessions_before_the_agent() {
    let _serial = SERIAL.lock().await;
    if needs_root("the_oom_killer_takes_sessions_before_the_agent") {
        oom_order_body(&[]).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_threads_get_the_requested_cpus() {
    let _serial = SERIAL.lock().await;
    if needs_root("busy_threads_get_the_requested_cpus") {
        cpu_body(&[]).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_helper_ended_by_sigterm_removes_its_cgroups() {
    let _serial = SERIAL.lock().await;
    if needs_root("a_helper_ended_by_sigterm_removes_its_cgroups") {
        sigterm_body(&[]).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_helpers_cgroup_is_removed_by_the_next() {
    let _serial = SERIAL.lock().await;
    if needs_root("a_killed_helpers_cgroup_is_removed_by_the_next") {
        stale_body(&[]).await;
    }
}

// ------------------------------------------------------------------ no cgroup

/// The test binary and the helper, which `nobody` must be able to run.
fn reachable_by_nobody(exe: &Path) {
    let reachable = exe
        .ancestors()
        .skip(1)
        .all(|d| std::fs::metadata(d).is_ok_and(|m| m.permissions().mode() & 0o001 != 0));
    assert!(
        reachable,
        "nobody cannot reach {}: make its directories world-searchable",
        exe.display()
    );
}

#[test]
fn without_a_cgroup_rlimits_stand_in_and_the_log_says_why() {
    const TEST: &str = "without_a_cgroup_rlimits_stand_in_and_the_log_says_why";
    let _serial = SERIAL.blocking_lock();
    if !is_root() {
        return nested::loud_skip(TEST, "not root: cannot run the helper as nobody");
    }
    let me = std::env::current_exe().expect("this test binary");
    reachable_by_nobody(&me);
    reachable_by_nobody(&built_helper());
    // The client must be the helper's user: the whole check runs as nobody.
    let out = Command::new(&me)
        .args([
            "--exact",
            "inner_nobody",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(INSIDE_ENV, "nobody")
        .env("TMPDIR", "/tmp")
        .current_dir("/tmp")
        .uid(NOBODY)
        .gid(NOBODY)
        .output()
        .expect("run the inner test as nobody");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.lines().any(|l| l.trim() == INNER_OK),
        "the run as nobody failed ({}):\n{text}",
        out.status
    );
    for l in text.lines() {
        if let Some(i) = l.find(REPORT) {
            eprintln!("{}", &l[i..]);
        }
    }

    // doctor says the same.
    let out = Command::new(built_helper())
        .args(["doctor", "--backend", "sandbox"])
        .uid(NOBODY)
        .gid(NOBODY)
        .current_dir("/tmp")
        .output()
        .expect("doctor");
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("sandbox limits: "))
        .collect();
    assert!(lines[0].contains("INCOMPLETE"), "{text}");
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("sandbox limits: cpu: MISSING: ")
                && l.contains("Permission denied")),
        "{text}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("sandbox limits: memory: ") && l.contains("RLIMIT_DATA")),
        "{text}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("sandbox limits: processes: ") && l.contains("RLIMIT_NPROC")),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run as nobody by without_a_cgroup_rlimits_stand_in_and_the_log_says_why"]
async fn inner_nobody() {
    assert_ne!(
        // SAFETY: geteuid cannot fail.
        unsafe { libc::geteuid() },
        0,
        "this check must run as a user without cgroup rights"
    );
    let d = daemon(&[]);
    let (pipe, mut sub) = vm(
        &d,
        "nocg",
        json!({"memoryGB": HOG_MEMORY_GB, "cpuCount": 1}),
    )
    .await;
    let log = d.log();
    let limit_lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("sandbox limit"))
        .collect();
    let has = |needle: &str| limit_lines.iter().any(|l| l.contains(needle));
    assert!(
        has("sandbox limit memory: ") && has("instead: RLIMIT_DATA 512 MiB per process"),
        "{limit_lines:#?}"
    );
    assert!(
        has("sandbox limit processes: ") && has("instead: RLIMIT_NPROC 4096"),
        "{limit_lines:#?}"
    );
    assert!(has("sandbox limit cpu: MISSING: "), "{limit_lines:#?}");
    assert!(
        limit_lines
            .iter()
            .filter(|l| l.contains("sandbox limit cpu"))
            .all(|l| l.contains("Permission denied") || l.contains("not writable")),
        "the reason is named: {limit_lines:#?}"
    );

    let limits = run_ok(&pipe, &mut sub, "limits", "nocg", "cat /proc/self/limits").await;
    let row = |name: &str| {
        limits
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("{name} in {limits}"))
            .split_whitespace()
            .skip(name.split_whitespace().count())
            .take(2)
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    assert_eq!(row("Max data size"), ["536870912", "536870912"], "{limits}");
    assert_eq!(row("Max processes"), ["4096", "4096"], "{limits}");

    // The hog: malloc fails (ENOMEM) at RLIMIT_DATA; nothing else is hurt.
    let out = run(
        &pipe,
        &mut sub,
        json!({"id": "hog", "name": "nocg", "command": "/usr/bin/perl", "args": ["-e", HOG], "isResume": false}),
    )
    .await;
    assert!(
        out.stderr_str().contains("Out of memory") && out.exit_code().is_some_and(|c| c != 0),
        "ENOMEM: {:?} {:?}",
        out.exit,
        out.stderr_str()
    );
    another_session_answers(&pipe, &mut sub).await;

    // The fork bomb: EAGAIN at RLIMIT_NPROC, counted in the sandbox's
    // user namespace only.
    let script = format!(
        "$| = 1; my ($n, $err) = (0, 'no error'); \
         for (1..{BOMB_FORKS}) {{ my $p = fork; if (!defined $p) {{ $err = \"$!\"; last }} \
         if ($p == 0) {{ sleep 600; exit 0 }} $n++ }} print \"forked $n, then: $err\\n\"; sleep 600"
    );
    pipe.call(
        "spawn",
        json!({"id": "bomb", "name": "nocg", "command": "/usr/bin/perl",
               "args": ["-e", script, BOMB_MARK], "isResume": false}),
    )
    .await
    .unwrap();
    let ev = sub
        .next_matching(T, |e| e["id"] == "bomb" && e["type"] == "stdout")
        .await
        .expect("the bomb reports");
    let line = ev["data"].as_str().unwrap_or_default().to_string();
    let forked: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.trim_end_matches(',').parse().ok())
        .unwrap_or_else(|| panic!("{line:?}"));
    assert!(
        line.contains("Resource temporarily unavailable"),
        "{line:?}"
    );
    assert!(forked < PIDS_MAX && forked + 64 >= PIDS_MAX, "{line:?}");
    pipe.call("kill", json!({"id": "bomb", "signal": "SIGKILL"}))
        .await
        .unwrap();
    sub.collect_process("bomb", T).await.expect("the bomb ends");
    assert!(support::daemon::wait_no_process(BOMB_MARK, T).is_empty());
    another_session_answers(&pipe, &mut sub).await;
    println!("{REPORT}no cgroup (nobody): hog ENOMEM at RLIMIT_DATA; bomb: {line}");
    pipe.call("stopVM", json!({})).await.unwrap();
    println!("{INNER_OK}");
}

#[test]
fn doctor_names_the_sandbox_limits() {
    let _serial = SERIAL.blocking_lock();
    if !needs_root("doctor_names_the_sandbox_limits") {
        return;
    }
    let doctor = |env: &[(&str, &str)]| {
        let mut c = Command::new(built_helper());
        c.args(["doctor", "--backend", "sandbox"])
            .stdout(std::process::Stdio::piped());
        for (k, v) in env {
            c.env(k, v);
        }
        let child = c.spawn().expect("doctor");
        let pid = child.id();
        let out = child.wait_with_output().expect("doctor");
        (pid, String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let (pid, text) = doctor(&[]);
    let line = text
        .lines()
        .find(|l| l.starts_with("sandbox limits: "))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        line.starts_with("sandbox limits: all enforced: memory 4096 MiB"),
        "{line}"
    );
    assert!(line.contains("4096 processes"), "{line}");
    // The trial cgroup is gone again.
    let read = |p: &str| std::fs::read_to_string(p).unwrap();
    let parents: Vec<PathBuf> =
        match cgroup::detect(&read("/proc/self/mountinfo"), &read("/proc/self/cgroup")) {
            cgroup::Layout::V1(dirs) => dirs.into_values().collect(),
            cgroup::Layout::V2 { dir, .. } => vec![dir],
            cgroup::Layout::None(why) => panic!("{why}"),
        };
    let prefix = format!("cowork-sandbox-{pid}-");
    for parent in &parents {
        let left: Vec<_> = std::fs::read_dir(parent)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
            .collect();
        assert!(
            left.is_empty(),
            "doctor left {left:?} in {}",
            parent.display()
        );
    }
    // Forced off as root: RLIMIT_NPROC cannot stand in, and doctor says so.
    let (_, text) = doctor(&[(cgroup::DISABLE_ENV, "1")]);
    assert!(
        text.lines()
            .any(|l| l.starts_with("sandbox limits: processes: MISSING: ")
                && l.contains("does not apply it to root")),
        "{text}"
    );
}

// ------------------------------------------------------------------ cgroup v2 in the nested harness

/// The inner runs: `v2` (the cgroup under the helper's own, L1's root
/// cgroup) and `systemd` (a scope from a `systemd --user` in L1).
async fn inner(kind: &str) {
    let expect = match kind {
        "v2" => "cgroup v2 /sys/fs/cgroup/cowork-sandbox-",
        "systemd" => "systemd scope, cgroup v2 /sys/fs/cgroup/",
        other => panic!("unknown inner run {other}"),
    };
    // Checked on the hog's helper log below through the body's helper.
    let env: Vec<(&str, &str)> = match kind {
        "systemd" => vec![("XDG_RUNTIME_DIR", "/run/user/0")],
        _ => vec![],
    };
    {
        let d = daemon(&env);
        let (pipe, mut sub) = vm(&d, "where", json!({"memoryGB": HOG_MEMORY_GB})).await;
        let cg = sandbox_cgroup(&pipe, &mut sub, "where").await;
        assert!(cg.v2, "{cg:?}");
        let log = d.log();
        let line = log
            .lines()
            .find(|l| l.contains("sandbox limits: "))
            .unwrap_or_else(|| panic!("no limits line:\n{log}"));
        assert!(
            line.contains(expect),
            "expected the sandbox in {expect}…: {line}"
        );
        let at = line.find("sandbox limits: ").unwrap_or(0);
        println!("{REPORT}{kind}: {}", &line[at..]);
        pipe.call("stopVM", json!({})).await.unwrap();
        assert!(cg.wait_gone(T), "{cg:?}");
    }
    hog_body(&env).await;
    oom_order_body(&env).await;
    bomb_body(&env).await;
    cpu_body(&env).await;
    if kind == "v2" {
        stale_body(&env).await;
    }
    sigterm_body(&env).await;
    println!("{INNER_OK}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run inside the nested harness by cgroup_v2_in_the_nested_harness"]
async fn inner_v2() {
    let _serial = SERIAL.lock().await;
    inner(&std::env::var(INSIDE_ENV).unwrap_or_else(|_| "v2".into())).await;
}

#[test]
fn cgroup_v2_in_the_nested_harness() {
    const TEST: &str = "cgroup_v2_in_the_nested_harness";
    if let Err(why) = nested::harness_check() {
        return nested::unavailable(TEST, &format!("the nested harness cannot run: {why}"));
    }
    let exe = std::env::current_exe().expect("this test binary");
    let cwd = std::env::current_dir().expect("the working directory");
    // The harness runs its command chrooted into the host's root, where the
    // kernel refuses new user namespaces (the sandbox needs one). The
    // script is therefore run from a mount namespace whose root is that
    // share, moved over the namespace's root as switch_root does (entered
    // from PID 1's root with nsenter, done with the initramfs's busybox).
    // L1 boots with no cgroup mounted: the unified hierarchy gets every
    // controller. The `systemd` part runs with a private /run (tmpfs) where
    // it starts a user manager for root, as a desktop session has one.
    let script = format!(
        r#"cd {cwd}
export TMPDIR=/dev/shm
run() {{ {INSIDE_ENV}=$1 timeout -k 5 900 {exe} --exact inner_v2 --ignored --nocapture --test-threads=1 2>&1; }}
if [ "$1" = systemd ]; then
  mount -t tmpfs tmpfs /run && mkdir -p /run/systemd/system /run/user/0 && chmod 700 /run/user/0 || exit 4
  (XDG_RUNTIME_DIR=/run/user/0 /lib/systemd/systemd --user >/dev/shm/systemd-user.log 2>&1 &)
  i=0; while [ ! -S /run/user/0/systemd/private ] && [ $i -lt 120 ]; do sleep 0.5; i=$((i+1)); done
  run systemd; r=$?
  [ $r = 0 ] || tail -n 30 /dev/shm/systemd-user.log
  exit $r
fi
unshare -U true || {{ echo "no user namespaces here"; exit 5; }}
run v2; r1=$?
unshare -m /bin/bash "$0" systemd; r2=$?
exit $((r1 | r2))
"#,
        cwd = nested::shell_quote(&cwd.to_string_lossy()),
        exe = nested::shell_quote(&exe.to_string_lossy()),
    );
    let cmd = format!(
        "mount -t cgroup2 none /sys/fs/cgroup || exit 3\n\
         echo \"controllers: $(cat /sys/fs/cgroup/cgroup.controllers)\"\n\
         cat > /dev/shm/sandbox-limits.sh <<'COWORK_EOF'\n{script}COWORK_EOF\n\
         nsenter -t 1 -m -r /bin/busybox sh -c 'cd /mnt && exec /bin/busybox unshare -m \
         /bin/busybox sh -c \"/bin/busybox mount --make-rprivate / && cd /mnt && \
         /bin/busybox mount --move . / && exec /bin/busybox chroot . /bin/bash \
         /dev/shm/sandbox-limits.sh\"'\n"
    );
    let out = nested::run_in_nested_kvm_with(
        &cmd,
        &nested::NestedOptions {
            timeout: Duration::from_secs(1500),
            mem_mib: Some(3072),
            ..nested::NestedOptions::default()
        },
    )
    .unwrap_or_else(|e| panic!("the nested harness failed: {e}"));
    let passes = out.stdout.lines().filter(|l| l.trim() == INNER_OK).count();
    assert!(
        out.exit_code == 0 && passes == 2,
        "the nested runs failed (exit {}, {passes} of 2 passed):\n{}",
        out.exit_code,
        out.stdout
    );
    for l in out.stdout.lines() {
        if let Some(i) = l.find(REPORT) {
            eprintln!("{} (nested, TCG speed)", &l[i..]);
        } else if l.starts_with("controllers: ") {
            eprintln!("L1 {l}");
        }
    }
}
