//! Fuzzing entry points of the vmm, shared by the cargo-fuzz targets in
//! `fuzz/` (nightly, libFuzzer) and the workspace's corpus replay test
//! (`tests/fuzz_corpora.rs`, stable).
//!
//! * [`mmio`]: a sequence of guest register accesses (any offset, width and
//!   value, mixed with the steps of a well-behaved driver so activation is
//!   reached) on a virtio-mmio transport wrapping the pattern test device,
//!   with chains posted on its queue in real guest memory. Invariants:
//!   fixed registers read their fixed values, and after a reset the status
//!   reads 0.
//! * [`acpi`]: the tables we generate for a fuzzed machine shape (vCPUs,
//!   virtio-mmio slots), read back by a decoder of our own written from the
//!   ACPI 6.5 specification, independent of the encoder: RSDP and SDT
//!   checksums and lengths, the XSDT → FADT → DSDT and MADT links, the MADT
//!   entry structure, and an AML walk of the DSDT (every package length
//!   nests exactly; each slot appears as an `LNRO0005` device with its
//!   memory window and interrupt). No crates.io AML decoder builds on
//!   stable (`aml` 0.16 needs `#![feature(decl_macro)]`; `acpi` 7 is a
//!   pre-release), hence our own.
//!
//! * [`snapshot_state`]: a snapshot's state file, untrusted input, through
//!   everything a restore checks before it touches KVM: the container
//!   (magic, version, lengths, CRC, key), the body's decoding, every vCPU
//!   structure and the VM state, and each saved virtio transport restored
//!   around a pattern device in guest memory. The input is tried as a
//!   whole file and as a bare body (random bytes rarely pass a CRC).
//!   Invariant: no panic; an accepted file re-encodes to itself.
//!
//! Limits: the mmio target's device worker runs on its own thread, so the
//! order of its completions against later register writes varies between
//! runs; the AML walk knows the subset of AML we emit (Name, Scope, Device,
//! integers, strings, buffers, packages) and fails on anything else.

use arbitrary::{Arbitrary, Unstructured};
use vm_memory::{Bytes, GuestAddress};

use crate::acpi::{self, aml, MmioSlot};
use crate::layout;
use crate::virtio::mmio::{self, MmioTransport};
use crate::virtio::testdev::PatternDevice;
use crate::virtio::{status, GuestMemoryMmap};

/// The key the snapshot_state target's files carry.
pub const SNAPSHOT_FUZZ_KEY: &str = "fuzz";

/// Runs a snapshot state file (or a bare body) through the restore's
/// checks (see the module docs).
pub fn snapshot_state(data: &[u8]) {
    use crate::snapshot::{file, kvm_state, VmState, FORMAT_VERSION};
    let path = std::path::Path::new("fuzz/vm.state");
    let body = match file::decode(path, data, FORMAT_VERSION, SNAPSHOT_FUZZ_KEY) {
        Ok(body) => {
            let again = file::encode(SNAPSHOT_FUZZ_KEY, FORMAT_VERSION, body)
                .expect("an accepted file re-encodes");
            assert_eq!(again, data, "an accepted file re-encodes to itself");
            body
        }
        Err(_) => data,
    };
    let Ok(state) = file::decode_body::<VmState>(path, body) else {
        return;
    };
    for v in &state.vcpu_states {
        let _ = kvm_state::check_vcpu(v, 0);
        let _ = kvm_state::check_vcpu(v, 16 << 10);
    }
    let _ = kvm_state::check_vm(&state.vm);
    let Ok(mem) = GuestMemoryMmap::from_ranges(&[
        (GuestAddress(MMIO_RAM[0].0), MMIO_RAM[0].1 as usize),
        (GuestAddress(MMIO_RAM[1].0), MMIO_RAM[1].1 as usize),
    ]) else {
        return;
    };
    for saved in state.devices.iter().take(layout::VIRTIO_MMIO_MAX_SLOTS) {
        // A device shaped like the saved one where that is a valid shape,
        // so the checks past the shape are reached.
        let sizes: Vec<u16> = saved
            .queues
            .iter()
            .take(8)
            .map(|q| q.max_size)
            .filter(|s| s.is_power_of_two() && *s <= 1024)
            .collect();
        let sizes = if sizes.is_empty() { vec![16] } else { sizes };
        if let Ok(t) =
            MmioTransport::restore(Box::new(PatternDevice::new(sizes)), mem.clone(), saved)
        {
            // What a restored transport reports is what was saved.
            assert_eq!(t.is_paused(), t.is_activated());
        }
    }
}

