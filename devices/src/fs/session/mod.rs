//! [`SessionFs`]: the exported virtual tree of session grants, and the grant
//! table that changes it at runtime.
//!
//! A fuse-backend-rs `Vfs` does the routing: its pseudo filesystem holds the
//! virtual directories (`/`, `/<session>`, intermediate mount-name
//! components) and each grant is a [`GrantFs`] mounted at
//! `/<session>/<mount name>`. `Vfs` inode numbers carry the grant's 8-bit
//! filesystem index in their top byte (0 = virtual directory), which is how
//! this layer tells the virtual tree from grants and grants from each other.
//!
//! On top of the `Vfs` this layer:
//!
//! * keeps the virtual directories read-only (`EROFS`), presents them as
//!   mode 0555 with a short cache lifetime ([`super::VIRTUAL_DIR_TTL`]), and
//!   answers every request on them itself where the `Vfs` would answer
//!   `ENOSYS` (the Linux client takes `ENOSYS` from `create`, `opendir`, the
//!   xattr calls... as "never supported" for the whole mount);
//! * refuses renames and hard links between grants with `EXDEV` (the `Vfs`
//!   says `EINVAL`), so `mv` falls back to copy and delete, each checked by
//!   its grant's policy;
//! * refreshes the attributes of a grant root on lookup (the `Vfs` returns
//!   the ones captured when the grant was mounted);
//! * refuses `.` and `..` lookups;
//! * gives each grant its presented owner ([`GrantOwner`], applied by
//!   [`GrantFs`]) and keeps the virtual directories owned by root;
//! * maps credentials ([`Credentials`]);
//! * re-initializes cleanly when a driver sends FUSE INIT again (guest
//!   reboot or driver reload without DESTROY).
//!
//! Grants are added and removed while the filesystem is being served. A
//! grant's removal unmounts it from the `Vfs` (requests on its inodes then
//! fail with `ENOENT`) and removes the virtual directories no other grant
//! needs, so a removed session's directory disappears from the tree.
//!
//! Limits: see the parent module. The `Vfs` recycles filesystem indexes
//! round-robin, so after 255 further grants a guest still holding inode
//! numbers of a removed grant could address inodes of a new grant with the
//! same index; those are inside a granted path and under that grant's
//! policy, so the host guarantees hold, but sessions are not isolated from
//! each other inside one guest (that is the agent's job).

use std::collections::BTreeMap;
use std::ffi::CStr;
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use fuse_backend_rs::abi::fuse_abi::{stat64, statvfs64, CreateIn};
use fuse_backend_rs::api::filesystem::{
    Context, DirEntry, Entry, FileSystem, FsOptions, GetxattrReply, ListxattrReply, OpenOptions,
    SetattrValid, ZeroCopyReader, ZeroCopyWriter,
};
use fuse_backend_rs::api::{Vfs, VfsIndex, VfsOptions, VFS_MAX_INO};
use tracing::{debug, info, warn};

use super::policy::{GrantFs, GrantFsError};
use super::{
    GrantMode, GrantOwner, MAX_GRANTS, MAX_MOUNT_NAME, MAX_NAME_COMPONENT, VIRTUAL_DIR_TTL,
};
use vmm::sync::MutexExt;

/// Bit position of the grant's filesystem index in a `Vfs` inode number.
const FS_INDEX_SHIFT: u32 = VFS_MAX_INO.count_ones();

/// Permission bits the virtual directories show (read and search only).
const VIRTUAL_DIR_PERMS: u32 = 0o555;

/// Owner (uid and gid) the virtual directories show: root, whatever the
/// grants below them present. Nothing in them is writable anyway, and
/// session processes never see them (the agent binds grants elsewhere).
const VIRTUAL_DIR_OWNER: u32 = 0;

/// Whether `ino` is a virtual directory (filesystem index 0).
fn is_virtual(ino: u64) -> bool {
    ino & !VFS_MAX_INO == 0
}

/// The filesystem index of `ino` (0 for virtual directories).
fn fs_index(ino: u64) -> u64 {
    ino >> FS_INDEX_SHIFT
}

