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
//! the helper finds it); the image must also carry mkfs.ext4, as the
//! self-contained bundle `/lib/cowork-mkfs/` or, in older images,
//! `/sbin/mkfs.ext4` (rebuild it with `scripts/mkguestimage.sh`). With `COWORK_QEMU_TESTS=1`
//! a missing prerequisite fails the test instead of skipping it.

mod support;

use std::process::Command;
use std::time::Duration;

use cowork_helper::backend::image::GuestImage;
use cowork_helper::client::{Pipe, Subscription, DEFAULT_TIMEOUT};
use serde_json::json;
use support::gate::{qemu_gate, qemu_missing};
use support::session;
use support::session_disk::{
    self, assert_sparse, assert_unlocked, disk_info, read_kept, write_on_disk, GIB,
};
use support::vm_helper::{self, built_helper, VmHelper, QEMU_VERBOSE_ENV};

/// Profile of the test.
const PROFILE: &str = "qemu-disk";
/// `userDataRoot` of the profile.
const ROOT: &str = "/tmp/qemu-disk-profile";
/// Limit for one request or one process's events (a TCG boot takes a few
/// seconds; the machine is shared).
const T: Duration = Duration::from_secs(120);
/// How long the helper gets to listen on its socket.
const LISTEN_LIMIT: Duration = Duration::from_secs(15);
/// The session whose file must survive.
const SESSION: &str = "keep";
/// What it writes.
const CONTENT: &str = "written before the first stopVM\n";

/// The guest image the helper binary will use, or why there is none or
/// it is too old to format the session disk.
fn image_for_helper() -> Result<GuestImage, String> {
    let img = vm_helper::image_for(&built_helper())?;
    let listing = Command::new("sh")
        .arg("-c")
        .arg("gzip -dcf \"$1\" | cpio -t --quiet")
        .arg("sh")
        .arg(&img.initramfs)
        .output()
        .map_err(|e| format!("cannot list {}: {e}", img.initramfs.display()))?;
    if !String::from_utf8_lossy(&listing.stdout)
        .lines()
        .any(|l| l == "lib/cowork-mkfs/mkfs.ext4" || l == "sbin/mkfs.ext4")
    {
        return Err(format!(
            "the guest image in {} has no mkfs.ext4 (lib/cowork-mkfs/ or sbin/)",
            img.dir.display()
        ));
    }
    Ok(img)
}

/// Whether the test may run; panics when it must run but cannot.
fn prerequisites() -> bool {
    qemu_gate(
        "qemu_disk",
        "the QEMU session-disk test",
        [
            qemu_missing(),
            image_for_helper().err().map(|e| {
                format!("no usable guest image ({e}); build it with scripts/mkguestimage.sh")
            }),
        ],
    )
}

/// A client of the test's profile (calls wait the client's default time).
async fn connect(helper: &VmHelper) -> (Pipe, Subscription) {
    session::client(helper, PROFILE, ROOT, DEFAULT_TIMEOUT).await
}

