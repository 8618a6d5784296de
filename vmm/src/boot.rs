//! x86_64 boot: kernel/initrd loading, the Linux zero page, PVH start info,
//! GDT, identity page tables, and the initial vCPU state (registers,
//! segment registers, FPU, MSRs, LAPIC LINT pins).
//!
//! Entry protocols:
//! - ELF with a `XEN_ELFNOTE_PHYS32_ENTRY` note → **PVH**: 32-bit protected
//!   mode, paging off, `%ebx` = `hvm_start_info`.
//! - other ELF (vmlinux) → **64-bit Linux boot protocol** at `e_entry`:
//!   long mode, identity-mapped 4 GiB, `%rsi` = zero page.
//! - bzImage → 64-bit Linux boot protocol at the protected-mode code + 0x200
//!   (`startup_64`), requires `XLF_KERNEL_64`.
//!
//! Everything read from the kernel or initrd files is untrusted: sizes and
//! addresses are checked against guest memory before use.

use std::fs::File;
use std::io::Read;

use kvm_bindings::{kvm_fpu, kvm_msr_entry, kvm_regs, kvm_segment, kvm_sregs, Msrs};
use kvm_ioctls::VcpuFd;
use linux_loader::loader::bootparam::{boot_params, setup_header};
use linux_loader::loader::{self as ll, KernelLoader};
use linux_loader::start_info::{hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemory as _};

use crate::layout::{self, E820Entry};
use crate::memory::GuestMemory;
use crate::sparse::{HoleSkipper, ReadStats};

/// Errors of the boot setup.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// Reading the kernel file failed.
    #[error("cannot read the kernel image: {0}")]
    ReadKernel(#[source] std::io::Error),
    /// linux-loader rejected the image.
    #[error("cannot load the kernel image ({format}): {source}. Pass an ELF vmlinux or a bzImage built for x86_64")]
    Load {
        /// "ELF" or "bzImage".
        format: &'static str,
        /// Loader error.
        source: ll::Error,
    },
    /// bzImage without a 64-bit entry point.
    #[error("this bzImage (boot protocol {version:#x}) has no 64-bit entry point (XLF_KERNEL_64); use a 64-bit kernel with boot protocol >= 2.12")]
    No64BitEntry {
        /// Protocol version.
        version: u16,
    },
    /// Entry point outside guest RAM.
    #[error("kernel entry point {0:#x} is outside guest memory")]
    BadEntry(u64),
    /// The initrd does not fit.
    #[error("initrd of {size} bytes does not fit between the kernel end {kernel_end:#x} and {limit:#x}; give the guest more memory or use a smaller initrd")]
    InitrdTooLarge {
        /// Initrd size.
        size: u64,
        /// Kernel end.
        kernel_end: u64,
        /// Highest allowed end.
        limit: u64,
    },
    /// Reading the initrd failed.
    #[error("cannot read the initrd: {0}")]
    ReadInitrd(#[source] std::io::Error),
    /// Command line problems.
    #[error("kernel command line is {len} bytes; the limit is {max} (including the trailing NUL)")]
    CmdlineTooLong {
        /// Length with NUL.
        len: usize,
        /// Limit.
        max: usize,
    },
    /// NUL in command line.
    #[error("kernel command line contains a NUL byte")]
    CmdlineNul,
    /// Too many memory map entries.
    #[error("memory map has {0} entries, more than the boot structures hold")]
    TooManyE820(usize),
    /// Guest memory write failed.
    #[error("cannot write {what} into guest memory: {source}")]
    Write {
        /// What.
        what: &'static str,
        /// Cause.
        source: vm_memory::GuestMemoryError,
    },
    /// A vCPU setup ioctl failed.
    #[error("{what} failed: {source}")]
    Vcpu {
        /// Which ioctl.
        what: &'static str,
        /// Cause.
        source: kvm_ioctls::Error,
    },
    /// KVM refused one of the boot MSRs.
    #[error("KVM refused boot MSR {index:#x} ({name}); set {set} of {total}")]
    Msr {
        /// MSR index.
        index: u32,
        /// MSR name.
        name: &'static str,
        /// How many were set.
        set: usize,
        /// How many were requested.
        total: usize,
    },
}

fn write_err(what: &'static str) -> impl FnOnce(vm_memory::GuestMemoryError) -> BootError {
    move |source| BootError::Write { what, source }
}

/// How the boot vCPU enters the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    /// 64-bit Linux boot protocol, `%rsi` = zero page.
    Linux64,
    /// PVH, `%ebx` = `hvm_start_info`.
    Pvh,
}

