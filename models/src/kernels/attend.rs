//! Attention of a few query rows over a cache: the shape of a decode step.
//!
//! Through candle, a decode step's attention is two batched matmuls per layer (scores, then
//! values) that `gemm` packs and dispatches for a 1 x 64 by 64 x T product, plus the softmax in
//! between: per-call costs that grow into milliseconds per token over 30 layers. Here each
//! query head reads its KV head's keys and values once, straight from the cache's buffers:
//! one dot product per visible key, the softmax of [`super::softmax`], then the weighted sum
//! of the values. Head size 64 has kernels for AVX-512 and AVX2, picked at run time.
//!
//! Each output row is the same computation whatever the other rows, so a job's tokens are the
//! same alone and in a batch.

use candle_core::{CpuStorage, Device, Storage, StorageRef, Tensor};
use rayon::prelude::*;

use super::softmax::softmax_prefix;

/// Query rows per sequence this kernel takes; more (a prefill) go through candle's matmuls.
pub(crate) const MAX_QUERY_ROWS: usize = 16;

/// Attention outputs `(n_h, t, d)` of queries `q` `(n_h, t, d)` (scaled and rotated) over keys
/// `k` and values `v` `(n_kv, n_keys, d)` (views of the cache, rows `d` apart), query `i` at
/// key index `past + i` (it sees keys `0..=past + i`); query head `h` uses KV head
/// `h / (n_h / n_kv)`.
pub(crate) fn attend_few(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    past: usize,
) -> candle_core::Result<Tensor> {
    let mut outs = attend_few_many(&[FewQueries { q, k, v, past }])?;
    outs.pop()
        .ok_or_else(|| candle_core::Error::Msg("attend_few: no output".into()))
}

/// One sequence's queries and the cache they attend to, as [`attend_few`] takes them.
#[derive(Clone, Copy)]
pub(crate) struct FewQueries<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub past: usize,
}

