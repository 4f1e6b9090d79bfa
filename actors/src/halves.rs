//! A job's two halves as a node's actors run them: the producer side (prefill, encode, send on a
//! connection to the consumer node) and the consumer side (take the job stream, rebuild, decode).
//! The in-process [`crate::Pipeline`] starts both halves of a job; a cluster node
//! ([`crate::node`]) starts the half its role and the job record give it. Either way a half is a
//! request to each of its actors, with a reply port, plus the bounded channels between them.
//!
//! A half's replies are settled together: the first stage that fails cancels the job, and the
//! error kept is the cause, not the knock-on errors of the stages that stopped because of it.

use ractor::{ActorRef, RpcReplyPort};
use scd_models::GenerateParams;
use scd_transport::{Connection, JobId, TraceContext};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::decoder::{DecodeJob, DecodeReport, DecoderError, DecoderMsg};
use crate::encoder::{EncodeJob, EncodeReport, EncoderError, EncoderMsg};
use crate::job::JobCodec;
use crate::job::{JobError, PipelineOptions};
use crate::producer::{
    DocumentsJob, DocumentsServed, PrefillJob, Prefilled, ProducerError, ProducerMsg,
};
use crate::timeline::Span;
use crate::transfer::{Inbound, SendJob, TransferError, TransferOutMsg, TransferReport};

/// The producer side's actors.
#[derive(Clone)]
pub(crate) struct ProducerActors {
    pub producer: ActorRef<ProducerMsg>,
    pub encoder: ActorRef<EncoderMsg>,
    pub transfer: ActorRef<TransferOutMsg>,
}

/// The producer side's replies for one job.
pub(crate) struct ProducerReplies {
    made: Made,
    sent: oneshot::Receiver<Result<TransferReport, TransferError>>,
}

/// What makes a job's frames: a prefill and its encoding, or the job's documents served.
enum Made {
    Prefill {
        prefilled: oneshot::Receiver<Result<Option<Prefilled>, ProducerError>>,
        encoded: oneshot::Receiver<Result<EncodeReport, EncoderError>>,
    },
    Documents(oneshot::Receiver<Result<DocumentsServed, ProducerError>>),
}

/// What the producer side did for a job.
pub(crate) struct ProducerDone {
    pub prefill: Option<Span>,
    /// Prefix tokens the producer's cache gave.
    pub cached_tokens: usize,
    /// Codes per layer (a job with documents: the documents' caches, with no encode span).
    pub encoded: EncodeReport,
    pub sent: TransferReport,
    /// The job's documents, for a job that names some.
    pub documents: Option<DocumentsServed>,
}

impl ProducerActors {
    /// Starts the producer side of `job`: its codes go out on `to_consumer`. Requests go to the
    /// transfer first, then back up the chain, so each stage's consumer is waiting before its
    /// producer starts.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        &self,
        job: JobId,
        trace: TraceContext,
        prefix: Vec<u32>,
        codec: JobCodec,
        to_consumer: Connection,
        q: &PipelineOptions,
        cancel: &CancellationToken,
    ) -> Result<ProducerReplies, JobError> {
        let (captures_tx, captures_rx) = mpsc::channel(q.capture_queue.max(1));
        let (frames_tx, frames_rx) = mpsc::channel(q.frame_queue.max(1));
        let sent = self.send(job, trace, to_consumer, frames_rx, cancel)?;
        let encoded = ask(&self.encoder, "encoder", |reply| {
            EncoderMsg::Encode(
                EncodeJob {
                    job,
                    codec: codec.clone(),
                    captures: captures_rx,
                    frames: frames_tx,
                    cancel: cancel.clone(),
                },
                reply,
            )
        })?;
        let prefilled = ask(&self.producer, "producer", |reply| {
            ProducerMsg::Prefill(
                PrefillJob {
                    job,
                    prefix,
                    codec,
                    captures: captures_tx,
                    cancel: cancel.clone(),
                },
                reply,
            )
        })?;
        Ok(ProducerReplies {
            made: Made::Prefill { prefilled, encoded },
            sent,
        })
    }

    /// Starts the producer side of a job that names documents: `documents` (id and tokens, in
    /// order) are served from the producer's store and go out on `to_consumer`; `after` is the
    /// prompt and the tokens to generate that must fit the context after them.
    #[allow(clippy::too_many_arguments)]
    pub fn start_documents(
        &self,
        job: JobId,
        trace: TraceContext,
        documents: Vec<(String, Vec<u32>)>,
        after: usize,
        to_consumer: Connection,
        q: &PipelineOptions,
        cancel: &CancellationToken,
    ) -> Result<ProducerReplies, JobError> {
        let (frames_tx, frames_rx) = mpsc::channel(q.frame_queue.max(1));
        let sent = self.send(job, trace, to_consumer, frames_rx, cancel)?;
        let served = ask(&self.producer, "producer", |reply| {
            ProducerMsg::Documents(
                DocumentsJob {
                    job,
                    documents,
                    after,
                    frames: frames_tx,
                    cancel: cancel.clone(),
                },
                reply,
            )
        })?;
        Ok(ProducerReplies {
            made: Made::Documents(served),
            sent,
        })
    }

    /// Asks the transfer to send the job's frames, as they come on `frames`, to the consumer.
    fn send(
        &self,
        job: JobId,
        trace: TraceContext,
        connection: Connection,
        frames: mpsc::Receiver<scd_transport::CodeFrame>,
        cancel: &CancellationToken,
    ) -> Result<oneshot::Receiver<Result<TransferReport, TransferError>>, JobError> {
        ask(&self.transfer, "producer transfer", |reply| {
            TransferOutMsg::Send(
                SendJob {
                    job,
                    connection,
                    trace,
                    frames,
                    cancel: cancel.clone(),
                },
                reply,
            )
        })
    }
}

