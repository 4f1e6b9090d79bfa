//! `scd finetune`: train a LoRA expert of a base model on a text corpus, with a progress bar,
//! periodic atomic checkpoints, `--resume`, and Ctrl-C that finishes the current step, writes a
//! checkpoint and exits.

use scd_models::KernelChoice;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::progress::Progress;
use anyhow::{bail, Context};
use candle_core::DType;
use scd_models::corpus::Corpus;
use scd_models::llama::Proj;
use scd_models::train::{
    self, FinetuneOptions, FinetuneOutcome, Schedule, TrainConfig, TrainEvent,
};

/// Arguments of `scd finetune`.
#[derive(clap::Args)]
#[command(after_help = "Example:\n  \
    scd finetune --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --corpus moby-dick --out experts/melville")]
pub struct Args {
    /// The base model (GGUF file or Hugging Face directory).
    #[arg(long, env = "SCD_MODEL")]
    pub model: PathBuf,
    /// `moby-dick`, `sotu`, `brown` (from --data-dir), a directory with train.txt and
    /// valid.txt, or a text file (last 10% of lines for validation).
    #[arg(long)]
    pub corpus: String,
    #[command(flatten)]
    pub dirs: crate::paths::DataDirs,
    /// Output folder (adapter, manifest, checkpoints/).
    #[arg(long)]
    pub out: PathBuf,
    /// LoRA rank.
    #[arg(long, default_value_t = 16)]
    pub rank: usize,
    /// LoRA alpha.
    #[arg(long, default_value_t = 32.0)]
    pub alpha: f64,
    /// Peak learning rate.
    #[arg(long, default_value_t = 2e-4)]
    pub lr: f64,
    /// Warm-up steps.
    #[arg(long, default_value_t = 20)]
    pub warmup: usize,
    /// Decay after warm-up: cosine, linear or constant.
    #[arg(long, default_value = "cosine")]
    pub schedule: String,
    /// Optimisation steps.
    #[arg(long, default_value_t = 300)]
    pub steps: usize,
    /// Tokens per window.
    #[arg(long, default_value_t = 256)]
    pub seq_len: usize,
    /// Windows per step.
    #[arg(long, default_value_t = 4)]
    pub batch: usize,
    /// Seed (adapter initialisation and window choice).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// AdamW weight decay.
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f64,
    /// Global gradient-norm clip (0 disables).
    #[arg(long, default_value_t = 1.0)]
    pub clip: f64,
    /// Validation windows.
    #[arg(long, default_value_t = 16)]
    pub valid_windows: usize,
    /// Projections to adapt in every layer: `all`, `attention` (q, k, v, o), or a list such as
    /// `q,k,v,o,down`.
    #[arg(long, default_value = "all")]
    pub targets: String,
    /// Layers to adapt: `all`, or a range such as `0-9` (the first ten).
    #[arg(long, default_value = "all")]
    pub layers: String,
    /// Give the expert its own RoPE base (the base model's by default), as long-context
    /// fine-tunes do; stored in the adapter's metadata and in the expert's identity.
    #[arg(long)]
    pub rope_theta: Option<f64>,
    /// Steps between checkpoints.
    #[arg(long, default_value_t = 25)]
    pub checkpoint_every: usize,
    /// Continue from the latest checkpoint in OUT/checkpoints.
    #[arg(long)]
    pub resume: bool,
    /// Storage type of the shipped adapter: bf16 or f32.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
}

pub fn run(args: Args, kernels: KernelChoice) -> anyhow::Result<()> {
    let schedule = parse_schedule(&args.schedule)?;
    let dtype = parse_dtype(&args.dtype)?;
    let cfg = TrainConfig {
        rank: args.rank,
        alpha: args.alpha,
        lr: args.lr,
        warmup: args.warmup,
        schedule,
        steps: args.steps,
        seq_len: args.seq_len,
        batch: args.batch,
        seed: args.seed,
        weight_decay: args.weight_decay,
        clip_norm: (args.clip > 0.0).then_some(args.clip),
        valid_windows: args.valid_windows,
        layers: parse_layers(&args.layers)?,
        rope_theta: args.rope_theta,
        boundary: None,
        targets: Proj::parse_list(&args.targets).ok_or_else(|| {
            anyhow::anyhow!(
                "--targets {}: expected all, attention, or a comma list of q,k,v,o,gate,up,down",
                args.targets
            )
        })?,
    };
    let corpus = Corpus::open(&args.corpus, &args.dirs.data_dir).context("opening the corpus")?;
    let (base, tok) = super::generate::load(&args.model, kernels)?;
    let stop = Arc::new(AtomicBool::new(false));
    watch_ctrl_c(stop.clone())?;
    let opts = FinetuneOptions {
        out_dir: args.out.clone(),
        checkpoint_every: args.checkpoint_every,
        resume: args.resume,
        dtype,
    };
    let bar = Progress::new(cfg.steps as u64, "steps")?;
    let outcome = train::finetune(
        &base,
        &tok,
        &corpus,
        &cfg,
        &opts,
        &stop,
        print_events(&bar, cfg.steps),
    )
    .context("fine-tuning")?;
    bar.finish();
    match outcome {
        FinetuneOutcome::Stopped { step, checkpoint } => {
            exit_stopped(step, &checkpoint);
        }
        FinetuneOutcome::Finished(m) => {
            let v = &m.validation;
            eprintln!(
                "done: {} steps in {:.0} s ({:.2} s/step); validation perplexity base {:.3} -> expert {:.3} ({:+.1}%); adapter {} ({} bytes); manifest {}",
                m.steps,
                m.train_seconds,
                m.seconds_per_step,
                v.base_perplexity,
                v.expert_perplexity,
                -100.0 * v.perplexity_reduction,
                args.out.join(&m.adapter.file).display(),
                m.adapter.bytes,
                args.out.join("manifest.json").display()
            );
        }
    }
    Ok(())
}

