//! vecinfer: product vector quantization after per-channel smoothing and a Hadamard
//! rotation (VecInfer, arXiv 2510.06175).
//!
//! Per (layer, KV head, stream), from calibration vectors C (n × d, [`FormatCtx`]):
//! smoothing λ_j = √(max_t |C_tj|) normalized to geometric mean 1 (1 for dead channels);
//! rotation R (randomized Hadamard, dense orthogonal for other d); then d/g sub-spaces of
//! g channels, each with a 2^b-centroid codebook trained by seeded k-means++ (`kmeans.rs`)
//! on the transformed calibration vectors z = R·(c/λ). A vector x is stored as the d/g
//! indices of the nearest centroids of z = R·(x/λ); decode x̂ = λ ⊙ Rᵀ·ẑ.
//! Keys: q' = R·(q ⊙ λ) so ⟨q', z⟩ = ⟨q, x/λ ⊙ λ⟩; scoring builds one lookup table per
//! query, `LUT[s][c]` = ⟨q'_s, centroid_{s,c}⟩, then sums d/g table entries per key.
//! Values: centroids accumulate in the z domain, `finish` applies Rᵀ and λ once per head.
//!
//! | bytes                 | content                                  |
//! |-----------------------|------------------------------------------|
//! | T × ⌈(d/g)·b/32⌉·4    | b-bit centroid indices, one row per token |
//!
//! Bits/value = b/g (2 for `vecinfer:8:g4`, 1 for `vecinfer:8:g8`); the codebooks
//! ((d/g)·2^b·g f32 = 2^b·d·4 bytes), λ and the rotation are shared state
//! (`state_bytes()`, counted in the cache's `resident_bytes()`).
//! Anchor: ≈ 2 bits/value reaches full-precision quality on real keys (REFERENCE.md §6).
//! Calibration must come from real model vectors on text disjoint from the evaluation text;
//! building without it is [`VqError::MissingCalibration`]. Deviations: smoothing exponent
//! fixed at 1/2 (the paper tunes it); k-means runs at most [`KMEANS_ITERS`] Lloyd steps.
//! Spec: `vecinfer:b:g{g}`, b ∈ {4, 8}, g ∈ {2, 4, 8}; needs d % g = 0.

use std::sync::Arc;

use super::sketch::code_bytes;
use super::{check_finite, check_len, check_row_input, Format, FormatCtx, FormatDesc, FormatSpec, QueryState};
use crate::error::{Result, VqError};
use crate::kmeans::{kmeans, nearest};
use crate::pack;
use crate::rng::derive_seed;
use crate::rotate::Rotation;

/// Lloyd steps per codebook (k-means has converged to < 0.1 % objective change by then on
/// Gaussian calibration sets of 1–4k vectors; see the kmeans test).
pub const KMEANS_ITERS: usize = 20;

pub static DESC: FormatDesc = FormatDesc {
    name: "vecinfer",
    bits: &[4, 8],
    default_bits: 8,
    groups: &[2, 4, 8],
    default_group: 4,
    needs_calibration: true,
    build: |spec, ctx| Ok(Arc::new(VecInfer::train(spec, ctx, true)?)),
    ..FormatDesc::BASE
};

#[derive(Debug)]
pub struct VecInfer {
    spec: FormatSpec,
    d: usize,
    t: usize,
    g: usize,
    k: usize,
    /// Per-channel smoothing λ (all 1 for plain PQ).
    lambda: Vec<f32>,
    rot: Option<Rotation>,
    /// (d/g) × k × g, sub-space major.
    codebooks: Vec<f32>,
    row_bytes: usize,
}

