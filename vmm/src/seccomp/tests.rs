use std::ffi::CString;

use super::*;
use crate::sync::MutexExt;

/// Runs `f` on a new thread that installed `class`'s filter in `mode`
/// first, and returns what `f` returned.
fn filtered<T: Send + 'static>(
    class: ThreadClass,
    mode: Mode,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    std::thread::spawn(move || {
        Filter::new(class, mode)
            .expect("filter builds")
            .expect("a filter for On/Log")
            .install()
            .expect("filter installs");
        assert_eq!(current(), Some((class, mode)));
        f()
    })
    .join()
    .expect("filtered thread panicked")
}

/// The errno of a raw call's -1 result, or `Ok(value)`.
fn errno_of(rc: libc::c_long) -> Result<libc::c_long, i32> {
    if rc == -1 {
        Err(io::Error::last_os_error().raw_os_error().unwrap_or(0))
    } else {
        Ok(rc)
    }
}

fn close(fd: libc::c_long) {
    // SAFETY: closing an fd this test created.
    unsafe { libc::close(fd as i32) };
}

/// `socket(domain, SOCK_STREAM)`, closing what it got.
fn socket(domain: i32) -> Result<(), i32> {
    // SAFETY: plain syscall with integer arguments.
    let rc = unsafe { libc::syscall(libc::SYS_socket, domain, libc::SOCK_STREAM, 0) };
    errno_of(rc).map(close)
}

/// `execve` of a path that does not exist: ENOENT when allowed.
fn execve_missing() -> i32 {
    let path = CString::new("/nonexistent/cowork-seccomp-test").unwrap();
    let argv: [*const libc::c_char; 1] = [std::ptr::null()];
    // SAFETY: valid NUL-terminated path and empty argv/envp arrays.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_execve,
            path.as_ptr(),
            argv.as_ptr(),
            argv.as_ptr(),
        )
    };
    errno_of(rc).expect_err("execve of a missing file cannot succeed")
}

/// `openat(AT_FDCWD, "/", O_RDONLY|O_DIRECTORY)`, closing what it got.
fn open_root() -> Result<(), i32> {
    let path = CString::new("/").unwrap();
    // SAFETY: valid NUL-terminated path.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_openat,
            libc::AT_FDCWD,
            path.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    errno_of(rc).map(close)
}

/// An anonymous one-page mapping with `prot`, unmapped again.
fn map_page(prot: i32) -> Result<(), i32> {
    // SAFETY: a fresh private anonymous mapping, unmapped below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            prot,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error().raw_os_error().unwrap_or(0));
    }
    // SAFETY: the mapping made above.
    unsafe { libc::munmap(p, 4096) };
    Ok(())
}

#[test]
fn every_class_builds_in_every_filtering_mode() {
    for class in ThreadClass::ALL {
        for mode in [Mode::On, Mode::Log] {
            let f = Filter::new(class, mode).unwrap().unwrap();
            assert_eq!(f.class(), class);
            assert!(!f.program.is_empty());
        }
        assert!(Filter::new(class, Mode::Off).unwrap().is_none());
    }
}

#[test]
fn every_entry_says_why_and_no_class_allows_process_creation_or_ip() {
    for class in ThreadClass::ALL {
        for group in class.groups() {
            for entry in group.iter() {
                assert!(!entry.why.trim().is_empty(), "{} has no reason", entry.name);
            }
        }
        let names = allowed_syscalls(class);
        for forbidden in [
            "execve",
            "execveat",
            "fork",
            "vfork",
            "clone",
            "clone3",
            "ptrace",
            "mount",
            "bind",
            "listen",
            "kill",
            "process_vm_writev",
            "init_module",
            "bpf",
        ] {
            assert!(
                !names.contains(&forbidden),
                "{} allows {forbidden}",
                class.name()
            );
        }
    }
    assert!(allowed_syscalls(ThreadClass::FsWorker).contains(&"openat"));
    assert!(!allowed_syscalls(ThreadClass::DeviceWorker).contains(&"openat"));
    assert!(!allowed_syscalls(ThreadClass::Vcpu).contains(&"openat"));
}

