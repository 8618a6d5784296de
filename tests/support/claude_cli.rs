//! The real Claude Code CLI for the tests that run it: the native Linux
//! binary from npm, fetched and cached by `scripts/fetch-claude-cli.sh`
//! (offline once cached: the newest cached version is used when npm cannot
//! be reached).
//!
//! Where neither npm nor the cache has it, [`fetch_or_skip`] skips loudly,
//! unless [`super::gate::QEMU_TESTS_ENV`] is `1` (CI), which makes it a
//! failure.

use std::path::PathBuf;
use std::process::Command;

use super::gate::{qemu_tests_required, QEMU_TESTS_ENV};
use super::nested::loud_notice;

/// The cached CLI.
#[derive(Clone, Debug)]
pub struct ClaudeCli {
    /// The binary (`<cache>/claude-cli/<version>/claude`).
    pub path: PathBuf,
    /// Its version, e.g. `2.1.337`.
    pub version: String,
}

/// The CLI from npm (cached by the script), or why not.
pub fn fetch() -> Result<ClaudeCli, String> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/fetch-claude-cli.sh");
    let out = Command::new(&script)
        .arg("--quiet")
        .output()
        .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
    if !out.status.success() {
        return Err(format!(
            "scripts/fetch-claude-cli.sh failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let var = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(k))
            .map(str::to_string)
            .ok_or_else(|| format!("fetch-claude-cli.sh printed no {k}: {text}"))
    };
    Ok(ClaudeCli {
        path: PathBuf::from(var("CLAUDE_CLI=")?),
        version: var("CLAUDE_CLI_VERSION=")?,
    })
}

/// [`fetch`], or `None` after a loud notice that `what` is skipped; panics
/// instead when [`QEMU_TESTS_ENV`] is `1`.
pub fn fetch_or_skip(what: &str) -> Option<ClaudeCli> {
    match fetch() {
        Ok(cli) => Some(cli),
        Err(why) => {
            assert!(
                !qemu_tests_required(),
                "{QEMU_TESTS_ENV}=1 but the CLI is unavailable: {why}"
            );
            loud_notice(&format!(
                "SKIPPED {what}: {why}\n(set {QEMU_TESTS_ENV}=1 to make this a failure)"
            ));
            None
        }
    }
}
