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
use crate::reply::{Step, TokenSource};
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

/// One job's decoding as it goes: the decoder's tokens, then its report. A
/// [`TokenSource`]: the decoder's failure ends the tokens early (and cancels the job, so that
/// its blocking work stops), even while the decoder still holds the token channel.
pub(crate) struct Decoding {
    tokens: mpsc::Receiver<u32>,
    reply: oneshot::Receiver<Result<DecodeReport, DecoderError>>,
    /// The decoder's answer, once it came.
    answer: Option<Result<DecodeReport, JobError>>,
    cancel: CancellationToken,
}

impl TokenSource for Decoding {
    type Outcome = Result<DecodeReport, JobError>;

    async fn next(&mut self) -> Option<Step> {
        // After a failure the decoder's work may still hold the channel: the tokens end here.
        if matches!(self.answer, Some(Err(_))) {
            return None;
        }
        loop {
            tokio::select! {
                t = self.tokens.recv() => {
                    let mut tokens = vec![t?];
                    // What else is queued comes in the same step.
                    while let Ok(t) = self.tokens.try_recv() {
                        tokens.push(t);
                    }
                    return Some(Step::Tokens(tokens));
                }
                r = &mut self.reply, if self.answer.is_none() => {
                    let r = match r {
                        Ok(r) => r.map_err(JobError::from),
                        Err(_) => Err(JobError::ActorGone("decoder")),
                    };
                    let failed = r.is_err();
                    self.answer = Some(r);
                    if failed {
                        self.cancel.cancel();
                        return None;
                    }
                }
            }
        }
    }

    async fn finish(mut self) -> Self::Outcome {
        while self.next().await.is_some() {}
        match self.answer {
            Some(answer) => answer,
            None => settle(self.reply, "decoder", &self.cancel).await,
        }
    }
}

/// Asks `decoder` to rebuild and decode `job`.
pub(crate) fn start_decode(
    decoder: &ActorRef<DecoderMsg>,
    job: ConsumerJob,
    q: &PipelineOptions,
    cancel: &CancellationToken,
) -> Result<Decoding, JobError> {
    let (tokens_tx, tokens) = mpsc::channel(q.token_queue.max(1));
    let reply = ask(decoder, "decoder", |reply| {
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
    Ok(Decoding {
        tokens,
        reply,
        answer: None,
        cancel: cancel.clone(),
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    fn decoding() -> (
        Decoding,
        mpsc::Sender<u32>,
        oneshot::Sender<Result<DecodeReport, DecoderError>>,
    ) {
        let (tokens_tx, tokens) = mpsc::channel(8);
        let (reply_tx, reply) = oneshot::channel();
        let d = Decoding {
            tokens,
            reply,
            answer: None,
            cancel: CancellationToken::new(),
        };
        (d, tokens_tx, reply_tx)
    }

    #[tokio::test]
    async fn queued_tokens_come_in_one_step() {
        let (mut d, tx, _reply) = decoding();
        for t in [3, 4, 5] {
            tx.send(t).await.unwrap();
        }
        match d.next().await {
            Some(Step::Tokens(t)) => assert_eq!(t, [3, 4, 5]),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn the_decoders_failure_ends_the_tokens_and_cancels_the_job_while_it_holds_the_channel() {
        let (mut d, tx, reply) = decoding();
        tx.send(1).await.unwrap();
        reply.send(Err(DecoderError::Cancelled)).unwrap();
        let cancel = d.cancel.clone();
        let mut tokens = Vec::new();
        while let Some(step) = d.next().await {
            if let Step::Tokens(t) = step {
                tokens.extend(t);
            }
        }
        // `tx` is still held: without the reply the tokens would never end.
        assert!(tokens.len() <= 1, "{tokens:?}");
        assert!(cancel.is_cancelled());
        assert!(matches!(
            d.finish().await,
            Err(JobError::Decoder(DecoderError::Cancelled))
        ));
        drop(tx);
    }

    #[tokio::test]
    async fn a_decoder_gone_without_a_reply_is_actor_gone() {
        let (d, tx, reply) = decoding();
        drop(reply);
        drop(tx);
        assert!(matches!(
            d.collect().await.1,
            Err(JobError::ActorGone("decoder"))
        ));
    }
}
