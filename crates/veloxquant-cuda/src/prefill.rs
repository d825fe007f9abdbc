//! Prefill attention over the device cache, one sequence's chunk at a time, attending exactly
//! as decode would: the query at position p sees keys older than its window through the codes
//! and the newer ones exact (kernels/prefill.cu). The products are cuBLAS GEMMs over the
//! dense decoded cache (`kv_dense`), batched over the KV heads; the causal mask and the exact
//! band are applied between them.
//!
//! Per chunk: `window` (the exact values before the append, and the chunk's) → the cache's
//! append → `dense` → S = Q·K̃ᵀ → band softmax → O = P·Ṽ → band values, out as f16.
//! [`PrefillKernel::Flash`] replaces the last four steps by one fused kernel (no score
//! matrix: its workspace is the dense copy and the window alone) that attends the chunks of
//! up to four sequences in one launch (`run_many`: each a few hundred blocks, too few to fill
//! the GPU alone); the GEMM path remains for head size 256 and rabitq keys (scored with a
//! second, 4-bit query).

use std::sync::Arc;

use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};

use crate::blas::{Blas, Mat};
use crate::cache::{AppendRow, AppendSrc, GpuKvCache};
use crate::device::{Family, GpuDevice};
use crate::error::{drv, CudaError, Result};

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct BandArgs {
    p0: i32,
    n_q: i32,
    n_end: i32,
    coded0: i32,
    win_lo: i32,
    ld_s: i32,
    band_cap: i32,
    scale: f32,
}
// SAFETY: plain 32-bit fields, `#[repr(C)]`, the layout of prefill.cu's struct BandArgs.
unsafe impl DeviceRepr for BandArgs {}

/// One sequence's chunk in a flash launch: prefill.cu's struct FlashItem (its band, first
/// row, and the device addresses of its dense copy and window).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct FlashItem {
    a: BandArgs,
    row0: i32,
    pad: i32,
    kd: u64,
    vd: u64,
    kwin: u64,
    vwin: u64,
}
// SAFETY: plain integer fields, `#[repr(C)]`, the layout of prefill.cu's struct FlashItem
// (pointers as u64 addresses, 8-aligned after 40 bytes of 32-bit fields).
unsafe impl DeviceRepr for FlashItem {}
// SAFETY: all-zero bits are a valid FlashItem (integers only).
unsafe impl cudarc::driver::ValidAsZeroBits for FlashItem {}

/// Device bytes the flash plan may spend on parallel items' dense copies and windows.
const FLASH_ITEMS_BYTES: usize = 64 << 20;
/// Most sequences one flash launch attends.
const FLASH_ITEMS_MAX: usize = 4;

/// How a chunk's attention is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillKernel {
    /// cuBLAS GEMMs over the dense copy with the band fixed between them.
    Gemm,
    /// One fused kernel (`flash_prefill`): tiles of the dense copy and of the window, online
    /// softmax, tensor-core products; head sizes up to 128, keys not rabitq.
    Flash,
}

impl PrefillKernel {
    /// Flash where it applies, else the GEMMs.
    pub fn best(cfg: &crate::GpuCacheConfig) -> Self {
        if Self::Flash.supports(cfg) {
            Self::Flash
        } else {
            Self::Gemm
        }
    }

    pub fn supports(self, cfg: &crate::GpuCacheConfig) -> bool {
        self == Self::Gemm || (matches!(cfg.head_dim, 64 | 128) && cfg.k.name != "rabitq")
    }
}

/// Keys per flash tile (prefill.cu `FBN`); a block's query rows are 16 per warp.
const FLASH_KEYS: usize = 64;

