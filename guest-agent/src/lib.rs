//! The cowork guest agent and the host<->agent protocol.
//!
//! Layering (arrows point only downwards; nothing outside [`agent`] imports
//! `agent::`):
//!
//! * **Protocol**, shared with the host (`cowork-helper`): framing
//!   ([`framing`]), the message types ([`proto`]), signal and name rules
//!   ([`signal`], [`names`]), the boot milestone values the agent writes to
//!   our VMM ([`milestone`]), and the ext superblock fields both sides read
//!   from disks ([`extfs`]), and the log writer that keeps each event on
//!   one line ([`logline`]).
//! * **Host-or-guest services**: the session-disk [`janitor`], which the
//!   agent serves and the host runs itself when no agent runs, over the
//!   system-call wrappers ([`sys`]) and this process's mount table
//!   ([`mounttable`]); the wrappers and the loopback set-up ([`net`]) also
//!   serve the host's namespace sandbox, which does the agent's init duties
//!   for a sandbox.
//! * **The agent** ([`agent`]): the guest's init in a VM, or a plain process
//!   inside the namespace sandbox; it dials the host and serves spawn/exec,
//!   files, mounts and the janitor. It uses everything above. It is public
//!   because two executables run it through [`agent::main_with_args`]: this
//!   crate's `cowork-guest-agent` (the guest image's `/init`) and
//!   `cowork-helper` itself (its hidden `__agent` entry, which the sandbox
//!   backend starts inside the sandbox).

pub mod agent;
pub mod egress;
pub mod extfs;
pub mod framing;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
pub mod janitor;
pub mod logline;
pub mod milestone;
pub mod mounttable;
pub mod names;
pub mod net;
pub mod proto;
pub mod signal;
pub mod sync;
pub mod sys;
