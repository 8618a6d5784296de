//! A minimal AML (ACPI Machine Language) encoder: exactly the objects our
//! DSDT needs — `Scope`, `Device`, `Name`, strings, integers, `Package`,
//! and resource-template buffers holding `Memory32Fixed` and extended
//! `Interrupt` descriptors. Encodings follow ACPI 6.5 §20 (AML grammar) and
//! §6.4 (resource data types).

/// `ZeroOp`.
const ZERO_OP: u8 = 0x00;
/// `OneOp`.
const ONE_OP: u8 = 0x01;
/// `NameOp`.
const NAME_OP: u8 = 0x08;
/// `BytePrefix`.
const BYTE_PREFIX: u8 = 0x0a;
/// `WordPrefix`.
const WORD_PREFIX: u8 = 0x0b;
/// `DWordPrefix`.
const DWORD_PREFIX: u8 = 0x0c;
/// `StringPrefix`.
const STRING_PREFIX: u8 = 0x0d;
/// `QWordPrefix`.
const QWORD_PREFIX: u8 = 0x0e;
/// `ScopeOp`.
const SCOPE_OP: u8 = 0x10;
/// `BufferOp`.
const BUFFER_OP: u8 = 0x11;
/// `PackageOp`.
const PACKAGE_OP: u8 = 0x12;
/// `ExtOpPrefix`.
const EXT_OP_PREFIX: u8 = 0x5b;
/// `DeviceOp` (after `ExtOpPrefix`).
const DEVICE_OP: u8 = 0x82;
/// `RootChar` `\`.
const ROOT_CHAR: u8 = b'\\';
/// `DualNamePrefix`.
const DUAL_NAME_PREFIX: u8 = 0x2e;
/// `MultiNamePrefix`.
const MULTI_NAME_PREFIX: u8 = 0x2f;

/// Resource descriptor: large item "32-bit fixed memory range" (tag 0x86).
const MEMORY32_FIXED_TAG: u8 = 0x86;
/// Resource descriptor: large item "extended interrupt" (tag 0x89).
const EXT_INTERRUPT_TAG: u8 = 0x89;
/// Resource descriptor: small item "I/O port" (0x47 = type 0x8, length 7).
const IO_PORT_TAG: u8 = 0x47;
/// Resource descriptor: small item "IRQ" without flags (0x22 = type 0x4,
/// length 2): edge-triggered, active-high, exclusive.
const IRQ_NO_FLAGS_TAG: u8 = 0x22;
/// Resource descriptor: small item "end tag" (0x79 = type 0xF, length 1).
const END_TAG: u8 = 0x79;

/// Errors of AML encoding (invalid names or sizes; never guest-controlled).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AmlError {
    /// A name segment is not 1-4 characters of `[A-Z0-9_]` starting with a
    /// letter or `_`.
    #[error(
        "invalid AML name {0:?}: use 1-4 chars [A-Z0-9_] per segment, not starting with a digit"
    )]
    BadName(String),
    /// A package length exceeds the 28-bit PkgLength field.
    #[error("AML object of {0} bytes is too large for a PkgLength")]
    TooLarge(usize),
    /// An ISA IRQ descriptor for an IRQ above 15.
    #[error("ISA IRQ {0} out of range 0-15")]
    BadIrq(u8),
    /// An EISA ID is not three uppercase letters and four hex digits.
    #[error("invalid EISA ID {0:?}: expected e.g. \"PNP0501\"")]
    BadEisaId(String),
    /// A string contains a NUL or non-ASCII byte.
    #[error("AML string {0:?} must be ASCII without NUL")]
    BadString(String),
}

/// Something that encodes to AML bytes.
pub trait Aml {
    /// Appends this object's encoding to `out`.
    fn encode(&self, out: &mut Vec<u8>) -> Result<(), AmlError>;
}

/// Encodes `PkgLength` for a body of `body_len` bytes (the encoded length
/// includes the PkgLength bytes themselves).
pub fn pkg_length(body_len: usize) -> Result<Vec<u8>, AmlError> {
    // One byte holds up to 63; n extra bytes add 4 + 8*(n-1)... bits.
    for extra in 0..=3usize {
        let total = body_len + 1 + extra;
        let fits = match extra {
            0 => total < 0x40,
            n => total < 1 << (4 + 8 * n),
        };
        if fits {
            let mut v = Vec::with_capacity(1 + extra);
            if extra == 0 {
                v.push(total as u8);
            } else {
                v.push(((extra as u8) << 6) | (total & 0xf) as u8);
                for i in 0..extra {
                    v.push((total >> (4 + 8 * i)) as u8);
                }
            }
            return Ok(v);
        }
    }
    Err(AmlError::TooLarge(body_len))
}

