//! `scd bench`: benchmarks, one subcommand per area. Build with `--release`.

use super::{
    bench_codes, bench_decode, bench_docs, bench_fanout, bench_links, bench_memory, bench_model,
    bench_transport, bench_ttft,
};
use scd_models::KernelChoice;

/// Arguments of `scd bench`.
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    scd bench model --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf\n  \
    scd bench transport\n  \
    scd bench memory --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf\n  \
    scd bench decode --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --jobs 1,2,4,8 --experts 1,3\n  \
    scd bench docs --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --docs 4,8,16\n  \
    scd bench links --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --links 50,500,5000\n  \
    scd bench fanout --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --experts mail,sotu,melville\n  \
    scd bench ttft --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --lengths 256,1024 --links 50,500,5000,loopback")]
pub struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Subcommand)]
enum Command {
    /// QUIC goodput next to plain quinn, frame codec throughput, pacing accuracy.
    #[command(after_help = "Example:\n  scd bench transport")]
    Transport(bench_transport::Args),
    /// Prefill (AMX tiles and f32) and decode (narrow and f32 weights) speed next to llama.cpp,
    /// candle-transformers' quantized llama and the machine's f32 matmul and AMX peaks; peak
    /// memory.
    #[command(after_help = "Example:\n  \
        scd bench model --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --llama-python .cache/llama-cpp/bin/python")]
    Model(bench_model::Args),
    /// Resident memory of the base and its experts: one expert against several, adapters
    /// merged or applied on the fly.
    #[command(after_help = "Example:\n  \
        scd bench memory --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    Memory(bench_memory::Args),
    /// Several jobs decoding at once in one batch, over one expert or several sharing the
    /// base: aggregate tokens/s and per-job ms/token next to one job alone.
    #[command(after_help = "Example:\n  \
        scd bench decode --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --jobs 1,2,4,8 --experts 1,3")]
    Decode(bench_decode::Args),
    /// Time to first token with compiled document caches (stitched, no document-side compute)
    /// against full recompute of the same prompt, for several document counts.
    #[command(after_help = "Example:\n  \
        scd bench docs --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --docs 4,8,16")]
    Docs(bench_docs::Args),
    /// Codes sized for the link: the same prompts over emulated links of several speeds as raw
    /// KV, at the translator's default ranks and at ranks the producer picks for the link it
    /// measured; ranks, payload, time to first token and KL per link.
    #[command(after_help = "Example:\n  \
        scd bench links --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --links 50,500,5000")]
    Links(bench_links::Args),
    /// One prompt for several experts: one fan-out job (one prefill, one code stream) against
    /// one job per expert at the same time; bytes and time to first token.
    #[command(after_help = "Example:\n  \
        scd bench fanout --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --experts mail,sotu,melville")]
    Fanout(bench_fanout::Args),
    /// Time to first token of every transfer mode over a grid of links and prompt lengths,
    /// cold and warm, through real nodes, with each mode's quality beside it; `--project`
    /// fits the cost model to such a run, projects it to 7B / 32B pairs and draws the plots.
    #[command(after_help = "Examples:\n  \
        scd bench ttft --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --lengths 256,1024 --links 50,500,5000,loopback --out docs/m8/ttft.json\n  \
        scd bench ttft --project docs/m8/ttft.json --plots docs/m8")]
    Ttft(bench_ttft::Args),
    /// What coding a prompt's state costs: for one prompt and an expert's translator, each
    /// coded mode at the rate its rate table gives for a share of raw's bytes, its encode and
    /// rebuild against the producer's and the oracle's prefill, and the entropy coder's speed
    /// on one thread.
    #[command(after_help = "Example:\n  \
        scd bench codes --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --expert experts/sotu --tokens 1024")]
    Codes(bench_codes::Args),
}

pub fn run(args: Args, kernels: KernelChoice) -> anyhow::Result<()> {
    match args.command {
        Command::Transport(a) => bench_transport::run(a),
        Command::Model(a) => bench_model::run(a, kernels),
        Command::Memory(a) => bench_memory::run(a, kernels),
        Command::Decode(a) => bench_decode::run(a, kernels),
        Command::Docs(a) => bench_docs::run(a, kernels),
        Command::Links(a) => bench_links::run(a, kernels),
        Command::Fanout(a) => bench_fanout::run(a, kernels),
        Command::Ttft(a) => bench_ttft::run(a, kernels),
        Command::Codes(a) => bench_codes::run(a, kernels),
    }
}

/// The median of `reps` timed runs of `f` after `warmup` untimed ones (at least one timed).
pub(crate) fn median_time(
    warmup: usize,
    reps: usize,
    mut f: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<std::time::Duration> {
    for _ in 0..warmup {
        f()?;
    }
    let mut times = Vec::with_capacity(reps.max(1));
    for _ in 0..reps.max(1) {
        let t = std::time::Instant::now();
        f()?;
        times.push(t.elapsed());
    }
    times.sort();
    Ok(times[times.len() / 2])
}
