//! Reading the measurements `bench boot` needs out of the helper's log.
//!
//! The helper under test logs one line per event through `tracing`'s text
//! format (`2026-12-03T05:51:10.053471Z  INFO message key=value ...`, see
//! `crate::logging`). The boot benchmark starts it with `COWORK_LOG=info`
//! and reads back the events that carry boot timings: the VMM's build and
//! first `KVM_RUN`, the boot-port marks, QEMU's start and its vhost-user
//! connections, and the agent's hello; and, for the warm start of either
//! backend, whether the VM started cold or warm, the restore's phases (the
//! VMM's, or the qemu backend's), the agent's dial after it, the boot
//! snapshot a cold boot took and why a snapshot was not taken or not
//! restored. [`HelperLog::parse`] turns the text into typed records
//! ([`BootEvents`]); nothing here derives a phase (that is
//! [`super::phases`]).
//!
//! Limits: the format is the helper's own and is read by exact message
//! text ([`MSG_KVM_STARTED`], ...); a message that is renamed makes the
//! matching measurement absent (reported as such), never wrong. Wall-clock
//! timestamps have microsecond resolution and assume the host clock is not
//! stepped during a boot.

use std::collections::HashMap;

/// The kvm backend's line once the VM is built (`build_ms`).
pub const MSG_KVM_STARTED: &str = "kvm vm started";
/// The kvm backend's line when the VM thread ends (`build_ms`, `first_run_ms`).
pub const MSG_KVM_ENDED: &str = "kvm vm ended";
/// The VMM's boot-timing port, one line per guest write (`value`, `at_us`).
pub const MSG_BOOT_MARK: &str = "guest boot milestone";
/// The qemu backend's line once QEMU was spawned (`pid`, `accel`,
/// `start`); a warm start whose restore failed logs a second one, cold.
pub const MSG_QEMU_STARTED: &str = "qemu started";
/// The qemu backend's line once a restored machine runs (`ram_mib`,
/// `ram_ms`, `load_ms`, `hotplug_ms`, `total_ms`).
pub const MSG_QEMU_RESTORED: &str = "qemu boot snapshot restored";
/// The helper's line when the agent's vsock connection was accepted (the
/// port follows in the message; `ms`).
pub const MSG_AGENT_DIALLED: &str = "guest agent dialled vsock port";
/// Suffix of each in-process vhost-user server's line when QEMU connects.
pub const MSG_FRONTEND_CONNECTED: &str = ": frontend connected";
/// The daemon's line once the agent's hello was read (its boot clock).
pub const MSG_AGENT_CONNECTED: &str = "guest agent connected";
/// The daemon's line when a `startVM` request arrives.
pub const MSG_START_VM: &str = "startVM";
/// The VMM's line once it restored a VM from a snapshot (`restore_us` and
/// its phases `state_us`, `kvm_us`, `memory_us`, `vcpus_us`, `vm_us`,
/// `devices_us`).
pub const MSG_VM_RESTORED: &str = "VM restored from a snapshot";
/// The backends' line once a cold boot saved its boot snapshot (kvm:
/// `snapshot_ms`, `memory_data_mib`, `memory_disk_mib`, `state_bytes`;
/// qemu: `memory_data_mib`, `state_bytes`, `stopped_ms`).
pub const MSG_SNAPSHOT_TAKEN: &str = "boot snapshot taken";
/// The backends' line when a snapshot could not be restored (`error`);
/// the same start then boots cold.
pub const MSG_RESTORE_FAILED: &str = "the boot snapshot cannot be restored; removed, booting cold";
/// The backends' lines when a cold boot with snapshots on took no
/// snapshot (some with `error`).
pub const MSG_NO_SNAPSHOT: [&str; 8] = [
    "cannot take the boot snapshot; the next start boots cold again",
    "the guest agent has no template point; no boot snapshot",
    "no boot snapshot",
    "cannot create the snapshot directory; no snapshot this boot",
    "the VM ended before its snapshot was taken",
    "the guest agent never said its template point on the console; no boot snapshot",
    "the console closed before the template point",
    "cannot continue the machine after its snapshot",
];
/// The `start` value of [`MSG_KVM_STARTED`] and [`MSG_QEMU_STARTED`] for a
/// VM that booted its kernel.
pub const START_COLD: &str = "cold";
/// The `start` value of [`MSG_KVM_STARTED`] and [`MSG_QEMU_STARTED`] for a
/// VM restored from a snapshot.
pub const START_WARM: &str = "warm";

