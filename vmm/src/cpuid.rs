//! CPUID normalization: the guest sees the host's features as KVM reports
//! them (`KVM_GET_SUPPORTED_CPUID`, so AVX2/AVX-512/... pass through), with a
//! small, table-driven set of edits for what a VMM must own: APIC IDs and
//! topology per vCPU, the hypervisor bit, TSC-deadline, the PMU leaf, and AMX.
//!
//! Every edit is a row of [`EDITS`]: leaf, subleaf selector, register, bit
//! field, value, condition, and the name of the field in the Intel SDM /
//! AMD APM it sets. [`normalize`] applies the rows to one vCPU's copy of the
//! table; rows whose leaf KVM did not report are skipped (we never invent
//! leaves).
//!
//! AMX: since Linux 5.17, a process must ask for permission to give guests
//! the AMX tile data state (`arch_prctl(ARCH_REQ_XCOMP_GUEST_PERM,
//! XFEATURE_XTILEDATA)`) before KVM reports or accepts it. We ask
//! ([`request_amx_permission`]); if that fails, the AMX rows mask the feature.

use kvm_bindings::kvm_cpuid_entry2;

/// Errors of CPUID setup.
#[derive(Debug, thiserror::Error)]
pub enum CpuidError {
    /// KVM_GET_SUPPORTED_CPUID failed.
    #[error("KVM_GET_SUPPORTED_CPUID failed: {0}")]
    Supported(#[source] kvm_ioctls::Error),
    /// Building the FAM struct failed (too many entries).
    #[error(
        "cannot build the CPUID table for KVM: {0:?} (more than KVM_MAX_CPUID_ENTRIES leaves?)"
    )]
    Fam(vmm_sys_util::fam::Error),
}

/// A CPUID register.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reg {
    /// EAX.
    Eax,
    /// EBX.
    Ebx,
    /// ECX.
    Ecx,
    /// EDX.
    Edx,
}

/// Which subleaves of a leaf a row applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sub {
    /// Every entry of the leaf.
    Any,
    /// Exactly this subleaf (ECX input).
    Eq(u32),
    /// This subleaf and all above it.
    AtLeast(u32),
}

/// The value written into a field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Val {
    /// A constant.
    Const(u32),
    /// This vCPU's APIC ID (= its index).
    ApicId,
    /// Number of vCPUs.
    CpuCount,
    /// Number of vCPUs minus one.
    CpuCountMinus1,
    /// Bits of APIC ID used for the core level: ceil(log2(vCPUs)).
    CoreBits,
    /// 2^CoreBits - 1, capped to the field (leaf 4 "addressable IDs - 1").
    CoreIdsMinus1,
    /// 2^CoreBits capped at 255 (leaf 1 "addressable logical IDs").
    LogicalIds,
    /// Leaf 4: logical processors sharing this cache - 1, from the entry's
    /// own cache level (`EAX[7:5]`): private for L1/L2, package-wide for L3.
    CacheSharingMinus1,
    /// Host capability: 1 if the VMM enables the TSC-deadline timer.
    TscDeadline,
    /// 1 if more than one vCPU.
    MultiCpu,
}

/// When a row applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum When {
    /// Always.
    Always,
    /// Only on Intel hosts (vendor "GenuineIntel").
    Intel,
    /// Only on AMD hosts (vendor "AuthenticAMD" / "HygonGenuine").
    Amd,
    /// Only when the guest may not have AMX.
    NoAmx,
}

/// One normalizer edit.
#[derive(Debug, Clone, Copy)]
pub struct Edit {
    /// CPUID leaf (EAX input).
    pub leaf: u32,
    /// Subleaf selector.
    pub sub: Sub,
    /// Register.
    pub reg: Reg,
    /// Lowest bit of the field.
    pub lo: u32,
    /// Highest bit of the field (inclusive).
    pub hi: u32,
    /// New value (truncated to the field).
    pub val: Val,
    /// Condition.
    pub when: When,
    /// Manual field name this edit sets.
    pub field: &'static str,
}

// A positional row constructor keeps the table one line per edit.
#[allow(clippy::too_many_arguments)]
const fn e(
    leaf: u32,
    sub: Sub,
    reg: Reg,
    lo: u32,
    hi: u32,
    val: Val,
    when: When,
    field: &'static str,
) -> Edit {
    Edit {
        leaf,
        sub,
        reg,
        lo,
        hi,
        val,
        when,
        field,
    }
}