fn errno(code: i32) -> io::Error {
    io::Error::from_raw_os_error(code)
}

/// Identifies one grant of a [`SessionFs`]; never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GrantId(u64);

impl GrantId {
    /// The raw number (for logs and protocol replies).
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for GrantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "grant#{}", self.0)
    }
}

/// Whose credentials files are created with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Credentials {
    /// The helper's own: the guest's uid and gid are ignored, files belong
    /// to the user running the helper, and permission checks inside grants
    /// are left to the guest kernel. Works unprivileged (the default).
    #[default]
    Helper,
    /// The requesting guest process's uid and gid (switched per request and
    /// thread). Needs CAP_SETUID and CAP_SETGID, i.e. a root helper.
    Guest,
}

/// How a [`SessionFs`] behaves.
#[derive(Clone, Copy, Debug, Default)]
pub struct SessionFsOptions {
    /// Whose credentials files are created with.
    pub credentials: Credentials,
    /// Serve extended attributes (`user.*` and POSIX ACLs may be set, any
    /// may be read). Off by default, as in virtiofsd: while a mount serves
    /// xattrs, the guest kernel asks for `security.capability` before the
    /// first write to every file (and again after each attribute refresh),
    /// one round trip per written file. Off, every xattr request is answered
    /// `ENOSYS`, which the Linux client remembers for the whole mount
    /// (programs then see `EOPNOTSUPP`).
    pub xattr: bool,
}

/// A grant as listed by [`SessionFs::grants`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GrantInfo {
    /// The grant's id.
    pub id: GrantId,
    /// Session name (first component of the guest path).
    pub session: String,
    /// Mount name under the session (`.claude/skills`).
    pub mount_name: String,
    /// The granted host path, canonicalized at grant time.
    pub host_path: PathBuf,
    /// What the guest may do.
    pub mode: GrantMode,
    /// Where it appears in the exported tree: `/<session>/<mount name>`.
    pub guest_path: String,
    /// The owner it presents to the guest; `None` shows the host's.
    pub owner: Option<GrantOwner>,
}

/// Why a grant could not be added or removed.
#[derive(Debug, thiserror::Error)]
pub enum SessionFsError {
    /// The session name cannot be a path component.
    #[error("session name {name:?} is invalid: {reason}")]
    InvalidSession {
        /// The refused name.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The mount name is not a relative path of safe components.
    #[error("mount name {name:?} is invalid: {reason}")]
    InvalidMountName {
        /// The refused name.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Host paths must be absolute.
    #[error("host path {0:?} is not absolute; grant absolute host paths only")]
    RelativeHostPath(PathBuf),
    /// Resolving the host path failed.
    #[error("cannot resolve host path {path:?}: {source}; check that it exists")]
    HostPath {
        /// The host path as given.
        path: PathBuf,
        /// OS error.
        source: io::Error,
    },
    /// The host root is never shared.
    #[error("host path {0:?} resolves to the host root, which is never shared; grant a directory below it")]
    HostRoot(PathBuf),
    /// Only directories and regular files can be granted.
    #[error(
        "host path {0:?} is neither a directory nor a regular file; only those can be granted"
    )]
    UnsupportedFileType(PathBuf),
    /// A grant inside another grant of the same session (or around one).
    #[error("mount name {mount_name:?} of session {session:?} would nest with existing mount {other:?}; grants of a session must not contain each other")]
    Nested {
        /// Session name.
        session: String,
        /// The new mount name.
        mount_name: String,
        /// The existing mount name it nests with.
        other: String,
    },
    /// All filesystem indexes are in use.
    #[error("too many grants: at most {max} can be active at once; remove a session first")]
    TooManyGrants {
        /// The limit.
        max: usize,
    },
    /// Building the grant's filesystem failed.
    #[error(transparent)]
    Grant(#[from] GrantFsError),
    /// The `Vfs` refused the mount.
    #[error("cannot mount grant at {guest_path}: {reason}")]
    Mount {
        /// Where it was to appear.
        guest_path: String,
        /// The `Vfs` error.
        reason: String,
    },
    /// No such grant.
    #[error("{0} does not exist (already removed?)")]
    UnknownGrant(GrantId),
    /// The `Vfs` refused the unmount; the grant is forgotten anyway.
    #[error("cannot unmount grant at {guest_path}: {reason}")]
    Unmount {
        /// Where it appeared.
        guest_path: String,
        /// The `Vfs` error.
        reason: String,
    },
}

/// One active grant.
struct GrantRecord {
    session: String,
    mount_name: String,
    host_path: PathBuf,
    mode: GrantMode,
    owner: Option<GrantOwner>,
    /// `/<session>/<mount name>`.
    vfs_path: String,
    fs_index: VfsIndex,
}

impl GrantRecord {
    fn info(&self, id: GrantId) -> GrantInfo {
        GrantInfo {
            id,
            session: self.session.clone(),
            mount_name: self.mount_name.clone(),
            host_path: self.host_path.clone(),
            mode: self.mode,
            guest_path: self.vfs_path.clone(),
            owner: self.owner,
        }
    }
}

/// Checks one path component; returns what is wrong with it.
fn component_problem(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        Some("empty component")
    } else if name.len() > MAX_NAME_COMPONENT {
        Some("component longer than 255 bytes")
    } else if name == "." || name == ".." {
        Some("'.' and '..' are not names")
    } else if name.contains('/') {
        Some("contains '/'")
    } else if name.chars().any(char::is_control) {
        Some("contains NUL or a control character")
    } else {
        None
    }
}

