//! The transfer actors, the QUIC side of a job.
//!
//! - [`TransferOut`] (producer node): for each job it opens a job stream on the connection to
//!   the job's consumer node and sends the encoder's frames as they come, each job on a task
//!   of its own, so that a slow consumer holds up only its own job: QUIC's per-stream flow
//!   control and the transport's bounded [`scd_transport::JobSender`] queue apply per job.
//! - [`TransferIn`] (consumer node) accepts job streams on every connection from a producer
//!   node it is given ([`TransferInMsg::Connection`]). A stream goes to the decoder channel
//!   registered for its job ([`TransferInMsg::Expect`]), or, for a stream nobody expects, to the
//!   node's handler of new jobs if it has one (a cluster node looks the job up in the store and
//!   hands the stream back with [`TransferInMsg::Attach`]); otherwise it is cancelled. Frames are
//!   forwarded stamped with their arrival time; a stream whose decoder stopped taking frames is
//!   cancelled (the producer node sees why).

use std::collections::HashMap;
use std::time::Instant;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use scd_transport::{
    AcceptJobError, CodeFrame, Connection, JobId, JobReceiver, Message, OpenJobError, RecvError,
    SendError, TraceContext,
};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::job::Arrival;
use crate::timeline::Span;

/// Errors sending a job's frames to the consumer node.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// The job stream could not be opened.
    #[error(transparent)]
    Open(#[from] OpenJobError),
    /// Sending or finishing the job stream failed.
    #[error("sending the codes: {0}")]
    Send(#[from] SendError),
    /// The job was cancelled.
    #[error("transfer cancelled")]
    Cancelled,
}

/// What the producer node's side of a job stream carried.
#[derive(Debug, Clone, Copy)]
pub struct TransferReport {
    /// Stream opened to stream finished (the consumer node has read everything).
    pub span: Span,
    /// Bytes sent, frame headers and the Open frame included.
    pub wire_bytes: u64,
    /// Bytes per second the link carried them at, not counting waits for the encoder
    /// ([`scd_transport::SendReport::link_rate`]).
    pub link_rate: Option<scd_transport::LinkRate>,
}

/// The producer node's transfer actor.
pub struct TransferOut;

/// One job's frames to send.
pub struct SendJob {
    /// The job.
    pub job: JobId,
    /// The connection to the job's consumer node.
    pub connection: Connection,
    /// The job's trace context, carried by the stream's Open frame.
    pub trace: TraceContext,
    /// Frames from the encoder, in order; the stream finishes when this closes.
    pub frames: mpsc::Receiver<CodeFrame>,
    /// The job's cancellation.
    pub cancel: CancellationToken,
}

/// Messages of [`TransferOut`].
pub enum TransferOutMsg {
    /// Open a job stream and send the job's frames on it.
    Send(SendJob, RpcReplyPort<Result<TransferReport, TransferError>>),
}

impl Actor for TransferOut {
    type Msg = TransferOutMsg;
    type State = ();
    type Arguments = ();

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        (): (),
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        (): &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            TransferOutMsg::Send(job, reply) => {
                tokio::spawn(async move {
                    let result = send_job(job).await;
                    if let Err(e) = &result {
                        tracing::debug!(error = %e, "transfer failed");
                    }
                    let _ = reply.send(result);
                });
            }
        }
        Ok(())
    }
}

async fn send_job(job: SendJob) -> Result<TransferReport, TransferError> {
    let SendJob {
        job,
        connection: conn,
        trace,
        mut frames,
        cancel,
    } = job;
    let start = Instant::now();
    // Dropping the sender on cancellation resets the stream: the consumer node sees the job
    // cancelled. The cancellation is polled first: a stage that failed cancels the job before
    // its channel closes (`blocking::Outlet`), and that close must not finish the stream.
    let mut sender = tokio::select! {
        biased;
        () = cancel.cancelled() => return Err(TransferError::Cancelled),
        s = conn.open_job(job, trace) => s?,
    };
    loop {
        let frame = tokio::select! {
            biased;
            () = cancel.cancelled() => return Err(TransferError::Cancelled),
            f = frames.recv() => f,
        };
        let Some(frame) = frame else { break };
        tokio::select! {
            biased;
            () = cancel.cancelled() => return Err(TransferError::Cancelled),
            sent = sender.send(frame) => sent?,
        }
    }
    let report = tokio::select! {
        biased;
        () = cancel.cancelled() => return Err(TransferError::Cancelled),
        r = sender.finish() => r?,
    };
    Ok(TransferReport {
        span: Span {
            start,
            end: Instant::now(),
        },
        wire_bytes: report.bytes,
        link_rate: report.link_rate(),
    })
}

/// What the consumer node's transfer forwards to a job's decoder: a frame, or why the job
/// stream failed. The channel closes when the stream finished.
pub type Inbound = Result<Arrival, RecvError>;

/// The consumer node's transfer actor.
pub struct TransferIn;

/// What a [`TransferIn`] starts with.
pub struct TransferInArgs {
    /// The node's cancellation: stops the accept loops and every forwarding task.
    pub cancel: CancellationToken,
    /// Where streams nobody expects go (bounded: when it is full, such a stream is cancelled as
    /// busy); `None`: they are cancelled.
    pub unexpected: Option<mpsc::Sender<JobReceiver>>,
}

