//! Fused encode on the GPU: norm → rotation → quantize → pack → side info, bit-identical to
//! the CPU's `encode_page`. Pages of 32 tokens (the default) of q8_0, q4_0, rabitq,
//! turboquant_rvq, turboquant_frac (rows of whole words; `Tuning::encode_frac_pages`) and
//! turboquant_mse codes use the thread-per-row kernels (`encode_pages_tpr`:
//! one warp per page, one lane per row, all in registers; two lanes per row for the codes);
//! fp16 and other page sizes use one warp per row (`encode_rows`), qjl and turboquant_prod one
//! warp per 8 rows of a page (4 at d = 256: each load of the sketch serves them all; with f16
//! input at d = 64 and 128 their sketch on tensor cores, `Tuning::encode_sketch_mma`), kivi one
//! warp per page (the same kernel, launched with a warp per page), vecinfer a block per page
//! (`encode_vq_pages`: a lane per row, f32 ranking checked against a bound, the CPU's f64
//! distances where it cannot decide; the warp-per-row kernel where shared memory is short).

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};

use crate::device::{Family, GpuDevice};
use crate::error::{drv, CudaError, Result};
use crate::format::{GpuFormat, KernelKind, BIN_QK, BIN_QS};
use crate::tuning::Tuning;

/// Element type of the encoder's input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputKind {
    F32 = 0,
    F16 = 1,
    Bf16 = 2,
}

