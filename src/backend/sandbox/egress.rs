//! The sandbox's only way out: a unix socket per sandbox on which the
//! daemon's egress proxy ([`crate::egress::EgressProxy`]) listens.
//!
//! The sandbox has a network namespace of its own with nothing but `lo`, so
//! its agent relays every session connection to this socket, and the proxy
//! applies the spawn's allowlist on the host. The socket lives in a private
//! directory of the daemon (0700, the socket itself 0600), named after the
//! daemon's pid and a random part, under `$XDG_RUNTIME_DIR` or the temporary
//! directory. The init binds that directory at [`super::EGRESS_DIR`] for the
//! agent alone (the agent hides it from what it spawns, as it hides
//! [`super::HOST_ROOT`]).
//!
//! [`EgressSocket`] owns the directory and the task that accepts on the
//! socket: dropping it stops accepting, closes the listener and removes the
//! directory. Connections already accepted end when the sandbox's side
//! closes them (all of them, at the latest, when the sandbox dies).
//!
//! Limits: a directory left behind by a daemon that was killed is removed by
//! the next daemon that starts a sandbox under the same base directory,
//! recognised by the dead pid in its name.

use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::net::UnixListener;
use tokio::task::JoinHandle;

use super::SandboxError;
use crate::egress::EgressProxy;
use crate::hostfs::{HostEnv, DEFAULT_TEMP_DIR};

/// File name of the proxy's socket in the run directory (and in
/// [`super::EGRESS_DIR`] inside the sandbox).
pub const SOCKET_NAME: &str = "proxy.sock";

/// Prefix of the run directories:
/// `cowork-sandbox-<daemon pid>-<sequence>-<random>`.
const RUN_DIR_PREFIX: &str = "cowork-sandbox-";

/// Random bytes in a run directory's name, so another user of a shared
/// temporary directory cannot take the name first.
const RUN_DIR_RANDOM_BYTES: usize = 8;

/// Longest unix socket path `bind` accepts (`sun_path` minus the NUL).
const MAX_SOCKET_PATH: usize = 107;

/// Only the daemon's user may enter the run directory.
const RUN_DIR_MODE: u32 = 0o700;

/// Only the daemon's user (the sandbox's agent, mapped onto the same uid)
/// may connect to the socket.
const SOCKET_MODE: u32 = 0o600;

/// Distinguishes the run directories of one daemon's sandboxes.
static RUN_DIR_SEQ: AtomicU64 = AtomicU64::new(0);

/// One sandbox's proxy socket and the task serving it.
#[derive(Debug)]
pub struct EgressSocket {
    dir: PathBuf,
    task: JoinHandle<()>,
}

impl EgressSocket {
    /// Creates the run directory (under `host`'s runtime or temporary
    /// directory, see [`base_dir`]), binds the socket in it and serves it
    /// with `proxy` on a new task. Must be called within a tokio runtime.
    pub fn open(proxy: EgressProxy, host: &HostEnv) -> Result<EgressSocket, SandboxError> {
        let mut random = [0u8; RUN_DIR_RANDOM_BYTES];
        getrandom::getrandom(&mut random).map_err(|e| SandboxError::Io {
            what: "name the sandbox run directory",
            source: std::io::Error::other(e.to_string()),
        })?;
        let random: String = random.iter().map(|b| format!("{b:02x}")).collect();
        let name = format!(
            "{RUN_DIR_PREFIX}{}-{}-{random}",
            std::process::id(),
            RUN_DIR_SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let base = base_dir(&name, host);
        let dir = base.join(&name);
        let io_err = |what| move |source| SandboxError::Io { what, source };
        std::fs::create_dir_all(&base).map_err(io_err("create the sandbox run directory"))?;
        sweep_stale(&base);
        // A leftover of a killed daemon whose pid came round again.
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::DirBuilder::new()
            .mode(RUN_DIR_MODE)
            .create(&dir)
            .map_err(io_err("create the sandbox run directory"))?;
        // From here on, dropping `guard` removes the directory again.
        let guard = DirGuard(dir);
        let path = guard.0.join(SOCKET_NAME);
        let listener =
            UnixListener::bind(&path).map_err(io_err("bind the sandbox's egress socket"))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(SOCKET_MODE))
            .map_err(io_err("restrict the sandbox's egress socket"))?;
        let task = tokio::spawn(async move {
            if let Err(e) = proxy.serve_unix(listener).await {
                tracing::warn!(error = %e, "the sandbox's egress socket stopped accepting");
            }
        });
        tracing::debug!(dir = %guard.0.display(), "sandbox egress socket listening");
        Ok(EgressSocket {
            dir: guard.into_inner(),
            task,
        })
    }

    /// The run directory holding [`SOCKET_NAME`].
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for EgressSocket {
    fn drop(&mut self) {
        // The listener is owned by the task's future, which abort drops.
        self.task.abort();
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(dir = %self.dir.display(), error = %e, "cannot remove the sandbox run directory");
            }
        }
    }
}

/// Removes its directory unless defused with [`DirGuard::into_inner`].
struct DirGuard(PathBuf);

impl DirGuard {
    fn into_inner(mut self) -> PathBuf {
        std::mem::take(&mut self.0)
    }
}

