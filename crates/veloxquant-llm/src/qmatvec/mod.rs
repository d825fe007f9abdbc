//! Weight-quantized matrix–vector products for decode: y = W·x with W kept in its GGUF
//! blocks and x in f32 (no activation quantization), for 1 to 8 rows of x at once.
//!
//! Layout: exactly the GGUF bytes, row-major, each row's blocks contiguous. Nothing is
//! converted at load, so the values are the file's and a decoded token reads the file's
//! bytes (SmolLM2-135M Q4_1: ≈ 96 MB instead of ≈ 540 MB of f32).
//!
//! | format | block bytes | values per block | value                    |
//! |--------|-------------|------------------|--------------------------|
//! | q4_0   | 18          | 32               | `d · (q − 8)`, q 4-bit   |
//! | q4_1   | 20          | 32               | `d · q + m`, q 4-bit     |
//! | q8_0   | 34          | 32               | `d · q`, q signed 8-bit  |
//!
//! `d` and `m` are f16 at the start of the block; 4-bit block byte j holds value j in its
//! low nibble and value j + 16 in its high nibble (ggml's `block_q4_0/1`, `block_q8_0`).
//!
//! A block dequantizes to the same f32 values as candle's `dequantize` (the f32 path;
//! tested bit for bit), so `matvec` equals the f32 GEMM up to rounding: the summation
//! order, and for 1–2 rows of x the fast kernel's factored d·(q·x) + m·Σx per block. The
//! scalar `scalar::rows_ref` (dequantize, then dot) defines the semantics; `avx2::rows`
//! (AVX2 + FMA + F16C, detected once at run time) is the fast path; tests hold both within
//! 1e-5 of Σ|w·x| of the f64 product. Rows are split over rayon tasks of 64 rows; every
//! task reads its rows' blocks once for all rows of x.

#[cfg(target_arch = "x86_64")]
mod avx2;
mod int8;
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // its kernel is x86-only
mod interleaved;
mod scalar;
#[cfg(target_arch = "x86_64")]
mod vnni;

pub use int8::QuantX;

use crate::error::{LlmError, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use rayon::prelude::*;
use std::borrow::Cow;

/// Values per block, for every supported format.
pub const BLOCK: usize = 32;
/// Most rows of x one pass of the f32-activation kernel reads W for.
pub const MAX_N: usize = 8;
/// Most rows of x one pass of the 8-bit-activation kernel reads W for (a batched decode
/// step of 16 sequences reads the weights once).
pub const MAX_N_Q8: usize = 16;
/// Weight rows per rayon task: enough work (≈ 64 × 18 blocks) to hide the task overhead,
/// small enough that the 576-row projections split into 9 tasks over 2 cores. Not tuned:
/// 16, 64 and 256 gave the same decode-step time within noise (13–17 ms, loaded 2 cores).
const ROWS_PER_TASK: usize = 64;
/// Rayon tasks per thread for the VNNI kernel (contiguous runs of whole tiles). A worker
/// that slept between two products wakes tens of µs late on this 2-core VM (a `join` of
/// two 40 µs halves after 20 µs of serial work took 97 µs), so the caller should be able to
/// take most of the work and the late one steal what is left: 8 measured 525–544 tokens/s
/// at B = 16 (tg32, SmolLM2-135M) against 492–517 for 2; 1–16 gave the same kernel time
/// in isolation within noise.
const TILE_TASKS_PER_THREAD: usize = 8;

/// The GGUF block formats [`PackedMatrix`] holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackedFormat {
    Q4_0,
    Q4_1,
    Q8_0,
}

impl PackedFormat {
    pub const ALL: [PackedFormat; 3] = [PackedFormat::Q4_0, PackedFormat::Q4_1, PackedFormat::Q8_0];

    /// The format of a GGUF dtype, None for those not packed (dense, k-quants).
    pub fn of(dtype: GgmlDType) -> Option<Self> {
        match dtype {
            GgmlDType::Q4_0 => Some(Self::Q4_0),
            GgmlDType::Q4_1 => Some(Self::Q4_1),
            GgmlDType::Q8_0 => Some(Self::Q8_0),
            _ => None,
        }
    }

    pub fn ggml(self) -> GgmlDType {
        match self {
            Self::Q4_0 => GgmlDType::Q4_0,
            Self::Q4_1 => GgmlDType::Q4_1,
            Self::Q8_0 => GgmlDType::Q8_0,
        }
    }

    pub fn block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q8_0 => 34,
        }
    }
}

