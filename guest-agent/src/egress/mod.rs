//! Guest side of egress: how programs inside the VM (or the sandbox's
//! network namespace) reach the network only through the host's egress
//! proxy, which applies each spawn's `allowedDomains`.
//!
//! Neither the VM nor the sandbox's namespace has a route anywhere; the only
//! way out is a stream to the host's proxy ([`upstream`]: vsock port
//! [`proto::EGRESS_PORT`] in a VM, the unix socket named by
//! [`proto::EGRESS_SOCKET_ENV`] in the sandbox). The agent provides:
//!
//! * **stage 1**, for proxy-aware programs: the relay on
//!   `127.0.0.1:`[`proto::GUEST_PROXY_PORT`] ([`relay`]), which copies each
//!   connection to a fresh upstream stream; the spawn's credential travels
//!   in the client's own request (the host puts the proxy URL into every
//!   spawn's environment). ssh gets a `ProxyCommand` ([`connect_tool`]).
//! * **stage 2**, for everything else: the DNS stub ([`dns`]) answers with
//!   fake addresses ([`fake`]), the capture ([`capture`]) takes every TCP
//!   connection to a non-loopback address, and [`flows`] sends each to the
//!   host as SOCKS5 CONNECT by name ([`socks_client`]) with the credential
//!   of the spawn that made it ([`attrib`] finds it in the [`Spawns`]
//!   registry, which the agent's process supervisor fills).
//!
//! [`start`] is the one call the agent makes, before it dials the host. It
//! binds the relay and the DNS stub at once (a few syscalls) and installs
//! the capture on a thread of its own (loading and verifying the BPF
//! program is the slow part: about 0.4 s in a nested-KVM boot, 45 ms under
//! QEMU TCG directly, under 1 ms without emulation), so the install
//! overlaps the agent's dial and hello. The [`gate`] keeps session
//! processes from starting before that install has finished (or failed),
//! so a spawn's first connection is captured like any later one.
//!
//! Enforcement is entirely the host's: nothing here can widen what a spawn
//! may reach, a broken or disabled stage only makes more connections fail.
//!
//! Limits: IPv4 only in stage 2; UDP is not carried at all.

pub mod attrib;
pub mod capture;
pub mod connect_tool;
pub mod dns;
pub mod fake;
pub mod flows;
pub mod gate;
pub mod relay;
pub mod sockdiag;
pub mod socks_client;
pub mod spawns;
pub mod upstream;

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use gate::{EgressGate, GateHold, Passage};
pub use spawns::{ProxyCredential, Spawns, Ticket};
pub use upstream::Upstream;

use crate::proto;
use crate::sync::MutexExt;

/// Where the relay listens in production: loopback only, so nothing but
/// local programs can use it.
pub const RELAY_ADDR: SocketAddrV4 =
    SocketAddrV4::new(Ipv4Addr::LOCALHOST, proto::GUEST_PROXY_PORT);

/// Log lines a [`RateLimitedLog`] lets through per [`LOG_WINDOW`]; a flood
/// of refused connections must not flood the agent's log.
pub const LOG_BURST: u32 = 20;

/// The window of [`LOG_BURST`].
pub const LOG_WINDOW: Duration = Duration::from_secs(10);

/// Errors of [`start`]: stage 1 could not come up (stage 2 failures are
/// logged, never returned).
#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    #[error(transparent)]
    Relay(#[from] relay::RelayError),
    #[error("egress must be started inside the agent's tokio runtime")]
    NoRuntime,
}

/// What [`start`] brings up.
#[derive(Debug)]
pub struct Options {
    /// The host's proxy.
    pub upstream: Upstream,
    /// The registry attribution reads (the process supervisor fills it).
    pub spawns: Spawns,
    /// The relay's address ([`RELAY_ADDR`]; port 0 in tests).
    pub relay_addr: SocketAddr,
    /// Stage 2 (DNS stub on this address, capture, captured flows); `None`
    /// for stage 1 only.
    pub dns_addr: Option<SocketAddrV4>,
    /// procfs for attribution ([`attrib::PROC_ROOT`]).
    pub proc_root: PathBuf,
    /// Held until the capture's install has finished (either way), so the
    /// [`gate`] this hold belongs to opens only then.
    pub hold: GateHold,
}

impl Options {
    /// Production settings: both stages, the well-known addresses; `hold`
    /// keeps its gate closed until the capture is installed or failed.
    pub fn production(upstream: Upstream, spawns: Spawns, hold: GateHold) -> Self {
        Self {
            upstream,
            spawns,
            relay_addr: SocketAddr::V4(RELAY_ADDR),
            dns_addr: Some(dns::STUB_ADDR),
            proc_root: PathBuf::from(attrib::PROC_ROOT),
            hold,
        }
    }
}