/// Queue sizes of the pattern device under the mmio target.
const MMIO_QUEUE_MAX: [u16; 2] = [16, 8];
/// Guest RAM of the mmio target: two regions with a hole between them, so
/// ring addresses can straddle or miss memory.
const MMIO_RAM: [(u64, u64); 2] = [(0, 0x10_0000), (0x20_0000, 0x10_0000)];
/// Candidate ring addresses of the driver steps (in RAM, in the hole,
/// straddling the end of the first region, misaligned).
const RING_ADDRS: [u64; 6] = [0x1000, 0x2000, 0x3000, 0x0f_fff0, 0x15_0000, 0x2001];
/// Where the `Activate` step puts queue 0's rings (queue `i` at
/// `+ i * 0x1000`: descriptor table, then available ring at `+0x400`, used
/// ring at `+0x800`).
const ACTIVATE_RINGS: u64 = 0x4000;
/// Where chain buffers of the mmio target are allocated.
const MMIO_BUF_BASE: u64 = 0x1_0000;
/// Most register accesses one input makes.
const MAX_STEPS: usize = 256;
/// Magic value register content ("virt").
const MAGIC_VALUE: u32 = 0x7472_6976;

/// One guest access or driver step against the transport.
#[derive(Arbitrary, Debug)]
pub enum MmioStep {
    /// Read `width` bytes at `offset`.
    Read { offset: u16, width: u8 },
    /// Write `width` bytes of `value` at `offset`.
    Write { offset: u16, width: u8, value: u64 },
    /// Write a status value built from the usual bits.
    Status(u8),
    /// Select a queue and program it with candidate ring addresses.
    SetupQueue {
        index: u8,
        size: u16,
        desc: u8,
        avail: u8,
        used: u8,
        ready: bool,
    },
    /// Accept these feature bits (both pages).
    Features(u64),
    /// The whole bring-up of a well-behaved driver: ACKNOWLEDGE, DRIVER,
    /// `features` plus VERSION_1, FEATURES_OK, every queue at its maximum
    /// size on rings of its own in RAM, DRIVER_OK (activation).
    Activate { features: u64 },
    /// Post a device-writable chain of these lengths on queue `index` (at
    /// the rings the driver steps programmed last), then notify.
    Chain { index: u8, lens: Vec<u16> },
}

fn r32(t: &MmioTransport, off: u64) -> u32 {
    let mut d = [0u8; 4];
    t.read(off, &mut d);
    u32::from_le_bytes(d)
}

fn w32(t: &MmioTransport, off: u64, v: u32) {
    t.write(off, &v.to_le_bytes());
}

/// Driver-side view of one queue the steps programmed.
#[derive(Clone, Copy, Default)]
struct QueueView {
    size: u16,
    desc: u64,
    avail: u64,
    next_desc: u16,
    avail_idx: u16,
}

