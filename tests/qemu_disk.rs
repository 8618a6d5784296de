//! End-to-end test of the session disk under `--backend qemu`: `createVM
//! {diskSizeGB: 1}` creates the profile's sparse `sessiondata.img`, the
//! helper serves it to QEMU over our vhost-user-blk (entropy over our
//! vhost-user-rng), the agent formats it as ext4 and mounts it at
//! `/sessions`, and a session's file survives `stopVM` + `startVM` in the
//! same helper and a new helper on the same data directory; a second
//! `createVM` with a larger size grows the image and the agent grows the
//! filesystem online at the next boot, a smaller one keeps it; the janitor
//! measures the disk
//! and deletes the session inside the guest, and refuses (rather than
//! falling back to a host directory) while no guest is connected. Three
//! boots in all, one VM at a time.
//!
//! Gate: as `tests/qemu_e2e.rs` (QEMU and the guest image, found the way
//! the helper finds it); the image must also carry `/sbin/mkfs.ext4`
//! (rebuild it with `scripts/mkguestimage.sh`). With `COWORK_QEMU_TESTS=1`
//! a missing prerequisite fails the test instead of skipping it.

#[path = "support/vm_helper.rs"]
mod vm_helper;

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use base64::Engine;
use cowork_helper::backend::image::GuestImage;
use cowork_helper::backend::qemu;
use cowork_helper::client::{Pipe, Subscription};
use cowork_helper::daemon::profile_key;
use serde_json::{json, Value};
use vm_helper::VmHelper;

/// Environment variable that makes missing prerequisites a failure.
const REQUIRE_ENV: &str = "COWORK_QEMU_TESTS";
/// Environment variable that prints the helpers' whole logs at the end.
const VERBOSE_ENV: &str = "COWORK_QEMU_E2E_VERBOSE";
/// Profile of the test.
const PROFILE: &str = "qemu-disk";
/// `userDataRoot` of the profile.
const ROOT: &str = "/tmp/qemu-disk-profile";
/// Limit for one request or one process's events (a TCG boot takes a few
/// seconds; the machine is shared).
const T: Duration = Duration::from_secs(120);
/// One GiB.
const GIB: u64 = 1 << 30;
/// The session whose file must survive.
const SESSION: &str = "keep";
/// What it writes.
const CONTENT: &str = "written before the first stopVM\n";

fn helper_exe() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_cowork-helper"))
}

/// The guest image the helper binary will use, or why there is none or
/// it is too old to format the session disk.
fn image_for_helper() -> Result<GuestImage, String> {
    let img = vm_helper::image_for(&helper_exe())?;
    let listing = Command::new("sh")
        .arg("-c")
        .arg("gzip -dc \"$1\" | cpio -t --quiet")
        .arg("sh")
        .arg(&img.initramfs)
        .output()
        .map_err(|e| format!("cannot list {}: {e}", img.initramfs.display()))?;
    if !String::from_utf8_lossy(&listing.stdout)
        .lines()
        .any(|l| l == "sbin/mkfs.ext4")
    {
        return Err(format!(
            "the guest image in {} has no sbin/mkfs.ext4",
            img.dir.display()
        ));
    }
    Ok(img)
}

/// Whether the test may run; panics when it must run but cannot.
fn prerequisites() -> bool {
    let required = std::env::var(REQUIRE_ENV).is_ok_and(|v| v == "1");
    let missing: Vec<String> = [
        qemu::find_qemu().err().map(|e| e.to_string()),
        image_for_helper()
            .err()
            .map(|e| format!("no usable guest image ({e}); build it with scripts/mkguestimage.sh")),
    ]
    .into_iter()
    .flatten()
    .collect();
    if missing.is_empty() {
        return true;
    }
    assert!(
        !required,
        "{REQUIRE_ENV}=1 but the QEMU session-disk test cannot run: {}",
        missing.join("; ")
    );
    eprintln!(
        "\n========================================================================\n\
         SKIPPED qemu_disk: {}\n\
         (set {REQUIRE_ENV}=1 to make this a failure)\n\
         ========================================================================\n",
        missing.join("; ")
    );
    false
}

/// SIGTERM; asserts a clean exit (bounded), printing the log when
/// `VERBOSE_ENV` is set.
fn stop_clean(helper: &mut VmHelper) {
    let status = helper.stop();
    if std::env::var_os(VERBOSE_ENV).is_some() {
        eprintln!("---- helper log ----\n{}---- end ----", helper.log_text());
    }
    let status = status.expect("helper exit status");
    assert!(
        status.success(),
        "helper exit: {status}\n{}",
        helper.log_text()
    );
}

