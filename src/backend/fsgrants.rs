//! Host folders for a VM through its virtio-fs share: every session mount is
//! a grant the host adds to the VM's [`SessionFs`] (which enforces its mode),
//! and the agent binds it from where it mounted the share.
//!
//! [`SharedFolders`] is what [`super::HostPaths::Shared`] holds. A grant for
//! session `s`, mount `m` appears to the agent at
//! `<SESSIONS_FS_MOUNT>/s/m` ([`guest_agent::proto::SESSIONS_FS_MOUNT`]),
//! which becomes the mount's `source`. Granting the same (session, mount,
//! host path, mode) again reuses the grant, so a repeated mount or SDK
//! install does not cut off files the guest has open. Deleting a session's
//! directory releases its grants.
//!
//! The SDK (`installSdk`) is granted read-only under the reserved session
//! name [`SDK_SESSION`], which client sessions cannot use for mounts nor
//! release, at the mount name [`SDK_MOUNT`]: the directory holding the CLI
//! binary, whose file the agent binds to its install path.
//!
//! Owners: sessions run in the guest as their own users
//! ([`guest_agent::proto::session_uid`]) and the guest checks file modes
//! against the owners the share reports, so a session's grants present
//! that user (uid and gid) as the owner of every file in them; `rw`/`rwd`
//! grants are then writable by the session whoever owns the host files (the
//! share still enforces the mode). The SDK grant presents root
//! ([`SDK_OWNER`]), like any `/usr/local/bin` install: every session may
//! run the binary when its host mode lets others read and execute it (a
//! warning is logged when it does not).
//!
//! Limits: a grant is resolved on the host when it is made. A client path
//! that leads through a symlink the guest planted in another writable grant
//! therefore grants the symlink's target (the client chose that path; the
//! grant then holds whatever the host path resolved to). At most
//! [`devices::fs::MAX_GRANTS`] grants at once per VM.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use devices::fs::{GrantMode, GrantOwner, SessionFs};
use guest_agent::proto::{session_uid, MountMode, SESSIONS_FS_MOUNT};

/// Session name the SDK install is granted under. `guest_agent::names`
/// accepts it as a client session name, so [`SharedFolders`] refuses client
/// mounts in it and never releases it for a client.
pub const SDK_SESSION: &str = ".cowork-sdk";

/// Mount name of the SDK directory under [`SDK_SESSION`] (one at a time:
/// installing another version replaces it).
pub const SDK_MOUNT: &str = "current";

/// Owner the SDK grant presents: root (uid and gid 0), as for a binary
/// installed in `/usr/local/bin`; no session owns it.
pub const SDK_OWNER: GrantOwner = GrantOwner { uid: 0, gid: 0 };

/// Mode bits a binary needs for users other than its owner to run it: read
/// (the CLI reads its own file) and execute for "other".
const OTHERS_READ_EXECUTE: u32 = 0o005;

/// Why a grant could not be made.
#[derive(Debug, thiserror::Error)]
pub enum GrantError {
    /// The session name is reserved for the helper.
    #[error("session name {0:?} is reserved for the SDK install; use another session name")]
    ReservedSession(String),
    /// The SDK path has no directory or file name.
    #[error("SDK path {0:?} has no parent directory or file name")]
    SdkPath(PathBuf),
    /// The SDK binary's name is not UTF-8.
    #[error("SDK binary name {0:?} is not valid UTF-8")]
    SdkName(PathBuf),
    /// The share refused the grant.
    #[error(transparent)]
    Fs(#[from] devices::fs::SessionFsError),
}

/// The grant table side of a VM's virtio-fs share.
#[derive(Clone)]
pub struct SharedFolders {
    fs: Arc<SessionFs>,
    agent_root: String,
}

impl fmt::Debug for SharedFolders {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedFolders")
            .field("agent_root", &self.agent_root)
            .field("grants", &self.fs.grants().len())
            .finish()
    }
}

fn grant_mode(mode: MountMode) -> GrantMode {
    match mode {
        MountMode::Ro => GrantMode::Ro,
        MountMode::Rw => GrantMode::Rw,
        MountMode::Rwd => GrantMode::Rwd,
    }
}

