//! veloxquant-cuda: the veloxquant formats on NVIDIA GPUs.
//!
//! CUDA C kernels (`kernels/*.cu`, embedded) are compiled through NVRTC on first use for the
//! device's compute capability, specialized by `#define`s and cached per configuration.
//! Only libcuda and libnvrtc are needed at run time (dynamic loading); without them every
//! entry point returns [`CudaError::CudaUnavailable`] instead of panicking.
//!
//! ```no_run
//! use veloxquant::FormatSpec;
//! use veloxquant_cuda::{GpuCacheConfig, GpuDevice, GpuPagedCache, attn};
//! # fn main() -> veloxquant_cuda::Result<()> {
//! let dev = GpuDevice::new(0)?; // Err(CudaUnavailable) on machines without CUDA
//! let cfg = GpuCacheConfig {
//!     n_seqs: 1, n_kv_heads: 2, head_dim: 128, page_tokens: 32, recent: 0,
//!     k: FormatSpec::parse("turboquant_mse:4")?, v: FormatSpec::parse("turboquant_mse:4")?,
//!     seed: 0x5EED, layer: 0, max_pages_per_seq: 64,
//! };
//! let mut cache = GpuPagedCache::new(&dev, cfg)?;
//! let n = 100;
//! let mut rng = veloxquant::rng::SplitMix64::new(1);
//! cache.append(0, &rng.gaussian_vec(2 * n * 128), &rng.gaussian_vec(2 * n * 128), n)?;
//! let out = attn::decode(&mut cache, &rng.gaussian_vec(8 * 128), 8)?; // GQA 4:1
//! # let _ = out; Ok(()) }
//! ```

pub mod attn;
pub mod bench;
pub mod bench_util;
pub mod cache;
pub mod device;
pub mod encode;
pub mod error;
pub mod format;

pub use cache::{GpuCacheConfig, GpuPagedCache};
pub use device::{libraries_present, GpuDevice};
pub use encode::{GpuEncoder, InputKind};
pub use error::{CudaError, Result};
pub use format::GpuFormat;