/// Runs a script of register accesses against a virtio-mmio transport.
pub fn mmio(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok(steps) = Vec::<MmioStep>::arbitrary(&mut u) else {
        return;
    };
    let Ok(mem) = GuestMemoryMmap::from_ranges(&[
        (GuestAddress(MMIO_RAM[0].0), MMIO_RAM[0].1 as usize),
        (GuestAddress(MMIO_RAM[1].0), MMIO_RAM[1].1 as usize),
    ]) else {
        return;
    };
    let device = PatternDevice::new(MMIO_QUEUE_MAX.to_vec());
    let Ok(t) = MmioTransport::new(Box::new(device), mem.clone()) else {
        return;
    };
    let mut views = [QueueView::default(); MMIO_QUEUE_MAX.len()];
    let mut next_buf = MMIO_BUF_BASE;
    for step in steps.iter().take(MAX_STEPS) {
        match step {
            MmioStep::Read { offset, width } => {
                let mut d = [0u8; 8];
                let w = usize::from(*width % 9);
                t.read(u64::from(*offset % 0x200), &mut d[..w]);
            }
            MmioStep::Write {
                offset,
                width,
                value,
            } => {
                let w = usize::from(*width % 9);
                t.write(u64::from(*offset % 0x200), &value.to_le_bytes()[..w]);
            }
            MmioStep::Status(bits) => {
                let s = [
                    status::ACKNOWLEDGE,
                    status::DRIVER,
                    status::FEATURES_OK,
                    status::DRIVER_OK,
                    status::FAILED,
                    status::DEVICE_NEEDS_RESET,
                ]
                .iter()
                .enumerate()
                .filter(|(i, _)| bits & (1 << i) != 0)
                .fold(0, |a, (_, b)| a | b);
                w32(&t, mmio::STATUS, s);
                if s == 0 {
                    assert_eq!(r32(&t, mmio::STATUS), 0, "status after a reset");
                }
            }
            MmioStep::SetupQueue {
                index,
                size,
                desc,
                avail,
                used,
                ready,
            } => {
                let i = usize::from(*index) % (MMIO_QUEUE_MAX.len() + 1);
                let pick = |sel: u8| RING_ADDRS[usize::from(sel) % RING_ADDRS.len()];
                let (d, a, us) = (pick(*desc), pick(*avail) + 0x400, pick(*used) + 0x800);
                w32(&t, mmio::QUEUE_SEL, i as u32);
                w32(&t, mmio::QUEUE_NUM, u32::from(*size));
                for (low, addr) in [
                    (mmio::QUEUE_DESC_LOW, d),
                    (mmio::QUEUE_DRIVER_LOW, a),
                    (mmio::QUEUE_DEVICE_LOW, us),
                ] {
                    w32(&t, low, addr as u32);
                    w32(&t, low + 4, (addr >> 32) as u32);
                }
                w32(&t, mmio::QUEUE_READY, u32::from(*ready));
                if let Some(v) = views.get_mut(i) {
                    *v = QueueView {
                        size: *size,
                        desc: d,
                        avail: a,
                        next_desc: 0,
                        avail_idx: 0,
                    };
                }
            }
            MmioStep::Features(f) => {
                for page in 0..2u32 {
                    w32(&t, mmio::DRIVER_FEATURES_SEL, page);
                    w32(&t, mmio::DRIVER_FEATURES, (f >> (32 * page)) as u32);
                }
            }
            MmioStep::Activate { features } => {
                let f = features | crate::virtio::features::VERSION_1;
                let mut s = status::ACKNOWLEDGE;
                w32(&t, mmio::STATUS, s);
                s |= status::DRIVER;
                w32(&t, mmio::STATUS, s);
                for page in 0..2u32 {
                    w32(&t, mmio::DRIVER_FEATURES_SEL, page);
                    w32(&t, mmio::DRIVER_FEATURES, (f >> (32 * page)) as u32);
                }
                s |= status::FEATURES_OK;
                w32(&t, mmio::STATUS, s);
                for (i, &size) in MMIO_QUEUE_MAX.iter().enumerate() {
                    let desc = ACTIVATE_RINGS + i as u64 * 0x1000;
                    w32(&t, mmio::QUEUE_SEL, i as u32);
                    w32(&t, mmio::QUEUE_NUM, u32::from(size));
                    for (low, addr) in [
                        (mmio::QUEUE_DESC_LOW, desc),
                        (mmio::QUEUE_DRIVER_LOW, desc + 0x400),
                        (mmio::QUEUE_DEVICE_LOW, desc + 0x800),
                    ] {
                        w32(&t, low, addr as u32);
                        w32(&t, low + 4, (addr >> 32) as u32);
                    }
                    w32(&t, mmio::QUEUE_READY, 1);
                    views[i] = QueueView {
                        size,
                        desc,
                        avail: desc + 0x400,
                        next_desc: 0,
                        avail_idx: 0,
                    };
                }
                s |= status::DRIVER_OK;
                w32(&t, mmio::STATUS, s);
            }
            MmioStep::Chain { index, lens } => {
                let i = usize::from(*index) % MMIO_QUEUE_MAX.len();
                let v = &mut views[i];
                if !v.size.is_power_of_two() || lens.is_empty() {
                    continue;
                }
                let lens = &lens[..lens.len().min(usize::from(v.size))];
                let head = v.next_desc;
                for (k, &len) in lens.iter().enumerate() {
                    let idx = v.next_desc;
                    let next = (idx + 1) % v.size;
                    let flags = 2 | if k + 1 < lens.len() { 1 } else { 0 };
                    let len = u32::from(len % 0x2000);
                    let addr = next_buf;
                    next_buf = (next_buf + u64::from(len) + 64) % 0x8_0000 + MMIO_BUF_BASE;
                    let at = GuestAddress(v.desc + u64::from(idx) * 16);
                    let mut raw = [0u8; 16];
                    raw[..8].copy_from_slice(&addr.to_le_bytes());
                    raw[8..12].copy_from_slice(&len.to_le_bytes());
                    raw[12..14].copy_from_slice(&(flags as u16).to_le_bytes());
                    raw[14..16].copy_from_slice(&next.to_le_bytes());
                    let _ = mem.write_slice(&raw, at);
                    v.next_desc = next;
                }
                let slot = v.avail + 4 + u64::from(v.avail_idx % v.size) * 2;
                let _ = mem.write_obj(head, GuestAddress(slot));
                v.avail_idx = v.avail_idx.wrapping_add(1);
                let _ = mem.write_obj(v.avail_idx, GuestAddress(v.avail + 2));
                w32(&t, mmio::QUEUE_NOTIFY, i as u32);
            }
        }
        assert_eq!(r32(&t, mmio::MAGIC), MAGIC_VALUE, "magic register");
        assert_eq!(r32(&t, mmio::VERSION), 2, "version register");
    }
    t.shutdown();
}

