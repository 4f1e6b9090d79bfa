//! The llama transformer, read top-down: weights (linear, block, model), then the forward pass
//! with its state hooks (what to capture, which cache to continue from), attention, MLP.
//!
//! Weights are immutable f32 tensors; everything that changes per request (the KV cache, the
//! positions, what to capture) is passed in explicitly. Cloning a [`Llama`] shares its weight
//! storage, so several experts (base + different adapters) cost one base in memory.
//!
//! Layouts at the boundary, one row per token, batch size 1:
//! - hidden states and `H_in` (the RMS-normalised input of the attention block): `(T, hidden)`;
//! - K (before or after RoPE) and V: `(T, kv_heads * head_dim)`, head-major within a row;
//! - logits: `(1, vocab)` for the last position or `(T, vocab)` for all.
//!
//! K "before RoPE" is the key projection's output in this crate's internal layout, in which RoPE
//! pairs adjacent dimensions (see [`crate::config::RopeVariant`]); for a model loaded from a
//! half-split Hugging Face checkpoint it is a per-head permutation of that checkpoint's keys.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};

use crate::cache::KvCache;
use crate::config::LlamaConfig;
use crate::decode_products::DecodeProducts;
use crate::decode_weights::{DecodeWeights, Narrow};
use crate::error::ForwardError;
use crate::kernels::{self, LowRank, LowRankTerm, PackedWeight};
use crate::ops;
use crate::prefill_matmul::PrefillMatmul;
use crate::rope::Rope;

/// Query rows per attention chunk: bounds the score matrix at `heads * CHUNK * keys` floats
/// (about 19 MB at 2,048 keys for 9 heads) and lets each chunk skip the keys its causal mask
/// hides.
const ATTN_CHUNK: usize = 256;

/// The LoRA term of one projection, applied on the fly: `scale * (x A^T) B^T`.
#[derive(Debug, Clone)]
pub(crate) struct LoraDelta {
    /// `(rank, in)`.
    pub a: Tensor,
    /// `(out, rank)`, rows in the model's internal layout.
    pub b: Tensor,
    pub scale: f64,
}

/// `t` in bf16 where that holds each of its values exactly (an adapter saved in bf16, scaled by
/// a power of two), else `t`: half the bytes for a decode step to stream, the same products.
fn narrowest(t: Tensor) -> candle_core::Result<Tensor> {
    let narrow = t.to_dtype(DType::BF16)?;
    let exact = narrow
        .to_dtype(DType::F32)?
        .eq(&t)?
        .min_all()?
        .to_scalar::<u8>()?
        == 1;
    Ok(if exact { narrow } else { t })
}

impl LoraDelta {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        ops::linear(&ops::linear(x, &self.a)?, &self.b)? * self.scale
    }
}

/// One projection of a [`Linear`]: its rows and, on the fly, its adapter term.
#[derive(Debug, Clone)]
pub(crate) struct Part {
    pub proj: Proj,
    pub rows: usize,
    pub lora: Option<LoraDelta>,
}

/// `y = x W^T` (no bias in llama) for one projection, or for several that read the same input
/// fused into one weight: q/k/v and gate/up run as one wider matmul each (fewer passes over the
/// input and fewer thread fork/joins than three and two narrow ones). An adapter applied on the
/// fly adds its low-rank term per part, so experts keep the fused base matmul.
///
/// This is the one place where the forward pass differs between inference, on-the-fly experts
/// and training: the weight multiplies through [`ops::linear`] (frozen when gradients flow) and
/// the parts' adapter terms are added when present. Everything else runs the same code.
///
/// A decode step's few rows multiply the weight's narrow copy when it has one
/// ([`crate::decode_weights`]); everything else multiplies the f32 weight, on AMX tiles when
/// `tiles` ([`crate::prefill_matmul`]).
#[derive(Debug, Clone)]
pub(crate) struct Linear {
    /// `(out, in)`: the parts' rows, one part after another.
    pub weight: Tensor,
    pub parts: Vec<Part>,
    /// `weight` in a block format, for decode steps.
    pub narrow: Option<Narrow>,
    /// Whether prefill rows multiply on AMX tiles ([`crate::prefill_matmul`]).
    pub tiles: bool,
    /// The products of decode rows on `narrow` ([`crate::decode_products`]).
    pub products: DecodeProducts,
    /// The parts' adapter terms laid out for decode steps ([`Linear::stack_adapter`]); the
    /// parts' own terms are views of it.
    pub low_rank: Option<Arc<LowRank>>,
}

impl Linear {
    /// Fuses `(projection, weight (rows, in), packed weight)` parts, in order. The packed copies
    /// are fused when every part has one in one format.
    fn fuse(parts: Vec<(Proj, Tensor, Option<PackedWeight>)>) -> candle_core::Result<Self> {
        let weight = if parts.len() == 1 {
            parts[0].1.clone()
        } else {
            Tensor::cat(&parts.iter().map(|(_, w, _)| w).collect::<Vec<_>>(), 0)?
        };
        let packed: Option<Vec<&PackedWeight>> = parts.iter().map(|(_, _, p)| p.as_ref()).collect();
        let narrow = packed
            .and_then(|p| PackedWeight::concat_rows(&p))
            .map(|p| Narrow::new(p, &weight));
        let parts = parts
            .into_iter()
            .map(|(proj, w, _)| {
                Ok(Part {
                    proj,
                    rows: w.dim(0)?,
                    lora: None,
                })
            })
            .collect::<candle_core::Result<_>>()?;
        Ok(Self {
            weight,
            parts,
            narrow,
            tiles: false,
            products: DecodeProducts::Int,
            low_rank: None,
        })
    }

    /// `x W^T` with the base weight: the narrow copy when `narrow` (rows of decode-shaped
    /// sequences, see [`decode_shaped`]) and it holds this weight's values, the f32 weight
    /// otherwise.
    fn base(&self, x: &Tensor, narrow: bool) -> candle_core::Result<Tensor> {
        let packed = self.narrow.as_ref().and_then(|n| n.of(&self.weight));
        let packed = packed.filter(|_| narrow).map(|p| (p, self.products.isa()));
        ops::linear_packed(x, &self.weight, packed, self.tiles)
    }

    /// The first row of `proj` and its part.
    fn part(&self, proj: Proj) -> Option<(usize, &Part)> {
        let mut row = 0;
        for p in &self.parts {
            if p.proj == proj {
                return Some((row, p));
            }
            row += p.rows;
        }
        None
    }

    /// The base weight of one projection, `(rows, in)`, a view into the fused weight.
    pub(crate) fn weight_of(&self, proj: Proj) -> candle_core::Result<Tensor> {
        match self.part(proj) {
            Some((row, p)) => self.weight.narrow(0, row, p.rows),
            None => candle_core::bail!("{proj:?} is not part of this projection"),
        }
    }

    /// Sets (or clears) the on-the-fly adapter term of `proj`; [`Linear::stack_adapter`] lays
    /// the terms out for decode steps once they are all set.
    pub(crate) fn set_lora(&mut self, proj: Proj, lora: Option<LoraDelta>) {
        if let Some(p) = self.parts.iter_mut().find(|p| p.proj == proj) {
            p.lora = lora;
        }
        self.low_rank = None;
    }