fn check_session(name: &str) -> Result<(), SessionFsError> {
    match component_problem(name) {
        None => Ok(()),
        Some(reason) => Err(SessionFsError::InvalidSession {
            name: name.to_string(),
            reason,
        }),
    }
}

fn check_mount_name(name: &str) -> Result<(), SessionFsError> {
    let bad = |reason| SessionFsError::InvalidMountName {
        name: name.to_string(),
        reason,
    };
    if name.len() > MAX_MOUNT_NAME {
        return Err(bad("longer than 1024 bytes"));
    }
    match name.split('/').find_map(component_problem) {
        None => Ok(()),
        Some(reason) => Err(bad(reason)),
    }
}

/// Whether mount name `inner` lies strictly inside mount name `outer`.
fn strictly_inside(inner: &str, outer: &str) -> bool {
    inner
        .strip_prefix(outer)
        .is_some_and(|rest| rest.starts_with('/'))
}

/// `path`'s parent in the `Vfs` path space (`/a/b` -> `/a`, `/a` -> `/`).
fn vfs_parent(path: &str) -> &str {
    match path.rfind('/') {
        Some(0) | None => "/",
        Some(i) => &path[..i],
    }
}

/// Makes a virtual directory's attributes honest: read-only, short-lived.
fn present_virtual(attr: &mut stat64) {
    attr.st_mode = libc::S_IFDIR | VIRTUAL_DIR_PERMS;
    attr.st_nlink = 2;
    attr.st_uid = VIRTUAL_DIR_OWNER;
    attr.st_gid = VIRTUAL_DIR_OWNER;
}

fn present_virtual_entry(e: &mut Entry) {
    present_virtual(&mut e.attr);
    e.attr_timeout = VIRTUAL_DIR_TTL;
    e.entry_timeout = VIRTUAL_DIR_TTL;
}

/// The exported filesystem: a virtual tree of session grants. Serve it with
/// fuse-backend-rs's `Server` (it is `Send + Sync`; share it in an `Arc`).
/// One transport at a time: a FUSE INIT resets every grant's open files and
/// inodes.
pub struct SessionFs {
    vfs: Vfs,
    opts: SessionFsOptions,
    grants: Mutex<BTreeMap<GrantId, GrantRecord>>,
    next_id: AtomicU64,
}

