//! Test support: re-running a test inside fresh namespaces with `unshare(1)`
//! so its mounts (and chroot) never touch the machine running the tests.
//!
//! The outer half (the test as `cargo test` runs it) makes a scratch
//! directory, re-executes the test binary for exactly that test under
//! `unshare <flags>`, checks that it ran and passed, and removes the
//! directory; the inner half finds the directory in [`NS_DIR_ENV`] and runs
//! the body.

use std::path::PathBuf;

/// Environment variable telling a re-executed test it runs inside its
/// namespaces, and naming the scratch directory its outer half made for it.
pub const NS_DIR_ENV: &str = "GUEST_AGENT_NS_DIR";

/// Inside a re-executed test: its scratch directory. Outside: `None`.
pub fn inside() -> Option<PathBuf> {
    std::env::var_os(NS_DIR_ENV).map(PathBuf::from)
}

/// Whether a test that needs real root (not the root of a user namespace:
/// loop devices, ext4 mounts, `redirect_dir`) can run here; says why not.
pub fn real_root_or_skip(why: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    let ok = inside().is_some() || unsafe { libc::geteuid() } == 0;
    if !ok {
        eprintln!("skipping: {why} needs real root (not a user namespace)");
    }
    ok
}

/// Re-runs test `name` (its full path) under `unshare <flags>` with a fresh
/// scratch directory and returns `None` after checking it passed; inside,
/// returns the directory so the test body runs.
pub fn in_namespaces(name: &str, flags: &[&str]) -> Option<PathBuf> {
    if let Some(d) = inside() {
        return Some(d);
    }
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new("unshare")
        .args(flags)
        .arg("--")
        .arg(exe)
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(NS_DIR_ENV, dir.path())
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
