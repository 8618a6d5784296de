//! Guest-physical memory map and every fixed address or magic number the
//! machine uses.
//!
//! ```text
//! 0x0000_0000  ┌──────────────────────────────┐
//!              │ real-mode IVT / BDA (unused) │
//! 0x0000_0500  │ boot GDT, boot IDT           │
//! 0x0000_6000  │ PVH hvm_start_info + lists   │
//! 0x0000_7000  │ Linux zero page (boot_params)│
//! 0x0000_8ff0  │ boot stack (grows down)      │
//! 0x0000_9000  │ PML4, PDPT, 4 × PD           │
//! 0x0002_0000  │ kernel command line          │
//! 0x0009_fc00  │ EBDA (empty)                 │  e820 reserved
//! 0x000a_0000  │ VGA / option ROM hole        │  not in e820
//! 0x000e_0000  │ ACPI tables (RSDP first)     │  e820 reserved
//! 0x000f_0000  │ MP table                     │  e820 reserved
//! 0x0010_0000  │ RAM (kernel, initrd at top)  │
//!      ...     │                              │
//! 0xc000_0000  ├──────────────────────────────┤  32-bit MMIO gap
//! 0xd000_0000  │ virtio-mmio slots, 4 KiB each│
//! 0xfec0_0000  │ IOAPIC                       │
//! 0xfee0_0000  │ LAPIC                        │
//! 0xfffb_c000  │ EPT identity page, TSS       │
//! 0x1_0000_0000├──────────────────────────────┤
//!              │ RAM above 4 GiB (if any)     │
//!              └──────────────────────────────┘
//! ```
//!
//! Port I/O: COM1 at 0x3f8 (IRQ 4), i8042 at 0x60/0x64, the ACPI sleep
//! control/status registers at 0x600/0x601 and the boot-timing port at 0x402.

/// One KiB.
pub const KIB: u64 = 1 << 10;
/// One MiB.
pub const MIB: u64 = 1 << 20;
/// One GiB.
pub const GIB: u64 = 1 << 30;

/// Guest page size used for alignment of the initrd and table areas.
pub const PAGE_SIZE: u64 = 4096;

/// Boot GDT. Low, fixed, out of the way of everything the kernel reads
/// early; the kernel replaces it right after entry.
pub const BOOT_GDT_START: u64 = 0x500;
/// Maximum number of 8-byte descriptors in the boot GDT (null, code32,
/// code64, data, TSS low + high).
pub const BOOT_GDT_MAX: usize = 6;
/// Boot IDT: a zero-length IDT right after the GDT. The guest must not take
/// an exception before it installs its own (a fault then triple-faults,
/// which ends the run as a reset).
pub const BOOT_IDT_START: u64 = 0x540;

/// PVH `hvm_start_info` (struct from the Xen PVH ABI; `%ebx` at entry).
pub const PVH_INFO_START: u64 = 0x6000;
/// PVH module list (the initrd), right after `hvm_start_info` (56 bytes).
pub const PVH_MODLIST_START: u64 = 0x6040;
/// PVH memory map (24-byte `hvm_memmap_table_entry` each), after the
/// single module entry (32 bytes).
pub const PVH_MEMMAP_START: u64 = 0x6080;
/// Room for the PVH memory map: up to the zero page.
pub const PVH_MEMMAP_MAX_ENTRIES: usize = ((ZERO_PAGE_START - PVH_MEMMAP_START) / 24) as usize;

/// The Linux "zero page" (`struct boot_params`, 4 KiB; `%rsi` at the
/// 64-bit entry).
pub const ZERO_PAGE_START: u64 = 0x7000;

/// Initial stack pointer of the boot vCPU: top of the page below the page
/// tables, 16-byte aligned per the SysV ABI.
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;

