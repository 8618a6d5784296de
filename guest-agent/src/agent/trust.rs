//! Trusting the host's egress CA: the host intercepts the API hosts' TLS to
//! put real credentials into requests (sessions hold placeholders only), so
//! session programs must trust the CA that signs those hosts' certificates.
//!
//! [`trust_ca`] (a VM's `Setup` carries the CA, trusted while the boot
//! finishes; elsewhere the host's `TrustCa` request, sent once after the
//! hello) makes the CA certificate, and nothing else, trusted in three
//! places:
//!
//! - [`CA_FILE`] (`/run/cowork/egress-ca.pem`, mode 0644): a file holding
//!   only that CA, which the host names in every spawn's
//!   `NODE_EXTRA_CA_CERTS` (the Claude Code CLI's runtime reads that
//!   variable, and not `SSL_CERT_FILE`);
//! - the userland's system bundle [`SYSTEM_BUNDLE`] (curl, git, Python's
//!   ssl): the CA is appended between [`BEGIN_MARK`] and [`END_MARK`], a
//!   second request replaces that block. In a VM the root is an overlay
//!   whose upper layer is a tmpfs, so the bundle is rewritten there and
//!   the read-only image (ours or the client's `rootfs.img`) never
//!   changes. Where the bundle cannot be rewritten in place (the sandbox
//!   binds the host's `/etc` read-only) the combined bundle is written to
//!   [`COMBINED_BUNDLE`] and bound over it, in the agent's mount namespace,
//!   which every session's inherits;
//! - [`ANCHOR`] in `/usr/local/share/ca-certificates` when that directory
//!   is writable, so an `update-ca-certificates` run by root keeps it.
//!
//! Limits: only the Debian/Ubuntu bundle path is handled (both userlands
//! are Debian-family); a userland without it (the busybox initramfs) gets
//! the CA file only.

use std::io;
use std::path::{Path, PathBuf};

use crate::sys;

/// The file holding only the egress CA.
pub const CA_FILE: &str = crate::proto::EGRESS_CA_FILE;
/// The system's CA bundle on Debian and Ubuntu.
pub const SYSTEM_BUNDLE: &str = "etc/ssl/certs/ca-certificates.crt";
/// Where the combined bundle lives when it must be bound over the system's.
pub const COMBINED_BUNDLE: &str = "run/cowork/ca-certificates.crt";
/// The CA as a local trust anchor for `update-ca-certificates`.
pub const ANCHOR: &str = "usr/local/share/ca-certificates/cowork-egress-ca.crt";
/// Opens our block in the system bundle.
pub const BEGIN_MARK: &str = "# BEGIN cowork-helper egress CA\n";
/// Closes our block in the system bundle.
pub const END_MARK: &str = "# END cowork-helper egress CA\n";
/// Largest CA certificate accepted (a P-256 CA is under 1 KiB).
pub const MAX_PEM: usize = 16 * 1024;
/// Mode of the files written (every session user reads them).
const FILE_MODE: u32 = 0o644;

/// The CA could not be trusted.
#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    #[error("the CA is not one PEM certificate of at most {MAX_PEM} bytes")]
    NotAPem,
    #[error("cannot write {path}: {source}")]
    Write { path: PathBuf, source: io::Error },
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("cannot bind {from} over {to}: {source}")]
    Bind {
        from: PathBuf,
        to: PathBuf,
        source: io::Error,
    },
}

/// What [`trust_ca`] did, for the reply and the log.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Trusted {
    /// The system bundle now holds the CA.
    pub bundle: bool,
    /// ... through a bind mount of a combined copy.
    pub bound: bool,
    /// The trust anchor was written.
    pub anchor: bool,
}

/// The wire form of a [`trust_ca`] result (the final hello's
/// `caTrust`), logged once here.
pub fn report(result: Result<Trusted, TrustError>) -> crate::proto::CaTrust {
    match result {
        Ok(done) => {
            // The host logs the same from the reply or the final hello.
            tracing::debug!(
                bundle = done.bundle,
                bound = done.bound,
                anchor = done.anchor,
                "egress CA trusted"
            );
            crate::proto::CaTrust {
                bundle: done.bundle,
                bound: done.bound,
                anchor: done.anchor,
                error: None,
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "the egress CA could not be trusted");
            crate::proto::CaTrust {
                error: Some(e.to_string()),
                ..Default::default()
            }
        }
    }
}

/// Checks that `pem` is one certificate.
fn check_pem(pem: &str) -> Result<&str, TrustError> {
    let pem = pem.trim();
    let ok = pem.len() <= MAX_PEM
        && pem.starts_with("-----BEGIN CERTIFICATE-----")
        && pem.ends_with("-----END CERTIFICATE-----")
        && pem.matches("-----BEGIN").count() == 1
        && pem
            .bytes()
            .all(|b| b.is_ascii_graphic() || b == b'\n' || b == b'\r' || b == b' ');
    if ok {
        Ok(pem)
    } else {
        Err(TrustError::NotAPem)
    }
}

