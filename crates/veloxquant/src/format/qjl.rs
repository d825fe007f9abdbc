//! qjl: the Quantized Johnson–Lindenstrauss key sketch (Zandieh, Daliri, Han, "QJL: 1-Bit
//! Quantized JL Transform for KV Cache Quantization with Zero Overhead", arXiv 2406.03482).
//!
//! Per key k: the m = mult·d sign bits of S·k (S seeded, Gaussian or orthogonalized, see
//! `sketch.rs`) and ‖k‖ in f16. Estimator of ⟨q, k⟩ = √(π/2)/m · ‖k‖ · ⟨S·q, sign(S·k)⟩;
//! the reference decode is k̂ = √(π/2)/m · ‖k‖ · Sᵀ·sign(S·k), so ⟨q, k̂⟩ is exactly the
//! estimator. Fused scoring computes S·q once per query (`prepare_query`) and then only
//! adds ±(S·q)_i per key bit.
//!
//! | bytes                          | content                          |
//! |--------------------------------|----------------------------------|
//! | T × ⌈m/32⌉·4                   | sign bits of S·k, LSB-first      |
//! | 2·T                            | ‖k‖ per token, f16               |
//!
//! Bits/value = m/d + 16/d (1.125 at m = d = 128, 2.125 at m = 2d). Keys only.
//! Anchor: unbiased, variance ≤ π/(2m)·‖q‖²‖k‖² (REFERENCE.md §3), tested.
//! Deviations from the paper: no outlier-channel split and no per-layer m; values are left
//! to another format (the paper uses 2-bit per-token values). Spec: `qjl:1x`, `qjl:2x:orth`.

use std::sync::Arc;

use super::sketch::{code_bytes, signed_sum, Sketch, TokenLayout};
use super::{Format, FormatDesc, FormatSpec, QueryState};
use crate::reduce::sum_sq_canonical;

pub static DESC: FormatDesc = FormatDesc {
    name: "qjl",
    for_values: false,
    mults: &[1, 2],
    has_sketch: true,
    build: |spec, ctx| {
        let (d, m) = (ctx.head_dim, ctx.head_dim * spec.mult as usize);
        Ok(Arc::new(Qjl {
            spec: spec.clone(),
            d,
            sketch: Sketch::new(spec.sketch, m, d, ctx.seed),
            layout: TokenLayout { t: ctx.page_tokens, row_bytes: code_bytes(m, 1), n_side: 1 },
        }))
    },
    ..FormatDesc::BASE
};

#[derive(Debug)]
pub struct Qjl {
    spec: FormatSpec,
    d: usize,
    sketch: Sketch,
    layout: TokenLayout,
}

impl Qjl {
    fn encode_row_unchecked(&self, k: &[f32], page: &mut [u8], i: usize) {
        self.sketch.encode_signs(k, self.layout.row_mut(page, i));
        self.layout.set_side(page, 0, i, sum_sq_canonical(k).sqrt());
    }
}

impl Format for Qjl {
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
        self.sketch.rows.len() * 4
    }

    token_rows_methods!();

    fn decode_page(&self, page: &[u8], out: &mut [f32]) {
        let c = self.sketch.scale();
        for (i, o) in out.chunks_exact_mut(self.d).enumerate() {
            o.fill(0.0);
            let w = c * self.layout.side(page, 0, i);
            self.sketch.add_back_projection(self.layout.row(page, i), w, o);
        }
    }

    /// aux = [S·q_h (m) | Σ_i (S·q_h)_i] per query head.
    fn prepare_query(&self, q: &[f32], n_q: usize) -> QueryState {
        let m = self.sketch.m;
        let mut aux = vec![0f32; n_q * (m + 1)];
        for (qh, a) in q.chunks_exact(self.d).zip(aux.chunks_exact_mut(m + 1)) {
            self.sketch.project(qh, &mut a[..m]);
            a[m] = a[..m].iter().sum();
        }
        QueryState { n_q, q: Vec::new(), aux }
    }

    fn scores(&self, qs: &QueryState, page: &[u8], out: &mut [f32]) {
        let (m, t) = (self.sketch.m, self.layout.t);
        let c = self.sketch.scale();
        for (h, a) in qs.aux.chunks_exact(m + 1).enumerate() {
            for i in 0..t {
                let s = signed_sum(&a[..m], self.layout.row(page, i), a[m]);
                out[h * t + i] = c * self.layout.side(page, 0, i) * s;
            }
        }
    }
}