impl ProducerReplies {
    /// Waits for every stage; on failure, every error (the caller picks the cause with
    /// [`cause`], possibly together with the other half's).
    pub async fn settle(self, cancel: &CancellationToken) -> Result<ProducerDone, Vec<JobError>> {
        match self.made {
            Made::Prefill { prefilled, encoded } => {
                let (p, e, t) = tokio::join!(
                    settle(prefilled, "producer", cancel),
                    settle(encoded, "encoder", cancel),
                    settle(self.sent, "producer transfer", cancel),
                );
                match (p, e, t) {
                    (Ok(prefill), Ok(encoded), Ok(sent)) => Ok(ProducerDone {
                        prefill: prefill.map(|p| p.span),
                        cached_tokens: prefill.map_or(0, |p| p.cached_tokens),
                        encoded,
                        sent,
                        documents: None,
                    }),
                    (p, e, t) => Err([p.err(), e.err(), t.err()].into_iter().flatten().collect()),
                }
            }
            Made::Documents(served) => {
                let (d, t) = tokio::join!(
                    settle(served, "producer", cancel),
                    settle(self.sent, "producer transfer", cancel),
                );
                match (d, t) {
                    (Ok(served), Ok(sent)) => Ok(ProducerDone {
                        prefill: None,
                        cached_tokens: 0,
                        encoded: EncodeReport {
                            span: None,
                            layer_bytes: served.layer_bytes.clone(),
                            ..EncodeReport::default()
                        },
                        sent,
                        documents: Some(served),
                    }),
                    (d, t) => Err([d.err(), t.err()].into_iter().flatten().collect()),
                }
            }
        }
    }
}

/// One job's decoding on the consumer side.
pub(crate) struct ConsumerJob {
    pub job: JobId,
    pub prompt: Vec<u32>,
    pub codec: JobCodec,
    pub params: GenerateParams,
    /// Tokens an earlier attempt already showed (`params.max_tokens` counts only what follows
    /// them): decoded after the prompt, not generated again.
    pub resume: Vec<u32>,
    /// Frames as the transfer forwards them.
    pub inbound: mpsc::Receiver<Inbound>,
    /// Where a copy of the rebuilt cache goes, for a job the drift guard checks.
    pub shadow: Option<oneshot::Sender<scd_models::KvCache>>,
}

/// The decoder's reply for a job.
pub(crate) type DecodeReply = oneshot::Receiver<Result<DecodeReport, DecoderError>>;

/// Asks `decoder` to rebuild and decode `job`; the reply, and the tokens as they come.
pub(crate) fn start_decode(
    decoder: &ActorRef<DecoderMsg>,
    job: ConsumerJob,
    q: &PipelineOptions,
    cancel: &CancellationToken,
) -> Result<(DecodeReply, mpsc::Receiver<u32>), JobError> {
    let (tokens_tx, tokens_rx) = mpsc::channel(q.token_queue.max(1));
    let decoded = ask(decoder, "decoder", |reply| {
        DecoderMsg::Decode(
            DecodeJob {
                job: job.job,
                prompt: job.prompt,
                codec: job.codec,
                params: job.params,
                resume: job.resume,
                inbound: job.inbound,
                tokens: tokens_tx,
                cancel: cancel.clone(),
                shadow: job.shadow,
            },
            reply,
        )
    })?;
    Ok((decoded, tokens_rx))
}

/// Sends `actor` a request built around a fresh reply port; the receiver of the reply.
pub(crate) fn ask<M: ractor::Message, T>(
    actor: &ActorRef<M>,
    stage: &'static str,
    build: impl FnOnce(RpcReplyPort<T>) -> M,
) -> Result<oneshot::Receiver<T>, JobError> {
    let (tx, rx) = oneshot::channel();
    actor
        .send_message(build(tx.into()))
        .map_err(|_| JobError::ActorGone(stage))?;
    Ok(rx)
}

/// A stage's reply; the first failure cancels the job.
pub(crate) async fn settle<T, E>(
    reply: oneshot::Receiver<Result<T, E>>,
    stage: &'static str,
    cancel: &CancellationToken,
) -> Result<T, JobError>
where
    JobError: From<E>,
{
    let result = match reply.await {
        Ok(r) => r.map_err(JobError::from),
        Err(_) => Err(JobError::ActorGone(stage)),
    };
    if result.is_err() {
        cancel.cancel();
    }
    result
}

/// The failure's cause among a job's errors (in stage order): the first that is not a knock-on
/// of another.
pub(crate) fn cause(mut errors: Vec<JobError>) -> JobError {
    if errors.is_empty() {
        return JobError::Internal("a stage failed without an error".into());
    }
    let at = errors.iter().position(|e| !e.is_knock_on()).unwrap_or(0);
    errors.swap_remove(at)
}
