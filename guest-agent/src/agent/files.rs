//! `ReadFile`: reading a file of a session without escaping it.
//!
//! The path is absolute (then it must lie under `<sessions-root>/<session>`)
//! or relative to that session directory. It is opened with `openat2`
//! relative to a descriptor of the session directory with
//! `RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS`: neither `..` nor a symlink
//! (absolute or relative) can leave the directory, atomically, whatever the
//! session's processes do concurrently. Mounts inside the session (`mnt/…`)
//! are followed, they are part of the session's view.
//!
//! On kernels without `openat2` (before 5.6) the fallback canonicalizes the
//! path and checks the prefix; that has a check-then-open race with a
//! concurrently swapped symlink, which is the documented limit of the
//! fallback. Only regular files up to [`MAX_READ_FILE`] bytes are read (what fits one
//! client frame after base64).

use std::io::{self, Read};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use crate::names;
use crate::sys;

/// Room left in a client frame for the JSON envelope around `content`.
const CLIENT_ENVELOPE_SLACK: usize = 64 * 1024;

/// Largest file `ReadFile` returns. The host hands the bytes to the client
/// base64-encoded (4 output bytes per 3 input bytes) inside one frame of at
/// most [`crate::framing::MAX_CLIENT_FRAME`] (10 MiB), so a file must stay
/// below 3/4 of that, minus the envelope: about 7.45 MiB. (A flat 8 MiB
/// would encode to 10.7 MiB and not fit.)
pub const MAX_READ_FILE: u64 =
    ((crate::framing::MAX_CLIENT_FRAME - CLIENT_ENVELOPE_SLACK) / 4 * 3) as u64;

/// Why a file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadFileError {
    #[error(transparent)]
    Name(#[from] names::NameError),
    #[error("session {0:?} does not exist")]
    NoSession(String),
    #[error("{path:?} is outside the session directory")]
    Escapes { path: String },
    #[error("{path:?} does not exist")]
    NotFound { path: String },
    #[error("{path:?} is not a regular file")]
    NotAFile { path: String },
    #[error("{path:?} is {size} bytes; files larger than {max} bytes cannot be read this way")]
    TooLarge { path: String, size: u64, max: u64 },
    #[error("cannot read {path:?}: {source}")]
    Io { path: String, source: io::Error },
}

/// Reads `path` of `session` below `sessions_root`.
pub fn read_session_file(
    sessions_root: &Path,
    session: &str,
    path: &str,
) -> Result<Vec<u8>, ReadFileError> {
    read_session_file_with(sessions_root, session, path, false)
}

/// As [`read_session_file`]; `force_fallback` skips `openat2` (for tests).
pub(crate) fn read_session_file_with(
    sessions_root: &Path,
    session: &str,
    path: &str,
    force_fallback: bool,
) -> Result<Vec<u8>, ReadFileError> {
    names::session_name(session)?;
    let session_dir = sessions_root.join(session);
    let rel = relative_to_session(&session_dir, path)?;
    let io_err = |e: io::Error| map_open_error(path, e);
    let dirfd = sys::open(
        &session_dir,
        libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW,
    )
    .map_err(|_| ReadFileError::NoSession(session.to_string()))?;
    let flags = libc::O_RDONLY | libc::O_NOCTTY | libc::O_NONBLOCK;
    let file = if force_fallback {
        open_fallback(&session_dir, &rel, flags).map_err(io_err)?
    } else {
        let crel = sys::cstring(&rel).map_err(io_err)?;
        let resolve = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_MAGICLINKS;
        match sys::openat2(dirfd.as_fd(), &crel, flags, resolve) {
            Err(e) if sys::errno_of(&e) == libc::ENOSYS => {
                open_fallback(&session_dir, &rel, flags).map_err(io_err)?
            }
            other => other.map_err(io_err)?,
        }
    };
    read_regular(file, path)
}

/// The path relative to the session directory, refusing absolute paths
/// elsewhere. `..` is left for the kernel to judge (it may stay inside).
fn relative_to_session(session_dir: &Path, path: &str) -> Result<PathBuf, ReadFileError> {
    if path.is_empty() || path.contains('\0') {
        return Err(ReadFileError::NotFound {
            path: path.to_string(),
        });
    }
    let p = Path::new(path);
    let rel = if p.is_absolute() {
        p.strip_prefix(session_dir)
            .map_err(|_| ReadFileError::Escapes {
                path: path.to_string(),
            })?
            .to_path_buf()
    } else {
        p.to_path_buf()
    };
    if rel.as_os_str().is_empty() {
        return Err(ReadFileError::NotAFile {
            path: path.to_string(),
        });
    }
    Ok(rel)
}

fn map_open_error(path: &str, e: io::Error) -> ReadFileError {
    let path = path.to_string();
    match sys::errno_of(&e) {
        libc::EXDEV | libc::ELOOP => ReadFileError::Escapes { path },
        libc::ENOENT | libc::ENOTDIR => ReadFileError::NotFound { path },
        _ => ReadFileError::Io { path, source: e },
    }
}

