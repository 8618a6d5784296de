//! End-to-end test of `--backend kvm`: the helper binary boots the guest
//! image under its in-process VMM, the agent (PID 1 of the Linux guest)
//! dials the helper over our in-process virtio-vsock device on
//! virtio-mmio, and the usual protocol drives it: configure, subscribe,
//! startVM (hello, startup steps, `isGuestConnected`), spawn
//! `/bin/echo hello-from-kvm` (stdout and exit 0), an `ro` and an `rw` host
//! folder through the in-process virtio-fs share, stopVM (the guest powers
//! off; no VM thread, vCPU thread, device worker or KVM fd is left in the
//! helper), and the helper exits cleanly on SIGTERM. It prints startVM →
//! hello time and the helper's RSS with the VM running.
//!
//! The session disk across two boots in the same helper: `createVM
//! {diskSizeGB: 1}` makes the profile's sparse `sessiondata.img`, the
//! in-process virtio-blk device serves it, the agent formats it (ext4) and
//! mounts it at `/sessions` on the first boot, a session writes a file and
//! `getSessionsDiskInfo` lists it; after stopVM (the image unlocked) a
//! second startVM mounts the disk without formatting it and `readFile`
//! returns the file; after its stopVM the helper holds the same
//! descriptors, kind by kind, as after the first.
//!
//! Where it runs:
//! - directly, on hosts whose `/dev/kvm` can boot Linux (vmx/svm, not PVM);
//! - otherwise inside the nested-KVM harness (`scripts/nested-run.sh`, a
//!   QEMU TCG L1 guest with emulated SVM sharing this host's `/`): this test
//!   binary re-runs itself there, in direct mode, and checks the result.
//!   Everything then runs at TCG speed: the numbers it prints are nested
//!   numbers, not what hardware KVM gives.
//!
//! Gating: runs when the guest image (`scripts/mkguestimage.sh`) exists and,
//! in nested mode, the harness prerequisites are there; otherwise it prints
//! a loud skip. With `COWORK_NESTED_TESTS=1` a missing image is built with
//! `scripts/mkguestimage.sh` and anything else missing fails the test.
//! `COWORK_NESTED_MODE=direct|nested` forces the mode;
//! `COWORK_KVM_E2E_VERBOSE=1` prints the helper's log (guest console included);
//! `COWORK_KVM_E2E_HELPER=PATH` tests another helper binary (a release build).

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use cowork_helper::backend::image::{self, GuestImage};
use cowork_helper::client::Pipe;
use serde_json::json;
use support::nested;
use support::procfs::{
    kvm_fds, large_mappings_rss_kib, settled_fd_kinds, status_kib, thread_names,
};
use support::session::{self, run};
use support::session_checks::{self, HostFolders};
use support::session_disk::{
    self, assert_sparse, assert_unlocked, disk_info, read_kept, write_on_disk, GIB, KEPT_FILE,
};
use support::vm_helper::{self, VmHelper};

/// Name of the test (also what the nested re-run selects).
const TEST: &str = "kvm_backend_end_to_end";
/// Set (to 1) on the re-run inside the nested harness: run the body directly.
const INSIDE_ENV: &str = "COWORK_KVM_BACKEND_INSIDE";
/// Profile used by the test.
const PROFILE: &str = "kvm-e2e";
/// Environment variable that prints the helper's whole log at the end.
const VERBOSE_ENV: &str = "COWORK_KVM_E2E_VERBOSE";
/// Marker line the body prints when every check passed.
const OK_MARKER: &str = "kvm_backend: ok";
/// Prefix of the measurement lines the body prints.
const REPORT_PREFIX: &str = "kvm_backend: ";
/// Guest memory asked of startVM.
const MEMORY_GB: f64 = 1.0;
/// vCPUs asked of startVM.
const CPUS: u32 = 2;
/// Limit for startVM (the helper's own hello timeout is 60 s; a nested boot
/// takes ~15-30 s at TCG speed).
const START_LIMIT: Duration = Duration::from_secs(90);
/// Limit for one case's events (nested: every process start runs at TCG speed).
const T: Duration = Duration::from_secs(60);
/// Limit for one command of the userland checks (python and node start
/// at TCG speed in L2).
const USERLAND_T: Duration = Duration::from_secs(300);
/// Limit for the body inside the L1 guest (two boots and the userland
/// checks).
const INNER_TIMEOUT: Duration = Duration::from_secs(900);
/// Limit for the whole harness run (L1 boot, ~4 s, included).
const HARNESS_TIMEOUT: Duration = Duration::from_secs(960);
/// Nested attempts: QEMU TCG's SVM emulation now and then crashes a guest
/// that boots fine otherwise (L2 triple faults, silent L1 resets, L1 hangs;
/// see tests/nested_boot.rs).
const NESTED_ATTEMPTS: u32 = 5;
/// Thread names of a running in-process VM in the helper.
const VM_THREADS: [&str; 9] = [
    "cowork-kvm-vm",
    "vmm-event-loop",
    "vcpu",
    "virtio-vsock",
    "virtio-fs",
    "virtio-blk",
    "virtio-rng",
    "virtio-balloon",
    "egress-accept",
];
/// `createVM.diskSizeGB` of the test.
const DISK_GB: u64 = 1;
/// The session whose file ([`KEPT_FILE`]) lives on the session disk across boots.
const KEPT_SESSION: &str = "keep";
/// What it writes there.
const KEPT_CONTENT: &str = "written on the first kvm boot\n";
/// The helper's log line for a VM the guest powered off (stopVM's clean end).
const POWERED_OFF: &str = "kvm vm stopped how=the guest powered the VM off";

