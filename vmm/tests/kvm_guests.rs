//! KVM tests with tiny guests built from `tests/guests/*.s` (see each file's
//! header for what it does). They need `/dev/kvm` (any KVM, PVM included:
//! the guests are not Linux) and binutils.

mod common;

use std::time::{Duration, Instant};

use common::{build_guest, e820_lines, hex, Capture};
use vmm::layout::{self, E820Type};
use vmm::memory::Backing;
use vmm::{Config, ExitReason, Vm};

fn config(guest: &str, cmdline: &str, mem_mib: u64, vcpus: u8) -> (Config, Capture) {
    let cap = Capture::default();
    let mut c = Config::new(build_guest(guest));
    c.cmdline = cmdline.to_string();
    c.mem_mib = mem_mib;
    c.vcpus = vcpus;
    c.serial = Some(Box::new(cap.clone()));
    (c, cap)
}

fn expected_e820(mem_mib: u64) -> Vec<(u64, u64, u32)> {
    layout::e820_map(mem_mib << 20)
        .iter()
        .map(|e| (e.addr, e.size, e.kind as u32))
        .collect()
}

fn host_avx2() -> bool {
    let l7 = std::arch::x86_64::__cpuid_count(7, 0);
    l7.ebx & (1 << 5) != 0
}

#[test]
fn linux64_entry_reports_e820_cmdline_and_cpuid_then_resets() {
    for (mem, backing) in [(64, Backing::Anonymous), (4096, Backing::Memfd)] {
        let (mut c, cap) = config("linux64", "report console=ttyS0", mem, 1);
        c.memory_backing = backing;
        let mut vm = Vm::build(c).unwrap();
        let cmdline = vm.cmdline().to_string();
        let reason = vm.run().unwrap();
        let out = cap.text();
        assert_eq!(reason, ExitReason::Reset, "{out}");
        assert!(out.starts_with("hello from linux64\n"), "{out}");
        assert!(out.ends_with("done\n"), "{out}");

        let e820 = e820_lines(&out);
        assert_eq!(e820, expected_e820(mem), "{out}");
        let ram: u64 = e820
            .iter()
            .filter(|e| e.2 == E820Type::Ram as u32)
            .map(|e| e.1)
            .sum();
        assert_eq!(
            ram,
            (mem << 20) - (layout::HIMEM_START - layout::EBDA_START)
        );
        assert!(out.contains(&format!("cmdline {cmdline}\n")), "{out}");

        let cpuid1 = out.lines().find(|l| l.starts_with("cpuid1")).unwrap();
        let f: Vec<&str> = cpuid1.split(['=', ' ']).collect();
        let (ebx, ecx) = (hex(f[2]), hex(f[4]));
        assert_eq!(ebx >> 24, 0, "APIC ID of vCPU 0");
        assert_ne!(ecx & (1 << 31), 0, "hypervisor bit");
        let cpuid7 = out.lines().find(|l| l.starts_with("cpuid7")).unwrap();
        let ebx7 = hex(cpuid7.split('=').nth(1).unwrap());
        assert_eq!(
            ebx7 & (1 << 5) != 0,
            host_avx2(),
            "guest sees the host's AVX2"
        );

        let t = vm.timeline();
        assert!(t.first_run.is_some() && t.exit.is_some());
        assert!(t.build <= t.first_run.unwrap());
        let marks: Vec<u32> = t.boot_marks.iter().map(|m| m.value).collect();
        assert_eq!(marks, vec![1, 2], "boot-port writes recorded");
        assert!(t.boot_marks[0].at <= t.boot_marks[1].at);
        assert!(t.first_run.unwrap() <= t.boot_marks[0].at);
        assert!(matches!(vm.run(), Err(vmm::VmError::AlreadyRan)));
    }
}

#[test]
fn pvh_entry_reads_start_info_memmap() {
    let (c, cap) = config("pvh", "pvh test line", 128, 1);
    let mut vm = Vm::build(c).unwrap();
    assert_eq!(vm.timeline().entry, Some(vmm::boot::EntryKind::Pvh));
    let reason = vm.run().unwrap();
    let out = cap.text();
    assert_eq!(reason, ExitReason::Reset, "{out}");
    assert!(
        out.contains("hello from pvh\npvh magic 0x336ec578\n"),
        "{out}"
    );
    assert_eq!(e820_lines(&out), expected_e820(128), "{out}");
    assert!(out.contains("cmdline pvh test line\n"), "{out}");
    assert!(
        out.contains(&format!("rsdp 0x{:08x}\n", layout::ACPI_START)),
        "{out}"
    );
    assert!(out.ends_with("done\n"), "{out}");
}

#[test]
fn all_vcpus_start_with_their_own_apic_ids() {
    for cpus in [2u8, 4] {
        let (c, cap) = config("smp", "smp", 64, cpus);
        let mut vm = Vm::build(c).unwrap();
        let reason = vm.run().unwrap();
        let out = cap.text();
        assert_eq!(reason, ExitReason::Reset, "{out}");
        assert!(!out.contains("timeout"), "{out}");
        let line = out.lines().find(|l| l.starts_with("smp expected")).unwrap();
        let t: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(hex(t[2]), u64::from(cpus), "CPUID topology count: {line}");
        assert_eq!(hex(t[4]), u64::from(cpus), "vCPUs online: {line}");
        assert_eq!(hex(t[6]), 0, "BSP APIC ID: {line}");
        assert_eq!(hex(t[8]), (1u64 << cpus) - 1, "APIC ID bitmap: {line}");
    }
}

