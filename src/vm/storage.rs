//! A profile's session storage: the sparse session disk the VM backends
//! hand the guest (created by `createVM` or `startVM`, grown but never
//! shrunk) or the sandbox's host sessions directory, and the janitor
//! operations on it (run by the agent, or on the host directory when the
//! sandbox's guest is down).
//!
//! Limits: `createVM.diskSizeGB` is 1..=[`MAX_SESSION_DISK_GIB`]; under the
//! VM backends the janitor needs a connected guest (only the guest reads
//! the ext4 disk).

use guest_agent::proto::Op;
use serde_json::Value;

use super::link::op_name;
use super::{Vm, VmError, CALL_TIMEOUT};

/// Size of the session disk, in GiB, when it must be created and
/// `createVM.diskSizeGB` did not say (or `startVM` came without `createVM`).
pub const DEFAULT_SESSION_DISK_GIB: u64 = 10;

/// Largest `createVM.diskSizeGB` accepted, in GiB (the sparse image costs
/// nothing up front; this only refuses absurd values with a clear error).
pub const MAX_SESSION_DISK_GIB: u64 = 16 * 1024;

/// Bytes in one GiB (`diskSizeGB` is read as GiB).
const GIB: u64 = 1 << 30;

/// Bytes of a `createVM.diskSizeGB` value (GiB), or why it is refused.
pub fn session_disk_bytes(disk_size_gb: u64) -> Result<u64, VmError> {
    if disk_size_gb == 0 || disk_size_gb > MAX_SESSION_DISK_GIB {
        return Err(VmError::Invalid(format!(
            "createVM: diskSizeGB {disk_size_gb} is out of range; give 1 to {MAX_SESSION_DISK_GIB} (GiB)"
        )));
    }
    Ok(disk_size_gb * GIB)
}

impl Vm {
    /// Creates (or keeps) the persistent session storage. Sandbox: the
    /// host sessions directory (`disk_size_gb` does not apply). qemu and
    /// kvm: the sparse session disk
    /// [`crate::backend::VmConfig::session_disk`]. An existing disk is never
    /// truncated, shrunk or recreated: with `disk_size_gb` it is grown
    /// sparsely when smaller (the guest's filesystem keeps its size) and
    /// kept when larger; without it (`startVM`) it is kept as it is, and a
    /// missing one is created with [`DEFAULT_SESSION_DISK_GIB`].
    pub fn create_storage(&self, disk_size_gb: Option<u64>) -> Result<(), VmError> {
        if !self.cfg.uses_session_disk() {
            return std::fs::create_dir_all(self.cfg.sessions_dir()).map_err(|e| {
                VmError::Start(format!(
                    "cannot create {}: {e}",
                    self.cfg.sessions_dir().display()
                ))
            });
        }
        let requested = disk_size_gb.map(session_disk_bytes).transpose()?;
        let disk = self.cfg.session_disk();
        if requested.is_none() && std::fs::symlink_metadata(&disk).is_ok() {
            tracing::debug!(disk = %disk.display(), "session disk kept");
            return Ok(());
        }
        std::fs::create_dir_all(&self.cfg.profile_dir).map_err(|e| {
            VmError::SessionDisk(format!(
                "cannot create {}: {e}",
                self.cfg.profile_dir.display()
            ))
        })?;
        let bytes = requested.unwrap_or(DEFAULT_SESSION_DISK_GIB * GIB);
        let size = devices::blk::create_sparse_image(&disk, bytes)
            .map_err(|e| VmError::SessionDisk(e.to_string()))?;
        tracing::info!(disk = %disk.display(), size, requested = bytes, "session disk ready");
        Ok(())
    }

    /// Runs a janitor operation in the guest, or on the host's session
    /// directory when no guest is connected. Deleted session directories
    /// also lose what the backend granted their mounts.
    pub async fn janitor(&self, op: Op) -> Result<Value, VmError> {
        let deleting = matches!(op, Op::DeleteSessionDirs { .. });
        let result = self.run_janitor(op).await?;
        if deleting {
            if let Some(host_paths) = self
                .lifecycle
                .lock()
                .await
                .as_ref()
                .map(|m| m.host_paths.clone())
            {
                let deleted = result["deleted"].as_array().into_iter().flatten();
                for session in deleted.filter_map(Value::as_str) {
                    host_paths.release_session(session);
                }
            }
        }
        Ok(result)
    }

