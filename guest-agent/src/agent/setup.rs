//! The template point of a VM's boot and what ends it: the host's `Setup`.
//!
//! A VM's agent stops its boot once the userland is up and before anything
//! per boot exists (no session disk, no session share, no session, no
//! egress credential), says a template hello ([`proto::Hello::TEMPLATE`])
//! and waits for [`proto::HostMessage::Setup`]. The host may snapshot the
//! machine while it waits: a machine restored from that snapshot wakes up
//! in the same wait, with its vsock connections reset (the transport reset
//! the VMM sends closes them), so the agent dials again and says the
//! template hello again ([`template_handshake`]). A machine with no vsock
//! device yet (the qemu backend hot-plugs it after its snapshot; the kernel
//! command line then says [`proto::TEMPLATE_SIGNAL_ENV`]) gets the template
//! point on the console instead, once the boot's background work is done,
//! and the agent polls for the device before the same handshake. Either way the `Setup` it
//! finally gets belongs to this boot, and [`apply`] makes the machine this
//! boot's before anything else runs:
//!
//! - the host's entropy is added to the kernel's pool with credit
//!   (`RNDADDENTROPY`) and the kernel's CRNG is reseeded at once
//!   (`RNDRESEEDCRNG`): Debian's cloud kernel has no VM generation ID driver
//!   that would do it, and two restores of one snapshot must not repeat each
//!   other's random numbers;
//! - the wall clock is set to the host's (`CLOCK_REALTIME`): a restored
//!   machine's clock otherwise resumes from the snapshot's instant;
//! - the agent's own randomness: it keeps no userspace generator (it reads
//!   the kernel's for everything, after the reseed), so there is nothing to
//!   reseed in the process.
//!
//! Limits: the entropy is credited as full (it comes from the host's OS
//! generator over the host link); a failed ioctl or clock set is logged,
//! not fatal (a sandbox-less test agent as a plain process lacks the
//! privileges).

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

use crate::framing;
use crate::proto::{self, AgentMessage, Envelope, Hello, HostMessage};

/// `RNDADDENTROPY`, `_IOW('R', 0x03, int[2])`: add bytes with credit.
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
/// `RNDRESEEDCRNG`, `_IO('R', 0x07)`: reseed the CRNG now.
const RNDRESEEDCRNG: libc::c_ulong = 0x5207;
/// The kernel's random device.
const URANDOM: &str = "/dev/urandom";

/// What a `Setup` carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setup {
    /// The host's wall clock, ns since the epoch.
    pub wall_clock_ns: u64,
    /// Host entropy ([`proto::SETUP_ENTROPY_BYTES`]).
    pub entropy: Vec<u8>,
    /// The egress CA to trust before the final hello, when the host has one.
    pub trust_ca: Option<String>,
}

/// The handshake or the setup failed.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("the host link: {0}")]
    Link(#[from] framing::FrameError),
    #[error("cannot write the template hello: {0}")]
    Write(io::Error),
    #[error("the host's answer to the template hello is not a Setup: {0}")]
    NotSetup(String),
    #[error("the Setup carries {got} bytes of entropy, not {want}")]
    Entropy { got: usize, want: usize },
    #[error("the host link could not be dialled again: {0}")]
    Redial(String),
    #[error("{what}: {source}")]
    Apply {
        what: &'static str,
        source: io::Error,
    },
}

/// Whether a link error means the connection went away (reset, closed),
/// after which the agent dials again.
fn link_lost(e: &SetupError) -> bool {
    match e {
        SetupError::Link(framing::FrameError::Io(io)) | SetupError::Write(io) => matches!(
            io.kind(),
            io::ErrorKind::ConnectionReset
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::BrokenPipe
                | io::ErrorKind::UnexpectedEof
                | io::ErrorKind::NotConnected
        ),
        _ => false,
    }
}

