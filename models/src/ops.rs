//! The operations of the forward pass, each one function with two implementations behind it:
//! the fused CPU kernel of [`crate::kernels`] when no gradient is being recorded, and a
//! composition of candle's differentiable ops when one is (an input derives from a `Var`: a
//! LoRA being trained, a SemPIC writer's cache).
//!
//! candle records a graph only for tensors that derive from a variable ([`Tensor::track_op`]),
//! so the choice is made per call from the data, not by a flag threaded through the model: the
//! same `forward` serves inference, on-the-fly experts and training. The kernels have no
//! backward pass; the compositions compute the same function (tested here and, end to end, on
//! the real model).

use candle_core::{CpuStorage, CustomOp1, Device, Layout, Shape, Storage, Tensor, D};

use crate::kernels;
pub(crate) use crate::kernels::Heads;

/// `x W^T` for a weight `(out, in)`.
///
/// When `x` carries gradients and `w` does not (a frozen base weight under a trained adapter),
/// candle's matmul backward would still compute the weight's gradient, as large as the weight,
/// and throw it away: the [`FrozenMatmul`] op returns the input's gradient only, which halves
/// the backward pass of fine-tuning.
///
/// Without gradients, a few rows (a decode step, one row per job) go to
/// [`kernels::linear_few_rows`], which streams the weight once instead of packing it first.
pub(crate) fn linear(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    use candle_core::DType;
    if !x.track_op()
        && !w.track_op()
        && x.dims2()?.0 <= kernels::MAX_ROWS
        && x.dims2()?.1 >= kernels::MIN_DEPTH
        && x.is_contiguous()
        && w.is_contiguous()
        && x.dtype() == DType::F32
        && matches!(w.dtype(), DType::F32 | DType::BF16)
    {
        return kernels::linear_few_rows(x, w);
    }
    // A weight held narrower than `x` (an adapter's terms in bf16) is widened for the others.
    let w = w.to_dtype(x.dtype())?;
    if x.track_op() && !w.track_op() {
        x.contiguous()?.apply_op1(FrozenMatmul { w })
    } else {
        x.matmul(&w.t()?)
    }
}

/// `x W^T` where `W` may also be held in a block format (`packed`, the same values, given for
/// a decode step's rows with the kernel to multiply them on): without gradients the rows
/// multiply the packed copy
/// ([`kernels::linear_narrow`]), which streams a quarter to an eighth of the f32 bytes. Other
/// rows without gradients multiply on AMX tiles when `tiles` ([`kernels::linear_tiles`], bf16
/// products); anything else goes to [`linear`].
pub(crate) fn linear_packed(
    x: &Tensor,
    w: &Tensor,
    packed: Option<(&kernels::PackedWeight, kernels::NarrowIsa)>,
    tiles: bool,
) -> candle_core::Result<Tensor> {
    let plain = !x.track_op() && !w.track_op() && x.dtype() == candle_core::DType::F32;
    if let Some((p, isa)) = packed {
        if plain {
            return kernels::linear_narrow(&x.contiguous()?, p, isa);
        }
    }
    if tiles && plain && x.dims2()?.0 > kernels::MAX_ROWS && w.dtype() == candle_core::DType::F32 {
        return kernels::linear_tiles(&x.contiguous()?, &w.contiguous()?);
    }
    linear(x, w)
}

/// `x W^T` for a frozen `W` `(out, in)`: backward gives `dx = dy W` and nothing for `W`.
struct FrozenMatmul {
    /// Shares the model's storage (a tensor clone is a reference).
    w: Tensor,
}

impl CustomOp1 for FrozenMatmul {
    fn name(&self) -> &'static str {
        "frozen-matmul"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(data) = storage else {
            candle_core::bail!("frozen-matmul expects f32 input");
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("frozen-matmul expects a contiguous input");
        };
        let x = Tensor::from_slice(&data[start..end], layout.shape(), &Device::Cpu)?;
        let y = x.matmul(&self.w.t()?)?;
        let shape = y.shape().clone();
        let (s, l) = y.storage_and_layout();
        match (&*s, l.contiguous_offsets()) {
            (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => {
                Ok((CpuStorage::F32(v[a..b].to_vec()), shape))
            }
            _ => candle_core::bail!("frozen-matmul: unexpected matmul output"),
        }
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(grad_res.matmul(&self.w)?))
    }
}

/// RMS normalisation of the rows of `x` with gain `weight`.
pub(crate) fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    if x.track_op() || weight.track_op() {
        candle_nn::ops::rms_norm_slow(x, weight, eps as f32)
    } else {
        candle_nn::ops::rms_norm(&x.contiguous()?, weight, eps as f32)
    }
}

