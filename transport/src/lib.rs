//! mesh transport: QUIC endpoints with cluster mutual TLS, and framed rkyv envelopes.
//!
//! - [`tls`]: the cluster CA (`mesh cert init`), node certificates (`mesh cert issue`), and the
//!   rustls configurations; every connection is mutually authenticated and a peer's node
//!   name is its certificate's common name.
//! - [`endpoint`]: one quinn endpoint per node that accepts and dials; one long-lived
//!   connection per peer is kept by the layer above (`mesh-actors`).
//! - [`frame`]: `MS | version | length | rkyv` frames, validated on receipt with a size limit.
//!
//! The transport knows nothing of message types: the wire enums live in `mesh-actors`.

pub mod endpoint;
pub mod frame;
pub mod tls;

pub use endpoint::{wire_version, Endpoint, PeerConnection, TransportConfig};
pub use frame::{read_frame, write_frame, FrameError, DEFAULT_MAX_FRAME, WIRE_VERSION};
pub use tls::{Identity, IdentityPaths};

/// Errors of the transport layer.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// Certificates or keys could not be created, read or used.
    #[error("tls: {0}")]
    Tls(String),
    /// The UDP socket could not be bound (address in use, no permission).
    #[error("binding {addr}: {reason}")]
    Bind {
        /// Address.
        addr: std::net::SocketAddr,
        /// Why.
        reason: String,
    },
    /// Dialing a peer failed (unreachable, handshake refused: e.g. a certificate from
    /// another cluster).
    #[error("connecting to {addr}: {reason}")]
    Connect {
        /// Address.
        addr: std::net::SocketAddr,
        /// Why.
        reason: String,
    },
    /// A setting is out of range.
    #[error("config: {0}")]
    Config(String),
    /// Socket-level failure.
    #[error("io: {0}")]
    Io(String),
}
