//! Warm start of the qemu backend: a boot snapshot QEMU itself saves and
//! loads (migration to and from a file), with the guest's RAM kept beside
//! it as a sparse file.
//!
//! QEMU 7.2 refuses to migrate a machine with vhost-user virtio-fs, vsock
//! or rng devices, so a machine that takes or uses a snapshot is laid out
//! without them ([`super::Layout::Migratable`]): the disks (vhost-user-blk,
//! whose servers offer `VHOST_F_LOG_ALL` for this) and QEMU's balloon are
//! on the command line, the RAM is a memfd of the helper's that QEMU maps
//! shared, and the other three devices are hot-plugged once the machine is
//! past its snapshot ([`hotplug`]). The agent, which then has no vsock
//! device to say its template hello on, prints its template point on the
//! console instead (`guest_agent::proto::TEMPLATE_CONSOLE_MARK`) and polls
//! for the device.
//!
//! - **Taking** ([`save`], then [`Pending::commit`]): at the mark, the
//!   machine is stopped, QEMU writes its device state (`migrate` with the
//!   `x-ignore-shared` capability: the shared RAM stays out of the stream)
//!   into the state file after our header (magic and key), and the memfd's
//!   data is copied into the RAM file (holes stay holes: pages the guest
//!   never touched, and those the balloon's free page reporting punched
//!   out, are not stored). The machine runs on as soon as the copy is done;
//!   the files are synced and renamed into place after, the state file
//!   last, so a crash leaves no snapshot a later start would use (its
//!   temporary files go at the next snapshot taken in that store).
//! - **Restoring** ([`Prepared::open`], then [`load`]): the header's key
//!   must be this machine's, the RAM file the machine's size; its data is
//!   copied into a new memfd (QEMU writes to its RAM and the snapshot must
//!   stay as it is; a shared mapping of the file itself would write
//!   through), QEMU starts paused with `-incoming defer`, loads the state,
//!   gets the three devices and runs.
//!
//! The key ([`QemuIdentity::key`]) holds everything that shapes the
//! machine: QEMU's binary, the accelerator, kernel, initramfs and root
//! disks, the command line, memory, vCPUs, the device list, the session
//! disk's size (the guest's driver read it before the snapshot), this
//! helper's build and this host.
//!
//! Limits: the RAM file is as large as the guest's memory (sparse: the
//! data is what the guest touched); a restore copies that data (tens to a
//! few hundred MiB) before QEMU starts. `x-ignore-shared` is an
//! experimental QEMU capability (in QEMU since 4.0).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::plan::{Accel, Hotplug};
use super::qmp::{Qmp, QmpError};
use crate::backend::snapstore::{KeyText, Store, StoreKind};

/// The committing file of a qemu store: our header, then QEMU's stream.
pub const STATE_FILE: &str = "qemu.state";
/// The guest's RAM, a sparse file as large as the guest's memory.
pub const RAM_FILE: &str = "qemu.ram";
/// The qemu backend's stores: `qemu-<digest>`, committed by [`STATE_FILE`].
pub const QEMU_STORE: StoreKind = StoreKind {
    prefix: "qemu-",
    commit_file: STATE_FILE,
};
/// First line of [`STATE_FILE`]; a file without it is not ours (or of an
/// older format) and is never given to QEMU.
pub const STATE_MAGIC: &[u8] = b"cowork-qemu-snapshot/1\n";
/// Version of the key's text: bump when a line changes meaning.
pub const KEY_FORMAT: u32 = 1;
/// Longest key the header may announce (a key is a few KiB).
const MAX_KEY: usize = 64 << 10;
/// The name QEMU knows the state file's descriptor by (`getfd`).
const STATE_FD_NAME: &str = "cowork-snapshot";
/// How long QEMU gets to write or read the device state (a few hundred
/// KiB: milliseconds, but TCG hosts are slow and loaded).
pub const MIGRATION_LIMIT: Duration = Duration::from_secs(60);
/// How long a restore gets from QEMU's start to the state loaded (tens of
/// ms here); past it the start boots cold instead, which still fits the
/// client's minute.
pub const LOAD_LIMIT: Duration = Duration::from_secs(15);
/// Pause between `query-status` polls while the state loads.
const LOAD_POLL: Duration = Duration::from_millis(2);
/// Copy granule: a page.
const PAGE: usize = 4096;
/// Bytes copied per read (RAM data comes in runs of up to this).
const COPY_CHUNK: usize = 1 << 20;
/// The migration capability that keeps shared RAM out of the stream.
const IGNORE_SHARED: &str = "x-ignore-shared";

