//! `x W^T` for many rows on AMX tiles: bf16 products, f32 sums.
//!
//! Sapphire Rapids and later Xeons multiply 16 x 32 by 32 x 16 bf16 tiles into 16 x 16 f32
//! accumulators in one instruction (`tdpbf16ps`), some 30 times what AVX-512 FMA does per core.
//! A prefill's projections are that shape: many rows of `x` times a weight. Each parallel task
//! takes 32 outputs (two B tiles wide), converts those weight rows to bf16 in the tile layout
//! into a buffer that stays in L1 (so the weight is read once per call, as gemm's packing reads
//! it, and no second copy of the model is kept), then walks all rows of `x` 32 at a time: two A
//! tiles, two B tiles, four accumulators per step of 32 along `in`.
//!
//! `x` is rounded to bf16 once per call, the weights per task; sums are f32 (what llama.cpp's
//! and oneDNN's bf16 paths do). Rows and outputs that do not fill a tile are zero-padded.
//!
//! The kernel needs the CPU's AMX-TILE and AMX-BF16 and the kernel's permission to use the
//! tile data (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`; without it the first tile
//! instruction faults). [`available`] checks both once per process. The instructions are
//! written with `asm!` because Rust's AMX intrinsics and feature detection are not stable.

use rayon::prelude::*;

/// Rows (and outputs) of one tile.
const TILE: usize = 16;
/// Inputs of one A tile row: 64 bytes of bf16.
const DEPTH: usize = 32;
/// Rows of `x` (and outputs) per step: two tiles each way.
const STEP: usize = 2 * TILE;

/// Whether this CPU and kernel let this process run the tile kernel (checked once).
pub(crate) fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(detect)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect() -> bool {
    // CPUID leaf 7: EDX bit 24 AMX-TILE, bit 22 AMX-BF16; EBX bit 16 AVX-512F; sub-leaf 1
    // EAX bit 5 AVX512_BF16 (the conversion of inputs to bf16).
    let max = std::arch::x86_64::__cpuid(0).eax;
    if max < 7 {
        return false;
    }
    let l7 = std::arch::x86_64::__cpuid_count(7, 0);
    let l7s1 = std::arch::x86_64::__cpuid_count(7, 1);
    let cpu = l7.edx >> 24 & 1 == 1
        && l7.edx >> 22 & 1 == 1
        && l7.ebx >> 16 & 1 == 1
        && l7s1.eax >> 5 & 1 == 1;
    cpu && request_tile_permission()
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn detect() -> bool {
    false
}

/// Asks Linux for the AMX tile-data state for this process (all its threads); true when given.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_tile_permission() -> bool {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: arch_prctl with ARCH_REQ_XCOMP_PERM only changes which XSAVE features the kernel
    // lets this process use; it reads no memory of ours. `syscall` clobbers rcx and r11.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret == 0
}

/// Outputs per parallel task: a block of the packed weight (`k` x 256 bf16, 295 KB for
/// SmolLM2's 576 inputs) that stays in L2 while the task's 32-row blocks of `x` pass by it.
const TASK_OUTPUTS: usize = 256;
/// The most rows of `x` per parallel task, so that a projection with few outputs still splits
/// evenly.
const TASK_ROWS: usize = 256;
/// Tasks a product is split into at least, where it has the rows for it.
const MIN_TASKS: usize = 8;

/// A weight `(n, k)` in bf16 tiles: for each 16 outputs, one B tile per 32 inputs.
pub(crate) struct TileWeight {
    /// Tile column `c` (outputs `16c..16c + 16`) holds `k_pad / 32` tiles of 512 values: row
    /// `i` of tile `s` is `(w[16c + j][32s + 2i], w[16c + j][32s + 2i + 1])` for `j = 0..16`,
    /// the pairs `tdpbf16ps` multiplies with an A row's elements `2i` and `2i + 1`. Outputs
    /// past `n` and inputs past `k` are zero.
    data: Vec<u16>,
    n: usize,
    k: usize,
    n_pad: usize,
    k_pad: usize,
}

