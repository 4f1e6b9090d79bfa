//! The training forward pass: the model's computation with the adapter's `A`/`B` as the only
//! tensors that get gradients.
//!
//! candle's matmul backward computes the gradient of both operands, so a plain forward through
//! the model would spend as much time on gradients of the frozen base weights (then thrown
//! away) as on the activations' gradients, and allocate a base-sized gradient per window.
//! Here every base projection is a [`FrozenMatmul`] custom op whose backward returns the input's
//! gradient only. The result equals [`Llama::forward`] with `differentiable(true)` (tested).

use std::collections::BTreeMap;

use candle_core::{CpuStorage, CustomOp1, Device, Layout, Shape, Storage, Tensor, Var};

use crate::llama::{Llama, Proj};
use crate::rope::rotate_heads;

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

fn frozen(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op1(FrozenMatmul { w: w.clone() })
}

/// The adapter's trainable matrices and their scale.
pub(crate) struct Lora<'a> {
    pub vars: &'a BTreeMap<(usize, Proj), (Var, Var)>,
    pub scale: f64,
}

fn linear(
    model: &Llama,
    lora: &Lora<'_>,
    layer: usize,
    proj: Proj,
    x: &Tensor,
) -> candle_core::Result<Tensor> {
    let y = frozen(x, &model.blocks[layer].proj(proj).weight)?;
    match lora.vars.get(&(layer, proj)) {
        None => Ok(y),
        Some((a, b)) => {
            let delta = x.matmul(&a.as_tensor().t()?)?.matmul(&b.as_tensor().t()?)?;
            y + (delta * lora.scale)?
        }
    }
}

/// Logits `(T, vocab)` of `tokens` at positions `0..T`, differentiable in the adapter only.
pub(crate) fn logits(
    model: &Llama,
    lora: &Lora<'_>,
    tokens: &[u32],
) -> candle_core::Result<Tensor> {
    let cfg = &model.cfg;
    let t = tokens.len();
    let (n_h, n_kv, d) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
    let groups = n_h / n_kv;
    let eps = cfg.rms_norm_eps as f32;
    let ids = Tensor::new(tokens, &Device::Cpu)?;
    let mut x = model.embed.index_select(&ids, 0)?;
    let positions: Vec<u32> = (0..t as u32).collect();
    let (cos, sin) = model.rope.cos_sin(&positions, &Device::Cpu)?;
    let mut mask = vec![0f32; t * t];
    for i in 0..t {
        for v in &mut mask[i * t + i + 1..(i + 1) * t] {
            *v = f32::NEG_INFINITY;
        }
    }
    let mask = Tensor::from_vec(mask, (t, t), &Device::Cpu)?;
    let heads = |x: &Tensor, n: usize| -> candle_core::Result<Tensor> {
        x.reshape((t, n, d))?.transpose(0, 1)?.contiguous()
    };
    for (l, block) in model.blocks.iter().enumerate() {
        let h = candle_nn::ops::rms_norm_slow(&x, &block.attn_norm, eps)?;
        let q = linear(model, lora, l, Proj::Q, &h)?;
        let k = linear(model, lora, l, Proj::K, &h)?;
        let v = linear(model, lora, l, Proj::V, &h)?;
        let q = (rotate_heads(&heads(&q, n_h)?, &cos, &sin, true)? * (1.0 / (d as f64).sqrt()))?;
        let k = rotate_heads(&heads(&k, n_kv)?, &cos, &sin, true)?;
        let v = heads(&v, n_kv)?;
        let q = q.reshape((n_kv, groups * t, d))?;
        let scores = q
            .matmul(&k.transpose(1, 2)?)?
            .reshape((n_kv, groups, t, t))?
            .broadcast_add(&mask)?;
        let probs = candle_nn::ops::softmax(&scores, candle_core::D::Minus1)?.reshape((
            n_kv,
            groups * t,
            t,
        ))?;
        let out = probs
            .matmul(&v)?
            .reshape((n_h, t, d))?
            .transpose(0, 1)?
            .contiguous()?
            .reshape((t, n_h * d))?;
        x = (x + linear(model, lora, l, Proj::O, &out)?)?;
        let h = candle_nn::ops::rms_norm_slow(&x, &block.ffn_norm, eps)?;
        let gate = linear(model, lora, l, Proj::Gate, &h)?;
        let up = linear(model, lora, l, Proj::Up, &h)?;
        x = (x + linear(model, lora, l, Proj::Down, &(gate.silu()? * up)?)?)?;
    }
    let x = candle_nn::ops::rms_norm_slow(&x, &model.norm, eps)?;
    frozen(&x, &model.lm_head)
}