/// Rotates `x` of shape `(heads, T, head_dim)` with tables `(T, head_dim / 2)` (the interleaved
/// RoPE: dimensions `2i` and `2i + 1` rotate together).
pub(crate) fn rope_heads(x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    let (h, t, d) = x.dims3()?;
    if x.track_op() {
        let pairs = x.reshape((h, t, d / 2, 2))?;
        let x0 = pairs.narrow(3, 0, 1)?;
        let x1 = pairs.narrow(3, 1, 1)?;
        let cos = cos.reshape((1, t, d / 2, 1))?;
        let sin = sin.reshape((1, t, d / 2, 1))?;
        let y0 = (x0.broadcast_mul(&cos)? - x1.broadcast_mul(&sin)?)?;
        let y1 = (x0.broadcast_mul(&sin)? + x1.broadcast_mul(&cos)?)?;
        Tensor::cat(&[y0, y1], 3)?.reshape((h, t, d))
    } else {
        let x4 = x.contiguous()?.reshape((1, h, t, d))?;
        candle_nn::rotary_emb::rope_i(&x4, &cos.contiguous()?, &sin.contiguous()?)?
            .reshape((h, t, d))
    }
}

/// Splits the fused projection output `qkv` `(T, (n_h + 2 n_kv) d)` into heads, with RoPE on
/// queries and keys and `q_scale` on queries.
pub(crate) fn split_qkv_rope(
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    (n_h, n_kv, d): (usize, usize, usize),
    q_scale: f32,
) -> candle_core::Result<Heads> {
    if !qkv.track_op() {
        return kernels::split_qkv_rope(qkv, cos, sin, (n_h, n_kv, d), q_scale);
    }
    let t = qkv.dim(0)?;
    let heads = |offset: usize, n: usize| -> candle_core::Result<Tensor> {
        qkv.narrow(1, offset * d, n * d)?
            .contiguous()?
            .reshape((t, n, d))?
            .transpose(0, 1)?
            .contiguous()
    };
    Ok(Heads {
        q: (rope_heads(&heads(0, n_h)?, cos, sin)? * f64::from(q_scale))?,
        k_rot: rope_heads(&heads(n_h, n_kv)?, cos, sin)?,
        v: heads(n_h + n_kv, n_kv)?,
    })
}

/// Causal softmax over the last dimension of `scores` `(.., rows, n_keys)`: query row `i` sees
/// keys `0..=first + i`. Without gradients the fresh score matrix is rewritten in place.
pub(crate) fn causal_softmax(scores: Tensor, first: usize) -> candle_core::Result<Tensor> {
    if scores.track_op() {
        let dims = scores.dims();
        let (rows, n_keys) = (dims[dims.len() - 2], dims[dims.len() - 1]);
        let mask = causal_mask(rows, n_keys, first)?;
        candle_nn::ops::softmax(&scores.broadcast_add(&mask)?, D::Minus1)
    } else {
        kernels::causal_softmax_(&scores, first)?;
        Ok(scores)
    }
}

/// `(rows, n_keys)` additive mask: query `i` (at key index `first + i`) sees keys `0..=first + i`.
fn causal_mask(rows: usize, n_keys: usize, first: usize) -> candle_core::Result<Tensor> {
    let mut m = vec![0f32; rows * n_keys];
    for i in 0..rows {
        for v in &mut m[(i * n_keys + first + i + 1).min((i + 1) * n_keys)..(i + 1) * n_keys] {
            *v = f32::NEG_INFINITY;
        }
    }
    Tensor::from_vec(m, (rows, n_keys), &Device::Cpu)
}

/// Attention outputs per chunk of consecutive queries, each `(n_h, rows, d)`, as one
/// `(T, n_h d)` matrix (the output projection's input).
pub(crate) fn merge_heads(chunks: &[Tensor]) -> candle_core::Result<Tensor> {
    if chunks.iter().any(Tensor::track_op) {
        let all = Tensor::cat(chunks, 1)?;
        let (n_h, t, d) = all.dims3()?;
        all.transpose(0, 1)?.contiguous()?.reshape((t, n_h * d))
    } else {
        kernels::merge_heads(chunks)
    }
}

/// `op` of every row of `x` `(T, n)` and the row vector `b` `(n)` (a bias, a code's mean):
/// [`kernels::with_row_vector`] without gradients, candle's broadcast ops with them.
pub(crate) fn row_vector(
    x: &Tensor,
    b: &Tensor,
    op: kernels::RowOp,
) -> candle_core::Result<Tensor> {
    use candle_core::DType;
    let plain = !x.track_op()
        && !b.track_op()
        && x.dtype() == DType::F32
        && b.dtype() == DType::F32
        && x.rank() == 2;
    match op {
        _ if plain => kernels::with_row_vector(x, b, op),
        kernels::RowOp::Add => x.broadcast_add(b),
        kernels::RowOp::Sub => x.broadcast_sub(b),
        kernels::RowOp::AddSilu => x.broadcast_add(b)?.silu(),
    }
}

