//! The KVM half of a snapshot: each vCPU's architectural state and the
//! VM's in-kernel devices (PIT, clock, the two PICs and the IOAPIC),
//! saved and restored in the order KVM needs (Firecracker's, with the
//! fixes its history records).
//!
//! vCPU save order ([`save_vcpu`]): `KVM_GET_MP_STATE` first (it runs the
//! LAPIC's pending INIT/SIPI processing, which can change the LAPIC), then
//! REGS, SREGS, XSAVE (`KVM_GET_XSAVE2` sized by `KVM_CAP_XSAVE2` where
//! the kernel has it, so AMX state fits; else the 4 KiB `KVM_GET_XSAVE`),
//! XCRS, DEBUGREGS, LAPIC, the TSC frequency, CPUID, the MSRs, and
//! `KVM_GET_VCPU_EVENTS` last (pending exceptions and interrupts, read
//! when nothing can change them any more). Every vCPU must be out of
//! `KVM_RUN`.
//!
//! MSRs: `KVM_GET_MSR_INDEX_LIST` filtered through [`SAVED_MSR_RANGES`]
//! (the architectural MSRs a guest kernel programs, the MTRRs and PAT, the
//! machine-check banks, `IA32_TSC_DEADLINE`, and the whole KVM
//! paravirtual range `0x4b564d00..=0x4b564dff`: kvmclock, async page
//! faults including `ASYNC_PF_INT`/`ACK`, steal time, PV EOI, poll
//! control; Firecracker lost guests for each of these it missed). An MSR
//! this KVM lists but refuses to read is left out. A `TSC_DEADLINE` of 0
//! is saved as the TSC's value instead: an armed-at-zero deadline left
//! restored vCPUs without timer interrupts (Firecracker #4618); a deadline
//! in the past fires once at once, which a guest handles.
//!
//! vCPU restore order ([`restore_vcpu`]): `KVM_SET_CPUID2`, MP_STATE,
//! REGS (it clears pending exceptions, so before VCPU_EVENTS), SREGS (it
//! sets the APIC base, so before LAPIC), XSAVE, XCRS, DEBUGREGS, LAPIC
//! (before the MSRs: the TSC-deadline MSR needs a configured LAPIC), the
//! MSRs with `TSC_DEADLINE` in a final chunk after `IA32_TSC` (the
//! other way round gives wrong or lost timer interrupts, Firecracker
//! #4666), VCPU_EVENTS, and `KVM_KVMCLOCK_CTRL` (tells the guest it was
//! stopped, so its soft-lockup watchdog does not fire; `EINVAL` when the
//! guest has no kvmclock, ignored). Under QEMU TCG (the nested harness)
//! TR goes back with the available-TSS type (see `tr_type_for_this_host`).
//!
//! VM state ([`save_vm`], [`restore_vm`]): PIT2, CLOCK, then the three
//! IRQCHIPs. The clock is restored with no flags: passing back
//! `KVM_CLOCK_REALTIME` (set by `KVM_GET_CLOCK` on hosts since 5.16)
//! would make KVM advance kvmclock by the wall time elapsed since the
//! snapshot and the guest's monotonic clock would jump (Firecracker
//! #5809); the guest's wall clock is set by its agent after a restore.
//!
//! The TSC frequency is set on the new vCPUs ([`match_tsc_khz`]) only when
//! it differs from this host's by more than [`TSC_KHZ_TOLERANCE_PPM`]
//! (QEMU's tolerance), before any vCPU state is restored.
//!
//! Every structure is kept as the raw bytes of its KVM C struct; reading
//! one back checks its length exactly ([`KvmStateError::Size`]), counts
//! are bounded, and a value KVM refuses is an error, never a half-set
//! vCPU that runs.
//!
//! Limits: x86_64 only; no nested-virtualisation state (`KVM_GET_NESTED_STATE`:
//! our guests do not run VMs), no SMM, no PMU state (the PMU is hidden
//! from the guest). A snapshot restores on the host (CPU model, kernel)
//! it was taken on; the key the caller gives must say so.

use std::mem::size_of;

use kvm_bindings::{
    kvm_clock_data, kvm_cpuid_entry2, kvm_debugregs, kvm_irqchip, kvm_lapic_state, kvm_mp_state,
    kvm_msr_entry, kvm_pit_state2, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave,
    kvm_xsave2, CpuId, Msrs, Xsave, KVM_MAX_CPUID_ENTRIES, KVM_MAX_MSR_ENTRIES,
};
use kvm_ioctls::{Cap, Kvm, VcpuFd, VmFd};
use serde::{Deserialize, Serialize};
use vmm_sys_util::fam::FamStruct;
use zerocopy::{FromBytes, Immutable, IntoBytes};

