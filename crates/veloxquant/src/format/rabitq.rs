//! rabitq: 1-bit RaBitQ codes for keys (Gao & Long, "RaBitQ: Quantizing High-Dimensional
//! Vectors with a Theoretical Error Bound for Approximate Nearest Neighbor Search", SIGMOD
//! 2024, arXiv 2405.12497).
//!
//! Per key x: y = R·x/‖x‖ (seeded rotation), sign code ō with ō_i = ±1/√d (bit set ⇔
//! y_i ≥ 0), x0 = ⟨ō, y⟩ = ‖y‖₁/√d (≈ √(2/π) ≈ 0.80), and ‖x‖; both scalars in f16.
//! Estimator ⟨x, q⟩ ≈ ‖x‖·⟨ō, R·q⟩/x0 (unbiased); the reference decode is
//! x̂ = ‖x‖/x0 · Rᵀ·ō, whose dot with q is exactly that estimator.
//!
//! Query: R·q is quantized once per decode step to B_q = 4 bits (uniform over [min, max],
//! nearest rounding), and scoring uses bit planes, popcounts only:
//! ⟨ō, q̄⟩ = (lo·(2·pop(ō) − d) + Δ·(2·Σ_j 2^j·pop(ō ∧ plane_j) − Σu))/√d. The dequantized
//! 4-bit query is what `scoring_query_ref` returns, so the reference path reproduces the
//! fused scores.
//!
//! | bytes           | content                          |
//! |-----------------|----------------------------------|
//! | T × ⌈d/32⌉·4    | sign bits of R·x, LSB-first      |
//! | 2·T             | ‖x‖, f16                          |
//! | 2·T             | x0 = ⟨ō, y⟩, f16                  |
//!
//! Bits/value = 1 + 32/d. Anchor: E(x0) = √(2/π) = 0.798 at large d; error of the exact
//! query estimator ≈ √((1 − x0²)/x0²)·N(0,1)/√(d − 1) (REFERENCE.md §5), tested.
//! Deviations: nearest (not randomized) rounding of the query — its error is measured in
//! the tests; no extended multi-bit codes yet. Keys only. Spec: `rabitq`.

use std::sync::Arc;

use super::sketch::{code_bytes, TokenLayout};
use super::{Format, FormatDesc, FormatSpec, QueryState};
use crate::reduce::sum_sq_canonical;
use crate::rotate::Rotation;

/// Query bits B_q (RaBitQ's default).
pub const QUERY_BITS: u32 = 4;

pub static DESC: FormatDesc = FormatDesc {
    name: "rabitq",
    for_values: false,
    build: |spec, ctx| {
        let d = ctx.head_dim;
        Ok(Arc::new(Rabitq {
            spec: spec.clone(),
            d,
            rot: Rotation::new(d, ctx.seed)?,
            words: code_bytes(d, 1) / 4,
            layout: TokenLayout { t: ctx.page_tokens, row_bytes: code_bytes(d, 1), n_side: 2 },
        }))
    },
    ..FormatDesc::BASE
};

#[derive(Debug)]
pub struct Rabitq {
    spec: FormatSpec,
    d: usize,
    rot: Rotation,
    /// u32 words per sign row.
    words: usize,
    layout: TokenLayout,
}

/// One quantized query: lo, Δ, Σu and the 4 bit planes of u (each `words` u32).
struct QQuery {
    lo: f32,
    delta: f32,
    sum_u: f32,
    planes: Vec<u32>,
}

impl Rabitq {
    /// Rotate q and quantize it to B_q bits; returns (dequantized rotated q̄, planes).
    fn quantize_query(&self, q: &[f32]) -> (Vec<f32>, QQuery) {
        let mut r = q.to_vec();
        self.rot.apply(&mut r);
        let lo = r.iter().cloned().fold(f32::INFINITY, f32::min);
        let hi = r.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let levels = ((1u32 << QUERY_BITS) - 1) as f32;
        let delta = (hi - lo) / levels;
        let mut planes = vec![0u32; QUERY_BITS as usize * self.words];
        let mut sum_u = 0f32;
        for (i, v) in r.iter_mut().enumerate() {
            let u = if delta > 0.0 { ((*v - lo) / delta).round().clamp(0.0, levels) } else { 0.0 };
            sum_u += u;
            for (j, plane) in planes.chunks_exact_mut(self.words).enumerate() {
                if (u as u32) >> j & 1 == 1 {
                    plane[i / 32] |= 1 << (i % 32);
                }
            }
            *v = lo + delta * u;
        }
        let qq = QQuery { lo, delta, sum_u, planes };
        (r, qq)
    }

