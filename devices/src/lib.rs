//! Device models for cowork-helper's microVMs: virtio-vsock ([`vsock`]),
//! virtio-fs with per-session grants ([`fs`]), virtio-blk ([`blk`]),
//! virtio-rng ([`rng`]) and virtio-balloon with free page reporting
//! ([`balloon`], in-process only: it gives memory the guest freed back to the
//! host).
//!
//! Each model works on `virtio-queue` queues and guest memory and knows
//! nothing of KVM or vhost-user. It has two faces:
//! * in-process, for the vmm's virtio-mmio transport ([`vsock::VsockDevice`],
//!   [`fs::device::FsDevice`], [`blk::BlkDevice`], [`rng::RngDevice`]): each holds a
//!   `vmm::virtio::in_process::DeviceCommon` (type, queue sizes, features,
//!   read-only config space) and implements
//!   `vmm::virtio::in_process::InProcessDevice`, which makes it a
//!   `vmm::virtio::VirtioDevice`; its worker thread is
//!   `vmm::virtio::worker`'s, and blk and rng, which serve one queue, run the
//!   whole of `vmm::virtio::single_queue` over their model's
//!   `vmm::virtio::single_queue::QueueModel`;
//! * over vhost-user, for QEMU or any vhost-user frontend ([`vhost_user`]):
//!   blk and rng through one single-queue backend driving the same
//!   `QueueModel`, vsock and fs through backends of their own.
//!
//! The helper talks to the guest's vsock through a [`vsock::VsockHost`]
//! handle and manages virtio-fs grants through [`fs::SessionFs`].

pub mod balloon;
pub mod blk;
pub mod fs;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
pub mod rng;
pub mod vhost_user;
pub mod vsock;
