//! QUIC endpoints and connections with mutual TLS under the cluster CA.
//!
//! A node binds one [`Endpoint`] that both serves and connects; an admin client binds a
//! client-only one. Both sides present a certificate signed by the cluster CA and trust nothing
//! else, so a stranger is refused in the TLS handshake, before any stream is accepted. ALPN
//! carries the protocol version (`scd/1`): a peer speaking another version fails the handshake
//! with [`ConnectError::VersionMismatch`]. After the handshake the client opens a short hello
//! stream and both sides exchange [`Control::Hello`]; that round trip is what tells the client
//! for sure that the server accepted its certificate.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{ConnectionError, TransportErrorCode, VarInt};
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;

use crate::config::TransportOptions;
use crate::pacing::Pacer;
use crate::pki::{peer_identity, Identity, PeerIdentity};
use crate::session::error_code;
use crate::stream::{read_one, write_one, FrameReadError};
use crate::wire::{Control, Message};

// TLS alert numbers (RFC 8446 section 6); QUIC reports them as CRYPTO_ERROR 0x100 + alert.
const ALERT_BAD_CERTIFICATE: u8 = 42;
const ALERT_UNSUPPORTED_CERTIFICATE: u8 = 43;
const ALERT_CERTIFICATE_UNKNOWN: u8 = 46;
const ALERT_UNKNOWN_CA: u8 = 48;
const ALERT_ACCESS_DENIED: u8 = 49;
const ALERT_DECRYPT_ERROR: u8 = 51;
const ALERT_CERTIFICATE_REQUIRED: u8 = 116;
const ALERT_NO_APPLICATION_PROTOCOL: u8 = 120;

/// Errors setting up an endpoint.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// The identity's certificate or key is unusable for TLS.
    #[error("TLS configuration: {0}")]
    Tls(String),
    /// The identity cannot serve (an admin certificate has no server authentication).
    #[error("a {0} certificate cannot serve connections")]
    CannotServe(crate::pki::Role),
    /// The UDP socket could not be bound.
    #[error("binding {addr}: {source}")]
    Socket {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
}

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

/// Counts the tasks this crate spawned for an endpoint, so tests and shutdown can check that
/// none is left behind.
#[derive(Debug, Default)]
pub(crate) struct TaskCounter(AtomicUsize);

/// Decrements the counter when the task that holds it ends, however it ends.
pub(crate) struct TaskGuard(Arc<TaskCounter>);

impl TaskCounter {
    pub(crate) fn enter(self: &Arc<Self>) -> TaskGuard {
        self.0.fetch_add(1, Ordering::SeqCst);
        TaskGuard(Arc::clone(self))
    }
}

impl Drop for TaskGuard {
    fn drop(&mut self) {
        (self.0).0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) opts: TransportOptions,
    pub(crate) tasks: Arc<TaskCounter>,
}

/// A QUIC endpoint with the cluster identity.
#[derive(Debug, Clone)]
pub struct Endpoint {
    inner: quinn::Endpoint,
    me: PeerIdentity,
    shared: Arc<Shared>,
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn roots(identity: &Identity) -> Result<Arc<RootCertStore>, BindError> {
    let mut roots = RootCertStore::empty();
    roots
        .add(identity.ca.clone())
        .map_err(|e| BindError::Tls(format!("cluster CA: {e}")))?;
    Ok(Arc::new(roots))
}

fn server_config(
    identity: &Identity,
    opts: &TransportOptions,
) -> Result<quinn::ServerConfig, BindError> {
    let tls = |e: rustls::Error| BindError::Tls(e.to_string());
    let verifier = WebPkiClientVerifier::builder_with_provider(roots(identity)?, provider())
        .build()
        .map_err(|e| BindError::Tls(e.to_string()))?;
    let mut crypto = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(identity.cert_chain.clone(), identity.key.clone_key())
        .map_err(tls)?;
    crypto.alpn_protocols = vec![opts.alpn()];
    let quic = QuicServerConfig::try_from(crypto).map_err(|e| BindError::Tls(e.to_string()))?;
    let mut config = quinn::ServerConfig::with_crypto(Arc::new(quic));
    config.transport_config(opts.quinn_transport());
    Ok(config)
}

fn client_config(
    identity: &Identity,
    opts: &TransportOptions,
) -> Result<quinn::ClientConfig, BindError> {
    let tls = |e: rustls::Error| BindError::Tls(e.to_string());
    let mut crypto = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls)?
        .with_root_certificates(roots(identity)?)
        .with_client_auth_cert(identity.cert_chain.clone(), identity.key.clone_key())
        .map_err(tls)?;
    crypto.alpn_protocols = vec![opts.alpn()];
    let quic = QuicClientConfig::try_from(crypto).map_err(|e| BindError::Tls(e.to_string()))?;
    let mut config = quinn::ClientConfig::new(Arc::new(quic));
    config.transport_config(opts.quinn_transport());
    Ok(config)
}

