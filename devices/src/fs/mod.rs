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
//! Ownership the guest sees: the guest mounts the share with
//! `default_permissions`, so its kernel checks every access against the
//! mode bits and the owner this server reports, while sessions run as their
//! own unprivileged users. Host files belong to host users (the helper's
//! user, root, anyone), so a session user would be "other" everywhere and
//! could not write even an `rw` grant. A grant may therefore carry a
//! guest-facing owner ([`GrantOwner`], [`SessionFs::add_grant_with_owner`]):
//!
//! * every attribute reply for an inode of that grant (the entries of
//!   lookup, create, mkdir, mknod, symlink and link, getattr, setattr,
//!   readdirplus, and the grant root as its virtual parent lists it) reports
//!   that uid and gid instead of the host's; mode bits, sizes and times stay
//!   the host's;
//! * a chown or chgrp from the guest to the presented owner (or `-1`) is a
//!   successful no-op, so `cp -p`, `tar`, git and rsync work; any other uid
//!   or gid fails with `EPERM`. The host file's owner never changes. `ro`
//!   grants still answer `EROFS` to every change, chown included;
//! * without an owner, the host's uid and gid are reported and chown goes
//!   to the host as before;
//! * the virtual directories stay owned by root (uid and gid 0).
//!
//! Limits of the presentation: it is a view, not a permission system. Every
//! file in the grant shows the one owner, including files another host user
//! owns (whose content the helper's user may still be unable to read or
//! write: the host answers `EACCES` then). The guest kernel's checks against
//! the presented owner are a convenience; the boundary is the host policy
//! (grant mode, the helper's own host permissions). POSIX ACLs and other
//! extended attributes are passed through unchanged when xattrs are served
//! ([`SessionFsOptions::xattr`]), so an ACL naming host uids means nothing
//! useful in the guest. Files the guest creates belong, on the host, to the
//! helper's user ([`Credentials::Helper`]); with [`Credentials::Guest`] the
//! owner is the guest's uid as before, whatever is presented. A set-ID
//! bit on a host file is shown as it is, so in a guest that honours it the
//! program would run as the presented owner, never as the host's.
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

/// The owner a grant presents to the guest in place of the host's (see the
/// module docs): every attribute reply for an inode of the grant shows this
/// uid and gid, and chown/chgrp to them is accepted as a no-op.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GrantOwner {
    /// User id the guest sees as the owner.
    pub uid: u32,
    /// Group id the guest sees as the group.
    pub gid: u32,
}

impl GrantOwner {
    /// An owner with user and group id both `id` (a per-session user whose
    /// group has its own id).
    pub fn same(id: u32) -> Self {
        Self { uid: id, gid: id }
    }
}

impl std::fmt::Display for GrantOwner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.uid, self.gid)
    }
}

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