/// One machine shape, and names for the AML primitives.
#[derive(Arbitrary, Debug)]
pub struct AcpiInput {
    cpus: u8,
    slots: Vec<(u64, u64, u32)>,
    names: Vec<String>,
    strings: Vec<String>,
    eisa: String,
    pkg_len: u32,
}

/// Generates the ACPI tables for a fuzzed machine and reads them back.
pub fn acpi(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok(input) = AcpiInput::arbitrary(&mut u) else {
        return;
    };
    primitives(&input);
    let slots: Vec<MmioSlot> = input
        .slots
        .iter()
        .take(64)
        .map(|&(base, len, gsi)| MmioSlot { base, len, gsi })
        .collect();
    let Ok(mem) = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), layout::ACPI_END as usize)])
    else {
        return;
    };
    match acpi::write_tables(&mem, input.cpus, &slots) {
        Ok(l) => {
            let mut area = vec![0u8; (layout::ACPI_END - layout::ACPI_START) as usize];
            if mem
                .read_slice(&mut area, GuestAddress(layout::ACPI_START))
                .is_err()
            {
                return;
            }
            check_tables(&area, l.rsdp, input.cpus, &slots);
        }
        Err(acpi::AcpiError::TooLarge { .. }) => {}
        Err(acpi::AcpiError::Aml(_)) => {
            assert!(
                slots
                    .iter()
                    .any(|s| s.base > u64::from(u32::MAX) || s.len > u64::from(u32::MAX)),
                "the DSDT failed to encode for 32-bit slots"
            );
        }
        Err(e) => panic!("writing ACPI tables into RAM failed: {e}"),
    }
}