/// One log line: its wall-clock time (µs since the Unix epoch), level,
/// message and `key=value` fields.
#[derive(Clone, Debug, PartialEq)]
pub struct LogLine {
    pub at_us: i64,
    pub level: String,
    pub message: String,
    pub fields: HashMap<String, String>,
}

impl LogLine {
    /// A field parsed as a number.
    pub fn num(&self, key: &str) -> Option<f64> {
        self.fields.get(key)?.parse().ok()
    }
}

/// Microseconds since the Unix epoch of an RFC 3339 UTC timestamp as
/// `tracing` writes it (`2026-12-03T05:51:10.053471Z`; any number of
/// fraction digits, or none).
pub fn parse_timestamp(s: &str) -> Option<i64> {
    let s = s.strip_suffix('Z')?;
    let (date, time) = s.split_once('T')?;
    let mut d = date.splitn(3, '-');
    let year: i64 = d.next()?.parse().ok()?;
    let month: i64 = d.next()?.parse().ok()?;
    let day: i64 = d.next()?.parse().ok()?;
    let (hms, frac) = match time.split_once('.') {
        Some((hms, frac)) => (hms, frac),
        None => (time, ""),
    };
    let mut t = hms.splitn(3, ':');
    let h: i64 = t.next()?.parse().ok()?;
    let m: i64 = t.next()?.parse().ok()?;
    let sec: i64 = t.next()?.parse().ok()?;
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || h > 23 || m > 59 || sec > 60 {
        return None;
    }
    if !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    // Microseconds from the first six fraction digits.
    let mut us = 0i64;
    for i in 0..6 {
        us = us * 10 + frac.as_bytes().get(i).map_or(0, |b| i64::from(b - b'0'));
    }
    let days = guest_agent::agent::clock::days_from_civil(year, month, day);
    Some(((days * 24 + h) * 60 + m) * 60_000_000 + sec * 1_000_000 + us)
}

/// Splits `key=value key="quoted value" ...` into a map (a quoted value
/// keeps its text between the quotes, `\"` unescaped).
fn parse_fields(s: &str) -> HashMap<String, String> {
    let mut out = HashMap::new();
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        while i < b.len() && b[i] == b' ' {
            i += 1;
        }
        let key_start = i;
        while i < b.len() && b[i] != b'=' && b[i] != b' ' {
            i += 1;
        }
        if i >= b.len() || b[i] != b'=' {
            continue;
        }
        let key = &s[key_start..i];
        i += 1;
        let value = if b.get(i) == Some(&b'"') {
            i += 1;
            let mut v = String::new();
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' && i + 1 < b.len() {
                    i += 1;
                }
                // Push whole characters (values may hold any UTF-8).
                let ch = s[i..].chars().next().unwrap_or(' ');
                v.push(ch);
                i += ch.len_utf8();
            }
            i += 1;
            v
        } else {
            let start = i;
            while i < b.len() && b[i] != b' ' {
                i += 1;
            }
            s[start..i].to_string()
        };
        out.insert(key.to_string(), value);
    }
    out
}

/// Parses one line of the helper's log; `None` for anything else (guest
/// console text, a continuation line).
pub fn parse_line(line: &str, message: &str) -> Option<LogLine> {
    let mut parts = line.splitn(2, ' ');
    let at_us = parse_timestamp(parts.next()?)?;
    let rest = parts.next()?.trim_start();
    let (level, rest) = rest.split_once(' ')?;
    let rest = rest.trim_start();
    let after = rest.strip_prefix(message)?;
    if !(after.is_empty() || after.starts_with(' ')) {
        return None;
    }
    Some(LogLine {
        at_us,
        level: level.to_string(),
        message: message.to_string(),
        fields: parse_fields(after),
    })
}

/// A boot-port write as the VMM logged it: the raw value, the VMM's time
/// since it began building the VM, and the wall time of the log line (taken
/// on the vCPU thread right after `at_us`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Mark {
    pub value: u32,
    pub at_us: u64,
    pub logged_at: i64,
}

/// The VMM's restore of a VM from a snapshot ([`MSG_VM_RESTORED`]): when
/// it was logged (right after the restore ended) and how long the whole
/// restore and each of its phases took, in µs (a phase the line lacks is
/// `None`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Restore {
    /// Wall time of the line (µs since the epoch).
    pub logged_at: i64,
    /// The whole restore (`restore_us`).
    pub total_us: f64,
    /// State file read and checked against this machine (`state_us`).
    pub state_us: Option<f64>,
    /// The KVM VM, its irqchip, PIT and vCPUs created (`kvm_us`).
    pub kvm_us: Option<f64>,
    /// The memory file mapped copy-on-write and registered (`memory_us`).
    pub memory_us: Option<f64>,
    /// The vCPUs' saved state loaded (`vcpus_us`).
    pub vcpus_us: Option<f64>,
    /// The VM's saved clock, PIT and irqchip loaded (`vm_us`).
    pub vm_us: Option<f64>,
    /// Platform and virtio devices restored and attached (`devices_us`).
    pub devices_us: Option<f64>,
}