/// A connected, configured pipe and a subscription for the test's profile.
async fn connect(helper: &VmHelper) -> (Pipe, Subscription) {
    let pipe = Pipe::connect_profile(&helper.socket, PROFILE, ROOT)
        .await
        .expect("connect");
    let sub = Subscription::connect(&helper.socket, PROFILE, ROOT)
        .await
        .expect("subscribe");
    (pipe, sub)
}

/// startVM, timed.
async fn start_vm(pipe: &Pipe, what: &str) {
    let t0 = Instant::now();
    tokio::time::timeout(
        T,
        pipe.call("startVM", json!({"memoryGB": 1, "cpuCount": 1})),
    )
    .await
    .unwrap_or_else(|_| panic!("{what}: startVM took over {T:?}"))
    .unwrap_or_else(|e| panic!("{what}: startVM: {e}"));
    eprintln!("qemu_disk: {what}: startVM took {:?}", t0.elapsed());
}

/// readFile of the session's file, decoded.
async fn read_kept(pipe: &Pipe) -> Result<String, String> {
    let r = pipe
        .call(
            "readFile",
            json!({"processName": SESSION, "filePath": "kept.txt"}),
        )
        .await
        .map_err(|e| e.to_string())?;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(r["content"].as_str().unwrap_or_default())
        .map_err(|e| e.to_string())?;
    String::from_utf8(bytes).map_err(|e| e.to_string())
}

/// getSessionsDiskInfo: (totalBytes, session names).
async fn disk_info(pipe: &Pipe) -> (u64, Vec<String>, Value) {
    let info = pipe
        .call("getSessionsDiskInfo", json!({"lowWaterBytes": 0}))
        .await
        .expect("getSessionsDiskInfo");
    let total = info["totalBytes"].as_u64().unwrap_or(0);
    let names = info["sessions"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s["name"].as_str().map(String::from))
        .collect();
    (total, names, info)
}

