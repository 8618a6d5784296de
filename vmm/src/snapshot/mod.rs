//! Snapshots of a paused VM, and VMs restored from them: the warm start
//! of a machine that would otherwise boot for seconds.
//!
//! A snapshot is a directory holding two files:
//! * [`STATE_FILE`]: everything but guest memory, versioned and
//!   checksummed, with the caller's key ([`file`](mod@file)): the shape of the
//!   machine (vCPUs, memory, command line, devices), each vCPU's KVM state
//!   and the VM's in-kernel devices ([`kvm_state`]), the UART, and each
//!   virtio-mmio transport with its queues and its device's own state
//!   ([`crate::virtio::state`]);
//! * `memory-<id>.bin`: guest RAM, the regions one after the other in
//!   guest-physical order, as a sparse file: only pages that are not all
//!   zeroes are written, so its size on disk is what the guest had
//!   touched (and not given back). The state file names it.
//!
//! Taking one ([`crate::Vm::snapshot`]): the VM must be paused
//! ([`crate::PauseHandle`]; `run()` returned [`crate::ExitReason::Paused`]),
//! so every vCPU is out of `KVM_RUN` with its last exit completed and
//! every device's worker stopped with its queue positions back in its
//! transport. The order: each vCPU's state (in vCPU order; the per-vCPU
//! order is in [`kvm_state`]), then the VM's (PIT, clock, interrupt
//! controllers), then the UART and each device (virtio-vsock posts its
//! TRANSPORT_RESET here: connections do not survive), then memory, written
//! last because device saving may still write to it. Every file is written
//! under a temporary name in the directory, `fsync`ed, and renamed into
//! place, the memory file first and the state file last, then the
//! directory is `fsync`ed: the state file's rename is the commit, a crash
//! before it leaves the previous snapshot (or none) in force, and the
//! memory file a state file names is never rewritten, only replaced by a
//! new name. Memory files no state file names any more are removed
//! afterwards (a VM restored from one keeps its mapping: unlinking does
//! not take pages away from a mapping). Files are 0600, a directory this
//! creates 0700. The VM can be resumed (`run()` again) or dropped after.
//!
//! Restoring ([`crate::Vm::restore`]) builds the machine [`crate::Vm::build`]
//! would build from the same [`crate::Config`] (the shape must match the
//! state's, or nothing is built) but loads no kernel: the KVM VM; guest
//! memory mapped copy-on-write from the memory file
//! ([`crate::memory::map_snapshot`]: no copy; the restored process's RSS
//! grows only with the pages the guest touches) and registered; identity
//! map and TSS pages, the in-kernel irqchip and PIT, the vCPUs; the TSC
//! frequency set when this host's differs ([`kvm_state::match_tsc_khz`]);
//! each vCPU's state, then the VM's; then the devices, last, so that
//! nothing raises an interrupt before the irqchip and the LAPICs hold
//! their saved state: the UART and the virtio transports, each around the
//! *new* device the config brings (a new session disk, a new grant table,
//! a new vsock host side), into which only the transport, queue and device
//! state is loaded. The devices start serving when the VM runs, before its
//! first vCPU does. Memory is registered before the irqchip and vCPUs
//! exist, as at build (Firecracker registers it after creating its
//! vCPUs): nothing in KVM orders the two, and a memory slot added once
//! vCPUs exist cost several times more here (measured on this PVM host:
//! 1-8 ms against 0.2-4 ms, KVM waiting for an expedited SRCU grace
//! period). A failure at any step returns a typed error and drops
//! everything built so far (every fd closed); nothing runs.
//!
//! The state file is untrusted input: its lengths are bounded before
//! anything is allocated, every count is checked, every KVM struct's size
//! is checked, queue addresses are checked against guest memory, and
//! whatever KVM refuses is an error. A truncated, corrupt, foreign-key or
//! other-version file is refused with its own error
//! ([`file::StateFileError`]); the caller then boots cold.
//!
//! Limits: the snapshot restores on the host it was taken on (same CPU
//! model and KVM; the key must say so) and with private guest memory only
//! (not [`crate::memory::Backing::Memfd`]: vhost-user backends cannot map
//! a private copy-on-write file). The memory file must not change while a
//! restored VM lives. The CRC covers the state file, not guest memory
//! (checking it would read the whole file at every restore): a memory file
//! damaged in place goes unnoticed. Restored guests are clones: the same
//! RNG state and the same wall clock as at the snapshot, until the guest
//! reseeds and resets its clock (the agent's job). Timers the guest armed
//! fire late by the time the snapshot spent on disk, then catch up.

