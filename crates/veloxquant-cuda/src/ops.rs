//! Launchers of the model's element-wise kernels (kernels/model.cu), each checking its
//! buffers' extents before launching.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

use crate::device::{Family, GpuDevice};
use crate::error::{drv, CudaError, Result};

pub struct ModelOps {
    f_embed: CudaFunction,
    f_rmsnorm: CudaFunction,
    f_rmsnorm_rows: CudaFunction,
    f_rope: CudaFunction,
    f_swiglu: CudaFunction,
    f_argmax: CudaFunction,
    f_sample: CudaFunction,
    f_fill16: CudaFunction,
    f_fill32: CudaFunction,
    sm_count: usize,
}

fn need(op: &'static str, have: usize, want: usize) -> Result<()> {
    if have < want {
        return Err(CudaError::ShapeMismatch { op, expected: want, got: have });
    }
    Ok(())
}

/// From this many rows RMSNorm runs a warp per row (prefill) instead of a block per row.
const RMS_WARP_ROWS: usize = 128;

fn rows_cfg(rows: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

fn int(x: usize) -> Result<i32> {
    i32::try_from(x).map_err(|_| CudaError::ShapeMismatch { op: "size fits i32", expected: i32::MAX as usize, got: x })
}

/// One row's words for [`ModelOps::sample`]: temperature (≤ 0: argmax), top-p, top-k (0:
/// none), seed, and the request's draw index.
pub fn sample_params(temperature: f32, top_p: f32, top_k: u64, seed: u64, draw: u64) -> [u64; 4] {
    [temperature.to_bits() as u64 | (top_p.to_bits() as u64) << 32, top_k, seed, draw]
}

/// The RoPE destination of the queries: f32 `[row][n_q][d]` (decode), or f16 in the prefill
/// GEMM's grouped layout `[kv_head][row][group][d]`.
pub enum QOut<'a, 'b> {
    F32(&'a mut CudaViewMut<'b, f32>),
    Grouped16(&'a mut CudaViewMut<'b, u16>),
}

impl ModelOps {
    pub fn new(dev: &Arc<GpuDevice>) -> Result<Self> {
        let f = |name: &str| dev.function(Family::Model, &[], name);
        Ok(Self {
            f_embed: f("embed")?,
            f_rmsnorm: f("rmsnorm")?,
            f_rmsnorm_rows: f("rmsnorm_rows")?,
            f_rope: f("rope")?,
            f_swiglu: f("swiglu")?,
            f_argmax: f("argmax_rows")?,
            f_sample: f("sample_rows")?,
            f_fill16: f("fill_f16")?,
            f_fill32: f("fill_f32")?,
            sm_count: dev.sm_count,
        })
    }

    /// `x[t] = table[ids[t]]` for `rows` ids (each < `n_vocab`, checked by the caller's
    /// tokenizer bounds), table `[n_vocab][h]` f16.
    pub fn embed(
        &self,
        st: &Arc<CudaStream>,
        ids: &CudaView<'_, i32>,
        rows: usize,
        table: &CudaSlice<u16>,
        h: usize,
        x: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        need("embed ids", ids.len(), rows)?;
        need("embed out", x.len(), rows * h)?;
        let hi = int(h)?;
        let mut l = st.launch_builder(&self.f_embed);
        l.arg(ids).arg(table).arg(&hi).arg(x);
        // SAFETY: matches embed(ids, table, h, x); x holds rows·h, ids rows entries whose
        // values the engine bounds by the vocabulary (the table's rows).
        unsafe { l.launch(rows_cfg(rows)) }.map_err(drv("embed"))?;
        Ok(())
    }

    /// `out16[r] = f16(x[r] · w / rms(x[r]))`, x rows `ld_x` apart.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm(
        &self,
        st: &Arc<CudaStream>,
        x: &CudaView<'_, f32>,
        ld_x: usize,
        rows: usize,
        w: &CudaSlice<f32>,
        eps: f32,
        out16: &mut CudaViewMut<'_, u16>,
    ) -> Result<()> {
        let h = w.len();
        if rows == 0 {
            return Ok(());
        }
        if h > 256 * 32 {
            return Err(CudaError::ShapeMismatch { op: "rmsnorm width (≤ 8192)", expected: 8192, got: h });
        }
        need("rmsnorm x", x.len(), (rows - 1) * ld_x + h)?;
        need("rmsnorm out", out16.len(), rows * h)?;
        let (ld, hi) = (ld_x as i64, int(h)?);
        // Many rows (prefill): a warp per row (model.cu rmsnorm_rows, h ≤ 2048); else a block.
        if rows >= RMS_WARP_ROWS && h <= 2048 {
            let n = int(rows)?;
            let mut l = st.launch_builder(&self.f_rmsnorm_rows);
            l.arg(x).arg(&ld).arg(w).arg(&hi).arg(&eps).arg(&n).arg(out16);
            let cfg =
                LaunchConfig { grid_dim: (rows.div_ceil(8) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: matches rmsnorm_rows(x, ld_x, w, h, eps, n_rows, out16); rows < n_rows are
            // read and written, extents checked above.
            unsafe { l.launch(cfg) }.map_err(drv("rmsnorm_rows"))?;
            return Ok(());
        }
        let mut l = st.launch_builder(&self.f_rmsnorm);
        l.arg(x).arg(&ld).arg(w).arg(&hi).arg(&eps).arg(out16);
        // SAFETY: matches rmsnorm(x, ld_x, w, h, eps, out16); extents checked above.
        unsafe { l.launch(rows_cfg(rows)) }.map_err(drv("rmsnorm"))?;
        Ok(())
    }

    /// RoPE of the fused QKV rows (`ld` f32 per row: q heads, k heads, v heads), positions
    /// `pos[row]` < the table's positions; q to `q`, rotated keys to `k32` `[row][hkv][d]`.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        st: &Arc<CudaStream>,
        qkv: &CudaView<'_, f32>,
        ld: usize,
        pos: &CudaView<'_, i32>,
        rows: usize,
        tables: (&CudaSlice<f32>, &CudaSlice<f32>),
        (hq, hkv, d): (usize, usize, usize),
        q: QOut<'_, '_>,
        k32: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        need("rope qkv", qkv.len(), (rows - 1) * ld + (hq + hkv) * d)?;
        need("rope qkv width", ld, (hq + 2 * hkv) * d)?;
        need("rope pos", pos.len(), rows)?;
        need("rope k", k32.len(), rows * hkv * d)?;
        let (ldi, hqi, hki, di, ri) = (int(ld)?, int(hq)?, int(hkv)?, int(d)?, int(rows)?);
        let mut l = st.launch_builder(&self.f_rope);
        l.arg(qkv).arg(&ldi).arg(pos).arg(tables.0).arg(tables.1).arg(&hqi).arg(&hki).arg(&di).arg(&ri);
        let null = 0u64;
        match q {
            QOut::F32(q32) => {
                need("rope q", q32.len(), rows * hq * d)?;
                l.arg(q32).arg(&null);
            }
            QOut::Grouped16(q16) => {
                need("rope q16", q16.len(), rows * hq * d)?;
                l.arg(&null).arg(q16);
            }
        }
        l.arg(k32);
        // SAFETY: matches rope(...) in model.cu; extents checked above; positions are below the
        // tables' length (the engine bounds every sequence by the model's context, the tables'
        // size).
        unsafe { l.launch(rows_cfg(rows)) }.map_err(drv("rope"))?;
        Ok(())
    }

    /// `act16[t][j] = silu(gate) · up` over `rows` rows of `[gate (f) | up (f)]`.
    pub fn swiglu(
        &self,
        st: &Arc<CudaStream>,
        gu: &CudaView<'_, f32>,
        f: usize,
        rows: usize,
        act16: &mut CudaViewMut<'_, u16>,
    ) -> Result<()> {
        need("swiglu in", gu.len(), rows * 2 * f)?;
        need("swiglu out", act16.len(), rows * f)?;
        let (fi, n) = (int(f)?, (rows * f) as i64);
        let cfg =
            LaunchConfig { grid_dim: ((self.sm_count * 4) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut l = st.launch_builder(&self.f_swiglu);
        l.arg(gu).arg(&fi).arg(&n).arg(act16);
        // SAFETY: matches swiglu(gu, f, n, act16); extents checked above.
        unsafe { l.launch(cfg) }.map_err(drv("swiglu"))?;
        Ok(())
    }

    /// Greedy token of each logits row.
    pub fn argmax(
        &self,
        st: &Arc<CudaStream>,
        logits: &CudaView<'_, f32>,
        rows: usize,
        n_vocab: usize,
        ids: &mut CudaViewMut<'_, i32>,
    ) -> Result<()> {
        need("argmax logits", logits.len(), rows * n_vocab)?;
        need("argmax ids", ids.len(), rows)?;
        let nv = int(n_vocab)?;
        let mut l = st.launch_builder(&self.f_argmax);
        l.arg(logits).arg(&nv).arg(ids);
        let cfg = LaunchConfig { block_dim: (1024, 1, 1), ..rows_cfg(rows) };
        // SAFETY: matches argmax_rows(logits, n_vocab, ids) with its 1024-thread block; extents
        // checked above.
        unsafe { l.launch(cfg) }.map_err(drv("argmax"))?;
        Ok(())
    }

    /// A sampled token of each logits row (veloxquant-llm's `sample_token`, the same
    /// arithmetic): `params` holds 4 words per row (see [`sample_params`]).
    pub fn sample(
        &self,
        st: &Arc<CudaStream>,
        logits: &CudaView<'_, f32>,
        rows: usize,
        n_vocab: usize,
        params: &CudaView<'_, u64>,
        ids: &mut CudaViewMut<'_, i32>,
    ) -> Result<()> {
        need("sample logits", logits.len(), rows * n_vocab)?;
        need("sample params", params.len(), 4 * rows)?;
        need("sample ids", ids.len(), rows)?;
        let nv = int(n_vocab)?;
        let mut l = st.launch_builder(&self.f_sample);
        l.arg(logits).arg(&nv).arg(params).arg(ids);
        let cfg = LaunchConfig { block_dim: (1024, 1, 1), ..rows_cfg(rows) };
        // SAFETY: matches sample_rows(logits, n_vocab, params, ids) with its 1024-thread
        // block; logits hold rows·n_vocab, params 4·rows, ids rows (checked above).
        unsafe { l.launch(cfg) }.map_err(drv("sample"))?;
        Ok(())
    }

    /// Fill with `offset + scale · N(0,1)` from a counter-based generator (random weights).
    pub fn fill_f16(
        &self,
        st: &Arc<CudaStream>,
        x: &mut CudaSlice<u16>,
        seed: u64,
        scale: f32,
        offset: f32,
    ) -> Result<()> {
        let n = x.len() as u64;
        let cfg =
            LaunchConfig { grid_dim: ((self.sm_count * 8) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut l = st.launch_builder(&self.f_fill16);
        l.arg(x).arg(&n).arg(&seed).arg(&scale).arg(&offset);
        // SAFETY: fill_f16(out, n, …) writes n = x.len() values.
        unsafe { l.launch(cfg) }.map_err(drv("fill_f16"))?;
        Ok(())
    }

    pub fn fill_f32(
        &self,
        st: &Arc<CudaStream>,
        x: &mut CudaSlice<f32>,
        seed: u64,
        scale: f32,
        offset: f32,
    ) -> Result<()> {
        let n = x.len() as u64;
        let cfg =
            LaunchConfig { grid_dim: ((self.sm_count * 8) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut l = st.launch_builder(&self.f_fill32);
        l.arg(x).arg(&n).arg(&seed).arg(&scale).arg(&offset);
        // SAFETY: fill_f32(out, n, …) writes n = x.len() values.
        unsafe { l.launch(cfg) }.map_err(drv("fill_f32"))?;
        Ok(())
    }
}
