//! turboquant_rvq: two-stage residual TurboQuant (Zandieh et al., arXiv 2504.19874; the
//! residual construction of REFERENCE.md §2, "RVQ").
//!
//! Stage 1: r = R₁·x, n₁ = ‖x‖, y = r/n₁ → b₁-bit Lloyd-Max code ŷ₁ (codebook scaled by
//! 1/√d). Stage 2: e = y − ŷ₁, n₂ = ‖e‖, z = R₂·(e/n₂) with a fresh seeded rotation → its
//! own b₂-bit code ẑ (same scaling: z is a unit vector again, so its coordinates are
//! ≈ N(0, 1/d) — the residual codebook is *not* the stage-1 one shrunk by hand).
//! Reconstruction x̂ = n₁·R₁ᵀ(ŷ₁ + n₂·R₂ᵀ·ẑ); MSE ≈ D(b₁)·D(b₂).
//!
//! Fused: q₁ = R₁·q and q₂ = R₂·q₁ once per query; score = n₁(⟨q₁,ŷ₁⟩ + n₂⟨q₂,ẑ⟩) by table
//! lookups, keys never materialized. Values accumulate in both domains (acc width 2d:
//! Σ w·n₁·ŷ₁ and Σ w·n₁n₂·ẑ); `finish` applies R₂ᵀ and R₁ᵀ once per head.
//!
//! | bytes              | content                         |
//! |--------------------|---------------------------------|
//! | T × ⌈d·b₁/32⌉·4    | stage-1 codes                   |
//! | (same row)  ⌈d·b₂/32⌉·4 | stage-2 codes              |
//! | 2·T                | n₁ = ‖x‖, f16                   |
//! | 2·T                | n₂ = ‖y − ŷ₁‖, f16              |
//!
//! Bits/value = b₁ + b₂ + 32/d. Anchor: 1+1 → 0.130, 2+2 → 0.0135 (REFERENCE.md §2).
//! Spec: `turboquant_rvq:b1:b2`, e.g. `turboquant_rvq:2:2`.

use std::sync::Arc;

use super::sketch::{code_bytes, TokenLayout};
use super::{Format, FormatDesc, FormatSpec, QueryState};
use crate::codebook::ScaledCodebook;
use crate::pack;
use crate::reduce::sum_sq_canonical;
use crate::rng::derive_seed;
use crate::rotate::Rotation;

pub static DESC: FormatDesc = FormatDesc {
    name: "turboquant_rvq",
    bits: &[1, 2, 3, 4],
    default_bits: 2,
    bits2: &[1, 2, 3, 4],
    default_bits2: 2,
    build: |spec, ctx| {
        let d = ctx.head_dim;
        let stage = |bits| Stage {
            bits,
            cb: ScaledCodebook::new(bits, d),
            table: ScaledCodebook::new(bits, d).table16(),
            bytes: code_bytes(d, bits),
        };
        let (s1, s2) = (stage(spec.bits), stage(spec.bits2));
        Ok(Arc::new(Rvq {
            spec: spec.clone(),
            d,
            r1: Rotation::new(d, ctx.seed)?,
            r2: Rotation::new(d, derive_seed(ctx.seed, &[0x52]))?,
            layout: TokenLayout { t: ctx.page_tokens, row_bytes: s1.bytes + s2.bytes, n_side: 2 },
            s1,
            s2,
        }))
    },
    ..FormatDesc::BASE
};

#[derive(Debug)]
struct Stage {
    bits: u32,
    cb: ScaledCodebook,
    table: [f32; 16],
    bytes: usize,
}

impl Stage {
    fn encode(&self, y: &[f32], out: &mut [u8]) -> Vec<u8> {
        let codes: Vec<u8> = y.iter().map(|&v| self.cb.quantize(v)).collect();
        pack::pack(&codes, self.bits, out).expect("row sized by the layout");
        codes
    }

    #[inline]
    fn get(&self, row: &[u8], j: usize) -> f32 {
        self.table[pack::get(row, j, self.bits) as usize]
    }
}

#[derive(Debug)]
pub struct Rvq {
    spec: FormatSpec,
    d: usize,
    r1: Rotation,
    r2: Rotation,
    s1: Stage,
    s2: Stage,
    layout: TokenLayout,
}

fn normalize(v: &mut [f32]) -> f32 {
    let n = sum_sq_canonical(v).sqrt();
    let inv = if n > 0.0 { 1.0 / n } else { 0.0 };
    v.iter_mut().for_each(|x| *x *= inv);
    n
}

