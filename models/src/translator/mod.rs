//! SCD translators: what a calibrated model pair (a base producer and one or more expert
//! consumers) needs to move a prompt's state in a few low-rank codes instead of raw KV.
//!
//! Per layer a translator holds the Reuse codes of K and V ([`low_rank`]: a joint low-rank
//! factorisation of producer and consumer rows, a ridge encoder for the producer and a decoder
//! per consumer), and, for the few Patch layers, a code of the attention input `H_in` with an
//! MLP [`aligner`] per consumer, after which the consumer regenerates K and V with its own
//! weights. Ranks are nested, so a request may use any ranks up to the stored `r_max`.
//!
//! Files: [`moments`] (calibration statistics), [`low_rank`] (fit, encode, decode),
//! [`aligner`] (the Patch MLP), [`artifact`] (the manifest and the safetensors file, with the
//! checks a loader makes), [`calibrate`](mod@calibrate) (the `scd calibrate` pipeline: its
//! settings, prompts and the sequence of steps in `calibrate.rs`, one file per step under
//! `calibrate/`: `capture.rs`, `fit_layers.rs`, `heldout.rs`, `assemble.rs`), [`select`]
//! (measuring quality on held-out calibration prompts, and choosing the Patch layers and
//! DroidSpeak blocks with it), [`rank_curve`] (quality at a grid of ranks, and the choice of
//! ranks for a link), [`rate_table`] (the step scales of transform-coded codes, and quality
//! and size at a ladder of rates), [`kvtc`] (the base's own PCA basis, for the `kvtc` mode
//! that transform-codes raw KV without translating it).

use std::path::PathBuf;

use crate::error::ForwardError;

pub mod aligner;
pub mod artifact;
pub mod calibrate;
pub mod kvtc;
pub mod low_rank;
pub mod moments;
pub mod rank_curve;
pub mod rate_table;
pub mod select;

pub use aligner::{Aligner, AlignerConfig};
pub use artifact::{
    CalibrationInfo, ConsumerRef, LayerTranslator, ModelRef, PatchLayer, Ranks, Translator,
    TranslatorManifest, WeightsDtype,
};
pub use calibrate::{calibrate, CalibrateEvent, CalibrationConfig, PatchChoice};
pub use low_rank::{FitOptions, LowRankCode};
pub use rank_curve::{LinkEstimate, RankChoice, RankCurve, RankPoint, RankPolicy};
pub use rate_table::{RateChoice, RatePoint, RateTable};

/// Errors of fitting, saving, loading or applying a translator.
#[derive(Debug, thiserror::Error)]
pub enum TranslatorError {
    /// Tensor math failed.
    #[error("tensor operation failed: {0}")]
    Tensor(#[from] candle_core::Error),
    /// A forward pass failed.
    #[error(transparent)]
    Forward(#[from] ForwardError),
    /// The fit cannot be done with this data or these settings.
    #[error("translator fit: {0}")]
    Fit(String),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The artifact is damaged: unreadable, truncated, or its content does not match its
    /// manifest.
    #[error("corrupt translator: {0}")]
    Corrupt(String),
    /// The translator was calibrated for other models than the ones given.
    #[error("translator made for another model pair: {0}")]
    WrongPair(String),
    /// Ranks above what the translator stores, or otherwise unusable.
    #[error("bad ranks: {0}")]
    Ranks(String),
    /// Calibration data that cannot be used.
    #[error(transparent)]
    Data(#[from] crate::corpus::CorpusError),
    /// Tokenising the calibration text failed.
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    /// A codec failed while measuring quality.
    #[error(transparent)]
    Codec(Box<crate::codec::CodecError>),
    /// The optimiser's state did not fit.
    #[error(transparent)]
    Optimiser(#[from] crate::optim::StateMismatch),
}

impl From<crate::codec::CodecError> for TranslatorError {
    fn from(e: crate::codec::CodecError) -> Self {
        Self::Codec(Box::new(e))
    }
}
