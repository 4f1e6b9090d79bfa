//! What happens between a QUIC connection's TLS handshake and its first job: the peer's identity
//! read from its certificate, and the hello exchange on a short stream the client opens, where
//! both sides send [`Control::Hello`] with their protocol version. The server's hello is what
//! tells a client for sure that its certificate was accepted (TLS 1.3 lets the client finish
//! before the server has checked it). Failures are classified here, once, into
//! [`ConnectError`] and [`AcceptError`] with what an operator needs to know.

use std::net::SocketAddr;
use std::time::Duration;

use quinn::{ConnectionError, VarInt};

use crate::codec::DecodeError;
use crate::framing::{read_one, write_one, FrameReadError, FrameWriteError};
use crate::pki::{peer_identity, PeerIdentity};
use crate::session::error_code;
use crate::tls::{alert, AlertKind};
use crate::wire::{Control, Message};

/// Cap on a hello frame's body: a version and a node name, a few dozen bytes.
pub(crate) const HELLO_MAX_FRAME_BYTES: u32 = 4 << 10;

/// Errors connecting to a peer.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// quinn refused to start the connection (bad server name, endpoint stopping ...).
    #[error("cannot connect to {addr}: {reason}")]
    Start {
        /// The peer address.
        addr: SocketAddr,
        /// Why.
        reason: String,
    },
    /// The peer speaks another protocol version.
    #[error("protocol version mismatch: {addr} does not speak scd/{ours}")]
    VersionMismatch {
        /// The peer address.
        addr: SocketAddr,
        /// Our version.
        ours: u16,
    },
    /// The peer refused our certificate (not signed by its cluster CA, or missing).
    #[error("{addr} refused our certificate: {reason}")]
    Refused {
        /// The peer address.
        addr: SocketAddr,
        /// The TLS alert or reason.
        reason: String,
    },
    /// The peer's certificate is not signed by our cluster CA or does not match its name.
    #[error("{addr} presented an untrusted certificate: {reason}")]
    UntrustedPeer {
        /// The peer address.
        addr: SocketAddr,
        /// What rustls found wrong.
        reason: String,
    },
    /// No answer in time.
    #[error("{addr} did not answer (timed out)")]
    TimedOut {
        /// The peer address.
        addr: SocketAddr,
    },
    /// The connection failed for another reason.
    #[error("connecting to {addr}: {reason}")]
    Failed {
        /// The peer address.
        addr: SocketAddr,
        /// Why.
        reason: String,
    },
}

/// Errors accepting an incoming connection.
#[derive(Debug, thiserror::Error)]
pub enum AcceptError {
    /// The client speaks another protocol version.
    #[error("protocol version mismatch: {addr} does not speak scd/{ours}")]
    VersionMismatch {
        /// The client address.
        addr: SocketAddr,
        /// Our version.
        ours: u16,
    },
    /// The client presented no certificate or one not signed by the cluster CA.
    #[error("{addr} presented no trusted certificate: {reason}")]
    UntrustedPeer {
        /// The client address.
        addr: SocketAddr,
        /// What was wrong.
        reason: String,
    },
    /// The client did not complete the hello exchange.
    #[error("hello from {addr} failed: {reason}")]
    Hello {
        /// The client address.
        addr: SocketAddr,
        /// Why.
        reason: String,
    },
    /// The handshake failed for another reason.
    #[error("handshake with {addr}: {reason}")]
    Failed {
        /// The client address.
        addr: SocketAddr,
        /// Why.
        reason: String,
    },
}

/// Who this side is, for its hello.
#[derive(Debug, Clone)]
pub(crate) struct Hello {
    /// Our protocol version.
    pub(crate) protocol: u16,
    /// Our node name (from our certificate).
    pub(crate) node_id: String,
    /// How long the exchange may take.
    pub(crate) timeout: Duration,
}

impl Hello {
    fn message(&self) -> Message {
        Message::Control(Control::Hello {
            protocol: self.protocol,
            node_id: self.node_id.clone(),
        })
    }
}

/// The peer's identity, from the certificate it presented in the TLS handshake.
fn identity_of(conn: &quinn::Connection) -> Result<PeerIdentity, String> {
    let any = conn
        .peer_identity()
        .ok_or("peer presented no certificate")?;
    let chain = any
        .downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
        .map_err(|_| "peer identity is not a certificate chain")?;
    let leaf = chain
        .first()
        .ok_or("peer presented an empty certificate chain")?;
    peer_identity(leaf)
}

