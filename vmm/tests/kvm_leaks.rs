//! After `Vm::run` returns, every vCPU thread is joined and every fd the VM
//! owned is closed; while it runs, none of its fds would leak into a child
//! process (all are close-on-exec). Alone in its own test binary so no
//! other test binary changes the process's fd and thread counts, and its
//! tests take turns.

mod common;

use std::collections::BTreeSet;

use vmm::sync::MutexExt;
use vmm::virtio::testdev::PatternDevice;
use vmm::{Config, ExitReason, Vm};

/// The tests of this binary count the whole process's fds and threads: one
/// at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The process's open fd numbers (the listing's own fd included).
fn fd_set() -> BTreeSet<i32> {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

fn fds() -> usize {
    fd_set().len()
}

/// Whether `fd` is closed on exec, or `None` once it is closed (the
/// directory listing itself is such an fd).
fn cloexec(fd: i32) -> Option<bool> {
    // SAFETY: F_GETFD only reads the descriptor's flags.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    (flags >= 0).then_some(flags & libc::FD_CLOEXEC != 0)
}

fn threads() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| {
            l.strip_prefix("Threads:")
                .map(|v| v.trim().parse::<usize>().unwrap())
        })
        .unwrap()
}

/// `(fds(), threads())` once it equals `want`, or after a second. A joined
/// thread is still counted for a moment while the kernel finishes its exit
/// (the join returns when its tid is cleared, before it is released), and
/// the VMM's event loop thread is joined just before `run()` returns.
fn settled(want: (usize, usize)) -> (usize, usize) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
    loop {
        let now = (fds(), threads());
        if now == want || std::time::Instant::now() > deadline {
            return now;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

fn boot(cpus: u8, cmdline: &str) -> ExitReason {
    let mut c = Config::new(common::build_guest("linux64"));
    c.cmdline = cmdline.into();
    c.mem_mib = 64;
    c.vcpus = cpus;
    c.serial = Some(Box::new(common::Capture::default()));
    Vm::build(c).unwrap().run().unwrap()
}

#[test]
fn no_fd_or_thread_survives_a_run() {
    let _alone = ONE_AT_A_TIME.locked();
    // Warm up: guest build, one-time signal handler installation.
    assert_eq!(boot(1, "quiet"), ExitReason::Reset);
    std::thread::sleep(std::time::Duration::from_millis(100));
    let (f0, t0) = (fds(), threads());
    for cpus in [1, 2, 3] {
        assert_eq!(boot(cpus, "quiet"), ExitReason::Reset);
        assert_eq!(settled((f0, t0)), (f0, t0), "after a {cpus}-vCPU run");
    }
    // Also after a host stop and a guest error.
    let mut c = Config::new(common::build_guest("linux64"));
    c.cmdline = "halt".into();
    c.vcpus = 2;
    c.mem_mib = 64;
    let mut vm = Vm::build(c).unwrap();
    let h = vm.stop_handle();
    let t = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(100));
        h.stop()
    });
    assert_eq!(vm.run().unwrap(), ExitReason::Stopped);
    assert!(t.join().unwrap());
    drop(vm);
    assert!(matches!(boot(1, "ud2"), ExitReason::GuestError(_)));
    assert_eq!(settled((f0, t0)), (f0, t0));
}

#[test]
fn every_fd_of_a_running_vm_is_close_on_exec() {
    let _alone = ONE_AT_A_TIME.locked();
    let before = fd_set();
    let mut c = Config::new(common::build_guest("linux64"));
    c.cmdline = "halt".into();
    c.vcpus = 2;
    c.mem_mib = 64;
    c.serial = Some(Box::new(common::Capture::default()));
    // Two virtio-mmio transports: their queue-notify and interrupt eventfds.
    c.virtio_devices = vec![
        Box::new(PatternDevice::new(vec![8])),
        Box::new(PatternDevice::new(vec![16, 16])),
    ];
    let mut vm = Vm::build(c).unwrap();
    let h = vm.stop_handle();
    let t = std::thread::spawn(move || {
        // Long enough for the vCPU threads and the event loop to be up.
        std::thread::sleep(std::time::Duration::from_millis(300));
        let new: Vec<i32> = fd_set().difference(&before).copied().collect();
        let open: Vec<(i32, String)> = new
            .iter()
            .filter(|&&fd| cloexec(fd) == Some(false))
            .map(|&fd| {
                let target = std::fs::read_link(format!("/proc/self/fd/{fd}"))
                    .map(|p| p.display().to_string())
                    .unwrap_or_default();
                (fd, target)
            })
            .collect();
        assert!(h.stop());
        (new.len(), open)
    });
    assert_eq!(vm.run().unwrap(), ExitReason::Stopped);
    let (new, inherited) = t.join().unwrap();
    // kvm, vm, vCPUs, eventfds for the devices, the event loop's epoll...
    assert!(new >= 8, "only {new} new fds while the VM ran");
    assert!(
        inherited.is_empty(),
        "fds a child process would inherit: {inherited:?}"
    );
}

