//! Warm start of the kvm backend: where a machine's boot snapshot lives,
//! what it is keyed by, and the template hello that says when to take it.
//!
//! The first `startVM` of a machine shape boots cold; when its agent says
//! the template hello (userland up, nothing per boot yet: see
//! `guest_agent::agent::setup`), the backend pauses the VM, saves it with
//! [`vmm::Vm::snapshot`] into this shape's [`Store`] and resumes it. Later
//! starts of the same shape restore that snapshot ([`vmm::Vm::restore`])
//! instead of booting, and go on from the same template point with this
//! boot's session disk, share and `Setup`.
//!
//! The key ([`MachineIdentity::key`]) is the canonical text of everything
//! that shapes the machine: the kernel, initramfs and root disks (path,
//! size, modification time, inode), the full command line, memory, vCPUs,
//! the device list, this helper's build (version and executable identity),
//! [`KEY_FORMAT`], this host's CPU and kernel release. It is stored in the
//! snapshot's state file and compared verbatim at restore, and its digest
//! names the store's directory (`kvm-<16 hex digits>` under the snapshot
//! directory, by default `<data dir>/snapshots`, 0700): a change of any of
//! it makes a new snapshot, never a wrong restore. At most
//! [`KEEP_SNAPSHOTS`] stores are kept, the most recently used.
//!
//! Limits: a snapshot in use is never rewritten in place (the VMM writes
//! new files and renames), but [`Store::discard`] removes a store whole,
//! so a helper that finds a snapshot it cannot restore while another
//! profile's VM is taking a new one in the same store may remove that one
//! too; the next start then boots cold again. Executable identity is by
//! metadata, not content: a rebuilt helper with the same size and
//! modification time would be taken for the same build.

use std::fmt::Write as _;
use std::fs;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use guest_agent::framing::PREFIX_LEN;
use guest_agent::proto::{self, AgentMessage, Envelope, Hello};
use tokio::io::Interest;
use tokio::net::UnixStream;

/// Prefix of a store's directory name (the rest is the key's digest).
pub const STORE_PREFIX: &str = "kvm-";
/// Snapshot directories kept: the shape in use and the one before (a
/// client that alternates two memory sizes keeps both warm).
pub const KEEP_SNAPSHOTS: usize = 2;
/// Version of the key's text: bump when a line changes meaning, so that
/// snapshots keyed the old way are never taken for the new.
pub const KEY_FORMAT: u32 = 1;
/// Largest hello the backend looks at to see whether it is a template
/// hello (a hello is a few hundred bytes; a larger first frame is not one).
pub const MAX_PEEKED_HELLO: usize = 64 << 10;

/// `--snapshot`: whether the kvm backend takes and restores boot snapshots.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum SnapshotMode {
    /// Restore a snapshot of this machine shape when there is one; take
    /// one at the template point of a cold boot when there is not.
    #[default]
    Auto,
    /// Always boot cold; take no snapshot.
    Off,
}

/// Warm-start settings of the kvm backend (the daemon's `--snapshot` and
/// `--snapshot-dir`).
#[derive(Clone, Debug, Default)]
pub struct SnapshotOptions {
    /// Whether snapshots are taken and restored.
    pub mode: SnapshotMode,
    /// The directory holding one store per machine shape; none: no
    /// snapshots (as with [`SnapshotMode::Off`]).
    pub dir: Option<PathBuf>,
}

/// Everything that shapes the machine, for the snapshot key.
pub struct MachineIdentity<'a> {
    /// The kernel booted.
    pub kernel: &'a Path,
    /// The initramfs (the agent lives in it).
    pub initrd: &'a Path,
    /// The userland's read-only root disks.
    pub root_disks: Vec<&'a Path>,
    /// The command line the backend gives the VMM (the VMM appends the
    /// device entries, which follow from the device list).
    pub cmdline: &'a str,
    /// Guest memory.
    pub mem_mib: u64,
    /// vCPUs.
    pub vcpus: u8,
    /// Device kinds, in slot order.
    pub devices: Vec<&'static str>,
}