/// A [rows][cols] weight matrix in GGUF blocks.
#[derive(Clone, Debug)]
pub struct PackedMatrix {
    format: PackedFormat,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
    /// [`product`](Self::product) quantizes x to 8 bits ([`matvec_q8`](Self::matvec_q8)).
    q8_x: bool,
    /// The AVX2 int8 kernel's layout, made on first use (None: odd blocks per row).
    repacked: std::sync::OnceLock<Option<int8::Repacked>>,
    /// The VNNI int8 kernel's layout, made on first use.
    interleaved: std::sync::OnceLock<interleaved::Interleaved>,
}

/// Which kernel runs: the fast one where the CPU has it, or the scalar reference.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    Scalar,
    Avx2,
}

impl Kernel {
    /// The best kernel this CPU runs (detected once).
    pub fn best() -> Self {
        static AVX2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        #[cfg(target_arch = "x86_64")]
        let avx2 = *AVX2.get_or_init(|| {
            is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
        });
        #[cfg(not(target_arch = "x86_64"))]
        let avx2 = *AVX2.get_or_init(|| false);
        if avx2 {
            Kernel::Avx2
        } else {
            Kernel::Scalar
        }
    }
}

/// Which kernel runs the products with 8-bit x ([`PackedMatrix::matvec_q8`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Int8Kernel {
    Scalar,
    /// AVX2 + FMA + F16C: the dot as `vpmaddubsw` + `vpmaddwd`.
    Avx2,
    /// AVX512F/BW/VL + VNNI: 16 weight rows per 512-bit `vpdpbusd`, x broadcast
    /// ([`interleaved`]'s layout; any shape).
    Vnni,
}

impl Int8Kernel {
    /// The fastest this CPU runs (detected once).
    pub fn best() -> Self {
        #[cfg(target_arch = "x86_64")]
        if Kernel::best() == Kernel::Avx2 {
            return if vnni::has_vnni() { Int8Kernel::Vnni } else { Int8Kernel::Avx2 };
        }
        Int8Kernel::Scalar
    }

    /// Every kernel this CPU runs (tests compare them).
    pub fn available() -> Vec<Self> {
        match Self::best() {
            Int8Kernel::Vnni => vec![Int8Kernel::Scalar, Int8Kernel::Avx2, Int8Kernel::Vnni],
            Int8Kernel::Avx2 => vec![Int8Kernel::Scalar, Int8Kernel::Avx2],
            Int8Kernel::Scalar => vec![Int8Kernel::Scalar],
        }
    }
}

/// One task's share of a product: weight rows `w` (whole rows of `n_blocks` blocks) against
/// `n` rows of x (`[n][n_blocks · 32]`), written to `out[row][n]`.
pub(crate) struct RowsParams<'a> {
    pub format: PackedFormat,
    pub w: &'a [u8],
    pub n_blocks: usize,
    pub x: &'a [f32],
    /// Per-block sums of x that a kernel's layout of x asks for (empty for the reference).
    pub x_sums: &'a [f32],
    pub n: usize,
    pub out: &'a mut [f32],
}

impl PackedMatrix {
    /// The blocks of a GGUF tensor `[rows][cols]`; None when its dtype is not packed.
    pub fn from_qtensor(t: &QTensor) -> Result<Option<Self>> {
        let Some(format) = PackedFormat::of(t.dtype()) else { return Ok(None) };
        let &[rows, cols] = t.shape().dims() else {
            return Err(LlmError::InvalidArgument(format!("packed weight must be 2-D, got {:?}", t.shape())));
        };
        Self::from_bytes(format, rows, cols, t.data()?.into_owned()).map(Some)
    }

    /// From raw GGUF block bytes; `cols` must be a positive multiple of 32 and `data`
    /// exactly the blocks.
    pub fn from_bytes(format: PackedFormat, rows: usize, cols: usize, data: Vec<u8>) -> Result<Self> {
        let expected = rows * cols / BLOCK * format.block_bytes();
        if cols == 0 || !cols.is_multiple_of(BLOCK) || data.len() != expected {
            return Err(LlmError::ShapeMismatch { op: "PackedMatrix::from_bytes", expected, got: data.len() });
        }
        Ok(Self {
            format,
            rows,
            cols,
            data,
            q8_x: false,
            repacked: Default::default(),
            interleaved: Default::default(),
        })
    }