/// MSR ranges (inclusive) a snapshot saves when this KVM lists them, with
/// what they hold.
pub const SAVED_MSR_RANGES: &[(u32, u32, &str)] = &[
    (0x10, 0x10, "IA32_TSC"),
    (
        0x11,
        0x12,
        "KVM's legacy wall clock and system time (kvmclock v1)",
    ),
    (0x1b, 0x1b, "IA32_APIC_BASE"),
    (0x3a, 0x3b, "IA32_FEATURE_CONTROL, IA32_TSC_ADJUST"),
    (0x48, 0x48, "IA32_SPEC_CTRL"),
    (0x174, 0x176, "IA32_SYSENTER_CS/ESP/EIP"),
    (0x179, 0x17a, "IA32_MCG_CAP, IA32_MCG_STATUS (not MCG_CTL)"),
    (0x1a0, 0x1a0, "IA32_MISC_ENABLE"),
    (0x200, 0x2ff, "the MTRRs, IA32_PAT and MTRR_DEF_TYPE"),
    (0x400, 0x47f, "the machine-check banks"),
    (
        MSR_IA32_TSC_DEADLINE,
        MSR_IA32_TSC_DEADLINE,
        "IA32_TSC_DEADLINE",
    ),
    (0x800, 0x8ff, "the x2APIC registers"),
    (0xda0, 0xda0, "IA32_XSS"),
    (0xc000_0080, 0xc000_0084, "EFER, STAR, LSTAR, CSTAR, SFMASK"),
    (
        0xc000_0100,
        0xc000_0103,
        "FS_BASE, GS_BASE, KERNEL_GS_BASE, TSC_AUX",
    ),
    (
        0x4b56_4d00,
        0x4b56_4dff,
        "the KVM paravirtual range (kvmclock, async page faults, steal time, PV EOI, poll control)",
    ),
];

/// `IA32_TSC`: the time-stamp counter.
pub const MSR_IA32_TSC: u32 = 0x10;
/// `IA32_TSC_DEADLINE`: the LAPIC timer's deadline in TSC-deadline mode.
pub const MSR_IA32_TSC_DEADLINE: u32 = 0x6e0;
/// How far (parts per million) the host's TSC frequency may differ from
/// the snapshot's before the vCPUs get the snapshot's (QEMU's tolerance).
pub const TSC_KHZ_TOLERANCE_PPM: u64 = 250;
/// Most MSRs a vCPU state may carry.
pub const MAX_MSRS: usize = 1024;
/// Largest XSAVE area accepted, in bytes (AMX needs about 11 KiB).
pub const MAX_XSAVE_BYTES: usize = 1 << 20;
/// `KVM_VCPUEVENT_VALID_NMI_PENDING`: restore the pending-NMI flag.
const VCPUEVENT_VALID_NMI_PENDING: u32 = 0x1;
/// `KVM_VCPUEVENT_VALID_SIPI_VECTOR`: restore the SIPI vector.
const VCPUEVENT_VALID_SIPI_VECTOR: u32 = 0x2;
/// `KVM_IRQCHIP_PIC_MASTER`, `KVM_IRQCHIP_PIC_SLAVE`, `KVM_IRQCHIP_IOAPIC`.
const IRQCHIP_IDS: [u32; 3] = [0, 1, 2];

