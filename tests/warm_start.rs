//! Three starts of one profile's VM in one helper and data directory, as a
//! user's day has them: each start writes to the session disk and reads
//! back what the previous one wrote, reads 32 bytes of `/dev/urandom` and
//! the guest's wall clock. The disk holds every earlier start's file, the
//! random bytes of the three starts all differ (the agent reseeds the
//! kernel's RNG from host entropy in every boot's `Setup`, which is what
//! keeps restored machines from being clones), and the guest's clock is
//! within [`CLOCK_SLACK`] of the host's (the `Setup` sets it).
//!
//! Under `--backend qemu` here (TCG) and `--backend kvm` in the nested
//! harness. Under both the first start boots cold and takes the boot
//! snapshot, the second and third restore it (the log says which start
//! was which), and a fourth start after the snapshot's state file was
//! truncated boots cold again, says so in one log line and takes a new
//! snapshot; the checks are the same for every start. Under qemu each
//! restore also shows the guest a new VM generation ID (`vmgenid`).
//!
//! Gate: QEMU and the guest image with its userland (`COWORK_QEMU_TESTS=1`
//! makes them mandatory); the nested harness for kvm (`COWORK_NESTED_TESTS`).

mod support;

use std::collections::BTreeSet;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::json;
use support::gate::{qemu_gate, qemu_missing};
use support::nested;
use support::session::{self, bash, run};
use support::vm_helper::{self, built_helper, VmHelper, QEMU_VERBOSE_ENV};

/// Limit for startVM.
const START_LIMIT: Duration = Duration::from_secs(240);
/// Limit for one session command.
const T: Duration = Duration::from_secs(120);
/// How far the guest's wall clock may be from the host's.
const CLOCK_SLACK: Duration = Duration::from_secs(2);
/// Starts per run.
const STARTS: usize = 3;
/// Printed by the body when all its checks passed (for the nested re-run).
const OK_MARKER: &str = "WARM-START-CHECKS-PASSED";

fn host_now_secs() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs_f64()
}

/// The body: `STARTS` starts of one VM under `backend`.
async fn three_starts(backend: &str) {
    // Its own snapshot directory (not the nested harness's shared one):
    // the first start must be cold, and the test cuts the snapshot.
    let tmp = tempfile::Builder::new()
        .prefix("warm-start-")
        .tempdir_in(nested::helper_base_dir())
        .expect("tempdir");
    let snapshots = vm_helper::data_dir(tmp.path()).join("snapshots");
    let mut helper = VmHelper::start_in_with(
        &built_helper(),
        tmp.path(),
        "helper",
        backend,
        &["--snapshot-dir", &snapshots.to_string_lossy()],
        Duration::from_secs(15),
    );
    let (pipe, mut sub) = session::client(&helper, "warm", "/tmp/warm-profile", START_LIMIT).await;
    let mut randoms = BTreeSet::new();
    for start in 0..=STARTS {
        if start == STARTS {
            check_starts(backend, &helper.log_text(), &["cold", "warm", "warm"], 1);
            truncate_snapshot(backend, &snapshots);
        }
        session::start_vm(
            &pipe,
            &helper,
            json!({"memoryGB": 1}),
            START_LIMIT,
            "startVM",
        )
        .await;
        let script = format!(
            "set -e; ls /sessions/warm/start-* 2>/dev/null | wc -l; \
             echo {start} > /sessions/warm/start-{start}; sync; \
             head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; date +%s.%N"
        );
        let out = run(
            &pipe,
            &mut sub,
            bash(&format!("start-{start}"), "warm", &script),
            T,
        )
        .await;
        let received = host_now_secs();
        let text = out.stdout_str();
        assert_eq!(
            out.exit_code(),
            Some(0),
            "start {start}: {text} {}",
            out.stderr_str()
        );
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "start {start}: {text:?}");
        assert_eq!(
            lines[0].trim().parse::<usize>().expect("a count"),
            start,
            "start {start} must find every earlier start's file on the session disk"
        );
        assert_eq!(lines[1].len(), 64, "32 random bytes as hex: {text:?}");
        assert!(
            randoms.insert(lines[1].to_string()),
            "start {start} repeated an earlier start's random bytes"
        );
        let guest: f64 = lines[2].trim().parse().expect("guest time");
        let skew = (received - guest).abs();
        assert!(
            skew <= CLOCK_SLACK.as_secs_f64(),
            "start {start}: the guest's clock is {skew:.3} s off the host's"
        );
        eprintln!("warm_start: start {start} under {backend}: clock skew {skew:.3} s");
        pipe.call("stopVM", json!({})).await.expect("stopVM");
    }
    let log = helper.log_text();
    // QEMU is started for the truncated snapshot (its header is whole) and
    // fails on the stream; the kvm backend's restore fails before a VM is.
    let after_truncation: &[&str] = if backend == "kvm" {
        &["cold", "warm", "warm", "cold"]
    } else {
        &["cold", "warm", "warm", "warm", "cold"]
    };
    check_starts(backend, &log, after_truncation, 2);
    if backend == "qemu" {
        // Each restore shows the guest a new VM generation ID.
        let ids: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("qemu boot snapshot restored"))
            .filter_map(|l| l.split("generation_id=").nth(1))
            .filter_map(|rest| rest.split_whitespace().next())
            .collect();
        assert_eq!(ids.len(), 2, "two restores:\n{log}");
        assert_ne!(ids[0], ids[1], "a generation ID repeated:\n{log}");
        assert!(
            ids.iter()
                .all(|id| id.len() == 36 && id.matches('-').count() == 4),
            "{ids:?}"
        );
    }
    assert_eq!(
        log.matches("the boot snapshot cannot be restored").count(),
        1,
        "one line for the truncated snapshot:\n{log}"
    );
    helper.stop_clean(QEMU_VERBOSE_ENV);
}

