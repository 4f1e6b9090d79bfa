//! The whole `scd sempic train` command (and `scd sempic boundary`): multi-document examples
//! from the SQuAD articles kept for the writer ([`crate::eval::multidoc::writer_split`]), a run
//! of the writer's objective ([`super::sempic`]) resuming if asked, the adapter saved in its
//! storage dtype (or KV-Packet boundary tokens, [`crate::boundary`], when the configuration asks
//! for them), and a manifest with the held-out KL before and after.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use candle_core::DType;
use serde::{Deserialize, Serialize};

use super::sempic::{example_kl, WriterExample, WriterObjective};
use super::{run, start_or_resume, tail_mean, LoopEnd, TrainConfig, TrainError, TrainEvent};
use crate::boundary::{Boundary, BoundaryMeta};
use crate::eval::data::{FileInfo, QaItem};
use crate::eval::multidoc::{build_items, gold_answer, pieces, writer_split, WRITER_ARTICLES};
use crate::expert::{save_adapter, AdapterFileInfo, BaseModelInfo};
use crate::json_file;
use crate::llama::Llama;
use crate::lora::{AdapterMode, LoraAdapter};
use crate::tokenizer::Tokenizer;

/// The manifest's name beside a writer adapter.
pub const WRITER_MANIFEST_FILE: &str = "manifest.json";

/// What [`train_writer`] trains on and where it writes.
#[derive(Debug, Clone)]
pub struct WriterOptions {
    /// Output folder: `adapter.safetensors`, `adapter_config.json`, `manifest.json`,
    /// `checkpoints/`.
    pub out_dir: PathBuf,
    /// Steps between checkpoints (0: only at the end and when stopped).
    pub checkpoint_every: usize,
    /// Continue from the latest checkpoint in `out_dir/checkpoints` if there is one.
    pub resume: bool,
    /// Storage dtype of the adapter (`F32` or `BF16`).
    pub dtype: DType,
    /// KV gradient checkpointing per writer layer.
    pub checkpointing: bool,
    /// Training examples (questions of the writer's articles, each with its distractors).
    pub examples: usize,
    /// Held-out examples (other questions of the same articles) for the KL before and after.
    pub valid_examples: usize,
    /// Fewest and most distractor paragraphs per example.
    pub distractors: (usize, usize),
    /// For boundary tokens ([`TrainConfig::boundary`]): a SemPIC writer that compiles with
    /// them (the joint mode); `None` compiles with the base.
    pub compiler_adapter: Option<LoraAdapter>,
    /// A writer to continue training (with its file), instead of a fresh adapter: its rank,
    /// alpha and projections must be the run's.
    pub init: Option<(LoraAdapter, FileInfo)>,
}

/// The data a writer was trained on.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct WriterData {
    /// The SQuAD file and its hash.
    pub squad: FileInfo,
    /// The articles used (indices in the file), none of which the evaluation reads.
    pub articles: Vec<usize>,
    /// Training examples.
    pub examples: usize,
    /// Held-out examples.
    pub valid_examples: usize,
    /// Distractor paragraphs per example, fewest and most.
    pub distractors: (usize, usize),
    /// Mean tokens per training example.
    pub mean_tokens: f64,
}

/// The held-out KL to full recompute at the positions after the documents.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct WriterValidation {
    /// Examples.
    pub examples: usize,
    /// Documents compiled by the base (plain stitching, no recompute).
    pub kl_no_recompute: f64,
    /// Documents compiled by the writer as stored (boundary tokens: by the compiler between the
    /// tokens as stored).
    pub kl_writer: f64,
    /// Boundary tokens for a writer: documents compiled by that writer without them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kl_compiler_alone: Option<f64>,
}

