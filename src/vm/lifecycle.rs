//! Starting and stopping a profile's machine: boot through the backend,
//! wait for the agent's hello (checking the userland it reports against
//! the backend's plan), wire the link, publish the startup steps, notice
//! the machine or the agent going away, and stop it (the agent ends its
//! processes, then the machine is killed).
//!
//! Limits: the agent must say hello within [`HELLO_TIMEOUT`]; `stopVM`
//! gives the agent [`super::SHUTDOWN_GRACE`] to end its processes and the
//! guest [`POWEROFF_DEADLINE`] to power off before the machine is killed.
//! The helper's own shutdown ([`ProfileVm::shut_down`]) gives both no more than
//! its deadline.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use guest_agent::proto::{CaTrust, Hello, Op};
use tokio::sync::{oneshot, watch};

use super::link::{hello_with_setup, AgentLink, HelloError};
use super::{ProfileVm, ProfileVmError, Running, CALL_TIMEOUT, SHUTDOWN_GRACE};
use crate::backend::guest::{AgentDialError, POWEROFF_DEADLINE};
use crate::backend::userland::UserlandError;
use crate::backend::{BackendMachine, BootError, HostPaths, MachineEnd, HELLO_TIMEOUT};
use crate::protocol::{event, step};
use vmm::sync::MutexExt;
use vmm::sync::RwLockExt;

/// Serial of the next machine booted (see `Running::serial`).
static NEXT_MACHINE: AtomicU64 = AtomicU64::new(1);

