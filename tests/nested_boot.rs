//! Full-boot test: `cowork-helper vm run` boots Debian's stock cloud kernel
//! (`linux-image-cloud-amd64`, fetched by `scripts/fetch-kernel.sh`) with a tiny busybox
//! initramfs (`scripts/initramfs/boot-test-init`) that prints a marker and the online CPUs and
//! resets the machine; with `--cpus 2` both CPUs must come online. This checks the boot path,
//! ACPI/MP tables and CPUID against a real kernel.
//!
//! Where it runs:
//! - directly, on hosts whose `/dev/kvm` can boot Linux (vmx/svm flag, not PVM);
//! - otherwise inside the nested-KVM harness (`scripts/nested-run.sh`: QEMU TCG L1 guest with
//!   emulated SVM, the host's `/` shared over virtiofs).
//!
//! Gating: skipped, with a loud notice, only when the kernel or QEMU (nested mode) is absent and
//! `COWORK_NESTED_TESTS` is not `1`. With `COWORK_NESTED_TESTS=1` (CI) a missing kernel is
//! fetched and anything else missing fails the test.
//!
//! Knobs: `COWORK_NESTED_MODE=direct|nested` forces the mode; `COWORK_NESTED_VMM=qemu` boots the
//! same kernel and initramfs with `qemu-system-x86_64 -enable-kvm -M microvm` instead of
//! cowork-helper, to validate the harness and the test itself independently of our VMM.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use support::nested::{self, shell_quote, Kernel, Mode};

const BOOT_MARKER: &str = "COWORK-BOOT-OK";
const CPUS_MARKER: &str = "COWORK-BOOT-CPUS ";
/// What boot-test-init also writes to /dev/kmsg (printed by the kernel's polled console).
const KMSG_MARKER: &str = "cowork-boot-init: ran";
const CPUS: u32 = 2;
const MEM_MIB: u32 = 256;
/// Limit for one guest boot inside L1 (everything there runs at TCG speed; measured ~20 s).
const NESTED_VMM_TIMEOUT: Duration = Duration::from_secs(240);
/// Limit for the whole harness run (L1 boot, ~4 s, included).
const NESTED_HARNESS_TIMEOUT: Duration = Duration::from_secs(330);
/// Limit for one guest boot on a host with hardware KVM.
const DIRECT_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Vmm {
    CoworkHelper,
    /// QEMU with `-M microvm` as a stand-in for our VMM (`COWORK_NESTED_VMM=qemu`).
    Qemu,
}

#[derive(Debug, Clone, Copy)]
enum KernelFormat {
    BzImage,
    ElfVmlinux,
}

struct Plan {
    mode: Mode,
    vmm: Vmm,
    kernel: Kernel,
}