/// A [`TransferIn`]'s state.
pub struct TransferInState {
    /// Jobs expected and not yet arrived, with their decoder's channel.
    expected: HashMap<JobId, mpsc::Sender<Inbound>>,
    unexpected: Option<mpsc::Sender<JobReceiver>>,
    cancel: CancellationToken,
    accept_loops: Vec<JoinHandle<()>>,
}

/// Messages of [`TransferIn`].
pub enum TransferInMsg {
    /// Expect a job stream and forward its frames to `inbound`; the reply says it is
    /// registered (send the job's codes only after it).
    Expect {
        /// The job.
        job: JobId,
        /// The decoder's channel.
        inbound: mpsc::Sender<Inbound>,
        /// Acknowledgement.
        reply: RpcReplyPort<()>,
    },
    /// Accept job streams on this connection from a producer node.
    Connection(Connection),
    /// A job stream was accepted (from one of the actor's accept loops).
    Accepted(Box<JobReceiver>),
    /// Forward this stream, handed out as unexpected, to `inbound`.
    Attach {
        /// The stream.
        receiver: Box<JobReceiver>,
        /// The decoder's channel.
        inbound: mpsc::Sender<Inbound>,
    },
}

impl Actor for TransferIn {
    type Msg = TransferInMsg;
    type State = TransferInState;
    type Arguments = TransferInArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: TransferInArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(TransferInState {
            expected: HashMap::new(),
            unexpected: args.unexpected,
            cancel: args.cancel,
            accept_loops: Vec::new(),
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        for task in &state.accept_loops {
            task.abort();
        }
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            TransferInMsg::Expect {
                job,
                inbound,
                reply,
            } => {
                // Jobs whose decoder gave up before their stream came are forgotten here, so
                // the table stays as small as the jobs in flight.
                state.expected.retain(|_, tx| !tx.is_closed());
                state.expected.insert(job, inbound);
                let _ = reply.send(());
            }
            TransferInMsg::Accepted(receiver) => {
                let cancel = state.cancel.child_token();
                match state.expected.remove(&receiver.job_id()) {
                    Some(inbound) => {
                        tokio::spawn(forward(*receiver, inbound, cancel));
                    }
                    None => hand_out(state.unexpected.as_ref(), *receiver),
                }
            }
            TransferInMsg::Attach { receiver, inbound } => {
                tokio::spawn(forward(*receiver, inbound, state.cancel.child_token()));
            }
            TransferInMsg::Connection(connection) => {
                state.accept_loops.retain(|t| !t.is_finished());
                let task = accept_loop(connection, myself, state.cancel.clone());
                state.accept_loops.push(tokio::spawn(task));
            }
        }
        Ok(())
    }
}

/// Gives a stream nobody expects to the node's handler, or cancels it.
fn hand_out(handler: Option<&mpsc::Sender<JobReceiver>>, receiver: JobReceiver) {
    let job = receiver.job_id();
    let Some(handler) = handler else {
        tracing::warn!(%job, "job stream nobody expects");
        tokio::spawn(receiver.cancel("no decoder expects this job"));
        return;
    };
    match handler.try_send(receiver) {
        Ok(()) => {}
        Err(mpsc::error::TrySendError::Full(receiver)) => {
            tracing::warn!(%job, "too many new job streams waiting; refusing one");
            tokio::spawn(receiver.cancel("the consumer node is busy"));
        }
        Err(mpsc::error::TrySendError::Closed(receiver)) => {
            tokio::spawn(receiver.cancel("the consumer node is shutting down"));
        }
    }
}

/// Accepts job streams until the connection or the node goes.
async fn accept_loop(conn: Connection, actor: ActorRef<TransferInMsg>, cancel: CancellationToken) {
    loop {
        let accepted = tokio::select! {
            () = cancel.cancelled() => return,
            a = conn.accept_job() => a,
        };
        match accepted {
            Ok(receiver) => {
                if actor
                    .send_message(TransferInMsg::Accepted(Box::new(receiver)))
                    .is_err()
                {
                    return;
                }
            }
            Err(AcceptJobError::ConnectionLost(e)) => {
                tracing::info!(peer = %conn.peer().name, error = %e, "connection from a producer node ended");
                return;
            }
            Err(e) => tracing::warn!(error = %e, "refused a job stream"),
        }
    }
}

/// Forwards one job stream's frames to its decoder until the stream ends.
async fn forward(
    mut receiver: JobReceiver,
    inbound: mpsc::Sender<Inbound>,
    cancel: CancellationToken,
) {
    loop {
        let next = tokio::select! {
            () = cancel.cancelled() => {
                receiver.cancel("the consumer node is shutting down").await;
                return;
            }
            () = inbound.closed() => {
                receiver.cancel("the decoder stopped taking codes").await;
                return;
            }
            n = receiver.next() => n,
        };
        let arrival = match next {
            Ok(Some(Message::Code(frame))) => Arrival {
                frame,
                at: Instant::now(),
            },
            Ok(Some(Message::Control(c))) => {
                tracing::debug!(?c, "control message on a job stream");
                continue;
            }
            // Finished: dropping `inbound` tells the decoder.
            Ok(None) => return,
            Err(e) => {
                let _ = inbound.send(Err(e)).await;
                return;
            }
        };
        if inbound.send(Ok(arrival)).await.is_err() {
            receiver.cancel("the decoder stopped taking codes").await;
            return;
        }
    }
}
