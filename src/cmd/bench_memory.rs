//! `scd bench memory`: the resident memory of a consumer's models with one expert and with
//! several, with the adapters merged (a weight copy per expert) and applied on the fly (the
//! base's weights shared), which is what `[models] adapter_mode` chooses between. Each point
//! runs in a fresh child process (this binary again), so that one point's allocations cannot
//! pad another's figure.

use scd_models::KernelChoice;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context};
use scd_models::bench::{peak_rss_bytes, rss_bytes};
use scd_models::{AdapterMode, Input, Llama, LogitsWanted, LoraAdapter};

/// Arguments of `scd bench memory`.
#[derive(clap::Args)]
pub struct Args {
    /// The base model (GGUF).
    #[arg(long, env = "SCD_MODEL")]
    model: PathBuf,
    /// The experts (folders with adapter.safetensors), in the order they are added.
    #[arg(
        long = "expert",
        default_values = ["experts/mail", "experts/sotu", "experts/melville"]
    )]
    experts: Vec<PathBuf>,
    /// Internal: measure one point (`merge:N` or `on-the-fly:N`) and print it.
    #[arg(long, hide = true)]
    point: Option<String>,
}

pub fn run(args: Args, kernels: KernelChoice) -> anyhow::Result<()> {
    if let Some(point) = &args.point {
        return measure(&args, point, kernels);
    }
    let n = args.experts.len();
    println!(
        "resident memory of the base model and its experts, each point in a fresh process ({})",
        args.experts
            .iter()
            .map(|e| e.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!("| adapters | experts | RSS MiB | peak MiB | vs one merged expert |");
    println!("| --- | ---: | ---: | ---: | ---: |");
    let exe = std::env::current_exe().context("finding this binary")?;
    let mut reference = None;
    for (mode, count) in [
        ("merge", 1),
        ("merge", n),
        ("on-the-fly", 1),
        ("on-the-fly", n),
    ] {
        let mut cmd = Command::new(&exe);
        cmd.args(["bench", "memory", "--model"]).arg(&args.model);
        // Each point measures the same kernels as this process chose.
        cmd.arg(format!("--decode-weights={}", kernels.decode_weights))
            .arg(format!("--decode-products={}", kernels.decode_products))
            .arg(format!("--prefill-matmul={}", kernels.prefill_matmul));
        for e in &args.experts {
            cmd.arg("--expert").arg(e);
        }
        let out = cmd
            .args(["--point", &format!("{mode}:{count}")])
            .output()
            .context("running a measurement")?;
        if !out.status.success() {
            bail!(
                "the {mode} x {count} measurement failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let mut fields = text.split_whitespace().map(str::parse::<u64>);
        let (Some(Ok(rss)), Some(Ok(peak))) = (fields.next(), fields.next()) else {
            bail!("unexpected measurement output: {text}");
        };
        let base = *reference.get_or_insert(rss);
        println!(
            "| {mode} | {count} | {:.0} | {:.0} | {:.2}x |",
            rss as f64 / 1048576.0,
            peak as f64 / 1048576.0,
            rss as f64 / base as f64
        );
    }
    Ok(())
}

/// Loads the base and `count` experts in `mode`, runs a short prefill on each (so that what a
/// forward pass allocates is counted), and prints RSS and peak RSS in bytes.
fn measure(args: &Args, point: &str, kernels: KernelChoice) -> anyhow::Result<()> {
    let (mode, count) = point.split_once(':').context("--point is MODE:COUNT")?;
    let mode = match mode {
        "merge" => AdapterMode::Merge,
        "on-the-fly" => AdapterMode::OnTheFly,
        other => bail!("unknown adapter mode {other}"),
    };
    let count: usize = count.parse().context("--point count")?;
    if count == 0 || count > args.experts.len() {
        bail!(
            "--point asks for {count} experts; {} given",
            args.experts.len()
        );
    }
    let base = Llama::from_gguf_with(&args.model, kernels).context("loading the base")?;
    let tokens: Vec<u32> = (0..32).map(|i| 100 + i * 7).collect();
    let mut experts = Vec::new();
    for dir in &args.experts[..count] {
        let file = dir.join("adapter.safetensors");
        let adapter = LoraAdapter::load(&file, base.config())
            .with_context(|| format!("loading {}", file.display()))?;
        let expert = base.with_adapter(&adapter, mode)?;
        expert.forward(Input::new(&tokens).logits(LogitsWanted::Last))?;
        experts.push(expert);
    }
    let (Some(rss), Some(peak)) = (rss_bytes(), peak_rss_bytes()) else {
        bail!("resident memory is read from /proc/self/status (Linux only)");
    };
    println!("{rss} {peak}");
    Ok(())
}
