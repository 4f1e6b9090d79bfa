//! Position-independent document caches: the serving side of SemPIC (`docs/method.md` §2.4
//! and §5.1).
//!
//! A document is compiled once, alone: a prefill from position 0 whose per-layer keys (after
//! RoPE) and values are kept ([`CompiledDoc`]). At request time several compiled documents are
//! placed one after another ([`stitch`]): each one's keys are re-rotated by the offset it lands
//! at (RoPE's rotations compose, `R(p) R(i) = R(p + i)`, so a key rotated to `i` becomes the key
//! at `p + i`; values carry no position), and the documents' caches are concatenated into one
//! [`KvCache`]. Inline tokens (an instruction, a question) then run through the reader with that
//! cache under the ordinary causal mask, and decoding continues from there.
//!
//! Nothing of a document is recomputed at request time, and no document ever attended to
//! another: that is the "no recompute" baseline when the writer is the reader itself, and
//! SemPIC when a LoRA writer compiled the documents for a frozen reader. With KV-Packet's
//! boundary tokens ([`crate::boundary`]) a document is compiled between a trained header and
//! trailer, whose keys and values it keeps: it then occupies more positions than it has
//! tokens. A document records the model that wrote it and its boundary tokens; a reader of
//! another base refuses it, and one prompt never mixes documents of two writer versions.
//! [`store`] keeps compiled documents on disk, addressed by writer version and tokens.

use candle_core::Tensor;

pub mod store;

pub use store::{document_id, DocStore, StoreError, WriterVersion};

use crate::boundary::Boundary;
use crate::cache::KvCache;
use crate::error::ForwardError;
use crate::llama::{Input, Llama, LogitsWanted, ModelIdentity};
use crate::rope::Rope;

/// One document's KV cache, compiled alone at positions `0..len` (boundary tokens included).
#[derive(Debug, Clone)]
pub struct CompiledDoc {
    tokens: Vec<u32>,
    /// Per layer, K after RoPE and V, each `(len, kv_heads * head_dim)`.
    layers: Vec<(Tensor, Tensor)>,
    writer: ModelIdentity,
    /// Header and trailer tokens around `tokens`, and their content hash.
    boundary: Option<(usize, usize, String)>,
}

impl CompiledDoc {
    /// Prefills `tokens` alone from position 0 with `writer` (the base, or the base with a
    /// writer adapter) and keeps every layer's keys and values.
    pub fn compile(writer: &Llama, tokens: &[u32]) -> Result<Self, ForwardError> {
        Self::compile_with(writer, tokens, None)
    }

