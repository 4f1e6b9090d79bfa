//! The transport benchmarks without building the whole `scd` binary (same code as
//! `scd bench transport` with its defaults):
//! `cargo run --release -p scd-transport --example bench_transport`

#[tokio::main]
async fn main() -> Result<(), scd_transport::bench::BenchError> {
    scd_transport::bench::report(&scd_transport::bench::ReportOptions::default()).await
}
