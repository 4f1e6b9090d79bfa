//! Attention of a few query rows over a cache: the shape of a decode step.
//!
//! Through candle, a decode step's attention is two batched matmuls per layer (scores, then
//! values) that `gemm` packs and dispatches for a 1 x 64 by 64 x T product, plus the softmax in
//! between: per-call costs that grow into milliseconds per token over 30 layers. Here each
//! query head reads its KV head's keys and values once, straight from the cache's buffers:
//! one dot product per visible key, the softmax of [`super::softmax`], then the weighted sum
//! of the values. Head size 64 has kernels for AVX-512 and AVX2, picked at run time.
//!
//! The cache's keys and values are f32, or f16 where a model decodes on narrow weights
//! ([`crate::cache::KvCache`]): the kernels widen each row as they load it (`vcvtph2ps`), so a
//! step reads half the bytes. With several jobs in a step the caches are most of what it reads.
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

/// [`attend_few`] of several sequences (a batched decode step) in one parallel pass. One pass
/// instead of one per sequence spares a wake-up of the thread pool per sequence and layer and
/// shares out the work more evenly. A task is a sequence's KV head (its query heads reading each
/// key and value once, [`query_rows`]) when there are at least four such tasks per thread, else
/// a sequence's query head: one job's 3 KV heads split unevenly over 2 threads (15.2-15.6
/// against 12.9-13.6 ms per token). Either way each output is the same computation as alone.
pub(crate) fn attend_few_many(seqs: &[FewQueries<'_>]) -> candle_core::Result<Vec<Tensor>> {
    let mut shapes = Vec::with_capacity(seqs.len());
    let mut queries = Vec::with_capacity(seqs.len());
    for s in seqs {
        let shape = Shapes::of("attend_few", s.q, s.k, s.v, s.past)?;
        if shape.t > MAX_QUERY_ROWS {
            candle_core::bail!("attend_few: {} queries, at most {MAX_QUERY_ROWS}", shape.t);
        }
        shapes.push(shape);
        // A batch's queries are views of one tensor of all its rows, each head's rows `d`
        // apart: read in place.
        queries.push(if HeadsView::of(s.q).is_ok() {
            s.q.clone()
        } else {
            s.q.contiguous()?
        });
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
    // A task per KV head (its query heads together, each key and value read once for all of
    // them) when there are enough such tasks to share out evenly, else a task per query head.
    let per_kv_head: usize = shapes.iter().map(|s| s.n_kv).sum();
    let fuse = per_kv_head >= 4 * rayon::current_num_threads();
    let mut tasks = Vec::new();
    for (i, out) in outs.iter_mut().enumerate() {
        let s = &shapes[i];
        let heads = if fuse { s.n_h / s.n_kv } else { 1 };
        tasks.extend(
            out.chunks_mut((heads * s.t * s.d).max(1))
                .enumerate()
                .map(|(c, o)| (i, c * heads, heads, o)),
        );
    }
    let (ks, vs) = (HeadsView::slices(&kv)?, HeadsView::slices(&vv)?);
    let qs = HeadsView::slices(&qv)?
        .into_iter()
        .map(|(q, head)| Ok((q.f32()?, head)))
        .collect::<candle_core::Result<Vec<_>>>()?;
    // Tasks differ in length (each sequence its own cache): split to single tasks, so that a
    // thread out of work can take any that is left.
    tasks
        .into_par_iter()
        .with_max_len(1)
        .for_each(|(i, h0, heads, out)| {
            let Shapes {
                n_h,
                t,
                d,
                n_kv,
                n_keys,
            } = shapes[i];
            let g = h0 / (n_h / n_kv);
            // The queries may be a view of a whole batch's rows: heads `q_head` apart.
            let q_head = qs[i].1;
            let queries = &qs[i].0[h0 * q_head..][..(heads - 1) * q_head + t * d];
            let (keys, values) = (
                ks[i].0.window(g * ks[i].1, n_keys * d),
                vs[i].0.window(g * vs[i].1, n_keys * d),
            );
            let rows = Rows {
                queries,
                q_head,
                heads,
                t,
                d,
                past: seqs[i].past,
                n_keys,
            };
            match (keys, values) {
                (Stored::F32(k), Stored::F32(v)) => rows.attend(k, v, out),
                (Stored::F16(k), Stored::F16(v)) => rows.attend(k, v, out),
                // `Shapes::of` checked that keys and values share a dtype.
                _ => unreachable!("keys and values of one cache in two dtypes"),
            }
        });
    outs.into_iter()
        .zip(&shapes)
        .map(|(out, s)| Tensor::from_vec(out, (s.n_h, s.t, s.d), &Device::Cpu))
        .collect()
}

/// One task's query rows: `heads` query heads of `t` rows of `d` (`q_head` apart) that share
/// one KV head, query `r` seeing keys `0..=past + r`.
struct Rows<'a> {
    queries: &'a [f32],
    q_head: usize,
    heads: usize,
    t: usize,
    d: usize,
    past: usize,
    n_keys: usize,
}

impl Rows<'_> {
    /// Their outputs into `out` (head after head, `t * d` each) over `keys` and `values`
    /// (`n_keys` rows of `d`).
    fn attend<T: Element>(&self, keys: &[T], values: &[T], out: &mut [f32]) {
        let Rows {
            queries,
            q_head,
            heads,
            t,
            d,
            past,
            n_keys,
        } = *self;
        let mut probs = vec![0f32; heads * n_keys];
        let mut outs: Vec<&mut [f32]> = out.chunks_exact_mut(t * d).collect();
        for r in 0..t {
            let seen = past + r + 1;
            let q: Vec<&[f32]> = (0..heads)
                .map(|h| &queries[h * q_head + r * d..][..d])
                .collect();
            let mut o: Vec<&mut [f32]> = outs.iter_mut().map(|o| &mut o[r * d..][..d]).collect();
            query_rows(
                &q,
                &keys[..seen * d],
                &values[..seen * d],
                &mut probs,
                &mut o,
            );
        }
    }
}

