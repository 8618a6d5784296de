//! Granting a directory must not change the helper's umask.
//!
//! fuse-backend-rs's `PassthroughFs::import` (run for every grant, and again
//! when a grant is destroyed) sets the process umask to 0; `GrantFs` puts
//! the helper's back, or every file the helper created afterwards would be
//! world-writable. The umask is process-wide, so this is the only test in
//! its binary.

use devices::fs::{GrantMode, SessionFs, SessionFsOptions};

#[test]
fn granting_and_removing_keep_the_helpers_umask() {
    let dir = tempfile::tempdir().unwrap();
    // SAFETY: umask only swaps the process file mode creation mask.
    let original = unsafe { libc::umask(0o027) };
    let fs = SessionFs::new(SessionFsOptions::default());
    let id = fs
        .add_grant("s", "m", dir.path(), GrantMode::Rw)
        .expect("grant");
    fs.remove_grant(id).expect("remove");
    drop(fs);
    // A file the helper creates afterwards still gets the helper's mask.
    let probe = dir.path().join("probe");
    std::fs::write(&probe, b"x").unwrap();
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&probe).unwrap().permissions());
    // SAFETY: as above.
    let during = unsafe { libc::umask(original) };
    assert_eq!(during, 0o027, "the umask changed");
    assert_eq!(mode & 0o777, 0o640);
}