/// A kernel loaded into guest memory.
#[derive(Debug, Clone, Copy)]
pub struct LoadedKernel {
    /// Entry protocol.
    pub kind: EntryKind,
    /// Entry address.
    pub entry: u64,
    /// First byte after the kernel image (bss included for ELF).
    pub kernel_end: u64,
    /// bzImage setup header, to be copied into the zero page.
    pub setup_header: Option<setup_header>,
}

/// bzImage `xloadflags`: the kernel has a 64-bit entry at +0x200.
const XLF_KERNEL_64: u16 = 1;
/// Offset of `startup_64` from the start of the protected-mode kernel.
const STARTUP_64_OFFSET: u64 = 0x200;

/// Loads an ELF vmlinux or a bzImage into `mem`, which must be freshly
/// mapped (all zero): the file's holes are skipped ([`crate::sparse`]).
/// Returns what was loaded and how its bytes got there.
pub fn load_kernel(mem: &GuestMemory, file: &File) -> Result<(LoadedKernel, ReadStats), BootError> {
    let mut src = HoleSkipper::into_fresh_ram(file).map_err(BootError::ReadKernel)?;
    let mut magic = [0u8; 4];
    src.read_exact(&mut magic).map_err(BootError::ReadKernel)?;
    let himem = Some(GuestAddress(layout::HIMEM_START));
    let loaded = if &magic == b"\x7fELF" {
        let r = ll::Elf::load(mem, None, &mut src, himem).map_err(|source| BootError::Load {
            format: "ELF",
            source,
        })?;
        let (kind, entry) = match r.pvh_boot_cap {
            ll::PvhBootCapability::PvhEntryPresent(a) => (EntryKind::Pvh, a.raw_value()),
            _ => (EntryKind::Linux64, r.kernel_load.raw_value()),
        };
        check_entry(mem, entry)?;
        LoadedKernel {
            kind,
            entry,
            kernel_end: r.kernel_end,
            setup_header: None,
        }
    } else {
        let r =
            ll::BzImage::load(mem, None, &mut src, himem).map_err(|source| BootError::Load {
                format: "bzImage",
                source,
            })?;
        let hdr = r
            .setup_header
            .ok_or(BootError::No64BitEntry { version: 0 })?;
        if hdr.version < 0x020c || hdr.xloadflags & XLF_KERNEL_64 == 0 {
            return Err(BootError::No64BitEntry {
                version: hdr.version,
            });
        }
        let entry = r.kernel_load.raw_value() + STARTUP_64_OFFSET;
        check_entry(mem, entry)?;
        LoadedKernel {
            kind: EntryKind::Linux64,
            entry,
            kernel_end: r.kernel_end,
            setup_header: Some(hdr),
        }
    };
    Ok((loaded, src.stats()))
}

fn check_entry(mem: &GuestMemory, entry: u64) -> Result<(), BootError> {
    if mem.address_in_range(GuestAddress(entry)) {
        Ok(())
    } else {
        Err(BootError::BadEntry(entry))
    }
}

/// Where the initrd went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InitrdPlacement {
    /// Guest address.
    pub addr: u64,
    /// Size.
    pub size: u64,
}

/// Computes the initrd address: as high as possible (page-aligned) below
/// the end of low RAM and the kernel's `initrd_addr_max`, above the kernel.
pub fn place_initrd(
    size: u64,
    low_ram_end: u64,
    kernel_end: u64,
    addr_max: u64,
) -> Result<InitrdPlacement, BootError> {
    let limit = low_ram_end.min(addr_max.saturating_add(1));
    let floor = kernel_end.div_ceil(layout::PAGE_SIZE) * layout::PAGE_SIZE;
    let err = BootError::InitrdTooLarge {
        size,
        kernel_end,
        limit,
    };
    let start = limit.checked_sub(size).ok_or(err)? & !(layout::PAGE_SIZE - 1);
    if start < floor.max(layout::HIMEM_START) {
        return Err(BootError::InitrdTooLarge {
            size,
            kernel_end,
            limit,
        });
    }
    Ok(InitrdPlacement { addr: start, size })
}

