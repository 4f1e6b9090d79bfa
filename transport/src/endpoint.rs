//! QUIC endpoints: binding a UDP socket with the cluster identity, connecting to peers and
//! accepting them.
//!
//! A node binds one [`Endpoint`] that both serves and connects; an admin client binds a
//! client-only one. Both sides present a certificate signed by the cluster CA and trust nothing
//! else ([`crate::tls`]), so a stranger is refused in the TLS handshake, before any stream is
//! accepted. ALPN carries the protocol version (`scd/<version>`, from
//! [`crate::wire::PROTOCOL_VERSION`]): a peer speaking another version fails the handshake with [`ConnectError::VersionMismatch`]. The hello exchange that follows is
//! [`crate::handshake`]'s; its result is a [`Connection`].

use std::net::SocketAddr;
use std::sync::Arc;

use quinn::VarInt;

use crate::budget::{BudgetStats, ReceiveBudget};
use crate::config::TransportOptions;
use crate::connection::{Connection, Shared};
use crate::handshake::{self, classify_accept, classify_connect, AcceptError, ConnectError, Hello};
use crate::pki::{peer_identity, Identity, PeerIdentity, Role};
use crate::session::error_code;
use crate::tls::{self, TlsConfigError};

/// Errors setting up an endpoint.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// The identity's certificate or key is unusable for TLS.
    #[error(transparent)]
    Tls(#[from] TlsConfigError),
    /// The identity's own certificate cannot be read.
    #[error("own certificate: {0}")]
    Identity(String),
    /// The identity cannot serve (an admin certificate has no server authentication).
    #[error("a {0} certificate cannot serve connections")]
    CannotServe(Role),
    /// The receive budget cannot hold even one frame of the largest size allowed (every such
    /// frame would be refused).
    #[error("receive budget of {budget} bytes is smaller than the frame cap of {max_frame} bytes: raise receive_budget_bytes or lower max_frame_bytes")]
    BudgetBelowFrameCap {
        /// The configured budget.
        budget: u64,
        /// The configured frame cap.
        max_frame: u32,
    },
    /// The UDP socket could not be bound.
    #[error("binding {addr}: {source}")]
    Socket {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
}

/// A QUIC endpoint with the cluster identity.
#[derive(Debug, Clone)]
pub struct Endpoint {
    inner: quinn::Endpoint,
    me: PeerIdentity,
    shared: Arc<Shared>,
}

impl Endpoint {
    /// A node endpoint on `addr` that serves connections and opens them.
    pub fn bind(
        addr: SocketAddr,
        identity: &Identity,
        opts: TransportOptions,
    ) -> Result<Self, BindError> {
        let me = own_identity(identity)?;
        if me.role != Role::Node {
            return Err(BindError::CannotServe(me.role));
        }
        check_budget(&opts)?;
        let server = tls::server_config(identity, opts.alpn(), opts.quinn_transport())?;
        let mut inner = quinn::Endpoint::server(server, addr)
            .map_err(|source| BindError::Socket { addr, source })?;
        inner.set_default_client_config(tls::client_config(
            identity,
            opts.alpn(),
            opts.quinn_transport(),
        )?);
        Ok(Self::wrap(inner, me, opts))
    }

    /// A client-only endpoint on `addr` (admin clients; `127.0.0.1:0` or `[::]:0` usually).
    pub fn client(
        addr: SocketAddr,
        identity: &Identity,
        opts: TransportOptions,
    ) -> Result<Self, BindError> {
        let me = own_identity(identity)?;
        check_budget(&opts)?;
        let mut inner =
            quinn::Endpoint::client(addr).map_err(|source| BindError::Socket { addr, source })?;
        inner.set_default_client_config(tls::client_config(
            identity,
            opts.alpn(),
            opts.quinn_transport(),
        )?);
        Ok(Self::wrap(inner, me, opts))
    }

    fn wrap(inner: quinn::Endpoint, me: PeerIdentity, opts: TransportOptions) -> Self {
        let budget = ReceiveBudget::new(opts.receive_budget_bytes);
        Self {
            inner,
            me,
            shared: Arc::new(Shared {
                opts,
                tasks: Arc::default(),
                budget,
            }),
        }
    }

    fn hello(&self) -> Hello {
        Hello {
            protocol: self.shared.opts.protocol_version,
            node_id: self.me.name.clone(),
            timeout: self.shared.opts.open_timeout,
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
        self.shared.tasks.live()
    }

    /// How the receive budget shared by all this endpoint's job streams is used.
    pub fn receive_budget(&self) -> BudgetStats {
        self.shared.budget.stats()
    }

    /// Connect to the node `server_name` (the name in its certificate) at `addr`.
    pub async fn connect(
        &self,
        addr: SocketAddr,
        server_name: &str,
    ) -> Result<Connection, ConnectError> {
        let ours = self.shared.opts.protocol_version;
        let connecting =
            self.inner
                .connect(addr, server_name)
                .map_err(|e| ConnectError::Start {
                    addr,
                    reason: e.to_string(),
                })?;
        let conn = connecting
            .await
            .map_err(|e| classify_connect(addr, ours, e))?;
        let peer = handshake::client(&conn, addr, &self.hello()).await?;
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
            hello: self.hello(),
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
        .ok_or_else(|| BindError::Identity("empty certificate chain".into()))?;
    peer_identity(leaf).map_err(BindError::Identity)
}

fn check_budget(opts: &TransportOptions) -> Result<(), BindError> {
    if opts.receive_budget_bytes < u64::from(opts.max_frame_bytes) {
        return Err(BindError::BudgetBelowFrameCap {
            budget: opts.receive_budget_bytes,
            max_frame: opts.max_frame_bytes,
        });
    }
    Ok(())
}

/// An incoming connection whose handshake is not finished.
pub struct Accepting {
    incoming: quinn::Incoming,
    shared: Arc<Shared>,
    hello: Hello,
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
        let conn = self
            .incoming
            .await
            .map_err(|e| classify_accept(addr, self.hello.protocol, e))?;
        let peer = handshake::server(&conn, addr, &self.hello).await?;
        Ok(Connection::new(conn, peer, self.shared))
    }
}
