//! Data safety of the session disk (issue 11 item 4), end to end through
//! the built helper under `--backend qemu`:
//!
//! - a session disk that is not blank and holds no ext filesystem, or
//!   whose ext superblock is damaged, is never formatted: `startVM` fails
//!   with an error naming the disk, and the image's bytes are unchanged on
//!   the host; a blank disk is formatted and used
//!   ([`a_disk_that_is_not_blank_is_never_formatted`]);
//! - a full session disk is the session's `ENOSPC`, and nothing else
//!   breaks: other spawns, the janitor, `stopVM`
//!   ([`a_full_session_disk_is_the_sessions_error_only`]);
//! - `stopVM` in the middle of heavy writes loses no record a session had
//!   fsynced and acknowledged ([`stop_vm_loses_nothing_that_was_fsynced`]);
//! - a full host filesystem makes `createVM` fail with a clear error and
//!   leaves the old image as it was, and a new disk is never left half made
//!   ([`a_full_host_disk_fails_create_vm_and_keeps_the_image`], which
//!   needs no VM: it re-runs itself in a private mount namespace with the
//!   data directory on a small tmpfs);
//! - a host filesystem that fills up under a running VM makes the guest's
//!   `fsync` fail (`EIO`) rather than report data the host could not
//!   store, the agent goes on, and what was fsynced before is intact at
//!   the next boot ([`a_host_disk_filling_under_a_running_vm_fails_fsync`],
//!   same namespace and tmpfs, with a VM).
//!
//! Small disks keep it fast under TCG: `startVM` keeps an existing image as
//! it is, so the tests put a 64 MiB one in place before booting.
//!
//! Gate: QEMU, the guest image with its default userland (python3 writes
//! the records), the host's `mkfs.ext4` and `sha256sum`; for the host-disk
//! cases `unshare` and a private mount namespace (root, or unprivileged
//! user namespaces). With `COWORK_QEMU_TESTS=1` a missing
//! prerequisite fails instead of skipping.

mod support;

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use cowork_helper::client::{Pipe, Subscription, DEFAULT_TIMEOUT};
use serde_json::json;
use support::fsync_records;
use support::gate::{qemu_gate, qemu_missing};
use support::session::{self, assert_exit_0, run, sh, spawn};
use support::session_disk::{self, disk_info, write_on_disk, GIB};
use support::vm_helper::{self, built_helper, VmHelper, QEMU_VERBOSE_ENV};

/// `userDataRoot` of the test profiles.
const ROOT: &str = "/tmp/data-safety-profile";
/// Limit for one request or one process's events (TCG, shared machine).
const T: Duration = Duration::from_secs(180);
/// Size of the small session disks put in place before a boot.
const SMALL_DISK: u64 = 64 << 20;
/// One MiB.
const MIB: u64 = 1 << 20;
/// Where the test writes "user data" into a disk that is not blank: past
/// the first MiB the agent's own check reads, so only the host's
/// whole-image check can see it.
const FOREIGN_DATA_AT: u64 = 32 << 20;
/// `s_log_block_size`'s offset in an ext superblock (which starts at
/// 1 KiB); 20 (1 GiB blocks) is past what Linux mounts.
const LOG_BLOCK_SIZE_AT: u64 = 1024 + 0x18;
/// The damaged `s_log_block_size`.
const BAD_LOG_BLOCK_SIZE: u32 = 20;
/// Size of the tmpfs the host-disk case puts the data directory on: above
/// what `createVM {diskSizeGB: 1}` needs free (256 MiB plus 8 MiB).
const TMPFS_SIZE: &str = "300m";
/// The helper's log line for a disk it refused before or after the boot.
const REFUSED: &str = "session disk refused";

/// Whether the VM cases may run; panics when they must run but cannot.
fn vm_prerequisites(test: &str) -> bool {
    let image = vm_helper::image_for(&built_helper());
    qemu_gate(
        test,
        "the data-safety VM tests",
        [
            qemu_missing(),
            image.as_ref().err().map(|e| format!("no guest image: {e}")),
            image.as_ref().ok().and_then(|i| {
                i.rootfs.is_none().then(|| {
                    "the guest image has no default userland (rootfs.img); build it with scripts/setup.sh".to_string()
                })
            }),
            missing_tool("mkfs.ext4"),
            missing_tool("sha256sum"),
        ],
    )
}

