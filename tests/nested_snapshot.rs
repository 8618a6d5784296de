//! Snapshot and restore of a real Linux guest: our VMM (in this test
//! process) boots Debian's cloud kernel (`scripts/fetch-kernel.sh`) with 2
//! vCPUs, a virtio-rng device and a busybox initramfs whose init
//! (`scripts/initramfs/snapshot-test-init`) ticks on the serial console
//! every 0.2 s with its uptime, wall clock and bytes from the virtio-rng
//! device. Once it reached user space and ticked a few times the VM is
//! paused, snapshotted and dropped; a few seconds later a new VM is
//! restored from the files (with a new rng device) and must go on ticking:
//! the tick counter continues (the output before and after forms one
//! sequence), the guest's monotonic clock continues without jumping over
//! the seconds the snapshot spent on disk (kvmclock restored without
//! `KVM_CLOCK_REALTIME`) and keeps running, the UART's transmit interrupt
//! still drives the tty, and the restored virtio-rng device serves the
//! guest's reads.
//!
//! Where it runs: directly where this host's KVM boots Linux, else the
//! test binary re-runs itself inside the nested-KVM harness
//! (`tests/support/nested.rs`; retried on QEMU TCG SVM emulation faults).
//! `COWORK_NESTED_TESTS=1` makes a missing prerequisite a failure (CI),
//! otherwise it is a loud skip. `COWORK_NESTED_SNAPSHOT_VERBOSE=1` prints
//! the inner run's output.

mod support;

use std::time::{Duration, Instant};

use support::nested;

/// Name of the test (what the nested re-run selects).
const TEST: &str = "linux_guest_goes_on_after_a_restore";
/// Set (to 1) on the re-run inside the nested harness.
const INSIDE_ENV: &str = "COWORK_NESTED_SNAPSHOT_INSIDE";
/// Line the body prints when every check passed.
const OK_MARKER: &str = "nested_snapshot: ok";
/// Prefix of the lines the body reports.
const REPORT_PREFIX: &str = "nested_snapshot: ";
/// Prints the inner run's whole output.
const VERBOSE_ENV: &str = "COWORK_NESTED_SNAPSHOT_VERBOSE";
/// Limit of the inner run (a nested boot at TCG speed, a snapshot, a
/// restore).
const INNER_LIMIT: Duration = Duration::from_secs(600);
/// Limit of the harness run (L1 boot included).
const HARNESS_LIMIT: Duration = Duration::from_secs(720);
/// Attempts inside the harness.
const NESTED_ATTEMPTS: u32 = 3;
/// Limit for the guest to reach user space and tick.
const BOOT_LIMIT: Duration = Duration::from_secs(300);
/// Limit for the restored guest's ticks.
const TICK_LIMIT: Duration = Duration::from_secs(120);
/// Ticks before the pause.
const TICKS_BEFORE: usize = 5;
/// Ticks the restored guest must print.
const TICKS_AFTER: usize = 10;
/// How long the snapshot rests before the restore: a guest clock that
/// jumped over it would show.
const REST: Duration = Duration::from_secs(5);
/// The snapshot's key.
const KEY: &str = "nested-snapshot-test";
/// The printed marker of user space.
const READY: &str = "COWORK-SNAP-READY";

/// One `COWORK-TICK` line.
#[derive(Debug, Clone, PartialEq)]
struct Tick {
    n: u64,
    uptime: f64,
    wall: u64,
    rng: String,
}

fn ticks(text: &str) -> Vec<Tick> {
    text.lines()
        .filter_map(|l| {
            let i = l.find("COWORK-TICK ")?;
            let f: Vec<&str> = l[i..].split_whitespace().collect();
            if f.len() != 5 {
                return None;
            }
            Some(Tick {
                n: f[1].parse().ok()?,
                uptime: f[2].parse().ok()?,
                wall: f[3].parse().ok()?,
                rng: f[4].to_string(),
            })
        })
        .collect()
}

fn config(kernel: &std::path::Path, initrd: &std::path::Path, cap: &Capture) -> vmm::Config {
    let mut c = vmm::Config::new(kernel);
    c.initrd = Some(initrd.to_path_buf());
    c.cmdline = "console=ttyS0 reboot=k panic=-1 pci=off".into();
    c.mem_mib = 256;
    c.vcpus = 2;
    c.serial = Some(Box::new(cap.clone()));
    c.virtio_devices = vec![Box::new(devices::rng::RngDevice::new())];
    c
}

