//! CPU kernels that candle lacks and a long prefill or a decode step needs.
//!
//! Each one fuses a few of candle's element-wise passes into one, on the non-differentiable
//! (inference) path only; training keeps candle's ops and their gradients. Rows are spread over
//! rayon's global pool, the one candle's matmul uses, so the kernels never oversubscribe the
//! cores. Inner loops are plain Rust written to auto-vectorise; [`multiversion!`] compiles them
//! a second time for AVX2 + FMA and picks that copy at run time when the CPU has it, so the
//! binary stays portable without giving up the wide registers. The AMX kernels of a prefill
//! (`amx`, `attend_tiles`) and the narrow decode kernels (`narrow`) are written for their
//! instructions (`asm!`, intrinsics) and chosen at run time where the CPU has them; `low_rank`
//! adds an expert's adapter terms inside the narrow kernel's pass.

pub(crate) mod amx;
mod attend;
mod attend_tiles;
mod exp;
mod heads;
mod low_rank;
mod narrow;
mod row_vector;
mod rows;
mod softmax;
mod swiglu;
mod tile_linear;

pub(crate) use attend::{attend_few, attend_few_many, FewQueries, MAX_QUERY_ROWS};
pub(crate) use attend_tiles::attend_tiles;
pub(crate) use exp::exp;
pub(crate) use heads::{merge_heads, rows_to_cache_heads, split_qkv_rope, Heads};
pub(crate) use low_rank::{LowRank, LowRankTerm};
pub(crate) use narrow::{
    linear_narrow, linear_narrow_low_rank, Format, Isa as NarrowIsa, PackedWeight,
};
pub(crate) use row_vector::{with_row_vector, RowOp};
pub(crate) use rows::{linear_few_rows, MAX_ROWS, MIN_DEPTH};
pub(crate) use softmax::causal_softmax_;
pub(crate) use swiglu::{silu_, swiglu};
pub(crate) use tile_linear::{skip_mlp_tiles, TileLinear};

use candle_core::{CpuStorage, Layout, Storage, Tensor};

/// Defines `fn $name(args)` as a dispatcher over two compilations of one body: AVX2 + FMA when
/// the CPU reports both, the build's baseline otherwise.
macro_rules! multiversion {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $(#[$m])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name($($arg: $ty),*) {
            #[inline(always)]
            #[allow(clippy::too_many_arguments)]
            fn generic($($arg: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                fn avx2($($arg: $ty),*) {
                    generic($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: `avx2` only needs the two features just detected on this CPU.
                    return unsafe { avx2($($arg),*) };
                }
            }
            generic($($arg),*)
        }
    };
}
pub(crate) use multiversion;

/// `x W^T` on AMX tiles (bf16 products, f32 sums) for `x` `(m, k)` and `w` `(n, k)`, both
/// contiguous f32. Callers check [`amx::available`].
///
/// The weight is packed into the tile layout per call, into a buffer the calling thread keeps
/// (as gemm packs its panels per call): the model holds one f32 copy, not a second in bf16.
pub(crate) fn linear_tiles(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    let (n, k_w) = w.dims2()?;
    tiles_product(x, w, n, k_w, |packed, ws| packed.repack(ws, n, k_w))
}

/// `x M` on AMX tiles for `x` `(m, k)` and `m` `(k, n)`, both contiguous f32: [`linear_tiles`]
/// with `W = M^T` packed straight from `M`'s columns (a translator's matrices are stored in
/// that orientation; transposing them per call cost as much as the product). Callers check
/// [`amx::available`].
pub(crate) fn matmul_tiles(x: &Tensor, m: &Tensor) -> candle_core::Result<Tensor> {
    let (k_m, n) = m.dims2()?;
    tiles_product(x, m, n, k_m, |packed, ms| {
        packed.repack_transposed(ms, k_m, n)
    })
}

/// `x W^T` for `W` `(n, k_w)` packed from `w` by `pack`.
fn tiles_product(
    x: &Tensor,
    w: &Tensor,
    n: usize,
    k_w: usize,
    pack: impl Fn(&mut amx::TileWeight, &[f32]) + Sync,
) -> candle_core::Result<Tensor> {
    let (m, k) = x.dims2()?;
    if k != k_w || m == 0 {
        candle_core::bail!("tile product: x {:?} and weight {:?}", x.dims(), w.dims());
    }
    let y = with_f32(x, |xs| {
        with_f32(w, |ws| {
            let run = |s: &mut amx::Scratch| {
                pack(&mut s.weight, ws);
                amx::linear(xs, m, &s.weight, &mut s.a)
            };
            // The output head of all-position logits (49,152 x 576 for SmolLM2) would leave
            // its 57 MB packed copy in the thread's buffers for good: such weights get buffers
            // of their own, freed after the call.
            Ok(if n * k > amx::SCRATCH_WEIGHT_MAX {
                run(&mut amx::Scratch::new())
            } else {
                amx::with_scratch(run)
            })
        })
    })?;
    Tensor::from_vec(y, (m, n), &candle_core::Device::Cpu)
}

/// `f` on a thread of rayon's pool. Called from outside the pool (an actor's thread, the
/// harness), each parallel product in `f` would hand its tasks to the pool and sleep until
/// they are done: a wake-up per product, which was a third of a translator's encode on one
/// thread. On a pool thread the products' tasks start at once.
pub(crate) fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| f())
}