/// `bundle` without our block, with `pem` as a new block at its end.
pub fn with_block(bundle: &str, pem: &str) -> String {
    let mut out = match (bundle.find(BEGIN_MARK), bundle.find(END_MARK)) {
        (Some(b), Some(e)) if e > b => format!("{}{}", &bundle[..b], &bundle[e + END_MARK.len()..]),
        _ => bundle.to_string(),
    };
    if !out.is_empty() && !out.ends_with('\n') {
        out.push('\n');
    }
    out.push_str(BEGIN_MARK);
    out.push_str(pem);
    out.push('\n');
    out.push_str(END_MARK);
    out
}

/// Writes `contents` to `path` through a temporary file renamed over it.
fn write_atomic(path: &Path, contents: &[u8]) -> io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("cowork-tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(FILE_MODE)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)?;
    f.write_all(contents)?;
    f.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(FILE_MODE))?;
    drop(f);
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// Makes `pem` trusted below `root` (`/` in the guest); see the module doc.
pub fn trust_ca(root: &Path, pem: &str) -> Result<Trusted, TrustError> {
    let pem = check_pem(pem)?;
    let write_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| TrustError::Write { path, source }
    };
    let ca_file = root.join(CA_FILE.trim_start_matches('/'));
    if let Some(dir) = ca_file.parent() {
        std::fs::create_dir_all(dir).map_err(write_err(dir))?;
    }
    write_atomic(&ca_file, format!("{pem}\n").as_bytes()).map_err(write_err(&ca_file))?;

    let mut done = Trusted::default();
    let bundle = root.join(SYSTEM_BUNDLE);
    match std::fs::read_to_string(&bundle) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(TrustError::Read {
                path: bundle,
                source,
            })
        }
        Ok(current) => {
            let combined = with_block(&current, pem);
            match write_atomic(&bundle, combined.as_bytes()) {
                Ok(()) => done.bundle = true,
                // A read-only bind of the host's /etc (the sandbox), or our
                // own bind from an earlier request (renaming over a mount
                // point is EBUSY).
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EROFS | libc::EBUSY | libc::EACCES | libc::EPERM)
                    ) =>
                {
                    bind_combined(root, &bundle, &combined)?;
                    done.bundle = true;
                    done.bound = true;
                }
                Err(source) => {
                    return Err(TrustError::Write {
                        path: bundle,
                        source,
                    })
                }
            }
        }
    }
    let anchor = root.join(ANCHOR);
    if anchor.parent().is_some_and(Path::is_dir) {
        done.anchor = write_atomic(&anchor, format!("{pem}\n").as_bytes()).is_ok();
    }
    Ok(done)
}