/// Builds a counting guest with a virtio device, runs it until it printed
/// `lines` lines, pauses it, snapshots it into `dir` and drops it.
fn snapshot_into(dir: &std::path::Path) {
    let cap = common::Capture::default();
    let mut vm = Vm::build(counter_config(&cap)).unwrap();
    let p = vm.pause_handle();
    let cap2 = cap.clone();
    let t = std::thread::spawn(move || {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
        while !cap2.text().contains("count 0x0000000000000005")
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        p.pause()
    });
    assert_eq!(vm.run().unwrap(), ExitReason::Paused);
    assert!(t.join().unwrap());
    vm.snapshot(dir, KEY).unwrap();
}

/// The key of this binary's snapshots.
const KEY: &str = "leak-test";

fn counter_config(cap: &common::Capture) -> Config {
    let mut c = Config::new(common::build_guest("counter"));
    c.cmdline = "c".into();
    c.mem_mib = 64;
    c.vcpus = 2;
    c.serial = Some(Box::new(cap.clone()));
    c.virtio_devices = vec![Box::new(PatternDevice::new(vec![8]))];
    c
}

/// Rewrites the snapshot in `dir` with `change` applied to its state (a
/// well-formed file with the right key and checksum).
fn alter(dir: &std::path::Path, change: impl FnOnce(&mut vmm::snapshot::VmState)) {
    use vmm::snapshot::{file, FORMAT_VERSION, STATE_FILE};
    let path = dir.join(STATE_FILE);
    let body = file::read(&path, FORMAT_VERSION, KEY).unwrap();
    let mut state: vmm::snapshot::VmState = file::decode_body(&path, &body).unwrap();
    change(&mut state);
    let body = file::encode_body(&state).unwrap();
    std::fs::write(&path, file::encode(KEY, FORMAT_VERSION, &body).unwrap()).unwrap();
}

#[test]
fn restores_good_or_failed_leave_no_fd_or_thread_behind() {
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    snapshot_into(dir.path());
    let good = std::fs::read(dir.path().join(vmm::snapshot::STATE_FILE)).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(100));
    let (f0, t0) = (fds(), threads());

    // A restore that runs and is stopped.
    let cap = common::Capture::default();
    let mut vm = Vm::restore(counter_config(&cap), dir.path(), KEY).unwrap();
    let h = vm.stop_handle();
    let t = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(200));
        h.stop()
    });
    assert_eq!(vm.run().unwrap(), ExitReason::Stopped);
    assert!(t.join().unwrap());
    drop(vm);
    assert!(
        cap.text().contains("count 0x0000000000000006"),
        "{}",
        cap.text()
    );
    assert_eq!(settled((f0, t0)), (f0, t0), "after a restored run");

    let restore = || Vm::restore(counter_config(&common::Capture::default()), dir.path(), KEY);
    // Refused before anything is built: another key.
    assert!(Vm::restore(
        counter_config(&common::Capture::default()),
        dir.path(),
        "other"
    )
    .is_err());
    // Refused by KVM after the VM, its memory and its vCPUs exist: an
    // impossible CR0 (paging without protection) in vCPU 1's SREGS
    // (offset 224 of `kvm_sregs`, after 8 segments and 2 tables).
    alter(dir.path(), |s| {
        s.vcpu_states[1].sregs[224..232].copy_from_slice(&0x8000_0000u64.to_le_bytes());
    });
    match restore() {
        Err(vmm::SnapshotError::Kvm(e)) => {
            assert!(e.to_string().contains("KVM_SET_SREGS on vCPU 1"), "{e}")
        }
        other => panic!("expected KVM_SET_SREGS to fail: {other:?}"),
    }
    assert_eq!(settled((f0, t0)), (f0, t0), "after a failed KVM restore");
    // Refused at the last step, the devices: a queue of another size.
    std::fs::write(dir.path().join(vmm::snapshot::STATE_FILE), &good).unwrap();
    alter(dir.path(), |s| s.devices[0].queues[0].max_size = 16);
    assert!(matches!(restore(), Err(vmm::SnapshotError::Shape { .. })));
    alter(dir.path(), |s| {
        s.devices[0].queues[0].max_size = 8;
        s.devices[0].status = 0xff;
    });
    assert!(matches!(
        restore(),
        Err(vmm::SnapshotError::Transport { slot: 0, .. })
    ));
    assert_eq!(settled((f0, t0)), (f0, t0), "after failed device restores");
    // A memory file of the wrong size.
    std::fs::write(dir.path().join(vmm::snapshot::STATE_FILE), &good).unwrap();
    let mem = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().contains("memory-"))
        .unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&mem)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    assert!(matches!(restore(), Err(vmm::SnapshotError::Memory(_))));
    assert_eq!(settled((f0, t0)), (f0, t0), "after a short memory file");
}
