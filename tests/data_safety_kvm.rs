//! Data safety of the session disk under `--backend kvm`: the in-process
//! virtio-blk device (on virtio-mmio, in the helper's own process) loses no
//! record a session fsynced and saw acknowledged, when
//!
//! - `stopVM` comes in the middle of heavy writes (the guest powers off);
//! - the helper itself is killed with SIGKILL in the middle of them (the
//!   VMM dies with it: no power-off, no sync, no teardown). A new helper on
//!   the same data directory boots the same profile; the disk was not
//!   cleanly unmounted, so ext4 replays its journal, and every acknowledged
//!   record is there, whole. The dead helper's lock on the image went with
//!   it.
//!
//! The same writer as the QEMU case (`tests/data_safety.rs`,
//! `support::fsync_records`): a python3 process appends 4 KiB records,
//! fsyncs each and prints `ack N`, beside a `dd` loop of unsynced 48 MiB
//! writes.
//!
//! Where it runs: directly on hosts whose `/dev/kvm` boots Linux, else
//! inside the nested-KVM harness (this binary re-runs itself in L1 with the
//! helper's files on L1's tmpfs), like `tests/kvm_backend.rs`. Gate: the
//! guest image with its default userland (python3); a loud skip without
//! it, a failure under `COWORK_NESTED_TESTS=1`.

mod support;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::json;
use support::fsync_records::{check_records, write_records};
use support::nested::{self, Mode};
use support::session;
use support::session_disk::{self, assert_unlocked};
use support::vm_helper::{self, built_helper, VmHelper};

/// Name of the test (what its nested re-run selects).
const TEST: &str = "kvm_stop_and_helper_kill_lose_nothing_that_was_fsynced";
/// Set (to 1) on the re-run inside the nested harness.
const INSIDE_ENV: &str = "COWORK_DATA_SAFETY_KVM_INSIDE";
/// Printed by the body when every check passed.
const OK_MARKER: &str = "data_safety_kvm: ok";
/// Prefix of the lines the body prints for the report.
const REPORT_PREFIX: &str = "data_safety_kvm: ";
/// Prints the helpers' whole logs at the end.
const VERBOSE_ENV: &str = "COWORK_DATA_SAFETY_KVM_VERBOSE";
/// Limit of the inner run (nested: the guest runs at TCG speed).
const INNER_TIMEOUT: Duration = Duration::from_secs(900);
/// Limit of the whole harness run (L1 boot included).
const HARNESS_TIMEOUT: Duration = Duration::from_secs(960);
/// Nested attempts (QEMU TCG's SVM emulation now and then faults a guest).
const NESTED_ATTEMPTS: u32 = 3;
/// Limit of one startVM, one request or one process's events.
const T: Duration = Duration::from_secs(180);
/// How long a kvm helper gets to listen on its socket.
const LISTEN_LIMIT: Duration = Duration::from_secs(30);
/// The test's profile and its `userDataRoot`.
const PROFILE: &str = "fsync-kvm";
const ROOT: &str = "/tmp/data-safety-kvm-profile";
/// The session that writes the records.
const SESSION: &str = "records";

/// Where the helpers' files go: inside the harness `/` is the host's over
/// virtiofs, so sockets, logs and the disk image stay on L1's own tmpfs.
fn base_dir() -> PathBuf {
    if std::env::var_os("COWORK_NESTED_INSIDE").is_some() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    }
}

#[test]
fn kvm_stop_and_helper_kill_lose_nothing_that_was_fsynced() {
    if std::env::var(INSIDE_ENV).is_ok_and(|v| v == "1") {
        body();
        return;
    }
    match vm_helper::image_for(&built_helper()) {
        Err(e) => return nested::unavailable(TEST, &format!("no guest image: {e}")),
        Ok(image) if image.rootfs.is_none() => return nested::unavailable(
            TEST,
            "the guest image has no default userland (rootfs.img); build it with scripts/setup.sh",
        ),
        Ok(_) => {}
    }
    let mode = nested::mode();
    if mode == Mode::Nested {
        if let Err(missing) = nested::harness_check() {
            return nested::unavailable(
                TEST,
                &format!("the nested-KVM harness is not usable: {missing}"),
            );
        }
    }
    match mode {
        Mode::Direct => body(),
        Mode::Nested => nested::rerun_test(&nested::Rerun {
            test: TEST,
            inside_env: INSIDE_ENV,
            ok_marker: OK_MARKER,
            report_prefix: REPORT_PREFIX,
            verbose_env: VERBOSE_ENV,
            inner_timeout: INNER_TIMEOUT,
            harness_timeout: HARNESS_TIMEOUT,
            attempts: NESTED_ATTEMPTS,
        }),
    }
}

