//! The seccomp filters are really on the VM's threads: a tiny guest spins
//! on two vCPUs while the test reads every thread's `Seccomp:` field in
//! `/proc/self/task/*/status` (2 = filter mode). With `Config::seccomp`
//! on, both vCPU threads and the event loop thread are filtered and the
//! thread that called `run()` and the spawner are not; with it off, no
//! thread is and the event loop runs on the caller. Needs `/dev/kvm` (any
//! KVM, PVM included) and binutils, like `kvm_guests`.

mod common;

use std::time::{Duration, Instant};

use common::{build_guest, Capture};
use vmm::machine::EVENT_LOOP_THREAD_NAME;
use vmm::seccomp::{Mode, SPAWNER_THREAD_NAME};
use vmm::{Config, ExitReason, Vm};

/// What the linux64 guest prints once it loops forever (mode `spin`).
const SPINNING: &str = "spinning\n";

/// `(thread name, seccomp mode)` of every thread of this process.
fn threads() -> Vec<(String, u32)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let dir = entry.path();
        let (Ok(comm), Ok(status)) = (
            std::fs::read_to_string(dir.join("comm")),
            std::fs::read_to_string(dir.join("status")),
        ) else {
            continue; // The thread ended meanwhile.
        };
        let mode = status
            .lines()
            .find_map(|l| l.strip_prefix("Seccomp:"))
            .and_then(|v| v.trim().parse().ok())
            .expect("a Seccomp: line");
        out.push((comm.trim().to_string(), mode));
    }
    out
}

/// The seccomp modes of the threads named `name`.
fn modes_of(all: &[(String, u32)], name: &str) -> Vec<u32> {
    all.iter()
        .filter(|(n, _)| n == name)
        .map(|(_, m)| *m)
        .collect()
}

/// Boots the spinning guest on 2 vCPUs with `mode`, snapshots the threads
/// while it spins, stops it; returns the snapshot and the caller's mode.
fn threads_while_running(mode: Mode) -> (Vec<(String, u32)>, u32) {
    let cap = Capture::default();
    let mut c = Config::new(build_guest("linux64"));
    c.cmdline = "spin".into();
    c.mem_mib = 64;
    c.vcpus = 2;
    c.serial = Some(Box::new(cap.clone()));
    c.seccomp = mode;
    let mut vm = Vm::build(c).unwrap();
    let stop = vm.stop_handle();
    let watcher_cap = cap.clone();
    let watcher = std::thread::Builder::new()
        .name("seccomp-watcher".into())
        .spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(20);
            while !watcher_cap.text().contains(SPINNING) {
                assert!(Instant::now() < deadline, "the guest never spun");
                std::thread::sleep(Duration::from_millis(2));
            }
            let seen = threads();
            assert!(stop.stop());
            seen
        })
        .unwrap();
    let caller = std::thread::current()
        .name()
        .unwrap_or_default()
        .to_string();
    let reason = vm.run().unwrap();
    assert_eq!(reason, ExitReason::Stopped, "{}", cap.text());
    let seen = watcher.join().unwrap();
    let caller_mode = modes_of(&threads(), &caller[..caller.len().min(15)]);
    let caller_mode = caller_mode
        .first()
        .copied()
        .expect("the thread that called run() is listed");
    (seen, caller_mode)
}

#[test]
fn vm_threads_run_filtered_unless_seccomp_is_off() {
    let (on, caller) = threads_while_running(Mode::On);
    assert_eq!(modes_of(&on, "vcpu0"), [2], "{on:?}");
    assert_eq!(modes_of(&on, "vcpu1"), [2], "{on:?}");
    assert_eq!(modes_of(&on, EVENT_LOOP_THREAD_NAME), [2], "{on:?}");
    assert_eq!(modes_of(&on, SPAWNER_THREAD_NAME), [0], "{on:?}");
    assert_eq!(modes_of(&on, "seccomp-watcher"), [0], "{on:?}");
    assert_eq!(caller, 0, "the caller of run() must stay unfiltered");

    let (off, caller) = threads_while_running(Mode::Off);
    assert_eq!(modes_of(&off, "vcpu0"), [0], "{off:?}");
    assert_eq!(modes_of(&off, "vcpu1"), [0], "{off:?}");
    assert!(modes_of(&off, EVENT_LOOP_THREAD_NAME).is_empty(), "{off:?}");
    assert_eq!(caller, 0);
}