/// The qemu backend's restore of a VM from its boot snapshot
/// ([`MSG_QEMU_RESTORED`]): when it was logged (once the machine runs,
/// after `cont`), the whole restore and its measured steps, in ms (a step
/// the line lacks is `None`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct QemuRestore {
    /// Wall time of the line (µs since the epoch).
    pub logged_at: i64,
    /// The restore's beginning (before the RAM copy) → the machine runs
    /// (`total_ms`).
    pub total_ms: f64,
    /// The snapshot's RAM data copied into a new memfd (`ram_ms`).
    pub ram_ms: Option<f64>,
    /// QEMU's QMP reached and the device state loaded (`load_ms`).
    pub load_ms: Option<f64>,
    /// The devices hot-plugged and `cont` (`hotplug_ms`).
    pub hotplug_ms: Option<f64>,
    /// RAM data copied (`ram_mib`).
    pub ram_mib: Option<f64>,
}

/// QEMU spawned ([`MSG_QEMU_STARTED`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct QemuStarted {
    /// Wall time of the line (µs since the epoch).
    pub at_us: i64,
    /// Its accelerator (`accel`).
    pub accel: String,
    /// QEMU's process id (`pid`).
    pub pid: Option<u32>,
}

/// A boot snapshot a cold boot took ([`MSG_SNAPSHOT_TAKEN`]; also read
/// back from a `bench boot --json` document, where a missing field is
/// `None`).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Deserialize)]
#[serde(default)]
pub struct SnapshotTaken {
    /// kvm: pausing, saving and resuming the VM (`snapshot_ms`).
    pub snapshot_ms: Option<f64>,
    /// qemu: the machine stopped for the device state and the RAM copy
    /// (`stopped_ms`; the files are synced while it runs on).
    pub stopped_ms: Option<f64>,
    /// Guest memory holding data, saved (`memory_data_mib`).
    pub memory_data_mib: Option<f64>,
    /// kvm: the memory file's blocks on disk (`memory_disk_mib`).
    pub memory_disk_mib: Option<f64>,
    /// The state file (`state_bytes`; qemu: QEMU's device state).
    pub state_bytes: Option<f64>,
}

/// The boot events of one helper run, each at its wall-clock time (µs).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BootEvents {
    /// `startVM` arrived at the daemon.
    pub start_vm_at: Option<i64>,
    /// kvm: the VM was built (logged when the VM thread reported it) and
    /// how long the build took.
    pub kvm_started: Option<(i64, f64)>,
    /// kvm: `first_run_ms` after the build began (from the end-of-run line).
    pub kvm_first_run_ms: Option<f64>,
    /// kvm: boot-port marks, in order.
    pub marks: Vec<Mark>,
    /// qemu: QEMU was spawned (the last line: after a failed restore, the
    /// QEMU that booted cold).
    pub qemu_started: Option<QemuStarted>,
    /// qemu: each vhost-user frontend connection (wall time), in order.
    pub frontend_connected: Vec<i64>,
    /// The agent's hello was read: wall time and its boot clock fields
    /// (`agent_start_us`, `init_done_us`, `userland_switched_us`,
    /// `connected_us`, guest `CLOCK_BOOTTIME`).
    pub agent_connected: Option<LogLine>,
    /// The `start` field ([`START_COLD`] or [`START_WARM`]) of the last
    /// [`MSG_KVM_STARTED`] or [`MSG_QEMU_STARTED`] line (a qemu warm start
    /// whose restore failed logs `warm`, then `cold`); `None` from a helper
    /// that predates the backend's warm start.
    pub start: Option<String>,
    /// kvm: the VM was restored from a snapshot.
    pub restore: Option<Restore>,
    /// qemu: the machine was restored from its boot snapshot.
    pub qemu_restore: Option<QemuRestore>,
    /// The agent's connection was accepted ([`MSG_AGENT_DIALLED`], the
    /// first).
    pub agent_dialled: Option<i64>,
    /// A cold boot took the boot snapshot.
    pub snapshot_taken: Option<SnapshotTaken>,
    /// A snapshot could not be restored (the `error` field, or the message
    /// when there is none); the start booted cold.
    pub restore_failed: Option<String>,
    /// Why a cold boot with snapshots on took no snapshot (the message,
    /// with its `error` field when there is one).
    pub no_snapshot: Option<String>,
}

