//! The model on an NVIDIA GPU (feature `cuda`): weights on the device, the compressed paged
//! cache on the device, prefill and graph-replayed batched decode, and batched evaluation.
//! The forward pass is the CPU's (`model.rs`) op for op: RMSNorm → fused QKV → RoPE (pairs
//! 2i, 2i+1, the same f64-built tables) → attention through the cache → output projection
//! → RMSNorm → SwiGLU MLP, residuals in f32; matrix products in f16 with f32 accumulation.

mod engine;
mod eval;
mod model;
mod passkey;

pub use engine::{
    EngineBytes, EngineConfig, GpuEngine, GpuMethod, PendingPrefill, PendingStep, PrefillTimes, StepOut, StepPart,
};
pub use eval::{compare_methods_gpu, GpuEvalRow};
pub use model::{synthetic_config, weight_bytes, GpuModel};
pub use passkey::passkey_accuracy_gpu;