/// The image is not locked by anyone (the helper closed it): an exclusive
/// `flock` succeeds.
fn assert_unlocked(disk: &Path) {
    let f = File::open(disk).expect("open the session disk");
    // SAFETY: flock on an owned descriptor, released when `f` closes.
    let r = unsafe {
        libc::flock(
            std::os::fd::AsRawFd::as_raw_fd(&f),
            libc::LOCK_EX | libc::LOCK_NB,
        )
    };
    assert_eq!(r, 0, "the session disk is still locked after stopVM");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_session_disk_survives_stop_restart_and_a_new_helper() {
    if !prerequisites() {
        return;
    }
    let dir = tempfile::Builder::new()
        .prefix("cowork-qemu-disk-")
        .tempdir()
        .expect("tempdir");
    let disk = dir
        .path()
        .join("data/profiles")
        .join(profile_key(Some(PROFILE), Some(ROOT)))
        .join("sessiondata.img");

    // Helper 1: createVM makes the sparse 1 GiB disk; the first boot
    // formats it and a session writes a file.
    let mut helper = VmHelper::start_in(
        &helper_exe(),
        dir.path(),
        "helper1",
        "qemu",
        Duration::from_secs(15),
    );
    let (pipe, mut sub) = connect(&helper).await;
    pipe.call("createVM", json!({"bundlePath": "", "diskSizeGB": 1}))
        .await
        .expect("createVM");
    let meta = std::fs::metadata(&disk).expect("createVM made no session disk");
    assert_eq!(meta.len(), GIB);
    assert!(
        meta.blocks() * 512 < 1 << 20,
        "not sparse: {} blocks",
        meta.blocks()
    );
    start_vm(&pipe, "first boot").await;
    let script = format!(
        "printf '{}' > kept.txt && pwd && grep ' /sessions ' /proc/mounts && \
         test -c /dev/hwrng && echo hwrng=$(cat /sys/class/misc/hw_random/rng_current)",
        CONTENT.replace('\n', "\\n")
    );
    pipe.call(
        "spawn",
        json!({"id": "w-1", "name": SESSION, "command": "/bin/sh", "args": ["-c", script],
               "isResume": false}),
    )
    .await
    .expect("spawn");
    let out = sub.collect_process("w-1", T).await.expect("w-1 events");
    let text = out.stdout_str();
    eprintln!("qemu_disk: first boot: {text:?} {:?}", out.stderr_str());
    assert_eq!(
        out.exit_code(),
        Some(0),
        "{} {}",
        out.exit,
        out.stderr_str()
    );
    assert!(
        text.starts_with(&format!("/sessions/{SESSION}\n")),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.split_whitespace().nth(1) == Some("/sessions")
                && l.split_whitespace().nth(2) == Some("ext4")),
        "/sessions is not the ext4 session disk: {text}"
    );
    assert!(text.contains("hwrng=virtio_rng"), "no virtio-rng: {text}");
    let log = helper.log_text();
    assert!(
        log.contains("session disk formatted and mounted"),
        "the agent did not format the blank disk: {log}"
    );
    let (total, names, info) = disk_info(&pipe).await;
    eprintln!("qemu_disk: getSessionsDiskInfo: {info}");
    assert!(
        total > GIB * 85 / 100 && total <= GIB,
        "totalBytes {total} is not the 1 GiB disk: {info}"
    );
    assert!(names.iter().any(|n| n == SESSION), "{info}");

    // stopVM closes the disk (flushed, unlocked); the janitor then refuses
    // instead of measuring some host directory.
    pipe.call("stopVM", json!({})).await.expect("stopVM");
    assert_unlocked(&disk);
    assert!(
        helper.log_text().contains("session disk closed"),
        "{}",
        helper.log_text()
    );
    let e = pipe
        .call("getSessionsDiskInfo", json!({"lowWaterBytes": 0}))
        .await
        .expect_err("getSessionsDiskInfo without a guest");
    assert!(e.to_string().contains("call startVM first"), "{e}");

    // Same helper, second boot: the file is there; the disk is not formatted again.
    start_vm(&pipe, "second boot").await;
    assert_eq!(read_kept(&pipe).await.as_deref(), Ok(CONTENT));
    let log = helper.log_text();
    assert_eq!(
        log.matches("formatting the blank session disk").count(),
        1,
        "the disk was formatted twice: {log}"
    );
    // The first boot's power-off remounted it read-only: no journal replay.
    assert!(
        log.contains("session disk remounted read-only"),
        "the agent did not settle the session disk at power-off: {log}"
    );
    assert!(
        !log.contains("not cleanly unmounted"),
        "the session disk's journal was replayed: {log}"
    );
    pipe.call("stopVM", json!({})).await.expect("stopVM");
    drop(sub);
    drop(pipe);
    stop_clean(&mut helper);

    // Helper 2 on the same data directory: createVM with other sizes keeps
    // the disk (grown sparsely when larger, never shrunk), and the file is
    // still there.
    let mut helper = VmHelper::start_in(
        &helper_exe(),
        dir.path(),
        "helper2",
        "qemu",
        Duration::from_secs(15),
    );
    let (pipe, _sub) = connect(&helper).await;
    pipe.call("createVM", json!({"diskSizeGB": 2}))
        .await
        .expect("createVM 2 GiB");
    assert_eq!(std::fs::metadata(&disk).unwrap().len(), 2 * GIB);
    pipe.call("createVM", json!({"diskSizeGB": 1}))
        .await
        .expect("createVM 1 GiB");
    assert_eq!(std::fs::metadata(&disk).unwrap().len(), 2 * GIB);
    start_vm(&pipe, "new helper").await;
    assert_eq!(read_kept(&pipe).await.as_deref(), Ok(CONTENT));
    let (total, names, info) = disk_info(&pipe).await;
    assert!(names.iter().any(|n| n == SESSION), "{info}");
    // The agent grew the 1 GiB filesystem to the 2 GiB disk, online.
    assert!(
        total > 2 * GIB * 85 / 100 && total <= 2 * GIB,
        "totalBytes {total}: the filesystem did not grow with the disk: {info}"
    );
    assert!(
        helper
            .log_text()
            .contains("session disk filesystem grown to the whole disk"),
        "{}",
        helper.log_text()
    );

    // deleteSessionDirs removes the session inside the guest.
    let r = pipe
        .call("deleteSessionDirs", json!({"names": [SESSION]}))
        .await
        .expect("deleteSessionDirs");
    assert_eq!(r["deleted"], json!([SESSION]), "{r}");
    let (_, names, info) = disk_info(&pipe).await;
    assert!(!names.iter().any(|n| n == SESSION), "{info}");
    let e = read_kept(&pipe)
        .await
        .expect_err("the deleted session's file is still readable");
    eprintln!("qemu_disk: readFile after deleteSessionDirs: {e}");
    pipe.call("stopVM", json!({})).await.expect("stopVM");
    assert_unlocked(&disk);
    drop(pipe);
    stop_clean(&mut helper);
}
