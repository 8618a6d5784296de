//! The profile's session disk (`sessiondata.img`) as the VM suites see it:
//! its path and shape on the host (sparse, unlocked once the VM stopped),
//! the agent's log lines about it, a session writing a file on it, and
//! `getSessionsDiskInfo`.
//!
//! Limits: the agent's log lines are matched as text (they are
//! `guest-agent/src/agent/sessiondisk.rs`'s messages, relayed through the
//! guest console into the helper's log).

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use cowork_helper::client::{Pipe, Subscription};
use cowork_helper::daemon::profile_key;
use serde_json::{json, Value};

use super::session::{assert_exit_0, read_file, run, sh};
use super::vm_helper;

/// One GiB.
pub const GIB: u64 = 1 << 30;
/// The file (relative to its session's directory) a session keeps on the
/// disk across boots.
pub const KEPT_FILE: &str = "kept.txt";
/// The agent's log line for a blank disk it is about to format.
pub const FORMATTING: &str = "formatting the blank session disk";
/// The agent's log line for a blank disk it formatted and mounted.
pub const FORMATTED: &str = "session disk formatted and mounted";
/// The agent's log line for a formatted disk it mounted as it was.
pub const MOUNTED: &str = "session disk mounted";
/// The agent's log line for the disk settled read-only at power-off.
pub const REMOUNTED_READ_ONLY: &str = "session disk remounted read-only";
/// The agent's log line for a disk whose journal had to be replayed.
pub const NOT_CLEAN: &str = "not cleanly unmounted";
/// The agent's log line for a filesystem grown to a larger disk.
pub const GROWN: &str = "session disk filesystem grown to the whole disk";
/// The helper's log line for the image closed after the VM stopped.
pub const CLOSED: &str = "session disk closed";
/// Most an empty sparse image may occupy on the host.
const SPARSE_MAX_BYTES: u64 = 1 << 20;
/// Bytes of a `st_blocks` unit.
const BLOCK_BYTES: u64 = 512;
/// Share of the disk a fresh ext4 filesystem offers at least, in percent
/// (the rest is its metadata).
const FS_SHARE_PERCENT: u64 = 85;

/// The session disk image of profile `profile` at `root`, for a helper
/// started in `helper_dir`.
pub fn image_path(helper_dir: &Path, profile: &str, root: &str) -> PathBuf {
    vm_helper::data_dir(helper_dir)
        .join("profiles")
        .join(profile_key(Some(profile), Some(root)))
        .join("sessiondata.img")
}

/// The image exists, is `size` bytes long and sparse (almost nothing
/// allocated yet).
pub fn assert_sparse(disk: &Path, size: u64) {
    let meta = std::fs::metadata(disk).expect("createVM made no session disk");
    assert_eq!(meta.len(), size);
    assert!(
        meta.blocks() * BLOCK_BYTES < SPARSE_MAX_BYTES,
        "the session disk is not sparse: {} blocks",
        meta.blocks()
    );
}

/// The image is not locked by anyone (the helper closed it): an exclusive
/// `flock` succeeds.
pub fn assert_unlocked(disk: &Path) {
    let f = File::open(disk).expect("open the session disk");
    // SAFETY: flock on an owned descriptor, released when `f` closes.
    let r = unsafe {
        libc::flock(
            std::os::fd::AsRawFd::as_raw_fd(&f),
            libc::LOCK_EX | libc::LOCK_NB,
        )
    };
    assert_eq!(r, 0, "the session disk is still locked after stopVM");
}

/// Process `id` in `session` writes `content` to [`KEPT_FILE`] in its
/// working directory, then runs `more` (a shell command list, may be empty).
/// Asserts exit 0, that the working directory is the session's on
/// `/sessions`, and that `/sessions` is an ext4 mount; returns that mount's
/// `/proc/mounts` line and the whole stdout.
pub async fn write_on_disk(
    pipe: &Pipe,
    sub: &mut Subscription,
    id: &str,
    session: &str,
    content: &str,
    more: &str,
    limit: Duration,
) -> (String, String) {
    let more = if more.is_empty() {
        String::new()
    } else {
        format!(" && {more}")
    };
    let script = format!(
        "printf '{}' > {KEPT_FILE} && pwd && grep ' /sessions ' /proc/mounts{more}",
        content.replace('\n', "\\n")
    );
    let out = run(pipe, sub, sh(id, session, &script), limit).await;
    assert_exit_0(id, &out);
    let text = out.stdout_str();
    assert!(
        text.starts_with(&format!("/sessions/{session}\n")),
        "{text}"
    );
    let mount = text
        .lines()
        .find(|l| l.split_whitespace().nth(1) == Some("/sessions"))
        .unwrap_or_default()
        .to_string();
    assert!(
        mount.split_whitespace().nth(2) == Some("ext4"),
        "/sessions is not the ext4 session disk: {text}"
    );
    (mount, text)
}

/// readFile of `session`'s [`KEPT_FILE`], decoded.
pub async fn read_kept(pipe: &Pipe, session: &str) -> Result<String, String> {
    read_file(pipe, session, KEPT_FILE).await
}

/// What `getSessionsDiskInfo` says.
pub struct DiskInfo {
    /// `totalBytes`.
    pub total: u64,
    /// The names of the sessions it lists.
    pub names: Vec<String>,
    /// The whole reply, for messages.
    pub reply: Value,
}

impl DiskInfo {
    /// Whether the filesystem spans a disk of `size` bytes (all of it but
    /// its metadata).
    pub fn spans(&self, size: u64) -> bool {
        self.total > size * FS_SHARE_PERCENT / 100 && self.total <= size
    }

    /// Whether it lists `session`.
    pub fn lists(&self, session: &str) -> bool {
        self.names.iter().any(|n| n == session)
    }
}

/// `getSessionsDiskInfo {lowWaterBytes: 0}`.
pub async fn disk_info(pipe: &Pipe) -> DiskInfo {
    let reply = pipe
        .call("getSessionsDiskInfo", json!({"lowWaterBytes": 0}))
        .await
        .expect("getSessionsDiskInfo");
    let total = reply["totalBytes"].as_u64().unwrap_or(0);
    let names = reply["sessions"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s["name"].as_str().map(String::from))
        .collect();
    DiskInfo {
        total,
        names,
        reply,
    }
}
