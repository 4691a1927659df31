//! QUIC endpoints: one UDP socket per node that both accepts and dials, with
//! mutual TLS from the cluster CA on every connection.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::pki_types::CertificateDer;

use crate::tls::{common_name, Identity, CLUSTER_SAN};
use crate::TransportError;

/// Connection-level settings.
#[derive(Debug, Clone)]
pub struct TransportConfig {
    /// QUIC keep-alive interval (keeps idle connections open through NATs and lets the
    /// idle timeout detect a dead peer).
    pub keep_alive: Duration,
    /// A connection with no packets for this long is closed (a peer that vanished).
    pub idle_timeout: Duration,
    /// Concurrent bidirectional streams a peer may open (requests in flight per peer).
    pub max_bidi_streams: u32,
}

impl Default for TransportConfig {
    fn default() -> Self {
        Self {
            keep_alive: Duration::from_millis(500),
            idle_timeout: Duration::from_secs(5),
            max_bidi_streams: 1024,
        }
    }
}

/// A mutually authenticated connection to a named peer.
#[derive(Debug, Clone)]
pub struct PeerConnection {
    /// The connection.
    pub conn: quinn::Connection,
    /// The peer's node name, read from its certificate.
    pub peer: String,
}

/// The wire version a connection speaks: the one its TLS handshake chose by ALPN (see
/// [`crate::frame::alpn`]). A handshake without a common version fails, so every
/// established connection has one; the oldest is assumed otherwise.
pub fn wire_version(conn: &quinn::Connection) -> u16 {
    conn.handshake_data()
        .and_then(|d| d.downcast::<quinn::crypto::rustls::HandshakeData>().ok())
        .and_then(|d| d.protocol)
        .and_then(|p| crate::frame::alpn_version(&p))
        .unwrap_or(crate::frame::OLDEST_WIRE_VERSION)
}

/// This node's QUIC endpoint.
#[derive(Debug, Clone)]
pub struct Endpoint {
    ep: quinn::Endpoint,
    name: String,
}

fn peer_name(conn: &quinn::Connection) -> Result<String, TransportError> {
    let certs = conn
        .peer_identity()
        .and_then(|any| any.downcast::<Vec<CertificateDer<'static>>>().ok())
        .ok_or_else(|| TransportError::Tls("peer presented no certificate".into()))?;
    let first = certs
        .first()
        .ok_or_else(|| TransportError::Tls("peer presented no certificate".into()))?;
    common_name(first)
}

impl Endpoint {
    /// Binds `addr` (UDP) for both accepting and dialing.
    pub fn bind(
        identity: &Identity,
        addr: SocketAddr,
        cfg: &TransportConfig,
    ) -> Result<Self, TransportError> {
        let mut transport = quinn::TransportConfig::default();
        transport
            .keep_alive_interval(Some(cfg.keep_alive))
            .max_idle_timeout(Some(
                cfg.idle_timeout
                    .try_into()
                    .map_err(|_| TransportError::Config("idle_timeout too large".into()))?,
            ))
            .max_concurrent_bidi_streams(cfg.max_bidi_streams.into())
            // Wider windows than quinn's defaults: KV pages are MiB-sized bulk transfers.
            .stream_receive_window((8u32 << 20).into())
            .receive_window((32u32 << 20).into())
            .send_window(32 << 20)
            .max_concurrent_uni_streams(1024u32.into());
        let transport = Arc::new(transport);
        let server_crypto = QuicServerConfig::try_from(identity.server.clone())
            .map_err(|e| TransportError::Tls(format!("server config: {e}")))?;
        let mut server = quinn::ServerConfig::with_crypto(Arc::new(server_crypto));
        server.transport_config(transport.clone());
        let client_crypto = QuicClientConfig::try_from(identity.client.clone())
            .map_err(|e| TransportError::Tls(format!("client config: {e}")))?;
        let mut client = quinn::ClientConfig::new(Arc::new(client_crypto));
        client.transport_config(transport);
        let mut ep = quinn::Endpoint::server(server, addr).map_err(|e| TransportError::Bind {
            addr,
            reason: e.to_string(),
        })?;
        ep.set_default_client_config(client);
        Ok(Self {
            ep,
            name: identity.name.clone(),
        })
    }

    /// This node's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The bound UDP address.
    pub fn local_addr(&self) -> Result<SocketAddr, TransportError> {
        self.ep
            .local_addr()
            .map_err(|e| TransportError::Io(e.to_string()))
    }

    /// Dials `addr`; resolves once both sides have verified each other.
    ///
    /// Cancel safety: cancel-safe (an abandoned handshake is dropped).
    pub async fn connect(&self, addr: SocketAddr) -> Result<PeerConnection, TransportError> {
        let connecting =
            self.ep
                .connect(addr, CLUSTER_SAN)
                .map_err(|e| TransportError::Connect {
                    addr,
                    reason: e.to_string(),
                })?;
        let conn = connecting.await.map_err(|e| TransportError::Connect {
            addr,
            reason: e.to_string(),
        })?;
        let peer = peer_name(&conn)?;
        Ok(PeerConnection { conn, peer })
    }

    /// Waits for the next authenticated incoming connection; `None` once the endpoint closed.
    /// Handshake failures (unknown certificates, garbage) are logged and skipped.
    ///
    /// Cancel safety: cancel-safe.
    pub async fn accept(&self) -> Option<PeerConnection> {
        loop {
            let incoming = self.ep.accept().await?;
            let remote = incoming.remote_address();
            match incoming.await {
                Ok(conn) => match peer_name(&conn) {
                    Ok(peer) => return Some(PeerConnection { conn, peer }),
                    Err(e) => {
                        tracing::warn!(%remote, error = %e, "refused connection");
                        conn.close(0x01u32.into(), b"bad identity");
                    }
                },
                Err(e) => tracing::warn!(%remote, error = %e, "refused connection"),
            }
        }
    }

    /// Closes every connection with `code` and the socket.
    pub fn close(&self, code: u32) {
        self.ep.close(code.into(), b"node leaving");
    }

    /// Waits until every connection is closed (after [`Self::close`]), for at most `limit`.
    pub async fn wait_idle(&self, limit: Duration) {
        let _ = tokio::time::timeout(limit, self.ep.wait_idle()).await;
    }
}
