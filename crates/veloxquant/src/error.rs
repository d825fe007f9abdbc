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
}

pub type Result<T, E = VqError> = std::result::Result<T, E>;
