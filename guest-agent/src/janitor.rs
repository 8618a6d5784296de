//! The session-disk janitor: disk usage, deleting session directories and
//! pruning their caches.
//!
//! Plain functions over a sessions root (`/sessions` in the guest) and the
//! set of *live* sessions (those with a running process), so the agent
//! serves them and the host can run them itself when no agent runs. Results
//! are the JSON shapes of the client's `getSessionsDiskInfo`,
//! `deleteSessionDirs` and `pruneSessionCaches`.
//!
//! Semantics:
//! * Sessions are the directories directly below the root whose names pass
//!   [`crate::names::session_name`]; symlinks and other entries are ignored,
//!   and so is [`LOST_FOUND`], which ext4 keeps at the root of the session
//!   disk (it is neither listed, pruned nor deletable).
//! * Sizes are allocated bytes (`st_blocks * 512`, like `du`), counted
//!   without following symlinks and without descending into mount points
//!   (mount id from `statx`, or a different device on old kernels): a user
//!   folder bind-mounted into `mnt/` is never counted, and never deleted.
//! * [`disk_info`]: `{totalBytes, freeBytes, sessions: [{name, sizeBytes}],
//!   lowWaterBytes, belowLowWater}` where free is what unprivileged users
//!   may still allocate (`statvfs` `f_bavail`).
//! * [`delete_session_dirs`]: `{deleted: [names], errors: {name: message}}`.
//!   Invalid names and live sessions are refused; a session that does not
//!   exist counts as deleted (the call is idempotent). Mounts below the
//!   session are detached first (only the agent has any); if a mount is
//!   still there, nothing of that session is deleted.
//! * [`prune_session_caches`]: `{prunedSessions, skippedSessions,
//!   freedBytes, errors}`. When `only_if_free_bytes_below` is given and free
//!   space is at least that, nothing is done (all lists empty). Otherwise,
//!   for every session that is not live: everything inside
//!   `<session>/.cache` is removed (the directory itself stays), and with
//!   `include_session_tmp` every entry of `<session>/tmp` whose own mtime is
//!   older than `session_tmp_older_than_secs` (all entries when `None`).
//!   `prunedSessions` lists the sessions where something was removed; live
//!   sessions are listed in `skippedSessions`.

use std::collections::{BTreeMap, HashSet};
use std::io;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use crate::sys::{self, StatInfo};
use crate::{mounttable, names};

/// Subdirectory of a session holding caches (the session directory is `HOME`).
pub const CACHE_DIR: &str = ".cache";

/// Subdirectory of a session holding temporary files.
pub const TMP_DIR: &str = "tmp";

/// Errors that concern the whole sessions root.
#[derive(Debug, thiserror::Error)]
pub enum JanitorError {
    #[error("cannot read the sessions disk {path}: {source}")]
    Root { path: String, source: io::Error },
}

fn root_err(root: &Path) -> impl FnOnce(io::Error) -> JanitorError + '_ {
    move |source| JanitorError::Root {
        path: root.display().to_string(),
        source,
    }
}

/// What a walk below one directory found.
#[derive(Default)]
struct Walk {
    /// Non-directories with their allocated bytes.
    files: Vec<(PathBuf, u64)>,
    /// Directories (pre-order) with their allocated bytes, the start excluded.
    dirs: Vec<(PathBuf, u64)>,
    /// Mount points found (not descended into).
    mounts: Vec<PathBuf>,
    /// Entries that could not be examined.
    errors: Vec<String>,
}

impl Walk {
    fn bytes(&self) -> u64 {
        self.files.iter().chain(&self.dirs).map(|(_, b)| *b).sum()
    }
}

/// Walks below `start` without following symlinks or entering mounts.
fn walk(start: &Path) -> io::Result<Walk> {
    let base = sys::lstat(start)?;
    let mut out = Walk::default();
    let mut stack = vec![start.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) => {
                out.errors.push(format!("{}: {e}", dir.display()));
                continue;
            }
        };
        for entry in entries {
            let path = match entry {
                Ok(e) => e.path(),
                Err(e) => {
                    out.errors.push(format!("{}: {e}", dir.display()));
                    continue;
                }
            };
            let st = match sys::lstat(&path) {
                Ok(st) => st,
                Err(e) => {
                    out.errors.push(format!("{}: {e}", path.display()));
                    continue;
                }
            };
            if st.is_dir() {
                if st.crosses_mount_from(&base) {
                    out.mounts.push(path);
                } else {
                    out.dirs.push((path.clone(), st.allocated));
                    stack.push(path);
                }
            } else if !st.is_symlink() && st.crosses_mount_from(&base) {
                // A file bind-mounted over an entry.
                out.mounts.push(path);
            } else {
                out.files.push((path, st.allocated));
            }
        }
    }
    Ok(out)
}

