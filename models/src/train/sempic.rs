//! The SemPIC writer's objective (`docs/method.md` §2.3 and §5.2): the base plus a LoRA (the
//! writer) compiles each document alone; the frozen base (the reader, LoRA off) stitches the
//! compiled caches ([`crate::sempic`]) and reads the request's own tokens over them. The loss is
//! the KL (temperature 1) from the teacher, the base reading the whole prompt in one prefill,
//! to that student, averaged over every position after the documents.
//!
//! The gradient reaches the writer only through the documents' keys and values, which are both
//! what a compiled cache stores and the interface the reader differentiates through. Two ways
//! to compute it, with the same result (tested):
//! - one graph: every writer layer of every document stays recorded until the backward pass;
//! - KV gradient checkpointing per writer layer: the forward pass keeps only each layer's
//!   input and its keys and values; the reader's backward gives the gradients of the keys and
//!   values, and each writer layer is then recomputed, last to first, with the LoRA active,
//!   and differentiated alone (the gradient of its output coming from the layer above). Peak
//!   memory then holds one layer's graph instead of all of them.
//!
//! The same objective trains KV-Packet's boundary tokens ([`crate::boundary`]) when the
//! trainer holds those instead of an adapter: the documents are then compiled between the
//! tokens by a frozen compiler (the base, or the base with a trained writer for the joint
//! mode), and the gradient goes on through every compiler layer to the tokens' embeddings.

use candle_core::{Tensor, Var, D};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

use super::trainer::step_seed;
use super::{Objective, StepGrads, TrainError, Trainer};
use crate::boundary::Boundary;
use crate::error::ForwardError;
use crate::eval::multidoc::Pieces;
use crate::llama::{Capture, Input, Llama, LogitsWanted};
use crate::lora::AdapterMode;
use crate::sempic::{stitch_after_head, CompiledDoc};
use crate::{DecodeWeights, PrefillMatmul};

/// One training context: documents between the reader's own tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriterExample {
    /// Tokens before the documents (chat header, instruction). Nothing precedes them, so the
    /// reader's own prefill of them is exact; the writer never sees them.
    pub head: Vec<u32>,
    /// The documents, each compiled alone by the writer.
    pub documents: Vec<Vec<u32>>,
    /// Tokens after the documents that the reader runs itself (question, assistant header,
    /// answer, end of turn): the loss is taken at each of their positions.
    pub tail: Vec<u32>,
}

impl WriterExample {
    /// A multi-document prompt's pieces followed by `answer` (its tokens, end of turn
    /// included): the teacher's full-context reading of the answer is what the student learns.
    pub fn new(pieces: Pieces, answer: &[u32]) -> Self {
        let mut tail = pieces.tail;
        tail.extend_from_slice(answer);
        Self {
            head: pieces.head,
            documents: pieces.documents,
            tail,
        }
    }

    /// Every token of the example.
    pub fn len(&self) -> usize {
        self.head.len() + self.documents.iter().map(Vec::len).sum::<usize>() + self.tail.len()
    }

    /// Whether it has no tokens.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn prefix(&self) -> Vec<u32> {
        let mut t = self.head.clone();
        for d in &self.documents {
            t.extend(d);
        }
        t
    }
}

/// `base` as the reader and teacher of training: f32 products everywhere, so that the
/// teacher, the student's plain rows and its recorded rows multiply alike (the AMX tiles
/// round to bf16, the narrow decode weights to 8 bits).
pub fn training_reader(base: &Llama) -> Result<Llama, TrainError> {
    let mut reader = base.clone().with_decode_weights(DecodeWeights::F32)?;
    reader.set_prefill_matmul(PrefillMatmul::F32);
    Ok(reader)
}

/// The teacher's log-probabilities `(tail, vocab)` at the tail's positions: `reader` over the
/// whole prompt, documents in place.
pub fn teacher_log_probs(reader: &Llama, ex: &WriterExample) -> Result<Tensor, ForwardError> {
    let mut cache = reader.new_cache();
    reader.forward(
        Input::new(&ex.prefix())
            .with_cache(&mut cache)
            .logits(LogitsWanted::None),
    )?;
    let logits = tail_logits(reader, &mut cache, &ex.tail)?;
    Ok(candle_nn::ops::log_softmax(&logits, D::Minus1)?)
}

/// `reader`'s logits at every position of `tail`, run on top of `cache`.
pub fn tail_logits(
    reader: &Llama,
    cache: &mut crate::KvCache,
    tail: &[u32],
) -> Result<Tensor, ForwardError> {
    let out = reader.forward(Input::new(tail).with_cache(cache).logits(LogitsWanted::All))?;
    out.logits
        .ok_or_else(|| candle_core::Error::Msg("forward returned no logits".into()).into())
}

/// The student's logits at the tail's positions: `reader` over the head (its own prefill) and
/// `docs` (compiled elsewhere) stitched in order.
pub fn student_logits(
    reader: &Llama,
    ex: &WriterExample,
    docs: &[CompiledDoc],
) -> Result<Tensor, ForwardError> {
    let mut cache = stitch_after_head(reader, &ex.head, docs)?;
    tail_logits(reader, &mut cache, &ex.tail)
}