    /// Lays the parts' adapter terms out for decode steps ([`LowRank`]: the `A`s stacked, each
    /// `B` transposed and scaled, each in bf16 where that holds its values exactly) and makes
    /// each part's term a view of that layout, so that the adapter is held once. Terms that are
    /// training variables stay as they are (a layout would be a stale copy after the next
    /// step), and so do terms in another dtype than f32 or bf16.
    pub(crate) fn stack_adapter(&mut self) -> candle_core::Result<()> {
        self.low_rank = None;
        let mut adapted = Vec::new();
        let mut col = 0;
        for (i, p) in self.parts.iter().enumerate() {
            if let Some(l) = &p.lora {
                let held = |t: &Tensor| matches!(t.dtype(), DType::F32 | DType::BF16);
                if l.a.is_variable() || l.b.is_variable() || !held(&l.a) || !held(&l.b) {
                    return Ok(());
                }
                adapted.push((i, col, l));
            }
            col += p.rows;
        }
        if adapted.is_empty() {
            return Ok(());
        }
        // In f32 first: a part laid out before (a view, maybe in bf16) joins the others exactly.
        let wide = |t: &Tensor| t.to_dtype(DType::F32);
        let parts_a = adapted
            .iter()
            .map(|(_, _, l)| wide(&l.a))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let a = narrowest(Tensor::cat(&parts_a, 0)?)?;
        let mut terms = Vec::with_capacity(adapted.len());
        let mut at = 0;
        for &(_, col, l) in &adapted {
            let bt = narrowest((wide(&l.b)?.t()? * l.scale)?.contiguous()?)?;
            terms.push(LowRankTerm { col, at, bt });
            at += l.a.dim(0)?;
        }
        let views: Vec<(usize, LoraDelta)> = adapted
            .iter()
            .zip(&terms)
            .map(|(&(i, _, _), t)| {
                Ok((
                    i,
                    LoraDelta {
                        a: a.narrow(0, t.at, t.bt.dim(0)?)?,
                        b: t.bt.t()?,
                        scale: 1.0,
                    },
                ))
            })
            .collect::<candle_core::Result<_>>()?;
        for (i, view) in views {
            self.parts[i].lora = Some(view);
        }
        self.low_rank = Some(Arc::new(LowRank { a, terms }));
        Ok(())
    }

    /// Adds `delta` `(rows, in)` to the weight rows of `proj`, in a new weight tensor (the old
    /// one may be shared with another model).
    pub(crate) fn add_to_weight(&mut self, proj: Proj, delta: &Tensor) -> candle_core::Result<()> {
        let Some((row, part)) = self.part(proj) else {
            candle_core::bail!("{proj:?} is not part of this projection");
        };
        let (rows, width) = self.weight.dims2()?;
        let mut pieces = Vec::with_capacity(3);
        if row > 0 {
            pieces.push(Tensor::zeros((row, width), DType::F32, &Device::Cpu)?);
        }
        pieces.push(delta.clone());
        let after = rows - row - part.rows;
        if after > 0 {
            pieces.push(Tensor::zeros((after, width), DType::F32, &Device::Cpu)?);
        }
        self.weight = (&self.weight + Tensor::cat(&pieces, 0)?)?;
        Ok(())
    }

    /// One part's output `(T, rows)`: its base rows and its adapter term.
    /// In f32 when not `tiles`, whatever the model's prefill setting.
    fn forward_part(&self, proj: Proj, x: &Tensor, tiles: bool) -> candle_core::Result<Tensor> {
        let Some((_, part)) = self.part(proj) else {
            candle_core::bail!("{proj:?} is not part of this projection");
        };
        let y = ops::linear_packed(x, &self.weight_of(proj)?, None, tiles)?;
        match &part.lora {
            Some(l) => y + l.forward(x)?,
            None => Ok(y),
        }
    }

    /// `x W^T` plus the adapter terms, `x` the rows of one sequence or of several that are all
    /// decode-shaped (`narrow`) or all not.
    fn forward(&self, x: &Tensor, narrow: bool) -> candle_core::Result<Tensor> {
        if narrow {
            if let Some(y) = self.forward_decode(x, &[(self, x.dim(0)?)])? {
                return Ok(y);
            }
        }
        let y = self.base(x, narrow)?;
        match self.lora_delta(x)? {
            Some(delta) => y + delta,
            None => Ok(y),
        }
    }

    /// The rows of models that share this base weight (`runs`: each one's linear and rows, in
    /// row order) on its narrow copy, each model's adapter term added in the same pass
    /// ([`kernels::linear_narrow_low_rank`]). `None` where that path does not apply (no narrow
    /// copy, or gradients); the caller then takes the general one.
    fn forward_decode(
        &self,
        x: &Tensor,
        runs: &[(&Linear, usize)],
    ) -> candle_core::Result<Option<Tensor>> {
        let Some(packed) = self.narrow.as_ref().and_then(|n| n.of(&self.weight)) else {
            return Ok(None);
        };
        if x.track_op() || x.dtype() != DType::F32 {
            return Ok(None);
        }
        let (mut stacked, mut other, mut r0) = (Vec::new(), Vec::new(), 0);
        for &(lin, rows) in runs {
            match &lin.low_rank {
                Some(l) => stacked.push((r0, rows, &**l)),
                None if lin.parts.iter().any(|p| p.lora.is_some()) => other.push((r0, rows, lin)),
                None => {}
            }
            r0 += rows;
        }
        let isa = self.products.isa();
        let y = kernels::linear_narrow_low_rank(&x.contiguous()?, packed, isa, &stacked)?;
        if other.is_empty() {
            return Ok(Some(y));
        }
        // Terms not laid out for decode (a model in training): added the general way.
        let mut pieces = Vec::new();
        let mut at = 0;
        for (r0, rows, lin) in other {
            if r0 > at {
                pieces.push(y.narrow(0, at, r0 - at)?);
            }
            let d = lin.lora_delta(&x.narrow(0, r0, rows)?)?;
            let ys = y.narrow(0, r0, rows)?;
            pieces.push(match d {
                Some(d) => (ys + d)?,
                None => ys,
            });
            at = r0 + rows;
        }
        if at < y.dim(0)? {
            pieces.push(y.narrow(0, at, y.dim(0)? - at)?);
        }
        Ok(Some(Tensor::cat(&pieces, 0)?))
    }

    /// Whether `self` and `other` multiply by the same base weight the same way (so that their
    /// rows can share one matmul).
    fn same_base(&self, other: &Linear) -> bool {
        self.weight.id() == other.weight.id()
            && self.tiles == other.tiles
            && self.products == other.products
            && match (&self.narrow, &other.narrow) {
                (None, None) => true,
                (Some(a), Some(b)) => a.same(b),
                _ => false,
            }
    }