/// `y` `(m, n)` from its transpose `yt` `(n, m)`: the few-rows kernels compute `y^T` so that
/// each parallel task writes one contiguous block of weight rows' outputs.
pub(crate) fn transposed(yt: &[f32], m: usize, n: usize) -> candle_core::Result<Tensor> {
    let mut y = vec![0f32; m * n];
    for (j, col) in yt.chunks_exact(m).enumerate() {
        for (r, &v) in col.iter().enumerate() {
            y[r * n + j] = v;
        }
    }
    Tensor::from_vec(y, (m, n), &candle_core::Device::Cpu)
}

/// Calls `f` with the f32 elements of a contiguous CPU tensor (its own window of the storage).
pub(crate) fn with_f32<R>(
    t: &Tensor,
    f: impl FnOnce(&[f32]) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let (storage, layout) = t.storage_and_layout();
    f(f32_elements(&storage, layout)?)
}

/// The window of `storage` that a contiguous f32 CPU tensor with `layout` holds.
fn f32_elements<'a>(storage: &'a Storage, layout: &Layout) -> candle_core::Result<&'a [f32]> {
    match elements(storage, layout)? {
        Elements::F32(data) => Ok(data),
        Elements::Bf16(_) => candle_core::bail!("kernel input must be an f32 CPU tensor, got bf16"),
    }
}

/// An element the kernels widen to f32 as they load it: f32 itself, or bf16, whose bits are an
/// f32's high half, so that the widening is exact and a bf16 weight holding a value gives the
/// same products as an f32 weight holding it.
pub(crate) trait Widen: Copy + Send + Sync + 'static {
    /// Whether it is bf16 (the SIMD kernels choose their load by this constant).
    const BF16: bool;
    /// Its value.
    fn f32(self) -> f32;
}

impl Widen for f32 {
    const BF16: bool = false;
    #[inline(always)]
    fn f32(self) -> f32 {
        self
    }
}

impl Widen for half::bf16 {
    const BF16: bool = true;
    #[inline(always)]
    fn f32(self) -> f32 {
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }
}

/// A contiguous CPU tensor's elements in either storage the kernels take for weights.
#[derive(Clone, Copy)]
pub(crate) enum Elements<'a> {
    F32(&'a [f32]),
    Bf16(&'a [half::bf16]),
}

/// Calls `f` with the elements of several contiguous CPU tensors, f32 or bf16, in order.
pub(crate) fn with_elements_all<R>(
    ts: &[&Tensor],
    f: impl FnOnce(&[Elements<'_>]) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let held: Vec<_> = ts.iter().map(|t| t.storage_and_layout()).collect();
    let slices = held
        .iter()
        .map(|(storage, layout)| elements(storage, layout))
        .collect::<candle_core::Result<Vec<_>>>()?;
    f(&slices)
}

/// The window of `storage` that a contiguous f32 or bf16 CPU tensor with `layout` holds.
fn elements<'a>(storage: &'a Storage, layout: &Layout) -> candle_core::Result<Elements<'a>> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!(
            "kernel input must be contiguous, got strides {:?}",
            layout.stride()
        );
    };
    match storage {
        Storage::Cpu(CpuStorage::F32(d)) => Ok(Elements::F32(&d[start..end])),
        Storage::Cpu(CpuStorage::BF16(d)) => Ok(Elements::Bf16(&d[start..end])),
        other => candle_core::bail!(
            "kernel input must be an f32 or bf16 CPU tensor, got {:?}",
            other.dtype()
        ),
    }
}

/// `len` deterministic values in `[-1, 1)` (xorshift from `seed`), the kernels' test inputs.
#[cfg(test)]
pub(crate) fn test_values(len: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2_654_435_761).max(1);
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s % 2000) as f32 / 1000.0 - 1.0
        })
        .collect()
}