    async fn run_janitor(&self, op: Op) -> Result<Value, VmError> {
        if let Ok(link) = self.connected_link() {
            return link.call(op, &[], CALL_TIMEOUT).await.map(|(v, _)| v);
        }
        if self.cfg.uses_session_disk() {
            let method = match op {
                Op::DiskInfo { .. } => "getSessionsDiskInfo",
                ref other => op_name(other),
            };
            return Err(VmError::JanitorNeedsGuest {
                op: method,
                backend: self.cfg.backend.as_str(),
                disk: self.cfg.session_disk(),
            });
        }
        let root = self.cfg.sessions_dir();
        let live = self.live_sessions();
        tokio::task::spawn_blocking(move || {
            use guest_agent::janitor;
            std::fs::create_dir_all(&root)
                .map_err(|e| VmError::Agent(format!("{}: {e}", root.display())))?;
            let outcome = match op {
                Op::DiskInfo { low_water_bytes } => janitor::disk_info(&root, low_water_bytes),
                Op::DeleteSessionDirs { names } => {
                    Ok(janitor::delete_session_dirs(&root, &names, &live))
                }
                Op::PruneSessionCaches {
                    only_if_free_bytes_below,
                    include_session_tmp,
                    session_tmp_older_than_seconds,
                } => janitor::prune_session_caches(
                    &root,
                    only_if_free_bytes_below,
                    include_session_tmp,
                    session_tmp_older_than_seconds,
                    &live,
                ),
                other => {
                    return Err(VmError::Invalid(format!(
                        "{} needs a running VM",
                        op_name(&other)
                    )))
                }
            };
            outcome.map_err(|e| VmError::Agent(e.to_string()))
        })
        .await
        .map_err(|e| VmError::Agent(format!("janitor task failed: {e}")))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{BackendKind, VmConfig, SESSION_DISK_FILE};
    use std::os::unix::fs::MetadataExt;
    use std::path::Path;
    use std::sync::Arc;

    fn vm(backend: BackendKind, dir: &Path) -> Arc<Vm> {
        Vm::new(VmConfig {
            backend,
            profile_dir: dir.join("profile"),
            helper_exe: "/nonexistent/cowork-helper".into(),
            egress: crate::egress::EgressProxy::from_env(),
        })
    }

    #[test]
    fn the_session_disk_is_created_sparse_grown_and_never_shrunk() {
        let tmp = tempfile::tempdir().unwrap();
        let vm = vm(BackendKind::Qemu, tmp.path());
        let disk = vm.config().session_disk();
        assert_eq!(disk, tmp.path().join("profile").join(SESSION_DISK_FILE));

        vm.create_storage(Some(1)).unwrap();
        let meta = std::fs::metadata(&disk).unwrap();
        assert_eq!(meta.len(), GIB);
        assert!(
            meta.blocks() * 512 < 1 << 20,
            "not sparse: {} blocks",
            meta.blocks()
        );
        assert_eq!(meta.mode() & 0o777, 0o600);
        let data = b"a session's bytes";
        std::os::unix::fs::FileExt::write_all_at(
            &std::fs::OpenOptions::new().write(true).open(&disk).unwrap(),
            data,
            4096,
        )
        .unwrap();

        // startVM keeps the disk as it is; a larger createVM grows it; a
        // smaller one keeps it; the data survives all of them.
        vm.create_storage(None).unwrap();
        assert_eq!(std::fs::metadata(&disk).unwrap().len(), GIB);
        vm.create_storage(Some(2)).unwrap();
        assert_eq!(std::fs::metadata(&disk).unwrap().len(), 2 * GIB);
        vm.create_storage(Some(1)).unwrap();
        assert_eq!(std::fs::metadata(&disk).unwrap().len(), 2 * GIB);
        let mut back = vec![0u8; data.len()];
        std::os::unix::fs::FileExt::read_exact_at(
            &std::fs::File::open(&disk).unwrap(),
            &mut back,
            4096,
        )
        .unwrap();
        assert_eq!(&back, data);

        for bad in [0, MAX_SESSION_DISK_GIB + 1, u64::MAX] {
            let e = vm.create_storage(Some(bad)).unwrap_err();
            assert!(e.to_string().contains("diskSizeGB"), "{e}");
        }
        assert_eq!(std::fs::metadata(&disk).unwrap().len(), 2 * GIB);
    }

    #[test]
    fn start_creates_a_missing_disk_with_the_default_size() {
        let tmp = tempfile::tempdir().unwrap();
        let vm = vm(BackendKind::Kvm, tmp.path());
        vm.create_storage(None).unwrap();
        let meta = std::fs::metadata(vm.config().session_disk()).unwrap();
        assert_eq!(meta.len(), DEFAULT_SESSION_DISK_GIB * GIB);
        assert!(!vm.config().sessions_dir().exists());
    }

    #[test]
    fn the_sandbox_keeps_its_host_sessions_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let vm = vm(BackendKind::Sandbox, tmp.path());
        vm.create_storage(Some(1)).unwrap();
        assert!(vm.config().sessions_dir().is_dir());
        assert!(!vm.config().session_disk().exists());
    }

    #[tokio::test]
    async fn the_janitor_needs_the_guest_under_vm_backends() {
        let tmp = tempfile::tempdir().unwrap();
        for backend in [BackendKind::Qemu, BackendKind::Kvm] {
            let vm = vm(backend, tmp.path());
            let e = vm
                .janitor(Op::DiskInfo { low_water_bytes: 0 })
                .await
                .unwrap_err();
            let text = e.to_string();
            assert!(text.contains("getSessionsDiskInfo"), "{text}");
            assert!(text.contains("call startVM first"), "{text}");
            assert!(text.contains(backend.as_str()), "{text}");
            let e = vm
                .janitor(Op::DeleteSessionDirs {
                    names: vec!["s1".into()],
                })
                .await
                .unwrap_err();
            assert!(matches!(e, VmError::JanitorNeedsGuest { .. }), "{e}");
            // The host never made a sessions directory to fall back on.
            assert!(!vm.config().sessions_dir().exists());
        }
        // The sandbox still measures its host directory.
        let vm = vm(BackendKind::Sandbox, tmp.path());
        let info = vm
            .janitor(Op::DiskInfo { low_water_bytes: 0 })
            .await
            .unwrap();
        assert!(info["totalBytes"].as_u64().unwrap_or(0) > 0, "{info}");
    }
}
