//! Fused encode on the GPU: norm → rotation → quantize → pack → side info, one warp per
//! token row, bit-identical to the CPU's `encode_page`.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};

use crate::device::{Family, GpuDevice};
use crate::error::{drv, CudaError, Result};
use crate::format::GpuFormat;

/// Element type of the encoder's input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputKind {
    F32 = 0,
    F16 = 1,
    Bf16 = 2,
}

pub struct GpuEncoder {
    pub dev: Arc<GpuDevice>,
    pub fmt: GpuFormat,
    pub input: InputKind,
    func: CudaFunction,
    thresholds: CudaSlice<f32>,
    centroids: CudaSlice<f32>,
}

impl GpuEncoder {
    pub fn new(dev: &Arc<GpuDevice>, fmt: &GpuFormat, input: InputKind) -> Result<Self> {
        let defines = [
            ("D", fmt.d as i64),
            ("T", fmt.t as i64),
            ("KIND", fmt.kind as i64),
            ("BITS", fmt.bits.max(1) as i64),
            ("ROT", fmt.rotation.is_some() as i64),
            ("EDEN", fmt.eden as i64),
            ("IN_KIND", input as i64),
            ("ROW_BYTES", fmt.row_bytes as i64),
            ("PAGE_BYTES", fmt.page_bytes as i64),
        ];
        let func = dev.function(Family::Encode, &defines, "encode_rows")?;
        let s = &dev.stream;
        Ok(Self {
            dev: dev.clone(),
            fmt: fmt.clone(),
            input,
            func,
            thresholds: s.clone_htod(&fmt.thresholds).map_err(drv("htod"))?,
            centroids: s.clone_htod(&fmt.centroids).map_err(drv("htod"))?,
        })
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
        signs: &CudaSlice<f32>,
        rot_scale: f32,
    ) -> Result<()> {
        let n_rows = (n_jobs * self.fmt.t) as i32;
        if n_rows == 0 {
            return Ok(());
        }
        let cfg =
            LaunchConfig { grid_dim: ((n_rows as u32).div_ceil(8), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut b = self.dev.stream.launch_builder(&self.func);
        b.arg(x)
            .arg(&n_rows)
            .arg(page_idx)
            .arg(head_idx)
            .arg(pool)
            .arg(signs)
            .arg(&rot_scale)
            .arg(&self.thresholds)
            .arg(&self.centroids);
        // SAFETY: argument list matches encode_rows in kernels/encode.cu; buffers are sized by
        // the callers (x: n_jobs·T·D, pool: ≥ max(page_idx)+1 pages, signs: heads·D).
        unsafe { b.launch(cfg) }.map_err(drv("encode_rows"))?;
        Ok(())
    }

    /// Host convenience (tests): encode `n_pages` pages of f32 input, pages returned in order.
    pub fn encode_pages_f32(&self, x: &[f32]) -> Result<Vec<u8>> {
        let per = self.fmt.t * self.fmt.d;
        if self.input != InputKind::F32 || !x.len().is_multiple_of(per) {
            return Err(CudaError::ShapeMismatch { op: "encode_pages_f32", expected: per, got: x.len() });
        }
        let n = x.len() / per;
        let s = &self.dev.stream;
        let xd = s.clone_htod(x).map_err(drv("htod"))?;
        let idx: Vec<i32> = (0..n as i32).collect();
        let zeros = vec![0i32; n];
        let pid = s.clone_htod(&idx).map_err(drv("htod"))?;
        let hid = s.clone_htod(&zeros).map_err(drv("htod"))?;
        let mut pool = s.alloc_zeros::<u8>(n * self.fmt.page_bytes).map_err(drv("alloc"))?;
        let (signs, sc) = self.fmt.signs_or_ones();
        let sd = s.clone_htod(&signs).map_err(drv("htod"))?;
        self.launch(&xd, n, &pid, &hid, &mut pool, &sd, sc)?;
        s.clone_dtoh(&pool).map_err(drv("dtoh"))
    }
}