use Reg::*;
use Sub::*;
use Val::*;
use When::*;

/// The normalizer table, applied in order.
pub const EDITS: &[Edit] = &[
    // Leaf 1: version and feature information.
    e(1, Any, Ebx, 24, 31, ApicId, Always, "SDM CPUID.01H:EBX[31:24] Initial APIC ID"),
    e(1, Any, Ebx, 16, 23, LogicalIds, Always, "SDM CPUID.01H:EBX[23:16] Maximum number of addressable IDs for logical processors in this physical package"),
    e(1, Any, Ebx, 8, 15, Const(8), Always, "SDM CPUID.01H:EBX[15:8] CLFLUSH line size (value x 8 = 64 bytes)"),
    e(1, Any, Ecx, 31, 31, Const(1), Always, "CPUID.01H:ECX[31] hypervisor present (reserved for hypervisor use)"),
    e(1, Any, Ecx, 24, 24, TscDeadline, Always, "SDM CPUID.01H:ECX[24] TSC-Deadline"),
    e(1, Any, Edx, 28, 28, MultiCpu, Always, "SDM CPUID.01H:EDX[28] HTT (max addressable IDs field is valid)"),
    // Leaf 4: deterministic cache parameters (Intel).
    e(4, Any, Eax, 26, 31, CoreIdsMinus1, Intel, "SDM CPUID.04H:EAX[31:26] Maximum number of addressable IDs for processor cores in the physical package - 1"),
    e(4, Any, Eax, 14, 25, CacheSharingMinus1, Intel, "SDM CPUID.04H:EAX[25:14] Maximum number of addressable IDs for logical processors sharing this cache - 1"),
    // Leaf 7: structured extended features — AMX only when permitted.
    e(7, Eq(0), Edx, 22, 22, Const(0), NoAmx, "SDM CPUID.(EAX=07H,ECX=0):EDX[22] AMX-BF16"),
    e(7, Eq(0), Edx, 24, 25, Const(0), NoAmx, "SDM CPUID.(EAX=07H,ECX=0):EDX[24] AMX-TILE, EDX[25] AMX-INT8"),
    e(7, Eq(1), Eax, 21, 21, Const(0), NoAmx, "SDM CPUID.(EAX=07H,ECX=1):EAX[21] AMX-FP16"),
    e(7, Eq(1), Edx, 8, 8, Const(0), NoAmx, "SDM CPUID.(EAX=07H,ECX=1):EDX[8] AMX-COMPLEX"),
    // Leaf 0xA: architectural performance monitoring. We give the guest no
    // vPMU (version 0): counters would be costly to context-switch, are
    // unavailable under PVM, and nothing in the guest needs them.
    e(0xa, Any, Eax, 0, 31, Const(0), Always, "SDM CPUID.0AH:EAX[7:0] Version ID of architectural performance monitoring = 0 (and the rest of EAX)"),
    e(0xa, Any, Ebx, 0, 31, Const(0), Always, "SDM CPUID.0AH:EBX architectural event availability"),
    e(0xa, Any, Ecx, 0, 31, Const(0), Always, "SDM CPUID.0AH:ECX supported fixed counters bit mask"),
    e(0xa, Any, Edx, 0, 31, Const(0), Always, "SDM CPUID.0AH:EDX number/width of fixed-function counters"),
    // Leaf 0xB and 0x1F: (V2) extended topology: one thread per core, all
    // vCPUs are cores of one package.
    e(0xb, Eq(0), Eax, 0, 4, Const(0), Always, "SDM CPUID.0BH.0:EAX[4:0] bits to shift x2APIC ID to get next level (SMT: 0, one thread per core)"),
    e(0xb, Eq(0), Ebx, 0, 15, Const(1), Always, "SDM CPUID.0BH.0:EBX[15:0] logical processors at this level (1)"),
    e(0xb, Eq(0), Ecx, 0, 15, Const(0x100), Always, "SDM CPUID.0BH.0:ECX[15:8] level type = 1 (SMT), ECX[7:0] level number = 0"),
    e(0xb, Eq(1), Eax, 0, 4, CoreBits, Always, "SDM CPUID.0BH.1:EAX[4:0] bits to shift x2APIC ID to get the package ID"),
    e(0xb, Eq(1), Ebx, 0, 15, CpuCount, Always, "SDM CPUID.0BH.1:EBX[15:0] logical processors at this level (all vCPUs)"),
    e(0xb, Eq(1), Ecx, 0, 15, Const(0x201), Always, "SDM CPUID.0BH.1:ECX[15:8] level type = 2 (Core), ECX[7:0] level number = 1"),
    e(0xb, AtLeast(2), Eax, 0, 31, Const(0), Always, "SDM CPUID.0BH.n:EAX invalid level"),
    e(0xb, AtLeast(2), Ebx, 0, 31, Const(0), Always, "SDM CPUID.0BH.n:EBX invalid level"),
    e(0xb, AtLeast(2), Ecx, 8, 15, Const(0), Always, "SDM CPUID.0BH.n:ECX[15:8] level type = 0 (invalid)"),
    e(0xb, Any, Edx, 0, 31, ApicId, Always, "SDM CPUID.0BH:EDX x2APIC ID of the current logical processor"),
    e(0x1f, Eq(0), Eax, 0, 4, Const(0), Always, "SDM CPUID.1FH.0:EAX[4:0] bits to shift x2APIC ID to get next level (SMT)"),
    e(0x1f, Eq(0), Ebx, 0, 15, Const(1), Always, "SDM CPUID.1FH.0:EBX[15:0] logical processors at this level"),
    e(0x1f, Eq(0), Ecx, 0, 15, Const(0x100), Always, "SDM CPUID.1FH.0:ECX level type SMT, level 0"),
    e(0x1f, Eq(1), Eax, 0, 4, CoreBits, Always, "SDM CPUID.1FH.1:EAX[4:0] bits to shift x2APIC ID to get the package ID"),
    e(0x1f, Eq(1), Ebx, 0, 15, CpuCount, Always, "SDM CPUID.1FH.1:EBX[15:0] logical processors at this level"),
    e(0x1f, Eq(1), Ecx, 0, 15, Const(0x201), Always, "SDM CPUID.1FH.1:ECX level type Core, level 1"),
    e(0x1f, AtLeast(2), Eax, 0, 31, Const(0), Always, "SDM CPUID.1FH.n:EAX invalid level"),
    e(0x1f, AtLeast(2), Ebx, 0, 31, Const(0), Always, "SDM CPUID.1FH.n:EBX invalid level"),
    e(0x1f, AtLeast(2), Ecx, 8, 15, Const(0), Always, "SDM CPUID.1FH.n:ECX[15:8] level type = 0 (invalid)"),
    e(0x1f, Any, Edx, 0, 31, ApicId, Always, "SDM CPUID.1FH:EDX x2APIC ID of the current logical processor"),
    // Leaf 0xD: XSAVE state components — AMX tile state only when permitted.
    e(0xd, Eq(0), Eax, 17, 18, Const(0), NoAmx, "SDM CPUID.(EAX=0DH,ECX=0):EAX[17] XTILECFG, EAX[18] XTILEDATA supported in XCR0"),
    e(0xd, Eq(17), Eax, 0, 31, Const(0), NoAmx, "SDM CPUID.(EAX=0DH,ECX=17) XTILECFG state size"),
    e(0xd, Eq(17), Ebx, 0, 31, Const(0), NoAmx, "SDM CPUID.(EAX=0DH,ECX=17) XTILECFG state offset"),
    e(0xd, Eq(17), Ecx, 0, 31, Const(0), NoAmx, "SDM CPUID.(EAX=0DH,ECX=17) XTILECFG flags"),
    e(0xd, Eq(18), Eax, 0, 31, Const(0), NoAmx, "SDM CPUID.(EAX=0DH,ECX=18) XTILEDATA state size"),
    e(0xd, Eq(18), Ebx, 0, 31, Const(0), NoAmx, "SDM CPUID.(EAX=0DH,ECX=18) XTILEDATA state offset"),
    e(0xd, Eq(18), Ecx, 0, 31, Const(0), NoAmx, "SDM CPUID.(EAX=0DH,ECX=18) XTILEDATA flags"),
    e(0x1d, Any, Eax, 0, 31, Const(0), NoAmx, "SDM CPUID.1DH:EAX tile information: max palette = 0"),
    e(0x1d, Any, Ebx, 0, 31, Const(0), NoAmx, "SDM CPUID.1DH:EBX tile palette"),
    e(0x1d, Any, Ecx, 0, 31, Const(0), NoAmx, "SDM CPUID.1DH:ECX tile palette"),
    e(0x1e, Any, Ebx, 0, 31, Const(0), NoAmx, "SDM CPUID.1EH:EBX TMUL information"),
    // AMD topology.
    e(0x8000_0001, Any, Ecx, 1, 1, Const(0), Amd, "APM CPUID Fn8000_0001_ECX[1] CmpLegacy = 0 (topology from Fn8000_0008)"),
    e(0x8000_0008, Any, Ecx, 0, 7, CpuCountMinus1, Amd, "APM CPUID Fn8000_0008_ECX[7:0] NC: number of physical threads - 1"),
    e(0x8000_0008, Any, Ecx, 12, 15, CoreBits, Amd, "APM CPUID Fn8000_0008_ECX[15:12] ApicIdSize"),
    e(0x8000_001e, Any, Eax, 0, 31, ApicId, Amd, "APM CPUID Fn8000_001E_EAX ExtendedApicId"),
    e(0x8000_001e, Any, Ebx, 0, 7, ApicId, Amd, "APM CPUID Fn8000_001E_EBX[7:0] ComputeUnitId"),
    e(0x8000_001e, Any, Ebx, 8, 15, Const(0), Amd, "APM CPUID Fn8000_001E_EBX[15:8] ThreadsPerComputeUnit - 1 = 0"),
    e(0x8000_001e, Any, Ecx, 0, 7, Const(0), Amd, "APM CPUID Fn8000_001E_ECX[7:0] NodeId = 0"),
];