/// Client side, after the TLS handshake: read the server's identity, then send our hello and
/// check the server's. Closes the connection when the exchange fails.
pub(crate) async fn client(
    conn: &quinn::Connection,
    addr: SocketAddr,
    hello: &Hello,
) -> Result<PeerIdentity, ConnectError> {
    let ours = hello.protocol;
    let peer = identity_of(conn).map_err(|reason| ConnectError::UntrustedPeer { addr, reason })?;
    let exchange = async {
        let (mut send, mut recv) = conn
            .open_bi()
            .await
            .map_err(|e| classify_connect(addr, ours, e))?;
        write_one(&mut send, &hello.message(), HELLO_MAX_FRAME_BYTES)
            .await
            .map_err(|e| match e {
                FrameWriteError::Connection(c) => classify_connect(addr, ours, c),
                other => ConnectError::Failed {
                    addr,
                    reason: format!("hello: {other}"),
                },
            })?;
        let _ = send.finish();
        match read_one(&mut recv, HELLO_MAX_FRAME_BYTES)
            .await
            .map_err(|e| hello_read_error(addr, ours, e))?
        {
            Some(Message::Control(Control::Hello { protocol, .. })) if protocol == ours => Ok(()),
            Some(Message::Control(Control::Hello { .. })) => {
                Err(ConnectError::VersionMismatch { addr, ours })
            }
            other => Err(ConnectError::Failed {
                addr,
                reason: format!("expected a hello, got {other:?}"),
            }),
        }
    };
    match tokio::time::timeout(hello.timeout, exchange).await {
        Ok(Ok(())) => Ok(peer),
        Ok(Err(e)) => {
            conn.close(VarInt::from_u32(error_code::PROTOCOL), b"hello failed");
            Err(e)
        }
        Err(_) => {
            conn.close(VarInt::from_u32(error_code::PROTOCOL), b"hello timed out");
            Err(ConnectError::TimedOut { addr })
        }
    }
}

/// Server side, after the TLS handshake: read the client's identity, then wait for its hello
/// and answer with ours. Closes the connection when the exchange fails.
pub(crate) async fn server(
    conn: &quinn::Connection,
    addr: SocketAddr,
    hello: &Hello,
) -> Result<PeerIdentity, AcceptError> {
    let ours = hello.protocol;
    let peer = identity_of(conn).map_err(|reason| AcceptError::UntrustedPeer { addr, reason })?;
    let failed = |reason: String| AcceptError::Hello { addr, reason };
    let exchange = async {
        let (mut send, mut recv) = conn.accept_bi().await.map_err(|e| failed(e.to_string()))?;
        match read_one(&mut recv, HELLO_MAX_FRAME_BYTES)
            .await
            .map_err(|e| failed(e.to_string()))?
        {
            Some(Message::Control(Control::Hello { protocol, .. })) if protocol == ours => {}
            Some(Message::Control(Control::Hello { .. })) => {
                return Err(AcceptError::VersionMismatch { addr, ours })
            }
            other => return Err(failed(format!("expected a hello, got {other:?}"))),
        }
        write_one(&mut send, &hello.message(), HELLO_MAX_FRAME_BYTES)
            .await
            .map_err(|e| failed(e.to_string()))?;
        let _ = send.finish();
        Ok(())
    };
    match tokio::time::timeout(hello.timeout, exchange).await {
        Ok(Ok(())) => Ok(peer),
        Ok(Err(e)) => {
            conn.close(VarInt::from_u32(error_code::PROTOCOL), b"hello failed");
            Err(e)
        }
        Err(_) => {
            conn.close(VarInt::from_u32(error_code::PROTOCOL), b"hello timed out");
            Err(failed("timed out".into()))
        }
    }
}

/// A failed connection attempt, read as what it means for the operator.
pub(crate) fn classify_connect(addr: SocketAddr, ours: u16, e: ConnectionError) -> ConnectError {
    match alert(&e) {
        Some(AlertKind::NoCommonProtocol) => ConnectError::VersionMismatch { addr, ours },
        // A locally raised alert means we rejected them; one in a close frame, they us.
        Some(AlertKind::Certificate {
            raised_here: true,
            text,
        }) => ConnectError::UntrustedPeer { addr, reason: text },
        Some(AlertKind::Certificate {
            raised_here: false,
            text,
        }) => ConnectError::Refused { addr, reason: text },
        None => match e {
            ConnectionError::TimedOut => ConnectError::TimedOut { addr },
            other => ConnectError::Failed {
                addr,
                reason: other.to_string(),
            },
        },
    }
}

/// A failed incoming handshake, read as what it means for the operator.
pub(crate) fn classify_accept(addr: SocketAddr, ours: u16, e: ConnectionError) -> AcceptError {
    match alert(&e) {
        Some(AlertKind::NoCommonProtocol) => AcceptError::VersionMismatch { addr, ours },
        Some(AlertKind::Certificate { text, .. }) => {
            AcceptError::UntrustedPeer { addr, reason: text }
        }
        None => AcceptError::Failed {
            addr,
            reason: e.to_string(),
        },
    }
}

fn hello_read_error(addr: SocketAddr, ours: u16, e: FrameReadError) -> ConnectError {
    match e {
        FrameReadError::Connection(c) => classify_connect(addr, ours, c),
        FrameReadError::Decode(DecodeError::UnsupportedVersion { .. }) => {
            ConnectError::VersionMismatch { addr, ours }
        }
        other => ConnectError::Failed {
            addr,
            reason: format!("hello: {other}"),
        },
    }
}
