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
        let inv = 1.0 / exp_sum::<LANES>(seen, max);
        for x in seen.iter_mut() {
            *x *= inv;
        }
        hidden.fill(0.0);
    }
}

/// Replaces each of `seen` by `e^(x - max)` and returns their sum, taken in `W` independent
/// partial sums (one SIMD register of them, at the caller's vector width) and then the tail.
#[inline(always)]
fn exp_sum<const W: usize>(seen: &mut [f32], max: f32) -> f32 {
    let mut sums = [0f32; W];
    let mut chunks = seen.chunks_exact_mut(W);
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
    sum
}

/// Softmax of `row[..visible]` rounded to bf16 into `out` (`row`'s length, a multiple of 32),
/// zeros after it; `row` is left holding the unscaled exponentials. The tile attention's
/// probabilities go straight into the bf16 operand of its second product: a pass over the
/// scores fewer than [`softmax_prefix`] and a separate rounding, and 16 lanes where the
/// portable kernel's AVX2 version has 8.
///
/// # Safety
/// The CPU has AVX-512F and AVX512_BF16 (which [`super::amx::available`] checks).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
pub(crate) unsafe fn softmax_prefix_bf16(row: &mut [f32], visible: usize, out: &mut [u16]) {
    use std::arch::x86_64::*;
    const WIDE: usize = 16;
    assert!(
        visible <= row.len() && out.len() == row.len() && row.len().is_multiple_of(2 * WIDE),
        "softmax_prefix_bf16: {visible} of {} scores into {}",
        row.len(),
        out.len()
    );
    let seen = &mut row[..visible];
    let mut chunks = seen.chunks_exact(WIDE);
    let mut maxes = _mm512_set1_ps(f32::NEG_INFINITY);
    for c in &mut chunks {
        // SAFETY: `c` holds 16 f32.
        maxes = _mm512_max_ps(maxes, unsafe { _mm512_loadu_ps(c.as_ptr()) });
    }
    let max =
        chunks.remainder().iter().fold(
            _mm512_reduce_max_ps(maxes),
            |m, &x| if x > m { x } else { m },
        );
    let inv = _mm512_set1_ps(1.0 / exp_sum::<WIDE>(seen, max));
    // Lanes at or past `visible` are zeroed by the masks.
    let mask = |from: usize| -> u16 {
        match visible.saturating_sub(from) {
            0 => 0,
            n if n >= WIDE => u16::MAX,
            n => (1u16 << n) - 1,
        }
    };
    for (i, (src, dst)) in row
        .chunks_exact(2 * WIDE)
        .zip(out.chunks_exact_mut(2 * WIDE))
        .enumerate()
    {
        let at = i * 2 * WIDE;
        // SAFETY: `src` holds 32 f32 and `dst` 32 u16 (64 bytes).
        unsafe {
            let lo = _mm512_maskz_mul_ps(mask(at), _mm512_loadu_ps(src.as_ptr()), inv);
            let hi =
                _mm512_maskz_mul_ps(mask(at + WIDE), _mm512_loadu_ps(src[WIDE..].as_ptr()), inv);
            let bf = _mm512_cvtne2ps_pbh(hi, lo);
            _mm512_storeu_si512(
                dst.as_mut_ptr().cast(),
                std::mem::transmute::<__m512bh, __m512i>(bf),
            );
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) unsafe fn softmax_prefix_bf16(_: &mut [f32], _: usize, _: &mut [u16]) {
    unreachable!("AMX is x86-64 only; amx::available() is false elsewhere")
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

    #[test]
    #[ignore = "needs a CPU with AMX; `make test` runs it where the CPU has AMX (`make test-amx`)"]
    fn probabilities_in_bf16_are_the_rounded_softmax_on_amx_tiles() {
        assert!(
            crate::kernels::amx::available(),
            "this CPU or kernel cannot run AMX tiles"
        );
        let bf16 = |v: f32| f32::from_bits(u32::from(half::bf16::from_f32(v).to_bits()) << 16);
        // Prefixes shorter than a vector, across a 16-lane boundary, whole rows; rows that
        // held other values before (the buffer is reused).
        for (width, visible) in [(32, 1), (32, 17), (64, 33), (64, 64), (96, 50)] {
            let scores: Vec<f32> = (0..width)
                .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.7)
                .collect();
            let mut want = scores.clone();
            softmax_prefix(&mut want, visible);
            let mut row = scores.clone();
            let mut out = vec![0x3f80u16; width];
            // SAFETY: `amx::available()` checked AVX-512F and AVX512_BF16.
            unsafe { softmax_prefix_bf16(&mut row, visible, &mut out) };
            for (i, (&got, &p)) in out.iter().zip(&want).enumerate() {
                let got = f32::from_bits(u32::from(got) << 16);
                if i >= visible {
                    assert_eq!(got, 0.0, "({width}, {visible}) key {i} is hidden");
                } else {
                    // The same value up to the sum's order, then rounded: one bf16 step.
                    assert!(
                        (got - bf16(p)).abs() <= p * 2f32.powi(-7),
                        "({width}, {visible}) key {i}: {got} vs {p}"
                    );
                }
            }
        }
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