/// PML4 of the boot identity map (64-bit entry only).
pub const PML4_START: u64 = 0x9000;
/// The single PDPT the PML4 points to.
pub const PDPTE_START: u64 = 0xa000;
/// First of [`BOOT_IDENTITY_MAP_GIB`] page directories (2 MiB pages).
pub const PDE_START: u64 = 0xb000;
/// GiB identity-mapped at 64-bit entry: all of the 32-bit space, so the
/// kernel, zero page, command line, initrd (below 4 GiB), LAPIC and MMIO are
/// all reachable before the guest builds its own tables.
pub const BOOT_IDENTITY_MAP_GIB: u64 = 4;

/// Kernel command line (NUL-terminated).
pub const CMDLINE_START: u64 = 0x20000;
/// Largest command line we accept (bytes, including the NUL). x86 Linux's
/// `COMMAND_LINE_SIZE` is 2048; a bzImage may advertise a different
/// `cmdline_size`, which then takes precedence when smaller.
pub const CMDLINE_MAX_SIZE: usize = 2048;

/// Start of the Extended BIOS Data Area (kept reserved and empty, as on a
/// PC; Linux looks for the MP floating pointer and RSDP there first).
pub const EBDA_START: u64 = 0x9fc00;
/// End of conventional memory: the VGA hole starts here.
pub const VGA_HOLE_START: u64 = 0xa0000;

/// ACPI tables: the RSDP must be on a 16-byte boundary in 0xe0000..0xfffff
/// for legacy scans; we also pass its address in `boot_params.acpi_rsdp_addr`
/// and PVH `rsdp_paddr`.
pub const ACPI_START: u64 = 0xe0000;
/// End (exclusive) of the ACPI area, where the MP table area starts.
pub const ACPI_END: u64 = 0xf0000;
/// MP floating pointer + configuration table. In the 0xf0000..0xfffff BIOS
/// area Linux scans for `_MP_`; 64 KiB fit 254 processor entries (the 1 KiB
/// EBDA would only fit ~37).
pub const MPTABLE_START: u64 = 0xf0000;
/// End (exclusive) of the MP table area: the BIOS area ends at 1 MiB.
pub const MPTABLE_END: u64 = 0x100000;

/// Start of "high" memory (1 MiB): a bzImage's protected-mode code goes
/// here, and no kernel may load below it.
pub const HIMEM_START: u64 = 0x100000;

/// Start of the 32-bit MMIO gap (3 GiB): RAM above this is relocated above
/// 4 GiB.
pub const MMIO_GAP_START: u64 = 0xc000_0000;
/// End of the 32-bit MMIO gap (4 GiB).
pub const MMIO_GAP_END: u64 = 1 << 32;
/// Size of the 32-bit MMIO gap.
pub const MMIO_GAP_SIZE: u64 = MMIO_GAP_END - MMIO_GAP_START;

/// First virtio-mmio slot. Inside the gap, far from the APICs.
pub const VIRTIO_MMIO_BASE: u64 = 0xd000_0000;
/// Size of one virtio-mmio slot (register file is 0x100 + config space).
pub const VIRTIO_MMIO_SLOT_SIZE: u64 = 0x1000;
/// Offset of the QueueNotify register in a virtio-mmio register file.
pub const VIRTIO_MMIO_QUEUE_NOTIFY: u64 = 0x50;
/// First GSI handed to virtio-mmio devices: 0-4 are timer/keyboard/cascade/
/// COM2/COM1 on a PC.
pub const VIRTIO_IRQ_BASE: u32 = 5;
/// Last GSI available (the in-kernel IOAPIC has 24 pins).
pub const IRQ_MAX: u32 = 23;
/// How many virtio-mmio slots exist: one per free IOAPIC pin.
pub const VIRTIO_MMIO_MAX_SLOTS: usize = (IRQ_MAX - VIRTIO_IRQ_BASE + 1) as usize;

