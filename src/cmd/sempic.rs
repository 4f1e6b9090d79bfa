//! `scd sempic train`: train a SemPIC writer (a LoRA of the base that compiles documents alone
//! for the frozen base to read stitched), with a progress bar, periodic atomic checkpoints,
//! `--resume`, and Ctrl-C that finishes the current step, writes a checkpoint and exits.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::{bail, Context};
use scd_models::eval::EvalData;
use scd_models::llama::Proj;
use scd_models::train::writer::{train_writer, WriterOptions, WriterOutcome};
use scd_models::train::TrainConfig;

use super::finetune::{exit_stopped, parse_dtype, parse_schedule, print_events, watch_ctrl_c};
use crate::progress::Progress;

/// `scd sempic`.
#[derive(clap::Args)]
#[command(after_help = "Example:\n  \
    scd sempic train --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --out experts/sempic-writer")]
pub struct Args {
    #[command(subcommand)]
    pub sub: Sub,
}

/// The SemPIC commands.
#[derive(clap::Subcommand)]
pub enum Sub {
    /// Train a writer by distillation: the base with the full context in place teaches the
    /// base reading documents the writer compiled alone. Trains on the last four articles of
    /// the SQuAD part, which `scd eval multidoc` never reads.
    #[command(after_help = "Example:\n  \
        scd sempic train --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --out experts/sempic-writer")]
    Train(TrainArgs),
}

/// Arguments of `scd sempic train`.
#[derive(clap::Args)]
pub struct TrainArgs {
    /// The base model (the reader; the writer is it plus the adapter).
    #[arg(long, env = "SCD_MODEL")]
    pub model: PathBuf,
    /// Output folder: adapter.safetensors, adapter_config.json, manifest.json, checkpoints/.
    #[arg(long)]
    pub out: PathBuf,
    #[command(flatten)]
    pub dirs: crate::paths::DataDirs,
    /// LoRA rank.
    #[arg(long, default_value_t = 8)]
    pub rank: usize,
    /// LoRA alpha (scale alpha / rank).
    #[arg(long, default_value_t = 16.0)]
    pub alpha: f64,
    /// Peak learning rate.
    #[arg(long, default_value_t = 5e-4)]
    pub lr: f64,
    /// Warm-up steps.
    #[arg(long, default_value_t = 10)]
    pub warmup: usize,
    /// Decay after warm-up: linear, cosine or constant.
    #[arg(long, default_value = "linear")]
    pub schedule: String,
    /// Optimisation steps.
    #[arg(long, default_value_t = 300)]
    pub steps: usize,
    /// Examples per step.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Training examples (questions of the writer's articles with their distractors).
    #[arg(long, default_value_t = 600)]
    pub examples: usize,
    /// Held-out examples for the KL before and after.
    #[arg(long, default_value_t = 24)]
    pub valid_examples: usize,
    /// Fewest distractor paragraphs per example.
    #[arg(long, default_value_t = 2)]
    pub min_distractors: usize,
    /// Most distractor paragraphs per example.
    #[arg(long, default_value_t = 4)]
    pub max_distractors: usize,
    /// Projections the writer adapts: all, attention, or a comma list of q,k,v,o,gate,up,down.
    #[arg(long, default_value = "all")]
    pub targets: String,
    /// Seed of the adapter's initialisation, the examples and their order.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Clip the global gradient norm (0: off).
    #[arg(long, default_value_t = 1.0)]
    pub clip: f64,
    /// Keep every writer layer's graph instead of recomputing each layer in the backward pass
    /// (faster, more memory).
    #[arg(long)]
    pub no_checkpointing: bool,
    /// Steps between checkpoints.
    #[arg(long, default_value_t = 25)]
    pub checkpoint_every: usize,
    /// Continue from the latest checkpoint in OUT/checkpoints.
    #[arg(long)]
    pub resume: bool,
    /// Storage type of the adapter: bf16 or f32.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
}

/// Runs `scd sempic`.
pub fn run(args: Args) -> anyhow::Result<()> {
    match args.sub {
        Sub::Train(a) => train(a),
    }
}

fn train(args: TrainArgs) -> anyhow::Result<()> {
    if args.min_distractors > args.max_distractors {
        bail!("--min-distractors is above --max-distractors");
    }
    let cfg = TrainConfig {
        rank: args.rank,
        alpha: args.alpha,
        lr: args.lr,
        warmup: args.warmup,
        schedule: parse_schedule(&args.schedule)?,
        steps: args.steps,
        // Examples are whole prompts; the window length of fine-tuning is unused.
        seq_len: 2,
        batch: args.batch,
        seed: args.seed,
        weight_decay: 0.0,
        clip_norm: (args.clip > 0.0).then_some(args.clip),
        valid_windows: 0,
        targets: Proj::parse_list(&args.targets).ok_or_else(|| {
            anyhow::anyhow!(
                "--targets {}: expected all, attention, or a comma list of q,k,v,o,gate,up,down",
                args.targets
            )
        })?,
        layers: None,
        rope_theta: None,
    };
    let opts = WriterOptions {
        out_dir: args.out.clone(),
        checkpoint_every: args.checkpoint_every,
        resume: args.resume,
        dtype: parse_dtype(&args.dtype)?,
        checkpointing: !args.no_checkpointing,
        examples: args.examples,
        valid_examples: args.valid_examples,
        distractors: (args.min_distractors, args.max_distractors),
    };
    let data = EvalData::load(&args.dirs.shared_data).with_context(|| {
        format!(
            "reading SQuAD under {} (set --shared-data or SCD_SHARED_DATA)",
            args.dirs.shared_data.display()
        )
    })?;
    let (base, tok) = super::generate::load(&args.model)?;
    let stop = Arc::new(AtomicBool::new(false));
    watch_ctrl_c(stop.clone())?;
    let bar = Progress::new(cfg.steps as u64, "steps")?;
    let outcome = train_writer(
        &base,
        &tok,
        &data.squad,
        &data.squad_file,
        &cfg,
        &opts,
        &stop,
        print_events(&bar, cfg.steps),
    )
    .context("training the SemPIC writer")?;
    bar.finish();
    match outcome {
        WriterOutcome::Stopped { step, checkpoint } => {
            exit_stopped(step, &checkpoint);
        }
        WriterOutcome::Finished(m) => {
            let v = &m.validation;
            eprintln!(
                "done: {} steps in {:.0} s ({:.2} s/step); held-out KL to full recompute over {} examples: plain stitching {:.4} -> writer {:.4}; adapter {} ({} bytes); manifest {}",
                m.steps,
                m.train_seconds,
                m.seconds_per_step,
                v.examples,
                v.kl_no_recompute,
                v.kl_writer,
                args.out.join(&m.adapter.file).display(),
                m.adapter.bytes,
                args.out.join("manifest.json").display()
            );
        }
    }
    Ok(())
}
