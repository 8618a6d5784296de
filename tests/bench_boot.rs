//! `cowork-helper bench boot` end to end: the built helper boots the guest
//! image with its Debian userland through the real startVM path and reports
//! the boot phases as JSON and as an SVG chart.
//!
//! - `bench_boot_qemu_json_and_chart`: `--backend qemu --start both -n 1
//!   --json --chart F` here (QEMU TCG on this machine); the cold series has
//!   every cold phase present and positive, adding up; the warm series (its
//!   first, unmeasured boot takes the boot snapshot, the measured one
//!   restores it: the bench fails a run whose log does not say
//!   `start="warm"`) has qemu's restore steps and the warm phases, adding
//!   up, none of the cold kernel and agent phases nor kvm's restore phases,
//!   its snapshot and a warm/cold ratio; the chart is an SVG naming both
//!   series. Gate: QEMU and a guest image with `rootfs.img` and an agent
//!   with `template-console` (`scripts/setup.sh`); with
//!   `COWORK_QEMU_TESTS=1` a missing one fails.
//! - `bench_boot_kvm_nested`: `--backend kvm --start both` where this
//!   host's KVM boots Linux, else re-run inside the nested-KVM harness
//!   (`tests/support/nested.rs`); gated by `COWORK_NESTED_TESTS=1` like the
//!   other nested suites. The cold series gets the same checks as qemu's
//!   plus the kvm-only phase sources (the VMM's first `KVM_RUN` and the
//!   boot-port marks); the warm series (its first, unmeasured boot takes
//!   the boot snapshot, the measured one restores it: the bench fails a
//!   run whose log does not say `start="warm"`) must have every restore
//!   and warm phase, none of the cold kernel and agent phases, its
//!   snapshot, and warm/cold ratios.
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

/// The phase keys a cold run must measure (`bench::boot::phases::Phase`).
const PHASES: [&str; 12] = [
    "helper_to_vmm_ready",
    "vmm_ready_to_kernel",
    "kernel_to_agent",
    "agent_to_userland",
    "userland_to_hello",
    "agent_to_hello",
    "kernel_to_hello",
    "hello_to_connected",
    "vmm_ready_to_hello_read",
    "hello_read_to_connected",
    "startvm_to_connected",
    "first_spawn_to_exit",
];
/// The cold phases that follow each other from startVM to connected.
const COLD_TIMELINE: [&str; 6] = [
    "helper_to_vmm_ready",
    "vmm_ready_to_kernel",
    "kernel_to_agent",
    "agent_to_userland",
    "userland_to_hello",
    "hello_to_connected",
];
/// The phase keys a warm run of either backend must measure, more than
/// 0 ms.
const WARM_PHASES: [&str; 9] = [
    "helper_to_restore",
    "restore_total",
    "vm_run_to_redial",
    "redial_to_hello_read",
    "helper_to_vmm_ready",
    "vmm_ready_to_hello_read",
    "hello_read_to_connected",
    "startvm_to_connected",
    "first_spawn_to_exit",
];
/// A kvm warm run's restore phases and the hand-over to the first
/// `KVM_RUN`: measured, but each may round to 0 µs.
const WARM_SHORT_PHASES: [&str; 7] = [
    "restore_state",
    "restore_kvm",
    "restore_memory",
    "restore_vcpus",
    "restore_vm",
    "restore_devices",
    "restored_to_vm_run",
];
/// The kvm warm phases that follow each other from startVM to connected.
const WARM_TIMELINE: [&str; 11] = [
    "helper_to_restore",
    "restore_state",
    "restore_kvm",
    "restore_memory",
    "restore_vcpus",
    "restore_vm",
    "restore_devices",
    "restored_to_vm_run",
    "vm_run_to_redial",
    "redial_to_hello_read",
    "hello_read_to_connected",
];
/// A qemu warm run's restore steps, more than 0 ms.
const QEMU_RESTORE_PHASES: [&str; 4] = [
    "restore_ram",
    "restore_spawn",
    "restore_load",
    "restore_hotplug",
];
/// The qemu warm phases that follow each other from startVM to connected.
const QEMU_WARM_TIMELINE: [&str; 8] = [
    "helper_to_restore",
    "restore_ram",
    "restore_spawn",
    "restore_load",
    "restore_hotplug",
    "vm_run_to_redial",
    "redial_to_hello_read",
    "hello_read_to_connected",
];
/// The cold phases a warm run must not have (they would be the snapshot's
/// own boot).
const COLD_ONLY: [&str; 7] = [
    "vmm_ready_to_kernel",
    "kernel_to_agent",
    "agent_to_userland",
    "userland_to_hello",
    "agent_to_hello",
    "kernel_to_hello",
    "hello_to_connected",
];
/// How far the stacked phases' sum may be from startVM → connected (ms):
/// each phase is rounded to a microsecond; a warm run's restore phases
/// are the VMM's laps, truncated to a microsecond each and ending a moment
/// before its total.
const SUM_TOLERANCE_MS: f64 = 0.5;
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
/// Limit of one `bench boot --start both` run of qemu: two cold TCG boots
/// (one measured, one taking the snapshot) and a warm start, under load.
const BENCH_LIMIT: Duration = Duration::from_secs(900);
/// Limit of the nested `bench boot --start both` run: two cold boots (one
/// measured, one taking the snapshot) and a warm start, at nested speed.
const KVM_BENCH_LIMIT: Duration = Duration::from_secs(1200);
/// Limit of the harness run (L1 boot included).
const HARNESS_LIMIT: Duration = Duration::from_secs(1320);
/// Nested attempts (QEMU TCG's SVM emulation now and then kills a boot).
const NESTED_ATTEMPTS: u32 = 3;