/// A TLS alert carried by a connection error, with the reason text.
fn tls_alert(e: &ConnectionError) -> Option<(u8, String)> {
    let (code, reason) = match e {
        ConnectionError::TransportError(t) => (t.code, t.reason.clone()),
        ConnectionError::ConnectionClosed(c) => (
            c.error_code,
            String::from_utf8_lossy(&c.reason).into_owned(),
        ),
        _ => return None,
    };
    (0x100..0x200)
        .contains(&u64::from(code))
        .then(|| ((u64::from(code) - 0x100) as u8, reason))
        .filter(|(alert, _)| code == TransportErrorCode::crypto(*alert))
}

fn alert_text(alert: u8, reason: &str) -> String {
    let name = match alert {
        ALERT_BAD_CERTIFICATE => "bad certificate",
        ALERT_UNSUPPORTED_CERTIFICATE => "unsupported certificate",
        ALERT_CERTIFICATE_UNKNOWN => "certificate unknown",
        ALERT_UNKNOWN_CA => "unknown CA",
        ALERT_ACCESS_DENIED => "access denied",
        ALERT_DECRYPT_ERROR => "decrypt error",
        ALERT_CERTIFICATE_REQUIRED => "certificate required",
        ALERT_NO_APPLICATION_PROTOCOL => "no application protocol",
        _ => "TLS alert",
    };
    if reason.is_empty() {
        format!("{name} (alert {alert})")
    } else {
        format!("{name} (alert {alert}): {reason}")
    }
}

fn is_cert_alert(alert: u8) -> bool {
    matches!(
        alert,
        ALERT_BAD_CERTIFICATE
            | ALERT_UNSUPPORTED_CERTIFICATE
            | ALERT_CERTIFICATE_UNKNOWN
            | ALERT_UNKNOWN_CA
            | ALERT_ACCESS_DENIED
            | ALERT_DECRYPT_ERROR
            | ALERT_CERTIFICATE_REQUIRED
    )
}

impl Endpoint {
    /// A node endpoint on `addr` that serves connections and opens them.
    pub fn bind(
        addr: SocketAddr,
        identity: &Identity,
        opts: TransportOptions,
    ) -> Result<Self, BindError> {
        let me = own_identity(identity)?;
        if me.role != crate::pki::Role::Node {
            return Err(BindError::CannotServe(me.role));
        }
        let server = server_config(identity, &opts)?;
        let mut inner = quinn::Endpoint::server(server, addr)
            .map_err(|source| BindError::Socket { addr, source })?;
        inner.set_default_client_config(client_config(identity, &opts)?);
        Ok(Self::wrap(inner, me, opts))
    }

    /// A client-only endpoint on `addr` (admin clients; `127.0.0.1:0` or `[::]:0` usually).
    pub fn client(
        addr: SocketAddr,
        identity: &Identity,
        opts: TransportOptions,
    ) -> Result<Self, BindError> {
        let me = own_identity(identity)?;
        let mut inner =
            quinn::Endpoint::client(addr).map_err(|source| BindError::Socket { addr, source })?;
        inner.set_default_client_config(client_config(identity, &opts)?);
        Ok(Self::wrap(inner, me, opts))
    }

    fn wrap(inner: quinn::Endpoint, me: PeerIdentity, opts: TransportOptions) -> Self {
        Self {
            inner,
            me,
            shared: Arc::new(Shared {
                opts,
                tasks: Arc::default(),
            }),
        }
    }

    /// The local UDP address.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    /// This endpoint's own identity, from its certificate.
    pub fn identity(&self) -> &PeerIdentity {
        &self.me
    }

    /// The options the endpoint was built with.
    pub fn options(&self) -> &TransportOptions {
        &self.shared.opts
    }

    /// Tasks spawned by this crate for this endpoint's jobs that are still running.
    pub fn live_tasks(&self) -> usize {
        self.shared.tasks.0.load(Ordering::SeqCst)
    }

