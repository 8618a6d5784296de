//! One grant: a fuse-backend-rs `PassthroughFs` rooted at the grant's host
//! path, behind a policy layer that refuses what the grant's [`GrantMode`]
//! does not allow.
//!
//! [`GrantFs`] implements `FileSystem` by delegating to the passthrough
//! filesystem after checking each request; it is what
//! [`super::SessionFs`] mounts into its `Vfs` for every grant. The checks do
//! not trust the guest kernel: a request that a well-behaved kernel would
//! never send (a write on a file it could only have opened read-only, a
//! lookup of `..`) is refused here all the same.
//!
//! Policy, per mode:
//!
//! * `ro`: `EROFS` for write, create, mknod, mkdir, symlink, link, rename,
//!   unlink, rmdir, setattr, setxattr, removexattr, fallocate and for an
//!   open asking for write access or truncation; `access(W_OK)` fails with
//!   `EROFS` too.
//! * `rw`: everything `ro` refuses is allowed except removing entries the
//!   guest did not create in this grant's lifetime: unlink, rmdir, and a
//!   rename whose source or (existing) target is such an entry fail with
//!   `EPERM`. "Created" is tracked by host identity (device, inode number)
//!   of whatever create, mknod, mkdir and symlink made; an identity is
//!   forgotten when its last name is removed. A hard link the guest makes to
//!   a pre-existing file is therefore not removable either.
//! * `rwd`: no mode restriction.
//!
//! Presented owner ([`GrantFs::with_owner`], see the parent module): every
//! `stat` this layer returns (entries of lookup, create, mkdir, mknod,
//! symlink and link, getattr, setattr, readdirplus, the root entry given to
//! the `Vfs` at mount) carries the owner's uid and gid; a setattr changing
//! the uid or gid succeeds without touching the host when the new ids are
//! the presented ones (or `-1`) and fails with `EPERM` otherwise. Checks
//! made on host attributes (deletion tracking, file type) use the real ones.
//!
//! In every mode: `.` and `..` lookups are refused (`EINVAL`; the Linux
//! client only sends them for NFS export, which we do not offer), device
//! nodes cannot be created (`EPERM`), set-user-ID and set-group-ID bits are
//! cleared from the modes the guest creates files with or chmods files to
//! (a directory keeps set-group-ID), only `user.*` and POSIX ACL extended
//! attributes can be set or removed (`EPERM`: `security.capability` on a
//! host file is a host privilege), and `RENAME_WHITEOUT` is refused
//! (`EINVAL`: it creates a device node).
//!
//! Escape prevention relies on the passthrough filesystem and is verified by
//! the tests: inodes are `O_PATH` descriptors opened with `O_NOFOLLOW`
//! relative to their parent's descriptor; opening a symlink inode fails;
//! attribute and xattr changes go through `/proc/self/fd/N`, whose magic
//! link resolves to the symlink itself, never its target; `inode_file_handles`
//! is off so nothing is ever reopened with `open_by_handle_at`.
//!
//! Round trips: the server answers every open and create with
//! `FOPEN_NOFLUSH` when closing a duplicate descriptor (what the passthrough
//! does for a FUSE `FLUSH`) can have no effect: always for read-only opens,
//! and for writable ones when the file is on the grant root's filesystem and
//! that is a local one ([`LOCAL_FS_MAGICS`]: no write-back on close, no
//! deferred error, and the server holds no POSIX locks that a close would
//! drop). The guest's `close()` then costs no request; on NFS, CIFS or
//! another FUSE filesystem, and for files on anything mounted inside the
//! grant, writable opens keep their `FLUSH`, so a close still reports that
//! filesystem's errors. Linux before 5.16 ignores the flag.
//!
//! Limits: the set of created identities grows with the number of live
//! files the guest created in an `rw` grant (about 40 bytes each). A host
//! inode number reused by the host for a new file after the guest's file is
//! deleted by someone else keeps the guest's deletion right. The `rw`
//! check costs each unlink, rmdir and rename one host lookup of the name
//! (`openat(O_PATH)`, `statx`, `close`) before the removal itself: the
//! passthrough filesystem does not expose the parent's descriptor, which a
//! single `fstatat` would need. `rwd` and `ro` add no system call to any
//! request.

