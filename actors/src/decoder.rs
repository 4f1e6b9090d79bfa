//! The decoder actor (consumer node): owns an expert model. For a job it builds the codec's
//! [`scd_models::LayerDecoder`] for the prefix, pushes codes as they arrive (a codec rebuilds
//! layer `l` while layer `l + 1` is in flight) and finishes the cache, on a blocking thread;
//! then it hands the cache to the node's [`DecodeLoop`], which decodes it together with every
//! other job of the node (greedy, or as the job's parameters say) from the prompt's last token
//! and streams the tokens to the caller through a bounded channel. The actor itself never
//! waits: rebuilds of several jobs and the decoding of earlier ones overlap, and the actor
//! answers each job when the loop reports its end.
//!
//! The aligner's work (a Patch layer's `Z_H` through the MLP, then the expert's own `W_k`,
//! `W_v`) happens inside the `scd` codec's layer decoder today, so there is no separate aligner
//! actor in this slice.
//!
//! Frames are checked before they reach the codec: a frame of another job, or made with a
//! translator other than the job's, fails the job.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use scd_models::{CodecError, GenerateError, GenerateParams, KvCache, Llama, Prefix, StopReason};
use scd_transport::{JobId, RecvError, TranslatorHash};
use tokio::runtime::Handle;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::blocking;
use crate::decode_loop::{DecodeLoop, Decoded, Joining};
use crate::job::JobCodec;
use crate::timeline::{FrameArrival, Span};
use crate::transfer::Inbound;

