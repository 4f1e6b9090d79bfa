//! Products on AMX tiles whose weights are packed once and kept, for the small fixed weights a
//! node multiplies on every request (a translator's fused Patch layers, a few hundred KB in
//! bf16). The model's own projections are packed per call instead ([`super::linear_tiles`]):
//! they are large, and a second copy of them would double the model's memory; these are
//! small, and packing them per call cost as much as their products.

use candle_core::{Device, Tensor};
use rayon::prelude::*;

use super::{amx, silu_, with_f32};

/// `x W^T + b` with `W` `(n, k)` packed in tiles.
pub(crate) struct TileLinear {
    w: amx::TileWeight,
    bias: Vec<f32>,
}

impl TileLinear {
    /// `W = M^T` for `m` `(k, n)` (the orientation a chain of products `x M_1 M_2` gives),
    /// `bias` `(n)`. Callers check [`amx::available`].
    pub(crate) fn from_columns(m: &Tensor, bias: &Tensor) -> candle_core::Result<Self> {
        Self::packed(m, bias, |w, ms, (k, n)| w.repack_transposed(ms, k, n))
    }

    /// `W` `(n, k)` as a layer stores it, `bias` `(n)`. Callers check [`amx::available`].
    pub(crate) fn from_rows(w: &Tensor, bias: &Tensor) -> candle_core::Result<Self> {
        Self::packed(w, bias, |p, ws, (n, k)| p.repack(ws, n, k))
    }

    /// `t` packed by `pack` (given its elements and dimensions), with `bias`.
    fn packed(
        t: &Tensor,
        bias: &Tensor,
        pack: impl FnOnce(&mut amx::TileWeight, &[f32], (usize, usize)),
    ) -> candle_core::Result<Self> {
        let dims = t.dims2()?;
        let mut w = amx::TileWeight::empty();
        with_f32(&t.contiguous()?, |ts| {
            pack(&mut w, ts, dims);
            Ok(())
        })?;
        let n = w.shape().1;
        if bias.dims() != [n] {
            candle_core::bail!("tile linear: bias {:?} for {n} outputs", bias.dims());
        }
        let bias = bias.to_dtype(candle_core::DType::F32)?.to_vec1()?;
        Ok(Self { w, bias })
    }
}

/// `[x | silu(x W_1^T + b_1)] W_2^T + b_2` for `x` `(rows, k)`: a one-hidden-layer MLP whose
/// output layer also reads its input (a translator's aligner, fused with what follows it).
/// The hidden layer goes from the first product's sums to the second's bf16 input in one
/// pass, in the thread's scratch: it is never an f32 tensor of its own.
pub(crate) fn skip_mlp_tiles(
    x: &Tensor,
    first: &TileLinear,
    second: &TileLinear,
) -> candle_core::Result<Tensor> {
    let (rows, k) = x.dims2()?;
    let ((k1, hidden), (k2, n)) = (first.w.shape(), second.w.shape());
    if rows == 0 || k1 != k || k2 != k + hidden {
        candle_core::bail!(
            "skip mlp: x {:?} for layers of {k1} -> {hidden} and {k2} -> {n} inputs",
            x.dims()
        );
    }
    let rows_pad = amx::padded_rows(rows);
    let (k1_pad, k2_pad) = (first.w.padded_depth(), second.w.padded_depth());
    let mut y = Vec::new();
    let n_pad = with_f32(&x.contiguous()?, |xs| {
        Ok(amx::with_scratch(|s| {
            // Zeros in the padding rows and columns, which the products read.
            for (a, k_pad) in [(&mut s.a, k1_pad), (&mut s.a2, k2_pad)] {
                a.clear();
                a.resize(rows_pad * k_pad, 0);
                amx::block_to_bf16((xs, k), (rows, k), (a, k_pad), 0);
            }
            let h_pad = amx::linear_padded_bf16(&s.a, rows_pad, &first.w, &mut s.y);
            s.a2.par_chunks_mut(k2_pad)
                .zip(s.y.par_chunks_mut(h_pad))
                .take(rows)
                .with_min_len(16)
                .for_each(|(a, h)| {
                    let h = &mut h[..hidden];
                    for (v, b) in h.iter_mut().zip(&first.bias) {
                        *v += b;
                    }
                    silu_(h);
                    amx::to_bf16(h, &mut a[k..k + hidden]);
                });
            amx::linear_padded_bf16(&s.a2, rows_pad, &second.w, &mut y)
        }))
    })?;
    y.par_chunks_mut(n_pad)
        .take(rows)
        .with_min_len(16)
        .for_each(|row| {
            for (o, b) in row.iter_mut().zip(&second.bias) {
                *o += b;
            }
        });
    Tensor::from_vec(amx::unpadded(y, rows, n_pad, n), (rows, n), &Device::Cpu)
}

