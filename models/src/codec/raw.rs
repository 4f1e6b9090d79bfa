//! Raw KV transfer, what disaggregated serving does today: the producer's keys and values of
//! every layer in bf16, decoded on as they are, although they come from another model's
//! feature space.
//!
//! "As they are" includes the producer's rotation: a served cache holds keys rotated with the
//! producer's RoPE base, and an expert that rotates with another base (a long-context
//! fine-tune) reads them wrongly. The keys travel before RoPE and the consumer applies the
//! producer's rotation ([`Llama::base_rope`]: the producer is the base model the consumer's
//! adapter was trained on), which is the same cache as shipping rotated keys up to the order of
//! the bf16 rounding, and keeps one capture and one wire layout for every codec.

use scd_types::{CodeDType, CodeKind, LayerCode, Mode};

use super::tensor_bytes::from_bytes;
use super::{
    check_rows, dtype_name, kind_name, tensor_code, Codec, CodecError, KvSlots, LayerDecoder,
    Prefix,
};
use crate::cache::KvCache;
use crate::llama::{Capture, LayerCapture, Llama};

/// The producer's K and V in bf16.
#[derive(Debug, Clone, Copy, Default)]
pub struct Raw;

/// The wire dtype of raw K and V.
pub const RAW_DTYPE: CodeDType = CodeDType::BF16;

struct RawDecoder<'a> {
    consumer: &'a Llama,
    prefix: Prefix<'a>,
    /// Per layer: (K before RoPE, V), each `(T, kv_dim)`.
    layers: KvSlots,
}

impl Codec for Raw {
    fn mode(&self) -> Mode {
        Mode::Raw
    }

    fn capture(&self) -> Option<Capture> {
        Some(Capture {
            k_pre_rope: true,
            v: true,
            ..Capture::none()
        })
    }

    fn encode_layer(
        &self,
        capture: &LayerCapture,
        out: &mut Vec<LayerCode>,
    ) -> Result<(), CodecError> {
        let layer = capture.layer;
        let missing = |what| CodecError::MissingCapture { layer, what };
        for (kind, t, what) in [
            (CodeKind::RAW_K, &capture.k_pre_rope, "K before RoPE"),
            (CodeKind::RAW_V, &capture.v, "V"),
        ] {
            let t = t.as_ref().ok_or_else(|| missing(what))?;
            out.push(tensor_code(layer, kind, RAW_DTYPE, t)?);
        }
        Ok(())
    }

    fn decoder<'a>(
        &'a self,
        consumer: &'a Llama,
        prefix: Prefix<'a>,
    ) -> Result<Box<dyn LayerDecoder + 'a>, CodecError> {
        Ok(Box::new(RawDecoder {
            consumer,
            prefix,
            layers: KvSlots::new(consumer.config().num_layers),
        }))
    }
}

impl LayerDecoder for RawDecoder<'_> {
    fn push(&mut self, code: &LayerCode) -> Result<(), CodecError> {
        let cfg = self.consumer.config();
        let is_k = match code.kind {
            CodeKind::RAW_K => true,
            CodeKind::RAW_V => false,
            other => {
                return Err(CodecError::UnexpectedCode {
                    mode: Mode::Raw,
                    layer: code.layer,
                    kind: kind_name(other),
                })
            }
        };
        if code.dtype != RAW_DTYPE {
            return Err(CodecError::DType {
                layer: code.layer,
                kind: kind_name(code.kind),
                got: dtype_name(code.dtype),
                expected: dtype_name(RAW_DTYPE),
            });
        }
        let (rows, width) = (self.prefix.tokens.len(), cfg.kv_dim());
        check_rows(code, cfg.num_layers, rows, width)?;
        self.layers.fill(code, is_k, || {
            from_bytes(&code.bytes, code.dtype, &[rows, width])
        })
    }

    fn finish(self: Box<Self>) -> Result<KvCache, CodecError> {
        let layers = self.layers.finish(("raw_k", "raw_v"))?;
        Ok(KvCache::from_pre_rope(
            self.consumer.config(),
            self.consumer.base_rope(),
            &layers,
            &self.prefix.positions(),
        )?)
    }
}