/// What came up.
#[derive(Debug)]
pub struct Started {
    /// The relay's bound address.
    pub relay_addr: SocketAddr,
    /// Where the DNS stub serves, if it does.
    pub dns: Option<SocketAddrV4>,
    /// The capture's install, still running on its own thread; `None`
    /// without stage 2.
    pub capture: Option<PendingCapture>,
}

/// The capture's install running on its own thread (see [`start`]).
#[derive(Debug)]
pub struct PendingCapture {
    rx: tokio::sync::oneshot::Receiver<Option<capture::CaptureMode>>,
}

impl PendingCapture {
    /// How connections are captured once the install has finished, `None`
    /// if it failed (logged with its reason).
    pub async fn outcome(self) -> Option<capture::CaptureMode> {
        self.rx.await.ok().flatten()
    }
}

/// The host's proxy for this agent: the sandbox names a unix socket in
/// [`proto::EGRESS_SOCKET_ENV`] (read through `env`); a VM's init uses
/// vsock; anything else (a plain agent, tests) has no egress.
pub fn choose_upstream(vm_init: bool, env: impl Fn(&str) -> Option<String>) -> Option<Upstream> {
    if let Some(path) = env(proto::EGRESS_SOCKET_ENV).filter(|p| !p.is_empty()) {
        return Some(Upstream::Unix(PathBuf::from(path)));
    }
    vm_init.then(Upstream::host_vsock)
}

/// Brings up egress: the relay (stage 1; its failure is the error), then
/// the DNS stub, and on a thread of its own the capture and the
/// captured-flow loop (stage 2; each failure is logged with its reason and
/// leaves that part off). Returns once the relay and the stub are bound;
/// `opts.hold` is released when the capture's install has finished (at
/// once with stage 1 only or on error). Must be called inside a tokio
/// runtime, from a thread in the network namespace to capture;
/// everything serves on spawned tasks.
pub fn start(opts: Options) -> Result<Started, EgressError> {
    if tokio::runtime::Handle::try_current().is_err() {
        return Err(EgressError::NoRuntime);
    }
    let listener = std::net::TcpListener::bind(opts.relay_addr)
        .and_then(|l| {
            l.set_nonblocking(true)?;
            tokio::net::TcpListener::from_std(l)
        })
        .map_err(|source| relay::RelayError::Bind {
            addr: opts.relay_addr,
            source,
        })?;
    let relay_addr = listener.local_addr().unwrap_or(opts.relay_addr);
    let upstream = opts.upstream.clone();
    tokio::spawn(async move {
        if let Err(e) = relay::serve(listener, upstream).await {
            tracing::error!(error = %e, "egress relay stopped");
        }
    });
    tracing::info!(relay = %relay_addr, upstream = %opts.upstream, "egress relay listening");
    let mut started = Started {
        relay_addr,
        dns: None,
        capture: None,
    };
    let Some(dns_addr) = opts.dns_addr else {
        return Ok(started);
    };
    let pool = Arc::new(fake::FakePool::new());
    match dns::serve(Arc::clone(&pool), dns_addr) {
        // dns::serve logs where it listens.
        Ok(addr) => started.dns = Some(addr),
        Err(e) => tracing::warn!(error = %e, "egress stage 2: no DNS stub; names do not resolve"),
    }
    let ctx = flows::FlowContext::new(opts.upstream, opts.spawns, pool, opts.proc_root);
    started.capture = Some(spawn_capture(ctx, opts.hold));
    Ok(started)
}

/// Name of the thread that installs the capture (seen in `ps -T`).
const CAPTURE_THREAD: &str = "egress-capture";

/// What the capture's thread needs: the flows' context, where to send the
/// outcome, the hold to release when done, and when the work was handed
/// over (for the log line).
type CaptureWork = (
    flows::FlowContext,
    tokio::sync::oneshot::Sender<Option<capture::CaptureMode>>,
    GateHold,
    Instant,
);

