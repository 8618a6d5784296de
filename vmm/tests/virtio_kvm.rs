//! KVM test of the virtio-mmio transport with a real guest driver.
//!
//! `tests/guests/virtio_driver.c` (freestanding C, built here with the system
//! `gcc`; see its header) boots through the 64-bit Linux boot protocol, finds
//! the last virtio-mmio slot on its command line, and drives the pattern
//! test device there like a driver would: probe, feature negotiation
//! (including a refused one), one virtqueue in its own memory, a buffer
//! kicked through QueueNotify, the interrupt taken through the IOAPIC and
//! LAPIC on a real IDT vector, the used buffer checked, then a bad buffer
//! that must put the device in DEVICE_NEEDS_RESET, and a reset. It prints
//! one report line on COM1 and resets the machine.
//!
//! Needs `/dev/kvm` (any KVM, PVM included: the guest is not Linux) and gcc.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{hex, Capture};
use vmm::layout;
use vmm::virtio::mmio::{CONFIG_SPACE, STATUS};
use vmm::virtio::testdev::{PatternDevice, CONFIG_COMPLETED, TEST_DEVICE_ID};
use vmm::{Config, ExitReason, Vm};

/// Runs `vm` with a host-side watchdog: a guest that never gets its
/// interrupt halts forever, and the watchdog stops it.
fn run_with_watchdog(vm: &mut Vm, limit: Duration) -> (ExitReason, Duration) {
    let stop = vm.stop_handle();
    let done = Arc::new(AtomicBool::new(false));
    let done2 = done.clone();
    let watchdog = std::thread::spawn(move || {
        let start = Instant::now();
        while !done2.load(Ordering::SeqCst) {
            if start.elapsed() > limit {
                stop.stop();
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    });
    let start = Instant::now();
    let reason = vm.run().expect("vm run");
    let took = start.elapsed();
    done.store(true, Ordering::SeqCst);
    watchdog.join().unwrap();
    (reason, took)
}

/// `key=0x...` from the report line.
fn field(line: &str, key: &str) -> u64 {
    let tok = line
        .split_whitespace()
        .find_map(|t| t.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"));
    hex(tok)
}

#[test]
fn guest_driver_uses_virtqueue_through_ioeventfd_and_irqfd() {
    let cap = Capture::default();
    let mut c = Config::new(common::build_c_guest());
    c.cmdline = "virtio-driver-test".into();
    c.mem_mib = 64;
    c.serial = Some(Box::new(cap.clone()));
    // Two devices: the guest drives the one in slot 1, so the test also
    // shows that slot 0's registers, ioeventfd and irqfd are not involved.
    c.virtio_devices = vec![
        Box::new(PatternDevice::new(vec![8])),
        Box::new(PatternDevice::new(vec![16])),
    ];
    let mut vm = Vm::build(c).unwrap();
    let transports = vm.virtio_transports();
    assert_eq!(transports.len(), 2);

    let (reason, took) = run_with_watchdog(&mut vm, Duration::from_secs(30));
    let out = cap.text();
    assert_eq!(
        reason,
        ExitReason::Reset,
        "guest did not finish (took {took:?}); serial:\n{out}"
    );
    let line = out
        .lines()
        .find(|l| l.starts_with("virtio-guest: OK") || l.starts_with("virtio-guest: FAIL"))
        .unwrap_or_else(|| panic!("no report; serial:\n{out}"));
    assert!(line.starts_with("virtio-guest: OK "), "{out}");

    // Probe: the registers the guest read over MMIO exits.
    assert_eq!(field(line, "magic"), 0x7472_6976);
    assert_eq!(field(line, "version"), 2);
    assert_eq!(field(line, "device"), u64::from(TEST_DEVICE_ID));
    // Negotiation: an unoffered feature bit was refused at FEATURES_OK.
    assert_eq!(field(line, "refused_unknown"), 1);
    // It found the second slot's GSI on the command line, routed that IOAPIC
    // pin to its vector, and took exactly one interrupt for the used buffer
    // with INT_VRING set in InterruptStatus.
    assert_eq!(
        field(line, "irq"),
        u64::from(layout::virtio_mmio_slot_irq(1))
    );
    assert_eq!(field(line, "vector"), 0x40);
    assert_eq!(field(line, "isr"), 1);
    assert_eq!(field(line, "used_len"), 64);
    // The bad buffer: a config-change interrupt and NEEDS_RESET (0x40) on top
    // of ACK|DRIVER|FEATURES_OK|DRIVER_OK, then a clean reset.
    assert_eq!(field(line, "interrupts"), 2);
    assert_eq!(field(line, "bad_isr"), 2);
    assert_eq!(field(line, "bad_status"), 0x4f);
    assert_eq!(field(line, "reset_status"), 0);

    // The guest's two kicks went through the ioeventfd: none reached the
    // transport as an MMIO exit. Slot 0 saw nothing.
    assert_eq!(transports[1].notify_exits(), 0);
    assert_eq!(transports[0].notify_exits(), 0);
    let cfg = |t: &vmm::virtio::MmioTransport, off: u64| {
        let mut d = [0u8; 4];
        t.read(off, &mut d);
        u32::from_le_bytes(d)
    };
    assert_eq!(cfg(&transports[1], CONFIG_SPACE + CONFIG_COMPLETED), 1);
    assert_eq!(cfg(&transports[0], CONFIG_SPACE + CONFIG_COMPLETED), 0);
    // run() reset both devices (their workers are joined).
    assert_eq!(cfg(&transports[1], STATUS), 0);
    assert!(!transports[1].is_activated());
}