/// The IOAPIC's MMIO address (fixed by KVM's in-kernel IOAPIC).
pub const IOAPIC_ADDR: u32 = 0xfec0_0000;
/// The LAPIC's default MMIO address (architectural reset value of
/// `IA32_APIC_BASE`).
pub const APIC_ADDR: u32 = 0xfee0_0000;
/// Number of IOAPIC pins of KVM's in-kernel IOAPIC.
pub const IOAPIC_PINS: u32 = 24;

/// Three pages KVM needs for the TSS on Intel (`KVM_SET_TSS_ADDR`), in the
/// gap below the BIOS ROM shadow.
pub const KVM_TSS_ADDRESS: u64 = 0xfffb_d000;
/// One page for the EPT identity map of real-mode guests on Intel
/// (`KVM_SET_IDENTITY_MAP_ADDR`), just below the TSS.
pub const KVM_IDENTITY_MAP_ADDRESS: u64 = 0xfffb_c000;

/// Start of RAM above the MMIO gap.
pub const HIGH_RAM_START: u64 = MMIO_GAP_END;

/// COM1 base port.
pub const COM1_PORT: u16 = 0x3f8;
/// COM1 port count.
pub const COM1_PORT_LEN: u16 = 8;
/// COM1 IRQ (ISA).
pub const COM1_IRQ: u32 = 4;
/// i8042 data port (0x60); the controller spans 0x60..=0x64 here so the
/// command port 0x64 is at offset 4, as vm-superio's `I8042Device` expects.
pub const I8042_PORT: u16 = 0x60;
/// i8042 port range length.
pub const I8042_PORT_LEN: u16 = 5;
/// Boot-timing port: a guest (firmware convention from QEMU's debug
/// console) writes 1, 2 or 4 bytes here to log a timestamped milestone.
/// Not 0x80: Linux uses that for `io_delay`.
pub const BOOT_TIMER_PORT: u16 = 0x402;
/// ACPI hardware-reduced sleep control register (FADT `SLEEP_CONTROL_REG`).
pub const ACPI_SLEEP_CONTROL_PORT: u16 = 0x600;
/// ACPI hardware-reduced sleep status register (FADT `SLEEP_STATUS_REG`).
pub const ACPI_SLEEP_STATUS_PORT: u16 = 0x601;
/// The `_S5_` sleep type our DSDT advertises; a write of
/// `SLP_EN | (ACPI_S5_SLEEP_TYPE << 2)` to the sleep control register powers
/// the machine off.
pub const ACPI_S5_SLEEP_TYPE: u8 = 5;

/// Kernel load alignment Linux expects (CONFIG_PHYSICAL_ALIGN default),
/// reported in `kernel_alignment` for ELF boots.
pub const KERNEL_ALIGNMENT: u32 = 0x0100_0000;
/// Highest initrd end for ELF boots where there is no setup header to
/// ask: Linux's historical `initrd_addr_max` default.
pub const INITRD_ADDR_MAX_DEFAULT: u64 = 0x37ff_ffff;

/// Boot protocol magic `HdrS` in `setup_header.header`.
pub const BOOT_HDR_MAGIC: u32 = 0x5372_6448;
/// `setup_header.boot_flag` value.
pub const BOOT_FLAG_MAGIC: u16 = 0xaa55;
/// `type_of_loader` value for "undefined boot loader".
pub const LOADER_TYPE_UNDEFINED: u8 = 0xff;
/// PVH `hvm_start_info.magic` (Xen's XEN_HVM_START_MAGIC_VALUE).
pub const PVH_START_MAGIC: u32 = 0x336e_c578;

/// Smallest guest memory we accept: room for the boot structures, a tiny
/// kernel at 1 MiB, and the stack.
pub const MIN_MEM_MIB: u64 = 4;
/// Largest guest memory we accept (sanity bound; the host's guest physical
/// address width may be smaller and KVM then refuses the slot).
pub const MAX_MEM_MIB: u64 = 1 << 20;
/// Largest vCPU count: xAPIC IDs are 8 bits and 0xff is broadcast, and the
/// MP table uses 8-bit APIC IDs.
pub const MAX_VCPUS: u8 = 254;

