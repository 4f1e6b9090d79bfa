//! The transport benchmarks without building the whole `scd` binary (same code as
//! `scd bench transport`):
//! `cargo run --release -p scd-transport --example bench_transport [-- OPTIONS]`
//!
//! Options (all optional; the defaults are those of `scd bench transport`):
//! - `--sizes-mb 16,64`: goodput transfer sizes in MB;
//! - `--runs N`: transfers per size and side (the best is reported);
//! - `--goodput-only`: skip the codec and pacing sections (for quick iterations).

use scd_transport::bench::{report, BenchError, ReportOptions};

fn parse(args: &[String]) -> Result<ReportOptions, BenchError> {
    let mut opts = ReportOptions::default();
    let mut it = args.iter();
    let bad = |what: &str| BenchError::new(format!("bad argument: {what}"));
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--sizes-mb" => {
                let list = it.next().ok_or_else(|| bad("--sizes-mb needs a value"))?;
                opts.sizes = list
                    .split(',')
                    .map(|s| s.trim().parse::<usize>().map(|mb| mb << 20))
                    .collect::<Result<_, _>>()
                    .map_err(|_| bad(list))?;
            }
            "--runs" => {
                let n = it.next().ok_or_else(|| bad("--runs needs a value"))?;
                opts.runs = n.parse().map_err(|_| bad(n))?;
            }
            "--goodput-only" => {
                opts.codec_payloads.clear();
                opts.pacing_rates.clear();
            }
            other => return Err(bad(other)),
        }
    }
    Ok(opts)
}

#[tokio::main]
async fn main() -> Result<(), BenchError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    report(&parse(&args)?).await
}