/// Host CPU vendor, from leaf 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Vendor {
    /// GenuineIntel.
    Intel,
    /// AuthenticAMD or HygonGenuine.
    Amd,
    /// Anything else.
    Other,
}

/// Determines the vendor from the leaf-0 entry of a table.
pub fn vendor(entries: &[kvm_cpuid_entry2]) -> Vendor {
    let Some(l0) = entries.iter().find(|e| e.function == 0) else {
        return Vendor::Other;
    };
    let mut s = [0u8; 12];
    s[0..4].copy_from_slice(&l0.ebx.to_le_bytes());
    s[4..8].copy_from_slice(&l0.edx.to_le_bytes());
    s[8..12].copy_from_slice(&l0.ecx.to_le_bytes());
    match &s {
        b"GenuineIntel" => Vendor::Intel,
        b"AuthenticAMD" | b"HygonGenuine" => Vendor::Amd,
        _ => Vendor::Other,
    }
}

/// Per-vCPU parameters of the normalizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuParams {
    /// This vCPU's index, used as its APIC ID.
    pub index: u8,
    /// Total vCPUs.
    pub count: u8,
    /// Whether the TSC-deadline timer is advertised (KVM_CAP_TSC_DEADLINE_TIMER).
    pub tsc_deadline: bool,
    /// Whether the guest may use AMX (permission obtained).
    pub amx: bool,
}

