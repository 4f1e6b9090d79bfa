//! Causal softmax in place on the attention scores.
//!
//! candle's path (build a mask, add it, softmax every column) costs a mask allocation, an extra
//! pass over the score matrix and an `exp` for every masked entry, about half of a causal
//! prefill's scores. This kernel touches only the keys a query may see, with the vectorised
//! [`exp`], and writes zeros past them. It has no backward pass, so the differentiable forward
//! keeps candle's ops.

use candle_core::{CpuStorage, InplaceOp1, Layout, Tensor};
use rayon::prelude::*;

use super::{exp, multiversion};

/// Independent accumulators per reduction, so the compiler can keep one SIMD register of
/// partial maxima or sums instead of a serial chain.
const LANES: usize = 8;

/// Causal softmax over the last dimension of `scores`, shaped `(.., rows, n_keys)`, in place.
/// Query row `i` sees keys `0..=first + i`; later keys get probability zero.
pub(crate) fn causal_softmax_(scores: &Tensor, first: usize) -> candle_core::Result<()> {
    scores.inplace_op1(&CausalSoftmax { first })
}

struct CausalSoftmax {
    first: usize,
}

impl InplaceOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "causal-softmax"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let CpuStorage::F32(data) = storage else {
            candle_core::bail!("causal softmax: f32 scores expected");
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("causal softmax: contiguous scores expected");
        };
        let dims = layout.dims();
        let [.., rows, n_keys] = dims else {
            candle_core::bail!("causal softmax: scores need (.., rows, keys), got {dims:?}");
        };
        let (rows, n_keys) = (*rows, *n_keys);
        if self.first + rows > n_keys {
            candle_core::bail!(
                "causal softmax: {rows} queries from key {} need {} keys, have {n_keys}",
                self.first,
                self.first + rows
            );
        }
        if n_keys == 0 {
            return Ok(());
        }
        let first = self.first;
        data[start..end]
            .par_chunks_mut(n_keys)
            .with_min_len(16)
            .enumerate()
            .for_each(|(r, row)| softmax_prefix(row, first + r % rows + 1));
        Ok(())
    }
}

multiversion! {
    /// Softmax of `row[..visible]`, zeros after it.
    pub(super) fn softmax_prefix(row: &mut [f32], visible: usize) {
        let (seen, hidden) = row.split_at_mut(visible);
        let mut acc = [f32::NEG_INFINITY; LANES];
        let mut chunks = seen.chunks_exact(LANES);
        for c in &mut chunks {
            for (a, &x) in acc.iter_mut().zip(c) {
                *a = if x > *a { x } else { *a };
            }
        }
        let max = chunks
            .remainder()
            .iter()
            .chain(&acc)
            .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
        let mut sums = [0f32; LANES];
        let mut chunks = seen.chunks_exact_mut(LANES);
        for c in &mut chunks {
            for (s, x) in sums.iter_mut().zip(c.iter_mut()) {
                *x = exp(*x - max);
                *s += *x;
            }
        }
        let mut sum: f32 = sums.iter().sum();
        for x in chunks.into_remainder() {
            *x = exp(*x - max);
            sum += *x;
        }
        let inv = 1.0 / sum;
        for x in seen.iter_mut() {
            *x *= inv;
        }
        hidden.fill(0.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, D};

    #[test]
    fn matches_mask_then_softmax() -> candle_core::Result<()> {
        // Short rows stay in the scalar tail; long ones go through the lane loops.
        for (heads, rows, first) in [(5, 7, 4), (3, 37, 50)] {
            check_against_candle(heads, rows, first)?;
        }
        Ok(())
    }

    fn check_against_candle(heads: usize, rows: usize, first: usize) -> candle_core::Result<()> {
        let n_keys = first + rows;
        let scores = Tensor::randn(0f32, 3.0, (heads, rows, n_keys), &Device::Cpu)?;
        let mut mask = vec![0f32; rows * n_keys];
        for i in 0..rows {
            for v in &mut mask[i * n_keys + first + i + 1..(i + 1) * n_keys] {
                *v = f32::NEG_INFINITY;
            }
        }
        let mask = Tensor::from_vec(mask, (rows, n_keys), &Device::Cpu)?;
        let expected = candle_nn::ops::softmax(&scores.broadcast_add(&mask)?, D::Minus1)?;
        let got = scores.copy()?;
        causal_softmax_(&got, first)?;
        let diff = (got - expected)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-6, "max difference {diff}");
        Ok(())
    }

    #[test]
    fn refuses_too_few_keys() -> candle_core::Result<()> {
        let scores = Tensor::zeros((1, 4, 5), candle_core::DType::F32, &Device::Cpu)?;
        assert!(causal_softmax_(&scores, 2).is_err());
        Ok(())
    }
}
