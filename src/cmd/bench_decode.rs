//! `scd bench decode`: a consumer decoding several jobs at once (the batched decode of
//! `actors/src/decode_loop.rs`). For each number of experts (applied on the fly over the shared
//! base) and each number of concurrent jobs, every job decodes the same number of greedy tokens in
//! one [`Batch`]; the figures are aggregate tokens per second and each job's milliseconds per
//! token, next to one job alone (the first row of each table, measured in the same run with the
//! same warm-up and repetitions), and to one merged expert decoding alone (what a node with one
//! expert does).

use scd_models::KernelChoice;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use scd_models::batch::Batch;
use scd_models::bench::synthetic_tokens;
use scd_models::{AdapterMode, GenerateParams, Input, KvCache, Llama, LogitsWanted, LoraAdapter};

/// Arguments of `scd bench decode`.
#[derive(clap::Args)]
pub struct Args {
    /// The base model (GGUF).
    #[arg(long, env = "SCD_MODEL")]
    model: PathBuf,
    /// The experts (folders with adapter.safetensors); jobs go to them round-robin.
    #[arg(
        long = "expert",
        default_values = ["experts/mail", "experts/sotu", "experts/melville"]
    )]
    expert_dirs: Vec<PathBuf>,
    /// Concurrent jobs, one table row each; the first, 1, is what the others compare with.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    jobs: Vec<usize>,
    /// How many of the experts the jobs spread over, one table each.
    #[arg(long, value_delimiter = ',', default_value = "1,3")]
    experts: Vec<usize>,
    /// Prompt tokens of every job (its cache before decoding).
    #[arg(long, default_value_t = 256)]
    prompt_tokens: usize,
    /// Greedy tokens every job decodes per repetition.
    #[arg(long, default_value_t = 32)]
    tokens: usize,
    /// Untimed repetitions before the timed ones.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Timed repetitions (the median is reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
}

pub fn run(args: Args, kernels: KernelChoice) -> anyhow::Result<()> {
    if args.jobs.contains(&0) || args.experts.contains(&0) {
        bail!("--jobs and --experts take positive counts");
    }
    if let Some(&e) = args.experts.iter().find(|&&e| e > args.expert_dirs.len()) {
        bail!(
            "--experts {e} needs {e} expert folders; {} given with --expert",
            args.expert_dirs.len()
        );
    }
    if args.jobs.first() != Some(&1) {
        bail!("--jobs must start with 1: each table compares its rows with one job alone");
    }
    if args.reps == 0 || args.tokens == 0 {
        bail!("--reps and --tokens must be positive");
    }
    let base = Llama::from_gguf_with(&args.model, kernels).context("loading the base")?;
    let adapters = args
        .expert_dirs
        .iter()
        .map(|dir| {
            let file = dir.join("adapter.safetensors");
            LoraAdapter::load(&file, base.config())
                .with_context(|| format!("loading {}", file.display()))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let on_the_fly = adapters
        .iter()
        .map(|a| Ok(Arc::new(base.with_adapter(a, AdapterMode::OnTheFly)?)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let threads = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .or_else(|| {
            std::thread::available_parallelism()
                .ok()
                .map(|p| p.to_string())
        })
        .unwrap_or_else(|| "?".into());
    println!(
        "batched decode: {} prompt tokens per job, {} greedy tokens, median of {} runs after {} \
         untimed, {threads} threads; decode weights {} with {} products",
        args.prompt_tokens,
        args.tokens,
        args.reps,
        args.warmup,
        base.decode_weights(),
        base.decode_products()
    );
    let merged = Arc::new(base.with_adapter(&adapters[0], AdapterMode::Merge)?);
    let alone = time_jobs(&args, &[merged], 1)?;
    println!(
        "one job on {} merged (adapter_mode = merge): {:.1} tok/s, {:.1} ms/token",
        args.expert_dirs[0].display(),
        tokens_per_second(&args, 1, alone),
        ms_per_token(&args, alone)
    );
    for &e in &args.experts {
        let models = &on_the_fly[..e];
        println!("\n{e} expert(s) on the fly over the shared base, jobs round-robin:");
        println!("| jobs | aggregate tok/s | ms/token per job | vs one job |");
        println!("| ---: | ---: | ---: | ---: |");
        let mut one = None;
        for &j in &args.jobs {
            let took = time_jobs(&args, models, j)?;
            let rate = tokens_per_second(&args, j, took);
            let reference = *one.get_or_insert(rate / j as f64);
            println!(
                "| {j} | {rate:.1} | {:.1} | {:.2}x |",
                ms_per_token(&args, took),
                rate / reference
            );
        }
    }
    Ok(())
}

fn tokens_per_second(args: &Args, jobs: usize, took: Duration) -> f64 {
    (jobs * args.tokens) as f64 / took.as_secs_f64()
}

fn ms_per_token(args: &Args, took: Duration) -> f64 {
    took.as_secs_f64() * 1e3 / args.tokens as f64
}

/// The median time for `jobs` jobs (round-robin over `models`) to decode `args.tokens` tokens
/// each in one batch, from caches prefilled (untimed) with distinct prompts.
fn time_jobs(args: &Args, models: &[Arc<Llama>], jobs: usize) -> anyhow::Result<Duration> {
    let vocab = models[0].config().vocab_size;
    let text = synthetic_tokens(vocab, (args.prompt_tokens + 1) * jobs);
    let mut prefilled: Vec<(Arc<Llama>, KvCache, u32)> = Vec::new();
    for (j, prompt) in text.chunks(args.prompt_tokens + 1).enumerate() {
        let model = Arc::clone(&models[j % models.len()]);
        let (&last, prefix) = prompt.split_last().context("empty prompt")?;
        let mut cache = model.new_cache();
        model.forward(
            Input::new(prefix)
                .with_cache(&mut cache)
                .logits(LogitsWanted::None),
        )?;
        prefilled.push((model, cache, last));
    }
    let params = GenerateParams {
        max_tokens: args.tokens,
        ..GenerateParams::default()
    };
    let mut times = Vec::new();
    for rep in 0..args.warmup + args.reps {
        let mut batch = Batch::new();
        for (j, (model, cache, last)) in prefilled.iter().enumerate() {
            batch.join(
                j,
                Arc::clone(model),
                cache.try_clone()?,
                vec![*last],
                &params,
            )?;
        }
        let t0 = Instant::now();
        while !batch.is_empty() {
            batch.step(|_| true)?;
        }
        if rep >= args.warmup {
            times.push(t0.elapsed());
        }
    }
    times.sort();
    Ok(times[times.len() / 2])
}
