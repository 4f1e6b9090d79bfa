//! `scd bench model`: prefill and decode speed of scd (prefill on AMX tiles where the CPU has
//! them and on f32, decode on the narrow Q4_1 / Q8_0 weights and on f32), candle-transformers'
//! quantized llama
//! and, when llama-cpp-python is installed, llama.cpp on the same GGUF in the same run, all
//! under one timing protocol (`scd_models::bench::Protocol`), next to the machine's f32 matmul
//! throughput; plus peak resident memory. Build with `--release`; the figures go into
//! BENCHMARKS.md, with llama.cpp as the baseline that counts.

use scd_models::KernelChoice;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use scd_models::baseline::QuantizedLlama;
use scd_models::bench::{
    amx_peak_gflops, fma_peak_gflops, matmul_gflops, peak_rss_bytes, prefill_flops, rss_bytes,
    synthetic_tokens, time_decode, time_prefill, Protocol, Runs, Timed, TimedLlama,
};
use scd_models::{DecodeProducts, DecodeWeights, Llama, LlamaConfig, PrefillMatmul};
use serde::Deserialize;

/// Arguments of `scd bench model`.
#[derive(clap::Args)]
pub struct Args {
    /// The GGUF model.
    #[arg(long, env = "SCD_MODEL")]
    model: PathBuf,
    /// Prompt lengths for the prefill of scd and llama.cpp.
    #[arg(long, value_delimiter = ',', default_value = "256,1024,2048")]
    lengths: Vec<usize>,
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
    /// Timed decode steps after each prompt of --decode-after, for every implementation.
    #[arg(long, default_value_t = 32)]
    decode_tokens: usize,
    /// Prompt lengths after which decode is timed (a decode step reads the whole cache).
    #[arg(long, value_delimiter = ',', default_value = "256,1024")]
    decode_after: Vec<usize>,
    /// Threads for llama.cpp (the Rust implementations use every core; 2 on the reference VM).
    #[arg(long, default_value_t = 2)]
    llama_threads: usize,
    /// Python of the llama.cpp environment (`make llama-cpp` installs it there).
    #[arg(
        long,
        env = "SCD_LLAMA_PYTHON",
        default_value = ".cache/llama-cpp/bin/python"
    )]
    llama_python: PathBuf,
    /// The script that times llama.cpp.
    #[arg(long, default_value = "ops/llama-bench.py")]
    llama_script: PathBuf,
    /// Leave llama.cpp out.
    #[arg(long)]
    no_llama_cpp: bool,
    /// Side of the square matmul that measures the machine's throughput.
    #[arg(long, default_value_t = 1024)]
    matmul_size: usize,
}

const LLAMA_CPP: &str = "llama.cpp (llama-cpp-python, Q4_1)";
const INSTALL_HINT: &str = "install it with `make llama-cpp` (ops/install-llama-cpp.sh, 7 to 10 minutes), or pass --llama-python";

fn mb(bytes: Option<u64>) -> String {
    bytes.map_or("n/a".into(), |b| format!("{:.0} MB", b as f64 / 1e6))
}

/// One implementation's figures in this run.
struct Measured {
    name: String,
    /// `(T, runs)` per prefill length.
    prefill: Vec<(usize, Runs)>,
    /// `(prompt length, time per token)` per decode prompt.
    decode: Vec<(usize, Duration)>,
    /// Bytes of weights one decode step streams, where known.
    decode_bytes: Option<usize>,
    /// The peak its prefill's products run against (AMX or FMA), GFLOP/s, where known.
    peak: Option<f64>,
}