/// Environment variable naming another helper binary to test (e.g. a
/// release build, for its RSS); default: the one cargo built for the test.
const HELPER_ENV: &str = "COWORK_KVM_E2E_HELPER";

fn helper_exe() -> PathBuf {
    std::env::var_os(HELPER_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_cowork-helper")))
}

/// Builds the guest image with `scripts/mkguestimage.sh` (its default
/// output is where [`vm_helper::image_for`] looks).
fn build_image() -> Result<GuestImage, String> {
    let out = Command::new(nested::script("mkguestimage.sh"))
        .arg("--quiet")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run mkguestimage.sh: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "scripts/mkguestimage.sh failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    vm_helper::image_for(&helper_exe())
}

/// Why the test cannot run, if it cannot: no guest image. With
/// `COWORK_NESTED_TESTS=1` a missing image is built instead (a failed build
/// fails the test).
fn image_missing() -> Option<String> {
    let why = vm_helper::image_for(&helper_exe()).err()?;
    if !nested::nested_tests_required() {
        return Some(format!(
            "no guest image ({why}); build it with scripts/mkguestimage.sh"
        ));
    }
    if let Err(e) = build_image() {
        panic!(
            "COWORK_NESTED_TESTS=1, there was no guest image ({why}) and building one failed: {e}"
        );
    }
    None
}

#[test]
fn kvm_backend_end_to_end() {
    nested::run_on_linux_kvm(
        &nested::Rerun {
            test: TEST,
            inside_env: INSIDE_ENV,
            ok_marker: OK_MARKER,
            report_prefix: REPORT_PREFIX,
            verbose_env: VERBOSE_ENV,
            inner_timeout: INNER_TIMEOUT,
            harness_timeout: HARNESS_TIMEOUT,
            attempts: NESTED_ATTEMPTS,
        },
        image_missing,
        body,
    );
}

/// Threads of `pid` that belong to a running VM.
fn vm_threads(pid: u32) -> Vec<String> {
    thread_names(pid)
        .into_iter()
        .filter(|n| VM_THREADS.iter().any(|p| n.starts_with(p)))
        .collect()
}

/// startVM with the test's size, timed; panics with the helper's log.
async fn start_vm(pipe: &Pipe, helper: &VmHelper, what: &str) -> Duration {
    let params = json!({"memoryGB": MEMORY_GB, "cpuCount": CPUS});
    session::start_vm(pipe, helper, params, START_LIMIT, what).await
}

/// stopVM (the `stops`-th of the test), timed, and checks the guest
/// powered off by itself and the VM is gone from the helper: not running,
/// agent disconnected, no VM thread or KVM fd left, the disk unlocked.
async fn stop_vm(
    pipe: &Pipe,
    helper: &VmHelper,
    disk: &Path,
    stops: usize,
    what: &str,
) -> Duration {
    let pid = helper.pid();
    let t0 = Instant::now();
    pipe.call("stopVM", json!({}))
        .await
        .unwrap_or_else(|e| panic!("{what}: stopVM: {e}"));
    let took = t0.elapsed();
    assert_eq!(
        pipe.call("isRunning", json!({})).await.unwrap()["running"],
        json!(false),
        "{what}"
    );
    assert_eq!(
        pipe.call("isGuestConnected", json!({})).await.unwrap()["connected"],
        json!(false),
        "{what}"
    );
    let left = vm_threads(pid);
    assert!(
        left.is_empty(),
        "{what}: VM threads left after stopVM: {left:?}"
    );
    let fds = kvm_fds(pid);
    assert!(fds.is_empty(), "{what}: KVM fds left after stopVM: {fds:?}");
    assert_unlocked(disk);
    let log = helper.log_text();
    assert_eq!(
        log.matches(POWERED_OFF).count(),
        stops,
        "{what}: the guest did not power off cleanly: {log}"
    );
    assert!(
        !log.contains("did not power off in time"),
        "{what}: the VM had to be stopped by the host: {log}"
    );
    took
}

fn body() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(body_async());
}

