//! Whether a QEMU end-to-end suite may run here. It needs QEMU and the
//! guest image (plus what the suite itself names); when something is
//! missing the suite skips with a framed notice saying what and how to get
//! it, unless [`QEMU_TESTS_ENV`] is `1`, which makes it a failure (CI).
//!
//! The notice is written to the process's stderr directly (libtest's
//! capture only takes `print!`/`eprint!`), so a plain `cargo test` shows it.
//! The nested-KVM suites have their own gate (`COWORK_NESTED_TESTS`, see
//! [`super::nested`]).

use cowork_helper::backend::qemu;

/// Environment variable that makes a missing prerequisite of a QEMU suite
/// a failure instead of a skip.
pub const QEMU_TESTS_ENV: &str = "COWORK_QEMU_TESTS";

/// Whether [`QEMU_TESTS_ENV`] is `1`.
pub fn qemu_tests_required() -> bool {
    std::env::var(QEMU_TESTS_ENV).is_ok_and(|v| v == "1")
}

/// Why QEMU cannot be used here, or `None` when it can.
pub fn qemu_missing() -> Option<String> {
    // As the helper finds it: `--qemu`'s variable, its `PATH`.
    let wanted = std::env::var_os(qemu::QEMU_ENV).map(std::path::PathBuf::from);
    let env = cowork_helper::cli::Environment::read();
    qemu::find_qemu(wanted.as_deref(), &env.host)
        .err()
        .map(|e| e.to_string())
}

/// Whether `test` may run given what is `missing` (one reason each, `None`
/// for what is there). Panics, saying `what` cannot run, when the suite is
/// required; otherwise prints the skip notice and returns `false`.
pub fn qemu_gate(
    test: &str,
    what: &str,
    missing: impl IntoIterator<Item = Option<String>>,
) -> bool {
    let missing: Vec<String> = missing.into_iter().flatten().collect();
    if missing.is_empty() {
        return true;
    }
    assert!(
        !qemu_tests_required(),
        "{QEMU_TESTS_ENV}=1 but {what} cannot run: {}",
        missing.join("; ")
    );
    super::nested::loud_notice(&format!(
        "SKIPPED {test}: {}\n(set {QEMU_TESTS_ENV}=1 to make this a failure)",
        missing.join("; ")
    ));
    false
}
