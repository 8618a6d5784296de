//! The integration-test harness of the root package, included by every
//! suite that needs it with `mod support;`. Each module has one concern:
//!
//! - [`helper_process`]: what every harness starting the helper shares (the
//!   binary, its output captured, waiting for its socket, SIGTERM then
//!   SIGKILL, its log when a test fails);
//! - [`daemon`]: the sandbox protocol suites' helpers (`--backend sandbox`,
//!   many at once, logs in memory, a shared one per test binary) and the
//!   protocol steps they share;
//! - [`fake_agent`]: the misbehaving guest agent of the hostility tests, run
//!   by the sandbox from the suite's own test binary;
//! - [`gate`]: whether a QEMU suite may run here (a loud skip, or a failure
//!   under `COWORK_QEMU_TESTS=1`);
//! - [`nested`]: the nested-KVM harness and the guest-image scripts, and the
//!   `COWORK_NESTED_TESTS` gate;
//! - [`vm_helper`]: the VM suites' helper process (its log in a file) and the
//!   guest image it uses;
//! - [`session`]: driving a VM's sessions over the socket protocol as the
//!   client does (connect and configure, startVM, spawn and collect, readFile);
//! - [`session_checks`]: the checks both VM backends make of a session
//!   (host folders, the default userland);
//! - [`session_disk`]: the profile's session disk (`sessiondata.img`) seen
//!   from the host and through the protocol;
//! - [`fsync_records`]: the data-safety tests' fsync record writer and its
//!   check;
//! - [`procfs`]: what `/proc` says about the helper and its children;
//! - [`debroot`]: throwaway Debian roots for the package tests
//!   (`package_deb`), and their `COWORK_PACKAGE_TESTS` gate;
//! - [`netns`]: network namespaces, a veth pair and test servers for the
//!   egress tests (`egress_netns`, `egress_vm`);
//! - [`mock_api`]: a mock of the Anthropic API over TLS, with a test CA, that
//!   the real CLI completes a turn against, recording every request;
//! - [`claude_cli`]: the real Claude Code CLI, fetched and cached by
//!   `scripts/fetch-claude-cli.sh`, or a loud skip.
//! - [`tls_upstream`]: a loopback TLS upstream behind the egress proxy's
//!   interception (`egress_intercept`).
//!
//! It is test code: every failure panics with what was seen.

// Each test binary uses a different part of the support code.
#![allow(dead_code)]

pub mod claude_cli;
pub mod daemon;
pub mod debroot;
pub mod fake_agent;
pub mod fsync_records;
pub mod gate;
pub mod helper_process;
pub mod mock_api;
pub mod nested;
pub mod netns;
pub mod procfs;
pub mod session;
pub mod session_checks;
pub mod session_disk;
pub mod tls_upstream;
pub mod vm_helper;