/// The encode module's defines for `fmt` and `input` (`pf`: the cp.async prefetch, sm_80+).
pub fn encode_defines(fmt: &GpuFormat, input: InputKind, pf: i64, t: &Tuning) -> [(&'static str, i64); 25] {
    [
        ("RPW", fmt.encode_rows_per_warp() as i64),
        ("GRP", fmt.group.max(1) as i64),
        ("PERCH", fmt.per_channel as i64),
        ("MSE_BYTES", fmt.mse_bytes as i64),
        ("BITS2", fmt.bits2.max(1) as i64),
        ("D", fmt.d as i64),
        ("T", fmt.t as i64),
        ("KIND", fmt.kind as i64),
        ("BITS", fmt.bits.max(1) as i64),
        ("ROT", fmt.rotation.is_some() as i64),
        ("EDEN", fmt.eden as i64),
        ("IN_KIND", input as i64),
        ("ROW_BYTES", fmt.row_bytes as i64),
        ("PAGE_BYTES", fmt.page_bytes as i64),
        ("WARPS", t.encode_warps as i64),
        // Keep a block's warps in step (one barrier per page) to share instruction fetch.
        ("LOCKSTEP", t.encode_lockstep as i64),
        // Blocks per SM the register allocation must allow (2: up to 255 registers, 8 warps).
        ("MINB", t.encode_minb),
        // Prefetch the next page's rows by cp.async into a second stage (sm_80+).
        ("PF", pf),
        ("WARPS2", t.encode_warps2 as i64),
        ("MINB2", t.encode_minb2),
        ("QK", BIN_QK as i64),
        ("QS", BIN_QS as i64),
        // turboquant_frac: the wide channels' count (BITS: theirs, BITS2: the others'), μ.
        ("NHI", fmt.frac.as_ref().map_or(0, |f| f.n_hi) as i64),
        ("CENTER", fmt.spec.center as i64),
        // A dense rotation's matrices after the format's transform words (0: Hadamard).
        ("DENSE_W", fmt.dense.len() as i64),
    ]
}

/// A page kernel as [`GpuEncoder::page_kernel`] sets it up.
struct PageKernel {
    f: CudaFunction,
    smem: u32,
    warps: usize,
    units_per_job: usize,
}

/// Whether `fmt` pages are encoded by a page kernel (thread per row) where its shared memory
/// fits: pages of 32 rows, a row per lane (or two) in registers (d ≤ 128, a power of two: the
/// codecs rotate by the FWHT), of a format with a page codec.
pub fn has_page_kernel(fmt: &GpuFormat, t: &Tuning) -> bool {
    fmt.t == 32
        && matches!(fmt.d, 64 | 128)
        && fmt.page_codec()
        && (fmt.kind != KernelKind::Frac || t.encode_frac_pages)
}

/// Whether `fmt` pages of `input` have their sketch signs on tensor cores (`encode_sketch_mma`):
/// qjl or turboquant_prod, pages of 32, d 64 or 128, f16 input, sm_80+, and the tuning asks.
pub fn has_sketch_mma(fmt: &GpuFormat, input: InputKind, dev: &GpuDevice) -> bool {
    matches!(fmt.kind, KernelKind::Sketch | KernelKind::Prod)
        && (fmt.sketch_halves() == 1 || dev.tuning.encode_sketch_mma_2x)
        && fmt.t == 32
        && matches!(fmt.d, 64 | 128)
        && input == InputKind::F16
        && dev.compute_capability.0 >= 8
        && dev.tuning.encode_sketch_mma
}

/// A page kernel's shared memory: the cell tables once per block, then each warp's stages
/// (its 32 or 16 input rows, and with the prefetch a second stage and the page's transform).
#[derive(Clone, Copy, Debug)]
pub struct PageSmem {
    pub name: &'static str,
    /// The tuning's warps per block (the most the host builds).
    pub warps: usize,
    pub table_bytes: usize,
    pub per_warp: usize,
    two_per_row: bool,
    units_per_job: usize,
}

impl PageSmem {
    pub fn new(fmt: &GpuFormat, input: InputKind, pf: i64, t: &Tuning) -> Self {
        // turboquant_mse codes: two threads per row (half the registers, twice the warps).
        let two_per_row = fmt.kind == KernelKind::Codes && pf != 0 && t.encode_two_per_row;
        let (name, warps, rows, units_per_job) = if two_per_row {
            ("encode_pages_tpr2", t.encode_warps2, 16, 2)
        } else {
            ("encode_pages_tpr", t.encode_warps, 32, 1)
        };
        let in_bytes = if input == InputKind::F32 { 4 } else { 2 };
        let stage = rows * (fmt.d * in_bytes + 16);
        // The cell tables' bins (4 words each) in shared memory take 128 bytes each.
        let table_bytes = fmt.bins.as_ref().map_or(0, |b| b.len() / 4 * 128);
        let stages = if pf != 0 { 2 } else { 1 };
        // With the prefetch, each stage also holds the page's transform (rotation signs;
        // turboquant_rvq: both rotations'; turboquant_frac: μ, slots and scale base too).
        let signs_bytes = if stages == 2 && fmt.rotation.is_some() { 4 * fmt.transform_words() } else { 0 };
        Self { name, warps, table_bytes, per_warp: stages * (stage + signs_bytes), two_per_row, units_per_job }
    }

    /// Dynamic shared bytes of a block of `warps`.
    pub fn dynamic_bytes(&self, warps: usize) -> usize {
        self.table_bytes + warps * self.per_warp
    }

    /// The most warps (up to the tuning's) whose block fits `limit` bytes beside
    /// `static_bytes` of static shared memory (0: none fits).
    pub fn fitting_warps(&self, limit: usize, static_bytes: usize) -> usize {
        (limit.saturating_sub(static_bytes + self.table_bytes) / self.per_warp).min(self.warps)
    }

    /// `t` with this kernel's warps per block set to `warps`.
    pub fn tuning(&self, t: &Tuning, warps: usize) -> Tuning {
        let mut tw = *t;
        if self.two_per_row {
            tw.encode_warps2 = warps;
        } else {
            tw.encode_warps = warps;
        }
        tw
    }

    /// Every tuning a device granting `limit` bytes a block may build this kernel with, when
    /// its static shared memory is below one warp's share (the compile-all test checks that
    /// bound on the PTX): the tuning's warps, and those that fit beside 0 or
    /// `per_warp − 1` static bytes.
    pub fn tunings(&self, t: &Tuning, limit: usize) -> Vec<Tuning> {
        let mut w = vec![self.warps];
        for static_bytes in [0, self.per_warp - 1] {
            let fit = self.fitting_warps(limit, static_bytes);
            if fit >= 1 && !w.contains(&fit) {
                w.push(fit);
            }
        }
        w.into_iter().map(|w| self.tuning(t, w)).collect()
    }
}

/// A format's own page kernel as set up: the sketch on tensor cores (`encode_sketch_mma`,
/// kernels/formats/qjl.cuh; qjl and turboquant_prod: a page per warp) or vecinfer's block per
/// page (`encode_vq_pages`, kernels/formats/vecinfer.cuh). Both take encode_rows' arguments
/// with the page count, loop over pages by the grid and check their dynamic shared memory.
struct PagesKernel {
    f: CudaFunction,
    name: &'static str,
    /// What `GpuEncoder::kernel` reports.
    label: &'static str,
    smem: u32,
    warps: usize,
    pages_per_block: usize,
    max_grid: u32,
}

impl PagesKernel {
    /// `f` with as many warps (up to `max_warps`) as shared memory holds beside its static
    /// part: `smem` = (bytes a block, bytes a warp); a page per warp or per block. `None`
    /// where not even one warp fits.
    fn new(
        dev: &GpuDevice,
        f: CudaFunction,
        (name, label): (&'static str, &'static str),
        (base, per_warp): (usize, usize),
        max_warps: usize,
        page_per_warp: bool,
    ) -> Result<Option<Self>> {
        let static_bytes = f.shared_size_bytes().map_err(drv("shared_size_bytes"))? as usize;
        let warps = max_warps.min(dev.max_smem_optin.saturating_sub(static_bytes + base) / per_warp);
        let smem = base + warps * per_warp;
        if warps == 0 || !allow_dynamic_smem(&f, smem) {
            return Ok(None);
        }
        let max_grid = resident_blocks(dev, &f, warps, smem)?;
        let pages_per_block = if page_per_warp { warps } else { 1 };
        Ok(Some(Self { f, name, label, smem: smem as u32, warps, pages_per_block, max_grid }))
    }
}

/// Lets `f` launch with `smem` dynamic shared bytes; false where the device refuses.
fn allow_dynamic_smem(f: &CudaFunction, smem: usize) -> bool {
    f.set_attribute(
        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        smem as i32,
    )
    .is_ok()
}

/// Blocks of `warps` warps and `smem` dynamic shared bytes the whole device holds at once (the
/// grid cap of kernels that loop over their jobs).
fn resident_blocks(dev: &GpuDevice, f: &CudaFunction, warps: usize, smem: usize) -> Result<u32> {
    let per_sm =
        f.occupancy_max_active_blocks_per_multiprocessor((warps * 32) as u32, smem, None).map_err(drv("occupancy"))?;
    Ok(per_sm.max(1) * dev.sm_count as u32)
}

pub struct GpuEncoder {
    pub dev: Arc<GpuDevice>,
    pub fmt: GpuFormat,
    pub input: InputKind,
    func: CudaFunction,
    thresholds: CudaSlice<f32>,
    centroids: CudaSlice<f32>,
    /// Thread-per-row kernel, its cell table, dynamic shared bytes, grid cap, warps per block
    /// and warp work units per page (1, or 2 for the two-threads-per-row kernel).
    tpr: Option<(CudaFunction, CudaSlice<u32>, u32, u32, usize, usize)>,
    pages: Option<PagesKernel>,
}

impl GpuEncoder {
    pub fn new(dev: &Arc<GpuDevice>, fmt: &GpuFormat, input: InputKind) -> Result<Self> {
        if !fmt.calibrated() {
            return Err(CudaError::Core(veloxquant::VqError::MissingCalibration {
                format: fmt.spec.to_string(),
                why: "the GPU encoder needs the calibrated state (GpuFormat::with_state)".into(),
            }));
        }
        let pf = (dev.compute_capability.0 >= 8 && dev.tuning.encode_prefetch) as i64;
        let tpr = if has_page_kernel(fmt, &dev.tuning) { Self::page_kernel(dev, fmt, input, pf)? } else { None };
        let tuning = tpr.as_ref().map_or(dev.tuning, |p| p.1);
        let func = dev.function(Family::Encode, &encode_defines(fmt, input, pf, &tuning), "encode_rows")?;
        let pages = Self::pages_kernel(dev, fmt, input, pf, &tuning)?;
        let s = &dev.stream;
        let tpr = match tpr {
            Some((PageKernel { f, smem, warps, units_per_job }, _)) => {
                let max_grid = resident_blocks(dev, &f, warps, smem as usize)?;
                let table = fmt.bins.clone().unwrap_or_else(|| vec![0u32; 4]);
                let td = s.clone_htod(&table).map_err(drv("htod"))?;
                Some((f, td, smem, max_grid, warps, units_per_job))
            }
            None => None,
        };
        Ok(Self {
            dev: dev.clone(),
            fmt: fmt.clone(),
            input,
            func,
            thresholds: s.clone_htod(&fmt.thresholds).map_err(drv("htod"))?,
            centroids: s.clone_htod(&fmt.centroids).map_err(drv("htod"))?,
            tpr,
            pages,
        })
    }

    /// The format's own page kernel, if it has one, with as many warps as shared memory
    /// holds: the sketch on tensor cores (up to the tuning's warps, a page each, beside the
    /// block's S': kernels/formats/qjl.cuh SK_S, SK_WARP) or vecinfer's block per page (up to
    /// 8 warps, each a sub-vector's codebook staged at a time). `None` where none fits (then
    /// the warp-per-row kernel encodes).
    fn pages_kernel(
        dev: &Arc<GpuDevice>,
        fmt: &GpuFormat,
        input: InputKind,
        pf: i64,
        tuning: &Tuning,
    ) -> Result<Option<PagesKernel>> {
        let (names, smem, max_warps, page_per_warp) = if has_sketch_mma(fmt, input, dev) {
            (("encode_sketch_mma", "tensor cores"), sketch_smem(fmt), dev.tuning.encode_sketch_warps, true)
        } else if fmt.kind == KernelKind::Vq && dev.tuning.encode_vq_pairs {
            // Two codebook slots per warp.
            let (base, slot) = vq_pages_smem(fmt);
            (("encode_vq_pages2", "block/page, 2 rows a lane"), (base, 2 * slot), 8, false)
        } else if fmt.kind == KernelKind::Vq {
            (("encode_vq_pages", "block/page"), vq_pages_smem(fmt), 8, false)
        } else {
            return Ok(None);
        };
        let f = dev.function(Family::Encode, &encode_defines(fmt, input, pf, tuning), names.0)?;
        PagesKernel::new(dev, f, names, smem, max_warps, page_per_warp)
    }

    /// The page kernel (thread per row; two per row for turboquant_mse codes) with as many of
    /// the tuning's warps per block as the device's shared memory holds ([`PageSmem`]), and
    /// the tuning its module was built with; `None` where not even one warp fits (then a warp
    /// per row encodes).
    fn page_kernel(
        dev: &Arc<GpuDevice>,
        fmt: &GpuFormat,
        input: InputKind,
        pf: i64,
    ) -> Result<Option<(PageKernel, Tuning)>> {
        let plan = PageSmem::new(fmt, input, pf, &dev.tuning);
        let mut warps = plan.warps;
        while warps >= 1 {
            let tw = plan.tuning(&dev.tuning, warps);
            let f = dev.function(Family::Encode, &encode_defines(fmt, input, pf, &tw), plan.name)?;
            let static_bytes = f.shared_size_bytes().map_err(drv("shared_size_bytes"))? as usize;
            let smem = plan.dynamic_bytes(warps);
            // Past the device's opt-in limit the attribute call fails: not attempted.
            if static_bytes + smem <= dev.max_smem_optin && allow_dynamic_smem(&f, smem) {
                let units_per_job = plan.units_per_job;
                return Ok(Some((PageKernel { f, smem: smem as u32, warps, units_per_job }, tw)));
            }
            warps = plan.fitting_warps(dev.max_smem_optin, static_bytes).min(warps - 1);
        }
        Ok(None)
    }

    /// Use the warp-per-row kernel even where a page kernel applies (benchmarks).
    pub fn force_warp_per_row(&mut self) {
        self.tpr = None;
        self.pages = None;
    }

    /// The kernel launches use: "warp/row", "thread/row", "2 threads/row", "tensor cores",
    /// "block/page" or "block/page, 2 rows a lane".
    pub fn kernel(&self) -> &'static str {
        if let Some(k) = &self.pages {
            return k.label;
        }
        match &self.tpr {
            None => "warp/row",
            Some((.., 1)) => "thread/row",
            Some(_) => "2 threads/row",
        }
    }

    /// Whether launches use the thread-per-row kernel.
    pub fn thread_per_row(&self) -> bool {
        self.tpr.is_some()
    }

    /// Launch: `x` holds `page_idx.len()` jobs of T rows each (in the input kind); job j is
    /// written to page `page_idx[j]` of `pool` with the rotation signs of head `head_idx[j]`.
    #[allow(clippy::too_many_arguments)]
    pub fn launch<X>(
        &self,
        x: &CudaSlice<X>,
        n_jobs: usize,
        page_idx: &CudaSlice<i32>,
        head_idx: &CudaSlice<i32>,
        pool: &mut CudaSlice<u8>,
        signs: &cudarc::driver::CudaView<'_, f32>,
        rot_scale: f32,
    ) -> Result<()> {
        let n_rows = (n_jobs * self.fmt.t) as i32;
        if n_rows == 0 {
            return Ok(());
        }
        if let Some((f, table, smem, max_grid, warps, upj)) = &self.tpr {
            let self_warps = *warps;
            let n = n_jobs as i32;
            // −(bits(1.5·2^23) − QK − 1)·128: the cell table's bias (see kernels/encode.cu).
            let tab_bias = 0u32.wrapping_sub((0x4B40_0000u32 - BIN_QK as u32 - 1).wrapping_mul(128));
            // Bytes per bin (32 words), as a run-time value so the kernel multiplies on the FMA pipe.
            let tab_mul = 128u32;
            let grid = ((n_jobs * upj).div_ceil(self_warps) as u32).min(*max_grid);
            let cfg = LaunchConfig {
                grid_dim: (grid, 1, 1),
                block_dim: ((self_warps * 32) as u32, 1, 1),
                shared_mem_bytes: *smem,
            };
            let mut b = self.dev.stream.launch_builder(f);
            b.arg(x)
                .arg(&n)
                .arg(page_idx)
                .arg(head_idx)
                .arg(pool)
                .arg(signs)
                .arg(&rot_scale)
                .arg(table)
                .arg(&self.thresholds)
                .arg(&self.centroids)
                .arg(&tab_bias)
                .arg(&tab_mul);
            // SAFETY: argument list matches encode_pages_tpr in kernels/encode.cu and
            // encode_pages_tpr2 in kernels/formats/turboquant_mse.cuh; buffers are sized by the
            // callers as for encode_rows; the table has 2·QK+3 bins of 4 words (turboquant_frac:
            // two such tables, GpuFormat::bins).
            unsafe { b.launch(cfg) }.map_err(drv("encode_pages_tpr"))?;
            return Ok(());
        }
        // A format's own page kernel (PagesKernel), else a warp per row (qjl, turboquant_prod:
        // per RPW rows of a page; kivi's a warp per page: its kernel reads n_rows / T pages).
        // All take encode_rows' arguments, the count aside.
        let (f, cfg, count, name) = match &self.pages {
            Some(k) => {
                let grid = (n_jobs.div_ceil(k.pages_per_block) as u32).min(k.max_grid);
                let block = ((k.warps * 32) as u32, 1, 1);
                let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: block, shared_mem_bytes: k.smem };
                (&k.f, cfg, n_jobs as i32, k.name)
            }
            None => {
                let warps = if self.fmt.kind == KernelKind::Kivi {
                    n_jobs
                } else {
                    (n_rows as usize).div_ceil(self.fmt.encode_rows_per_warp())
                };
                let grid = (warps.div_ceil(8) as u32, 1, 1);
                (
                    &self.func,
                    LaunchConfig { grid_dim: grid, block_dim: (256, 1, 1), shared_mem_bytes: 0 },
                    n_rows,
                    "encode_rows",
                )
            }
        };
        let mut b = self.dev.stream.launch_builder(f);
        b.arg(x)
            .arg(&count)
            .arg(page_idx)
            .arg(head_idx)
            .arg(pool)
            .arg(signs)
            .arg(&rot_scale)
            .arg(&self.thresholds)
            .arg(&self.centroids);
        // SAFETY: argument list matches encode_rows in kernels/encode.cu (count: rows),
        // encode_sketch_mma in kernels/formats/qjl.cuh and encode_vq_pages in
        // kernels/formats/vecinfer.cuh (count: pages); buffers are sized by the callers (x:
        // n_jobs·T·D, pool: ≥ max(page_idx)+1 pages, signs: heads·TW); the page kernels trap (a
        // failed launch) if their dynamic shared memory is short of what they use.
        unsafe { b.launch(cfg) }.map_err(drv(name))?;
        Ok(())
    }

    /// Host convenience (tests): encode `n_pages` pages of f32 input, pages returned in order.
    pub fn encode_pages_f32(&self, x: &[f32]) -> Result<Vec<u8>> {
        if self.input != InputKind::F32 {
            let per = self.fmt.t * self.fmt.d;
            return Err(CudaError::ShapeMismatch { op: "encode_pages_f32", expected: per, got: x.len() });
        }
        self.encode_pages_host(x, "encode_pages_f32")
    }

    /// Host convenience (tests): as [`Self::encode_pages_f32`] for f16 input (bits).
    pub fn encode_pages_f16(&self, x: &[u16]) -> Result<Vec<u8>> {
        if self.input != InputKind::F16 {
            let per = self.fmt.t * self.fmt.d;
            return Err(CudaError::ShapeMismatch { op: "encode_pages_f16", expected: per, got: x.len() });
        }
        self.encode_pages_host(x, "encode_pages_f16")
    }

    fn encode_pages_host<X: cudarc::driver::DeviceRepr + Default + Clone + Unpin>(
        &self,
        x: &[X],
        op: &'static str,
    ) -> Result<Vec<u8>> {
        let per = self.fmt.t * self.fmt.d;
        if !x.len().is_multiple_of(per) {
            return Err(CudaError::ShapeMismatch { op, expected: per, got: x.len() });
        }
        let n = x.len() / per;
        let s = &self.dev.stream;
        let xd = s.clone_htod(x).map_err(drv("htod"))?;
        let idx: Vec<i32> = (0..n as i32).collect();
        let zeros = vec![0i32; n];
        let pid = s.clone_htod(&idx).map_err(drv("htod"))?;
        let hid = s.clone_htod(&zeros).map_err(drv("htod"))?;
        let mut pool = s.alloc_zeros::<u8>(n * self.fmt.page_bytes).map_err(drv("alloc"))?;
        let (signs, sc) = self.fmt.transform();
        let sd = s.clone_htod(&signs).map_err(drv("htod"))?;
        self.launch(&xd, n, &pid, &hid, &mut pool, &sd.slice(..), sc)?;
        s.clone_dtoh(&pool).map_err(drv("dtoh"))
    }
}