/// Runs the AML encoder's primitives on fuzzed names and values and checks
/// what they produce.
fn primitives(input: &AcpiInput) {
    for n in input.names.iter().take(8) {
        let mut out = Vec::new();
        if aml::name_string(n, &mut out).is_ok() {
            let mut p = 0;
            let name = read_name(&out, &mut p).expect("an encoded name string decodes");
            assert_eq!(p, out.len(), "name string {n:?} has trailing bytes");
            assert_eq!(
                name.trim_start_matches('\\').replace('.', ""),
                n.trim_start_matches('\\')
                    .split('.')
                    .map(|s| format!("{s:_<4}"))
                    .collect::<String>(),
                "name string round trip"
            );
        }
    }
    for s in input.strings.iter().take(8) {
        let mut out = Vec::new();
        if aml::Aml::encode(&aml::Str(s), &mut out).is_ok() {
            let mut p = 0;
            assert_eq!(
                read_data(&out, &mut p),
                Some(Val::Str(s.clone())),
                "string round trip"
            );
        }
    }
    let _ = aml::EisaId::new(&input.eisa);
    let len = input.pkg_len as usize;
    if let Ok(enc) = aml::pkg_length(len) {
        let mut p = 0;
        let value = read_pkg_len(&enc, &mut p).expect("an encoded package length decodes");
        assert_eq!(p, enc.len(), "package length size");
        assert_eq!(value, len + enc.len(), "package length value");
    }
    let mut out = Vec::new();
    if aml::Aml::encode(&aml::Int(u64::from(input.pkg_len)), &mut out).is_ok() {
        let mut p = 0;
        assert_eq!(
            read_data(&out, &mut p),
            Some(Val::Int(u64::from(input.pkg_len)))
        );
    }
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn sum(b: &[u8]) -> u8 {
    b.iter().fold(0u8, |a, x| a.wrapping_add(*x))
}

/// Checks one system description table at `addr`; returns its bytes.
fn table<'a>(area: &'a [u8], addr: u64, sig: &[u8; 4]) -> &'a [u8] {
    let off = addr
        .checked_sub(layout::ACPI_START)
        .map(|o| o as usize)
        .filter(|&o| o + 36 <= area.len())
        .unwrap_or_else(|| panic!("table {sig:?} at {addr:#x} is outside the ACPI area"));
    assert_eq!(&area[off..off + 4], sig, "signature at {addr:#x}");
    let len = le32(area, off + 4) as usize;
    assert!(len >= 36 && off + len <= area.len(), "{sig:?} length {len}");
    let t = &area[off..off + len];
    assert_eq!(sum(t), 0, "{sig:?} checksum");
    t
}

fn check_tables(area: &[u8], rsdp_addr: u64, cpus: u8, slots: &[MmioSlot]) {
    let r = &area[(rsdp_addr - layout::ACPI_START) as usize..][..36];
    assert_eq!(&r[..8], b"RSD PTR ", "RSDP signature");
    assert_eq!(sum(&r[..20]), 0, "RSDP checksum (ACPI 1.0 part)");
    assert_eq!(sum(r), 0, "RSDP extended checksum");
    assert_eq!(r[15], 2, "RSDP revision");
    assert_eq!(le32(r, 20), 36, "RSDP length");
    let xsdt = table(area, le64(r, 24), b"XSDT");
    assert_eq!((xsdt.len() - 36) % 8, 0, "XSDT entries are 8 bytes");
    let entries: Vec<u64> = (36..xsdt.len()).step_by(8).map(|o| le64(xsdt, o)).collect();
    assert_eq!(entries.len(), 2, "XSDT lists FADT and MADT");
    let fadt = table(area, entries[0], b"FACP");
    assert!(fadt.len() >= 276, "FADT length");
    let x_dsdt = le64(fadt, 140);
    assert_eq!(
        u64::from(le32(fadt, 40)),
        x_dsdt,
        "FADT DSDT and X_DSDT agree"
    );
    let madt = table(area, entries[1], b"APIC");
    check_madt(madt, cpus);
    let dsdt = table(area, x_dsdt, b"DSDT");
    check_dsdt(&dsdt[36..], slots);
}

fn check_madt(madt: &[u8], cpus: u8) {
    let mut p = 44;
    let mut lapics = 0usize;
    while p < madt.len() {
        assert!(p + 2 <= madt.len(), "MADT entry header runs past the table");
        let (kind, len) = (madt[p], usize::from(madt[p + 1]));
        assert!(len >= 2 && p + len <= madt.len(), "MADT entry length {len}");
        if kind == 0 {
            assert_eq!(len, 8, "Local APIC entry length");
            assert_eq!(usize::from(madt[p + 3]), lapics, "APIC IDs in order");
            lapics += 1;
        }
        p += len;
    }
    assert_eq!(lapics, usize::from(cpus), "one Local APIC per vCPU");
}

