//! The kernels every model this process loads runs on: one choice, built here from the flags
//! (or their `SCD_*` variables) and passed down; the libraries read no environment.

use anyhow::Context;
use scd_models::{DecodeProducts, DecodeWeights, KernelChoice, PrefillMatmul};

/// The kernel flags, accepted by every command.
#[derive(clap::Args, Clone, Debug)]
pub struct KernelArgs {
    /// Decode weights: `narrow` (the model's 4- and 8-bit blocks) or `f32` (the reference).
    #[arg(long, global = true, env = DecodeWeights::ENV, default_value = "narrow")]
    decode_weights: String,
    /// Decode products on narrow weights: `auto`, `tiles` (AMX), `bf16` (AVX-512 BF16) or
    /// `int`.
    #[arg(long, global = true, env = DecodeProducts::ENV, default_value = "auto")]
    decode_products: String,
    /// Prefill products (and translator codes'): `auto`, `amx` (tiles) or `f32`.
    #[arg(long, global = true, env = PrefillMatmul::ENV, default_value = "auto")]
    prefill_matmul: String,
}

impl KernelArgs {
    /// The choice; a kernel this CPU lacks, or a name nobody knows, is an error saying which.
    pub fn choice(&self) -> anyhow::Result<KernelChoice> {
        KernelChoice::parse(
            &self.decode_weights,
            &self.decode_products,
            &self.prefill_matmul,
        )
        .context(
            "choosing the model's kernels (--decode-weights, --decode-products, --prefill-matmul)",
        )
    }
}
