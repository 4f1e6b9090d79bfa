//! The model side of scd: everything that is tensor math and nothing that is networking.
//!
//! - weight and tokenizer loading (GGUF and Hugging Face directories) for llama-family models;
//! - a transformer forward pass with state hooks (capture K before RoPE, V and the attention
//!   input; inject a per-layer KV cache; run a range of layers), RoPE apply/inverse;
//! - LoRA adapters, sampling and generation;
//! - later: SCD translators (calibration, Reuse, Patch, layer selection), baseline codecs and
//!   quality metrics.
//!
//! All math is f32 on the CPU; f16/bf16 appear only where tensors are packed for the wire.
//!
//! Files, top-down: `config` (hyperparameters from GGUF metadata or `config.json`), `gguf` and
//! `hf` (loaders, as constructors of [`Llama`]), `llama` (the model and its forward pass with
//! hooks), `cache` (the per-layer KV cache, injectable), `rope` (rotary embedding at arbitrary
//! positions, apply and inverse), `lora` (adapters), `sampling` and `generate`, `baseline`
//! (candle-transformers' quantized llama, the independent reference), `bench` (timing helpers
//! of `scd bench model`), `error`.
#![warn(missing_docs)]

pub mod baseline;
pub mod bench;
pub mod cache;
pub mod config;
pub mod error;
pub mod generate;
pub mod gguf;
pub mod hf;
mod kernels;
pub mod llama;
pub mod lora;
pub mod rope;
pub mod sampling;
pub mod tokenizer;

pub use cache::KvCache;
pub use config::{HfLlamaConfig, LlamaConfig, RopeVariant};
pub use error::{AdapterError, ForwardError, GenerateError, LoadError};
pub use generate::{generate, generate_with_cache, GenerateParams, Generation, StopReason};
pub use gguf::GgufFile;
pub use llama::{Capture, Input, LayerCapture, Llama, LogitsWanted, ModelIdentity, Output, Proj};
pub use lora::{AdapterMode, LoraAdapter};
pub use rope::Rope;
pub use sampling::{Sampler, Sampling};
pub mod corpus;
pub mod eval;
pub mod metrics;
pub mod train;
