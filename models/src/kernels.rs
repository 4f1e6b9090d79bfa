//! CPU kernels that candle lacks and a long prefill needs.
//!
//! The only one so far is a causal softmax done in place on the attention scores: candle's path
//! (build a mask, add it, softmax every column) costs a mask allocation, an extra pass over the
//! score matrix and an `exp` for every masked entry, about half of a causal prefill's scores.
//! This kernel touches only the keys a query may see and writes zeros past them. It has no
//! backward pass, so the differentiable forward keeps candle's ops.

use candle_core::{CpuStorage, InplaceOp1, Layout, Tensor};

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
        let data = &mut data[start..end];
        let matrix = rows * n_keys;
        // Two halves on two threads: each matrix is (rows x keys) for one head; the heads are
        // independent. Splitting by whole matrices keeps the causal row index simple.
        let n_mat = data.len() / matrix.max(1);
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(n_mat.max(1));
        let per = n_mat.div_ceil(threads) * matrix;
        std::thread::scope(|s| {
            for part in data.chunks_mut(per.max(1)) {
                s.spawn(move || {
                    for m in part.chunks_mut(matrix) {
                        for (i, row) in m.chunks_mut(n_keys).enumerate() {
                            softmax_prefix(row, self.first + i + 1);
                        }
                    }
                });
            }
        });
        Ok(())
    }
}

/// Softmax of `row[..visible]`, zeros after it.
fn softmax_prefix(row: &mut [f32], visible: usize) {
    let (seen, hidden) = row.split_at_mut(visible);
    let max = seen.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for x in seen.iter_mut() {
        *x = (*x - max).exp();
        sum += *x;
    }
    let inv = 1.0 / sum;
    for x in seen.iter_mut() {
        *x *= inv;
    }
    hidden.fill(0.0);
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, D};

    #[test]
    fn matches_mask_then_softmax() -> candle_core::Result<()> {
        let (heads, rows, first) = (5, 7, 4);
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
