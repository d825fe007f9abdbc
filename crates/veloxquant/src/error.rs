//! One error type for the core crate: every variant names what failed.

use thiserror::Error;

/// Errors of the core crate. Bad input is always reported, never a panic.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum VqError {
    #[error("shape mismatch in {op}: expected {expected}, got {got}")]
    ShapeMismatch { op: &'static str, expected: usize, got: usize },
    #[error("unsupported head size {d} for {format}: {why}")]
    UnsupportedHeadDim { format: String, d: usize, why: &'static str },
    #[error("unsupported bit width {bits} for {format} (supported: {supported})")]
    UnsupportedBits { format: String, bits: u32, supported: &'static str },
    #[error("unknown format {0:?} (see veloxquant::format::REGISTRY for the known names)")]
    UnknownFormat(String),
    #[error("invalid format spec {spec:?}: {why}")]
    InvalidSpec { spec: String, why: String },
    #[error("non-finite value (NaN or Inf) in {what} at token {token}, channel {channel}")]
    NonFinite { what: &'static str, token: usize, channel: usize },
    #[error("attention over an empty cache (layer {layer}): no token has been appended")]
    EmptyCache { layer: usize },
    #[error("index out of range in {what}: {index} >= {len}")]
    OutOfRange { what: &'static str, index: usize, len: usize },
    #[error("{format} needs calibration vectors: {why}")]
    MissingCalibration { format: String, why: String },
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    #[error("cannot trim {requested} tokens: layer {layer} holds {held}")]
    TrimTooFar { layer: usize, requested: usize, held: usize },
    #[error("I/O error ({kind:?}) while {during}: {message}")]
    Io { during: &'static str, kind: std::io::ErrorKind, message: String },
    #[error("cache file truncated in {section}")]
    FileTruncated { section: String },
    #[error("cache file corrupt: {0}")]
    FileCorrupt(String),
    #[error("cache file version {found:?} is not supported (this build reads versions 1 to {supported})")]
    FileVersion { found: String, supported: u32 },
    #[error("cache file was saved for another model: {what} is {found}, expected {expected}")]
    FileMismatch { what: &'static str, expected: String, found: String },
    #[error("cache file checksum mismatch: header says {expected:08x}, payload gives {found:08x}")]
    FileChecksum { expected: u32, found: u32 },
}

impl VqError {
    /// An I/O error with what was being done, keeping the error kind (truncation reads as
    /// [`VqError::FileTruncated`] at the call sites that know the section).
    pub fn io(during: &'static str, e: &std::io::Error) -> Self {
        Self::Io { during, kind: e.kind(), message: e.to_string() }
    }
}

pub type Result<T, E = VqError> = std::result::Result<T, E>;
