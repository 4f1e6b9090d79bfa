//! Which kernels a model runs on, chosen once: the decode weights ([`DecodeWeights`]), the
//! decode products ([`DecodeProducts`]) and the prefill products ([`PrefillMatmul`]).
//!
//! The library reads no environment: [`KernelChoice::best`] is what a caller gets by default,
//! and the `scd` binary builds a choice from its flags (`--decode-weights`, `--decode-products`,
//! `--prefill-matmul`, or their `SCD_*` variables) and passes it to every model it loads, and
//! to the codecs whose products follow the prefill's ([`crate::codec::CodecOptions`]).

use crate::decode_products::DecodeProducts;
use crate::decode_weights::DecodeWeights;
use crate::error::LoadError;
use crate::prefill_matmul::PrefillMatmul;

/// The kernels a model is loaded with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelChoice {
    /// Which weights decode steps multiply.
    pub decode_weights: DecodeWeights,
    /// Which products decode steps on narrow weights take.
    pub decode_products: DecodeProducts,
    /// Which kernel multiplies prefill rows by the weights (and a translator's codes).
    pub prefill_matmul: PrefillMatmul,
}

impl KernelChoice {
    /// The best this machine offers: narrow decode weights, the fastest decode products the
    /// CPU has (never AMX tiles, which are asked for), AMX prefill where the CPU has it.
    pub fn best() -> Self {
        Self {
            decode_weights: DecodeWeights::default(),
            decode_products: DecodeProducts::best(),
            prefill_matmul: PrefillMatmul::best(),
        }
    }

    /// From the three settings as a user writes them (`narrow|f32`, `auto|tiles|bf16|int`,
    /// `auto|amx|f32`); a kernel this CPU lacks is an error that says so.
    pub fn parse(
        decode_weights: &str,
        decode_products: &str,
        prefill_matmul: &str,
    ) -> Result<Self, LoadError> {
        Ok(Self {
            decode_weights: decode_weights.parse()?,
            decode_products: DecodeProducts::parse(decode_products)?,
            prefill_matmul: PrefillMatmul::parse(prefill_matmul)?,
        })
    }
}

impl Default for KernelChoice {
    fn default() -> Self {
        Self::best()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_settings_are_the_best_choice_and_bad_names_are_refused() {
        assert_eq!(
            KernelChoice::parse("narrow", "auto", "auto").unwrap(),
            KernelChoice::best()
        );
        let f32 = KernelChoice::parse("f32", "int", "f32").unwrap();
        assert_eq!(f32.decode_weights, DecodeWeights::F32);
        assert_eq!(f32.decode_products, DecodeProducts::Int);
        assert_eq!(f32.prefill_matmul, PrefillMatmul::F32);
        for bad in [
            ("wide", "auto", "auto"),
            ("narrow", "fast", "auto"),
            ("narrow", "auto", "gpu"),
        ] {
            let err = KernelChoice::parse(bad.0, bad.1, bad.2)
                .unwrap_err()
                .to_string();
            assert!(err.contains("is not valid"), "{err}");
        }
    }
}