impl SessionFs {
    /// An empty tree (just the root directory).
    pub fn new(opts: SessionFsOptions) -> Self {
        let vfs_opts = VfsOptions {
            // Real opens: the policy sees each open's flags, and reads do not
            // reopen the file every time.
            no_open: false,
            no_opendir: false,
            // Host processes may change granted files at any time: no
            // guest-side write-back caching.
            no_writeback: true,
            // The server clears set-user-ID/set-group-ID bits and file
            // capabilities on write and truncation (the passthrough drops
            // CAP_FSETID for those calls), so the guest kernel does not ask
            // for `security.capability` before every write: one round trip
            // less per write.
            killpriv_v2: true,
            ..VfsOptions::default()
        };
        let mut vfs_opts = vfs_opts;
        // No DAX window is offered.
        vfs_opts.out_opts.remove(FsOptions::PERFILE_DAX);
        // Host processes change granted files behind the guest's back: when
        // a refreshed size or mtime shows it, the guest must drop the pages
        // it cached (AUTO_INVAL_DATA). EXPLICIT_INVAL_DATA would make it
        // keep them until told by a notification, which we never send.
        vfs_opts.out_opts.remove(FsOptions::EXPLICIT_INVAL_DATA);
        let mut vfs = Vfs::new(vfs_opts);
        // Unmounting a grant removes its directory from the virtual tree.
        vfs.set_remove_pseudo_root();
        Self {
            vfs,
            opts,
            grants: Mutex::new(BTreeMap::new()),
            next_id: AtomicU64::new(1),
        }
    }

