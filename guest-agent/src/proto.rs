//! The host<->agent protocol.
//!
//! The agent dials the host (a Unix socket or an inherited socket in the
//! sandbox backend, AF_VSOCK to [`HOST_CID`]:[`AGENT_PORT`] in a VM) and sends
//! [`AgentMessage::Hello`]. From then on both sides exchange messages inside
//! the frames of [`crate::framing`]:
//!
//! ```text
//! frame body = u32 BE header length | header (JSON) | payload (raw bytes)
//! ```
//!
//! The JSON header says what the message is; the payload carries bulk bytes
//! (process output, stdin, file contents) so they never pay base64 or JSON
//! escaping on this link. Host requests carry a `u64` id and are answered by
//! exactly one [`AgentMessage::Response`] with the same id, in any order.
//! Process output, exits and guest-originated requests flow as unsolicited
//! agent messages. Output of one process is delivered in order, and its
//! `Exit` follows the last byte of both its stdout and stderr.
//!
//! Limits: a message must fit one frame ([`MAX_MESSAGE`]); bulk producers
//! chunk at [`MAX_CHUNK`].

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// Version sent in the hello; the host refuses agents with another major.
pub const PROTOCOL_VERSION: u32 = 1;

/// vsock CID of the host, as fixed by the virtio-vsock specification.
pub const HOST_CID: u32 = 2;

/// vsock port the agent dials on the host (the official agent's port).
pub const AGENT_PORT: u32 = 51234;

/// vsock port of the host's egress proxy: the guest agent's relay dials
/// (CID 2, this port) once per relayed connection. The host answers with the
/// egress proxy (HTTP CONNECT, absolute-form HTTP or SOCKS5, told apart by
/// the first byte); every request carries a spawn's credential. Next to
/// [`AGENT_PORT`] so both are easy to spot in a vsock trace.
pub const EGRESS_PORT: u32 = 51235;

/// TCP port the agent's egress relay listens on at `127.0.0.1` (in the VM,
/// and in the sandbox's network namespace): the usual proxy port, and the
/// one session processes find in their `*_PROXY` variables.
pub const GUEST_PROXY_PORT: u16 = 3128;

/// In the guest, the file holding only the host's egress CA (see
/// [`Op::TrustCa`]); the host names it in every spawn's
/// `NODE_EXTRA_CA_CERTS`.
pub const EGRESS_CA_FILE: &str = "/run/cowork/egress-ca.pem";

/// Environment variable through which the sandbox tells its agent where the
/// host's egress proxy listens: a unix socket path as the agent sees it.
/// Unset in a VM, where the relay dials vsock [`EGRESS_PORT`].
pub const EGRESS_SOCKET_ENV: &str = "COWORK_EGRESS_SOCKET";

/// Kernel command-line variable (so the VM agent's environment) naming one
/// session whose processes run as guest root with every capability instead
/// of as the session's own user: a test hook, set by the helper only from
/// its own environment (`COWORK_GUEST_ROOT_SESSION`), never from the client.
/// Tests use it to show that what the host enforces (egress, vsock ports,
/// virtio-fs grants) holds against guest root too.
pub const ROOT_SESSION_ENV: &str = "COWORK_ROOT_SESSION";

/// Kernel command-line variable (so the VM agent's environment) saying how
/// the agent signals its template point when the machine has no vsock
/// device yet: [`TEMPLATE_SIGNAL_CONSOLE`] is the only value. The qemu
/// backend boots its snapshot-taking machines without the devices QEMU
/// cannot migrate (vsock among them) and hot-plugs them after the
/// snapshot, so the agent cannot say its template hello until then.
pub const TEMPLATE_SIGNAL_ENV: &str = "COWORK_TEMPLATE_SIGNAL";
/// [`TEMPLATE_SIGNAL_ENV`]'s value: once its boot's background work is done
/// (the egress gate), the agent prints [`TEMPLATE_CONSOLE_MARK`] on the
/// console, then dials the host every [`TEMPLATE_POLL_MS`] until the vsock
/// device arrives, and goes on with its template hello as always.
pub const TEMPLATE_SIGNAL_CONSOLE: &str = "console";
/// The console line (its start) that says the agent is at its template
/// point (see [`TEMPLATE_SIGNAL_ENV`]); what follows it is informational.
/// Any guest code could print it: the host only snapshots the machine
/// earlier than it would otherwise, it trusts nothing more.
pub const TEMPLATE_CONSOLE_MARK: &str = "cowork-agent: template point";
/// Pause between the agent's dials while it waits for a hot-plugged vsock
/// device (ms): short, because a restored machine's start waits on it.
pub const TEMPLATE_POLL_MS: u64 = 10;

