//! One error type for the CUDA backend: every variant names what failed.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum CudaError {
    /// The driver (libcuda) or NVRTC (libnvrtc) could not be loaded, or no device answered.
    #[error("CUDA unavailable: {lib} could not be loaded or initialized ({why})")]
    CudaUnavailable { lib: &'static str, why: String },
    #[error("CUDA driver call failed in {op}: {err}")]
    Driver { op: &'static str, err: String },
    #[error("NVRTC failed to compile kernel {key}:\n{log}")]
    Nvrtc { key: String, log: String },
    #[error("format {format} is not supported on the CUDA backend: {why}")]
    UnsupportedFormat { format: String, why: &'static str },
    #[error("shape mismatch in {op}: expected {expected}, got {got}")]
    ShapeMismatch { op: &'static str, expected: usize, got: usize },
    /// A fixed-size resource (slots, the page pool, a plan's capacity) is full.
    #[error("out of {what}: capacity {capacity}")]
    OutOfCapacity { what: &'static str, capacity: usize },
    /// What was planned does not fit the device's free memory (checked before allocating).
    #[error("{what} needs {need} bytes of device memory; {free} are free")]
    OutOfDeviceMemory { what: String, need: usize, free: usize },
    /// cuBLAS failed or could not be loaded.
    #[error("cuBLAS failed in {op}: {err}")]
    Cublas { op: &'static str, err: String },
    #[error(transparent)]
    Core(#[from] veloxquant::VqError),
}

pub type Result<T, E = CudaError> = std::result::Result<T, E>;

/// Map a driver error into [`CudaError::Driver`] naming the operation.
pub(crate) fn drv<E: std::fmt::Debug>(op: &'static str) -> impl FnOnce(E) -> CudaError {
    move |e| CudaError::Driver { op, err: format!("{e:?}") }
}
