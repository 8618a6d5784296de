//! Memory back to the host: a session allocates and touches 1 GiB, frees it,
//! and the VM's host RSS falls back within 10 s (free page reporting through
//! virtio-balloon: our in-process device under `--backend kvm`, QEMU's own
//! under `--backend qemu`).
//!
//! Each test boots the default userland with 2 GiB through the real helper,
//! checks the guest bound its balloon driver, waits for the VM's host RSS
//! to settle (the idle figure it prints), then a python3 session writes a
//! 1 GiB buffer and holds it: the RSS must rise by at least
//! [`MIN_RISE_MIB`]; once the process exited, the RSS must come back to
//! within [`RETURN_SLACK_MIB`] of its value before the allocation within
//! [`RETURN_LIMIT`]. The RSS is QEMU's (the helper's child) for qemu and
//! the helper's own for kvm. Lines starting `balloon: ` carry the numbers.
//!
//! * `balloon_qemu`: gated like the other QEMU suites (QEMU and a guest
//!   image with `rootfs.img`; `COWORK_QEMU_TESTS=1` makes a missing
//!   prerequisite a failure).
//! * `balloon_kvm`: directly where this host's KVM boots Linux, else inside
//!   the nested-KVM harness (the test binary re-runs itself there, as
//!   `tests/kvm_backend.rs` does; retried on QEMU TCG SVM faults);
//!   `COWORK_NESTED_TESTS=1` makes a missing prerequisite a failure,
//!   `COWORK_NESTED_MODE` forces the mode. Nested numbers run at TCG speed.
//!
//! `COWORK_BALLOON_VERBOSE=1` prints the helper's log at the end.

mod support;

use std::time::{Duration, Instant};

use cowork_helper::client::{Pipe, Subscription};
use serde_json::json;
use support::gate::{qemu_gate, qemu_missing};
use support::nested;
use support::procfs::{children_named, status_kib, thread_names};
use support::session::{self, assert_exit_0, bash, ok, run, wait_stdout};
use support::vm_helper::{self, built_helper, VmHelper};
use vmm::sync::MutexExt;