/// virtio-fs tag of the host's session share in a VM (ours, not the official
/// helper's `claudeshared`). Its root holds `/<session>/<mount name>` for each
/// mount the host granted; the host enforces each mount's mode.
pub const SESSIONS_FS_TAG: &str = "cowork-sessions";

/// Where the agent, as a VM's init, mounts [`SESSIONS_FS_TAG`]. Private to the
/// agent: session processes do not see it (they see only the binds at
/// `/sessions/<name>/mnt/<mount name>`). Mount sources the host sends in a VM
/// with the share are below it.
pub const SESSIONS_FS_MOUNT: &str = "/run/cowork/fs";

/// Serial (virtio-blk GET_ID, `/sys/block/<disk>/serial`) of the session disk
/// in a VM. The agent formats it as ext4 when blank and mounts it at
/// `/sessions` (see `agent::sessiondisk`); the host's device model serves it
/// (`devices::blk::SESSION_DISK_SERIAL` names the same string).
pub const SESSION_DISK_SERIAL: &str = "cowork-sessions";

/// Serial of our default userland disk in a VM: a whole-disk ext4 filesystem
/// (no partition table, no journal) labelled [`ROOTFS_LABEL`], attached
/// read-only. The agent, as init, mounts it as the read-only lower of the
/// session userland (see `agent::userland`).
pub const ROOTFS_SERIAL: &str = "cowork-rootfs";

/// ext4 volume label of our default userland image (`mkfs.ext4 -L`); the
/// agent checks it before trusting the disk behind [`ROOTFS_SERIAL`].
pub const ROOTFS_LABEL: &str = "cowork-rootfs";

/// Serial of the client's bundle `rootfs.img` in a VM: a GPT disk whose root
/// is the ext4 partition labelled [`BUNDLE_ROOTFS_LABEL`], attached read-only
/// (`VIRTIO_BLK_F_RO`). The agent prefers it over [`ROOTFS_SERIAL`] and mounts
/// it `ro,noload` so a dirty journal is never replayed.
pub const BUNDLE_ROOTFS_SERIAL: &str = "cowork-bundle-root";

/// ext4 volume label of the root partition in the client's bundle image
/// (Ubuntu cloud images label their root this way).
pub const BUNDLE_ROOTFS_LABEL: &str = "cloudimg-rootfs";

/// Largest frame on the agent link.
pub const MAX_MESSAGE: usize = crate::framing::MAX_CLIENT_FRAME;

/// Largest payload a producer puts in one message (stdout chunk, file chunk).
pub const MAX_CHUNK: usize = 256 * 1024;

/// Lowest uid (and gid) of a session user: 2^30, far above the ranges of
/// system accounts (< 1000), regular users (1000–60000), `nobody` (65534) and
/// the usual subordinate-id ranges handed out from 100000, so a session user
/// never takes the id of an account a userland ships or creates.
pub const SESSION_UID_BASE: u32 = 1 << 30;

/// Number of distinct session uids: 2^30, so the highest one is 2^31 - 1 and
/// every session uid stays positive for software that stores ids as signed
/// 32-bit integers (and far from the special `(uid_t)-1`).
pub const SESSION_UID_RANGE: u32 = 1 << 30;

/// FNV-1a 64-bit offset basis (the published FNV parameter).
const FNV64_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// FNV-1a 64-bit prime (the published FNV parameter).
const FNV64_PRIME: u64 = 0x0000_0100_0000_01b3;

