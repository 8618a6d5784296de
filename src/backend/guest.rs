//! What the VM backends (QEMU and in-process KVM) share about the guest
//! they boot: its vsock identity, the host's ability to run it under KVM,
//! the kernel command-line words that shorten its boot
//! ([`BOOT_TIME_CMDLINE`]) and the agent's log level passed there, how long a
//! power-off may take, and the wait for the guest agent to dial the helper
//! over vsock, and the acceptor that hands the guest's connections to the
//! host egress proxy ([`EgressAcceptor`]). The console both keep is in
//! [`super::console`], the guest's size in [`super::sizing`].
//!
//! Egress: the guest has no NIC; its relay dials CID 2 port
//! [`EGRESS_PORT`] once per relayed connection. A dedicated thread
//! ([`EGRESS_THREAD_NAME`]) blocks on that port's [`Listener`] (no polling
//! delay) and hands each stream to the tokio runtime that booted the machine,
//! where [`EgressProxy::serve_stream`] applies the spawn's credential and
//! policy. Every other host port stays unlistened, so the device answers a
//! guest connection to it with RST (`devices::vsock::muxer`).
//!
//! Limits: the agent must dial within [`AGENT_DIAL_TIMEOUT`]; the guest
//! must power off within [`POWEROFF_DEADLINE`] of being told to. A relayed
//! connection whose upstream stays idle outlives the machine until the
//! upstream closes (the proxy's relay ends on the next byte it cannot
//! deliver); its credential is revoked with its process all the same.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use devices::vsock::{HostError, Listener, VsockHost};
use guest_agent::proto::{AGENT_PORT, EGRESS_PORT};
use tokio::runtime::Handle;

use crate::egress::EgressProxy;

use super::console::{Console, ConsoleQuote, QUOTED_LINES};
use super::{AgentStream, HELLO_TIMEOUT};

/// The guest's CID (each VM has its own device, so all can use the same).
pub const GUEST_CID: u64 = 3;
/// The words of [`BOOT_TIME_CMDLINE`] as a literal, for `concat!` in each
/// backend's `KERNEL_CMDLINE`.
macro_rules! boot_time_cmdline {
    () => {
        "8250.nr_uarts=1 i8042.noaux cryptomgr.notests \
         initcall_blacklist=crypto_kdf108_init,init_encrypted,trace_eval_init,tracer_init_tracefs \
         apparmor=0"
    };
}
pub(crate) use boot_time_cmdline;

/// Kernel command-line words both VM backends boot with, each for boot
/// time: `8250.nr_uarts=1` registers COM1 only (no probing of COM2-4,
/// which the VMs do not have), `i8042.noaux` skips probing a PS/2 mouse
/// port, and `cryptomgr.notests` skips the crypto self-tests the kernel
/// otherwise runs for every algorithm it registers (the implementations
/// are the distribution's, tested there). Linux 6.1's SP800-108 KDF runs
/// its own self-test in its initcall regardless of that flag, and it is the
/// slowest initcall of a TCG boot (0.32-0.36 s of the kernel's 2.5 s to
/// `/init`): `initcall_blacklist=crypto_kdf108_init` skips that initcall,
/// which does nothing else (the KDF stays usable; later kernels skip the
/// test under `cryptomgr.notests` themselves). The same list skips
/// `init_encrypted`, the "encrypted" key type's registration (nothing in
/// the guest uses that key type; its set-up instantiates a cipher, 60-70 ms
/// of a TCG boot), and `apparmor=0` leaves AppArmor off: the guest loads
/// no AppArmor policy (the agent is init; no systemd, no
/// `apparmor_parser`), so its set-up (the LSM, its netfilter hooks, its
/// policy hash) guarded nothing. Both: QEMU TCG to `/init`, 6 alternating
/// boots, median 2.04 → 1.74 s. Last, `trace_eval_init` and
/// `tracer_init_tracefs` leave out the tracing subsystem's tracefs tree:
/// between them they queue work that creates a directory of files for
/// each of the kernel's 1,390 trace events and rewrites every event's
/// format string with the enum values it prints, and the boot thread waits
/// for that work at the next initcall that takes the trace event lock
/// (`init_kprobe_trace` or `init_blk_tracer`: 0.24-0.59 s of a nested boot
/// under our VMM, `initcall_debug`). Trace events stay registered (BPF and
/// perf can attach by id); only `/sys/kernel/tracing/events` and the
/// ftrace control files are missing, which nothing in the guest uses and
/// only root could. Nested, our VMM, kernel to `/init`, 8 alternating
/// boots: median 2.13 → 1.78 s.
pub const BOOT_TIME_CMDLINE: &str = boot_time_cmdline!();