/// Why `startVM` could not bring the guest up; the client reads "the VM
/// failed to start: " followed by this ([`ProfileVmError::Start`]).
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The sandbox's sessions directory cannot be created.
    #[error("cannot create {}: {source}", path.display())]
    SessionsDir {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The backend could not boot the machine.
    #[error(transparent)]
    Boot(#[from] BootError),
    /// The guest agent never dialled the helper.
    #[error(transparent)]
    AgentDial(#[from] AgentDialError),
    /// The agent's first message was not an acceptable hello.
    #[error(transparent)]
    Hello(#[from] HelloError),
    /// The machine ended before the agent's hello.
    #[error("{0}")]
    MachineEnded(MachineEnd),
    /// The machine's task ended without saying how.
    #[error("the machine ended")]
    MachineGone,
    /// The guest did not boot the userland `--userland` forced.
    #[error(transparent)]
    Userland(#[from] UserlandError),
    /// The link's socketpair cannot be created (replaying an agent's bytes).
    #[error("socketpair: {0}")]
    Socketpair(#[source] std::io::Error),
}

impl ProfileVm {
    pub async fn start(
        self: &Arc<Self>,
        api_probe_url: Option<String>,
        boot: crate::backend::BootOptions,
    ) -> Result<(), ProfileVmError> {
        let mut lifecycle = self.lifecycle.lock().await;
        // Checked under the lock `shut_down` takes after setting it: a
        // start either finishes before the shutdown stops it, or refuses.
        if self.closing.load(Ordering::Acquire) {
            return Err(ProfileVmError::ShuttingDown);
        }
        if lifecycle.is_some() && self.is_guest_connected() {
            return Ok(());
        }
        if let Some(old) = lifecycle.take() {
            // A machine whose agent is gone: clear it before booting anew.
            self.teardown(old, Instant::now() + POWEROFF_DEADLINE).await;
        }
        let began = Instant::now();
        self.hub
            .publish(&event::startup_step(step::VM_BOOT, "started"))
            .await;
        if let Err(e) = self.prepare_storage_for_boot().await {
            self.hub
                .publish(&event::startup_step(step::VM_BOOT, "failed"))
                .await;
            return Err(e);
        }
        let booted = crate::backend::boot(&self.cfg, &boot)
            .await
            .map_err(|e| ProfileVmError::Start(e.into()));
        let crate::backend::Booted {
            machine: backend_machine,
            agent,
            host_paths,
            userland,
        } = match booted {
            Ok(b) => b,
            Err(e) => {
                self.hub
                    .publish(&event::startup_step(step::VM_BOOT, "failed"))
                    .await;
                tracing::error!(error = %e, "vm boot failed");
                return Err(e);
            }
        };
        self.hub
            .publish(&event::startup_step(step::VM_BOOT, "completed"))
            .await;
        self.hub
            .publish(&event::startup_step(step::GUEST_CONNECT, "started"))
            .await;

        let (kill_tx, kill_rx) = oneshot::channel();
        let (machine_gone_tx, mut machine_gone_rx) = oneshot::channel::<MachineEnd>();
        let done = tokio::spawn(run_machine(backend_machine, kill_rx, machine_gone_tx));
        let (probe_stop, probe_rx) = watch::channel(false);
        let serial = NEXT_MACHINE.fetch_add(1, Ordering::Relaxed);
        let machine = Running {
            serial,
            kill: Some(kill_tx),
            done,
            probe_stop,
            host_paths,
        };

        let ca_pem = self.cfg.egress.ca_pem();
        let hello = tokio::select! {
            h = tokio::time::timeout(HELLO_TIMEOUT, async move {
                let stream = agent.await.map_err(|e| ProfileVmError::Start(e.into()))?;
                hello_with_setup(stream, ca_pem)
                    .await
                    .map_err(|e| ProfileVmError::Start(e.into()))
            }) => match h {
                Ok(Ok(h)) => Ok(h),
                Ok(Err(e)) => Err(e),
                Err(_) => Err(ProfileVmError::HelloTimeout(HELLO_TIMEOUT)),
            },
            gone = &mut machine_gone_rx => Err(ProfileVmError::Start(
                gone.map_or(StartError::MachineGone, StartError::MachineEnded)
            )),
        };
        let hello = hello.and_then(|(hello, stream)| {
            check_userland(userland.as_ref(), &hello)?;
            self.check_guest_disk(&hello)?;
            Ok((hello, stream))
        });
        let (hello, stream) = match hello {
            Ok(h) => h,
            Err(e) => {
                self.hub
                    .publish(&event::startup_step(step::GUEST_CONNECT, "failed"))
                    .await;
                tracing::error!(error = %e, "guest agent did not connect");
                self.teardown(machine, Instant::now() + POWEROFF_DEADLINE)
                    .await;
                return Err(e);
            }
        };
        tracing::info!(
            backend = self.cfg.backend.as_str(),
            // The guest's words, quoted and escaped: a newline in them
            // cannot forge a log line.
            agent = ?hello.version,
            kernel = ?hello.kernel,
            boot_ms = began.elapsed().as_secs_f64() * 1e3,
            agent_start_us = hello.boot.agent_start_us,
            init_done_us = hello.boot.init_done_us,
            userland_switched_us = hello.boot.userland_switched_us,
            connected_us = hello.boot.connected_us,
            "guest agent connected"
        );
        let ca_trust = hello.ca_trust.clone();
        let link = self.attach(hello, stream);
        match ca_trust {
            // A VM's agent trusted the CA of its Setup before its final hello.
            Some(done) => log_ca_trust(&done),
            None => self.trust_egress_ca(&link).await,
        }
        self.running.store(true, Ordering::Release);
        self.hub
            .publish(&event::startup_step(step::GUEST_CONNECT, "completed"))
            .await;
        self.hub.publish(&event::network_status("connected")).await;
        tokio::spawn(crate::probe::monitor(
            api_probe_url,
            self.cfg.egress.clone(),
            self.hub.clone(),
            probe_rx,
        ));

        // Watch for the machine ending on its own.
        let me = Arc::downgrade(self);
        tokio::spawn(async move {
            if let Ok(end) = machine_gone_rx.await {
                if let Some(vm) = me.upgrade() {
                    vm.machine_gone(serial, &end).await;
                }
            }
        });
        *lifecycle = Some(machine);
        drop(lifecycle);

        // Re-apply a previously requested SDK install.
        let pending_sdk = self.sdk.locked().clone();
        if let Some((rel, version)) = pending_sdk {
            self.hub
                .publish(&event::startup_step(step::SDK_INSTALL, "started"))
                .await;
            let outcome = self.apply_sdk(&link, &rel, &version).await;
            if let Err(e) = &outcome {
                tracing::warn!(error = %e, "installing the SDK after boot failed");
            }
            self.publish_sdk_outcome(outcome.is_ok()).await;
        }
        Ok(())
    }

    /// Has the agent trust the egress proxy's CA, before any spawn: session
    /// programs then accept the API hosts' intercepted certificates. A
    /// failure is logged; sessions then cannot reach the API hosts.
    async fn trust_egress_ca(&self, link: &Arc<AgentLink>) {
        let Some(pem) = self.cfg.egress.ca_pem() else {
            return;
        };
        let op = Op::TrustCa {
            pem: pem.to_string(),
        };
        // The reply has the shape of the final hello's `caTrust`.
        let done = match link.call(op, &[], CALL_TIMEOUT).await {
            Ok((result, _)) => serde_json::from_value(result).unwrap_or_else(|e| CaTrust {
                error: Some(format!("the agent's answer does not read: {e}")),
                ..CaTrust::default()
            }),
            Err(e) => CaTrust {
                error: Some(e.to_string()),
                ..CaTrust::default()
            },
        };
        log_ca_trust(&done);
    }

    /// The agent's stream ended: every process it ran is gone.
    pub(super) async fn agent_gone(&self, link: &Arc<AgentLink>) {
        link.fail_pending();
        {
            let mut slot = self.link.write_locked();
            if !slot.as_ref().is_some_and(|l| Arc::ptr_eq(l, link)) {
                // Already accounted for (stop and the link reader both get here).
                return;
            }
            *slot = None;
        }
        self.running.store(false, Ordering::Release);
        let orphans: Vec<String> = {
            let procs = self.procs.locked();
            procs
                .map
                .iter()
                .filter(|(_, r)| r.running)
                .map(|(id, _)| id.clone())
                .collect()
        };
        // Why, when the agent broke the link protocol.
        let why = link.violation().map_or_else(
            || "the VM stopped unexpectedly; the process was killed with it".to_string(),
            |v| format!("{v}; the process was killed with the VM"),
        );
        for id in orphans {
            // The agent could not report these processes' ends: they died
            // with the machine. Say so, then close them with an exit.
            self.flush_output(&id).await;
            self.procs.locked().mark_exited(&id, None);
            self.hub.publish(&event::error(&id, &why, true)).await;
            self.hub
                .publish(&event::exit(&id, None, Some("SIGKILL"), None))
                .await;
        }
        self.hub
            .publish(&event::network_status("disconnected"))
            .await;
        tracing::info!("guest agent disconnected");
    }

    /// Machine `serial` ended on its own. A `startVM` that tore it down and
    /// booted another before this ran keeps its new machine.
    async fn machine_gone(self: &Arc<Self>, serial: u64, end: &MachineEnd) {
        let mut lifecycle = self.lifecycle.lock().await;
        if lifecycle.as_ref().is_some_and(|m| m.serial != serial) {
            tracing::debug!(reason = %end, "an earlier machine's end, already handled");
            return;
        }
        if let Some(m) = lifecycle.take() {
            tracing::warn!(reason = %end, "the VM ended unexpectedly");
            // The agent died with its machine even if no backend closed
            // the link yet: its processes end now (fatal error and exit),
            // not when (or if) the stream reports it.
            self.teardown(m, Instant::now() + POWEROFF_DEADLINE).await;
        }
    }

    /// Ends machine `m` (the guest may power off until `poweroff_by`, then
    /// it is killed) and accounts for everything that ran in it.
    async fn teardown(&self, mut m: Running, poweroff_by: Instant) {
        let _ = m.probe_stop.send(true);
        if let Some(kill) = m.kill.take() {
            let _ = kill.send(poweroff_by);
        }
        let _ = (&mut m.done).await;
        if let Some(link) = self.link() {
            // What the agent wrote before the end reaches its callers and
            // the event stream first (an answer sent just before the agent
            // died is an answer, not "disconnected"); then everything that
            // ran is accounted for.
            link.drain().await;
            self.agent_gone(&link).await;
        }
        // No credential outlives its machine (agent_gone revoked those of
        // the processes it closed; this catches any record it did not see).
        let revoked = self.procs.locked().revoke_all();
        if revoked > 0 {
            tracing::debug!(revoked, "egress credentials revoked with the machine");
        }
        self.running.store(false, Ordering::Release);
    }

    /// Stops the VM (`stopVM`, the idle policy): processes end (exit
    /// events delivered), then the machine.
    pub async fn stop(&self) -> Result<(), ProfileVmError> {
        let mut lifecycle = self.lifecycle.lock().await;
        let deadline = Instant::now() + SHUTDOWN_GRACE + POWEROFF_DEADLINE;
        self.stop_locked(&mut lifecycle, deadline).await;
        Ok(())
    }

    /// Stops the VM for the helper's exit, by `deadline`: no machine starts
    /// from now on, a start in progress is waited for (until `deadline`,
    /// else [`ProfileVmError::StillStarting`]), and the running machine stops as
    /// in [`ProfileVm::stop`], killed at `deadline` if it has not powered off.
    pub async fn shut_down(&self, deadline: Instant) -> Result<(), ProfileVmError> {
        self.closing.store(true, Ordering::Release);
        let mut lifecycle = tokio::time::timeout_at(deadline.into(), self.lifecycle.lock())
            .await
            .map_err(|_| ProfileVmError::StillStarting)?;
        self.stop_locked(&mut lifecycle, deadline).await;
        Ok(())
    }

    /// Stops the machine in `lifecycle`, if any: the agent gets up to
    /// [`SHUTDOWN_GRACE`] to end its processes and the guest up to
    /// [`POWEROFF_DEADLINE`] to power off, neither past `deadline`; then
    /// the machine is killed.
    async fn stop_locked(&self, lifecycle: &mut Option<Running>, deadline: Instant) {
        let Some(machine) = lifecycle.take() else {
            return;
        };
        let left = || deadline.saturating_duration_since(Instant::now());
        if let Some(link) = self.link() {
            let grace = SHUTDOWN_GRACE.min(left());
            if let Err(e) = link.call(Op::Shutdown, &[], grace).await {
                tracing::warn!(error = %e, "agent shutdown did not complete; killing the VM");
            }
        }
        let poweroff_by = deadline.min(Instant::now() + POWEROFF_DEADLINE);
        self.teardown(machine, poweroff_by).await;
        tracing::info!("vm stopped");
    }

    pub(super) async fn current_host_paths(&self) -> Result<HostPaths, ProfileVmError> {
        let lifecycle = self.lifecycle.lock().await;
        lifecycle
            .as_ref()
            .map(|m| m.host_paths.clone())
            .ok_or(ProfileVmError::NotRunning)
    }
}

/// Logs the userland the agent reports against the backend's plan: why
/// candidates were skipped on the host, which one the guest took and why it
/// rejected others. A forced `--userland` the guest did not honour fails the
/// start.
fn check_userland(
    plan: Option<&crate::backend::userland::UserlandPlan>,
    hello: &Hello,
) -> Result<(), ProfileVmError> {
    let Some(plan) = plan else {
        return Ok(());
    };
    for why in &plan.skipped {
        tracing::warn!(reason = %why, "userland candidate skipped on the host");
    }
    let (kind, fallbacks, os) = match &hello.userland {
        Some(u) => (
            Some(u.kind.as_str()),
            u.fallbacks.as_slice(),
            u.pretty_name.as_deref(),
        ),
        None => (None, &[][..], None),
    };
    let report = crate::backend::userland::check_hello(plan, kind, fallbacks)
        .map_err(|e| ProfileVmError::Start(e.into()))?;
    tracing::info!(os = os.unwrap_or("-"), "{report}");
    Ok(())
}

/// Owns the machine until it ends or is killed; reports how it ended.
/// `kill` brings the instant until which the guest may power off by
/// itself (a dropped sender: [`POWEROFF_DEADLINE`] from then).
async fn run_machine(
    mut machine: BackendMachine,
    kill: oneshot::Receiver<Instant>,
    gone: oneshot::Sender<MachineEnd>,
) {
    tokio::select! {
        how = machine.wait() => {
            let _ = gone.send(how);
        }
        by = kill => {
            let poweroff_by = by.unwrap_or_else(|_| Instant::now() + POWEROFF_DEADLINE);
            machine.kill_by(poweroff_by).await;
        }
    }
}

/// One line for how the guest came to trust the egress CA (or why not).
/// The error is the guest's words: quoted and escaped, a newline in them
/// cannot forge a log line.
fn log_ca_trust(done: &CaTrust) {
    match &done.error {
        None => tracing::info!(
            bundle = done.bundle,
            bound = done.bound,
            anchor = done.anchor,
            "the guest trusts the egress CA"
        ),
        Some(e) => tracing::error!(
            error = ?e,
            "the guest could not trust the egress CA: sessions cannot reach the API hosts"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{BackendKind, VmConfig};

    /// A sandbox-backend VM of a profile under `dir` (nothing started).
    fn test_vm(dir: &std::path::Path) -> Arc<ProfileVm> {
        ProfileVm::new(VmConfig {
            backend: BackendKind::Sandbox,
            profile_dir: dir.join("profile"),
            helper_exe: "/nonexistent/cowork-helper".into(),
            egress: crate::egress::EgressProxy::direct(),
            max_processes: crate::vm::MAX_PROCESSES,
            max_pending_requests: crate::vm::MAX_PENDING_REQUESTS,
        })
    }

    /// A machine's end saying `why`.
    fn ended(why: &str) -> MachineEnd {
        MachineEnd::Sandbox(crate::backend::sandbox::SandboxExit::Unknown(why.into()))
    }

    /// Machine `serial` whose backend task has ended (its kill and probe
    /// channels lead nowhere).
    fn ended_machine(serial: u64) -> Running {
        let (kill, _) = oneshot::channel();
        let (probe_stop, _) = watch::channel(false);
        Running {
            serial,
            kill: Some(kill),
            done: tokio::spawn(async {}),
            probe_stop,
            host_paths: HostPaths::Prefix("/".into()),
        }
    }

    /// A failed start reads as one sentence for the client, and the log
    /// can still walk from it to the cause.
    #[test]
    fn a_start_error_keeps_its_text_and_its_cause() {
        use std::error::Error as _;

        use crate::backend::qemu::QemuError;

        let cause = std::io::Error::from_raw_os_error(libc::EACCES);
        let cause_text = cause.to_string();
        let e = ProfileVmError::from(StartError::from(BootError::from(QemuError::RunDir {
            path: "/run/user/1000/cowork-qemu-1-0".into(),
            source: cause,
        })));
        assert_eq!(
            e.to_string(),
            format!(
                "the VM failed to start: cannot create the VM's runtime directory \
                 /run/user/1000/cowork-qemu-1-0: {cause_text}"
            )
        );
        let mut chain = Vec::new();
        let mut next = e.source();
        while let Some(cause) = next {
            chain.push(cause.to_string());
            next = cause.source();
        }
        assert_eq!(chain.last(), Some(&cause_text), "{chain:?}");
        assert!(matches!(
            e,
            ProfileVmError::Start(StartError::Boot(BootError::Qemu(QemuError::RunDir { .. })))
        ));

        // A machine that ended before the hello says how.
        let e = ProfileVmError::from(StartError::MachineEnded(ended("the agent exited")));
        assert_eq!(
            e.to_string(),
            "the VM failed to start: the sandbox ended in an unknown way: the agent exited"
        );
    }

    #[tokio::test]
    async fn a_stale_machine_end_leaves_the_current_machine_alone() {
        let tmp = tempfile::tempdir().unwrap();
        let vm = test_vm(tmp.path());
        // A startVM tore machine 6 down and booted machine 7; machine 6's
        // watcher only then reports its end.
        *vm.lifecycle.lock().await = Some(ended_machine(7));
        vm.machine_gone(6, &ended("machine 6 ended")).await;
        assert!(
            vm.lifecycle
                .lock()
                .await
                .as_ref()
                .is_some_and(|m| m.serial == 7),
            "machine 7 was taken for machine 6's end"
        );
        vm.machine_gone(7, &ended("machine 7 ended")).await;
        assert!(vm.lifecycle.lock().await.is_none());
    }

    /// The helper's shutdown with an agent that answers nothing and a
    /// deadline shorter than the agent's usual grace: the shutdown request
    /// gets only what is left, the machine is told to be gone by the
    /// deadline, and no machine starts afterwards.
    #[tokio::test]
    async fn a_shutdown_keeps_to_its_deadline_and_refuses_later_starts() {
        use std::time::Duration;

        let tmp = tempfile::tempdir().unwrap();
        let vm = test_vm(tmp.path());
        // The agent's end stays open and silent.
        let (host, _agent) = std::os::unix::net::UnixStream::pair().unwrap();
        host.set_nonblocking(true).unwrap();
        let host = tokio::net::UnixStream::from_std(host).unwrap();
        vm.attach(guest_agent::proto::Hello::default(), host);
        vm.running.store(true, Ordering::Release);
        let (kill, killed) = oneshot::channel::<Instant>();
        let (told, poweroff_by) = oneshot::channel();
        let (probe_stop, _) = watch::channel(false);
        *vm.lifecycle.lock().await = Some(Running {
            serial: 1,
            kill: Some(kill),
            done: tokio::spawn(async move {
                if let Ok(by) = killed.await {
                    let _ = told.send(by);
                }
            }),
            probe_stop,
            host_paths: HostPaths::Prefix("/".into()),
        });

        let t0 = Instant::now();
        let deadline = t0 + Duration::from_millis(300);
        vm.shut_down(deadline).await.expect("shut down");
        let took = t0.elapsed();
        assert!(
            took < SHUTDOWN_GRACE,
            "the shutdown waited the agent's whole grace: {took:?}"
        );
        let by = poweroff_by.await.expect("the machine was ended");
        assert!(by <= deadline, "the machine may outlive the deadline");
        assert!(!vm.is_running() && vm.lifecycle.lock().await.is_none());
        assert!(matches!(
            vm.start(None, Default::default()).await,
            Err(ProfileVmError::ShuttingDown)
        ));
    }

    /// The agent answers a request and its machine ends at once, before
    /// the link reader ran: the answer still reaches its caller. The
    /// backend keeps its end of the link open (as a VMM's vsock device may
    /// until it is dropped), so only the drain's shutdown ends the stream.
    /// Single-threaded runtime: nothing runs between the answer's write and
    /// the machine's end unless the teardown yields to the reader.
    #[tokio::test]
    async fn an_answer_written_just_before_the_machine_ends_is_delivered() {
        use std::io::Write;
        use std::time::Duration;

        use guest_agent::proto;

        let tmp = tempfile::tempdir().unwrap();
        let vm = test_vm(tmp.path());
        let (host, mut agent) = std::os::unix::net::UnixStream::pair().unwrap();
        host.set_nonblocking(true).unwrap();
        let host = tokio::net::UnixStream::from_std(host).unwrap();
        let link = vm.attach(proto::Hello::default(), host);
        vm.running.store(true, Ordering::Release);
        *vm.lifecycle.lock().await = Some(ended_machine(1));
        let call = link
            .send(Op::Ping, &[])
            .await
            .expect("the request is queued");
        // The machine's task has finished; the reader waits for data.
        tokio::task::yield_now().await;

        // The first request of a link has id 1.
        let mut frame = Vec::new();
        proto::encode_frame_into(
            &mut frame,
            &proto::AgentMessage::Response {
                id: 1,
                error: None,
                result: serde_json::json!({"pong": true}),
            },
            &[],
        );
        agent.write_all(&frame).unwrap();
        vm.machine_gone(1, &ended("the agent died")).await;

        let (answer, _) = call
            .wait(&link, Duration::from_secs(1))
            .await
            .expect("the answer written before the end");
        assert_eq!(answer, serde_json::json!({"pong": true}));
        assert!(vm.link().is_none(), "the link is gone with its machine");
        // A later request fails at once.
        assert!(matches!(
            link.call(Op::Ping, &[], Duration::from_secs(1)).await,
            Err(ProfileVmError::AgentGone)
        ));
        drop(agent);
    }
}