pub mod file;
pub mod kvm_state;

use std::fs::File;
use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use vm_memory::{Bytes, GuestMemory, GuestMemoryRegion, MemoryRegionAddress};

use crate::devices::serial::SerialSnapshot;
use crate::memory::GuestMemory as GuestMem;
use crate::virtio::state::{DeviceStateError, TransportState};
use file::StateFileError;
use kvm_state::{KvmStateError, VcpuState, VmKvmState};

/// Version of the snapshot format this build writes and reads. Bump it
/// whenever the state's layout changes (any struct below, a device's
/// saved state, the memory file's layout).
pub const FORMAT_VERSION: u32 = 1;
/// Name of the state file in a snapshot directory.
pub const STATE_FILE: &str = "vm.state";
/// Prefix of the memory file's name (then 16 hex digits, then
/// [`MEMORY_FILE_SUFFIX`]).
pub const MEMORY_FILE_PREFIX: &str = "memory-";
/// Suffix of the memory file's name.
pub const MEMORY_FILE_SUFFIX: &str = ".bin";
/// Prefix of the temporary names files are written under.
pub const TEMP_PREFIX: &str = ".tmp-";
/// Mode of the snapshot's files: they hold guest memory (secrets).
pub const FILE_MODE: u32 = 0o600;
/// Mode of a snapshot directory this module creates.
pub const DIR_MODE: u32 = 0o700;
/// Granularity of the sparse memory file: a page that is all zeroes is
/// not written.
pub const PAGE_SIZE: usize = 4096;
/// Guest memory is copied out through a buffer of this size.
const COPY_CHUNK: usize = 2 << 20;
/// `/proc/self/pagemap`: one 64-bit entry per virtual page of this process.
const PAGEMAP: &str = "/proc/self/pagemap";
/// Bytes of one pagemap entry.
const PAGEMAP_ENTRY_BYTES: usize = 8;
/// Pagemap entry bit: the page is in RAM.
const PAGEMAP_PRESENT: u64 = 1 << 63;
/// Pagemap entry bit: the page is in swap.
const PAGEMAP_SWAPPED: u64 = 1 << 62;

