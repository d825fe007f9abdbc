//! One error type for the crate; variants name what failed.

use std::path::PathBuf;

/// Errors from model fetching, loading, tokenizing and evaluation.
#[derive(Debug, thiserror::Error)]
pub enum LlmError {
    #[error("model file not found: {path}")]
    ModelNotFound { path: PathBuf },
    #[error("file {path} is truncated or corrupt: {detail}")]
    Truncated { path: PathBuf, detail: String },
    #[error("unsupported architecture {found:?} (only \"llama\" is supported)")]
    WrongArchitecture { found: String },
    #[error("GGUF metadata key {key:?} is missing or has the wrong type")]
    MissingMetadata { key: String },
    #[error("GGUF tensor {name:?} is missing")]
    MissingTensor { name: String },
    #[error("tensor {name:?} has shape {got:?}, expected {expected:?}")]
    BadTensorShape { name: String, expected: Vec<usize>, got: Vec<usize> },
    #[error("text has {tokens} tokens, fewer than one window of {n_ctx}")]
    TextTooShort { tokens: usize, n_ctx: usize },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("shape mismatch in {op}: expected {expected}, got {got}")]
    ShapeMismatch { op: &'static str, expected: usize, got: usize },
    #[error("token id {id} is outside the vocabulary of {n_vocab}")]
    TokenOutOfRange { id: u32, n_vocab: usize },
    #[error("context overflow: position {pos} exceeds the model's context {n_ctx_train}")]
    ContextOverflow { pos: usize, n_ctx_train: usize },
    #[error("fetching the model failed: {0}")]
    Fetch(String),
    #[error("checksum mismatch for {path}: expected {expected}, got {got}")]
    Checksum { path: PathBuf, expected: String, got: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("KV store: {0}")]
    Store(String),
    /// An error from a KvStore implementation in another crate, kept as the source.
    #[error("KV store backend: {0}")]
    StoreBackend(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// The GPU backend (feature `cuda`): a missing library or device, a plan that does not
    /// fit, a kernel error.
    #[cfg(feature = "cuda")]
    #[error("GPU: {0}")]
    Gpu(#[source] veloxquant_cuda::CudaError),
    #[error("I/O on {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
}

pub type Result<T> = std::result::Result<T, LlmError>;

impl LlmError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        LlmError::Io { path: path.into(), source }
    }
}
