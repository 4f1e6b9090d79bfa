//! The MLP's gated activation, `silu(gate) * up`, from the fused gate/up projection, and
//! `silu` alone (a translator's aligner).
//!
//! Unfused it is two passes over `(T, intermediate)` and a scalar `expf` per element; here one
//! pass reads both halves of each row of the fused output and writes the product.

use candle_core::{Device, Tensor};
use rayon::prelude::*;

use super::{exp, multiversion, with_f32};

/// `silu(g) * u` for `gate_up` `(T, 2 n)` whose rows are `[g | u]`; returns `(T, n)`.
pub(crate) fn swiglu(gate_up: &Tensor) -> candle_core::Result<Tensor> {
    let (t, width) = gate_up.dims2()?;
    if width % 2 != 0 {
        candle_core::bail!("swiglu: fused row width {width} is odd");
    }
    let n = width / 2;
    let mut out = vec![0f32; t * n];
    with_f32(gate_up, |src| {
        out.par_chunks_mut(n)
            .zip(src.par_chunks(width))
            .with_min_len(8)
            .for_each(|(o, row)| {
                let (g, u) = row.split_at(n);
                silu_mul(o, g, u);
            });
        Ok(())
    })?;
    Tensor::from_vec(out, (t, n), &Device::Cpu)
}

multiversion! {
    /// `x = silu(x)` in place (candle's `silu` is a scalar `expf` per element and a new
    /// tensor: a tenth of a translator's Patch layer).
    pub(crate) fn silu_(x: &mut [f32]) {
        for v in x.iter_mut() {
            *v /= 1.0 + exp(-*v);
        }
    }
}

multiversion! {
    fn silu_mul(out: &mut [f32], g: &[f32], u: &[f32]) {
        for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
            *o = g / (1.0 + exp(-g)) * u;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_candle_silu_times_up() -> candle_core::Result<()> {
        let gate_up = Tensor::randn(0f32, 4.0, (5, 2 * 19), &Device::Cpu)?;
        let g = gate_up.narrow(1, 0, 19)?;
        let u = gate_up.narrow(1, 19, 19)?;
        let expected = (g.silu()? * u)?;
        let got = swiglu(&gate_up)?;
        let diff = (got - expected)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "max difference {diff}");
        Ok(())
    }

    #[test]
    fn silu_in_place_matches_candle_silu() -> candle_core::Result<()> {
        let x = Tensor::randn(0f32, 4.0, (3, 37), &Device::Cpu)?;
        let mut got = x.flatten_all()?.to_vec1::<f32>()?;
        silu_(&mut got);
        let expected = x.silu()?.flatten_all()?.to_vec1::<f32>()?;
        for (g, e) in got.iter().zip(&expected) {
            assert!((g - e).abs() <= 1e-5 * e.abs().max(1.0), "{g} against {e}");
        }
        Ok(())
    }
}