impl VecInfer {
    /// Train from `ctx.calibration`. `smooth_rotate = false` gives plain product
    /// quantization (no λ, no rotation): the baseline the method is measured against.
    pub fn train(spec: &FormatSpec, ctx: &FormatCtx, smooth_rotate: bool) -> Result<Self> {
        let (d, g, k) = (ctx.head_dim, spec.group as usize, 1usize << spec.bits);
        if d % g != 0 {
            return Err(VqError::UnsupportedHeadDim {
                format: spec.to_string(),
                d,
                why: "d must be a multiple of the sub-vector size g",
            });
        }
        if let Some(state) = &ctx.state {
            return Self::restore(spec, ctx, smooth_rotate, state);
        }
        let calib = ctx.calibration.as_ref().ok_or_else(|| VqError::MissingCalibration {
            format: spec.to_string(),
            why: "no calibration vectors for this (layer, head, stream)".into(),
        })?;
        let n = calib.len() / d;
        if calib.len() % d != 0 || n < k {
            return Err(VqError::MissingCalibration {
                format: spec.to_string(),
                why: format!("need ≥ {k} whole vectors of d = {d}, got {} floats", calib.len()),
            });
        }
        check_finite("calibration vectors", calib, d)?;
        let mut lambda = vec![1f32; d];
        if smooth_rotate {
            for row in calib.chunks_exact(d) {
                for (l, v) in lambda.iter_mut().zip(row) {
                    *l = l.max(v.abs());
                }
            }
            // λ_j = √max|C_j| (channels with max < 1 keep λ = 1 before normalizing), then
            // geometric mean 1 so λ only reshapes, never rescales, the vectors.
            lambda.iter_mut().for_each(|l| *l = l.sqrt());
            let gm = (lambda.iter().map(|l| (*l as f64).ln()).sum::<f64>() / d as f64).exp();
            lambda.iter_mut().for_each(|l| *l = (*l as f64 / gm) as f32);
        }
        let mut me = Self {
            spec: spec.clone(),
            d,
            t: ctx.page_tokens,
            g,
            k,
            lambda,
            rot: if smooth_rotate { Some(Rotation::new(d, ctx.seed)?) } else { None },
            codebooks: Vec::new(),
            row_bytes: code_bytes(d / g, spec.bits),
        };
        let z: Vec<f32> = calib.chunks_exact(d).flat_map(|row| me.forward(row)).collect();
        for s in 0..d / g {
            let sub: Vec<f32> = z.chunks_exact(d).flat_map(|row| row[s * g..(s + 1) * g].to_vec()).collect();
            let km = kmeans(&sub, g, k, KMEANS_ITERS, derive_seed(ctx.seed, &[0x56, s as u64]));
            me.codebooks.extend(km.centroids);
        }
        Ok(me)
    }

    /// The instance `export_state` was taken from: λ then the codebooks, checked for length
    /// and finiteness (the state comes from a file).
    fn restore(spec: &FormatSpec, ctx: &FormatCtx, smooth_rotate: bool, state: &[f32]) -> Result<Self> {
        let (d, g, k) = (ctx.head_dim, spec.group as usize, 1usize << spec.bits);
        let want = d + d * k;
        if state.len() != want {
            return Err(VqError::InvalidConfig(format!(
                "{spec}: saved state has {} floats, expected {want} (λ and codebooks)",
                state.len()
            )));
        }
        check_finite("saved vecinfer state", state, d)?;
        let (lambda, codebooks) = state.split_at(d);
        if lambda.iter().any(|l| *l <= 0.0) {
            return Err(VqError::InvalidConfig(format!("{spec}: saved smoothing factors must be > 0")));
        }
        Ok(Self {
            spec: spec.clone(),
            d,
            t: ctx.page_tokens,
            g,
            k,
            lambda: lambda.to_vec(),
            rot: if smooth_rotate { Some(Rotation::new(d, ctx.seed)?) } else { None },
            codebooks: codebooks.to_vec(),
            row_bytes: code_bytes(d / g, spec.bits),
        })
    }

    /// z = R·(x/λ).
    fn forward(&self, x: &[f32]) -> Vec<f32> {
        let mut z: Vec<f32> = x.iter().zip(&self.lambda).map(|(v, l)| v / l).collect();
        if let Some(r) = &self.rot {
            r.apply(&mut z);
        }
        z
    }

    /// x ← λ ⊙ Rᵀ·x.
    fn backward(&self, x: &mut [f32]) {
        if let Some(r) = &self.rot {
            r.apply_inverse(x);
        }
        x.iter_mut().zip(&self.lambda).for_each(|(v, l)| *v *= l);
    }

    fn centroid(&self, s: usize, c: usize) -> &[f32] {
        let o = (s * self.k + c) * self.g;
        &self.codebooks[o..o + self.g]
    }

    /// Row `i` of `page`: the nearest centroid's index per sub-vector of z = R·(x/λ).
    fn encode_one(&self, x: &[f32], page: &mut [u8], i: usize) {
        let z = self.forward(x);
        let codes: Vec<u8> = (0..self.d / self.g)
            .map(|s| {
                let cb = &self.codebooks[s * self.k * self.g..(s + 1) * self.k * self.g];
                nearest(cb, self.g, &z[s * self.g..(s + 1) * self.g]).0 as u8
            })
            .collect();
        let rb = self.row_bytes;
        pack::pack(&codes, self.spec.bits, &mut page[i * rb..(i + 1) * rb]).expect("row sized by the layout");
    }

