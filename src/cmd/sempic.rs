//! `scd sempic train`: train a SemPIC writer (a LoRA of the base that compiles documents alone
//! for the frozen base to read stitched); `scd sempic boundary`: KV-Packet's boundary tokens,
//! for the base or for a writer. Both with a progress bar, periodic atomic checkpoints,
//! `--resume`, and Ctrl-C that finishes the current step, writes a checkpoint and exits.

use scd_models::KernelChoice;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::{bail, Context};
use scd_models::eval::data::FileInfo;
use scd_models::eval::EvalData;
use scd_models::llama::Proj;
use scd_models::lora::LoraAdapter;
use scd_models::train::writer::{train_writer, WriterManifest, WriterOptions, WriterOutcome};
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
    /// Train KV-Packet boundary tokens: a few soft tokens before and after every document,
    /// trained by the same distillation with the model frozen (the packet baseline), or for a
    /// trained writer with `--writer` (the joint mode).
    #[command(after_help = "Examples:\n  \
        scd sempic boundary --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --out experts/packet-boundary\n  \
        scd sempic boundary --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --writer experts/sempic-writer/adapter.safetensors --out experts/joint-boundary")]
    Boundary(BoundaryArgs),
}

/// What every `scd sempic` training run takes.
#[derive(clap::Args)]
pub struct RunArgs {
    /// The base model (the reader; the writer is it plus the adapter).
    #[arg(long, env = "SCD_MODEL")]
    pub model: PathBuf,
    /// Output folder: the trained files, manifest.json, checkpoints/.
    #[arg(long)]
    pub out: PathBuf,
    #[command(flatten)]
    pub dirs: crate::paths::DataDirs,
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
    /// Seed of the initialisation, the examples and their order.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Clip the global gradient norm (0: off).
    #[arg(long, default_value_t = 1.0)]
    pub clip: f64,
    /// Keep every compiling layer's graph instead of recomputing each layer in the backward
    /// pass (faster, more memory).
    #[arg(long)]
    pub no_checkpointing: bool,
    /// Steps between checkpoints.
    #[arg(long, default_value_t = 25)]
    pub checkpoint_every: usize,
    /// Continue from the latest checkpoint in OUT/checkpoints.
    #[arg(long)]
    pub resume: bool,
}

/// Arguments of `scd sempic train`.
#[derive(clap::Args)]
pub struct TrainArgs {
    #[command(flatten)]
    pub run: RunArgs,
    /// LoRA rank.
    #[arg(long, default_value_t = 8)]
    pub rank: usize,
    /// LoRA alpha (scale alpha / rank).
    #[arg(long, default_value_t = 16.0)]
    pub alpha: f64,
    /// Peak learning rate.
    #[arg(long, default_value_t = 5e-4)]
    pub lr: f64,
    /// Projections the writer adapts: all, attention, or a comma list of q,k,v,o,gate,up,down.
    #[arg(long, default_value = "all")]
    pub targets: String,
    /// Storage type of the adapter: bf16 or f32.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Continue training this writer's adapter (same rank, alpha and targets) instead of a
    /// fresh one, with a fresh optimiser and schedule: a second stage on other data.
    #[arg(long, value_name = "ADAPTER")]
    pub init: Option<PathBuf>,
}

/// Arguments of `scd sempic boundary`.
#[derive(clap::Args)]
pub struct BoundaryArgs {
    #[command(flatten)]
    pub run: RunArgs,
    /// Header tokens before each document.
    #[arg(long, default_value_t = 4)]
    pub header: usize,
    /// Trailer tokens after each document.
    #[arg(long, default_value_t = 4)]
    pub trailer: usize,
    /// Peak learning rate.
    #[arg(long, default_value_t = 1e-2)]
    pub lr: f64,
    /// A SemPIC writer's adapter (`scd sempic train`) that compiles the documents between the
    /// tokens: the joint mode. Without it the base compiles them (KV-Packet).
    #[arg(long)]
    pub writer: Option<PathBuf>,
}

/// Runs `scd sempic`.
pub fn run(args: Args, kernels: KernelChoice) -> anyhow::Result<()> {
    match args.sub {
        Sub::Train(a) => train(a, kernels),
        Sub::Boundary(a) => boundary(a, kernels),
    }
}

/// The configuration shared by both runs; LoRA fields at their defaults.
fn run_config(run: &RunArgs, lr: f64) -> anyhow::Result<TrainConfig> {
    if run.min_distractors > run.max_distractors {
        bail!("--min-distractors is above --max-distractors");
    }
    Ok(TrainConfig {
        lr,
        warmup: run.warmup,
        schedule: parse_schedule(&run.schedule)?,
        steps: run.steps,
        // Examples are whole prompts; the window length of fine-tuning is unused.
        seq_len: 2,
        batch: run.batch,
        seed: run.seed,
        weight_decay: 0.0,
        clip_norm: (run.clip > 0.0).then_some(run.clip),
        valid_windows: 0,
        ..TrainConfig::default()
    })
}