pub fn run(args: Args, kernels: KernelChoice) -> anyhow::Result<()> {
    let protocol = Protocol {
        warmup: args.warmup,
        reps: args.reps.max(1),
        decode_warmup: args.decode_warmup,
        decode_steps: args.decode_tokens.max(1),
    };
    println!("load average at start: {}", load_average());
    let gflops = matmul_gflops(args.matmul_size, 5).context("matmul benchmark")?;
    let n = args.matmul_size;
    println!("f32 matmul {n}x{n}x{n} (candle, best of 5): {gflops:.1} GFLOP/s");
    let fma_peak = fma_peak_gflops(20_000_000);
    println!(
        "f32 FMA peak (fused multiply-adds on registers, every thread): {fma_peak:.0} GFLOP/s"
    );
    let amx_peak = amx_peak_gflops(2_000_000);
    match amx_peak {
        Some(peak) => println!(
            "AMX bf16 peak (tdpbf16ps on tiles in registers, every thread): {peak:.0} GFLOP/s"
        ),
        None => println!("AMX: not available on this machine (prefill runs on f32)"),
    }
    println!(
        "threads: {} (llama.cpp: {})",
        std::thread::available_parallelism().map_or(0, |p| p.get()),
        args.llama_threads
    );
    println!(
        "protocol, every implementation: {} untimed + {} timed prefills per length; decode after a prefill of each of {:?}: {} untimed + {} timed greedy steps",
        protocol.warmup,
        protocol.reps,
        args.decode_after,
        protocol.decode_warmup,
        protocol.decode_steps
    );

    let t = Instant::now();
    let model = Llama::from_gguf_with(&args.model, kernels).context("loading the model")?;
    let cfg = model.config().clone();
    println!(
        "model loaded (f32 weights dequantized, prefill on {}, decode weights {} with {} products) in {:.2}s; RSS {} (peak so far {})",
        model.prefill_matmul(),
        model.decode_weights(),
        model.decode_products(),
        t.elapsed().as_secs_f64(),
        mb(rss_bytes()),
        mb(peak_rss_bytes())
    );
    let prompts: Vec<Vec<u32>> = args
        .decode_after
        .iter()
        .map(|&len| synthetic_tokens(cfg.vocab_size, len))
        .collect();
    let decode_all = |m: &mut dyn FnMut(&[u32]) -> anyhow::Result<Duration>| {
        prompts
            .iter()
            .map(|p| Ok((p.len(), m(p)?)))
            .collect::<anyhow::Result<Vec<_>>>()
    };

    let mut results = Vec::new();
    let mut timed = TimedLlama::new(&model);
    let prefill = prefills(&mut timed, &cfg, &args.lengths, &protocol, "scd")?;
    let decode = decode_all(&mut |p| {
        time_decode(&mut timed, p, &protocol).context("scd decode (narrow weights)")
    })?;
    results.push(Measured {
        name: format!(
            "scd (prefill {}, decode {} {})",
            model.prefill_matmul(),
            model.decode_weights(),
            model.decode_products()
        ),
        prefill,
        decode,
        decode_bytes: Some(model.decode_weight_bytes()),
        peak: match model.prefill_matmul() {
            PrefillMatmul::Tiles => amx_peak,
            PrefillMatmul::F32 => Some(fma_peak),
        },
    });
    drop(timed);
    // Where the default decode takes bf16 products, the integer ones too (decode only): what
    // the rounding to bf16 buys.
    if model.decode_products() != DecodeProducts::Int {
        let int_model = model
            .clone()
            .with_decode_products(DecodeProducts::Int)
            .context("integer decode products")?;
        let mut timed = TimedLlama::new(&int_model);
        let decode = decode_all(&mut |p| {
            time_decode(&mut timed, p, &protocol).context("scd decode (narrow weights, int)")
        })?;
        results.push(Measured {
            name: "scd (decode narrow int)".into(),
            prefill: Vec::new(),
            decode,
            decode_bytes: Some(int_model.decode_weight_bytes()),
            peak: Some(fma_peak),
        });
    }
    // The same weights, prefill and decode on f32: what the tiles and the narrow weights are
    // measured against (the prefill only where it differs from the row above).
    let f32_model = model
        .clone()
        .with_decode_weights(DecodeWeights::F32)
        .context("dropping the narrow weights")?
        .with_prefill_matmul(PrefillMatmul::F32)
        .context("prefill on f32")?;
    let mut timed = TimedLlama::new(&f32_model);
    let prefill = if model.prefill_matmul() != PrefillMatmul::F32 {
        prefills(&mut timed, &cfg, &args.lengths, &protocol, "scd on f32")?
    } else {
        Vec::new()
    };
    let decode = decode_all(&mut |p| {
        time_decode(&mut timed, p, &protocol).context("scd decode (f32 weights)")
    })?;
    results.push(Measured {
        name: if prefill.is_empty() {
            "scd (decode f32)".into()
        } else {
            "scd (prefill f32, decode f32)".into()
        },
        prefill,
        decode,
        decode_bytes: Some(f32_model.decode_weight_bytes()),
        peak: Some(fma_peak),
    });
    let peak_ours = peak_rss_bytes();
    drop(timed);
    drop(f32_model);
    drop(model);

    if !args.baseline_lengths.is_empty() {
        let mut q = QuantizedLlama::load(&args.model).context("loading the quantized baseline")?;
        let prefill = prefills(
            &mut q,
            &cfg,
            &args.baseline_lengths,
            &protocol,
            "quantized_llama",
        )?;
        let decode = decode_all(&mut |p| {
            time_decode(&mut q, p, &protocol).context("quantized_llama decode")
        })?;
        results.push(Measured {
            name: "candle-transformers quantized_llama (Q4_1)".into(),
            prefill,
            decode,
            decode_bytes: None,
            peak: Some(fma_peak),
        });
    }

    let llama_note = if args.no_llama_cpp {
        "llama.cpp: left out (--no-llama-cpp)".to_string()
    } else {
        match llama_cpp(&args, &cfg, &protocol, &prompts)? {
            LlamaCpp::Measured(m, about) => {
                results.push(m);
                about
            }
            LlamaCpp::NotInstalled(why) => format!(
                "llama.cpp: NOT INSTALLED, no llama.cpp figures in this run ({why}); {INSTALL_HINT}"
            ),
        }
    };

    let reference = results.iter().find(|m| m.name == LLAMA_CPP);
    println!();
    println!("{llama_note}");
    println!();
    println!(
        "| implementation | T | best s | median s | tokens/s (best) | GFLOP/s | % of f32 matmul | % of its peak | speed vs llama.cpp |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for m in &results {
        for (len, runs) in &m.prefill {
            let best = runs.best().as_secs_f64();
            let g = prefill_flops(&cfg, *len) / best / 1e9;
            let vs = reference
                .and_then(|r| r.prefill.iter().find(|(l, _)| l == len))
                .map_or("n/a".into(), |(_, r)| {
                    format!("{:.2}x", r.best().as_secs_f64() / best)
                });
            let of_peak = m
                .peak
                .map_or("n/a".into(), |p| format!("{:.0}%", 100.0 * g / p));
            println!(
                "| {} | {len} | {best:.3} | {:.3} | {:.0} | {g:.1} | {:.0}% | {of_peak} | {vs} |",
                m.name,
                runs.median().as_secs_f64(),
                *len as f64 / best,
                100.0 * g / gflops
            );
        }
    }
    println!();
    println!(
        "| implementation | decode after | ms/token | tokens/s | weights per token | their GB/s | speed vs llama.cpp |"
    );
    println!("|---|---|---|---|---|---|---|");
    for m in &results {
        for &(after, per) in &m.decode {
            let per = per.as_secs_f64();
            let vs = reference
                .and_then(|r| r.decode.iter().find(|(a, _)| *a == after))
                .map_or("n/a".into(), |(_, r)| {
                    format!("{:.2}x", r.as_secs_f64() / per)
                });
            let (bytes, rate) = m.decode_bytes.map_or(("n/a".into(), "n/a".into()), |b| {
                (
                    format!("{:.0} MB", b as f64 / 1e6),
                    format!("{:.1}", b as f64 / per / 1e9),
                )
            });
            println!(
                "| {} | {after} | {:.1} | {:.1} | {bytes} | {rate} | {vs} |",
                m.name,
                per * 1e3,
                1.0 / per
            );
        }
    }
    println!();
    println!(
        "peak RSS of scd's runs (load, every prefill and decode above, largest T = {}): {}",
        args.lengths.iter().max().copied().unwrap_or(0),
        mb(peak_ours)
    );
    println!("load average at the end: {}", load_average());
    Ok(())
}