    #[inline]
    fn code(&self, page: &[u8], t: usize, s: usize) -> usize {
        pack::get(&page[t * self.row_bytes..], s, self.spec.bits) as usize
    }
}

impl Format for VecInfer {
    fn spec(&self) -> &FormatSpec {
        &self.spec
    }
    fn head_dim(&self) -> usize {
        self.d
    }
    fn page_tokens(&self) -> usize {
        self.t
    }
    fn page_bytes(&self) -> usize {
        self.t * self.row_bytes
    }
    fn state_bytes(&self) -> usize {
        (self.codebooks.len() + self.lambda.len()) * 4 + self.rot.as_ref().map_or(0, Rotation::state_bytes)
    }
    fn export_state(&self) -> Vec<f32> {
        self.lambda.iter().chain(&self.codebooks).copied().collect()
    }

    fn encode_page(&self, x: &[f32], page: &mut [u8]) -> Result<()> {
        let (d, t) = (self.d, self.t);
        check_len("encode_page input", d * t, x.len())?;
        check_len("encode_page output", self.page_bytes(), page.len())?;
        check_finite("encode_page input", x, d)?;
        for (i, row) in x.chunks_exact(d).enumerate() {
            self.encode_one(row, page, i);
        }
        Ok(())
    }

    /// Tokens are coded independently: the cache fills pages a token at a time (row mode).
    fn row_granular(&self) -> bool {
        true
    }

    fn encode_row(&self, x: &[f32], page: &mut [u8], row: usize) -> Result<()> {
        check_row_input(self, x, page, row)?;
        self.encode_one(x, page, row);
        Ok(())
    }

    fn clear_rows_from(&self, page: &mut [u8], from: usize) {
        let at = (from * self.row_bytes).min(page.len());
        page[at..].fill(0);
    }

    fn decode_page(&self, page: &[u8], out: &mut [f32]) {
        for (i, o) in out.chunks_exact_mut(self.d).enumerate() {
            for (s, chunk) in o.chunks_exact_mut(self.g).enumerate() {
                chunk.copy_from_slice(self.centroid(s, self.code(page, i, s)));
            }
            self.backward(o);
        }
    }

    /// aux per head: `LUT[s][c]` = ⟨(R·(q ⊙ λ))_s, centroid_{s,c}⟩, (d/g) × 2^b floats.
    fn prepare_query(&self, q: &[f32], n_q: usize) -> QueryState {
        let (d, g, k) = (self.d, self.g, self.k);
        let mut aux = Vec::with_capacity(n_q * d / g * k);
        for qh in q.chunks_exact(d).take(n_q) {
            let mut qp: Vec<f32> = qh.iter().zip(&self.lambda).map(|(v, l)| v * l).collect();
            if let Some(r) = &self.rot {
                r.apply(&mut qp);
            }
            for s in 0..d / g {
                let qs = &qp[s * g..(s + 1) * g];
                aux.extend((0..k).map(|c| qs.iter().zip(self.centroid(s, c)).map(|(a, b)| a * b).sum::<f32>()));
            }
        }
        QueryState { n_q, q: Vec::new(), aux }
    }

    fn scores(&self, qs: &QueryState, page: &[u8], out: &mut [f32]) {
        let (n_sub, k, t) = (self.d / self.g, self.k, self.t);
        for (h, lut) in qs.aux.chunks_exact(n_sub * k).enumerate() {
            for i in 0..t {
                out[h * t + i] = (0..n_sub).map(|s| lut[s * k + self.code(page, i, s)]).sum();
            }
        }
    }

    fn accumulate(&self, w: &[f32], n_q: usize, page: &[u8], acc: &mut [f32]) {
        let (d, g, t) = (self.d, self.g, self.t);
        for i in 0..t {
            for h in 0..n_q {
                let wt = w[h * t + i];
                for (s, a) in acc[h * d..(h + 1) * d].chunks_exact_mut(g).enumerate() {
                    let c = self.centroid(s, self.code(page, i, s));
                    a.iter_mut().zip(c).for_each(|(x, y)| *x += wt * y);
                }
            }
        }
    }

    fn finish(&self, acc: &mut [f32], n_q: usize) {
        for a in acc.chunks_exact_mut(self.d).take(n_q) {
            self.backward(a);
        }
    }
}
