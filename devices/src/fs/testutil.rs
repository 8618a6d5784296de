//! Test helpers shared by the virtio-fs unit tests: host fixtures, request
//! plumbing for calling `FileSystem` methods directly, and in-memory data
//! readers/writers for READ and WRITE.

use std::ffi::CString;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use fuse_backend_rs::abi::fuse_abi::CreateIn;
use fuse_backend_rs::api::filesystem::{Context, ZeroCopyReader, ZeroCopyWriter};
use fuse_backend_rs::file_buf::FileVolatileSlice;
use fuse_backend_rs::file_traits::FileReadWriteVolatile;

/// Content of the pre-existing file `pre.txt`.
pub const PRE: &[u8] = b"pre-existing";
/// Content of `sub/inner.txt`.
pub const INNER: &[u8] = b"inner";
/// Content of the file outside every grant.
pub const SECRET: &[u8] = b"host secret";

/// A temp dir with a grant root and a sibling the guest must never reach:
///
/// ```text
/// <tmp>/host/pre.txt                 "pre-existing"
/// <tmp>/host/sub/inner.txt           "inner"
/// <tmp>/host/rel_out -> ../outside/secret.txt
/// <tmp>/host/abs_out -> <tmp>/outside
/// <tmp>/outside/secret.txt           "host secret"
/// ```
pub struct Fixture {
    pub dir: tempfile::TempDir,
}

impl Fixture {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let host = dir.path().join("host");
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(host.join("sub")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(host.join("pre.txt"), PRE).unwrap();
        std::fs::write(host.join("sub/inner.txt"), INNER).unwrap();
        std::fs::write(outside.join("secret.txt"), SECRET).unwrap();
        std::fs::set_permissions(
            outside.join("secret.txt"),
            std::fs::Permissions::from_mode(0o600),
        )
        .unwrap();
        std::os::unix::fs::symlink("../outside/secret.txt", host.join("rel_out")).unwrap();
        std::os::unix::fs::symlink(&outside, host.join("abs_out")).unwrap();
        Self { dir }
    }

    pub fn host(&self) -> PathBuf {
        self.dir.path().join("host")
    }

    pub fn outside(&self) -> PathBuf {
        self.dir.path().join("outside")
    }

    /// Asserts the outside file is untouched (content, mode, no xattrs).
    pub fn assert_outside_untouched(&self) {
        let secret = self.outside().join("secret.txt");
        assert_eq!(std::fs::read(&secret).unwrap(), SECRET);
        let mode = std::fs::metadata(&secret).unwrap().permissions().mode();
        assert_eq!(mode & 0o7777, 0o600, "mode of the outside file changed");
        assert!(list_xattrs(&secret).is_empty(), "outside file got xattrs");
        let names: Vec<_> = std::fs::read_dir(self.outside())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("secret.txt")]);
    }
}

/// Extended attribute names of `path` (not following symlinks).
pub fn list_xattrs(path: &Path) -> Vec<String> {
    let p = CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    let mut buf = vec![0u8; 4096];
    // SAFETY: buf is valid for buf.len() bytes; p is NUL-terminated.
    let n = unsafe { libc::llistxattr(p.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    assert!(
        n >= 0,
        "llistxattr {path:?}: {}",
        io::Error::last_os_error()
    );
    buf.truncate(n as usize);
    buf.split(|b| *b == 0)
        .filter(|s| !s.is_empty())
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect()
}

pub fn ctx() -> Context {
    Context::new()
}

pub fn c(s: &str) -> CString {
    CString::new(s).unwrap()
}

/// The errno of a failed call (panics on success).
pub fn errno_of<T>(r: io::Result<T>) -> i32 {
    match r {
        Ok(_) => panic!("expected an error, got success"),
        Err(e) => e.raw_os_error().expect("an OS error"),
    }
}

/// CREATE arguments for a regular file.
pub fn create_args(flags: i32, mode: u32) -> CreateIn {
    CreateIn {
        flags: (flags | libc::O_CREAT) as u32,
        mode: libc::S_IFREG | mode,
        umask: 0,
        fuse_flags: 0,
    }
}

/// WRITE payload source.
pub struct DataReader {
    data: Vec<u8>,
    pos: usize,
}

impl DataReader {
    pub fn new(data: &[u8]) -> Self {
        Self {
            data: data.to_vec(),
            pos: 0,
        }
    }
}

impl io::Read for DataReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = buf.len().min(self.data.len() - self.pos);
        buf[..n].copy_from_slice(&self.data[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

impl ZeroCopyReader for DataReader {
    fn read_to(
        &mut self,
        f: &mut dyn FileReadWriteVolatile,
        count: usize,
        off: u64,
    ) -> io::Result<usize> {
        let n = count.min(self.data.len() - self.pos);
        let chunk = &mut self.data[self.pos..self.pos + n];
        // SAFETY: the slice lives for the whole call.
        let slice = unsafe { FileVolatileSlice::from_mut_slice(chunk) };
        let done = f.write_at_volatile(slice, off)?;
        self.pos += done;
        Ok(done)
    }
}

/// READ reply sink.
#[derive(Default)]
pub struct DataWriter {
    pub data: Vec<u8>,
}

impl io::Write for DataWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.data.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl ZeroCopyWriter for DataWriter {
    fn write_from(
        &mut self,
        f: &mut dyn FileReadWriteVolatile,
        count: usize,
        off: u64,
    ) -> io::Result<usize> {
        let mut buf = vec![0u8; count];
        // SAFETY: the slice lives for the whole call.
        let slice = unsafe { FileVolatileSlice::from_mut_slice(&mut buf) };
        let n = f.read_at_volatile(slice, off)?;
        self.data.extend_from_slice(&buf[..n]);
        Ok(n)
    }

    fn available_bytes(&self) -> usize {
        usize::MAX
    }
}