/// The uid of session `name`'s user in a VM; its primary gid is the same
/// number. A pure function of the name, shared by the host (which presents
/// the files of the session's virtio-fs grants as owned by it) and the agent
/// (which creates the user and runs the session's processes as it), and
/// stable across boots and versions: the session disk keeps its files' owners.
///
/// It is `SESSION_UID_BASE + h mod SESSION_UID_RANGE`, where `h` is the 64-bit
/// FNV-1a hash of the name's UTF-8 bytes with its high half folded onto its
/// low half. Two names share a uid with probability 2^-30; among `n`
/// sessions on one disk some pair collides with probability about
/// n²/2^31: 5·10^-6 for 100 sessions, 5·10^-4 for 1000. The agent detects a
/// collision (the uid already belongs to another user or another session's
/// home) and refuses the spawn rather than letting two sessions share a user.
pub fn session_uid(name: &str) -> u32 {
    let mut h = FNV64_OFFSET;
    for b in name.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(FNV64_PRIME);
    }
    let folded = (h ^ (h >> 32)) as u32;
    SESSION_UID_BASE + folded % SESSION_UID_RANGE
}

/// Errors decoding a message.
#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    #[error("message shorter than its header length prefix")]
    Short,
    #[error("header length {0} runs past the end of the message")]
    HeaderLength(usize),
    #[error("malformed message header: {0}")]
    Json(#[from] serde_json::Error),
}

/// A decoded message: the typed header and the raw payload that followed it.
#[derive(Debug)]
pub struct Envelope<T> {
    pub header: T,
    pub payload: Vec<u8>,
}

/// Encodes `header` and `payload` as one frame body.
pub fn encode<T: Serialize>(header: &T, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + payload.len());
    encode_into(&mut out, header, payload);
    out
}

/// Appends a complete frame (length prefix included) for `header`+`payload` to `out`.
pub fn encode_frame_into<T: Serialize>(out: &mut Vec<u8>, header: &T, payload: &[u8]) {
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    encode_into(out, header, payload);
    let len = (out.len() - start - 4) as u32;
    out[start..start + 4].copy_from_slice(&len.to_be_bytes());
}

fn encode_into<T: Serialize>(out: &mut Vec<u8>, header: &T, payload: &[u8]) {
    let at = out.len();
    out.extend_from_slice(&[0; 4]);
    // Serializing our own plain data types into a Vec cannot fail.
    serde_json::to_writer(&mut *out, header).expect("protocol header serializes");
    let hlen = (out.len() - at - 4) as u32;
    out[at..at + 4].copy_from_slice(&hlen.to_be_bytes());
    out.extend_from_slice(payload);
}

/// Decodes a frame body into header and payload.
pub fn decode<T: for<'de> Deserialize<'de>>(mut body: Vec<u8>) -> Result<Envelope<T>, ProtoError> {
    let (header, payload_len) = decode_ref(&body).map(|(h, p)| (h, p.len()))?;
    let payload = body.split_off(body.len() - payload_len);
    Ok(Envelope { header, payload })
}

/// Decodes a frame body without copying the payload: returns the header and
/// a view of the bytes that follow it (the hot path of process output).
pub fn decode_ref<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<(T, &[u8]), ProtoError> {
    if body.len() < 4 {
        return Err(ProtoError::Short);
    }
    let hlen = u32::from_be_bytes([body[0], body[1], body[2], body[3]]) as usize;
    if hlen > body.len() - 4 {
        return Err(ProtoError::HeaderLength(hlen));
    }
    let header = serde_json::from_slice(&body[4..4 + hlen])?;
    Ok((header, &body[4 + hlen..]))
}

/// A string that never appears in logs or `Debug` output (OAuth tokens).
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(pub String);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// Boot timestamps the agent reports, in microseconds since its kernel booted
/// (CLOCK_BOOTTIME) or since the agent process started when not PID 1.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BootTimes {
    /// When the agent's `main` started.
    pub agent_start_us: u64,
    /// When early init (mounts, modules) was done; equals start outside a VM.
    pub init_done_us: u64,
    /// When the connection to the host was established.
    pub connected_us: u64,
    /// When the root was switched to a userland disk (a VM's init only;
    /// absent when it stayed on its initramfs, and from older agents).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub userland_switched_us: Option<u64>,
}