    fn table(&self) -> MutexGuard<'_, BTreeMap<GrantId, GrantRecord>> {
        self.grants.locked()
    }

    /// Grants `host_path` (a directory or regular file; symlinks in it are
    /// resolved now, once) to `session` at `mount_name`, in `mode`. It
    /// appears at `/<session>/<mount_name>` at once, while the filesystem
    /// is being served. A grant already at that name is replaced. Files in
    /// it show their host owners ([`Self::add_grant_with_owner`] presents
    /// another).
    ///
    /// The caller must trust `host_path`: in particular a path below another
    /// writable grant can be turned into a symlink by the guest before it
    /// is granted.
    pub fn add_grant(
        &self,
        session: &str,
        mount_name: &str,
        host_path: &Path,
        mode: GrantMode,
    ) -> Result<GrantId, SessionFsError> {
        self.add_grant_with_owner(session, mount_name, host_path, mode, None)
    }

    /// [`Self::add_grant`], presenting `owner` (when `Some`) as the owner of
    /// every file in the grant, with chown to it accepted as a no-op (see
    /// the module docs of [`super`]).
    pub fn add_grant_with_owner(
        &self,
        session: &str,
        mount_name: &str,
        host_path: &Path,
        mode: GrantMode,
        owner: Option<GrantOwner>,
    ) -> Result<GrantId, SessionFsError> {
        check_session(session)?;
        check_mount_name(mount_name)?;
        if !host_path.is_absolute() {
            return Err(SessionFsError::RelativeHostPath(host_path.to_path_buf()));
        }
        let canonical =
            std::fs::canonicalize(host_path).map_err(|source| SessionFsError::HostPath {
                path: host_path.to_path_buf(),
                source,
            })?;
        if canonical.parent().is_none() {
            return Err(SessionFsError::HostRoot(host_path.to_path_buf()));
        }
        let meta = std::fs::metadata(&canonical).map_err(|source| SessionFsError::HostPath {
            path: host_path.to_path_buf(),
            source,
        })?;
        if !meta.is_dir() && !meta.is_file() {
            return Err(SessionFsError::UnsupportedFileType(canonical));
        }
        let vfs_path = format!("/{session}/{mount_name}");
        let grant = GrantFs::new(
            &canonical,
            mode,
            self.opts.xattr,
            format!("{session}/{mount_name}"),
        )?
        .with_owner(owner);

        let mut table = self.table();
        let mut replaced = None;
        for (id, rec) in table.iter() {
            if rec.session != session {
                continue;
            }
            if rec.mount_name == mount_name {
                replaced = Some(*id);
            } else if strictly_inside(mount_name, &rec.mount_name)
                || strictly_inside(&rec.mount_name, mount_name)
            {
                return Err(SessionFsError::Nested {
                    session: session.to_string(),
                    mount_name: mount_name.to_string(),
                    other: rec.mount_name.clone(),
                });
            }
        }
        if replaced.is_none() && table.len() >= MAX_GRANTS {
            return Err(SessionFsError::TooManyGrants { max: MAX_GRANTS });
        }
        if let Some(old) = replaced.and_then(|id| table.remove(&id).map(|rec| (id, rec))) {
            if let Err(e) = self.vfs.umount(&old.1.vfs_path) {
                warn!(grant = %old.0, path = %old.1.vfs_path, "virtio-fs: unmounting the replaced grant failed: {e}");
            }
            info!(grant = %old.0, session, mount_name, "virtio-fs grant replaced");
        }
        let fs_index = match self.vfs.mount(Box::new(grant), &vfs_path) {
            Ok(i) => i,
            Err(e) => {
                self.prune(&table, &vfs_path);
                return Err(SessionFsError::Mount {
                    guest_path: vfs_path,
                    reason: e.to_string(),
                });
            }
        };
        let id = GrantId(self.next_id.fetch_add(1, Ordering::Relaxed));
        info!(
            grant = %id,
            session,
            mount_name,
            host_path = %canonical.display(),
            %mode,
            owner = %owner.map_or_else(|| "host".to_string(), |o| o.to_string()),
            fs_index,
            "virtio-fs grant added"
        );
        table.insert(
            id,
            GrantRecord {
                session: session.to_string(),
                mount_name: mount_name.to_string(),
                host_path: canonical,
                mode,
                owner,
                vfs_path,
                fs_index,
            },
        );
        Ok(id)
    }

    /// Removes one grant; its tree vanishes from the export.
    pub fn remove_grant(&self, id: GrantId) -> Result<(), SessionFsError> {
        let mut table = self.table();
        let rec = table.remove(&id).ok_or(SessionFsError::UnknownGrant(id))?;
        let res = self.unmount(&table, id, &rec);
        info!(grant = %id, session = %rec.session, mount_name = %rec.mount_name, "virtio-fs grant removed");
        res
    }

    /// Removes every grant of `session` and its directory; returns how many
    /// grants it had. Unmount failures are logged (the grants are gone from
    /// the table regardless).
    pub fn remove_session(&self, session: &str) -> usize {
        let mut table = self.table();
        let ids: Vec<GrantId> = table
            .iter()
            .filter(|(_, r)| r.session == session)
            .map(|(id, _)| *id)
            .collect();
        for id in &ids {
            if let Some(rec) = table.remove(id) {
                if let Err(e) = self.unmount(&table, *id, &rec) {
                    warn!(grant = %id, "virtio-fs: {e}");
                }
            }
        }
        info!(session, grants = ids.len(), "virtio-fs session removed");
        ids.len()
    }

    /// The active grants, in the order they were added.
    pub fn grants(&self) -> Vec<GrantInfo> {
        self.table().iter().map(|(id, rec)| rec.info(*id)).collect()
    }

    /// Unmounts `rec` (already removed from `table`) and prunes the virtual
    /// directories nothing else needs.
    fn unmount(
        &self,
        table: &BTreeMap<GrantId, GrantRecord>,
        id: GrantId,
        rec: &GrantRecord,
    ) -> Result<(), SessionFsError> {
        debug!(grant = %id, fs_index = rec.fs_index, path = %rec.vfs_path, "virtio-fs unmounting grant");
        let res = self
            .vfs
            .umount(&rec.vfs_path)
            .map(|_| ())
            .map_err(|e| SessionFsError::Unmount {
                guest_path: rec.vfs_path.clone(),
                reason: e.to_string(),
            });
        self.prune(table, &rec.vfs_path);
        res
    }

    /// Removes the virtual directories at `path` and above that no grant in
    /// `table` needs. Only called with the table lock held, which also
    /// serializes every change to the `Vfs`'s pseudo filesystem.
    fn prune(&self, table: &BTreeMap<GrantId, GrantRecord>, path: &str) {
        let pseudo = self.vfs.get_root_pseudofs();
        let mut path = path;
        while path != "/" {
            let needed = table
                .values()
                .any(|r| r.vfs_path == path || strictly_inside(&r.vfs_path, path));
            if needed {
                break;
            }
            // A mount point is never evicted here: no grant is at `path`.
            if let Ok(Some(ino)) = pseudo.path_walk(path) {
                pseudo.evict_inode(ino);
            }
            path = vfs_parent(path);
        }
    }

    /// Refreshes a grant root entry returned for a virtual directory: the
    /// `Vfs` keeps the attributes from mount time.
    fn fresh_grant_root(&self, ctx: &Context, e: &mut Entry) -> io::Result<()> {
        let (attr, ttl) = self.vfs.getattr(ctx, e.inode.into(), None)?;
        e.attr = attr;
        e.attr_timeout = ttl;
        e.entry_timeout = e.entry_timeout.min(VIRTUAL_DIR_TTL);
        Ok(())
    }

    fn refuse(&self, op: &'static str, code: i32, why: &'static str) -> io::Error {
        debug!(op, why, "virtio-fs request refused");
        errno(code)
    }

    /// `ENOSYS` for every xattr request unless xattrs are served
    /// ([`SessionFsOptions::xattr`]).
    fn check_xattr(&self) -> io::Result<()> {
        if self.opts.xattr {
            Ok(())
        } else {
            Err(errno(libc::ENOSYS))
        }
    }

    /// `EROFS` if `ino` is a virtual directory.
    fn check_not_virtual(&self, op: &'static str, ino: u64) -> io::Result<()> {
        if is_virtual(ino) {
            return Err(self.refuse(op, libc::EROFS, "virtual directory"));
        }
        Ok(())
    }

    /// For rename and link: both inodes in one grant.
    fn check_same_grant(&self, op: &'static str, a: u64, b: u64) -> io::Result<()> {
        self.check_not_virtual(op, a)?;
        self.check_not_virtual(op, b)?;
        if fs_index(a) != fs_index(b) {
            return Err(self.refuse(op, libc::EXDEV, "across grants"));
        }
        Ok(())
    }
}