/// Environment variable of `--guest-log` (read by [`crate::cli`]), whose
/// value becomes the guest agent's `COWORK_LOG`.
pub const GUEST_LOG_ENV: &str = "COWORK_GUEST_LOG";
/// Longest `COWORK_LOG=` value passed on the kernel command line.
const MAX_GUEST_LOG: usize = 200;
/// How long the agent has to dial in; a little less than the controller's
/// hello timeout so the error quoting the console wins the race.
pub const AGENT_DIAL_TIMEOUT: Duration = HELLO_TIMEOUT.saturating_sub(Duration::from_secs(5));
/// How long the guest gets to power off after the agent was told to shut down.
pub const POWEROFF_DEADLINE: Duration = Duration::from_secs(10);
/// How often the agent listener (and a finishing vhost-user thread) is polled.
pub(crate) const ACCEPT_POLL: Duration = Duration::from_millis(20);

/// Name of the thread that accepts the guest's egress connections (at
/// most 15 bytes, so `/proc/<pid>/task/*/comm` shows it whole).
pub const EGRESS_THREAD_NAME: &str = "egress-accept";

/// Longest thread name the kernel keeps (`TASK_COMM_LEN` minus the NUL).
const THREAD_COMM_MAX: usize = 15;
const _: () = assert!(EGRESS_THREAD_NAME.len() <= THREAD_COMM_MAX);

/// Why the egress port could not be served.
#[derive(Debug, thiserror::Error)]
pub enum EgressServeError {
    #[error("cannot listen on the egress vsock port {EGRESS_PORT}: {0}")]
    Listen(#[from] HostError),
    #[error("cannot start the egress accept thread: {0}")]
    Thread(std::io::Error),
    #[error("the egress acceptor must be started from inside the daemon's tokio runtime")]
    NoRuntime,
}

/// Serves the guest's connections to (CID 2, [`EGRESS_PORT`]) with the
/// host egress proxy, for as long as it lives (see the module docs).
/// [`EgressAcceptor::stop`] (or dropping it) frees the port and joins the
/// thread; streams already handed over are served to their end.
pub struct EgressAcceptor {
    host: VsockHost,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for EgressAcceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EgressAcceptor")
            .field("running", &self.thread.is_some())
            .finish()
    }
}

impl EgressAcceptor {
    /// Listens on [`EGRESS_PORT`] of `host` and starts the accept thread,
    /// which serves each stream with `egress` on the current runtime.
    pub fn start(host: &VsockHost, egress: EgressProxy) -> Result<Self, EgressServeError> {
        let runtime = Handle::try_current().map_err(|_| EgressServeError::NoRuntime)?;
        let listener = host.listen(EGRESS_PORT)?;
        let thread = std::thread::Builder::new()
            .name(EGRESS_THREAD_NAME.into())
            .spawn(move || {
                let accepted = accept_streams(|| listener.accept(), &egress, &runtime);
                tracing::debug!(accepted, "egress vsock listener closed");
            });
        match thread {
            Ok(t) => Ok(EgressAcceptor {
                host: host.clone(),
                thread: Some(t),
            }),
            Err(e) => {
                // The closure (and the listener in it) is gone: free the port.
                host.unmap(EGRESS_PORT);
                Err(EgressServeError::Thread(e))
            }
        }
    }

    /// Stops accepting: removes the port's registration (which disconnects
    /// the listener's channel, ending the blocking accept at once) and joins
    /// the thread. Later guest connections to the port get RST. Idempotent.
    pub fn stop(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        self.host.unmap(EGRESS_PORT);
        if thread.join().is_err() {
            tracing::warn!("the egress accept thread panicked");
        }
    }
}