/// Distinguishes temporary files of snapshots taken at the same time.
static TMP_SEQ: AtomicU64 = AtomicU64::new(0);

/// Errors of taking, restoring or completing a qemu boot snapshot.
#[derive(Debug, thiserror::Error)]
pub enum WarmError {
    #[error(transparent)]
    Qmp(#[from] QmpError),
    #[error("{what} {}: {source}", path.display())]
    File {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("cannot make the guest's memory: {0}")]
    Memory(io::Error),
    #[error("{} is not a snapshot of this helper's format", .0.display())]
    NotOurs(PathBuf),
    #[error("the snapshot is of another machine, QEMU, helper or host")]
    OtherMachine,
    #[error("{} holds {got} bytes, the machine has {want}", path.display())]
    RamSize { path: PathBuf, got: u64, want: u64 },
    #[error("QEMU is {0:?} after loading the snapshot, not paused")]
    NotLoaded(String),
    #[error("the snapshot's device state did not load within {}s", LOAD_LIMIT.as_secs())]
    LoadTimeout,
}

/// Everything that shapes a qemu machine, for the snapshot key.
pub struct QemuIdentity<'a> {
    pub qemu: &'a Path,
    pub accel: Accel,
    pub kernel: &'a Path,
    pub initrd: &'a Path,
    pub root_disks: Vec<&'a Path>,
    pub cmdline: &'a str,
    pub mem_mib: u64,
    pub cpus: u32,
    /// Device drivers on the command line, in order, then the hot-plugged.
    pub devices: Vec<&'a str>,
    /// The session disk's size in bytes.
    pub session_disk_bytes: u64,
}

impl QemuIdentity<'_> {
    /// The snapshot key: one `name=value` line per property.
    pub fn key(&self) -> String {
        let mut k = KeyText::new(KEY_FORMAT);
        k.file("qemu", self.qemu)
            .line("accel", self.accel.as_str())
            .boot_files(self.kernel, self.initrd, &self.root_disks)
            .line("cmdline", self.cmdline)
            .line("mem_mib", self.mem_mib)
            .line("cpus", self.cpus)
            .line("devices", self.devices.join(","))
            .line("session_disk_bytes", self.session_disk_bytes)
            .finish()
    }
}

/// A new memfd of `bytes` (sparse: it takes memory as it is written), for
/// the guest's RAM.
pub fn guest_ram(bytes: u64) -> Result<File, WarmError> {
    // SAFETY: memfd_create with a NUL-terminated name; the result is
    // checked and owned below.
    let fd = unsafe { libc::memfd_create(c"cowork-guest-ram".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(WarmError::Memory(io::Error::last_os_error()));
    }
    // SAFETY: a new descriptor nothing else owns.
    let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    file.set_len(bytes).map_err(WarmError::Memory)?;
    Ok(file)
}

/// The next data offset at or after `from` (`SEEK_DATA`), `None` past the
/// last data.
fn seek_data(f: &File, from: u64, whence: libc::c_int) -> io::Result<Option<u64>> {
    let Ok(off) = libc::off_t::try_from(from) else {
        return Ok(None);
    };
    // SAFETY: lseek on an open descriptor moves only its offset.
    let r = unsafe { libc::lseek(f.as_raw_fd(), off, whence) };
    if r < 0 {
        let e = io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::ENXIO) {
            Ok(None)
        } else {
            Err(e)
        };
    }
    Ok(u64::try_from(r).ok())
}