fn core_bits(count: u8) -> u32 {
    let n = u32::from(count.max(1));
    32 - (n - 1).leading_zeros()
}

fn value(v: Val, p: &CpuParams, entry: &kvm_cpuid_entry2) -> u32 {
    let bits = core_bits(p.count);
    match v {
        Const(c) => c,
        ApicId => u32::from(p.index),
        CpuCount => u32::from(p.count),
        CpuCountMinus1 => u32::from(p.count.saturating_sub(1)),
        CoreBits => bits,
        CoreIdsMinus1 => (1u32 << bits) - 1,
        LogicalIds => (1u32 << bits).min(255),
        CacheSharingMinus1 => {
            let level = (entry.eax >> 5) & 0x7;
            if level >= 3 {
                (1u32 << bits) - 1
            } else {
                0
            }
        }
        TscDeadline => u32::from(p.tsc_deadline),
        MultiCpu => u32::from(p.count > 1),
    }
}

fn applies(ed: &Edit, entry: &kvm_cpuid_entry2, vendor: Vendor, p: &CpuParams) -> bool {
    if entry.function != ed.leaf {
        return false;
    }
    let sub_ok = match ed.sub {
        Any => true,
        Eq(n) => entry.index == n,
        AtLeast(n) => entry.index >= n,
    };
    let when_ok = match ed.when {
        Always => true,
        Intel => vendor == Vendor::Intel,
        Amd => vendor == Vendor::Amd,
        NoAmx => !p.amx,
    };
    sub_ok && when_ok
}