/// The `error` field of `line` (parsed as `l`). The helper writes it last
/// and unquoted (`error = %e`, its `Display`), so it runs to the end of
/// the line; a quoted one comes from the parsed fields.
fn error_of(line: &str, l: &LogLine) -> Option<String> {
    let (_, after) = line.split_once(l.message.as_str())?;
    let (_, value) = after.split_once(" error=")?;
    if value.starts_with('"') {
        l.fields.get("error").cloned()
    } else {
        Some(value.trim_end().to_string())
    }
}

/// The line's message, followed by its `error` field when it has one.
fn with_error(line: &str, l: &LogLine) -> String {
    match error_of(line, l) {
        Some(e) => format!("{}: {e}", l.message),
        None => l.message.clone(),
    }
}

/// The helper's log text.
pub struct HelperLog<'a>(pub &'a str);

impl HelperLog<'_> {
    /// Collects every boot event the log holds.
    pub fn parse(&self) -> BootEvents {
        let mut ev = BootEvents::default();
        for line in self.0.lines() {
            if let Some(l) = parse_line(line, MSG_START_VM) {
                ev.start_vm_at.get_or_insert(l.at_us);
            } else if let Some(l) = parse_line(line, MSG_KVM_STARTED) {
                ev.start = l.fields.get("start").cloned();
                if let Some(b) = l.num("build_ms") {
                    ev.kvm_started.get_or_insert((l.at_us, b));
                }
            } else if let Some(l) = parse_line(line, MSG_VM_RESTORED) {
                if let (None, Some(total_us)) = (&ev.restore, l.num("restore_us")) {
                    ev.restore = Some(Restore {
                        logged_at: l.at_us,
                        total_us,
                        state_us: l.num("state_us"),
                        kvm_us: l.num("kvm_us"),
                        memory_us: l.num("memory_us"),
                        vcpus_us: l.num("vcpus_us"),
                        vm_us: l.num("vm_us"),
                        devices_us: l.num("devices_us"),
                    });
                }
            } else if let Some(l) = parse_line(line, MSG_QEMU_RESTORED) {
                if let (None, Some(total_ms)) = (&ev.qemu_restore, l.num("total_ms")) {
                    ev.qemu_restore = Some(QemuRestore {
                        logged_at: l.at_us,
                        total_ms,
                        ram_ms: l.num("ram_ms"),
                        load_ms: l.num("load_ms"),
                        hotplug_ms: l.num("hotplug_ms"),
                        ram_mib: l.num("ram_mib"),
                    });
                }
            } else if let Some(l) = parse_line(line, MSG_AGENT_DIALLED) {
                ev.agent_dialled.get_or_insert(l.at_us);
            } else if let Some(l) = parse_line(line, MSG_SNAPSHOT_TAKEN) {
                ev.snapshot_taken.get_or_insert(SnapshotTaken {
                    snapshot_ms: l.num("snapshot_ms"),
                    stopped_ms: l.num("stopped_ms"),
                    memory_data_mib: l.num("memory_data_mib"),
                    memory_disk_mib: l.num("memory_disk_mib"),
                    state_bytes: l.num("state_bytes"),
                });
            } else if let Some(l) = parse_line(line, MSG_RESTORE_FAILED) {
                ev.restore_failed
                    .get_or_insert_with(|| error_of(line, &l).unwrap_or(l.message));
            } else if let Some(l) = MSG_NO_SNAPSHOT.iter().find_map(|m| parse_line(line, m)) {
                ev.no_snapshot.get_or_insert_with(|| with_error(line, &l));
            } else if let Some(l) = parse_line(line, MSG_KVM_ENDED) {
                if ev.kvm_first_run_ms.is_none() {
                    ev.kvm_first_run_ms = l.num("first_run_ms");
                }
            } else if let Some(l) = parse_line(line, MSG_BOOT_MARK) {
                let value = l.fields.get("value").and_then(|v| v.parse().ok());
                let at = l.fields.get("at_us").and_then(|v| v.parse().ok());
                if let (Some(value), Some(at_us)) = (value, at) {
                    ev.marks.push(Mark {
                        value,
                        at_us,
                        logged_at: l.at_us,
                    });
                }
            } else if let Some(l) = parse_line(line, MSG_QEMU_STARTED) {
                ev.start = l.fields.get("start").cloned();
                ev.qemu_started = Some(QemuStarted {
                    at_us: l.at_us,
                    accel: l.fields.get("accel").cloned().unwrap_or_default(),
                    pid: l.fields.get("pid").and_then(|p| p.parse().ok()),
                });
            } else if let Some(l) = parse_line(line, MSG_AGENT_CONNECTED) {
                ev.agent_connected.get_or_insert(l);
            } else if let Some((ts, rest)) = line.split_once(' ') {
                // `vhost-user-<device>: frontend connected socket=...`
                let msg = rest
                    .trim_start()
                    .split_once(' ')
                    .map(|(_, m)| m.trim_start());
                if let (Some(at), Some(msg)) = (parse_timestamp(ts), msg) {
                    let head = msg.split(" socket=").next().unwrap_or(msg);
                    if head.starts_with("vhost-user-") && head.ends_with(MSG_FRONTEND_CONNECTED) {
                        ev.frontend_connected.push(at);
                    }
                }
            }
        }
        ev
    }
}

