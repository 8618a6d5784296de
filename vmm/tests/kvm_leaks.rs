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