/// Errors of taking or restoring a snapshot.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The VM runs, or has finished: only a paused (or never run) VM can
    /// be saved.
    #[error(
        "the VM is {0}; pause it (PauseHandle, run() returns Paused) before taking a snapshot"
    )]
    NotPaused(&'static str),
    /// A device cannot be saved or restored.
    #[error("virtio-mmio slot {slot}: {source}")]
    Device {
        /// Slot index.
        slot: usize,
        /// Cause.
        source: DeviceStateError,
    },
    /// A virtio transport refused the saved state.
    #[error("virtio-mmio slot {slot}: {source}")]
    Transport {
        /// Slot index.
        slot: usize,
        /// Cause.
        source: crate::virtio::MmioTransportError,
    },
    /// KVM state.
    #[error(transparent)]
    Kvm(#[from] KvmStateError),
    /// The state file.
    #[error(transparent)]
    StateFile(#[from] StateFileError),
    /// Guest memory.
    #[error(transparent)]
    Memory(#[from] crate::memory::MemoryError),
    /// A file or directory operation failed.
    #[error("cannot {what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// On which path.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// The snapshot is not of the machine the config describes.
    #[error("the snapshot's {what} is {saved}, the configuration asks for {config}; take a new snapshot")]
    Shape {
        /// Which property.
        what: &'static str,
        /// The snapshot's value.
        saved: String,
        /// The config's value.
        config: String,
    },
    /// The state names a memory file it may not name.
    #[error(
        "the snapshot state names the memory file {0:?}, which is not a snapshot memory file name"
    )]
    MemoryFileName(String),
    /// Building the restored machine's KVM VM, platform devices or virtio
    /// wiring failed (the machine's own error, boxed: this module sits
    /// below the machine).
    #[error("cannot build the restored VM: {0}")]
    Build(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// What [`crate::Vm::snapshot`] wrote.
#[derive(Debug, Clone)]
pub struct SnapshotInfo {
    /// The state file.
    pub state_file: PathBuf,
    /// The memory file.
    pub memory_file: PathBuf,
    /// Size of the state file.
    pub state_bytes: u64,
    /// Apparent size of the memory file (the guest's RAM).
    pub memory_bytes: u64,
    /// Bytes of guest memory written (pages not all zeroes).
    pub memory_data_bytes: u64,
    /// Space the memory file takes on disk.
    pub memory_disk_bytes: u64,
    /// How long saving the vCPUs, the VM and the devices took.
    pub state_time: Duration,
    /// How long writing guest memory took (the rest of the time).
    pub memory_time: Duration,
    /// The whole snapshot, fsyncs and renames included.
    pub total_time: Duration,
}

/// How long each step of a restore took ([`crate::Vm::restore`]), in
/// order; their sum is the time before the VM could run.
#[derive(Debug, Clone, Default)]
pub struct RestorePhases {
    /// Reading and checking the state file and the config against it.
    pub state: Duration,
    /// KVM VM, irqchip, PIT and vCPUs created.
    pub kvm: Duration,
    /// Guest memory mapped from the memory file and registered.
    pub memory: Duration,
    /// TSC frequency and every vCPU's state set.
    pub vcpus: Duration,
    /// PIT, clock and interrupt controllers set.
    pub vm: Duration,
    /// UART and virtio transports restored and wired.
    pub devices: Duration,
}

/// The machine as the state file's body holds it (public for tools and
/// tests that inspect or alter a snapshot; its layout is the format
/// version's).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VmState {
    /// Name of the memory file in the snapshot directory.
    pub memory_file: String,
    /// Guest memory in MiB.
    pub mem_mib: u64,
    /// vCPU count.
    pub vcpus: u8,
    /// The full command line (virtio entries included).
    pub cmdline: String,
    /// Each vCPU's state, in vCPU order.
    pub vcpu_states: Vec<VcpuState>,
    /// The VM's in-kernel devices.
    pub vm: VmKvmState,
    /// COM1.
    pub serial: SerialSnapshot,
    /// Each virtio-mmio slot's transport and device, in slot order.
    pub devices: Vec<TransportState>,
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> SnapshotError + 'a {
    move |source| SnapshotError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// Whether `name` is a memory file name this module writes.
pub fn is_memory_file_name(name: &str) -> bool {
    name.strip_prefix(MEMORY_FILE_PREFIX)
        .and_then(|rest| rest.strip_suffix(MEMORY_FILE_SUFFIX))
        .is_some_and(|id| id.len() == 16 && id.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// A fresh memory file name: 64 random bits.
fn new_memory_file_name() -> Result<String, std::io::Error> {
    let mut id = [0u8; 8];
    let mut filled = 0;
    while filled < id.len() {
        // SAFETY: the pointer and length describe the unfilled tail of `id`.
        let n = unsafe { libc::getrandom(id[filled..].as_mut_ptr().cast(), id.len() - filled, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        filled += n as usize;
    }
    Ok(format!(
        "{MEMORY_FILE_PREFIX}{:016x}{MEMORY_FILE_SUFFIX}",
        u64::from_le_bytes(id)
    ))
}

/// Creates `dir` (0700) if it does not exist.
pub(crate) fn prepare_dir(dir: &Path) -> Result<(), SnapshotError> {
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(SnapshotError::Io {
            what: "use as the snapshot directory",
            path: dir.to_path_buf(),
            source: std::io::Error::from_raw_os_error(libc::ENOTDIR),
        }),
        Err(_) => std::fs::DirBuilder::new()
            .recursive(true)
            .mode(DIR_MODE)
            .create(dir)
            .map_err(io("create the snapshot directory", dir)),
    }
}

/// A new file at `dir/<TEMP_PREFIX><name>`, 0600, replacing a stale one.
fn create_temp(dir: &Path, name: &str) -> Result<(File, PathBuf), SnapshotError> {
    let path = dir.join(format!("{TEMP_PREFIX}{name}"));
    let _ = std::fs::remove_file(&path);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(FILE_MODE)
        .custom_flags(libc::O_CLOEXEC)
        .open(&path)
        .map_err(io("create", &path))?;
    // The umask may have cleared bits of the mode, never added any; make
    // sure it is exactly 0600.
    f.set_permissions(std::fs::Permissions::from_mode(FILE_MODE))
        .map_err(io("set the mode of", &path))?;
    Ok((f, path))
}

/// fsyncs `f` (at `temp`) and renames it to `dir/name`.
fn commit(f: File, temp: &Path, dir: &Path, name: &str) -> Result<PathBuf, SnapshotError> {
    f.sync_all().map_err(io("fsync", temp))?;
    drop(f);
    let path = dir.join(name);
    std::fs::rename(temp, &path).map_err(io("rename into place", &path))?;
    Ok(path)
}

/// fsyncs the directory itself, so the renames are durable.
fn sync_dir(dir: &Path) -> Result<(), SnapshotError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io("fsync the snapshot directory", dir))
}

/// What writing guest memory produced.
pub(crate) struct MemoryWritten {
    pub name: String,
    pub path: PathBuf,
    pub data_bytes: u64,
}

/// Writes guest memory into a new sparse memory file in `dir` (regions
/// in guest-physical order, all-zero pages skipped), fsynced and renamed
/// into place under a fresh name.
pub(crate) fn write_memory(
    dir: &Path,
    mem: &GuestMem,
    size: u64,
) -> Result<MemoryWritten, SnapshotError> {
    let name = new_memory_file_name().map_err(io("pick a name in", dir))?;
    let (f, temp) = create_temp(dir, &name)?;
    let result = (|| {
        f.set_len(size).map_err(io("size", &temp))?;
        let mut buf = vec![0u8; COPY_CHUNK];
        let mut data_bytes = 0u64;
        let mut file_off = 0u64;
        let pagemap = Pagemap::open();
        for region in mem.iter() {
            let len = region.len();
            // Only anonymous memory's unpopulated pages are zeroes (a file
            // mapping's come from the file).
            let host = (crate::memory::MappingKind::of(region)
                == crate::memory::MappingKind::Anonymous)
                .then(|| region.as_ptr() as usize);
            let mut off = 0u64;
            while off < len {
                let n = (len - off).min(COPY_CHUNK as u64) as usize;
                if let (Some(map), Some(host)) = (&pagemap, host) {
                    if !map.any_populated(host + off as usize, n) {
                        off += n as u64;
                        continue;
                    }
                }
                let chunk = &mut buf[..n];
                region
                    .read_slice(chunk, MemoryRegionAddress(off))
                    .map_err(|e| SnapshotError::Io {
                        what: "read guest memory for",
                        path: temp.clone(),
                        source: std::io::Error::other(e.to_string()),
                    })?;
                data_bytes += write_nonzero_pages(&f, &temp, chunk, file_off + off)?;
                off += n as u64;
            }
            file_off += len;
        }
        Ok(data_bytes)
    })();
    let data_bytes = match result {
        Ok(n) => n,
        Err(e) => {
            drop(f);
            let _ = std::fs::remove_file(&temp);
            return Err(e);
        }
    };
    let path = commit(f, &temp, dir, &name)?;
    Ok(MemoryWritten {
        name,
        path,
        data_bytes,
    })
}

/// This process's page table as `/proc/self/pagemap` shows it: which
/// pages of an anonymous mapping were ever populated. A chunk of guest RAM
/// with no page present or swapped out was never touched (or was given
/// back, the balloon's free page reporting), so it is all zeroes and is
/// skipped without reading it: reading it would cost as much as reading
/// touched memory (1 GiB took ~20 s in the nested harness, where L1 runs
/// at TCG speed, for 86 MiB of data).
struct Pagemap(File);

impl Pagemap {
    /// The pagemap, or none when it cannot be read (every chunk is then
    /// read and tested).
    fn open() -> Option<Pagemap> {
        File::open(PAGEMAP).ok().map(Pagemap)
    }

    /// Whether any page of `[addr, addr + len)` of this process is present
    /// or swapped; true when the pagemap cannot say (the caller reads).
    fn any_populated(&self, addr: usize, len: usize) -> bool {
        let first = addr / PAGE_SIZE;
        let pages = len.div_ceil(PAGE_SIZE);
        let mut entries = vec![0u8; pages * PAGEMAP_ENTRY_BYTES];
        let at = (first * PAGEMAP_ENTRY_BYTES) as u64;
        if self.0.read_exact_at(&mut entries, at).is_err() {
            return true;
        }
        entries
            .chunks_exact(PAGEMAP_ENTRY_BYTES)
            .filter_map(|e| <[u8; PAGEMAP_ENTRY_BYTES]>::try_from(e).ok())
            .any(|e| u64::from_ne_bytes(e) & (PAGEMAP_PRESENT | PAGEMAP_SWAPPED) != 0)
    }
}

/// Whether `bytes` are all zero, 16 at a time (what the compiler turns
/// into vector compares).
fn is_zero(bytes: &[u8]) -> bool {
    let chunks = bytes.chunks_exact(16);
    let tail = chunks.remainder();
    chunks.fold(0u128, |acc, c| {
        acc | u128::from_ne_bytes(c.try_into().unwrap_or([0xff; 16]))
    }) == 0
        && tail.iter().all(|&b| b == 0)
}

/// Writes the runs of pages of `chunk` that are not all zeroes at
/// `at` + their offset in `f`; returns the bytes written.
fn write_nonzero_pages(f: &File, path: &Path, chunk: &[u8], at: u64) -> Result<u64, SnapshotError> {
    let mut written = 0u64;
    let mut run: Option<usize> = None;
    let pages = chunk.len().div_ceil(PAGE_SIZE);
    for p in 0..=pages {
        let nonzero = p < pages && {
            let page = &chunk[p * PAGE_SIZE..((p + 1) * PAGE_SIZE).min(chunk.len())];
            !is_zero(page)
        };
        match (nonzero, run) {
            (true, None) => run = Some(p),
            (false, Some(start)) => {
                let bytes = &chunk[start * PAGE_SIZE..(p * PAGE_SIZE).min(chunk.len())];
                f.write_all_at(bytes, at + (start * PAGE_SIZE) as u64)
                    .map_err(io("write", path))?;
                written += bytes.len() as u64;
                run = None;
            }
            _ => {}
        }
    }
    Ok(written)
}

/// Writes the state file (`body` with `key`) into `dir`, committing the
/// snapshot; returns its path and size.
pub(crate) fn write_state(
    dir: &Path,
    key: &str,
    state: &VmState,
) -> Result<(PathBuf, u64), SnapshotError> {
    let body = file::encode_body(state)?;
    let bytes = file::encode(key, FORMAT_VERSION, &body)?;
    let (mut f, temp) = create_temp(dir, STATE_FILE)?;
    if let Err(e) = f.write_all(&bytes) {
        drop(f);
        let _ = std::fs::remove_file(&temp);
        return Err(io("write", &temp)(e));
    }
    let path = commit(f, &temp, dir, STATE_FILE)?;
    sync_dir(dir)?;
    Ok((path, bytes.len() as u64))
}

/// Removes memory files other than `keep` and stale temporary files from
/// `dir` (best effort: a failure only leaves a file behind).
pub(crate) fn remove_stale(dir: &Path, keep: &str) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        let stale = (is_memory_file_name(name) && name != keep) || name.starts_with(TEMP_PREFIX);
        if stale {
            if let Err(err) = std::fs::remove_file(e.path()) {
                tracing::debug!(file = name, "cannot remove a stale snapshot file: {err}");
            }
        }
    }
}

/// Space `path` takes on disk.
pub(crate) fn disk_bytes(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path)
        .map(|m| m.blocks() * 512)
        .unwrap_or(0)
}

/// Reads and checks the state file of the snapshot in `dir` against `key`.
pub(crate) fn read_state(dir: &Path, key: &str) -> Result<VmState, SnapshotError> {
    let path = dir.join(STATE_FILE);
    let body = file::read(&path, FORMAT_VERSION, key)?;
    let state: VmState = file::decode_body(&path, &body)?;
    if !is_memory_file_name(&state.memory_file) {
        return Err(SnapshotError::MemoryFileName(state.memory_file));
    }
    Ok(state)
}

/// Opens the memory file `name` of the snapshot in `dir`, read-only.
pub(crate) fn open_memory(dir: &Path, name: &str) -> Result<File, SnapshotError> {
    let path = dir.join(name);
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(&path)
        .map_err(io("open the snapshot memory file", &path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_pages() {
        let mut page = vec![0u8; PAGE_SIZE];
        assert!(is_zero(&page));
        assert!(is_zero(&page[..17]));
        for at in [0, 15, 16, 4095] {
            page[at] = 1;
            assert!(!is_zero(&page), "{at}");
            page[at] = 0;
        }
        assert!(!is_zero(&[0, 0, 1]));
    }

    #[test]
    fn memory_file_names() {
        let n = new_memory_file_name().unwrap();
        assert!(is_memory_file_name(&n), "{n}");
        assert_ne!(n, new_memory_file_name().unwrap());
        for bad in [
            "",
            "memory-.bin",
            "memory-0123456789abcdef.bin.x",
            "memory-0123456789abcdeg.bin",
            "../memory-0123456789abcdef.bin",
            "memory-0123456789abcdef/.bin",
            "vm.state",
        ] {
            assert!(!is_memory_file_name(bad), "{bad}");
        }
    }

    #[test]
    fn memory_is_written_sparse_and_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let ram = crate::memory::create(8, crate::memory::Backing::AnonymousBasePages).unwrap();
        // Two pages of data far apart, one byte at the end of RAM.
        ram.mem
            .write_slice(&[7u8; 4096], vm_memory::GuestAddress(0x1000))
            .unwrap();
        ram.mem
            .write_slice(&[9u8; 10], vm_memory::GuestAddress(5 << 20))
            .unwrap();
        ram.mem
            .write_obj(1u8, vm_memory::GuestAddress((8 << 20) - 1))
            .unwrap();
        let w = write_memory(dir.path(), &ram.mem, ram.size).unwrap();
        assert_eq!(w.data_bytes, 3 * 4096);
        let meta = std::fs::metadata(&w.path).unwrap();
        assert_eq!(meta.len(), 8 << 20);
        assert_eq!(meta.permissions().mode() & 0o777, FILE_MODE);
        assert!(
            disk_bytes(&w.path) < 1 << 20,
            "sparse: {}",
            disk_bytes(&w.path)
        );
        let back =
            crate::memory::map_snapshot(8, std::sync::Arc::new(File::open(&w.path).unwrap()))
                .unwrap();
        assert_eq!(
            back.mem
                .read_obj::<u8>(vm_memory::GuestAddress(0x1fff))
                .unwrap(),
            7
        );
        assert_eq!(
            back.mem
                .read_obj::<u8>(vm_memory::GuestAddress(0x2000))
                .unwrap(),
            0
        );
        assert_eq!(
            back.mem
                .read_obj::<u8>(vm_memory::GuestAddress((5 << 20) + 9))
                .unwrap(),
            9
        );
        assert_eq!(
            back.mem
                .read_obj::<u8>(vm_memory::GuestAddress((8 << 20) - 1))
                .unwrap(),
            1
        );
        // The untouched chunk [2 MiB, 4 MiB) was skipped, not read: a read
        // would have mapped the zero page there, which the pagemap shows.
        let map = Pagemap::open().unwrap();
        let base = ram.mem.iter().next().unwrap().as_ptr() as usize;
        assert!(map.any_populated(base, COPY_CHUNK));
        assert!(!map.any_populated(base + (2 << 20), COPY_CHUNK));
        // No temporary file is left; a stale one and an old memory file go.
        std::fs::write(dir.path().join(".tmp-junk"), b"x").unwrap();
        std::fs::write(dir.path().join("memory-0000000000000000.bin"), b"x").unwrap();
        remove_stale(dir.path(), &w.name);
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, vec![w.name.clone()]);
        // A file that is not the RAM's size is refused.
        assert!(matches!(
            crate::memory::map_snapshot(16, std::sync::Arc::new(File::open(&w.path).unwrap())),
            Err(crate::memory::MemoryError::SnapshotSize { .. })
        ));
    }
}