async fn body_async() {
    let mut helper = VmHelper::start_temp(
        &helper_exe(),
        "cowork-kvm-e2e-",
        &nested::helper_base_dir(),
        "kvm",
        Duration::from_secs(30),
    );
    let pid = helper.pid();
    let root = "/tmp/kvm-e2e-profile";
    let (pipe, mut sub) = session::client(&helper, PROFILE, root, START_LIMIT).await;
    let rss_idle = status_kib(pid, "VmRSS");
    assert!(vm_threads(pid).is_empty(), "VM threads before startVM");

    // createVM makes the profile's sparse session disk at the asked size
    // (before any startVM, which would create the default size).
    let disk = session_disk::image_path(&helper.dir, PROFILE, root);
    pipe.call("createVM", json!({"diskSizeGB": DISK_GB}))
        .await
        .expect("createVM");
    assert_sparse(&disk, DISK_GB * GIB);

    // A bundle whose kernel is not one: startVM fails with the reason and
    // leaves nothing running.
    let bogus = tempfile::Builder::new()
        .prefix("bogus-image-")
        .tempdir_in(&helper.dir)
        .expect("tempdir");
    std::fs::write(bogus.path().join("vmlinuz"), b"not a kernel").unwrap();
    std::fs::write(bogus.path().join("initramfs"), b"").unwrap();
    std::fs::write(
        bogus.path().join("image-info"),
        format!("{}\n", image::IMAGE_FORMAT),
    )
    .unwrap();
    let e = pipe
        .call("startVM", json!({"bundlePath": bogus.path()}))
        .await
        .expect_err("startVM with a bogus kernel");
    assert!(
        e.to_string().contains("cannot build the VM from"),
        "unexpected error: {e}"
    );
    assert!(
        vm_threads(pid).is_empty(),
        "VM threads after a failed build"
    );
    assert!(kvm_fds(pid).is_empty(), "KVM fds after a failed build");

    // Boot: startVM returns once the agent said hello over vsock.
    let boot = start_vm(&pipe, &helper, "first boot").await;
    session::assert_booted(&pipe, &mut sub, &helper, "kvm", T).await;
    let log = helper.log_text();
    assert!(
        log.contains("kvm vm started"),
        "the in-process VM did not start: {log}"
    );
    assert!(
        // The FUSE INIT of the guest's mount reached the in-process device.
        log.contains("virtio-fs: FUSE session initialized"),
        "the agent did not mount the in-process virtio-fs share: {log}"
    );
    assert!(
        log.contains(session_disk::FORMATTING) && log.contains(session_disk::FORMATTED),
        "the agent did not format the blank session disk: {log}"
    );
    assert!(
        !log.contains(session_disk::MOUNTED),
        "the blank disk was mounted unformatted: {log}"
    );
    let running = vm_threads(pid);
    assert!(
        running.iter().any(|n| n == "cowork-kvm-vm") && running.iter().any(|n| n == "vcpu0"),
        "the VM's threads are not in the helper: {running:?}"
    );
    let rss_running = status_kib(pid, "VmRSS");
    let guest_ram_rss = large_mappings_rss_kib(pid, (MEMORY_GB * 1024.0 * 1024.0) as u64 / 2);

    // A process in the guest: its stdout and exit code come back.
    let t_spawn = Instant::now();
    let echo = session::spawn("echo-1", "s1", "/bin/echo", &["hello-from-kvm"]);
    let out = run(&pipe, &mut sub, echo, T).await;
    let spawn_time = t_spawn.elapsed();
    assert_eq!(out.exit_code(), Some(0), "{}", out.exit);
    assert_eq!(out.stdout_str(), "hello-from-kvm\n");
    assert_eq!(out.stderr_str(), "");

    // The default userland, when the image has one (it does once
    // scripts/setup.sh built it): the same session checks as under QEMU.
    let has_rootfs = vm_helper::image_for(&helper_exe())
        .map(|i| i.rootfs.is_some())
        .unwrap_or(false);
    if has_rootfs {
        assert!(
            helper.log_text().contains("userland default"),
            "the guest did not switch to the default userland: {}",
            helper.log_text()
        );
        let t_userland = Instant::now();
        session_checks::default_userland(&pipe, &mut sub, "kvm", USERLAND_T).await;
        eprintln!(
            "{REPORT_PREFIX}default userland session checks took {:.1} s",
            t_userland.elapsed().as_secs_f64()
        );
    } else {
        assert!(
            !nested::nested_tests_required(),
            "COWORK_NESTED_TESTS=1 but the guest image has no rootfs.img (scripts/setup.sh)"
        );
        nested::loud_skip(
            TEST,
            "the default userland checks: the guest image has no rootfs.img",
        );
    }

    // Host folders through the in-process virtio-fs share: an ro mount is
    // read and refuses writes (enforced by the host), an rw mount's write
    // reaches the host.
    let folders = HostFolders::create(&helper.dir.join("shared"));
    let more = session_checks::host_folders(&pipe, &mut sub, &folders, "fs-1", "s2", "", T).await;
    assert_eq!(more, "", "output nobody asked for");

    // The session disk: a session's working directory is on it (ext4 at
    // /sessions) and the janitor measures it and lists the session.
    let (sessions_mount, text) =
        write_on_disk(&pipe, &mut sub, "keep-1", KEPT_SESSION, KEPT_CONTENT, "", T).await;
    assert!(
        sessions_mount.starts_with("/dev/vd"),
        "/sessions is not the ext4 session disk: {text}"
    );
    let info = disk_info(&pipe).await;
    let total = info.total;
    assert!(
        info.spans(DISK_GB * GIB),
        "totalBytes {total} is not the {DISK_GB} GiB disk: {}",
        info.reply
    );
    assert!(
        info.lists(KEPT_SESSION),
        "getSessionsDiskInfo does not list {KEPT_SESSION}: {}",
        info.reply
    );

    // stopVM: the guest powers off and the VM is gone from the helper.
    let stop_time = stop_vm(&pipe, &helper, &disk, 1, "first boot").await;
    let rss_stopped = status_kib(pid, "VmRSS");
    let fds_stopped = settled_fd_kinds(pid).await;

    // Second boot in the same helper: the agent mounts the disk it
    // formatted (no second format) and the session's file is there.
    let boot2 = start_vm(&pipe, &helper, "second boot").await;
    assert_eq!(
        read_kept(&pipe, KEPT_SESSION).await.as_deref(),
        Ok(KEPT_CONTENT)
    );
    let log = helper.log_text();
    assert_eq!(
        log.matches(session_disk::FORMATTING).count(),
        1,
        "the session disk was formatted again: {log}"
    );
    assert_eq!(
        log.matches(session_disk::FORMATTED).count(),
        1,
        "the session disk was formatted again: {log}"
    );
    assert_eq!(
        log.matches(session_disk::MOUNTED).count(),
        1,
        "the second boot did not mount the formatted session disk: {log}"
    );
    assert!(
        !log.contains(session_disk::NOT_CLEAN),
        "the first power-off left the session disk's journal to replay: {log}"
    );
    let mounted_line = log
        .lines()
        .find(|l| l.contains(session_disk::MOUNTED))
        .unwrap_or_default()
        .trim()
        .to_string();
    let stop2_time = stop_vm(&pipe, &helper, &disk, 2, "second boot").await;
    let hwm = status_kib(pid, "VmHWM");
    // A boot leaves no descriptor behind (by kind: eventfds, sockets, ...).
    assert_eq!(
        settled_fd_kinds(pid).await,
        fds_stopped,
        "descriptors after the second stopVM differ from after the first"
    );

    drop(sub);
    drop(pipe);
    helper.stop_clean(VERBOSE_ENV);

    let boot_line = helper
        .log_text()
        .lines()
        .find(|l| l.contains("guest agent connected"))
        .map(str::to_string)
        .unwrap_or_default();
    let kib = |v: Option<u64>| v.map_or("?".into(), |k| format!("{:.1} MiB", k as f64 / 1024.0));
    println!("{REPORT_PREFIX}startVM -> agent hello {boot:?} ({CPUS} vCPUs, {MEMORY_GB} GiB)");
    println!("{REPORT_PREFIX}hello: {}", boot_line.trim());
    println!("{REPORT_PREFIX}spawn echo -> exit event {spawn_time:?}; stopVM {stop_time:?}");
    println!(
        "{REPORT_PREFIX}session disk: {} (getSessionsDiskInfo totalBytes {total}, lists {KEPT_SESSION:?})",
        sessions_mount.trim()
    );
    println!(
        "{REPORT_PREFIX}second boot: startVM -> agent hello {boot2:?}, readFile {KEPT_FILE} = {KEPT_CONTENT:?}, stopVM {stop2_time:?}"
    );
    println!("{REPORT_PREFIX}second boot agent: {mounted_line}");
    println!(
        "{REPORT_PREFIX}helper RSS: idle {}, VM running {} (of which guest RAM {}), after stopVM {}, peak {}",
        kib(rss_idle),
        kib(rss_running),
        kib(guest_ram_rss),
        kib(rss_stopped),
        kib(hwm)
    );
    println!("{OK_MARKER}");
}