/// Errors of saving or restoring KVM state.
#[derive(Debug, thiserror::Error)]
pub enum KvmStateError {
    /// An ioctl failed.
    #[error("{what}{} failed: {source}", vcpu.map(|v| format!(" on vCPU {v}")).unwrap_or_default())]
    Ioctl {
        /// Which call.
        what: &'static str,
        /// On which vCPU, if any.
        vcpu: Option<u8>,
        /// Cause.
        source: kvm_ioctls::Error,
    },
    /// A saved structure has the wrong size for this build's KVM headers.
    #[error("saved {what} is {got} bytes, {want} expected")]
    Size {
        /// Which structure.
        what: &'static str,
        /// Its size in the snapshot.
        got: usize,
        /// The struct's size.
        want: usize,
    },
    /// A count is out of its bounds.
    #[error("saved {what}: {got} entries, at most {max} allowed")]
    Count {
        /// What was counted.
        what: &'static str,
        /// The count.
        got: usize,
        /// The bound.
        max: usize,
    },
    /// KVM refused part of the MSRs.
    #[error("vCPU {vcpu}: KVM_SET_MSRS took {set} of {of} MSRs; MSR {index:#x} was refused")]
    Msr {
        /// The vCPU.
        vcpu: u8,
        /// How many it took.
        set: usize,
        /// How many were given.
        of: usize,
        /// The first refused one.
        index: u32,
    },
    /// The saved XSAVE area does not fit this host's.
    #[error("the saved XSAVE area is {saved} bytes, this host's KVM takes {host}")]
    Xsave {
        /// Saved size.
        saved: usize,
        /// This host's size.
        host: usize,
    },
    /// The TSC frequency differs and KVM cannot scale it.
    #[error("the snapshot's TSC runs at {saved} kHz, this host's at {host} kHz, and KVM cannot set it ({source}); take a new snapshot on this host")]
    TscScaling {
        /// Saved frequency.
        saved: u32,
        /// Host frequency.
        host: u32,
        /// Cause.
        source: kvm_ioctls::Error,
    },
    /// A saved IRQCHIP is not the chip its position says.
    #[error("saved irqchip {position} has id {id}")]
    IrqchipId {
        /// Position in the state.
        position: usize,
        /// Its chip id.
        id: u32,
    },
}

fn ioctl(what: &'static str, vcpu: Option<u8>) -> impl FnOnce(kvm_ioctls::Error) -> KvmStateError {
    move |source| KvmStateError::Ioctl { what, vcpu, source }
}

/// The raw bytes of a KVM struct.
fn raw<T: IntoBytes + Immutable>(v: &T) -> Vec<u8> {
    v.as_bytes().to_vec()
}

/// A KVM struct from its raw bytes, which must be exactly its size.
fn from_raw<T: FromBytes>(what: &'static str, bytes: &[u8]) -> Result<T, KvmStateError> {
    T::read_from_bytes(bytes).map_err(|_| KvmStateError::Size {
        what,
        got: bytes.len(),
        want: size_of::<T>(),
    })
}

/// One vCPU's state, each KVM struct as its raw bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VcpuState {
    /// `kvm_mp_state`.
    pub mp_state: Vec<u8>,
    /// `kvm_regs`.
    pub regs: Vec<u8>,
    /// `kvm_sregs`.
    pub sregs: Vec<u8>,
    /// The XSAVE area: `kvm_xsave`'s 4 KiB, plus what `KVM_GET_XSAVE2`
    /// returned beyond it.
    pub xsave: Vec<u8>,
    /// `kvm_xcrs`.
    pub xcrs: Vec<u8>,
    /// `kvm_debugregs`.
    pub debugregs: Vec<u8>,
    /// `kvm_lapic_state`.
    pub lapic: Vec<u8>,
    /// TSC frequency in kHz, when KVM reports it.
    pub tsc_khz: Option<u32>,
    /// CPUID entries (`kvm_cpuid_entry2` each).
    pub cpuid: Vec<Vec<u8>>,
    /// MSRs as (index, value).
    pub msrs: Vec<(u32, u64)>,
    /// `kvm_vcpu_events`.
    pub events: Vec<u8>,
}

/// The VM's in-kernel devices.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmKvmState {
    /// `kvm_pit_state2`.
    pub pit: Vec<u8>,
    /// `kvm_clock_data`.
    pub clock: Vec<u8>,
    /// `kvm_irqchip` of the master PIC, the slave PIC and the IOAPIC.
    pub irqchips: Vec<Vec<u8>>,
}

/// Whether MSR `index` is one a snapshot saves.
pub fn msr_saved(index: u32) -> bool {
    SAVED_MSR_RANGES
        .iter()
        .any(|&(first, last, _)| (first..=last).contains(&index))
}

