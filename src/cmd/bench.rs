//! `scd bench`: benchmarks, one subcommand per area. Build with `--release`.

use super::{bench_model, bench_transport};

/// Arguments of `scd bench`.
#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Subcommand)]
enum Command {
    /// QUIC goodput next to plain quinn, frame codec throughput, pacing accuracy.
    Transport(bench_transport::Args),
    /// f32 prefill/decode speed next to the machine's matmul throughput and candle-transformers'
    /// quantized llama; peak memory.
    Model(bench_model::Args),
}

pub fn run(args: Args) -> anyhow::Result<()> {
    match args.command {
        Command::Transport(a) => bench_transport::run(a),
        Command::Model(a) => bench_model::run(a),
    }
}