    /// Stacks matrices of one format and width along the rows (the fused QKV and gate/up
    /// projections); None when they differ.
    pub fn concat_rows(parts: &[PackedMatrix]) -> Option<Self> {
        let first = parts.first()?;
        if parts.iter().any(|p| p.format != first.format || p.cols != first.cols || p.q8_x != first.q8_x) {
            return None;
        }
        let data = parts.iter().flat_map(|p| p.data.iter().copied()).collect();
        let rows = parts.iter().map(|p| p.rows).sum();
        let m = Self {
            format: first.format,
            rows,
            cols: first.cols,
            data,
            q8_x: false,
            repacked: Default::default(),
            interleaved: Default::default(),
        };
        Some(m.with_q8_activations(first.q8_x))
    }

    /// Whether [`product`](Self::product) quantizes x to 8 bits (the best int8 kernel's
    /// layout is made now, so resident bytes are known from the start).
    pub fn with_q8_activations(mut self, on: bool) -> Self {
        self.q8_x = on;
        if on {
            match Int8Kernel::best() {
                Int8Kernel::Vnni => {
                    self.interleave();
                }
                Int8Kernel::Avx2 => {
                    self.repack();
                }
                Int8Kernel::Scalar => {}
            }
        }
        self
    }

    fn repack(&self) -> Option<&int8::Repacked> {
        let nb = self.cols / BLOCK;
        self.repacked.get_or_init(|| int8::Repacked::new(self.format, &self.data, self.rows, nb)).as_ref()
    }

    fn interleave(&self) -> &interleaved::Interleaved {
        let nb = self.cols / BLOCK;
        self.interleaved.get_or_init(|| interleaved::Interleaved::new(self.format, &self.data, self.rows, nb))
    }

    /// Bytes held: the blocks, and the int8 kernels' relaid copies once made.
    pub fn resident_bytes(&self) -> usize {
        let repacked = self.repacked.get().and_then(Option::as_ref).map_or(0, int8::Repacked::bytes);
        self.data.len() + repacked + self.interleaved.get().map_or(0, interleaved::Interleaved::bytes)
    }

    /// Most rows of x one pass of [`product`](Self::product) takes.
    pub fn max_rows_per_pass(&self) -> usize {
        if self.q8_x {
            MAX_N_Q8
        } else {
            MAX_N
        }
    }

    /// The product this matrix was set up for: [`matvec_q8`](Self::matvec_q8) or
    /// [`matvec`](Self::matvec).
    pub fn product(&self, x: &[f32], n: usize) -> Result<Vec<f32>> {
        if self.q8_x {
            self.matvec_q8(x, n)
        } else {
            self.matvec(x, n)
        }
    }

