//! What candle's `broadcast_add` of a row vector costs next to the product before it, at the
//! shape of a rebuilt K or V (512 tokens, 192 wide, from a rank-192 code): the measurement
//! behind `ops::row_vector` (BENCHMARKS.md, "The fused Patch form in f32, and means added
//! without candle's broadcast"). Run with `RAYON_NUM_THREADS=1` and `=2`.
use candle_core::{Device, Tensor};
use std::time::Instant;

/// Best of 5 rounds of 60 calls, in ms per call.
fn per_call(f: impl Fn() -> candle_core::Result<Tensor>) -> candle_core::Result<f64> {
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        for _ in 0..60 {
            f()?;
        }
        best = best.min(t.elapsed().as_secs_f64() * 1e3 / 60.0);
    }
    Ok(best)
}

fn main() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let z = Tensor::randn(0f32, 1.0, (512, 192), &dev)?;
    let w = Tensor::randn(0f32, 1.0, (192, 192), &dev)?;
    let mean = Tensor::randn(0f32, 1.0, 192, &dev)?;
    let product = per_call(|| z.matmul(&w))?;
    let both = per_call(|| z.matmul(&w)?.broadcast_add(&mean))?;
    println!("(512, 192) x (192, 192) product: {product:.3} ms per call");
    println!("product then broadcast_add of a (192) mean: {both:.3} ms per call");
    println!("the broadcast_add alone: {:.3} ms per call", both - product);
    Ok(())
}