    /// Connect to the node `server_name` (the name in its certificate) at `addr`.
    pub async fn connect(
        &self,
        addr: SocketAddr,
        server_name: &str,
    ) -> Result<Connection, ConnectError> {
        let ours = self.shared.opts.protocol_version;
        let map = |e: ConnectionError| classify_connect(addr, ours, e);
        let connecting =
            self.inner
                .connect(addr, server_name)
                .map_err(|e| ConnectError::Start {
                    addr,
                    reason: e.to_string(),
                })?;
        let conn = connecting.await.map_err(map)?;
        let peer =
            conn_identity(&conn).map_err(|reason| ConnectError::UntrustedPeer { addr, reason })?;
        let hello = Message::Control(Control::Hello {
            protocol: ours,
            node_id: self.me.name.clone(),
        });
        let max = self.shared.opts.max_frame_bytes;
        let exchange = async {
            let (mut send, mut recv) = conn.open_bi().await.map_err(map)?;
            write_one(&mut send, &hello, max)
                .await
                .map_err(|e| hello_err(addr, ours, e))?;
            let _ = send.finish();
            match read_one(&mut recv, max)
                .await
                .map_err(|e| hello_err(addr, ours, e))?
            {
                Some(Message::Control(Control::Hello { protocol, .. })) if protocol == ours => {
                    Ok(())
                }
                Some(Message::Control(Control::Hello { .. })) => {
                    Err(ConnectError::VersionMismatch { addr, ours })
                }
                other => Err(ConnectError::Failed {
                    addr,
                    reason: format!("expected a hello, got {other:?}"),
                }),
            }
        };
        match tokio::time::timeout(self.shared.opts.open_timeout, exchange).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                conn.close(VarInt::from_u32(error_code::PROTOCOL), b"hello timed out");
                return Err(ConnectError::TimedOut { addr });
            }
        }
        Ok(Connection::new(conn, peer, Arc::clone(&self.shared)))
    }

    /// Wait for the next incoming connection; `None` once the endpoint is closed. Complete the
    /// handshake with [`Accepting::complete`] (in a task of its own, so one slow client does not
    /// hold up the others).
    pub async fn accept(&self) -> Option<Accepting> {
        let incoming = self.inner.accept().await?;
        Some(Accepting {
            incoming,
            shared: Arc::clone(&self.shared),
            me: self.me.name.clone(),
        })
    }

    /// Close every connection (peers see [`error_code::SHUTDOWN`]) and stop accepting.
    pub fn close(&self) {
        self.inner.close(
            VarInt::from_u32(error_code::SHUTDOWN),
            b"endpoint shutting down",
        );
    }

    /// Wait until every connection is closed and its close has been sent.
    pub async fn wait_idle(&self) {
        self.inner.wait_idle().await;
    }
}

fn own_identity(identity: &Identity) -> Result<PeerIdentity, BindError> {
    let leaf = identity
        .cert_chain
        .first()
        .ok_or_else(|| BindError::Tls("empty certificate chain".into()))?;
    peer_identity(leaf).map_err(BindError::Tls)
}