fn stop_when_printed(mode: &str, marker: &str, vcpus: u8) {
    let (c, cap) = config("linux64", mode, 64, vcpus);
    let mut vm = Vm::build(c).unwrap();
    let stop = vm.stop_handle();
    let cap2 = cap.clone();
    let wanted = marker.to_string();
    let stopper = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !cap2.text().contains(&wanted) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        // Let the guest settle into its loop, then stop it.
        std::thread::sleep(Duration::from_millis(50));
        let t = Instant::now();
        assert!(stop.stop());
        (t, stop)
    });
    let reason = vm.run().unwrap();
    let returned = Instant::now();
    let (stopped_at, stop) = stopper.join().unwrap();
    assert_eq!(reason, ExitReason::Stopped, "{}", cap.text());
    assert!(cap.text().contains(marker));
    assert!(
        returned.duration_since(stopped_at) < Duration::from_secs(2),
        "stop took {:?}",
        returned.duration_since(stopped_at)
    );
    // The VM is gone: the handle no longer reaches it.
    assert!(!stop.stop());
}

#[test]
fn host_stop_ends_a_spinning_guest() {
    stop_when_printed("spin", "spinning\n", 1);
    // The AP sits in wait-for-SIPI inside KVM_RUN: the kick must reach it too.
    stop_when_printed("spin", "spinning\n", 2);
}

#[test]
fn host_stop_ends_a_halted_guest() {
    stop_when_printed("halt", "halting\n", 1);
}

#[test]
fn acpi_sleep_register_powers_off() {
    let (c, cap) = config("linux64", "poweroff", 64, 1);
    let mut vm = Vm::build(c).unwrap();
    assert_eq!(vm.run().unwrap(), ExitReason::Shutdown, "{}", cap.text());
}

#[test]
fn triple_fault_is_a_guest_error() {
    let (c, cap) = config("linux64", "ud2", 64, 1);
    let mut vm = Vm::build(c).unwrap();
    match vm.run().unwrap() {
        ExitReason::GuestError(msg) => assert!(msg.contains("triple fault"), "{msg}"),
        other => panic!("expected a guest error, got {other:?}: {}", cap.text()),
    }
}

#[test]
fn build_errors_are_clear() {
    let mut c = Config::new("/nonexistent/vmlinux");
    let e = Vm::build(c).unwrap_err().to_string();
    assert!(e.contains("cannot open kernel /nonexistent/vmlinux"), "{e}");

    c = Config::new(build_guest("linux64"));
    c.vcpus = 0;
    assert!(Vm::build(c)
        .unwrap_err()
        .to_string()
        .contains("vCPU count 0"));

    c = Config::new(build_guest("linux64"));
    c.mem_mib = 1;
    assert!(Vm::build(c)
        .unwrap_err()
        .to_string()
        .contains("out of range"));

    c = Config::new(build_guest("linux64"));
    c.cmdline = "x".repeat(4000);
    let e = Vm::build(c).unwrap_err().to_string();
    assert!(e.contains("command line is 4001 bytes"), "{e}");

    // Not a kernel at all.
    let junk = std::env::temp_dir().join(format!("vmm-junk-{}", std::process::id()));
    std::fs::write(&junk, vec![0u8; 4096]).unwrap();
    let e = Vm::build(Config::new(&junk)).unwrap_err().to_string();
    assert!(e.contains("bzImage"), "{e}");
    std::fs::remove_file(junk).unwrap();
}

#[test]
fn vm_run_cli_exit_statuses() {
    use vmm::cli::{vm_run, VmRunArgs};
    let mut a = VmRunArgs::new(build_guest("linux64"));
    a.cmdline = Some("quiet".into());
    a.mem_mib = 64;
    assert_eq!(vm_run(a.clone()), 0);
    a.cmdline = Some("ud2".into());
    assert_eq!(vm_run(a.clone()), 1);
    a.kernel = "/nonexistent".into();
    assert_ne!(vm_run(a), 0);
}

#[test]
fn virtio_slots_are_wired_and_described() {
    use vmm::virtio::testdev::PatternDevice;
    let (mut c, cap) = config("linux64", "report", 64, 1);
    c.virtio_devices = vec![
        Box::new(PatternDevice::new(vec![8])),
        Box::new(PatternDevice::new(vec![8, 16])),
    ];
    let mut vm = Vm::build(c).unwrap();
    let t = vm.virtio_transports();
    assert_eq!(t.len(), 2);
    assert_eq!(t[1].queue_evts().len(), 2);
    assert_eq!(
        vm.cmdline(),
        "report virtio_mmio.device=4K@0xd0000000:5 virtio_mmio.device=4K@0xd0001000:6"
    );
    drop(t);
    assert_eq!(vm.run().unwrap(), ExitReason::Reset);
    // The guest saw the same command line the VMM reported.
    assert!(cap.text().contains(
        "cmdline report virtio_mmio.device=4K@0xd0000000:5 virtio_mmio.device=4K@0xd0001000:6\n"
    ));
    assert!(vm.virtio_transports().is_empty());

    let mut c = Config::new(build_guest("linux64"));
    c.virtio_devices = (0..=layout::VIRTIO_MMIO_MAX_SLOTS)
        .map(|_| Box::new(PatternDevice::new(vec![8])) as Box<dyn vmm::virtio::VirtioDevice>)
        .collect();
    assert!(Vm::build(c).unwrap_err().to_string().contains("slots"));
}
