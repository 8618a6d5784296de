//! virtio-vsock: one device model, two faces.
//!
//! * [`packet`]: `virtio_vsock_hdr` and byte-stream access to descriptor
//!   chains.
//! * [`conn`]: one connection's state machine and credit accounting.
//! * [`muxer`]: the connection table (RST for unknown ports, connection
//!   limit, local port allocation, host-side polling).
//! * [`backend`]: the host side the helper uses ([`VsockHost`],
//!   [`Listener`]): streams for guest- and host-initiated connections,
//!   optional mapping of ports to host Unix sockets.
//! * [`device`]: the model over the three virtqueues ([`VsockModel`]) and the
//!   in-process face for the vmm's virtio-mmio transport ([`VsockDevice`]).
//!
//! The vhost-user face is [`crate::vhost_user::vsock`].
//!
//! Using it (either face):
//!
//! ```text
//! let host = VsockHost::new()?;                       // before the VM starts
//! let agent = host.listen(guest_agent::proto::AGENT_PORT)?;
//! // in-process: Box::new(VsockDevice::new(cid, VsockConfig::default(), host.clone())?)
//! //             handed to vmm::virtio::MmioTransport::new
//! // QEMU:       VhostUserVsockServer::bind(&VhostUserVsockConfig::new(sock, cid), &host)?.spawn()?
//! let stream: std::os::unix::net::UnixStream = agent.accept()?;   // guest dialled 2:AGENT_PORT
//! let out = host.connect(guest_port, DEFAULT_CONNECT_TIMEOUT)?;    // host dials the guest
//! host.map_unix(port, "/path/to/tool.sock")?;                      // optional forwarding
//! ```
//!
//! Limits: stream sockets only (no SEQPACKET, no DGRAM); the host is CID 2
//! and the only peer (no sibling VMs); one device model per [`VsockHost`] at
//! a time; writes to host streams rely on SIGPIPE being ignored (Rust
//! binaries do so by default).

pub mod backend;
pub mod conn;
pub mod device;
pub mod muxer;
pub mod packet;

#[cfg(test)]
mod tests;

pub use backend::{ConnectError, HostError, Listener, VsockHost, DEFAULT_CONNECT_TIMEOUT};
pub use device::{VsockDevice, VsockDeviceError, VsockModel, VIRTIO_ID_VSOCK};

/// Default receive buffer we advertise per connection (`buf_alloc`): the
/// most guest data buffered on the host side of one connection.
pub const DEFAULT_BUF_ALLOC: u32 = 256 * 1024;
/// Default connection limit.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;

/// Tunables of the device model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VsockConfig {
    /// Most simultaneous connections; guest REQUESTs beyond it get RST and
    /// host connects fail with [`ConnectError::Limit`].
    pub max_connections: usize,
    /// Receive buffer advertised to the guest per connection.
    pub buf_alloc: u32,
}

impl Default for VsockConfig {
    fn default() -> Self {
        Self {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            buf_alloc: DEFAULT_BUF_ALLOC,
        }
    }
}