/// Pre-`openat2` resolution: canonicalize and require the session prefix.
fn open_fallback(session_dir: &Path, rel: &Path, flags: libc::c_int) -> io::Result<OwnedFd> {
    let base = session_dir.canonicalize()?;
    let mut joined = base.clone();
    for c in rel.components() {
        match c {
            Component::Normal(n) => joined.push(n),
            Component::ParentDir => joined.push(".."),
            _ => {}
        }
    }
    let real = joined.canonicalize()?;
    if !real.starts_with(&base) {
        return Err(io::Error::from_raw_os_error(libc::EXDEV));
    }
    sys::open(&real, flags | libc::O_NOFOLLOW)
}

fn read_regular(file: OwnedFd, path: &str) -> Result<Vec<u8>, ReadFileError> {
    let io_err = |e| ReadFileError::Io {
        path: path.to_string(),
        source: e,
    };
    let st = sys::fstat(file.as_fd()).map_err(io_err)?;
    if !st.is_file() {
        return Err(ReadFileError::NotAFile {
            path: path.to_string(),
        });
    }
    if st.size > MAX_READ_FILE {
        return Err(ReadFileError::TooLarge {
            path: path.to_string(),
            size: st.size,
            max: MAX_READ_FILE,
        });
    }
    let mut out = Vec::with_capacity(st.size as usize);
    // Read one byte past the limit to notice a file that grew meanwhile.
    std::fs::File::from(file)
        .take(MAX_READ_FILE + 1)
        .read_to_end(&mut out)
        .map_err(io_err)?;
    if out.len() as u64 > MAX_READ_FILE {
        return Err(ReadFileError::TooLarge {
            path: path.to_string(),
            size: out.len() as u64,
            max: MAX_READ_FILE,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn layout() -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        let s = root.path().join("s1");
        std::fs::create_dir_all(s.join("sub")).unwrap();
        std::fs::create_dir_all(root.path().join("s2")).unwrap();
        std::fs::write(s.join("a.txt"), b"alpha").unwrap();
        std::fs::write(s.join("sub/b.txt"), b"beta").unwrap();
        std::fs::write(root.path().join("s2/secret"), b"other session").unwrap();
        symlink("sub/b.txt", s.join("inside-link")).unwrap();
        symlink("/etc/hostname", s.join("abs-link")).unwrap();
        symlink("../s2/secret", s.join("rel-escape")).unwrap();
        symlink("/proc/self/root/etc/hostname", s.join("magic")).unwrap();
        symlink(root.path().join("s2"), root.path().join("linked")).unwrap();
        root
    }

    fn check_all(fallback: bool) {
        let root = layout();
        let r = root.path();
        let read = |p: &str| read_session_file_with(r, "s1", p, fallback);
        assert_eq!(read("a.txt").unwrap(), b"alpha");
        assert_eq!(read("sub/../a.txt").unwrap(), b"alpha");
        assert_eq!(read("inside-link").unwrap(), b"beta");
        let abs = r.join("s1/sub/b.txt");
        assert_eq!(read(abs.to_str().unwrap()).unwrap(), b"beta");
        for bad in [
            "../s2/secret",
            "abs-link",
            "rel-escape",
            "magic",
            "sub/../../s2/secret",
        ] {
            let err = read(bad).unwrap_err();
            assert!(matches!(err, ReadFileError::Escapes { .. }), "{bad}: {err}");
        }
        let other = r.join("s2/secret");
        assert!(matches!(
            read(other.to_str().unwrap()),
            Err(ReadFileError::Escapes { .. })
        ));
        assert!(matches!(
            read("/etc/hostname"),
            Err(ReadFileError::Escapes { .. })
        ));
        assert!(matches!(read("nope"), Err(ReadFileError::NotFound { .. })));
        assert!(matches!(read("sub"), Err(ReadFileError::NotAFile { .. })));
        assert!(matches!(
            read_session_file_with(r, "..", "a.txt", fallback),
            Err(ReadFileError::Name(_))
        ));
        assert!(matches!(
            read_session_file_with(r, "missing", "a.txt", fallback),
            Err(ReadFileError::NoSession(_))
        ));
        // A session directory that is a symlink is not a session.
        assert!(matches!(
            read_session_file_with(r, "linked", "secret", fallback),
            Err(ReadFileError::NoSession(_))
        ));
    }

    #[test]
    fn openat2_resolution_stays_inside() {
        check_all(false);
    }

    #[test]
    fn fallback_resolution_stays_inside() {
        check_all(true);
    }

    #[test]
    fn large_files_are_refused() {
        let root = layout();
        let f = std::fs::File::create(root.path().join("s1/big")).unwrap();
        f.set_len(MAX_READ_FILE + 1).unwrap();
        let err = read_session_file(root.path(), "s1", "big").unwrap_err();
        assert!(matches!(err, ReadFileError::TooLarge { .. }));
        assert!(err.to_string().contains("larger than"), "{err}");
        f.set_len(MAX_READ_FILE).unwrap();
        assert_eq!(
            read_session_file(root.path(), "s1", "big").unwrap().len() as u64,
            MAX_READ_FILE
        );
    }
}
