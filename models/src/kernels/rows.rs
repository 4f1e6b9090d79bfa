//! `x W^T` for a few rows of `x`: the shape of a decode step (one row per job in the batch).
//!
//! candle hands every matmul to `gemm`, which packs the right-hand side into panels before it
//! multiplies. For a prefill that copy is paid back many times; for a handful of rows it is a
//! second pass over the weight, and decode is bound by streaming the weights. Here each weight
//! row is read once, straight from the model's `(out, in)` layout, and multiplied with every
//! row of `x` (which stays in L1) while it is in registers. Tiles of weight rows and `x` rows
//! are sized so that their accumulators fit the 16 AVX2 registers.
//!
//! Every output is the same dot product whatever the tile it falls in (partial sums over `in`
//! in vector lanes, then the lanes in a fixed order, then the tail), so a row gives the same
//! result alone as in a batch on a given CPU. AVX-512 (16 lanes, 32 registers: tiles of 4 x 4)
//! where the CPU has it, else AVX2 + FMA (8 lanes, 16 registers: tiles of up to 8 sums), else
//! portable code with the AVX2 path's order of sums. The weight may be f32 or bf16 (an
//! adapter's terms, stored narrow where their values allow): bf16 is widened to f32 exactly as it
//! is loaded, so the sums are those of an f32 weight with the same values.

use candle_core::Tensor;
use rayon::prelude::*;

use super::{transposed, with_elements_all, Elements, Widen};

/// The most rows of `x` this kernel takes; more go to `gemm`.
pub(crate) const MAX_ROWS: usize = 16;

/// The shortest rows (`in`) worth this kernel: below it each output's reduction across the
/// vector lanes costs more than its few multiply-adds (a LoRA term's `B`, `in` = its rank), and
/// `gemm`'s packing of a small weight is cheap.
pub(crate) const MIN_DEPTH: usize = 128;

/// Weight rows per parallel task: enough work to be worth a task, small enough to share out.
const ROWS_PER_TASK: usize = 64;

/// `x W^T` for `x` `(m, k)` with `m <= MAX_ROWS` and `w` `(n, k)`, both contiguous, `x` f32 and
/// `w` f32 or bf16.
pub(crate) fn linear_few_rows(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    let (m, k) = x.dims2()?;
    let (n, k_w) = w.dims2()?;
    if k != k_w || m == 0 || m > MAX_ROWS {
        candle_core::bail!("linear_few_rows: x {:?} and w {:?}", x.dims(), w.dims());
    }
    let yt = with_elements_all(&[x, w], |e| match *e {
        [Elements::F32(xs), w] => Ok(few_rows_t_of(xs, m, k, w)),
        _ => candle_core::bail!("linear_few_rows: x must be f32"),
    })?;
    transposed(&yt, m, n)
}

/// [`few_rows_t`] for a weight in either storage.
pub(crate) fn few_rows_t_of(x: &[f32], m: usize, k: usize, w: Elements<'_>) -> Vec<f32> {
    match w {
        Elements::F32(w) => few_rows_t(x, m, k, w),
        Elements::Bf16(w) => few_rows_t(x, m, k, w),
    }
}

/// `(x W^T)^T` `(n, m)` for `x` `(m, k)` and `w` `(n, k)` as slices: each parallel task writes
/// its own contiguous block.
pub(crate) fn few_rows_t<T: Widen>(x: &[f32], m: usize, k: usize, w: &[T]) -> Vec<f32> {
    let n = w.len() / k;
    let mut yt = vec![0f32; n * m];
    yt.par_chunks_mut(ROWS_PER_TASK * m)
        .zip(w.par_chunks(ROWS_PER_TASK * k))
        .for_each(|(out, rows)| weight_rows(x, m, k, rows, out));
    yt
}