use std::any::Any;
use std::collections::HashSet;
use std::ffi::CStr;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use fuse_backend_rs::abi::fuse_abi::{stat64, statvfs64, CreateIn};
use fuse_backend_rs::api::filesystem::{
    Context, DirEntry, Entry, FileSystem, FsOptions, GetxattrReply, ListxattrReply, OpenOptions,
    SetattrValid, ZeroCopyReader, ZeroCopyWriter, ROOT_ID,
};
use fuse_backend_rs::api::{BackendFileSystem, VFS_MAX_INO};
use fuse_backend_rs::passthrough::{CachePolicy, Config, PassthroughFs};
use tracing::debug;

use super::{GrantMode, GrantOwner, GRANT_ATTR_TTL, GRANT_ENTRY_TTL};
use vmm::sync::MutexExt;

/// The id a chown request uses for "leave unchanged" (`(uid_t)-1`).
const UNCHANGED_ID: u32 = u32::MAX;

/// Mode bits the guest may never set on a non-directory.
const SETID_BITS: u32 = libc::S_ISUID | libc::S_ISGID;

/// Extended attribute name prefix the guest may set and remove.
const USER_XATTR_PREFIX: &[u8] = b"user.";

/// POSIX ACL attributes, which the guest may set and remove like a chmod.
const ACL_XATTRS: [&[u8]; 2] = [b"system.posix_acl_access", b"system.posix_acl_default"];

/// Open flags that make an open a write (besides the access mode).
const WRITE_OPEN_FLAGS: i32 = libc::O_TRUNC;

/// `FOPEN_NOFLUSH` (Linux 5.16, `include/uapi/linux/fuse.h`): the kernel
/// sends no `FUSE_FLUSH` when a descriptor of this open file is closed.
/// fuse-backend-rs 0.14's `OpenOptions` has no name for it.
const FOPEN_NOFLUSH: u32 = 1 << 5;

/// `statfs(2)` `f_type` of host filesystems where closing one of several
/// descriptors of an open file does nothing: no data is written back and no
/// error is reported on close (`linux/magic.h`). ext2/3/4, XFS, Btrfs,
/// tmpfs, ramfs, F2FS, bcachefs, overlayfs (over any of these) and OpenZFS.
/// Network filesystems (NFS, CIFS/SMB) and FUSE filesystems flush or report
/// errors on close and are deliberately absent.
pub const LOCAL_FS_MAGICS: [i64; 9] = [
    0xEF53,      // EXT4_SUPER_MAGIC (also ext2, ext3)
    0x5846_5342, // XFS_SUPER_MAGIC
    0x9123_683E, // BTRFS_SUPER_MAGIC
    0x0102_1994, // TMPFS_MAGIC
    0x8584_58F6, // RAMFS_MAGIC
    0xF2F5_2010, // F2FS_SUPER_MAGIC
    0xCA45_1A4E, // BCACHEFS_SUPER_MAGIC
    0x794C_7630, // OVERLAYFS_SUPER_MAGIC
    0x2FC1_2FC1, // ZFS_SUPER_MAGIC (OpenZFS)
];

/// The device of `path` when the filesystem holding it is one of
/// [`LOCAL_FS_MAGICS`]; `None` when it is not or cannot be told.
fn local_fs_dev(path: &Path) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    if !close_is_noop_on(path) {
        return None;
    }
    std::fs::metadata(path).ok().map(|m| m.dev())
}

/// Whether the filesystem holding `path` is one of [`LOCAL_FS_MAGICS`];
/// `false` when it cannot be told.
fn close_is_noop_on(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    let mut st = std::mem::MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: `c` is a NUL-terminated path and `st` a buffer of the size
    // statfs(2) writes; it is read only after the call succeeded.
    if unsafe { libc::statfs(c.as_ptr(), st.as_mut_ptr()) } != 0 {
        return false;
    }
    // SAFETY: statfs(2) returned 0, so it filled `st`.
    let f_type = unsafe { st.assume_init() }.f_type;
    LOCAL_FS_MAGICS.contains(&f_type)
}

/// `opts` with `FOPEN_NOFLUSH` added.
fn with_noflush(opts: OpenOptions) -> OpenOptions {
    // SAFETY: bitflags 1 `from_bits_unchecked` only stores the bits; the
    // value is passed on to the kernel as `fuse_open_out.open_flags` and
    // never matched against the named flags.
    unsafe { OpenOptions::from_bits_unchecked(opts.bits() | FOPEN_NOFLUSH) }
}

