//! Tests of the QEMU backend: its command line, sizes, console and
//! runtime directory, and starts against a stand-in QEMU (a shell script).

use super::*;
use crate::backend::console::{CONSOLE_TAIL, MAX_CONSOLE_LINE};
use crate::backend::guest::POWEROFF_DEADLINE;
use crate::backend::userland::RootDisk;
use crate::hostfs::HostEnv;
use machine::pump_console;
use rundir::sweep_stale_run_dirs;
use std::ffi::OsString;
use std::os::unix::fs::PermissionsExt;
use std::time::Instant;

fn no_userland() -> UserlandPlan {
    UserlandPlan {
        disks: Vec::new(),
        expected: userland::UserlandKind::Initramfs,
        strict: false,
        skipped: Vec::new(),
    }
}

/// Starts `plan` with default boot options (shared folders, seccomp on), no
/// root disk and the production egress proxy.
async fn start_plain(plan: QemuPlan, run_dir: RunDir) -> Result<Booted, QemuError> {
    start(
        plan,
        run_dir,
        "test",
        &BootOptions::default(),
        &no_userland(),
        &crate::egress::EgressProxy::direct(),
        Start::Cold,
    )
    .await
}

fn plan(accel: Accel, socket: &str) -> QemuPlan {
    QemuPlan {
        qemu: "/usr/bin/qemu-system-x86_64".into(),
        image: GuestImage {
            dir: "/img".into(),
            vmlinuz: "/img/vmlinuz".into(),
            initramfs: "/img/initramfs".into(),
            rootfs: None,
            template_console: true,
        },
        accel,
        memory_mib: 1024,
        cpus: 2,
        vsock_socket: socket.into(),
        fs_socket: Path::new(socket).with_file_name("fs.sock"),
        blk_socket: Path::new(socket).with_file_name("blk.sock"),
        rng_socket: Path::new(socket).with_file_name("rng.sock"),
        session_disk: "/data/sessiondata.img".into(),
        root_disks: Vec::new(),
        extra_cmdline: vec!["COWORK_LOG=debug".into()],
        layout: Layout::Full,
    }
}

/// The boot snapshot's layout: only what QEMU migrates is on the command
/// line, the RAM is the helper's memfd by its procfs path, QMP listens,
/// the agent is asked for its template point on the console; a restore
/// starts paused and waits for the state.
#[test]
fn migratable_command_line() {
    let mut p = plan(Accel::Tcg, "/run/x/vsock.sock");
    p.layout = Layout::Migratable {
        ram_fd: 17,
        qmp: "/run/x,y/qmp.sock".into(),
        incoming: false,
    };
    let a = p.args();
    assert_eq!(
        values(&a, "-object"),
        ["memory-backend-file,id=mem,size=1024M,share=on,mem-path=/proc/self/fd/17"]
    );
    assert_eq!(
        values(&a, "-qmp"),
        ["unix:/run/x,,y/qmp.sock,server=on,wait=off"]
    );
    assert_eq!(
        values(&a, "-device"),
        [
            "vhost-user-blk-pci,chardev=blk0,num-queues=1",
            "virtio-balloon-pci,free-page-reporting=on",
            "vmgenid,guid=auto"
        ]
    );
    assert_eq!(
        values(&a, "-chardev"),
        ["socket,id=blk0,path=/run/x/blk.sock"]
    );
    assert!(!a.iter().any(|x| x == "-S" || x == "-incoming"));
    assert_eq!(
        values(&a, "-append"),
        [format!("{KERNEL_CMDLINE} COWORK_LOG=debug COWORK_TEMPLATE_SIGNAL=console").as_str()]
    );
    // The hot-plugged rest, vsock last (the agent polls for it).
    let plugs = p.hotplugs();
    let drivers: Vec<&str> = plugs.iter().map(|h| h.driver).collect();
    assert_eq!(
        drivers,
        [
            "vhost-user-fs-pci",
            "vhost-user-rng-pci",
            "vhost-user-vsock-pci"
        ]
    );
    assert_eq!(plugs[2].socket, Path::new("/run/x/vsock.sock"));
    assert!(plugs[0]
        .props
        .contains(&("tag", serde_json::json!("cowork-sessions"))));

    p.layout = Layout::Migratable {
        ram_fd: 17,
        qmp: "/q.sock".into(),
        incoming: true,
    };
    let r = p.args();
    assert!(r.iter().any(|x| x == "-S"));
    assert_eq!(values(&r, "-incoming"), ["defer"]);
}

