//! LoRA training of a frozen base: the experts that SCD serves are the base plus an adapter
//! trained here, and so is SemPIC's writer.
//!
//! Files, top-down: [`config`] (hyperparameters and the learning-rate schedule), [`trainer`]
//! (one optimisation step of an [`Objective`], [`crate::optim::AdamW`]; an expert's objective
//! is next-token cross-entropy on random windows of the tokenised train split, through the
//! model's own forward pass with the adapter applied on the fly), [`checkpoint`] (written
//! atomically, resumable bit for bit), [`run`] (the loop with its stop flag and events), and
//! the two commands: [`finetune`] (an expert: tokenise, train, save, validate, write its
//! manifest, see [`crate::expert`]) and [`writer`] (a SemPIC writer, whose objective is
//! [`sempic`]: the KL from the base reading the whole prompt to the base reading documents
//! the writer compiled alone).
//!
//! Determinism: the windows of step `s` come from a generator seeded by `(seed, s)`, so the
//! only state a checkpoint needs beyond the adapter and the optimiser's moments is the step;
//! resuming from a checkpoint gives the same adapter as never stopping.
//!
//! Only the adapter's `A`/`B` matrices are [`candle_core::Var`]s (or, for KV-Packet's boundary
//! tokens, those tokens: [`TrainConfig::boundary`]); the base weights are plain tensors, so the
//! optimiser never touches them, and the forward pass multiplies by them through a
//! frozen-weight op whose backward computes no gradient for them at all.

use std::path::{Path, PathBuf};

use crate::corpus::CorpusError;
use crate::error::{AdapterError, ForwardError};
use crate::json_file::JsonFileError;
use crate::optim::StateMismatch;

pub mod checkpoint;
pub mod config;
pub mod finetune;
pub mod run;
pub mod sempic;
pub mod trainer;
pub mod writer;

pub use config::{Schedule, TrainConfig};
pub use finetune::{finetune, FinetuneOptions, FinetuneOutcome};
pub use run::{run, start_or_resume, LoopEnd, TrainEvent};
pub use trainer::{Objective, StepGrads, StepReport, TrainData, Trainer};

/// Errors of fine-tuning.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// Tensor math failed.
    #[error("tensor operation failed: {0}")]
    Tensor(#[from] candle_core::Error),
    /// The forward pass failed.
    #[error(transparent)]
    Forward(#[from] ForwardError),
    /// Building or saving the adapter failed.
    #[error(transparent)]
    Adapter(#[from] AdapterError),
    /// The corpus is unusable.
    #[error(transparent)]
    Corpus(#[from] CorpusError),
    /// Tokenising the corpus failed.
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    /// A JSON file (checkpoint metadata, manifest) could not be read or written.
    #[error(transparent)]
    File(#[from] JsonFileError),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A checkpoint that cannot be used.
    #[error("checkpoint {path}: {reason}")]
    Checkpoint {
        /// The checkpoint.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// Saved optimiser state that does not fit the adapter.
    #[error(transparent)]
    Optimiser(#[from] StateMismatch),
    /// Boundary tokens could not be built, saved or loaded.
    #[error(transparent)]
    Boundary(#[from] crate::boundary::BoundaryError),
    /// Hyperparameters that make no sense.
    #[error("invalid training configuration: {0}")]
    Config(String),
    /// The loss became NaN or infinite.
    #[error("loss is not finite at step {step} (try a lower learning rate)")]
    Diverged {
        /// The step.
        step: usize,
    },
}

pub(crate) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Mean of the last up-to-`n` values.
pub fn tail_mean(values: &[f64], n: usize) -> f64 {
    let tail = &values[values.len().saturating_sub(n)..];
    if tail.is_empty() {
        return f64::NAN;
    }
    tail.iter().sum::<f64>() / tail.len() as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_mean_of_short_series() {
        assert_eq!(tail_mean(&[1.0, 3.0], 10), 2.0);
        assert_eq!(tail_mean(&[1.0, 3.0, 5.0], 2), 4.0);
        assert!(tail_mean(&[], 2).is_nan());
    }
}