/// Why a grant's filesystem could not be built.
#[derive(Debug, thiserror::Error)]
pub enum GrantFsError {
    /// The host path is not valid UTF-8 (fuse-backend-rs takes roots as strings).
    #[error("host path {0:?} is not valid UTF-8; only UTF-8 host paths can be granted")]
    NonUtf8Path(PathBuf),
    /// fuse-backend-rs refused the configuration (it opens `/proc/self/fd`).
    #[error("cannot create the passthrough filesystem for {path:?}: {source}; is /proc mounted?")]
    Create {
        /// The grant's host path.
        path: PathBuf,
        /// OS error.
        source: io::Error,
    },
    /// Opening the grant's root failed.
    #[error("cannot open the granted host path {path:?}: {source}; check that it exists and is readable by the helper")]
    OpenRoot {
        /// The grant's host path.
        path: PathBuf,
        /// OS error.
        source: io::Error,
    },
}

/// Host identity of a file: (device, inode number).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct HostId {
    dev: u64,
    ino: u64,
}

impl HostId {
    fn of(attr: &stat64) -> Self {
        Self {
            dev: attr.st_dev,
            ino: attr.st_ino,
        }
    }
}

/// What a name refers to, as far as the deletion policy cares.
#[derive(Clone, Copy, Debug)]
struct Target {
    id: HostId,
    is_dir: bool,
    nlink: u64,
}

impl Target {
    /// Whether removing one name of this target removes the file for good.
    fn last_name(&self) -> bool {
        self.is_dir || self.nlink <= 1
    }
}

fn errno(code: i32) -> io::Error {
    io::Error::from_raw_os_error(code)
}

fn is_dot_or_dotdot(name: &CStr) -> bool {
    matches!(name.to_bytes(), b"." | b"..")
}

/// Clears the bits the guest may not set from `mode`, for a file of type
/// `file_type` (`S_IFMT` bits).
fn sanitize_mode(file_type: u32, mode: u32) -> u32 {
    if file_type == libc::S_IFDIR {
        mode & !libc::S_ISUID
    } else {
        mode & !SETID_BITS
    }
}

fn xattr_name_allowed(name: &CStr) -> bool {
    let n = name.to_bytes();
    n.starts_with(USER_XATTR_PREFIX) && n.len() > USER_XATTR_PREFIX.len() || ACL_XATTRS.contains(&n)
}

/// Runs `f` (which may call `PassthroughFs::import`, which sets the umask
/// to 0; `destroy` calls it too) where that umask is private: on the
/// calling thread when it has a filesystem context of its own (the
/// virtio-fs and vhost-user workers, see `vmm::threadfs`), else on a
/// short-lived thread that makes one first. Either way the thread's umask
/// is put back afterwards, and no other thread of the helper ever sees 0
/// (which would make the files it creates meanwhile world-writable).
fn with_private_umask<T: Send>(f: impl FnOnce() -> T + Send) -> io::Result<T> {
    /// `f` with the umask 0 it may set anyway, then the thread's umask back.
    fn restoring<T>(f: impl FnOnce() -> T) -> T {
        // SAFETY: umask only swaps this thread's file mode creation mask.
        let old = unsafe { libc::umask(0) };
        let out = f();
        // SAFETY: as above.
        unsafe { libc::umask(old) };
        out
    }
    if vmm::threadfs::is_private() {
        return Ok(restoring(f));
    }
    std::thread::scope(|scope| {
        std::thread::Builder::new()
            .name("grant-root".into())
            .spawn_scoped(scope, || {
                vmm::threadfs::unshare_once()?;
                Ok(restoring(f))
            })?
            .join()
            .map_err(|_| io::Error::other("the thread opening a grant's root panicked"))?
    })
}

/// A grant's filesystem: a passthrough filesystem rooted at the host path,
/// plus the mode policy. See the module docs.
pub struct GrantFs {
    inner: PassthroughFs<()>,
    mode: GrantMode,
    root: PathBuf,
    /// `<session>/<mount name>`, for logs.
    label: String,
    /// `rw` only: identities of the entries the guest created.
    created: Mutex<HashSet<HostId>>,
    /// `rw` only: serializes the deletion check with the deletion, so two
    /// guest requests cannot race a name between them.
    deletion: Mutex<()>,
    /// The grant root's device when it is on a local host filesystem:
    /// writable opens of files on that device get `FOPEN_NOFLUSH` too (see
    /// the module doc).
    local_dev: Option<u64>,
    /// The owner every reply presents instead of the host's, if any.
    owner: Option<GrantOwner>,
}

