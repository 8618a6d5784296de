//! vhost-user faces of the device models.

pub mod vsock;