    /// [`CompiledDoc::compile`] between `boundary`'s header and trailer tokens (which must have
    /// been trained for `writer`), when given.
    pub fn compile_with(
        writer: &Llama,
        tokens: &[u32],
        boundary: Option<&Boundary>,
    ) -> Result<Self, ForwardError> {
        let mut cache = writer.new_cache();
        let rows = match boundary {
            None => {
                writer.forward(
                    Input::new(tokens)
                        .with_cache(&mut cache)
                        .logits(LogitsWanted::None),
                )?;
                tokens.len()
            }
            Some(b) => {
                b.check(writer).map_err(Box::new)?;
                let x = b.embed(writer, tokens)?;
                writer.forward_layers(&x, 0..writer.config().num_layers, 0, Some(&mut cache))?;
                x.dim(0)?
            }
        };
        let layers = (0..cache.num_layers())
            .map(|l| {
                cache.layer(l)?.ok_or_else(|| ForwardError::Shape {
                    what: format!("compiled document, layer {l}"),
                    got: vec![0],
                    expected: vec![rows],
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let doc = Self::from_layers(tokens.to_vec(), layers, writer.identity().clone());
        match boundary {
            Some(b) => doc.with_boundary(b),
            None => Ok(doc),
        }
    }

    /// A document from its per-layer `(K after RoPE, V)`, each `(len, kv_heads * head_dim)`,
    /// computed elsewhere (a writer's layers run one at a time under gradient checkpointing).
    pub(crate) fn from_layers(
        tokens: Vec<u32>,
        layers: Vec<(Tensor, Tensor)>,
        writer: ModelIdentity,
    ) -> Self {
        Self {
            tokens,
            layers,
            writer,
            boundary: None,
        }
    }

    /// The same document marked as compiled between `boundary`'s tokens (its `layers` hold
    /// their rows).
    pub(crate) fn with_boundary(self, boundary: &Boundary) -> Result<Self, ForwardError> {
        let (header, trailer) = boundary.counts();
        let sha = boundary.content_sha256().map_err(Box::new)?;
        Ok(self.with_boundary_parts(header, trailer, sha))
    }

    /// The same document marked as compiled between `header` and `trailer` boundary tokens of
    /// content hash `sha256`.
    pub(crate) fn with_boundary_parts(
        mut self,
        header: usize,
        trailer: usize,
        sha256: String,
    ) -> Self {
        self.boundary = Some((header, trailer, sha256));
        self
    }

    /// The document's tokens.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Positions the document occupies: its tokens and any boundary tokens.
    pub fn len(&self) -> usize {
        let (header, trailer) = self.boundary_counts();
        header + self.tokens.len() + trailer
    }

    /// Header and trailer tokens around the document's own (0 and 0 without boundary tokens).
    pub fn boundary_counts(&self) -> (usize, usize) {
        self.boundary.as_ref().map_or((0, 0), |(h, t, _)| (*h, *t))
    }

    /// The content hash of the boundary tokens it was compiled between, if any.
    pub fn boundary_sha256(&self) -> Option<&str> {
        self.boundary.as_ref().map(|(_, _, s)| s.as_str())
    }

    /// Whether the document occupies no positions (never true for a compiled one).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The model that compiled it (its base file and, for a writer, the adapter).
    pub fn writer(&self) -> &ModelIdentity {
        &self.writer
    }

    /// Layer `layer`'s `(K after RoPE, V)` for the document placed at `offset`, each
    /// `(len, kv_heads * head_dim)`: the keys rotated on by `offset`.
    pub fn layer_at(
        &self,
        rope: &Rope,
        layer: usize,
        offset: usize,
    ) -> Result<(Tensor, Tensor), ForwardError> {
        let Some((k, v)) = self.layers.get(layer) else {
            return Err(ForwardError::LayerRange {
                start: layer,
                end: layer + 1,
                layers: self.layers.len(),
            });
        };
        if offset == 0 {
            return Ok((k.clone(), v.clone()));
        }
        let at = u32::try_from(offset).map_err(|_| ForwardError::ContextOverflow {
            needed: offset + self.len(),
            context: u32::MAX as usize,
        })?;
        Ok((rope.apply(k, &vec![at; self.len()])?, v.clone()))
    }
}

/// The cache of `docs` placed one after another from position 0, for `reader` to continue
/// (its next position is their total length). Refuses documents another base compiled and
/// documents that do not fit the reader's context window (with room for one more token).
pub fn stitch(reader: &Llama, docs: &[&CompiledDoc]) -> Result<KvCache, ForwardError> {
    let total: usize = docs.iter().map(|d| d.len()).sum();
    let context = reader.config().context_length;
    if total >= context {
        return Err(ForwardError::ContextOverflow {
            needed: total + 1,
            context,
        });
    }
    if let Some(d) = docs
        .iter()
        .find(|d| d.writer.sha256 != reader.identity().sha256)
    {
        return Err(ForwardError::ForeignDocument {
            writer: d.writer.sha256.clone(),
            reader: reader.identity().sha256.clone(),
        });
    }
    if docs.is_empty() {
        return Ok(reader.new_cache());
    }
    let layers = (0..reader.config().num_layers)
        .map(|l| {
            let mut offset = 0;
            let mut ks = Vec::with_capacity(docs.len());
            let mut vs = Vec::with_capacity(docs.len());
            for d in docs {
                let (k, v) = d.layer_at(reader.rope(), l, offset)?;
                ks.push(k);
                vs.push(v);
                offset += d.len();
            }
            Ok((Tensor::cat(&ks, 0)?, Tensor::cat(&vs, 0)?))
        })
        .collect::<Result<Vec<_>, ForwardError>>()?;
    KvCache::from_post_rope(reader.config(), &layers, total)
}

/// The cache of a prompt's `head` (the tokens before the documents, prefilled by `reader`
/// itself: exact, since nothing precedes them) followed by `docs` compiled elsewhere, all by one
/// writer version.
pub fn stitch_after_head(
    reader: &Llama,
    head: &[u32],
    docs: &[CompiledDoc],
) -> Result<KvCache, ForwardError> {
    if let Some(first) = docs.first().map(WriterVersion::of_doc) {
        if let Some(other) = docs.iter().map(WriterVersion::of_doc).find(|v| *v != first) {
            return Err(ForwardError::MixedWriters {
                first: first.id(),
                other: other.id(),
            });
        }
    }
    let head = CompiledDoc::compile(reader, head)?;
    let refs: Vec<&CompiledDoc> = std::iter::once(&head).chain(docs).collect();
    stitch(reader, &refs)
}