#[test]
fn modes_parse() {
    assert_eq!("on".parse::<Mode>().unwrap(), Mode::On);
    assert_eq!(" OFF ".parse::<Mode>().unwrap(), Mode::Off);
    assert_eq!("log".parse::<Mode>().unwrap(), Mode::Log);
    assert_eq!("0".parse::<Mode>().unwrap(), Mode::Off);
    let e = "maybe".parse::<Mode>().unwrap_err().to_string();
    assert!(e.contains("on, off or log"), "{e}");
    assert_eq!(Mode::default(), Mode::On);
}

#[test]
fn unfiltered_thread_reaches_the_kernel() {
    // The baseline the refusals below are measured against.
    assert_eq!(execve_missing(), libc::ENOENT);
    assert_eq!(socket(libc::AF_INET), Ok(()));
    assert_eq!(current(), None);
}

#[test]
fn every_class_refuses_execve_and_ip_sockets_but_runs_std() {
    for class in ThreadClass::ALL {
        let (exec, inet, alloc, log) = filtered(class, Mode::On, || {
            // Allowed: allocation, thread-local hash keys, a pipe-less write
            // to stderr (an empty write), a futex through a mutex.
            let v: Vec<u8> = vec![7; 1 << 20];
            let m = std::sync::Mutex::new(std::collections::HashMap::<u8, usize>::new());
            m.lock().unwrap().insert(1, v.len());
            // SAFETY: a zero-length write to stderr.
            let rc = unsafe { libc::write(2, std::ptr::null(), 0) };
            (execve_missing(), socket(libc::AF_INET), v.len(), rc)
        });
        assert_eq!(exec, libc::EPERM, "{}: execve", class.name());
        assert_eq!(inet, Err(libc::EPERM), "{}: socket(AF_INET)", class.name());
        assert_eq!(alloc, 1 << 20);
        assert_eq!(log, 0, "{}: write to stderr", class.name());
    }
}

#[test]
fn no_class_maps_executable_memory() {
    for class in ThreadClass::ALL {
        let (rw, rx) = filtered(class, Mode::On, || {
            (
                map_page(libc::PROT_READ | libc::PROT_WRITE),
                map_page(libc::PROT_READ | libc::PROT_EXEC),
            )
        });
        assert_eq!(rw, Ok(()), "{}", class.name());
        assert_eq!(rx, Err(libc::EPERM), "{}", class.name());
    }
}

#[test]
fn vcpu_ioctls_are_kvm_run_only() {
    let (run, create_vm) = filtered(ThreadClass::Vcpu, Mode::On, || {
        // On fd -1 an allowed request fails in the kernel with EBADF.
        // SAFETY: ioctl on an invalid fd touches no memory.
        let run = errno_of(unsafe { libc::syscall(libc::SYS_ioctl, -1, KVM_RUN, 0) });
        // KVM_CREATE_VM (_IO(0xAE, 0x01)) is not a vCPU's business.
        // SAFETY: as above.
        let create = errno_of(unsafe { libc::syscall(libc::SYS_ioctl, -1, 0xAE01u64, 0) });
        (run, create)
    });
    assert_eq!(run, Err(libc::EBADF));
    assert_eq!(create_vm, Err(libc::EPERM));
}

#[test]
fn only_the_fs_worker_opens_files() {
    assert_eq!(filtered(ThreadClass::FsWorker, Mode::On, open_root), Ok(()));
    assert_eq!(
        filtered(ThreadClass::VhostUser, Mode::On, open_root),
        Ok(())
    );
    for class in [
        ThreadClass::Vcpu,
        ThreadClass::EventLoop,
        ThreadClass::DeviceWorker,
    ] {
        assert_eq!(
            filtered(class, Mode::On, open_root),
            Err(libc::EPERM),
            "{}",
            class.name()
        );
    }
}