/// The value following `key` in `args`, for each occurrence.
fn values<'a>(args: &'a [OsString], key: &str) -> Vec<&'a str> {
    args.windows(2)
        .filter(|w| w[0] == key)
        .map(|w| w[1].to_str().unwrap())
        .collect()
}

#[test]
fn qemu_command_line() {
    let a = plan(Accel::Tcg, "/run/x,y/vsock.sock").args();
    for flag in ["-nodefaults", "-nographic", "-no-reboot"] {
        assert!(a.iter().any(|x| x == flag), "{flag} missing: {a:?}");
    }
    assert_eq!(values(&a, "-accel"), ["tcg"]);
    assert_eq!(values(&a, "-cpu"), ["max"]);
    assert_eq!(values(&a, "-m"), ["1024M"]);
    assert_eq!(values(&a, "-smp"), ["2"]);
    assert_eq!(
        values(&a, "-object"),
        ["memory-backend-memfd,id=mem,size=1024M,share=on"]
    );
    assert_eq!(values(&a, "-numa"), ["node,memdev=mem"]);
    assert_eq!(values(&a, "-serial"), ["stdio"]);
    // A comma in the socket path must not split QEMU's option.
    assert_eq!(
        values(&a, "-chardev"),
        [
            "socket,id=vsock,path=/run/x,,y/vsock.sock",
            "socket,id=fs0,path=/run/x,,y/fs.sock",
            "socket,id=blk0,path=/run/x,,y/blk.sock",
            "socket,id=rng0,path=/run/x,,y/rng.sock"
        ]
    );
    // Every device is ours over vhost-user (QEMU's own rng is not used)
    // but the balloon, last.
    assert_eq!(
        values(&a, "-device"),
        [
            "vhost-user-vsock-pci,chardev=vsock",
            "vhost-user-fs-pci,chardev=fs0,tag=cowork-sessions,queue-size=1024",
            "vhost-user-blk-pci,chardev=blk0,num-queues=1",
            "vhost-user-rng-pci,chardev=rng0",
            "virtio-balloon-pci,free-page-reporting=on"
        ]
    );
    // The image itself is never handed to QEMU.
    assert!(!a
        .iter()
        .any(|x| x.to_string_lossy().contains("sessiondata")));
    assert_eq!(values(&a, "-kernel"), ["/img/vmlinuz"]);
    assert_eq!(values(&a, "-initrd"), ["/img/initramfs"]);
    assert_eq!(
        values(&a, "-append"),
        [format!("{KERNEL_CMDLINE} COWORK_LOG=debug").as_str()]
    );
    assert!(!a
        .iter()
        .any(|x| x == "-qmp" || x == "-incoming" || x == "-S"));
    let k = plan(Accel::Kvm, "/s").args();
    assert_eq!(values(&k, "-accel"), ["kvm"]);
    assert_eq!(values(&k, "-cpu"), ["host"]);

    // Root disks follow the fixed devices, each on its own socket; the
    // image path never reaches QEMU (our server opens it read-only).
    let mut with_roots = plan(Accel::Tcg, "/run/x/vsock.sock");
    for (i, serial) in [userland::BUNDLE_ROOTFS_SERIAL, userland::ROOTFS_SERIAL]
        .into_iter()
        .enumerate()
    {
        with_roots.root_disks.push(RootDiskSocket {
            disk: RootDisk {
                path: format!("/bundle/rootfs{i}.img").into(),
                serial,
                kind: userland::UserlandKind::Default,
            },
            socket: format!("/run/x/root{i}.sock").into(),
        });
    }
    let r = with_roots.args();
    let devices = values(&r, "-device");
    assert_eq!(
        devices[4..],
        [
            "vhost-user-blk-pci,chardev=root0,num-queues=1",
            "vhost-user-blk-pci,chardev=root1,num-queues=1",
            plan::BALLOON_DEVICE
        ]
    );
    assert!(values(&r, "-chardev").contains(&"socket,id=root1,path=/run/x/root1.sock"));
    assert!(!r.iter().any(|x| x.to_string_lossy().contains("rootfs")));
}

#[test]
fn memory_defaults_to_qemus_own() {
    // The bounds and the vCPU count are `sizing`'s (tested there).
    assert_eq!(memory_mib(None), DEFAULT_MEMORY_MIB);
    for bad in [f64::NAN, -2.0, 0.0] {
        assert_eq!(memory_mib(Some(bad)), DEFAULT_MEMORY_MIB, "{bad}");
    }
    assert_eq!(memory_mib(Some(4.0)), 4096);
    assert_eq!(memory_mib(Some(1e9)), sizing::MAX_MEMORY_MIB);
}

