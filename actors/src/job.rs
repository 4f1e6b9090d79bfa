//! What one job carries through the actors: its codec (shared by both nodes in the in-process
//! pipeline), what the caller asks for, the units that move between stages, the bounds of the
//! queues between them ([`PipelineOptions`]), and why a job failed ([`JobError`]), classified
//! once here for everyone who decides what to do about it.

use std::sync::Arc;
use std::time::Instant;

use scd_models::codec::{codec_with, CodecOptions};
use scd_models::translator::Translator;
use scd_models::{Codec, CodecError, GenerateParams};
use scd_transport::{
    CodeFrame, JobId, Mode, RecvError, SendError, TranslatorHash, TransportOptions,
};

use crate::decoder::DecoderError;
use crate::encoder::EncoderError;
use crate::producer::ProducerError;
use crate::transfer::TransferError;

/// A transfer mode's codec for one job, with the translator version its codes are made with
/// (`None` for modes without one: oracle, raw, q4). The producer stamps the hash on every frame
/// and the consumer refuses frames that carry another.
#[derive(Clone)]
pub struct JobCodec {
    /// The codec.
    pub codec: Arc<dyn Codec>,
    /// The translator version, for `reuse`, `scd` and `kvtc`
    /// ([`scd_models::translator::Translator::hash`]).
    pub translator: Option<TranslatorHash>,
}

impl JobCodec {
    /// The codec of `mode` ([`codec_with`]); `translator` is the pair's translator and the
    /// expert's index in it ([`Translator::check_pair`]), needed by `droidspeak`, `reuse` and
    /// `scd` (and `kvtc`). Frames carry the translator's content hash for the modes whose codes
    /// only it decodes (`reuse`, `scd`, and `kvtc`, coded in the base basis it stores;
    /// droidspeak sends raw KV and only takes its block list from it, as
    /// [`scd_transport::CodeFrame`] says).
    pub fn for_mode(
        mode: Mode,
        translator: Option<(&Arc<Translator>, usize)>,
        opts: &CodecOptions,
    ) -> Result<Self, CodecError> {
        let codec = codec_with(mode, translator, opts)?;
        let uses_translator = mode.codes_tied_to_translator();
        Ok(Self {
            codec: Arc::from(codec),
            translator: translator
                .filter(|_| uses_translator)
                .map(|(t, _)| t.hash()),
        })
    }
}

impl std::fmt::Debug for JobCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobCodec")
            .field("mode", &self.codec.mode())
            .field("translator", &self.translator)
            .finish()
    }
}

/// One job as the caller asks for it.
#[derive(Debug, Clone)]
pub struct JobSpec {
    /// The job.
    pub id: JobId,
    /// The whole prompt, tokenised with the base model's tokenizer (at least two tokens: the
    /// producer prefills all but the last, the expert continues from the last).
    pub prompt: Vec<u32>,
    /// The transfer mode's codec.
    pub codec: JobCodec,
    /// What the expert generates (greedy gives a result that can be compared).
    pub params: GenerateParams,
}

impl JobSpec {
    /// The prefix the producer prefills and the consumer rebuilds, and the token the expert
    /// continues from; an error for a prompt under two tokens.
    pub fn split(&self) -> Result<(&[u32], u32), scd_types::RequestError> {
        scd_types::split_prompt(&self.prompt)
    }
}

/// A code frame as it arrived at the consumer node, with when.
#[derive(Debug)]
pub struct Arrival {
    /// The frame.
    pub frame: CodeFrame,
    /// When its last byte was read and it passed validation.
    pub at: Instant,
}

/// Queue bounds and transport options of a job's path (a node's, or the in-process pipeline's).
#[derive(Debug, Clone)]
pub struct PipelineOptions {
    /// Transport options of both endpoints.
    pub transport: TransportOptions,
    /// Layer captures the producer may run ahead of the encoder.
    pub capture_queue: usize,
    /// Frames the encoder may run ahead of the transfer (the transport's own send queue comes
    /// on top). The default holds a whole job's codes (30 layers of K, V and `H_in` codes fit
    /// four times over), so that a slow link holds up only its own job's stream, never the
    /// encoder that the producer's other jobs need; a job's codes are bounded by its prompt.
    pub frame_queue: usize,
    /// Frames the consumer node's transfer may read ahead of the decoder.
    pub arrival_queue: usize,
    /// Tokens the decoder may run ahead of the caller.
    pub token_queue: usize,
}

impl Default for PipelineOptions {
    fn default() -> Self {
        Self {
            transport: TransportOptions::default(),
            capture_queue: 2,
            frame_queue: 384,
            arrival_queue: 4,
            token_queue: 16,
        }
    }
}

/// Why a job failed: the stage that caused it, with its error.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// The request fails the one request check.
    #[error(transparent)]
    Request(#[from] scd_types::RequestError),
    /// The producer failed.
    #[error("producer: {0}")]
    Producer(#[from] ProducerError),
    /// The encoder failed.
    #[error("encoder: {0}")]
    Encoder(#[from] EncoderError),
    /// Sending the codes failed.
    #[error("transfer: {0}")]
    Transfer(#[from] TransferError),
    /// The consumer node failed (receiving, rebuilding or generating).
    #[error("decoder: {0}")]
    Decoder(#[from] DecoderError),
    /// An actor the job needs is gone.
    #[error("the {0} actor is gone")]
    ActorGone(&'static str),
    /// The job's own task failed.
    #[error("job task failed: {0}")]
    Internal(String),
}

impl JobError {
    /// Whether the error says the producer vanished while its codes were arriving (connection
    /// lost, stream reset or cut inside a frame): the attempt can run again on another
    /// producer, and this consumer is not to blame.
    pub fn producer_lost(&self) -> bool {
        matches!(
            self,
            JobError::Decoder(DecoderError::Transfer(
                RecvError::PeerGone(_) | RecvError::Aborted(_) | RecvError::Truncated
            ))
        )
    }

    /// Whether the error says this consumer's receive budget was spent by the jobs it already
    /// holds: the consumer is healthy and the job sound, so the attempt goes back to the
    /// queue (another consumer, or this one once it has room) rather than failing. A frame
    /// larger than the whole budget is no such case: no wait makes it fit.
    pub fn receiver_full(&self) -> bool {
        matches!(
            self,
            JobError::Decoder(DecoderError::Transfer(RecvError::OverBudget(
                scd_transport::BudgetError::Exhausted { .. }
            )))
        )
    }

    /// Whether the error says the consumer vanished while the codes were going out: the
    /// attempt can run again on another consumer, and this producer is not to blame.
    pub fn consumer_lost(&self) -> bool {
        matches!(
            self,
            JobError::Transfer(TransferError::Send(SendError::PeerGone(_)))
        )
    }

    /// Whether the error only says that another stage of the job stopped first (a closed
    /// channel, a cancelled stream): never the cause of a failure.
    pub fn is_knock_on(&self) -> bool {
        matches!(
            self,
            JobError::Producer(
                ProducerError::EncoderGone | ProducerError::TransferGone | ProducerError::Cancelled
            ) | JobError::Encoder(EncoderError::TransferGone | EncoderError::Cancelled)
                | JobError::Transfer(
                    TransferError::Cancelled
                        | TransferError::Send(SendError::CancelledByPeer { .. })
                )
                | JobError::Decoder(
                    DecoderError::Cancelled
                        | DecoderError::Transfer(
                            RecvError::CancelledByPeer { .. } | RecvError::Aborted(_)
                        )
                )
        )
    }
}
