//! The fsync record writer of the data-safety tests (`data_safety`,
//! `data_safety_kvm`): a session appends numbered records to a file on the
//! session disk, fsyncs after each and acknowledges it on stdout, while
//! another process keeps the disk busy with unsynced writes; after the
//! machine ends (stopVM, or killed outright) every acknowledged record must
//! be on the disk, whole.

use std::time::{Duration, Instant};

use cowork_helper::client::{Pipe, Subscription};
use serde_json::Value;

use super::session::{assert_exit_0, run, sh, spawn};

/// Bytes of one record the fsync writer appends (payload and header).
pub const RECORD_LEN: usize = 4096;
/// Acknowledged records to see before the machine is ended.
pub const ACKS_BEFORE_STOP: u64 = 150;

/// The fsync writer: appends [`RECORD_LEN`]-byte records (`seq`, a payload
/// derived from it, newline) to the file `argv[2]`, fsyncs after each, then
/// prints `ack <seq>`.
const WRITER: &str = r#"
import os, sys
LEN = int(sys.argv[1])
fd = os.open(sys.argv[2], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
seq = 0
while True:
    seq += 1
    head = b"%08d " % seq
    body = (b"%08d" % (seq * 7919 % 100000000)) * LEN
    rec = head + body[: LEN - len(head) - 1] + b"\n"
    os.write(fd, rec)
    os.fsync(fd)
    sys.stdout.write("ack %d\n" % seq)
    sys.stdout.flush()
"#;

/// The record the writer appends as number `seq`.
fn record(seq: u64) -> Vec<u8> {
    let head = format!("{seq:08} ");
    let unit = format!("{:08}", seq * 7919 % 100_000_000);
    let mut rec = head.into_bytes();
    let body = unit.repeat(RECORD_LEN);
    rec.extend_from_slice(&body.as_bytes()[..RECORD_LEN - rec.len() - 1]);
    rec.push(b'\n');
    rec
}

/// Starts heavy unsynced writes (`bulk-<tag>`) and the fsync writer
/// (`writer-<tag>`, records in `file`) in `session`; returns once at least
/// [`ACKS_BEFORE_STOP`] records were acknowledged (all within `limit`), with the last ack seen.
pub async fn write_records(
    pipe: &Pipe,
    sub: &mut Subscription,
    limit: Duration,
    session: &str,
    tag: &str,
    file: &str,
) -> u64 {
    let writer = format!("writer-{tag}");
    pipe.call(
        "spawn",
        sh(
            &format!("bulk-{tag}"),
            session,
            "while :; do dd if=/dev/zero of=bulk bs=1M count=48 status=none; done",
        ),
    )
    .await
    .expect("spawn bulk");
    pipe.call(
        "spawn",
        spawn(
            &writer,
            session,
            "python3",
            &["-c", WRITER, &RECORD_LEN.to_string(), file],
        ),
    )
    .await
    .expect("spawn writer");
    let mut acked = 0u64;
    let mut text = String::new();
    let deadline = Instant::now() + limit;
    while acked < ACKS_BEFORE_STOP {
        let left = deadline.saturating_duration_since(Instant::now());
        let ev = sub
            .next_matching(left, |v: &Value| {
                v["id"] == writer.as_str() && (v["type"] == "stdout" || v["type"] == "exit")
            })
            .await
            .unwrap_or_else(|e| panic!("{writer}: {e} after {acked} acks"));
        assert_eq!(ev["type"], "stdout", "the writer ended early: {ev} {text}");
        text.push_str(ev["data"].as_str().unwrap_or_default());
        while let Some(nl) = text.find('\n') {
            let line: String = text.drain(..=nl).collect();
            let n: u64 = line
                .trim()
                .strip_prefix("ack ")
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("writer said {line:?}"));
            assert_eq!(n, acked + 1, "acks out of order");
            acked = n;
        }
    }
    acked
}