/// An element of the cache's keys and values, widened to f32 as the kernels load it. The
/// weights' kernels have their own ([`super::Widen`], f32 or bf16): each kernel's loads know
/// every type its trait admits, so neither can be handed a type it would misread.
pub(crate) trait Element: Copy + Send + Sync + 'static {
    /// Whether it is f16 (the SIMD kernels choose their load by this constant).
    const F16: bool;
    /// Its value.
    fn f32(self) -> f32;
}

impl Element for f32 {
    const F16: bool = false;
    #[inline(always)]
    fn f32(self) -> f32 {
        self
    }
}

impl Element for half::f16 {
    const F16: bool = true;
    #[inline(always)]
    fn f32(self) -> f32 {
        self.to_f32()
    }
}

/// A view's elements in either dtype the cache keeps.
#[derive(Clone, Copy)]
enum Stored<'a> {
    F32(&'a [f32]),
    F16(&'a [half::f16]),
}

impl<'a> Stored<'a> {
    /// Elements `at..at + len`.
    fn window(self, at: usize, len: usize) -> Self {
        match self {
            Self::F32(x) => Self::F32(&x[at..][..len]),
            Self::F16(x) => Self::F16(&x[at..][..len]),
        }
    }

    /// The elements, which must be f32 (queries; a prefill's keys and values).
    fn f32(self) -> candle_core::Result<&'a [f32]> {
        match self {
            Self::F32(x) => Ok(x),
            Self::F16(_) => candle_core::bail!("attention: f32 tensor expected, got f16"),
        }
    }
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
        if v.dims3()? != (n_kv, n_keys, d_k)
            || v.dtype() != k.dtype()
            || d_k != d
            || n_kv == 0
            || n_h % n_kv != 0
        {
            candle_core::bail!(
                "{kernel}: q {:?}, k {:?} {:?}, v {:?} {:?}",
                q.dims(),
                k.dims(),
                k.dtype(),
                v.dims(),
                v.dtype()
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
    f(view.slice()?.f32()?, view.head)
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
    fn slices(views: &[Self]) -> candle_core::Result<Vec<(Stored<'_>, usize)>> {
        views.iter().map(|v| Ok((v.slice()?, v.head))).collect()
    }

    fn slice(&self) -> candle_core::Result<Stored<'_>> {
        let range = self.start..self.start + self.len;
        let outside = || candle_core::Error::Msg("attend_few: view outside its storage".into());
        match &*self.storage {
            Storage::Cpu(CpuStorage::F32(data)) => {
                data.get(range).map(Stored::F32).ok_or_else(outside)
            }
            Storage::Cpu(CpuStorage::F16(data)) => {
                data.get(range).map(Stored::F16).ok_or_else(outside)
            }
            _ => candle_core::bail!("attend_few: f32 or f16 CPU tensors expected"),
        }
    }
}

/// [`query_row`] for the rows `qs` of heads that share `keys` and `values`, into `outs`;
/// `probs` has room for each head's scores. Each head's result is exactly [`query_row`]'s:
/// the AVX-512 kernels take the heads in turn over each block of keys (still in L1 for the
/// next head) and values, in the same order of sums as for one head.
fn query_rows<T: Element>(
    qs: &[&[f32]],
    keys: &[T],
    values: &[T],
    probs: &mut [f32],
    outs: &mut [&mut [f32]],
) {
    let Some(d) = qs.first().map(|q| q.len()) else {
        return;
    };
    let seen = keys.len() / d.max(1);
    #[cfg(target_arch = "x86_64")]
    if qs.len() > 1 && d == avx512::D && std::arch::is_x86_feature_detected!("avx512f") {
        let mut rows: Vec<&mut [f32]> = probs
            .chunks_exact_mut(probs.len() / qs.len())
            .map(|p| &mut p[..seen])
            .collect();
        // SAFETY: AVX-512F was just detected; every query and output row is `D` long, `keys`
        // and `values` hold `seen` rows of `D`, and every row of `rows` at least `seen`.
        unsafe {
            avx512::scores_heads(qs, keys, &mut rows);
            for p in rows.iter_mut() {
                softmax_prefix(p, seen);
            }
            avx512::weighted_values_heads(&rows, values, outs);
        }
        return;
    }
    for (q, out) in qs.iter().zip(outs.iter_mut()) {
        query_row(q, keys, values, probs, out);
    }
}

/// One query row over the keys and values it sees: `out = softmax(K q) V`, with `probs` as
/// room for the scores.
fn query_row<T: Element>(q: &[f32], keys: &[T], values: &[T], probs: &mut [f32], out: &mut [f32]) {
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
        && std::arch::is_x86_feature_detected!("f16c")
    {
        // SAFETY: the three features `avx2` needs were just detected; `q` and `out` are `D` long
        // and `keys`, `values` hold `seen` rows of `D`.
        unsafe {
            avx2::scores(q, keys, probs);
            softmax_prefix(probs, seen);
            avx2::weighted_values(probs, values, out);
        }
        return;
    }
    for (s, key) in probs.iter_mut().zip(keys.chunks_exact(q.len())) {
        *s = q.iter().zip(key).map(|(a, b)| a * b.f32()).sum();
    }
    softmax_prefix(probs, seen);
    out.fill(0.0);
    for (&p, value) in probs.iter().zip(values.chunks_exact(out.len())) {
        for (o, &v) in out.iter_mut().zip(value) {
            *o += p * v.f32();
        }
    }
}

/// The head size of SmolLM2 and most small llamas, written out for AVX2: a query row, or an
/// output row, is eight registers.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::Element;

    pub(super) const D: usize = 64;

    /// Eight elements from `p`, widened.
    ///
    /// # Safety
    /// AVX2 and F16C; eight elements at `p`.
    #[inline(always)]
    unsafe fn load<T: Element>(p: *const T) -> __m256 {
        // SAFETY: as the caller guarantees.
        unsafe {
            if T::F16 {
                _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
            } else {
                _mm256_loadu_ps(p.cast())
            }
        }
    }

    /// `scores[j] = q . k_j` for the `scores.len()` rows of `keys`.
    ///
    /// # Safety
    /// AVX2, FMA and F16C; `q` is `D` long, `keys` at least `scores.len() * D`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn scores<T: Element>(q: &[f32], keys: &[T], scores: &mut [f32]) {
        debug_assert!(q.len() == D && keys.len() >= scores.len() * D);
        // SAFETY: as the caller guarantees, every load is inside `q` or key row `j`.
        unsafe {
            let qv: [__m256; 8] = std::array::from_fn(|c| _mm256_loadu_ps(q.as_ptr().add(8 * c)));
            for (j, s) in scores.iter_mut().enumerate() {
                let k = keys.as_ptr().add(j * D);
                let mut a = _mm256_mul_ps(qv[0], load(k));
                let mut b = _mm256_mul_ps(qv[1], load(k.add(8)));
                for c in (2..8).step_by(2) {
                    a = _mm256_fmadd_ps(qv[c], load(k.add(8 * c)), a);
                    b = _mm256_fmadd_ps(qv[c + 1], load(k.add(8 * c + 8)), b);
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
    /// AVX2, FMA and F16C; `out` is `D` long, `values` at least `probs.len() * D`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn weighted_values<T: Element>(probs: &[f32], values: &[T], out: &mut [f32]) {
        debug_assert!(out.len() == D && values.len() >= probs.len() * D);
        // SAFETY: as the caller guarantees, every access is inside value row `j` or `out`.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); 8];
            for (j, &p) in probs.iter().enumerate() {
                let v = values.as_ptr().add(j * D);
                let pv = _mm256_set1_ps(p);
                for (c, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(pv, load(v.add(8 * c)), *a);
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

    use super::Element;

    pub(super) const D: usize = 64;

    /// Sixteen elements from `p`, widened.
    ///
    /// # Safety
    /// AVX-512F; sixteen elements at `p`.
    #[inline(always)]
    unsafe fn load<T: Element>(p: *const T) -> __m512 {
        // SAFETY: as the caller guarantees.
        unsafe {
            if T::F16 {
                _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
            } else {
                _mm512_loadu_ps(p.cast())
            }
        }
    }

    /// Key `j`'s products with `q`, summed down to one register of 16 partial sums.
    ///
    /// # Safety
    /// AVX-512F; `k` points at `D` values.
    #[inline(always)]
    unsafe fn partial<T: Element>(q: &[__m512; 4], k: *const T) -> __m512 {
        // SAFETY: as the caller guarantees.
        unsafe {
            let a = _mm512_mul_ps(q[0], load(k));
            let a = _mm512_fmadd_ps(q[1], load(k.add(16)), a);
            let a = _mm512_fmadd_ps(q[2], load(k.add(32)), a);
            _mm512_fmadd_ps(q[3], load(k.add(48)), a)
        }
    }

    /// `scores[j] = q . k_j` for the `scores.len()` rows of `keys`, sixteen keys at a time.
    ///
    /// # Safety
    /// AVX-512F; `q` is `D` long, `keys` at least `scores.len() * D`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scores<T: Element>(q: &[f32], keys: &[T], scores: &mut [f32]) {
        // SAFETY: as the caller guarantees.
        unsafe { scores_heads(&[q], keys, &mut [scores]) }
    }

    /// [`scores`] of each query of `qs` into the row of `scores` of the same index, the first
    /// `n` of each (`n` the first row's length), over each block of sixteen keys in turn.
    ///
    /// # Safety
    /// AVX-512F; each query is `D` long, each row of `scores` at least `n` long and `keys`
    /// at least `n * D`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scores_heads<T: Element>(
        qs: &[&[f32]],
        keys: &[T],
        scores: &mut [&mut [f32]],
    ) {
        let n = scores.first().map_or(0, |s| s.len());
        debug_assert!(qs.len() == scores.len() && keys.len() >= n * D);
        debug_assert!(qs.iter().all(|q| q.len() == D) && scores.iter().all(|s| s.len() >= n));
        // Adjacent lanes' pairs: lanes 0-7 from the first register, 8-15 from the second.
        let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
        // SAFETY: as the caller guarantees, every load is inside a query or key row `j < n`;
        // the stores write lanes of each row of `scores` below `n` (masked at the end).
        unsafe {
            for b in 0..n.div_ceil(16) {
                let len = (n - 16 * b).min(16);
                for (q, out) in qs.iter().zip(scores.iter_mut()) {
                    let qv: [__m512; 4] =
                        std::array::from_fn(|c| _mm512_loadu_ps(q.as_ptr().add(16 * c)));
                    // Sixteen registers of one key's partial sums each, then halved four
                    // times: each step sums adjacent lanes of two registers into one, keys in
                    // order.
                    let mut v: [__m512; 16] = std::array::from_fn(|i| {
                        if i < len {
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
                    let mask = ((1u32 << len) - 1) as __mmask16;
                    _mm512_mask_storeu_ps(out.as_mut_ptr().add(16 * b), mask, v[0]);
                }
            }
        }
    }

    /// `out = sum_j p_j v_j` over the `probs.len()` rows of `values`.
    ///
    /// # Safety
    /// AVX-512F; `out` is `D` long, `values` at least `probs.len() * D`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn weighted_values<T: Element>(probs: &[f32], values: &[T], out: &mut [f32]) {
        // SAFETY: as the caller guarantees.
        unsafe { weighted_values_heads(&[probs], values, &mut [out]) }
    }

    /// [`weighted_values`] for each row of `probs` (its first `n`, the first row's length, all
    /// rows at least that long) into the row of `outs` of the same index: up to four heads'
    /// sums at a time, each value row loaded once for them.
    ///
    /// # Safety
    /// AVX-512F; each row of `outs` is `D` long, `values` at least `n * D`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn weighted_values_heads<T: Element, P: AsRef<[f32]>>(
        probs: &[P],
        values: &[T],
        outs: &mut [&mut [f32]],
    ) {
        let n = probs.first().map_or(0, |p| p.as_ref().len());
        debug_assert!(probs.len() == outs.len() && values.len() >= n * D);
        debug_assert!(outs.iter().all(|o| o.len() == D));
        for (ps, os) in probs.chunks(4).zip(outs.chunks_mut(4)) {
            let ps: [&[f32]; 4] =
                std::array::from_fn(|h| ps.get(h).map_or(&[][..], |p| &p.as_ref()[..n]));
            // SAFETY: as the caller guarantees.
            unsafe {
                match os.len() {
                    1 => weighted_values_of::<T, 1>(&ps, n, values, os),
                    2 => weighted_values_of::<T, 2>(&ps, n, values, os),
                    3 => weighted_values_of::<T, 3>(&ps, n, values, os),
                    _ => weighted_values_of::<T, 4>(&ps, n, values, os),
                }
            }
        }
    }

    /// [`weighted_values_heads`] for `H` heads, their accumulators in registers.
    ///
    /// # Safety
    /// AVX-512F; `probs[..H]` at least `n` long, `outs` `H` rows of `D`, `values` `n * D`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn weighted_values_of<T: Element, const H: usize>(
        probs: &[&[f32]; 4],
        n: usize,
        values: &[T],
        outs: &mut [&mut [f32]],
    ) {
        debug_assert!(outs.len() == H && probs[..H].iter().all(|p| p.len() >= n));
        // SAFETY: as the caller guarantees, every access is inside value row `j < n`, a row of
        // `probs` or of `outs`.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); 4]; H];
            for j in 0..n {
                let v = values.as_ptr().add(j * D);
                let row: [__m512; 4] = std::array::from_fn(|c| load(v.add(16 * c)));
                for (h, a) in acc.iter_mut().enumerate() {
                    let pv = _mm512_set1_ps(*probs[h].get_unchecked(j));
                    for (c, a) in a.iter_mut().enumerate() {
                        *a = _mm512_fmadd_ps(pv, row[c], *a);
                    }
                }
            }
            for (a, out) in acc.iter().zip(outs.iter_mut()) {
                for (c, a) in a.iter().enumerate() {
                    _mm512_storeu_ps(out.as_mut_ptr().add(16 * c), *a);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX-512 kernels against plain sums: scores over key counts around whole blocks of
    /// sixteen, and the weighted values, with keys in f32 and in f16.
    #[cfg(target_arch = "x86_64")]
    #[test]
    #[ignore = "needs a CPU with AVX-512F; `make test` runs it where the CPU has AVX-512F (`make test-avx512f`)"]
    fn avx512_kernels_match_plain_sums_on_avx512f() {
        assert!(
            std::arch::is_x86_feature_detected!("avx512f"),
            "this test needs a CPU with AVX-512F"
        );
        each_case(Kernel::Avx512);
    }

    /// The AVX2 kernels against plain sums, on the same cases.
    #[cfg(target_arch = "x86_64")]
    #[test]
    #[ignore = "needs a CPU with AVX2, FMA and F16C; `make test` runs it where the CPU has them (`make test-avx2`)"]
    fn avx2_kernels_match_plain_sums_on_avx2() {
        use std::arch::is_x86_feature_detected as has;
        assert!(
            has!("avx2") && has!("fma") && has!("f16c"),
            "this test needs a CPU with AVX2, FMA and F16C"
        );
        each_case(Kernel::Avx2);
    }

    #[cfg(target_arch = "x86_64")]
    #[derive(Clone, Copy, Debug)]
    enum Kernel {
        Avx512,
        Avx2,
    }

    /// `kernel` over key counts around whole blocks of sixteen, keys in f32 and in f16.
    #[cfg(target_arch = "x86_64")]
    fn each_case(kernel: Kernel) {
        let d = avx512::D;
        let value = |i: usize| ((i * 7919 % 1013) as f32 - 506.0) / 300.0;
        let q: Vec<f32> = (0..d).map(|i| value(i + 5)).collect();
        for n in [1, 15, 16, 17, 40, 64] {
            let keys: Vec<f32> = (0..n * d).map(|i| value(3 * i + 1)).collect();
            let probs: Vec<f32> = (0..n).map(|j| value(j + 11).abs() / 2.0).collect();
            let keys16: Vec<half::f16> = keys.iter().map(|&x| half::f16::from_f32(x)).collect();
            check(kernel, &q, &keys, &probs, "f32");
            // Keys held in f16: the same sums over the values f16 holds.
            check(kernel, &q, &keys16, &probs, "f16");
        }
    }

    /// `kernel` on `keys` (also the values) against plain sums over their values widened to
    /// f32. The caller has checked that the CPU has the kernel's features.
    #[cfg(target_arch = "x86_64")]
    fn check<T: Element>(kernel: Kernel, q: &[f32], keys: &[T], probs: &[f32], dtype: &str) {
        let (d, n) = (q.len(), probs.len());
        let widened: Vec<f32> = keys.iter().map(|k| k.f32()).collect();
        let plain_scores: Vec<f32> = widened
            .chunks_exact(d)
            .map(|k| k.iter().zip(q).map(|(a, b)| a * b).sum())
            .collect();
        let mut plain_out = vec![0f32; d];
        for (p, v) in probs.iter().zip(widened.chunks_exact(d)) {
            for (o, x) in plain_out.iter_mut().zip(v) {
                *o += p * x;
            }
        }
        let close = |a: &[f32], b: &[f32], what: &str| {
            for (x, y) in a.iter().zip(b) {
                assert!(
                    (x - y).abs() <= 1e-4 * y.abs().max(1.0),
                    "{kernel:?} {what} ({dtype}), {n} keys: {x} {y}"
                );
            }
        };
        let (mut scores, mut out) = (vec![0f32; n], vec![0f32; d]);
        match kernel {
            // SAFETY: the caller checked AVX-512F; the lengths are as the kernels require.
            Kernel::Avx512 => unsafe {
                avx512::scores(q, keys, &mut scores);
                avx512::weighted_values(probs, keys, &mut out);
            },
            // SAFETY: the caller checked AVX2, FMA and F16C; the lengths are as the kernels
            // require.
            Kernel::Avx2 => unsafe {
                avx2::scores(q, keys, &mut scores);
                avx2::weighted_values(probs, keys, &mut out);
            },
        }
        close(&scores, &plain_scores, "scores");
        close(&out, &plain_out, "values");
    }

    /// The heads of a KV head taken together give each head exactly what it gets alone, for
    /// head counts below, at and above the four the value kernel takes at a time. (Without
    /// AVX-512 both sides take the one-head path, and there is nothing to compare.)
    #[test]
    #[ignore = "needs a CPU with AVX-512F; `make test` runs it where the CPU has AVX-512F (`make test-avx512f`)"]
    fn heads_together_equal_each_head_alone_on_avx512f() {
        #[cfg(target_arch = "x86_64")]
        let avx512 = std::arch::is_x86_feature_detected!("avx512f");
        #[cfg(not(target_arch = "x86_64"))]
        let avx512 = false;
        assert!(
            avx512,
            "this test needs a CPU with AVX-512F (the heads kernel's)"
        );
        let d = 64;
        let value = |i: usize| ((i * 7919 % 1013) as f32 - 506.0) / 300.0;
        for heads in [2, 3, 4, 5] {
            for n in [1, 16, 17, 50] {
                let keys: Vec<f32> = (0..n * d).map(|i| value(3 * i + 1)).collect();
                let values: Vec<f32> = (0..n * d).map(|i| value(5 * i + 2) / 2.0).collect();
                let qs: Vec<Vec<f32>> = (0..heads)
                    .map(|h| (0..d).map(|i| value(i + 97 * h) / 8.0).collect())
                    .collect();
                let q: Vec<&[f32]> = qs.iter().map(|q| q.as_slice()).collect();
                let mut probs = vec![0f32; heads * (n + 3)];
                let mut together = vec![vec![0f32; d]; heads];
                let mut outs: Vec<&mut [f32]> =
                    together.iter_mut().map(|o| o.as_mut_slice()).collect();
                query_rows(&q, &keys, &values, &mut probs, &mut outs);
                for (h, got) in together.iter().enumerate() {
                    let mut alone = vec![0f32; d];
                    query_row(&qs[h], &keys, &values, &mut vec![0f32; n], &mut alone);
                    assert_eq!(got, &alone, "{heads} heads, {n} keys, head {h}");
                }
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
        // Different cache lengths, query rows and head counts; one cache a view with spare room;
        // enough KV heads for a task per KV head on a few threads.
        let mut owned = Vec::new();
        let many = (0..8).map(|i| (9, 3, 1 + i % 2, 7 * i, 64));
        let shapes = [(9, 3, 1, 40, 64), (4, 2, 3, 5, 64), (2, 1, 1, 0, 24)];
        for (n_h, n_kv, t, past, d) in shapes.into_iter().chain(many) {
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

    /// A batched step's queries are views of one tensor of all its rows (a sequence's rows of
    /// each head, the heads the whole batch's rows apart): they give what copies of them give.
    #[test]
    fn queries_viewed_in_the_batch_tensor_give_what_copies_give() -> candle_core::Result<()> {
        let (n_h, n_kv, d) = (9, 3, 64);
        let rows = [1, 2, 1, 1, 3];
        let total: usize = rows.iter().sum();
        let q_all = Tensor::randn(0f32, 0.3, (n_h, total, d), &Device::Cpu)?;
        let mut caches = Vec::new();
        for (i, &t) in rows.iter().enumerate() {
            let past = 5 * i + 3;
            let k = Tensor::randn(0f32, 1.0, (n_kv, past + t, d), &Device::Cpu)?;
            let v = Tensor::randn(0f32, 1.0, (n_kv, past + t, d), &Device::Cpu)?;
            caches.push((k, v, past));
        }
        let mut at = 0;
        let (mut views, mut copies) = (Vec::new(), Vec::new());
        for &t in &rows {
            let view = q_all.narrow(1, at, t)?;
            copies.push(view.contiguous()?);
            views.push(view);
            at += t;
        }
        let run = |qs: &[Tensor]| {
            let few: Vec<_> = qs
                .iter()
                .zip(&caches)
                .map(|(q, (k, v, past))| FewQueries {
                    q,
                    k,
                    v,
                    past: *past,
                })
                .collect();
            attend_few_many(&few)
        };
        for (a, b) in run(&views)?.iter().zip(&run(&copies)?) {
            assert_eq!(
                a.flatten_all()?.to_vec1::<f32>()?,
                b.flatten_all()?.to_vec1::<f32>()?
            );
        }
        Ok(())
    }

    /// Keys and values held in f16 (a narrow decode's cache) give, bit for bit, what f32
    /// tensors holding the same values give: the kernels widen each element exactly and sum
    /// in the same order. One sequence alone (a task per query head) and eight together (a
    /// task per KV head), over key counts around the blocks of sixteen.
    #[test]
    fn f16_caches_attend_as_f32_caches_of_the_same_values() -> candle_core::Result<()> {
        use candle_core::DType;
        for seqs in [1, 8] {
            let mut f16s = Vec::new();
            let mut f32s = Vec::new();
            for i in 0..seqs {
                let (n_h, n_kv, d, past) = (9, 3, 64, [15, 16, 17, 40, 0, 3, 33, 64][i]);
                let t = 1 + i % 2;
                // A buffer with spare rows, as the cache keeps it, viewed up to its length.
                let buf = Tensor::randn(0f32, 2.0, (n_kv, past + t + 5, d), &Device::Cpu)?
                    .to_dtype(DType::F16)?;
                let vbuf = Tensor::randn(0f32, 1.0, (n_kv, past + t + 5, d), &Device::Cpu)?
                    .to_dtype(DType::F16)?;
                let (k, v) = (buf.narrow(1, 0, past + t)?, vbuf.narrow(1, 0, past + t)?);
                let q = Tensor::randn(0f32, 0.3, (n_h, t, d), &Device::Cpu)?;
                f32s.push((
                    q.clone(),
                    k.to_dtype(DType::F32)?,
                    v.to_dtype(DType::F32)?,
                    past,
                ));
                f16s.push((q, k, v, past));
            }
            let run = |all: &[(Tensor, Tensor, Tensor, usize)]| {
                let few: Vec<_> = all
                    .iter()
                    .map(|(q, k, v, past)| FewQueries {
                        q,
                        k,
                        v,
                        past: *past,
                    })
                    .collect();
                attend_few_many(&few)
            };
            for (half, full) in run(&f16s)?.iter().zip(&run(&f32s)?) {
                assert_eq!(
                    half.flatten_all()?.to_vec1::<f32>()?,
                    full.flatten_all()?.to_vec1::<f32>()?,
                    "{seqs} sequences"
                );
            }
        }
        // Keys in f16 and values in f32 are not one cache.
        let (q, k, v, past) = (
            Tensor::zeros((2, 1, 64), DType::F32, &Device::Cpu)?,
            Tensor::zeros((1, 4, 64), DType::F16, &Device::Cpu)?,
            Tensor::zeros((1, 4, 64), DType::F32, &Device::Cpu)?,
            3,
        );
        assert!(attend_few(&q, &k, &v, past).is_err());
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