    /// The adapter terms of all parts for `x` `(T, in)`, side by side `(T, out)`; `None`
    /// without an adapter on the fly.
    fn lora_delta(&self, x: &Tensor) -> candle_core::Result<Option<Tensor>> {
        if self.parts.iter().all(|p| p.lora.is_none()) {
            return Ok(None);
        }
        let t = x.dim(0)?;
        let deltas = self
            .parts
            .iter()
            .map(|p| match &p.lora {
                Some(l) => l.forward(x),
                None => Tensor::zeros((t, p.rows), DType::F32, &Device::Cpu),
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Some(match deltas.as_slice() {
            [one] => one.clone(),
            many => Tensor::cat(many, 1)?,
        }))
    }
}

/// The same projection of several sequences' models over their rows of `x`, stacked in
/// `parts` order (`(linear, rows)` each). Models that share the base weight (experts applied on
/// the fly over one base) share one matmul over all their rows, the way Punica and S-LoRA batch
/// LoRA experts; each model's own adapter term is then added to its rows only. Decode is
/// bound by streaming the weights, so one pass over them for many rows is the whole gain.
fn forward_rows(parts: &[(&Linear, usize)], x: &Tensor) -> candle_core::Result<Tensor> {
    let Some(&(first, _)) = parts.first() else {
        candle_core::bail!("no rows to project");
    };
    let narrow = |n: usize| decode_shaped(n);
    let kind = narrow(parts[0].1);
    if parts
        .iter()
        .all(|&(l, n)| std::ptr::eq(l, first) && narrow(n) == kind)
    {
        return first.forward(x, kind);
    }
    let mut outs = Vec::with_capacity(parts.len());
    let (mut i, mut row) = (0, 0);
    while i < parts.len() {
        let run = parts[i..]
            .iter()
            .take_while(|&&(l, n)| l.same_base(parts[i].0) && narrow(n) == narrow(parts[i].1))
            .count();
        let rows: usize = parts[i..i + run].iter().map(|&(_, n)| n).sum();
        if narrow(parts[i].1) {
            if let Some(y) = parts[i]
                .0
                .forward_decode(&x.narrow(0, row, rows)?, &parts[i..i + run])?
            {
                outs.push(y);
                i += run;
                row += rows;
                continue;
            }
        }
        let y = parts[i]
            .0
            .base(&x.narrow(0, row, rows)?, narrow(parts[i].1))?;
        // Within the run, consecutive rows of one model add one adapter term.
        let (mut j, mut r) = (i, 0);
        while j < i + run {
            let lin = parts[j].0;
            let same = parts[j..i + run]
                .iter()
                .take_while(|(l, _)| std::ptr::eq(*l, lin))
                .count();
            let n: usize = parts[j..j + same].iter().map(|&(_, n)| n).sum();
            let ys = y.narrow(0, r, n)?;
            outs.push(match lin.lora_delta(&x.narrow(0, row + r, n)?)? {
                Some(d) => (ys + d)?,
                None => ys,
            });
            j += same;
            r += n;
        }
        i += run;
        row += rows;
    }
    Tensor::cat(&outs, 0)
}

/// Whether a sequence's `rows` in a pass are a decode step's (a few new tokens: the narrow
/// decode weights) rather than a prefill's (the f32 weights). Decided per sequence, not per
/// pass, so that a job's arithmetic is the same alone and batched with any number of others.
pub(crate) fn decode_shaped(rows: usize) -> bool {
    rows <= kernels::MAX_ROWS
}

/// The projections of a block that LoRA can adapt.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Proj {
    /// Query projection.
    Q,
    /// Key projection.
    K,
    /// Value projection.
    V,
    /// Attention output projection.
    O,
    /// MLP gate.
    Gate,
    /// MLP up.
    Up,
    /// MLP down.
    Down,
}

impl Proj {
    /// All seven, in block order.
    pub const ALL: [Proj; 7] = [
        Proj::Q,
        Proj::K,
        Proj::V,
        Proj::O,
        Proj::Gate,
        Proj::Up,
        Proj::Down,
    ];

    /// The four attention projections: an adapter on these alone edits K and V directly.
    pub const ATTENTION: [Proj; 4] = [Proj::Q, Proj::K, Proj::V, Proj::O];

    /// Parses a list of targets: `all`, `attention`, or comma-separated short names
    /// (`q,k,v,o,gate,up,down`), in block order without repeats.
    pub fn parse_list(s: &str) -> Option<Vec<Proj>> {
        match s {
            "all" => return Some(Proj::ALL.to_vec()),
            "attention" => return Some(Proj::ATTENTION.to_vec()),
            _ => {}
        }
        let mut out = Vec::new();
        for name in s.split(',').map(str::trim) {
            let p = Proj::ALL.into_iter().find(|p| p.short_name() == name)?;
            out.push(p);
        }
        out.sort();
        out.dedup();
        (!out.is_empty()).then_some(out)
    }

    /// The short name (`q`, `gate`, ..), as in a target list.
    pub fn short_name(self) -> &'static str {
        match self {
            Proj::Q => "q",
            Proj::K => "k",
            Proj::V => "v",
            Proj::O => "o",
            Proj::Gate => "gate",
            Proj::Up => "up",
            Proj::Down => "down",
        }
    }

    /// The Hugging Face module path inside a decoder layer (`self_attn.q_proj`, `mlp.up_proj`..).
    pub fn hf_name(self) -> &'static str {
        match self {
            Proj::Q => "self_attn.q_proj",
            Proj::K => "self_attn.k_proj",
            Proj::V => "self_attn.v_proj",
            Proj::O => "self_attn.o_proj",
            Proj::Gate => "mlp.gate_proj",
            Proj::Up => "mlp.up_proj",
            Proj::Down => "mlp.down_proj",
        }
    }

    /// `(out, in)` of the projection's weight for `cfg`.
    pub fn shape(self, cfg: &LlamaConfig) -> (usize, usize) {
        let h = cfg.hidden_size;
        match self {
            Proj::Q => (cfg.q_dim(), h),
            Proj::K | Proj::V => (cfg.kv_dim(), h),
            Proj::O => (h, cfg.q_dim()),
            Proj::Gate | Proj::Up => (cfg.intermediate_size, h),
            Proj::Down => (h, cfg.intermediate_size),
        }
    }
}

/// One transformer block's weights.
#[derive(Debug, Clone)]
pub(crate) struct Block {
    pub attn_norm: Tensor,
    /// q, k and v fused: `(q_dim + 2 kv_dim, hidden)`.
    pub qkv: Linear,
    pub o: Linear,
    pub ffn_norm: Tensor,
    /// gate and up fused: `(2 intermediate, hidden)`.
    pub gate_up: Linear,
    pub down: Linear,
}

/// A block's weights as a checkpoint stores them: one `(out, in)` matrix per projection, in
/// [`Proj::ALL`] order, and each one's blocks when the checkpoint holds it in a format the
/// decode kernels take as it is.
pub(crate) struct BlockWeights {
    pub attn_norm: Tensor,
    pub ffn_norm: Tensor,
    pub projections: [Tensor; 7],
    pub packed: [Option<PackedWeight>; 7],
}

impl Block {
    /// Assembles a block, fusing q/k/v and gate/up (the separate tensors are released unless a
    /// caller keeps them).
    pub(crate) fn new(w: BlockWeights) -> candle_core::Result<Self> {
        let [q, k, v, o, gate, up, down] = w.projections;
        let [pq, pk, pv, po, pgate, pup, pdown] = w.packed;
        Ok(Self {
            attn_norm: w.attn_norm,
            qkv: Linear::fuse(vec![(Proj::Q, q, pq), (Proj::K, k, pk), (Proj::V, v, pv)])?,
            o: Linear::fuse(vec![(Proj::O, o, po)])?,
            ffn_norm: w.ffn_norm,
            gate_up: Linear::fuse(vec![(Proj::Gate, gate, pgate), (Proj::Up, up, pup)])?,
            down: Linear::fuse(vec![(Proj::Down, down, pdown)])?,
        })
    }