/// Copies the data of `src`'s first `len` bytes into `dst` at the same
/// offsets: only `src`'s data extents are read (`SEEK_DATA`/`SEEK_HOLE`)
/// and pages of zeros are not written, so `dst` (as long as `len`) stays
/// sparse. Returns the bytes written.
pub fn copy_data(src: &File, dst: &File, len: u64) -> io::Result<u64> {
    dst.set_len(len)?;
    let mut buf = vec![0u8; COPY_CHUNK];
    let mut written = 0u64;
    let mut pos = 0u64;
    while pos < len {
        let Some(start) = seek_data(src, pos, libc::SEEK_DATA)? else {
            break;
        };
        if start >= len {
            break;
        }
        let end = seek_data(src, start, libc::SEEK_HOLE)?
            .unwrap_or(len)
            .min(len);
        let mut at = start;
        while at < end {
            let want = usize::try_from((end - at).min(COPY_CHUNK as u64)).unwrap_or(COPY_CHUNK);
            let got = src.read_at(&mut buf[..want], at)?;
            if got == 0 {
                break;
            }
            // One write per run of pages that are not all zeros.
            let data = &buf[..got];
            let mut page = 0;
            while page * PAGE < got {
                let zero = |p: usize| {
                    data[p * PAGE..((p + 1) * PAGE).min(got)]
                        .iter()
                        .all(|&b| b == 0)
                };
                if zero(page) {
                    page += 1;
                    continue;
                }
                let first = page;
                while page * PAGE < got && !zero(page) {
                    page += 1;
                }
                let run = &data[first * PAGE..(page * PAGE).min(got)];
                dst.write_all_at(run, at + (first * PAGE) as u64)?;
                written += run.len() as u64;
            }
            at += got as u64;
        }
        pos = end.max(start + 1);
    }
    Ok(written)
}

/// What [`save`] leaves to finish once the machine runs again.
pub struct Pending {
    dir: PathBuf,
    state_tmp: PathBuf,
    state: File,
    ram_tmp: PathBuf,
    ram: File,
    /// Bytes of RAM data stored.
    pub ram_data: u64,
    /// Bytes of QEMU's device state.
    pub state_bytes: u64,
    /// Time the machine was stopped for.
    pub stopped: Duration,
}

impl Pending {
    /// Syncs both files and renames them into place, the state file last.
    pub fn commit(self) -> Result<(), WarmError> {
        let file_err = |what, path: &Path| {
            let path = path.to_path_buf();
            move |source| WarmError::File { what, path, source }
        };
        self.ram
            .sync_all()
            .map_err(file_err("cannot sync", &self.ram_tmp))?;
        fs::rename(&self.ram_tmp, self.dir.join(RAM_FILE))
            .map_err(file_err("cannot rename", &self.ram_tmp))?;
        self.state
            .sync_all()
            .map_err(file_err("cannot sync", &self.state_tmp))?;
        fs::rename(&self.state_tmp, self.dir.join(STATE_FILE))
            .map_err(file_err("cannot rename", &self.state_tmp))?;
        if let Ok(d) = File::open(&self.dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }

    /// Removes the temporary files (a snapshot given up).
    pub fn abandon(self) {
        let _ = fs::remove_file(&self.state_tmp);
        let _ = fs::remove_file(&self.ram_tmp);
    }
}

/// Removes the temporary files (`.<file>.<pid>.<seq>.tmp`) that helpers
/// which are gone left in `dir` (killed while taking a snapshot); those of
/// live helpers are theirs.
fn sweep_dead_temporaries(dir: &Path) {
    super::rundir::sweep_dead_helpers(
        dir,
        |n| {
            n.strip_prefix('.')
                .and_then(|n| n.strip_suffix(".tmp"))
                .and_then(|n| n.rsplit('.').nth(1))
        },
        "snapshot file",
    );
}

/// A new 0600 file at `path`, truncated.
fn create_private(path: &Path) -> Result<File, WarmError> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|source| WarmError::File {
            what: "cannot create",
            path: path.to_path_buf(),
            source,
        })
}

