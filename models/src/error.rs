//! Typed errors, one enum per operation: loading weights, running the model, loading or
//! applying an adapter, and generating.

use std::path::PathBuf;

/// Loading a model (GGUF file or Hugging Face directory) failed.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The path does not exist.
    #[error("model file {path} not found (run `make model` to fetch the default model)")]
    NotFound {
        /// The path that was given.
        path: PathBuf,
    },
    /// Reading the file failed for another reason than its absence.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file being read.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// The file does not start with the GGUF magic bytes.
    #[error(
        "{path} is not a GGUF file (it starts with {magic:02x?}, a GGUF file starts with \"GGUF\")"
    )]
    NotGguf {
        /// The file.
        path: PathBuf,
        /// Its first bytes (up to four).
        magic: Vec<u8>,
    },
    /// The GGUF header (metadata and tensor directory) could not be parsed.
    #[error("{path}: the GGUF header is unreadable, the file is truncated or corrupt ({reason})")]
    BadHeader {
        /// The file.
        path: PathBuf,
        /// What the parser reported.
        reason: String,
    },
    /// A tensor's data lies beyond the end of the file.
    #[error("{path} is truncated: tensor {tensor} needs bytes up to offset {needed}, but the file has {len} bytes")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// The first tensor that does not fit.
        tensor: String,
        /// The end offset its data needs.
        needed: u64,
        /// The file's length.
        len: u64,
    },
    /// The checkpoint is not a llama-architecture model.
    #[error("{path}: unsupported architecture {found:?}; only \"llama\" models are supported")]
    UnsupportedArchitecture {
        /// The file or directory.
        path: PathBuf,
        /// The architecture it declares.
        found: String,
    },
    /// A hyperparameter is missing from the metadata or has the wrong type.
    #[error("{path}: metadata key {key} is missing or not a number")]
    Metadata {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
    },
    /// The hyperparameters are inconsistent or use a feature this implementation lacks.
    #[error("invalid model configuration: {0}")]
    Config(String),
    /// A weight the architecture needs is absent.
    #[error("{path}: tensor {name} is missing")]
    MissingTensor {
        /// The file or directory.
        path: PathBuf,
        /// The checkpoint's name of the tensor.
        name: String,
    },
    /// A weight has a shape that does not match the configuration.
    #[error("tensor {name} has shape {got:?}, the configuration implies {expected:?}")]
    TensorShape {
        /// The checkpoint's name of the tensor.
        name: String,
        /// The shape found.
        got: Vec<usize>,
        /// The shape expected.
        expected: Vec<usize>,
    },
    /// `config.json` of a Hugging Face directory is not valid.
    #[error("{path}: invalid config.json: {source}")]
    ConfigJson {
        /// The config file.
        path: PathBuf,
        /// The parser's error.
        source: serde_json::Error,
    },
    /// A Hugging Face directory has no `*.safetensors` weights.
    #[error("{path}: no .safetensors weights in this directory")]
    NoWeights {
        /// The directory.
        path: PathBuf,
    },
    /// Tensor conversion failed (dequantisation, safetensors parsing).
    #[error("tensor error while loading {path}: {source}")]
    Tensor {
        /// The file or directory.
        path: PathBuf,
        /// candle's error.
        source: candle_core::Error,
    },
}

