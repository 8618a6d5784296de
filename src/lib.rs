//! `cowork-helper`: the daemon the Claude desktop client starts as
//! `<helper> -socket $XDG_RUNTIME_DIR/claude-cowork-vm.sock`.
//!
//! It serves the client's length-prefixed JSON protocol ([`server`],
//! [`protocol`]), keeps per-profile state ([`daemon`]), runs one sandbox VM
//! per profile with the guest agent inside ([`vm`]), and fans the agent's
//! process events out to the client's subscriptions ([`events`]).
//! Backends ([`backend`]): the namespace sandbox ([`backend::sandbox`]), QEMU
//! driving our own virtio devices over vhost-user ([`backend::qemu`]), and
//! the in-process KVM machine of the `vmm` crate ([`backend::kvm`]).
//! [`cli`] is the command line (serving, [`doctor`], `bench`, `vm run`,
//! [`install`]/`uninstall` at the client's helper path, [`image_build`]);
//! [`shutdown`] says when serving ends (a signal, or the client gone).
//!
//! Dependencies point one way: [`daemon`] → [`vm`] → [`backend`] (which
//! never reaches back into [`vm`]); docs/architecture.md has the module
//! map.

pub mod backend;
pub mod bench;
pub mod cli;
pub mod client;
pub mod daemon;
pub mod doctor;
pub mod egress;
pub mod events;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
pub mod hostfs;
pub mod image_build;
pub mod install;
pub mod logging;
pub mod probe;
pub mod protocol;
pub mod server;
pub mod shutdown;
pub mod utf8;
pub mod vm;
