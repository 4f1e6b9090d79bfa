//! The whole fine-tuning command: tokenise the corpus, validate the base, train (resuming if
//! asked), save the adapter in its storage dtype, validate the stored adapter as a user would
//! load it, and write the expert's manifest.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use candle_core::DType;

use super::{
    run, start_or_resume, tail_mean, LoopEnd, TrainConfig, TrainData, TrainError, TrainEvent,
};
use crate::corpus::{self, Corpus, CorpusError};
use crate::expert::{
    save_adapter, BaseModelInfo, CorpusInfo, Manifest, ValidationInfo, MANIFEST_FILE,
};
use crate::llama::Llama;
use crate::lora::{AdapterMode, LoraAdapter};
use crate::perplexity::score_windows;
use crate::tokenizer::Tokenizer;

/// Where and how [`finetune`] writes.
#[derive(Debug, Clone)]
pub struct FinetuneOptions {
    /// Output folder: `adapter.safetensors`, `adapter_config.json`, `manifest.json`, and
    /// `checkpoints/`.
    pub out_dir: PathBuf,
    /// Steps between checkpoints (0: only at the end and when stopped).
    pub checkpoint_every: usize,
    /// Continue from the latest checkpoint in `out_dir/checkpoints` if there is one.
    pub resume: bool,
    /// Storage dtype of the shipped adapter (`F32` or `BF16`).
    pub dtype: DType,
}

/// How [`finetune`] ended.
#[derive(Debug, Clone)]
pub enum FinetuneOutcome {
    /// Trained, saved and validated.
    Finished(Box<Manifest>),
    /// Stopped by the flag after `step` steps; resume from `checkpoint`.
    Stopped {
        /// Steps done.
        step: usize,
        /// The checkpoint folder.
        checkpoint: PathBuf,
    },
}

fn validation_loss(model: &Llama, windows: &[Vec<u32>]) -> Result<f64, TrainError> {
    score_windows(model, windows)?
        .map(|s| s.mean_nll)
        .ok_or_else(|| TrainError::Config("no validation tokens".into()))
}

/// Runs the fine-tuning command; see the module doc.
pub fn finetune(
    base: &Llama,
    tok: &Tokenizer,
    corpus: &Corpus,
    cfg: &TrainConfig,
    opts: &FinetuneOptions,
    stop: &AtomicBool,
    mut on_event: impl FnMut(&TrainEvent),
) -> Result<FinetuneOutcome, TrainError> {
    let wall = Instant::now();
    cfg.validate()?;
    on_event(&TrainEvent::Note(format!("tokenising {}", corpus.name)));
    let train = corpus::tokenize_long(tok, &corpus.train)?;
    let valid_tokens = corpus::tokenize_long(tok, &corpus.valid)?;
    let valid = corpus::even_windows(&valid_tokens, cfg.seq_len + 1, cfg.valid_windows, "valid")?;
    if train.len() < cfg.seq_len + 1 {
        return Err(CorpusError::TooShort {
            split: "train",
            tokens: train.len(),
            needed: cfg.seq_len + 1,
        }
        .into());
    }
    let data = TrainData { train, valid };
    let ckpt_dir = opts.out_dir.join("checkpoints");
    let mut trainer = start_or_resume(base, cfg, &ckpt_dir, opts.resume, None, &mut on_event)?;
    on_event(&TrainEvent::Note(format!(
        "validating the base on {} windows",
        data.valid.len()
    )));
    let base_loss = validation_loss(base, &data.valid)?;
    if let LoopEnd::Stopped { step, checkpoint } = run(
        &mut trainer,
        &data,
        &ckpt_dir,
        opts.checkpoint_every,
        stop,
        &mut on_event,
    )? {
        return Ok(FinetuneOutcome::Stopped { step, checkpoint });
    }
    on_event(&TrainEvent::Note(
        "saving and validating the adapter".into(),
    ));
    let adapter = trainer.adapter(base, opts.dtype)?;
    let file = save_adapter(&adapter, base, &opts.out_dir, opts.dtype)?;
    // Validate what was stored (after any rounding), loaded back as a user would.
    let stored = LoraAdapter::load(opts.out_dir.join(&file.file), base.config())?;
    let expert = base.with_adapter(&stored, AdapterMode::Merge)?;
    let expert_loss = validation_loss(&expert, &data.valid)?;
    let manifest = Manifest {
        scd_version: env!("CARGO_PKG_VERSION").into(),
        base_model: BaseModelInfo::of(base),
        corpus: CorpusInfo {
            name: corpus.name.clone(),
            train_sha256: corpus.train_sha256.clone(),
            valid_sha256: corpus.valid_sha256.clone(),
            split_rule: corpus.split_rule.clone(),
            train_tokens: data.train.len(),
            valid_tokens: valid_tokens.len(),
        },
        hyperparameters: cfg.clone(),
        targets: cfg
            .targets
            .iter()
            .map(|p| p.hf_name().to_string())
            .collect(),
        steps: trainer.step(),
        final_train_loss: tail_mean(trainer.losses(), 10),
        validation: ValidationInfo {
            windows: data.valid.len(),
            window_tokens: cfg.seq_len + 1,
            base_loss,
            base_perplexity: base_loss.exp(),
            expert_loss,
            expert_perplexity: expert_loss.exp(),
            perplexity_reduction: 1.0 - (expert_loss - base_loss).exp(),
        },
        train_seconds: trainer.train_seconds(),
        wall_seconds: wall.elapsed().as_secs_f64(),
        seconds_per_step: trainer.train_seconds() / trainer.step().max(1) as f64,
        adapter: file,
    };
    manifest.save(&opts.out_dir.join(MANIFEST_FILE))?;
    Ok(FinetuneOutcome::Finished(Box::new(manifest)))
}