/// [`attend_few`] of several sequences (a batched decode step) in one parallel pass, a task per
/// sequence and query head. One pass instead of one per sequence spares a wake-up of the thread
/// pool per sequence and layer and shares out the work more evenly; each output is the same
/// computation as alone. (A task per KV head, its query heads together, left one job's 3 KV
/// heads unevenly split over 2 threads: 15.2-15.6 against 12.9-13.6 ms per token.)
pub(crate) fn attend_few_many(seqs: &[FewQueries<'_>]) -> candle_core::Result<Vec<Tensor>> {
    let mut shapes = Vec::with_capacity(seqs.len());
    let mut queries = Vec::with_capacity(seqs.len());
    for s in seqs {
        let shape = Shapes::of("attend_few", s.q, s.k, s.v, s.past)?;
        if shape.t > MAX_QUERY_ROWS {
            candle_core::bail!("attend_few: {} queries, at most {MAX_QUERY_ROWS}", shape.t);
        }
        shapes.push(shape);
        queries.push(s.q.contiguous()?);
    }
    let (qv, kv, vv) = (
        HeadsView::all(queries.iter())?,
        HeadsView::all(seqs.iter().map(|s| s.k))?,
        HeadsView::all(seqs.iter().map(|s| s.v))?,
    );
    let mut outs: Vec<Vec<f32>> = shapes
        .iter()
        .map(|s| vec![0f32; s.n_h * s.t * s.d])
        .collect();
    let mut tasks = Vec::new();
    for (i, out) in outs.iter_mut().enumerate() {
        let s = &shapes[i];
        tasks.extend(
            out.chunks_mut((s.t * s.d).max(1))
                .enumerate()
                .map(|(h, o)| (i, h, o)),
        );
    }
    let (qs, ks, vs) = (
        HeadsView::slices(&qv)?,
        HeadsView::slices(&kv)?,
        HeadsView::slices(&vv)?,
    );
    tasks.into_par_iter().for_each(|(i, h, out)| {
        let Shapes {
            n_h,
            t,
            d,
            n_kv,
            n_keys,
        } = shapes[i];
        let g = h / (n_h / n_kv);
        let past = seqs[i].past;
        let keys = &ks[i].0[g * ks[i].1..][..n_keys * d];
        let values = &vs[i].0[g * vs[i].1..][..n_keys * d];
        let queries = &qs[i].0[h * t * d..][..t * d];
        let mut probs = vec![0f32; n_keys];
        for (r, (q, o)) in queries
            .chunks_exact(d)
            .zip(out.chunks_exact_mut(d))
            .enumerate()
        {
            let seen = past + r + 1;
            query_row(q, &keys[..seen * d], &values[..seen * d], &mut probs, o);
        }
    });
    outs.into_iter()
        .zip(&shapes)
        .map(|(out, s)| Tensor::from_vec(out, (s.n_h, s.t, s.d), &Device::Cpu))
        .collect()
}

/// The sizes of an attention call: `n_h` query heads of `t` rows of `d` over `n_kv` KV heads
/// of `n_keys` keys.
pub(super) struct Shapes {
    pub n_h: usize,
    pub t: usize,
    pub d: usize,
    pub n_kv: usize,
    pub n_keys: usize,
}

impl Shapes {
    /// Checks `q` `(n_h, t, d)`, `k` and `v` `(n_kv, n_keys, d)` against each other and the
    /// causal window (`past + t <= n_keys`); `kernel` names the caller in errors.
    pub(super) fn of(
        kernel: &str,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        past: usize,
    ) -> candle_core::Result<Self> {
        let (n_h, t, d) = q.dims3()?;
        let (n_kv, n_keys, d_k) = k.dims3()?;
        if v.dims3()? != (n_kv, n_keys, d_k) || d_k != d || n_kv == 0 || n_h % n_kv != 0 {
            candle_core::bail!(
                "{kernel}: q {:?}, k {:?}, v {:?}",
                q.dims(),
                k.dims(),
                v.dims()
            );
        }
        if past + t > n_keys {
            candle_core::bail!("{kernel}: {t} queries from key {past} over {n_keys} keys");
        }
        Ok(Self {
            n_h,
            t,
            d,
            n_kv,
            n_keys,
        })
    }
}

/// Calls `f` with the f32 storage of a `(heads, rows, d)` tensor from its first element and the
/// distance between heads, when its rows are contiguous (`d` apart, unit stride): the cache's
/// views of its buffers.
pub(super) fn heads_view<R>(
    t: &Tensor,
    f: impl FnOnce(&[f32], usize) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let view = HeadsView::of(t)?;
    f(view.slice()?, view.head)
}

/// A `(heads, rows, d)` tensor's storage held for reading, with where its heads lie: what
/// [`heads_view`] hands its closure, for callers that hold several at once.
struct HeadsView<'a> {
    storage: StorageRef<'a>,
    /// The first element.
    start: usize,
    /// Elements from the first head's first row to the last head's last.
    len: usize,
    /// Elements from one head to the next.
    head: usize,
}

impl<'a> HeadsView<'a> {
    fn of(t: &'a Tensor) -> candle_core::Result<Self> {
        let (storage, layout) = t.storage_and_layout();
        let dims = layout.dims();
        let stride = layout.stride();
        let [heads, rows, d] = *dims else {
            candle_core::bail!("attend_few: expected (heads, rows, d), got {dims:?}");
        };
        if (rows > 1 && stride[1] != d) || (d > 1 && stride[2] != 1) {
            candle_core::bail!("attend_few: rows not contiguous, strides {stride:?}");
        }
        let head = if heads > 1 { stride[0] } else { rows * d };
        let len = (heads.max(1) - 1) * head + rows * d;
        let start = layout.start_offset();
        Ok(Self {
            storage,
            start,
            len,
            head,
        })
    }

