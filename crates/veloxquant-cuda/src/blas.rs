//! Matrix products through cuBLAS (loaded at run time): f16 operands, f32 accumulation, f32
//! or f16 results. Row-major helpers over cuBLAS's column-major calls.
//!
//! The handle gets a fixed workspace so calls can be captured into CUDA graphs (cuBLAS would
//! otherwise allocate inside the capture).

use std::ffi::c_void;
use std::panic::catch_unwind;
use std::sync::Arc;

use cudarc::cublas::sys::{self, cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use crate::device::GpuDevice;
use crate::error::{drv, CudaError, Result};

/// Workspace given to cuBLAS (its documented recommendation for Hopper is 32 MiB).
const WORKSPACE_BYTES: usize = 32 << 20;

/// Whether libcublas can be loaded (never panics).
pub fn cublas_present() -> Result<()> {
    // SAFETY: only tries dlopen on the candidate names.
    let ok = catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false);
    if !ok {
        return Err(CudaError::CudaUnavailable { lib: "libcublas", why: "not found by the dynamic loader".into() });
    }
    Ok(())
}

pub struct Blas {
    blas: CudaBlas,
    _workspace: CudaSlice<u8>,
}

/// Element type of a matrix operand or result.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    F16,
    F32,
}

impl Elem {
    fn cuda(self) -> cudaDataType {
        match self {
            Elem::F16 => cudaDataType::CUDA_R_16F,
            Elem::F32 => cudaDataType::CUDA_R_32F,
        }
    }
    pub fn bytes(self) -> usize {
        match self {
            Elem::F16 => 2,
            Elem::F32 => 4,
        }
    }
}

/// A device matrix operand: base address, element type, leading dimension (row stride, in
/// elements, of the row-major matrix), and the elements addressable from the base.
#[derive(Clone, Copy, Debug)]
pub struct Mat {
    pub ptr: u64,
    pub elem: Elem,
    pub ld: usize,
    pub len: usize,
}

impl Mat {
    pub fn f16<S: DevicePtr<u16>>(x: &S, ld: usize, stream: &CudaStream) -> Self {
        Self { ptr: x.device_ptr(stream).0, elem: Elem::F16, ld, len: x.len() }
    }
    pub fn f32<S: DevicePtr<f32>>(x: &S, ld: usize, stream: &CudaStream) -> Self {
        Self { ptr: x.device_ptr(stream).0, elem: Elem::F32, ld, len: x.len() }
    }
    /// Rows `r0..` of the matrix (same ld).
    pub fn rows_from(self, r0: usize) -> Self {
        let skip = (r0 * self.ld).min(self.len);
        Self { ptr: self.ptr + (skip * self.elem.bytes()) as u64, len: self.len - skip, ..self }
    }
    /// Elements a row-major `rows × cols` matrix spans with this ld.
    fn need(&self, rows: usize, cols: usize) -> usize {
        if rows == 0 || cols == 0 {
            0
        } else {
            (rows - 1) * self.ld + cols
        }
    }
}

fn cublas_err(op: &'static str) -> impl FnOnce(cudarc::cublas::result::CublasError) -> CudaError {
    move |e| CudaError::Cublas { op, err: format!("{e:?}") }
}

impl Blas {
    pub fn new(dev: &Arc<GpuDevice>) -> Result<Self> {
        cublas_present()?;
        let blas = catch_unwind(|| CudaBlas::new(dev.stream.clone()))
            .map_err(|_| CudaError::CudaUnavailable { lib: "libcublas", why: "panicked while initializing".into() })?
            .map_err(cublas_err("create handle"))?;
        let ws = dev.stream.alloc_zeros::<u8>(WORKSPACE_BYTES).map_err(drv("alloc cublas workspace"))?;
        let p = ws.device_ptr(&dev.stream).0;
        // SAFETY: the workspace is a live device allocation of WORKSPACE_BYTES owned by Self,
        // which outlives the handle's use of it.
        unsafe { sys::cublasSetWorkspace_v2(*blas.handle(), p as *mut c_void, WORKSPACE_BYTES) }
            .result()
            .map_err(cublas_err("set workspace"))?;
        Ok(Self { blas, _workspace: ws })
    }