// Compile-time layout checks.
const _: () = assert!(PDE_START + BOOT_IDENTITY_MAP_GIB * 4096 <= CMDLINE_START);
const _: () = assert!(PVH_MEMMAP_MAX_ENTRIES >= 8);
const _: () = assert!(BOOT_IDENTITY_MAP_GIB * GIB >= MMIO_GAP_END);

/// A contiguous range of guest RAM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RamRange {
    /// Guest-physical start.
    pub start: u64,
    /// Length in bytes.
    pub len: u64,
}

impl RamRange {
    /// One past the last byte.
    pub fn end(&self) -> u64 {
        self.start + self.len
    }
}

/// The RAM ranges backing `mem_bytes` of guest memory: one below the gap,
/// and one above 4 GiB when the memory does not fit below it.
pub fn ram_ranges(mem_bytes: u64) -> Vec<RamRange> {
    let low = mem_bytes.min(MMIO_GAP_START);
    let mut v = vec![RamRange { start: 0, len: low }];
    if mem_bytes > MMIO_GAP_START {
        v.push(RamRange {
            start: HIGH_RAM_START,
            len: mem_bytes - MMIO_GAP_START,
        });
    }
    v
}

/// An e820 entry type (the values Linux and PVH share).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum E820Type {
    /// Usable RAM.
    Ram = 1,
    /// Reserved (EBDA, ACPI/BIOS area).
    Reserved = 2,
}

/// One e820 / PVH memory-map entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct E820Entry {
    /// Start address.
    pub addr: u64,
    /// Size in bytes.
    pub size: u64,
    /// Type.
    pub kind: E820Type,
}

/// The memory map handed to the guest: RAM below the EBDA, the EBDA and the
/// BIOS area holding the ACPI and MP tables as reserved, RAM from 1 MiB to the gap (or end of
/// memory), and RAM above 4 GiB. The VGA hole 0xa0000..0xe0000 is absent,
/// as on real machines. `mem_bytes` must be at least [`MIN_MEM_MIB`] MiB.
pub fn e820_map(mem_bytes: u64) -> Vec<E820Entry> {
    let mut v = vec![
        E820Entry {
            addr: 0,
            size: EBDA_START,
            kind: E820Type::Ram,
        },
        E820Entry {
            addr: EBDA_START,
            size: VGA_HOLE_START - EBDA_START,
            kind: E820Type::Reserved,
        },
        E820Entry {
            addr: ACPI_START,
            size: MPTABLE_END - ACPI_START,
            kind: E820Type::Reserved,
        },
    ];
    for r in ram_ranges(mem_bytes) {
        let start = r.start.max(HIMEM_START);
        if r.end() > start {
            v.push(E820Entry {
                addr: start,
                size: r.end() - start,
                kind: E820Type::Ram,
            });
        }
    }
    v
}

/// Guest-physical base of virtio-mmio slot `i`.
pub fn virtio_mmio_slot_addr(i: usize) -> u64 {
    VIRTIO_MMIO_BASE + i as u64 * VIRTIO_MMIO_SLOT_SIZE
}