/// A decoded AML data object.
#[derive(Debug, Clone, PartialEq)]
enum Val {
    Int(u64),
    Str(String),
    Buf(Vec<u8>),
    Pkg(Vec<Val>),
}

/// A decoded AML named object.
#[derive(Debug)]
enum Node {
    Scope(String, Vec<Node>),
    Device(String, Vec<Node>),
    Name(String, Val),
}

/// Reads the value of a PkgLength at `*p` (the package's length, the
/// PkgLength bytes included).
fn read_pkg_len(b: &[u8], p: &mut usize) -> Option<usize> {
    let lead = *b.get(*p)?;
    *p += 1;
    let extra = usize::from(lead >> 6);
    let mut len = if extra == 0 {
        usize::from(lead & 0x3f)
    } else {
        usize::from(lead & 0x0f)
    };
    for i in 0..extra {
        len |= usize::from(*b.get(*p)?) << (4 + 8 * i);
        *p += 1;
    }
    Some(len)
}

/// Reads a PkgLength at `*p`; returns the absolute end of the package.
fn read_pkg_end(b: &[u8], p: &mut usize) -> Option<usize> {
    let start = *p;
    let end = start.checked_add(read_pkg_len(b, p)?)?;
    (end <= b.len() && end >= *p).then_some(end)
}

fn read_seg(b: &[u8], p: &mut usize) -> Option<String> {
    let s = b.get(*p..*p + 4)?;
    let ok = (s[0].is_ascii_uppercase() || s[0] == b'_')
        && s[1..]
            .iter()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == b'_');
    *p += 4;
    ok.then(|| String::from_utf8_lossy(s).into_owned())
}

/// Reads a NameString (root and parent prefixes, dual and multi names).
fn read_name(b: &[u8], p: &mut usize) -> Option<String> {
    let mut out = String::new();
    while let Some(&c) = b.get(*p) {
        match c {
            b'\\' | b'^' => {
                out.push(char::from(c));
                *p += 1;
            }
            _ => break,
        }
    }
    let count = match *b.get(*p)? {
        0x00 => {
            *p += 1;
            0
        }
        0x2e => {
            *p += 1;
            2
        }
        0x2f => {
            *p += 2;
            usize::from(*b.get(*p - 1)?)
        }
        _ => 1,
    };
    let segs: Option<Vec<String>> = (0..count).map(|_| read_seg(b, p)).collect();
    out.push_str(&segs?.join("."));
    Some(out)
}

fn read_data(b: &[u8], p: &mut usize) -> Option<Val> {
    let op = *b.get(*p)?;
    *p += 1;
    let int = |p: &mut usize, n: usize| -> Option<Val> {
        let s = b.get(*p..*p + n)?;
        *p += n;
        let mut v = [0u8; 8];
        v[..n].copy_from_slice(s);
        Some(Val::Int(u64::from_le_bytes(v)))
    };
    match op {
        0x00 => Some(Val::Int(0)),
        0x01 => Some(Val::Int(1)),
        0xff => Some(Val::Int(u64::MAX)),
        0x0a => int(p, 1),
        0x0b => int(p, 2),
        0x0c => int(p, 4),
        0x0e => int(p, 8),
        0x0d => {
            let nul = b.get(*p..)?.iter().position(|&c| c == 0)?;
            let s = std::str::from_utf8(&b[*p..*p + nul]).ok()?.to_string();
            *p += nul + 1;
            Some(Val::Str(s))
        }
        0x11 => {
            let end = read_pkg_end(b, p)?;
            let Val::Int(size) = read_data(b, p)? else {
                return None;
            };
            let bytes = b.get(*p..end)?.to_vec();
            if bytes.len() as u64 != size {
                return None;
            }
            *p = end;
            Some(Val::Buf(bytes))
        }
        0x12 => {
            let end = read_pkg_end(b, p)?;
            let n = *b.get(*p)?;
            *p += 1;
            let mut items = Vec::new();
            for _ in 0..n {
                items.push(read_data(b, p)?);
            }
            (*p == end).then_some(Val::Pkg(items))
        }
        _ => None,
    }
}