/// `protocol`'s prefills of synthetic prompts of each of `lengths`; `what` names the
/// implementation in errors.
fn prefills<M: Timed>(
    model: &mut M,
    cfg: &LlamaConfig,
    lengths: &[usize],
    protocol: &Protocol,
    what: &str,
) -> anyhow::Result<Vec<(usize, Runs)>>
where
    M::Error: std::error::Error + Send + Sync + 'static,
{
    lengths
        .iter()
        .map(|&len| {
            let tokens = synthetic_tokens(cfg.vocab_size, len);
            let runs = time_prefill(model, &tokens, protocol)
                .with_context(|| format!("{what} prefill of {len} tokens"))?;
            Ok((len, runs))
        })
        .collect()
}

/// The 1, 5 and 15 minute load averages: figures from a run on a busy machine are not
/// comparable with a quiet one's (llama.cpp's OpenMP threads spin while they wait for a core).
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg").map_or("n/a".into(), |s| {
        s.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
    })
}

enum LlamaCpp {
    /// The figures and a line on what ran.
    Measured(Measured, String),
    /// Why llama.cpp could not be run.
    NotInstalled(String),
}

#[derive(Deserialize)]
struct LlamaReply {
    installed: bool,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    llama_cpp_python: Option<String>,
    #[serde(default)]
    llama_cpp: Option<String>,
    #[serde(default)]
    settings: serde_json::Value,
    #[serde(default)]
    prefill: Vec<LlamaPrefill>,
    #[serde(default)]
    decode: Vec<LlamaDecode>,
}

