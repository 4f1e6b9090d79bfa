//! `scd bench model`: prefill and decode speed of the f32 model next to the machine's f32 matmul
//! throughput (measured in the same run) and candle-transformers' quantized llama on the same
//! GGUF, plus peak resident memory. Build with `--release`; the figures go into BENCHMARKS.md.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use scd_models::baseline::QuantizedLlama;
use scd_models::bench::{
    matmul_gflops, peak_rss_bytes, prefill_flops, rss_bytes, synthetic_tokens, time_decode,
    time_prefill,
};
use scd_models::Llama;

/// Arguments of `scd bench model`.
#[derive(clap::Args)]
pub struct Args {
    /// The GGUF model.
    #[arg(long, env = "SCD_MODEL")]
    model: PathBuf,
    /// Prompt lengths for the f32 prefill.
    #[arg(long, value_delimiter = ',', default_value = "256,1024,2048")]
    lengths: Vec<usize>,
<<<<<<< ours
    /// Decode steps timed after a prefill of the first length.
=======
    /// Prompt lengths for candle-transformers' quantized llama (slow: 10 to 18 s at 256 on the
    /// loaded 2-core VM); the flag with no value leaves it out.
    #[arg(long, value_delimiter = ',', num_args = 0.., default_value = "256")]
    baseline_lengths: Vec<usize>,
    /// Untimed prefills of each length before the timed ones, for every implementation.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Timed prefills of each length, for every implementation (best and median reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Untimed decode steps before the timed ones, for every implementation.
    #[arg(long, default_value_t = 4)]
    decode_warmup: usize,
    /// Timed decode steps after a prefill of the first length, for every implementation.
>>>>>>> theirs
    #[arg(long, default_value_t = 32)]
    decode_tokens: usize,
    /// Prompt lengths for candle-transformers' quantized llama (slow: ~47 s at 1,024).
    #[arg(long, value_delimiter = ',', default_value = "256")]
    baseline_lengths: Vec<usize>,
    /// Decode steps timed for the quantized baseline.
    #[arg(long, default_value_t = 16)]
    baseline_decode_tokens: usize,
    /// Timed repetitions per prefill length (the best is reported).
    #[arg(long, default_value_t = 2)]
    reps: usize,
    /// Side of the square matmul that measures the machine's throughput.
    #[arg(long, default_value_t = 1024)]
    matmul_size: usize,
}

fn mb(bytes: Option<u64>) -> String {
    bytes.map_or("n/a".into(), |b| format!("{:.0} MB", b as f64 / 1e6))
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let gflops = matmul_gflops(args.matmul_size, 5).context("matmul benchmark")?;
    let n = args.matmul_size;
    println!("f32 matmul {n}x{n}x{n} (candle, best of 5): {gflops:.1} GFLOP/s");
    println!(
        "threads: {}",
        std::thread::available_parallelism().map_or(0, |p| p.get())
    );

    let t = Instant::now();
    let model = Llama::from_gguf(&args.model).context("loading the model")?;
    let cfg = model.config().clone();
    println!(
        "f32 model loaded (dequantized) in {:.2}s; RSS {} (peak so far {})",
        t.elapsed().as_secs_f64(),
        mb(rss_bytes()),
        mb(peak_rss_bytes())
    );
    println!();
    println!("| implementation | T | prefill s | tokens/s | GFLOP/s | % of matmul |");
    println!("|---|---|---|---|---|---|");
    for &len in &args.lengths {
        let tokens = synthetic_tokens(cfg.vocab_size, len);
        let secs = time_prefill(&model, &tokens, args.reps)
            .with_context(|| format!("prefill of {len} tokens"))?
            .as_secs_f64();
        let g = prefill_flops(&cfg, len) / secs / 1e9;
        println!(
            "| scd f32 | {len} | {secs:.3} | {:.0} | {g:.1} | {:.0}% |",
            len as f64 / secs,
            100.0 * g / gflops
        );
    }
    let first = args.lengths.first().copied().unwrap_or(256);
    let step = time_decode(
        &model,
        &synthetic_tokens(cfg.vocab_size, first),
        args.decode_tokens,
    )
    .context("decode")?;
    let peak_ours = peak_rss_bytes();
    drop(model);

    let mut baseline_rows = Vec::new();
    if !args.baseline_lengths.is_empty() {
        let mut q = QuantizedLlama::load(&args.model).context("loading the quantized baseline")?;
        for &len in &args.baseline_lengths {
            let tokens = synthetic_tokens(cfg.vocab_size, len);
            q.reset();
            let t = Instant::now();
            q.forward(&tokens).context("baseline prefill")?;
            let secs = t.elapsed().as_secs_f64();
            let g = prefill_flops(&cfg, len) / secs / 1e9;
            println!(
                "| candle-transformers quantized_llama (Q4_1) | {len} | {secs:.3} | {:.0} | {g:.1} | {:.0}% |",
                len as f64 / secs,
                100.0 * g / gflops
            );
        }
        let tokens = synthetic_tokens(cfg.vocab_size, first);
        q.reset();
        q.forward(&tokens).context("baseline prefill")?;
        let t = Instant::now();
        for i in 0..args.baseline_decode_tokens {
            q.forward(&[(i % cfg.vocab_size) as u32])
                .context("baseline decode")?;
        }
        let per = t.elapsed().as_secs_f64() / args.baseline_decode_tokens.max(1) as f64;
        baseline_rows.push(format!(
            "| candle-transformers quantized_llama (Q4_1) | after {first} | {:.1} ms | {:.1} |",
            per * 1e3,
            1.0 / per
        ));
    }
    println!();
    println!("| implementation | decode from | ms/token | tokens/s |");
    println!("|---|---|---|---|");
    let per = step.as_secs_f64();
    println!(
        "| scd f32 | after {first} | {:.1} ms | {:.1} |",
        per * 1e3,
        1.0 / per
    );
    for r in baseline_rows {
        println!("{r}");
    }
    println!();
    println!(
        "peak RSS of the f32 runs (load + every prefill above, largest T = {}): {}",
        args.lengths.iter().max().copied().unwrap_or(0),
        mb(peak_ours)
    );
    Ok(())
}
