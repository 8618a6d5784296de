//! Reading the measurements `bench boot` needs out of the helper's log.
//!
//! The helper under test logs one line per event through `tracing`'s text
//! format (`2026-12-03T05:51:10.053471Z  INFO message key=value ...`, see
//! `crate::logging`). The boot benchmark starts it with `COWORK_LOG=info`
//! and reads back the events that carry boot timings: the VMM's build and
//! first `KVM_RUN`, the boot-port marks, QEMU's start and its vhost-user
//! connections, and the agent's hello. [`HelperLog::parse`] turns the text
//! into typed records ([`BootEvents`]); nothing here derives a phase (that
//! is [`super::phases`]).
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
/// The qemu backend's line once QEMU was spawned (`pid`, `accel`).
pub const MSG_QEMU_STARTED: &str = "qemu started";
/// Suffix of each in-process vhost-user server's line when QEMU connects.
pub const MSG_FRONTEND_CONNECTED: &str = ": frontend connected";
/// The daemon's line once the agent's hello was read (its boot clock).
pub const MSG_AGENT_CONNECTED: &str = "guest agent connected";
/// The daemon's line when a `startVM` request arrives.
pub const MSG_START_VM: &str = "startVM";

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
    /// qemu: QEMU was spawned, and its accelerator.
    pub qemu_started: Option<(i64, String)>,
    /// qemu: each vhost-user frontend connection (wall time), in order.
    pub frontend_connected: Vec<i64>,
    /// The agent's hello was read: wall time and its boot clock fields
    /// (`agent_start_us`, `init_done_us`, `userland_switched_us`,
    /// `connected_us`, guest `CLOCK_BOOTTIME`).
    pub agent_connected: Option<LogLine>,
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
                if let Some(b) = l.num("build_ms") {
                    ev.kvm_started.get_or_insert((l.at_us, b));
                }
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
                let accel = l.fields.get("accel").cloned().unwrap_or_default();
                ev.qemu_started.get_or_insert((l.at_us, accel));
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
        assert_eq!(ev.qemu_started, Some((base + 10_000, "tcg".to_string())));
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
    }
}