impl SharedFolders {
    /// Grants into `fs`, which the agent mounts at [`SESSIONS_FS_MOUNT`].
    pub fn new(fs: Arc<SessionFs>) -> Self {
        Self {
            fs,
            agent_root: SESSIONS_FS_MOUNT.to_string(),
        }
    }

    /// The share these grants go to.
    pub fn fs(&self) -> &Arc<SessionFs> {
        &self.fs
    }

    /// Grants host directory or file `/<host_rel>` to `session` at
    /// `mount_name` in `mode`; returns the agent's path of the grant.
    pub fn grant(
        &self,
        session: &str,
        mount_name: &str,
        host_rel: &str,
        mode: MountMode,
    ) -> Result<String, GrantError> {
        if session == SDK_SESSION {
            return Err(GrantError::ReservedSession(session.to_string()));
        }
        self.grant_once(
            session,
            mount_name,
            &Path::new("/").join(host_rel),
            grant_mode(mode),
            GrantOwner::same(session_uid(session)),
        )
    }

    /// Grants the directory of the SDK binary `/<host_rel>` read-only under
    /// [`SDK_SESSION`]; returns the agent's path of the binary.
    pub fn grant_sdk(&self, host_rel: &str) -> Result<String, GrantError> {
        let binary = Path::new("/").join(host_rel);
        let (Some(dir), Some(name)) = (binary.parent(), binary.file_name()) else {
            return Err(GrantError::SdkPath(binary));
        };
        let name = name
            .to_str()
            .ok_or_else(|| GrantError::SdkName(binary.clone()))?;
        warn_unless_others_can_run(&binary);
        let root = self.grant_once(SDK_SESSION, SDK_MOUNT, dir, GrantMode::Ro, SDK_OWNER)?;
        Ok(format!("{root}/{name}"))
    }

    /// Releases every grant of client session `session` (its directory was
    /// deleted); returns how many there were. The SDK's grants stay.
    pub fn release_session(&self, session: &str) -> usize {
        if session == SDK_SESSION {
            tracing::warn!(session, "refusing to release the SDK's grants for a client");
            return 0;
        }
        self.fs.remove_session(session)
    }

    /// Adds the grant (presenting `owner`) unless the same one exists;
    /// returns the agent path.
    fn grant_once(
        &self,
        session: &str,
        mount_name: &str,
        host: &Path,
        mode: GrantMode,
        owner: GrantOwner,
    ) -> Result<String, GrantError> {
        let agent_path = format!("{}/{session}/{mount_name}", self.agent_root);
        let canonical = std::fs::canonicalize(host).ok();
        let existing = self.fs.grants().into_iter().find(|g| {
            g.session == session
                && g.mount_name == mount_name
                && g.mode == mode
                && g.owner == Some(owner)
                && Some(&g.host_path) == canonical.as_ref()
        });
        if let Some(g) = existing {
            tracing::debug!(grant = %g.id, session, mount_name, "virtio-fs grant reused");
            return Ok(agent_path);
        }
        self.fs
            .add_grant_with_owner(session, mount_name, host, mode, Some(owner))?;
        Ok(agent_path)
    }
}