/// `encode_sketch_mma`'s dynamic shared memory (kernels/formats/qjl.cuh: SK_S, SK_WARP): the
/// block's S' (f16, d × d), and per warp two stages of input rows (f16, padded by 16 bytes),
/// turboquant_prod's residuals (f32, rows of d + 1), the sign words, the list of 256 outputs
/// (u16) and two counters. The module states its own (`encode_sketch_mma_smem`); the
/// compile-all test holds them equal.
pub fn sketch_smem(fmt: &GpuFormat) -> (usize, usize) {
    let (d, list) = (fmt.d, 256);
    let residuals = if fmt.kind == KernelKind::Prod { 32 * (d + 1) * 4 } else { 0 };
    let blocks = if fmt.kind == KernelKind::Sketch { fmt.sketch_halves() } else { 1 };
    (blocks * 2 * d * d, 2 * 32 * (2 * d + 16) + residuals + 32 * d / 8 + 2 * list + 16)
}

/// `encode_vq_pages`' dynamic shared memory (kernels/formats/vecinfer.cuh: VQ_BASE,
/// VQ_PER_WARP; the module states its own as `encode_vq_pages_smem`, held equal by the
/// compile-all test): the block's 32 rotated rows (f32, stride d + 1) and their codes (a byte
/// per sub-vector), then per codebook slot one sub-vector's codebook and its ‖c‖² (f32); a warp
/// has one slot (`encode_vq_pages`) or two (`encode_vq_pages2`).
pub fn vq_pages_smem(fmt: &GpuFormat) -> (usize, usize) {
    let (d, g, k) = (fmt.d, fmt.group.max(1), 1usize << fmt.bits);
    ((32 * (d + 1) * 4 + 32 * (d / g)).div_ceil(16) * 16, k * (g + 1) * 4)
}
