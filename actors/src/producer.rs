//! The producer actor: owns the base model and prefills a job's prefix layer by layer on a
//! blocking thread, handing each layer's capture to the encoder (a bounded channel) as soon as
//! the layer is done, so that layer `l` is encoded and sent while layer `l + 1` is computed.
//!
//! A codec that needs no producer pass (the oracle) gets nothing: the capture channel closes at
//! once. Prefills run one at a time (the handler waits for its blocking thread); the prefix
//! cache of step 3 of the architecture is not here yet.

use std::sync::Arc;
use std::time::Instant;

use candle_core::{Device, Tensor};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use scd_models::{ForwardError, LayerCapture, Llama};
use scd_transport::JobId;
use tokio::runtime::Handle;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::blocking::{self, run_and_reply, Interrupted};
use crate::job::JobCodec;
use crate::timeline::Span;

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
}

/// A producer's state: its model.
pub struct ProducerState {
    model: Arc<Llama>,
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

/// Messages of the producer.
pub enum ProducerMsg {
    /// Prefill a job; the reply is the prefill's span (`None` when the codec needs no pass).
    Prefill(
        PrefillJob,
        RpcReplyPort<Result<Option<Span>, ProducerError>>,
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
        Ok(ProducerState { model: args.model })
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
                run_and_reply("prefill", reply, ProducerError::Internal, move |rt| {
                    prefill(rt, &model, job)
                })
                .await;
            }
        }
        Ok(())
    }
}

/// Embeds the prefix and runs the layers one at a time, sending each capture on.
fn prefill(rt: &Handle, model: &Llama, job: PrefillJob) -> Result<Option<Span>, ProducerError> {
    let PrefillJob {
        prefix,
        codec,
        captures,
        cancel,
        ..
    } = job;
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
    let start = Instant::now();
    let ids = Tensor::new(prefix.as_slice(), &Device::Cpu)?;
    let mut hidden = model.embedding().index_select(&ids, 0)?;
    let mut captured = Vec::with_capacity(1);
    for layer in 0..model.config().num_layers {
        if cancel.is_cancelled() {
            return Err(ProducerError::Cancelled);
        }
        hidden = model.forward_layers_capture(
            &hidden,
            layer..layer + 1,
            0,
            None,
            &capture,
            &mut captured,
        )?;
        for c in captured.drain(..) {
            blocking::send(rt, &captures, c, &cancel).map_err(|e| match e {
                Interrupted::Cancelled => ProducerError::Cancelled,
                Interrupted::Closed => ProducerError::EncoderGone,
            })?;
        }
    }
    Ok(Some(Span {
        start,
        end: Instant::now(),
    }))
}