/// Installs the capture ([`start_capture`]) on a new thread, which shares
/// this thread's network namespace (a thread of the runtime's blocking pool
/// might have been started from another one), then releases the hold. If
/// no thread can be started the install runs here.
fn spawn_capture(ctx: flows::FlowContext, hold: GateHold) -> PendingCapture {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let runtime = tokio::runtime::Handle::current();
    let work = Arc::new(Mutex::new(Some((ctx, tx, hold, Instant::now()))));
    let theirs = Arc::clone(&work);
    let thread_runtime = runtime.clone();
    let spawned = std::thread::Builder::new()
        .name(CAPTURE_THREAD.to_string())
        .spawn(move || {
            let _runtime = thread_runtime.enter();
            install_capture(&theirs);
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start a thread for the egress capture; installing it before dialling the host");
        let _runtime = runtime.enter();
        install_capture(&work);
    }
    PendingCapture { rx }
}

/// The capture thread's work (once: whoever takes it first).
fn install_capture(work: &Mutex<Option<CaptureWork>>) {
    let taken = work.locked().take();
    let Some((ctx, tx, hold, handed_over)) = taken else {
        return;
    };
    let began = Instant::now();
    let mode = start_capture(ctx);
    tracing::debug!(
        ?mode,
        thread_start_us = began.duration_since(handed_over).as_micros() as u64,
        install_us = began.elapsed().as_micros() as u64,
        "egress capture start-up finished"
    );
    let _ = tx.send(mode);
    hold.release();
}

/// Installs the capture and spawns its accept loop; `None` (logged) when
/// it cannot be installed.
fn start_capture(ctx: flows::FlowContext) -> Option<capture::CaptureMode> {
    let cap = match capture::install() {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "egress stage 2: no capture; programs that ignore the proxy variables cannot connect");
            return None;
        }
    };
    // capture::install logged how it captures.
    let mode = cap.mode();
    let ctx = Arc::new(ctx);
    tokio::spawn(async move {
        loop {
            match cap.accept().await {
                Ok(c) => {
                    tokio::spawn(flows::handle(
                        Arc::clone(&ctx),
                        c.stream,
                        c.original_dst,
                        c.peer,
                    ));
                }
                Err(e) => {
                    if let Err(e) = relay::accept_failed(e).await {
                        tracing::error!(error = %e, "egress capture stopped");
                        return;
                    }
                }
            }
        }
    });
    Some(mode)
}

/// A log budget: at most [`LOG_BURST`] lines per [`LOG_WINDOW`]; the
/// number held back is reported once the next window opens.
#[derive(Debug)]
pub struct RateLimitedLog {
    state: Mutex<(Instant, u32, u64)>,
}

impl Default for RateLimitedLog {
    fn default() -> Self {
        Self::new()
    }
}

impl RateLimitedLog {
    pub fn new() -> Self {
        Self {
            state: Mutex::new((Instant::now(), 0, 0)),
        }
    }

    /// Whether one more line may be logged now.
    pub fn allow(&self) -> bool {
        self.allow_at(Instant::now())
    }