/// `Some(why)` when `tool` is not on `PATH` (nor in `/sbin`).
fn missing_tool(tool: &str) -> Option<String> {
    let found = Command::new("sh")
        .args([
            "-c",
            &format!("PATH=$PATH:/sbin:/usr/sbin command -v {tool}"),
        ])
        .output()
        .is_ok_and(|o| o.status.success());
    (!found).then(|| format!("{tool} is missing (scripts/setup.sh installs it)"))
}

/// `sha256sum` of `path`.
fn sha256(path: &Path) -> String {
    let out = Command::new("sha256sum")
        .arg(path)
        .output()
        .expect("run sha256sum");
    assert!(out.status.success(), "sha256sum {}", path.display());
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string()
}

/// A client of `profile` on `helper`.
async fn connect(helper: &VmHelper, profile: &str) -> (Pipe, Subscription) {
    session::client(helper, profile, ROOT, DEFAULT_TIMEOUT).await
}

/// startVM with a small machine; the reply (`Err` with its text).
async fn try_start(pipe: &Pipe) -> Result<Duration, String> {
    let t0 = Instant::now();
    tokio::time::timeout(
        T,
        pipe.call("startVM", json!({"memoryGB": 1, "cpuCount": 1})),
    )
    .await
    .map_err(|_| format!("startVM took over {T:?}"))?
    .map_err(|e| e.to_string())?;
    Ok(t0.elapsed())
}

/// startVM that must succeed (`what`: which boot, for messages).
async fn start(pipe: &Pipe, helper: &VmHelper, what: &str) {
    let took = try_start(pipe)
        .await
        .unwrap_or_else(|e| panic!("{what}: startVM: {e}\n{}", helper.log_text()));
    eprintln!("data_safety: {what}: startVM took {took:?}");
}

/// A sparse image of `len` bytes at `disk` (its directory created).
fn sparse_image(disk: &Path, len: u64) -> File {
    std::fs::create_dir_all(disk.parent().expect("profile dir")).expect("profile dir");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(disk)
        .expect("create image");
    f.set_len(len).expect("size image");
    f
}

