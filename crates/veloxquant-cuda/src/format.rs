//! The GPU view of a row format: kernel defines plus the constants taken from the CPU's own
//! objects (`ScaledCodebook`, `Rotation`), so thresholds, centroids and signs are identical.

use half::f16;
use veloxquant::codebook::ScaledCodebook;
use veloxquant::format::rows::{RowKind, RowLayout};
use veloxquant::rotate::Rotation;
use veloxquant::{FormatSpec, NormMode};

use crate::error::{CudaError, Result};

/// Row kind ids shared with the kernels (`KIND`, `KK`, `VK`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelKind {
    F16 = 0,
    Q8_0 = 1,
    Q4_0 = 2,
    Codes = 3,
}

#[derive(Clone, Debug)]
pub struct GpuFormat {
    pub spec: FormatSpec,
    pub kind: KernelKind,
    pub bits: u32,
    pub d: usize,
    pub t: usize,
    pub row_bytes: usize,
    pub page_bytes: usize,
    /// Hadamard signs (±1) and scale when the format rotates.
    pub rotation: Option<(Vec<f32>, f32)>,
    pub eden: bool,
    pub thresholds: Vec<f32>,
    pub centroids: Vec<f32>,
    /// Centroids as f16 bits, padded to 16 (decode table).
    pub table_f16: [u16; 16],
}

impl GpuFormat {
    /// The same format the CPU builds for `spec` at head size `d`, page `t`, rotation `seed`.
    pub fn new(spec: &FormatSpec, d: usize, t: usize, seed: u64) -> Result<Self> {
        let unsupported = |why| CudaError::UnsupportedFormat { format: spec.to_string(), why };
        if !(d == 64 || d == 128) {
            return Err(unsupported("head size must be 64 or 128 on the GPU"));
        }
        let (kind, row_kind, rotate) = match spec.name {
            "fp16" => (KernelKind::F16, RowKind::F16, false),
            "q8_0" => (KernelKind::Q8_0, RowKind::Q8_0, spec.rotate),
            "q4_0" => (KernelKind::Q4_0, RowKind::Q4_0, spec.rotate),
            "turboquant_mse" => {
                let table = ScaledCodebook::new(spec.bits, d).table16();
                (KernelKind::Codes, RowKind::Codes { bits: spec.bits, table }, true)
            }
            _ => return Err(unsupported("no CUDA kernel for this format yet")),
        };
        let layout = RowLayout::new(row_kind, d, t);
        let rotation = if rotate {
            match Rotation::new(d, seed)? {
                Rotation::Hadamard { signs, scale } => Some((signs, scale)),
                Rotation::Dense { .. } => return Err(unsupported("dense rotations are CPU-only")),
            }
        } else {
            None
        };
        let (thresholds, centroids) = if kind == KernelKind::Codes {
            let cb = ScaledCodebook::new(spec.bits, d);
            (cb.thresholds, cb.centroids)
        } else {
            (vec![0.0], vec![0.0])
        };
        let mut table_f16 = [0u16; 16];
        for (o, c) in table_f16.iter_mut().zip(&centroids) {
            *o = f16::from_f32(*c).to_bits();
        }
        Ok(Self {
            spec: spec.clone(),
            kind,
            bits: if kind == KernelKind::Codes { spec.bits } else { 0 },
            d,
            t,
            row_bytes: layout.row_bytes,
            page_bytes: layout.page_bytes(),
            rotation,
            eden: spec.norm == NormMode::Eden && kind == KernelKind::Codes,
            thresholds,
            centroids,
            table_f16,
        })
    }

    pub fn bits_per_value(&self) -> f64 {
        (self.page_bytes * 8) as f64 / (self.t * self.d) as f64
    }

    /// Signs for the kernels (all ones when the format does not rotate) and the scale.
    pub fn signs_or_ones(&self) -> (Vec<f32>, f32) {
        match &self.rotation {
            Some((s, sc)) => (s.clone(), *sc),
            None => (vec![1.0; self.d], 1.0),
        }
    }
}
