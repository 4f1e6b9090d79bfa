//! The model side of scd: everything that is tensor math and nothing that is networking.
//!
//! - weight and tokenizer loading (GGUF and Hugging Face directories) for llama-family models;
//! - a transformer forward pass with state hooks (capture K before RoPE, V and the attention
//!   input; inject a per-layer KV cache; run a range of layers), RoPE apply/inverse;
//! - LoRA adapters (merged or on the fly), fine-tuning, sampling and generation;
//! - the codecs that carry a prompt's state from producer to consumer (oracle, raw, q4,
//!   DroidSpeak, SCD Reuse and Patch over calibrated translators), and the quality harness
//!   with its metrics.
//!
//! Math is f32 on the CPU, except the products of the projections: a decode step's multiply the
//! weights' 4- and 8-bit blocks (`decode_weights`) by activations rounded to bf16 where the CPU
//! has AVX-512 BF16, in two bytes with integer dot products elsewhere (`decode_products`, both
//! with f32 sums and accuracy tested), and a prefill's run on AMX tiles in bf16 with f32 sums
//! where the CPU has them (`prefill_matmul`, accuracy tested); f16/bf16 also appear where
//! tensors are packed for the wire.
//!
//! Files, top-down: `config` (hyperparameters from GGUF metadata or `config.json`), `gguf` and
//! `hf` (loaders, as constructors of [`Llama`]), `llama` (the model and its one forward pass
//! with hooks), `ops` (the forward pass's operations: fused kernels from `kernels` for
//! inference, candle's differentiable ops while gradients are recorded), `decode_weights` (the
//! packed copies decode steps multiply), `decode_products` (bf16 or integer products for
//! them), `prefill_matmul` (AMX tiles or f32 for prefill), `cache` (the per-layer
//! KV cache, injectable), `rope` (rotary embedding at arbitrary positions, apply and inverse),
//! `lora` (adapters), `tokenizer` (byte-level BPE and chat templates), `sampling` and
//! `generate` (and `batch`, several generations decoded together), `sempic` (documents compiled
//! alone into caches and stitched at request time: SemPIC's serving side; `train::sempic` trains
//! its writer); `codec` (the transfer modes: producer-side
//! encode into layer codes, consumer-side rebuild of a KV cache) and `translator` (SCD's
//! calibrated translators: low-rank codes, Patch aligners, calibration); `optim` (AdamW), `train`
//! (LoRA fine-tuning) and `expert` (an expert folder and its manifest); `corpus` (training
//! text), `perplexity`, `metrics` and `stats` (quality figures with intervals), `eval` (the
//! quality harness and the drift report); `baseline` (candle-transformers' quantized llama, an
//! independent reference), `bench` (timing helpers of `scd bench model`), `json_file` (atomic
//! JSON files), `error`.
#![warn(missing_docs)]

pub mod baseline;
pub mod batch;
pub mod bench;
pub mod boundary;
pub mod cache;
pub mod codec;
pub mod config;
pub mod corpus;
pub mod decode_products;
pub mod decode_weights;
pub mod error;
pub mod eval;
pub mod expert;
pub mod generate;
pub mod gguf;
pub mod hf;
pub mod json_file;
pub mod kernel_choice;
mod kernels;
pub mod llama;
pub mod lora;
pub mod metrics;
mod ops;
pub mod optim;
pub mod perplexity;
pub mod prefill_matmul;
pub mod rope;
pub mod sampling;
pub mod sempic;
pub mod stats;
pub mod tokenizer;
pub mod train;
pub mod translator;

pub use cache::KvCache;
pub use codec::{Codec, CodecError, LayerDecoder, Prefix};
pub use config::{HfLlamaConfig, LlamaConfig, RopeVariant};
pub use decode_products::DecodeProducts;
pub use decode_weights::DecodeWeights;
pub use error::{AdapterError, ForwardError, GenerateError, LoadError};
pub use generate::{generate, generate_with_cache, GenerateParams, Generation, StopReason};
pub use gguf::GgufFile;
pub use kernel_choice::KernelChoice;
pub use llama::{
    Capture, Input, LayerCapture, Llama, LogitsWanted, ModelIdentity, Output, Proj, Sequence,
};
pub use lora::{AdapterMode, LoraAdapter};
pub use prefill_matmul::PrefillMatmul;
pub use rope::{Rope, RopeTables};
pub use sampling::{Sampler, Sampling};
