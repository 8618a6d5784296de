//! Length-prefixed framing shared by the client socket and the host<->agent link.
//!
//! Every frame is a 4-byte big-endian body length followed by the body. The
//! client protocol caps bodies at [`MAX_CLIENT_FRAME`] (10 MiB, as the desktop
//! client does); the agent link uses the same cap. A frame whose announced
//! length exceeds the cap is reported as [`FrameError::TooLarge`] *before* its
//! body is read: the caller decides whether to answer and close, because the
//! stream position is then no longer on a frame boundary.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Largest body the desktop client sends or accepts (its own limit).
pub const MAX_CLIENT_FRAME: usize = 10 * 1024 * 1024;

/// Size of the big-endian length prefix.
pub const PREFIX_LEN: usize = 4;

/// Errors of the framing layer.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The peer announced a body larger than we accept; framing is lost.
    #[error("frame of {len} bytes exceeds the {max}-byte limit")]
    TooLarge { len: usize, max: usize },
    /// The stream ended inside a frame.
    #[error("connection closed in the middle of a frame ({got} of {want} bytes)")]
    Truncated { got: usize, want: usize },
    /// Any other I/O failure.
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
}

/// Reads one frame body into `buf` (replacing its contents).
///
/// Returns `Ok(false)` on a clean end of stream at a frame boundary.
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    max: usize,
    buf: &mut Vec<u8>,
) -> Result<bool, FrameError> {
    let mut prefix = [0u8; PREFIX_LEN];
    let mut got = 0;
    while got < PREFIX_LEN {
        let n = r.read(&mut prefix[got..]).await?;
        if n == 0 {
            if got == 0 {
                return Ok(false);
            }
            return Err(FrameError::Truncated {
                got,
                want: PREFIX_LEN,
            });
        }
        got += n;
    }
    let len = u32::from_be_bytes(prefix) as usize;
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    buf.clear();
    buf.resize(len, 0);
    let mut got = 0;
    while got < len {
        let n = r.read(&mut buf[got..]).await?;
        if n == 0 {
            return Err(FrameError::Truncated { got, want: len });
        }
        got += n;
    }
    Ok(true)
}

/// Appends the length prefix and `body` to `out` (for batching several frames
/// into one write).
pub fn encode_frame_into(out: &mut Vec<u8>, body: &[u8]) {
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(body);
}

/// Writes one frame. The caller is responsible for `body.len()` fitting the
/// peer's limit; larger bodies are refused here rather than truncated.
pub async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    body: &[u8],
    max: usize,
) -> Result<(), FrameError> {
    if body.len() > max {
        return Err(FrameError::TooLarge {
            len: body.len(),
            max,
        });
    }
    w.write_all(&(body.len() as u32).to_be_bytes()).await?;
    w.write_all(body).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn round_trip_and_clean_eof() {
        let mut wire = Vec::new();
        encode_frame_into(&mut wire, b"{\"a\":1}");
        encode_frame_into(&mut wire, b"");
        let mut r = &wire[..];
        let mut buf = Vec::new();
        assert!(read_frame(&mut r, 100, &mut buf).await.unwrap());
        assert_eq!(buf, b"{\"a\":1}");
        assert!(read_frame(&mut r, 100, &mut buf).await.unwrap());
        assert!(buf.is_empty());
        assert!(!read_frame(&mut r, 100, &mut buf).await.unwrap());
    }

    #[tokio::test]
    async fn too_large_is_reported_before_reading_the_body() {
        let wire = 1_000u32.to_be_bytes();
        let mut r = &wire[..];
        let err = read_frame(&mut r, 999, &mut Vec::new()).await.unwrap_err();
        assert!(matches!(
            err,
            FrameError::TooLarge {
                len: 1000,
                max: 999
            }
        ));
    }

    #[tokio::test]
    async fn truncated_prefix_and_body() {
        let mut r = &[0u8, 0][..];
        let err = read_frame(&mut r, 10, &mut Vec::new()).await.unwrap_err();
        assert!(matches!(err, FrameError::Truncated { got: 2, want: 4 }));
        let mut r = &[0u8, 0, 0, 5, b'a'][..];
        let err = read_frame(&mut r, 10, &mut Vec::new()).await.unwrap_err();
        assert!(matches!(err, FrameError::Truncated { got: 1, want: 5 }));
    }

    #[tokio::test]
    async fn write_refuses_oversized_body() {
        let mut out = Vec::new();
        assert!(write_frame(&mut out, &[0; 11], 10).await.is_err());
        assert!(out.is_empty());
        write_frame(&mut out, b"hi", 10).await.unwrap();
        assert_eq!(out, [0, 0, 0, 2, b'h', b'i']);
    }
}