/// Decide how to run, or `None` after a loud skip notice. Panics when the test is required
/// (`COWORK_NESTED_TESTS=1`) and something is missing.
fn plan(test: &str) -> Option<Plan> {
    let required = nested::nested_tests_required();
    let unavailable = |reason: String| -> Option<Plan> {
        nested::unavailable(test, &reason);
        None
    };

    let vmm = match std::env::var("COWORK_NESTED_VMM").as_deref() {
        Ok("qemu") => Vmm::Qemu,
        Ok("cowork-helper") | Ok("") | Err(_) => Vmm::CoworkHelper,
        Ok(other) => panic!("COWORK_NESTED_VMM must be 'qemu' or 'cowork-helper', not '{other}'"),
    };
    let mode = nested::mode();

    let kernel = match nested::cached_kernel() {
        Some(k) => k,
        None if required => match nested::fetch_kernel() {
            Ok(k) => k,
            Err(e) => panic!("COWORK_NESTED_TESTS=1 and fetching the kernel failed: {e}"),
        },
        None => {
            return unavailable(format!(
                "no guest kernel cached in {} (run scripts/fetch-kernel.sh)",
                nested::guest_cache_dir().display()
            ))
        }
    };

    if mode == Mode::Nested {
        if let Err(missing) = nested::harness_check() {
            return unavailable(format!("the nested-KVM harness is not usable: {missing}"));
        }
    }
    if vmm == Vmm::Qemu && which("qemu-system-x86_64").is_none() {
        return unavailable(
            "COWORK_NESTED_VMM=qemu but qemu-system-x86_64 is not installed".into(),
        );
    }
    Some(Plan { mode, vmm, kernel })
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

/// The VMM command line for one boot, as an argument vector.
fn vmm_argv(vmm: Vmm, kernel: &Path, initrd: &Path) -> Vec<String> {
    let kernel = kernel.display().to_string();
    let initrd = initrd.display().to_string();
    match vmm {
        Vmm::CoworkHelper => vec![
            env!("CARGO_BIN_EXE_cowork-helper").to_string(),
            "vm".into(),
            "run".into(),
            "--kernel".into(),
            kernel,
            "--initrd".into(),
            initrd,
            "--cmdline".into(),
            "console=ttyS0 reboot=k panic=-1 pci=off".into(),
            "--mem".into(),
            MEM_MIB.to_string(),
            "--cpus".into(),
            CPUS.to_string(),
        ],
        // microvm has no i8042, so the reset goes through a triple fault (reboot=t); with
        // reboot=k the kernel spends ~45 s nested trying other methods first.
        Vmm::Qemu => vec![
            "qemu-system-x86_64".into(),
            "-enable-kvm".into(),
            "-cpu".into(),
            "host".into(),
            "-M".into(),
            "microvm".into(),
            "-m".into(),
            MEM_MIB.to_string(),
            "-smp".into(),
            CPUS.to_string(),
            "-nodefaults".into(),
            "-no-user-config".into(),
            "-display".into(),
            "none".into(),
            "-serial".into(),
            "stdio".into(),
            "-no-reboot".into(),
            "-kernel".into(),
            kernel,
            "-initrd".into(),
            initrd,
            "-append".into(),
            "console=ttyS0 reboot=t panic=-1 pci=off".into(),
        ],
    }
}

struct BootResult {
    output: String,
    exit_code: Option<i32>,
    detail: String,
}

fn boot(plan: &Plan, format: KernelFormat, initrd: &Path) -> BootResult {
    let kernel = match format {
        KernelFormat::BzImage => &plan.kernel.vmlinuz,
        KernelFormat::ElfVmlinux => &plan.kernel.vmlinux,
    };
    let argv = vmm_argv(plan.vmm, kernel, initrd);
    match plan.mode {
        Mode::Direct => {
            let mut cmd = Command::new(&argv[0]);
            cmd.args(&argv[1..]);
            let out = nested::run_with_timeout(&mut cmd, DIRECT_TIMEOUT)
                .unwrap_or_else(|e| panic!("cannot run {}: {e}", argv[0]));
            let detail = if out.timed_out {
                format!("timed out after {DIRECT_TIMEOUT:?}")
            } else {
                out.status.to_string()
            };
            BootResult {
                output: format!("{}\n--- stderr ---\n{}", out.stdout, out.stderr),
                exit_code: if out.timed_out {
                    None
                } else {
                    out.status.code()
                },
                detail,
            }
        }
        Mode::Nested => {
            let quoted: Vec<String> = argv.iter().map(|a| shell_quote(a)).collect();
            let inner = format!(
                "timeout -k 5 {} {} 2>&1",
                NESTED_VMM_TIMEOUT.as_secs(),
                quoted.join(" ")
            );
            match nested::run_in_nested_kvm(&inner, NESTED_HARNESS_TIMEOUT) {
                Ok(out) => {
                    let detail = format!(
                        "exit status {} in L1{}; harness: {}",
                        out.exit_code,
                        if out.exit_code == 124 {
                            " (the VMM timed out)"
                        } else {
                            ""
                        },
                        out.harness_log.trim()
                    );
                    BootResult {
                        output: out.stdout,
                        exit_code: Some(out.exit_code),
                        detail,
                    }
                }
                Err(e) => panic!("the nested-KVM harness failed: {e}"),
            }
        }
    }
}

fn full_boot(test: &str, format: KernelFormat) {
    let Some(plan) = plan(test) else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let initrd = dir.path().join("boot-test.img");
    let init = nested::script("initramfs/boot-test-init");
    nested::build_initramfs(&initrd, &init, &[]).unwrap_or_else(|e| panic!("{e}"));

    // Nested, everything runs on QEMU TCG's emulation of SVM, which now and then crashes a
    // guest that boots fine otherwise (measured here with QEMU itself as the L2 VMM: 2 of 21
    // boots failed, one by an L1 kernel panic, one by an L2 triple fault; a CI run once saw
    // two in a row: an L1 reset, then an L2 triple fault mid-boot; on 2026-12-02 one CI-like
    // run saw three in a row on one test: two L2 triple faults during kprobes init, then a
    // silent L1 reset, while the next two runs passed). So a failed nested boot is tried up to
    // four more times, loudly; direct boots are not.
    let attempts: u32 = std::env::var("COWORK_NESTED_BOOT_ATTEMPTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if plan.mode == Mode::Nested { 5 } else { 1 })
        .max(1);
    for attempt in 1..=attempts {
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            check_boot(test, &plan, format, &initrd)
        }));
        match outcome {
            Ok(()) => return,
            Err(panic) if attempt < attempts => {
                let msg = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                nested::loud_notice(&format!(
                    "{test}: attempt {attempt}/{attempts} failed; trying again (nested boots are \
                     subject to QEMU TCG SVM emulation faults). The failure was:\n{msg}"
                ));
            }
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
}

fn check_boot(test: &str, plan: &Plan, format: KernelFormat, initrd: &Path) {
    let started = Instant::now();
    let result = boot(plan, format, initrd);
    let elapsed = started.elapsed();
    let context = format!(
        "{test}: mode {:?}, vmm {:?}, kernel {} ({format:?}), {}, {:.1} s wall\n--- guest output ---\n{}",
        plan.mode,
        plan.vmm,
        plan.kernel.version,
        result.detail,
        elapsed.as_secs_f64(),
        result.output
    );

    if !result.output.contains(BOOT_MARKER) {
        let hint = if result.output.contains(KMSG_MARKER) {
            "init ran (its /dev/kmsg line reached the console through printk) but its stdout never \
             arrived: the serial path for user space (8250 transmit interrupt) looks broken"
        } else if result.output.contains("Run /init as init process") {
            "the kernel started /init, but neither its stdout nor its /dev/kmsg line arrived"
        } else {
            "the kernel never reached /init"
        };
        panic!("the guest's init never printed {BOOT_MARKER}: {hint}\n{context}");
    }
    let cpus_line = result
        .output
        .lines()
        .find_map(|l| l.find(CPUS_MARKER).map(|i| &l[i + CPUS_MARKER.len()..]))
        .unwrap_or_else(|| panic!("no {CPUS_MARKER}line in the guest output\n{context}"));
    let count: u32 = cpus_line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("count="))
        .and_then(|c| c.trim().parse().ok())
        .unwrap_or_else(|| panic!("cannot parse the CPU count from '{cpus_line}'\n{context}"));
    assert_eq!(
        count, CPUS,
        "{CPUS} vCPUs configured but {count} online ({cpus_line})\n{context}"
    );
    assert_eq!(
        result.exit_code,
        Some(0),
        "the VMM should exit 0 after the guest resets\n{context}"
    );
    eprintln!(
        "{test}: ok: mode {:?}, vmm {:?}, {cpus_line}, {}, {:.1} s wall",
        plan.mode,
        plan.vmm,
        result.detail,
        elapsed.as_secs_f64()
    );
}

#[test]
fn boots_debian_bzimage_with_two_cpus() {
    full_boot("boots_debian_bzimage_with_two_cpus", KernelFormat::BzImage);
}

#[test]
fn boots_debian_elf_vmlinux_with_two_cpus() {
    full_boot(
        "boots_debian_elf_vmlinux_with_two_cpus",
        KernelFormat::ElfVmlinux,
    );
}