/// Loads the initrd file into guest memory, which must be freshly mapped
/// (all zero): the file's holes are skipped ([`crate::sparse`]).
pub fn load_initrd(
    mem: &GuestMemory,
    file: &File,
    kernel: &LoadedKernel,
    low_ram_end: u64,
) -> Result<(InitrdPlacement, ReadStats), BootError> {
    let mut src = HoleSkipper::into_fresh_ram(file).map_err(BootError::ReadInitrd)?;
    let size = src.size();
    let addr_max = kernel
        .setup_header
        .map(|h| u64::from(h.initrd_addr_max))
        .filter(|m| *m != 0)
        .unwrap_or(layout::INITRD_ADDR_MAX_DEFAULT);
    let p = place_initrd(size, low_ram_end, kernel.kernel_end, addr_max)?;
    let len = usize::try_from(size).map_err(|_| BootError::InitrdTooLarge {
        size,
        kernel_end: kernel.kernel_end,
        limit: low_ram_end,
    })?;
    mem.read_exact_volatile_from(GuestAddress(p.addr), &mut src, len)
        .map_err(|e| BootError::ReadInitrd(std::io::Error::other(e.to_string())))?;
    Ok((p, src.stats()))
}

/// Checks and writes the command line at [`layout::CMDLINE_START`];
/// `max` includes the NUL.
pub fn write_cmdline(mem: &GuestMemory, cmdline: &str, max: usize) -> Result<(), BootError> {
    if cmdline.as_bytes().contains(&0) {
        return Err(BootError::CmdlineNul);
    }
    let len = cmdline.len() + 1;
    if len > max {
        return Err(BootError::CmdlineTooLong { len, max });
    }
    let mut bytes = Vec::with_capacity(len);
    bytes.extend_from_slice(cmdline.as_bytes());
    bytes.push(0);
    mem.write_slice(&bytes, GuestAddress(layout::CMDLINE_START))
        .map_err(write_err("command line"))
}

/// The command-line limit for a kernel: [`layout::CMDLINE_MAX_SIZE`], or
/// the bzImage's `cmdline_size + 1` when smaller.
pub fn cmdline_limit(kernel: &LoadedKernel) -> usize {
    match kernel.setup_header {
        Some(h) if h.version >= 0x0206 && h.cmdline_size > 0 => (h.cmdline_size as usize)
            .saturating_add(1)
            .min(layout::CMDLINE_MAX_SIZE),
        _ => layout::CMDLINE_MAX_SIZE,
    }
}

/// Inputs of the boot-structure writers.
#[derive(Debug, Clone)]
pub struct BootInfo<'a> {
    /// Loaded kernel.
    pub kernel: &'a LoadedKernel,
    /// Length of the command line (without NUL) at [`layout::CMDLINE_START`].
    pub cmdline_len: usize,
    /// The initrd, if any.
    pub initrd: Option<InitrdPlacement>,
    /// Memory map.
    pub e820: &'a [E820Entry],
    /// RSDP address.
    pub rsdp: u64,
}

/// Builds the zero page (`struct boot_params`).
pub fn zero_page(info: &BootInfo<'_>) -> Result<boot_params, BootError> {
    let mut p = boot_params::default();
    if let Some(h) = info.kernel.setup_header {
        p.hdr = h;
    } else {
        p.hdr.boot_flag = layout::BOOT_FLAG_MAGIC;
        p.hdr.header = layout::BOOT_HDR_MAGIC;
        p.hdr.kernel_alignment = layout::KERNEL_ALIGNMENT;
    }
    p.hdr.type_of_loader = layout::LOADER_TYPE_UNDEFINED;
    p.hdr.cmd_line_ptr = layout::CMDLINE_START as u32;
    p.hdr.cmdline_size = info.cmdline_len as u32;
    if let Some(i) = info.initrd {
        p.hdr.ramdisk_image = i.addr as u32;
        p.hdr.ramdisk_size = i.size as u32;
        p.ext_ramdisk_image = (i.addr >> 32) as u32;
        p.ext_ramdisk_size = (i.size >> 32) as u32;
    }
    p.acpi_rsdp_addr = info.rsdp;
    if info.e820.len() > p.e820_table.len() {
        return Err(BootError::TooManyE820(info.e820.len()));
    }
    for (slot, e) in p.e820_table.iter_mut().zip(info.e820) {
        slot.addr = e.addr;
        slot.size = e.size;
        slot.type_ = e.kind as u32;
    }
    p.e820_entries = info.e820.len() as u8;
    Ok(p)
}

