//! `cowork-helper bench boot` end to end: the built helper boots the guest
//! image with its Debian userland through the real startVM path and reports
//! the boot phases as JSON and as an SVG chart.
//!
//! - `bench_boot_qemu_json_and_chart`: `--backend qemu -n 1 --json --chart
//!   F` here (QEMU TCG on this machine); every phase is present and
//!   positive, the kvm-only sources are not invented, the chart is an SVG
//!   naming the backend. Gate: QEMU and a guest image with `rootfs.img`
//!   (`scripts/setup.sh`); with `COWORK_QEMU_TESTS=1` a missing one fails.
//! - `bench_boot_kvm_nested`: the same with `--backend kvm`, where this
//!   host's KVM boots Linux, else re-run inside the nested-KVM harness
//!   (`tests/support/nested.rs`); gated by `COWORK_NESTED_TESTS=1` like the
//!   other nested suites. It also checks the kvm-only phase sources: the
//!   VMM's first `KVM_RUN` and the boot-port marks.
//!
//! Only the shape and signs are asserted: timing targets are for the
//! benchmark itself (docs/boot.md), not for tests.

mod support;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use support::gate::{qemu_gate, qemu_missing};
use support::nested;
use support::vm_helper::{self, built_helper};

/// Every phase key the JSON must hold (`bench::boot::phases::Phase::ALL`).
const PHASES: [&str; 10] = [
    "helper_to_vmm_ready",
    "vmm_ready_to_kernel",
    "kernel_to_agent",
    "agent_to_userland",
    "userland_to_hello",
    "agent_to_hello",
    "kernel_to_hello",
    "hello_to_connected",
    "startvm_to_connected",
    "first_spawn_to_exit",
];
/// Name of the nested test (what its re-run selects).
const KVM_TEST: &str = "bench_boot_kvm_nested";
/// Set (to 1) on the re-run inside the nested harness.
const INSIDE_ENV: &str = "COWORK_BENCH_BOOT_INSIDE";
/// Line the nested body prints when every check passed.
const OK_MARKER: &str = "bench_boot: ok";
/// Prefix of the lines the nested body reports.
const REPORT_PREFIX: &str = "bench_boot: ";
/// Prints the inner run's whole output.
const VERBOSE_ENV: &str = "COWORK_BENCH_BOOT_VERBOSE";
/// Limit of one `bench boot` run (a TCG boot under load, or a nested one).
const BENCH_LIMIT: Duration = Duration::from_secs(600);
/// Limit of the harness run (L1 boot included).
const HARNESS_LIMIT: Duration = Duration::from_secs(720);
/// Nested attempts (QEMU TCG's SVM emulation now and then kills a boot).
const NESTED_ATTEMPTS: u32 = 3;

/// Runs `bench boot --backend BACKEND -n 1 --warmup 0 --json --chart CHART`
/// with its temporary files under `tmp`; returns the parsed JSON.
fn run_bench(backend: &str, tmp: &Path, chart: &Path) -> Value {
    let mut cmd = Command::new(built_helper());
    cmd.args([
        "bench",
        "boot",
        "--backend",
        backend,
        "-n",
        "1",
        "--warmup",
        "0",
        "--json",
    ])
    .arg("--chart")
    .arg(chart)
    .env("TMPDIR", tmp);
    let out = nested::run_with_timeout(&mut cmd, BENCH_LIMIT).expect("run bench boot");
    assert!(!out.timed_out, "bench boot timed out:\n{}", out.stderr);
    assert!(
        out.status.success(),
        "bench boot failed ({}):\nstderr:\n{}\nstdout:\n{}",
        out.status,
        out.stderr,
        out.stdout
    );
    assert!(
        out.stderr
            .contains(&format!("bench boot: {backend} 1/1: startVM → connected")),
        "no progress line on stderr:\n{}",
        out.stderr
    );
    serde_json::from_str(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}):\n{}", out.stdout))
}