/// First message of every agent connection.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Hello {
    pub protocol: u32,
    /// The agent crate's version.
    pub version: String,
    /// Whether the agent runs as PID 1 (the VM's init).
    pub is_init: bool,
    pub boot: BootTimes,
    /// Kernel release (`uname -r`) as the agent sees it.
    pub kernel: String,
    /// Which userland this boot runs sessions in, when the agent is a VM's
    /// init (absent otherwise, and from agents that predate it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub userland: Option<UserlandInfo>,
    /// What the agent did with the session disk at boot, when it is a VM's
    /// init (absent otherwise, and from agents that predate it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_disk: Option<SessionDiskInfo>,
    /// [`Hello::TEMPLATE`] for a VM's init whose userland is up but which
    /// holds nothing per boot yet: the host may snapshot the machine now,
    /// and answers with [`HostMessage::Setup`], after which the agent
    /// finishes its boot and says its final hello (no phase). Absent in
    /// the final hello, and from a sandbox's or plain agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// What the agent did with the CA of the `Setup`'s `trustCa` (final
    /// hello only; absent when the `Setup` carried none).
    /// (Boxed: it is rare and keeps every message small.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_trust: Option<Box<CaTrust>>,
    /// The agent answers [`HostMessage::Quiesce`] at its template point
    /// (template hello only; agents that predate it leave it out, and the
    /// host then snapshots without asking).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub quiesce: bool,
}

/// How the guest came to trust the egress CA (the answer to
/// [`Op::TrustCa`], or the final hello's [`Hello::ca_trust`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct CaTrust {
    /// The CA was added to the system bundle.
    pub bundle: bool,
    /// The combined bundle is bound over a read-only system bundle.
    pub bound: bool,
    /// The CA was written as a trust anchor for `update-ca-certificates`.
    pub anchor: bool,
    /// Why the CA could not be trusted (then nothing above is true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Hello {
    /// The phase of a VM's first hello (see [`Hello::phase`]).
    pub const TEMPLATE: &'static str = "template";

    /// Whether this is a VM's template hello.
    pub fn is_template(&self) -> bool {
        self.phase.as_deref() == Some(Self::TEMPLATE)
    }
}

/// Bytes of host entropy in a [`HostMessage::Setup`] payload: the kernel
/// reseeds its RNG from them (a restored machine must not repeat another
/// restore's random numbers).
pub const SETUP_ENTROPY_BYTES: usize = 64;

/// The session disk as a VM's agent found it at boot (see
/// `agent::sessiondisk`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SessionDiskInfo {
    /// [`SessionDiskInfo::MOUNTED`], [`SessionDiskInfo::FORMATTED`],
    /// [`SessionDiskInfo::ABSENT`] or [`SessionDiskInfo::FAILED`]; a string
    /// so a newer agent's word does not break an older host.
    pub state: String,
    /// The guest's device node, when the disk was found.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dev: Option<String>,
    /// Why it could not be used ([`SessionDiskInfo::FAILED`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl SessionDiskInfo {
    /// It held a filesystem and is mounted at `/sessions`.
    pub const MOUNTED: &'static str = "mounted";
    /// It was blank, was formatted and is mounted at `/sessions`.
    pub const FORMATTED: &'static str = "formatted";
    /// No disk with [`SESSION_DISK_SERIAL`] was found.
    pub const ABSENT: &'static str = "absent";
    /// It was found but not mounted (and not formatted): see `error`.
    pub const FAILED: &'static str = "failed";
}

/// The userland a VM's agent switched to at boot (see `agent::userland`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UserlandInfo {
    /// [`UserlandInfo::BUNDLE`], [`UserlandInfo::DEFAULT`] or
    /// [`UserlandInfo::INITRAMFS`]; a string so a newer agent's word does
    /// not break an older host.
    pub kind: String,
    /// `PRETTY_NAME` of the userland's `os-release`, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pretty_name: Option<String>,
    /// Why each candidate tried before the one taken was rejected, one
    /// line each, in the order they were tried.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fallbacks: Vec<String>,
}