fn body() {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(body_async());
    println!("{OK_MARKER}");
}

/// startVM with a small machine, within [`T`].
async fn start(pipe: &cowork_helper::client::Pipe, helper: &VmHelper, what: &str) {
    let t0 = Instant::now();
    tokio::time::timeout(
        T,
        pipe.call("startVM", json!({"memoryGB": 1, "cpuCount": 1})),
    )
    .await
    .unwrap_or_else(|_| panic!("{what}: startVM took over {T:?}\n{}", helper.log_text()))
    .unwrap_or_else(|e| panic!("{what}: startVM: {e}\n{}", helper.log_text()));
    println!("{REPORT_PREFIX}{what}: startVM took {:?}", t0.elapsed());
}

async fn body_async() {
    let exe = built_helper();
    let dir = tempfile::Builder::new()
        .prefix("cowork-data-safety-kvm-")
        .tempdir_in(base_dir())
        .expect("tempdir");
    let mut helper = VmHelper::start_in(&exe, dir.path(), "first", "kvm", LISTEN_LIMIT);
    let (pipe, mut sub) = session::client(&helper, PROFILE, ROOT, T).await;
    pipe.call("createVM", json!({"diskSizeGB": 1}))
        .await
        .expect("createVM");
    start(&pipe, &helper, "first boot").await;

    // stopVM in the middle of the writes.
    let acked = write_records(&pipe, &mut sub, T, SESSION, "stop", "records-stop").await;
    let stop_sent = Instant::now();
    pipe.call("stopVM", json!({})).await.expect("stopVM");
    println!(
        "{REPORT_PREFIX}stopVM after {acked} acknowledged records took {:?}",
        stop_sent.elapsed()
    );
    start(&pipe, &helper, "after stopVM").await;
    let beyond = check_records(
        &pipe,
        &mut sub,
        T,
        SESSION,
        "check-stop",
        "records-stop",
        acked,
    )
    .await;
    println!(
        "{REPORT_PREFIX}stopVM: all {acked} acknowledged records intact, {beyond} bytes beyond"
    );

    // Harder: the helper, and with it the VMM, killed in the middle of the
    // writes.
    let acked = write_records(&pipe, &mut sub, T, SESSION, "kill", "records-kill").await;
    let mut child = helper.take_child().expect("the first helper runs");
    child.kill().expect("SIGKILL the helper");
    child.wait().expect("reap the helper");
    drop(sub);
    drop(pipe);
    let first_log = helper.log_text();
    let disk = session_disk::image_path(dir.path(), PROFILE, ROOT);
    assert_unlocked(&disk);

    let mut helper = VmHelper::start_in(&exe, dir.path(), "second", "kvm", LISTEN_LIMIT);
    let (pipe, mut sub) = session::client(&helper, PROFILE, ROOT, T).await;
    start(&pipe, &helper, "after the helper was killed").await;
    let log = helper.log_text();
    assert!(
        log.contains(session_disk::NOT_CLEAN),
        "a killed VM's disk needs its journal replayed: {log}"
    );
    let beyond = check_records(
        &pipe,
        &mut sub,
        T,
        SESSION,
        "check-kill",
        "records-kill",
        acked,
    )
    .await;
    // The first file is still whole too.
    check_records(
        &pipe,
        &mut sub,
        T,
        SESSION,
        "check-stop-2",
        "records-stop",
        1,
    )
    .await;
    println!(
        "{REPORT_PREFIX}helper killed: all {acked} acknowledged records intact, {beyond} bytes beyond"
    );
    pipe.call("stopVM", json!({})).await.expect("stopVM");
    drop(sub);
    drop(pipe);
    if std::env::var_os(VERBOSE_ENV).is_some() {
        eprintln!("---- first helper's log ----\n{first_log}---- end ----");
    }
    helper.stop_clean(VERBOSE_ENV);
}
