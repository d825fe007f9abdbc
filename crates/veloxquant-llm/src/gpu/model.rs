//! The model's weights on the device: the GGUF's tensors dequantized on the host and uploaded
//! as f16 (Q, K, V fused into one matrix, gate and up into another), or random weights of a
//! named shape generated on the device (benchmarks: no file needed).

use std::path::Path;
use std::sync::Arc;

use cudarc::driver::CudaSlice;
use half::f16;
use veloxquant_cuda::{GpuDevice, ModelOps};

use crate::error::{LlmError, Result};
use crate::gguf::Gguf;
use crate::model::{rope_table, tensor, vector, LlamaConfig};

pub(crate) fn gpu(e: veloxquant_cuda::CudaError) -> LlmError {
    LlmError::Gpu(e)
}

fn drv<E: std::fmt::Debug>(op: &'static str) -> impl FnOnce(E) -> LlmError {
    move |e| LlmError::Gpu(veloxquant_cuda::CudaError::Driver { op, err: format!("{e:?}") })
}

/// One layer's weights: matrices f16 row-major `[out][in]`, norms f32.
pub struct DeviceLayer {
    pub attn_norm: CudaSlice<f32>,
    /// `[(n_heads + 2 n_kv_heads) · head_dim][hidden]`: Q, then K, then V.
    pub wqkv: CudaSlice<u16>,
    pub wo: CudaSlice<u16>,
    pub ffn_norm: CudaSlice<f32>,
    /// `[2 ffn][hidden]`: gate, then up.
    pub w_gate_up: CudaSlice<u16>,
    pub w_down: CudaSlice<u16>,
}

/// A Llama model on one GPU.
pub struct GpuModel {
    pub dev: Arc<GpuDevice>,
    pub config: LlamaConfig,
    /// `[n_vocab][hidden]` f16: the embedding table, and the output when tied.
    pub embed: CudaSlice<u16>,
    pub output: Option<CudaSlice<u16>>,
    pub output_norm: CudaSlice<f32>,
    pub layers: Vec<DeviceLayer>,
    /// `[n_ctx_train][head_dim / 2]`, the CPU's tables (f64 angles).
    pub rope_cos: CudaSlice<f32>,
    pub rope_sin: CudaSlice<f32>,
    pub ops: ModelOps,
    /// Whether the weights came from a file (`gguf`) or the generator (`synthetic`).
    pub weights: &'static str,
}

/// Named model shapes for synthetic weights.
pub fn synthetic_config(name: &str) -> Result<LlamaConfig> {
    let c = |n_layers, n_heads, n_kv_heads, head_dim, ffn_hidden, n_vocab, rope_base, n_ctx_train| LlamaConfig {
        n_layers,
        n_heads,
        n_kv_heads,
        head_dim,
        hidden: n_heads * head_dim,
        ffn_hidden,
        n_vocab,
        rope_base,
        rms_eps: 1e-5,
        n_ctx_train,
    };
    match name {
        "smollm2-135m" => Ok(c(30, 9, 3, 64, 1536, 49152, 100_000.0, 8192)),
        "llama-8b" => Ok(c(32, 32, 8, 128, 14336, 128_256, 500_000.0, 131_072)),
        other => Err(LlmError::InvalidArgument(format!("unknown synthetic model {other:?} (smollm2-135m, llama-8b)"))),
    }
}

/// Device bytes of a model's weights (planned before uploading).
pub fn weight_bytes(c: &LlamaConfig, tied: bool) -> usize {
    let (h, f, kvd) = (c.hidden, c.ffn_hidden, c.n_kv_heads * c.head_dim);
    let per_layer = 2 * (h * (h + 2 * kvd) + h * h + 2 * f * h + h * f) + 2 * h * 4;
    let embed = 2 * c.n_vocab * h * if tied { 1 } else { 2 };
    c.n_layers * per_layer + embed + h * 4 + 2 * c.n_ctx_train * c.head_dim / 2 * 4
}

/// Fail before allocating when `need` bytes do not fit the device's free memory.
pub fn check_fits(dev: &GpuDevice, what: &str, need: usize) -> Result<()> {
    let (free, _) = dev.ctx.mem_get_info().map_err(drv("mem_get_info"))?;
    if need > free {
        return Err(gpu(veloxquant_cuda::CudaError::OutOfDeviceMemory { what: what.into(), need, free }));
    }
    Ok(())
}

fn upload16(dev: &GpuDevice, x: &[f32]) -> Result<CudaSlice<u16>> {
    let h: Vec<u16> = x.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
    dev.stream.clone_htod(&h).map_err(drv("htod weights"))
}

fn upload32(dev: &GpuDevice, x: &[f32]) -> Result<CudaSlice<f32>> {
    dev.stream.clone_htod(x).map_err(drv("htod weights"))
}

fn dequant(g: &mut Gguf, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
    let t = tensor(g, name, Some(shape))?;
    Ok(t.dequantize(&candle_core::Device::Cpu)?.flatten_all()?.to_vec1()?)
}

