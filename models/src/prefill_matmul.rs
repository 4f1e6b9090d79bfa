//! Which kernel multiplies a prefill's many rows by the weights, and the switch.
//!
//! A prefill (more than [`crate::kernels`]' few decode rows per sequence) multiplies each
//! projection and, for all-position logits, the output head by many rows: compute-bound work.
//! Where the CPU has AMX (Sapphire Rapids and later Xeons) and Linux grants the tile state, the
//! products run on AMX tiles in bf16 with f32 sums ([`PrefillMatmul::Tiles`], the default
//! there); elsewhere, and whenever asked, on f32 with gemm ([`PrefillMatmul::F32`]). Training
//! (anything recording gradients) always multiplies in f32.
//!
//! `SCD_PREFILL_MATMUL=f32` (the binary's `--prefill-matmul`, into [`crate::KernelChoice`]),
//! or [`Llama::with_prefill_matmul`], forces the f32 path on
//! a machine with AMX (the reference the tiles are measured against); `amx` asks for the tiles
//! and fails to load where they are missing; `auto` (or unset) picks.

use crate::error::LoadError;
use crate::kernels::amx;
use crate::llama::Llama;

/// Which kernel multiplies prefill rows by the weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillMatmul {
    /// AMX tiles: bf16 products, f32 sums.
    Tiles,
    /// f32 products and sums (gemm).
    F32,
}

impl PrefillMatmul {
    /// The environment variable the binary reads it from (the library reads no environment:
    /// see [`crate::KernelChoice`]).
    pub const ENV: &'static str = "SCD_PREFILL_MATMUL";

    /// The best this machine offers: tiles when it has AMX, f32 otherwise.
    pub fn best() -> Self {
        if amx::available() {
            Self::Tiles
        } else {
            Self::F32
        }
    }

    /// `auto`, `amx` or `f32`, as the binary's `--prefill-matmul` (or [`Self::ENV`]) says.
    pub fn parse(s: &str) -> Result<Self, LoadError> {
        match s.trim() {
            "auto" | "" => Ok(Self::best()),
            "amx" if amx::available() => Ok(Self::Tiles),
            "amx" => Err(unavailable()),
            "f32" => Ok(Self::F32),
            other => Err(LoadError::Config(format!(
                "{}={other:?} is not valid: expected auto, amx or f32",
                Self::ENV
            ))),
        }
    }
}

impl PrefillMatmul {
    /// `self`, or the error that says why this machine cannot run it (tiles without AMX).
    pub fn check_available(self) -> Result<Self, LoadError> {
        if self == Self::Tiles && !amx::available() {
            return Err(unavailable());
        }
        Ok(self)
    }
}

fn unavailable() -> LoadError {
    LoadError::Config(format!(
        "AMX tiles asked for ({}=amx or Tiles), but this machine cannot run them (the CPU lacks \
         AMX-TILE, AMX-BF16 or AVX512_BF16, or Linux refused the tile-data permission); use \
         auto or f32",
        PrefillMatmul::ENV
    ))
}

impl std::fmt::Display for PrefillMatmul {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Tiles => "amx",
            Self::F32 => "f32",
        })
    }
}

impl Llama {
    /// This model with its prefill products on `matmul`. [`PrefillMatmul::Tiles`] on a machine
    /// without AMX is refused.
    pub fn with_prefill_matmul(mut self, matmul: PrefillMatmul) -> Result<Self, LoadError> {
        self.set_prefill_matmul(matmul.check_available()?);
        Ok(self)
    }

    pub(crate) fn set_prefill_matmul(&mut self, matmul: PrefillMatmul) {
        self.prefill = matmul;
        for block in &mut self.blocks {
            for lin in block.linears_mut() {
                lin.tiles = matmul == PrefillMatmul::Tiles;
            }
        }
    }

    /// Which kernel multiplies this model's prefill rows.
    pub fn prefill_matmul(&self) -> PrefillMatmul {
        self.prefill
    }
}