    pub fn format(&self) -> PackedFormat {
        self.format
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Resident bytes (also what one product reads).
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    fn row_bytes(&self) -> usize {
        self.cols / BLOCK * self.format.block_bytes()
    }

    /// The matrix as f32 `[rows][cols]` (the values every kernel multiplies by).
    pub fn dequantize_ref(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        let bb = self.format.block_bytes();
        for (block, o) in self.data.chunks_exact(bb).zip(out.chunks_exact_mut(BLOCK)) {
            scalar::dequantize_block_ref(self.format, block, o);
        }
        out
    }

    /// `x [n][cols] · Wᵀ → [n][rows]` with the best kernel.
    pub fn matvec(&self, x: &[f32], n: usize) -> Result<Vec<f32>> {
        self.matvec_with(Kernel::best(), x, n)
    }

    /// [`matvec`](Self::matvec) with a chosen kernel (tests compare them); Avx2 on a CPU
    /// without it runs the scalar reference. More than [`MAX_N`] rows go in passes of 8.
    pub fn matvec_with(&self, kernel: Kernel, x: &[f32], n: usize) -> Result<Vec<f32>> {
        if x.len() != n * self.cols {
            return Err(LlmError::ShapeMismatch { op: "PackedMatrix::matvec", expected: n * self.cols, got: x.len() });
        }
        let mut y = vec![0f32; n * self.rows];
        for (xs, ys) in x.chunks(MAX_N * self.cols).zip(y.chunks_mut(MAX_N * self.rows)) {
            self.pass(kernel, xs, xs.len() / self.cols, ys);
        }
        Ok(y)
    }

    /// [`product`](Self::product) of `ys.len()` rows of x, row j of the result written to
    /// `ys[j]` (each `rows` long): the VNNI kernel writes there itself (a batch's logits go
    /// straight to each sequence's buffer), the others through a copy.
    pub fn product_into(&self, x: &[f32], ys: &mut [&mut [f32]]) -> Result<()> {
        let n = ys.len();
        if x.len() != n * self.cols {
            return Err(LlmError::ShapeMismatch {
                op: "PackedMatrix::product_into x",
                expected: n * self.cols,
                got: x.len(),
            });
        }
        if let Some(y) = ys.iter().find(|y| y.len() != self.rows) {
            return Err(LlmError::ShapeMismatch {
                op: "PackedMatrix::product_into y",
                expected: self.rows,
                got: y.len(),
            });
        }
        #[cfg(target_arch = "x86_64")]
        if self.q8_x && n <= MAX_N_Q8 && Int8Kernel::best() == Int8Kernel::Vnni {
            let qx = QuantX::new(x);
            let (il, x_off) = (self.interleave(), interleaved::x_offsets(self.format, &qx));
            // SAFETY: the kernel writes only f32 values through these views.
            let mut ys: Vec<&mut [std::mem::MaybeUninit<f32>]> = ys
                .iter_mut()
                .map(|y| unsafe { &mut *(&mut **y as *mut [f32] as *mut [std::mem::MaybeUninit<f32>]) })
                .collect();
            self.by_row_tiles_into(&mut ys, |rows, out| {
                // SAFETY: `best()` is Vnni only where `has_vnni()` detected AVX512F/BW/VL,
                // VNNI and F16C (`rows` checks the extents).
                unsafe { vnni::rows(il, rows, &qx, &x_off, out) }
            });
            return Ok(());
        }
        let y = self.product(x, n)?;
        for (dst, src) in ys.iter_mut().zip(y.chunks_exact(self.rows)) {
            dst.copy_from_slice(src);
        }
        Ok(())
    }

    /// `x [n][cols] · Wᵀ → [n][rows]` with x quantized to 8 bits per block ([`QuantX`]),
    /// as llama.cpp decodes: exact integer dots, several times fewer instructions than
    /// f32 x; the result is W·x̂ (x̂ = x's dequantized codes) up to f32 rounding.
    pub fn matvec_q8(&self, x: &[f32], n: usize) -> Result<Vec<f32>> {
        self.matvec_q8_with(Int8Kernel::best(), x, n)
    }

    /// [`matvec_q8`](Self::matvec_q8) with a chosen kernel (one the CPU lacks runs the
    /// scalar reference).
    pub fn matvec_q8_with(&self, kernel: Int8Kernel, x: &[f32], n: usize) -> Result<Vec<f32>> {
        if x.len() != n * self.cols {
            return Err(LlmError::ShapeMismatch {
                op: "PackedMatrix::matvec_q8",
                expected: n * self.cols,
                got: x.len(),
            });
        }
        let kernel = if Int8Kernel::available().contains(&kernel) { kernel } else { Int8Kernel::Scalar };
        let n_blocks = self.cols / BLOCK;
        #[cfg(target_arch = "x86_64")]
        if kernel == Int8Kernel::Vnni {
            // y is not zeroed first: the kernel writes all of it (a batched step's outputs are
            // ~10 MB, which one thread's `calloc` zeroed in ~0.5 ms of a 15 ms step).
            let mut y: Vec<f32> = Vec::with_capacity(n * self.rows);
            let spare = &mut y.spare_capacity_mut()[..n * self.rows];
            for (xs, ys) in x.chunks(MAX_N_Q8 * self.cols).zip(spare.chunks_mut(MAX_N_Q8 * self.rows)) {
                let qx = QuantX::new(xs);
                let (il, x_off) = (self.interleave(), interleaved::x_offsets(self.format, &qx));
                let mut parts: Vec<&mut [std::mem::MaybeUninit<f32>]> = ys.chunks_mut(self.rows).collect();
                self.by_row_tiles_into(&mut parts, |rows, out| {
                    // SAFETY: `available()` lists Vnni only where `has_vnni()` detected
                    // AVX512F/BW/VL, VNNI and F16C (`rows` checks the extents).
                    unsafe { vnni::rows(il, rows, &qx, &x_off, out) }
                });
            }
            // SAFETY: the chunks cover the first n·rows elements, by_row_tiles_into's tasks
            // cover every row of each chunk's outputs, and `vnni::rows` writes all of its.
            unsafe { y.set_len(n * self.rows) };
            return Ok(y);
        }
        let mut y = vec![0f32; n * self.rows];
        for (xs, ys) in x.chunks(MAX_N_Q8 * self.cols).zip(y.chunks_mut(MAX_N_Q8 * self.rows)) {
            let m = xs.len() / self.cols;
            let qx = QuantX::new(xs);
            #[cfg(target_arch = "x86_64")]
            if kernel == Int8Kernel::Avx2 {
                if let Some(rp) = self.repack() {
                    self.by_tasks(m, ys, |r0, w, out| {
                        let rows = r0..r0 + w.len() / self.row_bytes();
                        // SAFETY: as below; `rows_repacked` checks the rows, blocks and
                        // outputs against the repacked matrix and x.
                        unsafe { int8::rows_repacked(self.format, rp, rows, &qx, m, out) };
                    });
                    continue;
                }
            }
            self.by_tasks(m, ys, |_, w, out| {
                #[cfg(target_arch = "x86_64")]
                if kernel == Int8Kernel::Avx2 {
                    // SAFETY: `available()` lists Avx2 only where AVX2, FMA and F16C were
                    // detected (`rows` checks the extents).
                    unsafe { int8::rows(self.format, w, n_blocks, &qx, m, out) };
                    return;
                }
                int8::rows_ref(self.format, w, n_blocks, &qx, m, out)
            });
        }
        Ok(y)
    }

    /// One pass over W for n ≤ 8 rows of x: tasks of whole rows write `[row][n]`, then
    /// that is transposed to `y [n][rows]`.
    fn pass(&self, kernel: Kernel, x: &[f32], n: usize, y: &mut [f32]) {
        let n_blocks = self.cols / BLOCK;
        let kernel = if kernel == Kernel::best() { kernel } else { Kernel::Scalar };
        let (x, x_sums) = match kernel {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => avx2::prepare_x(self.format, x),
            _ => (Cow::Borrowed(x), Vec::new()),
        };
        let (x, x_sums) = (x.as_ref(), x_sums.as_slice());
        self.by_tasks(n, y, |_, w, out| {
            let p = RowsParams { format: self.format, w, n_blocks, x, x_sums, n, out };
            match kernel {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `Kernel::best()` returned Avx2, so AVX2, FMA and F16C were detected
                // (`rows` checks the slice sizes itself).
                Kernel::Avx2 => unsafe { avx2::rows(p) },
                _ => scalar::rows_ref(p),
            }
        });
    }

    /// Runs `task(rows, outs)` over [`TILE_TASKS_PER_THREAD`] rayon tasks per thread of
    /// contiguous whole tiles (sizes within one tile of each other), each given its rows of
    /// every `ys[j]` (row j of the result, `rows` long) as `outs[j]`.
    fn by_row_tiles_into<T: Send>(
        &self,
        ys: &mut [&mut [T]],
        task: impl Fn(std::ops::Range<usize>, &mut [&mut [T]]) + Sync,
    ) {
        use interleaved::TILE;
        let n_tiles = self.rows.div_ceil(TILE);
        let n_tasks = n_tiles.min(TILE_TASKS_PER_THREAD * rayon::current_num_threads()).max(1);
        let bounds: Vec<usize> = (0..=n_tasks).map(|i| (i * n_tiles / n_tasks * TILE).min(self.rows)).collect();
        let mut parts: Vec<Vec<&mut [T]>> = (0..n_tasks).map(|_| Vec::with_capacity(ys.len())).collect();
        for yj in ys.iter_mut() {
            let mut rest = &mut yj[..];
            for (part, w) in parts.iter_mut().zip(bounds.windows(2)) {
                let (mine, tail) = rest.split_at_mut(w[1] - w[0]);
                part.push(mine);
                rest = tail;
            }
        }
        parts.into_par_iter().zip(bounds.par_windows(2)).for_each(|(mut outs, w)| task(w[0]..w[1], &mut outs));
    }

    /// Runs `task(first row, w rows, out [row][n])` over rayon tasks of whole weight rows,
    /// then transposes the `[row][n]` results into `y [n][rows]`.
    fn by_tasks(&self, n: usize, y: &mut [f32], task: impl Fn(usize, &[u8], &mut [f32]) + Sync) {
        let rb = self.row_bytes();
        let mut by_row = vec![0f32; self.rows * n];
        by_row
            .par_chunks_mut(ROWS_PER_TASK * n)
            .zip(self.data.par_chunks(ROWS_PER_TASK * rb))
            .enumerate()
            .for_each(|(i, (out, w))| task(i * ROWS_PER_TASK, w, out));
        if n == 1 {
            y.copy_from_slice(&by_row);
            return;
        }
        for (r, vals) in by_row.chunks_exact(n).enumerate() {
            for (j, &v) in vals.iter().enumerate() {
                y[j * self.rows + r] = v;
            }
        }
    }
}

#[cfg(test)]
mod tests;
