//! Which products a decode step on narrow weights takes, and the switch.
//!
//! A decode step's narrow weights ([`crate::decode_weights`]) meet the activations in one of
//! three kernels ([`crate::kernels`]' `narrow`):
//!
//! - [`DecodeProducts::Int`]: each activation in two signed bytes per block of 32, integer dot
//!   products (AVX-512 VNNI or AVX2, plain Rust elsewhere). Within float noise of the f32 path
//!   (mean KL about 3e-8 on the shipped model).
//! - [`DecodeProducts::Bf16`]: activations rounded to bf16, `vdpbf16ps` (AVX-512 BF16: Cooper
//!   Lake and later Xeons, AMD Zen 4). Per 64 weights and row, two dot products and one fused
//!   multiply-add instead of six steps; a single job is bound by the weights' bytes either way,
//!   a batch of jobs by these steps, so batches decode faster. The rounding is relative to each
//!   value (outlier channels round nothing else away): mean KL about 7e-5 to the f32 path,
//!   greedy agreement 0.99-1.0 over 256 steps (measured in the real-model tests), against 2e-3
//!   and 0.965 for one byte per value as llama.cpp rounds them.
//! - [`DecodeProducts::Tiles`]: the same rounding, products on AMX tiles (Sapphire Rapids and
//!   later Xeons): 16 outputs by 32 inputs by every row of the step in one instruction, so a
//!   batch of 8 jobs decodes some 40% faster, and a single job 10-18% slower (the tile's
//!   stores and loads are latency one row cannot hide). A batch's kernel cannot depend on how
//!   many rows it has (the two kernels sum in different orders, and a job's tokens would then
//!   depend on the load), so tiles are asked for, for a node that serves batches, rather than
//!   picked.
//!
//! The default ([`DecodeProducts::best`]) is bf16 where the CPU has AVX-512 BF16, as the AMX
//! prefill is the default where the CPU has tiles, and integers elsewhere; tiles are never
//! picked, only asked for. `SCD_DECODE_PRODUCTS=int` (the binary's `--decode-products`, into
//! [`crate::KernelChoice`]), or
//! [`Llama::with_decode_products`], keeps the integer kernel; `bf16` and `tiles` ask for theirs
//! and fail to load where the CPU lacks it; `auto` (or unset) picks. A job's tokens are the
//! same alone and in a batch under each.

use crate::error::LoadError;
use crate::kernels::NarrowIsa;
use crate::llama::Llama;

/// Which products a decode step on narrow weights takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeProducts {
    /// Activations rounded to bf16, bf16 tile products with f32 sums (AMX).
    Tiles,
    /// Activations rounded to bf16, bf16 dot products with f32 sums (AVX-512 BF16).
    Bf16,
    /// Activations in two signed bytes per value, integer dot products.
    Int,
}

impl DecodeProducts {
    /// The environment variable the binary reads it from (the library reads no environment:
    /// see [`crate::KernelChoice`]).
    pub const ENV: &'static str = "SCD_DECODE_PRODUCTS";

    /// The default on this machine: bf16 when it has AVX-512 BF16, integers otherwise. Tiles
    /// are asked for, not picked: they decode batches faster and a single job slower.
    pub fn best() -> Self {
        if NarrowIsa::Avx512Bf16.runs_here() {
            Self::Bf16
        } else {
            Self::Int
        }
    }

    /// `auto`, `tiles`, `bf16` or `int`, as the binary's `--decode-products` (or [`Self::ENV`])
    /// says.
    pub fn parse(s: &str) -> Result<Self, LoadError> {
        match s.trim() {
            "auto" | "" => Ok(Self::best()),
            "tiles" => Self::Tiles.checked(),
            "bf16" => Self::Bf16.checked(),
            "int" => Ok(Self::Int),
            other => Err(LoadError::Config(format!(
                "{}={other:?} is not valid: expected auto, tiles, bf16 or int",
                Self::ENV
            ))),
        }
    }

    /// The kernel's instruction set.
    pub(crate) fn isa(self) -> NarrowIsa {
        match self {
            Self::Tiles => NarrowIsa::AmxBf16,
            Self::Bf16 => NarrowIsa::Avx512Bf16,
            Self::Int => NarrowIsa::best_integer(),
        }
    }

    /// `self`, or an error where this CPU (or its kernel, for AMX's tile data) lacks it.
    fn checked(self) -> Result<Self, LoadError> {
        if self.isa().runs_here() {
            return Ok(self);
        }
        let lacks = match self {
            Self::Tiles => "AMX (tiles and BF16, with the tile data granted by the kernel)",
            Self::Bf16 => "AVX-512 BF16",
            Self::Int => unreachable!("the integer kernel runs everywhere"),
        };
        Err(LoadError::Config(format!(
            "{self} decode products asked for ({}={self} or DecodeProducts::{self:?}), but this \
             CPU lacks {lacks}; use auto or int",
            DecodeProducts::ENV
        )))
    }
}

impl std::fmt::Display for DecodeProducts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Tiles => "tiles",
            Self::Bf16 => "bf16",
            Self::Int => "int",
        })
    }
}

impl Llama {
    /// This model with its decode steps' narrow products on `products`.
    /// Products this CPU lacks ([`DecodeProducts::Tiles`] without AMX,
    /// [`DecodeProducts::Bf16`] without AVX-512 BF16) are refused.
    pub fn with_decode_products(mut self, products: DecodeProducts) -> Result<Self, LoadError> {
        self.set_decode_products(products.checked()?);
        Ok(self)
    }

    pub(crate) fn set_decode_products(&mut self, products: DecodeProducts) {
        self.products = products;
        for block in &mut self.blocks {
            for lin in block.linears_mut() {
                lin.products = products;
            }
        }
    }

    /// Which products this model's decode steps take on narrow weights.
    pub fn decode_products(&self) -> DecodeProducts {
        self.products
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_switch_and_refuses_what_the_cpu_lacks() {
        assert_eq!(DecodeProducts::parse("int").ok(), Some(DecodeProducts::Int));
        assert_eq!(
            DecodeProducts::parse(" auto ").ok(),
            Some(DecodeProducts::best())
        );
        assert_eq!(DecodeProducts::parse("").ok(), Some(DecodeProducts::best()));
        let (tiles, bf16) = (NarrowIsa::AmxBf16, NarrowIsa::Avx512Bf16);
        for (name, products, isa, lacks) in [
            ("tiles", DecodeProducts::Tiles, tiles, "AMX"),
            ("bf16", DecodeProducts::Bf16, bf16, "AVX-512 BF16"),
        ] {
            match DecodeProducts::parse(name) {
                Ok(p) => assert!(isa.runs_here() && p == products),
                Err(e) => {
                    assert!(!isa.runs_here());
                    assert!(e.to_string().contains(lacks), "{e}");
                }
            }
        }
        let best = match bf16.runs_here() {
            true => DecodeProducts::Bf16,
            false => DecodeProducts::Int,
        };
        assert_eq!(DecodeProducts::best(), best);
        let err = DecodeProducts::parse("fp8").err().map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("expected auto, tiles, bf16 or int")));
        assert_eq!(DecodeProducts::Int.isa(), NarrowIsa::best_integer());
    }
}