impl Rvq {
    /// Row i of `page` from the token x (checked by the caller).
    fn encode_row_unchecked(&self, x: &[f32], page: &mut [u8], i: usize) {
        let mut y = x.to_vec();
        self.r1.apply(&mut y);
        let n1 = normalize(&mut y);
        let row = self.layout.row_mut(page, i);
        let (c1, c2) = row.split_at_mut(self.s1.bytes);
        let codes = self.s1.encode(&y, c1);
        if n1 > 0.0 {
            for (v, &c) in y.iter_mut().zip(&codes) {
                *v -= self.s1.table[c as usize];
            }
        } else {
            y.fill(0.0);
        }
        let n2 = normalize(&mut y);
        self.r2.apply(&mut y);
        self.s2.encode(&y, c2);
        self.layout.set_side(page, 0, i, n1);
        self.layout.set_side(page, 1, i, n2);
    }
}

impl Format for Rvq {
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
        self.r1.state_bytes() + self.r2.state_bytes() + self.s1.cb.state_bytes() + self.s2.cb.state_bytes()
    }
    fn acc_width(&self) -> usize {
        2 * self.d
    }

    token_rows_methods!();

    fn decode_page(&self, page: &[u8], out: &mut [f32]) {
        for (i, o) in out.chunks_exact_mut(self.d).enumerate() {
            let row = self.layout.row(page, i);
            let c2 = &row[self.s1.bytes..];
            for (j, v) in o.iter_mut().enumerate() {
                *v = self.s2.get(c2, j);
            }
            self.r2.apply_inverse(o);
            let n2 = self.layout.side(page, 1, i);
            for (j, v) in o.iter_mut().enumerate() {
                *v = self.s1.get(row, j) + n2 * *v;
            }
            self.r1.apply_inverse(o);
            let n1 = self.layout.side(page, 0, i);
            o.iter_mut().for_each(|v| *v *= n1);
        }
    }

    /// q = [R₁·q_h | R₂·R₁·q_h] per head (2d floats).
    fn prepare_query(&self, q: &[f32], n_q: usize) -> QueryState {
        let d = self.d;
        let mut out = vec![0f32; n_q * 2 * d];
        for (qh, o) in q.chunks_exact(d).zip(out.chunks_exact_mut(2 * d)).take(n_q) {
            let (a, b) = o.split_at_mut(d);
            a.copy_from_slice(qh);
            self.r1.apply(a);
            b.copy_from_slice(a);
            self.r2.apply(b);
        }
        QueryState::plain(out, n_q)
    }

    fn scores(&self, qs: &QueryState, page: &[u8], out: &mut [f32]) {
        let (d, t) = (self.d, self.layout.t);
        for i in 0..t {
            let row = self.layout.row(page, i);
            let c2 = &row[self.s1.bytes..];
            let (n1, n2) = (self.layout.side(page, 0, i), self.layout.side(page, 1, i));
            for h in 0..qs.n_q {
                let (q1, q2) = qs.q[h * 2 * d..(h + 1) * 2 * d].split_at(d);
                let a: f32 = q1.iter().enumerate().map(|(j, v)| v * self.s1.get(row, j)).sum();
                let b: f32 = q2.iter().enumerate().map(|(j, v)| v * self.s2.get(c2, j)).sum();
                out[h * t + i] = n1 * (a + n2 * b);
            }
        }
    }

    fn accumulate(&self, w: &[f32], n_q: usize, page: &[u8], acc: &mut [f32]) {
        let (d, t) = (self.d, self.layout.t);
        for i in 0..t {
            let row = self.layout.row(page, i);
            let c2 = &row[self.s1.bytes..];
            let (n1, n2) = (self.layout.side(page, 0, i), self.layout.side(page, 1, i));
            for h in 0..n_q {
                let wt = w[h * t + i] * n1;
                let (a1, a2) = acc[h * 2 * d..(h + 1) * 2 * d].split_at_mut(d);
                for (j, v) in a1.iter_mut().enumerate() {
                    *v += wt * self.s1.get(row, j);
                }
                let wt2 = wt * n2;
                for (j, v) in a2.iter_mut().enumerate() {
                    *v += wt2 * self.s2.get(c2, j);
                }
            }
        }
    }

    fn finish(&self, acc: &mut [f32], n_q: usize) {
        let d = self.d;
        for h in 0..n_q {
            let (mut a1, mut a2) = {
                let (a, b) = acc[h * 2 * d..(h + 1) * 2 * d].split_at(d);
                (a.to_vec(), b.to_vec())
            };
            self.r2.apply_inverse(&mut a2);
            a1.iter_mut().zip(&a2).for_each(|(x, y)| *x += y);
            self.r1.apply_inverse(&mut a1);
            acc[h * d..(h + 1) * d].copy_from_slice(&a1);
        }
    }
}