/// Writes `combined` to [`COMBINED_BUNDLE`] and binds it over `bundle`
/// (once: a later call rewrites the bound file in place).
fn bind_combined(root: &Path, bundle: &Path, combined: &str) -> Result<(), TrustError> {
    let copy = root.join(COMBINED_BUNDLE);
    let already_bound = sys::stat(&copy)
        .and_then(|c| sys::stat(bundle).map(|b| (c, b)))
        .is_ok_and(|(c, b)| c.dev == b.dev && c.ino == b.ino);
    if let Some(dir) = copy.parent() {
        std::fs::create_dir_all(dir).map_err(|source| TrustError::Write {
            path: dir.to_path_buf(),
            source,
        })?;
    }
    if already_bound {
        // The bound inode must stay: write it in place.
        return std::fs::write(&copy, combined)
            .map_err(|source| TrustError::Write { path: copy, source });
    }
    write_atomic(&copy, combined.as_bytes()).map_err(|source| TrustError::Write {
        path: copy.clone(),
        source,
    })?;
    let bind_err = |source| TrustError::Bind {
        from: copy.clone(),
        to: bundle.to_path_buf(),
        source,
    };
    let from = sys::cstring(&copy).map_err(bind_err)?;
    let to = sys::cstring(bundle).map_err(bind_err)?;
    sys::mount(Some(&from), &to, None, libc::MS_BIND, None).map_err(bind_err)?;
    // Read-only for the sessions, like the rest of /etc there.
    sys::mount(
        None,
        &to,
        None,
        libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY,
        None,
    )
    .map_err(bind_err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::testns;

    const PEM: &str = "-----BEGIN CERTIFICATE-----\nMIIBdGVzdA==\n-----END CERTIFICATE-----";
    const OTHER: &str = "-----BEGIN CERTIFICATE-----\nMIIBb3RoZXI=\n-----END CERTIFICATE-----";
    const HOST_BUNDLE: &str =
        "-----BEGIN CERTIFICATE-----\nSYSTEMROOT\n-----END CERTIFICATE-----\n";

    fn tree() -> tempfile::TempDir {
        let t = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(t.path().join("etc/ssl/certs")).unwrap();
        std::fs::write(t.path().join(SYSTEM_BUNDLE), HOST_BUNDLE).unwrap();
        std::fs::create_dir_all(t.path().join("usr/local/share/ca-certificates")).unwrap();
        t
    }

    #[test]
    fn the_ca_joins_the_bundle_once_and_a_new_one_replaces_it() {
        let t = tree();
        let done = trust_ca(t.path(), PEM).unwrap();
        assert_eq!(
            done,
            Trusted {
                bundle: true,
                bound: false,
                anchor: true
            }
        );
        let ca = std::fs::read_to_string(t.path().join(CA_FILE.trim_start_matches('/'))).unwrap();
        assert_eq!(ca, format!("{PEM}\n"));
        let bundle = std::fs::read_to_string(t.path().join(SYSTEM_BUNDLE)).unwrap();
        assert!(
            bundle.starts_with(HOST_BUNDLE) && bundle.contains(PEM),
            "{bundle}"
        );
        trust_ca(t.path(), OTHER).unwrap();
        let bundle = std::fs::read_to_string(t.path().join(SYSTEM_BUNDLE)).unwrap();
        assert!(bundle.contains(OTHER) && !bundle.contains(PEM), "{bundle}");
        assert_eq!(bundle.matches(BEGIN_MARK).count(), 1);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(t.path().join(SYSTEM_BUNDLE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o644);
        assert_eq!(
            std::fs::read_to_string(t.path().join(ANCHOR)).unwrap(),
            format!("{OTHER}\n")
        );
    }

    #[test]
    fn without_a_bundle_only_the_ca_file_is_written() {
        let t = tempfile::tempdir().unwrap();
        assert_eq!(trust_ca(t.path(), PEM).unwrap(), Trusted::default());
        assert!(t.path().join(CA_FILE.trim_start_matches('/')).is_file());
    }

    #[test]
    fn anything_but_one_certificate_is_refused() {
        let t = tree();
        for bad in [
            "",
            "not a pem",
            &format!("{PEM}\n{OTHER}"),
            "-----BEGIN PRIVATE KEY-----\nx\n-----END PRIVATE KEY-----",
            &format!(
                "-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----",
                "A".repeat(MAX_PEM)
            ),
        ] {
            assert!(
                matches!(trust_ca(t.path(), bad), Err(TrustError::NotAPem)),
                "{bad:.40}"
            );
        }
        assert_eq!(
            std::fs::read_to_string(t.path().join(SYSTEM_BUNDLE)).unwrap(),
            HOST_BUNDLE
        );
    }

    /// The sandbox's case: `/etc` is a read-only bind; the combined bundle
    /// is bound over the system's, and a second CA rewrites it in place.
    #[test]
    fn ns_a_read_only_etc_gets_a_bound_combined_bundle() {
        let Some(dir) = testns::in_namespaces(
            "agent::trust::tests::ns_a_read_only_etc_gets_a_bound_combined_bundle",
            &["-Ur", "-m"],
        ) else {
            return;
        };
        std::fs::create_dir_all(dir.join("etc/ssl/certs")).unwrap();
        std::fs::write(dir.join(SYSTEM_BUNDLE), HOST_BUNDLE).unwrap();
        let etc = sys::cstring(dir.join("etc")).unwrap();
        sys::mount(Some(&etc), &etc, None, libc::MS_BIND, None).unwrap();
        sys::mount(
            None,
            &etc,
            None,
            libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY,
            None,
        )
        .unwrap();
        let done = trust_ca(&dir, PEM).unwrap();
        assert!(done.bound && done.bundle, "{done:?}");
        let bundle = std::fs::read_to_string(dir.join(SYSTEM_BUNDLE)).unwrap();
        assert!(
            bundle.starts_with(HOST_BUNDLE) && bundle.contains(PEM),
            "{bundle}"
        );
        let done = trust_ca(&dir, OTHER).unwrap();
        assert!(done.bound);
        let bundle = std::fs::read_to_string(dir.join(SYSTEM_BUNDLE)).unwrap();
        assert!(bundle.contains(OTHER) && !bundle.contains(PEM), "{bundle}");
        // The host's file under the bind is untouched.
        sys::umount2(&sys::cstring(dir.join(SYSTEM_BUNDLE)).unwrap(), 0).unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.join(SYSTEM_BUNDLE)).unwrap(),
            HOST_BUNDLE
        );
    }
}
