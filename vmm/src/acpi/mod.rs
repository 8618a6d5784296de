//! ACPI tables for a hardware-reduced machine: RSDP → XSDT → {FADT, MADT},
//! FADT → DSDT.
//!
//! - FADT (rev 6.5): `HW_REDUCED_ACPI`, no legacy PM blocks, a sleep
//!   control/status register pair on port I/O so the guest can power off
//!   through `\_S5`, boot-architecture flags saying there is no VGA, no CMOS
//!   RTC, no i8042 to probe (reset still works through port 0x64) and no MSI.
//! - MADT: one enabled Local APIC per vCPU (APIC ID = index), the IOAPIC,
//!   and LINT1 = NMI on all processors.
//! - DSDT: `\_S5` and, under `\_SB`, COM1 (`PNP0501`, ports 0x3f8-0x3ff,
//!   ISA IRQ 4) and one `LNRO0005` (virtio-mmio) device per slot with
//!   `Memory32Fixed` + edge `Interrupt`, so kernels built without
//!   `VIRTIO_MMIO_CMDLINE_DEVICES` find the devices. COM1 must be described:
//!   on a hardware-reduced platform Linux has no legacy PIC and sets up no
//!   ISA IRQ mappings, so the 8250 driver only gets a working IRQ 4 (and
//!   interrupt-driven TX for user space) through the ACPI/PNP description.
//!
//! Tables are packed into `[ACPI_START, ACPI_END)` with the RSDP first
//! (16-byte aligned, inside the legacy scan range).

pub mod aml;

use vm_memory::{Bytes, GuestAddress};

use crate::layout;
use crate::memory::GuestMemory;

use aml::{Aml, Device, EisaId, Int, Name, Package, Resource, ResourceTemplate, Scope, Str};

/// OEM ID in every table.
pub const OEM_ID: [u8; 6] = *b"COWORK";
/// OEM table ID in every table.
pub const OEM_TABLE_ID: [u8; 8] = *b"COWORKVM";
/// Creator ID.
pub const CREATOR_ID: [u8; 4] = *b"CWVM";

/// Errors building or writing ACPI tables.
#[derive(Debug, thiserror::Error)]
pub enum AcpiError {
    /// The DSDT AML could not be encoded.
    #[error("cannot encode the DSDT: {0}")]
    Aml(#[from] aml::AmlError),
    /// Tables do not fit the ACPI area.
    #[error("ACPI tables need {need} bytes but the area {start:#x}..{end:#x} holds {have}: too many devices or vCPUs")]
    TooLarge {
        /// Needed bytes.
        need: u64,
        /// Available bytes.
        have: u64,
        /// Area start.
        start: u64,
        /// Area end.
        end: u64,
    },
    /// Writing guest memory failed.
    #[error("cannot write ACPI table at {addr:#x}: {source}")]
    Write {
        /// Address.
        addr: u64,
        /// Cause.
        source: vm_memory::GuestMemoryError,
    },
}

/// A virtio-mmio device as the DSDT describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MmioSlot {
    /// MMIO base.
    pub base: u64,
    /// MMIO length.
    pub len: u64,
    /// GSI.
    pub gsi: u32,
}

/// Sum-to-zero checksum byte for `data` (whose checksum byte is 0).
pub fn checksum(data: &[u8]) -> u8 {
    0u8.wrapping_sub(data.iter().fold(0u8, |a, b| a.wrapping_add(*b)))
}

/// A system description table under construction: header + body.
fn sdt(signature: &[u8; 4], revision: u8, body: &[u8]) -> Vec<u8> {
    let len = 36 + body.len();
    let mut t = Vec::with_capacity(len);
    t.extend_from_slice(signature);
    t.extend_from_slice(&(len as u32).to_le_bytes());
    t.push(revision);
    t.push(0); // checksum, fixed below
    t.extend_from_slice(&OEM_ID);
    t.extend_from_slice(&OEM_TABLE_ID);
    t.extend_from_slice(&1u32.to_le_bytes()); // OEM revision
    t.extend_from_slice(&CREATOR_ID);
    t.extend_from_slice(&1u32.to_le_bytes()); // creator revision
    t.extend_from_slice(body);
    t[9] = checksum(&t);
    t
}

/// Generic Address Structure (ACPI 6.5 §5.2.3.2) for a byte-wide I/O port.
fn gas_io_byte(port: u16) -> [u8; 12] {
    let mut g = [0u8; 12];
    g[0] = 1; // address space: System I/O
    g[1] = 8; // register bit width
    g[2] = 0; // bit offset
    g[3] = 1; // access size: byte
    g[4..12].copy_from_slice(&u64::from(port).to_le_bytes());
    g
}