    /// Issue later calls on `stream` (e.g. one being captured).
    pub fn set_stream(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        // SAFETY: callers order their work on that one stream themselves.
        unsafe { self.blas.set_stream(stream.clone()) }.map_err(cublas_err("set stream"))
    }

    /// Row-major `y[n][m] = alpha · x[n][k] · w[m][k]ᵀ + beta · y` (a linear layer: w holds
    /// one output per row). f16 x and w, f32 accumulation.
    #[allow(clippy::too_many_arguments)]
    pub fn linear(&self, n: usize, m: usize, k: usize, x: Mat, w: Mat, y: Mat, alpha: f32, beta: f32) -> Result<()> {
        self.gemm_batched(n, m, k, x, 0, w, 0, y, 0, 1, alpha, beta, false)
    }

    /// Row-major `y[n][m] = alpha · x[n][k] · b[k][m] + beta · y` (b not transposed).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_nn(&self, n: usize, m: usize, k: usize, x: Mat, b: Mat, y: Mat, alpha: f32, beta: f32) -> Result<()> {
        self.gemm_batched(n, m, k, x, 0, b, 0, y, 0, 1, alpha, beta, true)
    }

    /// `batch` products of [`Self::linear`] (`b_nn`: of [`Self::matmul_nn`]) with the operands'
    /// bases `stride_*` elements apart. Every operand's extent is checked first.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_batched(
        &self,
        n: usize,
        m: usize,
        k: usize,
        x: Mat,
        sx: usize,
        w: Mat,
        sw: usize,
        y: Mat,
        sy: usize,
        batch: usize,
        alpha: f32,
        beta: f32,
        b_nn: bool,
    ) -> Result<()> {
        if n == 0 || m == 0 || batch == 0 {
            return Ok(());
        }
        let (wr, wc) = if b_nn { (k, m) } else { (m, k) };
        let span = |mat: &Mat, rows: usize, cols: usize, stride: usize| (batch - 1) * stride + mat.need(rows, cols);
        let checks = [
            (span(&x, n, k, sx), x.len, x.ld >= k),
            (span(&w, wr, wc, sw), w.len, w.ld >= wc),
            (span(&y, n, m, sy), y.len, y.ld >= m),
        ];
        for (need, have, ld_ok) in checks {
            if need > have || !ld_ok {
                return Err(CudaError::ShapeMismatch { op: "gemm operand extent", expected: need, got: have });
            }
        }
        if x.elem != Elem::F16 || w.elem != Elem::F16 {
            return Err(CudaError::ShapeMismatch { op: "gemm operands must be f16", expected: 2, got: 4 });
        }
        let int = |v: usize| {
            i32::try_from(v).map_err(|_| CudaError::ShapeMismatch {
                op: "gemm size",
                expected: i32::MAX as usize,
                got: v,
            })
        };
        let long = |v: usize| {
            i64::try_from(v).map_err(|_| CudaError::ShapeMismatch { op: "gemm stride", expected: 0, got: v })
        };
        // Column-major: yᵀ (m × n) = op(W) (m × k) · xᵀ (k × n).
        let op_w = if b_nn { cublasOperation_t::CUBLAS_OP_N } else { cublasOperation_t::CUBLAS_OP_T };
        // SAFETY: every operand's extent was checked against its allocation above; alpha and
        // beta are host scalars (the handle's default pointer mode); the handle's stream orders
        // the call after the writes of its inputs.
        unsafe {
            sys::cublasGemmStridedBatchedEx(
                *self.blas.handle(),
                op_w,
                cublasOperation_t::CUBLAS_OP_N,
                int(m)?,
                int(n)?,
                int(k)?,
                &alpha as *const f32 as *const c_void,
                w.ptr as *const c_void,
                w.elem.cuda(),
                int(w.ld)?,
                long(sw)?,
                x.ptr as *const c_void,
                x.elem.cuda(),
                int(x.ld)?,
                long(sx)?,
                &beta as *const f32 as *const c_void,
                y.ptr as *mut c_void,
                y.elem.cuda(),
                int(y.ld)?,
                long(sy)?,
                int(batch)?,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .result()
        .map_err(cublas_err("gemm"))
    }
}