/// Takes the boot snapshot of the running machine QEMU (`qmp`) has, whose
/// RAM is `ram` (`mem_bytes`): stops it, has QEMU write its device state
/// after our header into a temporary state file, copies the RAM's data
/// into a temporary RAM file, and returns with the machine still stopped
/// (the caller continues it, then commits). On failure nothing is left in
/// the store but what was there.
pub async fn save(
    qmp: &mut Qmp,
    ram: &File,
    mem_bytes: u64,
    store: &Store,
) -> Result<Pending, WarmError> {
    let began = Instant::now();
    let dir = store.dir().to_path_buf();
    store
        .prepare()
        .and_then(|()| {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&dir)
        })
        .map_err(|source| WarmError::File {
            what: "cannot create",
            path: dir.clone(),
            source,
        })?;
    sweep_dead_temporaries(&dir);
    let tag = format!(
        "{}.{}",
        std::process::id(),
        TMP_SEQ.fetch_add(1, Ordering::Relaxed)
    );
    let state_tmp = dir.join(format!(".{STATE_FILE}.{tag}.tmp"));
    let ram_tmp = dir.join(format!(".{RAM_FILE}.{tag}.tmp"));
    let mut state = create_private(&state_tmp)?;
    let ram_out = match create_private(&ram_tmp) {
        Ok(f) => f,
        Err(e) => {
            let _ = fs::remove_file(&state_tmp);
            return Err(e);
        }
    };
    let mut pending = Pending {
        dir,
        state_tmp,
        state: state.try_clone().map_err(WarmError::Memory)?,
        ram_tmp,
        ram: ram_out,
        ram_data: 0,
        state_bytes: 0,
        stopped: Duration::ZERO,
    };
    match save_into(qmp, ram, mem_bytes, store.key(), &mut state, &mut pending).await {
        Ok(()) => {
            tracing::debug!(
                total_ms = began.elapsed().as_secs_f64() * 1e3,
                "qemu snapshot written"
            );
            Ok(pending)
        }
        Err(e) => {
            pending.abandon();
            Err(e)
        }
    }
}

/// [`save`]'s steps, into `pending`'s files.
async fn save_into(
    qmp: &mut Qmp,
    ram: &File,
    mem_bytes: u64,
    key: &str,
    state: &mut File,
    pending: &mut Pending,
) -> Result<(), WarmError> {
    let write_failed = |path: &Path| {
        let path = path.to_path_buf();
        move |source| WarmError::File {
            what: "cannot write",
            path,
            source,
        }
    };
    let header = header(key);
    state
        .write_all(&header)
        .map_err(write_failed(&pending.state_tmp))?;
    let stopped_at = Instant::now();
    let deadline = tokio::time::Instant::now() + MIGRATION_LIMIT;
    qmp.stop().await?;
    qmp.send_fd(STATE_FD_NAME, state.as_fd()).await?;
    qmp.migrate(&format!("fd:{STATE_FD_NAME}")).await?;
    qmp.wait_migration(deadline).await?;
    pending.state_bytes = state
        .metadata()
        .map(|m| m.len().saturating_sub(header.len() as u64))
        .unwrap_or(0);
    let src = ram.try_clone().map_err(WarmError::Memory)?;
    let dst = pending.ram.try_clone().map_err(WarmError::Memory)?;
    pending.ram_data = tokio::task::spawn_blocking(move || copy_data(&src, &dst, mem_bytes))
        .await
        .map_err(|e| WarmError::Memory(io::Error::other(e.to_string())))?
        .map_err(write_failed(&pending.ram_tmp))?;
    pending.stopped = stopped_at.elapsed();
    Ok(())
}

/// The state file's header: [`STATE_MAGIC`], the key's length (8 bytes,
/// little-endian) and the key.
fn header(key: &str) -> Vec<u8> {
    let mut h = STATE_MAGIC.to_vec();
    h.extend_from_slice(&(key.len() as u64).to_le_bytes());
    h.extend_from_slice(key.as_bytes());
    h
}

