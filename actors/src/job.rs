//! What one job carries through the actors: its codec (shared by both nodes in the in-process
//! pipeline), what the caller asks for, and the units that move between stages.

use std::sync::Arc;
use std::time::Instant;

use scd_models::codec::{codec_with, CodecOptions};
use scd_models::translator::Translator;
use scd_models::{Codec, CodecError, GenerateParams};
use scd_transport::{CodeFrame, JobId, Mode, TranslatorHash};

/// A transfer mode's codec for one job, with the translator version its codes are made with
/// (`None` for modes without one: oracle, raw, q4). The producer stamps the hash on every frame
/// and the consumer refuses frames that carry another.
#[derive(Clone)]
pub struct JobCodec {
    /// The codec.
    pub codec: Arc<dyn Codec>,
    /// The translator version, for `reuse` and `scd`
    /// ([`scd_models::translator::Translator::hash`]).
    pub translator: Option<TranslatorHash>,
}

impl JobCodec {
    /// The codec of `mode` ([`codec_with`]); `translator` is the pair's translator and the
    /// expert's index in it ([`Translator::check_pair`]), needed by `droidspeak`, `reuse` and
    /// `scd`. Frames carry the translator's content hash for the modes whose codes it makes
    /// (`reuse`, `scd`; droidspeak sends raw KV and only takes its block list from it, as
    /// [`scd_transport::CodeFrame`] says).
    pub fn for_mode(
        mode: Mode,
        translator: Option<(&Arc<Translator>, usize)>,
        opts: &CodecOptions,
    ) -> Result<Self, CodecError> {
        let codec = codec_with(mode, translator, opts)?;
        let uses_translator = matches!(mode, Mode::Reuse | Mode::Scd);
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
    /// continues from; `None` for a prompt under two tokens.
    pub fn split(&self) -> Option<(&[u32], u32)> {
        match self.prompt.split_last() {
            Some((&last, prefix)) if !prefix.is_empty() => Some((prefix, last)),
            _ => None,
        }
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
