//! Boot benchmark (`cargo bench -p vmm --bench boot`), harness-less.
//!
//! Guest: `tests/guests/linux64.s` in quiet mode (command line "quiet"): it
//! enters through the 64-bit Linux boot protocol, writes one boot-port mark
//! and resets through the i8042 — the minimal round trip.
//!
//! Reports:
//! 1. in-process medians over N runs with 256 MiB: `Vm::build` (config →
//!    vCPUs ready), config → first KVM_RUN, config → guest reset;
//! 2. process start → process exit: this binary re-executed as a `vm run`
//!    child (env `VMM_BENCH_CHILD=<kernel>` makes it call
//!    `vmm::cli::vm_run` and exit), spawn → exit wall time, median of N;
//! 3. process start → guest reset itself: the child builds and runs the
//!    same VM through the library (env `VMM_BENCH_CHILD=reset-clock:<kernel>`)
//!    and prints the CLOCK_MONOTONIC instant at which the VMM saw the reset;
//!    the parent subtracts the instant it spawned the child. Unlike (2) this
//!    excludes the kernel's destruction of the VM at exit (~20 ms here, the
//!    in-kernel irqchip and PIT), which happens after the guest is done;
//! 4. RSS: the `vm run` child's peak RSS (wait4) minus that of the same
//!    binary doing nothing (`VMM_BENCH_CHILD=noop`) = VMM overhead (plus the
//!    few guest pages the guest touches);
//! 5. guest memory backing: the same guest in touch mode (command line "t":
//!    one write per 4 KiB page of 256 MiB, then reset) with 512 MiB of RAM
//!    as `Backing::Anonymous` (huge pages advised, aligned) and as
//!    `Backing::AnonymousBasePages`, config → reset medians: what a guest
//!    pays for first touching its memory.
//!
//! Environment (read here, the library reads none): `VMM_BENCH_ITERS` (runs,
//! default 50), `VMM_BENCH_VERBOSE` (print each in-process run's timeline),
//! and, as the helper's flags would set them, `COWORK_GUEST_THP=off` (base
//! pages for reports 1 to 4) and `COWORK_SECCOMP` (`off`, `log`; default on).

#[path = "../tests/common/mod.rs"]
mod common;

use std::process::{Command, Stdio};

/// CLOCK_MONOTONIC now, in nanoseconds (comparable across processes).
fn monotonic_ns() -> u128 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer for the call.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u128 * 1_000_000_000 + ts.tv_nsec as u128
}

/// Guest memory backing as the helper's `--guest-thp` reads
/// `COWORK_GUEST_THP`: `off` advises no huge pages.
fn backing_from_env() -> vmm::memory::Backing {
    match std::env::var("COWORK_GUEST_THP") {
        Ok(v) if v.trim().eq_ignore_ascii_case("off") => vmm::memory::Backing::AnonymousBasePages,
        _ => vmm::memory::Backing::Anonymous,
    }
}

/// Seccomp as the helper's `--seccomp` reads `COWORK_SECCOMP` (default on;
/// an unknown word is refused).
fn seccomp_from_env() -> vmm::seccomp::Mode {
    std::env::var("COWORK_SECCOMP")
        .map(|w| w.parse().expect("COWORK_SECCOMP: on, off or log"))
        .unwrap_or_default()
}

fn child(kernel: &str) -> ! {
    if kernel == "noop" {
        std::process::exit(0);
    }
    if let Some(kernel) = kernel.strip_prefix("reset-clock:") {
        let origin = monotonic_ns();
        let mut c = vmm::Config::new(kernel);
        c.cmdline = "quiet".into();
        c.mem_mib = 256;
        c.memory_backing = backing_from_env();
        c.seccomp = seccomp_from_env();
        let mut vm = vmm::Vm::build(c).expect("build");
        let reason = vm.run().expect("run");
        assert!(matches!(reason, vmm::ExitReason::Reset), "{reason:?}");
        let exit = vm.timeline().exit.expect("exit time");
        println!("{}", origin + exit.as_nanos());
        std::process::exit(0);
    }
    let mut a = vmm::cli::VmRunArgs::new(kernel);
    a.cmdline = Some("quiet".into());
    a.mem_mib = 256;
    a.memory_backing = backing_from_env();
    a.seccomp = seccomp_from_env();
    std::process::exit(vmm::cli::vm_run(a));
}