/// A forward pass was given inputs it cannot run.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// No tokens (or an empty hidden state) were given.
    #[error("empty input: at least one token is needed")]
    EmptyInput,
    /// A token id is not in the vocabulary.
    #[error("token id {id} is outside the vocabulary of {vocab} tokens")]
    TokenOutOfRange {
        /// The offending id.
        id: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// The positions would run past the model's context window.
    #[error("positions up to {needed} exceed the context window of {context} tokens")]
    ContextOverflow {
        /// The number of positions needed (last position + 1).
        needed: usize,
        /// The model's context length.
        context: usize,
    },
    /// A layer range does not lie within the model.
    #[error("layer range {start}..{end} is not within the model's {layers} layers")]
    LayerRange {
        /// Start of the range.
        start: usize,
        /// End of the range (exclusive).
        end: usize,
        /// Number of layers.
        layers: usize,
    },
    /// A tensor handed in (a hidden state, an injected cache) has the wrong shape.
    #[error("{what}: shape {got:?}, expected {expected:?}")]
    Shape {
        /// Which input.
        what: String,
        /// The shape found.
        got: Vec<usize>,
        /// The shape expected.
        expected: Vec<usize>,
    },
    /// The number of positions differs from the number of rows.
    #[error("{what}: {positions} positions for {rows} rows")]
    Positions {
        /// Which input.
        what: String,
        /// Positions given.
        positions: usize,
        /// Rows in the tensor.
        rows: usize,
    },
    /// A batch mixed models of different bases (or configurations).
    #[error("a batch must share one base model: {first} and {other} differ")]
    MixedBases {
        /// The first sequence's base (hex SHA-256).
        first: String,
        /// Another sequence's.
        other: String,
    },
    /// A compiled document came from a model of another base than the one reading it.
    #[error("document compiled by base {writer} cannot be read by base {reader}")]
    ForeignDocument {
        /// The writer's base (hex SHA-256).
        writer: String,
        /// The reader's base.
        reader: String,
    },
    /// Documents of one prompt compiled by different writer versions (another adapter or other
    /// boundary tokens): stitching never mixes them.
    #[error("documents of writer versions {first} and {other} cannot be stitched together")]
    MixedWriters {
        /// The first document's writer version ([`crate::sempic::WriterVersion::id`]).
        first: String,
        /// Another document's.
        other: String,
    },
    /// Boundary tokens that do not belong to the model compiling with them.
    #[error(transparent)]
    Boundary(#[from] Box<crate::boundary::BoundaryError>),
    /// The tensor library failed.
    #[error("tensor error: {0}")]
    Tensor(#[from] candle_core::Error),
}

/// Loading, building, applying or saving a LoRA adapter failed.
#[derive(Debug, thiserror::Error)]
pub enum AdapterError {
    /// Reading or writing a file failed.
    #[error("cannot access adapter file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// The safetensors file is malformed.
    #[error("{path}: not a valid safetensors file: {reason}")]
    Format {
        /// The file.
        path: PathBuf,
        /// The parser's error.
        reason: String,
    },
    /// Neither `adapter_config.json` nor the file's metadata gives rank and alpha.
    #[error("{path}: cannot find LoRA {what}: no adapter_config.json beside it and no such entry in its metadata")]
    MissingConfig {
        /// The adapter file.
        path: PathBuf,
        /// "rank" or "alpha".
        what: &'static str,
    },
    /// A tensor name is not one of the PEFT LoRA names for this model.
    #[error("adapter tensor {name} is not a LoRA weight of this model ({reason})")]
    UnknownTensor {
        /// The tensor's name.
        name: String,
        /// Why it was rejected.
        reason: String,
    },
    /// An `A` matrix without its `B` (or the reverse).
    #[error("adapter tensor {name} has no partner {missing}")]
    Unpaired {
        /// The tensor found.
        name: String,
        /// The partner that is missing.
        missing: String,
    },
    /// A tensor's shape does not fit the model's projection.
    #[error("adapter tensor {tensor} has shape {got:?}, the model needs {expected:?}")]
    Shape {
        /// The tensor's name (PEFT naming).
        tensor: String,
        /// The shape found.
        got: Vec<usize>,
        /// The shape the model needs.
        expected: Vec<usize>,
    },
    /// Rank or alpha is not usable.
    #[error("invalid LoRA hyperparameters: {0}")]
    Hyper(String),
    /// The tensor library failed.
    #[error("tensor error: {0}")]
    Tensor(#[from] candle_core::Error),
}

/// Generation could not start or failed midway.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    /// No prompt tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// The prompt alone does not fit.
    #[error("the prompt has {prompt} tokens, more than the context window of {context}")]
    PromptTooLong {
        /// Prompt tokens (including any cached prefix).
        prompt: usize,
        /// The model's context length.
        context: usize,
    },
    /// The prompt fits but prompt plus the requested new tokens does not.
    #[error("{prompt} prompt tokens + {max_tokens} new tokens exceed the context window of {context}; ask for at most {} new tokens", context.saturating_sub(*prompt))]
    ExceedsContext {
        /// Prompt tokens (including any cached prefix).
        prompt: usize,
        /// Requested new tokens.
        max_tokens: usize,
        /// The model's context length.
        context: usize,
    },
    /// Sampling parameters are out of range.
    #[error("invalid sampling parameters: {0}")]
    Sampling(String),
    /// The forward pass failed.
    #[error(transparent)]
    Forward(#[from] ForwardError),
}

impl From<candle_core::Error> for GenerateError {
    fn from(e: candle_core::Error) -> Self {
        Self::Forward(ForwardError::Tensor(e))
    }
}