impl GrantFs {
    /// A grant of `root` (canonical: no symlink components, as the
    /// passthrough root is opened with `O_NOFOLLOW`) in `mode`, serving
    /// extended attributes if `xattr`. `label` names the grant in logs.
    pub fn new(
        root: &Path,
        mode: GrantMode,
        xattr: bool,
        label: String,
    ) -> Result<Self, GrantFsError> {
        let root_dir = root
            .to_str()
            .ok_or_else(|| GrantFsError::NonUtf8Path(root.to_path_buf()))?
            .to_string();
        let cfg = Config {
            root_dir,
            // Under a Vfs: the root is imported here, not at FUSE INIT.
            do_import: false,
            xattr,
            inode_file_handles: false,
            entry_timeout: GRANT_ENTRY_TTL,
            attr_timeout: GRANT_ATTR_TTL,
            cache_policy: CachePolicy::Auto,
            writeback: false,
            no_open: false,
            no_opendir: false,
            // See `SessionFs::new`: writes and truncations kill privileges
            // on the host side.
            killpriv_v2: true,
            use_host_ino: false,
            ..Config::default()
        };
        let inner = PassthroughFs::<()>::new(cfg).map_err(|source| GrantFsError::Create {
            path: root.to_path_buf(),
            source,
        })?;
        with_private_umask(|| inner.import())
            .and_then(|opened| opened)
            .map_err(|source| GrantFsError::OpenRoot {
                path: root.to_path_buf(),
                source,
            })?;
        Ok(Self {
            inner,
            mode,
            root: root.to_path_buf(),
            label,
            created: Mutex::new(HashSet::new()),
            deletion: Mutex::new(()),
            local_dev: local_fs_dev(root),
            owner: None,
        })
    }

    /// This grant presenting `owner` (if `Some`) as the owner of every file
    /// in it, with the chown rule of the module docs.
    pub fn with_owner(mut self, owner: Option<GrantOwner>) -> Self {
        self.owner = owner;
        self
    }

    /// The owner the grant presents, if any.
    pub fn owner(&self) -> Option<GrantOwner> {
        self.owner
    }

    /// Rewrites the owner of `attr` to the presented one, if any.
    fn present(&self, attr: &mut stat64) {
        if let Some(o) = self.owner {
            attr.st_uid = o.uid;
            attr.st_gid = o.gid;
        }
    }

    /// [`Self::present`] for an entry reply.
    fn present_entry(&self, mut e: Entry) -> Entry {
        self.present(&mut e.attr);
        e
    }

    /// Applies the chown rule to a setattr: with a presented owner, a uid or
    /// gid change to that owner (or `-1`) is dropped from `valid` (a no-op),
    /// any other one is refused with `EPERM`. Without an owner, `valid` is
    /// left alone (the host decides).
    fn owner_change(&self, attr: &stat64, valid: SetattrValid) -> io::Result<SetattrValid> {
        let Some(o) = self.owner else {
            return Ok(valid);
        };
        let ok = |wanted: u32, presented: u32| wanted == presented || wanted == UNCHANGED_ID;
        if valid.contains(SetattrValid::UID) && !ok(attr.st_uid, o.uid) {
            return Err(self.refuse("chown", libc::EPERM, "uid other than the presented owner"));
        }
        if valid.contains(SetattrValid::GID) && !ok(attr.st_gid, o.gid) {
            return Err(self.refuse("chgrp", libc::EPERM, "gid other than the presented group"));
        }
        Ok(valid - (SetattrValid::UID | SetattrValid::GID))
    }

    /// The grant's mode.
    pub fn mode(&self) -> GrantMode {
        self.mode
    }

    /// The granted host path.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// How many entries the guest created (and has not removed) in an `rw`
    /// grant; always 0 in other modes.
    pub fn created_count(&self) -> usize {
        self.created_set().len()
    }