impl TileWeight {
    /// No weight yet: a buffer for [`Self::repack`].
    pub(crate) fn empty() -> Self {
        Self {
            data: Vec::new(),
            n: 0,
            k: 0,
            n_pad: 0,
            k_pad: 0,
        }
    }

    /// Packs `w` `(n, k)` into this buffer, reusing its memory (a fresh buffer's first touch
    /// costs a page fault per 4 KB, more than the packing).
    pub(crate) fn repack(&mut self, w: &[f32], n: usize, k: usize) {
        debug_assert_eq!(w.len(), n * k);
        let k_pad = self.reset(n, k);
        self.data
            .par_chunks_mut(TILE * k_pad)
            .enumerate()
            .for_each(|(c, col)| {
                let r0 = c * TILE;
                if r0 + TILE <= n && k.is_multiple_of(2) {
                    pack_full_column(&w[r0 * k..(r0 + TILE) * k], k, col);
                    // Pair p takes `col[32 p..32 p + 32]`: the padding depth after pair k / 2.
                    col[TILE * k..].fill(0);
                    return;
                }
                // Padding outputs (and an odd depth's last partner) must be zero; the rows
                // below overwrite the rest.
                col.fill(0);
                for j in 0..TILE.min(n.saturating_sub(r0)) {
                    let src = &w[(r0 + j) * k..(r0 + j + 1) * k];
                    // Pair p = 16s + i of the row goes to tile s, row i, slot j.
                    for (p, pair) in src.chunks(2).enumerate() {
                        let at = (p * TILE + j) * 2;
                        col[at] = bf16_bits(pair[0]);
                        col[at + 1] = pair.get(1).map_or(0, |&v| bf16_bits(v));
                    }
                }
            });
    }

    /// Sizes the buffer for `(n, k)` and records the shape; returns the padded depth. The
    /// buffer keeps what an earlier call left: each packing task writes all of its tile
    /// column, padding zeros included (clearing the whole buffer per call, for a chunk of
    /// attention's keys, cost more than packing it).
    fn reset(&mut self, n: usize, k: usize) -> usize {
        let k_pad = k.div_ceil(DEPTH) * DEPTH;
        let n_pad = n.div_ceil(STEP) * STEP;
        self.data.resize(n_pad * k_pad, 0);
        (self.n, self.k, self.n_pad, self.k_pad) = (n, k, n_pad, k_pad);
        k_pad
    }

    /// The depth rounded up to whole tiles: the row length of the bf16 `x` that
    /// [`linear_padded_bf16`] multiplies by this weight.
    pub(crate) fn padded_depth(&self) -> usize {
        self.k_pad
    }

    /// The weight's inputs (its depth before padding) and outputs.
    pub(crate) fn shape(&self) -> (usize, usize) {
        (self.k, self.n)
    }

    /// Packs `W = V^T` for `v` `(k, n)` row-major f32: outputs are `v`'s columns, the depth
    /// its rows (attention's values, multiplied by the probabilities over the keys).
    pub(crate) fn repack_transposed(&mut self, v: &[f32], k: usize, n: usize) {
        debug_assert_eq!(v.len(), k * n);
        let k_pad = self.reset(n, k);
        self.data
            .par_chunks_mut(TILE * k_pad)
            .enumerate()
            .for_each(|(c, col)| {
                let c0 = c * TILE;
                if c0 + TILE > n {
                    // Padding outputs must be zero; the columns below overwrite the rest.
                    col.fill(0);
                }
                if c0 >= n {
                    return;
                }
                // Pair p (depth 2p, 2p + 1) of output j goes to tile p / 16, row p % 16, slot j.
                let pairs = k / 2;
                // The padding depth, after the last pair with a value (`col[32 p..]` is pair p).
                col[2 * TILE * k.div_ceil(2)..].fill(0);
                if c0 + TILE <= n {
                    // SAFETY: `available()` (which the tile path requires) checked AVX-512BW
                    // and AVX512_BF16; the 16 columns from `c0` exist in every row.
                    unsafe { pack_transposed_pairs(v, n, c0, pairs, col) };
                } else {
                    for p in 0..pairs {
                        for j in 0..n - c0 {
                            let at = (p * TILE + j) * 2;
                            col[at] = bf16_bits(v[2 * p * n + c0 + j]);
                            col[at + 1] = bf16_bits(v[(2 * p + 1) * n + c0 + j]);
                        }
                    }
                }
                if k % 2 == 1 {
                    // The last depth row pairs with a zero.
                    let p = k / 2;
                    for j in 0..TILE.min(n - c0) {
                        col[(p * TILE + j) * 2] = bf16_bits(v[(k - 1) * n + c0 + j]);
                        col[(p * TILE + j) * 2 + 1] = 0;
                    }
                }
            });
    }
}

