//! The transfer actors, the QUIC side of a job.
//!
//! - [`TransferOut`] (producer node) holds the connection to the consumer node; for each job it
//!   opens a job stream and sends the encoder's frames as they come. The transport's
//!   [`scd_transport::JobSender`] queue is bounded, so a slow link slows the encoder, which
//!   slows the producer. Jobs are sent one at a time.
//! - [`TransferIn`] (consumer node) accepts job streams on the connection from the producer
//!   node. A job is expected first ([`TransferInMsg::Expect`], with the bounded channel of the
//!   decoder that will take it); its frames are then forwarded as they arrive, stamped with
//!   their arrival time. A stream nobody expects is cancelled, and so is a stream whose decoder
//!   stopped taking frames (the producer node sees why).

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
}

/// The producer node's transfer actor.
pub struct TransferOut;

/// A [`TransferOut`]'s state and arguments: the connection to the consumer node.
pub struct TransferOutState {
    /// The connection.
    pub connection: Connection,
}

/// One job's frames to send.
pub struct SendJob {
    /// The job.
    pub job: JobId,
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
    type State = TransferOutState;
    type Arguments = TransferOutState;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: TransferOutState,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(args)
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            TransferOutMsg::Send(job, reply) => {
                let result = send_job(&state.connection, job).await;
                if let Err(e) = &result {
                    tracing::debug!(error = %e, "transfer failed");
                }
                let _ = reply.send(result);
            }
        }
        Ok(())
    }
}

async fn send_job(conn: &Connection, job: SendJob) -> Result<TransferReport, TransferError> {
    let SendJob {
        job,
        mut frames,
        cancel,
    } = job;
    let start = Instant::now();
    // Dropping the sender on cancellation resets the stream: the consumer node sees the job
    // cancelled.
    let mut sender = tokio::select! {
        () = cancel.cancelled() => return Err(TransferError::Cancelled),
        s = conn.open_job(job, TraceContext::new()) => s?,
    };
    loop {
        let frame = tokio::select! {
            () = cancel.cancelled() => return Err(TransferError::Cancelled),
            f = frames.recv() => f,
        };
        let Some(frame) = frame else { break };
        tokio::select! {
            () = cancel.cancelled() => return Err(TransferError::Cancelled),
            sent = sender.send(frame) => sent?,
        }
    }
    let report = tokio::select! {
        () = cancel.cancelled() => return Err(TransferError::Cancelled),
        r = sender.finish() => r?,
    };
    Ok(TransferReport {
        span: Span {
            start,
            end: Instant::now(),
        },
        wire_bytes: report.bytes,
    })
}

/// What the consumer node's transfer forwards to a job's decoder: a frame, or why the job
/// stream failed. The channel closes when the stream finished.
pub type Inbound = Result<Arrival, RecvError>;

/// The consumer node's transfer actor.
pub struct TransferIn;

/// What a [`TransferIn`] starts with.
pub struct TransferInArgs {
    /// The connection from the producer node.
    pub connection: Connection,
    /// The node's cancellation: stops the accept loop and every forwarding task.
    pub cancel: CancellationToken,
}

/// A [`TransferIn`]'s state.
pub struct TransferInState {
    /// Jobs expected and not yet arrived, with their decoder's channel.
    expected: HashMap<JobId, mpsc::Sender<Inbound>>,
    cancel: CancellationToken,
    accept_loop: JoinHandle<()>,
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
    /// A job stream was accepted (from the actor's own accept loop).
    Accepted(Box<JobReceiver>),
}

impl Actor for TransferIn {
    type Msg = TransferInMsg;
    type State = TransferInState;
    type Arguments = TransferInArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: TransferInArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let accept_loop = tokio::spawn(accept_loop(args.connection, myself, args.cancel.clone()));
        Ok(TransferInState {
            expected: HashMap::new(),
            cancel: args.cancel,
            accept_loop,
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        state.accept_loop.abort();
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
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
                    None => {
                        tracing::warn!(job = %receiver.job_id(), "job stream nobody expects");
                        tokio::spawn(receiver.cancel("no decoder expects this job"));
                    }
                }
            }
        }
        Ok(())
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
                tracing::warn!(error = %e, "connection from the producer node lost");
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