impl Drop for SessionFs {
    fn drop(&mut self) {
        self.vfs.destroy();
    }
}

impl FileSystem for SessionFs {
    type Inode = u64;
    type Handle = u64;

    fn init(&self, capable: FsOptions) -> io::Result<FsOptions> {
        if self.vfs.initialized() {
            info!("virtio-fs: FUSE INIT on an initialized filesystem; resetting open files and inodes");
            self.vfs.destroy();
        }
        let opts = self.vfs.init(capable)?;
        info!(options = ?opts, "virtio-fs: FUSE session initialized");
        Ok(opts)
    }

    fn destroy(&self) {
        self.vfs.destroy()
    }

    fn lookup(&self, ctx: &Context, parent: u64, name: &CStr) -> io::Result<Entry> {
        if matches!(name.to_bytes(), b"." | b"..") {
            return Err(self.refuse("lookup", libc::EINVAL, "dot or dot-dot name"));
        }
        let mut e = self.vfs.lookup(ctx, parent.into(), name)?;
        if is_virtual(parent) {
            if is_virtual(e.inode) {
                present_virtual_entry(&mut e);
            } else {
                self.fresh_grant_root(ctx, &mut e)?;
            }
        }
        Ok(e)
    }

    fn forget(&self, ctx: &Context, inode: u64, count: u64) {
        self.vfs.forget(ctx, inode.into(), count)
    }

    fn batch_forget(&self, ctx: &Context, requests: Vec<(u64, u64)>) {
        for (inode, count) in requests {
            self.vfs.forget(ctx, inode.into(), count)
        }
    }