impl MachineIdentity<'_> {
    /// The snapshot key: one `name=value` line per property (see the
    /// module doc). A file that cannot be read gets `missing` (the boot
    /// itself then fails or differs, and the key with it).
    pub fn key(&self) -> String {
        let mut k = String::new();
        let mut line = |name: &str, value: &dyn std::fmt::Display| {
            let _ = writeln!(k, "{name}={value}");
        };
        line("key_format", &KEY_FORMAT);
        line("snapshot_format", &vmm::snapshot::FORMAT_VERSION);
        line("helper", &helper_identity());
        line("host", &host_identity());
        line("kernel", &file_identity(self.kernel));
        line("initrd", &file_identity(self.initrd));
        for disk in &self.root_disks {
            line("root_disk", &file_identity(disk));
        }
        line("cmdline", &self.cmdline);
        line("mem_mib", &self.mem_mib);
        line("vcpus", &self.vcpus);
        line("devices", &self.devices.join(","));
        k
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
fn fnv1a(bytes: &[u8]) -> u64 {
    /// FNV-1a's 64-bit offset basis.
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    /// FNV-1a's 64-bit prime.
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    bytes
        .iter()
        .fold(OFFSET, |h, b| (h ^ u64::from(*b)).wrapping_mul(PRIME))
}

/// One machine shape's snapshot directory.
#[derive(Clone, Debug)]
pub struct Store {
    dir: PathBuf,
    key: String,
}

impl Store {
    /// The store for the key `key` makes under `opts`' directory; none
    /// (and the key never made: it stats files and reads `/proc`) when
    /// snapshots are off.
    pub fn new(opts: &SnapshotOptions, key: impl FnOnce() -> String) -> Option<Store> {
        if opts.mode == SnapshotMode::Off {
            return None;
        }
        let root = opts.dir.as_ref()?;
        let key = key();
        let dir = root.join(format!("{STORE_PREFIX}{:016x}", fnv1a(key.as_bytes())));
        Some(Store { dir, key })
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
        self.dir.join(vmm::snapshot::STATE_FILE).is_file()
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
                    .is_some_and(|n| n.starts_with(STORE_PREFIX))
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

/// Errors of looking at the agent's first frame.
#[derive(Debug, thiserror::Error)]
pub enum PeekError {
    #[error("cannot peek at the agent's first message: {0}")]
    Io(#[from] io::Error),
}

/// The agent's first message when it is a hello, read without consuming
/// it (the lifecycle reads it again); `None` when the link closed or the
/// first frame is not a well-formed hello of at most [`MAX_PEEKED_HELLO`]
/// bytes.
pub async fn peek_hello(stream: &UnixStream) -> Result<Option<Hello>, PeekError> {
    let mut buf = vec![0u8; PREFIX_LEN + MAX_PEEKED_HELLO];
    loop {
        stream.readable().await?;
        let peeked = stream.try_io(Interest::READABLE, || {
            // SAFETY: `buf` is a live, writable buffer of `buf.len()` bytes
            // for the duration of the call, and the fd is the stream's own.
            let n = unsafe {
                libc::recv(
                    stream.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_PEEK | libc::MSG_DONTWAIT,
                )
            };
            let n = usize::try_from(n).map_err(|_| io::Error::last_os_error())?;
            if n == 0 {
                return Ok(None);
            }
            let Some(prefix) = buf.get(..PREFIX_LEN) else {
                return Err(io::ErrorKind::WouldBlock.into());
            };
            let Ok(prefix) = <[u8; PREFIX_LEN]>::try_from(prefix) else {
                return Err(io::ErrorKind::WouldBlock.into());
            };
            let len = u32::from_be_bytes(prefix) as usize;
            if len > MAX_PEEKED_HELLO {
                return Ok(Some(None));
            }
            if n < PREFIX_LEN + len {
                // Part of the frame: wait until more arrives.
                return Err(io::ErrorKind::WouldBlock.into());
            }
            Ok(Some(Some(buf[PREFIX_LEN..PREFIX_LEN + len].to_vec())))
        });
        match peeked {
            Ok(None) => return Ok(None),
            Ok(Some(None)) => return Ok(None),
            Ok(Some(Some(body))) => {
                return Ok(match proto::decode::<AgentMessage>(body) {
                    Ok(Envelope {
                        header: AgentMessage::Hello(h),
                        ..
                    }) => Some(h),
                    _ => None,
                })
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// How long the host waits for the agent's `Quiesced` before it snapshots
/// anyway: the agent's own wait is bounded by its egress gate (30 s), and a
/// snapshot of a machine still finishing its boot is correct, only slower
/// to start from; a few seconds cover a healthy boot under emulation.
pub const QUIESCE_LIMIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Errors of asking the agent to be quiet before the snapshot.
#[derive(Debug, thiserror::Error)]
pub enum QuiesceError {
    #[error("the agent link: {0}")]
    Link(#[from] guest_agent::framing::FrameError),
    #[error("cannot ask the agent to be quiet: {0}")]
    Write(io::Error),
    #[error("the link closed before the agent answered")]
    Closed,
    #[error("the agent answered with something else than Quiesced")]
    Unexpected,
    #[error("no answer within {0:?}")]
    Timeout(std::time::Duration),
}

/// Asks the agent at its template point (whose hello said it answers) to
/// let its boot's background work finish: consumes the template hello on
/// `stream` (the connection is dropped at the snapshot anyway), sends
/// `Quiesce` and reads the `Quiesced`, within `limit`. Returns how long the
/// agent waited and whether its work finished.
pub async fn quiesce(
    stream: &mut UnixStream,
    limit: std::time::Duration,
) -> Result<(u64, bool), QuiesceError> {
    use tokio::io::AsyncWriteExt;
    let exchange = async {
        let mut buf = Vec::new();
        if !guest_agent::framing::read_frame(&mut *stream, proto::MAX_MESSAGE, &mut buf).await? {
            return Err(QuiesceError::Closed);
        }
        let mut frame = Vec::new();
        proto::encode_frame_into(&mut frame, &proto::HostMessage::Quiesce, &[]);
        stream
            .write_all(&frame)
            .await
            .map_err(QuiesceError::Write)?;
        buf.clear();
        if !guest_agent::framing::read_frame(&mut *stream, proto::MAX_MESSAGE, &mut buf).await? {
            return Err(QuiesceError::Closed);
        }
        match proto::decode::<AgentMessage>(buf).map(|e| e.header) {
            Ok(AgentMessage::Quiesced {
                waited_ms,
                complete,
            }) => Ok((waited_ms, complete)),
            _ => Err(QuiesceError::Unexpected),
        }
    };
    tokio::time::timeout(limit, exchange)
        .await
        .unwrap_or(Err(QuiesceError::Timeout(limit)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn identity<'a>(kernel: &'a Path, initrd: &'a Path) -> MachineIdentity<'a> {
        MachineIdentity {
            kernel,
            initrd,
            root_disks: vec![],
            cmdline: "console=ttyS0",
            mem_mib: 1024,
            vcpus: 2,
            devices: vec!["vsock", "fs", "blk", "rng", "balloon"],
        }
    }

    #[test]
    fn the_key_changes_with_every_part_of_the_shape() {
        let d = tempfile::tempdir().unwrap();
        let (kernel, initrd) = (d.path().join("vmlinux"), d.path().join("initramfs"));
        fs::write(&kernel, b"kernel").unwrap();
        fs::write(&initrd, b"initrd").unwrap();
        let base = identity(&kernel, &initrd).key();
        assert_eq!(base, identity(&kernel, &initrd).key(), "stable");
        for line in [
            "key_format=",
            "helper=",
            "host=cpu ",
            "cmdline=console=ttyS0",
        ] {
            assert!(base.contains(line), "{line} in {base}");
        }
        let mut other = identity(&kernel, &initrd);
        other.mem_mib = 2048;
        assert_ne!(base, other.key());
        let mut other = identity(&kernel, &initrd);
        other.vcpus = 1;
        assert_ne!(base, other.key());
        let mut other = identity(&kernel, &initrd);
        other.cmdline = "console=ttyS0 quiet";
        assert_ne!(base, other.key());
        let mut other = identity(&kernel, &initrd);
        other.devices.pop();
        assert_ne!(base, other.key());
        let mut other = identity(&kernel, &initrd);
        other.root_disks.push(&kernel);
        assert_ne!(base, other.key());
        // A rebuilt initramfs (new size, new inode) is another machine.
        fs::remove_file(&initrd).unwrap();
        fs::write(&initrd, b"initrd, rebuilt").unwrap();
        assert_ne!(base, identity(&kernel, &initrd).key());
    }

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
        assert!(Store::new(&off, || unreachable!("no key is made when off")).is_none());
        assert!(Store::new(&SnapshotOptions::default(), || "k".into()).is_none());
        let a = Store::new(&opts, || "a".into()).unwrap();
        let b = Store::new(&opts, || "b".into()).unwrap();
        assert_ne!(a.dir(), b.dir());
        assert_eq!(a.key(), "a");
        assert!(!a.exists());
        a.prepare().unwrap();
        let mode = fs::metadata(&root).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        // Three stores, used in the order c, a, b: c goes.
        let c = Store::new(&opts, || "c".into()).unwrap();
        for s in [&c, &a, &b] {
            fs::create_dir(s.dir()).unwrap();
            fs::write(s.dir().join(vmm::snapshot::STATE_FILE), b"x").unwrap();
            s.touch_and_prune();
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert!(a.exists() && b.exists());
        assert!(!c.dir().exists());
        // Something else in the directory is left alone.
        fs::write(root.join("notes"), b"mine").unwrap();
        b.touch_and_prune();
        assert!(root.join("notes").exists());
        a.discard();
        assert!(!a.dir().exists());
        a.discard();
    }

    fn frame(msg: &AgentMessage) -> Vec<u8> {
        let mut f = Vec::new();
        proto::encode_frame_into(&mut f, msg, &[]);
        f
    }

    fn hello(phase: Option<&str>) -> Hello {
        Hello {
            protocol: proto::PROTOCOL_VERSION,
            version: "t".into(),
            is_init: true,
            boot: Default::default(),
            kernel: "k".into(),
            userland: None,
            session_disk: None,
            phase: phase.map(Into::into),
            ca_trust: None,
            quiesce: false,
        }
    }

    /// The template hello is consumed, `Quiesce` sent, `Quiesced` read; any
    /// other answer, or none in time, is an error the caller logs.
    #[tokio::test]
    async fn quiesce_asks_and_reads_the_answer_within_the_limit() {
        use tokio::io::AsyncWriteExt;
        for answer in [
            Some(AgentMessage::Quiesced {
                waited_ms: 12,
                complete: true,
            }),
            Some(AgentMessage::Hello(hello(None))),
            None,
        ] {
            let (mut host, mut agent) = UnixStream::pair().unwrap();
            agent
                .write_all(&frame(&AgentMessage::Hello(hello(Some(Hello::TEMPLATE)))))
                .await
                .unwrap();
            let reply = answer.clone();
            let guest = tokio::spawn(async move {
                let mut buf = Vec::new();
                assert!(
                    guest_agent::framing::read_frame(&mut agent, proto::MAX_MESSAGE, &mut buf)
                        .await
                        .unwrap()
                );
                let msg = proto::decode::<proto::HostMessage>(buf).unwrap();
                assert_eq!(msg.header, proto::HostMessage::Quiesce);
                if let Some(r) = reply {
                    agent.write_all(&frame(&r)).await.unwrap();
                }
                agent
            });
            let got = quiesce(&mut host, std::time::Duration::from_millis(300)).await;
            match answer {
                Some(AgentMessage::Quiesced { .. }) => assert_eq!(got.unwrap(), (12, true)),
                Some(_) => assert!(matches!(got, Err(QuiesceError::Unexpected)), "{got:?}"),
                None => assert!(matches!(got, Err(QuiesceError::Timeout(_))), "{got:?}"),
            }
            drop(guest.await.unwrap());
        }
    }

    #[tokio::test]
    async fn peeking_leaves_the_hello_to_be_read_and_waits_for_a_whole_frame() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (a, mut b) = UnixStream::pair().unwrap();
        let bytes = frame(&AgentMessage::Hello(hello(Some(Hello::TEMPLATE))));
        // Half a frame first: the peek waits for the rest.
        b.write_all(&bytes[..bytes.len() / 2]).await.unwrap();
        let peek = tokio::spawn(async move {
            let h = peek_hello(&a).await.unwrap();
            (h, a)
        });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(!peek.is_finished());
        b.write_all(&bytes[bytes.len() / 2..]).await.unwrap();
        let (h, mut a) = peek.await.unwrap();
        assert!(h.unwrap().is_template());
        let mut again = vec![0u8; bytes.len()];
        a.read_exact(&mut again).await.unwrap();
        assert_eq!(again, bytes, "the frame is still there to read");
    }

    #[tokio::test]
    async fn anything_but_a_small_hello_is_none() {
        use tokio::io::AsyncWriteExt;
        let (a, mut b) = UnixStream::pair().unwrap();
        b.write_all(&frame(&AgentMessage::Hello(hello(None))))
            .await
            .unwrap();
        assert!(!peek_hello(&a).await.unwrap().unwrap().is_template());

        let (a, mut b) = UnixStream::pair().unwrap();
        b.write_all(&(MAX_PEEKED_HELLO as u32 + 1).to_be_bytes())
            .await
            .unwrap();
        assert!(peek_hello(&a).await.unwrap().is_none(), "too large");

        let (a, mut b) = UnixStream::pair().unwrap();
        b.write_all(&[0, 0, 0, 3, b'x', b'y', b'z']).await.unwrap();
        assert!(peek_hello(&a).await.unwrap().is_none(), "not a message");

        let (a, b) = UnixStream::pair().unwrap();
        drop(b);
        assert!(peek_hello(&a).await.unwrap().is_none(), "closed");
    }
}
