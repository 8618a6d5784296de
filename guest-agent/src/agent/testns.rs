//! Test support: re-running a test inside fresh namespaces with `unshare(1)`
//! so its mounts (and chroot) never touch the machine running the tests.
//!
//! The outer half (the test as `cargo test` runs it) makes a scratch
//! directory, re-executes the test binary for exactly that test under
//! `unshare <flags>` and checks that it ran and passed; the inner half finds
//! the directory in [`NS_DIR_ENV`] and runs the body.

use std::path::{Path, PathBuf};

/// Environment variable telling a re-executed test it runs inside its
/// namespaces, and naming the scratch directory its outer half made for it.
pub const NS_DIR_ENV: &str = "GUEST_AGENT_NS_DIR";

/// Inside a re-executed test: its scratch directory. Outside: `None`.
pub fn inside() -> Option<PathBuf> {
    std::env::var_os(NS_DIR_ENV).map(PathBuf::from)
}

/// Re-runs test `name` (its full path) under `unshare <flags>` with `dir` as
/// its scratch directory and returns `None` after checking it passed;
/// inside, returns the directory so the test body runs.
pub fn in_namespaces(name: &str, flags: &[&str], dir: &Path) -> Option<PathBuf> {
    if let Some(d) = inside() {
        return Some(d);
    }
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new("unshare")
        .args(flags)
        .arg("--")
        .arg(exe)
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(NS_DIR_ENV, dir)
        .output()
        .expect("unshare(1) from util-linux runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{name} failed inside namespaces:\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("1 passed"),
        "{name} did not run inside namespaces:\n{stdout}\n{stderr}"
    );
    None
}
