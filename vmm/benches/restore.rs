//! Restore benchmark (`cargo bench -p vmm --bench restore`), harness-less.
//!
//! Guest: `tests/guests/counter.s` in fill mode ("f": 64 MiB of non-zero
//! data written once, then it counts and prints forever) with 256 MiB of
//! RAM and 1 vCPU: paused after a few lines and snapshotted once, then
//! restored N times (`VMM_BENCH_ITERS`, default 30), each run until the
//! restored guest printed its next line, then stopped.
//!
//! Reports:
//! 1. the snapshot: time, state file size, memory file apparent size, data
//!    written and space on disk;
//! 2. medians of the restore: `Vm::restore` (config → VM ready, with its
//!    phases) and restore start → first `KVM_RUN` of vCPU 0 (everything
//!    the host does before the first guest instruction: `Vm::restore`
//!    plus `run()`'s device resume and thread start), and, for reference,
//!    `Vm::build` → first `KVM_RUN` of the same guest booted cold;
//! 3. memory: guest memory resident in this process right after a restore
//!    and after the restored guest printed a line (smaps `Rss` of the
//!    guest mappings), against the 64 MiB of data the snapshot holds;
//! 4. `memory::map_snapshot` alone (mapping the file, no KVM), to tell
//!    the mapping from the KVM memory-slot registration.

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::Capture;

/// Guest RAM.
const MEM_MIB: u64 = 256;
/// The snapshot's key.
const KEY: &str = "restore-bench";

fn config(kernel: &std::path::Path, cap: &Capture) -> vmm::Config {
    let mut c = vmm::Config::new(kernel);
    c.cmdline = "f".into();
    c.mem_mib = MEM_MIB;
    c.serial = Some(Box::new(cap.clone()));
    c
}

fn lines(cap: &Capture) -> usize {
    cap.text().matches("count ").count()
}

/// Runs `vm` on a thread until `cap` shows `n` count lines, then pauses
/// (or stops) it.
fn run_until(vm: vmm::Vm, cap: &Capture, n: usize, pause: bool) -> vmm::Vm {
    let (ph, sh) = (vm.pause_handle(), vm.stop_handle());
    let runner = std::thread::spawn(move || {
        let mut vm = vm;
        vm.run().expect("run");
        vm
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    while lines(cap) < n {
        assert!(Instant::now() < deadline, "guest too slow: {}", cap.text());
        std::thread::sleep(Duration::from_micros(200));
    }
    if pause {
        ph.pause();
    } else {
        sh.stop();
    }
    runner.join().expect("runner")
}

/// Resident bytes of the mappings overlapping `mem` (smaps `Rss`).
fn guest_rss(mem: &vmm::memory::GuestMemory) -> u64 {
    use vm_memory::{GuestMemory as _, GuestMemoryRegion as _};
    let ranges: Vec<(u64, u64)> = mem
        .iter()
        .map(|r| (r.as_ptr() as u64, r.as_ptr() as u64 + r.len()))
        .collect();
    let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
    let (mut total, mut inside) = (0, false);
    for line in smaps.lines() {
        let head = line.split_whitespace().next().unwrap_or_default();
        if let Some((a, b)) = head.split_once('-') {
            if let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) {
                inside = ranges.iter().any(|&(s, e)| a < e && s < b);
                continue;
            }
        }
        if inside {
            if let Some(kb) = line.strip_prefix("Rss:") {
                total += kb
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .unwrap_or(0)
                    * 1024;
            }
        }
    }
    total
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn main() {
    let n: usize = std::env::var("VMM_BENCH_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30)
        .max(1);
    let kernel = common::build_guest("counter");
    let dir = tempfile::tempdir().expect("tempdir");

    // Cold boots of the same guest, for reference.
    let mut cold = Vec::new();
    for _ in 0..n.min(10) {
        let cap = Capture::default();
        let vm = vmm::Vm::build(config(&kernel, &cap)).expect("build");
        let vm = run_until(vm, &cap, 1, false);
        cold.push(vm.timeline().first_run.expect("first run"));
    }

    // One snapshot.
    let cap = Capture::default();
    let vm = vmm::Vm::build(config(&kernel, &cap)).expect("build");
    let mut vm = run_until(vm, &cap, 20, true);
    let info = vm.snapshot(dir.path(), KEY).expect("snapshot");
    drop(vm);
    println!(
        "snapshot ({MEM_MIB} MiB guest, 64 MiB filled): {:.1} ms (state {:.2} ms, memory {:.1} ms); state file {} KiB; memory file {} MiB apparent, {} MiB written, {} MiB on disk",
        ms(info.total_time),
        ms(info.state_time),
        ms(info.memory_time),
        info.state_bytes / 1024,
        info.memory_bytes >> 20,
        info.memory_data_bytes >> 20,
        info.memory_disk_bytes >> 20,
    );

    // Restores.
    let (mut restore, mut first, mut rss_restored, mut rss_run) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut phases: [Vec<Duration>; 6] = Default::default();
    for _ in 0..n {
        let cap = Capture::default();
        let vm = vmm::Vm::restore(config(&kernel, &cap), dir.path(), KEY).expect("restore");
        let mem = vm.guest_memory().expect("memory").clone();
        rss_restored.push(guest_rss(&mem));
        let t = vm.timeline().clone();
        restore.push(t.build);
        let p = t.restore.expect("phases");
        for (slot, d) in phases
            .iter_mut()
            .zip([p.state, p.kvm, p.memory, p.vcpus, p.vm, p.devices])
        {
            slot.push(d);
        }
        let vm = run_until(vm, &cap, 1, false);
        first.push(vm.timeline().first_run.expect("first run"));
        rss_run.push(guest_rss(&mem));
    }
    let [state, kvm, memory, vcpus, vmstate, devices] = phases.map(median);
    println!(
        "restore, median of {n}: Vm::restore {:.3} ms (state file {:.3}, KVM VM+vCPUs {:.3}, memory map+slots {:.3}, vCPU state {:.3}, VM state {:.3}, devices {:.3}); restore start -> first KVM_RUN {:.3} ms (min {:.3}, max {:.3})",
        ms(median(restore.clone())),
        ms(state),
        ms(kvm),
        ms(memory),
        ms(vcpus),
        ms(vmstate),
        ms(devices),
        ms(median(first.clone())),
        ms(*first.iter().min().unwrap()),
        ms(*first.iter().max().unwrap()),
    );
    println!(
        "cold boot of the same guest, median of {}: Vm::build -> first KVM_RUN {:.3} ms",
        cold.len(),
        ms(median(cold))
    );
    rss_restored.sort();
    rss_run.sort();
    println!(
        "guest memory resident in this process: {} KiB after restore, {} KiB after the first line (medians; the snapshot holds {} MiB of data)",
        rss_restored[rss_restored.len() / 2] / 1024,
        rss_run[rss_run.len() / 2] / 1024,
        info.memory_data_bytes >> 20,
    );

    // The mapping alone.
    let mut map = Vec::new();
    for _ in 0..n {
        let f = std::fs::File::open(&info.memory_file).expect("memory file");
        let t = Instant::now();
        let ram = vmm::memory::map_snapshot(MEM_MIB, std::sync::Arc::new(f)).expect("map");
        map.push(t.elapsed());
        drop(ram);
    }
    println!(
        "memory::map_snapshot alone, median of {n}: {:.3} ms",
        ms(median(map))
    );
}