/// Mean over rows of KL(teacher ‖ student) at temperature 1; `teacher` holds
/// log-probabilities, `student` logits, both `(rows, vocab)`.
pub fn kl_to_teacher(teacher: &Tensor, student: &Tensor) -> candle_core::Result<Tensor> {
    let s = candle_nn::ops::log_softmax(student, D::Minus1)?;
    let rows = teacher.dim(0)?.max(1) as f64;
    (teacher.exp()? * (teacher - s)?)?.sum_all()? / rows
}

/// The KL of one example with documents compiled by `writer` (the base itself: plain
/// stitching, no recompute), between `boundary`'s tokens if given; no gradients kept.
pub fn example_kl(
    reader: &Llama,
    writer: &Llama,
    boundary: Option<&Boundary>,
    ex: &WriterExample,
) -> Result<f64, ForwardError> {
    let teacher = teacher_log_probs(reader, ex)?;
    let docs = ex
        .documents
        .iter()
        .map(|d| CompiledDoc::compile_with(writer, d, boundary))
        .collect::<Result<Vec<_>, _>>()?;
    let student = student_logits(reader, ex, &docs)?.detach();
    Ok(f64::from(
        kl_to_teacher(&teacher, &student)?.to_scalar::<f32>()?,
    ))
}

/// The writer's distillation objective over a fixed set of examples, `batch` of them per step
/// (seeded by the step).
#[derive(Debug)]
pub struct WriterObjective {
    reader: Llama,
    examples: Vec<WriterExample>,
    checkpointing: bool,
}

impl WriterObjective {
    /// The objective of `examples` read by `base` (made f32 by [`training_reader`]); with
    /// `checkpointing`, gradients per writer layer (see the module doc).
    pub fn new(
        base: &Llama,
        examples: Vec<WriterExample>,
        checkpointing: bool,
    ) -> Result<Self, TrainError> {
        if examples.is_empty() {
            return Err(TrainError::Config("no training examples".into()));
        }
        Ok(Self {
            reader: training_reader(base)?,
            examples,
            checkpointing,
        })
    }

    /// The reader (and teacher).
    pub fn reader(&self) -> &Llama {
        &self.reader
    }

    /// The examples of step `step`: `batch` distinct ones while there are enough.
    pub fn batch_of(&self, seed: u64, step: usize, batch: usize) -> Vec<&WriterExample> {
        let mut rng = StdRng::seed_from_u64(step_seed(seed, step));
        let mut picked: Vec<&WriterExample> = Vec::with_capacity(batch);
        while picked.len() < batch {
            let take = (batch - picked.len()).min(self.examples.len());
            picked.extend(self.examples.choose_multiple(&mut rng, take));
        }
        picked
    }

    /// Adds the gradients of `scale` times one example's loss to `grads`; returns the loss.
    pub fn example_gradients(
        &self,
        trainer: &Trainer,
        ex: &WriterExample,
        scale: f64,
        grads: &mut [Option<Tensor>],
    ) -> Result<f64, TrainError> {
        let teacher = teacher_log_probs(&self.reader, ex)?;
        if self.checkpointing {
            return self.checkpointed(trainer, ex, &teacher, scale, grads);
        }
        let docs = ex
            .documents
            .iter()
            .map(|d| CompiledDoc::compile_with(trainer.model(), d, trainer.boundary()))
            .collect::<Result<Vec<_>, _>>()?;
        let loss = kl_to_teacher(&teacher, &student_logits(&self.reader, ex, &docs)?)?;
        let value = f64::from(loss.to_scalar::<f32>()?);
        trainer.accumulate(grads, &(loss * scale)?.backward()?)?;
        Ok(value)
    }

