//! Turning process output bytes into the JSON strings of `stdout`/`stderr`
//! events. Chunks may split a multi-byte UTF-8 sequence; the incomplete tail
//! is carried into the next chunk so text is never mangled at a boundary.
//! Bytes that are not UTF-8 at all become U+FFFD (the client's event `data`
//! is a string; it cannot carry raw bytes).

/// Longest UTF-8 sequence; a carried tail is always shorter.
const MAX_SEQ: usize = 4;

/// Per-stream decoder state.
#[derive(Default, Debug)]
pub struct Utf8Stream {
    carry: Vec<u8>,
}

impl Utf8Stream {
    /// Decodes `chunk`, keeping an incomplete trailing sequence for later.
    pub fn push(&mut self, chunk: &[u8]) -> String {
        self.push_with(chunk, str::to_owned)
    }

    /// Decodes `chunk` and hands the text to `f` without copying it when
    /// the chunk is valid UTF-8 and nothing was carried (the common case).
    pub fn push_with<R>(&mut self, chunk: &[u8], f: impl FnOnce(&str) -> R) -> R {
        let joined;
        let data: &[u8] = if self.carry.is_empty() {
            chunk
        } else {
            let mut buf = std::mem::take(&mut self.carry);
            buf.extend_from_slice(chunk);
            joined = buf;
            &joined
        };
        let keep = incomplete_tail(data);
        let (body, tail) = data.split_at(data.len() - keep);
        self.carry.extend_from_slice(tail);
        match std::str::from_utf8(body) {
            Ok(s) => f(s),
            Err(_) => f(&String::from_utf8_lossy(body)),
        }
    }

    /// Flushes a carried tail at end of stream (as U+FFFD).
    pub fn finish(&mut self) -> Option<String> {
        if self.carry.is_empty() {
            return None;
        }
        let tail = std::mem::take(&mut self.carry);
        Some(String::from_utf8_lossy(&tail).into_owned())
    }
}

/// Length of a trailing prefix of a valid multi-byte sequence that needs more bytes.
fn incomplete_tail(data: &[u8]) -> usize {
    let n = data.len();
    for back in 1..=MAX_SEQ.min(n) {
        let b = data[n - back];
        if b & 0xC0 == 0x80 {
            continue; // continuation byte: keep looking for the lead byte
        }
        let need = match b {
            0xC2..=0xDF => 2,
            0xE0..=0xEF => 3,
            0xF0..=0xF4 => 4,
            _ => return 0,
        };
        return if need > back { back } else { 0 };
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_sequences_are_rejoined() {
        let text = "héllo ✓ 𝄞 end";
        let bytes = text.as_bytes();
        for cut in 0..bytes.len() {
            let mut s = Utf8Stream::default();
            let mut out = s.push(&bytes[..cut]);
            out += &s.push(&bytes[cut..]);
            assert!(s.finish().is_none());
            assert_eq!(out, text, "cut at {cut}");
        }
    }

    #[test]
    fn invalid_bytes_become_replacement() {
        let mut s = Utf8Stream::default();
        assert_eq!(s.push(b"a\xffb"), "a\u{fffd}b");
        assert_eq!(s.push(b"x\xe2\x9c"), "x");
        assert_eq!(s.finish().as_deref(), Some("\u{fffd}"));
    }
}
