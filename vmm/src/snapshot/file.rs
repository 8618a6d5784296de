//! The snapshot's state file: a fixed header, the caller's key, and the
//! body (the machine's state, bincode-encoded), checked in full before
//! anything in it is used.
//!
//! Layout (little-endian):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | [`MAGIC`] |
//! | 8 | 4 | format version ([`super::FORMAT_VERSION`]) |
//! | 12 | 4 | key length, at most [`MAX_KEY_BYTES`] |
//! | 16 | 8 | body length, at most [`MAX_BODY_BYTES`] |
//! | 24 | 4 | CRC-32 (IEEE) of bytes 0..24, the key and the body |
//! | 28 | 4 | reserved, zero |
//! | 32 | key length | the key (UTF-8) |
//! | 32 + key length | body length | the body |
//!
//! [`decode`] checks, in this order, and stops at the first failure: the
//! length of the fixed header, the magic, the version (an older or newer
//! format is refused as such, before its other fields are trusted), the
//! reserved word, the two lengths against their bounds, the file length
//! against them (shorter: truncated; longer: corrupt), the CRC, and only
//! then the key. The body is decoded with a byte limit, trailing bytes
//! refused ([`decode_body`]), so a corrupt length inside it cannot make the
//! reader allocate more than the file holds.
//!
//! Limits: the CRC detects accidents (a torn or bit-flipped file), not
//! tampering: the snapshot directory must be writable by its user only.

use std::path::{Path, PathBuf};

use bincode::Options;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// First bytes of every state file.
pub const MAGIC: [u8; 8] = *b"CWVMSNAP";
/// Length of the fixed header, before the key.
pub const HEADER_LEN: usize = 32;
/// Longest key accepted, in bytes.
pub const MAX_KEY_BYTES: usize = 4096;
/// Longest body accepted, in bytes: the state of 254 vCPUs with AMX-sized
/// XSAVE areas stays well below it; a larger length is corruption.
pub const MAX_BODY_BYTES: u64 = 64 << 20;

/// Offset of the format version in the header.
const VERSION_AT: usize = 8;
/// Offset of the key length.
const KEY_LEN_AT: usize = 12;
/// Offset of the body length.
const BODY_LEN_AT: usize = 16;
/// Offset of the CRC; the bytes before it are covered by it.
const CRC_AT: usize = 24;
/// Offset of the reserved word.
const RESERVED_AT: usize = 28;

/// Why a state file was refused.
#[derive(Debug, thiserror::Error)]
pub enum StateFileError {
    /// Reading or writing failed.
    #[error("cannot {what} the snapshot state file {path}: {source}")]
    Io {
        /// "read" or "write".
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// Shorter than its header says (a crash while writing, a partial copy).
    #[error("the snapshot state file {path} is truncated ({got} bytes, {want} expected); discard the snapshot")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// Its length.
        got: u64,
        /// The length its header implies (or the header's own).
        want: u64,
    },
    /// Not a state file at all.
    #[error("{path} is not a snapshot state file (bad magic); discard it")]
    NotASnapshot {
        /// The file.
        path: PathBuf,
    },
    /// Written by an older helper in a format this one does not read.
    #[error("the snapshot {path} has format version {found}, older than this helper's {expected}; take a new snapshot")]
    OlderFormat {
        /// The file.
        path: PathBuf,
        /// Its version.
        found: u32,
        /// Ours.
        expected: u32,
    },
    /// Written by a newer helper.
    #[error("the snapshot {path} has format version {found}, newer than this helper's {expected}; take a new snapshot")]
    NewerFormat {
        /// The file.
        path: PathBuf,
        /// Its version.
        found: u32,
        /// Ours.
        expected: u32,
    },
    /// Damaged: a bad length, checksum or body.
    #[error("the snapshot state file {path} is corrupt: {reason}; discard the snapshot")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// Intact, but taken for another machine (kernel, image, shape, build).
    #[error(
        "the snapshot {path} was taken for another machine (its key differs); take a new snapshot"
    )]
    ForeignKey {
        /// The file.
        path: PathBuf,
    },
    /// The machine state could not be encoded.
    #[error("cannot encode the snapshot state: {0}")]
    Encode(String),
    /// The key or body given to [`encode`] is too long.
    #[error("cannot write a snapshot: its {what} is {len} bytes, at most {max} allowed")]
    TooLong {
        /// "key" or "body".
        what: &'static str,
        /// Its length.
        len: u64,
        /// The bound.
        max: u64,
    },
}

fn body_options() -> impl Options {
    bincode::DefaultOptions::new()
        .with_fixint_encoding()
        .with_little_endian()
        .reject_trailing_bytes()
        .with_limit(MAX_BODY_BYTES)
}

/// Encodes a body for [`encode`].
pub fn encode_body<T: Serialize>(body: &T) -> Result<Vec<u8>, StateFileError> {
    body_options()
        .serialize(body)
        .map_err(|e| StateFileError::Encode(e.to_string()))
}