impl UserlandInfo {
    /// The client's bundle root ([`BUNDLE_ROOTFS_SERIAL`]).
    pub const BUNDLE: &'static str = "bundle";
    /// Our default userland ([`ROOTFS_SERIAL`]).
    pub const DEFAULT: &'static str = "default";
    /// The busybox initramfs the agent booted from (no root disk usable).
    pub const INITRAMFS: &'static str = "initramfs";
}

/// How a session mount may be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MountMode {
    /// Read-only.
    Ro,
    /// Read-write; deleting pre-existing files is not allowed where the
    /// backend can enforce it.
    Rw,
    /// Read-write with deletion.
    Rwd,
}

impl MountMode {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "ro" => Some(Self::Ro),
            "rw" => Some(Self::Rw),
            "rwd" => Some(Self::Rwd),
            _ => None,
        }
    }
    pub fn writable(self) -> bool {
        !matches!(self, Self::Ro)
    }
}

/// One session mount: `source` (a path in the agent's own view, chosen by the
/// backend) appears at `/sessions/<session>/mnt/<name>`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MountSpec {
    pub session: String,
    /// Mount name relative to the session's `mnt/`; may be nested (`.claude/skills`).
    pub name: String,
    pub source: String,
    pub mode: MountMode,
}

/// A process to start.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SpawnSpec {
    /// Client-chosen process id (unique among live processes of the agent).
    pub id: String,
    /// Session name; the process runs in `/sessions/<name>` unless `cwd` says otherwise.
    pub name: String,
    pub command: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub cwd: Option<String>,
    /// Environment, as sent by the client. The agent drops empty values and
    /// applies the OAuth rule with `oauth_token`.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub oauth_token: Option<Secret>,
    #[serde(default)]
    pub mounts: Vec<MountSpec>,
    #[serde(default)]
    pub is_resume: bool,
    #[serde(default)]
    pub one_shot: bool,
    #[serde(default)]
    pub mount_skeleton_home: bool,
    #[serde(default)]
    pub allowed_domains: Option<Vec<String>>,
    /// This spawn's egress proxy URL, `http://<user>:<credential>@127.0.0.1:<GUEST_PROXY_PORT>`,
    /// issued by the host and revoked when the process exits. The host also
    /// puts it in the `*_PROXY` variables of `env`; the agent uses it to
    /// authenticate connections it captures for this process's group
    /// (programs that ignore the proxy variables). Never logged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_proxy: Option<Secret>,
}

/// Environment variables that carry credentials: their values are never logged,
/// and their presence stops the agent from injecting the OAuth token.
pub const CREDENTIAL_VARS: [&str; 3] = [
    "CLAUDE_CODE_OAUTH_TOKEN",
    "ANTHROPIC_AUTH_TOKEN",
    "ANTHROPIC_API_KEY",
];