fn name_seg(s: &str) -> Result<[u8; 4], AmlError> {
    let b = s.as_bytes();
    let ok = !b.is_empty()
        && b.len() <= 4
        && (b[0].is_ascii_uppercase() || b[0] == b'_')
        && b.iter()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == b'_');
    if !ok {
        return Err(AmlError::BadName(s.to_string()));
    }
    let mut seg = [b'_'; 4];
    seg[..b.len()].copy_from_slice(b);
    Ok(seg)
}

/// Encodes a NameString: optional leading `\`, then dot-separated segments
/// (`\_SB_.V000`). Short segments are padded with `_`.
pub fn name_string(name: &str, out: &mut Vec<u8>) -> Result<(), AmlError> {
    let (root, rest) = match name.strip_prefix('\\') {
        Some(r) => (true, r),
        None => (false, name),
    };
    if root {
        out.push(ROOT_CHAR);
    }
    let segs = rest
        .split('.')
        .map(name_seg)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| AmlError::BadName(name.to_string()))?;
    match segs.len() {
        1 => {}
        2 => out.push(DUAL_NAME_PREFIX),
        n if n <= 255 => {
            out.push(MULTI_NAME_PREFIX);
            out.push(n as u8);
        }
        _ => return Err(AmlError::BadName(name.to_string())),
    }
    for s in segs {
        out.extend_from_slice(&s);
    }
    Ok(())
}

/// An integer constant, encoded in the smallest form.
pub struct Int(pub u64);

impl Aml for Int {
    fn encode(&self, out: &mut Vec<u8>) -> Result<(), AmlError> {
        let v = self.0;
        match v {
            0 => out.push(ZERO_OP),
            1 => out.push(ONE_OP),
            2..=0xff => out.extend_from_slice(&[BYTE_PREFIX, v as u8]),
            0x100..=0xffff => {
                out.push(WORD_PREFIX);
                out.extend_from_slice(&(v as u16).to_le_bytes());
            }
            0x1_0000..=0xffff_ffff => {
                out.push(DWORD_PREFIX);
                out.extend_from_slice(&(v as u32).to_le_bytes());
            }
            _ => {
                out.push(QWORD_PREFIX);
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        Ok(())
    }
}

/// A string constant.
pub struct Str<'a>(pub &'a str);

impl Aml for Str<'_> {
    fn encode(&self, out: &mut Vec<u8>) -> Result<(), AmlError> {
        if !self.0.bytes().all(|b| b.is_ascii() && b != 0) {
            return Err(AmlError::BadString(self.0.to_string()));
        }
        out.push(STRING_PREFIX);
        out.extend_from_slice(self.0.as_bytes());
        out.push(0);
        Ok(())
    }
}

/// `Name(name, value)`.
pub struct Name<'a> {
    /// Object name.
    pub name: &'a str,
    /// Value.
    pub value: &'a dyn Aml,
}

impl Aml for Name<'_> {
    fn encode(&self, out: &mut Vec<u8>) -> Result<(), AmlError> {
        out.push(NAME_OP);
        name_string(self.name, out)?;
        self.value.encode(out)
    }
}

fn with_pkg(prefix: &[u8], body: Vec<u8>, out: &mut Vec<u8>) -> Result<(), AmlError> {
    out.extend_from_slice(prefix);
    out.extend_from_slice(&pkg_length(body.len())?);
    out.extend_from_slice(&body);
    Ok(())
}

/// `Scope(name) { children }`.
pub struct Scope<'a> {
    /// Scope path.
    pub name: &'a str,
    /// Contents.
    pub children: Vec<&'a dyn Aml>,
}

impl Aml for Scope<'_> {
    fn encode(&self, out: &mut Vec<u8>) -> Result<(), AmlError> {
        let mut body = Vec::new();
        name_string(self.name, &mut body)?;
        for c in &self.children {
            c.encode(&mut body)?;
        }
        with_pkg(&[SCOPE_OP], body, out)
    }
}

/// `Device(name) { children }`.
pub struct Device<'a> {
    /// Device name.
    pub name: &'a str,
    /// Contents.
    pub children: Vec<&'a dyn Aml>,
}

impl Aml for Device<'_> {
    fn encode(&self, out: &mut Vec<u8>) -> Result<(), AmlError> {
        let mut body = Vec::new();
        name_string(self.name, &mut body)?;
        for c in &self.children {
            c.encode(&mut body)?;
        }
        with_pkg(&[EXT_OP_PREFIX, DEVICE_OP], body, out)
    }
}