/// The manifest written beside a writer adapter.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct WriterManifest {
    /// scd version that trained it.
    pub scd_version: String,
    /// The base model (writer with the adapter, reader without).
    pub base_model: BaseModelInfo,
    /// The training data.
    pub data: WriterData,
    /// Hyperparameters (`seq_len` unused: examples are whole prompts).
    pub hyperparameters: TrainConfig,
    /// KV gradient checkpointing per writer layer.
    pub checkpointing: bool,
    /// Steps done.
    pub steps: usize,
    /// Mean training loss (KL) of the last (up to) 10 steps.
    pub final_train_loss: f64,
    /// Held-out KL before and after.
    pub validation: WriterValidation,
    /// Seconds of optimisation steps.
    pub train_seconds: f64,
    /// Wall time of this invocation, seconds.
    pub wall_seconds: f64,
    /// Mean seconds per step.
    pub seconds_per_step: f64,
    /// The adapter file (`None` for boundary tokens).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapter: Option<AdapterFileInfo>,
    /// The boundary tokens' description (`None` for a writer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boundary: Option<BoundaryMeta>,
    /// The adapter a writer's run continued (`None`: a fresh adapter from the seed). Its own
    /// manifest tells how it was trained; `steps` and `data` here are this run's alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub continued_from: Option<FileInfo>,
}

/// How [`train_writer`] ended.
#[derive(Debug, Clone)]
pub enum WriterOutcome {
    /// Trained, saved and validated.
    Finished(Box<WriterManifest>),
    /// Stopped by the flag after `step` steps; resume from `checkpoint`.
    Stopped {
        /// Steps done.
        step: usize,
        /// The checkpoint folder.
        checkpoint: PathBuf,
    },
}

/// The examples of a writer's run.
#[derive(Debug, Clone)]
pub struct WriterExamples {
    /// What the run trains on.
    pub train: Vec<WriterExample>,
    /// Held out, for the KL before and after.
    pub valid: Vec<WriterExample>,
    /// The SQuAD articles they come from (indices in the file).
    pub articles: Vec<usize>,
}

/// Training and held-out examples from the writer's articles of `squad`.
pub fn writer_examples(
    tok: &Tokenizer,
    squad: &[QaItem],
    opts: &WriterOptions,
    seed: u64,
) -> Result<WriterExamples, TrainError> {
    let (train, _) = writer_split(squad);
    let mut articles: Vec<usize> = train.iter().map(|q| q.article).collect();
    articles.dedup();
    let wanted = opts.examples + opts.valid_examples;
    if train.len() < wanted {
        return Err(TrainError::Config(format!(
            "{wanted} examples asked for, the writer's {WRITER_ARTICLES} articles have {} questions",
            train.len()
        )));
    }
    let items = build_items(&train, wanted, opts.distractors, seed);
    let mut examples = items
        .iter()
        .map(|item| {
            let p = pieces(tok, item).map_err(|e| TrainError::Config(e.to_string()))?;
            let answer = gold_answer(tok, item).map_err(|e| TrainError::Config(e.to_string()))?;
            Ok(WriterExample::new(p, &answer))
        })
        .collect::<Result<Vec<_>, TrainError>>()?;
    let valid = examples.split_off(opts.examples);
    Ok(WriterExamples {
        train: examples,
        valid,
        articles,
    })
}

fn mean_kl(
    reader: &Llama,
    writer: &Llama,
    boundary: Option<&Boundary>,
    examples: &[WriterExample],
) -> Result<f64, TrainError> {
    let mut sum = 0.0;
    for ex in examples {
        sum += example_kl(reader, writer, boundary, ex)?;
    }
    Ok(sum / examples.len().max(1) as f64)
}