/// A warm start's helper log as the helper writes it (trimmed to the
/// lines [`HelperLog::parse`] reads, plus some it must skip): startVM at
/// 02:00:00, the restore ending 41 ms later after 30 ms, the agent
/// redialling at the VMM's 89 ms (its mark stamped with the snapshot's
/// guest clock) and its final hello read at 180 ms; the hello's boot
/// times are the snapshot's own boot.
#[cfg(test)]
pub(super) const WARM_LOG: &str = r#"2026-12-06T02:00:00.000000Z  INFO startVM profile=bench-boot backend="kvm"
2026-12-06T02:00:00.041000Z  INFO VM restored from a snapshot restore_us=30000 state_us=2000 kvm_us=8000 memory_us=5000 vcpus_us=6000 vm_us=1000 devices_us=8000 vcpus=2 mem_mib=1024
2026-12-06T02:00:00.041500Z  INFO kvm vm started image=/work/target/guest-image kernel=/work/target/guest-image/vmlinux memory_mib=1024 cpus=2 start="warm" build_ms=33.1
2026-12-06T02:00:00.100020Z  INFO guest boot milestone value=2734688858 at_us=89000
2026-12-06T02:00:00.110000Z  INFO guest agent dialled vsock port 51234 ms=60
2026-12-06T02:00:00.180000Z  INFO guest agent connected backend="kvm" agent="0.1.0" kernel="6.1.0-28-cloud-amd64" boot_ms=179.8 agent_start_us=1200000 init_done_us=2500000 userland_switched_us=1900000 connected_us=2650000
2026-12-06T02:00:01.000000Z  INFO kvm vm stopped how=the guest powered the VM off ms=40
2026-12-06T02:00:01.000100Z  INFO kvm vm ended how=the guest powered the VM off run_ms=950 build_ms=30.012 first_run_ms=32.5 teardown_ms=4.1 boot_marks=0xa3@89ms/guest2650ms
"#;

/// The helper log of a cold boot that took the boot snapshot (a warm
/// series' unmeasured first boot): the agent's first connection is
/// snapshotted, then it dials again.
#[cfg(test)]
pub(super) const SNAPSHOT_LOG: &str = r#"2026-12-06T01:59:50.000000Z  INFO startVM profile=bench-boot backend="kvm"
2026-12-06T01:59:50.030000Z  INFO kvm vm started image=/work/target/guest-image kernel=/work/target/guest-image/vmlinux memory_mib=1024 cpus=2 start="cold" build_ms=29.5
2026-12-06T01:59:52.700000Z  INFO guest agent dialled vsock port 51234 ms=2650
2026-12-06T01:59:53.600000Z  INFO VM snapshot taken dir=/tmp/cowork-bench-7-data-kvm-warm/snapshots/kvm-0123456789abcdef state_bytes=48213 memory_data_mib=301 memory_disk_mib=305 state_ms=3.2 total_ms=880.4
2026-12-06T01:59:53.600200Z  INFO boot snapshot taken dir=/tmp/cowork-bench-7-data-kvm-warm/snapshots/kvm-0123456789abcdef memory_data_mib=301 memory_disk_mib=305 state_bytes=48213 snapshot_ms=884.75
2026-12-06T01:59:53.700000Z  INFO guest agent connected backend="kvm" agent="0.1.0" boot_ms=3700.1 agent_start_us=1200000 connected_us=2650000
"#;

