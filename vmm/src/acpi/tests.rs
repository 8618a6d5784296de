//! ACPI table tests, including an independent decoder for the AML subset we
//! emit, so the DSDT is checked by reading it back rather than by comparing
//! against the encoder's own output.

use super::*;
use vm_memory::GuestAddress;

#[derive(Debug, Clone, PartialEq)]
enum Val {
    Int(u64),
    Str(String),
    Buf(Vec<u8>),
    Pkg(Vec<Val>),
}

#[derive(Debug, Clone, PartialEq)]
enum Node {
    Scope(String, Vec<Node>),
    Device(String, Vec<Node>),
    Name(String, Val),
}

struct Rd<'a> {
    b: &'a [u8],
    p: usize,
}

impl Rd<'_> {
    fn u8(&mut self) -> u8 {
        let v = self.b[self.p];
        self.p += 1;
        v
    }
    fn take(&mut self, n: usize) -> &[u8] {
        let s = &self.b[self.p..self.p + n];
        self.p += n;
        s
    }
    /// Returns the end offset of the package starting at the PkgLength.
    fn pkg_end(&mut self) -> usize {
        let start = self.p;
        let lead = self.u8();
        let extra = (lead >> 6) as usize;
        let len = if extra == 0 {
            (lead & 0x3f) as usize
        } else {
            let mut l = (lead & 0xf) as usize;
            for i in 0..extra {
                l |= (self.u8() as usize) << (4 + 8 * i);
            }
            l
        };
        start + len
    }
    fn name(&mut self) -> String {
        let mut s = String::new();
        if self.b[self.p] == b'\\' {
            self.p += 1;
            s.push('\\');
        }
        let n = match self.b[self.p] {
            0x2e => {
                self.p += 1;
                2
            }
            0x2f => {
                self.p += 1;
                self.u8() as usize
            }
            _ => 1,
        };
        let segs: Vec<String> = (0..n)
            .map(|_| String::from_utf8(self.take(4).to_vec()).unwrap())
            .collect();
        s + &segs.join(".")
    }
    fn val(&mut self) -> Val {
        match self.u8() {
            0x00 => Val::Int(0),
            0x01 => Val::Int(1),
            0x0a => Val::Int(self.u8() as u64),
            0x0b => Val::Int(u16::from_le_bytes(self.take(2).try_into().unwrap()) as u64),
            0x0c => Val::Int(u32::from_le_bytes(self.take(4).try_into().unwrap()) as u64),
            0x0e => Val::Int(u64::from_le_bytes(self.take(8).try_into().unwrap())),
            0x0d => {
                let end = self.b[self.p..].iter().position(|c| *c == 0).unwrap();
                let s = String::from_utf8(self.take(end).to_vec()).unwrap();
                self.p += 1;
                Val::Str(s)
            }
            0x11 => {
                let end = self.pkg_end();
                let Val::Int(n) = self.val() else {
                    panic!("buffer size")
                };
                let data = self.take(n as usize).to_vec();
                assert_eq!(self.p, end, "buffer length mismatch");
                Val::Buf(data)
            }
            0x12 => {
                let end = self.pkg_end();
                let n = self.u8();
                let v: Vec<Val> = (0..n).map(|_| self.val()).collect();
                assert_eq!(self.p, end, "package length mismatch");
                Val::Pkg(v)
            }
            op => panic!("unexpected data op {op:#x} at {}", self.p - 1),
        }
    }
    fn terms(&mut self, end: usize) -> Vec<Node> {
        let mut v = Vec::new();
        while self.p < end {
            v.push(match self.u8() {
                0x08 => {
                    let n = self.name();
                    Node::Name(n, self.val())
                }
                0x10 => {
                    let e = self.pkg_end();
                    let n = self.name();
                    Node::Scope(n, self.terms(e))
                }
                0x5b => {
                    assert_eq!(self.u8(), 0x82, "only DeviceOp is emitted");
                    let e = self.pkg_end();
                    let n = self.name();
                    Node::Device(n, self.terms(e))
                }
                op => panic!("unexpected term op {op:#x}"),
            });
        }
        assert_eq!(self.p, end, "term list overran its package");
        v
    }
}

fn decode(aml: &[u8]) -> Vec<Node> {
    let mut r = Rd { b: aml, p: 0 };
    r.terms(aml.len())
}

/// Resources decoded from a `_CRS` buffer: (base, len) and GSIs.
type Crs = (Vec<(u32, u32)>, Vec<(u32, u8)>);