/// FADT flag: HW_REDUCED_ACPI (bit 20).
const FADT_HW_REDUCED_ACPI: u32 = 1 << 20;
/// IAPC_BOOT_ARCH: VGA Not Present (bit 2).
const IAPC_VGA_NOT_PRESENT: u16 = 1 << 2;
/// IAPC_BOOT_ARCH: MSI Not Supported (bit 3).
const IAPC_MSI_NOT_SUPPORTED: u16 = 1 << 3;
/// IAPC_BOOT_ARCH: CMOS RTC Not Present (bit 5).
const IAPC_CMOS_RTC_NOT_PRESENT: u16 = 1 << 5;
/// FADT length for revision 6 (through the hypervisor vendor identity).
const FADT_LEN: usize = 276;

/// Builds the FADT pointing at the DSDT at `dsdt_addr`.
pub fn fadt(dsdt_addr: u64) -> Vec<u8> {
    // Body offsets below are table offsets minus the 36-byte header.
    let mut b = vec![0u8; FADT_LEN - 36];
    let at = |off: usize| off - 36;
    // DSDT (32-bit) — the tables live below 1 MiB so it always fits.
    b[at(40)..at(44)].copy_from_slice(&(dsdt_addr as u32).to_le_bytes());
    // Preferred_PM_Profile: 0 unspecified. SCI_INT 0 (no SCI: HW-reduced).
    // IAPC_BOOT_ARCH at 109. Note: the 8042 bit (1) stays clear so Linux's
    // i8042 driver does not probe a keyboard controller we only use for reset.
    b[at(109)..at(111)].copy_from_slice(
        &(IAPC_VGA_NOT_PRESENT | IAPC_MSI_NOT_SUPPORTED | IAPC_CMOS_RTC_NOT_PRESENT).to_le_bytes(),
    );
    b[at(112)..at(116)].copy_from_slice(&FADT_HW_REDUCED_ACPI.to_le_bytes());
    // FADT minor version (131) = 5 → ACPI 6.5.
    b[at(131)] = 5;
    // X_DSDT (140).
    b[at(140)..at(148)].copy_from_slice(&dsdt_addr.to_le_bytes());
    // SLEEP_CONTROL_REG (244), SLEEP_STATUS_REG (256).
    b[at(244)..at(256)].copy_from_slice(&gas_io_byte(layout::ACPI_SLEEP_CONTROL_PORT));
    b[at(256)..at(268)].copy_from_slice(&gas_io_byte(layout::ACPI_SLEEP_STATUS_PORT));
    // Hypervisor Vendor Identity (268).
    b[at(268)..at(276)].copy_from_slice(b"COWORKVM");
    sdt(b"FACP", 6, &b)
}

/// MADT flag PCAT_COMPAT: the (in-kernel) dual 8259 PIC exists.
const MADT_PCAT_COMPAT: u32 = 1;

/// Builds the MADT for `cpus` vCPUs with APIC IDs 0..cpus.
pub fn madt(cpus: u8) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&layout::APIC_ADDR.to_le_bytes());
    b.extend_from_slice(&MADT_PCAT_COMPAT.to_le_bytes());
    for i in 0..cpus {
        // Processor Local APIC: type 0, length 8, UID, APIC ID, flags=Enabled.
        b.extend_from_slice(&[0, 8, i, i]);
        b.extend_from_slice(&1u32.to_le_bytes());
    }
    // I/O APIC: type 1, length 12, ID, reserved, address, GSI base 0.
    b.extend_from_slice(&[1, 12, cpus, 0]);
    b.extend_from_slice(&layout::IOAPIC_ADDR.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes());
    // Local APIC NMI: type 4, length 6, UID 0xff (all), flags 0 (conforms
    // to the bus), LINT# 1.
    b.extend_from_slice(&[4, 6, 0xff, 0, 0, 1]);
    sdt(b"APIC", 5, &b)
}