/// Deterministic bytes standing for a user's data.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) | 1)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_that_is_not_blank_is_never_formatted() {
    const PROFILE: &str = "not-blank";
    if !vm_prerequisites("a_disk_that_is_not_blank_is_never_formatted") {
        return;
    }
    let t0 = Instant::now();
    let mut helper = VmHelper::start_qemu("cowork-data-safety-", &[]);
    let disk = session_disk::image_path(&helper.dir, PROFILE, ROOT);
    let (pipe, mut sub) = connect(&helper, PROFILE).await;

    // 1. Zeroes where every signature lives, the user's data further in:
    // the host refuses before booting.
    let f = sparse_image(&disk, SMALL_DISK);
    f.write_all_at(&pattern(4096, 7), FOREIGN_DATA_AT)
        .expect("write data");
    drop(f);
    let before = sha256(&disk);
    let e = try_start(&pipe)
        .await
        .expect_err("startVM on a foreign disk");
    eprintln!("data_safety: foreign disk: {e}");
    assert!(
        e.contains(disk.to_str().unwrap())
            && e.contains(&format!("offset {FOREIGN_DATA_AT}"))
            && e.contains("not formatted"),
        "{e}"
    );
    assert_eq!(sha256(&disk), before, "the foreign disk was changed");
    assert_eq!(std::fs::metadata(&disk).unwrap().len(), SMALL_DISK);
    let log = helper.log_text();
    assert!(log.contains(REFUSED), "{log}");
    assert!(
        !log.contains(session_disk::FORMATTING),
        "the agent formatted: {log}"
    );
    assert_eq!(
        pipe.call("isRunning", json!({})).await.unwrap()["running"],
        json!(false)
    );

    // 2. An ext4 filesystem whose superblock is damaged: the host hands it
    // to the guest (the magic is there), the guest's mount fails, the
    // agent reports it and startVM fails; nothing is written.
    sparse_image(&disk, SMALL_DISK);
    let out = Command::new("sh")
        .args([
            "-c",
            "PATH=$PATH:/sbin:/usr/sbin mkfs.ext4 -q -F -L cowork-sessions \"$1\"",
        ])
        .arg("sh")
        .arg(&disk)
        .output()
        .expect("mkfs.ext4");
    assert!(out.status.success(), "{out:?}");
    OpenOptions::new()
        .write(true)
        .open(&disk)
        .unwrap()
        .write_all_at(&BAD_LOG_BLOCK_SIZE.to_le_bytes(), LOG_BLOCK_SIZE_AT)
        .unwrap();
    let before = sha256(&disk);
    let e = try_start(&pipe)
        .await
        .expect_err("startVM on a damaged filesystem");
    eprintln!("data_safety: damaged superblock: {e}");
    assert!(
        e.contains(disk.to_str().unwrap())
            && e.contains("cannot mount session disk")
            && e.contains("(kernel: EXT4-fs (")
            && e.contains("Invalid log block size")
            && e.contains("not reformatted"),
        "{e}"
    );
    let log = helper.log_text();
    assert!(
        !log.contains(session_disk::FORMATTING),
        "the agent formatted: {log}"
    );
    assert!(
        log.contains("session disk not mounted and not formatted"),
        "the guest did not say why: {log}"
    );
    assert_eq!(sha256(&disk), before, "the damaged disk was changed");
    session_disk::assert_unlocked(&disk);
    assert_eq!(
        pipe.call("isRunning", json!({})).await.unwrap()["running"],
        json!(false)
    );

    // 3. A blank disk is formatted and used.
    sparse_image(&disk, SMALL_DISK);
    start(&pipe, &helper, "blank disk").await;
    let (mount, _) = write_on_disk(&pipe, &mut sub, "w-1", "fresh", "kept\n", "", T).await;
    eprintln!("data_safety: blank disk mounted: {mount}");
    assert!(
        helper.log_text().contains(session_disk::FORMATTED),
        "{}",
        helper.log_text()
    );
    let info = disk_info(&pipe).await;
    assert!(info.spans(SMALL_DISK), "{}", info.reply);
    pipe.call("stopVM", json!({})).await.expect("stopVM");
    drop(sub);
    drop(pipe);
    helper.stop_clean(QEMU_VERBOSE_ENV);
    eprintln!("data_safety: not-blank case took {:?}", t0.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_session_disk_is_the_sessions_error_only() {
    const PROFILE: &str = "enospc";
    if !vm_prerequisites("a_full_session_disk_is_the_sessions_error_only") {
        return;
    }
    let t0 = Instant::now();
    let mut helper = VmHelper::start_qemu("cowork-data-safety-", &[]);
    let disk = session_disk::image_path(&helper.dir, PROFILE, ROOT);
    sparse_image(&disk, SMALL_DISK);
    let (pipe, mut sub) = connect(&helper, PROFILE).await;
    start(&pipe, &helper, "small disk").await;

    // A session writes more than the disk holds.
    let fill = run(
        &pipe,
        &mut sub,
        sh(
            "fill",
            "filler",
            "dd if=/dev/zero of=big bs=1M count=200 conv=fsync",
        ),
        T,
    )
    .await;
    eprintln!(
        "data_safety: fill: {} stderr {:?}",
        fill.exit,
        fill.stderr_str()
    );
    assert_ne!(fill.exit_code(), Some(0), "dd filled 200 MiB on 64 MiB");
    assert!(
        fill.stderr_str().contains("No space left on device"),
        "{:?}",
        fill.stderr_str()
    );
    // The disk is full as the janitor sees it.
    let info = disk_info(&pipe).await;
    let free = info.reply["freeBytes"].as_u64().unwrap_or(u64::MAX);
    eprintln!("data_safety: full disk: {}", info.reply);
    assert!(free < 8 * MIB, "{}", info.reply);

    // Everything else goes on: the agent answers, a new session starts,
    // the filler can clean up and write again.
    assert_eq!(
        pipe.call("isGuestConnected", json!({})).await.unwrap()["connected"],
        json!(true)
    );
    let other = run(&pipe, &mut sub, sh("other", "other", "echo alive; pwd"), T).await;
    assert_exit_0("a spawn on the full disk", &other);
    assert!(
        other.stdout_str().starts_with("alive\n/sessions/other"),
        "{}",
        other.stdout_str()
    );
    let again = run(
        &pipe,
        &mut sub,
        sh(
            "again",
            "filler",
            "rm big && dd if=/dev/zero of=small bs=1M count=4 conv=fsync status=none && ls -l small",
        ),
        T,
    )
    .await;
    assert_exit_0("writing after freeing space", &again);
    let info = disk_info(&pipe).await;
    assert!(
        info.lists("filler") && info.lists("other"),
        "{}",
        info.reply
    );
    pipe.call("stopVM", json!({})).await.expect("stopVM");
    session_disk::assert_unlocked(&disk);
    let log = helper.log_text();
    assert!(
        log.contains(session_disk::REMOUNTED_READ_ONLY),
        "the full disk was not settled at power-off: {log}"
    );
    drop(sub);
    drop(pipe);
    helper.stop_clean(QEMU_VERBOSE_ENV);
    eprintln!("data_safety: ENOSPC case took {:?}", t0.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_vm_loses_nothing_that_was_fsynced() {
    const PROFILE: &str = "fsync";
    const SESSION: &str = "records";
    if !vm_prerequisites("stop_vm_loses_nothing_that_was_fsynced") {
        return;
    }
    let t0 = Instant::now();
    let helper = VmHelper::start_qemu("cowork-data-safety-", &[]);
    let (pipe, sub) = connect(&helper, PROFILE).await;
    pipe.call("createVM", json!({"bundlePath": "", "diskSizeGB": 1}))
        .await
        .expect("createVM");
    start(&pipe, &helper, "first boot").await;
    let mut rig = QemuRig { helper, pipe, sub };
    for line in fsync_records::fsync_case(&mut rig, T, SESSION).await {
        eprintln!("data_safety: {line}");
    }
    rig.pipe.call("stopVM", json!({})).await.expect("stopVM");
    let QemuRig {
        mut helper,
        pipe,
        sub,
    } = rig;
    drop(sub);
    drop(pipe);
    helper.stop_clean(QEMU_VERBOSE_ENV);
    eprintln!("data_safety: fsync case took {:?}", t0.elapsed());
}

/// The fsync case's VM under `--backend qemu`: killed by killing QEMU.
struct QemuRig {
    helper: VmHelper,
    pipe: Pipe,
    sub: Subscription,
}

impl fsync_records::Rig for QemuRig {
    fn client(&mut self) -> (&Pipe, &mut Subscription) {
        (&self.pipe, &mut self.sub)
    }

    fn log(&self) -> String {
        self.helper.log_text()
    }

    async fn start(&mut self, what: &str) {
        start(&self.pipe, &self.helper, what).await;
    }

    /// SIGKILL to the helper's QEMU; returns once the helper noticed.
    async fn kill(&mut self) {
        let qemu = support::procfs::children_named(self.helper.pid(), "qemu");
        assert_eq!(qemu.len(), 1, "QEMU processes of the helper: {qemu:?}");
        // SAFETY: signalling the helper's QEMU child.
        unsafe { libc::kill(qemu[0] as libc::pid_t, libc::SIGKILL) };
        let deadline = Instant::now() + T;
        while self.pipe.call("isRunning", json!({})).await.unwrap()["running"] == json!(true) {
            assert!(
                Instant::now() < deadline,
                "the helper did not notice QEMU's end"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// The inner test of [`a_full_host_disk_fails_create_vm_and_keeps_the_image`].
const INNER_HOST_FULL: &str = "inner_host_full";
/// The inner test of [`a_host_disk_filling_under_a_running_vm_fails_fsync`].
const INNER_HOST_FILLS: &str = "inner_host_fills_while_running";
/// What an inner test prints when it finished.
const INNER_OK: &str = "data_safety: inner test done";

/// `unshare` options for a private mount namespace where this process may
/// mount a tmpfs: as root, just the namespace; otherwise also a user
/// namespace mapping the caller to root in it.
fn unshare_args() -> &'static [&'static str] {
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        &["--mount", "--propagation", "private"]
    } else {
        &[
            "--user",
            "--map-root-user",
            "--mount",
            "--propagation",
            "private",
        ]
    }
}

/// `Some(why)` when [`unshare_args`] cannot make the namespace here (no
/// `unshare`, or user namespaces disabled for an unprivileged caller).
fn no_mount_namespace() -> Option<String> {
    if let Some(why) = missing_tool("unshare") {
        return Some(why);
    }
    let ok = Command::new("unshare")
        .args(unshare_args())
        .args(["--", "true"])
        .status()
        .is_ok_and(|s| s.success());
    (!ok).then(|| {
        format!(
            "`unshare {} -- true` fails: a private mount namespace (root, or unprivileged user namespaces) is needed to mount a tmpfs",
            unshare_args().join(" ")
        )
    })
}

/// Re-runs this binary's `inner` test under `unshare` ([`unshare_args`]: a
/// private mount namespace, where it mounts its tmpfs); panics with its output
/// unless it passed.
fn rerun_in_mount_namespace(inner: &str) -> String {
    let exe = std::env::current_exe().expect("test binary");
    let out = Command::new("unshare")
        .args(unshare_args())
        .arg("--")
        .arg(exe)
        .args([
            "--exact",
            inner,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .output()
        .expect("run unshare");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains(INNER_OK),
        "inner run failed ({}):\n{text}",
        out.status
    );
    text
}

/// A temporary directory for a helper whose data directory (only) is a
/// tmpfs of [`TMPFS_SIZE`] (in this process's mount namespace). Dropping it
/// unmounts the tmpfs first: a mount point cannot be removed, and the
/// directory would be left behind on the host.
struct HelperDirOnTmpfs(tempfile::TempDir);

impl HelperDirOnTmpfs {
    fn new() -> HelperDirOnTmpfs {
        let tmp = tempfile::Builder::new()
            .prefix("cowork-data-safety-host-")
            .tempdir()
            .expect("tempdir");
        let data = vm_helper::data_dir(tmp.path());
        std::fs::create_dir_all(&data).unwrap();
        support::netns::run(&[
            "mount",
            "-t",
            "tmpfs",
            "-o",
            &format!("size={TMPFS_SIZE},mode=0700"),
            "tmpfs",
            data.to_str().unwrap(),
        ]);
        HelperDirOnTmpfs(tmp)
    }

    fn path(&self) -> &Path {
        self.0.path()
    }
}

impl Drop for HelperDirOnTmpfs {
    fn drop(&mut self) {
        let data = vm_helper::data_dir(self.0.path());
        if let Err(e) = Command::new("umount").arg(&data).status() {
            eprintln!("data_safety: cannot unmount {}: {e}", data.display());
        }
    }
}

#[test]
fn a_full_host_disk_fails_create_vm_and_keeps_the_image() {
    if !qemu_gate(
        "a_full_host_disk_fails_create_vm_and_keeps_the_image",
        "the full-host-disk test",
        [no_mount_namespace(), missing_tool("sha256sum")],
    ) {
        return;
    }
    let t0 = Instant::now();
    let text = rerun_in_mount_namespace(INNER_HOST_FULL);
    eprintln!(
        "{text}\ndata_safety: host-full case took {:?}",
        t0.elapsed()
    );
}

#[test]
fn a_host_disk_filling_under_a_running_vm_fails_fsync() {
    const TEST: &str = "a_host_disk_filling_under_a_running_vm_fails_fsync";
    if !vm_prerequisites(TEST) || !qemu_gate(TEST, "the host-fills-up test", [no_mount_namespace()])
    {
        return;
    }
    let t0 = Instant::now();
    let text = rerun_in_mount_namespace(INNER_HOST_FILLS);
    eprintln!(
        "{text}\ndata_safety: host-fills case took {:?}",
        t0.elapsed()
    );
}

/// Writes `argv[2]` MiB to the file `argv[1]` and fsyncs it; prints `ok`,
/// or `error <errno> <text>` and exits 3.
const BULK_FSYNC: &str = r#"
import os, sys
data = bytes(range(256)) * 4096
try:
    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for _ in range(int(sys.argv[2])):
        os.write(fd, data)
    os.fsync(fd)
except OSError as e:
    print("error", e.errno, e.strerror)
    sys.exit(3)
print("ok")
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by a_host_disk_filling_under_a_running_vm_fails_fsync in a private mount namespace"]
async fn inner_host_fills_while_running() {
    const PROFILE: &str = "fills";
    const SESSION: &str = "writer";
    let tmp = HelperDirOnTmpfs::new();
    let data = vm_helper::data_dir(tmp.path());
    let mut helper = VmHelper::start_in(
        &built_helper(),
        tmp.path(),
        "helper",
        "qemu",
        Duration::from_secs(15),
    );
    let (pipe, mut sub) = connect(&helper, PROFILE).await;
    pipe.call("createVM", json!({"bundlePath": "", "diskSizeGB": 1}))
        .await
        .expect("createVM");
    start(&pipe, &helper, "on a tmpfs").await;
    let write = |id: &str, file: &str, mib: u32| {
        spawn(
            id,
            SESSION,
            "python3",
            &["-c", BULK_FSYNC, file, &mib.to_string()],
        )
    };
    let before = run(&pipe, &mut sub, write("before", "before.bin", 4), T).await;
    assert_exit_0("writing with room on the host", &before);

    // The host filesystem fills up under the running VM: the guest's
    // fsync fails instead of reporting data the host could not store.
    let filler = fill(&data);
    let after = run(&pipe, &mut sub, write("after", "after.bin", 32), T).await;
    eprintln!(
        "data_safety: fsync on a full host: {} {:?}",
        after.exit,
        after.stdout_str()
    );
    assert_eq!(after.exit_code(), Some(3), "{:?}", after.stdout_str());
    assert!(
        after.stdout_str().starts_with("error "),
        "{:?}",
        after.stdout_str()
    );
    assert_eq!(
        pipe.call("isGuestConnected", json!({})).await.unwrap()["connected"],
        json!(true)
    );
    let alive = run(&pipe, &mut sub, sh("alive", SESSION, "echo alive"), T).await;
    assert_exit_0("a spawn after the host filled up", &alive);

    // Room again: stopVM, boot, the file fsynced before is intact.
    std::fs::remove_file(&filler).unwrap();
    pipe.call("stopVM", json!({})).await.expect("stopVM");
    start(&pipe, &helper, "after the host had room again").await;
    let check = run(
        &pipe,
        &mut sub,
        sh(
            "check",
            SESSION,
            "python3 -c 'import sys; d=open(\"before.bin\",\"rb\").read(); print(len(d), d == bytes(range(256)) * 4096 * 4)'",
        ),
        T,
    )
    .await;
    assert_exit_0("reading the file fsynced before", &check);
    assert_eq!(check.stdout_str().trim(), "4194304 True");
    // The device reported the host's refusals to the guest as I/O errors
    // (counted when the first machine's disk was closed), and the guest
    // kernel said what it made of them.
    let log = helper.log_text();
    let closed = log
        .lines()
        .find(|l| l.contains(session_disk::CLOSED))
        .unwrap_or_else(|| panic!("no {:?} line: {log}", session_disk::CLOSED));
    let errors: u64 = closed
        .split_whitespace()
        .find_map(|w| w.strip_prefix("errors="))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(errors > 0, "the device reported no I/O error: {closed}");
    let kernel: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("EXT4-fs") || l.contains("I/O error"))
        .take(6)
        .collect();
    eprintln!("data_safety: {closed}\ndata_safety: guest kernel: {kernel:#?}");
    pipe.call("stopVM", json!({})).await.expect("stopVM");
    drop(sub);
    drop(pipe);
    helper.stop_clean(QEMU_VERBOSE_ENV);
    println!("{INNER_OK}");
}

/// Fills the filesystem holding `dir` with a file there; returns it.
fn fill(dir: &Path) -> PathBuf {
    let filler = dir.join("filler");
    let f = File::create(&filler).expect("filler");
    let chunk = vec![0xa5u8; MIB as usize];
    let mut at = 0u64;
    loop {
        match f.write_at(&chunk, at) {
            Ok(0) => break,
            Ok(n) => at += n as u64,
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
            Err(e) => panic!("filling {}: {e}", dir.display()),
        }
    }
    filler
}

/// Files in `dir` (names), sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by a_full_host_disk_fails_create_vm_and_keeps_the_image in a private mount namespace"]
async fn inner_host_full() {
    const OLD: &str = "old";
    const NEW: &str = "new";
    let tmp = HelperDirOnTmpfs::new();
    let data = vm_helper::data_dir(tmp.path());
    // Only the data directory is on the tmpfs: the socket and the log are not.
    let mut helper = VmHelper::start_in(
        &built_helper(),
        tmp.path(),
        "helper",
        "qemu",
        Duration::from_secs(15),
    );
    let (old, _old_sub) = connect(&helper, OLD).await;
    old.call("createVM", json!({"bundlePath": "", "diskSizeGB": 1}))
        .await
        .expect("createVM with room");
    let disk = session_disk::image_path(tmp.path(), OLD, ROOT);
    // The user's sessions, standing in for a formatted filesystem.
    let f = OpenOptions::new().write(true).open(&disk).unwrap();
    f.write_all_at(&pattern(4 * MIB as usize, 1), 0).unwrap();
    f.write_all_at(&pattern(MIB as usize, 2), 512 * MIB)
        .unwrap();
    f.sync_all().unwrap();
    drop(f);
    let before = sha256(&disk);

    let filler = fill(&data);
    for gb in [1, 2] {
        let e = old
            .call("createVM", json!({"bundlePath": "", "diskSizeGB": gb}))
            .await
            .expect_err("createVM on a full host filesystem");
        let e = e.to_string();
        eprintln!("data_safety: createVM {gb} GiB on a full host: {e}");
        let why = if gb == 1 {
            "room for the guest's writes"
        } else {
            "to grow it and the filesystem in it"
        };
        assert!(
            e.contains(" MiB free")
                && e.contains(why)
                && e.contains(data.to_str().unwrap())
                && e.contains("free some space")
                && e.contains("was not changed"),
            "{e}"
        );
    }
    assert_eq!(std::fs::metadata(&disk).unwrap().len(), GIB);
    assert_eq!(sha256(&disk), before, "the old image changed");
    // startVM keeps the image it has (the check is createVM's).

    // A profile without a disk yet: refused, and nothing half made.
    let (new, _new_sub) = connect(&helper, NEW).await;
    let e = new
        .call("createVM", json!({"bundlePath": "", "diskSizeGB": 1}))
        .await
        .expect_err("createVM of a new disk on a full host");
    assert!(e.to_string().contains("to create and format it"), "{e}");
    let new_disk = session_disk::image_path(tmp.path(), NEW, ROOT);
    let new_dir = new_disk.parent().unwrap();
    assert_eq!(listing(new_dir), Vec::<String>::new(), "left behind");
    // Neither may startVM make one (it would create the default size).
    let e = try_start(&new).await.expect_err("startVM on a full host");
    assert!(e.contains("MiB free"), "{e}");
    assert_eq!(listing(new_dir), Vec::<String>::new(), "left behind");
    assert!(helper.log_text().contains(REFUSED), "{}", helper.log_text());

    // With room again both work; the old data is intact in the grown image.
    std::fs::remove_file(&filler).unwrap();
    old.call("createVM", json!({"bundlePath": "", "diskSizeGB": 2}))
        .await
        .expect("createVM once there is room");
    assert_eq!(std::fs::metadata(&disk).unwrap().len(), 2 * GIB);
    let head = Command::new("sh")
        .args(["-c", "head -c 1073741824 \"$1\" | sha256sum"])
        .arg("sh")
        .arg(&disk)
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&head.stdout).starts_with(&before),
        "the grown image lost the old bytes"
    );
    new.call("createVM", json!({"bundlePath": "", "diskSizeGB": 1}))
        .await
        .expect("createVM of a new disk once there is room");
    assert_eq!(listing(new_dir), vec!["sessiondata.img".to_string()]);
    drop(old);
    drop(new);
    helper.stop_clean(QEMU_VERBOSE_ENV);
    println!("{INNER_OK}");
}