#[tokio::test]
async fn console_tail_is_bounded_and_long_lines_are_cut() {
    let mut input = Vec::new();
    for i in 0..100 {
        input.extend_from_slice(format!("line {i}\r\n").as_bytes());
    }
    input.extend_from_slice(&vec![b'x'; MAX_CONSOLE_LINE + 10]);
    input.extend_from_slice(b"\n\n\nlast without newline");
    let console = Console::default();
    pump_console(&input[..], console.clone(), "test").await;
    let tail: Vec<String> = console.lines();
    assert_eq!(tail.len(), CONSOLE_TAIL);
    assert_eq!(tail[tail.len() - 1], "last without newline");
    assert_eq!(tail[tail.len() - 2], "x".repeat(10));
    assert_eq!(tail[tail.len() - 3], "x".repeat(MAX_CONSOLE_LINE));
    assert_eq!(tail[tail.len() - 4], "line 99");
    let q = console.quote(2).to_string();
    assert_eq!(
        q,
        format!(
            "; last console lines:\n  {}\n  last without newline",
            "x".repeat(10)
        )
    );
    assert!(Console::default()
        .quote(3)
        .to_string()
        .contains("printed nothing"));
}

/// A stand-in for QEMU: a script that ignores QEMU's arguments.
fn fake_qemu(dir: &Path, body: &str) -> PathBuf {
    let p = dir.join("fake-qemu");
    std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

/// A plan for `qemu` whose sockets and (1 MiB) session disk live in `run_dir`.
fn fake_plan(qemu: PathBuf, run_dir: &RunDir) -> QemuPlan {
    let session_disk = run_dir.0.join("sessiondata.img");
    devices::blk::create_sparse_image(&session_disk, 1 << 20).unwrap();
    QemuPlan {
        qemu,
        vsock_socket: run_dir.0.join("vsock.sock"),
        fs_socket: run_dir.0.join("fs.sock"),
        blk_socket: run_dir.0.join("blk.sock"),
        rng_socket: run_dir.0.join("rng.sock"),
        session_disk,
        ..plan(Accel::Tcg, "")
    }
}

#[tokio::test]
async fn a_failed_boot_quotes_the_console_and_cleans_up() {
    let tmp = tempfile::tempdir().unwrap();
    let qemu = fake_qemu(
        tmp.path(),
        "echo 'Booting the kernel'; echo 'Kernel panic - not syncing: VFS' ; echo 'qemu: bad option' >&2; exit 1",
    );
    let run_dir = RunDir::create(&HostEnv::default()).unwrap();
    let dir = run_dir.0.clone();
    assert_eq!(
        std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777,
        0o700
    );
    let booted = start_plain(fake_plan(qemu, &run_dir), run_dir)
        .await
        .unwrap();
    let BackendMachine::Qemu(mut m) = booted.machine else {
        panic!("not a QEMU machine")
    };
    let how = m.wait().await;
    assert!(
        matches!(&how, QemuEnd::Exited { status, .. } if status.code() == Some(1)),
        "{how:?}"
    );
    let how = how.to_string();
    assert!(how.contains("exit status: 1"), "{how}");
    assert!(how.contains("Kernel panic - not syncing: VFS"), "{how}");
    assert!(how.contains("qemu: bad option"), "{how}");
    // The vhost-user threads, whose frontend never came, were ended.
    assert!(m.vhost.is_none() && m.vhost_fs.is_none());
    assert!(m.single_queue.blk.is_none() && m.single_queue.rng.is_none());
    // The session disk was closed: its lock is free for the next VM.
    let disk = dir.join("sessiondata.img");
    drop(RawImage::open(&disk).expect("the session disk is still locked"));
    m.kill().await;
    drop(m);
    assert!(!dir.exists(), "runtime directory left behind");
    // Host folders are granted through the VM's share.
    let HostPaths::Shared(shared) = &booted.host_paths else {
        panic!("the QEMU backend shares host folders through virtio-fs")
    };
    let host = tempfile::tempdir().unwrap();
    let rel = host.path().to_str().unwrap().trim_start_matches('/');
    let src = booted
        .host_paths
        .grant("s1", "proj", rel, guest_agent::proto::MountMode::Ro)
        .unwrap();
    assert_eq!(
        src,
        format!("{}/s1/proj", guest_agent::proto::SESSIONS_FS_MOUNT)
    );
    assert_eq!(shared.fs().grants().len(), 1);
    booted.host_paths.release_session("s1");
    assert!(shared.fs().grants().is_empty());
}

#[tokio::test]
async fn kill_before_the_agent_connected_does_not_wait() {
    let tmp = tempfile::tempdir().unwrap();
    let qemu = fake_qemu(tmp.path(), "echo started; exec sleep 600");
    let run_dir = RunDir::create(&HostEnv::default()).unwrap();
    let booted = start_plain(fake_plan(qemu, &run_dir), run_dir)
        .await
        .unwrap();
    let BackendMachine::Qemu(mut m) = booted.machine else {
        panic!("not a QEMU machine")
    };
    let pid = m.pid.unwrap();
    let t0 = Instant::now();
    m.kill().await;
    assert!(t0.elapsed() < POWEROFF_DEADLINE, "{:?}", t0.elapsed());
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "QEMU still there"
    );
    // Idempotent, and wait() reports the earlier end.
    m.kill().await;
    let how = m.wait().await;
    assert!(matches!(how, QemuEnd::Stopped(_)), "{how:?}");
    assert!(how.to_string().contains("QEMU ended"), "{how}");
}