/// GSI (IOAPIC pin) of virtio-mmio slot `i`.
pub fn virtio_mmio_slot_irq(i: usize) -> u32 {
    VIRTIO_IRQ_BASE + i as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ram_total(m: &[E820Entry]) -> u64 {
        m.iter()
            .filter(|e| e.kind == E820Type::Ram)
            .map(|e| e.size)
            .sum()
    }

    #[test]
    fn fixed_areas_do_not_overlap() {
        let areas = [
            (BOOT_GDT_START, BOOT_GDT_MAX as u64 * 8),
            (BOOT_IDT_START, 8),
            (PVH_INFO_START, 56),
            (PVH_MODLIST_START, 32),
            (PVH_MEMMAP_START, PVH_MEMMAP_MAX_ENTRIES as u64 * 24),
            (ZERO_PAGE_START, 4096),
            (BOOT_STACK_POINTER - 0x800, 0x800),
            (PML4_START, 4096),
            (PDPTE_START, 4096),
            (PDE_START, BOOT_IDENTITY_MAP_GIB * 4096),
            (CMDLINE_START, CMDLINE_MAX_SIZE as u64),
            (EBDA_START, VGA_HOLE_START - EBDA_START),
            (ACPI_START, ACPI_END - ACPI_START),
            (MPTABLE_START, MPTABLE_END - MPTABLE_START),
        ];
        for (i, a) in areas.iter().enumerate() {
            assert!(a.0 + a.1 <= HIMEM_START);
            for b in &areas[i + 1..] {
                assert!(
                    a.0 + a.1 <= b.0 || b.0 + b.1 <= a.0,
                    "{a:x?} overlaps {b:x?}"
                );
            }
        }
        assert!(virtio_mmio_slot_addr(VIRTIO_MMIO_MAX_SLOTS) <= u64::from(IOAPIC_ADDR));
        assert_eq!(virtio_mmio_slot_irq(VIRTIO_MMIO_MAX_SLOTS - 1), IRQ_MAX);
        assert!(KVM_IDENTITY_MAP_ADDRESS >= u64::from(APIC_ADDR) + 0x1000);
    }

    #[test]
    fn e820_small_memory() {
        let m = e820_map(64 * MIB);
        assert_eq!(
            m,
            vec![
                E820Entry {
                    addr: 0,
                    size: 0x9fc00,
                    kind: E820Type::Ram
                },
                E820Entry {
                    addr: 0x9fc00,
                    size: 0x400,
                    kind: E820Type::Reserved
                },
                E820Entry {
                    addr: 0xe0000,
                    size: 0x20000,
                    kind: E820Type::Reserved
                },
                E820Entry {
                    addr: 0x100000,
                    size: 63 * MIB,
                    kind: E820Type::Ram
                },
            ]
        );
        assert_eq!(
            ram_ranges(64 * MIB),
            vec![RamRange {
                start: 0,
                len: 64 * MIB
            }]
        );
    }

    #[test]
    fn e820_exactly_at_gap_and_above() {
        // 3 GiB: fills the space below the gap exactly, nothing above 4 GiB.
        let m = e820_map(3 * GIB);
        assert_eq!(m.len(), 4);
        assert_eq!(
            m[3],
            E820Entry {
                addr: MIB,
                size: 3 * GIB - MIB,
                kind: E820Type::Ram
            }
        );
        assert_eq!(ram_ranges(3 * GIB).len(), 1);

        // 5 GiB: 3 GiB below the gap, 2 GiB from 4 GiB.
        let m = e820_map(5 * GIB);
        assert_eq!(m.len(), 5);
        assert_eq!(m[3].addr + m[3].size, MMIO_GAP_START);
        assert_eq!(
            m[4],
            E820Entry {
                addr: 4 * GIB,
                size: 2 * GIB,
                kind: E820Type::Ram
            }
        );
        assert_eq!(
            ram_ranges(5 * GIB),
            vec![
                RamRange {
                    start: 0,
                    len: 3 * GIB
                },
                RamRange {
                    start: 4 * GIB,
                    len: 2 * GIB
                },
            ]
        );
        // RAM reported = configured memory minus the BIOS area hole
        // (EBDA..1 MiB), for every size.
        for mib in [MIN_MEM_MIB, 128, 256, 3071, 3072, 3073, 8192] {
            let bytes = mib * MIB;
            assert_eq!(
                ram_total(&e820_map(bytes)),
                bytes - (HIMEM_START - EBDA_START),
                "{mib}"
            );
            let ranges: u64 = ram_ranges(bytes).iter().map(|r| r.len).sum();
            assert_eq!(ranges, bytes);
        }
    }
}
