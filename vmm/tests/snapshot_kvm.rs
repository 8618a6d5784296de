//! Snapshot and restore on this host's KVM with tiny guests (PVM is fine:
//! they are not Linux): `tests/guests/counter.s` counts in its memory and
//! prints every number on COM1; it is paused, snapshotted, the VM dropped,
//! and restored from the files into new `Vm`s, which must go on with the
//! next number (the outputs before and after form one unbroken sequence),
//! without copying guest memory (the restored VM's resident guest memory
//! stays near what it touches, far below the 64 MiB the snapshot holds).
//! The C guest of `virtio_kvm.rs` in its loop mode checks that a virtio
//! queue, its interrupt and the device's state survive the same trip. Bad
//! snapshots are refused with their own errors.
//!
//! Needs `/dev/kvm` and binutils (gcc for the virtio guest).

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{build_guest, hex, Capture};
use vmm::snapshot::file::StateFileError;
use vmm::snapshot::SnapshotError;
use vmm::{Config, ExitReason, Vm};

/// The key the tests take their snapshots with.
const KEY: &str = "snapshot-test key v1";
/// Guest RAM of the counting guest (its fill mode needs 96 MiB).
const MEM_MIB: u64 = 128;
/// Lines a guest prints before the tests pause or stop it.
const LINES: usize = 40;
/// How long a guest gets to print them (this host is shared and slow).
const LIMIT: Duration = Duration::from_secs(120);

fn counter_config(mode: &str, cap: &Capture) -> Config {
    let mut c = Config::new(build_guest("counter"));
    c.cmdline = mode.to_string();
    c.mem_mib = MEM_MIB;
    c.vcpus = 1;
    c.serial = Some(Box::new(cap.clone()));
    c
}

/// The numbers of the complete `count 0x...` lines of `text`, in order.
fn counts(text: &str) -> Vec<u64> {
    text.lines()
        .filter_map(|l| l.strip_prefix("count "))
        .filter(|h| h.len() == 18)
        .map(hex)
        .collect()
}

/// Asserts `v` is a run of consecutive numbers.
fn assert_consecutive(v: &[u64], what: &str) {
    for w in v.windows(2) {
        assert_eq!(w[1], w[0] + 1, "{what}: {} then {}", w[0], w[1]);
    }
}