#[test]
fn vsock_workers_get_unix_sockets_only() {
    let (unix, inet, inet6) = filtered(ThreadClass::DeviceWorker, Mode::On, || {
        (
            socket(libc::AF_UNIX),
            socket(libc::AF_INET),
            socket(libc::AF_INET6),
        )
    });
    assert_eq!(unix, Ok(()));
    assert_eq!(inet, Err(libc::EPERM));
    assert_eq!(inet6, Err(libc::EPERM));
    let pair = filtered(ThreadClass::DeviceWorker, Mode::On, || {
        std::os::unix::net::UnixStream::pair()
            .map(|_| ())
            .map_err(|e| e.raw_os_error())
    });
    assert_eq!(pair, Ok(()));
}

#[test]
fn fcntl_is_for_dups_and_flags_only() {
    for class in ThreadClass::ALL {
        // Opened here: most classes may not open files.
        let file = tempfile::tempfile().unwrap();
        let (flags, dup, lease, owner, lock) = filtered(class, Mode::On, move || {
            let fd = std::os::fd::AsRawFd::as_raw_fd(&file);
            // SAFETY: fcntl on a file this closure owns; a lock struct that
            // lives across the call.
            unsafe {
                let flags = errno_of(libc::fcntl(fd, libc::F_GETFL).into());
                let dup = errno_of(libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3).into());
                if let Ok(new) = dup {
                    close(new);
                }
                let lease = errno_of(libc::fcntl(fd, libc::F_SETLEASE, libc::F_RDLCK).into());
                let owner = errno_of(libc::fcntl(fd, libc::F_SETOWN, 1).into());
                let mut lk: libc::flock = std::mem::zeroed();
                lk.l_type = libc::F_RDLCK as i16;
                let lock = errno_of(libc::fcntl(fd, libc::F_GETLK, &mut lk).into());
                (flags, dup.map(|_| ()), lease, owner, lock)
            }
        });
        assert!(flags.is_ok(), "{class:?}: F_GETFL {flags:?}");
        assert_eq!(dup, Ok(()), "{class:?}: F_DUPFD_CLOEXEC");
        for (what, got) in [
            ("F_SETLEASE", lease),
            ("F_SETOWN", owner),
            ("F_GETLK", lock),
        ] {
            assert_eq!(got, Err(libc::EPERM), "{class:?}: {what}");
        }
    }
}

#[test]
fn tgkill_stays_inside_the_process() {
    let (own, other) = filtered(ThreadClass::EventLoop, Mode::On, || {
        let pid = std::process::id() as libc::c_long;
        // SAFETY: signal 0 only checks that the target exists.
        let own = errno_of(unsafe {
            libc::syscall(libc::SYS_tgkill, pid, libc::syscall(libc::SYS_gettid), 0)
        });
        // pid 1's main thread: refused by the filter before any check.
        // SAFETY: as above.
        let other = errno_of(unsafe { libc::syscall(libc::SYS_tgkill, 1, 1, 0) });
        (own, other)
    });
    assert_eq!(own, Ok(0));
    assert_eq!(other, Err(libc::EPERM));
}

#[test]
fn log_mode_allows_what_on_refuses() {
    let exec = filtered(ThreadClass::Vcpu, Mode::Log, execve_missing);
    assert_eq!(exec, libc::ENOENT);
}

#[test]
fn a_filtered_thread_spawns_unfiltered_threads_through_the_spawner() {
    start_spawner().unwrap();
    let (inner_exec, inner_current) = filtered(ThreadClass::Vcpu, Mode::On, || {
        let h = spawn_unfiltered(std::thread::Builder::new().name("child".into()), || {
            (execve_missing(), current())
        })
        .expect("spawn through the spawner");
        h.join().unwrap()
    });
    assert_eq!(inner_exec, libc::ENOENT);
    assert_eq!(inner_current, None);
}

#[test]
fn the_spawner_refuses_to_start_on_a_filtered_thread() {
    // A fresh slot is not available per test; check the guard directly.
    let r = filtered(ThreadClass::Vcpu, Mode::On, || {
        let slot = spawner().locked();
        let running = slot.is_some();
        drop(slot);
        (running, start_spawner())
    });
    match r {
        // Already running (another test started it): nothing to create.
        (true, res) => assert!(res.is_ok()),
        (false, res) => assert!(matches!(res, Err(SeccompError::SpawnerFiltered))),
    }
}