/// Runs `bench boot --backend BACKEND --start START -n 1 --warmup 0 --json
/// --chart CHART` with its temporary files under `tmp`; returns the parsed
/// JSON.
fn run_bench(backend: &str, start: &str, tmp: &Path, chart: &Path, limit: Duration) -> Value {
    let mut cmd = Command::new(built_helper());
    cmd.args([
        "bench",
        "boot",
        "--backend",
        backend,
        "--start",
        start,
        "-n",
        "1",
        "--warmup",
        "0",
        "--json",
    ])
    .arg("--chart")
    .arg(chart)
    .env("TMPDIR", tmp);
    let out = nested::run_with_timeout(&mut cmd, limit).expect("run bench boot");
    assert!(!out.timed_out, "bench boot timed out:\n{}", out.stderr);
    assert!(
        out.status.success(),
        "bench boot failed ({}):\nstderr:\n{}\nstdout:\n{}",
        out.status,
        out.stderr,
        out.stdout
    );
    let kinds: &[&str] = if start == "both" {
        &["cold", "warm"]
    } else {
        &[start]
    };
    for kind in kinds {
        assert!(
            out.stderr.contains(&format!(
                "bench boot: {backend} {kind} 1/1: startVM → connected"
            )),
            "no {kind} progress line on stderr:\n{}",
            out.stderr
        );
    }
    serde_json::from_str(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}):\n{}", out.stdout))
}

/// The checks of the document and of the chart; returns the series.
fn check_document(v: &Value, backend: &str, kinds: &[&str], chart: &Path) -> Vec<Value> {
    assert_eq!(v["schema"], "cowork-helper bench boot v2", "{v:#}");
    assert_eq!(v["runs"], 1);
    assert_eq!(v["userland"], "default");
    assert!(
        v["ratios"].is_null(),
        "one backend gives no kvm/qemu ratios: {v:#}"
    );
    let series = v["backends"].as_array().expect("backends array").clone();
    assert_eq!(series.len(), kinds.len(), "{v:#}");
    for (s, kind) in series.iter().zip(kinds) {
        assert_eq!(s["backend"], backend, "{v:#}");
        assert_eq!(s["start"], *kind, "{v:#}");
        assert_eq!(s["failures"].as_array().map(Vec::len), Some(0), "{v:#}");
        assert_eq!(s["runs"].as_array().map(Vec::len), Some(1), "{v:#}");
        assert_eq!(s["runs"][0]["start"], *kind, "{v:#}");
    }
    let svg = std::fs::read_to_string(chart).expect("the chart file");
    assert!(
        svg.starts_with("<svg"),
        "not an SVG: {}",
        &svg[..svg.len().min(200)]
    );
    assert!(svg.trim_end().ends_with("</svg>"));
    for kind in kinds {
        assert!(svg.contains(&format!("{backend} {kind}")), "no {kind} bar");
    }
    series
}