/// A snapshot checked and read for a restore: the RAM in a new memfd, the
/// state file positioned at QEMU's stream.
pub struct Prepared {
    pub ram: File,
    pub state: File,
    /// Bytes of RAM data copied in.
    pub ram_data: u64,
}

impl Prepared {
    /// Checks `store`'s snapshot against its key and `mem_bytes` and copies
    /// its RAM into a new memfd.
    pub fn open(store: &Store, mem_bytes: u64) -> Result<Prepared, WarmError> {
        let state_path = store.dir().join(STATE_FILE);
        let ram_path = store.dir().join(RAM_FILE);
        let open = |path: &Path| {
            File::open(path).map_err(|source| WarmError::File {
                what: "cannot open",
                path: path.to_path_buf(),
                source,
            })
        };
        let mut state = open(&state_path)?;
        let mut magic = vec![0u8; STATE_MAGIC.len()];
        let mut len = [0u8; 8];
        if state.read_exact(&mut magic).is_err()
            || magic != STATE_MAGIC
            || state.read_exact(&mut len).is_err()
        {
            return Err(WarmError::NotOurs(state_path));
        }
        let key_len = usize::try_from(u64::from_le_bytes(len)).unwrap_or(usize::MAX);
        if key_len > MAX_KEY {
            return Err(WarmError::NotOurs(state_path));
        }
        let mut key = vec![0u8; key_len];
        if state.read_exact(&mut key).is_err() {
            return Err(WarmError::NotOurs(state_path));
        }
        if key != store.key().as_bytes() {
            return Err(WarmError::OtherMachine);
        }
        let ram_file = open(&ram_path)?;
        let got = ram_file.metadata().map(|m| m.len()).unwrap_or(0);
        if got != mem_bytes {
            return Err(WarmError::RamSize {
                path: ram_path,
                got,
                want: mem_bytes,
            });
        }
        let ram = guest_ram(mem_bytes)?;
        let ram_data = copy_data(&ram_file, &ram, mem_bytes).map_err(|source| WarmError::File {
            what: "cannot read",
            path: ram_path,
            source,
        })?;
        Ok(Prepared {
            ram,
            state,
            ram_data,
        })
    }
}

/// Loads `state` (positioned at QEMU's stream) into the QEMU that `qmp`
/// talks to, started with `-S -incoming defer`; returns once QEMU says the
/// machine is paused with the state in. QEMU exits when the stream is bad:
/// that surfaces as a closed QMP connection.
pub async fn load(qmp: &mut Qmp, state: &File) -> Result<(), WarmError> {
    qmp.set_capabilities(&[(IGNORE_SHARED, true)]).await?;
    qmp.send_fd(STATE_FD_NAME, state.as_fd()).await?;
    qmp.migrate_incoming(&format!("fd:{STATE_FD_NAME}")).await?;
    let deadline = Instant::now() + LOAD_LIMIT;
    loop {
        let status = qmp.status().await?;
        match status.as_str() {
            "inmigrate" | "prelaunch" => {}
            "paused" | "postmigrate" => return Ok(()),
            _ => return Err(WarmError::NotLoaded(status)),
        }
        if Instant::now() >= deadline {
            return Err(WarmError::LoadTimeout);
        }
        tokio::time::sleep(LOAD_POLL).await;
    }
}

/// Hot-plugs `plugs` into the machine: each one's vhost-user socket as a
/// chardev, then the device on it.
pub async fn hotplug(qmp: &mut Qmp, plugs: &[Hotplug]) -> Result<(), WarmError> {
    for p in plugs {
        qmp.chardev_add_unix(p.chardev, &p.socket).await?;
        let mut props = serde_json::Map::new();
        props.insert("chardev".into(), p.chardev.into());
        for (k, v) in &p.props {
            props.insert((*k).to_string(), v.clone());
        }
        qmp.device_add(p.driver, p.chardev, props).await?;
    }
    Ok(())
}