/// Writes the PVH `hvm_start_info`, module list and memory map.
pub fn write_pvh(mem: &GuestMemory, info: &BootInfo<'_>) -> Result<(), BootError> {
    if info.e820.len() > layout::PVH_MEMMAP_MAX_ENTRIES {
        return Err(BootError::TooManyE820(info.e820.len()));
    }
    let mut si = hvm_start_info {
        magic: layout::PVH_START_MAGIC,
        version: 1,
        cmdline_paddr: layout::CMDLINE_START,
        rsdp_paddr: info.rsdp,
        memmap_paddr: layout::PVH_MEMMAP_START,
        memmap_entries: info.e820.len() as u32,
        ..Default::default()
    };
    if let Some(i) = info.initrd {
        let m = hvm_modlist_entry {
            paddr: i.addr,
            size: i.size,
            ..Default::default()
        };
        mem.write_obj(m, GuestAddress(layout::PVH_MODLIST_START))
            .map_err(write_err("PVH module list"))?;
        si.nr_modules = 1;
        si.modlist_paddr = layout::PVH_MODLIST_START;
    }
    for (i, e) in info.e820.iter().enumerate() {
        let ent = hvm_memmap_table_entry {
            addr: e.addr,
            size: e.size,
            type_: e.kind as u32,
            reserved: 0,
        };
        let at =
            layout::PVH_MEMMAP_START + (i * std::mem::size_of::<hvm_memmap_table_entry>()) as u64;
        mem.write_obj(ent, GuestAddress(at))
            .map_err(write_err("PVH memory map"))?;
    }
    mem.write_obj(si, GuestAddress(layout::PVH_INFO_START))
        .map_err(write_err("PVH start info"))
}

/// Writes the zero page.
pub fn write_zero_page(mem: &GuestMemory, info: &BootInfo<'_>) -> Result<(), BootError> {
    let zp = zero_page(info)?;
    mem.write_obj(zp, GuestAddress(layout::ZERO_PAGE_START))
        .map_err(write_err("zero page"))
}

/// GDT selector of the flat 32-bit code segment (PVH entry).
pub const SEL_CODE32: u16 = 0x08;
/// GDT selector of the flat 64-bit code segment (`__BOOT_CS`).
pub const SEL_CODE64: u16 = 0x10;
/// GDT selector of the flat data segment (`__BOOT_DS`).
pub const SEL_DATA: u16 = 0x18;
/// GDT selector of the (dummy) TSS.
pub const SEL_TSS: u16 = 0x20;

/// Packs a segment descriptor from flags (the 12 bits of access byte +
/// flags nibble as in `0xc09b`), base and limit.
pub const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    ((base as u64 & 0xff00_0000) << 32)
        | ((flags as u64 & 0xf0ff) << 40)
        | ((limit as u64 & 0x000f_0000) << 32)
        | ((base as u64 & 0x00ff_ffff) << 16)
        | (limit as u64 & 0xffff)
}

/// The boot GDT: null, code32, code64, data, TSS (16-byte system
/// descriptor in long mode; its upper half is zero).
pub const BOOT_GDT: [u64; layout::BOOT_GDT_MAX] = [
    0,
    gdt_entry(0xc09b, 0, 0xfffff), // 32-bit code: G, D, P, DPL0, exec/read, accessed
    gdt_entry(0xa09b, 0, 0xfffff), // 64-bit code: G, L, P, exec/read, accessed
    gdt_entry(0xc093, 0, 0xfffff), // data: G, B, P, read/write, accessed
    gdt_entry(0x008b, 0, 0x67),    // TSS: P, busy 32/64-bit TSS, 104 bytes
    0,
];

