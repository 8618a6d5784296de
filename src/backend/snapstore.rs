//! Where the VM backends keep their boot snapshots: one directory (a
//! [`Store`]) per machine shape, named after the digest of the shape's key
//! text, under the snapshot directory (by default `<data dir>/snapshots`,
//! 0700), at most [`KEEP_SNAPSHOTS`] per backend (the most recently used).
//! What a snapshot holds and how its key is made is each backend's
//! (`kvm::warm`, `qemu::warm`); the identities every key has (this helper's
//! build, this host, a file's) are here.
//!
//! Limits: a snapshot in use is never rewritten in place (each backend
//! writes new files and renames), but [`Store::discard`] removes a store
//! whole, so a helper that finds a snapshot it cannot restore while another
//! profile's VM is taking a new one in the same store may remove that one
//! too; the next start then boots cold again. Executable identity is by
//! metadata, not content: a rebuilt helper with the same size and
//! modification time would be taken for the same build.

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// Snapshot directories kept per backend: the shape in use and the one
/// before (a client that alternates two memory sizes keeps both warm).
pub const KEEP_SNAPSHOTS: usize = 2;

/// `--snapshot`: whether the VM backends take and restore boot snapshots.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum SnapshotMode {
    /// Restore a snapshot of this machine shape when there is one; take
    /// one at the template point of a cold boot when there is not.
    #[default]
    Auto,
    /// Always boot cold; take no snapshot.
    Off,
}

/// Warm-start settings of the VM backends (the daemon's `--snapshot` and
/// `--snapshot-dir`).
#[derive(Clone, Debug, Default)]
pub struct SnapshotOptions {
    /// Whether snapshots are taken and restored.
    pub mode: SnapshotMode,
    /// The directory holding one store per machine shape; none: no
    /// snapshots (as with [`SnapshotMode::Off`]).
    pub dir: Option<PathBuf>,
}

/// A snapshot key's text: one `name=value` line per property, starting
/// with the backend's key format, this helper's build and this host.
pub struct KeyText(String);

impl KeyText {
    /// The first lines: `key_format`, `helper`, `host`.
    pub fn new(format: u32) -> KeyText {
        let mut k = KeyText(String::new());
        k.line("key_format", format)
            .line("helper", helper_identity())
            .line("host", host_identity());
        k
    }

    /// Adds `name=value`.
    pub fn line(&mut self, name: &str, value: impl std::fmt::Display) -> &mut KeyText {
        use std::fmt::Write as _;
        let _ = writeln!(self.0, "{name}={value}");
        self
    }

    /// Adds `name=` and `path`'s identity.
    pub fn file(&mut self, name: &str, path: &Path) -> &mut KeyText {
        self.line(name, file_identity(path))
    }

    /// Adds the files a machine boots: `kernel=`, `initrd=` and a
    /// `root_disk=` per root disk, each with its identity.
    pub fn boot_files(
        &mut self,
        kernel: &Path,
        initrd: &Path,
        root_disks: &[&Path],
    ) -> &mut KeyText {
        self.file("kernel", kernel).file("initrd", initrd);
        for disk in root_disks {
            self.file("root_disk", disk);
        }
        self
    }

    /// The text.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.0)
    }
}

/// `path` as the key sees it: the path, its size, modification time (ns)
/// and device and inode numbers.
fn file_identity(path: &Path) -> String {
    match fs::metadata(path) {
        Ok(m) => format!(
            "{} size {} mtime {}.{:09} dev {} ino {}",
            path.display(),
            m.size(),
            m.mtime(),
            m.mtime_nsec(),
            m.dev(),
            m.ino()
        ),
        Err(_) => format!("{} missing", path.display()),
    }
}

/// This helper's build: its version and its executable's identity.
fn helper_identity() -> String {
    let exe = std::env::current_exe()
        .map(|p| file_identity(&p))
        .unwrap_or_else(|_| "unknown".into());
    format!("{} {exe}", env!("CARGO_PKG_VERSION"))
}

/// This host: its CPU (vendor, family, model, stepping and a digest of the
/// feature flags, from the first processor of `/proc/cpuinfo`) and its
/// kernel release (KVM's behaviour comes with it).
fn host_identity() -> String {
    let cpuinfo = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let mut cpu = Vec::new();
    for l in cpuinfo.lines().take_while(|l| !l.trim().is_empty()) {
        let Some((name, value)) = l.split_once(':') else {
            continue;
        };
        let (name, value) = (name.trim(), value.trim());
        match name {
            "vendor_id" | "cpu family" | "model" | "stepping" => cpu.push(value.to_string()),
            "flags" => cpu.push(format!("flags {:016x}", fnv1a(value.as_bytes()))),
            _ => {}
        }
    }
    let release = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!("cpu {} kernel {}", cpu.join(" "), release.trim())
}

/// FNV-1a, 64 bits: names a store after its key and condenses the CPU
/// flags (stable across builds, unlike std's hasher; not a security
/// boundary: the key itself is compared at restore).
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    /// FNV-1a's 64-bit offset basis.
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    /// FNV-1a's 64-bit prime.
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    bytes
        .iter()
        .fold(OFFSET, |h, b| (h ^ u64::from(*b)).wrapping_mul(PRIME))
}