#[cfg(test)]
mod tests {
    use super::super::test_values as values;
    use super::*;
    use candle_core::DType;

    /// Against candle's f32 products of the same values rounded to bf16 (the hidden layer
    /// too, as the second product reads it): shapes that pad rows, depth and outputs, and both
    /// ways of giving a weight.
    #[test]
    #[ignore = "needs a CPU with AMX; `make test` runs it where the CPU has AMX (`make test-amx`)"]
    fn skip_mlp_matches_the_rounded_reference_on_amx_tiles() -> candle_core::Result<()> {
        assert!(amx::available(), "this CPU or kernel cannot run AMX tiles");
        let dev = Device::Cpu;
        let bf = |t: &Tensor| t.to_dtype(DType::BF16)?.to_dtype(DType::F32);
        let t = |v: Vec<f32>, shape: (usize, usize)| Tensor::from_vec(v, shape, &dev);
        for (rows, k, hidden, n) in [(33, 40, 24, 48), (511, 128, 512, 384), (17, 7, 3, 5)] {
            let x = t(values(rows * k, 1), (rows, k))?;
            let w1 = t(values(hidden * k, 2), (hidden, k))?;
            let b1 = Tensor::from_vec(values(hidden, 3), hidden, &dev)?;
            let w2 = t(values(n * (k + hidden), 4), (n, k + hidden))?;
            let b2 = Tensor::from_vec(values(n, 5), n, &dev)?;
            let h = bf(&x)?.matmul(&bf(&w1)?.t()?)?.broadcast_add(&b1)?.silu()?;
            let expected = bf(&Tensor::cat(&[&x, &h], 1)?)?
                .matmul(&bf(&w2)?.t()?)?
                .broadcast_add(&b2)?;
            let first = TileLinear::from_rows(&w1, &b1)?;
            for second in [
                TileLinear::from_rows(&w2, &b2)?,
                TileLinear::from_columns(&w2.t()?, &b2)?,
            ] {
                let got = skip_mlp_tiles(&x, &first, &second)?;
                assert_eq!(got.dims(), [rows, n]);
                let diff = (got - &expected)?.abs()?.max_all()?.to_scalar::<f32>()?;
                let scale = expected.abs()?.max_all()?.to_scalar::<f32>()?;
                // The same bf16 inputs and f32 sums in another order, but a hidden value
                // next to a rounding boundary may round the other way: a few units of
                // bf16's last place on one input, times its weight.
                assert!(
                    diff <= 1e-2 * scale.max(1.0),
                    "{rows}x{k}->{hidden}->{n}: {diff}"
                );
            }
            let second = TileLinear::from_rows(&w2, &b2)?;
            assert!(skip_mlp_tiles(&x.narrow(1, 1, k - 1)?, &first, &second).is_err());
            assert!(skip_mlp_tiles(&x, &first, &first).is_err());
        }
        let zeros = Tensor::zeros(3, DType::F32, &dev)?;
        assert!(TileLinear::from_rows(&t(values(6, 6), (2, 3))?, &zeros).is_err());
        Ok(())
    }
}