/// Decodes a body [`decode`] returned; anything that does not decode as
/// `T` exactly is corruption.
pub fn decode_body<T: DeserializeOwned>(path: &Path, body: &[u8]) -> Result<T, StateFileError> {
    body_options()
        .deserialize(body)
        .map_err(|e| StateFileError::Corrupt {
            path: path.to_path_buf(),
            reason: format!("the body does not decode: {e}"),
        })
}

/// The whole state file for `key` and `body` in format `version`.
pub fn encode(key: &str, version: u32, body: &[u8]) -> Result<Vec<u8>, StateFileError> {
    if key.len() > MAX_KEY_BYTES {
        return Err(StateFileError::TooLong {
            what: "key",
            len: key.len() as u64,
            max: MAX_KEY_BYTES as u64,
        });
    }
    if body.len() as u64 > MAX_BODY_BYTES {
        return Err(StateFileError::TooLong {
            what: "body",
            len: body.len() as u64,
            max: MAX_BODY_BYTES,
        });
    }
    let mut out = Vec::with_capacity(HEADER_LEN + key.len() + body.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(key.len() as u32).to_le_bytes());
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    let mut crc = crc32fast::Hasher::new();
    crc.update(&out[..CRC_AT]);
    crc.update(key.as_bytes());
    crc.update(body);
    out.extend_from_slice(&crc.finalize().to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(body);
    Ok(out)
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(b)
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(b)
}

/// Checks the state file `bytes` (read from `path`) against format
/// `version` and `key`, in the order of the module docs, and returns its
/// body.
pub fn decode<'a>(
    path: &Path,
    bytes: &'a [u8],
    version: u32,
    key: &str,
) -> Result<&'a [u8], StateFileError> {
    let path_buf = || path.to_path_buf();
    let corrupt = |reason: String| StateFileError::Corrupt {
        path: path_buf(),
        reason,
    };
    let len = bytes.len() as u64;
    if bytes.len() < MAGIC.len() || bytes[..MAGIC.len()] != MAGIC {
        return Err(if bytes.len() < MAGIC.len() && MAGIC.starts_with(bytes) {
            StateFileError::Truncated {
                path: path_buf(),
                got: len,
                want: HEADER_LEN as u64,
            }
        } else {
            StateFileError::NotASnapshot { path: path_buf() }
        });
    }
    if bytes.len() < HEADER_LEN {
        return Err(StateFileError::Truncated {
            path: path_buf(),
            got: len,
            want: HEADER_LEN as u64,
        });
    }
    let found = u32_at(bytes, VERSION_AT);
    if found < version {
        return Err(StateFileError::OlderFormat {
            path: path_buf(),
            found,
            expected: version,
        });
    }
    if found > version {
        return Err(StateFileError::NewerFormat {
            path: path_buf(),
            found,
            expected: version,
        });
    }
    if u32_at(bytes, RESERVED_AT) != 0 {
        return Err(corrupt("the reserved header word is not zero".into()));
    }
    let key_len = u32_at(bytes, KEY_LEN_AT) as usize;
    if key_len > MAX_KEY_BYTES {
        return Err(corrupt(format!(
            "key length {key_len} above the bound {MAX_KEY_BYTES}"
        )));
    }
    let body_len = u64_at(bytes, BODY_LEN_AT);
    if body_len > MAX_BODY_BYTES {
        return Err(corrupt(format!(
            "body length {body_len} above the bound {MAX_BODY_BYTES}"
        )));
    }
    let want = HEADER_LEN as u64 + key_len as u64 + body_len;
    if len < want {
        return Err(StateFileError::Truncated {
            path: path_buf(),
            got: len,
            want,
        });
    }
    if len > want {
        return Err(corrupt(format!(
            "{} bytes after the end its header gives",
            len - want
        )));
    }
    let key_end = HEADER_LEN + key_len;
    let mut crc = crc32fast::Hasher::new();
    crc.update(&bytes[..CRC_AT]);
    crc.update(&bytes[HEADER_LEN..]);
    let stored = u32_at(bytes, CRC_AT);
    let computed = crc.finalize();
    if stored != computed {
        return Err(corrupt(format!(
            "checksum mismatch (stored {stored:#010x}, computed {computed:#010x})"
        )));
    }
    if &bytes[HEADER_LEN..key_end] != key.as_bytes() {
        return Err(StateFileError::ForeignKey { path: path_buf() });
    }
    Ok(&bytes[key_end..])
}