    fn getattr(
        &self,
        ctx: &Context,
        inode: u64,
        handle: Option<u64>,
    ) -> io::Result<(stat64, Duration)> {
        let (mut attr, ttl) = self.vfs.getattr(ctx, inode.into(), handle)?;
        if is_virtual(inode) {
            present_virtual(&mut attr);
            return Ok((attr, VIRTUAL_DIR_TTL));
        }
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
        self.check_not_virtual("setattr", inode)?;
        self.vfs.setattr(ctx, inode.into(), attr, handle, valid)
    }

    fn readlink(&self, ctx: &Context, inode: u64) -> io::Result<Vec<u8>> {
        if is_virtual(inode) {
            return Err(errno(libc::EINVAL));
        }
        self.vfs.readlink(ctx, inode.into())
    }

    fn symlink(
        &self,
        ctx: &Context,
        linkname: &CStr,
        parent: u64,
        name: &CStr,
    ) -> io::Result<Entry> {
        self.check_not_virtual("symlink", parent)?;
        self.vfs.symlink(ctx, linkname, parent.into(), name)
    }

    fn mknod(
        &self,
        ctx: &Context,
        parent: u64,
        name: &CStr,
        mode: u32,
        rdev: u32,
        umask: u32,
    ) -> io::Result<Entry> {
        self.check_not_virtual("mknod", parent)?;
        self.vfs.mknod(ctx, parent.into(), name, mode, rdev, umask)
    }

    fn mkdir(
        &self,
        ctx: &Context,
        parent: u64,
        name: &CStr,
        mode: u32,
        umask: u32,
    ) -> io::Result<Entry> {
        self.check_not_virtual("mkdir", parent)?;
        self.vfs.mkdir(ctx, parent.into(), name, mode, umask)
    }

    fn unlink(&self, ctx: &Context, parent: u64, name: &CStr) -> io::Result<()> {
        self.check_not_virtual("unlink", parent)?;
        self.vfs.unlink(ctx, parent.into(), name)
    }

    fn rmdir(&self, ctx: &Context, parent: u64, name: &CStr) -> io::Result<()> {
        self.check_not_virtual("rmdir", parent)?;
        self.vfs.rmdir(ctx, parent.into(), name)
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
        self.check_same_grant("rename", olddir, newdir)?;
        self.vfs
            .rename(ctx, olddir.into(), oldname, newdir.into(), newname, flags)
    }

    fn link(&self, ctx: &Context, inode: u64, newparent: u64, newname: &CStr) -> io::Result<Entry> {
        self.check_same_grant("link", inode, newparent)?;
        self.vfs.link(ctx, inode.into(), newparent.into(), newname)
    }

    fn open(
        &self,
        ctx: &Context,
        inode: u64,
        flags: u32,
        fuse_flags: u32,
    ) -> io::Result<(Option<u64>, OpenOptions, Option<u32>)> {
        if is_virtual(inode) {
            return Err(errno(libc::EISDIR));
        }
        self.vfs.open(ctx, inode.into(), flags, fuse_flags)
    }

