//! The model's matmul weights: how each is held ([`WeightMode`]) and the product that a
//! forward over n rows takes (the f32 GEMM for prefill, the GGUF blocks for decode steps).

use crate::error::Result;
use crate::qmatvec::PackedMatrix;
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};

/// How matmul weights are held.
///
/// Measured here (2-core AVX-512 Xeon, 512-token windows of SmolLM2-135M Q4_1, candle 0.11):
/// dequantized f32 through candle's gemm runs ~286 tokens/s, candle's QMatMul ~16 tokens/s
/// (its Q4_1 × Q8_1 dot product is scalar on x86). `DequantF32` is the default; it costs
/// ~0.5 GB of RAM for this model and every decoded token reads all of it. `Quantized` also
/// quantizes activations to Q8_1 like llama.cpp, which moves PPL by ~0.5 %. `Packed` keeps
/// the f32 weights for prefill and adds the GGUF blocks (Q4_0, Q4_1, Q8_0) that forward
/// calls of ≤ 8 tokens (decode steps) multiply by without quantizing activations
/// ([`crate::qmatvec`]): the same logits up to summation order, ~1/5 of the bytes per token.
/// `PackedQ8` is `Packed` with decode activations quantized to 8 bits per 32-value block
/// (as llama.cpp): integer dot products, several times fewer instructions per weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum WeightMode {
    #[default]
    DequantF32,
    Quantized,
    Packed,
    PackedQ8,
}

impl WeightMode {
    /// Whether decode steps multiply by the GGUF blocks.
    pub fn packs(self) -> bool {
        matches!(self, WeightMode::Packed | WeightMode::PackedQ8)
    }
}

/// A weight's dense (or candle-quantized) form, and in `Packed` mode its GGUF blocks when
/// the format has a packed kernel.
pub(crate) fn linear(t: QTensor, mode: WeightMode) -> Result<(QMatMul, Option<PackedMatrix>)> {
    let dense = matches!(t.dtype(), GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16);
    Ok(match mode {
        WeightMode::DequantF32 => (QMatMul::Tensor(t.dequantize(&Device::Cpu)?), None),
        WeightMode::Quantized if dense => (QMatMul::Tensor(t.dequantize(&Device::Cpu)?), None),
        WeightMode::Quantized => (QMatMul::from_qtensor(t)?, None),
        WeightMode::Packed | WeightMode::PackedQ8 => {
            let packed = PackedMatrix::from_qtensor(&t)?.map(|p| p.with_q8_activations(mode == WeightMode::PackedQ8));
            (QMatMul::Tensor(t.dequantize(&Device::Cpu)?), packed)
        }
    })
}

/// One product of an input with several weights, as one matrix (rows stacked) or each alone.
enum Parts<W> {
    Fused { w: W, widths: Vec<usize> },
    Separate(Vec<W>),
}

impl<W> Parts<W> {
    /// Splits `mul(w)` (`[n][rows of w]`) into one row-major `[n][width_i]` buffer per weight.
    fn forward(&self, n: usize, mul: impl Fn(&W) -> Result<Vec<f32>>) -> Result<Vec<Vec<f32>>> {
        match self {
            Parts::Separate(ws) => ws.iter().map(mul).collect(),
            Parts::Fused { w, widths } => {
                let y = mul(w)?;
                let total: usize = widths.iter().sum();
                let mut outs: Vec<Vec<f32>> = widths.iter().map(|&wd| Vec::with_capacity(wd * n)).collect();
                for row in y.chunks_exact(total) {
                    let mut off = 0;
                    for (out, &wd) in outs.iter_mut().zip(widths) {
                        out.extend_from_slice(&row[off..off + wd]);
                        off += wd;
                    }
                }
                Ok(outs)
            }
        }
    }

    /// `mul(w)` as one row-major `[n][Σ width_i]` buffer, each weight's columns in order.
    fn forward_joined(&self, n: usize, mul: impl Fn(&W) -> Result<Vec<f32>>) -> Result<Vec<f32>> {
        match self {
            Parts::Fused { w, .. } => mul(w),
            Parts::Separate(ws) => {
                let ys = ws.iter().map(mul).collect::<Result<Vec<_>>>()?;
                let mut out = Vec::with_capacity(ys.iter().map(Vec::len).sum());
                for r in 0..n {
                    for y in &ys {
                        let wd = y.len() / n.max(1);
                        out.extend_from_slice(&y[r * wd..(r + 1) * wd]);
                    }
                }
                Ok(out)
            }
        }
    }

    fn first(&self) -> Option<&W> {
        match self {
            Parts::Fused { w, .. } => Some(w),
            Parts::Separate(ws) => ws.first(),
        }
    }

    fn bytes(&self, f: impl Fn(&W) -> usize) -> usize {
        match self {
            Parts::Fused { w, .. } => f(w),
            Parts::Separate(ws) => ws.iter().map(f).sum(),
        }
    }
}

/// Projections of the same input (QKV, gate/up; or one weight). Dense weights are
/// concatenated into one matmul: fewer, larger gemm calls (measured ~5% faster prefill than
/// three separate calls); packed ones likewise when they share a format.
pub(crate) struct Proj {
    dense: Parts<QMatMul>,
    packed: Option<Parts<PackedMatrix>>,
    in_features: usize,
}