/// Decodes a GDT entry into the `kvm_segment` KVM expects.
pub fn segment_from_gdt(entry: u64, selector: u16) -> kvm_segment {
    let base = ((entry >> 16) & 0xff_ffff) | ((entry >> 32) & 0xff00_0000);
    let raw_limit = ((entry & 0xffff) | ((entry >> 32) & 0xf_0000)) as u32;
    let g = ((entry >> 55) & 1) as u8;
    let limit = if g == 1 {
        (raw_limit << 12) | 0xfff
    } else {
        raw_limit
    };
    kvm_segment {
        base,
        limit,
        selector,
        type_: ((entry >> 40) & 0xf) as u8,
        present: ((entry >> 47) & 1) as u8,
        dpl: ((entry >> 45) & 3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g,
        avl: ((entry >> 52) & 1) as u8,
        unusable: 0,
        padding: 0,
    }
}

/// Writes the GDT, an empty IDT and the identity page tables.
pub fn write_cpu_tables(mem: &GuestMemory) -> Result<(), BootError> {
    let gdt: Vec<u8> = BOOT_GDT.iter().flat_map(|e| e.to_le_bytes()).collect();
    mem.write_slice(&gdt, GuestAddress(layout::BOOT_GDT_START))
        .map_err(write_err("GDT"))?;
    mem.write_obj(0u64, GuestAddress(layout::BOOT_IDT_START))
        .map_err(write_err("IDT"))?;
    mem.write_obj(layout::PDPTE_START | 0x3, GuestAddress(layout::PML4_START))
        .map_err(write_err("PML4"))?;
    let pdpt: Vec<u8> = (0..layout::BOOT_IDENTITY_MAP_GIB)
        .flat_map(|i| ((layout::PDE_START + i * 4096) | 0x3).to_le_bytes())
        .collect();
    mem.write_slice(&pdpt, GuestAddress(layout::PDPTE_START))
        .map_err(write_err("PDPT"))?;
    // 2 MiB pages: present | writable | page size.
    let pd: Vec<u8> = (0..layout::BOOT_IDENTITY_MAP_GIB * 512)
        .flat_map(|i| ((i << 21) | 0x83).to_le_bytes())
        .collect();
    mem.write_slice(&pd, GuestAddress(layout::PDE_START))
        .map_err(write_err("page directories"))
}

/// CR0 bits.
const CR0_PE: u64 = 1;
const CR0_MP: u64 = 1 << 1;
const CR0_ET: u64 = 1 << 4;
const CR0_NE: u64 = 1 << 5;
const CR0_PG: u64 = 1 << 31;
/// CR4.PAE.
const CR4_PAE: u64 = 1 << 5;
/// EFER.LME / EFER.LMA.
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;

/// Segment and control registers for the boot vCPU.
pub fn boot_sregs(mut s: kvm_sregs, kind: EntryKind) -> kvm_sregs {
    let code = match kind {
        EntryKind::Linux64 => segment_from_gdt(BOOT_GDT[2], SEL_CODE64),
        EntryKind::Pvh => segment_from_gdt(BOOT_GDT[1], SEL_CODE32),
    };
    let data = segment_from_gdt(BOOT_GDT[3], SEL_DATA);
    s.gdt.base = layout::BOOT_GDT_START;
    s.gdt.limit = (layout::BOOT_GDT_MAX * 8 - 1) as u16;
    s.idt.base = layout::BOOT_IDT_START;
    s.idt.limit = 0;
    s.cs = code;
    s.ds = data;
    s.es = data;
    s.fs = data;
    s.gs = data;
    s.ss = data;
    s.tr = segment_from_gdt(BOOT_GDT[4], SEL_TSS);
    match kind {
        EntryKind::Linux64 => {
            s.cr0 = CR0_PE | CR0_MP | CR0_ET | CR0_NE | CR0_PG;
            s.cr3 = layout::PML4_START;
            s.cr4 = CR4_PAE;
            s.efer = EFER_LME | EFER_LMA;
        }
        EntryKind::Pvh => {
            s.cr0 = CR0_PE | CR0_ET;
            s.cr3 = 0;
            s.cr4 = 0;
            s.efer = 0;
        }
    }
    s
}

/// General registers for the boot vCPU.
pub fn boot_regs(kind: EntryKind, entry: u64) -> kvm_regs {
    let mut r = kvm_regs {
        rflags: 0x2, // bit 1 is reserved-set; IF clear
        rip: entry,
        rsp: layout::BOOT_STACK_POINTER,
        rbp: layout::BOOT_STACK_POINTER,
        ..Default::default()
    };
    match kind {
        EntryKind::Linux64 => r.rsi = layout::ZERO_PAGE_START,
        EntryKind::Pvh => r.rbx = layout::PVH_INFO_START,
    }
    r
}

/// Initial FPU state: x87 control word and MXCSR at their reset values.
pub fn boot_fpu() -> kvm_fpu {
    kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    }
}