    fn all(ts: impl Iterator<Item = &'a Tensor>) -> candle_core::Result<Vec<Self>> {
        ts.map(Self::of).collect()
    }

    /// Each view's elements and distance between heads.
    fn slices(views: &[Self]) -> candle_core::Result<Vec<(&[f32], usize)>> {
        views.iter().map(|v| Ok((v.slice()?, v.head))).collect()
    }

    fn slice(&self) -> candle_core::Result<&[f32]> {
        match &*self.storage {
            Storage::Cpu(CpuStorage::F32(data)) => {
                data.get(self.start..self.start + self.len).ok_or_else(|| {
                    candle_core::Error::Msg("attend_few: view outside its storage".into())
                })
            }
            _ => candle_core::bail!("attend_few: f32 CPU tensors expected"),
        }
    }
}

/// One query row over the keys and values it sees: `out = softmax(K q) V`, with `probs` as
/// room for the scores.
fn query_row(q: &[f32], keys: &[f32], values: &[f32], probs: &mut [f32], out: &mut [f32]) {
    let seen = keys.len() / q.len();
    let probs = &mut probs[..seen];
    #[cfg(target_arch = "x86_64")]
    if q.len() == avx512::D && std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F was just detected; `q` and `out` are `D` long and `keys`, `values`
        // hold `seen` rows of `D`.
        unsafe {
            avx512::scores(q, keys, probs);
            softmax_prefix(probs, seen);
            avx512::weighted_values(probs, values, out);
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if q.len() == avx2::D
        && std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
    {
        // SAFETY: the two features `avx2` needs were just detected; `q` and `out` are `D` long
        // and `keys`, `values` hold `seen` rows of `D`.
        unsafe {
            avx2::scores(q, keys, probs);
            softmax_prefix(probs, seen);
            avx2::weighted_values(probs, values, out);
        }
        return;
    }
    for (s, key) in probs.iter_mut().zip(keys.chunks_exact(q.len())) {
        *s = q.iter().zip(key).map(|(a, b)| a * b).sum();
    }
    softmax_prefix(probs, seen);
    out.fill(0.0);
    for (&p, value) in probs.iter().zip(values.chunks_exact(out.len())) {
        for (o, &v) in out.iter_mut().zip(value) {
            *o += p * v;
        }
    }
}

/// The head size of SmolLM2 and most small llamas, written out for AVX2: a query row, or an
/// output row, is eight registers.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    pub(super) const D: usize = 64;

    /// `scores[j] = q . k_j` for the `scores.len()` rows of `keys`.
    ///
    /// # Safety
    /// AVX2 and FMA; `q` is `D` long, `keys` at least `scores.len() * D`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn scores(q: &[f32], keys: &[f32], scores: &mut [f32]) {
        debug_assert!(q.len() == D && keys.len() >= scores.len() * D);
        // SAFETY: as the caller guarantees, every load is inside `q` or key row `j`.
        unsafe {
            let qv: [__m256; 8] = std::array::from_fn(|c| _mm256_loadu_ps(q.as_ptr().add(8 * c)));
            for (j, s) in scores.iter_mut().enumerate() {
                let k = keys.as_ptr().add(j * D);
                let mut a = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k));
                let mut b = _mm256_mul_ps(qv[1], _mm256_loadu_ps(k.add(8)));
                for c in (2..8).step_by(2) {
                    a = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k.add(8 * c)), a);
                    b = _mm256_fmadd_ps(qv[c + 1], _mm256_loadu_ps(k.add(8 * c + 8)), b);
                }
                let v = _mm256_add_ps(a, b);
                let v = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
                let v = _mm_add_ps(v, _mm_movehl_ps(v, v));
                let v = _mm_add_ss(v, _mm_movehdup_ps(v));
                *s = _mm_cvtss_f32(v);
            }
        }
    }

    /// `out = sum_j p_j v_j` over the `probs.len()` rows of `values`.
    ///
    /// # Safety
    /// AVX2 and FMA; `out` is `D` long, `values` at least `probs.len() * D`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn weighted_values(probs: &[f32], values: &[f32], out: &mut [f32]) {
        debug_assert!(out.len() == D && values.len() >= probs.len() * D);
        // SAFETY: as the caller guarantees, every access is inside value row `j` or `out`.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); 8];
            for (j, &p) in probs.iter().enumerate() {
                let v = values.as_ptr().add(j * D);
                let pv = _mm256_set1_ps(p);
                for (c, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v.add(8 * c)), *a);
                }
            }
            for (c, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.as_mut_ptr().add(8 * c), *a);
            }
        }
    }
}

