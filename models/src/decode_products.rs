//! Which products a decode step on narrow weights takes, and the switch.
//!
//! A decode step's narrow weights ([`crate::decode_weights`]) meet the activations in one of two
//! kernels ([`crate::kernels`]' `narrow`):
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
//!
//! The default is the best the CPU runs ([`DecodeProducts::best`]), as the AMX prefill is the
//! default where the CPU has tiles. `SCD_DECODE_PRODUCTS=int` at load, or
//! [`Llama::with_decode_products`], keeps the integer kernel; `bf16` asks for the bf16 one and
//! fails to load where the CPU lacks it; `auto` (or unset) picks. A job's tokens are the same
//! alone and in a batch under either.

use crate::error::LoadError;
use crate::kernels::NarrowIsa;
use crate::llama::Llama;

/// Which products a decode step on narrow weights takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeProducts {
    /// Activations rounded to bf16, bf16 dot products with f32 sums (AVX-512 BF16).
    Bf16,
    /// Activations in two signed bytes per value, integer dot products.
    Int,
}

impl DecodeProducts {
    /// The environment variable read at load.
    pub const ENV: &'static str = "SCD_DECODE_PRODUCTS";

    /// The best this machine offers: bf16 when it has AVX-512 BF16, integers otherwise.
    pub fn best() -> Self {
        if NarrowIsa::Avx512Bf16.runs_here() {
            Self::Bf16
        } else {
            Self::Int
        }
    }

    /// From [`Self::ENV`]: `auto` (also when unset) is [`Self::best`], `bf16` the bf16 kernel
    /// (an error where the CPU lacks it), `int` the integer one.
    pub fn from_env() -> Result<Self, LoadError> {
        match std::env::var(Self::ENV) {
            Err(std::env::VarError::NotPresent) => Ok(Self::best()),
            Ok(v) => Self::parse(&v),
            Err(std::env::VarError::NotUnicode(v)) => Err(LoadError::Config(format!(
                "{}={v:?} is not valid: expected auto, bf16 or int",
                Self::ENV
            ))),
        }
    }

    /// `auto`, `bf16` or `int`, as [`Self::from_env`] reads them.
    pub fn parse(s: &str) -> Result<Self, LoadError> {
        match s.trim() {
            "auto" | "" => Ok(Self::best()),
            "bf16" if NarrowIsa::Avx512Bf16.runs_here() => Ok(Self::Bf16),
            "bf16" => Err(unavailable()),
            "int" => Ok(Self::Int),
            other => Err(LoadError::Config(format!(
                "{}={other:?} is not valid: expected auto, bf16 or int",
                Self::ENV
            ))),
        }
    }

    /// The kernel's instruction set.
    pub(crate) fn isa(self) -> NarrowIsa {
        match self {
            Self::Bf16 => NarrowIsa::Avx512Bf16,
            Self::Int => NarrowIsa::best_integer(),
        }
    }
}

fn unavailable() -> LoadError {
    LoadError::Config(format!(
        "bf16 decode products asked for ({}=bf16 or DecodeProducts::Bf16), but this CPU lacks \
         AVX-512 BF16; use auto or int",
        DecodeProducts::ENV
    ))
}

impl std::fmt::Display for DecodeProducts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Bf16 => "bf16",
            Self::Int => "int",
        })
    }
}

impl Llama {
    /// This model with its decode steps' narrow products on `products`.
    /// [`DecodeProducts::Bf16`] on a CPU without AVX-512 BF16 is refused.
    pub fn with_decode_products(mut self, products: DecodeProducts) -> Result<Self, LoadError> {
        if products == DecodeProducts::Bf16 && !NarrowIsa::Avx512Bf16.runs_here() {
            return Err(unavailable());
        }
        self.set_decode_products(products);
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
        let bf16 = DecodeProducts::parse("bf16");
        if NarrowIsa::Avx512Bf16.runs_here() {
            assert_eq!(bf16.ok(), Some(DecodeProducts::Bf16));
            assert_eq!(DecodeProducts::best(), DecodeProducts::Bf16);
        } else {
            let err = bf16.err().map(|e| e.to_string()).unwrap_or_default();
            assert!(err.contains("AVX-512 BF16"), "{err}");
            assert_eq!(DecodeProducts::best(), DecodeProducts::Int);
        }
        let err = DecodeProducts::parse("fp8").err().map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("expected auto, bf16 or int")));
        assert_eq!(DecodeProducts::Int.isa(), NarrowIsa::best_integer());
    }
}
