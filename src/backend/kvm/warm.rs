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
//! directory; [`crate::backend::snapstore`] keeps the stores): a change of
//! any of it makes a new snapshot, never a wrong restore.
//!
//! Limits: those of [`crate::backend::snapstore`].

use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

use guest_agent::framing::PREFIX_LEN;
use guest_agent::proto::{self, AgentMessage, Envelope, Hello};
use tokio::io::Interest;
use tokio::net::UnixStream;

pub use crate::backend::snapstore::Store;
use crate::backend::snapstore::{KeyText, StoreKind};

/// The kvm backend's stores: `kvm-<digest>`, committed by the VMM's state
/// file.
pub const KVM_STORE: StoreKind = StoreKind {
    prefix: "kvm-",
    commit_file: vmm::snapshot::STATE_FILE,
};
/// Version of the key's text: bump when a line changes meaning, so that
/// snapshots keyed the old way are never taken for the new.
pub const KEY_FORMAT: u32 = 1;
/// Largest hello the backend looks at to see whether it is a template
/// hello (a hello is a few hundred bytes; a larger first frame is not one).
pub const MAX_PEEKED_HELLO: usize = 64 << 10;

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
        let mut k = KeyText::new(KEY_FORMAT);
        k.line("snapshot_format", vmm::snapshot::FORMAT_VERSION)
            .boot_files(self.kernel, self.initrd, &self.root_disks)
            .line("cmdline", self.cmdline)
            .line("mem_mib", self.mem_mib)
            .line("vcpus", self.vcpus)
            .line("devices", self.devices.join(","))
            .finish()
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
    use std::fs;

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