#[derive(Deserialize)]
struct LlamaPrefill {
    tokens: usize,
    seconds: Vec<f64>,
}

#[derive(Deserialize)]
struct LlamaDecode {
    after: usize,
    steps: usize,
    seconds: f64,
}

/// Times llama.cpp through `ops/llama-bench.py` on the same tokens and protocol.
fn llama_cpp(
    args: &Args,
    cfg: &LlamaConfig,
    protocol: &Protocol,
    prompts: &[Vec<u32>],
) -> anyhow::Result<LlamaCpp> {
    if !args.llama_python.exists() {
        return Ok(LlamaCpp::NotInstalled(format!(
            "no Python at {}",
            args.llama_python.display()
        )));
    }
    if !args.llama_script.exists() {
        bail!(
            "{} not found: run the bench from the repository root or pass --llama-script",
            args.llama_script.display()
        );
    }
    let request = serde_json::json!({
        "model": absolute(&args.model)?,
        "threads": args.llama_threads,
        "warmup": protocol.warmup,
        "reps": protocol.reps,
        "prefill": args
            .lengths
            .iter()
            .map(|&len| synthetic_tokens(cfg.vocab_size, len))
            .collect::<Vec<_>>(),
        "decode_prompts": prompts,
        "decode_warmup": protocol.decode_warmup,
        "decode_steps": protocol.decode_steps,
    });
    let mut child = Command::new(&args.llama_python)
        .arg(&args.llama_script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("starting {}", args.llama_python.display()))?;
    child
        .stdin
        .take()
        .context("llama.cpp script's stdin")?
        .write_all(request.to_string().as_bytes())
        .context("writing the request to the llama.cpp script")?;
    let out = child
        .wait_with_output()
        .context("waiting for the llama.cpp script")?;
    let reply: LlamaReply = serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "the llama.cpp script exited with {} and printed no result",
            out.status
        )
    })?;
    if !reply.installed {
        return Ok(LlamaCpp::NotInstalled(
            reply
                .reason
                .unwrap_or_else(|| "llama_cpp not importable".into()),
        ));
    }
    if !out.status.success() {
        bail!("the llama.cpp script failed: {}", out.status);
    }
    if reply.decode.len() != prompts.len() {
        bail!(
            "llama.cpp reply with {} decode timings for {} prompts",
            reply.decode.len(),
            prompts.len()
        );
    }
    let measured = Measured {
        name: LLAMA_CPP.into(),
        prefill: reply
            .prefill
            .iter()
            .map(|p| {
                let runs = p.seconds.iter().map(|&s| Duration::from_secs_f64(s));
                (p.tokens, Runs(runs.collect()))
            })
            .collect(),
        decode: reply
            .decode
            .iter()
            .map(|d| {
                let per = d.seconds / d.steps.max(1) as f64;
                (d.after, Duration::from_secs_f64(per))
            })
            .collect(),
        decode_bytes: None,
        // Its products are int8 dot products on Q4_1 blocks, a limit not measured here.
        peak: None,
    };
    let about = format!(
        "llama.cpp: llama-cpp-python {}, llama.cpp {}, settings {}",
        reply.llama_cpp_python.as_deref().unwrap_or("?"),
        reply.llama_cpp.as_deref().unwrap_or("?"),
        reply.settings
    );
    Ok(LlamaCpp::Measured(measured, about))
}

fn absolute(path: &Path) -> anyhow::Result<PathBuf> {
    std::path::absolute(path).with_context(|| format!("resolving {}", path.display()))
}
