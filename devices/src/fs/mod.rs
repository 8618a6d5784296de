//! virtio-fs: the guest's view of the host is the set of session mounts the
//! helper grants, and the host enforces each mount's mode.
//!
//! The exported tree is virtual. Its root holds one directory per session,
//! and under `/<session>/` each grant appears at its mount name (nested names
//! such as `.claude/skills` create read-only intermediate directories):
//!
//! ```text
//! /                         virtual, read-only
//! /<session>/               virtual, read-only
//! /<session>/<mount name>   a grant: a host directory or file, mode ro/rw/rwd
//! ```
//!
//! The pieces, outside in:
//!
//! * [`SessionFs`] is the FUSE `FileSystem` every transport serves (the
//!   in-process virtio device [`device::FsDevice`], a host `/dev/fuse` mount
//!   through [`fusedev::HostMount`], later the vhost-user backend). It owns a
//!   fuse-backend-rs `Vfs` whose pseudo filesystem holds the virtual
//!   directories, and the grant table: [`SessionFs::add_grant`] mounts a
//!   grant into the `Vfs` at runtime, [`SessionFs::remove_grant`] and
//!   [`SessionFs::remove_session`] unmount grants and prune the virtual
//!   directories left empty, all without a new FUSE connection. It keeps the
//!   virtual tree read-only and refuses renames and links across grants
//!   (`EXDEV`).
//! * [`policy::GrantFs`] wraps one fuse-backend-rs `PassthroughFs` rooted at
//!   the grant's host path and refuses what the grant's [`GrantMode`] does not
//!   allow, whatever the guest kernel sends.
//!
//! What the host guarantees to a hostile guest (tested in
//! `devices/tests/fs_host.rs` over `/dev/fuse` and in the unit tests through
//! the `FileSystem` API):
//!
//! * nothing outside a granted host path is reachable: names are resolved one
//!   component at a time relative to the parent's `O_PATH` descriptor with
//!   `O_NOFOLLOW`, `.` and `..` lookups are refused, symlinks are returned to
//!   the guest as symlinks (the server never follows one: opening a symlink
//!   inode fails, attribute and xattr changes apply to the link itself),
//!   inodes are never re-opened by file handle (`open_by_handle_at` is off),
//!   and renames and hard links between grants fail with `EXDEV`;
//! * `ro` refuses every mutation with `EROFS`; `rw` allows writes and new
//!   entries but refuses to unlink, remove, rename or replace any entry the
//!   guest did not create during the grant's lifetime (`EPERM`); `rwd` allows
//!   deletion too;
//! * in every mode: no device nodes, no set-user-ID / set-group-ID bits on
//!   files the guest creates or chmods; extended attributes are not served
//!   unless [`SessionFsOptions::xattr`] asks for them, and then only
//!   `user.*` and POSIX ACL ones may be changed; a write or truncation by a
//!   guest process without `CAP_FSETID` clears the set-ID bits and file
//!   capabilities of a pre-existing host file (FUSE `HANDLE_KILLPRIV_V2`:
//!   the server does it, so the guest does not ask for
//!   `security.capability` before every write).
//!
//! Round trips per operation are what the guest pays for (a few hundred
//! microseconds each under QEMU TCG, tens under KVM), so the server avoids
//! the ones it can: `FOPEN_NOFLUSH` where a `FLUSH` would do nothing
//! ([`policy`]), no xattrs by default (a mount serving them gets a
//! `GETXATTR security.capability` before the first write to every file),
//! writes and truncations that kill privileges on the host side. Opens
//! themselves stay real (the policy sees their flags, host file watchers
//! see a close when the guest closes).
//!
//! Limits: at most [`MAX_GRANTS`] grants at a time (the `Vfs` tags inodes
//! with an 8-bit filesystem index). A grant cannot be nested inside another
//! grant of the same session. Host paths must be valid UTF-8. A host process
//! that moves a directory out of a granted tree while the guest holds it
//! open lets the guest keep using that directory (as with any passthrough
//! server). Removing a grant makes its tree unreachable at once (requests on
//! its inodes fail with `ENOENT`), but a guest may keep seeing the removed
//! names in its dentry cache for up to [`VIRTUAL_DIR_TTL`] /
//! [`GRANT_ENTRY_TTL`]. Directory listings carry no `.` and `..` entries
//! (as fuse-backend-rs's passthrough and pseudo filesystems list them).
//! `rw` refuses replacing a pre-existing file, so editors that save by
//! renaming a new file over the old one need `rwd`. A `SessionFs` is served
//! by one transport at a time.

pub mod device;
pub mod fusedev;
pub mod policy;
mod session;
#[cfg(test)]
pub(crate) mod testutil;

use std::time::Duration;

pub use session::{Credentials, GrantId, GrantInfo, SessionFs, SessionFsError, SessionFsOptions};

/// Most grants a [`SessionFs`] holds at once: the `Vfs` keeps filesystem
/// index 0 for its virtual directories and has 255 others.
pub const MAX_GRANTS: usize = 255;

/// How long the guest may cache entries and attributes of the virtual
/// directories (session directories, intermediate mount-name directories).
/// Bounds how long a removed session stays visible in the guest's dentry
/// cache.
pub const VIRTUAL_DIR_TTL: Duration = Duration::from_secs(1);

/// How long the guest may cache a name lookup inside a grant. Host-side
/// changes to a granted tree show up in the guest after at most this long.
/// The same as virtiofsd's default (`cache=auto`): a longer lifetime would
/// save the guest's revalidating LOOKUP of names older than this (before an
/// unlink, say) at the price of staler views of files the user edits on
/// the host.
pub const GRANT_ENTRY_TTL: Duration = Duration::from_secs(1);

/// How long the guest may cache attributes of files inside a grant (as
/// virtiofsd's `cache=auto`). A `stat` of a name looked up less than this
/// (and [`GRANT_ENTRY_TTL`]) ago costs no request at all.
pub const GRANT_ATTR_TTL: Duration = Duration::from_secs(1);

/// Longest session name or mount-name component (Linux `NAME_MAX`).
pub const MAX_NAME_COMPONENT: usize = 255;

/// Longest mount name, all components included.
pub const MAX_MOUNT_NAME: usize = 1024;

/// What the guest may do inside a grant (the `mode` of a session mount).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GrantMode {
    /// Read-only: every mutation fails with `EROFS`.
    Ro,
    /// Read-write without deletion of pre-existing entries: the guest may
    /// write, create and delete what it created, but entries that existed
    /// before (or were created by someone else) cannot be unlinked, removed,
    /// renamed or replaced (`EPERM`).
    Rw,
    /// Read-write with deletion.
    Rwd,
}

impl GrantMode {
    /// Parses the protocol spelling (`ro`, `rw`, `rwd`), as in the agent
    /// protocol's `MountMode`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "ro" => Some(Self::Ro),
            "rw" => Some(Self::Rw),
            "rwd" => Some(Self::Rwd),
            _ => None,
        }
    }

    /// The protocol spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ro => "ro",
            Self::Rw => "rw",
            Self::Rwd => "rwd",
        }
    }
}

impl std::fmt::Display for GrantMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grant_mode_spellings_round_trip() {
        for m in [GrantMode::Ro, GrantMode::Rw, GrantMode::Rwd] {
            assert_eq!(GrantMode::parse(m.as_str()), Some(m));
            assert_eq!(m.to_string(), m.as_str());
        }
        assert_eq!(GrantMode::parse("RW"), None);
        assert_eq!(GrantMode::parse(""), None);
    }
}