fn dense_bytes(w: &QMatMul) -> usize {
    match w {
        QMatMul::QTensor(t) => t.storage_size_in_bytes(),
        QMatMul::Tensor(t) | QMatMul::TensorF16(t) => t.elem_count() * t.dtype().size_in_bytes(),
    }
}

impl Parts<PackedMatrix> {
    fn max_rows(&self) -> usize {
        self.first().map_or(0, PackedMatrix::max_rows_per_pass)
    }
}

impl Proj {
    /// From `(dense, packed)` weights of one input width (`linear`'s results). The packed
    /// form is kept only when every weight has one.
    pub(crate) fn new(parts: Vec<(QMatMul, Option<PackedMatrix>)>, in_features: usize) -> Result<Self> {
        let (dense, packed): (Vec<QMatMul>, Vec<Option<PackedMatrix>>) = parts.into_iter().unzip();
        let packed =
            packed.into_iter().collect::<Option<Vec<_>>>().map(|ps| match (ps.len(), PackedMatrix::concat_rows(&ps)) {
                (2.., Some(w)) => Parts::Fused { widths: ps.iter().map(|p| p.rows()).collect(), w },
                _ => Parts::Separate(ps),
            });
        let all_tensors = dense.iter().all(|p| matches!(p, QMatMul::Tensor(_)));
        let dense = if dense.len() > 1 && all_tensors {
            let ts: Vec<Tensor> = dense
                .iter()
                .filter_map(|p| match p {
                    QMatMul::Tensor(t) => Some(t.clone()),
                    _ => None,
                })
                .collect();
            let widths = ts.iter().map(|t| t.dim(0)).collect::<candle_core::Result<_>>()?;
            Parts::Fused { w: QMatMul::Tensor(Tensor::cat(&ts, 0)?), widths }
        } else {
            Parts::Separate(dense)
        };
        Ok(Proj { dense, packed, in_features })
    }

    /// `x [n][in]` times every weight: one row-major `[n][width_i]` buffer per weight. Up to
    /// one pass of the packed kernel's rows (decode steps: 8, or 16 with 8-bit activations)
    /// use the packed blocks when there are some.
    pub(crate) fn forward(&self, x: Vec<f32>, n: usize) -> Result<Vec<Vec<f32>>> {
        match &self.packed {
            Some(p) if n <= p.max_rows() => p.forward(n, |w| w.product(&x, n)),
            _ => {
                let x = Tensor::from_vec(x, (n, self.in_features), &Device::Cpu)?;
                self.dense.forward(n, |w| Ok(w.forward(&x)?.flatten_all()?.to_vec1()?))
            }
        }
    }

    /// [`forward`](Self::forward) with the weights' outputs side by side: `[n][Σ width_i]`
    /// (no split when the weights are one fused matrix).
    pub(crate) fn forward_joined(&self, x: Vec<f32>, n: usize) -> Result<Vec<f32>> {
        match &self.packed {
            Some(p) if n <= p.max_rows() => p.forward_joined(n, |w| w.product(&x, n)),
            _ => {
                let x = Tensor::from_vec(x, (n, self.in_features), &Device::Cpu)?;
                self.dense.forward_joined(n, |w| Ok(w.forward(&x)?.flatten_all()?.to_vec1()?))
            }
        }
    }

    /// [`forward`](Self::forward) of a single-weight projection.
    pub(crate) fn forward1(&self, x: Vec<f32>, n: usize) -> Result<Vec<f32>> {
        Ok(self.forward(x, n)?.into_iter().next().unwrap_or_default())
    }

    /// [`forward1`](Self::forward1) with row j of the product written to `ys[j]`: the packed
    /// kernel writes there itself, the dense product through a copy.
    pub(crate) fn forward1_into(&self, x: Vec<f32>, ys: &mut [&mut [f32]]) -> Result<()> {
        let n = ys.len();
        if let Some(Parts::Separate(ws)) = &self.packed {
            if let [w] = ws.as_slice() {
                if n <= w.max_rows_per_pass() {
                    return w.product_into(&x, ys);
                }
            }
        }
        let y = self.forward1(x, n)?;
        let width = y.len() / n.max(1);
        if let Some(dst) = ys.iter().find(|d| d.len() != width) {
            return Err(crate::error::LlmError::ShapeMismatch {
                op: "Proj::forward1_into",
                expected: width,
                got: dst.len(),
            });
        }
        for (dst, src) in ys.iter_mut().zip(y.chunks_exact(width.max(1))) {
            dst.copy_from_slice(src);
        }
        Ok(())
    }

    /// (resident bytes, bytes one decode step reads).
    pub(crate) fn bytes(&self) -> (usize, usize) {
        let dense = self.dense.bytes(dense_bytes);
        match &self.packed {
            Some(p) => (dense + p.bytes(PackedMatrix::resident_bytes), p.bytes(PackedMatrix::bytes)),
            None => (dense, dense),
        }
    }
}