    /// Row i of `page` from the token x (checked by the caller).
    fn encode_row_unchecked(&self, x: &[f32], page: &mut [u8], i: usize) {
        let d = self.d;
        let mut y = x.to_vec();
        self.rot.apply(&mut y);
        let norm = sum_sq_canonical(&y).sqrt();
        let row = self.layout.row_mut(page, i);
        let mut l1 = 0f64;
        for (j, v) in y.iter().enumerate() {
            if *v >= 0.0 {
                row[j / 8] |= 1 << (j % 8);
            }
            l1 += v.abs() as f64;
        }
        let x0 = if norm > 0.0 { (l1 / (norm as f64 * (d as f64).sqrt())) as f32 } else { 0.0 };
        self.layout.set_side(page, 0, i, norm);
        self.layout.set_side(page, 1, i, x0);
    }

    fn row_words<'a>(&self, page: &'a [u8], t: usize) -> impl Iterator<Item = u32> + 'a {
        let row = self.layout.row(page, t);
        row.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
    }
}

impl Format for Rabitq {
    fn spec(&self) -> &FormatSpec {
        &self.spec
    }
    fn head_dim(&self) -> usize {
        self.d
    }
    fn page_tokens(&self) -> usize {
        self.layout.t
    }
    fn page_bytes(&self) -> usize {
        self.layout.page_bytes()
    }
    fn state_bytes(&self) -> usize {
        self.rot.state_bytes()
    }

    token_rows_methods!();

    fn decode_page(&self, page: &[u8], out: &mut [f32]) {
        let inv_sqrt_d = 1.0 / (self.d as f32).sqrt();
        for (i, o) in out.chunks_exact_mut(self.d).enumerate() {
            let (n, x0) = (self.layout.side(page, 0, i), self.layout.side(page, 1, i));
            let w = if x0 > 0.0 { n / x0 * inv_sqrt_d } else { 0.0 };
            let row = self.layout.row(page, i);
            for (j, v) in o.iter_mut().enumerate() {
                *v = if row[j / 8] >> (j % 8) & 1 == 1 { w } else { -w };
            }
            self.rot.apply_inverse(o);
        }
    }

    fn scoring_query_ref(&self, q: &[f32], n_q: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(n_q * self.d);
        for qh in q.chunks_exact(self.d).take(n_q) {
            let (mut r, _) = self.quantize_query(qh);
            self.rot.apply_inverse(&mut r);
            out.extend(r);
        }
        out
    }

    /// aux per head: [lo, Δ, Σu, planes as f32 bit patterns (4 × words)].
    fn prepare_query(&self, q: &[f32], n_q: usize) -> QueryState {
        let stride = 3 + QUERY_BITS as usize * self.words;
        let mut aux = Vec::with_capacity(n_q * stride);
        for qh in q.chunks_exact(self.d).take(n_q) {
            let (_, qq) = self.quantize_query(qh);
            aux.extend([qq.lo, qq.delta, qq.sum_u]);
            aux.extend(qq.planes.iter().map(|w| f32::from_bits(*w)));
        }
        QueryState { n_q, q: Vec::new(), aux }
    }

    fn scores(&self, qs: &QueryState, page: &[u8], out: &mut [f32]) {
        let (d, t, nw) = (self.d, self.layout.t, self.words);
        let stride = 3 + QUERY_BITS as usize * nw;
        let inv_sqrt_d = 1.0 / (d as f32).sqrt();
        for i in 0..t {
            let code: Vec<u32> = self.row_words(page, i).collect();
            let pop: u32 = code.iter().map(|w| w.count_ones()).sum();
            let (n, x0) = (self.layout.side(page, 0, i), self.layout.side(page, 1, i));
            let f = if x0 > 0.0 { n / x0 * inv_sqrt_d } else { 0.0 };
            for (h, a) in qs.aux.chunks_exact(stride).enumerate() {
                let (lo, delta, sum_u) = (a[0], a[1], a[2]);
                let mut set_u = 0u32;
                for (j, plane) in a[3..].chunks_exact(nw).enumerate() {
                    let c: u32 = plane.iter().zip(&code).map(|(p, w)| (p.to_bits() & w).count_ones()).sum();
                    set_u += c << j;
                }
                let signed_u = 2.0 * set_u as f32 - sum_u;
                let dot = lo * (2.0 * pop as f32 - d as f32) + delta * signed_u;
                out[h * t + i] = f * dot;
            }
        }
    }
}