/// startVM, timed.
async fn start_vm(pipe: &Pipe, helper: &VmHelper, what: &str) {
    let params = json!({"memoryGB": 1, "cpuCount": 1});
    let took = session::start_vm(pipe, helper, params, T, what).await;
    eprintln!("qemu_disk: {what}: startVM took {took:?}");
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
    let disk = session_disk::image_path(dir.path(), PROFILE, ROOT);

    // Helper 1: createVM makes the sparse 1 GiB disk; the first boot
    // formats it and a session writes a file.
    let mut helper =
        VmHelper::start_in(&built_helper(), dir.path(), "helper1", "qemu", LISTEN_LIMIT);
    let (pipe, mut sub) = connect(&helper).await;
    pipe.call("createVM", json!({"bundlePath": "", "diskSizeGB": 1}))
        .await
        .expect("createVM");
    assert_sparse(&disk, GIB);
    start_vm(&pipe, &helper, "first boot").await;
    let (_, text) = write_on_disk(
        &pipe,
        &mut sub,
        "w-1",
        SESSION,
        CONTENT,
        "test -c /dev/hwrng && echo hwrng=$(cat /sys/class/misc/hw_random/rng_current)",
        T,
    )
    .await;
    eprintln!("qemu_disk: first boot: {text:?}");
    assert!(text.contains("hwrng=virtio_rng"), "no virtio-rng: {text}");
    let log = helper.log_text();
    assert!(
        log.contains(session_disk::FORMATTED),
        "the agent did not format the blank disk: {log}"
    );
    let info = disk_info(&pipe).await;
    eprintln!("qemu_disk: getSessionsDiskInfo: {}", info.reply);
    assert!(
        info.spans(GIB),
        "totalBytes {} is not the 1 GiB disk: {}",
        info.total,
        info.reply
    );
    assert!(info.lists(SESSION), "{}", info.reply);

    // stopVM closes the disk (flushed, unlocked); the janitor then refuses
    // instead of measuring some host directory.
    pipe.call("stopVM", json!({})).await.expect("stopVM");
    assert_unlocked(&disk);
    assert!(
        helper.log_text().contains(session_disk::CLOSED),
        "{}",
        helper.log_text()
    );
    let e = pipe
        .call("getSessionsDiskInfo", json!({"lowWaterBytes": 0}))
        .await
        .expect_err("getSessionsDiskInfo without a guest");
    assert!(e.to_string().contains("call startVM first"), "{e}");

    // Same helper, second boot: the file is there; the disk is not formatted again.
    start_vm(&pipe, &helper, "second boot").await;
    assert_eq!(read_kept(&pipe, SESSION).await.as_deref(), Ok(CONTENT));
    let log = helper.log_text();
    assert_eq!(
        log.matches(session_disk::FORMATTING).count(),
        1,
        "the disk was formatted twice: {log}"
    );
    // The first boot's power-off remounted it read-only: no journal replay.
    assert!(
        log.contains(session_disk::REMOUNTED_READ_ONLY),
        "the agent did not settle the session disk at power-off: {log}"
    );
    assert!(
        !log.contains(session_disk::NOT_CLEAN),
        "the session disk's journal was replayed: {log}"
    );
    pipe.call("stopVM", json!({})).await.expect("stopVM");
    drop(sub);
    drop(pipe);
    helper.stop_clean(QEMU_VERBOSE_ENV);

    // Helper 2 on the same data directory: createVM with other sizes keeps
    // the disk (grown sparsely when larger, never shrunk), and the file is
    // still there.
    let mut helper =
        VmHelper::start_in(&built_helper(), dir.path(), "helper2", "qemu", LISTEN_LIMIT);
    let (pipe, _sub) = connect(&helper).await;
    pipe.call("createVM", json!({"diskSizeGB": 2}))
        .await
        .expect("createVM 2 GiB");
    assert_eq!(std::fs::metadata(&disk).unwrap().len(), 2 * GIB);
    pipe.call("createVM", json!({"diskSizeGB": 1}))
        .await
        .expect("createVM 1 GiB");
    assert_eq!(std::fs::metadata(&disk).unwrap().len(), 2 * GIB);
    start_vm(&pipe, &helper, "new helper").await;
    assert_eq!(read_kept(&pipe, SESSION).await.as_deref(), Ok(CONTENT));
    let info = disk_info(&pipe).await;
    assert!(info.lists(SESSION), "{}", info.reply);
    // The agent grew the 1 GiB filesystem to the 2 GiB disk, online.
    assert!(
        info.spans(2 * GIB),
        "totalBytes {}: the filesystem did not grow with the disk: {}",
        info.total,
        info.reply
    );
    assert!(
        helper.log_text().contains(session_disk::GROWN),
        "{}",
        helper.log_text()
    );

    // deleteSessionDirs removes the session inside the guest.
    let r = pipe
        .call("deleteSessionDirs", json!({"names": [SESSION]}))
        .await
        .expect("deleteSessionDirs");
    assert_eq!(r["deleted"], json!([SESSION]), "{r}");
    let info = disk_info(&pipe).await;
    assert!(!info.lists(SESSION), "{}", info.reply);
    let e = read_kept(&pipe, SESSION)
        .await
        .expect_err("the deleted session's file is still readable");
    eprintln!("qemu_disk: readFile after deleteSessionDirs: {e}");
    pipe.call("stopVM", json!({})).await.expect("stopVM");
    assert_unlocked(&disk);
    drop(pipe);
    helper.stop_clean(QEMU_VERBOSE_ENV);
}