#[test]
fn the_run_dir_is_under_the_runtime_dir_where_its_sockets_fit() {
    let runtime = tempfile::tempdir().unwrap();
    let temp = tempfile::tempdir().unwrap();
    let host = HostEnv {
        runtime_dir: Some(runtime.path().to_path_buf()),
        temp_dir: temp.path().to_path_buf(),
        ..HostEnv::default()
    };
    let run_dir = RunDir::create(&host).unwrap();
    assert!(run_dir.0.starts_with(runtime.path()), "{:?}", run_dir.0);
    // Too long for sun_path: the temporary directory instead.
    let host = HostEnv {
        runtime_dir: Some(runtime.path().join("r".repeat(100))),
        ..host
    };
    let run_dir = RunDir::create(&host).unwrap();
    assert!(run_dir.0.starts_with(temp.path()), "{:?}", run_dir.0);
}

#[test]
fn stale_runtime_dirs_of_dead_helpers_are_swept() {
    let base = tempfile::tempdir().unwrap();
    // Above any pid_max, so never a live process.
    let dead = base.path().join("cowork-qemu-999999999-0");
    let live = base
        .path()
        .join(format!("cowork-qemu-{}-7", std::process::id()));
    let unrelated = base.path().join("cowork-qemu-x");
    for d in [&dead, &live, &unrelated] {
        std::fs::create_dir(d).unwrap();
    }
    sweep_stale_run_dirs(base.path());
    assert!(!dead.exists());
    assert!(live.exists() && unrelated.exists());
}

#[tokio::test]
async fn the_session_disk_is_exclusive_and_released_when_boot_fails() {
    let tmp = tempfile::tempdir().unwrap();
    let disk = tmp.path().join("sessiondata.img");
    devices::blk::create_sparse_image(&disk, 1 << 20).unwrap();
    let plan_with_disk = |run_dir: &RunDir| QemuPlan {
        session_disk: disk.clone(),
        ..fake_plan("/nonexistent/qemu-system-x86_64".into(), run_dir)
    };
    // Another VM holds the disk: refused, saying so.
    let holder = RawImage::open(&disk).unwrap();
    let run_dir = RunDir::create(&HostEnv::default()).unwrap();
    match start_plain(plan_with_disk(&run_dir), run_dir).await {
        Err(e @ QemuError::SessionDisk(ImageError::Locked(_))) => {
            assert!(e.to_string().contains("in use by another VM"), "{e}")
        }
        Err(e) => panic!("unexpected error: {e}"),
        Ok(_) => panic!("served a disk another VM holds"),
    }
    drop(holder);
    // A boot that fails after the disk was opened closes it again.
    let run_dir = RunDir::create(&HostEnv::default()).unwrap();
    match start_plain(plan_with_disk(&run_dir), run_dir).await {
        Err(QemuError::Spawn { .. }) => {}
        Err(e) => panic!("unexpected error: {e}"),
        Ok(_) => panic!("started a missing binary"),
    }
    drop(RawImage::open(&disk).expect("the session disk is still locked"));
}

#[tokio::test]
async fn a_missing_qemu_binary_is_a_clear_error() {
    let run_dir = RunDir::create(&HostEnv::default()).unwrap();
    let plan = fake_plan("/nonexistent/qemu-system-x86_64".into(), &run_dir);
    match start_plain(plan, run_dir).await {
        Err(QemuError::Spawn { qemu, .. }) => {
            assert_eq!(qemu, PathBuf::from("/nonexistent/qemu-system-x86_64"))
        }
        Err(e) => panic!("unexpected error: {e}"),
        Ok(_) => panic!("started a missing binary"),
    }
}