/// Runs `vm` on a thread until `cap` holds `lines` count lines more than
/// `base`, then pauses it; returns the run's result.
fn run_until_then_pause(vm: Vm, cap: &Capture, base: usize, lines: usize) -> (Vm, ExitReason) {
    let pause = vm.pause_handle();
    let runner = std::thread::spawn(move || {
        let mut vm = vm;
        let r = vm.run().expect("run");
        (vm, r)
    });
    let deadline = Instant::now() + LIMIT;
    while counts(&cap.text()).len() < base + lines {
        assert!(
            Instant::now() < deadline,
            "the guest printed too little: {}",
            cap.text()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(pause.pause());
    runner.join().unwrap()
}

/// Resident bytes of the mappings overlapping guest memory (smaps `Rss`).
fn guest_rss(mem: &vmm::memory::GuestMemory) -> u64 {
    use vm_memory::{GuestMemory as _, GuestMemoryRegion as _};
    let ranges: Vec<(u64, u64)> = mem
        .iter()
        .map(|r| (r.as_ptr() as u64, r.as_ptr() as u64 + r.len()))
        .collect();
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut total = 0;
    let mut inside = false;
    for line in smaps.lines() {
        if let Some((range, _)) = line.split_once(' ') {
            if let Some((a, b)) = range.split_once('-') {
                if let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) {
                    inside = ranges.iter().any(|&(s, e)| a < e && s < b);
                    continue;
                }
            }
        }
        if inside {
            if let Some(kb) = line.strip_prefix("Rss:") {
                total += kb
                    .trim()
                    .trim_end_matches(" kB")
                    .trim()
                    .parse::<u64>()
                    .unwrap()
                    * 1024;
            }
        }
    }
    total
}

/// Takes a snapshot of a counting guest that filled 64 MiB first, and
/// returns the directory and what was printed before the pause.
fn counting_snapshot(dir: &Path) -> (String, vmm::SnapshotInfo) {
    let cap = Capture::default();
    let vm = Vm::build(counter_config("f", &cap)).unwrap();
    let (mut vm, reason) = run_until_then_pause(vm, &cap, 0, LINES);
    assert_eq!(reason, ExitReason::Paused, "{}", cap.text());
    assert!(vm.guest_memory().is_some(), "a paused VM keeps its memory");
    let info = vm.snapshot(dir, KEY).expect("snapshot");
    drop(vm);
    (cap.text(), info)
}

#[test]
fn a_restored_guest_counts_on_where_it_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let snap = dir.path().join("snap");
    let (before, info) = counting_snapshot(&snap);
    assert!(before.starts_with("filled\n"), "{before}");
    let last = *counts(&before).last().unwrap();
    assert_consecutive(&counts(&before), "before the snapshot");

    // The files: 0600, the memory file sparse (64 MiB of data in 128 MiB).
    use std::os::unix::fs::PermissionsExt;
    for f in [&info.state_file, &info.memory_file] {
        let mode = std::fs::metadata(f).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{}", f.display());
    }
    assert_eq!(info.memory_bytes, MEM_MIB << 20);
    assert!(info.memory_data_bytes >= 64 << 20, "{info:?}");
    assert!(info.memory_data_bytes < 72 << 20, "{info:?}");
    assert!(info.memory_disk_bytes < 96 << 20, "not sparse: {info:?}");
    let names: Vec<String> = std::fs::read_dir(&snap)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");

    // Two restores of the same snapshot both go on from `last`.
    for round in 0..2 {
        let cap = Capture::default();
        let mut vm = Vm::restore(counter_config("f", &cap), &snap, KEY).expect("restore");
        let t = vm.timeline().clone();
        let phases = t.restore.clone().expect("restore phases");
        assert!(t.entry.is_none());
        let mem = vm.guest_memory().unwrap().clone();
        // Nothing of the 64 MiB is resident yet.
        let rss_restored = guest_rss(&mem);
        assert!(
            rss_restored < 1 << 20,
            "round {round}: {rss_restored} bytes resident after restore"
        );

        let stop = vm.stop_handle();
        let cap2 = cap.clone();
        let stopper = std::thread::spawn(move || {
            let deadline = Instant::now() + LIMIT;
            while counts(&cap2.text()).len() < LINES && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(2));
            }
            stop.stop();
        });
        let reason = vm.run().unwrap();
        stopper.join().unwrap();
        assert_eq!(reason, ExitReason::Stopped, "{}", cap.text());
        let after = cap.text();
        assert!(
            !after.contains("filled"),
            "the restored guest started over: {after}"
        );
        let joined = counts(&format!("{before}{after}"));
        assert_consecutive(&joined, &format!("round {round}, across the snapshot"));
        assert!(joined.len() >= counts(&before).len() + LINES - 1);
        assert!(counts(&after).iter().all(|&n| n > last));
        // The guest ran without touching the filled 64 MiB: it stayed on
        // disk (in the page cache at most), not in this process.
        let rss_run = guest_rss(&mem);
        assert!(
            rss_run < 4 << 20,
            "round {round}: {rss_run} bytes of guest memory resident after running"
        );
        let first_run = vm.timeline().first_run.expect("first KVM_RUN");
        eprintln!(
            "restore round {round}: {:.3} ms to first KVM_RUN (state {:?}, kvm {:?}, memory {:?}, vcpus {:?}, vm {:?}, devices {:?}); guest RSS {} KiB after restore, {} KiB after {} lines",
            first_run.as_secs_f64() * 1e3,
            phases.state,
            phases.kvm,
            phases.memory,
            phases.vcpus,
            phases.vm,
            phases.devices,
            rss_restored >> 10,
            rss_run >> 10,
            counts(&after).len()
        );
    }
}

#[test]
fn a_paused_vm_resumes_after_its_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let cap = Capture::default();
    let vm = Vm::build(counter_config("c", &cap)).unwrap();
    let (mut vm, reason) = run_until_then_pause(vm, &cap, 0, LINES);
    assert_eq!(reason, ExitReason::Paused);
    vm.snapshot(dir.path(), KEY).unwrap();
    let n = counts(&cap.text()).len();
    // Resume, pause again without a snapshot, resume again.
    let (vm, reason) = run_until_then_pause(vm, &cap, n, LINES);
    assert_eq!(reason, ExitReason::Paused);
    let n = counts(&cap.text()).len();
    let (mut vm, reason) = run_until_then_pause(vm, &cap, n, LINES);
    assert_eq!(reason, ExitReason::Paused);
    // A second snapshot into the same directory replaces the first.
    vm.snapshot(dir.path(), KEY).unwrap();
    let files = std::fs::read_dir(dir.path()).unwrap().count();
    assert_eq!(files, 2, "the old memory file is gone");
    let stop = vm.stop_handle();
    stop.stop();
    assert_eq!(vm.run().unwrap(), ExitReason::Stopped);
    assert!(vm.guest_memory().is_none());
    assert!(matches!(
        vm.snapshot(dir.path(), KEY),
        Err(SnapshotError::NotPaused(_))
    ));
    let all = counts(&cap.text());
    assert_consecutive(&all, "across two pauses");
    assert!(all.len() >= 3 * LINES);
}