/// Says the template hello on `conn` and waits for the `Setup`, answering
/// a `Quiesce` on the way once `quiet` (the boot's background work
/// finishing: `(waited_ms, complete)`) returns. `Ok(None)`: the link went
/// away (a snapshot or a restore reset it).
pub async fn exchange<S, Q, QF>(
    conn: &mut S,
    hello: &Hello,
    quiet: Q,
) -> Result<Option<Setup>, SetupError>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    Q: Fn() -> QF,
    QF: std::future::Future<Output = (u64, bool)>,
{
    let hello = AgentMessage::Hello(hello.clone());
    if let Err(e) = send(conn, &hello).await {
        return if link_lost(&e) { Ok(None) } else { Err(e) };
    }
    let mut buf = Vec::new();
    loop {
        match framing::read_frame(conn, proto::MAX_MESSAGE, &mut buf).await {
            Ok(true) => {}
            Ok(false) => return Ok(None),
            Err(e) => {
                let e = SetupError::Link(e);
                return if link_lost(&e) { Ok(None) } else { Err(e) };
            }
        }
        let message = proto::decode::<HostMessage>(std::mem::take(&mut buf));
        if !matches!(&message, Ok(env) if env.header == HostMessage::Quiesce) {
            return setup_of(message);
        }
        let (waited_ms, complete) = quiet().await;
        tracing::info!(waited_ms, complete, "quiet for the host's snapshot");
        let answer = AgentMessage::Quiesced {
            waited_ms,
            complete,
        };
        if let Err(e) = send(conn, &answer).await {
            return if link_lost(&e) { Ok(None) } else { Err(e) };
        }
    }
}

/// Writes one frame of `msg` (no payload) to `conn`.
async fn send<S>(conn: &mut S, msg: &AgentMessage) -> Result<(), SetupError>
where
    S: tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::AsyncWriteExt;
    let mut frame = Vec::new();
    proto::encode_frame_into(&mut frame, msg, &[]);
    conn.write_all(&frame).await.map_err(SetupError::Write)
}

/// The `Setup` in the host's (decoded) message.
fn setup_of(
    message: Result<Envelope<HostMessage>, proto::ProtoError>,
) -> Result<Option<Setup>, SetupError> {
    match message {
        Ok(Envelope {
            header:
                HostMessage::Setup {
                    wall_clock_ns,
                    trust_ca,
                },
            payload,
        }) => {
            if payload.len() != proto::SETUP_ENTROPY_BYTES {
                return Err(SetupError::Entropy {
                    got: payload.len(),
                    want: proto::SETUP_ENTROPY_BYTES,
                });
            }
            Ok(Some(Setup {
                wall_clock_ns,
                entropy: payload,
                trust_ca,
            }))
        }
        Ok(other) => Err(SetupError::NotSetup(format!("{:?}", other.header))),
        Err(e) => Err(SetupError::NotSetup(e.to_string())),
    }
}

/// Dials with `dial`, says the template hello `hello` (answering a
/// `Quiesce` once `quiet` returns, see [`exchange`]) and returns the
/// connection and the `Setup`; dials again (at most `max_dials` times in
/// all) whenever the link goes away before the `Setup` arrives.
pub async fn template_handshake<S, D, F, Q, QF>(
    mut dial: D,
    hello: &Hello,
    quiet: Q,
    max_dials: usize,
) -> Result<(S, Setup), SetupError>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    D: FnMut() -> F,
    F: std::future::Future<Output = Result<S, String>>,
    Q: Fn() -> QF,
    QF: std::future::Future<Output = (u64, bool)>,
{
    for attempt in 1..=max_dials.max(1) {
        let mut conn = dial().await.map_err(SetupError::Redial)?;
        match exchange(&mut conn, hello, &quiet).await? {
            Some(setup) => return Ok((conn, setup)),
            // Debug: every console byte is a port I/O exit on a warm
            // start's path, and the host logs the redial it accepts.
            None => tracing::debug!(
                attempt,
                "the host link was reset at the template point (a snapshot, or a restore); dialling again"
            ),
        }
    }
    Err(SetupError::Redial(format!(
        "the link went away {max_dials} times before the host's Setup"
    )))
}

/// Makes the machine this boot's (see the module doc). Each step is
/// attempted; the first failure is returned after all ran.
pub fn apply(setup: &Setup) -> Result<(), SetupError> {
    let entropy = add_entropy_and_reseed(&setup.entropy);
    let clock = set_wall_clock(setup.wall_clock_ns);
    match (&entropy, &clock) {
        // Debug: the final hello says as much (failures are warnings).
        (Ok(()), Ok(())) => tracing::debug!("setup applied: RNG reseeded, clock set"),
        _ => tracing::warn!(
            entropy = ?entropy.as_ref().err().map(ToString::to_string),
            clock = ?clock.as_ref().err().map(ToString::to_string),
            "setup partly applied"
        ),
    }
    entropy.and(clock)
}