/// Reads the state file at `path` (at most the largest size a valid one
/// can have) and [`decode`]s it.
pub fn read(path: &Path, version: u32, key: &str) -> Result<Vec<u8>, StateFileError> {
    use std::io::Read;
    let io = |source| StateFileError::Io {
        what: "read",
        path: path.to_path_buf(),
        source,
    };
    let max = HEADER_LEN as u64 + MAX_KEY_BYTES as u64 + MAX_BODY_BYTES;
    let file = std::fs::File::open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    if len > max {
        return Err(StateFileError::Corrupt {
            path: path.to_path_buf(),
            reason: format!("{len} bytes, more than a state file can have ({max})"),
        });
    }
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(max + 1).read_to_end(&mut bytes).map_err(io)?;
    let body = decode(path, &bytes, version, key)?;
    Ok(body.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    const V: u32 = 3;

    fn p() -> &'static Path {
        Path::new("/snap/vm.state")
    }

    #[test]
    fn round_trip() {
        let f = encode("key-1", V, b"the body").unwrap();
        assert_eq!(f.len(), HEADER_LEN + 5 + 8);
        assert_eq!(decode(p(), &f, V, "key-1").unwrap(), b"the body");
        let empty = encode("", V, b"").unwrap();
        assert_eq!(decode(p(), &empty, V, "").unwrap(), b"");
    }

    #[test]
    fn every_truncation_is_refused_as_truncated() {
        let f = encode("key-1", V, b"the body").unwrap();
        for n in 0..f.len() {
            match decode(p(), &f[..n], V, "key-1") {
                Err(StateFileError::Truncated { got, .. }) => assert_eq!(got, n as u64),
                other => panic!("{n} bytes: {other:?}"),
            }
        }
    }

    #[test]
    fn every_bit_flip_is_refused() {
        let f = encode("key-1", V, b"the body").unwrap();
        for byte in 0..f.len() {
            for bit in 0..8 {
                let mut g = f.clone();
                g[byte] ^= 1 << bit;
                let e = decode(p(), &g, V, "key-1").expect_err("a flipped bit must be refused");
                // Which error depends on the field the bit is in; none is
                // a key mismatch (the CRC covers the key).
                assert!(
                    !matches!(e, StateFileError::ForeignKey { .. }),
                    "byte {byte} bit {bit}: {e}"
                );
            }
        }
    }

    #[test]
    fn wrong_key_version_magic_and_lengths() {
        let f = encode("key-1", V, b"the body").unwrap();
        assert!(matches!(
            decode(p(), &f, V, "key-2"),
            Err(StateFileError::ForeignKey { .. })
        ));
        assert!(matches!(
            decode(p(), &f, V + 1, "key-1"),
            Err(StateFileError::OlderFormat { found: V, expected, .. }) if expected == V + 1
        ));
        assert!(matches!(
            decode(p(), &f, V - 1, "key-1"),
            Err(StateFileError::NewerFormat { found: V, .. })
        ));
        let mut g = f.clone();
        g[0] = b'X';
        assert!(matches!(
            decode(p(), &g, V, "key-1"),
            Err(StateFileError::NotASnapshot { .. })
        ));
        let mut longer = f.clone();
        longer.push(0);
        assert!(matches!(
            decode(p(), &longer, V, "key-1"),
            Err(StateFileError::Corrupt { .. })
        ));
        // A huge body length is refused before anything is allocated.
        let mut huge = f.clone();
        huge[BODY_LEN_AT..BODY_LEN_AT + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        let e = decode(p(), &huge, V, "key-1").unwrap_err();
        assert!(e.to_string().contains("above the bound"), "{e}");
        assert!(matches!(
            encode(&"k".repeat(MAX_KEY_BYTES + 1), V, b""),
            Err(StateFileError::TooLong { what: "key", .. })
        ));
    }

    #[test]
    fn bodies_decode_exactly() {
        let body = encode_body(&(7u32, vec![1u8, 2, 3])).unwrap();
        let v: (u32, Vec<u8>) = decode_body(p(), &body).unwrap();
        assert_eq!(v, (7, vec![1, 2, 3]));
        assert!(decode_body::<(u32, Vec<u8>)>(p(), &body[..body.len() - 1]).is_err());
        let mut longer = body.clone();
        longer.push(9);
        assert!(decode_body::<(u32, Vec<u8>)>(p(), &longer).is_err());
        // A vector length far beyond the bytes present.
        let mut lie = 7u32.to_le_bytes().to_vec();
        lie.extend_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(decode_body::<(u32, Vec<u8>)>(p(), &lie).is_err());
    }

    #[test]
    fn read_refuses_missing_and_oversized_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vm.state");
        assert!(matches!(
            read(&path, V, "k"),
            Err(StateFileError::Io { .. })
        ));
        std::fs::write(&path, encode("k", V, b"x").unwrap()).unwrap();
        assert_eq!(read(&path, V, "k").unwrap(), b"x");
        let f = std::fs::File::create(&path).unwrap();
        f.set_len(HEADER_LEN as u64 + MAX_KEY_BYTES as u64 + MAX_BODY_BYTES + 1)
            .unwrap();
        assert!(matches!(
            read(&path, V, "k"),
            Err(StateFileError::Corrupt { .. })
        ));
    }
}