    fn create(
        &self,
        ctx: &Context,
        parent: u64,
        name: &CStr,
        args: CreateIn,
    ) -> io::Result<(Entry, Option<u64>, OpenOptions, Option<u32>)> {
        self.check_not_virtual("create", parent)?;
        self.vfs.create(ctx, parent.into(), name, args)
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
        if is_virtual(inode) {
            return Err(errno(libc::EISDIR));
        }
        self.vfs.read(
            ctx,
            inode.into(),
            handle,
            w,
            size,
            offset,
            lock_owner,
            flags,
        )
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
        self.check_not_virtual("write", inode)?;
        self.vfs.write(
            ctx,
            inode.into(),
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
        if is_virtual(inode) {
            return Ok(());
        }
        self.vfs.flush(ctx, inode.into(), handle, lock_owner)
    }

    fn fsync(&self, ctx: &Context, inode: u64, datasync: bool, handle: u64) -> io::Result<()> {
        if is_virtual(inode) {
            return Ok(());
        }
        self.vfs.fsync(ctx, inode.into(), datasync, handle)
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
        self.check_not_virtual("fallocate", inode)?;
        self.vfs
            .fallocate(ctx, inode.into(), handle, mode, offset, length)
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
        if is_virtual(inode) {
            return Ok(());
        }
        self.vfs.release(
            ctx,
            inode.into(),
            flags,
            handle,
            flush,
            flock_release,
            lock_owner,
        )
    }

    fn statfs(&self, ctx: &Context, inode: u64) -> io::Result<statvfs64> {
        self.vfs.statfs(ctx, inode.into())
    }

    fn setxattr(
        &self,
        ctx: &Context,
        inode: u64,
        name: &CStr,
        value: &[u8],
        flags: u32,
    ) -> io::Result<()> {
        self.check_xattr()?;
        self.check_not_virtual("setxattr", inode)?;
        self.vfs.setxattr(ctx, inode.into(), name, value, flags)
    }

    fn getxattr(
        &self,
        ctx: &Context,
        inode: u64,
        name: &CStr,
        size: u32,
    ) -> io::Result<GetxattrReply> {
        self.check_xattr()?;
        if is_virtual(inode) {
            return Err(errno(libc::ENODATA));
        }
        self.vfs.getxattr(ctx, inode.into(), name, size)
    }

    fn listxattr(&self, ctx: &Context, inode: u64, size: u32) -> io::Result<ListxattrReply> {
        self.check_xattr()?;
        if is_virtual(inode) {
            return Ok(if size == 0 {
                ListxattrReply::Count(0)
            } else {
                ListxattrReply::Names(Vec::new())
            });
        }
        self.vfs.listxattr(ctx, inode.into(), size)
    }

    fn removexattr(&self, ctx: &Context, inode: u64, name: &CStr) -> io::Result<()> {
        self.check_xattr()?;
        self.check_not_virtual("removexattr", inode)?;
        self.vfs.removexattr(ctx, inode.into(), name)
    }

    fn opendir(
        &self,
        ctx: &Context,
        inode: u64,
        flags: u32,
    ) -> io::Result<(Option<u64>, OpenOptions)> {
        if is_virtual(inode) {
            // Virtual directories need no handle; check it exists.
            self.vfs.getattr(ctx, inode.into(), None)?;
            return Ok((None, OpenOptions::empty()));
        }
        self.vfs.opendir(ctx, inode.into(), flags)
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
        self.vfs
            .readdir(ctx, inode.into(), handle, size, offset, add_entry)
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
        if !is_virtual(inode) {
            return self
                .vfs
                .readdirplus(ctx, inode.into(), handle, size, offset, add_entry);
        }
        self.vfs
            .readdirplus(ctx, inode.into(), handle, size, offset, &mut |d, mut e| {
                if is_virtual(e.inode) {
                    present_virtual_entry(&mut e);
                } else {
                    self.fresh_grant_root(ctx, &mut e)?;
                }
                add_entry(d, e)
            })
    }

    fn fsyncdir(&self, ctx: &Context, inode: u64, datasync: bool, handle: u64) -> io::Result<()> {
        if is_virtual(inode) {
            return Ok(());
        }
        self.vfs.fsyncdir(ctx, inode.into(), datasync, handle)
    }

    fn releasedir(&self, ctx: &Context, inode: u64, flags: u32, handle: u64) -> io::Result<()> {
        if is_virtual(inode) {
            return Ok(());
        }
        self.vfs.releasedir(ctx, inode.into(), flags, handle)
    }

    fn access(&self, ctx: &Context, inode: u64, mask: u32) -> io::Result<()> {
        if is_virtual(inode) {
            if mask as i32 & libc::W_OK != 0 {
                return Err(self.refuse("access(W_OK)", libc::EROFS, "virtual directory"));
            }
            return self.vfs.getattr(ctx, inode.into(), None).map(|_| ());
        }
        self.vfs.access(ctx, inode.into(), mask)
    }

    fn id_remap(&self, ctx: &mut Context) -> io::Result<()> {
        if self.opts.credentials == Credentials::Helper {
            // The passthrough filesystem switches credentials only for
            // non-zero ids; 0 means "as the helper itself".
            ctx.uid = 0;
            ctx.gid = 0;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
