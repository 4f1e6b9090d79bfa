//! `scd bench docs`: time to first token with compiled document caches (SemPIC's serving cost,
//! `docs/method.md` §5.5) against full recompute. For each number of documents, every document
//! (`--doc-tokens` tokens) is compiled alone beforehand, as a document store would hold it; per
//! request the compiled side only stitches the caches and runs the question, while full recompute
//! prefills the documents and the question together. Both end at the first token's logits; same
//! warm-up and repetitions, median reported.

use scd_models::KernelChoice;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use scd_models::bench::synthetic_tokens;
use scd_models::sempic::{stitch, CompiledDoc};
use scd_models::{Input, Llama, LogitsWanted};

/// Arguments of `scd bench docs`.
#[derive(clap::Args)]
pub struct Args {
    /// The model (GGUF).
    #[arg(long, env = "SCD_MODEL")]
    model: PathBuf,
    /// Documents per request, one row each.
    #[arg(long, value_delimiter = ',', default_value = "4,8,16")]
    docs: Vec<usize>,
    /// Tokens per document.
    #[arg(long, default_value_t = 256)]
    doc_tokens: usize,
    /// Tokens of the question after the documents.
    #[arg(long, default_value_t = 24)]
    question_tokens: usize,
    /// Untimed requests before the timed ones, per row and side.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Timed requests per row and side (the median is reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
}

pub fn run(args: Args, kernels: KernelChoice) -> anyhow::Result<()> {
    if args.docs.contains(&0) || args.doc_tokens == 0 || args.question_tokens == 0 {
        bail!("--docs, --doc-tokens and --question-tokens take positive counts");
    }
    let (model, _) = super::generate::load(&args.model, kernels)?;
    let vocab = model.config().vocab_size;
    let most = args.docs.iter().copied().max().unwrap_or(0);
    let context = model.config().context_length;
    if most * args.doc_tokens + args.question_tokens >= context {
        bail!(
            "{most} documents of {} tokens and a {}-token question exceed the {context}-token window",
            args.doc_tokens,
            args.question_tokens
        );
    }
    // Distinct documents: each a different slice of a long synthetic text.
    let text = synthetic_tokens(vocab, most * args.doc_tokens + args.question_tokens);
    let (doc_text, question) = text.split_at(most * args.doc_tokens);
    let started = Instant::now();
    let compiled = doc_text
        .chunks(args.doc_tokens)
        .map(|d| CompiledDoc::compile(&model, d))
        .collect::<Result<Vec<_>, _>>()
        .context("compiling the documents")?;
    println!(
        "compiled {most} documents of {} tokens in {:.2} s (offline work, not in the figures); prefill on {}",
        args.doc_tokens,
        started.elapsed().as_secs_f64(),
        model.prefill_matmul()
    );
    println!(
        "protocol: {} untimed + {} timed requests per row and side, median; a request ends at the first token's logits",
        args.warmup, args.reps
    );
    println!();
    println!("| documents | prompt tokens | full recompute TTFT s | compiled TTFT s | speed-up |");
    println!("|---:|---:|---:|---:|---:|");
    for &n in &args.docs {
        let docs: Vec<&CompiledDoc> = compiled.iter().take(n).collect();
        let all: Vec<u32> = doc_text[..n * args.doc_tokens]
            .iter()
            .chain(question)
            .copied()
            .collect();
        let full = median(&args, || first_token_full(&model, &all))?;
        let fast = median(&args, || first_token_compiled(&model, &docs, question))?;
        println!(
            "| {n} | {} | {:.3} | {:.3} | {:.1}x |",
            all.len(),
            full.as_secs_f64(),
            fast.as_secs_f64(),
            full.as_secs_f64() / fast.as_secs_f64()
        );
    }
    Ok(())
}

fn median(args: &Args, f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<Duration> {
    super::bench::median_time(args.warmup, args.reps, f)
}

fn first_token_full(model: &Llama, tokens: &[u32]) -> anyhow::Result<()> {
    let mut cache = model.new_cache();
    model.forward(
        Input::new(tokens)
            .with_cache(&mut cache)
            .logits(LogitsWanted::Last),
    )?;
    Ok(())
}

fn first_token_compiled(
    model: &Llama,
    docs: &[&CompiledDoc],
    question: &[u32],
) -> anyhow::Result<()> {
    let mut cache = stitch(model, docs)?;
    model.forward(
        Input::new(question)
            .with_cache(&mut cache)
            .logits(LogitsWanted::Last),
    )?;
    Ok(())
}
