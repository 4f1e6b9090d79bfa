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
#![warn(missing_docs)]

pub mod tokenizer;
