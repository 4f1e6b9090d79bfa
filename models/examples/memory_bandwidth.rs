//! How long this machine takes to read the decode weights' bytes once: the floor of a decode
//! step that streams them, to read the decode's ms per token against (BENCHMARKS.md, "Where an
//! 8-job step goes"). Reads `MB` megabytes (default 96, SmolLM2-135M's Q4_1 decode weights with
//! its Q8_0 head) from eight buffers in turn, so that no read is served from the caches, on 1
//! and 2 threads. Usage: `cargo run --release -p scd-models --example memory_bandwidth [MB]`.

use std::time::Instant;

/// Buffers read in turn: eight times the bytes, past any last-level cache.
const BUFFERS: usize = 8;

fn sum(words: &[u64]) -> u64 {
    // Eight independent sums, which the compiler keeps in vector registers: a read bound by
    // memory, not by a chain of dependent adds.
    let mut acc = [0u64; 8];
    for chunk in words.chunks_exact(8) {
        for (a, w) in acc.iter_mut().zip(chunk) {
            *a = a.wrapping_add(*w);
        }
    }
    acc.iter().fold(0, |a, b| a.wrapping_add(*b))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mb: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(96);
    let words = mb * 1024 * 1024 / 8;
    let buffers: Vec<Vec<u64>> = (0..BUFFERS)
        .map(|k| (0..words as u64).map(|i| i ^ k as u64).collect())
        .collect();
    for threads in [1, 2] {
        for _ in 0..5 {
            let start = Instant::now();
            let mut total = 0u64;
            for b in &buffers {
                let part = words.div_ceil(threads);
                total = total.wrapping_add(std::thread::scope(|s| {
                    let handles: Vec<_> = b.chunks(part).map(|c| s.spawn(|| sum(c))).collect();
                    handles
                        .into_iter()
                        .map(|h| h.join().unwrap_or(0))
                        .fold(0u64, u64::wrapping_add)
                }));
            }
            let secs = start.elapsed().as_secs_f64();
            println!(
                "{threads} thread(s): {:.1} GB/s, {mb} MB in {:.2} ms (checksum {})",
                (BUFFERS * words * 8) as f64 / secs / 1e9,
                secs / BUFFERS as f64 * 1e3,
                total % 1000
            );
        }
    }
    Ok(())
}