    fn created_set(&self) -> MutexGuard<'_, HashSet<HostId>> {
        self.created.locked()
    }

    fn refuse(&self, op: &'static str, code: i32, why: &'static str) -> io::Error {
        debug!(grant = %self.label, op, why, "virtio-fs request refused");
        errno(code)
    }

    /// The options an open or create answers with: the passthrough's, plus
    /// `FOPEN_NOFLUSH` where a FLUSH would be a no-op: a read-only open, or
    /// a file on device `dev` (asked for only then) that is the grant
    /// root's local one.
    fn open_options(
        &self,
        opts: OpenOptions,
        writable: bool,
        dev: impl FnOnce() -> Option<u64>,
    ) -> OpenOptions {
        if !writable || self.local_dev.is_some_and(|local| dev() == Some(local)) {
            with_noflush(opts)
        } else {
            opts
        }
    }

    /// `EROFS` in a read-only grant.
    fn check_writable(&self, op: &'static str) -> io::Result<()> {
        if self.mode == GrantMode::Ro {
            return Err(self.refuse(op, libc::EROFS, "read-only grant"));
        }
        Ok(())
    }

    fn check_name(&self, op: &'static str, name: &CStr) -> io::Result<()> {
        if is_dot_or_dotdot(name) {
            return Err(self.refuse(op, libc::EINVAL, "dot or dot-dot name"));
        }
        Ok(())
    }

    /// Records an entry the guest just created (`rw` only).
    fn record_created(&self, entry: &Entry) {
        if self.mode == GrantMode::Rw {
            self.created_set().insert(HostId::of(&entry.attr));
        }
    }

    /// What `name` in `parent` refers to, without keeping a lookup count.
    fn target(&self, ctx: &Context, parent: u64, name: &CStr) -> io::Result<Target> {
        let e = self.inner.lookup(ctx, parent, name)?;
        self.inner.forget(ctx, e.inode, 1);
        Ok(Target {
            id: HostId::of(&e.attr),
            is_dir: e.attr.st_mode & libc::S_IFMT == libc::S_IFDIR,
            nlink: e.attr.st_nlink,
        })
    }

    /// `EPERM` unless the guest created `t` (`rw` only).
    fn check_created(&self, op: &'static str, t: &Target) -> io::Result<()> {
        if self.created_set().contains(&t.id) {
            Ok(())
        } else {
            Err(self.refuse(op, libc::EPERM, "entry not created by the guest (rw grant)"))
        }
    }

    /// Removes `name` from `parent` with `remove` under the `rw` deletion
    /// rule (the caller has already refused `ro`).
    fn delete_checked(
        &self,
        op: &'static str,
        ctx: &Context,
        parent: u64,
        name: &CStr,
        remove: impl FnOnce() -> io::Result<()>,
    ) -> io::Result<()> {
        if self.mode != GrantMode::Rw {
            return remove();
        }
        let _serial = self.deletion.locked();
        let t = self.target(ctx, parent, name)?;
        self.check_created(op, &t)?;
        remove()?;
        if t.last_name() {
            self.created_set().remove(&t.id);
        }
        Ok(())
    }

    /// Creates a file in an `rw` grant so that the caller knows whether it
    /// was created: `O_EXCL` first, then, if it existed and the guest did
    /// not ask for `O_EXCL`, a plain open of the existing file.
    fn create_tracked(
        &self,
        ctx: &Context,
        parent: u64,
        name: &CStr,
        args: CreateIn,
    ) -> io::Result<(Entry, Option<u64>, OpenOptions, Option<u32>)> {
        let excl = CreateIn {
            flags: args.flags | libc::O_EXCL as u32,
            ..args
        };
        match self.inner.create(ctx, parent, name, excl) {
            Ok(out) => {
                self.record_created(&out.0);
                Ok(out)
            }
            Err(e)
                if e.raw_os_error() == Some(libc::EEXIST)
                    && args.flags & libc::O_EXCL as u32 == 0 =>
            {
                let entry = self.inner.lookup(ctx, parent, name)?;
                let flags = args.flags & !((libc::O_CREAT | libc::O_EXCL) as u32);
                match self.inner.open(ctx, entry.inode, flags, args.fuse_flags) {
                    Ok((handle, opts, passthrough)) => Ok((entry, handle, opts, passthrough)),
                    Err(e) => {
                        self.inner.forget(ctx, entry.inode, 1);
                        Err(e)
                    }
                }
            }
            Err(e) => Err(e),
        }
    }
}