/// The checks both backends share; returns the one run's phases.
fn check_report(v: &Value, backend: &str, chart: &Path) -> serde_json::Map<String, Value> {
    assert_eq!(v["schema"], "cowork-helper bench boot v1", "{v:#}");
    assert_eq!(v["runs"], 1);
    assert_eq!(v["userland"], "default");
    assert!(v["ratios"].is_null(), "one backend gives no ratios: {v:#}");
    let backends = v["backends"].as_array().expect("backends array");
    assert_eq!(backends.len(), 1, "{v:#}");
    let b = &backends[0];
    assert_eq!(b["backend"], backend);
    assert_eq!(b["failures"].as_array().map(Vec::len), Some(0), "{v:#}");
    let runs = b["runs"].as_array().expect("runs array");
    assert_eq!(runs.len(), 1, "{v:#}");
    let run = runs[0].as_object().expect("a run is an object").clone();
    for key in PHASES {
        let ms = run
            .get(key)
            .unwrap_or_else(|| panic!("{key} missing: {v:#}"));
        let ms = ms
            .as_f64()
            .unwrap_or_else(|| panic!("{backend} did not measure {key}: {v:#}"));
        assert!(ms > 0.0 && ms.is_finite(), "{key} = {ms}: {v:#}");
        let s = &b["summary"][key];
        assert_eq!(s["n"], 1, "{key}: {v:#}");
        assert_eq!(s["median_ms"].as_f64(), Some(ms), "{key}: {v:#}");
        assert_eq!(s["p90_ms"].as_f64(), Some(ms), "{key}: {v:#}");
    }
    // The phases that follow each other add up to startVM → connected
    // (to within the rounding of each to a microsecond).
    let sum: f64 = [
        "helper_to_vmm_ready",
        "vmm_ready_to_kernel",
        "kernel_to_agent",
        "agent_to_userland",
        "userland_to_hello",
        "hello_to_connected",
    ]
    .iter()
    .map(|k| run[*k].as_f64().unwrap_or_default())
    .sum();
    let total = run["startvm_to_connected"].as_f64().unwrap_or_default();
    assert!((sum - total).abs() < 0.1, "{sum} != {total}: {v:#}");
    let svg = std::fs::read_to_string(chart).expect("the chart file");
    assert!(
        svg.starts_with("<svg"),
        "not an SVG: {}",
        &svg[..svg.len().min(200)]
    );
    assert!(svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains(backend) && svg.contains("kernel → agent start"));
    run
}

#[test]
fn bench_boot_qemu_json_and_chart() {
    if !qemu_gate(
        "bench_boot_qemu_json_and_chart",
        "the bench boot QEMU test",
        [
            qemu_missing(),
            vm_helper::userland_image_missing(&built_helper()),
        ],
    ) {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let chart = tmp.path().join("boot.svg");
    let v = run_bench("qemu", tmp.path(), &chart);
    check_report(&v, "qemu", &chart);
    let accel = v["backends"][0]["accel"].as_str().unwrap_or_default();
    assert!(accel == "tcg" || accel == "kvm", "{v:#}");
    eprintln!(
        "bench_boot: qemu ({accel}) startVM → connected {} ms",
        v["backends"][0]["runs"][0]["startvm_to_connected"]
    );
}

#[test]
fn bench_boot_kvm_nested() {
    nested::run_on_linux_kvm(
        &nested::Rerun {
            test: KVM_TEST,
            inside_env: INSIDE_ENV,
            ok_marker: OK_MARKER,
            report_prefix: REPORT_PREFIX,
            verbose_env: VERBOSE_ENV,
            inner_timeout: BENCH_LIMIT,
            harness_timeout: HARNESS_LIMIT,
            attempts: NESTED_ATTEMPTS,
        },
        || vm_helper::userland_image_missing(&built_helper()),
        kvm_body,
    );
}

/// `bench boot --backend kvm` where KVM boots Linux (directly, or inside L1).
fn kvm_body() {
    let tmp = tempfile::tempdir_in(nested::helper_base_dir()).unwrap();
    let chart = tmp.path().join("boot.svg");
    let v = run_bench("kvm", tmp.path(), &chart);
    let run = check_report(&v, "kvm", &chart);
    assert_eq!(v["backends"][0]["accel"], "kvm", "{v:#}");
    println!(
        "{REPORT_PREFIX}kvm startVM → connected {} ms, helper → first KVM_RUN {} ms, kernel → hello {} ms",
        run["startvm_to_connected"], run["helper_to_vmm_ready"], run["kernel_to_hello"]
    );
    println!("{OK_MARKER}");
}