fn conn_identity(conn: &quinn::Connection) -> Result<PeerIdentity, String> {
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

fn classify_connect(addr: SocketAddr, ours: u16, e: ConnectionError) -> ConnectError {
    if let Some((alert, reason)) = tls_alert(&e) {
        if alert == ALERT_NO_APPLICATION_PROTOCOL {
            return ConnectError::VersionMismatch { addr, ours };
        }
        if is_cert_alert(alert) {
            // A locally raised alert means we rejected them; one in a close frame, they us.
            return match e {
                ConnectionError::TransportError(_) => ConnectError::UntrustedPeer {
                    addr,
                    reason: alert_text(alert, &reason),
                },
                _ => ConnectError::Refused {
                    addr,
                    reason: alert_text(alert, &reason),
                },
            };
        }
    }
    match e {
        ConnectionError::TimedOut => ConnectError::TimedOut { addr },
        other => ConnectError::Failed {
            addr,
            reason: other.to_string(),
        },
    }
}

fn hello_err(addr: SocketAddr, ours: u16, e: FrameReadError) -> ConnectError {
    match e {
        FrameReadError::Connection(c) => classify_connect(addr, ours, c),
        FrameReadError::Decode(crate::codec::DecodeError::UnsupportedVersion { .. }) => {
            ConnectError::VersionMismatch { addr, ours }
        }
        other => ConnectError::Failed {
            addr,
            reason: format!("hello: {other}"),
        },
    }
}

/// An incoming connection whose handshake is not finished.
pub struct Accepting {
    incoming: quinn::Incoming,
    shared: Arc<Shared>,
    me: String,
}

impl Accepting {
    /// The client's address.
    pub fn remote_address(&self) -> SocketAddr {
        self.incoming.remote_address()
    }

    /// Finish the TLS handshake (refusing clients without a certificate from the cluster CA)
    /// and the hello exchange.
    pub async fn complete(self) -> Result<Connection, AcceptError> {
        let addr = self.incoming.remote_address();
        let ours = self.shared.opts.protocol_version;
        let max = self.shared.opts.max_frame_bytes;
        let conn = self
            .incoming
            .await
            .map_err(|e| classify_accept(addr, ours, e))?;
        let peer =
            conn_identity(&conn).map_err(|reason| AcceptError::UntrustedPeer { addr, reason })?;
        let hello_err = |reason: String| AcceptError::Hello { addr, reason };
        let exchange = async {
            let (mut send, mut recv) = conn
                .accept_bi()
                .await
                .map_err(|e| hello_err(e.to_string()))?;
            match read_one(&mut recv, max)
                .await
                .map_err(|e| hello_err(e.to_string()))?
            {
                Some(Message::Control(Control::Hello { protocol, .. })) if protocol == ours => {}
                Some(Message::Control(Control::Hello { .. })) => {
                    return Err(AcceptError::VersionMismatch { addr, ours })
                }
                other => return Err(hello_err(format!("expected a hello, got {other:?}"))),
            }
            let hello = Message::Control(Control::Hello {
                protocol: ours,
                node_id: self.me.clone(),
            });
            write_one(&mut send, &hello, max)
                .await
                .map_err(|e| hello_err(e.to_string()))?;
            let _ = send.finish();
            Ok(())
        };
        match tokio::time::timeout(self.shared.opts.open_timeout, exchange).await {
            Ok(Ok(())) => Ok(Connection::new(conn, peer, self.shared)),
            Ok(Err(e)) => {
                conn.close(VarInt::from_u32(error_code::PROTOCOL), b"hello failed");
                Err(e)
            }
            Err(_) => {
                conn.close(VarInt::from_u32(error_code::PROTOCOL), b"hello timed out");
                Err(hello_err("timed out".into()))
            }
        }
    }
}

fn classify_accept(addr: SocketAddr, ours: u16, e: ConnectionError) -> AcceptError {
    if let Some((alert, reason)) = tls_alert(&e) {
        if alert == ALERT_NO_APPLICATION_PROTOCOL {
            return AcceptError::VersionMismatch { addr, ours };
        }
        if is_cert_alert(alert) {
            return AcceptError::UntrustedPeer {
                addr,
                reason: alert_text(alert, &reason),
            };
        }
    }
    AcceptError::Failed {
        addr,
        reason: e.to_string(),
    }
}

/// An established, authenticated connection to a peer. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Connection {
    pub(crate) inner: quinn::Connection,
    peer: PeerIdentity,
    pub(crate) shared: Arc<Shared>,
    pub(crate) pacer: Option<Arc<Pacer>>,
}

impl Connection {
    fn new(inner: quinn::Connection, peer: PeerIdentity, shared: Arc<Shared>) -> Self {
        let pacer = shared.opts.pacing.map(|p| Arc::new(Pacer::new(p)));
        Self {
            inner,
            peer,
            shared,
            pacer,
        }
    }

    /// Who the peer is, from its certificate.
    pub fn peer(&self) -> &PeerIdentity {
        &self.peer
    }

    /// The peer's address.
    pub fn remote_address(&self) -> SocketAddr {
        self.inner.remote_address()
    }

    /// Smoothed round-trip time.
    pub fn rtt(&self) -> std::time::Duration {
        self.inner.rtt()
    }

    /// Close the connection; every job on it ends on both sides.
    pub fn close(&self, reason: &str) {
        self.inner
            .close(VarInt::from_u32(error_code::SHUTDOWN), reason.as_bytes());
    }

    /// Wait until the connection is closed, and say why.
    pub async fn closed(&self) -> ConnectionError {
        self.inner.closed().await
    }
}