/// Logs a warning when `binary`'s host mode does not let users other than
/// its owner read and execute it: sessions run as their own users and could
/// not start it.
fn warn_unless_others_can_run(binary: &Path) {
    use std::os::unix::fs::PermissionsExt;
    match std::fs::metadata(binary) {
        Ok(m) if m.permissions().mode() & OTHERS_READ_EXECUTE != OTHERS_READ_EXECUTE => {
            tracing::warn!(
                path = %binary.display(),
                mode = format!("{:o}", m.permissions().mode() & 0o7777),
                "SDK binary is not readable and executable by others; sessions (non-root users in the VM) cannot run it: chmod o+rx it"
            );
        }
        Ok(_) => {}
        Err(e) => {
            tracing::warn!(path = %binary.display(), "cannot check the SDK binary's mode: {e}")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use devices::fs::SessionFsOptions;

    fn shared() -> SharedFolders {
        SharedFolders::new(Arc::new(SessionFs::new(SessionFsOptions::default())))
    }

    fn rel(p: &Path) -> String {
        p.to_str().unwrap().trim_start_matches('/').to_string()
    }

    #[test]
    fn grants_appear_below_the_agents_share_mount() {
        let s = shared();
        let d = tempfile::tempdir().unwrap();
        let path = s
            .grant("sess", ".claude/skills", &rel(d.path()), MountMode::Rw)
            .unwrap();
        assert_eq!(path, format!("{SESSIONS_FS_MOUNT}/sess/.claude/skills"));
        let g = s.fs().grants();
        assert_eq!(g.len(), 1);
        assert_eq!(g[0].mode, GrantMode::Rw);
        assert_eq!(g[0].host_path, std::fs::canonicalize(d.path()).unwrap());
        // The session's user owns the grant, as the guest sees it.
        assert_eq!(g[0].owner, Some(GrantOwner::same(session_uid("sess"))));
        // The same grant again is reused (same id), another mode replaces it.
        s.grant("sess", ".claude/skills", &rel(d.path()), MountMode::Rw)
            .unwrap();
        assert_eq!(s.fs().grants()[0].id, g[0].id);
        s.grant("sess", ".claude/skills", &rel(d.path()), MountMode::Ro)
            .unwrap();
        let g2 = s.fs().grants();
        assert_eq!(g2.len(), 1);
        assert_ne!(g2[0].id, g[0].id);
        assert_eq!(g2[0].mode, GrantMode::Ro);
    }

    #[test]
    fn the_sdk_session_is_reserved() {
        let s = shared();
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("claude"), b"#!/bin/sh\n").unwrap();
        let bin = s.grant_sdk(&rel(&d.path().join("claude"))).unwrap();
        assert_eq!(
            bin,
            format!("{SESSIONS_FS_MOUNT}/{SDK_SESSION}/{SDK_MOUNT}/claude")
        );
        let g = s.fs().grants();
        assert_eq!(
            (g[0].session.as_str(), g[0].mode, g[0].owner),
            (SDK_SESSION, GrantMode::Ro, Some(SDK_OWNER))
        );
        assert!(matches!(
            s.grant(SDK_SESSION, "x", &rel(d.path()), MountMode::Ro),
            Err(GrantError::ReservedSession(_))
        ));
        assert_eq!(s.release_session(SDK_SESSION), 0);
        assert_eq!(s.fs().grants().len(), 1);
        // Installing again reuses the grant.
        s.grant_sdk(&rel(&d.path().join("claude"))).unwrap();
        assert_eq!(s.fs().grants()[0].id, g[0].id);
        assert!(guest_agent::names::session_name(SDK_SESSION).is_ok());
    }

    #[test]
    fn releasing_a_session_removes_only_its_grants() {
        let s = shared();
        let d = tempfile::tempdir().unwrap();
        s.grant("a", "m1", &rel(d.path()), MountMode::Ro).unwrap();
        s.grant("a", "m2", &rel(d.path()), MountMode::Rwd).unwrap();
        s.grant("b", "m1", &rel(d.path()), MountMode::Ro).unwrap();
        assert_eq!(s.release_session("a"), 2);
        let left = s.fs().grants();
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].session, "b");
        assert_eq!(left[0].owner, Some(GrantOwner::same(session_uid("b"))));
        assert_ne!(session_uid("a"), session_uid("b"));
        assert_eq!(s.release_session("a"), 0);
    }

    #[test]
    fn refused_grants_say_why() {
        let s = shared();
        let e = s
            .grant("a", "m", "nonexistent/cowork/path", MountMode::Ro)
            .unwrap_err();
        assert!(e.to_string().contains("/nonexistent/cowork/path"), "{e}");
        let e = s.grant("a", "../x", "tmp", MountMode::Ro).unwrap_err();
        assert!(e.to_string().contains("mount name"), "{e}");
    }

    #[test]
    fn the_tags_agree() {
        assert_eq!(
            guest_agent::proto::SESSIONS_FS_TAG,
            devices::fs::device::DEFAULT_TAG
        );
    }
}