/// Allocated bytes below `dir` (the directory's own blocks included).
fn tree_size(dir: &Path) -> u64 {
    let own = sys::lstat(dir).map(|s| s.allocated).unwrap_or(0);
    own + walk(dir).map(|w| w.bytes()).unwrap_or(0)
}

/// Removes `path` (a file, symlink or directory tree) without following
/// symlinks or crossing mounts. Returns the bytes freed.
fn remove_tree(path: &Path) -> io::Result<u64> {
    let st = sys::lstat(path)?;
    if !st.is_dir() {
        std::fs::remove_file(path)?;
        return Ok(st.allocated);
    }
    let w = walk(path)?;
    if let Some(m) = w.mounts.first() {
        return Err(io::Error::other(format!(
            "{} is a mount point; not removed",
            m.display()
        )));
    }
    if let Some(e) = w.errors.first() {
        return Err(io::Error::other(e.clone()));
    }
    let freed = w.bytes() + st.allocated;
    for (f, _) in &w.files {
        std::fs::remove_file(f)?;
    }
    for (d, _) in w.dirs.iter().rev() {
        std::fs::remove_dir(d)?;
    }
    std::fs::remove_dir(path)?;
    Ok(freed)
}

/// The directory `mke2fs` creates at the root of an ext4 file system; on the
/// session disk it sits beside the sessions but is not one.
pub const LOST_FOUND: &str = "lost+found";