/// Raises `stop` on the first Ctrl-C (the loop finishes its step and checkpoints); a second
/// Ctrl-C exits at once.
/// Tells the user how to go on after Ctrl-C stopped a run, and exits with 130.
pub(crate) fn exit_stopped(step: usize, checkpoint: &std::path::Path) -> ! {
    eprintln!(
        "interrupted: stopped after step {step}; checkpoint {} written. Continue with the same command plus --resume.",
        checkpoint.display()
    );
    std::process::exit(130)
}

/// Shows a run's events on `bar`: steps as its message, the rest as lines.
pub(crate) fn print_events(bar: &Progress, steps: usize) -> impl FnMut(&TrainEvent) + '_ {
    move |e| match e {
        TrainEvent::Started { from, total } => {
            bar.set(*from as u64, *total as u64);
            if !bar.is_tty() {
                eprintln!("training steps {from}..{total}");
            }
        }
        TrainEvent::Step(r) => {
            bar.set(r.step as u64, steps as u64);
            bar.message(
                format!(
                    "step {}/{} loss {:.4} lr {:.2e} |g| {:.3} {:.0} tok/s {:.2} s/step",
                    r.step, steps, r.loss, r.lr, r.grad_norm, r.tokens_per_s, r.seconds
                ),
                true,
            );
        }
        TrainEvent::Checkpoint { step, path } => {
            bar.line(format!("checkpoint at step {step}: {}", path.display()));
        }
        TrainEvent::Note(n) => bar.line(n),
    }
}

/// Raises `stop` on the first Ctrl-C (the run finishes its step and checkpoints); exits on the
/// second.
pub(crate) fn watch_ctrl_c(stop: Arc<AtomicBool>) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the signal watcher")?;
    std::thread::Builder::new()
        .name("ctrl-c".into())
        .spawn(move || {
            rt.block_on(async {
                if tokio::signal::ctrl_c().await.is_ok() {
                    eprintln!("\nCtrl-C: finishing the current step, then writing a checkpoint (Ctrl-C again to abort)");
                    stop.store(true, Ordering::SeqCst);
                }
                if tokio::signal::ctrl_c().await.is_ok() {
                    eprintln!("aborted without a checkpoint of the current step");
                    std::process::exit(130);
                }
            })
        })
        .context("starting the signal watcher")?;
    Ok(())
}

/// `all`, or `A-B` (inclusive).
pub(crate) fn parse_schedule(s: &str) -> anyhow::Result<Schedule> {
    Ok(match s {
        "cosine" => Schedule::Cosine,
        "linear" => Schedule::Linear,
        "constant" => Schedule::Constant,
        other => bail!("unknown schedule {other:?}: expected cosine, linear or constant"),
    })
}

pub(crate) fn parse_dtype(s: &str) -> anyhow::Result<DType> {
    Ok(match s {
        "bf16" => DType::BF16,
        "f32" => DType::F32,
        other => bail!("unknown adapter dtype {other:?}: expected bf16 or f32"),
    })
}

fn parse_layers(s: &str) -> anyhow::Result<Option<Vec<usize>>> {
    if s == "all" {
        return Ok(None);
    }
    let range = s.split_once('-').and_then(|(a, b)| {
        let (a, b) = (
            a.trim().parse::<usize>().ok()?,
            b.trim().parse::<usize>().ok()?,
        );
        (a <= b).then(|| (a..=b).collect())
    });
    match range {
        Some(layers) => Ok(Some(layers)),
        None => bail!("--layers {s}: expected all or a range such as 0-9"),
    }
}
