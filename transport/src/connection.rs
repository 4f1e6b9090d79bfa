//! An established, authenticated connection to a peer, and the endpoint-wide state its job
//! streams share (options, the task counter, the receive budget). Opening and accepting jobs is
//! delegated to [`crate::stream`]; how a connection comes to exist is [`crate::endpoint`]'s.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use quinn::{ConnectionError, VarInt};

use crate::admin::{self, AdminCall, AdminError, AdminRequest};
use crate::budget::ReceiveBudget;
use crate::config::TransportOptions;
use crate::pacing::Pacer;
use crate::pki::PeerIdentity;
use crate::session::error_code;
use crate::stream::{self, AcceptJobError, JobReceiver, JobSender, JobStreams, OpenJobError};
use crate::tasks::TaskCounter;
use crate::wire::Control;
use scd_types::{JobId, TraceContext};

/// What every connection of one endpoint shares.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) opts: TransportOptions,
    pub(crate) tasks: Arc<TaskCounter>,
    pub(crate) budget: ReceiveBudget,
}

/// An established, authenticated connection to a peer. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Connection {
    inner: quinn::Connection,
    peer: PeerIdentity,
    shared: Arc<Shared>,
    pacer: Option<Arc<Pacer>>,
}

impl Connection {
    pub(crate) fn new(inner: quinn::Connection, peer: PeerIdentity, shared: Arc<Shared>) -> Self {
        let pacer = shared
            .opts
            .pacing_for(&peer.name)
            .map(|p| Arc::new(Pacer::new(p)));
        Self {
            inner,
            peer,
            shared,
            pacer,
        }
    }

    fn streams(&self) -> JobStreams<'_> {
        JobStreams {
            opts: &self.shared.opts,
            tasks: &self.shared.tasks,
            budget: &self.shared.budget,
            pacer: self.pacer.as_ref(),
        }
    }

    /// Whether the connection has closed (for whatever reason): a new one is needed.
    pub fn is_closed(&self) -> bool {
        self.inner.close_reason().is_some()
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
    pub fn rtt(&self) -> Duration {
        self.inner.rtt()
    }

    /// Open a job stream for `job_id`; frames sent on it reach the peer's
    /// [`Connection::accept_job`] in order.
    pub async fn open_job(
        &self,
        job_id: JobId,
        trace: TraceContext,
    ) -> Result<JobSender, OpenJobError> {
        stream::open(&self.inner, self.streams(), job_id, trace).await
    }

    /// Wait for the peer to open a job stream, and read its Open frame.
    pub async fn accept_job(&self) -> Result<JobReceiver, AcceptJobError> {
        stream::accept(&self.inner, self.streams(), self.peer.clone()).await
    }

    /// Start an admin call: send `request` on a new stream and read the node's replies from
    /// the returned call.
    pub async fn call_admin(&self, request: Control) -> Result<AdminCall, AdminError> {
        AdminCall::start(&self.inner, request).await
    }

    /// Wait for the peer to start an admin call, and read its request.
    pub async fn accept_admin(&self) -> Result<AdminRequest, AdminError> {
        admin::accept(&self.inner, self.shared.opts.open_timeout).await
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
