//! `scd bench transport`: loopback goodput next to plain quinn, frame codec throughput, and
//! pacing accuracy. Build with `--release`; the figures go into BENCHMARKS.md.

use std::time::Duration;

use anyhow::Context;
use scd_transport::bench::{report, ReportOptions};

/// Arguments of `scd bench transport`.
#[derive(clap::Args)]
pub struct Args {
    /// Transfer sizes in MB for the goodput comparison.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
    sizes_mb: Vec<usize>,
    /// Runs per size (the best is reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Pacing rates in Mbit/s.
    #[arg(long, value_delimiter = ',', default_value = "10,100,1000")]
    pacing_mbps: Vec<u64>,
    /// Seconds of traffic per pacing rate.
    #[arg(long, default_value_t = 2.0)]
    pacing_secs: f64,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let opts = ReportOptions {
        sizes: args.sizes_mb.iter().map(|mb| mb << 20).collect(),
        runs: args.runs,
        pacing_rates: args.pacing_mbps.iter().map(|m| m * 1_000_000).collect(),
        pacing_time: Duration::from_secs_f64(args.pacing_secs),
        ..ReportOptions::default()
    };
    let rt = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
    rt.block_on(report(&opts)).context("transport benchmark")
}