    /// The [`Linear`] that computes `p`.
    pub(crate) fn linear(&self, p: Proj) -> &Linear {
        match p {
            Proj::Q | Proj::K | Proj::V => &self.qkv,
            Proj::O => &self.o,
            Proj::Gate | Proj::Up => &self.gate_up,
            Proj::Down => &self.down,
        }
    }

    /// The block's projections, to change.
    pub(crate) fn linears_mut(&mut self) -> [&mut Linear; 4] {
        [
            &mut self.qkv,
            &mut self.o,
            &mut self.gate_up,
            &mut self.down,
        ]
    }

    /// The [`Linear`] that computes `p`, to change.
    pub(crate) fn linear_mut(&mut self, p: Proj) -> &mut Linear {
        match p {
            Proj::Q | Proj::K | Proj::V => &mut self.qkv,
            Proj::O => &mut self.o,
            Proj::Gate | Proj::Up => &mut self.gate_up,
            Proj::Down => &mut self.down,
        }
    }
}

/// Where the weights came from, for manifests and logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelIdentity {
    /// Hex SHA-256 of the weight file (of config and weights for a directory).
    pub sha256: String,
    /// The path the model was loaded from.
    pub source: std::path::PathBuf,
    /// The applied adapter's content hash ([`crate::LoraAdapter::content_sha256`]), if any: an
    /// expert is its base file plus this.
    pub adapter_sha256: Option<String>,
}

impl ModelIdentity {
    /// The name of the file the model was loaded from (empty for a path without one).
    pub fn file_name(&self) -> String {
        self.source
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default()
    }
}

/// A llama-family model with f32 weights.
#[derive(Debug, Clone)]
pub struct Llama {
    pub(crate) cfg: LlamaConfig,
    /// `(vocab, hidden)`.
    pub(crate) embed: Tensor,
    pub(crate) blocks: Vec<Block>,
    pub(crate) norm: Tensor,
    /// `(vocab, hidden)`; shares the embedding's storage when tied.
    pub(crate) lm_head: Tensor,
    /// `lm_head` in a block format, for decode steps.
    pub(crate) head_narrow: Option<Narrow>,
    /// The kernel of prefill products ([`crate::prefill_matmul`]).
    pub(crate) prefill: PrefillMatmul,
    /// The products of decode steps on narrow weights ([`crate::decode_products`]).
    pub(crate) products: DecodeProducts,
    pub(crate) rope: Rope,
    /// The base model file's RoPE, which `rope` differs from when an adapter brings its own:
    /// the producer (the base) rotated the keys of any cache it serves with this one.
    pub(crate) base_rope: Rope,
    pub(crate) identity: ModelIdentity,
}

/// What a forward pass records, per layer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Capture {
    /// K before RoPE, `(T, kv_heads * head_dim)`.
    pub k_pre_rope: bool,
    /// V, `(T, kv_heads * head_dim)`.
    pub v: bool,
    /// `H_in`, the RMS-normalised input of the attention block, `(T, hidden)`.
    pub h_in: bool,
    /// The residual stream entering the layer, `(T, hidden)`: the input of
    /// [`Llama::forward_layers`] for a run that starts at this layer.
    pub hidden: bool,
    /// Which layers; `None` means all.
    pub layers: Option<Vec<usize>>,
}

impl Capture {
    /// Capture nothing.
    pub fn none() -> Self {
        Self::default()
    }

    /// Capture everything at every layer.
    pub fn all() -> Self {
        Self {
            k_pre_rope: true,
            v: true,
            h_in: true,
            hidden: true,
            layers: None,
        }
    }

    fn wants(&self, layer: usize) -> bool {
        (self.k_pre_rope || self.v || self.h_in || self.hidden)
            && self.layers.as_ref().is_none_or(|ls| ls.contains(&layer))
    }
}

/// What one layer recorded.
#[derive(Debug, Clone)]
pub struct LayerCapture {
    /// The layer index.
    pub layer: usize,
    /// K before RoPE, `(T, kv_heads * head_dim)`.
    pub k_pre_rope: Option<Tensor>,
    /// V, `(T, kv_heads * head_dim)`.
    pub v: Option<Tensor>,
    /// `H_in`, `(T, hidden)`.
    pub h_in: Option<Tensor>,
    /// Residual stream entering the layer, `(T, hidden)`.
    pub hidden: Option<Tensor>,
}

/// Which logits a forward pass computes. The output projection is as wide as the vocabulary, so
/// computing it for every position of a long prompt costs more than a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogitsWanted {
    /// Only the last position: `(1, vocab)`.
    #[default]
    Last,
    /// Every position: `(T, vocab)`.
    All,
    /// None (prefill of a cache, capture runs).
    None,
}

/// One forward pass: tokens, where they go, and the hooks.
#[derive(Debug)]
pub struct Input<'a> {
    /// The new tokens.
    pub tokens: &'a [u32],
    /// Position of the first new token; the rest follow contiguously.
    pub start_pos: usize,
    /// A cache to attend to and extend; without one the tokens attend only to each other.
    pub cache: Option<&'a mut KvCache>,
    /// What to record.
    pub capture: Capture,
    /// Which logits to compute.
    pub logits: LogitsWanted,
}

impl<'a> Input<'a> {
    /// `tokens` at positions `0..T`, no cache, no capture, last logits.
    pub fn new(tokens: &'a [u32]) -> Self {
        Self {
            tokens,
            start_pos: 0,
            cache: None,
            capture: Capture::none(),
            logits: LogitsWanted::Last,
        }
    }

    /// Continue from `cache` (positions start at its next position) and extend it.
    pub fn with_cache(mut self, cache: &'a mut KvCache) -> Self {
        self.start_pos = cache.next_position();
        self.cache = Some(cache);
        self
    }

    /// Place the first token at `pos`.
    pub fn at(mut self, pos: usize) -> Self {
        self.start_pos = pos;
        self
    }

    /// Record `capture`.
    pub fn capture(mut self, capture: Capture) -> Self {
        self.capture = capture;
        self
    }

    /// Compute `logits`.
    pub fn logits(mut self, logits: LogitsWanted) -> Self {
        self.logits = logits;
        self
    }
}

/// The result of a forward pass.
#[derive(Debug)]
pub struct Output {
    /// Logits as asked for; `None` with [`LogitsWanted::None`].
    pub logits: Option<Tensor>,
    /// Recorded layers in increasing layer order.
    pub captured: Vec<LayerCapture>,
    /// The residual stream after the last layer (before the final norm), `(T, hidden)`; kept
    /// only when `capture.hidden` is set.
    pub final_hidden: Option<Tensor>,
}

/// One sequence of [`Llama::forward_batch`].
#[derive(Debug)]
pub struct Sequence<'a> {
    /// Its model: the base or an expert of it.
    pub model: &'a Llama,
    /// The new tokens (at least one), placed from the cache's next position on.
    pub tokens: &'a [u32],
    /// Its cache, extended by `tokens`.
    pub cache: &'a mut KvCache,
}

impl Output {
    /// The capture of `layer`, if recorded.
    pub fn layer(&self, layer: usize) -> Option<&LayerCapture> {
        self.captured.iter().find(|c| c.layer == layer)
    }
}