/// [`avx2`] on AVX-512: a row is four registers, and sixteen keys' scores are summed across
/// their lanes together (a tree of pairwise sums, three instructions per step) rather than one
/// key at a time, which took as many instructions as the key's products.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    pub(super) const D: usize = 64;

    /// Key `j`'s products with `q`, summed down to one register of 16 partial sums.
    ///
    /// # Safety
    /// AVX-512F; `k` points at `D` values.
    #[inline(always)]
    unsafe fn partial(q: &[__m512; 4], k: *const f32) -> __m512 {
        // SAFETY: as the caller guarantees.
        unsafe {
            let a = _mm512_mul_ps(q[0], _mm512_loadu_ps(k));
            let a = _mm512_fmadd_ps(q[1], _mm512_loadu_ps(k.add(16)), a);
            let a = _mm512_fmadd_ps(q[2], _mm512_loadu_ps(k.add(32)), a);
            _mm512_fmadd_ps(q[3], _mm512_loadu_ps(k.add(48)), a)
        }
    }

    /// `scores[j] = q . k_j` for the `scores.len()` rows of `keys`, sixteen keys at a time.
    ///
    /// # Safety
    /// AVX-512F; `q` is `D` long, `keys` at least `scores.len() * D`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scores(q: &[f32], keys: &[f32], scores: &mut [f32]) {
        debug_assert!(q.len() == D && keys.len() >= scores.len() * D);
        // Adjacent lanes' pairs: lanes 0-7 from the first register, 8-15 from the second.
        let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
        // SAFETY: as the caller guarantees, every load is inside `q` or key row `j`; the
        // stores write lanes of `scores` that exist (masked at the end).
        unsafe {
            let qv: [__m512; 4] = std::array::from_fn(|c| _mm512_loadu_ps(q.as_ptr().add(16 * c)));
            for (b, out) in scores.chunks_mut(16).enumerate() {
                let n = out.len();
                // Sixteen registers of one key's partial sums each, then halved four times:
                // each step sums adjacent lanes of two registers into one, keys in order.
                let mut v: [__m512; 16] = std::array::from_fn(|i| {
                    if i < n {
                        partial(&qv, keys.as_ptr().add((16 * b + i) * D))
                    } else {
                        _mm512_setzero_ps()
                    }
                });
                let mut width = 16;
                while width > 1 {
                    for i in 0..width / 2 {
                        let (x, y) = (v[2 * i], v[2 * i + 1]);
                        v[i] = _mm512_add_ps(
                            _mm512_permutex2var_ps(x, even, y),
                            _mm512_permutex2var_ps(x, odd, y),
                        );
                    }
                    width /= 2;
                }
                _mm512_mask_storeu_ps(out.as_mut_ptr(), ((1u32 << n) - 1) as __mmask16, v[0]);
            }
        }
    }

    /// `out = sum_j p_j v_j` over the `probs.len()` rows of `values`.
    ///
    /// # Safety
    /// AVX-512F; `out` is `D` long, `values` at least `probs.len() * D`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn weighted_values(probs: &[f32], values: &[f32], out: &mut [f32]) {
        debug_assert!(out.len() == D && values.len() >= probs.len() * D);
        // SAFETY: as the caller guarantees, every access is inside value row `j` or `out`.
        unsafe {
            let mut acc = [_mm512_setzero_ps(); 4];
            for (j, &p) in probs.iter().enumerate() {
                let v = values.as_ptr().add(j * D);
                let pv = _mm512_set1_ps(p);
                for (c, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(pv, _mm512_loadu_ps(v.add(16 * c)), *a);
                }
            }
            for (c, a) in acc.iter().enumerate() {
                _mm512_storeu_ps(out.as_mut_ptr().add(16 * c), *a);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both x86 kernels, where the CPU has them, against plain sums: scores over key counts
    /// around whole blocks of sixteen, and the weighted values.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_and_avx512_kernels_match_plain_sums() {
        use std::arch::is_x86_feature_detected as has;
        let d = avx512::D;
        let value = |i: usize| ((i * 7919 % 1013) as f32 - 506.0) / 300.0;
        let q: Vec<f32> = (0..d).map(|i| value(i + 5)).collect();
        for n in [1, 15, 16, 17, 40, 64] {
            let keys: Vec<f32> = (0..n * d).map(|i| value(3 * i + 1)).collect();
            let probs: Vec<f32> = (0..n).map(|j| value(j + 11).abs() / 2.0).collect();
            let plain_scores: Vec<f32> = keys
                .chunks_exact(d)
                .map(|k| k.iter().zip(&q).map(|(a, b)| a * b).sum())
                .collect();
            let mut plain_out = vec![0f32; d];
            for (p, v) in probs.iter().zip(keys.chunks_exact(d)) {
                for (o, x) in plain_out.iter_mut().zip(v) {
                    *o += p * x;
                }
            }
            let close = |a: &[f32], b: &[f32], what: &str| {
                for (x, y) in a.iter().zip(b) {
                    assert!(
                        (x - y).abs() <= 1e-4 * y.abs().max(1.0),
                        "{what}, {n} keys: {x} {y}"
                    );
                }
            };
            let (mut scores, mut out) = (vec![0f32; n], vec![0f32; d]);
            if has!("avx512f") {
                // SAFETY: AVX-512F detected; the lengths are as the kernels require.
                unsafe {
                    avx512::scores(&q, &keys, &mut scores);
                    avx512::weighted_values(&probs, &keys, &mut out);
                }
                close(&scores, &plain_scores, "avx512 scores");
                close(&out, &plain_out, "avx512 values");
            }
            if has!("avx2") && has!("fma") {
                // SAFETY: AVX2 and FMA detected; the lengths are as the kernels require.
                unsafe {
                    avx2::scores(&q, &keys, &mut scores);
                    avx2::weighted_values(&probs, &keys, &mut out);
                }
                close(&scores, &plain_scores, "avx2 scores");
                close(&out, &plain_out, "avx2 values");
            }
        }
    }

    /// The same attention through candle: scores, masked softmax, values.
    fn reference(q: &Tensor, k: &Tensor, v: &Tensor, past: usize) -> candle_core::Result<Tensor> {
        let (n_h, t, d) = q.dims3()?;
        let (n_kv, n_keys, _) = k.dims3()?;
        let g = n_h / n_kv;
        let q = q.reshape((n_kv, g * t, d))?;
        let scores = q.matmul(&k.t()?)?.reshape((n_kv, g, t, n_keys))?;
        let mut mask = vec![0f32; t * n_keys];
        for i in 0..t {
            for j in past + i + 1..n_keys {
                mask[i * n_keys + j] = f32::NEG_INFINITY;
            }
        }
        let mask = Tensor::from_vec(mask, (t, n_keys), &Device::Cpu)?;
        let probs = candle_nn::ops::softmax(&scores.broadcast_add(&mask)?, candle_core::D::Minus1)?;
        probs
            .reshape((n_kv, g * t, n_keys))?
            .matmul(&v.contiguous()?)?
            .reshape((n_h, t, d))
    }

    #[test]
    fn matches_candle_on_cache_views_and_rows_alone_equal_rows_together() -> candle_core::Result<()>
    {
        for (n_h, n_kv, t, past, d) in [
            (9, 3, 1, 40, 64),
            (3, 1, 3, 14, 64),
            (4, 2, 5, 11, 24),
            (2, 2, 3, 0, 8),
        ] {
            let n_keys = past + t;
            // A buffer with spare capacity, as the cache holds it.
            let buf = Tensor::randn(0f32, 1.0, (n_kv, n_keys + 7, d), &Device::Cpu)?;
            let k = buf.narrow(1, 0, n_keys)?;
            let v = (buf.narrow(1, 0, n_keys)? * 0.5)?.sin()?;
            let q = Tensor::randn(0f32, 0.3, (n_h, t, d), &Device::Cpu)?;
            let got = attend_few(&q, &k, &v, past)?;
            let want = reference(&q, &k, &v, past)?;
            let diff = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 1e-5, "({n_h}, {n_kv}, {t}, {past}, {d}): {diff}");
            // Row i alone, with the keys it sees, is the same computation.
            for i in 0..t {
                let alone = attend_few(
                    &q.narrow(1, i, 1)?,
                    &k.narrow(1, 0, past + i + 1)?,
                    &v.narrow(1, 0, past + i + 1)?,
                    past + i,
                )?;
                assert_eq!(
                    alone.flatten_all()?.to_vec1::<f32>()?,
                    got.narrow(1, i, 1)?.flatten_all()?.to_vec1::<f32>()?
                );
            }
        }
        Ok(())
    }

    #[test]
    fn sequences_in_one_pass_get_what_each_gets_alone() -> candle_core::Result<()> {
        // Different cache lengths, query rows and head counts; one cache a view with spare room.
        let mut owned = Vec::new();
        for (n_h, n_kv, t, past, d) in [(9, 3, 1, 40, 64), (4, 2, 3, 5, 64), (2, 1, 1, 0, 24)] {
            let buf = Tensor::randn(0f32, 1.0, (n_kv, past + t + 3, d), &Device::Cpu)?;
            let k = buf.narrow(1, 0, past + t)?;
            let v = Tensor::randn(0f32, 1.0, (n_kv, past + t, d), &Device::Cpu)?;
            let q = Tensor::randn(0f32, 0.3, (n_h, t, d), &Device::Cpu)?;
            owned.push((q, k, v, past));
        }
        let seqs: Vec<_> = owned
            .iter()
            .map(|(q, k, v, past)| FewQueries {
                q,
                k,
                v,
                past: *past,
            })
            .collect();
        let together = attend_few_many(&seqs)?;
        assert_eq!(together.len(), owned.len());
        for ((q, k, v, past), got) in owned.iter().zip(&together) {
            let want = reference(q, k, v, *past)?;
            let diff = (got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 1e-5, "{:?}: {diff}", q.dims());
            assert_eq!(
                attend_few(q, k, v, *past)?
                    .flatten_all()?
                    .to_vec1::<f32>()?,
                got.flatten_all()?.to_vec1::<f32>()?
            );
        }
        // One sequence's bad shape refuses the whole pass.
        let bad = FewQueries {
            q: &owned[0].0,
            k: &owned[1].1,
            v: &owned[1].2,
            past: 0,
        };
        assert!(attend_few_many(&[seqs[0], bad]).is_err());
        Ok(())
    }

    #[test]
    fn refuses_queries_past_the_keys() -> candle_core::Result<()> {
        let q = Tensor::zeros((2, 3, 8), candle_core::DType::F32, &Device::Cpu)?;
        let k = Tensor::zeros((1, 4, 8), candle_core::DType::F32, &Device::Cpu)?;
        assert!(attend_few(&q, &k, &k, 2).is_err());
        assert!(attend_few(&q, &k, &k, 1).is_ok());
        Ok(())
    }
}