#[test]
fn bad_snapshots_are_refused_with_their_error() {
    let dir = tempfile::tempdir().unwrap();
    let snap = dir.path().join("snap");
    let cap = Capture::default();
    let vm = Vm::build(counter_config("c", &cap)).unwrap();
    let (mut vm, _) = run_until_then_pause(vm, &cap, 0, 10);
    vm.snapshot(&snap, KEY).unwrap();
    drop(vm);
    let state = snap.join(vmm::snapshot::STATE_FILE);
    let good = std::fs::read(&state).unwrap();
    let restore = |mode: &str, mem: u64, key: &str| {
        let mut c = counter_config(mode, &Capture::default());
        c.mem_mib = mem;
        Vm::restore(c, &snap, key).map(|_| ())
    };
    assert!(restore("c", MEM_MIB, KEY).is_ok());

    // Another key, another command line, another memory size.
    assert!(matches!(
        restore("c", MEM_MIB, "another machine"),
        Err(SnapshotError::StateFile(StateFileError::ForeignKey { .. }))
    ));
    assert!(matches!(
        restore("c and more", MEM_MIB, KEY),
        Err(SnapshotError::Shape {
            what: "command line",
            ..
        })
    ));
    assert!(matches!(
        restore("c", 256, KEY),
        Err(SnapshotError::Shape {
            what: "memory (MiB)",
            ..
        })
    ));
    // Truncated, bit-flipped, an older format.
    std::fs::write(&state, &good[..good.len() / 2]).unwrap();
    assert!(matches!(
        restore("c", MEM_MIB, KEY),
        Err(SnapshotError::StateFile(StateFileError::Truncated { .. }))
    ));
    let mut flipped = good.clone();
    let at = flipped.len() - 100;
    flipped[at] ^= 0x10;
    std::fs::write(&state, &flipped).unwrap();
    assert!(matches!(
        restore("c", MEM_MIB, KEY),
        Err(SnapshotError::StateFile(StateFileError::Corrupt { .. }))
    ));
    let mut older = good.clone();
    older[8..12].copy_from_slice(&0u32.to_le_bytes());
    std::fs::write(&state, &older).unwrap();
    assert!(matches!(
        restore("c", MEM_MIB, KEY),
        Err(SnapshotError::StateFile(StateFileError::OlderFormat { .. }))
    ));
    // A truncated memory file.
    std::fs::write(&state, &good).unwrap();
    let mem_file = std::fs::read_dir(&snap)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with("memory-")
        })
        .unwrap();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&mem_file)
        .unwrap();
    f.set_len((MEM_MIB << 20) - 4096).unwrap();
    assert!(matches!(
        restore("c", MEM_MIB, KEY),
        Err(SnapshotError::Memory(
            vmm::memory::MemoryError::SnapshotSize { .. }
        ))
    ));
    // No snapshot at all.
    assert!(matches!(
        Vm::restore(
            counter_config("c", &Capture::default()),
            &dir.path().join("none"),
            KEY
        ),
        Err(SnapshotError::StateFile(StateFileError::Io { .. }))
    ));
}

/// Runs `vm` on a thread until `done` says the output is complete (or the
/// limit passes), then pauses or stops it.
fn run_until(
    vm: Vm,
    cap: &Capture,
    limit: Duration,
    done: impl Fn(&str) -> bool,
    pause: bool,
) -> (Vm, ExitReason) {
    let (ph, sh) = (vm.pause_handle(), vm.stop_handle());
    let finished = Arc::new(AtomicBool::new(false));
    let f2 = finished.clone();
    let runner = std::thread::spawn(move || {
        let mut vm = vm;
        let r = vm.run().expect("run");
        f2.store(true, Ordering::SeqCst);
        (vm, r)
    });
    let deadline = Instant::now() + limit;
    while !done(&cap.text()) && Instant::now() < deadline && !finished.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(2));
    }
    if pause {
        ph.pause();
    } else {
        sh.stop();
    }
    runner.join().unwrap()
}

/// The numbers of the `virtio-loop n=0x...` lines.
fn loops(text: &str) -> Vec<u64> {
    text.lines()
        .filter_map(|l| l.strip_prefix("virtio-loop n="))
        .filter(|h| h.len() > 2)
        .map(hex)
        .collect()
}

#[test]
fn a_virtqueue_in_use_survives_a_snapshot() {
    use vmm::virtio::testdev::PatternDevice;
    let dir = tempfile::tempdir().unwrap();
    let config = |cap: &Capture| {
        let mut c = Config::new(common::build_c_guest());
        c.cmdline = "loop".into();
        c.mem_mib = 64;
        c.serial = Some(Box::new(cap.clone()));
        c.virtio_devices = vec![Box::new(PatternDevice::new(vec![8]))];
        c
    };
    let cap = Capture::default();
    let vm = Vm::build(config(&cap)).unwrap();
    let (mut vm, reason) = run_until(vm, &cap, LIMIT, |t| loops(t).len() >= LINES, true);
    let before = cap.text();
    assert_eq!(reason, ExitReason::Paused, "{before}");
    assert!(!before.contains("FAIL"), "{before}");
    vm.snapshot(dir.path(), KEY).unwrap();
    drop(vm);

    let cap = Capture::default();
    let vm = Vm::restore(config(&cap), dir.path(), KEY).unwrap();
    let (_vm, reason) = run_until(vm, &cap, LIMIT, |t| loops(t).len() >= LINES, false);
    let after = cap.text();
    assert_eq!(reason, ExitReason::Stopped, "{after}");
    assert!(!after.contains("FAIL"), "{after}");
    let joined = loops(&format!("{before}{after}"));
    assert_consecutive(&joined, "virtio loop across the snapshot");
    assert!(loops(&after).len() >= LINES, "{after}");
}