impl Llama {
    /// Assembles a model from loaded weights; `output` is `None` when the checkpoint ties the
    /// output head to the embedding (then both share one storage). `head_packed` is the output
    /// head's (or the tied embedding's) blocks, when the checkpoint has them in a format the
    /// decode kernels take. The decode weights are then made as `decode` says.
    pub(crate) fn assemble(
        cfg: LlamaConfig,
        embed: Tensor,
        blocks: Vec<BlockWeights>,
        norm: Tensor,
        (output, head_packed): (Option<Tensor>, Option<PackedWeight>),
        identity: ModelIdentity,
        (decode, products, prefill): (DecodeWeights, DecodeProducts, PrefillMatmul),
    ) -> candle_core::Result<Self> {
        let blocks = blocks
            .into_iter()
            .map(Block::new)
            .collect::<candle_core::Result<Vec<_>>>()?;
        let lm_head = output.unwrap_or_else(|| embed.clone());
        let head_narrow = head_packed.map(|p| Narrow::new(p, &lm_head));
        let mut model = Llama {
            rope: Rope::new(&cfg),
            base_rope: Rope::new(&cfg),
            cfg,
            embed,
            blocks,
            norm,
            lm_head,
            head_narrow,
            prefill: PrefillMatmul::F32,
            products: DecodeProducts::Int,
            identity,
        };
        model.set_decode_weights(decode)?;
        model.set_decode_products(products);
        model.set_prefill_matmul(prefill);
        Ok(model)
    }

    /// The configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// The RoPE of this model, for re-positioning captured or injected keys.
    pub fn rope(&self) -> &Rope {
        &self.rope
    }

    /// The RoPE of the base model file this model was loaded from (its adapter may bring
    /// another): the rotation of the keys in a cache the base serves.
    pub fn base_rope(&self) -> &Rope {
        &self.base_rope
    }

    /// Where the weights came from.
    pub fn identity(&self) -> &ModelIdentity {
        &self.identity
    }

    /// The token embedding, `(vocab, hidden)`.
    pub fn embedding(&self) -> &Tensor {
        &self.embed
    }