/// A serial sink the test reads while the VM runs.
#[derive(Clone, Default)]
struct Capture(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl Capture {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl std::io::Write for Capture {
    fn write(&mut self, d: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(d);
        Ok(d.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Runs `vm` on a thread until `done(text)` or `limit`, then pauses (or
/// stops) it; returns it, how the run ended and the output.
fn run_until(
    vm: vmm::Vm,
    cap: &Capture,
    limit: Duration,
    pause: bool,
    done: impl Fn(&str) -> bool,
) -> (vmm::Vm, vmm::ExitReason) {
    let (ph, sh) = (vm.pause_handle(), vm.stop_handle());
    let runner = std::thread::spawn(move || {
        let mut vm = vm;
        let r = vm.run();
        (vm, r)
    });
    let deadline = Instant::now() + limit;
    while !done(&cap.text()) && Instant::now() < deadline && !runner.is_finished() {
        std::thread::sleep(Duration::from_millis(20));
    }
    if pause {
        ph.pause();
    } else {
        sh.stop();
    }
    let (vm, r) = runner.join().expect("the VM thread");
    (vm, r.expect("run"))
}

fn body() {
    let kernel = match nested::cached_kernel() {
        Some(k) => k,
        None => nested::fetch_kernel().unwrap_or_else(|e| panic!("no kernel: {e}")),
    };
    let dir = tempfile::tempdir_in(nested::helper_base_dir()).unwrap();
    let initrd = dir.path().join("snapshot-test.img");
    nested::build_initramfs(
        &initrd,
        &nested::script("initramfs/snapshot-test-init"),
        &["virtio_mmio", "virtio_rng"],
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let snap = dir.path().join("snapshot");

    // Boot, let it tick, pause, snapshot.
    let cap = Capture::default();
    let vm = vmm::Vm::build(config(&kernel.vmlinuz, &initrd, &cap)).expect("build");
    let booted = Instant::now();
    let (mut vm, reason) = run_until(vm, &cap, BOOT_LIMIT, true, |t| {
        t.contains(READY) && ticks(t).len() >= TICKS_BEFORE
    });
    let before = cap.text();
    assert_eq!(
        reason,
        vmm::ExitReason::Paused,
        "the guest ended instead of pausing:\n{before}"
    );
    let a = ticks(&before);
    assert!(
        a.len() >= TICKS_BEFORE,
        "the guest did not tick within {BOOT_LIMIT:?}:\n{before}"
    );
    assert!(!before.contains("COWORK-SNAP-ERROR"), "{before}");
    let boot_time = booted.elapsed();
    let info = vm.snapshot(&snap, KEY).expect("snapshot");
    drop(vm);
    std::thread::sleep(REST);

    // Restore and let it tick on.
    let cap = Capture::default();
    let vm = vmm::Vm::restore(config(&kernel.vmlinuz, &initrd, &cap), &snap, KEY).expect("restore");
    let t = vm.timeline().clone();
    let (restored, reason) = run_until(vm, &cap, TICK_LIMIT, false, |t| {
        ticks(t).len() >= TICKS_AFTER
    });
    let after = cap.text();
    let context = format!("--- before ---\n{before}\n--- after ---\n{after}");
    assert_eq!(reason, vmm::ExitReason::Stopped, "{context}");
    assert!(
        !after.contains(READY),
        "the restored guest booted again\n{context}"
    );
    let b = ticks(&after);
    assert!(
        b.len() >= TICKS_AFTER,
        "the restored guest ticked {} times in {TICK_LIMIT:?}\n{context}",
        b.len()
    );

    // One sequence: the tick line cut by the pause, if any, completes in
    // the restored VM's output.
    let all = ticks(&format!("{before}{after}"));
    for w in all.windows(2) {
        assert_eq!(w[1].n, w[0].n + 1, "ticks skipped or repeated\n{context}");
        assert!(w[1].uptime >= w[0].uptime, "uptime went back\n{context}");
    }
    let last = a.last().unwrap();
    let first = b.first().unwrap();
    let gap = first.uptime - last.uptime;
    assert!(
        gap < REST.as_secs_f64() - 1.0,
        "the guest clock jumped {gap:.2} s across a snapshot that rested {REST:?}\n{context}"
    );
    let ran = b.last().unwrap().uptime - first.uptime;
    assert!(
        ran >= 0.2 * (b.len() - 1) as f64 * 0.9,
        "the restored guest's clock does not run ({ran:.2} s over {} ticks)\n{context}",
        b.len()
    );
    assert!(
        b.iter().all(|t| t.rng.len() == 16),
        "the restored virtio-rng device did not serve\n{context}"
    );
    let distinct: std::collections::HashSet<&str> = b.iter().map(|t| t.rng.as_str()).collect();
    assert!(
        distinct.len() > 1,
        "the same random bytes every tick\n{context}"
    );

    println!(
        "{REPORT_PREFIX}boot to {TICKS_BEFORE} ticks {:.1} s; snapshot {:.0} ms ({} KiB state, {} MiB of {} MiB memory written); restore {:.1} ms, first KVM_RUN at {:.1} ms; uptime gap {gap:.2} s and wall clock gap {} s after {REST:?} at rest (the wall clock is the agent's to set); {} ticks after",
        boot_time.as_secs_f64(),
        info.total_time.as_secs_f64() * 1e3,
        info.state_bytes / 1024,
        info.memory_data_bytes >> 20,
        info.memory_bytes >> 20,
        t.build.as_secs_f64() * 1e3,
        restored
            .timeline()
            .first_run
            .map_or(f64::NAN, |d| d.as_secs_f64() * 1e3),
        first.wall.saturating_sub(last.wall),
        b.len(),
    );
    println!("{OK_MARKER}");
}

#[test]
fn linux_guest_goes_on_after_a_restore() {
    nested::run_on_linux_kvm(
        &nested::Rerun {
            test: TEST,
            inside_env: INSIDE_ENV,
            ok_marker: OK_MARKER,
            report_prefix: REPORT_PREFIX,
            verbose_env: VERBOSE_ENV,
            inner_timeout: INNER_LIMIT,
            harness_timeout: HARNESS_LIMIT,
            attempts: NESTED_ATTEMPTS,
        },
        || {
            if nested::cached_kernel().is_none() && !nested::nested_tests_required() {
                Some(format!(
                    "no guest kernel cached in {} (run scripts/fetch-kernel.sh)",
                    nested::guest_cache_dir().display()
                ))
            } else {
                None
            }
        },
        body,
    );
}