/// `keys` of the run are measured: more than 0 ms, or at least 0 with
/// `may_be_zero`; each is its own series' median and p90 (one run).
fn check_measured(s: &Value, keys: &[&str], may_be_zero: bool, v: &Value) {
    let run = &s["runs"][0];
    for key in keys {
        let ms = run
            .get(*key)
            .unwrap_or_else(|| panic!("{key} missing: {v:#}"))
            .as_f64()
            .unwrap_or_else(|| panic!("{} did not measure {key}: {v:#}", s["start"]));
        let ok = ms.is_finite() && (ms > 0.0 || (may_be_zero && ms == 0.0));
        assert!(ok, "{key} = {ms}: {v:#}");
        let sum = &s["summary"][key];
        assert_eq!(sum["n"], 1, "{key}: {v:#}");
        assert_eq!(sum["median_ms"].as_f64(), Some(ms), "{key}: {v:#}");
        assert_eq!(sum["p90_ms"].as_f64(), Some(ms), "{key}: {v:#}");
    }
}

/// The stacked phases add up to startVM → connected.
fn check_sum(s: &Value, timeline: &[&str], v: &Value) {
    let run = &s["runs"][0];
    let sum: f64 = timeline
        .iter()
        .map(|k| run[*k].as_f64().unwrap_or_default())
        .sum();
    let total = run["startvm_to_connected"].as_f64().unwrap_or_default();
    assert!(
        (sum - total).abs() < SUM_TOLERANCE_MS,
        "{} phases add up to {sum}, not {total}: {v:#}",
        s["start"]
    );
}

/// A cold series: every cold phase measured, adding up; returns its run.
fn check_cold(s: &Value, v: &Value) -> Value {
    check_measured(s, &PHASES, false, v);
    check_sum(s, &COLD_TIMELINE, v);
    s["runs"][0].clone()
}

/// Why the helper's guest image cannot take a qemu boot snapshot (its
/// agent lacks `template-console`); `None` when it can, or when there is
/// no image (said by the userland gate).
fn template_console_missing() -> Option<String> {
    let img = vm_helper::image_for(&built_helper()).ok()?;
    (!img.template_console).then(|| {
        format!(
            "the guest image {} has no AGENT_FEATURES=template-console (no qemu warm start); rebuild it with scripts/setup.sh",
            img.dir.display()
        )
    })
}

