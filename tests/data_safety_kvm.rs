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

use std::path::{Path, PathBuf};
use std::time::Duration;

use cowork_helper::client::{Pipe, Subscription};
use serde_json::json;
use support::fsync_records;
use support::nested;
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

#[test]
fn kvm_stop_and_helper_kill_lose_nothing_that_was_fsynced() {
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
        || vm_helper::userland_image_missing(&built_helper()),
        body,
    );
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

/// The fsync case's VM under `--backend kvm`: killed by killing the helper
/// (the VMM is in its process); the next boot is a new helper's, on the
/// same data directory.
struct KvmRig {
    dir: PathBuf,
    helper: VmHelper,
    /// Helpers started so far (names their socket and log).
    helpers: u32,
    pipe: Pipe,
    sub: Subscription,
    /// The logs of the helpers killed so far.
    earlier_logs: String,
}

impl KvmRig {
    async fn new(dir: &Path) -> KvmRig {
        let helper = VmHelper::start_in(&built_helper(), dir, "helper1", "kvm", LISTEN_LIMIT);
        let (pipe, sub) = session::client(&helper, PROFILE, ROOT, T).await;
        KvmRig {
            dir: dir.to_path_buf(),
            helper,
            helpers: 1,
            pipe,
            sub,
            earlier_logs: String::new(),
        }
    }
}

impl fsync_records::Rig for KvmRig {
    fn client(&mut self) -> (&Pipe, &mut Subscription) {
        (&self.pipe, &mut self.sub)
    }

    fn log(&self) -> String {
        self.helper.log_text()
    }

    async fn start(&mut self, what: &str) {
        let params = json!({"memoryGB": 1, "cpuCount": 1});
        let took = session::start_vm(&self.pipe, &self.helper, params, T, what).await;
        println!("{REPORT_PREFIX}{what}: startVM took {took:?}");
    }

    /// SIGKILL to the helper; then a new helper on the same data directory,
    /// once the image is unlocked (the lock died with the helper).
    async fn kill(&mut self) {
        let mut child = self.helper.take_child().expect("the helper runs");
        child.kill().expect("SIGKILL the helper");
        child.wait().expect("reap the helper");
        self.earlier_logs.push_str(&self.helper.log_text());
        assert_unlocked(&session_disk::image_path(&self.dir, PROFILE, ROOT));
        self.helpers += 1;
        let name = format!("helper{}", self.helpers);
        self.helper = VmHelper::start_in(&built_helper(), &self.dir, &name, "kvm", LISTEN_LIMIT);
        (self.pipe, self.sub) = session::client(&self.helper, PROFILE, ROOT, T).await;
    }
}

async fn body_async() {
    let dir = tempfile::Builder::new()
        .prefix("cowork-data-safety-kvm-")
        .tempdir_in(nested::helper_base_dir())
        .expect("tempdir");
    let mut rig = KvmRig::new(dir.path()).await;
    rig.pipe
        .call("createVM", json!({"diskSizeGB": 1}))
        .await
        .expect("createVM");
    fsync_records::Rig::start(&mut rig, "first boot").await;
    for line in fsync_records::fsync_case(&mut rig, T, SESSION).await {
        println!("{REPORT_PREFIX}{line}");
    }
    rig.pipe.call("stopVM", json!({})).await.expect("stopVM");
    let KvmRig {
        mut helper,
        pipe,
        sub,
        earlier_logs,
        ..
    } = rig;
    drop(sub);
    drop(pipe);
    if std::env::var_os(VERBOSE_ENV).is_some() {
        eprintln!("---- the killed helpers' logs ----\n{earlier_logs}---- end ----");
    }
    helper.stop_clean(VERBOSE_ENV);
}