    fn checkpointed(
        &self,
        trainer: &Trainer,
        ex: &WriterExample,
        teacher: &Tensor,
        scale: f64,
        grads: &mut [Option<Tensor>],
    ) -> Result<f64, TrainError> {
        let writer = trainer.model();
        let layers = writer.config().num_layers;
        let boundary = trainer.boundary();
        // Forward: per document, each layer's input (the residual stream entering it) and its
        // keys and values. Nothing of it is differentiated, so it runs on the inference
        // kernels (with a plain copy of an adapter as it stands, and boundary tokens detached);
        // the keys and values become leaves whose gradients the reader's backward pass
        // computes.
        let frozen = match boundary {
            Some(_) => writer.clone(),
            None => self.reader.with_adapter(
                &trainer.adapter(&self.reader, candle_core::DType::F32)?,
                AdapterMode::OnTheFly,
            )?,
        };
        let plain_boundary = boundary.map(Boundary::detach);
        let mut inputs: Vec<Vec<Tensor>> = Vec::with_capacity(ex.documents.len());
        let mut leaves: Vec<Vec<(Var, Var)>> = Vec::with_capacity(ex.documents.len());
        let wants = Capture {
            hidden: true,
            ..Capture::none()
        };
        for doc in &ex.documents {
            let mut cache = frozen.new_cache();
            let mut captured = Vec::with_capacity(layers);
            frozen.forward_layers_capture(
                &embed_rows(&frozen, doc, plain_boundary.as_ref())?,
                0..layers,
                0,
                Some(&mut cache),
                &wants,
                &mut captured,
            )?;
            let mut ins = Vec::with_capacity(layers);
            let mut kv = Vec::with_capacity(layers);
            for (l, rec) in captured.into_iter().enumerate() {
                ins.push(rec.hidden.ok_or_else(|| missing(l, "input"))?);
                let (k, v) = cache.layer(l)?.ok_or_else(|| missing(l, "keys"))?;
                kv.push((Var::from_tensor(&k)?, Var::from_tensor(&v)?));
            }
            inputs.push(ins);
            leaves.push(kv);
        }
        let docs: Vec<CompiledDoc> = ex
            .documents
            .iter()
            .zip(&leaves)
            .map(|(tokens, kv)| {
                let doc = CompiledDoc::from_layers(
                    tokens.clone(),
                    kv.iter()
                        .map(|(k, v)| (k.as_tensor().clone(), v.as_tensor().clone()))
                        .collect(),
                    writer.identity().clone(),
                );
                match boundary {
                    Some(b) => doc.with_boundary(b),
                    None => Ok(doc),
                }
            })
            .collect::<Result<_, _>>()?;
        let loss = kl_to_teacher(teacher, &student_logits(&self.reader, ex, &docs)?)?;
        let value = f64::from(loss.to_scalar::<f32>()?);
        let store = (loss * scale)?.backward()?;
        drop(docs);
        // Backward, layer by layer from the last: recompute the layer from its input with the
        // LoRA active and differentiate <K, dK> + <V, dV> + <out, d out>, whose gradient is
        // the layer's share of the loss's.
        // Boundary tokens enter at the first layer's input, as the live variables there.
        for ((ins, kv), doc) in inputs.iter().zip(&leaves).zip(&ex.documents) {
            let mut d_out: Option<Tensor> = None;
            for l in (0..layers).rev() {
                let x = match boundary {
                    Some(b) if l == 0 => b.embed(writer, doc)?,
                    _ => Var::from_tensor(&ins[l])?.as_tensor().clone(),
                };
                let (out, k, v) = writer_layer(writer, l, &x)?;
                let mut terms = Vec::with_capacity(3);
                if let Some(g) = store.get(kv[l].0.as_tensor()) {
                    terms.push((k * g)?.sum_all()?);
                }
                if let Some(g) = store.get(kv[l].1.as_tensor()) {
                    terms.push((v * g)?.sum_all()?);
                }
                if let Some(g) = &d_out {
                    terms.push((out * g)?.sum_all()?);
                }
                let Some(first) = terms.pop() else {
                    d_out = None;
                    continue;
                };
                let surrogate = terms.iter().try_fold(first, |acc, t| acc + t)?;
                let layer_store = surrogate.backward()?;
                trainer.accumulate(grads, &layer_store)?;
                d_out = layer_store.get(&x).cloned();
            }
        }
        Ok(value)
    }
}

/// The rows a document compiles from: its tokens' embeddings, between `boundary`'s tokens if
/// given.
fn embed_rows(
    compiler: &Llama,
    tokens: &[u32],
    boundary: Option<&Boundary>,
) -> Result<Tensor, ForwardError> {
    match boundary {
        Some(b) => b.embed(compiler, tokens),
        None => {
            let ids = Tensor::new(tokens, &candle_core::Device::Cpu)?;
            Ok(compiler.embedding().index_select(&ids, 0)?)
        }
    }
}

/// Writer layer `l` over `x` (a document's rows from position 0): the layer's output and its
/// `(K after RoPE, V)`, each `(T, kv_heads * head_dim)`.
fn writer_layer(
    writer: &Llama,
    l: usize,
    x: &Tensor,
) -> Result<(Tensor, Tensor, Tensor), TrainError> {
    let mut cache = writer.new_cache();
    let out = writer.forward_layers(x, l..l + 1, 0, Some(&mut cache))?;
    let (k, v) = cache.layer(l)?.ok_or_else(|| missing(l, "keys"))?;
    Ok((out, k, v))
}

fn missing(layer: usize, what: &str) -> ForwardError {
    ForwardError::Shape {
        what: format!("writer layer {layer}'s {what}"),
        got: vec![0],
        expected: vec![1],
    }
}

impl Objective for WriterObjective {
    fn gradients(&self, trainer: &Trainer, step: usize) -> Result<StepGrads, TrainError> {
        let batch = trainer.config().batch;
        let mut grads: Vec<Option<Tensor>> = vec![None; trainer.params().len()];
        let (mut loss, mut tokens) = (0.0, 0);
        // One backward per example keeps one example's graph alive at a time.
        for ex in self.batch_of(trainer.config().seed, step, batch) {
            loss += self.example_gradients(trainer, ex, 1.0 / batch as f64, &mut grads)?;
            tokens += ex.len();
        }
        Ok(StepGrads {
            grads,
            loss: loss / batch as f64,
            tokens,
        })
    }
}