/// `out[j * m + r] = w_j . x_r` for the weight rows `w` (each `k` long) and all `m` rows of `x`.
fn weight_rows<T: Widen>(x: &[f32], m: usize, k: usize, w: &[T], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the feature `avx512::weight_rows` is compiled for was just detected.
        unsafe { avx512::weight_rows(x, m, k, w, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the two features `avx2::weight_rows` is compiled for were just detected.
        unsafe { avx2::weight_rows(x, m, k, w, out) };
        return;
    }
    for (wr, o) in w.chunks_exact(k).zip(out.chunks_exact_mut(m)) {
        for (xr, o) in x.chunks_exact(k).zip(o) {
            *o = dot_portable(xr, wr);
        }
    }
}

/// The same sum as the AVX2 tiles: 8 partial sums over `k`, then the lanes, then the tail.
fn dot_portable<T: Widen>(x: &[f32], w: &[T]) -> f32 {
    let mut lanes = [0f32; 8];
    let full = x.len() / 8 * 8;
    for (xc, wc) in x[..full].chunks_exact(8).zip(w[..full].chunks_exact(8)) {
        for i in 0..8 {
            lanes[i] += wc[i].f32() * xc[i];
        }
    }
    let mut s = lanes_sum(lanes);
    for (a, b) in x[full..].iter().zip(&w[full..]) {
        s += a * b.f32();
    }
    s
}

/// The lanes of an 8-wide partial sum in a fixed order (pairs, then pairs of pairs).
fn lanes_sum(l: [f32; 8]) -> f32 {
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{lanes_sum, Widen};

    /// See [`super::weight_rows`].
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn weight_rows<T: Widen>(x: &[f32], m: usize, k: usize, w: &[T], out: &mut [f32]) {
        let n = w.len() / k;
        let mut j = 0;
        while j < n {
            // Accumulators, (weight rows) x (x rows), stay at or under 8 of the 16 registers,
            // leaving room for the loads.
            let wide = match n - j {
                left if left >= 4 && m <= 2 => 4,
                left if left >= 2 => 2,
                _ => 1,
            };
            let mut r = 0;
            while r < m {
                let rows = (m - r).min(4);
                let at = Tile { r, j, k, m };
                match (wide, rows) {
                    (4, 1) => at.run::<1, 4, T>(x, w, out),
                    (4, _) => at.run::<2, 4, T>(x, w, out),
                    (2, 1) => at.run::<1, 2, T>(x, w, out),
                    (2, 2) => at.run::<2, 2, T>(x, w, out),
                    (2, 3) => at.run::<3, 2, T>(x, w, out),
                    (2, _) => at.run::<4, 2, T>(x, w, out),
                    (_, 1) => at.run::<1, 1, T>(x, w, out),
                    (_, 2) => at.run::<2, 1, T>(x, w, out),
                    (_, 3) => at.run::<3, 1, T>(x, w, out),
                    (_, _) => at.run::<4, 1, T>(x, w, out),
                }
                r += rows;
            }
            j += wide;
        }
    }

    /// Eight weights from `p`, widened to f32.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn load8<T: Widen>(p: *const T) -> __m256 {
        // SAFETY (the caller's): `p` points at 8 elements.
        unsafe {
            match T::BF16 {
                true => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                    _mm_loadu_si128(p.cast()),
                ))),
                false => _mm256_loadu_ps(p.cast()),
            }
        }
    }

    /// Where a tile sits: `x` rows from `r`, weight rows from `j`, rows `k` long, `m` rows of
    /// `x` in all (the output's row stride).
    #[derive(Clone, Copy)]
    struct Tile {
        r: usize,
        j: usize,
        k: usize,
        m: usize,
    }

    impl Tile {
        /// `W` weight rows times `R` rows of `x`, into `out[(j + a) * m + r + b]`.
        #[target_feature(enable = "avx2,fma")]
        #[inline]
        fn run<const R: usize, const W: usize, T: Widen>(
            &self,
            x: &[f32],
            w: &[T],
            out: &mut [f32],
        ) {
            let Tile { r, j, k, m } = *self;
            let xs: [&[f32]; R] = std::array::from_fn(|b| &x[(r + b) * k..(r + b + 1) * k]);
            let ws: [&[T]; W] = std::array::from_fn(|a| &w[(j + a) * k..(j + a + 1) * k]);
            let mut acc = [[_mm256_setzero_ps(); R]; W];
            let full = k / 8 * 8;
            let mut i = 0;
            while i < full {
                // SAFETY: every slice in `xs` and `ws` is `k` long and `i + 8 <= full <= k`.
                unsafe {
                    // Plain loops, not closures: a closure is not compiled with this function's
                    // target features, and a call per load would cost more than the load.
                    let mut xv = [_mm256_setzero_ps(); R];
                    for b in 0..R {
                        xv[b] = _mm256_loadu_ps(xs[b].as_ptr().add(i));
                    }
                    for a in 0..W {
                        let wv = load8(ws[a].as_ptr().add(i));
                        for b in 0..R {
                            acc[a][b] = _mm256_fmadd_ps(wv, xv[b], acc[a][b]);
                        }
                    }
                }
                i += 8;
            }
            for a in 0..W {
                for b in 0..R {
                    let mut lanes = [0f32; 8];
                    // SAFETY: `lanes` holds 8 floats.
                    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc[a][b]) };
                    let mut s = lanes_sum(lanes);
                    for t in full..k {
                        s += ws[a][t].f32() * xs[b][t];
                    }
                    out[(j + a) * m + r + b] = s;
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::Widen;

    /// See [`super::weight_rows`]: tiles of 4 weight rows by up to 4 rows of `x`.
    #[target_feature(enable = "avx512f")]
    pub(super) fn weight_rows<T: Widen>(x: &[f32], m: usize, k: usize, w: &[T], out: &mut [f32]) {
        let n = w.len() / k;
        let mut j = 0;
        while j < n {
            let wide = if n - j >= 4 { 4 } else { 1 };
            let mut r = 0;
            while r < m {
                let rows = (m - r).min(4);
                match (wide, rows) {
                    (4, 1) => run::<1, 4, T>(x, r, w, j, k, m, out),
                    (4, 2) => run::<2, 4, T>(x, r, w, j, k, m, out),
                    (4, 3) => run::<3, 4, T>(x, r, w, j, k, m, out),
                    (4, _) => run::<4, 4, T>(x, r, w, j, k, m, out),
                    (_, 1) => run::<1, 1, T>(x, r, w, j, k, m, out),
                    (_, 2) => run::<2, 1, T>(x, r, w, j, k, m, out),
                    (_, 3) => run::<3, 1, T>(x, r, w, j, k, m, out),
                    (_, _) => run::<4, 1, T>(x, r, w, j, k, m, out),
                }
                r += rows;
            }
            j += wide;
        }
    }

    /// Sixteen weights from `p`, widened to f32.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load16<T: Widen>(p: *const T) -> __m512 {
        // SAFETY (the caller's): `p` points at 16 elements.
        unsafe {
            match T::BF16 {
                true => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                    _mm256_loadu_si256(p.cast()),
                ))),
                false => _mm512_loadu_ps(p.cast()),
            }
        }
    }

    /// `W` weight rows from `j` times `R` rows of `x` from `r`, into `out[(j + a) * m + r + b]`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    // Index loops over the tile's fixed-size arrays, which the compiler keeps in registers.
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
    fn run<const R: usize, const W: usize, T: Widen>(
        x: &[f32],
        r: usize,
        w: &[T],
        j: usize,
        k: usize,
        m: usize,
        out: &mut [f32],
    ) {
        let x = &x[r * k..(r + R) * k];
        let w = &w[j * k..(j + W) * k];
        let mut acc = [[_mm512_setzero_ps(); R]; W];
        let full = k / 16 * 16;
        let mut i = 0;
        while i < full {
            // SAFETY: `x` holds `R` rows and `w` `W` rows of `k`, and `i + 16 <= full <= k`.
            // Plain loops, not closures: a closure is not compiled with this function's target
            // features, and a call per load would cost more than the load.
            unsafe {
                let mut xv = [_mm512_setzero_ps(); R];
                for b in 0..R {
                    xv[b] = _mm512_loadu_ps(x.as_ptr().add(b * k + i));
                }
                for a in 0..W {
                    let wv = load16(w.as_ptr().add(a * k + i));
                    for b in 0..R {
                        acc[a][b] = _mm512_fmadd_ps(wv, xv[b], acc[a][b]);
                    }
                }
            }
            i += 16;
        }
        for a in 0..W {
            for b in 0..R {
                // The lanes in the intrinsic's fixed order, in registers.
                let mut s = _mm512_reduce_add_ps(acc[a][b]);
                for t in full..k {
                    s += w[a * k + t].f32() * x[b * k + t];
                }
                out[(j + a) * m + r + b] = s;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn few_rows_equal_candle_matmul_and_a_row_alone_equals_it_in_a_batch() -> candle_core::Result<()>
    {
        // Odd sizes: a k tail after the 8-wide chunks, n not a multiple of any tile.
        for (m, k, n) in [
            (1, 37, 131),
            (2, 64, 7),
            (3, 576, 65),
            (8, 96, 130),
            (16, 24, 9),
        ] {
            let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu)?;
            let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu)?;
            let got = linear_few_rows(&x, &w)?;
            let want = x.matmul(&w.t()?)?;
            let diff = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 1e-3, "({m}, {k}, {n}): max difference {diff}");
            // A weight in bf16: the products of the same values in f32, to the bit.
            let rounded = w.to_dtype(candle_core::DType::BF16)?;
            let narrow = linear_few_rows(&x, &rounded)?;
            let wide = linear_few_rows(&x, &rounded.to_dtype(candle_core::DType::F32)?)?;
            assert_eq!(
                narrow.flatten_all()?.to_vec1::<f32>()?,
                wide.flatten_all()?.to_vec1::<f32>()?,
                "({m}, {k}, {n}) in bf16"
            );
            for row in 0..m {
                let alone = linear_few_rows(&x.narrow(0, row, 1)?, &w)?;
                let batched = got.narrow(0, row, 1)?;
                assert_eq!(
                    alone.flatten_all()?.to_vec1::<f32>()?,
                    batched.flatten_all()?.to_vec1::<f32>()?,
                    "({m}, {k}, {n}) row {row}"
                );
            }
        }
        Ok(())
    }
}
