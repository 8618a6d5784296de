//! vhost-user faces of the device models.

pub mod fs;
pub mod vsock;