/// `rand_pool_info` with its buffer: entropy count (bits), size, bytes.
fn pool_info(entropy: &[u8]) -> Vec<u8> {
    let bits = i32::try_from(entropy.len() * 8).unwrap_or(i32::MAX);
    let size = i32::try_from(entropy.len()).unwrap_or(i32::MAX);
    let mut info = Vec::with_capacity(8 + entropy.len());
    info.extend_from_slice(&bits.to_ne_bytes());
    info.extend_from_slice(&size.to_ne_bytes());
    info.extend_from_slice(entropy);
    // The kernel reads `buf_size` bytes of a `__u32` array: pad to a whole
    // number of words.
    while info.len() % 4 != 0 {
        info.push(0);
    }
    info
}

/// Adds `entropy` to the kernel's pool with credit and reseeds the CRNG.
pub fn add_entropy_and_reseed(entropy: &[u8]) -> Result<(), SetupError> {
    let dev: OwnedFd = std::fs::OpenOptions::new()
        .write(true)
        .open(URANDOM)
        .map(OwnedFd::from)
        .map_err(|source| SetupError::Apply {
            what: "open /dev/urandom",
            source,
        })?;
    let info = pool_info(entropy);
    // SAFETY: `info` is a rand_pool_info (two ints, then `buf_size` bytes)
    // that outlives the call; the kernel only reads it.
    let rc = unsafe { libc::ioctl(dev.as_raw_fd(), RNDADDENTROPY, info.as_ptr()) };
    if rc != 0 {
        return Err(SetupError::Apply {
            what: "RNDADDENTROPY",
            source: io::Error::last_os_error(),
        });
    }
    // SAFETY: RNDRESEEDCRNG takes no argument.
    let rc = unsafe { libc::ioctl(dev.as_raw_fd(), RNDRESEEDCRNG) };
    if rc != 0 {
        return Err(SetupError::Apply {
            what: "RNDRESEEDCRNG",
            source: io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// The `timespec` of `ns` since the epoch.
fn timespec_of(ns: u64) -> libc::timespec {
    libc::timespec {
        tv_sec: libc::time_t::try_from(ns / 1_000_000_000).unwrap_or(libc::time_t::MAX),
        tv_nsec: (ns % 1_000_000_000) as libc::c_long,
    }
}

/// Sets `CLOCK_REALTIME` to `ns` since the epoch.
fn set_wall_clock(ns: u64) -> Result<(), SetupError> {
    let ts = timespec_of(ns);
    // SAFETY: `ts` is a valid timespec; clock_settime only reads it.
    if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) } != 0 {
        return Err(SetupError::Apply {
            what: "clock_settime(CLOCK_REALTIME)",
            source: io::Error::last_os_error(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    fn template() -> Hello {
        Hello {
            protocol: proto::PROTOCOL_VERSION,
            phase: Some(Hello::TEMPLATE.into()),
            ca_trust: None,
            ..Hello::default()
        }
    }

    async fn read_hello(s: &mut tokio::net::UnixStream) -> Hello {
        let mut buf = Vec::new();
        assert!(framing::read_frame(s, proto::MAX_MESSAGE, &mut buf)
            .await
            .unwrap());
        match proto::decode::<AgentMessage>(buf).unwrap().header {
            AgentMessage::Hello(h) => h,
            other => panic!("not a hello: {other:?}"),
        }
    }

    fn setup_frame(entropy: usize) -> Vec<u8> {
        let mut f = Vec::new();
        proto::encode_frame_into(
            &mut f,
            &HostMessage::Setup {
                wall_clock_ns: 1_700_000_000_123_456_789,
                trust_ca: Some("the CA".into()),
            },
            &vec![7u8; entropy],
        );
        f
    }

    /// The host resets the first connection at the template point (as a
    /// snapshot does); the agent dials again and gets its Setup there.
    #[tokio::test]
    async fn a_link_reset_at_the_template_point_is_dialled_again() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("host.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let host = tokio::spawn(async move {
            let (mut first, _) = listener.accept().await.unwrap();
            assert!(read_hello(&mut first).await.is_template());
            // As before a snapshot: quiet first, then the link goes away.
            let mut f = Vec::new();
            proto::encode_frame_into(&mut f, &HostMessage::Quiesce, &[]);
            first.write_all(&f).await.unwrap();
            let mut buf = Vec::new();
            assert!(
                framing::read_frame(&mut first, proto::MAX_MESSAGE, &mut buf)
                    .await
                    .unwrap()
            );
            assert_eq!(
                proto::decode::<AgentMessage>(buf).unwrap().header,
                AgentMessage::Quiesced {
                    waited_ms: 5,
                    complete: true
                }
            );
            drop(first);
            let (mut second, _) = listener.accept().await.unwrap();
            let h = read_hello(&mut second).await;
            assert!(h.is_template());
            second
                .write_all(&setup_frame(proto::SETUP_ENTROPY_BYTES))
                .await
                .unwrap();
            second
        });
        let dial = || {
            let path = path.clone();
            async move {
                tokio::net::UnixStream::connect(&path)
                    .await
                    .map_err(|e| e.to_string())
            }
        };
        let quiet = || async { (5, true) };
        let (_conn, setup) = template_handshake(dial, &template(), quiet, 3)
            .await
            .unwrap();
        assert_eq!(setup.wall_clock_ns, 1_700_000_000_123_456_789);
        assert_eq!(setup.trust_ca.as_deref(), Some("the CA"));
        assert_eq!(setup.entropy, vec![7u8; proto::SETUP_ENTROPY_BYTES]);
        host.await.unwrap();
    }

    #[tokio::test]
    async fn anything_but_a_whole_setup_is_an_error() {
        for (frame, want) in [
            (setup_frame(3), "3 bytes of entropy"),
            (
                {
                    let mut f = Vec::new();
                    proto::encode_frame_into(
                        &mut f,
                        &HostMessage::Request {
                            id: 1,
                            op: proto::Op::Ping,
                        },
                        &[],
                    );
                    f
                },
                "not a Setup",
            ),
        ] {
            let (mut agent, mut host) = tokio::net::UnixStream::pair().unwrap();
            let h = tokio::spawn(async move {
                let _ = read_hello(&mut host).await;
                host.write_all(&frame).await.unwrap();
                host
            });
            let e = exchange(&mut agent, &template(), || async { (0, true) })
                .await
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{e}");
            h.await.unwrap();
        }
        // A host that keeps resetting: the agent gives up after its dials.
        let dial = || async {
            let (a, b) = tokio::net::UnixStream::pair().map_err(|e| e.to_string())?;
            drop(b);
            Ok::<_, String>(a)
        };
        let quiet = || async { (0, true) };
        let e = template_handshake(dial, &template(), quiet, 2)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("2 times"), "{e}");
    }

    #[test]
    fn the_pool_info_is_what_the_kernel_reads() {
        let info = pool_info(&[1, 2, 3, 4, 5]);
        assert_eq!(i32::from_ne_bytes(info[0..4].try_into().unwrap()), 40);
        assert_eq!(i32::from_ne_bytes(info[4..8].try_into().unwrap()), 5);
        assert_eq!(&info[8..13], &[1, 2, 3, 4, 5]);
        assert_eq!(info.len() % 4, 0);
        let ts = timespec_of(1_700_000_000_123_456_789);
        assert_eq!((ts.tv_sec, ts.tv_nsec), (1_700_000_000, 123_456_789));
    }

    /// Adding credited entropy and reseeding need CAP_SYS_ADMIN: as root
    /// here it runs for real (it only adds to the host's pool).
    #[test]
    fn entropy_is_added_and_the_crng_reseeded_as_root() {
        // SAFETY: geteuid takes no arguments and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipping: RNDADDENTROPY needs CAP_SYS_ADMIN");
            return;
        }
        let mut bytes = [0u8; proto::SETUP_ENTROPY_BYTES];
        getrandom(&mut bytes);
        add_entropy_and_reseed(&bytes).unwrap();
    }

    fn getrandom(buf: &mut [u8]) {
        // SAFETY: `buf` is writable for its length.
        let n = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
        assert_eq!(n as usize, buf.len());
    }
}