/// Pairs `0..pairs` of 16 whole columns from `c0` of `v` (rows of `n`): one tile row per pair,
/// the two depth rows' 16 values converted in one instruction and interleaved in another.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
fn pack_transposed_pairs(v: &[f32], n: usize, c0: usize, pairs: usize, col: &mut [u16]) {
    use std::arch::x86_64::*;
    // Output lane 2j takes element j of the first row (lanes 0..16 of the conversion), lane
    // 2j + 1 element j of the second (lanes 16..32).
    let index: [u16; 32] = std::array::from_fn(|l| (l / 2 + l % 2 * 16) as u16);
    // SAFETY: `index` is 64 bytes.
    let index = unsafe { _mm512_loadu_si512(index.as_ptr().cast()) };
    for p in 0..pairs {
        let r0 = &v[2 * p * n + c0..][..TILE];
        let r1 = &v[(2 * p + 1) * n + c0..][..TILE];
        let out = &mut col[p * 2 * TILE..][..2 * TILE];
        // SAFETY: `r0`, `r1` hold 16 f32 each; `out` 32 u16 (64 bytes).
        unsafe {
            let bf =
                _mm512_cvtne2ps_pbh(_mm512_loadu_ps(r1.as_ptr()), _mm512_loadu_ps(r0.as_ptr()));
            let mixed =
                _mm512_permutexvar_epi16(index, std::mem::transmute::<__m512bh, __m512i>(bf));
            _mm512_storeu_si512(out.as_mut_ptr().cast(), mixed);
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn pack_transposed_pairs(_: &[f32], _: usize, _: usize, _: usize, _: &mut [u16]) {
    unreachable!("AMX is x86-64 only; available() is false elsewhere")
}

/// One tile column of 16 whole weight rows `w` `(16, k)`, `k` even: pair `p` of row `j` at
/// `col[2 (16 p + j)..]`.
fn pack_full_column(w: &[f32], k: usize, col: &mut [u16]) {
    let whole = k / DEPTH * DEPTH;
    // SAFETY: `available()` (which the tile path requires) checked AVX-512F and AVX512_BF16.
    unsafe { pack_full_column_avx512(w, k, whole, col) };
    for p in whole / 2..k / 2 {
        for j in 0..TILE {
            let at = (p * TILE + j) * 2;
            col[at] = bf16_bits(w[j * k + 2 * p]);
            col[at + 1] = bf16_bits(w[j * k + 2 * p + 1]);
        }
    }
}

/// [`pack_full_column`] for inputs `0..whole` (a multiple of 32): each row's 32 values become
/// 16 bf16 pairs in one instruction, and the 16 x 16 pairs are transposed through a buffer.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
fn pack_full_column_avx512(w: &[f32], k: usize, whole: usize, col: &mut [u16]) {
    use std::arch::x86_64::*;
    let mut pairs = [[0u32; TILE]; TILE];
    for s in 0..whole / DEPTH {
        for (j, dst) in pairs.iter_mut().enumerate() {
            let src = &w[j * k + s * DEPTH..j * k + (s + 1) * DEPTH];
            // SAFETY: `src` holds 32 f32, `dst` 16 u32 (64 bytes each way).
            unsafe {
                let lo = _mm512_loadu_ps(src.as_ptr());
                let hi = _mm512_loadu_ps(src.as_ptr().add(16));
                let bf = _mm512_cvtne2ps_pbh(hi, lo);
                _mm512_storeu_si512(
                    dst.as_mut_ptr().cast(),
                    std::mem::transmute::<__m512bh, __m512i>(bf),
                );
            }
        }
        let tile = &mut col[s * TILE * DEPTH..(s + 1) * TILE * DEPTH];
        for (i, out) in tile.chunks_exact_mut(2 * TILE).enumerate() {
            for (j, row) in pairs.iter().enumerate() {
                out[2 * j] = row[i] as u16;
                out[2 * j + 1] = (row[i] >> 16) as u16;
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn pack_full_column_avx512(_: &[f32], _: usize, _: usize, _: &mut [u16]) {
    unreachable!("AMX is x86-64 only; available() is false elsewhere")
}

/// `y = x W^T` for `x` `(rows, k)` row-major f32 and a packed `W` `(n, k)`; `y` `(rows, n)`.
/// `a` is scratch for `x` in bf16, reused across calls like the packed weight.
///
/// Callers check [`available`] first.
pub(crate) fn linear(x: &[f32], rows: usize, w: &TileWeight, a: &mut Vec<u16>) -> Vec<f32> {
    let mut y = Vec::new();
    let n_pad = linear_padded((x, w.k), rows, w, a, &mut y);
    unpadded(y, rows, n_pad, w.n)
}

/// The first `rows` rows of `n` of `y`, whose rows are `n_pad` long (a padded product).
pub(crate) fn unpadded(mut y: Vec<f32>, rows: usize, n_pad: usize, n: usize) -> Vec<f32> {
    if n_pad == n {
        y.truncate(rows * n);
        return y;
    }
    let mut exact = Vec::with_capacity(rows * n);
    for r in y.chunks_exact(n_pad).take(rows) {
        exact.extend_from_slice(&r[..n]);
    }
    exact
}

/// [`linear`] for rows of `x` that lie `stride` apart (`stride >= k`), into `y` (its memory
/// reused) as `rows` rounded up to 32 rows of `n` rounded up to 32: returns that row length.
/// Padding rows and columns hold zeros' products (zero).
pub(crate) fn linear_padded(
    (x, stride): (&[f32], usize),
    rows: usize,
    w: &TileWeight,
    a: &mut Vec<u16>,
    y: &mut Vec<f32>,
) -> usize {
    let (k, k_pad) = (w.k, w.k_pad);
    debug_assert!(stride >= k && x.len() >= (rows.max(1) - 1) * stride + k);
    let rows_pad = padded_rows(rows);
    to_bf16_rows((x, stride), rows, k, (rows_pad, k_pad), a);
    linear_padded_bf16(a, rows_pad, w, y)
}

/// `rows` rounded up to the rows of whole steps: the rows [`linear_padded_bf16`] takes.
pub(crate) fn padded_rows(rows: usize) -> usize {
    rows.div_ceil(STEP) * STEP
}

/// [`linear_padded`] for `x` already in bf16: `a` holds `rows_pad` rows (from
/// [`padded_rows`]) of `w`'s [`TileWeight::padded_depth`], zeros in the padding rows and
/// columns. Returns the row length of `y`, `n` rounded up to 32.
pub(crate) fn linear_padded_bf16(
    a: &[u16],
    rows_pad: usize,
    w: &TileWeight,
    y: &mut Vec<f32>,
) -> usize {
    debug_assert!(available());
    let (n_pad, k_pad) = (w.n_pad, w.k_pad);
    // The tile loads below read whole steps of `a`.
    assert!(rows_pad.is_multiple_of(STEP) && a.len() >= rows_pad * k_pad);
    // Not zeroed: the tasks store every element (whole 32 x 32 blocks cover `rows_pad x
    // n_pad`), and zeroing a large buffer costs as much as a small product.
    y.clear();
    y.reserve(rows_pad * n_pad);
    let out = SharedOut(y.as_mut_ptr());
    let col_tiles = TILE * k_pad;
    let col_tasks = n_pad.div_ceil(TASK_OUTPUTS);
    // Narrow products (attention's values: 64 outputs) split their rows finer, so that every
    // core gets work.
    let task_rows = rows_pad
        .div_ceil(MIN_TASKS.div_ceil(col_tasks))
        .next_multiple_of(STEP)
        .clamp(STEP, TASK_ROWS);
    let row_tasks = rows_pad.div_ceil(task_rows);
    (0..row_tasks * col_tasks).into_par_iter().for_each(|task| {
        let (m0, n0) = (
            task / col_tasks * task_rows,
            task % col_tasks * TASK_OUTPUTS,
        );
        let m1 = (m0 + task_rows).min(rows_pad);
        let n1 = (n0 + TASK_OUTPUTS).min(n_pad);
        let a = &a[m0 * k_pad..m1 * k_pad];
        let b = &w.data[n0 * k_pad..n1 * k_pad];
        // SAFETY: `available()` holds (the callers' contract); `a` has `m1 - m0` rows (a
        // multiple of 32) of `k_pad`; `b` holds tile columns `n0 / 16..n1 / 16`, an even
        // number; this task writes only rows `m0..m1`, columns `n0..n1` of `y` (`rows_pad`
        // rows of `n_pad`, reserved above), which no other task writes.
        unsafe {
            block(
                a,
                m1 - m0,
                k_pad,
                b,
                col_tiles,
                out.at(m0 * n_pad + n0),
                n_pad,
            )
        };
    });
    // SAFETY: the tasks above stored all `rows_pad * n_pad` elements (see the reservation).
    unsafe { y.set_len(rows_pad * n_pad) };
    n_pad
}

/// Buffers a thread reuses from call to call: the packed weight and `x` in bf16 (a fresh
/// buffer's first touch costs a page fault per 4 KB, and zeroing one as much as a small
/// product).
pub(crate) struct Scratch {
    pub(crate) weight: TileWeight,
    pub(crate) a: Vec<u16>,
    /// Products kept between two steps (attention's scores).
    pub(crate) y: Vec<f32>,
    /// Inputs gathered for a product (attention's stacked queries).
    pub(crate) x: Vec<f32>,
    /// A second product's bf16 input (the hidden layer of a chain of two).
    pub(crate) a2: Vec<u16>,
}

/// The largest weight (elements) whose packed copy a thread keeps between calls: every
/// projection of a small llama, not an output head.
pub(crate) const SCRATCH_WEIGHT_MAX: usize = 4 << 20;

impl Scratch {
    pub(crate) fn new() -> Self {
        Self {
            weight: TileWeight::empty(),
            a: Vec::new(),
            y: Vec::new(),
            x: Vec::new(),
            a2: Vec::new(),
        }
    }
}

/// Calls `f` with this thread's [`Scratch`]. A call made while the thread's scratch is in use
/// (a rayon task stolen by a thread waiting inside `f`) gets fresh buffers.
pub(crate) fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    use std::cell::RefCell;
    thread_local! {
        static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::new());
    }
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut scratch) => f(&mut scratch),
        Err(_) => f(&mut Scratch::new()),
    })
}

/// An output's storage, shared by the tasks that each write their own block.
#[derive(Clone, Copy)]
pub(crate) struct SharedOut(pub(crate) *mut f32);
// SAFETY: users make each task write its own elements (see `linear_padded` and
// `attend_tiles`), and the storage outlives their parallel loop.
unsafe impl Send for SharedOut {}
// SAFETY: as above.
unsafe impl Sync for SharedOut {}

impl SharedOut {
    pub(crate) fn at(self, offset: usize) -> *mut f32 {
        // SAFETY: callers pass an offset inside `y`.
        unsafe { self.0.add(offset) }
    }
}

/// Rounds f32 to bf16, to nearest even (NaN stays NaN).
#[inline(always)]
fn bf16_bits(v: f32) -> u16 {
    let b = v.to_bits();
    let rounded = ((b + 0x7fff + (b >> 16 & 1)) >> 16) as u16;
    if b & 0x7fff_ffff > 0x7f80_0000 {
        0x7fc0
    } else {
        rounded
    }
}

/// `dst[i] = bf16(src[i])` (round to nearest even). Callers check [`available`].
pub(crate) fn to_bf16(src: &[f32], dst: &mut [u16]) {
    assert_eq!(src.len(), dst.len());
    // SAFETY: `available()` (the callers' contract) checked AVX512_BF16.
    unsafe { row_to_bf16(src, dst) }
}

/// Writes `rows` rows of `width` from `x` (each `stride` apart) in bf16 into columns
/// `col..col + width` of the rows of `a`, `k_pad` apart: a product's input, or one block of
/// inputs laid side by side.
pub(crate) fn block_to_bf16(
    (x, stride): (&[f32], usize),
    (rows, width): (usize, usize),
    (a, k_pad): (&mut [u16], usize),
    col: usize,
) {
    assert!(stride >= width && col + width <= k_pad && a.len() >= rows * k_pad);
    assert!(rows == 0 || x.len() >= (rows - 1) * stride + width);
    a[..rows * k_pad]
        .par_chunks_mut(STEP * k_pad)
        .enumerate()
        .for_each(|(c, dst)| {
            for (i, d) in dst.chunks_exact_mut(k_pad).enumerate() {
                let src = &x[(c * STEP + i) * stride..][..width];
                // SAFETY: `available()` (which the tile path requires) checked AVX512_BF16.
                unsafe { row_to_bf16(src, &mut d[col..col + width]) };
            }
        });
}

/// `x`'s `rows` rows of `k` (each `stride` apart) in bf16, zero-padded to `(rows_pad, k_pad)`.
fn to_bf16_rows(
    x: (&[f32], usize),
    rows: usize,
    k: usize,
    (rows_pad, k_pad): (usize, usize),
    a: &mut Vec<u16>,
) {
    if k_pad != k {
        // The padding columns must be zero; rows are overwritten below.
        a.clear();
    }
    a.resize(rows_pad * k_pad, 0);
    // Padding rows (after a longer call) must be zero too.
    a[rows * k_pad..].fill(0);
    block_to_bf16(x, (rows, k), (a, k_pad), 0);
}

/// `dst[i] = bf16(src[i])`, 32 at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
fn row_to_bf16(src: &[f32], dst: &mut [u16]) {
    use std::arch::x86_64::*;
    let whole = src.len() / 32 * 32;
    for (s, d) in src[..whole].chunks_exact(32).zip(dst.chunks_exact_mut(32)) {
        // SAFETY: `s` holds 32 f32, `d` 32 u16 (64 bytes).
        unsafe {
            let lo = _mm512_loadu_ps(s.as_ptr());
            let hi = _mm512_loadu_ps(s.as_ptr().add(16));
            let bf = _mm512_cvtne2ps_pbh(hi, lo);
            _mm512_storeu_si512(
                d.as_mut_ptr().cast(),
                std::mem::transmute::<__m512bh, __m512i>(bf),
            );
        }
    }
    for (d, &s) in dst[whole..].iter_mut().zip(&src[whole..]) {
        *d = bf16_bits(s);
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn row_to_bf16(src: &[f32], dst: &mut [u16]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = bf16_bits(s);
    }
}

/// Tile configuration: palette 1, all eight tiles 16 rows of 64 bytes.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

const CONFIG: TileConfig = {
    let mut c = [0u8; 64];
    c[0] = 1;
    let mut t = 0;
    while t < 8 {
        c[16 + 2 * t] = 64;
        c[48 + t] = TILE as u8;
        t += 1;
    }
    TileConfig(c)
};

/// All `rows_pad` rows of `a` (bf16, rows of `k_pad`) times the tile columns in `b` (each
/// `col_tiles` values), written at `y` (row stride `y_stride` f32): for each 32 rows, every
/// pair of tile columns, so that the 32 rows' A tiles stay in L1 while `b` (in L2) passes.
///
/// # Safety
/// AMX must be [`available`]; `a` holds `rows_pad` (a multiple of 32) rows of `k_pad` (a
/// multiple of 32); `b` an even number of [`TileWeight`] tile columns for `k_pad`; `y` is
/// valid for `rows_pad` rows of stride `y_stride` and 16 columns per tile column of `b`.
#[cfg(target_arch = "x86_64")]
unsafe fn block(
    a: &[u16],
    rows_pad: usize,
    k_pad: usize,
    b: &[u16],
    col_tiles: usize,
    y: *mut f32,
    y_stride: usize,
) {
    let steps = k_pad / DEPTH;
    let a_stride = k_pad * 2;
    let y_bytes = y_stride * 4;
    // SAFETY: the caller guarantees AMX; the configuration is a valid palette-1 layout.
    unsafe { std::arch::asm!("ldtilecfg [{}]", in(reg) CONFIG.0.as_ptr(), options(nostack)) };
    for m in (0..rows_pad).step_by(STEP) {
        for (pair, cols) in b.chunks_exact(2 * col_tiles).enumerate() {
            // SAFETY: rows m..m+32 exist in `a` and `y` (rows_pad is a multiple of 32); the
            // loop reads `steps` 64-byte-row tiles from each A row block and each of the two
            // tile columns, and writes four 16 x 16 f32 tiles inside this pair's 32 columns.
            unsafe {
                let a0 = a.as_ptr().add(m * k_pad);
                let a1 = a0.add(TILE * k_pad);
                let b0 = cols.as_ptr();
                let b1 = b0.add(col_tiles);
                let c0 = y.add(m * y_stride + pair * STEP);
                let c1 = c0.add(TILE * y_stride);
                std::arch::asm!(
                    "tilezero tmm0",
                    "tilezero tmm1",
                    "tilezero tmm2",
                    "tilezero tmm3",
                    "2:",
                    "tileloadd tmm4, [{a0} + {sa}]",
                    "tileloadd tmm6, [{b0} + {sb}]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tileloadd tmm7, [{b1} + {sb}]",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tileloadd tmm5, [{a1} + {sa}]",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    "add {a0}, 64",
                    "add {a1}, 64",
                    "add {b0}, 1024",
                    "add {b1}, 1024",
                    "dec {steps}",
                    "jnz 2b",
                    "tilestored [{c0} + {sc}], tmm0",
                    "tilestored [{c0h} + {sc}], tmm1",
                    "tilestored [{c1} + {sc}], tmm2",
                    "tilestored [{c1h} + {sc}], tmm3",
                    a0 = inout(reg) a0 => _,
                    a1 = inout(reg) a1 => _,
                    b0 = inout(reg) b0 => _,
                    b1 = inout(reg) b1 => _,
                    steps = inout(reg) steps => _,
                    sa = in(reg) a_stride,
                    sb = in(reg) 64usize,
                    c0 = in(reg) c0,
                    c0h = in(reg) c0.add(TILE),
                    c1 = in(reg) c1,
                    c1h = in(reg) c1.add(TILE),
                    sc = in(reg) y_bytes,
                    options(nostack),
                );
            }
        }
    }
    // SAFETY: returns the tile state to its initial (unused) state, cheap to save on a switch.
    unsafe { std::arch::asm!("tilerelease", options(nostack)) };
}

/// FLOPs of one `tdpbf16ps` on full tiles: 16 x 16 outputs, 32 products each, a multiply and
/// an add.
pub(crate) const FLOPS_PER_PRODUCT: f64 = (TILE * TILE * DEPTH * 2) as f64;

/// Runs `products` tile products (a multiple of 4 is run) on tiles that stay in registers:
/// the peak the kernels are measured against. Does nothing where AMX is not [`available`].
pub(crate) fn register_loop(products: u64) {
    if !available() {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AMX is available; the tiles are zeroed before use and released after, and the
    // loop touches no memory.
    unsafe {
        std::arch::asm!(
            "ldtilecfg [{cfg}]",
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "tilezero tmm4",
            "tilezero tmm5",
            "2:",
            "tdpbf16ps tmm0, tmm4, tmm5",
            "tdpbf16ps tmm1, tmm4, tmm5",
            "tdpbf16ps tmm2, tmm4, tmm5",
            "tdpbf16ps tmm3, tmm4, tmm5",
            "dec {n}",
            "jnz 2b",
            "tilerelease",
            cfg = in(reg) CONFIG.0.as_ptr(),
            n = inout(reg) (products / 4).max(1) => _,
            options(nostack),
        );
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn block(_: &[u16], _: usize, _: usize, _: &[u16], _: usize, _: *mut f32, _: usize) {
    unreachable!("AMX is x86-64 only; available() is false elsewhere")
}

#[cfg(test)]
mod tests {
    use super::super::test_values as values;
    use super::*;

    fn reference(x: &[f32], rows: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
        // The same bf16 rounding of both sides, sums in f64.
        let r = |v: f32| f32::from_bits((bf16_bits(v) as u32) << 16);
        let mut y = vec![0f32; rows * n];
        for i in 0..rows {
            for j in 0..n {
                let s: f64 = (0..k)
                    .map(|t| r(x[i * k + t]) as f64 * r(w[j * k + t]) as f64)
                    .sum();
                y[i * n + j] = s as f32;
            }
        }
        y
    }

    #[test]
    fn bf16_rounding_is_to_nearest_even() {
        assert_eq!(bf16_bits(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
        assert_eq!(bf16_bits(1.0 + 1.0 / 256.0), 0x3f80);
        assert_eq!(bf16_bits(1.0 + 3.0 / 256.0), 0x3f82);
        assert_eq!(bf16_bits(-2.0), 0xc000);
        assert_eq!(bf16_bits(f32::NAN), 0x7fc0);
        assert_eq!(bf16_bits(f32::INFINITY), 0x7f80);
    }

    #[test]
    #[ignore = "needs a CPU with AMX; `make test` runs it where the CPU has AMX (`make test-amx`)"]
    fn tiles_match_the_rounded_reference_on_every_shape_on_amx_tiles() {
        assert!(available(), "this CPU or kernel cannot run AMX tiles");
        // Whole tiles, and rows / outputs / depths that leave partial ones.
        for &(rows, n, k) in &[
            (32, 32, 32),
            (64, 96, 576),
            (17, 40, 64),
            (100, 33, 50),
            (9, 24, 37),
            (1, 16, 32),
            (45, 960, 576),
        ] {
            let x = values(rows * k, (rows * 31 + k) as u32);
            let w = values(n * k, (n * 7 + k) as u32);
            let want = reference(&x, rows, &w, n, k);
            // The same buffers reused across shapes, as a thread's scratch is.
            let (mut packed, mut a) = (TileWeight::empty(), vec![7u16; 5]);
            for _ in 0..2 {
                packed.repack(&w, n, k);
                close(&linear(&x, rows, &packed, &mut a), &want, (rows, n, k));
            }
            // The same weight given transposed, `(k, n)`.
            let wt: Vec<f32> = (0..k * n).map(|i| w[(i % n) * k + i / n]).collect();
            packed.repack_transposed(&wt, k, n);
            close(&linear(&x, rows, &packed, &mut a), &want, (rows, n, k));
        }
    }

    fn close(got: &[f32], want: &[f32], shape: (usize, usize, usize)) {
        assert_eq!(got.len(), want.len());
        for (i, (g, e)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - e).abs() <= 1e-4 * (1.0 + e.abs()),
                "{shape:?} element {i}: {g} vs {e}"
            );
        }
    }

    #[test]
    fn a_machine_without_tiles_says_so() {
        // On every machine: asking for tiles either works or names what is missing.
        match crate::PrefillMatmul::parse("amx") {
            Ok(m) => assert!(available() && m == crate::PrefillMatmul::Tiles),
            Err(e) => {
                assert!(!available());
                assert!(e.to_string().contains("AMX"), "{e}");
            }
        }
        assert_eq!(
            crate::PrefillMatmul::parse("f32").unwrap(),
            crate::PrefillMatmul::F32
        );
        assert!(crate::PrefillMatmul::parse("bf17").is_err());
    }
}