/// A qemu warm start's helper log (trimmed as [`WARM_LOG`]; the real
/// `qemu started` line also has `qemu`, `image` and `accel_reason`):
/// startVM at 03:00:00, the restore beginning 0.5 ms later (the RAM copy
/// first, so QEMU is spawned at 118 ms) and the machine running at 182 ms,
/// the blk frontends connecting as QEMU starts and the hot-plugged ones
/// before `cont`, the agent's dial accepted at 647.4 ms and its final hello
/// read at 729 ms; the hello's boot times are the snapshot's own boot.
#[cfg(test)]
pub(super) const QEMU_WARM_LOG: &str = r#"2026-12-06T03:00:00.000000Z  INFO startVM profile=bench-boot backend="qemu"
2026-12-06T03:00:00.118000Z  INFO qemu started pid=4486 accel="tcg" memory_mib=1024 cpus=2 start="warm"
2026-12-06T03:00:00.135000Z  INFO vhost-user-blk: frontend connected socket=/r/root0.sock
2026-12-06T03:00:00.135400Z  INFO vhost-user-blk: frontend connected socket=/r/blk.sock
2026-12-06T03:00:00.170000Z  INFO vhost-user-fs: frontend connected socket=/r/fs.sock
2026-12-06T03:00:00.174000Z  INFO vhost-user-rng: frontend connected socket=/r/rng.sock
2026-12-06T03:00:00.177000Z  INFO vhost-user-vsock: frontend connected socket=/r/vsock.sock
2026-12-06T03:00:00.182000Z  INFO qemu boot snapshot restored ram_mib=120 ram_ms=115.4 load_ms=49.7 hotplug_ms=14.6 total_ms=181.5
2026-12-06T03:00:00.647400Z  INFO guest agent dialled vsock port 51234 ms=465
2026-12-06T03:00:00.729000Z  INFO guest agent connected backend="qemu" agent="0.1.0" kernel="6.1.0-57-cloud-amd64" boot_ms=729.09 agent_start_us=1307030 init_done_us=2005816 userland_switched_us=1953684 connected_us=2612472
2026-12-06T03:00:00.870000Z  INFO vhost-user-vsock: frontend disconnected socket=/r/vsock.sock
"#;