fn set_field(reg: &mut u32, lo: u32, hi: u32, v: u32) {
    let width = hi - lo + 1;
    let mask = if width >= 32 {
        u32::MAX
    } else {
        ((1u32 << width) - 1) << lo
    };
    *reg = (*reg & !mask) | ((v << lo) & mask);
}

/// Leaves describing the topology level by level (SDM: "Extended Topology
/// Enumeration" 0BH and "V2 Extended Topology Enumeration" 1FH).
const TOPOLOGY_LEAVES: [u32; 2] = [0xb, 0x1f];
/// Subleaves we describe: 0 = SMT, 1 = core, 2 = invalid (terminator).
const TOPOLOGY_SUBLEAVES: u32 = 3;

/// KVM reports the topology leaves with only subleaf 0, zeroed (topology is
/// the VMM's business). Where such a leaf exists, replace its entries with
/// subleaves 0..3 (flagged index-significant) for the [`EDITS`] rows to
/// fill in.
fn expand_topology_leaves(entries: &mut Vec<kvm_cpuid_entry2>) {
    for leaf in TOPOLOGY_LEAVES {
        if !entries.iter().any(|e| e.function == leaf) {
            continue;
        }
        entries.retain(|e| e.function != leaf);
        for index in 0..TOPOLOGY_SUBLEAVES {
            entries.push(kvm_cpuid_entry2 {
                function: leaf,
                index,
                flags: kvm_bindings::KVM_CPUID_FLAG_SIGNIFCANT_INDEX,
                // Level number in ECX[7:0] is the subleaf.
                ecx: index,
                ..Default::default()
            });
        }
    }
}

/// Applies [`EDITS`] to `entries` for one vCPU (after giving the topology
/// leaves their subleaves).
pub fn normalize(entries: &mut Vec<kvm_cpuid_entry2>, p: &CpuParams) {
    expand_topology_leaves(entries);
    let vendor = vendor(entries);
    for entry in entries.iter_mut() {
        for ed in EDITS {
            if !applies(ed, entry, vendor, p) {
                continue;
            }
            let v = value(ed.val, p, entry);
            let reg = match ed.reg {
                Eax => &mut entry.eax,
                Ebx => &mut entry.ebx,
                Ecx => &mut entry.ecx,
                Edx => &mut entry.edx,
            };
            set_field(reg, ed.lo, ed.hi, v);
        }
    }
}

/// Builds the `CpuId` for vCPU `p.index` from KVM's supported table.
pub fn for_vcpu(
    supported: &kvm_bindings::CpuId,
    p: &CpuParams,
) -> Result<kvm_bindings::CpuId, CpuidError> {
    let mut entries = supported.as_slice().to_vec();
    normalize(&mut entries, p);
    kvm_bindings::CpuId::from_entries(&entries).map_err(CpuidError::Fam)
}

/// `arch_prctl` code to request guest permission for a dynamic XSAVE feature.
const ARCH_REQ_XCOMP_GUEST_PERM: libc::c_ulong = 0x1025;
/// XSAVE feature number of AMX tile data.
const XFEATURE_XTILEDATA: libc::c_ulong = 18;

/// Asks the kernel to let this process's guests use AMX tile data. Must run
/// before `KVM_GET_SUPPORTED_CPUID` and vCPU creation. Returns whether it
/// was granted (false on hosts without AMX or with kernels before 5.17).
pub fn request_amx_permission() -> bool {
    // SAFETY: arch_prctl with these arguments only changes this process's
    // XSAVE permission bitmap; no memory is passed.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_GUEST_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    rc == 0
}