/// A backend's kind of store: how its directories are named and which
/// file commits a snapshot (written last, by rename).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreKind {
    /// Prefix of a store's directory name (the rest is the key's digest);
    /// also what pruning counts: each backend keeps its own
    /// [`KEEP_SNAPSHOTS`].
    pub prefix: &'static str,
    /// The file whose presence says a snapshot was committed.
    pub commit_file: &'static str,
}

/// One machine shape's snapshot directory.
#[derive(Clone, Debug)]
pub struct Store {
    dir: PathBuf,
    key: String,
    kind: StoreKind,
}

impl Store {
    /// The store for the key `key` makes under `opts`' directory; none
    /// (and the key never made: it stats files and reads `/proc`) when
    /// snapshots are off.
    pub fn new(
        opts: &SnapshotOptions,
        kind: StoreKind,
        key: impl FnOnce() -> String,
    ) -> Option<Store> {
        if opts.mode == SnapshotMode::Off {
            return None;
        }
        let root = opts.dir.as_ref()?;
        let key = key();
        let dir = root.join(format!("{}{:016x}", kind.prefix, fnv1a(key.as_bytes())));
        Some(Store { dir, key, kind })
    }

    /// The snapshot directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The key the snapshot is taken and restored with.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Whether a snapshot has been committed here (its state file exists;
    /// whether it is good is for the restore to find out).
    pub fn exists(&self) -> bool {
        self.dir.join(self.kind.commit_file).is_file()
    }

    /// Creates the directory holding the stores (0700) so that the VMM can
    /// create this store in it.
    pub fn prepare(&self) -> io::Result<()> {
        match self.dir.parent() {
            Some(root) => fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(root),
            None => Ok(()),
        }
    }

    /// Removes this store (a snapshot that failed to restore). Errors are
    /// logged: the next snapshot replaces the state file anyway.
    pub fn discard(&self) {
        match fs::remove_dir_all(&self.dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(
                dir = %self.dir.display(),
                error = %e,
                "cannot remove the snapshot"
            ),
        }
    }

    /// Marks this store used now and removes the least recently used ones
    /// beyond [`KEEP_SNAPSHOTS`].
    pub fn touch_and_prune(&self) {
        if let Ok(d) = fs::File::open(&self.dir) {
            let _ = d.set_modified(SystemTime::now());
        }
        let Some(root) = self.dir.parent() else {
            return;
        };
        let Ok(entries) = fs::read_dir(root) else {
            return;
        };
        let mut stores: Vec<(SystemTime, PathBuf)> = entries
            .flatten()
            .filter(|e| {
                e.file_name()
                    .to_str()
                    .is_some_and(|n| n.starts_with(self.kind.prefix))
            })
            .filter_map(|e| {
                let m = e.metadata().ok()?;
                if !m.is_dir() {
                    return None;
                }
                Some((m.modified().ok()?, e.path()))
            })
            .collect();
        stores.sort_by_key(|s| std::cmp::Reverse(s.0));
        for (_, old) in stores.into_iter().skip(KEEP_SNAPSHOTS) {
            if old == self.dir {
                continue;
            }
            match fs::remove_dir_all(&old) {
                Ok(()) => tracing::info!(dir = %old.display(), "old snapshot removed"),
                Err(e) => tracing::warn!(
                    dir = %old.display(),
                    error = %e,
                    "cannot remove an old snapshot"
                ),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A store kind of the tests.
    const KIND: StoreKind = StoreKind {
        prefix: "test-",
        commit_file: "commit",
    };

    #[test]
    fn stores_are_per_key_off_means_none_and_old_ones_are_pruned() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("snapshots");
        let opts = SnapshotOptions {
            mode: SnapshotMode::Auto,
            dir: Some(root.clone()),
        };
        let off = SnapshotOptions {
            mode: SnapshotMode::Off,
            ..opts.clone()
        };
        assert!(Store::new(&off, KIND, || unreachable!("no key is made when off")).is_none());
        assert!(Store::new(&SnapshotOptions::default(), KIND, || "k".into()).is_none());
        let a = Store::new(&opts, KIND, || "a".into()).unwrap();
        let b = Store::new(&opts, KIND, || "b".into()).unwrap();
        assert_ne!(a.dir(), b.dir());
        assert_eq!(a.key(), "a");
        assert!(!a.exists());
        a.prepare().unwrap();
        let mode = fs::metadata(&root).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        // Three stores, used in the order c, a, b: c goes.
        let c = Store::new(&opts, KIND, || "c".into()).unwrap();
        for s in [&c, &a, &b] {
            fs::create_dir(s.dir()).unwrap();
            fs::write(s.dir().join(KIND.commit_file), b"x").unwrap();
            s.touch_and_prune();
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert!(a.exists() && b.exists());
        assert!(!c.dir().exists());
        // Something else in the directory is left alone.
        fs::write(root.join("notes"), b"mine").unwrap();
        b.touch_and_prune();
        assert!(root.join("notes").exists());
        // Another backend's stores are not counted (nor pruned).
        let other = StoreKind {
            prefix: "other-",
            commit_file: "state",
        };
        let o = Store::new(&opts, other, || "a".into()).unwrap();
        assert_ne!(o.dir(), a.dir());
        fs::create_dir(o.dir()).unwrap();
        fs::write(o.dir().join("state"), b"x").unwrap();
        assert!(o.exists());
        a.touch_and_prune();
        assert!(o.exists() && a.exists() && b.exists());
        a.discard();
        assert!(!a.dir().exists());
        a.discard();
    }
}