    /// A fresh cache for this model.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(&self.cfg)
    }

    /// Runs the model over `input.tokens`.
    ///
    /// One pass for every use: when an adapter applied on the fly holds `Var`s the pass records
    /// gradients for them (training), otherwise it runs the fused inference kernels.
    pub fn forward(&self, input: Input<'_>) -> Result<Output, ForwardError> {
        let Input {
            tokens,
            start_pos,
            cache,
            capture,
            logits,
        } = input;
        if tokens.is_empty() {
            return Err(ForwardError::EmptyInput);
        }
        if let Some(&id) = tokens
            .iter()
            .find(|&&id| id as usize >= self.cfg.vocab_size)
        {
            return Err(ForwardError::TokenOutOfRange {
                id,
                vocab: self.cfg.vocab_size,
            });
        }
        let ids = Tensor::new(tokens, &Device::Cpu)?;
        let x = self.embed.index_select(&ids, 0)?;
        let mut captured = Vec::new();
        let mut seqs = [Rows {
            model: self,
            rows: tokens.len(),
            start_pos,
            cache,
        }];
        let x = self.run_layers(
            x,
            0..self.cfg.num_layers,
            &mut seqs,
            &capture,
            &mut captured,
        )?;
        let logits = self.logits(&x, logits)?;
        Ok(Output {
            logits,
            captured,
            final_hidden: capture.hidden.then_some(x),
        })
    }

    /// One step of several sequences at once: each sequence's `tokens` go on top of its cache,
    /// and the logits of each sequence's last token come back as the rows of a
    /// `(seqs.len(), vocab)` matrix, in `seqs` order.
    ///
    /// The sequences may sit at different positions and use different models, as long as the
    /// models are the same base (experts of it, adapters merged or on the fly): each weight is
    /// streamed once per step for all the rows that share it, which is what makes decoding
    /// several jobs together cheaper than one after another. Each sequence computes what
    /// [`Llama::forward`] computes for it alone, up to the order of float sums in the matmuls.
    pub fn forward_batch(seqs: &mut [Sequence<'_>]) -> Result<Tensor, ForwardError> {
        let Some(base) = seqs.first().map(|s| s.model) else {
            return Err(ForwardError::EmptyInput);
        };
        // An expert may rotate with its own RoPE base; everything else is the base's.
        let shape = |m: &Llama| LlamaConfig {
            rope_theta: 0.0,
            ..m.cfg.clone()
        };
        for s in seqs.iter() {
            if shape(s.model) != shape(base) || s.model.identity.sha256 != base.identity.sha256 {
                return Err(ForwardError::MixedBases {
                    first: base.identity.sha256.clone(),
                    other: s.model.identity.sha256.clone(),
                });
            }
            if s.tokens.is_empty() {
                return Err(ForwardError::EmptyInput);
            }
            if let Some(&id) = s
                .tokens
                .iter()
                .find(|&&id| id as usize >= base.cfg.vocab_size)
            {
                return Err(ForwardError::TokenOutOfRange {
                    id,
                    vocab: base.cfg.vocab_size,
                });
            }
        }
        // Rows of models sharing a base weight go next to each other (one matmul), and rows of
        // one model next to each other within that (one adapter term); the sort is stable.
        let group = |m: &Llama| {
            let id = m.blocks.first().map(|b| b.qkv.weight.id());
            let by_weight = seqs
                .iter()
                .position(|t| t.model.blocks.first().map(|b| b.qkv.weight.id()) == id);
            let by_model = seqs.iter().position(|t| std::ptr::eq(t.model, m));
            (by_weight, by_model)
        };
        let keys: Vec<_> = seqs.iter().map(|s| group(s.model)).collect();
        let mut order: Vec<usize> = (0..seqs.len()).collect();
        order.sort_by_key(|&i| keys[i]);
        let mut ids = Vec::new();
        let mut last_rows = vec![0u32; seqs.len()];
        for &i in &order {
            ids.extend_from_slice(seqs[i].tokens);
            last_rows[i] = (ids.len() - 1) as u32;
        }
        let mut by_slot: Vec<Option<&mut Sequence<'_>>> = seqs.iter_mut().map(Some).collect();
        let mut rows = Vec::with_capacity(order.len());
        for &i in &order {
            if let Some(s) = by_slot[i].take() {
                rows.push(Rows {
                    model: s.model,
                    rows: s.tokens.len(),
                    start_pos: s.cache.next_position(),
                    cache: Some(&mut *s.cache),
                });
            }
        }
        let x = base
            .embed
            .index_select(&Tensor::new(ids.as_slice(), &Device::Cpu)?, 0)?;
        let x = base.run_layers(
            x,
            0..base.cfg.num_layers,
            &mut rows,
            &Capture::none(),
            &mut Vec::new(),
        )?;
        let last = x.index_select(&Tensor::new(last_rows.as_slice(), &Device::Cpu)?, 0)?;
        // One row per sequence, each its own decode step: the narrow head however many.
        Ok(base.head(&last, true)?)
    }

    /// Runs `layers` from the residual stream `hidden` `(T, hidden_size)` whose first row sits at
    /// `start_pos`, attending to and extending `cache` if given. Returns the residual stream
    /// after the last layer of the range; [`Llama::logits`] turns a full run into logits.
    pub fn forward_layers(
        &self,
        hidden: &Tensor,
        layers: Range<usize>,
        start_pos: usize,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor, ForwardError> {
        let mut sink = Vec::new();
        self.forward_layers_capture(
            hidden,
            layers,
            start_pos,
            cache,
            &Capture::none(),
            &mut sink,
        )
    }

    /// [`Llama::forward_layers`] that also records `capture` into `captured`.
    pub fn forward_layers_capture(
        &self,
        hidden: &Tensor,
        layers: Range<usize>,
        start_pos: usize,
        cache: Option<&mut KvCache>,
        capture: &Capture,
        captured: &mut Vec<LayerCapture>,
    ) -> Result<Tensor, ForwardError> {
        let width = self.cfg.hidden_size;
        match hidden.dims() {
            &[t, w] if t > 0 && w == width => {}
            dims => {
                return Err(ForwardError::Shape {
                    what: "hidden state".into(),
                    got: dims.to_vec(),
                    expected: vec![dims.first().copied().unwrap_or(1).max(1), width],
                })
            }
        }
        let mut seqs = [Rows {
            model: self,
            rows: hidden.dim(0)?,
            start_pos,
            cache,
        }];
        self.run_layers(hidden.clone(), layers, &mut seqs, capture, captured)
    }

    /// One projection of `layer` applied to `x` `(T, in)`, with the model's adapter if any:
    /// how a consumer regenerates K or V from an attention input it did not compute itself
    /// (K comes out before RoPE, rows in the internal layout). The base product runs where the
    /// model's prefill products do (AMX tiles or f32).
    pub fn project(&self, layer: usize, proj: Proj, x: &Tensor) -> Result<Tensor, ForwardError> {
        self.project_on(layer, proj, x, false)
    }

    /// [`Llama::project`] in f32 whatever the prefill setting: for maps composed with the
    /// projection once and then kept (a translator's fused Patch layers), whose rounding would
    /// otherwise stay in every request's products.
    pub fn project_f32(
        &self,
        layer: usize,
        proj: Proj,
        x: &Tensor,
    ) -> Result<Tensor, ForwardError> {
        self.project_on(layer, proj, x, true)
    }

    fn project_on(
        &self,
        layer: usize,
        proj: Proj,
        x: &Tensor,
        f32_only: bool,
    ) -> Result<Tensor, ForwardError> {
        let block = self.blocks.get(layer).ok_or(ForwardError::LayerRange {
            start: layer,
            end: layer + 1,
            layers: self.cfg.num_layers,
        })?;
        let (_, inp) = proj.shape(&self.cfg);
        match x.dims() {
            &[_, w] if w == inp => {
                let lin = block.linear(proj);
                Ok(lin.forward_part(proj, x, lin.tiles && !f32_only)?)
            }
            dims => Err(ForwardError::Shape {
                what: format!("input of {proj:?}"),
                got: dims.to_vec(),
                expected: vec![dims.first().copied().unwrap_or(0), inp],
            }),
        }
    }

    /// Final norm and output projection of a residual stream `(T, hidden)`.
    pub fn logits(
        &self,
        hidden: &Tensor,
        wanted: LogitsWanted,
    ) -> Result<Option<Tensor>, ForwardError> {
        let t = hidden.dim(0)?;
        let x = match wanted {
            LogitsWanted::None => return Ok(None),
            LogitsWanted::Last => hidden.narrow(0, t - 1, 1)?,
            LogitsWanted::All => hidden.clone(),
        };
        let narrow = decode_shaped(x.dim(0)?);
        Ok(Some(self.head(&x, narrow)?))
    }

    /// Final norm and output projection of rows `x`, on the narrow head when `narrow`.
    fn head(&self, x: &Tensor, narrow: bool) -> candle_core::Result<Tensor> {
        let x = ops::rms_norm(x, &self.norm, self.cfg.rms_norm_eps)?;
        let packed = self.head_narrow.as_ref().and_then(|n| n.of(&self.lm_head));
        let tiles = self.prefill == PrefillMatmul::Tiles;
        let packed = packed.filter(|_| narrow).map(|p| (p, self.products.isa()));
        ops::linear_packed(&x, &self.lm_head, packed, tiles)
    }

    /// The layers of `layers` over the rows of `x`: one sequence's, or several sequences'
    /// stacked (`seqs` in row order, each with its model, positions and cache). Norms and the
    /// embedding are the base's (`self`'s), which every sequence's model shares; RoPE and the
    /// projections are each sequence's model's (an expert may rotate with its own base);
    /// attention is per sequence.
    fn run_layers(
        &self,
        x: Tensor,
        layers: Range<usize>,
        seqs: &mut [Rows<'_, '_>],
        capture: &Capture,
        captured: &mut Vec<LayerCapture>,
    ) -> Result<Tensor, ForwardError> {
        // A decode step is some two hundred small parallel products: called from outside the
        // thread pool, each would hand its work to the pool and sleep until it is done (a
        // futex wake and wait per product: one job's step took 17.5 ms that way on 2 cores,
        // 10.8 ms from inside). Run from inside, the pool's threads split them the cheap way. A prefill's few large products gain
        // nothing, and run where they are called: on pool threads their allocations would
        // spread over more of the allocator's arenas (about 90 MB more peak RSS at 1,024).
        if seqs.iter().all(|s| decode_shaped(s.rows)) {
            let done = AtomicBool::new(false);
            rayon::scope(|scope| {
                keep_pool_awake(scope, &done);
                let out =
                    owning_a_step(|| self.run_layers_in_pool(x, layers, seqs, capture, captured));
                done.store(true, Ordering::Release);
                out
            })
        } else {
            self.run_layers_in_pool(x, layers, seqs, capture, captured)
        }
    }

    /// [`Llama::run_layers`]' work, on the thread that calls it.
    fn run_layers_in_pool(
        &self,
        mut x: Tensor,
        layers: Range<usize>,
        seqs: &mut [Rows<'_, '_>],
        capture: &Capture,
        captured: &mut Vec<LayerCapture>,
    ) -> Result<Tensor, ForwardError> {
        if layers.start > layers.end || layers.end > self.cfg.num_layers {
            return Err(ForwardError::LayerRange {
                start: layers.start,
                end: layers.end,
                layers: self.cfg.num_layers,
            });
        }
        let mut positions = Vec::with_capacity(x.dim(0)?);
        for s in seqs.iter() {
            let needed = s.start_pos + s.rows;
            if needed > self.cfg.context_length {
                return Err(ForwardError::ContextOverflow {
                    needed,
                    context: self.cfg.context_length,
                });
            }
            positions.extend((s.start_pos..needed).map(|p| p as u32));
        }
        let (cos, sin) = if seqs.iter().all(|s| s.model.rope == self.rope) {
            self.rope.cos_sin(&positions, &Device::Cpu)?
        } else {
            let (mut cos, mut sin, mut at) = (Vec::new(), Vec::new(), 0);
            for s in seqs.iter() {
                let (c, si) = s
                    .model
                    .rope
                    .cos_sin(&positions[at..at + s.rows], &Device::Cpu)?;
                cos.push(c);
                sin.push(si);
                at += s.rows;
            }
            (Tensor::cat(&cos, 0)?, Tensor::cat(&sin, 0)?)
        };
        let eps = self.cfg.rms_norm_eps;
        for l in layers {
            let block = &self.blocks[l];
            let mut rec = capture.wants(l).then(|| LayerCapture {
                layer: l,
                k_pre_rope: None,
                v: None,
                h_in: None,
                hidden: capture.hidden.then(|| x.clone()),
            });
            let h = ops::rms_norm(&x, &block.attn_norm, eps)?;
            let attn = self.attention(
                l,
                &h,
                (&cos, &sin),
                seqs,
                rec.as_mut().map(|r| (r, capture)),
            )?;
            if let Some(r) = rec.as_mut() {
                if capture.h_in {
                    r.h_in = Some(h);
                }
            }
            x = (x + attn)?;
            let h = ops::rms_norm(&x, &block.ffn_norm, eps)?;
            let act = ops::swiglu(&project_rows(seqs, l, |b| &b.gate_up, &h)?)?;
            x = (x + project_rows(seqs, l, |b| &b.down, &act)?)?;
            if let Some(r) = rec {
                captured.push(r);
            }
        }
        for s in seqs.iter_mut() {
            if let Some(c) = s.cache.as_deref_mut() {
                c.set_next_position(c.next_position().max(s.start_pos + s.rows));
            }
        }
        Ok(x)
    }

    /// Grouped-query attention of layer `layer` over `h` (the rows of `seqs`), each sequence
    /// attending to its own cache.
    fn attention(
        &self,
        layer: usize,
        h: &Tensor,
        (cos, sin): (&Tensor, &Tensor),
        seqs: &mut [Rows<'_, '_>],
        rec: Option<(&mut LayerCapture, &Capture)>,
    ) -> Result<Tensor, ForwardError> {
        let cfg = &self.cfg;
        let (n_h, n_kv, d) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let qkv = project_rows(seqs, layer, |b| &b.qkv, h)?;
        if let Some((r, c)) = rec {
            let (q_dim, kv_dim) = (n_h * d, n_kv * d);
            if c.k_pre_rope {
                r.k_pre_rope = Some(qkv.narrow(1, q_dim, kv_dim)?.contiguous()?);
            }
            if c.v {
                r.v = Some(qkv.narrow(1, q_dim + kv_dim, kv_dim)?.contiguous()?);
            }
        }
        // Scaling q before the product costs T * q_dim multiplications instead of one per score.
        let q_scale = 1.0 / (d as f32).sqrt();
        let heads = ops::split_qkv_rope(&qkv, cos, sin, (n_h, n_kv, d), q_scale)?;
        let mut outs = Vec::new();
        // Each sequence attends with its own model's kernels, so that a job computes the same
        // alone and batched.
        if let [one] = seqs {
            one.model
                .attend(layer, heads, one.cache.as_deref_mut(), &mut outs)?;
        } else {
            let mut row = 0;
            let mut inputs = Vec::with_capacity(seqs.len());
            for s in seqs.iter_mut() {
                // Views, not copies: the cache copies the keys and values it appends, and the
                // attention reads the queries in place.
                let rows = |x: &Tensor| x.narrow(1, row, s.rows);
                let own = ops::Heads {
                    q: rows(&heads.q)?,
                    k_rot: rows(&heads.k_rot)?,
                    v: rows(&heads.v)?,
                };
                inputs.push((
                    s.model,
                    s.model.attend_inputs(layer, own, s.cache.as_deref_mut())?,
                ));
                row += s.rows;
            }
            // A batched decode step: every sequence's heads in one parallel pass.
            if inputs.iter().all(|(_, a)| a.few()) {
                let few: Vec<_> = inputs
                    .iter()
                    .map(|(_, a)| kernels::FewQueries {
                        q: &a.q,
                        k: &a.keys,
                        v: &a.values,
                        past: a.past,
                    })
                    .collect();
                outs = kernels::attend_few_many(&few)?;
            } else {
                for (model, a) in inputs {
                    model.attend_on(a, &mut outs)?;
                }
            }
        }
        Ok(project_rows(
            seqs,
            layer,
            |b| &b.o,
            &ops::merge_heads(&outs)?,
        )?)
    }

    /// One sequence's attention outputs, pushed onto `outs` as `(n_heads, rows, head_dim)`
    /// chunks.
    fn attend(
        &self,
        layer: usize,
        heads: ops::Heads,
        cache: Option<&mut KvCache>,
        outs: &mut Vec<Tensor>,
    ) -> Result<(), ForwardError> {
        let inputs = self.attend_inputs(layer, heads, cache)?;
        self.attend_on(inputs, outs)
    }

    /// One sequence's queries with the keys and values they attend to: its new keys and values
    /// appended to `cache` (if given) and the cache's views of the layer.
    fn attend_inputs(
        &self,
        layer: usize,
        heads: ops::Heads,
        cache: Option<&mut KvCache>,
    ) -> Result<AttendInputs, ForwardError> {
        let (keys, values, past) = match cache {
            Some(cache) => {
                let past = cache.layer_len(layer);
                // A decode step on narrow weights keeps the layer in f16 from here on
                // (crate::cache says why).
                let plain = !heads.k_rot.track_op() && !heads.v.track_op();
                let f16 = self.head_narrow.is_some()
                    && plain
                    && heads.q.dim(1)? <= kernels::MAX_QUERY_ROWS;
                cache.append(layer, &heads.k_rot, &heads.v, f16)?;
                let (k_all, v_all) = cache
                    .views(layer)?
                    .ok_or_else(|| candle_core::Error::Msg("cache layer vanished".into()))?;
                (k_all, v_all, past)
            }
            None => (heads.k_rot, heads.v, 0),
        };
        Ok(AttendInputs {
            q: heads.q,
            keys,
            values,
            past,
        })
    }

    /// The attention of [`Llama::attend_inputs`], pushed onto `outs`.
    ///
    /// Queries of the heads that share a key/value head are stacked into one matrix per KV head,
    /// `(kv_heads, groups * T, head_dim)`, so keys and values are never repeated per query head.
    /// Query rows go in chunks of [`ATTN_CHUNK`], each multiplying only the keys its causal mask
    /// lets it see.
    fn attend_on(&self, inputs: AttendInputs, outs: &mut Vec<Tensor>) -> Result<(), ForwardError> {
        let cfg = &self.cfg;
        let (n_h, n_kv, d) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let groups = n_h / n_kv;
        let few = inputs.few();
        let AttendInputs {
            q,
            keys,
            values,
            past,
        } = inputs;
        let t = q.dim(1)?;
        if few {
            outs.push(kernels::attend_few(&q, &keys, &values, past)?);
            return Ok(());
        }
        // A prefill on top of a cache that decode steps turned f16 (a conversation's next
        // turn): its products are f32.
        let (keys, values) = (keys.to_dtype(DType::F32)?, values.to_dtype(DType::F32)?);
        let plain = |x: &Tensor| !x.track_op();
        if plain(&q) && plain(&keys) && plain(&values) && self.prefill == PrefillMatmul::Tiles {
            outs.push(kernels::attend_tiles(&q, &keys, &values, past)?);
            return Ok(());
        }
        // (n_h, T, d) -> (n_kv, groups, T, d): head h uses KV head h / groups.
        let q = q.reshape((n_kv, groups, t, d))?;
        let keys_t = keys.transpose(1, 2)?;
        let mut start = 0;
        while start < t {
            let rows = ATTN_CHUNK.min(t - start);
            // Causality: the chunk's last query sees the past plus new keys up to itself.
            let n_keys = past + start + rows;
            let qc = q
                .narrow(2, start, rows)?
                .contiguous()?
                .reshape((n_kv, groups * rows, d))?;
            let kc = keys_t.narrow(2, 0, n_keys)?;
            let vc = values.narrow(1, 0, n_keys)?;
            let scores = qc.matmul(&kc)?.reshape((n_kv, groups, rows, n_keys))?;
            let probs = ops::causal_softmax(scores, past + start)?.reshape((
                n_kv,
                groups * rows,
                n_keys,
            ))?;
            outs.push(probs.matmul(&vc)?.reshape((n_h, rows, d))?);
            start += rows;
        }
        Ok(())
    }
}

/// A sequence's queries `(n_h, T, d)` and the keys and values `(n_kv, past + T, d)` they attend
/// to, the first `past` from before.
struct AttendInputs {
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    past: usize,
}

impl AttendInputs {
    /// Whether [`kernels::attend_few`] takes them: few query rows, no gradient to track.
    fn few(&self) -> bool {
        let plain = |x: &Tensor| !x.track_op();
        self.q.dim(1).is_ok_and(|t| t <= kernels::MAX_QUERY_ROWS)
            && plain(&self.q)
            && plain(&self.keys)
            && plain(&self.values)
    }
}

/// Keeps the pool's other threads looking for work until `done`, so that the next product
/// of a decode step starts on them at once. A step is some two hundred small parallel products
/// with short serial work between them; in that gap an idle worker goes to sleep, and waking it
/// (a futex wake; on a VM an interrupt to a halted vCPU) took some 13% of an 8-job step on 2
/// cores. The threads spin only for the length of the step, and while they find work.
fn keep_pool_awake<'s>(scope: &rayon::Scope<'s>, done: &'s AtomicBool) {
    for _ in 1..rayon::current_num_threads() {
        scope.spawn(move |_| {
            // A thread that is running a step (this one, or another caller's on the same pool)
            // may pick this up while it waits for a product: spinning there, above the code
            // that would finish its step, would stall it.
            if STEPS_RUNNING.get() > 0 {
                return;
            }
            let mut idle_since = None;
            while !done.load(Ordering::Acquire) {
                if rayon::yield_now() == Some(rayon::Yield::Executed) {
                    idle_since = None;
                    continue;
                }
                // A gap longer than any between a step's products: the step is waiting on
                // something else, so the thread goes back to the pool's own idling.
                let since = *idle_since.get_or_insert_with(Instant::now);
                if since.elapsed() > MAX_SPIN {
                    return;
                }
                std::hint::spin_loop();
            }
        });
    }
}