    fn allow_at(&self, now: Instant) -> bool {
        let mut s = self.state.locked();
        let (start, used, held) = &mut *s;
        if now.saturating_duration_since(*start) >= LOG_WINDOW {
            if *held > 0 {
                tracing::warn!(suppressed = *held, "egress: similar log lines suppressed");
            }
            *start = now;
            *used = 0;
            *held = 0;
        }
        if *used < LOG_BURST {
            *used += 1;
            true
        } else {
            *held += 1;
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn the_upstream_follows_the_environment_then_the_vm() {
        let none = |_: &str| None;
        assert_eq!(choose_upstream(false, none), None);
        assert_eq!(choose_upstream(true, none), Some(Upstream::host_vsock()));
        let sandbox = |k: &str| (k == proto::EGRESS_SOCKET_ENV).then(|| "/.egress".to_string());
        assert_eq!(
            choose_upstream(false, sandbox),
            Some(Upstream::Unix("/.egress".into()))
        );
        let empty = |_: &str| Some(String::new());
        assert_eq!(choose_upstream(false, empty), None);
    }

    #[test]
    fn the_log_budget_refills_per_window() {
        let log = RateLimitedLog::new();
        let t0 = Instant::now();
        let allowed = (0..LOG_BURST + 5).filter(|_| log.allow_at(t0)).count();
        assert_eq!(allowed, LOG_BURST as usize);
        assert!(!log.allow_at(t0 + LOG_WINDOW / 2));
        assert!(log.allow_at(t0 + LOG_WINDOW));
    }

    #[test]
    fn start_needs_a_runtime() {
        let opts = Options {
            relay_addr: "127.0.0.1:0".parse().unwrap(),
            dns_addr: None,
            ..Options::production(
                Upstream::Unix("/nonexistent".into()),
                Spawns::new(),
                gate::gate().0,
            )
        };
        assert!(matches!(start(opts), Err(EgressError::NoRuntime)));
    }

    /// Stage 1 through `start`: a client of the relay reaches the unix
    /// upstream; a second start on the same address fails with the reason.
    /// Either way nothing is left to install: the gate is open.
    #[tokio::test]
    async fn start_brings_up_the_relay() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("egress.sock");
        let host = tokio::net::UnixListener::bind(&sock).unwrap();
        let opts = |addr: SocketAddr, hold: GateHold| Options {
            relay_addr: addr,
            dns_addr: None,
            ..Options::production(Upstream::Unix(sock.clone()), Spawns::new(), hold)
        };
        let (hold, ready) = gate::gate();
        let started = start(opts("127.0.0.1:0".parse().unwrap(), hold)).unwrap();
        assert!(started.dns.is_none() && started.capture.is_none());
        assert!(ready.is_open(), "stage 1 only: nothing runs on");
        let server = tokio::spawn(async move {
            let (mut s, _) = host.accept().await.unwrap();
            let mut b = [0u8; 7];
            s.read_exact(&mut b).await.unwrap();
            s.write_all(b"HTTP/1.1 407 \r\n\r\n").await.unwrap();
            b
        });
        let mut c = tokio::net::TcpStream::connect(started.relay_addr)
            .await
            .unwrap();
        c.write_all(b"CONNECT").await.unwrap();
        let mut answer = [0u8; 12];
        c.read_exact(&mut answer).await.unwrap();
        assert_eq!(&answer, b"HTTP/1.1 407");
        assert_eq!(&server.await.unwrap(), b"CONNECT");
        let (hold, ready) = gate::gate();
        let err = start(opts(started.relay_addr, hold)).unwrap_err();
        assert!(
            err.to_string().contains(&started.relay_addr.to_string()),
            "{err}"
        );
        assert!(ready.is_open(), "a failed start holds nothing");
    }

    /// Runs `body` on a current-thread runtime in a thread with a fresh
    /// network namespace (lo up), so nothing of this machine's network is
    /// touched; a panic in it fails the test.
    fn in_fresh_netns<F, Fut>(body: F)
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()>,
    {
        let thread = std::thread::spawn(move || {
            // SAFETY: unshare of this thread's network namespace only.
            if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                panic!("unshare(CLONE_NEWNET): {}", std::io::Error::last_os_error());
            }
            crate::agent::init::loopback_up().expect("lo up");
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(body());
        });
        if let Err(panic) = thread.join() {
            std::panic::resume_unwind(panic);
        }
    }

    /// One A query for `name` to the stub at `dns`; the answer's address.
    async fn resolve(dns: SocketAddrV4, name: &str) -> Ipv4Addr {
        let mut q = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
        for label in name.split('.') {
            q.push(label.len() as u8);
            q.extend_from_slice(label.as_bytes());
        }
        q.extend_from_slice(&[0, 0, 1, 0, 1]);
        let udp = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        udp.send_to(&q, dns).await.unwrap();
        let mut buf = [0u8; 512];
        let (n, _) = tokio::time::timeout(Duration::from_secs(5), udp.recv_from(&mut buf))
            .await
            .expect("the stub answers")
            .unwrap();
        assert_eq!(u16::from_be_bytes([buf[6], buf[7]]), 1, "one answer");
        Ipv4Addr::new(buf[n - 4], buf[n - 3], buf[n - 2], buf[n - 1])
    }