/// Guest memory asked of startVM.
const MEMORY_GB: u64 = 2;
/// vCPUs asked of startVM.
const CPUS: u32 = 2;
/// What the session allocates and touches, MiB.
const ALLOC_MIB: u64 = 1024;
/// Least rise of the host RSS while the allocation is held, MiB (the
/// guest may reuse a little memory it had already touched).
const MIN_RISE_MIB: u64 = 700;
/// How far above its pre-allocation value the RSS may stay after the free.
const RETURN_SLACK_MIB: u64 = 200;
/// How soon after the process's exit the RSS must be back.
const RETURN_LIMIT: Duration = Duration::from_secs(10);
/// RSS sampling period.
const SAMPLE: Duration = Duration::from_millis(250);
/// The RSS counts as settled when it moved at most this much over
/// [`SETTLE_WINDOW`] samples.
const SETTLE_TOLERANCE_MIB: u64 = 16;
/// Samples (one a second) a settled RSS is judged over.
const SETTLE_WINDOW: usize = 5;
/// Longest wait for the idle RSS to settle after boot.
const SETTLE_LIMIT: Duration = Duration::from_secs(90);
/// Limit for startVM (TCG boots; nested boots are slower still).
const START_LIMIT: Duration = Duration::from_secs(180);
/// Limit for one session command and for the rise (python and 1 GiB of
/// page faults at TCG speed, nested even slower).
const T: Duration = Duration::from_secs(300);
/// Session the allocation runs in.
const SESSION: &str = "balloon";
/// File (in the session's home) whose creation ends the held allocation.
const RELEASE_FILE: &str = "balloon-release";
/// What the allocating process prints once its buffer is written.
const HELD: &str = "held";
/// The in-process device's log line at reset, with its counters.
const DEVICE_RESET: &str = "balloon: device reset";
/// Name of the in-process device's worker thread.
const WORKER_THREAD: &str = "virtio-balloon";
/// Prefix of the measurement lines (echoed from the nested run).
const REPORT_PREFIX: &str = "balloon: ";
/// Environment variable that prints the helper's log at the end.
const VERBOSE_ENV: &str = "COWORK_BALLOON_VERBOSE";
/// Name of the kvm test (what the nested re-run selects).
const KVM_TEST: &str = "balloon_kvm";
/// Set (to 1) on the re-run inside the nested harness.
const INSIDE_ENV: &str = "COWORK_BALLOON_INSIDE";
/// Line the kvm body prints when every check passed.
const OK_MARKER: &str = "balloon: kvm ok";
/// Limit for the kvm body inside the L1 guest.
const INNER_TIMEOUT: Duration = Duration::from_secs(900);
/// Limit for the whole harness run.
const HARNESS_TIMEOUT: Duration = Duration::from_secs(960);
/// Nested attempts (QEMU TCG's SVM emulation now and then kills a guest).
const NESTED_ATTEMPTS: u32 = 3;
/// One VM at a time: TCG is CPU heavy and the machine has 2 cores.
static ONE_VM: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The python3 program of the session: writes [`ALLOC_MIB`] MiB (every
/// page), says [`HELD`], holds it until [`RELEASE_FILE`] exists, exits.
fn alloc_script() -> String {
    format!(
        "python3 -c '
import os, sys, time
b = bytearray(b\"\\x01\") * ({ALLOC_MIB} << 20)
print(\"{HELD}\", len(b) >> 20, flush=True)
f = os.path.expanduser(\"~/{RELEASE_FILE}\")
deadline = time.time() + {hold}
while not os.path.exists(f) and time.time() < deadline:
    time.sleep(0.05)
del b
'",
        hold = T.as_secs()
    )
}

/// Which VM's memory the test watches.
#[derive(Clone, Copy)]
enum Backend {
    Kvm,
    Qemu,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::Kvm => "kvm",
            Backend::Qemu => "qemu",
        }
    }

    /// The VM's host RSS in MiB: the helper's for kvm, its QEMU child's for
    /// qemu.
    fn rss_mib(self, helper_pid: u32) -> Option<u64> {
        let pid = match self {
            Backend::Kvm => helper_pid,
            Backend::Qemu => *children_named(helper_pid, "qemu-system").first()?,
        };
        Some(status_kib(pid, "VmRSS")? / 1024)
    }
}

/// Samples the RSS once a second until it moved at most
/// [`SETTLE_TOLERANCE_MIB`] over [`SETTLE_WINDOW`] samples; returns the last.
async fn settled_rss(backend: Backend, pid: u32) -> u64 {
    let t0 = Instant::now();
    let mut window: Vec<u64> = Vec::new();
    loop {
        let rss = backend.rss_mib(pid).expect("the VM's RSS");
        window.push(rss);
        if window.len() > SETTLE_WINDOW {
            window.remove(0);
        }
        let spread = window.iter().max().unwrap() - window.iter().min().unwrap();
        if window.len() == SETTLE_WINDOW && spread <= SETTLE_TOLERANCE_MIB {
            return rss;
        }
        if t0.elapsed() > SETTLE_LIMIT {
            eprintln!(
                "{REPORT_PREFIX}{}: RSS still moving after {SETTLE_LIMIT:?}: {window:?} MiB",
                backend.name()
            );
            return rss;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The whole check on a helper whose VM is not started yet.
async fn balloon_cycle(backend: Backend, helper: &VmHelper, pipe: &Pipe, sub: &mut Subscription) {
    let name = backend.name();
    let pid = helper.pid();
    let boot = session::start_vm(
        pipe,
        helper,
        json!({"memoryGB": MEMORY_GB, "cpuCount": CPUS}),
        START_LIMIT,
        "startVM",
    )
    .await;
    let rss_booted = backend.rss_mib(pid).expect("the VM's RSS");

    // The guest bound its balloon driver, with free page reporting.
    let out = ok(
        pipe,
        sub,
        "driver",
        SESSION,
        "ls /sys/bus/virtio/drivers/virtio_balloon/; \
         cat /sys/module/page_reporting/parameters/page_reporting_order",
        T,
    )
    .await;
    assert!(
        out.contains("virtio"),
        "no device bound to the guest's virtio_balloon driver: {out:?}\n{}",
        helper.log_text()
    );
    let order = out.lines().last().unwrap_or_default().trim().to_string();

    let idle = settled_rss(backend, pid).await;
    eprintln!(
        "{REPORT_PREFIX}{name}: startVM took {boot:?}; RSS right after boot {rss_booted} MiB, \
         idle (settled) {idle} MiB; guest page_reporting_order {order}"
    );

    // Allocate and hold.
    pipe.call("spawn", bash("alloc", SESSION, &alloc_script()))
        .await
        .expect("spawn the allocation");
    let t_alloc = Instant::now();
    wait_stdout(sub, "alloc", HELD, T).await;
    let wrote = t_alloc.elapsed();
    let deadline = Instant::now() + T;
    let mut held = backend.rss_mib(pid).expect("the VM's RSS");
    while held < idle + MIN_RISE_MIB && Instant::now() < deadline {
        tokio::time::sleep(SAMPLE).await;
        held = held.max(backend.rss_mib(pid).expect("the VM's RSS"));
    }
    assert!(
        held >= idle + MIN_RISE_MIB,
        "{name}: RSS rose only from {idle} to {held} MiB while {ALLOC_MIB} MiB were held"
    );

    // Free: the process exits; the RSS must come back.
    let release = run(
        pipe,
        sub,
        bash("release", SESSION, &format!("touch ~/{RELEASE_FILE}")),
        T,
    )
    .await;
    assert_exit_0("touch the release file", &release);
    let out = sub
        .collect_process("alloc", T)
        .await
        .unwrap_or_else(|e| panic!("the allocation did not end: {e}"));
    assert_exit_0("the allocation", &out);
    let freed = Instant::now();
    let mut trace = Vec::new();
    let back = loop {
        let rss = backend.rss_mib(pid).expect("the VM's RSS");
        trace.push((freed.elapsed().as_millis(), rss));
        if rss <= idle + RETURN_SLACK_MIB {
            break Some(freed.elapsed());
        }
        if freed.elapsed() > RETURN_LIMIT {
            break None;
        }
        tokio::time::sleep(SAMPLE).await;
    };
    let last = trace.last().map_or(0, |t| t.1);
    eprintln!(
        "{REPORT_PREFIX}{name}: idle {idle} MiB, holding {ALLOC_MIB} MiB {held} MiB \
         (written in {wrote:?}), after the free {last} MiB in {:?}; (ms, MiB) {trace:?}",
        back.unwrap_or(freed.elapsed())
    );
    assert!(
        back.is_some(),
        "{name}: RSS not back within {RETURN_SLACK_MIB} MiB of {idle} MiB within {RETURN_LIMIT:?} \
         of the free: (ms, MiB) {trace:?}"
    );
    // Where it ends up a little later (the guest reports in passes).
    tokio::time::sleep(Duration::from_secs(5)).await;
    if let Some(rss) = backend.rss_mib(pid) {
        eprintln!("{REPORT_PREFIX}{name}: 5 s later {rss} MiB");
    }
    pipe.call("stopVM", json!({})).await.expect("stopVM");
    if let Backend::Kvm = backend {
        // Our device did the releasing (it logs its counters at reset: the
        // guest's first reports after boot count too), and its worker is
        // gone with the VM.
        let log = helper.log_text();
        let released = log
            .lines()
            .filter(|l| l.contains(DEVICE_RESET))
            .filter_map(|l| {
                l.split("released_mib=")
                    .nth(1)?
                    .split_whitespace()
                    .next()?
                    .parse::<u64>()
                    .ok()
            })
            .max();
        eprintln!("{REPORT_PREFIX}{name}: the device released {released:?} MiB in all");
        assert!(
            released.is_some_and(|mib| mib >= MIN_RISE_MIB),
            "{name}: the balloon device did not report releasing {MIN_RISE_MIB} MiB: {log}"
        );
        let left: Vec<String> = thread_names(pid)
            .into_iter()
            .filter(|t| t.starts_with(WORKER_THREAD))
            .collect();
        assert!(
            left.is_empty(),
            "{name}: balloon worker left after stopVM: {left:?}"
        );
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

fn stop(mut helper: VmHelper) {
    if std::env::var_os(VERBOSE_ENV).is_some() {
        eprintln!("---- helper log ----\n{}---- end ----", helper.log_text());
    }
    helper.stop();
}

#[test]
fn balloon_qemu() {
    if !qemu_gate(
        "balloon_qemu",
        "balloon_qemu",
        [
            qemu_missing(),
            vm_helper::userland_image_missing(&built_helper()),
        ],
    ) {
        return;
    }
    let _one = ONE_VM.locked();
    runtime().block_on(async {
        let helper = VmHelper::start_qemu("cowork-balloon-qemu-", &[]);
        let (pipe, mut sub) =
            session::client(&helper, "balloon-qemu", "/tmp/balloon-qemu", START_LIMIT).await;
        balloon_cycle(Backend::Qemu, &helper, &pipe, &mut sub).await;
        drop(sub);
        drop(pipe);
        stop(helper);
    });
}

fn kvm_body() {
    runtime().block_on(async {
        let helper = VmHelper::start_temp(
            &built_helper(),
            "cowork-balloon-kvm-",
            &nested::helper_base_dir(),
            "kvm",
            Duration::from_secs(30),
        );
        let (pipe, mut sub) =
            session::client(&helper, "balloon-kvm", "/tmp/balloon-kvm", START_LIMIT).await;
        balloon_cycle(Backend::Kvm, &helper, &pipe, &mut sub).await;
        drop(sub);
        drop(pipe);
        stop(helper);
    });
    println!("{OK_MARKER}");
}

#[test]
fn balloon_kvm() {
    let _one = ONE_VM.locked();
    nested::run_on_linux_kvm(
        &nested::Rerun {
            test: KVM_TEST,
            inside_env: INSIDE_ENV,
            ok_marker: OK_MARKER,
            report_prefix: REPORT_PREFIX,
            verbose_env: VERBOSE_ENV,
            inner_timeout: INNER_TIMEOUT,
            harness_timeout: HARNESS_TIMEOUT,
            attempts: NESTED_ATTEMPTS,
        },
        || vm_helper::userland_image_missing(&built_helper()),
        kvm_body,
    );
}