impl Drop for DirGuard {
    fn drop(&mut self) {
        if !self.0.as_os_str().is_empty() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// `host`'s `$XDG_RUNTIME_DIR`, else its temporary directory, else `/tmp`:
/// the first under which the socket path of run directory `name` fits
/// `sun_path`.
fn base_dir(name: &str, host: &HostEnv) -> PathBuf {
    let fits = |base: &Path| base.join(name).join(SOCKET_NAME).as_os_str().len() <= MAX_SOCKET_PATH;
    host.runtime_dir
        .iter()
        .chain([&host.temp_dir])
        .find(|b| b.is_absolute() && fits(b))
        .cloned()
        .unwrap_or_else(|| PathBuf::from(DEFAULT_TEMP_DIR))
}

/// The daemon pid in a run directory's name, if it is one.
fn owner_pid(name: &str) -> Option<u32> {
    let mut parts = name.strip_prefix(RUN_DIR_PREFIX)?.split('-');
    let (pid, seq, random) = (parts.next()?, parts.next()?, parts.next()?);
    let random_ok =
        random.len() == 2 * RUN_DIR_RANDOM_BYTES && random.bytes().all(|b| b.is_ascii_hexdigit());
    (parts.next().is_none() && random_ok && seq.parse::<u64>().is_ok())
        .then(|| pid.parse().ok())
        .flatten()
}

/// Removes the run directories of daemons that are gone.
fn sweep_stale(base: &Path) {
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(owner_pid) else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            tracing::debug!(dir = %entry.path().display(), "removing a dead daemon's sandbox run directory");
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn run_dir_names_carry_the_pid() {
        assert_eq!(
            owner_pid("cowork-sandbox-123-4-0123456789abcdef"),
            Some(123)
        );
        assert_eq!(owner_pid("cowork-sandbox-123-4"), None);
        assert_eq!(owner_pid("cowork-sandbox-123-4-0123456789abcdef.x"), None);
        assert_eq!(owner_pid("cowork-sandbox-x-1-0123456789abcdef"), None);
        assert_eq!(owner_pid("cowork-qemu-123-4"), None);
    }

    #[test]
    fn base_dir_fits_sun_path() {
        let longest = "cowork-sandbox-4294967295-18446744073709551615-0123456789abcdef";
        let base = base_dir(longest, &HostEnv::default());
        assert_eq!(base, Path::new("/tmp"));
        let host = HostEnv {
            runtime_dir: Some(PathBuf::from("/run/user/1000")),
            ..HostEnv::default()
        };
        assert_eq!(base_dir(longest, &host), Path::new("/run/user/1000"));
        let host = HostEnv {
            runtime_dir: Some(PathBuf::from(format!("/{}", "r".repeat(60)))),
            temp_dir: PathBuf::from("relative"),
            ..HostEnv::default()
        };
        let base = base_dir(longest, &host);
        assert!(base.is_absolute());
        assert!(
            base.join(longest).join(SOCKET_NAME).as_os_str().len() <= MAX_SOCKET_PATH
                || base == Path::new("/tmp")
        );
    }

    #[tokio::test]
    async fn socket_is_private_served_and_removed() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let proxy = EgressProxy::direct();
        let socket = EgressSocket::open(proxy, &HostEnv::default()).expect("open");
        let dir = socket.dir().to_path_buf();
        let path = dir.join(SOCKET_NAME);
        let meta = std::fs::metadata(&dir).expect("dir");
        assert_eq!(meta.mode() & 0o777, RUN_DIR_MODE);
        let meta = std::fs::metadata(&path).expect("socket");
        assert_eq!(meta.mode() & 0o777, SOCKET_MODE);

        // The proxy answers: a request without a credential gets 407.
        let mut stream = tokio::net::UnixStream::connect(&path)
            .await
            .expect("connect");
        stream
            .write_all(b"CONNECT example.invalid:443 HTTP/1.1\r\nHost: example.invalid:443\r\n\r\n")
            .await
            .expect("write");
        let mut head = vec![0u8; 12];
        tokio::time::timeout(
            std::time::Duration::from_secs(10),
            stream.read_exact(&mut head),
        )
        .await
        .expect("reply in time")
        .expect("read");
        assert_eq!(&head, b"HTTP/1.1 407");

        // A second name for the socket, outside the run directory, shows
        // whether the listener itself is closed after the drop.
        let alias = dir.with_extension("alias");
        std::fs::hard_link(&path, &alias).expect("link the socket");
        std::os::unix::net::UnixStream::connect(&alias).expect("served through the alias");
        drop(socket);
        assert!(!dir.exists(), "run directory left behind");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let refused = loop {
            match std::os::unix::net::UnixStream::connect(&alias) {
                Err(e) => break e,
                Ok(_) if std::time::Instant::now() > deadline => panic!("still accepting"),
                Ok(_) => tokio::time::sleep(std::time::Duration::from_millis(10)).await,
            }
        };
        let _ = std::fs::remove_file(&alias);
        assert_eq!(
            refused.raw_os_error(),
            Some(libc::ECONNREFUSED),
            "{refused}"
        );
    }
}