/// The helper log of a qemu cold boot that took the boot snapshot: the
/// devices hot-plugged after the snapshot connect before its files are
/// synced and it is logged taken.
#[cfg(test)]
pub(super) const QEMU_SNAPSHOT_LOG: &str = r#"2026-12-06T02:59:50.000000Z  INFO startVM profile=bench-boot backend="qemu"
2026-12-06T02:59:50.003000Z  INFO qemu started pid=4432 accel="tcg" memory_mib=1024 cpus=2 start="cold"
2026-12-06T02:59:50.023000Z  INFO vhost-user-blk: frontend connected socket=/r/root0.sock
2026-12-06T02:59:52.700000Z  INFO vhost-user-vsock: frontend connected socket=/r/vsock.sock
2026-12-06T02:59:52.800000Z  INFO boot snapshot taken dir=/tmp/cowork-bench-7-data-qemu-warm/snapshots/qemu-e10577e775a4d2be memory_data_mib=120 state_bytes=467573 stopped_ms=159.64516
2026-12-06T02:59:53.150000Z  INFO guest agent dialled vsock port 51234 ms=446
2026-12-06T02:59:53.400000Z  INFO guest agent connected backend="qemu" agent="0.1.0" boot_ms=3400.2 agent_start_us=1307030 connected_us=2781698
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_epoch_microseconds() {
        assert_eq!(parse_timestamp("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(parse_timestamp("1970-01-01T00:00:01.5Z"), Some(1_500_000));
        // date -u -d 2026-12-03T05:51:10Z +%s = 1796277070
        assert_eq!(
            parse_timestamp("2026-12-03T05:51:10.053471Z"),
            Some(1_796_277_070_053_471)
        );
        for bad in [
            "2026-12-03 05:51:10Z",
            "2026-13-03T05:51:10Z",
            "x",
            "2026-12-03T05:51:10.0a1Z",
        ] {
            assert_eq!(parse_timestamp(bad), None, "{bad}");
        }
    }

    #[test]
    fn lines_give_message_fields_and_time() {
        let l = parse_line(
            r#"2026-12-03T05:51:10.053471Z  INFO guest agent connected backend="kvm" agent=0.1.0 boot_ms=812.5 agent_start_us=401234 connected_us=700000"#,
            MSG_AGENT_CONNECTED,
        )
        .unwrap();
        assert_eq!(l.level, "INFO");
        assert_eq!(l.fields["backend"], "kvm");
        assert_eq!(l.num("boot_ms"), Some(812.5));
        assert_eq!(l.num("agent_start_us"), Some(401_234.0));
        // Another message, or a longer one sharing the prefix, does not match.
        assert!(parse_line("2026-12-03T05:51:10Z  INFO startVMx a=1", MSG_START_VM).is_none());
        assert!(parse_line("guest console text", MSG_START_VM).is_none());
        let l = parse_line(
            r#"2026-12-03T05:51:10Z  INFO kvm vm ended how="the guest \"powered\" off" first_run_ms=3.25"#,
            MSG_KVM_ENDED,
        )
        .unwrap();
        assert_eq!(l.fields["how"], r#"the guest "powered" off"#);
        assert_eq!(l.num("first_run_ms"), Some(3.25));
    }

    #[test]
    fn a_log_gives_the_boot_events() {
        let log = "\
2026-12-03T05:00:00.000000Z  INFO startVM profile=p backend=\"qemu\"
2026-12-03T05:00:00.010000Z  INFO qemu started pid=7 accel=\"tcg\" memory_mib=1024
2026-12-03T05:00:00.100000Z  INFO vhost-user-vsock: frontend connected socket=/r/vsock.sock
2026-12-03T05:00:00.120000Z  INFO vhost-user-blk: frontend connected socket=/r/blk.sock
some guest console line
2026-12-03T05:00:00.150000Z  INFO guest boot milestone value=2701131778 at_us=1500
2026-12-03T05:00:03.000000Z  INFO guest agent connected backend=\"qemu\" agent_start_us=1000000 connected_us=2500000
";
        let ev = HelperLog(log).parse();
        let base = parse_timestamp("2026-12-03T05:00:00Z").unwrap();
        assert_eq!(ev.start_vm_at, Some(base));
        assert_eq!(
            ev.qemu_started,
            Some(QemuStarted {
                at_us: base + 10_000,
                accel: "tcg".into(),
                pid: Some(7),
            })
        );
        // A qemu helper from before its warm start: no start field.
        assert_eq!(ev.start, None);
        assert_eq!(ev.frontend_connected, vec![base + 100_000, base + 120_000]);
        assert_eq!(
            ev.marks,
            vec![Mark {
                value: 2_701_131_778,
                at_us: 1500,
                logged_at: base + 150_000
            }]
        );
        let hello = ev.agent_connected.unwrap();
        assert_eq!(hello.at_us, base + 3_000_000);
        assert_eq!(hello.num("connected_us"), Some(2_500_000.0));
        assert!(ev.kvm_started.is_none() && ev.kvm_first_run_ms.is_none());
        assert!(ev.qemu_restore.is_none() && ev.agent_dialled.is_none());
    }

    #[test]
    fn a_qemu_warm_start_gives_its_restore_steps_and_dial() {
        let ev = HelperLog(QEMU_WARM_LOG).parse();
        let base = parse_timestamp("2026-12-06T03:00:00Z").unwrap();
        assert_eq!(ev.start.as_deref(), Some(START_WARM));
        assert_eq!(
            ev.qemu_started,
            Some(QemuStarted {
                at_us: base + 118_000,
                accel: "tcg".into(),
                pid: Some(4486),
            })
        );
        assert_eq!(
            ev.qemu_restore,
            Some(QemuRestore {
                logged_at: base + 182_000,
                total_ms: 181.5,
                ram_ms: Some(115.4),
                load_ms: Some(49.7),
                hotplug_ms: Some(14.6),
                ram_mib: Some(120.0),
            })
        );
        assert_eq!(ev.agent_dialled, Some(base + 647_400));
        assert_eq!(ev.frontend_connected.len(), 5);
        assert_eq!(ev.agent_connected.map(|h| h.at_us), Some(base + 729_000));
        assert!(ev.restore.is_none() && ev.kvm_started.is_none());
        assert!(ev.snapshot_taken.is_none() && ev.restore_failed.is_none());

        // The snapshot-taking boot: cold, its snapshot as qemu logs it.
        let ev = HelperLog(QEMU_SNAPSHOT_LOG).parse();
        assert_eq!(ev.start.as_deref(), Some(START_COLD));
        assert!(ev.qemu_restore.is_none());
        assert_eq!(
            ev.snapshot_taken,
            Some(SnapshotTaken {
                snapshot_ms: None,
                stopped_ms: Some(159.64516),
                memory_data_mib: Some(120.0),
                memory_disk_mib: None,
                state_bytes: Some(467_573.0),
            })
        );

        // A restore that failed once QEMU ran: a warm line, the failure,
        // then the QEMU that booted cold (the last line counts).
        let log = r#"2026-12-06T03:00:00.000000Z  INFO startVM profile=bench-boot backend="qemu"
2026-12-06T03:00:00.118000Z  INFO qemu started pid=10 accel="tcg" memory_mib=1024 cpus=2 start="warm"
2026-12-06T03:00:00.300000Z  WARN the boot snapshot cannot be restored; removed, booting cold dir=/s/qemu-e10577e775a4d2be error=QMP: the connection closed
2026-12-06T03:00:00.310000Z  INFO qemu started pid=11 accel="tcg" memory_mib=1024 cpus=2 start="cold"
2026-12-06T03:00:03.000000Z  WARN the guest agent never said its template point on the console; no boot snapshot
"#;
        let ev = HelperLog(log).parse();
        assert_eq!(ev.start.as_deref(), Some(START_COLD));
        assert_eq!(ev.qemu_started.map(|q| q.pid), Some(Some(11)));
        assert_eq!(
            ev.restore_failed.as_deref(),
            Some("QMP: the connection closed")
        );
        assert_eq!(
            ev.no_snapshot.as_deref(),
            Some("the guest agent never said its template point on the console; no boot snapshot")
        );
    }

    #[test]
    fn a_warm_start_gives_its_kind_and_restore_phases() {
        let ev = HelperLog(WARM_LOG).parse();
        let base = parse_timestamp("2026-12-06T02:00:00Z").unwrap();
        assert_eq!(ev.start.as_deref(), Some(START_WARM));
        assert_eq!(ev.kvm_started, Some((base + 41_500, 33.1)));
        assert_eq!(ev.kvm_first_run_ms, Some(32.5));
        assert_eq!(
            ev.restore,
            Some(Restore {
                logged_at: base + 41_000,
                total_us: 30_000.0,
                state_us: Some(2_000.0),
                kvm_us: Some(8_000.0),
                memory_us: Some(5_000.0),
                vcpus_us: Some(6_000.0),
                vm_us: Some(1_000.0),
                devices_us: Some(8_000.0),
            })
        );
        assert_eq!(ev.marks.len(), 1);
        assert_eq!(ev.marks[0].at_us, 89_000);
        assert_eq!(ev.agent_connected.map(|h| h.at_us), Some(base + 180_000));
        assert!(ev.snapshot_taken.is_none() && ev.restore_failed.is_none());
        assert!(ev.no_snapshot.is_none());
    }

    #[test]
    fn a_cold_boot_gives_its_snapshot_or_why_there_is_none() {
        let ev = HelperLog(SNAPSHOT_LOG).parse();
        assert_eq!(ev.start.as_deref(), Some(START_COLD));
        assert!(ev.restore.is_none());
        // The VMM's own "VM snapshot taken" line is not the backend's.
        assert_eq!(
            ev.snapshot_taken,
            Some(SnapshotTaken {
                snapshot_ms: Some(884.75),
                stopped_ms: None,
                memory_data_mib: Some(301.0),
                memory_disk_mib: Some(305.0),
                state_bytes: Some(48_213.0),
            })
        );
        assert!(ev.no_snapshot.is_none());

        // A restore that failed, then a cold boot whose snapshot failed too.
        let log = r#"2026-12-06T02:00:00.000000Z  INFO startVM profile=bench-boot backend="kvm"
2026-12-06T02:00:00.020000Z  WARN the boot snapshot cannot be restored; removed, booting cold dir=/s/kvm-0123456789abcdef error=snapshot state: the key differs (another helper build)
2026-12-06T02:00:00.050000Z  INFO kvm vm started image=/i kernel=/i/vmlinux memory_mib=1024 cpus=2 start="cold" build_ms=28.0
2026-12-06T02:00:03.000000Z  WARN cannot take the boot snapshot; the next start boots cold again dir=/s/kvm-0123456789abcdef error=writing the memory file: No space left on device (os error 28)
"#;
        let ev = HelperLog(log).parse();
        assert_eq!(ev.start.as_deref(), Some(START_COLD));
        assert_eq!(
            ev.restore_failed.as_deref(),
            Some("snapshot state: the key differs (another helper build)")
        );
        assert_eq!(
            ev.no_snapshot.as_deref(),
            Some("cannot take the boot snapshot; the next start boots cold again: writing the memory file: No space left on device (os error 28)")
        );
        assert!(ev.snapshot_taken.is_none());
        // An agent without a template point: the message alone.
        let ev = HelperLog(
            "2026-12-06T02:00:03Z  INFO the guest agent has no template point; no boot snapshot\n",
        )
        .parse();
        assert_eq!(
            ev.no_snapshot.as_deref(),
            Some("the guest agent has no template point; no boot snapshot")
        );
        // A helper from before warm start: no start field.
        let ev = HelperLog(
            "2026-12-06T02:00:00Z  INFO kvm vm started image=/i kernel=/i/vmlinux memory_mib=1024 cpus=2 build_ms=28.0\n",
        )
        .parse();
        assert_eq!(ev.start, None);
        assert_eq!(ev.kvm_started.map(|s| s.1), Some(28.0));
    }
}