/// `Package() { elements }` of integers.
pub struct Package(pub Vec<u64>);

impl Aml for Package {
    fn encode(&self, out: &mut Vec<u8>) -> Result<(), AmlError> {
        let n = u8::try_from(self.0.len()).map_err(|_| AmlError::TooLarge(self.0.len()))?;
        let mut body = vec![n];
        for v in &self.0 {
            Int(*v).encode(&mut body)?;
        }
        with_pkg(&[PACKAGE_OP], body, out)
    }
}

/// One resource descriptor inside a [`ResourceTemplate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resource {
    /// `Memory32Fixed(ReadWrite, base, len)`.
    Memory32Fixed {
        /// Base address.
        base: u32,
        /// Length.
        len: u32,
    },
    /// `Interrupt(ResourceConsumer, Edge, ActiveHigh, Exclusive) { gsi }`.
    EdgeInterrupt {
        /// Global system interrupt.
        gsi: u32,
    },
    /// `IO(Decode16, base, base, 1, len)`: a fixed 16-bit port range.
    Io {
        /// First port.
        base: u16,
        /// Number of ports.
        len: u8,
    },
    /// `IRQNoFlags() { irq }`: an ISA IRQ (0-15), edge, active high.
    IrqNoFlags {
        /// ISA IRQ number.
        irq: u8,
    },
}

/// `ResourceTemplate() { ... }` — a Buffer of resource descriptors ending
/// with an end tag.
pub struct ResourceTemplate(pub Vec<Resource>);

impl Aml for ResourceTemplate {
    fn encode(&self, out: &mut Vec<u8>) -> Result<(), AmlError> {
        let mut data = Vec::new();
        for r in &self.0 {
            match *r {
                Resource::Memory32Fixed { base, len } => {
                    data.push(MEMORY32_FIXED_TAG);
                    data.extend_from_slice(&9u16.to_le_bytes());
                    data.push(1); // bit 0: read-write
                    data.extend_from_slice(&base.to_le_bytes());
                    data.extend_from_slice(&len.to_le_bytes());
                }
                Resource::EdgeInterrupt { gsi } => {
                    data.push(EXT_INTERRUPT_TAG);
                    data.extend_from_slice(&6u16.to_le_bytes());
                    // bit 0 consumer, bit 1 edge-triggered, bit 2 = 0 active
                    // high, bit 3 = 0 exclusive.
                    data.push(0b0000_0011);
                    data.push(1); // interrupt table length
                    data.extend_from_slice(&gsi.to_le_bytes());
                }
                Resource::Io { base, len } => {
                    data.push(IO_PORT_TAG);
                    data.push(1); // bit 0: decodes 16 address bits
                    data.extend_from_slice(&base.to_le_bytes()); // minimum
                    data.extend_from_slice(&base.to_le_bytes()); // maximum
                    data.push(1); // alignment
                    data.push(len);
                }
                Resource::IrqNoFlags { irq } => {
                    if irq > 15 {
                        return Err(AmlError::BadIrq(irq));
                    }
                    data.push(IRQ_NO_FLAGS_TAG);
                    data.extend_from_slice(&(1u16 << irq).to_le_bytes());
                }
            }
        }
        // End tag with a checksum byte making the template sum to zero.
        data.push(END_TAG);
        let sum = data.iter().fold(0u8, |a, b| a.wrapping_add(*b));
        data.push(0u8.wrapping_sub(sum));

        let mut body = Vec::new();
        Int(data.len() as u64).encode(&mut body)?;
        body.extend_from_slice(&data);
        with_pkg(&[BUFFER_OP], body, out)
    }
}

/// A compressed EISA ID (`EisaId("PNP0501")`): three letters, 5 bits
/// each, and four hex digits, stored big-endian in a DWord.
pub struct EisaId(pub u32);

impl EisaId {
    /// Compresses `id`.
    pub fn new(id: &str) -> Result<Self, AmlError> {
        let b = id.as_bytes();
        let bad = || AmlError::BadEisaId(id.to_string());
        if b.len() != 7 || !b[..3].iter().all(|c| c.is_ascii_uppercase()) {
            return Err(bad());
        }
        let hex = u16::from_str_radix(&id[3..], 16).map_err(|_| bad())?;
        let l = |c: u8| u32::from(c - 0x40);
        let v = (l(b[0]) << 26) | (l(b[1]) << 21) | (l(b[2]) << 16) | u32::from(hex);
        Ok(Self(v.swap_bytes()))
    }
}

