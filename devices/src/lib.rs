//! Device models for cowork-helper's microVMs.
//!
//! [`vsock`] is a virtio-vsock device model over `virtio-queue` that knows
//! nothing of KVM or vhost-user. It has two faces: [`vsock::VsockDevice`]
//! plugs into the vmm's in-process virtio-mmio transport, and
//! [`vhost_user::vsock`] serves the same model to QEMU (or any vhost-user
//! frontend) over a Unix socket. Either way the helper talks to the guest
//! through a [`vsock::VsockHost`] handle.

pub mod blk;
pub mod fs;
pub mod rng;
pub mod vhost_user;
pub mod vsock;
