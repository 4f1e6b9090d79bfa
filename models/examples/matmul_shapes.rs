//! Throughput of the matmul shapes a SmolLM2 prefill uses: the projections, with the weight as a
//! transposed view (how `Linear` stores it) and as a contiguous `(in, out)` matrix, the fused
//! q/k/v (960 rows) and gate/up (3,072 rows) projections, and one attention chunk's score and
//! value products (3 KV heads x 3 grouped queries x 256 rows against n keys, head width 64).
use candle_core::{Device, Tensor};
use std::time::Instant;

fn bench(name: &str, a: &Tensor, b: &Tensor, flops: f64) {
    let _ = a.matmul(b).unwrap();
    let reps = 5;
    let t = Instant::now();
    for _ in 0..reps {
        let _ = a.matmul(b).unwrap();
    }
    let s = t.elapsed().as_secs_f64() / reps as f64;
    println!(
        "{name:40} {:8.2} ms {:6.1} GFLOP/s",
        s * 1e3,
        flops / s / 1e9
    );
}

fn main() {
    let dev = Device::Cpu;
    let t = 1024;
    for (i, o) in [
        (576, 576),
        (576, 192),
        (576, 1536),
        (1536, 576),
        (576, 960),
        (576, 3072),
    ] {
        let x = Tensor::randn(0f32, 1., (t, i), &dev).unwrap();
        let w = Tensor::randn(0f32, 1., (o, i), &dev).unwrap();
        let wt = w.t().unwrap().contiguous().unwrap();
        let f = 2.0 * (t * i * o) as f64;
        bench(
            &format!("{t}x{i} . ({o}x{i})^T view"),
            &x,
            &w.t().unwrap(),
            f,
        );
        bench(&format!("{t}x{i} . {i}x{o} contiguous"), &x, &wt, f);
    }
    for n_keys in [256usize, 1024, 2048] {
        let rows = 3 * 256;
        let q = Tensor::randn(0f32, 1., (3, rows, 64), &dev).unwrap();
        let k = Tensor::randn(0f32, 1., (3, n_keys, 64), &dev).unwrap();
        let p = Tensor::randn(0f32, 1., (3, rows, n_keys), &dev).unwrap();
        let f = 2.0 * (3 * rows * n_keys * 64) as f64;
        let kt = k.transpose(1, 2).unwrap();
        bench(
            &format!("scores 3x{rows}x64 . (64x{n_keys}) view"),
            &q,
            &kt,
            f,
        );
        bench(
            &format!("values 3x{rows}x{n_keys} . {n_keys}x64"),
            &p,
            &k,
            f,
        );
    }
    let a = Tensor::randn(0f32, 1., (1024, 1024), &dev).unwrap();
    bench("1024^3", &a, &a, 2.0 * 1024f64.powi(3));
}