/// Runs the writer's training command; see the module doc.
#[allow(clippy::too_many_arguments)]
pub fn train_writer(
    base: &Llama,
    tok: &Tokenizer,
    squad: &[QaItem],
    squad_file: &FileInfo,
    cfg: &TrainConfig,
    opts: &WriterOptions,
    stop: &AtomicBool,
    mut on_event: impl FnMut(&TrainEvent),
) -> Result<WriterOutcome, TrainError> {
    let wall = Instant::now();
    cfg.validate()?;
    if opts.distractors.0 > opts.distractors.1 {
        return Err(TrainError::Config(
            "fewest distractors above the most".into(),
        ));
    }
    on_event(&TrainEvent::Note("building the examples".into()));
    let WriterExamples {
        train: examples,
        valid,
        articles,
    } = writer_examples(tok, squad, opts, cfg.seed)?;
    let mean_tokens =
        examples.iter().map(WriterExample::len).sum::<usize>() as f64 / examples.len() as f64;
    let objective = WriterObjective::new(base, examples, opts.checkpointing)?;
    let reader = objective.reader();
    // An adapter's run trains on the f32 reader, so that teacher and student multiply alike;
    // boundary tokens train for their compiler, the reader or the reader with a writer.
    let compiler = match (&cfg.boundary, &opts.compiler_adapter) {
        (Some(_), Some(a)) => reader.with_adapter(a, AdapterMode::Merge)?,
        (None, Some(_)) => {
            return Err(TrainError::Config(
                "a compiling writer only goes with boundary tokens".into(),
            ))
        }
        _ => reader.clone(),
    };
    let ckpt_dir = opts.out_dir.join("checkpoints");
    let mut trainer = start_or_resume(
        &compiler,
        cfg,
        &ckpt_dir,
        opts.resume,
        opts.init.as_ref().map(|(a, _)| a),
        &mut on_event,
    )?;
    on_event(&TrainEvent::Note(format!(
        "held-out KL of plain stitching on {} examples",
        valid.len()
    )));
    let kl_no_recompute = mean_kl(reader, reader, None, &valid)?;
    on_event(&TrainEvent::Note(format!(
        "held-out KL without the writer: {kl_no_recompute:.4}"
    )));
    let kl_compiler_alone = match opts.compiler_adapter {
        Some(_) => {
            let kl = mean_kl(reader, &compiler, None, &valid)?;
            on_event(&TrainEvent::Note(format!(
                "held-out KL of the compiling writer without boundary tokens: {kl:.4}"
            )));
            Some(kl)
        }
        None => None,
    };
    if let LoopEnd::Stopped { step, checkpoint } = run(
        &mut trainer,
        &objective,
        &ckpt_dir,
        opts.checkpoint_every,
        stop,
        &mut on_event,
    )? {
        return Ok(WriterOutcome::Stopped { step, checkpoint });
    }
    // Validate what was stored (after any rounding), loaded back as a user would.
    let (adapter, boundary, kl_writer) = match trainer.boundary() {
        Some(live) => {
            on_event(&TrainEvent::Note(
                "saving and validating the boundary tokens".into(),
            ));
            let meta = live.detach().save(&opts.out_dir)?;
            let stored = Boundary::load(&opts.out_dir, &compiler)?;
            let kl = mean_kl(reader, &compiler, Some(&stored), &valid)?;
            (None, Some(meta), kl)
        }
        None => {
            on_event(&TrainEvent::Note("saving and validating the writer".into()));
            let adapter = trainer.adapter(base, opts.dtype)?;
            let file = save_adapter(&adapter, base, &opts.out_dir, opts.dtype)?;
            let stored = LoraAdapter::load(opts.out_dir.join(&file.file), base.config())?;
            let writer = reader.with_adapter(&stored, AdapterMode::Merge)?;
            (Some(file), None, mean_kl(reader, &writer, None, &valid)?)
        }
    };
    let manifest = WriterManifest {
        scd_version: env!("CARGO_PKG_VERSION").into(),
        base_model: BaseModelInfo::of(base),
        data: WriterData {
            squad: squad_file.clone(),
            articles,
            examples: opts.examples,
            valid_examples: valid.len(),
            distractors: opts.distractors,
            mean_tokens,
        },
        hyperparameters: cfg.clone(),
        checkpointing: opts.checkpointing,
        steps: trainer.step(),
        final_train_loss: tail_mean(trainer.losses(), 10),
        validation: WriterValidation {
            examples: valid.len(),
            kl_no_recompute,
            kl_writer,
            kl_compiler_alone,
        },
        train_seconds: trainer.train_seconds(),
        wall_seconds: wall.elapsed().as_secs_f64(),
        seconds_per_step: trainer.train_seconds() / trainer.step().max(1) as f64,
        adapter,
        boundary,
        continued_from: opts.init.as_ref().map(|(_, f)| f.clone()),
    };
    json_file::write_atomic(&opts.out_dir.join(WRITER_MANIFEST_FILE), &manifest)?;
    Ok(WriterOutcome::Finished(Box::new(manifest)))
}