#[test]
fn bench_boot_qemu_json_and_chart() {
    if !qemu_gate(
        "bench_boot_qemu_json_and_chart",
        "the bench boot QEMU test",
        [
            qemu_missing(),
            vm_helper::userland_image_missing(&built_helper()),
            template_console_missing(),
        ],
    ) {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let chart = tmp.path().join("boot.svg");
    let v = run_bench("qemu", "both", tmp.path(), &chart, BENCH_LIMIT);
    let series = check_document(&v, "qemu", &["cold", "warm"], &chart);
    let cold = check_cold(&series[0], &v);
    assert!(series[0]["snapshot"].is_null(), "{v:#}");
    let accel = v["backends"][0]["accel"].as_str().unwrap_or_default();
    assert!(accel == "tcg" || accel == "kvm", "{v:#}");
    assert_eq!(v["backends"][1]["accel"], accel, "{v:#}");

    let warm = &series[1];
    check_measured(warm, &WARM_PHASES, false, &v);
    check_measured(warm, &QEMU_RESTORE_PHASES, false, &v);
    check_sum(warm, &QEMU_WARM_TIMELINE, &v);
    for key in COLD_ONLY.iter().chain(&WARM_SHORT_PHASES) {
        assert!(
            warm["runs"][0][key].is_null(),
            "a qemu warm run reported {key} (the snapshot's boot, or kvm's restore): {v:#}"
        );
    }
    let snapshot = &warm["snapshot"];
    assert!(
        snapshot["stopped_ms"].as_f64().is_some_and(|ms| ms > 0.0),
        "no snapshot taken by the warm-up boot: {v:#}"
    );
    for s in &series {
        assert_eq!(s["rss_process"], "qemu", "{v:#}");
        assert!(
            s["rss_after_connected"][0]["anon_kib"]
                .as_u64()
                .is_some_and(|k| k > 0),
            "no QEMU resident memory: {v:#}"
        );
    }
    let ratio = v["warm_cold_ratios"]["qemu"]["startvm_to_connected"].as_f64();
    assert!(
        ratio.is_some_and(|r| r > 0.0 && r.is_finite()),
        "no warm/cold ratio: {v:#}"
    );
    let svg = std::fs::read_to_string(&chart).expect("the chart file");
    assert!(
        svg.contains("restore: RAM copied into memfd"),
        "no restore segment"
    );
    let w = &warm["runs"][0];
    eprintln!(
        "bench_boot: qemu ({accel}) cold startVM → connected {} ms; warm {} ms, restore {} ms (warm/cold {})",
        cold["startvm_to_connected"],
        w["startvm_to_connected"],
        w["restore_total"],
        ratio.unwrap_or_default()
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
            inner_timeout: KVM_BENCH_LIMIT,
            harness_timeout: HARNESS_LIMIT,
            attempts: NESTED_ATTEMPTS,
        },
        || vm_helper::userland_image_missing(&built_helper()),
        kvm_body,
    );
}

/// `bench boot --backend kvm --start both` where KVM boots Linux (directly,
/// or inside L1).
fn kvm_body() {
    let tmp = tempfile::tempdir_in(nested::helper_base_dir()).unwrap();
    let chart = tmp.path().join("boot.svg");
    let v = run_bench("kvm", "both", tmp.path(), &chart, KVM_BENCH_LIMIT);
    let series = check_document(&v, "kvm", &["cold", "warm"], &chart);
    for s in &series {
        assert_eq!(s["accel"], "kvm", "{v:#}");
    }
    let cold = check_cold(&series[0], &v);
    assert!(series[0]["snapshot"].is_null(), "{v:#}");

    let warm = &series[1];
    check_measured(warm, &WARM_PHASES, false, &v);
    check_measured(warm, &WARM_SHORT_PHASES, true, &v);
    check_sum(warm, &WARM_TIMELINE, &v);
    for key in COLD_ONLY {
        assert!(
            warm["runs"][0][key].is_null(),
            "a warm run reported {key} (the snapshot's boot): {v:#}"
        );
    }
    let snapshot = &warm["snapshot"];
    assert!(
        snapshot["snapshot_ms"].as_f64().is_some_and(|ms| ms > 0.0),
        "no snapshot taken by the warm-up boot: {v:#}"
    );
    let ratio = v["warm_cold_ratios"]["kvm"]["startvm_to_connected"].as_f64();
    assert!(
        ratio.is_some_and(|r| r > 0.0 && r.is_finite()),
        "no warm/cold ratio: {v:#}"
    );
    let svg = std::fs::read_to_string(&chart).expect("the chart file");
    assert!(svg.contains("restore: guest memory"), "no restore segment");
    let w = &warm["runs"][0];
    println!(
        "{REPORT_PREFIX}kvm cold startVM → connected {} ms, helper → first KVM_RUN {} ms, kernel → hello {} ms",
        cold["startvm_to_connected"], cold["helper_to_vmm_ready"], cold["kernel_to_hello"]
    );
    println!(
        "{REPORT_PREFIX}kvm warm startVM → connected {} ms, restore {} ms, VM runs → final hello {} ms (warm/cold {})",
        w["startvm_to_connected"],
        w["restore_total"],
        w["vmm_ready_to_hello_read"],
        ratio.unwrap_or_default()
    );
    println!("{OK_MARKER}");
}