fn decode_crs(b: &[u8]) -> Crs {
    let (mut mem, mut irq) = (Vec::new(), Vec::new());
    let mut p = 0;
    loop {
        match b[p] {
            0x86 => {
                assert_eq!(u16::from_le_bytes([b[p + 1], b[p + 2]]), 9);
                assert_eq!(b[p + 3] & 1, 1, "read-write");
                let base = u32::from_le_bytes(b[p + 4..p + 8].try_into().unwrap());
                let len = u32::from_le_bytes(b[p + 8..p + 12].try_into().unwrap());
                mem.push((base, len));
                p += 12;
            }
            0x89 => {
                let l = u16::from_le_bytes([b[p + 1], b[p + 2]]) as usize;
                let flags = b[p + 3];
                assert_eq!(b[p + 4], 1);
                irq.push((
                    u32::from_le_bytes(b[p + 5..p + 9].try_into().unwrap()),
                    flags,
                ));
                p += 3 + l;
            }
            0x79 => {
                assert_eq!(p + 2, b.len(), "end tag must be last");
                assert_eq!(b.iter().fold(0u8, |a, x| a.wrapping_add(*x)), 0);
                return (mem, irq);
            }
            t => panic!("unexpected resource tag {t:#x}"),
        }
    }
}

fn assert_table(t: &[u8], sig: &[u8; 4]) {
    assert_eq!(&t[0..4], sig);
    assert_eq!(
        u32::from_le_bytes(t[4..8].try_into().unwrap()) as usize,
        t.len()
    );
    assert_eq!(
        t.iter().fold(0u8, |a, b| a.wrapping_add(*b)),
        0,
        "checksum of {sig:?}"
    );
}

fn slots(n: usize) -> Vec<MmioSlot> {
    (0..n)
        .map(|i| MmioSlot {
            base: layout::virtio_mmio_slot_addr(i),
            len: layout::VIRTIO_MMIO_SLOT_SIZE,
            gsi: layout::virtio_mmio_slot_irq(i),
        })
        .collect()
}

#[test]
fn dsdt_describes_every_virtio_slot() {
    let s = slots(3);
    let t = dsdt(&s).unwrap();
    assert_table(&t, b"DSDT");
    let nodes = decode(&t[36..]);
    assert_eq!(
        nodes[0],
        Node::Name(
            "_S5_".into(),
            Val::Pkg(vec![Val::Int(5), Val::Int(0), Val::Int(0), Val::Int(0)])
        )
    );
    let Node::Scope(sb, devs) = &nodes[1] else {
        panic!("no \\_SB_ scope: {nodes:?}")
    };
    assert_eq!(sb, "\\_SB_");
    assert_eq!(devs.len(), 4);
    // COM1 first: PNP0501 with its ports and ISA IRQ 4 (IRQNoFlags mask).
    let Node::Device(com, kids) = &devs[0] else {
        panic!("{:?}", devs[0])
    };
    assert_eq!(com, "COM1");
    assert_eq!(kids[0], Node::Name("_HID".into(), Val::Int(0x0105_d041)));
    let Node::Name(_, Val::Buf(crs)) = &kids[2] else {
        panic!("{:?}", kids[2])
    };
    assert_eq!(
        &crs[..12],
        &[0x47, 1, 0xf8, 3, 0xf8, 3, 1, 8, 0x22, 0x10, 0, 0x79]
    );
    assert_eq!(crs.iter().fold(0u8, |a, b| a.wrapping_add(*b)), 0);
    for (i, d) in devs[1..].iter().enumerate() {
        let Node::Device(name, kids) = d else {
            panic!("{d:?}")
        };
        assert_eq!(name, &format!("V{i:03X}"));
        assert_eq!(
            kids[0],
            Node::Name("_HID".into(), Val::Str("LNRO0005".into()))
        );
        assert_eq!(kids[1], Node::Name("_UID".into(), Val::Int(i as u64)));
        let Node::Name(crs, Val::Buf(buf)) = &kids[2] else {
            panic!("{:?}", kids[2])
        };
        assert_eq!(crs, "_CRS");
        let (mem, irq) = decode_crs(buf);
        assert_eq!(mem, vec![(s[i].base as u32, 0x1000)]);
        // consumer | edge, active-high, exclusive.
        assert_eq!(irq, vec![(s[i].gsi, 0b11)]);
    }
}

#[test]
fn dsdt_with_many_slots_uses_long_pkglengths() {
    let s = slots(layout::VIRTIO_MMIO_MAX_SLOTS);
    let t = dsdt(&s).unwrap();
    // The \_SB_ scope body is over 63 bytes: a multi-byte PkgLength.
    assert!(t.len() > 1000);
    let nodes = decode(&t[36..]);
    let Node::Scope(_, devs) = &nodes[1] else {
        panic!()
    };
    assert_eq!(devs.len(), 1 + 19);
    let empty = dsdt(&[]).unwrap();
    let Node::Scope(_, only_com1) = &decode(&empty[36..])[1] else {
        panic!()
    };
    assert_eq!(only_com1.len(), 1);
}

