//! Intel MultiProcessor Specification 1.4 tables: a floating pointer
//! (`_MP_`) and a configuration table (`PCMP`) listing one processor entry
//! per vCPU, an ISA bus, the IOAPIC, an I/O interrupt entry per IOAPIC pin
//! (ISA IRQ n → pin n, bus-conforming polarity/trigger), and the local
//! interrupts LINT0 = ExtINT, LINT1 = NMI.
//!
//! Kernels booted with `acpi=off` (or without ACPI support) use this to find
//! the APs and the IOAPIC; ACPI kernels prefer the MADT.

use vm_memory::{Bytes, GuestAddress};

use crate::layout;
use crate::memory::GuestMemory;

/// Errors writing the MP table.
#[derive(Debug, thiserror::Error)]
pub enum MptableError {
    /// Invalid CPU count.
    #[error("MP table supports 1..={max} vCPUs, got {0}", max = layout::MAX_VCPUS)]
    CpuCount(u8),
    /// The table does not fit its area.
    #[error("MP table of {0} bytes does not fit {start:#x}..{end:#x}", start = layout::MPTABLE_START, end = layout::MPTABLE_END)]
    TooLarge(u64),
    /// Guest memory write failed.
    #[error("cannot write the MP table into guest memory: {0}")]
    Write(#[source] vm_memory::GuestMemoryError),
}

/// Local APIC version we report (integrated APIC, as KVM's LAPIC reports).
const APIC_VERSION: u8 = 0x14;
/// IOAPIC version (KVM's in-kernel IOAPIC is version 0x11).
const IOAPIC_VERSION: u8 = 0x11;
/// MP spec revision 1.4.
const MP_SPEC_REV: u8 = 4;
/// Processor entry CPU flags: enabled.
const CPU_ENABLED: u8 = 1;
/// Processor entry CPU flags: bootstrap processor.
const CPU_BSP: u8 = 2;
/// Processor signature: family 6 (stepping/model 0); informational.
const CPU_SIGNATURE: u32 = 0x600;
/// Processor feature flags: FPU (bit 0) and on-chip APIC (bit 9).
const CPU_FEATURES: u32 = (1 << 9) | 1;
/// Interrupt type INT (vectored through the IOAPIC).
const INT_TYPE_INT: u8 = 0;
/// Interrupt type NMI.
const INT_TYPE_NMI: u8 = 1;
/// Interrupt type ExtINT (8259).
const INT_TYPE_EXTINT: u8 = 3;

fn checksum(data: &[u8]) -> u8 {
    0u8.wrapping_sub(data.iter().fold(0u8, |a, b| a.wrapping_add(*b)))
}

/// Builds the floating pointer + configuration table for `cpus` vCPUs,
/// to be placed at `base`.
pub fn build(cpus: u8, base: u64) -> Result<Vec<u8>, MptableError> {
    if cpus == 0 || cpus > layout::MAX_VCPUS {
        return Err(MptableError::CpuCount(cpus));
    }
    let ioapic_id = cpus; // first ID after the LAPICs
    let mut entries = Vec::new();
    let mut count: u16 = 0;
    for i in 0..cpus {
        entries.push(0u8); // processor
        entries.push(i); // LAPIC ID
        entries.push(APIC_VERSION);
        entries.push(CPU_ENABLED | if i == 0 { CPU_BSP } else { 0 });
        entries.extend_from_slice(&CPU_SIGNATURE.to_le_bytes());
        entries.extend_from_slice(&CPU_FEATURES.to_le_bytes());
        entries.extend_from_slice(&[0u8; 8]);
        count += 1;
    }
    entries.extend_from_slice(&[1, 0]); // bus 0
    entries.extend_from_slice(b"ISA   ");
    count += 1;
    entries.extend_from_slice(&[2, ioapic_id, IOAPIC_VERSION, 1]);
    entries.extend_from_slice(&layout::IOAPIC_ADDR.to_le_bytes());
    count += 1;
    for pin in 0..layout::IOAPIC_PINS as u8 {
        // type 3, INT, flags 0 (conforms to bus), bus 0, IRQ pin, IOAPIC, pin
        entries.extend_from_slice(&[3, INT_TYPE_INT, 0, 0, 0, pin, ioapic_id, pin]);
        count += 1;
    }
    // type 4: ExtINT → LINT0 and NMI → LINT1 of every LAPIC (0xff).
    entries.extend_from_slice(&[4, INT_TYPE_EXTINT, 0, 0, 0, 0, 0xff, 0]);
    entries.extend_from_slice(&[4, INT_TYPE_NMI, 0, 0, 0, 0, 0xff, 1]);
    count += 2;

    let table_len = 44 + entries.len();
    let mut hdr = Vec::with_capacity(table_len);
    hdr.extend_from_slice(b"PCMP");
    hdr.extend_from_slice(&(table_len as u16).to_le_bytes());
    hdr.push(MP_SPEC_REV);
    hdr.push(0); // checksum
    hdr.extend_from_slice(b"COWORK  ");
    hdr.extend_from_slice(b"COWORKVM    ");
    hdr.extend_from_slice(&0u32.to_le_bytes()); // OEM table pointer
    hdr.extend_from_slice(&0u16.to_le_bytes()); // OEM table size
    hdr.extend_from_slice(&count.to_le_bytes());
    hdr.extend_from_slice(&layout::APIC_ADDR.to_le_bytes());
    hdr.extend_from_slice(&0u16.to_le_bytes()); // extended table length
    hdr.push(0); // extended table checksum
    hdr.push(0);
    hdr.extend_from_slice(&entries);
    hdr[7] = checksum(&hdr);

    let mut fp = [0u8; 16];
    fp[0..4].copy_from_slice(b"_MP_");
    let cfg_addr = u32::try_from(base + 16).map_err(|_| MptableError::TooLarge(base))?;
    fp[4..8].copy_from_slice(&cfg_addr.to_le_bytes());
    fp[8] = 1; // length in 16-byte units
    fp[9] = MP_SPEC_REV;
    // fp[11] feature byte 1 = 0: a configuration table is present.
    fp[10] = checksum(&fp);

    let mut out = fp.to_vec();
    out.extend_from_slice(&hdr);
    Ok(out)
}

/// Writes the MP table at [`layout::MPTABLE_START`].
pub fn write(mem: &GuestMemory, cpus: u8) -> Result<(), MptableError> {
    let t = build(cpus, layout::MPTABLE_START)?;
    if layout::MPTABLE_START + t.len() as u64 > layout::MPTABLE_END {
        return Err(MptableError::TooLarge(t.len() as u64));
    }
    mem.write_slice(&t, GuestAddress(layout::MPTABLE_START))
        .map_err(MptableError::Write)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(d: &[u8]) -> u8 {
        d.iter().fold(0u8, |a, b| a.wrapping_add(*b))
    }

    #[test]
    fn checksums_and_entries() {
        for cpus in [1u8, 2, 8, layout::MAX_VCPUS] {
            let t = build(cpus, layout::MPTABLE_START).unwrap();
            assert!(layout::MPTABLE_START + t.len() as u64 <= layout::MPTABLE_END);
            let (fp, cfg) = t.split_at(16);
            assert_eq!(&fp[0..4], b"_MP_");
            assert_eq!(sum(fp), 0);
            assert_eq!(
                u32::from_le_bytes(fp[4..8].try_into().unwrap()) as u64,
                layout::MPTABLE_START + 16
            );
            assert_eq!(&cfg[0..4], b"PCMP");
            assert_eq!(u16::from_le_bytes([cfg[4], cfg[5]]) as usize, cfg.len());
            assert_eq!(sum(cfg), 0);
            let count = u16::from_le_bytes([cfg[34], cfg[35]]) as usize;
            assert_eq!(count, cpus as usize + 1 + 1 + 24 + 2);
            // Walk entries; processors first, BSP flag only on APIC ID 0.
            let mut p = 44;
            let mut procs = vec![];
            for _ in 0..count {
                let len = if cfg[p] == 0 { 20 } else { 8 };
                if cfg[p] == 0 {
                    procs.push((cfg[p + 1], cfg[p + 3]));
                }
                p += len;
            }
            assert_eq!(p, cfg.len());
            assert_eq!(procs.len(), cpus as usize);
            for (i, (id, flags)) in procs.iter().enumerate() {
                assert_eq!(*id as usize, i);
                assert_eq!(*flags, if i == 0 { 3 } else { 1 });
            }
        }
        assert!(build(0, 0).is_err());
        assert!(build(255, 0).is_err());
    }
}