fn run_options(run: &RunArgs) -> WriterOptions {
    WriterOptions {
        out_dir: run.out.clone(),
        checkpoint_every: run.checkpoint_every,
        resume: run.resume,
        dtype: candle_core::DType::F32,
        checkpointing: !run.no_checkpointing,
        examples: run.examples,
        valid_examples: run.valid_examples,
        distractors: (run.min_distractors, run.max_distractors),
        compiler_adapter: None,
        init: None,
    }
}

/// Loads the data, the model and the compiling `writer` if any, trains with a progress bar and
/// Ctrl-C, and returns the manifest, or exits after a stop.
fn train_run(
    kernels: KernelChoice,
    run: &RunArgs,
    cfg: &TrainConfig,
    mut opts: WriterOptions,
    writer: Option<&std::path::Path>,
    init: Option<&std::path::Path>,
    what: &str,
) -> anyhow::Result<WriterManifest> {
    let data = EvalData::load(&run.dirs.eval_data).with_context(|| {
        format!(
            "reading SQuAD under {} (set --eval-data or SCD_EVAL_DATA)",
            run.dirs.eval_data.display()
        )
    })?;
    let (base, tok) = super::generate::load(&run.model, kernels)?;
    if let Some(path) = writer {
        opts.compiler_adapter = Some(
            LoraAdapter::load(path, base.config())
                .with_context(|| format!("loading the writer {}", path.display()))?,
        );
    }
    if let Some(path) = init {
        let bytes = std::fs::read(path)
            .with_context(|| format!("reading the writer {}", path.display()))?;
        let adapter = LoraAdapter::load(path, base.config())
            .with_context(|| format!("loading the writer {} to continue", path.display()))?;
        let file = FileInfo {
            path: path.display().to_string(),
            sha256: scd_models::corpus::sha256_hex(&bytes),
        };
        opts.init = Some((adapter, file));
    }
    let stop = Arc::new(AtomicBool::new(false));
    watch_ctrl_c(stop.clone())?;
    let bar = Progress::new(cfg.steps as u64, "steps")?;
    let outcome = train_writer(
        &base,
        &tok,
        &data.squad,
        &data.squad_file,
        cfg,
        &opts,
        &stop,
        print_events(&bar, cfg.steps),
    )
    .with_context(|| format!("training {what}"))?;
    bar.finish();
    match outcome {
        WriterOutcome::Stopped { step, checkpoint } => exit_stopped(step, &checkpoint),
        WriterOutcome::Finished(m) => Ok(*m),
    }
}

fn train(args: TrainArgs, kernels: KernelChoice) -> anyhow::Result<()> {
    let cfg = TrainConfig {
        rank: args.rank,
        alpha: args.alpha,
        targets: Proj::parse_list(&args.targets).ok_or_else(|| {
            anyhow::anyhow!(
                "--targets {}: expected all, attention, or a comma list of q,k,v,o,gate,up,down",
                args.targets
            )
        })?,
        ..run_config(&args.run, args.lr)?
    };
    let opts = WriterOptions {
        dtype: parse_dtype(&args.dtype)?,
        ..run_options(&args.run)
    };
    let m = train_run(
        kernels,
        &args.run,
        &cfg,
        opts,
        None,
        args.init.as_deref(),
        "the SemPIC writer",
    )?;
    let v = &m.validation;
    let out = &args.run.out;
    eprintln!(
        "done: {} steps in {:.0} s ({:.2} s/step); held-out KL to full recompute over {} examples: plain stitching {:.4} -> writer {:.4}; {}manifest {}",
        m.steps,
        m.train_seconds,
        m.seconds_per_step,
        v.examples,
        v.kl_no_recompute,
        v.kl_writer,
        m.adapter.as_ref().map_or(String::new(), |a| format!(
            "adapter {} ({} bytes); ",
            out.join(&a.file).display(),
            a.bytes
        )),
        out.join("manifest.json").display()
    );
    Ok(())
}

fn boundary(args: BoundaryArgs, kernels: KernelChoice) -> anyhow::Result<()> {
    let cfg = TrainConfig {
        boundary: Some((args.header, args.trailer)),
        ..run_config(&args.run, args.lr)?
    };
    let opts = run_options(&args.run);
    let m = train_run(
        kernels,
        &args.run,
        &cfg,
        opts,
        args.writer.as_deref(),
        None,
        "the boundary tokens",
    )?;
    let v = &m.validation;
    eprintln!(
        "done: {} steps in {:.0} s ({:.2} s/step); held-out KL to full recompute over {} examples: plain stitching {:.4}{} -> with the boundary tokens {:.4}; {} {}",
        m.steps,
        m.train_seconds,
        m.seconds_per_step,
        v.examples,
        v.kl_no_recompute,
        v.kl_compiler_alone
            .map_or(String::new(), |k| format!(", the writer alone {k:.4}")),
        v.kl_writer,
        args.run.out.join(scd_models::boundary::BOUNDARY_FILE).display(),
        args.run.out.join("manifest.json").display()
    );
    Ok(())
}