/// Builds the DSDT body AML and wraps it in the table header.
pub fn dsdt(slots: &[MmioSlot]) -> Result<Vec<u8>, AcpiError> {
    let s5 = Package(vec![u64::from(layout::ACPI_S5_SLEEP_TYPE), 0, 0, 0]);
    let s5_name = Name {
        name: "_S5_",
        value: &s5,
    };

    struct Dev {
        name: String,
        uid: Int,
        crs: ResourceTemplate,
    }
    let mut devs = Vec::with_capacity(slots.len());
    for (i, s) in slots.iter().enumerate() {
        let base = u32::try_from(s.base).map_err(|_| aml::AmlError::TooLarge(s.base as usize))?;
        let len = u32::try_from(s.len).map_err(|_| aml::AmlError::TooLarge(s.len as usize))?;
        devs.push(Dev {
            name: format!("V{i:03X}"),
            uid: Int(i as u64),
            crs: ResourceTemplate(vec![
                Resource::Memory32Fixed { base, len },
                Resource::EdgeInterrupt { gsi: s.gsi },
            ]),
        });
    }
    let com1_hid = EisaId::new("PNP0501")?;
    let com1_uid = Int(0);
    let com1_crs = ResourceTemplate(vec![
        Resource::Io {
            base: layout::COM1_PORT,
            len: layout::COM1_PORT_LEN as u8,
        },
        Resource::IrqNoFlags {
            irq: layout::COM1_IRQ as u8,
        },
    ]);
    let com1_names = [
        Name {
            name: "_HID",
            value: &com1_hid,
        },
        Name {
            name: "_UID",
            value: &com1_uid,
        },
        Name {
            name: "_CRS",
            value: &com1_crs,
        },
    ];
    let com1 = Device {
        name: "COM1",
        children: com1_names.iter().map(|x| x as &dyn Aml).collect(),
    };
    let hid = Str("LNRO0005");
    let names: Vec<[Name; 3]> = devs
        .iter()
        .map(|d| {
            [
                Name {
                    name: "_HID",
                    value: &hid,
                },
                Name {
                    name: "_UID",
                    value: &d.uid,
                },
                Name {
                    name: "_CRS",
                    value: &d.crs,
                },
            ]
        })
        .collect();
    let devices: Vec<Device> = devs
        .iter()
        .zip(&names)
        .map(|(d, n)| Device {
            name: &d.name,
            children: n.iter().map(|x| x as &dyn Aml).collect(),
        })
        .collect();
    let mut sb_children: Vec<&dyn Aml> = vec![&com1];
    sb_children.extend(devices.iter().map(|d| d as &dyn Aml));
    let sb = Scope {
        name: "\\_SB_",
        children: sb_children,
    };
    let body = aml::encode_all(&[&s5_name, &sb])?;
    Ok(sdt(b"DSDT", 2, &body))
}

/// Builds the XSDT listing `tables`.
pub fn xsdt(tables: &[u64]) -> Vec<u8> {
    let body: Vec<u8> = tables.iter().flat_map(|a| a.to_le_bytes()).collect();
    sdt(b"XSDT", 1, &body)
}

/// Builds the 36-byte ACPI 2.0+ RSDP pointing at the XSDT.
pub fn rsdp(xsdt_addr: u64) -> [u8; 36] {
    let mut r = [0u8; 36];
    r[0..8].copy_from_slice(b"RSD PTR ");
    r[9..15].copy_from_slice(&OEM_ID);
    r[15] = 2; // revision: ACPI 2.0+
               // RsdtAddress (16..20) = 0: XSDT only.
    r[20..24].copy_from_slice(&36u32.to_le_bytes());
    r[24..32].copy_from_slice(&xsdt_addr.to_le_bytes());
    r[8] = checksum(&r[0..20]);
    r[32] = checksum(&r);
    r
}

/// Where the tables went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AcpiLayout {
    /// RSDP address (for boot_params.acpi_rsdp_addr / PVH rsdp_paddr).
    pub rsdp: u64,
    /// One past the last byte written.
    pub end: u64,
}

fn align16(x: u64) -> u64 {
    (x + 15) & !15
}

/// Writes all tables into guest memory at [`layout::ACPI_START`].
pub fn write_tables(
    mem: &GuestMemory,
    cpus: u8,
    slots: &[MmioSlot],
) -> Result<AcpiLayout, AcpiError> {
    let rsdp_addr = layout::ACPI_START;
    let mut next = align16(rsdp_addr + 36);
    let mut place = |t: &[u8]| {
        let a = next;
        next = align16(next + t.len() as u64);
        a
    };
    let dsdt_t = dsdt(slots)?;
    let dsdt_addr = place(&dsdt_t);
    let fadt_t = fadt(dsdt_addr);
    let fadt_addr = place(&fadt_t);
    let madt_t = madt(cpus);
    let madt_addr = place(&madt_t);
    let xsdt_t = xsdt(&[fadt_addr, madt_addr]);
    let xsdt_addr = place(&xsdt_t);
    let end = next;
    if end > layout::ACPI_END {
        return Err(AcpiError::TooLarge {
            need: end - layout::ACPI_START,
            have: layout::ACPI_END - layout::ACPI_START,
            start: layout::ACPI_START,
            end: layout::ACPI_END,
        });
    }
    let rsdp_t = rsdp(xsdt_addr);
    for (addr, t) in [
        (rsdp_addr, &rsdp_t[..]),
        (dsdt_addr, &dsdt_t[..]),
        (fadt_addr, &fadt_t[..]),
        (madt_addr, &madt_t[..]),
        (xsdt_addr, &xsdt_t[..]),
    ] {
        mem.write_slice(t, GuestAddress(addr))
            .map_err(|source| AcpiError::Write { addr, source })?;
    }
    Ok(AcpiLayout {
        rsdp: rsdp_addr,
        end,
    })
}

#[cfg(test)]
mod tests;