/// Whether a supported table advertises AMX tile data in leaf 0xD.
pub fn table_has_amx(entries: &[kvm_cpuid_entry2]) -> bool {
    entries
        .iter()
        .any(|e| e.function == 0xd && e.index == 0 && e.eax & (1 << 18) != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ent(function: u32, index: u32, eax: u32, ebx: u32, ecx: u32, edx: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            eax,
            ebx,
            ecx,
            edx,
            ..Default::default()
        }
    }

    fn intel_table() -> Vec<kvm_cpuid_entry2> {
        let v = |s: &[u8]| u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        vec![
            ent(0, 0, 0x1f, v(b"Genu"), v(b"ntel"), v(b"ineI")),
            // leaf 1: some host APIC ID junk, AVX2-era feature bits.
            ent(1, 0, 0x806f8, 0xff00_0800, 0x1ef8_3203, 0x0789_fbff),
            ent(4, 0, 0x121, 0, 0, 0),
            ent(4, 1, 0x122, 0, 0, 0),
            ent(4, 3, 0x163, 0, 0, 0),
            ent(7, 0, 2, 0x0000_0020, 0, 0x0340_0000), // AVX2 in EBX[5], AMX bits in EDX
            ent(0xa, 0, 0x0408_0302, 0xff, 0, 0x603),
            ent(0xb, 0, 1, 2, 0x100, 7),
            ent(0xb, 1, 4, 16, 0x201, 7),
            ent(0xb, 2, 0, 0, 2, 7),
            ent(0xd, 0, 0x6_02e7, 0, 0x2b00, 0),
            ent(0xd, 18, 0x2000, 0xac0, 6, 0),
            ent(0x1d, 0, 1, 0, 0, 0),
        ]
    }

    fn find(t: &[kvm_cpuid_entry2], f: u32, i: u32) -> kvm_cpuid_entry2 {
        *t.iter().find(|e| e.function == f && e.index == i).unwrap()
    }

    #[test]
    fn apic_ids_and_topology_per_vcpu() {
        for (index, count) in [(0u8, 1u8), (2, 3), (5, 8)] {
            let mut t = intel_table();
            // As KVM reports it: only subleaf 0 of 0xB/0x1F.
            t.retain(|e| !(e.function == 0xb && e.index > 0));
            t.push(ent(0x1f, 0, 0, 0, 0, 1));
            let p = CpuParams {
                index,
                count,
                tsc_deadline: true,
                amx: true,
            };
            normalize(&mut t, &p);
            let l1 = find(&t, 1, 0);
            assert_eq!(l1.ebx >> 24, u32::from(index));
            assert_eq!((l1.ebx >> 8) & 0xff, 8);
            let bits = core_bits(count);
            assert_eq!((l1.ebx >> 16) & 0xff, 1 << bits);
            assert_eq!(l1.ecx >> 31, 1, "hypervisor bit");
            assert_eq!((l1.ecx >> 24) & 1, 1, "tsc deadline");
            assert_eq!((l1.edx >> 28) & 1, u32::from(count > 1));
            // Unrelated feature bits untouched.
            assert_eq!(l1.ecx & 0x00ff_ffff, 0x1ef8_3203 & 0x00ff_ffff);
            assert_eq!(find(&t, 7, 0).ebx & (1 << 5), 1 << 5, "AVX2 kept");

            let b0 = find(&t, 0xb, 0);
            let b1 = find(&t, 0xb, 1);
            let b2 = find(&t, 0xb, 2);
            assert_eq!((b0.eax, b0.ebx & 0xffff, b0.ecx & 0xffff), (0, 1, 0x100));
            assert_eq!(
                (b1.eax & 0x1f, b1.ebx & 0xffff, b1.ecx & 0xffff),
                (bits, u32::from(count), 0x201)
            );
            assert_eq!(
                (b2.eax, b2.ebx, (b2.ecx >> 8) & 0xff, b2.ecx & 0xff),
                (0, 0, 0, 2)
            );
            for b in [b0, b1, b2] {
                assert_eq!(b.edx, u32::from(index));
                assert_eq!(b.flags, kvm_bindings::KVM_CPUID_FLAG_SIGNIFCANT_INDEX);
            }
            let f1 = find(&t, 0x1f, 1);
            assert_eq!(
                (f1.eax, f1.ebx, f1.ecx, f1.edx),
                (b1.eax, b1.ebx, b1.ecx, b1.edx),
                "leaf 1FH mirrors 0BH"
            );
            assert_eq!(t.iter().filter(|e| e.function == 0xb).count(), 3);
            // Leaf 4: L1/L2 private, L3 shared by the package.
            assert_eq!((find(&t, 4, 0).eax >> 14) & 0xfff, 0);
            assert_eq!((find(&t, 4, 3).eax >> 14) & 0xfff, (1 << bits) - 1);
            assert_eq!(find(&t, 4, 1).eax >> 26, (1 << bits) - 1);
            // PMU hidden.
            let a = find(&t, 0xa, 0);
            assert_eq!((a.eax, a.ebx, a.ecx, a.edx), (0, 0, 0, 0));
            // AMX allowed: kept.
            assert_eq!(find(&t, 7, 0).edx, 0x0340_0000);
            assert_eq!(find(&t, 0xd, 18).eax, 0x2000);
        }
    }

    #[test]
    fn amx_masked_without_permission_and_no_tsc_deadline() {
        let mut t = intel_table();
        normalize(
            &mut t,
            &CpuParams {
                index: 0,
                count: 1,
                tsc_deadline: false,
                amx: false,
            },
        );
        assert_eq!(find(&t, 7, 0).edx & 0x0340_0000, 0);
        assert_eq!(find(&t, 0xd, 0).eax & (3 << 17), 0);
        assert_eq!(
            find(&t, 0xd, 0).eax & 0xff,
            0xe7,
            "x87/SSE/AVX/AVX-512 state kept"
        );
        let x = find(&t, 0xd, 18);
        assert_eq!((x.eax, x.ebx, x.ecx), (0, 0, 0));
        assert_eq!(find(&t, 0x1d, 0).eax, 0);
        assert_eq!((find(&t, 1, 0).ecx >> 24) & 1, 0);
        assert!(!table_has_amx(&t));
        assert!(table_has_amx(&intel_table()));
    }

    #[test]
    fn amd_rows_only_on_amd() {
        let v = |s: &[u8]| u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        let amd = vec![
            ent(0, 0, 0x10, v(b"Auth"), v(b"cAMD"), v(b"enti")),
            ent(0x8000_0001, 0, 0, 0, 0x2, 0),
            ent(0x8000_0008, 0, 0x3030, 0, 0xffff, 0),
            ent(0x8000_001e, 0, 9, 0x0100, 0x0101, 0),
            ent(4, 0, 0x121, 0, 0, 0),
        ];
        assert_eq!(vendor(&amd), Vendor::Amd);
        let mut t = amd.clone();
        let p = CpuParams {
            index: 3,
            count: 4,
            tsc_deadline: false,
            amx: false,
        };
        normalize(&mut t, &p);
        assert_eq!(find(&t, 0x8000_0001, 0).ecx & 2, 0);
        assert_eq!(find(&t, 0x8000_0008, 0).ecx & 0xf0ff, (2 << 12) | 3);
        let x = find(&t, 0x8000_001e, 0);
        assert_eq!((x.eax, x.ebx & 0xffff, x.ecx & 0xff), (3, 3, 0));
        assert_eq!(find(&t, 4, 0).eax, 0x121, "Intel-only row skipped on AMD");

        let mut t = intel_table();
        let before = find(&t, 0xd, 0);
        t.push(ent(0x8000_0008, 0, 0x3030, 0, 0xffff, 0));
        normalize(&mut t, &p);
        assert_eq!(
            find(&t, 0x8000_0008, 0).ecx,
            0xffff,
            "AMD row skipped on Intel"
        );
        assert_eq!(find(&t, 0xd, 0).ecx, before.ecx);
    }

    #[test]
    fn every_row_is_documented_and_well_formed() {
        for ed in EDITS {
            assert!(ed.lo <= ed.hi && ed.hi < 32, "{ed:?}");
            assert!(
                ed.field.starts_with("SDM")
                    || ed.field.starts_with("APM")
                    || ed.field.starts_with("CPUID")
            );
        }
        assert_eq!(core_bits(1), 0);
        assert_eq!(core_bits(2), 1);
        assert_eq!(core_bits(3), 2);
        assert_eq!(core_bits(254), 8);
    }
}
