//! The producer actor: owns the base model and prefills a job's prefix layer by layer on a
//! blocking thread, handing each layer's capture to the encoder (a bounded channel) as soon as
//! the layer is done, so that layer `l` is encoded and sent while layer `l + 1` is computed.
//!
//! A codec that needs no producer pass (the oracle) gets nothing: the capture channel closes at
//! once. Prefills run one at a time (the handler waits for its blocking thread). With a
//! [`PrefixCache`], a prefix that starts with cached blocks is computed from where they end
//! (the cached rows of each layer join the computed ones before the capture goes on), and its
//! new whole blocks are cached once the last layer is done.
//!
//! A job that names documents is served instead of prefilled ([`ProducerMsg::Documents`]): its
//! documents come from the node's compiled-document store ([`crate::documents`]; compiled there
//! by the writer the first time), are placed one after another and go out per layer as code
//! frames ([`scd_models::codec::encode_documents`]) straight to the transfer. The expert reads
//! the prompt after them itself.

use std::sync::Arc;
use std::time::Instant;

use candle_core::{Device, Tensor};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use scd_models::codec::encode_documents;
use scd_models::sempic::StoreError;
use scd_models::{Capture, CodecError, ForwardError, KvCache, LayerCapture, Llama};
use scd_transport::{CodeFrame, JobId};
use tokio::runtime::Handle;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::blocking::{run_and_reply, Interrupted, Outlet};
use crate::documents::DocumentServer;
use crate::job::JobCodec;
use crate::prefix_cache::{Block, LayerRows, PrefixCache};
use crate::timeline::{LayerBytes, Span};