/// Buffers and kernels for chunks of up to `max_chunk` tokens in sequences of up to
/// `max_ctx` tokens.
pub struct PrefillAttn {
    pub dev: Arc<GpuDevice>,
    cache_id: u64,
    n_q_heads: usize,
    group: usize,
    max_chunk: usize,
    max_ctx: usize,
    win_ld: usize,
    band_cap: usize,
    /// One buffer set per item of a flash launch (one for the GEMM path).
    kwin: Vec<CudaSlice<u16>>,
    vwin: Vec<CudaSlice<u16>>,
    kd: Vec<CudaSlice<u16>>,
    vd: Vec<CudaSlice<u16>>,
    items_dev: CudaSlice<FlashItem>,
    d: usize,
    s: CudaSlice<f32>,
    p: CudaSlice<u16>,
    o: CudaSlice<f32>,
    wband: CudaSlice<f32>,
    /// rabitq keys: the chunk's 4-bit queries and the kernel forming them.
    qbar: Option<(CudaSlice<u16>, CudaFunction)>,
    f_softmax: CudaFunction,
    f_band_v: CudaFunction,
    /// The fused kernel, its dynamic shared memory and warps per block, when the plan uses it.
    flash: Option<(CudaFunction, u32, usize)>,
}

/// The defines of the prefill module for a cache shape and GQA group `g`.
pub fn prefill_defines(cfg: &crate::GpuCacheConfig, g: usize, row_mode: bool) -> [(&'static str, i64); 9] {
    [
        ("D", cfg.head_dim as i64),
        ("G", g as i64),
        ("NKV", cfg.n_kv_heads as i64),
        ("T", cfg.page_tokens as i64),
        ("NSINK", cfg.sink as i64),
        ("R", cfg.recent as i64),
        ("ROWMODE", row_mode as i64),
        ("KQUANT", (cfg.k.name == "rabitq") as i64),
        // rabitq's dense rotation (d not a power of two) after its signs in the transform.
        (
            "KDENSE_W",
            if cfg.k.name == "rabitq" && !cfg.head_dim.is_power_of_two() { cfg.head_dim.pow(2) as i64 } else { 0 },
        ),
    ]
}

/// Items per flash launch for buffer sets of `set_bytes` each.
fn flash_items(set_bytes: usize) -> usize {
    (FLASH_ITEMS_BYTES / set_bytes.max(1)).clamp(1, FLASH_ITEMS_MAX)
}

/// Bytes of one buffer set: the window's and the dense context's K and V (f16), all KV heads.
fn set_bytes(cache: &GpuKvCache, max_chunk: usize, max_ctx: usize) -> usize {
    let (hk, d) = (cache.cfg.n_kv_heads, cache.cfg.head_dim);
    let win_ld = max_chunk + cache.exact_slots();
    2 * hk * win_ld * d * 2 + 2 * hk * max_ctx * d * 2
}

fn ld_for(n_end: usize) -> usize {
    n_end.div_ceil(16) * 16
}

impl PrefillAttn {
    /// Device bytes `new` allocates (planned before allocating).
    pub fn workspace_bytes(cache: &GpuKvCache, n_q_heads: usize, max_chunk: usize, max_ctx: usize) -> usize {
        Self::workspace_bytes_for(cache, n_q_heads, max_chunk, max_ctx, PrefillKernel::best(&cache.cfg))
    }

    /// As [`Self::workspace_bytes`], for `kernel`.
    pub fn workspace_bytes_for(
        cache: &GpuKvCache,
        n_q_heads: usize,
        max_chunk: usize,
        max_ctx: usize,
        kernel: PrefillKernel,
    ) -> usize {
        let d = cache.cfg.head_dim;
        let dense = set_bytes(cache, max_chunk, max_ctx);
        if kernel == PrefillKernel::Flash {
            return dense * flash_items(dense) + FLASH_ITEMS_MAX * std::mem::size_of::<FlashItem>();
        }
        let band_cap = cache.exact_slots();
        let rows = max_chunk * n_q_heads; // n_q · G per KV head, all heads
        let ld = ld_for(max_ctx);
        let qbar = if cache.cfg.k.name == "rabitq" { rows * d * 2 } else { 0 };
        dense + rows * ld * (4 + 2) + rows * d * 4 + rows * band_cap * 4 + qbar
    }

    /// The plan with the best kernel for the cache ([`PrefillKernel::best`]).
    pub fn new(cache: &GpuKvCache, n_q_heads: usize, max_chunk: usize, max_ctx: usize) -> Result<Self> {
        Self::with_kernel(cache, n_q_heads, max_chunk, max_ctx, PrefillKernel::best(&cache.cfg))
    }

    /// The plan with `kernel`; `UnsupportedFormat` where it does not apply.
    pub fn with_kernel(
        cache: &GpuKvCache,
        n_q_heads: usize,
        max_chunk: usize,
        max_ctx: usize,
        kernel: PrefillKernel,
    ) -> Result<Self> {
        let cfg = &cache.cfg;
        if !kernel.supports(cfg) {
            return Err(CudaError::UnsupportedFormat {
                format: cfg.k.to_string(),
                why: "the flash prefill needs head size ≤ 128 and keys other than rabitq",
            });
        }
        let flash = kernel == PrefillKernel::Flash;
        let (hk, d) = (cfg.n_kv_heads, cfg.head_dim);
        if n_q_heads == 0 || !n_q_heads.is_multiple_of(hk) || max_chunk == 0 || max_ctx == 0 {
            return Err(CudaError::ShapeMismatch {
                op: "prefill heads / chunk / context",
                expected: hk,
                got: n_q_heads,
            });
        }
        let g = n_q_heads / hk;
        let dev = cache.dev.clone();
        let defines = prefill_defines(cfg, g, cache.row_mode);
        let win_ld = max_chunk + cache.exact_slots();
        let band_cap = cache.exact_slots();
        // The GEMM path's score, weight and output buffers (one element each with flash).
        let (rows, ld) = if flash { (0, 0) } else { (max_chunk * n_q_heads, ld_for(max_ctx)) };
        let sets = if flash { flash_items(set_bytes(cache, max_chunk, max_ctx)) } else { 1 };
        let s = &dev.stream;
        let alloc16 = |n: usize| s.alloc_zeros::<u16>(n.max(1)).map_err(drv("alloc prefill"));
        let alloc32 = |n: usize| s.alloc_zeros::<f32>(n.max(1)).map_err(drv("alloc prefill"));
        Ok(Self {
            cache_id: cache.id,
            n_q_heads,
            group: g,
            max_chunk,
            max_ctx,
            win_ld,
            band_cap,
            kwin: (0..sets).map(|_| alloc16(hk * win_ld * d)).collect::<Result<_>>()?,
            vwin: (0..sets).map(|_| alloc16(hk * win_ld * d)).collect::<Result<_>>()?,
            kd: (0..sets).map(|_| alloc16(hk * max_ctx * d)).collect::<Result<_>>()?,
            vd: (0..sets).map(|_| alloc16(hk * max_ctx * d)).collect::<Result<_>>()?,
            items_dev: s.alloc_zeros::<FlashItem>(sets).map_err(drv("alloc prefill"))?,
            d,
            s: alloc32(rows * ld)?,
            p: alloc16(rows * ld)?,
            o: alloc32(rows * d)?,
            wband: alloc32(rows * band_cap)?,
            // rabitq keys: the chunk's 4-bit queries (rabitq_query).
            qbar: if !flash && cfg.k.name == "rabitq" {
                Some((alloc16(rows * d)?, dev.function(Family::Prefill, &defines, "rabitq_query")?))
            } else {
                None
            },
            f_softmax: dev.function(Family::Prefill, &defines, "band_softmax")?,
            f_band_v: dev.function(Family::Prefill, &defines, "band_v")?,
            flash: if flash {
                let fw = dev.tuning.prefill_warps;
                let mut fdefs = defines.to_vec();
                fdefs.push(("FW", fw as i64));
                let f = dev.function(Family::Prefill, &fdefs, "flash_prefill")?;
                // Two stages of a K and a V tile, rows padded by 8 halves.
                let smem = (2 * 2 * FLASH_KEYS * (d + 8) * 2) as u32;
                f.set_attribute(
                    cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )
                .map_err(drv("set_attribute"))?;
                Some((f, smem, fw))
            } else {
                None
            },
            dev,
        })
    }

    /// The kernel this plan runs.
    pub fn kernel(&self) -> PrefillKernel {
        if self.flash.is_some() {
            PrefillKernel::Flash
        } else {
            PrefillKernel::Gemm
        }
    }

    /// One sequence's chunk at `layer`: appends it to the cache (`row`, planned by
    /// `plan_append` and already applied to the device tables; `row_dev` its device copy) and
    /// writes its attention output, f16 `[token][n_q_heads][d]`, at rows `row.src_row..` of
    /// `out16`. `q16`: every batch row's queries in the grouped layout `[kv][n_rows][G][d]`.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &mut self,
        blas: &Blas,
        cache: &mut GpuKvCache,
        layer: usize,
        row: &AppendRow,
        row_dev: &CudaView<'_, AppendRow>,
        src: (&AppendSrc<'_>, &AppendSrc<'_>),
        q16: &CudaView<'_, u16>,
        n_rows: usize,
        out16: &mut CudaViewMut<'_, u16>,
        st: &Arc<CudaStream>,
    ) -> Result<()> {
        self.run_many(blas, cache, layer, std::slice::from_ref(row), row_dev, src, q16, n_rows, out16, st)
    }

    /// Sequences processed per flash launch (each has its own dense copy and window).
    pub fn items_per_launch(&self) -> usize {
        self.kd.len()
    }

    /// `run` for the chunks of several sequences (distinct slots; `rows[i]`'s device copy at
    /// `rows_dev[i]`). The flash kernel attends up to [`Self::items_per_launch`] of them in one
    /// launch, so short launches do not leave the GPU idle one after another.
    #[allow(clippy::too_many_arguments)]
    pub fn run_many(
        &mut self,
        blas: &Blas,
        cache: &mut GpuKvCache,
        layer: usize,
        rows: &[AppendRow],
        rows_dev: &CudaView<'_, AppendRow>,
        src: (&AppendSrc<'_>, &AppendSrc<'_>),
        q16: &CudaView<'_, u16>,
        n_rows: usize,
        out16: &mut CudaViewMut<'_, u16>,
        st: &Arc<CudaStream>,
    ) -> Result<()> {
        if cache.id != self.cache_id {
            return Err(CudaError::ShapeMismatch { op: "prefill plan used with another cache", expected: 0, got: 1 });
        }
        if rows_dev.len() < rows.len() {
            return Err(CudaError::ShapeMismatch {
                op: "prefill rows on the device",
                expected: rows.len(),
                got: rows_dev.len(),
            });
        }
        let need = n_rows * self.n_q_heads * cache.cfg.head_dim;
        if q16.len() < need || out16.len() < need {
            return Err(CudaError::ShapeMismatch {
                op: "prefill q/out length",
                expected: need,
                got: q16.len().min(out16.len()),
            });
        }
        let mut seen = std::collections::HashSet::new();
        if !rows.iter().all(|r| seen.insert(r.slot)) {
            return Err(CudaError::ShapeMismatch {
                op: "prefill rows of distinct slots",
                expected: rows.len(),
                got: seen.len(),
            });
        }
        let per = self.items_per_launch();
        for (c, group) in rows.chunks(per).enumerate() {
            // Per group: each chunk's exact window (before the append), one append of the
            // group's rows, each chunk's dense copy, then its attention.
            let first = c * per;
            let mut bands = Vec::with_capacity(group.len());
            for (j, row) in group.iter().enumerate() {
                let (band, width) = self.band(cache, row, n_rows)?;
                let row_dev = rows_dev.slice(first + j..first + j + 1);
                cache.launch_window(
                    layer,
                    &row_dev,
                    width,
                    src.0,
                    src.1,
                    &mut self.kwin[j],
                    &mut self.vwin[j],
                    self.win_ld,
                    st,
                )?;
                bands.push(band);
            }
            let max_new = group.iter().map(|r| r.n as usize).max().unwrap_or(0);
            let max_enc = group.iter().map(|r| (r.coded1 - r.coded0) as usize).max().unwrap_or(0);
            let group_dev = rows_dev.slice(first..first + group.len());
            cache.launch_append(layer, &group_dev, group.len(), max_new, max_enc, src.0, src.1, st)?;
            let mut items = Vec::with_capacity(group.len());
            for (j, (row, &a)) in group.iter().zip(&bands).enumerate() {
                cache.launch_dense(layer, row.slot as usize, &mut self.kd[j], &mut self.vd[j], self.max_ctx, st)?;
                if self.flash.is_some() {
                    items.push(FlashItem {
                        a,
                        row0: row.src_row,
                        pad: 0,
                        kd: self.kd[j].device_ptr(st).0,
                        vd: self.vd[j].device_ptr(st).0,
                        kwin: self.kwin[j].device_ptr(st).0,
                        vwin: self.vwin[j].device_ptr(st).0,
                    });
                } else {
                    self.gemms(blas, cache, layer, a, row, q16, n_rows, out16, st)?;
                }
            }
            if !items.is_empty() {
                self.launch_flash(&items, q16, n_rows, out16, st)?;
            }
        }
        Ok(())
    }

    /// Checks one chunk against the plan; its band and the width of its exact window.
    fn band(&self, cache: &GpuKvCache, row: &AppendRow, n_rows: usize) -> Result<(BandArgs, usize)> {
        let (d, sink) = (cache.cfg.head_dim, cache.cfg.sink);
        let (n_q, p0) = (row.n as usize, row.pos0 as usize);
        let n_end = p0 + n_q;
        let r0 = row.src_row as usize;
        if n_q == 0
            || n_q > self.max_chunk
            || n_end > self.max_ctx
            || r0 + n_q > n_rows
            || row.coded0 < 0
            || row.coded1 < row.coded0
        {
            return Err(CudaError::ShapeMismatch {
                op: "prefill chunk within the plan",
                expected: self.max_chunk,
                got: n_q,
            });
        }
        let win_lo = sink + row.coded0 as usize;
        let band = BandArgs {
            p0: p0 as i32,
            n_q: n_q as i32,
            n_end: n_end as i32,
            coded0: row.coded0,
            win_lo: win_lo as i32,
            ld_s: ld_for(n_end) as i32,
            band_cap: self.band_cap as i32,
            scale: 1.0 / (d as f32).sqrt(),
        };
        Ok((band, n_end.saturating_sub(win_lo)))
    }

    /// One flash launch over staged items (`items[j]` in buffer set j).
    fn launch_flash(
        &mut self,
        items: &[FlashItem],
        q16: &CudaView<'_, u16>,
        n_rows: usize,
        out16: &mut CudaViewMut<'_, u16>,
        st: &Arc<CudaStream>,
    ) -> Result<()> {
        let Some((f, smem, fw)) = &self.flash else {
            return Err(CudaError::ShapeMismatch { op: "flash launch on a GEMM plan", expected: 1, got: 0 });
        };
        let hk = self.n_q_heads / self.group;
        let max_rows = items.iter().map(|it| it.a.n_q as usize * self.group).max().unwrap_or(0);
        if items.len() > self.items_dev.len() {
            return Err(CudaError::ShapeMismatch {
                op: "flash items per launch",
                expected: self.items_dev.len(),
                got: items.len(),
            });
        }
        if max_rows == 0 {
            return Ok(());
        }
        st.memcpy_htod(items, &mut self.items_dev.slice_mut(..items.len())).map_err(drv("htod flash items"))?;
        let grid = LaunchConfig {
            grid_dim: (max_rows.div_ceil(16 * fw) as u32, hk as u32, items.len() as u32),
            block_dim: (32 * *fw as u32, 1, 1),
            shared_mem_bytes: *smem,
        };
        let qgs = (n_rows * self.group * self.d) as i64;
        let (kd_ld, wld) = (self.max_ctx as i64, self.win_ld as i64);
        let mut l = st.launch_builder(f);
        l.arg(&self.items_dev).arg(q16).arg(&qgs).arg(&kd_ld).arg(&wld).arg(out16);
        // SAFETY: matches flash_prefill (kernels/prefill.cu). Each item was checked by `stage`:
        // its q16 rows row0·G .. (row0 + n_q)·G of each of the hk groups (stride n_rows·G·d)
        // lie inside q16 (len ≥ n_rows·hq·d, checked in run_many); its kd/vd (hk × max_ctx
        // rows) and kwin/vwin (hk × win_ld rows) point at this plan's buffer set, live for the
        // plan, just written by stage and read below n_end ≤ max_ctx and [0, n_end − win_lo);
        // out16 rows row0 .. row0 + n_q ≤ n_rows are written. items_dev holds items.len()
        // entries, uploaded above in stream order.
        unsafe { l.launch(grid) }.map_err(drv("flash_prefill"))?;
        Ok(())
    }

    /// The GEMM path for one staged chunk (buffer set 0).
    #[allow(clippy::too_many_arguments)]
    fn gemms(
        &mut self,
        blas: &Blas,
        cache: &GpuKvCache,
        layer: usize,
        a: BandArgs,
        row: &AppendRow,
        q16: &CudaView<'_, u16>,
        n_rows: usize,
        out16: &mut CudaViewMut<'_, u16>,
        st: &Arc<CudaStream>,
    ) -> Result<()> {
        let (hk, d) = (cache.cfg.n_kv_heads, cache.cfg.head_dim);
        let (n_q, n_end) = (row.n as usize, a.n_end as usize);
        let g = self.group;
        let r0 = row.src_row as usize;
        let rows = n_q * g;
        let ld_s = a.ld_s as usize;
        let q_g = q16.slice(r0 * g * d..);
        let (qgs, wld) = ((n_rows * g * d) as i64, self.win_ld as i64);
        if let Some((qbar, f)) = &mut self.qbar {
            let signs = cache.k.layer_signs(layer, hk);
            let rows_i = rows as i32;
            let cfg_q = LaunchConfig {
                grid_dim: (rows as u32, hk as u32, 1),
                block_dim: (d as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut l = st.launch_builder(f);
            l.arg(&q_g).arg(&qgs).arg(&signs).arg(&cache.k.rot_scale).arg(qbar).arg(&rows_i);
            // SAFETY: matches rabitq_query (kernels/prefill.cu): q_g holds hk groups of
            // n_rows·G rows from row r0·G (rows = n_q·G of them read), the signs hk·d floats,
            // qbar hk·rows·d ≤ hk·max_chunk·G·d values.
            unsafe { l.launch(cfg_q) }.map_err(drv("rabitq_query"))?;
        }
        let q0 = match &self.qbar {
            Some((qbar, _)) => Mat::f16(qbar, d, st),
            None => Mat::f16(q16, d, st).rows_from(r0 * g),
        };
        let q_stride = if self.qbar.is_some() { rows * d } else { n_rows * g * d };
        let kd = Mat::f16(&self.kd[0], d, st);
        let sm = Mat::f32(&self.s, ld_s, st);
        blas.gemm_batched(
            rows,
            n_end,
            d,
            q0,
            q_stride,
            kd,
            self.max_ctx * d,
            sm,
            rows * ld_s,
            hk,
            1.0 / (d as f32).sqrt(),
            0.0,
            false,
        )?;
        let grid = LaunchConfig {
            grid_dim: (rows as u32, hk as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: (self.band_cap * 4) as u32,
        };
        let kd_ld = self.max_ctx as i64;
        let mut l = st.launch_builder(&self.f_softmax);
        l.arg(&a)
            .arg(&mut self.s)
            .arg(&mut self.p)
            .arg(&mut self.wband)
            .arg(&q_g)
            .arg(&qgs)
            .arg(&self.kwin[0])
            .arg(&wld)
            .arg(&self.kd[0])
            .arg(&kd_ld);
        // SAFETY: matches band_softmax (kernels/prefill.cu): S and P hold hk·rows·ld_s values
        // (rows ≤ max_chunk·G, ld_s ≤ ld_for(max_ctx)), the band ≤ band_cap entries per row lies
        // inside the window [win_lo, n_end) written just above.
        unsafe { l.launch(grid) }.map_err(drv("band_softmax"))?;
        let pm = Mat::f16(&self.p, ld_s, st);
        let vd = Mat::f16(&self.vd[0], d, st);
        let om = Mat::f32(&self.o, d, st);
        blas.gemm_batched(rows, d, n_end, pm, rows * ld_s, vd, self.max_ctx * d, om, rows * d, hk, 1.0, 0.0, true)?;
        let grid_v =
            LaunchConfig { grid_dim: (rows as u32, hk as u32, 1), block_dim: (d as u32, 1, 1), shared_mem_bytes: 0 };
        let r0i = r0 as i32;
        let mut l = st.launch_builder(&self.f_band_v);
        l.arg(&a).arg(&self.o).arg(&self.wband).arg(&self.vwin[0]).arg(&wld).arg(out16).arg(&r0i);
        // SAFETY: matches band_v; o and wband as written above, out16 holds n_rows·hq·d values
        // and rows r0 .. r0 + n_q < n_rows are written.
        unsafe { l.launch(grid_v) }.map_err(drv("band_v"))?;
        Ok(())
    }
}