/// Asserts that `backend`'s starts were `kinds` (cold or warm, in order)
/// and that it took `snapshots` boot snapshots.
fn check_starts(backend: &str, log: &str, kinds: &[&str], snapshots: usize) {
    let started_line = if backend == "kvm" {
        "kvm vm started"
    } else {
        "qemu started"
    };
    let started: Vec<&str> = log
        .lines()
        .filter(|l| l.contains(started_line))
        .map(|l| {
            if l.contains("start=\"warm\"") || l.contains("start=warm") {
                "warm"
            } else {
                "cold"
            }
        })
        .collect();
    assert_eq!(started, kinds, "the starts, in order:\n{log}");
    assert_eq!(
        log.matches("boot snapshot taken").count(),
        snapshots,
        "boot snapshots taken:\n{log}"
    );
}

/// Cuts the state file of `backend`'s one boot snapshot under `snapshots`
/// in half.
fn truncate_snapshot(backend: &str, snapshots: &std::path::Path) {
    let stores: Vec<_> = std::fs::read_dir(snapshots)
        .expect("the snapshot directory")
        .flatten()
        .map(|e| e.path())
        .collect();
    assert_eq!(stores.len(), 1, "{stores:?}");
    let state = stores[0].join(if backend == "kvm" {
        "vm.state"
    } else {
        "qemu.state"
    });
    let len = std::fs::metadata(&state).expect("the state file").len();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&state)
        .expect("open the state file");
    f.set_len(len / 2).expect("truncate");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_starts_qemu() {
    let test = "three_starts_qemu";
    let no_rootfs = vm_helper::userland_image_missing(&built_helper());
    if !qemu_gate(test, test, [qemu_missing(), no_rootfs]) {
        return;
    }
    three_starts("qemu").await;
}

/// Set (to 1) on the re-run inside the nested harness.
const KVM_INSIDE_ENV: &str = "COWORK_WARM_START_KVM_INSIDE";
/// Prints the nested run's whole output when set.
const KVM_VERBOSE_ENV: &str = "COWORK_WARM_START_KVM_VERBOSE";

#[test]
fn three_starts_kvm() {
    nested::run_on_linux_kvm(
        &nested::Rerun {
            test: "three_starts_kvm",
            inside_env: KVM_INSIDE_ENV,
            ok_marker: OK_MARKER,
            report_prefix: "warm_start: ",
            verbose_env: KVM_VERBOSE_ENV,
            inner_timeout: Duration::from_secs(1200),
            harness_timeout: Duration::from_secs(1300),
            attempts: 2,
        },
        || vm_helper::userland_image_missing(&built_helper()),
        || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(three_starts("kvm"));
            println!("{OK_MARKER}");
        },
    );
}
