//! The cowork guest agent and the host<->agent protocol.
//!
//! The library half is shared with the host (`cowork-helper`): framing
//! ([`framing`]), the message types ([`proto`]), signal and name rules
//! ([`signal`], [`names`]). The binary `cowork-guest-agent` is the guest's init
//! in a VM, or a plain process inside the namespace sandbox; it dials the host
//! and serves spawn/exec, files, mounts and the session-disk janitor.

pub mod agent;
pub mod framing;
pub mod janitor;
pub mod names;
pub mod proto;
pub mod signal;
