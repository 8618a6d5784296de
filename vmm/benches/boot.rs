//! Boot benchmark (`cargo bench -p vmm --bench boot`), harness-less.
//!
//! Guest: `tests/guests/linux64.s` in quiet mode (command line "quiet"): it
//! enters through the 64-bit Linux boot protocol, writes one boot-port mark
//! and resets through the i8042 — the minimal round trip.
//!
//! Reports:
//! 1. in-process medians over N runs with 256 MiB: `Vm::build` (config →
//!    vCPUs ready), config → first KVM_RUN, config → guest reset;
//! 2. process start → guest reset: this binary re-executed as a `vm run`
//!    child (env `VMM_BENCH_CHILD=<kernel>` makes it call
//!    `vmm::cli::vm_run` and exit), spawn → exit wall time, median of N;
//! 3. RSS: the `vm run` child's peak RSS (wait4) minus that of the same
//!    binary doing nothing (`VMM_BENCH_CHILD=noop`) = VMM overhead (plus the
//!    few guest pages the guest touches).

#[path = "../tests/common/mod.rs"]
mod common;

use std::process::{Command, Stdio};

fn child(kernel: &str) -> ! {
    if kernel == "noop" {
        std::process::exit(0);
    }
    let mut a = vmm::cli::VmRunArgs::new(kernel);
    a.cmdline = Some("quiet".into());
    a.mem_mib = 256;
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

    let r = vmm::bench::in_process(&kernel, "quiet", 256, 1, n).expect("in-process bench");
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
        "process start -> guest reset (`vm run`, 256 MiB), {} runs:",
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
    println!(
        "  peak RSS: vm run {} KiB, no-op {} KiB, VMM overhead {} KiB",
        p.max_rss_kib,
        base.max_rss_kib,
        p.max_rss_kib.saturating_sub(base.max_rss_kib)
    );
}