impl Drop for EgressAcceptor {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The accept loop: takes streams from `accept` until it fails (the port
/// was freed or the device is gone) and serves each on `runtime` with
/// `egress`. Returns how many streams it handed over.
fn accept_streams<E: std::fmt::Display>(
    mut accept: impl FnMut() -> Result<std::os::unix::net::UnixStream, E>,
    egress: &EgressProxy,
    runtime: &Handle,
) -> u64 {
    // `from_std` registers the stream with this runtime's reactor.
    let _entered = runtime.enter();
    let mut accepted = 0u64;
    loop {
        let stream = match accept() {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(error = %e, "egress accept ended");
                return accepted;
            }
        };
        let stream = match stream
            .set_nonblocking(true)
            .and_then(|()| tokio::net::UnixStream::from_std(stream))
        {
            Ok(s) => s,
            Err(e) => {
                // The guest sees the stream close; the next one may work.
                tracing::warn!(error = %e, "cannot use a guest egress stream");
                continue;
            }
        };
        accepted += 1;
        let egress = egress.clone();
        runtime.spawn(async move {
            if let Err(e) = egress.serve_stream(stream).await {
                tracing::debug!(error = %e, "guest egress connection ended with an error");
            }
        });
    }
}

/// Why this host's `/dev/kvm` cannot boot the VM backends' Linux guest.
#[derive(Debug, thiserror::Error)]
pub enum KvmUnavailable {
    /// `/dev/kvm` is missing or lacks what any guest needs.
    #[error(transparent)]
    Unusable(#[from] vmm::kvm_check::KvmCheckError),
    /// `/dev/kvm` runs small guests but not Linux (PVM, no VT-x/AMD-V).
    #[error(transparent)]
    NotForLinux(#[from] vmm::kvm_check::KvmUnsuitable),
}

/// Whether `/dev/kvm` is usable and can boot Linux (why not otherwise).
pub fn kvm_for_linux() -> Result<(), KvmUnavailable> {
    vmm::kvm_check::check_capabilities()?;
    Ok(vmm::kvm_check::linux_capable()?)
}

/// Why the agent link of a VM backend could not be had: the guest agent
/// never dialled the helper, or its stream was unusable. Each message
/// quotes the guest console's last lines, which usually say why the guest
/// did not get as far as the agent.
#[derive(Debug, thiserror::Error)]
pub enum AgentDialError {
    /// The agent dialled, but its stream cannot be used on the runtime.
    #[error("cannot use the agent's vsock stream: {0}")]
    Stream(#[source] std::io::Error),
    /// The vsock device went away (the machine ended) before the agent dialled.
    #[error("the vsock device stopped before the guest agent dialled in: {source}{console}")]
    DeviceGone {
        source: HostError,
        console: ConsoleQuote,
    },
    /// The machine's vsock (and other hot-plugged) devices could not be
    /// added (the qemu backend's snapshot layout).
    #[error("cannot add the guest's vsock, virtio-fs and entropy devices: {source}{console}")]
    Hotplug {
        source: Box<dyn std::error::Error + Send + Sync>,
        console: ConsoleQuote,
    },
    /// The agent did not dial within [`AGENT_DIAL_TIMEOUT`].
    #[error("the guest agent did not dial vsock port {AGENT_PORT} within {}s{console}", .waited.as_secs())]
    Timeout {
        waited: Duration,
        console: ConsoleQuote,
    },
}

/// The kernel command-line word passing the guest's log filter
/// (`--guest-log`, [`GUEST_LOG_ENV`]) to the agent, when it is set and is
/// one word of safe characters.
pub fn guest_log_word(value: Option<&str>) -> Option<String> {
    let v = value?.trim();
    let safe = !v.is_empty()
        && v.len() <= MAX_GUEST_LOG
        && v.chars()
            .all(|c| c.is_ascii_alphanumeric() || "_=,:.-".contains(c));
    safe.then(|| format!("COWORK_LOG={v}"))
}

/// The helper's environment variable for the guest-root test hook (read by
/// [`crate::cli`] only, no flag): its value, a session name, reaches the VM
/// agent as [`guest_agent::proto::ROOT_SESSION_ENV`] on the kernel command
/// line, and that session's processes then run as guest root. Tests only;
/// the client cannot set it.
pub const GUEST_ROOT_SESSION_ENV: &str = "COWORK_GUEST_ROOT_SESSION";

/// The kernel command-line word of the guest-root test hook, when `value`
/// is a valid session name of letters, digits, `_`, `-` and `.` (a warning names it: it weakens the guest's
/// own separation of sessions, never what the host enforces).
pub fn root_session_word(value: Option<&str>) -> Option<String> {
    let v = value?.trim();
    if v.is_empty() {
        return None;
    }
    let one_word = v
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c));
    if !one_word || guest_agent::names::session_name(v).is_err() {
        tracing::warn!("{GUEST_ROOT_SESSION_ENV} is not a one-word session name; ignored");
        return None;
    }
    tracing::warn!(
        session = v,
        "test hook {GUEST_ROOT_SESSION_ENV}: this session runs as guest root"
    );
    Some(format!("{}={v}", guest_agent::proto::ROOT_SESSION_ENV))
}

/// Extra kernel command-line words from the helper's settings
/// ([`BootOptions`](super::BootOptions)): the guest's log filter
/// (`guest_log`, `--guest-log`) and the guest-root test hook
/// (`guest_root_session`, [`GUEST_ROOT_SESSION_ENV`]).
pub fn cmdline_words(guest_log: Option<&str>, guest_root_session: Option<&str>) -> Vec<String> {
    guest_log_word(guest_log)
        .into_iter()
        .chain(root_session_word(guest_root_session))
        .collect()
}

/// The future of the agent's connection to CID 2 port [`AGENT_PORT`].
pub(crate) fn agent_stream(
    mut listener: Listener,
    console: Console,
    connected: Arc<AtomicBool>,
) -> AgentStream {
    Box::pin(async move {
        let deadline = tokio::time::Instant::now() + AGENT_DIAL_TIMEOUT;
        accept_agent(&mut listener, &console, &connected, deadline).await
    })
}

/// Waits until the agent dials `listener` (polling every
/// [`ACCEPT_POLL`]) and returns its connection, or fails at `deadline` or
/// when the device's host side is gone; sets `connected` on the first
/// connection.
pub(crate) async fn accept_agent(
    listener: &mut Listener,
    console: &Console,
    connected: &AtomicBool,
    deadline: tokio::time::Instant,
) -> Result<tokio::net::UnixStream, AgentDialError> {
    let began = Instant::now();
    loop {
        match listener.try_accept() {
            Ok(Some(stream)) => {
                connected.store(true, Ordering::Release);
                tracing::info!(
                    ms = began.elapsed().as_millis() as u64,
                    "guest agent dialled vsock port {AGENT_PORT}"
                );
                stream
                    .set_nonblocking(true)
                    .map_err(AgentDialError::Stream)?;
                return tokio::net::UnixStream::from_std(stream).map_err(AgentDialError::Stream);
            }
            Ok(None) => {}
            Err(source) => {
                return Err(AgentDialError::DeviceGone {
                    source,
                    console: console.quote(QUOTED_LINES),
                })
            }
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(AgentDialError::Timeout {
                waited: AGENT_DIAL_TIMEOUT,
                console: console.quote(QUOTED_LINES),
            });
        }
        tokio::time::sleep(ACCEPT_POLL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_words() {
        assert_eq!(
            guest_log_word(Some("info,guest_agent=debug")).as_deref(),
            Some("COWORK_LOG=info,guest_agent=debug")
        );
        for bad in [None, Some(""), Some("debug quiet"), Some("a;rm -rf /")] {
            assert_eq!(guest_log_word(bad), None, "{bad:?}");
        }
        assert!(guest_log_word(Some(&"a".repeat(MAX_GUEST_LOG + 1))).is_none());
    }

    #[test]
    fn root_session_word_takes_only_session_names() {
        assert_eq!(
            root_session_word(Some("rootly")).as_deref(),
            Some("COWORK_ROOT_SESSION=rootly")
        );
        for bad in [
            None,
            Some(""),
            Some("a b"),
            Some("x=y init=/bin/sh"),
            Some("../etc"),
        ] {
            assert_eq!(root_session_word(bad), None, "{bad:?}");
        }
        assert!(AGENT_DIAL_TIMEOUT < HELLO_TIMEOUT);
    }

    /// A proxy whose guard lets loopback through (tests only).
    fn test_proxy() -> EgressProxy {
        use crate::egress::{AddressGuard, EgressDialer, NoProxy, ProxyConfig};
        let guard = AddressGuard::allowing_networks_for_tests(&[(
            std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
            8,
        )]);
        EgressProxy::new(
            EgressDialer::new(guard, None, NoProxy::default()),
            ProxyConfig::default(),
        )
    }

    /// Reads an HTTP response head from a blocking stream.
    fn read_head(s: &mut std::os::unix::net::UnixStream) -> String {
        use std::io::Read;
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            match s.read(&mut byte) {
                Ok(1) => head.push(byte[0]),
                _ => break,
            }
        }
        String::from_utf8_lossy(&head).into_owned()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn accepted_streams_are_served_by_the_proxy_until_accept_fails() {
        use std::io::{Read, Write};
        use std::os::unix::net::UnixStream;
        let proxy = test_proxy();
        // A destination on loopback, reachable through the test guard.
        let target = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let target_port = target.local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            let (mut s, _) = target.accept().unwrap();
            s.write_all(b"hello from upstream").unwrap();
        });
        let cred = proxy
            .issue("s1", crate::egress::Policy::Unrestricted)
            .unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<UnixStream>();
        let runtime = Handle::current();
        let loop_proxy = proxy.clone();
        let thread =
            std::thread::spawn(move || accept_streams(|| rx.recv(), &loop_proxy, &runtime));

        // Without a credential: 407.
        let (mut guest, host_end) = UnixStream::pair().unwrap();
        tx.send(host_end).unwrap();
        guest
            .write_all(b"CONNECT 127.0.0.1:9 HTTP/1.1\r\nHost: 127.0.0.1:9\r\n\r\n")
            .unwrap();
        let head = read_head(&mut guest);
        assert!(head.starts_with("HTTP/1.1 407"), "{head}");

        // With the spawn's credential: a tunnel to the destination.
        let (mut guest, host_end) = UnixStream::pair().unwrap();
        tx.send(host_end).unwrap();
        use base64::Engine as _;
        let auth =
            base64::engine::general_purpose::STANDARD.encode(format!("s1:{}", cred.expose()));
        guest
            .write_all(
                format!(
                    "CONNECT 127.0.0.1:{target_port} HTTP/1.1\r\nHost: 127.0.0.1:{target_port}\r\nProxy-Authorization: Basic {auth}\r\n\r\n"
                )
                .as_bytes(),
            )
            .unwrap();
        let head = read_head(&mut guest);
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        let mut body = Vec::new();
        guest.read_to_end(&mut body).unwrap();
        assert_eq!(body, b"hello from upstream");
        server.join().unwrap();

        // The source failing (the port freed, the device gone) ends the loop.
        drop(tx);
        let accepted = tokio::task::spawn_blocking(move || thread.join().unwrap())
            .await
            .unwrap();
        assert_eq!(accepted, 2);
    }

    #[tokio::test]
    async fn stopping_the_acceptor_frees_the_port_and_ends_the_thread() {
        let host = VsockHost::new().unwrap();
        let _agent = host.listen(AGENT_PORT).unwrap();
        let mut acceptor = EgressAcceptor::start(&host, test_proxy()).unwrap();
        // The port is taken while the acceptor runs.
        assert!(matches!(
            host.listen(EGRESS_PORT),
            Err(HostError::PortInUse(EGRESS_PORT))
        ));
        acceptor.stop();
        assert!(acceptor.thread.is_none());
        // Idempotent.
        acceptor.stop();
        // The listener was dropped with its thread: the port is free again,
        // and the agent's port was not touched.
        drop(host.listen(EGRESS_PORT).unwrap());
        assert!(matches!(
            host.listen(AGENT_PORT),
            Err(HostError::PortInUse(AGENT_PORT))
        ));
        // Many start/stop cycles leave no thread or registration behind.
        for _ in 0..50 {
            let a = EgressAcceptor::start(&host, test_proxy()).unwrap();
            drop(a);
        }
        drop(host.listen(EGRESS_PORT).unwrap());
    }

    #[test]
    fn the_acceptor_needs_a_runtime() {
        let host = VsockHost::new().unwrap();
        assert!(matches!(
            EgressAcceptor::start(&host, test_proxy()),
            Err(EgressServeError::NoRuntime)
        ));
        // Nothing was registered.
        drop(host.listen(EGRESS_PORT).unwrap());
    }
}