/// The MSRs to save on this KVM: its index list through
/// [`SAVED_MSR_RANGES`].
pub fn msr_list(kvm: &Kvm) -> Result<Vec<u32>, KvmStateError> {
    let list = kvm
        .get_msr_index_list()
        .map_err(ioctl("KVM_GET_MSR_INDEX_LIST", None))?;
    let mut out: Vec<u32> = list
        .as_slice()
        .iter()
        .copied()
        .filter(|&i| msr_saved(i))
        .collect();
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// The XSAVE area size this VM's vCPUs use: `KVM_CAP_XSAVE2`'s answer, or
/// 0 when the kernel has only `KVM_GET_XSAVE`.
pub fn xsave_size(vm: &VmFd) -> usize {
    usize::try_from(vm.check_extension_int(Cap::Xsave2)).unwrap_or(0)
}

/// An [`Xsave`] buffer of at least `bytes` bytes (the 4 KiB `kvm_xsave`
/// plus enough flexible-array entries).
fn xsave_buffer(bytes: usize) -> Result<Xsave, KvmStateError> {
    let entry = size_of::<<kvm_xsave2 as FamStruct>::Entry>();
    let extra = bytes.saturating_sub(size_of::<kvm_xsave>()).div_ceil(entry);
    Xsave::new(extra).map_err(|_| KvmStateError::Xsave {
        saved: bytes,
        host: bytes,
    })
}

/// The bytes of an [`Xsave`] buffer's area, `len` of them.
fn xsave_bytes(x: &Xsave, len: usize) -> Vec<u8> {
    let mut out = raw(&x.as_fam_struct_ref().xsave);
    for e in x.as_slice() {
        out.extend_from_slice(&e.to_ne_bytes());
    }
    out.truncate(len.max(size_of::<kvm_xsave>()));
    out
}

/// Saves vCPU `index`, whose fd is `fd`, in the order of the module docs.
/// `msrs` comes from [`msr_list`], `xsave` from [`xsave_size`].
pub fn save_vcpu(
    index: u8,
    fd: &VcpuFd,
    msrs: &[u32],
    xsave: usize,
) -> Result<VcpuState, KvmStateError> {
    let v = Some(index);
    let mp_state = fd.get_mp_state().map_err(ioctl("KVM_GET_MP_STATE", v))?;
    let regs = fd.get_regs().map_err(ioctl("KVM_GET_REGS", v))?;
    let sregs = fd.get_sregs().map_err(ioctl("KVM_GET_SREGS", v))?;
    let xsave_area = if xsave > 0 {
        let mut buf = xsave_buffer(xsave)?;
        // SAFETY: `buf` holds at least the KVM_CAP_XSAVE2 size this VM
        // reported, and no XSTATE feature is enabled after that check.
        unsafe { fd.get_xsave2(&mut buf) }.map_err(ioctl("KVM_GET_XSAVE2", v))?;
        xsave_bytes(&buf, xsave)
    } else {
        raw(&fd.get_xsave().map_err(ioctl("KVM_GET_XSAVE", v))?)
    };
    let xcrs = fd.get_xcrs().map_err(ioctl("KVM_GET_XCRS", v))?;
    let debugregs = fd.get_debug_regs().map_err(ioctl("KVM_GET_DEBUGREGS", v))?;
    let lapic = fd.get_lapic().map_err(ioctl("KVM_GET_LAPIC", v))?;
    let tsc_khz = fd.get_tsc_khz().ok();
    let cpuid = fd
        .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
        .map_err(ioctl("KVM_GET_CPUID2", v))?;
    let saved_msrs = read_msrs(index, fd, msrs)?;
    let events = fd
        .get_vcpu_events()
        .map_err(ioctl("KVM_GET_VCPU_EVENTS", v))?;
    Ok(VcpuState {
        mp_state: raw(&mp_state),
        regs: raw(&regs),
        sregs: raw(&sregs),
        xsave: xsave_area,
        xcrs: raw(&xcrs),
        debugregs: raw(&debugregs),
        lapic: raw(&lapic),
        tsc_khz,
        cpuid: cpuid.as_slice().iter().map(raw).collect(),
        msrs: saved_msrs,
        events: raw(&events),
    })
}

/// Reads `indices` from vCPU `index`, leaving out any this KVM refuses,
/// with a zero `TSC_DEADLINE` replaced by the TSC (module docs).
fn read_msrs(index: u8, fd: &VcpuFd, indices: &[u32]) -> Result<Vec<(u32, u64)>, KvmStateError> {
    let mut out = Vec::with_capacity(indices.len());
    let mut rest = indices;
    while !rest.is_empty() {
        let chunk = &rest[..rest.len().min(KVM_MAX_MSR_ENTRIES)];
        let entries: Vec<kvm_msr_entry> = chunk
            .iter()
            .map(|&i| kvm_msr_entry {
                index: i,
                ..Default::default()
            })
            .collect();
        let mut msrs = Msrs::from_entries(&entries).map_err(|_| KvmStateError::Count {
            what: "MSRs in one KVM_GET_MSRS",
            got: entries.len(),
            max: KVM_MAX_MSR_ENTRIES,
        })?;
        let n = fd
            .get_msrs(&mut msrs)
            .map_err(ioctl("KVM_GET_MSRS", Some(index)))?;
        out.extend(msrs.as_slice()[..n].iter().map(|e| (e.index, e.data)));
        if n < chunk.len() {
            // KVM stops at the first MSR it cannot read: leave it out.
            tracing::debug!(
                vcpu = index,
                msr = format_args!("{:#x}", chunk[n]),
                "MSR not readable on this KVM; not saved"
            );
            rest = &rest[n + 1..];
        } else {
            rest = &rest[chunk.len()..];
        }
    }
    let tsc = out.iter().find(|(i, _)| *i == MSR_IA32_TSC).map(|e| e.1);
    if let (Some(tsc), Some(deadline)) = (
        tsc,
        out.iter_mut().find(|(i, _)| *i == MSR_IA32_TSC_DEADLINE),
    ) {
        if deadline.1 == 0 {
            deadline.1 = tsc;
        }
    }
    Ok(out)
}

/// Sets the snapshot's TSC frequency on every vCPU when it differs from
/// this host's by more than [`TSC_KHZ_TOLERANCE_PPM`]. Returns whether it
/// did. Call before [`restore_vcpu`].
pub fn match_tsc_khz(vcpus: &[VcpuFd], saved: Option<u32>) -> Result<bool, KvmStateError> {
    let (Some(saved), Some(first)) = (saved, vcpus.first()) else {
        return Ok(false);
    };
    let Ok(host) = first.get_tsc_khz() else {
        return Ok(false);
    };
    let diff = u64::from(saved.abs_diff(host));
    if diff * 1_000_000 <= TSC_KHZ_TOLERANCE_PPM * u64::from(saved.max(1)) {
        return Ok(false);
    }
    for fd in vcpus {
        fd.set_tsc_khz(saved)
            .map_err(|source| KvmStateError::TscScaling {
                saved,
                host,
                source,
            })?;
    }
    Ok(true)
}

/// A vCPU state decoded and checked, ready for the ioctls.
struct DecodedVcpu {
    cpuid: CpuId,
    mp_state: kvm_mp_state,
    regs: kvm_regs,
    sregs: kvm_sregs,
    xcrs: kvm_xcrs,
    debugregs: kvm_debugregs,
    lapic: kvm_lapic_state,
    events: kvm_vcpu_events,
}

/// Decodes every structure of `s` and checks every count and size (for a
/// VM whose XSAVE area is `xsave` bytes), touching no vCPU.
fn decode_vcpu(s: &VcpuState, xsave: usize) -> Result<DecodedVcpu, KvmStateError> {
    if s.cpuid.len() > KVM_MAX_CPUID_ENTRIES {
        return Err(KvmStateError::Count {
            what: "CPUID entries",
            got: s.cpuid.len(),
            max: KVM_MAX_CPUID_ENTRIES,
        });
    }
    let entries = s
        .cpuid
        .iter()
        .map(|e| from_raw::<kvm_cpuid_entry2>("CPUID entry", e))
        .collect::<Result<Vec<_>, _>>()?;
    let cpuid = CpuId::from_entries(&entries).map_err(|_| KvmStateError::Count {
        what: "CPUID entries",
        got: entries.len(),
        max: KVM_MAX_CPUID_ENTRIES,
    })?;
    let mut events: kvm_vcpu_events = from_raw("vCPU events", &s.events)?;
    events.flags |= VCPUEVENT_VALID_NMI_PENDING | VCPUEVENT_VALID_SIPI_VECTOR;
    if s.msrs.len() > MAX_MSRS {
        return Err(KvmStateError::Count {
            what: "MSRs",
            got: s.msrs.len(),
            max: MAX_MSRS,
        });
    }
    let host_xsave = xsave.max(size_of::<kvm_xsave>());
    if s.xsave.len() < size_of::<kvm_xsave>() || s.xsave.len() > host_xsave.min(MAX_XSAVE_BYTES) {
        return Err(KvmStateError::Xsave {
            saved: s.xsave.len(),
            host: host_xsave,
        });
    }
    Ok(DecodedVcpu {
        cpuid,
        mp_state: from_raw("MP state", &s.mp_state)?,
        regs: from_raw("registers", &s.regs)?,
        sregs: from_raw("special registers", &s.sregs)?,
        xcrs: from_raw("XCRs", &s.xcrs)?,
        debugregs: from_raw("debug registers", &s.debugregs)?,
        lapic: from_raw("LAPIC", &s.lapic)?,
        events,
    })
}

/// Checks what [`restore_vcpu`] checks before its first ioctl.
pub fn check_vcpu(s: &VcpuState, xsave: usize) -> Result<(), KvmStateError> {
    decode_vcpu(s, xsave).map(|_| ())
}

/// Restores vCPU `index` from `s` in the order of the module docs. `xsave`
/// is this VM's [`xsave_size`]. Everything is decoded and checked before
/// the first ioctl: a bad structure leaves the vCPU untouched.
pub fn restore_vcpu(
    index: u8,
    fd: &VcpuFd,
    s: &VcpuState,
    xsave: usize,
) -> Result<(), KvmStateError> {
    let v = Some(index);
    let d = decode_vcpu(s, xsave)?;
    fd.set_cpuid2(&d.cpuid)
        .map_err(ioctl("KVM_SET_CPUID2", v))?;
    fd.set_mp_state(d.mp_state)
        .map_err(ioctl("KVM_SET_MP_STATE", v))?;
    fd.set_regs(&d.regs).map_err(ioctl("KVM_SET_REGS", v))?;
    let mut sregs = d.sregs;
    sregs.tr.type_ = tr_type_for_this_host(sregs.tr.type_, under_qemu_tcg());
    fd.set_sregs(&sregs).map_err(ioctl("KVM_SET_SREGS", v))?;
    set_xsave(index, fd, &s.xsave, xsave)?;
    fd.set_xcrs(&d.xcrs).map_err(ioctl("KVM_SET_XCRS", v))?;
    fd.set_debug_regs(&d.debugregs)
        .map_err(ioctl("KVM_SET_DEBUGREGS", v))?;
    fd.set_lapic(&d.lapic).map_err(ioctl("KVM_SET_LAPIC", v))?;
    write_msrs(index, fd, &s.msrs)?;
    fd.set_vcpu_events(&d.events)
        .map_err(ioctl("KVM_SET_VCPU_EVENTS", v))?;
    match fd.kvmclock_ctrl() {
        Ok(()) => {}
        Err(e) if e.errno() == libc::EINVAL => {}
        Err(e) => return Err(ioctl("KVM_KVMCLOCK_CTRL", v)(e)),
    }
    Ok(())
}

/// Type of a 64-bit TSS that is not busy.
const TSS_AVAILABLE: u8 = 9;
/// Type of a busy 64-bit TSS: what `KVM_GET_SREGS` always reports for TR.
const TSS_BUSY: u8 = 11;
/// CPUID leaf of the hypervisor's vendor signature.
const CPUID_HYPERVISOR_LEAF: u32 = 0x4000_0000;
/// QEMU TCG's hypervisor signature (EBX, ECX, EDX of that leaf).
const TCG_SIGNATURE: &[u8; 12] = b"TCGTCGTCGTCG";

/// Whether this helper runs in a guest of QEMU's TCG emulator (the nested
/// harness: our VMM on the KVM of an L1 whose SVM QEMU emulates).
fn under_qemu_tcg() -> bool {
    let leaf = std::arch::x86_64::__cpuid(CPUID_HYPERVISOR_LEAF);
    let mut sig = [0u8; 12];
    sig[..4].copy_from_slice(&leaf.ebx.to_le_bytes());
    sig[4..8].copy_from_slice(&leaf.ecx.to_le_bytes());
    sig[8..].copy_from_slice(&leaf.edx.to_le_bytes());
    &sig == TCG_SIGNATURE
}

/// The TR type to restore. KVM reports TR busy (it sets the busy bit on
/// the way out), which hardware and KVM take back as they are; QEMU TCG's
/// SVM emulation keeps the *available* type its `LTR` loaded in its
/// segment cache and its I/O-permission check refuses any other, so a
/// restored guest's user-space `out` to a port its `ioperm` allows (the
/// agent's boot marks) faulted with #GP there until TR went back as
/// available. Only under TCG, only a busy TSS.
fn tr_type_for_this_host(saved: u8, under_tcg: bool) -> u8 {
    if under_tcg && saved == TSS_BUSY {
        TSS_AVAILABLE
    } else {
        saved
    }
}

/// `KVM_SET_XSAVE` with a buffer as large as this VM's XSAVE area (KVM
/// reads that many bytes), the saved bytes first and zeroes after.
fn set_xsave(index: u8, fd: &VcpuFd, saved: &[u8], xsave: usize) -> Result<(), KvmStateError> {
    let v = Some(index);
    if xsave == 0 {
        let area: kvm_xsave = from_raw("XSAVE area", saved)?;
        // SAFETY: without KVM_CAP_XSAVE2 the kernel reads exactly the
        // 4 KiB `kvm_xsave` this is.
        return unsafe { fd.set_xsave(&area) }.map_err(ioctl("KVM_SET_XSAVE", v));
    }
    let mut buf = xsave_buffer(xsave)?;
    let (head, tail) = saved.split_at(size_of::<kvm_xsave>());
    let area: kvm_xsave = from_raw("XSAVE area", head)?;
    // SAFETY: only the fixed 4 KiB area is replaced; the entry count the
    // wrapper's invariants rest on is left as `xsave_buffer` set it.
    unsafe { buf.as_mut_fam_struct() }.xsave = area;
    for (entry, bytes) in buf.as_mut_slice().iter_mut().zip(tail.chunks(4)) {
        let mut b = [0u8; 4];
        b[..bytes.len()].copy_from_slice(bytes);
        *entry = u32::from_ne_bytes(b);
    }
    // SAFETY: `buf` holds at least the KVM_CAP_XSAVE2 size this VM
    // reported, and no XSTATE feature is enabled after that check.
    unsafe { fd.set_xsave2(&buf) }.map_err(ioctl("KVM_SET_XSAVE2", v))
}

/// Writes `msrs` to vCPU `index`: all but `TSC_DEADLINE` first, then that
/// one alone, after `IA32_TSC`.
fn write_msrs(index: u8, fd: &VcpuFd, msrs: &[(u32, u64)]) -> Result<(), KvmStateError> {
    let entry = |&&(index, data): &&(u32, u64)| kvm_msr_entry {
        index,
        data,
        ..Default::default()
    };
    let (deferred, first): (Vec<_>, Vec<_>) =
        msrs.iter().partition(|(i, _)| *i == MSR_IA32_TSC_DEADLINE);
    for group in [first, deferred] {
        for chunk in group.chunks(KVM_MAX_MSR_ENTRIES) {
            let entries: Vec<kvm_msr_entry> = chunk.iter().map(entry).collect();
            let m = Msrs::from_entries(&entries).map_err(|_| KvmStateError::Count {
                what: "MSRs in one KVM_SET_MSRS",
                got: entries.len(),
                max: KVM_MAX_MSR_ENTRIES,
            })?;
            let n = fd
                .set_msrs(&m)
                .map_err(ioctl("KVM_SET_MSRS", Some(index)))?;
            if n < entries.len() {
                return Err(KvmStateError::Msr {
                    vcpu: index,
                    set: n,
                    of: entries.len(),
                    index: entries[n].index,
                });
            }
        }
    }
    Ok(())
}

/// Saves the PIT, the clock and the three interrupt controllers.
pub fn save_vm(vm: &VmFd) -> Result<VmKvmState, KvmStateError> {
    let pit = vm.get_pit2().map_err(ioctl("KVM_GET_PIT2", None))?;
    let clock = vm.get_clock().map_err(ioctl("KVM_GET_CLOCK", None))?;
    let mut irqchips = Vec::with_capacity(IRQCHIP_IDS.len());
    for id in IRQCHIP_IDS {
        let mut chip = kvm_irqchip {
            chip_id: id,
            ..Default::default()
        };
        vm.get_irqchip(&mut chip)
            .map_err(ioctl("KVM_GET_IRQCHIP", None))?;
        irqchips.push(raw(&chip));
    }
    Ok(VmKvmState {
        pit: raw(&pit),
        clock: raw(&clock),
        irqchips,
    })
}

/// The VM state decoded and checked.
struct DecodedVm {
    pit: kvm_pit_state2,
    clock: kvm_clock_data,
    chips: Vec<kvm_irqchip>,
}

fn decode_vm(s: &VmKvmState) -> Result<DecodedVm, KvmStateError> {
    let pit: kvm_pit_state2 = from_raw("PIT state", &s.pit)?;
    let mut clock: kvm_clock_data = from_raw("clock", &s.clock)?;
    clock.flags = 0;
    if s.irqchips.len() != IRQCHIP_IDS.len() {
        return Err(KvmStateError::Count {
            what: "interrupt controllers",
            got: s.irqchips.len(),
            max: IRQCHIP_IDS.len(),
        });
    }
    let mut chips = Vec::with_capacity(IRQCHIP_IDS.len());
    for (position, (bytes, id)) in s.irqchips.iter().zip(IRQCHIP_IDS).enumerate() {
        let chip: kvm_irqchip = from_raw("irqchip", bytes)?;
        if chip.chip_id != id {
            return Err(KvmStateError::IrqchipId {
                position,
                id: chip.chip_id,
            });
        }
        chips.push(chip);
    }
    Ok(DecodedVm { pit, clock, chips })
}

/// Checks what [`restore_vm`] checks before its first ioctl.
pub fn check_vm(s: &VmKvmState) -> Result<(), KvmStateError> {
    decode_vm(s).map(|_| ())
}

/// Restores the PIT, the clock (flags cleared, module docs) and the three
/// interrupt controllers, in that order.
pub fn restore_vm(vm: &VmFd, s: &VmKvmState) -> Result<(), KvmStateError> {
    let d = decode_vm(s)?;
    vm.set_pit2(&d.pit).map_err(ioctl("KVM_SET_PIT2", None))?;
    vm.set_clock(&d.clock)
        .map_err(ioctl("KVM_SET_CLOCK", None))?;
    for chip in &d.chips {
        vm.set_irqchip(chip)
            .map_err(ioctl("KVM_SET_IRQCHIP", None))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn tr_goes_back_available_only_under_tcg_and_only_when_busy() {
        use super::{tr_type_for_this_host, TSS_AVAILABLE, TSS_BUSY};
        assert_eq!(tr_type_for_this_host(TSS_BUSY, true), TSS_AVAILABLE);
        assert_eq!(tr_type_for_this_host(TSS_BUSY, false), TSS_BUSY);
        assert_eq!(tr_type_for_this_host(TSS_AVAILABLE, true), TSS_AVAILABLE);
        assert_eq!(tr_type_for_this_host(3, true), 3);
    }
    use super::*;

    #[test]
    fn msr_allowlist_covers_what_guests_need() {
        for i in [
            MSR_IA32_TSC,
            MSR_IA32_TSC_DEADLINE,
            0x1b,
            0xc000_0080,
            0xc000_0102,
            0x277,
            // kvmclock (new), async PF enable, steal time, PV EOI,
            // ASYNC_PF_INT and ACK, poll control.
            0x4b56_4d00,
            0x4b56_4d01,
            0x4b56_4d02,
            0x4b56_4d03,
            0x4b56_4d04,
            0x4b56_4d06,
            0x4b56_4d07,
            0x4b56_4d05,
            0x4b56_4dff,
        ] {
            assert!(msr_saved(i), "{i:#x}");
        }
        // IA32_MCG_CTL is not saved (Firecracker denies it); nor are
        // arbitrary model-specific ones.
        for i in [0x17b, 0x1d9, 0xc001_0015, 0x4b56_4e00] {
            assert!(!msr_saved(i), "{i:#x}");
        }
    }

    #[test]
    fn raw_structs_check_their_size() {
        let regs = kvm_regs {
            rip: 0x1234,
            ..Default::default()
        };
        let bytes = raw(&regs);
        assert_eq!(bytes.len(), size_of::<kvm_regs>());
        let back: kvm_regs = from_raw("registers", &bytes).unwrap();
        assert_eq!(back.rip, 0x1234);
        assert!(matches!(
            from_raw::<kvm_regs>("registers", &bytes[1..]),
            Err(KvmStateError::Size { .. })
        ));
    }

    #[test]
    fn xsave_buffers_round_trip_their_bytes() {
        let size = size_of::<kvm_xsave>() + 100;
        let mut buf = xsave_buffer(size).unwrap();
        // SAFETY: only the fixed area is written, not the entry count.
        unsafe { buf.as_mut_fam_struct() }.xsave.region[3] = 7;
        if let Some(e) = buf.as_mut_slice().get_mut(1) {
            *e = 0xdead_beef;
        }
        let bytes = xsave_bytes(&buf, size);
        assert_eq!(bytes.len(), size);
        assert_eq!(bytes[12], 7);
        assert_eq!(&bytes[4096 + 4..4096 + 8], &0xdead_beefu32.to_ne_bytes());
        assert_eq!(xsave_bytes(&xsave_buffer(0).unwrap(), 0).len(), 4096);
    }
}