/// Reads a TermList up to `end`.
fn read_terms(b: &[u8], p: &mut usize, end: usize) -> Option<Vec<Node>> {
    let mut nodes = Vec::new();
    while *p < end {
        match b[*p] {
            0x08 => {
                *p += 1;
                let name = read_name(b, p)?;
                nodes.push(Node::Name(name, read_data(b, p)?));
            }
            0x10 => {
                *p += 1;
                let e = read_pkg_end(b, p)?;
                let name = read_name(b, p)?;
                nodes.push(Node::Scope(name, read_terms(b, p, e)?));
            }
            0x5b if b.get(*p + 1) == Some(&0x82) => {
                *p += 2;
                let e = read_pkg_end(b, p)?;
                let name = read_name(b, p)?;
                nodes.push(Node::Device(name, read_terms(b, p, e)?));
            }
            _ => return None,
        }
    }
    (*p == end).then_some(nodes)
}

/// The (memory base, length) and interrupt GSI a `_CRS` template declares.
fn read_crs(buf: &[u8]) -> (Vec<(u32, u32)>, Vec<u32>) {
    let (mut mem, mut irqs) = (Vec::new(), Vec::new());
    let mut p = 0;
    while p < buf.len() {
        let tag = buf[p];
        if tag & 0x80 == 0 {
            let len = usize::from(tag & 7);
            if tag >> 3 == 0x0f {
                assert_eq!(len, 1, "End Tag length");
                assert_eq!(p + 2, buf.len(), "End Tag is last");
                assert_eq!(sum(buf), 0, "resource template checksum");
                return (mem, irqs);
            }
            p += 1 + len;
        } else {
            assert!(p + 3 <= buf.len(), "large resource header");
            let len = usize::from(u16::from_le_bytes([buf[p + 1], buf[p + 2]]));
            let body = &buf[p + 3..p + 3 + len];
            match tag & 0x7f {
                0x06 => mem.push((le32(body, 1), le32(body, 5))),
                0x09 => {
                    assert_eq!(body[1], 1, "one interrupt per descriptor");
                    irqs.push(le32(body, 2));
                }
                _ => {}
            }
            p += 3 + len;
        }
    }
    panic!("resource template without an End Tag");
}

fn check_dsdt(aml: &[u8], slots: &[MmioSlot]) {
    let mut p = 0;
    let nodes = read_terms(aml, &mut p, aml.len()).expect("the DSDT's AML decodes");
    assert!(
        nodes
            .iter()
            .any(|n| matches!(n, Node::Name(name, Val::Pkg(_)) if name == "_S5_")),
        "\\_S5 package"
    );
    let sb = nodes
        .iter()
        .find_map(|n| match n {
            Node::Scope(name, kids) if name == "\\_SB_" => Some(kids),
            _ => None,
        })
        .expect("\\_SB scope");
    for (i, s) in slots.iter().enumerate() {
        let want = format!("V{i:03X}");
        let kids = sb
            .iter()
            .find_map(|n| match n {
                Node::Device(name, kids) if *name == want => Some(kids),
                _ => None,
            })
            .unwrap_or_else(|| panic!("device {want} missing"));
        let name = |n: &str| {
            kids.iter().find_map(|k| match k {
                Node::Name(x, v) if x == n => Some(v.clone()),
                _ => None,
            })
        };
        assert_eq!(
            name("_HID"),
            Some(Val::Str("LNRO0005".into())),
            "{want} _HID"
        );
        assert_eq!(name("_UID"), Some(Val::Int(i as u64)), "{want} _UID");
        let Some(Val::Buf(crs)) = name("_CRS") else {
            panic!("{want} has no _CRS buffer");
        };
        let (mem, irqs) = read_crs(&crs);
        assert_eq!(mem, vec![(s.base as u32, s.len as u32)], "{want} memory");
        assert_eq!(irqs, vec![s.gsi], "{want} interrupt");
    }
}