#[test]
fn fadt_madt_xsdt_rsdp() {
    let f = fadt(0xe0040);
    assert_table(&f, b"FACP");
    assert_eq!(f.len(), 276);
    assert_eq!(f[8], 6);
    let flags = u32::from_le_bytes(f[112..116].try_into().unwrap());
    assert_ne!(flags & (1 << 20), 0, "HW_REDUCED_ACPI");
    assert_eq!(u64::from_le_bytes(f[140..148].try_into().unwrap()), 0xe0040);
    assert_eq!(u32::from_le_bytes(f[40..44].try_into().unwrap()), 0xe0040);
    assert_eq!(&f[244..248], &[1, 8, 0, 1]);
    assert_eq!(u64::from_le_bytes(f[248..256].try_into().unwrap()), 0x600);
    assert_eq!(u64::from_le_bytes(f[260..268].try_into().unwrap()), 0x601);
    let boot_arch = u16::from_le_bytes([f[109], f[110]]);
    assert_eq!(boot_arch & 0b10, 0, "no i8042 to probe");

    let m = madt(3);
    assert_table(&m, b"APIC");
    assert_eq!(
        u32::from_le_bytes(m[36..40].try_into().unwrap()),
        0xfee0_0000
    );
    let mut p = 44;
    let (mut lapics, mut ioapics, mut nmis) = (vec![], 0, 0);
    while p < m.len() {
        let (ty, len) = (m[p], m[p + 1] as usize);
        match ty {
            0 => {
                assert_eq!(len, 8);
                assert_eq!(m[p + 4], 1, "enabled");
                lapics.push((m[p + 2], m[p + 3]));
            }
            1 => {
                assert_eq!(len, 12);
                assert_eq!(
                    u32::from_le_bytes(m[p + 4..p + 8].try_into().unwrap()),
                    0xfec0_0000
                );
                ioapics += 1;
            }
            4 => {
                assert_eq!((len, m[p + 2], m[p + 5]), (6, 0xff, 1));
                nmis += 1;
            }
            t => panic!("unexpected MADT entry {t}"),
        }
        p += len;
    }
    assert_eq!(p, m.len());
    assert_eq!(lapics, vec![(0, 0), (1, 1), (2, 2)]);
    assert_eq!((ioapics, nmis), (1, 1));

    let x = xsdt(&[0x1000, 0x2000]);
    assert_table(&x, b"XSDT");
    assert_eq!(x.len(), 36 + 16);

    let r = rsdp(0xe1234);
    assert_eq!(&r[0..8], b"RSD PTR ");
    assert_eq!(r[0..20].iter().fold(0u8, |a, b| a.wrapping_add(*b)), 0);
    assert_eq!(r.iter().fold(0u8, |a, b| a.wrapping_add(*b)), 0);
    assert_eq!(u64::from_le_bytes(r[24..32].try_into().unwrap()), 0xe1234);
}

#[test]
fn tables_in_guest_memory_link_up() {
    let ram = crate::memory::create(16, crate::memory::Backing::Anonymous).unwrap();
    let l = write_tables(&ram.mem, 2, &slots(2)).unwrap();
    assert_eq!(l.rsdp, layout::ACPI_START);
    assert!(l.end <= layout::ACPI_END);
    let read = |a: u64, n: usize| {
        let mut v = vec![0u8; n];
        ram.mem.read_slice(&mut v, GuestAddress(a)).unwrap();
        v
    };
    let r = read(l.rsdp, 36);
    let xsdt_addr = u64::from_le_bytes(r[24..32].try_into().unwrap());
    let xlen = u32::from_le_bytes(read(xsdt_addr + 4, 4).try_into().unwrap()) as usize;
    let x = read(xsdt_addr, xlen);
    assert_table(&x, b"XSDT");
    let mut sigs = vec![];
    for c in x[36..].chunks(8) {
        let a = u64::from_le_bytes(c.try_into().unwrap());
        let len = u32::from_le_bytes(read(a + 4, 4).try_into().unwrap()) as usize;
        let t = read(a, len);
        let sig: [u8; 4] = t[0..4].try_into().unwrap();
        assert_table(&t, &sig);
        if &sig == b"FACP" {
            let d = u64::from_le_bytes(t[140..148].try_into().unwrap());
            let dlen = u32::from_le_bytes(read(d + 4, 4).try_into().unwrap()) as usize;
            assert_table(&read(d, dlen), b"DSDT");
        }
        sigs.push(sig);
    }
    assert_eq!(sigs, vec![*b"FACP", *b"APIC"]);
}
