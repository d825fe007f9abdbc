//! veloxquant-cuda: the veloxquant formats on NVIDIA GPUs.
//!
//! CUDA C kernels (`kernels/*.cu`, embedded) are compiled through NVRTC on first use for the
//! device's compute capability, specialized by `#define`s and cached per configuration.
//! Only libcuda and libnvrtc are needed at run time (dynamic loading); without them every
//! entry point returns [`CudaError::CudaUnavailable`] instead of panicking.
//!
//! ```no_run
//! use veloxquant::{CacheConfig, FormatSpec};
//! use veloxquant_cuda::{GpuCacheConfig, GpuDevice, GpuKvCache, attn};
//! # fn main() -> veloxquant_cuda::Result<()> {
//! let dev = GpuDevice::new(0)?; // Err(CudaUnavailable) on machines without CUDA
//! let k = FormatSpec::parse("turboquant_mse:4")?;
//! let cpu = CacheConfig::new(1, 2, 128, k.clone(), k); // 1 layer, 2 KV heads, d = 128
//! // 4 sequence slots of up to 4096 tokens, a pool for 8192 coded tokens in all.
//! let mut cache = GpuKvCache::new(&dev, GpuCacheConfig::from_cpu(&cpu, 4, 4096, 8192))?;
//! let slot = cache.add_seq()?;
//! let n = 100;
//! let mut rng = veloxquant::rng::SplitMix64::new(1);
//! let (k, v) = (rng.gaussian_vec(2 * n * 128), rng.gaussian_vec(2 * n * 128)); // [kv][n][d]
//! cache.append(slot, &[(&k, &v)], n)?;
//! let out = attn::decode(&mut cache, &[slot], 0, &rng.gaussian_vec(8 * 128), 8)?; // GQA 4:1
//! # let _ = out; Ok(()) }
//! ```

pub mod attn;
pub mod bench;
pub mod bench_util;
pub mod blas;
pub mod cache;
pub mod device;
pub mod encode;
pub mod error;
pub mod format;
pub mod ops;
pub mod prefill;
pub mod tuning;

pub use blas::{cublas_present, Blas};
pub use cache::{AppendRow, GpuCacheConfig, GpuKvCache};
pub use device::{libraries_present, GpuDevice};
pub use encode::{GpuEncoder, InputKind};
pub use error::{CudaError, Result};
pub use format::GpuFormat;
pub use ops::ModelOps;
pub use prefill::{PrefillAttn, PrefillKernel};
pub use tuning::Tuning;