/// `silu(g) * u` for the fused gate/up output `(T, 2 n)` whose rows are `[g | u]`.
pub(crate) fn swiglu(gate_up: &Tensor) -> candle_core::Result<Tensor> {
    if gate_up.track_op() {
        let n = gate_up.dim(1)? / 2;
        gate_up.narrow(1, 0, n)?.silu()? * gate_up.narrow(1, n, n)?
    } else {
        kernels::swiglu(gate_up)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rope::Rope;
    use candle_core::Var;

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .and_then(|d| d.abs())
            .and_then(|d| d.flatten_all())
            .and_then(|d| d.max(0))
            .and_then(|d| d.to_scalar::<f32>())
            .unwrap_or(f32::INFINITY)
    }

    /// The same values, once as a plain tensor (kernel path) and once as a variable (the
    /// differentiable path).
    fn both(shape: &[usize], scale: f64) -> (Tensor, Var) {
        let t = Tensor::randn(0f32, 1.0, shape, &Device::Cpu)
            .and_then(|t| t * scale)
            .unwrap();
        let v = Var::from_tensor(&t).unwrap();
        (t, v)
    }

    #[test]
    fn kernels_and_differentiable_compositions_agree() -> candle_core::Result<()> {
        let (n_h, n_kv, d, t) = (6, 2, 8, 11);
        let rope = Rope::with_params(d, 10_000.0);
        let positions: Vec<u32> = (5..5 + t as u32).collect();
        let (cos, sin) = rope.cos_sin(&positions, &Device::Cpu)?;
        let (qkv, qkv_var) = both(&[t, (n_h + 2 * n_kv) * d], 1.0);
        let fast = split_qkv_rope(&qkv, &cos, &sin, (n_h, n_kv, d), 0.25)?;
        let slow = split_qkv_rope(qkv_var.as_tensor(), &cos, &sin, (n_h, n_kv, d), 0.25)?;
        assert!(slow.q.track_op() && !fast.q.track_op());
        for (a, b) in [
            (&fast.q, &slow.q),
            (&fast.k_rot, &slow.k_rot),
            (&fast.v, &slow.v),
        ] {
            assert_eq!(a.dims(), b.dims());
            assert!(max_diff(a, b) < 1e-5);
        }

        let (scores, scores_var) = both(&[2, 3, 4, 9], 3.0);
        let slow = causal_softmax(scores_var.as_tensor().clone(), 5)?;
        let fast = causal_softmax(scores.copy()?, 5)?;
        assert!(max_diff(&fast, &slow) < 1e-5);
        // Row i sees keys 0..=5 + i: the last key is hidden from rows 0..=2.
        let hidden = fast.narrow(3, 8, 1)?.narrow(2, 0, 3)?;
        assert_eq!(hidden.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);

        let (a, a_var) = both(&[3, 5, 4], 1.0);
        let (b, b_var) = both(&[3, 2, 4], 1.0);
        let fast = merge_heads(&[a, b])?;
        let slow = merge_heads(&[a_var.as_tensor().clone(), b_var.as_tensor().clone()])?;
        assert_eq!(max_diff(&fast, &slow), 0.0);

        let (gu, gu_var) = both(&[5, 38], 4.0);
        assert!(max_diff(&swiglu(&gu)?, &swiglu(gu_var.as_tensor())?) < 1e-5);

        let (x, x_var) = both(&[5, 16], 2.0);
        let w = Tensor::randn(0f32, 1.0, 16, &Device::Cpu)?;
        assert!(
            max_diff(
                &rms_norm(&x, &w, 1e-5)?,
                &rms_norm(x_var.as_tensor(), &w, 1e-5)?
            ) < 1e-5
        );
        Ok(())
    }

    /// The frozen matmul gives the input the same gradient as candle's matmul, and the weight
    /// none.
    #[test]
    fn frozen_linear_backward_is_the_input_gradient_only() -> candle_core::Result<()> {
        let (_, x) = both(&[4, 6], 1.0);
        let w = Tensor::randn(0f32, 1.0, (3, 6), &Device::Cpu)?;
        let y = linear(x.as_tensor(), &w)?;
        assert!(max_diff(&y, &x.as_tensor().matmul(&w.t()?)?) < 1e-6);
        let grads = y.sqr()?.sum_all()?.backward()?;
        let gx = grads.get(x.as_tensor()).expect("gradient of x");
        // d/dx sum((x W^T)^2) = 2 (x W^T) W.
        let want = ((x.as_tensor().matmul(&w.t()?)? * 2.0)?).matmul(&w)?;
        assert!(max_diff(gx, &want) < 1e-4);
        assert!(grads.get(&w).is_none());
        Ok(())
    }
}