impl Aml for EisaId {
    fn encode(&self, out: &mut Vec<u8>) -> Result<(), AmlError> {
        out.push(DWORD_PREFIX);
        out.extend_from_slice(&self.0.to_le_bytes());
        Ok(())
    }
}

/// Encodes a list of top-level terms.
pub fn encode_all(terms: &[&dyn Aml]) -> Result<Vec<u8>, AmlError> {
    let mut out = Vec::new();
    for t in terms {
        t.encode(&mut out)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pkg_length_forms() {
        assert_eq!(pkg_length(0).unwrap(), vec![1]);
        assert_eq!(pkg_length(62).unwrap(), vec![63]);
        // 63 body + 2 length bytes = 65 = 0x41: lead 0x41, next 0x04.
        assert_eq!(pkg_length(63).unwrap(), vec![0x41, 0x04]);
        assert_eq!(pkg_length(0xffd).unwrap(), vec![0x4f, 0xff]);
        // 0xffe + 3 = 0x1001: needs two extra bytes.
        assert_eq!(pkg_length(0xffe).unwrap(), vec![0x81, 0x00, 0x01]);
        assert!(pkg_length(1 << 28).is_err());
    }

    #[test]
    fn names_and_integers() {
        let mut v = Vec::new();
        name_string("\\_SB_.V000", &mut v).unwrap();
        assert_eq!(v, b"\\\x2e_SB_V000");
        let mut v = Vec::new();
        name_string("_S5", &mut v).unwrap();
        assert_eq!(v, b"_S5_");
        assert!(name_string("1ABC", &mut Vec::new()).is_err());
        assert!(name_string("abcd", &mut Vec::new()).is_err());
        assert!(name_string("TOOLONG", &mut Vec::new()).is_err());

        let enc = |x| {
            let mut v = Vec::new();
            Int(x).encode(&mut v).unwrap();
            v
        };
        assert_eq!(enc(0), [0]);
        assert_eq!(enc(1), [1]);
        assert_eq!(enc(5), [0x0a, 5]);
        assert_eq!(enc(0x1234), [0x0b, 0x34, 0x12]);
        assert_eq!(enc(0xd000_0000), [0x0c, 0, 0, 0, 0xd0]);
        assert_eq!(enc(1 << 40), [0x0e, 0, 0, 0, 0, 0, 1, 0, 0]);
        assert!(Str("a\0b").encode(&mut Vec::new()).is_err());
    }

    #[test]
    fn eisa_id_and_isa_resources() {
        // Well-known compressed values.
        assert_eq!(EisaId::new("PNP0501").unwrap().0, 0x0105_d041);
        assert_eq!(EisaId::new("PNP0A03").unwrap().0, 0x030a_d041);
        assert!(EisaId::new("pnp0501").is_err());
        assert!(EisaId::new("PNP05").is_err());
        assert!(EisaId::new("PNPXYZW").is_err());
        let mut v = Vec::new();
        ResourceTemplate(vec![
            Resource::Io {
                base: 0x3f8,
                len: 8,
            },
            Resource::IrqNoFlags { irq: 4 },
        ])
        .encode(&mut v)
        .unwrap();
        assert_eq!(&v[4..12], &[0x47, 1, 0xf8, 3, 0xf8, 3, 1, 8]);
        assert_eq!(&v[12..15], &[0x22, 0x10, 0]);
        assert!(ResourceTemplate(vec![Resource::IrqNoFlags { irq: 16 }])
            .encode(&mut Vec::new())
            .is_err());
    }

    #[test]
    fn resource_template_bytes() {
        let mut v = Vec::new();
        ResourceTemplate(vec![
            Resource::Memory32Fixed {
                base: 0xd000_0000,
                len: 0x1000,
            },
            Resource::EdgeInterrupt { gsi: 5 },
        ])
        .encode(&mut v)
        .unwrap();
        // Buffer, PkgLength, BufferSize (byte 23), then descriptors.
        assert_eq!(&v[..4], &[0x11, 26, 0x0a, 23]);
        assert_eq!(&v[4..16], &[0x86, 9, 0, 1, 0, 0, 0, 0xd0, 0, 0x10, 0, 0]);
        assert_eq!(&v[16..25], &[0x89, 6, 0, 3, 1, 5, 0, 0, 0]);
        assert_eq!(v[25], 0x79);
        let sum = v[4..].iter().fold(0u8, |a, b| a.wrapping_add(*b));
        assert_eq!(sum, 0);
    }
}