/// The VM generation ID QEMU shows the guest (`query-vm-generation-id`),
/// or why it cannot be had (a log field, never fatal).
pub async fn generation_id(qmp: &mut Qmp) -> String {
    match qmp.execute("query-vm-generation-id", None).await {
        Ok(v) => v
            .get("guid")
            .and_then(|g| g.as_str())
            .map_or_else(|| format!("unexpected answer {v}"), str::to_string),
        Err(e) => format!("unknown ({e})"),
    }
}

/// Sets the capability a snapshot-taking machine needs before it is
/// saved.
pub async fn prepare_source(qmp: &mut Qmp) -> Result<(), WarmError> {
    qmp.set_capabilities(&[(IGNORE_SHARED, true)]).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::snapstore::{SnapshotMode, SnapshotOptions};

    #[test]
    fn copies_data_and_keeps_holes() {
        let d = tempfile::tempdir().unwrap();
        let src = guest_ram(64 << 20).unwrap();
        // Data at 0, a zero page written at 8 MiB (data, but zeros), data
        // at 40 MiB + 1 page.
        src.write_all_at(b"first", 0).unwrap();
        src.write_all_at(&[0u8; PAGE], 8 << 20).unwrap();
        src.write_all_at(b"second", (40 << 20) + PAGE as u64)
            .unwrap();
        // A run of four pages with a zero page second, at 16 MiB.
        src.write_all_at(&[7u8; 4 * PAGE], 16 << 20).unwrap();
        src.write_all_at(&[0u8; PAGE], (16 << 20) + PAGE as u64)
            .unwrap();
        let dst = create_private(&d.path().join("ram")).unwrap();
        let n = copy_data(&src, &dst, 64 << 20).unwrap();
        assert_eq!(
            n,
            5 * PAGE as u64,
            "five pages of data, the zero pages skipped"
        );
        let mut run = vec![0u8; 4 * PAGE];
        dst.read_exact_at(&mut run, 16 << 20).unwrap();
        assert!(run[..PAGE].iter().all(|&b| b == 7));
        assert!(run[PAGE..2 * PAGE].iter().all(|&b| b == 0));
        assert!(run[2 * PAGE..].iter().all(|&b| b == 7));
        assert_eq!(dst.metadata().unwrap().len(), 64 << 20);
        let mut b = [0u8; 6];
        dst.read_exact_at(&mut b[..5], 0).unwrap();
        assert_eq!(&b[..5], b"first");
        dst.read_exact_at(&mut b, (40 << 20) + PAGE as u64).unwrap();
        assert_eq!(&b, b"second");
        // Sparse: far less allocated than its length.
        use std::os::unix::fs::MetadataExt;
        assert!(dst.metadata().unwrap().blocks() * 512 < 1 << 20);
        // And back into a memfd, as a restore does.
        let back = guest_ram(64 << 20).unwrap();
        assert_eq!(copy_data(&dst, &back, 64 << 20).unwrap(), n);
        back.read_exact_at(&mut b, (40 << 20) + PAGE as u64)
            .unwrap();
        assert_eq!(&b, b"second");
    }

    #[test]
    fn temporaries_of_dead_helpers_are_swept() {
        let d = tempfile::tempdir().unwrap();
        let me = std::process::id();
        // A pid that is not running: above the kernel's pid_max limit.
        let dead = 4_194_304 + 17;
        let files = [
            format!(".{STATE_FILE}.{dead}.0.tmp"),
            format!(".{RAM_FILE}.{dead}.3.tmp"),
            format!(".{STATE_FILE}.{me}.1.tmp"),
            STATE_FILE.to_string(),
            "notes".to_string(),
        ];
        for f in &files {
            fs::write(d.path().join(f), b"x").unwrap();
        }
        sweep_dead_temporaries(d.path());
        let left: Vec<bool> = files.iter().map(|f| d.path().join(f).exists()).collect();
        assert_eq!(left, [false, false, true, true, true]);
    }

    fn store(d: &Path, key: &str) -> Store {
        let opts = SnapshotOptions {
            mode: SnapshotMode::Auto,
            dir: Some(d.join("snapshots")),
        };
        Store::new(&opts, QEMU_STORE, || key.to_string()).unwrap()
    }

    /// Writes a committed snapshot as [`save`] would (without QEMU).
    fn write_snapshot(s: &Store, key: &str, ram_len: u64, stream: &[u8]) {
        fs::create_dir_all(s.dir()).unwrap();
        let mut st = header(key);
        st.extend_from_slice(stream);
        fs::write(s.dir().join(STATE_FILE), st).unwrap();
        let ram = File::create(s.dir().join(RAM_FILE)).unwrap();
        ram.set_len(ram_len).unwrap();
        ram.write_all_at(b"ram", 4096).unwrap();
    }

    #[test]
    fn a_restore_checks_format_key_and_size() {
        let d = tempfile::tempdir().unwrap();
        let s = store(d.path(), "key A");
        write_snapshot(&s, "key A", 8 << 20, b"QEVM-stream");
        let mut p = Prepared::open(&s, 8 << 20).unwrap();
        assert_eq!(p.ram_data, PAGE as u64);
        let mut rest = Vec::new();
        p.state.read_to_end(&mut rest).unwrap();
        assert_eq!(rest, b"QEVM-stream", "positioned at QEMU's stream");
        let mut b = [0u8; 3];
        p.ram.read_exact_at(&mut b, 4096).unwrap();
        assert_eq!(&b, b"ram");

        let e = Prepared::open(&s, 16 << 20).err().unwrap();
        assert!(matches!(e, WarmError::RamSize { .. }), "{e}");
        let other = store(d.path(), "key B");
        write_snapshot(&other, "key A", 8 << 20, b"x");
        let e = Prepared::open(&other, 8 << 20).err().unwrap();
        assert!(matches!(e, WarmError::OtherMachine), "{e}");
        // Truncated inside the header, a foreign file, a huge key length.
        let st = s.dir().join(STATE_FILE);
        fs::write(&st, &header("key A")[..10]).unwrap();
        assert!(matches!(
            Prepared::open(&s, 8 << 20),
            Err(WarmError::NotOurs(_))
        ));
        fs::write(&st, b"QEVM\0\0\0\x03").unwrap();
        assert!(matches!(
            Prepared::open(&s, 8 << 20),
            Err(WarmError::NotOurs(_))
        ));
        let mut h = STATE_MAGIC.to_vec();
        h.extend_from_slice(&u64::MAX.to_le_bytes());
        fs::write(&st, h).unwrap();
        assert!(matches!(
            Prepared::open(&s, 8 << 20),
            Err(WarmError::NotOurs(_))
        ));
        fs::remove_file(s.dir().join(RAM_FILE)).unwrap();
        write_snapshot(&s, "key A", 8 << 20, b"x");
        fs::remove_file(s.dir().join(RAM_FILE)).unwrap();
        let e = Prepared::open(&s, 8 << 20).err().unwrap();
        assert!(e.to_string().contains("cannot open"), "{e}");
    }

    #[test]
    fn the_key_names_what_shapes_the_machine() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("f");
        fs::write(&f, b"x").unwrap();
        let id = |mem_mib, session_disk_bytes| QemuIdentity {
            qemu: &f,
            accel: Accel::Tcg,
            kernel: &f,
            initrd: &f,
            root_disks: vec![&f],
            cmdline: "console=ttyS0",
            mem_mib,
            cpus: 2,
            devices: vec!["vhost-user-blk-pci", "virtio-balloon-pci"],
            session_disk_bytes,
        };
        let base = id(1024, 1 << 30).key();
        for line in ["key_format=1", "accel=tcg", "qemu=", "session_disk_bytes="] {
            assert!(base.contains(line), "{line} in {base}");
        }
        assert_ne!(base, id(2048, 1 << 30).key());
        assert_ne!(base, id(1024, 2 << 30).key());
        assert_eq!(base, id(1024, 1 << 30).key());
    }
}
