//! vhost-user faces of the device models.

pub mod blk;
pub mod fs;
pub mod rng;
pub(crate) mod single_queue;
pub mod vsock;