/// Errors of a job's prefill.
#[derive(Debug, thiserror::Error)]
pub enum ProducerError {
    /// Nothing to prefill.
    #[error("empty prefix: the producer prefills all of the prompt but its last token")]
    EmptyPrefix,
    /// A token the base model does not have.
    #[error("token {id} is outside the base model's vocabulary of {vocab}")]
    TokenOutOfRange {
        /// The token.
        id: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A layer's forward pass failed.
    #[error("prefill: {0}")]
    Forward(#[from] ForwardError),
    /// Tensor math outside a layer (the embedding) failed.
    #[error("prefill: embedding the prefix: {0}")]
    Tensor(#[from] candle_core::Error),
    /// The encoder stopped taking captures (it failed, or the job ended there).
    #[error("the encoder stopped taking captures")]
    EncoderGone,
    /// The transfer stopped taking a job's document frames.
    #[error("the transfer stopped taking frames")]
    TransferGone,
    /// A job names documents, and this producer serves none.
    #[error("this producer serves no documents: add a [documents] section to its config")]
    NoDocuments,
    /// A job's documents and prompt do not fit the context.
    #[error("the documents take {rows} positions and the prompt {prompt} more; the model's context holds {context}")]
    DocumentsTooLong {
        /// The documents' positions (boundary tokens included).
        rows: usize,
        /// The prompt's tokens and the tokens to generate.
        prompt: usize,
        /// The context.
        context: usize,
    },
    /// A document could not be read from the store or compiled into it.
    #[error("document {id}: {source}")]
    Document {
        /// The document.
        id: String,
        /// Why.
        source: StoreError,
    },
    /// Documents' caches could not be encoded.
    #[error("encoding the documents: {0}")]
    Codec(#[from] CodecError),
    /// The job was cancelled.
    #[error("prefill cancelled")]
    Cancelled,
    /// The prefill's thread failed (a panic in model code).
    #[error("prefill thread failed: {0}")]
    Internal(String),
}

/// The producer actor.
pub struct Producer;

/// What a producer starts with.
pub struct ProducerArgs {
    /// The base model.
    pub model: Arc<Llama>,
    /// Its prefix cache, if it keeps one (it outlives a restarted actor).
    pub prefix_cache: Option<Arc<PrefixCache>>,
    /// Its compiled documents, if it serves any.
    pub documents: Option<Arc<DocumentServer>>,
}

/// A producer's state: its model, prefix cache and documents.
pub struct ProducerState {
    model: Arc<Llama>,
    prefix_cache: Option<Arc<PrefixCache>>,
    documents: Option<Arc<DocumentServer>>,
}

/// What a prefill did.
#[derive(Debug, Clone, Copy)]
pub struct Prefilled {
    /// When it ran.
    pub span: Span,
    /// Leading prefix tokens taken from the prefix cache instead of computed.
    pub cached_tokens: usize,
}

/// One prefill.
pub struct PrefillJob {
    /// The job.
    pub job: JobId,
    /// The prefix (the prompt without its last token), at positions from 0.
    pub prefix: Vec<u32>,
    /// The job's codec: what to capture.
    pub codec: JobCodec,
    /// Where each layer's capture goes, in layer order; dropped when the prefill ends.
    pub captures: mpsc::Sender<LayerCapture>,
    /// The job's cancellation.
    pub cancel: CancellationToken,
}

/// One job's documents to serve.
pub struct DocumentsJob {
    /// The job.
    pub job: JobId,
    /// Each document's id and tokens, in the order they are placed.
    pub documents: Vec<(String, Vec<u32>)>,
    /// The prompt's tokens and the tokens to generate after the documents (to check that all
    /// fit the context before anything is sent).
    pub after: usize,
    /// Frames to the transfer, in layer order; dropped when the serving ends.
    pub frames: mpsc::Sender<CodeFrame>,
    /// The job's cancellation.
    pub cancel: CancellationToken,
}

/// What serving a job's documents did.
#[derive(Debug, Clone)]
pub struct DocumentsServed {
    /// From the first lookup to the last frame handed on.
    pub span: Span,
    /// The writer version that compiled them ([`scd_models::sempic::WriterVersion::id`]).
    pub writer: String,
    /// The positions they occupy, boundary tokens included.
    pub rows: usize,
    /// The ids of those compiled for this job (not in the store before).
    pub compiled: Vec<String>,
    /// How many came from the store, with nothing computed.
    pub hits: usize,
    /// Code bytes per layer.
    pub layer_bytes: Vec<LayerBytes>,
}

/// Messages of the producer.
pub enum ProducerMsg {
    /// Prefill a job; the reply says when it ran and what the cache gave (`None` when the
    /// codec needs no pass).
    Prefill(
        PrefillJob,
        RpcReplyPort<Result<Option<Prefilled>, ProducerError>>,
    ),
    /// Serve a job's documents from the store.
    Documents(
        DocumentsJob,
        RpcReplyPort<Result<DocumentsServed, ProducerError>>,
    ),
}

impl Actor for Producer {
    type Msg = ProducerMsg;
    type State = ProducerState;
    type Arguments = ProducerArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: ProducerArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(ProducerState {
            model: args.model,
            prefix_cache: args.prefix_cache,
            documents: args.documents,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            ProducerMsg::Prefill(job, reply) => {
                let model = Arc::clone(&state.model);
                let cache = state.prefix_cache.clone();
                run_and_reply("prefill", reply, ProducerError::Internal, move |rt| {
                    prefill(rt, &model, cache.as_deref(), job)
                })
                .await;
            }
            ProducerMsg::Documents(job, reply) => {
                let model = Arc::clone(&state.model);
                let documents = state.documents.clone();
                run_and_reply("documents", reply, ProducerError::Internal, move |rt| {
                    serve_documents(rt, &model, documents.as_deref(), job)
                })
                .await;
            }
        }
        Ok(())
    }
}

/// Checks a job's prefix; `None` when its codec needs no producer pass.
fn check(
    model: &Llama,
    prefix: &[u32],
    codec: &JobCodec,
) -> Result<Option<Capture>, ProducerError> {
    let Some(capture) = codec.codec.capture() else {
        return Ok(None);
    };
    if prefix.is_empty() {
        return Err(ProducerError::EmptyPrefix);
    }
    let vocab = model.config().vocab_size;
    if let Some(&id) = prefix.iter().find(|&&t| t as usize >= vocab) {
        return Err(ProducerError::TokenOutOfRange { id, vocab });
    }
    Ok(Some(capture))
}

fn send(
    rt: &Handle,
    captures: &Outlet<LayerCapture>,
    c: LayerCapture,
) -> Result<(), ProducerError> {
    captures.send(rt, c).map_err(|e| match e {
        Interrupted::Cancelled => ProducerError::Cancelled,
        Interrupted::Closed => ProducerError::EncoderGone,
    })
}

/// Embeds the prefix and runs the layers one at a time, sending each capture on as the codec
/// asked for it. With a prefix cache, the cached leading blocks' rows are taken as they are and
/// only the rest of the prefix is computed, on top of their K and V; every layer's capture is
/// the cached rows then the computed ones, and the prefix's new whole blocks are cached at the
/// end (which is why, with a cache, every layer's every capture is kept).
fn prefill(
    rt: &Handle,
    model: &Llama,
    cache: Option<&PrefixCache>,
    job: PrefillJob,
) -> Result<Option<Prefilled>, ProducerError> {
    let PrefillJob {
        prefix,
        codec,
        captures,
        cancel,
        ..
    } = job;
    let captures = Outlet::new(captures, cancel.clone());
    let Some(wanted) = check(model, &prefix, &codec)? else {
        captures.finish();
        return Ok(None);
    };
    let start = Instant::now();
    let chain = cache.map(|c| c.hashes(&prefix)).unwrap_or_default();
    let run = cache.map(|c| c.lookup(&chain)).unwrap_or_default();
    let block = cache.map_or(1, PrefixCache::block_tokens);
    let cached = run.len() * block;
    let layers = model.config().num_layers;
    let capture = match cache {
        Some(_) => Capture {
            k_pre_rope: true,
            v: true,
            h_in: true,
            hidden: true,
            layers: None,
        },
        None => wanted.clone(),
    };
    let rest = &prefix[cached..];
    let mut hidden = match rest.is_empty() {
        true => None,
        false => {
            let ids = Tensor::new(rest, &Device::Cpu)?;
            Some(model.embedding().index_select(&ids, 0)?)
        }
    };
    let mut kv = KvCache::new(model.config());
    let tables = model
        .rope()
        .tables(&(0..cached as u32).collect::<Vec<_>>())?;
    let mut pending: Vec<Vec<LayerRows>> = (run.len()..chain.len())
        .map(|_| Vec::with_capacity(layers))
        .collect();
    let mut captured = Vec::with_capacity(1);
    for layer in 0..layers {
        if cancel.is_cancelled() {
            return Err(ProducerError::Cancelled);
        }
        let from_cache =
            |pick: fn(&LayerRows) -> &Tensor| -> Result<Option<Tensor>, ProducerError> {
                if run.is_empty() {
                    return Ok(None);
                }
                let parts: Vec<&Tensor> = run.iter().map(|b| pick(&b.layers[layer])).collect();
                Ok(Some(Tensor::cat(&parts, 0)?))
            };
        let k_cached = from_cache(|r| &r.k_pre_rope)?;
        let v_cached = from_cache(|r| &r.v)?;
        let computed = match hidden.take() {
            Some(h) => {
                if let (Some(k), Some(v)) = (&k_cached, &v_cached) {
                    kv.fill_layer_rotating(&tables, layer, k, v)?;
                }
                hidden = Some(model.forward_layers_capture(
                    &h,
                    layer..layer + 1,
                    cached,
                    (cached > 0).then_some(&mut kv),
                    &capture,
                    &mut captured,
                )?);
                captured.pop()
            }
            None => None,
        };
        let sends = wanted.layers.as_ref().is_none_or(|l| l.contains(&layer));
        if cache.is_none() && !sends {
            continue;
        }
        // Cached rows, then computed ones.
        let join =
            |c: Option<Tensor>, n: Option<&Tensor>| -> Result<Option<Tensor>, ProducerError> {
                Ok(match (c, n) {
                    (Some(c), Some(n)) => Some(Tensor::cat(&[&c, n], 0)?),
                    (c, n) => c.or_else(|| n.cloned()),
                })
            };
        // Only the rows that are cached now or sent on are put together.
        let needed = |field: bool| !pending.is_empty() || (sends && field);
        let n = computed.as_ref();
        let k = match needed(wanted.k_pre_rope) {
            true => join(k_cached, n.and_then(|c| c.k_pre_rope.as_ref()))?,
            false => None,
        };
        let v = match needed(wanted.v) {
            true => join(v_cached, n.and_then(|c| c.v.as_ref()))?,
            false => None,
        };
        let h_in = match needed(wanted.h_in) {
            true => join(from_cache(|r| &r.h_in)?, n.and_then(|c| c.h_in.as_ref()))?,
            false => None,
        };
        let x = match needed(wanted.hidden) {
            true => join(
                from_cache(|r| &r.hidden)?,
                n.and_then(|c| c.hidden.as_ref()),
            )?,
            false => None,
        };
        if !pending.is_empty() {
            let (Some(k), Some(v), Some(h_in), Some(x)) = (&k, &v, &h_in, &x) else {
                return Err(ProducerError::Internal(format!(
                    "layer {layer}: a capture the prefix cache keeps is missing"
                )));
            };
            for (j, rows) in pending.iter_mut().enumerate() {
                let at = (run.len() + j) * block;
                rows.push(LayerRows {
                    k_pre_rope: k.narrow(0, at, block)?,
                    v: v.narrow(0, at, block)?,
                    h_in: h_in.narrow(0, at, block)?,
                    hidden: x.narrow(0, at, block)?,
                });
            }
        }
        if sends {
            let c = LayerCapture {
                layer,
                k_pre_rope: k.filter(|_| wanted.k_pre_rope),
                v: v.filter(|_| wanted.v),
                h_in: h_in.filter(|_| wanted.h_in),
                hidden: x.filter(|_| wanted.hidden),
            };
            send(rt, &captures, c)?;
        }
    }
    captures.finish();
    if let Some(cache) = cache {
        let new = pending
            .into_iter()
            .enumerate()
            .map(|(j, layers)| (run.len() + j, Block { layers }))
            .collect();
        cache.insert_chain(&chain, new);
    }
    Ok(Some(Prefilled {
        span: Span {
            start,
            end: Instant::now(),
        },
        cached_tokens: cached,
    }))
}

/// Fetches a job's documents (compiling the missing ones into the store) and sends their
/// caches, placed one after another, layer by layer.
fn serve_documents(
    rt: &Handle,
    model: &Llama,
    server: Option<&DocumentServer>,
    job: DocumentsJob,
) -> Result<DocumentsServed, ProducerError> {
    let DocumentsJob {
        job,
        documents,
        after,
        frames,
        cancel,
    } = job;
    let frames = Outlet::new(frames, cancel.clone());
    let server = server.ok_or(ProducerError::NoDocuments)?;
    let start = Instant::now();
    let vocab = model.config().vocab_size;
    let context = model.config().context_length;
    // Refused before anything is compiled or sent.
    let rows: usize = documents
        .iter()
        .map(|(_, t)| server.positions(t.len()))
        .sum();
    if rows + after > context {
        return Err(ProducerError::DocumentsTooLong {
            rows,
            prompt: after,
            context,
        });
    }
    let mut docs = Vec::with_capacity(documents.len());
    let mut compiled = Vec::new();
    for (id, tokens) in &documents {
        if cancel.is_cancelled() {
            return Err(ProducerError::Cancelled);
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ProducerError::TokenOutOfRange { id: t, vocab });
        }
        let (doc, fresh) =
            server
                .fetch(model, tokens)
                .map_err(|source| ProducerError::Document {
                    id: id.clone(),
                    source,
                })?;
        if fresh {
            compiled.push(id.clone());
        }
        docs.push(doc);
    }
    let mut layer_bytes = Vec::with_capacity(model.config().num_layers);
    let mut codes = Vec::with_capacity(2);
    for layer in 0..model.config().num_layers {
        encode_documents(model.rope(), &docs, layer, server.wire(), &mut codes)?;
        layer_bytes.push(LayerBytes {
            layer: layer as u16,
            bytes: codes.iter().map(|c| c.bytes.len()).sum(),
            encoded: Instant::now(),
        });
        for code in codes.drain(..) {
            frames
                .send(rt, CodeFrame::new(job, code))
                .map_err(|e| match e {
                    Interrupted::Cancelled => ProducerError::Cancelled,
                    Interrupted::Closed => ProducerError::TransferGone,
                })?;
        }
    }
    frames.finish();
    Ok(DocumentsServed {
        span: Span {
            start,
            end: Instant::now(),
        },
        writer: server.version().id(),
        rows,
        hits: docs.len() - compiled.len(),
        compiled,
        layer_bytes,
    })
}
