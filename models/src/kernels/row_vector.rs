//! A row vector added to (or taken from) every row of a matrix, optionally followed by `silu`:
//! a translator's means and biases.
//!
//! candle's broadcast ops walk the broadcast layout element by element, and from 64 K elements
//! they hand the work to candle's own thread pool, whose thread then spins for a while in case
//! more work comes: on a 2-core machine that thread took the core the next product wanted.
//! Adding a code's mean to a rebuilt `(512, 192)` K cost as much as the product that made it
//! (0.27 ms on one thread, 0.45 ms on two); this pass costs a few hundredths of that.

use candle_core::{Device, Tensor};
use rayon::prelude::*;

use super::{multiversion, silu_, with_f32};

/// What to do with each row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RowOp {
    /// `x + b`.
    Add,
    /// `x - b`.
    Sub,
    /// `silu(x + b)`.
    AddSilu,
}

/// `op` of every row of `x` `(T, n)` and `b` `(n)`, both f32; `x` need not be contiguous.
pub(crate) fn with_row_vector(x: &Tensor, b: &Tensor, op: RowOp) -> candle_core::Result<Tensor> {
    let (t, n) = x.dims2()?;
    if b.dims() != [n] {
        candle_core::bail!("row vector {:?} for rows of {n}", b.dims());
    }
    let mut out = vec![0f32; t * n];
    if out.is_empty() {
        return Tensor::from_vec(out, (t, n), &Device::Cpu);
    }
    with_f32(&x.contiguous()?, |xs| {
        with_f32(&b.contiguous()?, |bs| {
            // Rows in tasks of at least 64 KB: the pass is memory-bound, and a task per row
            // would cost more in hand-offs than it saves.
            let min_rows = (16 * 1024 / n).max(1);
            out.par_chunks_mut(n)
                .zip(xs.par_chunks(n))
                .with_min_len(min_rows)
                .for_each(|(o, row)| match op {
                    RowOp::Add => add(o, row, bs),
                    RowOp::Sub => sub(o, row, bs),
                    RowOp::AddSilu => {
                        add(o, row, bs);
                        silu_(o);
                    }
                });
            Ok(())
        })
    })?;
    Tensor::from_vec(out, (t, n), &Device::Cpu)
}

multiversion! {
    fn add(out: &mut [f32], x: &[f32], b: &[f32]) {
        for ((o, &x), &b) in out.iter_mut().zip(x).zip(b) {
            *o = x + b;
        }
    }
}

multiversion! {
    fn sub(out: &mut [f32], x: &[f32], b: &[f32]) {
        for ((o, &x), &b) in out.iter_mut().zip(x).zip(b) {
            *o = x - b;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_candles_broadcast_ops() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        // Wide enough for several tasks, and a transposed (non-contiguous) input.
        for (rows, n) in [(700, 96), (3, 5), (0, 4)] {
            let x = Tensor::randn(0f32, 3.0, (n, rows), &dev)?.t()?;
            let b = Tensor::randn(0f32, 1.0, n, &dev)?;
            let cases = [
                (RowOp::Add, x.broadcast_add(&b)?),
                (RowOp::Sub, x.broadcast_sub(&b)?),
                (RowOp::AddSilu, x.broadcast_add(&b)?.silu()?),
            ];
            for (op, expected) in cases {
                let got = with_row_vector(&x, &b, op)?;
                assert_eq!(got.dims(), expected.dims());
                if rows > 0 {
                    let diff = (got - expected)?.abs()?.max_all()?.to_scalar::<f32>()?;
                    assert!(diff < 1e-5, "{op:?} {rows}x{n}: {diff}");
                }
            }
        }
        let x = Tensor::zeros((4, 6), candle_core::DType::F32, &dev)?;
        let b = Tensor::zeros(5, candle_core::DType::F32, &dev)?;
        assert!(with_row_vector(&x, &b, RowOp::Add).is_err());
        Ok(())
    }
}