/// Names of the session directories below `root`, sorted.
fn session_names(root: &Path) -> io::Result<Vec<String>> {
    let mut names = Vec::new();
    for entry in std::fs::read_dir(root)? {
        let entry = entry?;
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        if names::session_name(&name).is_err() || name == LOST_FOUND {
            continue;
        }
        if entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

/// Disk usage of the sessions disk and of each session (see the module doc).
pub fn disk_info(root: &Path, low_water_bytes: u64) -> Result<Value, JanitorError> {
    let (total, free, _) = sys::statvfs(root).map_err(root_err(root))?;
    let sessions: Vec<Value> = session_names(root)
        .map_err(root_err(root))?
        .into_iter()
        .map(|name| {
            let size = tree_size(&root.join(&name));
            json!({"name": name, "sizeBytes": size})
        })
        .collect();
    Ok(json!({
        "totalBytes": total,
        "freeBytes": free,
        "sessions": sessions,
        "lowWaterBytes": low_water_bytes,
        "belowLowWater": free < low_water_bytes,
    }))
}

/// Deletes session directories (see the module doc).
pub fn delete_session_dirs(root: &Path, names: &[String], live: &HashSet<String>) -> Value {
    let mut deleted = Vec::new();
    let mut errors = BTreeMap::new();
    for name in names {
        match delete_one(root, name, live) {
            Ok(()) => deleted.push(name.clone()),
            Err(msg) => {
                errors.insert(name.clone(), msg);
            }
        }
    }
    json!({"deleted": deleted, "errors": errors})
}

fn delete_one(root: &Path, name: &str, live: &HashSet<String>) -> Result<(), String> {
    names::session_name(name).map_err(|e| e.to_string())?;
    if name == LOST_FOUND {
        return Err(format!(
            "{LOST_FOUND:?} belongs to the file system, not a session"
        ));
    }
    if live.contains(name) {
        return Err(format!(
            "session {name:?} has a running process; stop it first"
        ));
    }
    let dir = root.join(name);
    let st = match sys::lstat(&dir) {
        Ok(st) => st,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(format!("cannot examine {}: {e}", dir.display())),
    };
    if !st.is_dir() {
        return std::fs::remove_file(&dir)
            .map_err(|e| format!("cannot remove {}: {e}", dir.display()));
    }
    // mountinfo lists canonical paths; the root may be reached through a symlink.
    let canonical = dir.canonicalize().unwrap_or_else(|_| dir.clone());
    if let Err(e) = mounttable::unmount_below(&canonical) {
        tracing::debug!(session = name, error = %e, "could not detach mounts below a session");
    }
    remove_tree(&dir)
        .map(drop)
        .map_err(|e| format!("cannot delete session {name:?}: {e}"))
}

/// Prunes session caches (see the module doc).
pub fn prune_session_caches(
    root: &Path,
    only_if_free_bytes_below: Option<u64>,
    include_session_tmp: bool,
    session_tmp_older_than_secs: Option<u64>,
    live: &HashSet<String>,
) -> Result<Value, JanitorError> {
    let mut pruned = Vec::new();
    let mut skipped = Vec::new();
    let mut errors = BTreeMap::new();
    let mut freed = 0u64;
    let (_, free, _) = sys::statvfs(root).map_err(root_err(root))?;
    if only_if_free_bytes_below.is_some_and(|threshold| free >= threshold) {
        return Ok(
            json!({"prunedSessions": pruned, "skippedSessions": skipped, "freedBytes": 0, "errors": errors}),
        );
    }
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let cutoff = now.saturating_sub(
        session_tmp_older_than_secs
            .unwrap_or(0)
            .min(i64::MAX as u64) as i64,
    );
    for name in session_names(root).map_err(root_err(root))? {
        if live.contains(&name) {
            skipped.push(name);
            continue;
        }
        let dir = root.join(&name);
        let mut removed_any = false;
        let mut errs: Vec<String> = Vec::new();
        let mut prune_dir = |sub: &str, keep: &dyn Fn(&StatInfo) -> bool| {
            let d = dir.join(sub);
            match sys::lstat(&d) {
                Ok(st) if st.is_dir() => {}
                _ => return,
            }
            let entries = match std::fs::read_dir(&d) {
                Ok(e) => e,
                Err(e) => return errs.push(format!("{}: {e}", d.display())),
            };
            for entry in entries.flatten() {
                let p = entry.path();
                match sys::lstat(&p) {
                    Ok(st) if keep(&st) => continue,
                    Ok(_) => {}
                    Err(e) => {
                        errs.push(format!("{}: {e}", p.display()));
                        continue;
                    }
                }
                match remove_tree(&p) {
                    Ok(n) => {
                        freed += n;
                        removed_any = true;
                    }
                    Err(e) => errs.push(format!("{}: {e}", p.display())),
                }
            }
        };
        prune_dir(CACHE_DIR, &|_| false);
        if include_session_tmp {
            prune_dir(TMP_DIR, &|st| st.mtime > cutoff);
        }
        if removed_any {
            pruned.push(name.clone());
        }
        if !errs.is_empty() {
            errors.insert(name, errs.join("; "));
        }
    }
    Ok(
        json!({"prunedSessions": pruned, "skippedSessions": skipped, "freedBytes": freed, "errors": errors}),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    fn live(names: &[&str]) -> HashSet<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    fn set_mtime(path: &Path, secs_ago: i64) {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        let t = libc::timespec {
            tv_sec: now - secs_ago,
            tv_nsec: 0,
        };
        let c = sys::cstring(path).unwrap();
        let times = [t, t];
        // SAFETY: valid path and times array.
        let r = unsafe {
            libc::utimensat(
                libc::AT_FDCWD,
                c.as_ptr(),
                times.as_ptr(),
                libc::AT_SYMLINK_NOFOLLOW,
            )
        };
        assert_eq!(r, 0);
    }

    #[test]
    fn disk_info_sizes_sessions() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        fs::create_dir_all(r.join("big/sub")).unwrap();
        fs::create_dir_all(r.join("small")).unwrap();
        fs::write(r.join("big/sub/data"), vec![1u8; 300_000]).unwrap();
        fs::write(r.join("small/x"), b"x").unwrap();
        fs::write(r.join("not-a-session-file"), b"x").unwrap();
        fs::create_dir_all(r.join(LOST_FOUND)).unwrap();
        std::os::unix::fs::symlink("/usr", r.join("big/link-to-usr")).unwrap();
        std::os::unix::fs::symlink(r.join("big"), r.join("linked-session")).unwrap();
        let v = disk_info(r, u64::MAX).unwrap();
        assert!(v["totalBytes"].as_u64().unwrap() > 0);
        assert!(v["freeBytes"].as_u64().unwrap() <= v["totalBytes"].as_u64().unwrap());
        assert_eq!(v["belowLowWater"], true);
        let sessions = v["sessions"].as_array().unwrap();
        let names: Vec<&str> = sessions
            .iter()
            .map(|s| s["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["big", "small"]);
        let big = sessions[0]["sizeBytes"].as_u64().unwrap();
        let small = sessions[1]["sizeBytes"].as_u64().unwrap();
        assert!(big >= 300_000, "{big}");
        // The /usr symlink is not followed: big stays far below /usr's size.
        assert!(big < 300_000 + 1024 * 1024, "{big}");
        assert!(small < big);
        assert!(disk_info(&r.join("missing"), 0).is_err());
        // ext4's lost+found is not a session: never listed, never deleted.
        let v = delete_session_dirs(r, &[LOST_FOUND.to_string()], &live(&[]));
        assert!(v["errors"][LOST_FOUND].is_string(), "{v}");
        assert!(r.join(LOST_FOUND).is_dir());
    }

    #[test]
    fn delete_refuses_bad_names_and_live_sessions() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        for s in ["a", "b", "live"] {
            fs::create_dir_all(r.join(s).join("deep/er")).unwrap();
            fs::write(r.join(s).join("deep/er/f"), b"data").unwrap();
        }
        let outside = tempfile::tempdir().unwrap();
        fs::write(outside.path().join("keep"), b"precious").unwrap();
        std::os::unix::fs::symlink(outside.path(), r.join("a/link-out")).unwrap();
        let names: Vec<String> = ["a", "live", "..", "x/y", "", "never-existed"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let v = delete_session_dirs(r, &names, &live(&["live"]));
        assert_eq!(v["deleted"], json!(["a", "never-existed"]));
        let errors = v["errors"].as_object().unwrap();
        assert!(errors["live"].as_str().unwrap().contains("running process"));
        assert!(errors.contains_key(".."));
        assert!(errors.contains_key("x/y"));
        assert!(errors.contains_key(""));
        assert!(!r.join("a").exists());
        assert!(r.join("b/deep/er/f").exists());
        assert!(r.join("live/deep/er/f").exists());
        assert_eq!(fs::read(outside.path().join("keep")).unwrap(), b"precious");
    }

    #[test]
    fn prune_respects_threshold_live_sessions_and_age() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        for s in ["idle", "busy"] {
            fs::create_dir_all(r.join(s).join(".cache/pip")).unwrap();
            fs::write(r.join(s).join(".cache/pip/wheel"), vec![0u8; 50_000]).unwrap();
            fs::create_dir_all(r.join(s).join("tmp")).unwrap();
            fs::write(r.join(s).join("tmp/old"), vec![0u8; 10_000]).unwrap();
            fs::write(r.join(s).join("tmp/new"), b"n").unwrap();
            fs::write(r.join(s).join("work.txt"), b"keep me").unwrap();
            set_mtime(&r.join(s).join("tmp/old"), 7200);
        }
        // Plenty of space: a threshold of 1 byte means nothing to do.
        let v = prune_session_caches(r, Some(1), true, Some(3600), &live(&["busy"])).unwrap();
        assert_eq!(v["freedBytes"], 0);
        assert_eq!(v["prunedSessions"], json!([]));
        assert!(r.join("idle/.cache/pip/wheel").exists());

        let v = prune_session_caches(r, Some(u64::MAX), false, None, &live(&["busy"])).unwrap();
        assert_eq!(v["prunedSessions"], json!(["idle"]));
        assert_eq!(v["skippedSessions"], json!(["busy"]));
        assert!(v["freedBytes"].as_u64().unwrap() >= 50_000);
        assert!(r.join("idle/.cache").is_dir());
        assert!(!r.join("idle/.cache/pip").exists());
        assert!(
            r.join("idle/tmp/old").exists(),
            "tmp untouched without include_session_tmp"
        );
        assert!(r.join("busy/.cache/pip/wheel").exists());

        let v = prune_session_caches(r, None, true, Some(3600), &live(&["busy"])).unwrap();
        assert_eq!(v["prunedSessions"], json!(["idle"]));
        assert!(!r.join("idle/tmp/old").exists());
        assert!(r.join("idle/tmp/new").exists());
        assert!(r.join("idle/work.txt").exists());
        assert!(r.join("busy/tmp/old").exists());
        assert_eq!(v["errors"], json!({}));
    }

    #[test]
    fn remove_tree_does_not_follow_symlinks() {
        let root = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        fs::write(outside.path().join("f"), b"x").unwrap();
        let d = root.path().join("d");
        fs::create_dir(&d).unwrap();
        std::os::unix::fs::symlink(outside.path(), d.join("l")).unwrap();
        remove_tree(&d).unwrap();
        assert!(!d.exists());
        assert!(outside.path().join("f").exists());
    }
}
