//! Compiled documents before a prompt (SemPIC, `docs/method.md` §5.5): the oracle's own prefill of
//! the prompt, read over documents that a producer compiled elsewhere and serves from its store.
//!
//! The producer places the job's documents one after another ([`encode_documents`]: each
//! document's keys re-rotated by the offset it lands at, as [`crate::sempic::stitch`] does) and
//! sends, per layer, every document's keys (after RoPE, at their final positions) and values as
//! one [`CodeKind::DOC_K`] and one [`CodeKind::DOC_V`] code of `(rows, kv_dim)`, in f32 or
//! bf16. The consumer ([`Documents`]) takes them as its cache for positions `0..rows` and runs
//! its own forward pass over the prompt's prefix from position `rows`: the reader of SemPIC,
//! with nothing of a document recomputed on either side. The consumer needs neither the
//! documents' tokens nor their number; `rows` (boundary tokens included) comes with the codes.
//!
//! The keys come rotated with the producer's RoPE (the base's, [`Llama::base_rope`]). A consumer
//! that rotates with another base (a long-context fine-tune) turns them to its own rotation at
//! the same positions, so that its queries meet keys rotated as it expects; for every other
//! consumer the cache is the stitched one, bit for bit.

use candle_core::Tensor;
use scd_types::{CodeDType, CodeKind, LayerCode, Mode};

use super::tensor_bytes::from_bytes;
use super::{
    check_rows, dtype_name, kind_name, tensor_code, Codec, CodecError, KvSlots, LayerDecoder,
    Prefix,
};
use crate::cache::KvCache;
use crate::llama::{Capture, Input, LayerCapture, Llama, LogitsWanted};
use crate::rope::Rope;
use crate::sempic::CompiledDoc;

/// The consumer half of a job with documents: the oracle after served compiled documents.
/// Its mode is [`Mode::Oracle`]: the prompt's state is the consumer's own.
#[derive(Debug, Clone, Copy, Default)]
pub struct Documents;

/// Appends layer `layer`'s codes for `docs` placed one after another from position 0: their
/// keys re-rotated with `rope` to where they land, and their values, each `(rows, kv_dim)` in
/// `dtype` (f32, or bf16 to halve the bytes).
pub fn encode_documents(
    rope: &Rope,
    docs: &[CompiledDoc],
    layer: usize,
    dtype: CodeDType,
    out: &mut Vec<LayerCode>,
) -> Result<(), CodecError> {
    if !matches!(dtype, CodeDType::F32 | CodeDType::BF16) {
        return Err(CodecError::Unavailable(format!(
            "documents travel in f32 or bf16, not {}",
            dtype_name(dtype)
        )));
    }
    if docs.is_empty() {
        return Err(CodecError::Unavailable("no documents to encode".into()));
    }
    let mut offset = 0;
    let mut ks = Vec::with_capacity(docs.len());
    let mut vs = Vec::with_capacity(docs.len());
    for d in docs {
        let (k, v) = d.layer_at(rope, layer, offset)?;
        ks.push(k);
        vs.push(v);
        offset += d.len();
    }
    for (kind, parts) in [(CodeKind::DOC_K, ks), (CodeKind::DOC_V, vs)] {
        out.push(tensor_code(layer, kind, dtype, &Tensor::cat(&parts, 0)?)?);
    }
    Ok(())
}

struct DocumentsDecoder<'a> {
    consumer: &'a Llama,
    prefix: Prefix<'a>,
    /// The documents' rows, set by the first code.
    rows: Option<usize>,
    /// Per layer: (K after RoPE, V), each `(rows, kv_dim)`.
    layers: KvSlots,
}

impl Codec for Documents {
    fn mode(&self) -> Mode {
        Mode::Oracle
    }

    fn capture(&self) -> Option<Capture> {
        None
    }

    fn encode_layer(&self, _: &LayerCapture, _: &mut Vec<LayerCode>) -> Result<(), CodecError> {
        Err(CodecError::Unavailable(
            "documents are served from a compiled-document store (encode_documents), not \
             encoded from a prefill"
                .into(),
        ))
    }

    fn decoder<'a>(
        &'a self,
        consumer: &'a Llama,
        prefix: Prefix<'a>,
    ) -> Result<Box<dyn LayerDecoder + 'a>, CodecError> {
        Ok(Box::new(DocumentsDecoder {
            consumer,
            prefix,
            rows: None,
            layers: KvSlots::new(consumer.config().num_layers),
        }))
    }
}

impl LayerDecoder for DocumentsDecoder<'_> {
    fn push(&mut self, code: &LayerCode) -> Result<(), CodecError> {
        let cfg = self.consumer.config();
        let is_k = match code.kind {
            CodeKind::DOC_K => true,
            CodeKind::DOC_V => false,
            other => {
                return Err(CodecError::UnexpectedCode {
                    mode: Mode::Oracle,
                    layer: code.layer,
                    kind: kind_name(other),
                })
            }
        };
        if !matches!(code.dtype, CodeDType::F32 | CodeDType::BF16) {
            return Err(CodecError::DType {
                layer: code.layer,
                kind: kind_name(code.kind),
                got: dtype_name(code.dtype),
                expected: "f32 or bf16".into(),
            });
        }
        // The first code sets the documents' rows; they and the prompt must fit the context
        // (checked before anything is allocated for them).
        let rows = match self.rows {
            Some(r) => r,
            None => {
                let r = code.shape.first().map_or(0, |&r| r as usize);
                let needed = r + self.prefix.tokens.len() + 1;
                if r == 0 || needed > cfg.context_length {
                    return Err(CodecError::Shape {
                        layer: code.layer,
                        kind: kind_name(code.kind),
                        got: code.shape.clone(),
                        bytes: code.bytes.len(),
                        expected: format!(
                            "1 to {} document rows (the context holds {}, the prompt takes {})",
                            cfg.context_length
                                .saturating_sub(self.prefix.tokens.len() + 1),
                            cfg.context_length,
                            self.prefix.tokens.len() + 1
                        ),
                    });
                }
                r
            }
        };
        check_rows(code, cfg.num_layers, rows, cfg.kv_dim())?;
        self.rows = Some(rows);
        self.layers.fill(code, is_k, || {
            from_bytes(&code.bytes, code.dtype, &[rows, cfg.kv_dim()])
        })
    }

    fn finish(self: Box<Self>) -> Result<KvCache, CodecError> {
        let rows = self.rows.ok_or(CodecError::Missing {
            layer: 0,
            kind: "doc_k",
        })?;
        let mut layers = self.layers.finish(("doc_k", "doc_v"))?;
        let (own, base) = (self.consumer.rope(), self.consumer.base_rope());
        if own != base {
            let positions: Vec<u32> = (0..rows as u32).collect();
            for (k, _) in &mut layers {
                *k = own.apply(&base.inverse(k, &positions)?, &positions)?;
            }
        }
        let mut cache = KvCache::from_post_rope(self.consumer.config(), &layers, rows)?;
        if !self.prefix.tokens.is_empty() {
            self.consumer.forward(
                Input::new(self.prefix.tokens)
                    .with_cache(&mut cache)
                    .logits(LogitsWanted::None),
            )?;
        }
        Ok(cache)
    }
}