impl BackendFileSystem for GrantFs {
    /// The grant's root entry. Unlike `PassthroughFs::mount` this works for
    /// a granted regular file too (it does not look up `.` under the root).
    fn mount(&self) -> io::Result<(Entry, u64)> {
        let (mut attr, _) = self.inner.getattr(&Context::new(), ROOT_ID, None)?;
        self.present(&mut attr);
        let entry = Entry {
            inode: ROOT_ID,
            generation: 0,
            attr,
            attr_flags: 0,
            attr_timeout: GRANT_ATTR_TTL,
            entry_timeout: GRANT_ENTRY_TTL,
        };
        Ok((entry, VFS_MAX_INO))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl FileSystem for GrantFs {
    type Inode = u64;
    type Handle = u64;

    fn init(&self, capable: FsOptions) -> io::Result<FsOptions> {
        self.inner.init(capable)
    }

    fn destroy(&self) {
        // PassthroughFs::destroy re-imports the root, which sets the umask.
        if let Err(e) = with_private_umask(|| self.inner.destroy()) {
            tracing::warn!(grant = %self.label, error = %e, "virtio-fs: grant not reset at DESTROY");
        }
    }

    fn lookup(&self, ctx: &Context, parent: u64, name: &CStr) -> io::Result<Entry> {
        self.check_name("lookup", name)?;
        self.inner
            .lookup(ctx, parent, name)
            .map(|e| self.present_entry(e))
    }

    fn forget(&self, ctx: &Context, inode: u64, count: u64) {
        self.inner.forget(ctx, inode, count)
    }

    fn batch_forget(&self, ctx: &Context, requests: Vec<(u64, u64)>) {
        self.inner.batch_forget(ctx, requests)
    }

    fn getattr(
        &self,
        ctx: &Context,
        inode: u64,
        handle: Option<u64>,
    ) -> io::Result<(stat64, Duration)> {
        let (mut attr, ttl) = self.inner.getattr(ctx, inode, handle)?;
        self.present(&mut attr);
        Ok((attr, ttl))
    }

    fn setattr(
        &self,
        ctx: &Context,
        inode: u64,
        attr: stat64,
        handle: Option<u64>,
        valid: SetattrValid,
    ) -> io::Result<(stat64, Duration)> {
        self.check_writable("setattr")?;
        let valid = self.owner_change(&attr, valid)?;
        if valid.is_empty() {
            // A chown to the presented owner and nothing else.
            return self.getattr(ctx, inode, handle);
        }
        let mut attr = attr;
        if valid.contains(SetattrValid::MODE) {
            // The file type comes from the host, not from the request.
            let (current, _) = self.inner.getattr(ctx, inode, handle)?;
            let file_type = current.st_mode & libc::S_IFMT;
            if file_type == libc::S_IFLNK {
                return Err(self.refuse("setattr", libc::EOPNOTSUPP, "chmod of a symlink"));
            }
            attr.st_mode = file_type | sanitize_mode(file_type, attr.st_mode & 0o7777);
        }
        let (mut out, ttl) = self.inner.setattr(ctx, inode, attr, handle, valid)?;
        self.present(&mut out);
        Ok((out, ttl))
    }

    fn readlink(&self, ctx: &Context, inode: u64) -> io::Result<Vec<u8>> {
        self.inner.readlink(ctx, inode)
    }

    fn symlink(
        &self,
        ctx: &Context,
        linkname: &CStr,
        parent: u64,
        name: &CStr,
    ) -> io::Result<Entry> {
        self.check_writable("symlink")?;
        let entry = self.inner.symlink(ctx, linkname, parent, name)?;
        self.record_created(&entry);
        Ok(self.present_entry(entry))
    }

    fn mknod(
        &self,
        ctx: &Context,
        parent: u64,
        name: &CStr,
        mode: u32,
        _rdev: u32,
        umask: u32,
    ) -> io::Result<Entry> {
        self.check_writable("mknod")?;
        let file_type = mode & libc::S_IFMT;
        match file_type {
            0 | libc::S_IFREG | libc::S_IFIFO | libc::S_IFSOCK => {}
            _ => return Err(self.refuse("mknod", libc::EPERM, "device or unsupported node type")),
        }
        let mode = file_type | sanitize_mode(file_type, mode & 0o7777);
        let entry = self.inner.mknod(ctx, parent, name, mode, 0, umask)?;
        self.record_created(&entry);
        Ok(self.present_entry(entry))
    }

    fn mkdir(
        &self,
        ctx: &Context,
        parent: u64,
        name: &CStr,
        mode: u32,
        umask: u32,
    ) -> io::Result<Entry> {
        self.check_writable("mkdir")?;
        let mode = sanitize_mode(libc::S_IFDIR, mode & 0o7777);
        let entry = self.inner.mkdir(ctx, parent, name, mode, umask)?;
        self.record_created(&entry);
        Ok(self.present_entry(entry))
    }

    fn unlink(&self, ctx: &Context, parent: u64, name: &CStr) -> io::Result<()> {
        self.check_writable("unlink")?;
        self.delete_checked("unlink", ctx, parent, name, || {
            self.inner.unlink(ctx, parent, name)
        })
    }

    fn rmdir(&self, ctx: &Context, parent: u64, name: &CStr) -> io::Result<()> {
        self.check_writable("rmdir")?;
        self.delete_checked("rmdir", ctx, parent, name, || {
            self.inner.rmdir(ctx, parent, name)
        })
    }

    fn rename(
        &self,
        ctx: &Context,
        olddir: u64,
        oldname: &CStr,
        newdir: u64,
        newname: &CStr,
        flags: u32,
    ) -> io::Result<()> {
        self.check_writable("rename")?;
        if flags & libc::RENAME_WHITEOUT != 0 {
            return Err(self.refuse("rename", libc::EINVAL, "RENAME_WHITEOUT"));
        }
        if self.mode != GrantMode::Rw {
            return self
                .inner
                .rename(ctx, olddir, oldname, newdir, newname, flags);
        }
        let _serial = self.deletion.locked();
        let source = self.target(ctx, olddir, oldname)?;
        self.check_created("rename", &source)?;
        // With RENAME_NOREPLACE nothing is replaced: an existing target
        // makes the host fail the rename with EEXIST.
        let probe = if flags & libc::RENAME_NOREPLACE != 0 {
            Err(errno(libc::ENOENT))
        } else {
            self.target(ctx, newdir, newname)
        };
        let replaced = match probe {
            Ok(t) => {
                self.check_created("rename", &t)?;
                (flags & libc::RENAME_EXCHANGE == 0 && t.id != source.id).then_some(t)
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => None,
            Err(e) => return Err(e),
        };
        self.inner
            .rename(ctx, olddir, oldname, newdir, newname, flags)?;
        if let Some(t) = replaced.filter(Target::last_name) {
            self.created_set().remove(&t.id);
        }
        Ok(())
    }

    fn link(&self, ctx: &Context, inode: u64, newparent: u64, newname: &CStr) -> io::Result<Entry> {
        self.check_writable("link")?;
        self.inner
            .link(ctx, inode, newparent, newname)
            .map(|e| self.present_entry(e))
    }

    fn open(
        &self,
        ctx: &Context,
        inode: u64,
        flags: u32,
        fuse_flags: u32,
    ) -> io::Result<(Option<u64>, OpenOptions, Option<u32>)> {
        let f = flags as i32;
        let writable = f & libc::O_ACCMODE != libc::O_RDONLY || f & WRITE_OPEN_FLAGS != 0;
        if writable {
            self.check_writable("open for writing")?;
        }
        let (handle, opts, passthrough) = self.inner.open(ctx, inode, flags, fuse_flags)?;
        let dev = || {
            self.inner
                .getattr(ctx, inode, handle)
                .ok()
                .map(|(st, _)| st.st_dev)
        };
        Ok((handle, self.open_options(opts, writable, dev), passthrough))
    }

    fn create(
        &self,
        ctx: &Context,
        parent: u64,
        name: &CStr,
        args: CreateIn,
    ) -> io::Result<(Entry, Option<u64>, OpenOptions, Option<u32>)> {
        self.check_writable("create")?;
        let file_type = libc::S_IFREG;
        let args = CreateIn {
            mode: file_type | sanitize_mode(file_type, args.mode & 0o7777),
            ..args
        };
        let (entry, handle, opts, passthrough) = if self.mode == GrantMode::Rw {
            self.create_tracked(ctx, parent, name, args)?
        } else {
            self.inner.create(ctx, parent, name, args)?
        };
        let dev = entry.attr.st_dev;
        Ok((
            self.present_entry(entry),
            handle,
            self.open_options(opts, true, || Some(dev)),
            passthrough,
        ))
    }

    #[allow(clippy::too_many_arguments)]
    fn read(
        &self,
        ctx: &Context,
        inode: u64,
        handle: u64,
        w: &mut dyn ZeroCopyWriter,
        size: u32,
        offset: u64,
        lock_owner: Option<u64>,
        flags: u32,
    ) -> io::Result<usize> {
        self.inner
            .read(ctx, inode, handle, w, size, offset, lock_owner, flags)
    }

    #[allow(clippy::too_many_arguments)]
    fn write(
        &self,
        ctx: &Context,
        inode: u64,
        handle: u64,
        r: &mut dyn ZeroCopyReader,
        size: u32,
        offset: u64,
        lock_owner: Option<u64>,
        delayed_write: bool,
        flags: u32,
        fuse_flags: u32,
    ) -> io::Result<usize> {
        self.check_writable("write")?;
        self.inner.write(
            ctx,
            inode,
            handle,
            r,
            size,
            offset,
            lock_owner,
            delayed_write,
            flags,
            fuse_flags,
        )
    }

    fn flush(&self, ctx: &Context, inode: u64, handle: u64, lock_owner: u64) -> io::Result<()> {
        self.inner.flush(ctx, inode, handle, lock_owner)
    }

    fn fsync(&self, ctx: &Context, inode: u64, datasync: bool, handle: u64) -> io::Result<()> {
        self.inner.fsync(ctx, inode, datasync, handle)
    }

    fn fallocate(
        &self,
        ctx: &Context,
        inode: u64,
        handle: u64,
        mode: u32,
        offset: u64,
        length: u64,
    ) -> io::Result<()> {
        self.check_writable("fallocate")?;
        self.inner
            .fallocate(ctx, inode, handle, mode, offset, length)
    }

    fn release(
        &self,
        ctx: &Context,
        inode: u64,
        flags: u32,
        handle: u64,
        flush: bool,
        flock_release: bool,
        lock_owner: Option<u64>,
    ) -> io::Result<()> {
        self.inner
            .release(ctx, inode, flags, handle, flush, flock_release, lock_owner)
    }

    fn statfs(&self, ctx: &Context, inode: u64) -> io::Result<statvfs64> {
        self.inner.statfs(ctx, inode)
    }

    fn setxattr(
        &self,
        ctx: &Context,
        inode: u64,
        name: &CStr,
        value: &[u8],
        flags: u32,
    ) -> io::Result<()> {
        self.check_writable("setxattr")?;
        if !xattr_name_allowed(name) {
            return Err(self.refuse("setxattr", libc::EPERM, "xattr namespace not allowed"));
        }
        self.inner.setxattr(ctx, inode, name, value, flags)
    }

    fn getxattr(
        &self,
        ctx: &Context,
        inode: u64,
        name: &CStr,
        size: u32,
    ) -> io::Result<GetxattrReply> {
        self.inner.getxattr(ctx, inode, name, size)
    }

    fn listxattr(&self, ctx: &Context, inode: u64, size: u32) -> io::Result<ListxattrReply> {
        self.inner.listxattr(ctx, inode, size)
    }

    fn removexattr(&self, ctx: &Context, inode: u64, name: &CStr) -> io::Result<()> {
        self.check_writable("removexattr")?;
        if !xattr_name_allowed(name) {
            return Err(self.refuse("removexattr", libc::EPERM, "xattr namespace not allowed"));
        }
        self.inner.removexattr(ctx, inode, name)
    }

    fn opendir(
        &self,
        ctx: &Context,
        inode: u64,
        flags: u32,
    ) -> io::Result<(Option<u64>, OpenOptions)> {
        self.inner.opendir(ctx, inode, flags)
    }

    fn readdir(
        &self,
        ctx: &Context,
        inode: u64,
        handle: u64,
        size: u32,
        offset: u64,
        add_entry: &mut dyn FnMut(DirEntry) -> io::Result<usize>,
    ) -> io::Result<()> {
        self.inner
            .readdir(ctx, inode, handle, size, offset, add_entry)
    }

    fn readdirplus(
        &self,
        ctx: &Context,
        inode: u64,
        handle: u64,
        size: u32,
        offset: u64,
        add_entry: &mut dyn FnMut(DirEntry, Entry) -> io::Result<usize>,
    ) -> io::Result<()> {
        if self.owner.is_none() {
            return self
                .inner
                .readdirplus(ctx, inode, handle, size, offset, add_entry);
        }
        self.inner
            .readdirplus(ctx, inode, handle, size, offset, &mut |d, e| {
                add_entry(d, self.present_entry(e))
            })
    }

    fn fsyncdir(&self, ctx: &Context, inode: u64, datasync: bool, handle: u64) -> io::Result<()> {
        self.inner.fsyncdir(ctx, inode, datasync, handle)
    }

    fn releasedir(&self, ctx: &Context, inode: u64, flags: u32, handle: u64) -> io::Result<()> {
        self.inner.releasedir(ctx, inode, flags, handle)
    }

    fn access(&self, ctx: &Context, inode: u64, mask: u32) -> io::Result<()> {
        if mask as i32 & libc::W_OK != 0 {
            self.check_writable("access(W_OK)")?;
        }
        self.inner.access(ctx, inode, mask)
    }

    fn lseek(
        &self,
        ctx: &Context,
        inode: u64,
        handle: u64,
        offset: u64,
        whence: u32,
    ) -> io::Result<u64> {
        self.inner.lseek(ctx, inode, handle, offset, whence)
    }
}

#[cfg(test)]
mod tests;