/// Errors of a job on the consumer node.
#[derive(Debug, thiserror::Error)]
pub enum DecoderError {
    /// The prompt has no prefix to rebuild.
    #[error(transparent)]
    Request(#[from] scd_types::RequestError),
    /// The codec refused the job before any code (a translator for another pair ...).
    #[error("setting up the decoder: {0}")]
    Setup(CodecError),
    /// A code could not be decoded (wrong shape, dtype, kind, layer, a duplicate ...).
    #[error("decoding a code of layer {layer}: {source}")]
    Code {
        /// The layer the code names.
        layer: u16,
        /// Why.
        source: CodecError,
    },
    /// The codes ended before the cache was complete, or the cache could not be finished.
    #[error("finishing the cache: {0}")]
    Finish(CodecError),
    /// A frame made with a translator other than the job's.
    #[error("layer {layer}: codes made with translator {got}, this job decodes with {expected}")]
    TranslatorMismatch {
        /// The layer.
        layer: u16,
        /// The frame's translator (`none` when it names none).
        got: String,
        /// The job's (`none` for modes without one).
        expected: String,
    },
    /// A frame of another job.
    #[error("a frame of job {got} on job {expected}")]
    WrongJob {
        /// This job.
        expected: JobId,
        /// The frame's job.
        got: JobId,
    },
    /// The job stream failed.
    #[error("receiving the codes: {0}")]
    Transfer(#[from] RecvError),
    /// The expert's generation failed.
    #[error("generating: {0}")]
    Generate(#[from] GenerateError),
    /// The caller stopped reading tokens.
    #[error("the caller stopped reading tokens")]
    CallerGone,
    /// The job was cancelled.
    #[error("decoding cancelled")]
    Cancelled,
    /// The decoder's thread failed (a panic in model code).
    #[error("decoder thread failed: {0}")]
    Internal(String),
}

/// What the consumer node did for a job.
#[derive(Debug, Clone)]
pub struct DecodeReport {
    /// Every code frame as it arrived.
    pub arrivals: Vec<FrameArrival>,
    /// First code pushed (or the decoder made, without codes) to the cache finished.
    pub rebuild: Span,
    /// When the first token was produced.
    pub first_token: Option<Instant>,
    /// Why generation ended.
    pub stop: StopReason,
}

/// The decoder actor.
pub struct Decoder;

/// What a decoder starts with.
pub struct DecoderArgs {
    /// The expert model.
    pub model: Arc<Llama>,
    /// The node's decode loop, shared by its decoders.
    pub decode_loop: DecodeLoop,
}

/// A decoder's state: its model, the loop, and the jobs it has not answered yet.
pub struct DecoderState {
    model: Arc<Llama>,
    decode_loop: DecodeLoop,
    /// Reply ports, and each job's rebuild once done. If the actor dies they drop with it, and
    /// the jobs' callers see the decoder gone.
    jobs: HashMap<u64, Waiting>,
    next_key: u64,
}

struct Waiting {
    reply: RpcReplyPort<Result<DecodeReport, DecoderError>>,
    rebuilt: Option<(Vec<FrameArrival>, Span)>,
}

/// One job's decoding.
pub struct DecodeJob {
    /// The job.
    pub job: JobId,
    /// The whole prompt.
    pub prompt: Vec<u32>,
    /// The job's codec.
    pub codec: JobCodec,
    /// Generation parameters.
    pub params: GenerateParams,
    /// Tokens an earlier attempt already showed: run through the model after the prompt, and
    /// generation goes on after them (`params.max_tokens` counts only the new ones).
    pub resume: Vec<u32>,
    /// Frames from the transfer; closes when the stream finished.
    pub inbound: mpsc::Receiver<Inbound>,
    /// Generated tokens, as they come.
    pub tokens: mpsc::Sender<u32>,
    /// The job's cancellation.
    pub cancel: CancellationToken,
    /// Where a copy of the rebuilt cache goes, for a job the drift guard checks.
    pub shadow: Option<oneshot::Sender<KvCache>>,
}

/// Messages of the decoder.
pub enum DecoderMsg {
    /// Rebuild a job's cache from its codes and generate.
    Decode(DecodeJob, RpcReplyPort<Result<DecodeReport, DecoderError>>),
    /// A stage of a job ended (sent by the decoder's own tasks).
    Progress(Progress),
}

/// A stage of one of the decoder's jobs that ended: its rebuild, or its decoding.
pub struct Progress(Stage);

enum Stage {
    Rebuilt(u64, Result<Rebuilt, DecoderError>),
    Decoded(u64, Result<Decoded, DecoderError>),
}

/// A job's cache, rebuilt, and what decoding it needs.
struct Rebuilt {
    arrivals: Vec<FrameArrival>,
    rebuild: Span,
    cache: KvCache,
    /// The prompt's last token, then the tokens resumed from.
    pending: Vec<u32>,
    params: GenerateParams,
    tokens: mpsc::Sender<u32>,
    cancel: CancellationToken,
}

impl Actor for Decoder {
    type Msg = DecoderMsg;
    type State = DecoderState;
    type Arguments = DecoderArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: DecoderArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(DecoderState {
            model: args.model,
            decode_loop: args.decode_loop,
            jobs: HashMap::new(),
            next_key: 0,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            DecoderMsg::Decode(job, reply) => {
                let key = state.next_key;
                state.next_key += 1;
                state.jobs.insert(
                    key,
                    Waiting {
                        reply,
                        rebuilt: None,
                    },
                );
                let model = Arc::clone(&state.model);
                tokio::spawn(async move {
                    let rt = Handle::current();
                    let rebuilt = tokio::task::spawn_blocking(move || rebuild(&rt, &model, job))
                        .await
                        .unwrap_or_else(|e| Err(DecoderError::Internal(e.to_string())));
                    let _ = myself
                        .send_message(DecoderMsg::Progress(Progress(Stage::Rebuilt(key, rebuilt))));
                });
            }
            DecoderMsg::Progress(Progress(Stage::Rebuilt(key, Ok(r)))) => {
                let Some(waiting) = state.jobs.get_mut(&key) else {
                    return Ok(());
                };
                waiting.rebuilt = Some((r.arrivals, r.rebuild));
                let (done, decoded) = oneshot::channel();
                let joining = Joining {
                    model: Arc::clone(&state.model),
                    cache: r.cache,
                    pending: r.pending,
                    params: r.params,
                    tokens: r.tokens,
                    cancel: r.cancel,
                    done,
                };
                if !state.decode_loop.join(joining) {
                    answer(
                        state,
                        key,
                        Err(DecoderError::Internal("the decode loop is gone".into())),
                    );
                    return Ok(());
                }
                tokio::spawn(async move {
                    let result = decoded.await.unwrap_or_else(|_| {
                        Err(DecoderError::Internal(
                            "the decode loop dropped the job".into(),
                        ))
                    });
                    let _ = myself
                        .send_message(DecoderMsg::Progress(Progress(Stage::Decoded(key, result))));
                });
            }
            DecoderMsg::Progress(Progress(Stage::Rebuilt(key, Err(e)))) => {
                answer(state, key, Err(e));
            }
            DecoderMsg::Progress(Progress(Stage::Decoded(key, result))) => {
                answer(state, key, result);
            }
        }
        Ok(())
    }
}

/// Answers job `key` with the loop's result and its rebuild's record.
fn answer(state: &mut DecoderState, key: u64, result: Result<Decoded, DecoderError>) {
    let Some(waiting) = state.jobs.remove(&key) else {
        return;
    };
    let (arrivals, rebuild) = waiting.rebuilt.unwrap_or_else(|| {
        let now = Instant::now();
        (
            Vec::new(),
            Span {
                start: now,
                end: now,
            },
        )
    });
    let result = result.map(|d| DecodeReport {
        arrivals,
        rebuild,
        first_token: d.first_token,
        stop: d.stop,
    });
    if let Err(e) = &result {
        tracing::debug!(error = %e, "decoding failed");
    }
    let _ = waiting.reply.send(result);
}

fn hash_name(h: Option<TranslatorHash>) -> String {
    h.map_or_else(|| "none".to_owned(), |h| h.short())
}

/// Rebuilds `job`'s cache from its codes as they arrive.
fn rebuild(rt: &Handle, model: &Llama, job: DecodeJob) -> Result<Rebuilt, DecoderError> {
    let DecodeJob {
        job,
        prompt,
        codec,
        params,
        resume,
        mut inbound,
        tokens,
        cancel,
        shadow,
    } = job;
    let (prefix, last) = scd_types::split_prompt(&prompt)?;
    let made = Instant::now();
    let mut decoder = codec
        .codec
        .decoder(model, Prefix::new(prefix))
        .map_err(DecoderError::Setup)?;
    let mut arrivals = Vec::new();
    let mut rebuild_start = None;
    // `recv` fails only on cancellation (a closed channel is the end of the codes).
    while let Some(next) =
        blocking::recv(rt, &mut inbound, &cancel).map_err(|_| DecoderError::Cancelled)?
    {
        // With it, every code that arrived while the last ones were rebuilt: the codec
        // rebuilds their layers in parallel (one layer's products are too small for two
        // cores). On a fast link that is most of the payload.
        let mut batch = vec![next];
        while let Ok(more) = inbound.try_recv() {
            batch.push(more);
        }
        let mut codes = Vec::with_capacity(batch.len());
        for next in batch {
            let arrival = next?;
            let frame = arrival.frame;
            let layer = frame.code.layer;
            if frame.job_id != job {
                return Err(DecoderError::WrongJob {
                    expected: job,
                    got: frame.job_id,
                });
            }
            if frame.translator != codec.translator {
                return Err(DecoderError::TranslatorMismatch {
                    layer,
                    got: hash_name(frame.translator),
                    expected: hash_name(codec.translator),
                });
            }
            arrivals.push(FrameArrival {
                layer,
                kind: frame.code.kind,
                bytes: frame.code.bytes.len(),
                at: arrival.at,
            });
            codes.push(frame.code);
        }
        rebuild_start.get_or_insert_with(Instant::now);
        decoder.push_many(&codes).map_err(|source| {
            let first = codes.first().map_or(0, |c| c.layer);
            let layer = source
                .layer()
                .and_then(|l| u16::try_from(l).ok())
                .unwrap_or(first);
            DecoderError::Code { layer, source }
        })?;
    }
    let cache = decoder.finish().map_err(DecoderError::Finish)?;
    if let Some(shadow) = shadow {
        // A copy that shares no buffer: decoding writes into the cache in place. Failing to
        // copy only skips the check.
        match cache.try_clone() {
            Ok(copy) => {
                let _ = shadow.send(copy);
            }
            Err(e) => tracing::warn!(%job, error = %e, "copying a cache for its shadow check"),
        }
    }
    let rebuild = Span {
        start: rebuild_start.unwrap_or(made),
        end: Instant::now(),
    };
    Ok(Rebuilt {
        arrivals,
        rebuild,
        cache,
        pending: std::iter::once(last).chain(resume).collect(),
        params,
        tokens,
        cancel,
    })
}