impl GpuModel {
    /// A GGUF's weights on `dev` (dequantized on the host, uploaded as f16).
    pub fn load(dev: &Arc<GpuDevice>, path: &Path) -> Result<Self> {
        let mut g = Gguf::open(path)?;
        let config = LlamaConfig::from_metadata(&g)?;
        let (h, kvd, f) = (config.hidden, config.n_kv_heads * config.head_dim, config.ffn_hidden);
        // Every shape checked against the metadata before any tensor is read (model.rs).
        let n_vocab = crate::model::check_tensors(&mut g, &config)?;
        let config = LlamaConfig { n_vocab, ..config };
        let tied = !g.content.tensor_infos.contains_key("output.weight");
        check_fits(dev, "the model's weights", weight_bytes(&config, tied))?;
        let embed = upload16(dev, &dequant(&mut g, "token_embd.weight", &[n_vocab, h])?)?;
        let output = if tied { None } else { Some(upload16(dev, &dequant(&mut g, "output.weight", &[n_vocab, h])?)?) };
        let output_norm = upload32(dev, &vector(&mut g, "output_norm.weight", h)?)?;
        let mut layers = Vec::with_capacity(config.n_layers);
        for i in 0..config.n_layers {
            let name = |n: &str| format!("blk.{i}.{n}.weight");
            let mut qkv = dequant(&mut g, &name("attn_q"), &[h, h])?;
            qkv.extend(dequant(&mut g, &name("attn_k"), &[kvd, h])?);
            qkv.extend(dequant(&mut g, &name("attn_v"), &[kvd, h])?);
            let mut gu = dequant(&mut g, &name("ffn_gate"), &[f, h])?;
            gu.extend(dequant(&mut g, &name("ffn_up"), &[f, h])?);
            layers.push(DeviceLayer {
                attn_norm: upload32(dev, &vector(&mut g, &name("attn_norm"), h)?)?,
                wqkv: upload16(dev, &qkv)?,
                wo: upload16(dev, &dequant(&mut g, &name("attn_output"), &[h, h])?)?,
                ffn_norm: upload32(dev, &vector(&mut g, &name("ffn_norm"), h)?)?,
                w_gate_up: upload16(dev, &gu)?,
                w_down: upload16(dev, &dequant(&mut g, &name("ffn_down"), &[h, f])?)?,
            });
        }
        Self::assemble(dev, config, embed, output, output_norm, layers, "gguf")
    }

    /// Random weights of shape `config` generated on the device (N(0, 1/fan_in) matrices,
    /// norms near 1): the speed of real weights, no file.
    pub fn synthetic(dev: &Arc<GpuDevice>, config: &LlamaConfig, seed: u64) -> Result<Self> {
        let c = config.clone();
        check_fits(dev, "the model's weights", weight_bytes(&c, true))?;
        let ops = ModelOps::new(dev).map_err(gpu)?;
        let st = dev.stream.clone();
        let (h, kvd, f) = (c.hidden, c.n_kv_heads * c.head_dim, c.ffn_hidden);
        let mut seed_n = seed;
        let mut mat = |rows: usize, cols: usize| -> Result<CudaSlice<u16>> {
            let mut x = st.alloc_zeros::<u16>(rows * cols).map_err(drv("alloc weights"))?;
            seed_n = seed_n.wrapping_add(0x9E37_79B9);
            ops.fill_f16(&st, &mut x, seed_n, 1.0 / (cols as f32).sqrt(), 0.0).map_err(gpu)?;
            Ok(x)
        };
        let embed = mat(c.n_vocab, h)?;
        let mut layers = Vec::with_capacity(c.n_layers);
        for _ in 0..c.n_layers {
            layers.push(DeviceLayer {
                attn_norm: upload32(dev, &vec![1.0; h])?,
                wqkv: mat(h + 2 * kvd, h)?,
                wo: mat(h, h)?,
                ffn_norm: upload32(dev, &vec![1.0; h])?,
                w_gate_up: mat(2 * f, h)?,
                w_down: mat(h, f)?,
            });
        }
        let output_norm = upload32(dev, &vec![1.0; h])?;
        Self::assemble(dev, c, embed, None, output_norm, layers, "synthetic")
    }

    fn assemble(
        dev: &Arc<GpuDevice>,
        config: LlamaConfig,
        embed: CudaSlice<u16>,
        output: Option<CudaSlice<u16>>,
        output_norm: CudaSlice<f32>,
        layers: Vec<DeviceLayer>,
        weights: &'static str,
    ) -> Result<Self> {
        let (cos, sin) = rope_table(config.n_ctx_train, config.head_dim, config.rope_base);
        Ok(Self {
            dev: dev.clone(),
            rope_cos: upload32(dev, &cos)?,
            rope_sin: upload32(dev, &sin)?,
            ops: ModelOps::new(dev).map_err(gpu)?,
            config,
            embed,
            output,
            output_norm,
            layers,
            weights,
        })
    }

    /// Device bytes of the weights as uploaded.
    pub fn weight_bytes(&self) -> usize {
        weight_bytes(&self.config, self.output.is_none())
    }

    /// The output projection `[n_vocab][hidden]` (the embedding table when tied).
    pub fn output_matrix(&self) -> &CudaSlice<u16> {
        self.output.as_ref().unwrap_or(&self.embed)
    }
}
