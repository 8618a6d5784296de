//! `installSdk`: the Claude Code CLI under the client's SDK directory,
//! validated on the host, granted read-only to the guest and installed by
//! the agent; remembered so every later boot installs it again (with its
//! startup steps).
//!
//! Limits: one SDK per VM (the last request wins); the version must be a
//! valid name and `<subpath>/<version>/claude` a file.

use std::path::{Path, PathBuf};

use guest_agent::names::NameError;
use guest_agent::proto::Op;
use serde_json::{json, Value};

use super::link::AgentLink;
use super::{ProfileVm, ProfileVmError, CALL_TIMEOUT};
use crate::backend::GrantError;
use crate::protocol::{event, step};
use vmm::sync::MutexExt;

/// Why an `installSdk` request was refused on the host.
#[derive(Debug, thiserror::Error)]
pub enum SdkError {
    #[error("installSdk: {0}")]
    Subpath(#[source] NameError),
    #[error("installSdk: invalid version {0:?}")]
    Version(String),
    #[error("installSdk: {}: {source}", path.display())]
    Binary {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("installSdk: {} is not a file", .0.display())]
    NotAFile(PathBuf),
    #[error("installSdk: /{rel}: {source}")]
    Resolve { rel: String, source: std::io::Error },
    /// The backend could not make the binary reachable for the guest.
    #[error("installSdk: {0}")]
    Grant(#[source] GrantError),
}

impl ProfileVm {
    /// Records the SDK to install and installs it now when the guest is up.
    pub async fn install_sdk(
        &self,
        sdk_subpath: &str,
        version: &str,
    ) -> Result<Value, ProfileVmError> {
        let rel = match check_sdk(sdk_subpath, version) {
            Ok(rel) => rel,
            Err(e) => {
                self.hub
                    .publish(&event::startup_step(step::SDK_INSTALL, "started"))
                    .await;
                self.publish_sdk_outcome(false).await;
                return Err(e.into());
            }
        };
        *self.sdk.locked() = Some((rel.clone(), version.to_string()));
        let Ok(link) = self.connected_link() else {
            // Installed (with its startup steps) when the guest connects.
            return Ok(json!({"installed": false, "pending": true}));
        };
        self.hub
            .publish(&event::startup_step(step::SDK_INSTALL, "started"))
            .await;
        let outcome = self.apply_sdk(&link, &rel, version).await;
        self.publish_sdk_outcome(outcome.is_ok()).await;
        outcome
    }

    pub(super) async fn publish_sdk_outcome(&self, ok: bool) {
        let status = if ok { "completed" } else { "failed" };
        self.hub
            .publish(&event::startup_step(step::SDK_INSTALL, status))
            .await;
    }

    pub(super) async fn apply_sdk(
        &self,
        link: &AgentLink,
        rel: &str,
        version: &str,
    ) -> Result<Value, ProfileVmError> {
        let host_paths = self.current_host_paths().await?;
        let real = std::fs::canonicalize(Path::new("/").join(rel)).map_err(|source| {
            SdkError::Resolve {
                rel: rel.to_string(),
                source,
            }
        })?;
        let real_rel = real.to_string_lossy().trim_start_matches('/').to_string();
        let op = Op::InstallSdk {
            source: host_paths.grant_sdk(&real_rel).map_err(SdkError::Grant)?,
            version: version.to_string(),
        };
        link.call(op, &[], CALL_TIMEOUT).await.map(|(v, _)| v)
    }
}

/// Validates an `installSdk` request against the host file system; returns
/// the CLI's path relative to `/`.
fn check_sdk(sdk_subpath: &str, version: &str) -> Result<String, SdkError> {
    let sub = guest_agent::names::host_relative_path(sdk_subpath).map_err(SdkError::Subpath)?;
    guest_agent::names::session_name(version)
        .map_err(|_| SdkError::Version(version.to_string()))?;
    let rel = format!("{sub}/{version}/claude");
    let host = Path::new("/").join(&rel);
    let meta = std::fs::metadata(&host).map_err(|source| SdkError::Binary {
        path: host.clone(),
        source,
    })?;
    if !meta.is_file() {
        return Err(SdkError::NotAFile(host));
    }
    Ok(rel)
}
