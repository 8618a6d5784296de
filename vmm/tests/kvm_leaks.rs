//! After `Vm::run` returns, every vCPU thread is joined and every fd the VM
//! owned is closed. Alone in its own test binary so no concurrent test
//! changes the process's fd and thread counts.

mod common;

use vmm::{Config, ExitReason, Vm};

fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
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
