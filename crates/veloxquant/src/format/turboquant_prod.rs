//! turboquant_prod: TurboQuant's inner-product quantizer (Zandieh et al., "Online Vector
//! Quantization with Near-optimal Distortion Rate", arXiv 2504.19874, Algorithm 2).
//!
//! Per key x: r = R·x (seeded rotation), y = r/‖r‖, a (b−1)-bit turboquant_mse code ŷ of
//! y, then a 1-bit QJL sketch (m = d, `sketch.rs`) of the residual e = y − ŷ and its norm
//! γ = ‖e‖. Reconstruction x̂ = ‖x‖·Rᵀ(ŷ + √(π/2)/d · γ · Sᵀ·sign(S·e)): unbiased inner
//! products. Fused scoring rotates q once and projects it once (S·R·q); per key it looks
//! up the (b−1)-bit centroids and adds ±(S·R·q)_i per sign bit.
//!
//! | bytes                  | content                                   |
//! |------------------------|-------------------------------------------|
//! | T × ⌈d(b−1)/32⌉·4      | packed (b−1)-bit Lloyd-Max codes of y     |
//! | T × ⌈d/32⌉·4           | sign bits of S·e                          |
//! | 2·T                    | ‖x‖, f16                                  |
//! | 2·T                    | γ = ‖y − ŷ‖, f16                          |
//!
//! Bits/value = b + 32/d (b − 1 code bits + 1 sketch bit + two f16 per token).
//! Anchor (REFERENCE.md §2): d·E[(⟨q,x⟩ − ⟨q,x̂⟩)²] = 1.571, 0.571, 0.185, 0.054 for
//! b = 1..4 with a Gaussian sketch (b = 1 is `qjl:1x`), ≈2.7× lower with `:orth`.
//! Keys only. Spec: `turboquant_prod:3`, `turboquant_prod:3:orth`.

use std::sync::Arc;

use super::sketch::{code_bytes, signed_sum, Sketch, TokenLayout};
use super::{Format, FormatDesc, FormatSpec, QueryState};
use crate::codebook::ScaledCodebook;
use crate::pack;
use crate::reduce::{dot_canonical, sum_sq_canonical};
use crate::rng::derive_seed;
use crate::rotate::Rotation;

pub static DESC: FormatDesc = FormatDesc {
    name: "turboquant_prod",
    for_values: false,
    bits: &[2, 3, 4],
    default_bits: 3,
    has_sketch: true,
    build: |spec, ctx| {
        let d = ctx.head_dim;
        let cb = ScaledCodebook::new(spec.bits - 1, d);
        Ok(Arc::new(Prod {
            spec: spec.clone(),
            d,
            rot: Rotation::new(d, ctx.seed)?,
            sketch: Sketch::new(spec.sketch, d, d, derive_seed(ctx.seed, &[0x51])),
            mse_bytes: code_bytes(d, cb.bits),
            table: cb.table16(),
            cb,
            layout: TokenLayout {
                t: ctx.page_tokens,
                row_bytes: code_bytes(d, spec.bits - 1) + code_bytes(d, 1),
                n_side: 2,
            },
        }))
    },
    ..FormatDesc::BASE
};

#[derive(Debug)]
pub struct Prod {
    spec: FormatSpec,
    d: usize,
    rot: Rotation,
    sketch: Sketch,
    cb: ScaledCodebook,
    table: [f32; 16],
    mse_bytes: usize,
    layout: TokenLayout,
}

impl Prod {
    /// Row i of `page` from the token x (checked by the caller).
    fn encode_row_unchecked(&self, x: &[f32], page: &mut [u8], i: usize) {
        let mut r = x.to_vec();
        self.rot.apply(&mut r);
        let norm = sum_sq_canonical(&r).sqrt();
        let inv = if norm > 0.0 { 1.0 / norm } else { 0.0 };
        r.iter_mut().for_each(|v| *v *= inv);
        let codes: Vec<u8> = r.iter().map(|&v| self.cb.quantize(v)).collect();
        let row = self.layout.row_mut(page, i);
        let (mse, signs) = row.split_at_mut(self.mse_bytes);
        pack::pack(&codes, self.cb.bits, mse).expect("row sized by the layout");
        // Residual of the unit vector (zero for a zero input).
        for (v, &c) in r.iter_mut().zip(&codes) {
            *v = if norm > 0.0 { *v - self.table[c as usize] } else { 0.0 };
        }
        self.sketch.encode_signs(&r, signs);
        self.layout.set_side(page, 0, i, norm);
        self.layout.set_side(page, 1, i, dot_canonical(&r, &r).sqrt());
    }

    /// ŷ (the MSE stage, unit scale) of row t.
    fn mse_part(&self, row: &[u8], out: &mut [f32]) {
        for (j, o) in out.iter_mut().enumerate() {
            *o = self.table[pack::get(row, j, self.cb.bits) as usize];
        }
    }
}

impl Format for Prod {
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
        self.sketch.rows.len() * 4 + self.rot.state_bytes() + self.cb.state_bytes()
    }

    token_rows_methods!();

    fn decode_page(&self, page: &[u8], out: &mut [f32]) {
        let c = self.sketch.scale();
        for (i, o) in out.chunks_exact_mut(self.d).enumerate() {
            let row = self.layout.row(page, i);
            self.mse_part(row, o);
            let gamma = self.layout.side(page, 1, i);
            self.sketch.add_back_projection(&row[self.mse_bytes..], c * gamma, o);
            self.rot.apply_inverse(o);
            let n = self.layout.side(page, 0, i);
            o.iter_mut().for_each(|v| *v *= n);
        }
    }

    /// q = R·q_h; aux = [S·R·q_h (d) | Σ_i (S·R·q_h)_i] per head.
    fn prepare_query(&self, q: &[f32], n_q: usize) -> QueryState {
        let d = self.d;
        let mut qr = q[..n_q * d].to_vec();
        let mut aux = vec![0f32; n_q * (d + 1)];
        for (qh, a) in qr.chunks_exact_mut(d).zip(aux.chunks_exact_mut(d + 1)) {
            self.rot.apply(qh);
            self.sketch.project(qh, &mut a[..d]);
            a[d] = a[..d].iter().sum();
        }
        QueryState { n_q, q: qr, aux }
    }

    fn scores(&self, qs: &QueryState, page: &[u8], out: &mut [f32]) {
        let (d, t) = (self.d, self.layout.t);
        let c = self.sketch.scale();
        let bits = self.cb.bits;
        for i in 0..t {
            let row = self.layout.row(page, i);
            let (n, gamma) = (self.layout.side(page, 0, i), self.layout.side(page, 1, i));
            for h in 0..qs.n_q {
                let qh = &qs.q[h * d..(h + 1) * d];
                let a = &qs.aux[h * (d + 1)..(h + 1) * (d + 1)];
                let mse: f32 =
                    qh.iter().enumerate().map(|(j, v)| v * self.table[pack::get(row, j, bits) as usize]).sum();
                let qjl = signed_sum(&a[..d], &row[self.mse_bytes..], a[d]);
                out[h * t + i] = n * (mse + c * gamma * qjl);
            }
        }
    }
}