    /// A stand-in for the host's proxy on a unix socket: SOCKS5 streams
    /// (user/pass checked against `password`) get their CONNECT target
    /// recorded and then an echo with a prefix; anything else (the relay's
    /// raw bytes) is echoed as is.
    async fn fake_host(
        listener: tokio::net::UnixListener,
        password: &'static [u8],
    ) -> tokio::sync::mpsc::UnboundedReceiver<Vec<u8>> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = listener.accept().await.unwrap();
                let tx = tx.clone();
                tokio::spawn(async move {
                    let first = s.read_u8().await.unwrap();
                    if first != 5 {
                        let mut rest = vec![first];
                        let mut b = [0u8; 64];
                        let n = s.read(&mut b).await.unwrap();
                        rest.extend_from_slice(&b[..n]);
                        s.write_all(&rest).await.unwrap();
                        return;
                    }
                    let mut m = [0u8; 2];
                    s.read_exact(&mut m).await.unwrap();
                    s.write_all(&[5, 2]).await.unwrap();
                    let _ver = s.read_u8().await.unwrap();
                    let ulen = s.read_u8().await.unwrap();
                    let mut user = vec![0u8; usize::from(ulen)];
                    s.read_exact(&mut user).await.unwrap();
                    let plen = s.read_u8().await.unwrap();
                    let mut pass = vec![0u8; usize::from(plen)];
                    s.read_exact(&mut pass).await.unwrap();
                    assert_eq!(pass, password);
                    s.write_all(&[1, 0]).await.unwrap();
                    let mut head = [0u8; 4];
                    s.read_exact(&mut head).await.unwrap();
                    let mut target = vec![head[3]];
                    let len = match head[3] {
                        1 => 4,
                        3 => {
                            let l = s.read_u8().await.unwrap();
                            target.push(l);
                            usize::from(l)
                        }
                        t => panic!("atyp {t}"),
                    };
                    let mut rest = vec![0u8; len + 2];
                    s.read_exact(&mut rest).await.unwrap();
                    target.extend_from_slice(&rest);
                    tx.send(target).unwrap();
                    s.write_all(&[5, 0, 0, 1, 0, 0, 0, 0, 0, 0]).await.unwrap();
                    let mut b = [0u8; 4];
                    s.read_exact(&mut b).await.unwrap();
                    s.write_all(b"via:").await.unwrap();
                    s.write_all(&b).await.unwrap();
                });
            }
        });
        rx
    }

    /// Both stages through `start` in a fresh network namespace: the relay,
    /// the DNS stub, the capture and attribution of a connection of this
    /// very process (its session registered as a spawn). The gate opens
    /// only once the capture (installed on its own thread) takes
    /// connections: the first connection after it is captured. A name from
    /// the stub goes to the host by name, an IP literal by address; once the
    /// spawn is gone the same connection is reset.
    #[test]
    fn both_stages_end_to_end_in_a_fresh_netns() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIPPED: a network namespace and the capture need root");
            return;
        }
        in_fresh_netns(|| async {
            let dir = tempfile::tempdir().unwrap();
            let sock = dir.path().join("egress.sock");
            let mut targets =
                fake_host(tokio::net::UnixListener::bind(&sock).unwrap(), b"tok").await;
            let spawns = Spawns::new();
            // SAFETY: getsid(0) has no preconditions.
            let sid = unsafe { libc::getsid(0) };
            let key = if sid > 1 {
                sid
            } else {
                std::process::id() as i32
            };
            let ticket = spawns
                .register(key, Some("http://sess:tok@127.0.0.1:3128"))
                .unwrap();
            let (hold, ready) = gate::gate();
            let started = start(Options {
                relay_addr: "127.0.0.1:0".parse().unwrap(),
                dns_addr: Some("127.0.0.1:0".parse().unwrap()),
                ..Options::production(Upstream::Unix(sock), spawns.clone(), hold)
            })
            .unwrap();
            assert_eq!(ready.wait().await, Passage::Open);
            // The install had finished when the gate opened.
            let mut pending = started.capture.expect("stage 2 on");
            let mode = pending.rx.try_recv().expect("the capture's outcome");
            assert!(mode.is_some(), "capture installed as root");
            let ping = |dst: SocketAddrV4| async move {
                let mut c = tokio::net::TcpStream::connect(dst).await.unwrap();
                c.write_all(b"ping").await.unwrap();
                let mut b = Vec::new();
                let r = tokio::time::timeout(Duration::from_secs(5), c.read_to_end(&mut b))
                    .await
                    .expect("answered or reset in time");
                r.map(|_| b)
            };
            // The first connection once the gate is open: captured, by address.
            let lit = Ipv4Addr::new(192, 0, 2, 1);
            assert_eq!(ping(SocketAddrV4::new(lit, 22)).await.unwrap(), b"via:ping");
            assert_eq!(targets.recv().await.unwrap(), vec![1, 192, 0, 2, 1, 0, 22]);
            // Stage 1: raw bytes through the relay.
            let mut c = tokio::net::TcpStream::connect(started.relay_addr)
                .await
                .unwrap();
            c.write_all(b"GET / HTTP/1.1").await.unwrap();
            let mut b = [0u8; 14];
            c.read_exact(&mut b).await.unwrap();
            assert_eq!(&b, b"GET / HTTP/1.1");
            // Stage 2 by name.
            let ip = resolve(started.dns.unwrap(), "allowed.test").await;
            assert!(fake::FakePool::contains(ip), "{ip}");
            assert_eq!(ping(SocketAddrV4::new(ip, 443)).await.unwrap(), b"via:ping");
            let mut want = vec![3, 12];
            want.extend_from_slice(b"allowed.test");
            want.extend_from_slice(&443u16.to_be_bytes());
            assert_eq!(targets.recv().await.unwrap(), want);
            // The spawn exited: its connections are no longer carried.
            spawns.unregister(ticket);
            let err = ping(SocketAddrV4::new(ip, 443)).await.unwrap_err();
            assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");
            assert!(targets.try_recv().is_err(), "nothing reached the host");
        });
    }
}