fn main() {
    if let Ok(k) = std::env::var("VMM_BENCH_CHILD") {
        child(&k);
    }
    // `cargo bench` passes --bench; ignore arguments.
    let n: usize = std::env::var("VMM_BENCH_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50);
    let kernel = common::build_guest("linux64");
    let exe = std::env::current_exe().expect("current_exe");

    let r = vmm::bench::in_process_backed(&kernel, "quiet", 256, 1, backing_from_env(), n)
        .expect("in-process bench");
    if std::env::var_os("VMM_BENCH_VERBOSE").is_some() {
        for t in &r.timelines {
            eprint!("{t}");
        }
    }
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    println!(
        "in-process, 256 MiB, 1 vCPU, {} runs (medians):",
        r.iterations
    );
    println!(
        "  Vm::build (config -> vCPUs ready)   {:7.3} ms",
        ms(r.build)
    );
    println!(
        "  config -> first KVM_RUN             {:7.3} ms",
        ms(r.first_run)
    );
    println!(
        "  config -> guest reset seen by VMM   {:7.3} ms",
        ms(r.exit)
    );
    println!(
        "  teardown (join + close VM)          {:7.3} ms",
        ms(r.teardown)
    );
    println!(
        "  peak RSS growth of this process     {:7} KiB",
        r.rss_growth_kib
    );

    let spawn = |what: String| {
        let exe = exe.clone();
        move || {
            let mut c = Command::new(&exe);
            c.env("VMM_BENCH_CHILD", &what)
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            c
        }
    };
    let base = vmm::bench::process_start_to_exit(spawn("noop".into()), n).expect("noop child");
    let p = vmm::bench::process_start_to_exit(spawn(kernel.display().to_string()), n)
        .expect("vm run child");
    println!(
        "`vm run` (256 MiB), {} runs: process start -> process exit (VM destroyed)",
        p.iterations
    );
    println!(
        "  median {:7.3} ms   min {:7.3} ms   max {:7.3} ms",
        ms(p.median),
        ms(p.min),
        ms(p.max)
    );
    println!(
        "  same binary doing nothing: median {:7.3} ms",
        ms(base.median)
    );
    let mut resets = Vec::with_capacity(n);
    for _ in 0..n {
        let spawned = monotonic_ns();
        let out = Command::new(&exe)
            .env(
                "VMM_BENCH_CHILD",
                format!("reset-clock:{}", kernel.display()),
            )
            .stderr(Stdio::null())
            .output()
            .expect("reset-clock child");
        assert!(out.status.success(), "reset-clock child failed");
        let reset: u128 = String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .expect("child prints the reset instant");
        resets.push(std::time::Duration::from_nanos(
            reset.saturating_sub(spawned) as u64,
        ));
    }
    println!(
        "  process start -> guest reset seen by the VMM: median {:7.3} ms",
        ms(vmm::bench::median(&resets))
    );
    println!(
        "  peak RSS: vm run {} KiB, no-op {} KiB, VMM overhead {} KiB",
        p.max_rss_kib,
        base.max_rss_kib,
        p.max_rss_kib.saturating_sub(base.max_rss_kib)
    );

    let touch_runs = n.min(10);
    println!("guest writing one byte per 4 KiB page of 256 MiB, 512 MiB RAM, {touch_runs} runs (config -> reset, medians):");
    for (name, backing) in [
        ("huge pages (default)", vmm::memory::Backing::Anonymous),
        (
            "base pages          ",
            vmm::memory::Backing::AnonymousBasePages,
        ),
    ] {
        let r = vmm::bench::in_process_backed(&kernel, "t", 512, 1, backing, touch_runs)
            .expect("touch bench");
        println!(
            "  {name} {:8.3} ms   peak RSS growth {} KiB",
            ms(r.exit),
            r.rss_growth_kib
        );
    }
}
