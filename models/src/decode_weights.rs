//! The decode path's narrow weights: which a model has, in which format, and the switch.
//!
//! A decode step multiplies every weight by a handful of rows (one per job), so its time is the
//! bytes of the weights over the memory bandwidth. Each projection and the output head keep,
//! beside the f32 weight, a copy in GGUF's 4- or 8-bit blocks that decode steps multiply
//! ([`crate::kernels`]' narrow kernel): for SmolLM2-135M 96 MB per token instead of 540 MB.
//! A model loaded from a GGUF file keeps the file's own Q4_1 / Q8_0 blocks, so its decode
//! weights are exactly the values the f32 path dequantises; any other weight (a Hugging Face
//! checkpoint, another GGUF type, an expert merged into the base) is quantised to Q8_0 from its
//! f32 values. Adapters applied on the fly keep their low-rank term in f32 beside the packed
//! base, added in the same pass ([`crate::kernels`]' `low_rank`).
//!
//! The f32 weights stay: prefill and training multiply many rows, on f32 with gemm or on AMX
//! tiles packed from the f32 values per call ([`crate::prefill_matmul`]). The packed copies
//! add about a sixth to the model's memory.
//!
//! `SCD_DECODE_WEIGHTS=f32` (the binary's `--decode-weights`, into [`crate::KernelChoice`]),
//! or [`Llama::with_decode_weights`], keeps decode on the f32
//! weights (the reference the narrow path is measured against).

use std::sync::Arc;

use candle_core::{Tensor, TensorId};

use crate::error::{ForwardError, LoadError};
use crate::kernels::PackedWeight;
use crate::llama::{Linear, Llama};

/// Which weights decode steps multiply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DecodeWeights {
    /// 4- and 8-bit blocks (the default).
    #[default]
    Narrow,
    /// The f32 weights, as prefill.
    F32,
}

impl DecodeWeights {
    /// The environment variable the binary reads it from (the library reads no environment:
    /// see [`crate::KernelChoice`]).
    pub const ENV: &'static str = "SCD_DECODE_WEIGHTS";
}

impl std::str::FromStr for DecodeWeights {
    type Err = LoadError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "narrow" | "" => Ok(Self::Narrow),
            "f32" => Ok(Self::F32),
            other => Err(LoadError::Config(format!(
                "{}={other:?} is not valid: expected narrow or f32",
                Self::ENV
            ))),
        }
    }
}

impl std::fmt::Display for DecodeWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Narrow => "narrow",
            Self::F32 => "f32",
        })
    }
}

/// A packed copy of one f32 weight tensor. Clones share it, as they share the f32 weight.
#[derive(Debug, Clone)]
pub(crate) struct Narrow {
    packed: Arc<PackedWeight>,
    /// The f32 weight it holds the values of: a merge replaces the weight, and a copy of the
    /// old one must not be used for the new.
    of: TensorId,
}

impl Narrow {
    pub(crate) fn new(packed: PackedWeight, of: &Tensor) -> Self {
        Self {
            packed: Arc::new(packed),
            of: of.id(),
        }
    }

    /// Q8_0 of `weight` `(rows, cols)`; `None` when `cols` is not a whole number of blocks.
    fn quantize(weight: &Tensor) -> candle_core::Result<Option<Self>> {
        let (rows, cols) = weight.dims2()?;
        let values = weight.flatten_all()?.to_vec1::<f32>()?;
        Ok(PackedWeight::quantize_q8_0(&values, rows, cols).map(|p| Self::new(p, weight)))
    }

    /// The packed weight if it holds `weight`'s values.
    pub(crate) fn of(&self, weight: &Tensor) -> Option<&PackedWeight> {
        (self.of == weight.id()).then_some(&*self.packed)
    }

    /// Whether both are the same copy.
    pub(crate) fn same(&self, other: &Narrow) -> bool {
        Arc::ptr_eq(&self.packed, &other.packed)
    }
}

/// Makes `narrow` hold `weight`'s values: kept when it does, quantised when it is missing or
/// was made for another weight.
fn refresh(narrow: &mut Option<Narrow>, weight: &Tensor) -> candle_core::Result<()> {
    if narrow.as_ref().and_then(|n| n.of(weight)).is_none() {
        *narrow = Narrow::quantize(weight)?;
    }
    Ok(())
}

impl Linear {
    /// See [`refresh`].
    pub(crate) fn refresh_narrow(&mut self) -> candle_core::Result<()> {
        refresh(&mut self.narrow, &self.weight)
    }
}

impl Llama {
    /// This model with its decode steps on `weights`: packed copies made where missing or
    /// stale (narrow), or dropped (f32). Copies already made are shared, not repacked.
    pub fn with_decode_weights(mut self, weights: DecodeWeights) -> Result<Self, ForwardError> {
        self.set_decode_weights(weights)?;
        Ok(self)
    }

    pub(crate) fn set_decode_weights(&mut self, weights: DecodeWeights) -> candle_core::Result<()> {
        for block in &mut self.blocks {
            for lin in block.linears_mut() {
                match weights {
                    DecodeWeights::Narrow => lin.refresh_narrow()?,
                    DecodeWeights::F32 => lin.narrow = None,
                }
            }
        }
        match weights {
            DecodeWeights::Narrow => refresh(&mut self.head_narrow, &self.lm_head)?,
            DecodeWeights::F32 => self.head_narrow = None,
        }
        Ok(())
    }

    /// Which weights decode steps multiply: narrow when any projection has a packed copy.
    pub fn decode_weights(&self) -> DecodeWeights {
        let packed = self.head_narrow.is_some()
            || self.blocks.iter().any(|b| {
                [&b.qkv, &b.o, &b.gate_up, &b.down]
                    .iter()
                    .any(|l| l.narrow.is_some())
            });
        if packed {
            DecodeWeights::Narrow
        } else {
            DecodeWeights::F32
        }
    }

    /// The bytes of weights a decode step streams: each projection's and the output head's
    /// packed copy where it has one, its f32 weight otherwise (adapter terms not counted).
    pub fn decode_weight_bytes(&self) -> usize {
        let bytes = |w: &Tensor, n: &Option<Narrow>| match n.as_ref().and_then(|n| n.of(w)) {
            Some(p) => p.bytes(),
            None => w.elem_count() * 4,
        };
        let blocks: usize = self
            .blocks
            .iter()
            .flat_map(|b| [&b.qkv, &b.o, &b.gate_up, &b.down])
            .map(|l| bytes(&l.weight, &l.narrow))
            .sum();
        blocks + bytes(&self.lm_head, &self.head_narrow)
    }
}