impl fmt::Debug for SpawnSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Env values may hold secrets: show names only.
        f.debug_struct("SpawnSpec")
            .field("id", &self.id)
            .field("name", &self.name)
            .field("command", &self.command)
            .field("args", &self.args.len())
            .field("cwd", &self.cwd)
            .field("env_keys", &self.env.keys().collect::<Vec<_>>())
            .field(
                "oauth_token",
                &self.oauth_token.as_ref().map(|_| "<redacted>"),
            )
            .field("mounts", &self.mounts)
            .field("is_resume", &self.is_resume)
            .field("one_shot", &self.one_shot)
            .field(
                "egress_proxy",
                &self.egress_proxy.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

/// Operations the host asks of the agent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "camelCase")]
pub enum Op {
    /// Liveness check; result `{}`.
    Ping,
    /// Start a process; result `{"failedMounts": [names]}`.
    Spawn(SpawnSpec),
    /// Write the message payload to the process's stdin, in order.
    WriteStdin { id: String },
    /// Close the process's stdin.
    CloseStdin { id: String },
    /// Send `signal` (a number) to the process group; result `{}`.
    Kill { id: String, signal: i32 },
    /// Result `{"running": bool, "exitCode"?: i32}`; unknown ids are an error.
    ProcessStatus { id: String },
    /// Result: the file's bytes as payload. `path` is absolute, or relative to
    /// `/sessions/<session>`; it must resolve inside `/sessions/<session>`.
    ReadFile { session: String, path: String },
    /// Make `source` (the CLI binary, in the agent's view) available as
    /// `/usr/local/bin/claude`; idempotent.
    InstallSdk { source: String, version: String },
    /// Add a mount to a (possibly running) session; result `{}`.
    Mount(MountSpec),
    /// Result as the client's `getSessionsDiskInfo`.
    DiskInfo { low_water_bytes: u64 },
    /// Result as the client's `deleteSessionDirs`.
    DeleteSessionDirs { names: Vec<String> },
    /// Result as the client's `pruneSessionCaches`.
    PruneSessionCaches {
        only_if_free_bytes_below: Option<u64>,
        include_session_tmp: bool,
        session_tmp_older_than_seconds: Option<u64>,
    },
    /// Kill every process (exit events follow), then answer; the agent then
    /// powers the machine off when it is init, or exits otherwise.
    Shutdown,
    /// Trust this CA certificate (PEM): the host's egress proxy signs the
    /// API hosts' certificates with it. Written to [`EGRESS_CA_FILE`] and
    /// into the userland's system bundle; result a [`CaTrust`] (`{"bundle":
    /// bool, "bound": bool, "anchor": bool}`). Sent once after the hello, before
    /// any spawn; a later one replaces it.
    TrustCa { pem: String },
}

/// Messages from host to agent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "camelCase")]
pub enum HostMessage {
    /// A request; the agent answers with a `Response` of the same id.
    Request { id: u64, op: Op },
    /// At the template point, before the host snapshots the machine: the
    /// agent lets the background work of its boot finish (egress start-up,
    /// bounded by its gate's limit) and answers [`AgentMessage::Quiesced`],
    /// so the snapshot holds an idle machine and no start restored from it
    /// spends its first moments finishing that work. Then it waits for its
    /// `Setup` as before.
    Quiesce,
    /// The answer to a template hello ([`Hello::TEMPLATE`]): what this boot
    /// is, as opposed to the machine it may have been restored from. The
    /// payload is [`SETUP_ENTROPY_BYTES`] of host entropy the agent adds to
    /// the kernel's RNG before forcing a reseed; `wallClockNs` is the host's
    /// `CLOCK_REALTIME` (ns since the epoch) the agent sets the guest's
    /// clock to. Then the agent mounts the session disk and share and says
    /// its final hello. `trustCa`, when the host runs an egress proxy, is
    /// its CA certificate (PEM): the agent trusts it while it mounts (as
    /// [`Op::TrustCa`] would, one round trip later) and says how in the
    /// final hello's [`Hello::ca_trust`].
    #[serde(rename_all = "camelCase")]
    Setup {
        wall_clock_ns: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        trust_ca: Option<String>,
    },
    /// The client's answer to a guest-originated request.
    #[serde(rename_all = "camelCase")]
    GuestResponse {
        id: String,
        result_json: Option<String>,
        error: Option<String>,
    },
}

/// Messages from agent to host.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "camelCase")]
pub enum AgentMessage {
    Hello(Hello),
    /// The answer to [`HostMessage::Quiesce`]: nothing of the boot runs in
    /// the background any more (`complete`), or the wait gave up;
    /// `waitedMs` is how long the agent waited.
    #[serde(rename_all = "camelCase")]
    Quiesced {
        waited_ms: u64,
        complete: bool,
    },
    /// Answer to `HostMessage::Request`; bulk results travel in the payload.
    Response {
        id: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
        #[serde(default)]
        result: serde_json::Value,
    },
    /// Payload: a chunk of the process's stdout.
    Stdout {
        id: String,
    },
    /// Payload: a chunk of the process's stderr.
    Stderr {
        id: String,
    },
    /// The process ended; sent after its stdout and stderr reached EOF.
    #[serde(rename_all = "camelCase")]
    Exit {
        id: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        exit_code: Option<i32>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        signal: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        oom_kill_count: Option<u64>,
    },
    /// A process-scoped error (`fatal` means the process is gone).
    Error {
        id: String,
        message: String,
        fatal: bool,
    },
    /// A guest-originated request for the client.
    Request {
        id: String,
        method: String,
        params: serde_json::Value,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_round_trip_keeps_payload_bytes() {
        let msg = AgentMessage::Stdout { id: "p1".into() };
        let payload: Vec<u8> = (0..=255).collect();
        let env: Envelope<AgentMessage> = decode(encode(&msg, &payload)).unwrap();
        assert_eq!(env.header, msg);
        assert_eq!(env.payload, payload);
    }

    #[test]
    fn decode_ref_borrows_the_payload() {
        let body = encode(&AgentMessage::Stderr { id: "e".into() }, b"abc");
        let (h, p): (AgentMessage, &[u8]) = decode_ref(&body).unwrap();
        assert_eq!(h, AgentMessage::Stderr { id: "e".into() });
        assert_eq!(p, b"abc");
        assert!(matches!(
            decode_ref::<AgentMessage>(&[0, 0, 0, 9, b'{']),
            Err(ProtoError::HeaderLength(9))
        ));
    }

    #[test]
    fn frame_into_prefixes_length() {
        let mut out = Vec::new();
        encode_frame_into(
            &mut out,
            &HostMessage::Request {
                id: 7,
                op: Op::Ping,
            },
            b"xy",
        );
        let len = u32::from_be_bytes([out[0], out[1], out[2], out[3]]) as usize;
        assert_eq!(len, out.len() - 4);
        let env: Envelope<HostMessage> = decode(out[4..].to_vec()).unwrap();
        assert_eq!(
            env.header,
            HostMessage::Request {
                id: 7,
                op: Op::Ping
            }
        );
        assert_eq!(env.payload, b"xy");
    }

    #[test]
    fn malformed_messages_are_errors_not_panics() {
        assert!(matches!(
            decode::<AgentMessage>(vec![0, 0]),
            Err(ProtoError::Short)
        ));
        assert!(matches!(
            decode::<AgentMessage>(vec![0, 0, 0, 9, b'{']),
            Err(ProtoError::HeaderLength(9))
        ));
        assert!(matches!(
            decode::<AgentMessage>(vec![0, 0, 0, 2, b'{', b'}']),
            Err(ProtoError::Json(_))
        ));
        let unknown = encode(&serde_json::json!({"type": "nope"}), b"");
        assert!(decode::<AgentMessage>(unknown).is_err());
    }

    #[test]
    fn secrets_never_show_in_debug() {
        let mut env = BTreeMap::new();
        env.insert(
            "ANTHROPIC_API_KEY".to_string(),
            "sk-secret-value".to_string(),
        );
        let spec = SpawnSpec {
            id: "a".into(),
            name: "s".into(),
            command: "/bin/true".into(),
            args: vec![],
            cwd: None,
            env,
            oauth_token: Some(Secret("oauth-secret-value".into())),
            mounts: vec![],
            is_resume: false,
            one_shot: false,
            mount_skeleton_home: false,
            allowed_domains: None,
            egress_proxy: None,
        };
        let shown = format!("{:?}", Op::Spawn(spec));
        assert!(!shown.contains("sk-secret-value"), "{shown}");
        assert!(!shown.contains("oauth-secret-value"), "{shown}");
        assert!(shown.contains("ANTHROPIC_API_KEY"));
    }

    #[test]
    fn hello_userland_is_optional_both_ways() {
        // An older agent's hello (no userland) still decodes.
        let old = r#"{"type":"hello","protocol":1,"version":"0.1.0","isInit":true,
            "boot":{"agentStartUs":1,"initDoneUs":2,"connectedUs":3},"kernel":"6.1.0"}"#;
        let h: AgentMessage = serde_json::from_str(old).unwrap();
        let AgentMessage::Hello(h) = h else {
            panic!("not a hello: {h:?}")
        };
        assert_eq!(h.userland, None);
        // Without a userland nothing is sent; with one, camelCase fields.
        let text = serde_json::to_string(&AgentMessage::Hello(h.clone())).unwrap();
        assert!(!text.contains("userland"), "{text}");
        let with = Hello {
            userland: Some(UserlandInfo {
                kind: UserlandInfo::BUNDLE.into(),
                pretty_name: Some("Ubuntu 22.04.5 LTS".into()),
                fallbacks: vec![],
            }),
            ..h
        };
        let v = serde_json::to_value(AgentMessage::Hello(with.clone())).unwrap();
        assert_eq!(v["userland"]["kind"], "bundle");
        assert_eq!(v["userland"]["prettyName"], "Ubuntu 22.04.5 LTS");
        assert!(v["userland"].get("fallbacks").is_none());
        let back: AgentMessage = serde_json::from_value(v).unwrap();
        assert_eq!(back, AgentMessage::Hello(with));
        // An unknown kind from a newer agent decodes as its word.
        let newer = r#"{"kind":"nix","fallbacks":["cowork-rootfs: no bash"]}"#;
        let u: UserlandInfo = serde_json::from_str(newer).unwrap();
        assert_eq!((u.kind.as_str(), u.fallbacks.len()), ("nix", 1));
    }

    #[test]
    fn boot_times_carry_the_userland_switch_when_there_was_one() {
        let old = r#"{"agentStartUs":1,"initDoneUs":2,"connectedUs":3}"#;
        let t: BootTimes = serde_json::from_str(old).unwrap();
        assert_eq!(t.userland_switched_us, None);
        assert!(!serde_json::to_string(&t)
            .unwrap()
            .contains("userlandSwitched"));
        let t = BootTimes {
            userland_switched_us: Some(2_500),
            ..t
        };
        let v = serde_json::to_value(&t).unwrap();
        assert_eq!(v["userlandSwitchedUs"], 2_500);
        assert_eq!(serde_json::from_value::<BootTimes>(v).unwrap(), t);
    }

    #[test]
    fn mount_mode_parse() {
        assert_eq!(MountMode::parse("ro"), Some(MountMode::Ro));
        assert_eq!(MountMode::parse("rwd"), Some(MountMode::Rwd));
        assert_eq!(MountMode::parse("RW"), None);
        assert!(MountMode::Rw.writable() && !MountMode::Ro.writable());
    }

    #[test]
    fn session_uids_are_stable_and_in_range() {
        // Fixed values (checked with an independent FNV-1a implementation): the
        // host and every agent version must agree forever.
        let fixed = [
            ("", 1_339_080_641),
            ("a", 1_768_042_688),
            ("amazing-youthful-hopper", 1_346_783_753),
            ("Session 1", 2_062_749_045),
        ];
        for (name, want) in fixed {
            let uid = session_uid(name);
            assert_eq!(uid, want, "{name:?}");
        }
        let mut seen = std::collections::HashSet::new();
        for i in 0..10_000 {
            let uid = session_uid(&format!("session-{i}"));
            assert!(
                (SESSION_UID_BASE..=SESSION_UID_BASE + (SESSION_UID_RANGE - 1)).contains(&uid),
                "{uid}"
            );
            assert!(uid < 1 << 31);
            seen.insert(uid);
        }
        // 10 000 names in 2^30 values: a collision has probability ~5 %; more than
        // one would mean a broken spread.
        assert!(seen.len() >= 9_999, "{} distinct", seen.len());
    }

    /// `TrustCa`'s reply and the final hello's `caTrust` share one shape;
    /// what an agent leaves out reads as false.
    #[test]
    fn ca_trust_has_the_wire_shape_of_the_trust_ca_reply() {
        let done = CaTrust {
            bundle: true,
            bound: false,
            anchor: true,
            error: None,
        };
        let v = serde_json::to_value(&done).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"bundle": true, "bound": false, "anchor": true})
        );
        let partial: CaTrust = serde_json::from_value(serde_json::json!({"bundle": true})).unwrap();
        assert_eq!(
            partial,
            CaTrust {
                bundle: true,
                ..CaTrust::default()
            }
        );
    }
}
