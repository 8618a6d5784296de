//! `cowork-helper doctor` as people use it: piped into a reader that goes
//! away early (`doctor | head -n1`, `doctor | grep -q kvm`) it ends quietly,
//! without a panic message.

use std::io::Read;
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};

#[test]
fn doctor_whose_reader_went_away_ends_quietly() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_cowork-helper"))
        .args(["doctor", "--backend", "sandbox"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start cowork-helper doctor");
    // The reader leaves before doctor printed anything (its probes take
    // milliseconds), so its first line meets a closed pipe.
    drop(child.stdout.take());
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut stderr)
        .expect("stderr");
    let status = child.wait().expect("doctor's status");
    assert!(!stderr.contains("panicked"), "doctor panicked: {stderr}");
    assert_eq!(status.signal(), Some(libc::SIGPIPE), "{status}: {stderr}");
}