/// Reads `file` in `session` and checks that records 1..=`acked` are all
/// there, intact (the reading process done within `limit`); returns the
/// bytes found beyond them.
pub async fn check_records(
    pipe: &Pipe,
    sub: &mut Subscription,
    limit: Duration,
    session: &str,
    id: &str,
    file: &str,
    acked: u64,
) -> usize {
    let out = run(
        pipe,
        sub,
        sh(id, session, &format!("wc -c < {file} && base64 -w0 {file}")),
        limit,
    )
    .await;
    assert_exit_0("reading the records", &out);
    let stdout = out.stdout_str();
    let mut lines = stdout.lines();
    let size: usize = lines.next().unwrap_or_default().trim().parse().unwrap();
    let data = base64::Engine::decode(
        &base64::engine::general_purpose::STANDARD,
        lines.next().unwrap_or_default(),
    )
    .expect("base64 records");
    assert_eq!(data.len(), size);
    assert!(
        data.len() >= acked as usize * RECORD_LEN,
        "{} bytes hold fewer than the {acked} acknowledged records",
        data.len()
    );
    for seq in 1..=acked {
        let at = (seq as usize - 1) * RECORD_LEN;
        assert!(
            data[at..at + RECORD_LEN] == record(seq)[..],
            "record {seq} of {acked} acknowledged is damaged"
        );
    }
    data.len() - acked as usize * RECORD_LEN
}

/// File of the records written before `stopVM`.
const STOP_FILE: &str = "records-stop";
/// File of the records written before the machine is killed.
const KILL_FILE: &str = "records-kill";

/// A running VM of a backend, for [`fsync_case`]: its client and how it
/// boots and dies.
pub trait Rig {
    /// The client of the profile under test.
    fn client(&mut self) -> (&Pipe, &mut Subscription);
    /// Everything the helper (the current one) logged.
    fn log(&self) -> String;
    /// startVM that must succeed; `what` names the boot in messages.
    async fn start(&mut self, what: &str);
    /// Ends the machine the hard way in the middle of the writes (no
    /// power-off, no sync) and returns once the next [`Rig::start`] can
    /// boot the same profile.
    async fn kill(&mut self);
}

/// The fsync case on a rig whose VM runs: records until
/// [`ACKS_BEFORE_STOP`] acks, `stopVM`, boot, every acknowledged record
/// intact; records again, the machine killed, boot (the journal replayed),
/// every acknowledged record of both files intact. Each line of `report`
/// says what was seen; `limit` bounds every step.
pub async fn fsync_case(rig: &mut impl Rig, limit: Duration, session: &str) -> Vec<String> {
    let mut report = Vec::new();
    let (pipe, sub) = rig.client();
    let acked = write_records(pipe, sub, limit, session, "stop", STOP_FILE).await;
    let stop_sent = Instant::now();
    pipe.call("stopVM", serde_json::json!({}))
        .await
        .expect("stopVM");
    report.push(format!(
        "stopVM after {acked} acknowledged records took {:?}",
        stop_sent.elapsed()
    ));
    rig.start("after stopVM").await;
    let (pipe, sub) = rig.client();
    let beyond = check_records(pipe, sub, limit, session, "check-stop", STOP_FILE, acked).await;
    report.push(format!(
        "stopVM: all {acked} acknowledged records intact, {beyond} bytes beyond them"
    ));

    let acked = write_records(pipe, sub, limit, session, "kill", KILL_FILE).await;
    rig.kill().await;
    rig.start("after the kill").await;
    let log = rig.log();
    assert!(
        log.contains(super::session_disk::NOT_CLEAN),
        "a killed VM's disk needs its journal replayed: {log}"
    );
    let (pipe, sub) = rig.client();
    let beyond = check_records(pipe, sub, limit, session, "check-kill", KILL_FILE, acked).await;
    // The first file is still whole too.
    check_records(pipe, sub, limit, session, "check-stop-2", STOP_FILE, 1).await;
    report.push(format!(
        "killed: all {acked} acknowledged records intact, {beyond} bytes beyond them"
    ));
    report
}