/// How long [`keep_pool_awake`]'s threads look for work without finding any.
const MAX_SPIN: Duration = Duration::from_millis(2);

thread_local! {
    /// Decode steps this thread is running (see [`keep_pool_awake`]).
    static STEPS_RUNNING: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// `f`, counted in [`STEPS_RUNNING`] while it runs.
fn owning_a_step<R>(f: impl FnOnce() -> R) -> R {
    struct Running;
    impl Drop for Running {
        fn drop(&mut self) {
            STEPS_RUNNING.set(STEPS_RUNNING.get() - 1);
        }
    }
    STEPS_RUNNING.set(STEPS_RUNNING.get() + 1);
    let _running = Running;
    f()
}

/// One sequence's rows in a pass of [`Llama::run_layers`].
struct Rows<'m, 'c> {
    /// The base or an expert of it.
    model: &'m Llama,
    rows: usize,
    /// Position of the first row.
    start_pos: usize,
    cache: Option<&'c mut KvCache>,
}

/// Projection `which` of layer `layer` over the stacked rows of `seqs`, each with its model's.
fn project_rows(
    seqs: &[Rows<'_, '_>],
    layer: usize,
    which: fn(&Block) -> &Linear,
    x: &Tensor,
) -> candle_core::Result<Tensor> {
    let parts: Vec<(&Linear, usize)> = seqs
        .iter()
        .map(|s| (which(&s.model.blocks[layer]), s.rows))
        .collect();
    forward_rows(&parts, x)
}

/// Checks a loaded weight's shape against what the configuration implies.
pub(crate) fn check_shape(
    name: &str,
    t: &Tensor,
    expected: &[usize],
) -> Result<(), crate::error::LoadError> {
    if t.dims() != expected {
        return Err(crate::error::LoadError::TensorShape {
            name: name.into(),
            got: t.dims().to_vec(),
            expected: expected.to_vec(),
        });
    }
    if t.dtype() != DType::F32 {
        return Err(crate::error::LoadError::Config(format!(
            "tensor {name} is {:?}, expected f32 after conversion",
            t.dtype()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    #[test]
    fn adapter_terms_are_held_in_bf16_only_where_that_is_exact() -> candle_core::Result<()> {
        let exact = Tensor::new(&[1.0f32, -0.5, 3.0, 0.0078125, 1.5e-3], &Device::Cpu)?
            .to_dtype(DType::BF16)?
            .to_dtype(DType::F32)?;
        let doubled = (exact.clone() * 2.0)?;
        let held = super::narrowest(doubled.clone())?;
        assert_eq!(held.dtype(), DType::BF16);
        assert_eq!(
            held.to_dtype(DType::F32)?.to_vec1::<f32>()?,
            doubled.to_vec1::<f32>()?
        );
        // A scale that is not a power of two leaves values bf16 cannot hold: kept in f32.
        let scaled = (exact * 0.3)?;
        let held = super::narrowest(scaled.clone())?;
        assert_eq!(held.dtype(), DType::F32);
        assert_eq!(held.to_vec1::<f32>()?, scaled.to_vec1::<f32>()?);
        Ok(())
    }

    #[test]
    fn a_part_adapted_after_the_layout_joins_it_and_the_terms_are_unchanged(
    ) -> candle_core::Result<()> {
        use super::{Linear, LoraDelta, Proj};
        let bf16_valued = |shape: (usize, usize)| {
            Tensor::randn(0f32, 1.0, shape, &Device::Cpu)?
                .to_dtype(DType::BF16)?
                .to_dtype(DType::F32)
        };
        let (k, q_rows, k_rows) = (32, 24, 8);
        let lora = |rows, rank| -> candle_core::Result<LoraDelta> {
            Ok(LoraDelta {
                a: bf16_valued((rank, k))?,
                b: bf16_valued((rows, rank))?,
                scale: 2.0,
            })
        };
        let (on_q, on_k) = (lora(q_rows, 4)?, lora(k_rows, 3)?);
        let fused = Linear::fuse(vec![
            (Proj::Q, bf16_valued((q_rows, k))?, None),
            (Proj::K, bf16_valued((k_rows, k))?, None),
        ])?;
        // Both parts at once, and one after the other (the first then a bf16 view).
        let mut at_once = fused.clone();
        at_once.set_lora(Proj::Q, Some(on_q.clone()));
        at_once.set_lora(Proj::K, Some(on_k.clone()));
        at_once.stack_adapter()?;
        let mut in_turn = fused;
        in_turn.set_lora(Proj::Q, Some(on_q));
        in_turn.stack_adapter()?;
        in_turn.set_lora(Proj::K, Some(on_k));
        in_turn.stack_adapter()?;
        for lin in [&at_once, &in_turn] {
            let layout = lin.low_rank.as_ref().expect("laid out for decode steps");
            assert_eq!(
                (layout.a.dtype(), layout.a.dims()),
                (DType::BF16, &[7, k][..])
            );
        }
        let x = Tensor::randn(0f32, 1.0, (5, k), &Device::Cpu)?;
        let delta = |l: &Linear| -> candle_core::Result<Vec<Vec<f32>>> {
            l.lora_delta(&x)?.expect("adapted").to_vec2()
        };
        assert_eq!(delta(&at_once)?, delta(&in_turn)?);
        Ok(())
    }
}
