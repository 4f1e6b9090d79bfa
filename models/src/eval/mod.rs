//! The quality harness every transfer mode reports through: the producer prefills a prompt,
//! a [`crate::codec::Codec`] carries its state to the consumer, the consumer continues from
//! the rebuilt cache, and everything is compared with the oracle (the consumer's own prefill)
//! on the same prompts and the same continuation tokens.
//!
//! Files, top-down: [`config`] (what to run), [`data`] (WikiText-2 windows, SQuAD questions,
//! prompts), [`harness`] (the runs: teacher-forced continuations for KL / TV / perplexity,
//! greedy continuations for agreement, greedy answers for QA F1), [`record`] (the JSON +
//! Markdown record, every figure with its bootstrap interval), [`drift`] (how far an expert is
//! from its base, and what naive transfer costs), [`multidoc`] (multi-document QA over
//! compiled document caches, `docs/method.md` §5.4).
//!
//! Every method sees the prompt's first `T - 1` tokens through its cache; the consumer then
//! runs its own forward pass from the prompt's last token on. So the methods differ only in the
//! cache, and the continuation tokens, positions and decoding are identical.

use crate::codec::CodecError;
use crate::corpus::CorpusError;
use crate::error::{ForwardError, GenerateError};
use crate::tokenizer::TokenizerError;

pub mod config;
pub mod data;
pub mod drift;
pub mod harness;
pub mod multidoc;
pub mod needle;
pub mod record;

pub use config::{EvalConfig, QA_TEMPLATE};
pub use data::{
    first_line, parse_squad, qa_prompt, sample_questions, seeded_windows, EvalData, FileInfo,
    QaItem,
};
pub use drift::{drift, text_drift, DriftOptions, DriftReport, TextDrift};
pub use harness::{evaluate, evaluate_shared, Consumer, Pair};
pub use record::{DataInfo, EvalRecord, MethodMetrics, MethodTiming, ModelInfo, ModelsInfo};

/// Errors of an evaluation.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    /// A forward pass failed.
    #[error(transparent)]
    Forward(#[from] ForwardError),
    /// Generation failed.
    #[error(transparent)]
    Generate(#[from] GenerateError),
    /// A codec failed to encode or decode.
    #[error(transparent)]
    Codec(#[from] CodecError),
    /// Tensor math failed.
    #[error("tensor operation failed: {0}")]
    Tensor(#[from] candle_core::Error),
    /// Tokenising failed.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// A data file is missing or malformed.
    #[error(transparent)]
    Data(#[from] CorpusError),
    /// A configuration that cannot run.
    #[error("invalid evaluation configuration: {0}")]
    Config(String),
}