/// One boot MSR: index, value, name.
pub type BootMsr = (u32, u64, &'static str);

/// MSRs every vCPU starts with (SDM vol. 4 names). The syscall MSRs are
/// cleared so no stale host-ish values leak; fast strings on; MTRRs enabled
/// with write-back default so the guest does not run uncached.
pub const BOOT_MSRS: &[BootMsr] = &[
    (0x174, 0, "IA32_SYSENTER_CS"),
    (0x175, 0, "IA32_SYSENTER_ESP"),
    (0x176, 0, "IA32_SYSENTER_EIP"),
    (0xc000_0081, 0, "IA32_STAR"),
    (0xc000_0082, 0, "IA32_LSTAR"),
    (0xc000_0083, 0, "IA32_CSTAR"),
    (0xc000_0084, 0, "IA32_FMASK"),
    (0xc000_0102, 0, "IA32_KERNEL_GS_BASE"),
    (0x1a0, 1, "IA32_MISC_ENABLE (fast-string enable)"),
    (
        0x2ff,
        (1 << 11) | 6,
        "IA32_MTRR_DEF_TYPE (MTRRs enabled, default WB)",
    ),
];

/// Applies [`BOOT_MSRS`].
pub fn set_boot_msrs(vcpu: &VcpuFd) -> Result<(), BootError> {
    let entries: Vec<kvm_msr_entry> = BOOT_MSRS
        .iter()
        .map(|(index, data, _)| kvm_msr_entry {
            index: *index,
            data: *data,
            ..Default::default()
        })
        .collect();
    let msrs = Msrs::from_entries(&entries).map_err(|_| BootError::Msr {
        index: 0,
        name: "(table too large)",
        set: 0,
        total: entries.len(),
    })?;
    let set = vcpu.set_msrs(&msrs).map_err(|source| BootError::Vcpu {
        what: "KVM_SET_MSRS",
        source,
    })?;
    if set != entries.len() {
        let (index, _, name) = BOOT_MSRS[set.min(BOOT_MSRS.len() - 1)];
        return Err(BootError::Msr {
            index,
            name,
            set,
            total: entries.len(),
        });
    }
    Ok(())
}

/// LAPIC register offset of LVT LINT0.
const APIC_LVT0: usize = 0x350;
/// LAPIC register offset of LVT LINT1.
const APIC_LVT1: usize = 0x360;
/// Delivery mode ExtINT.
const APIC_MODE_EXTINT: u32 = 0x7;
/// Delivery mode NMI.
const APIC_MODE_NMI: u32 = 0x4;

fn lapic_reg(regs: &[std::os::raw::c_char; 1024], off: usize) -> u32 {
    let b: [u8; 4] = std::array::from_fn(|i| regs[off + i] as u8);
    u32::from_le_bytes(b)
}

fn set_lapic_reg(regs: &mut [std::os::raw::c_char; 1024], off: usize, v: u32) {
    for (i, b) in v.to_le_bytes().iter().enumerate() {
        regs[off + i] = *b as std::os::raw::c_char;
    }
}

/// LINT0 = ExtINT (the 8259 path), LINT1 = NMI, as on a PC.
pub fn set_lint(vcpu: &VcpuFd) -> Result<(), BootError> {
    let mut l = vcpu.get_lapic().map_err(|source| BootError::Vcpu {
        what: "KVM_GET_LAPIC",
        source,
    })?;
    let v0 = lapic_reg(&l.regs, APIC_LVT0);
    set_lapic_reg(
        &mut l.regs,
        APIC_LVT0,
        (v0 & !0x700) | (APIC_MODE_EXTINT << 8),
    );
    let v1 = lapic_reg(&l.regs, APIC_LVT1);
    set_lapic_reg(&mut l.regs, APIC_LVT1, (v1 & !0x700) | (APIC_MODE_NMI << 8));
    vcpu.set_lapic(&l).map_err(|source| BootError::Vcpu {
        what: "KVM_SET_LAPIC",
        source,
    })
}

/// Configures the boot vCPU's registers for `kernel`.
pub fn setup_boot_vcpu(vcpu: &VcpuFd, kernel: &LoadedKernel) -> Result<(), BootError> {
    let sregs = vcpu.get_sregs().map_err(|source| BootError::Vcpu {
        what: "KVM_GET_SREGS",
        source,
    })?;
    vcpu.set_sregs(&boot_sregs(sregs, kernel.kind))
        .map_err(|source| BootError::Vcpu {
            what: "KVM_SET_SREGS",
            source,
        })?;
    vcpu.set_regs(&boot_regs(kernel.kind, kernel.entry))
        .map_err(|source| BootError::Vcpu {
            what: "KVM_SET_REGS",
            source,
        })
}

/// Common per-vCPU setup: FPU, MSRs, LINT pins.
pub fn setup_any_vcpu(vcpu: &VcpuFd) -> Result<(), BootError> {
    vcpu.set_fpu(&boot_fpu())
        .map_err(|source| BootError::Vcpu {
            what: "KVM_SET_FPU",
            source,
        })?;
    set_boot_msrs(vcpu)?;
    set_lint(vcpu)
}

/// Guest memory end of the RAM range starting at 0 (where the initrd goes).
pub fn low_ram_end(mem: &GuestMemory) -> u64 {
    mem.find_region(GuestAddress(0))
        .map(|r| {
            use vm_memory::GuestMemoryRegion;
            r.start_addr().raw_value() + r.len()
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{self, Backing};

    #[test]
    fn gdt_entries_decode() {
        let c64 = segment_from_gdt(BOOT_GDT[2], SEL_CODE64);
        assert_eq!(
            (
                c64.base,
                c64.limit,
                c64.l,
                c64.db,
                c64.g,
                c64.type_,
                c64.present,
                c64.s
            ),
            (0, 0xffff_ffff, 1, 0, 1, 0xb, 1, 1)
        );
        let c32 = segment_from_gdt(BOOT_GDT[1], SEL_CODE32);
        assert_eq!((c32.l, c32.db, c32.limit), (0, 1, 0xffff_ffff));
        let d = segment_from_gdt(BOOT_GDT[3], SEL_DATA);
        assert_eq!((d.type_, d.db, d.s), (3, 1, 1));
        let t = segment_from_gdt(BOOT_GDT[4], SEL_TSS);
        assert_eq!((t.type_, t.s, t.limit, t.present), (0xb, 0, 0x67, 1));
        assert_eq!(BOOT_GDT[2], 0x00af_9b00_0000_ffff);
        assert_eq!(BOOT_GDT[3], 0x00cf_9300_0000_ffff);
    }

    #[test]
    fn initrd_placement() {
        let p = place_initrd(0x1234, 64 << 20, 0x200_0000, u64::MAX).unwrap();
        assert_eq!(p.addr, (64 << 20) - 0x2000);
        assert_eq!(p.addr % 4096, 0);
        // Capped by initrd_addr_max.
        let p = place_initrd(0x1000, 2 << 30, 0x100_0000, 0x37ff_ffff).unwrap();
        assert_eq!(p.addr, 0x3800_0000 - 0x1000);
        // Does not fit above the kernel, or larger than memory.
        assert!(place_initrd(60 << 20, 64 << 20, 0x100_0000, u64::MAX).is_err());
        assert!(place_initrd(u64::MAX, 64 << 20, 0, u64::MAX).is_err());
    }

    #[test]
    fn zero_page_fields() {
        let e820 = layout::e820_map(256 << 20);
        let k = LoadedKernel {
            kind: EntryKind::Linux64,
            entry: 0x100_0000,
            kernel_end: 0x180_0000,
            setup_header: None,
        };
        let info = BootInfo {
            kernel: &k,
            cmdline_len: 11,
            initrd: Some(InitrdPlacement {
                addr: 0xf00_0000,
                size: 0x1234,
            }),
            e820: &e820,
            rsdp: layout::ACPI_START,
        };
        let zp = zero_page(&info).unwrap();
        let hdr = zp.hdr;
        assert_eq!({ hdr.boot_flag }, 0xaa55);
        assert_eq!({ hdr.header }, 0x5372_6448);
        assert_eq!({ hdr.type_of_loader }, 0xff);
        assert_eq!({ hdr.cmd_line_ptr }, 0x20000);
        assert_eq!({ hdr.cmdline_size }, 11);
        assert_eq!({ hdr.ramdisk_image }, 0xf00_0000);
        assert_eq!({ hdr.ramdisk_size }, 0x1234);
        assert_eq!({ hdr.kernel_alignment }, 0x100_0000);
        assert_eq!({ zp.acpi_rsdp_addr }, 0xe0000);
        assert_eq!(zp.e820_entries as usize, e820.len());
        for (i, e) in e820.iter().enumerate() {
            let t = zp.e820_table[i];
            assert_eq!(
                ({ t.addr }, { t.size }, { t.type_ }),
                (e.addr, e.size, e.kind as u32)
            );
        }

        // Layout of the struct as the kernel sees it (offsets from
        // Documentation/arch/x86/zero-page.rst).
        let ram = memory::create(16, Backing::Anonymous).unwrap();
        write_zero_page(&ram.mem, &info).unwrap();
        let rd = |off: u64| {
            ram.mem
                .read_obj::<u32>(GuestAddress(layout::ZERO_PAGE_START + off))
                .unwrap()
        };
        assert_eq!(rd(0x228), 0x20000, "cmd_line_ptr");
        assert_eq!(rd(0x218), 0xf00_0000, "ramdisk_image");
        assert_eq!(rd(0x070), 0xe0000, "acpi_rsdp_addr");
        assert_eq!(rd(0x1e8) & 0xff, e820.len() as u32, "e820_entries");
        assert_eq!(rd(0x2d0 + 20 * 3 + 16), 1, "4th e820 entry type");

        // Too many e820 entries is an error, not a panic.
        let many = vec![e820[0]; 200];
        let bad = BootInfo {
            e820: &many,
            ..info.clone()
        };
        assert!(zero_page(&bad).is_err());
        assert!(write_pvh(&ram.mem, &bad).is_err());
    }

    #[test]
    fn pvh_start_info_layout() {
        let ram = memory::create(16, Backing::Anonymous).unwrap();
        let e820 = layout::e820_map(16 << 20);
        let k = LoadedKernel {
            kind: EntryKind::Pvh,
            entry: 0x100_0000,
            kernel_end: 0x110_0000,
            setup_header: None,
        };
        let info = BootInfo {
            kernel: &k,
            cmdline_len: 0,
            initrd: Some(InitrdPlacement {
                addr: 0x80_0000,
                size: 77,
            }),
            e820: &e820,
            rsdp: 0xe0000,
        };
        write_pvh(&ram.mem, &info).unwrap();
        let r32 = |a: u64| ram.mem.read_obj::<u32>(GuestAddress(a)).unwrap();
        let r64 = |a: u64| ram.mem.read_obj::<u64>(GuestAddress(a)).unwrap();
        let b = layout::PVH_INFO_START;
        assert_eq!(r32(b), 0x336e_c578);
        assert_eq!(r32(b + 4), 1);
        assert_eq!(r32(b + 12), 1, "nr_modules");
        assert_eq!(r64(b + 16), layout::PVH_MODLIST_START);
        assert_eq!(r64(b + 24), layout::CMDLINE_START);
        assert_eq!(r64(b + 32), 0xe0000);
        assert_eq!(r64(b + 40), layout::PVH_MEMMAP_START);
        assert_eq!(r32(b + 48) as usize, e820.len());
        assert_eq!(r64(layout::PVH_MODLIST_START), 0x80_0000);
        assert_eq!(r64(layout::PVH_MODLIST_START + 8), 77);
        let last = layout::PVH_MEMMAP_START + 24 * (e820.len() as u64 - 1);
        assert_eq!(
            (r64(last), r64(last + 8), r32(last + 16)),
            (0x10_0000, 15 << 20, 1)
        );
    }

    #[test]
    fn page_tables_identity_map_4g() {
        let ram = memory::create(16, Backing::Anonymous).unwrap();
        write_cpu_tables(&ram.mem).unwrap();
        let r64 = |a: u64| ram.mem.read_obj::<u64>(GuestAddress(a)).unwrap();
        // Walk a few addresses: LAPIC, 16 MiB, the last 2 MiB page.
        for va in [0xfee0_0000u64, 0x100_0000, 0xffe0_0000] {
            let pml4e = r64(layout::PML4_START + ((va >> 39) & 0x1ff) * 8);
            let pdpte = r64((pml4e & !0xfff) + ((va >> 30) & 0x1ff) * 8);
            let pde = r64((pdpte & !0xfff) + ((va >> 21) & 0x1ff) * 8);
            assert_eq!(pde & 0x83, 0x83);
            assert_eq!(pde & !0xfff & !0x80, va & !0x1f_ffff);
        }
        let s = boot_sregs(kvm_sregs::default(), EntryKind::Linux64);
        assert_eq!(
            (s.cr3, s.efer, s.cs.selector, s.ds.selector),
            (layout::PML4_START, 0x500, 0x10, 0x18)
        );
        assert_ne!(s.cr0 & CR0_PG, 0);
        let s = boot_sregs(kvm_sregs::default(), EntryKind::Pvh);
        assert_eq!(
            (s.cr0 & CR0_PG, s.efer, s.cs.selector, s.cs.db),
            (0, 0, 0x08, 1)
        );
        let r = boot_regs(EntryKind::Pvh, 0x1234);
        assert_eq!(
            (r.rip, r.rbx, r.rflags),
            (0x1234, layout::PVH_INFO_START, 2)
        );
        let r = boot_regs(EntryKind::Linux64, 0x1234);
        assert_eq!(r.rsi, layout::ZERO_PAGE_START);
    }
}
