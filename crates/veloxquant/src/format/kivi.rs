//! kivi: asymmetric min/max quantization with per-channel keys and per-token values (Liu et
//! al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML 2024, arXiv
//! 2402.02750).
//!
//! Keys: each channel j is quantized over groups of G consecutive tokens of the page (G = T
//! = 32 by default: one group per channel per page). Values: each token is quantized in
//! groups of G consecutive channels. A group with min m and max M gets scale
//! s = (M − m)/(2^b − 1) and zero z = m, both stored in f16; codes are
//! u = clamp(round((x − z₁₆)/s₁₆), 0, 2^b − 1) computed against the *stored* f16 values, so
//! every element's error is ≤ s₁₆/2 plus the f16 rounding of s and z. The cache's fp16
//! tail holds the recent tokens and flushes them in whole pages (KIVI's residual R).
//!
//! | bytes                 | content                                              |
//! |-----------------------|------------------------------------------------------|
//! | T × ⌈d·b/32⌉·4        | codes, one row per token, LSB-first                  |
//! | 2·T·d/G               | scales (keys: `[T/G][d]`; values: `[T][d/G]`), f16       |
//! | 2·T·d/G               | zeros, same order, f16                               |
//!
//! Bits/value = b + 32/G: 3 for "2-bit" and 5 for "4-bit" at G = 32, as KIVI counts them
//! (REFERENCE.md §4). Fused keys: per group, q_j·s_j and Σ_j q_j·z_j once, then one
//! multiply-add per code; values accumulate s·u + z directly.
//! Needs T % G = 0 (keys) and d % G = 0 (values): otherwise a typed error.
//! Spec: `kivi:2`, `kivi:4`, optionally `:g16` / `:g32` (default g32).

use std::sync::Arc;

use half::f16;

use super::sketch::code_bytes;
use super::{check_finite, check_len, Format, FormatDesc, FormatSpec, Stream};
use crate::error::{Result, VqError};
use crate::pack;

pub static DESC: FormatDesc = FormatDesc {
    name: "kivi",
    bits: &[2, 4],
    default_bits: 2,
    groups: &[16, 32],
    default_group: 32,
    build: |spec, ctx| {
        let (d, t, g) = (ctx.head_dim, ctx.page_tokens, spec.group as usize);
        match ctx.stream {
            Stream::Keys if t % g != 0 => {
                return Err(VqError::InvalidConfig(format!(
                    "{spec}: page size T = {t} must be a multiple of the group size {g}"
                )))
            }
            Stream::Values if d % g != 0 => {
                return Err(VqError::UnsupportedHeadDim {
                    format: spec.to_string(),
                    d,
                    why: "values are grouped by channel: d must be a multiple of G",
                })
            }
            _ => {}
        }
        Ok(Arc::new(Kivi {
            spec: spec.clone(),
            d,
            t,
            g,
            per_channel: ctx.stream == Stream::Keys,
            row_bytes: code_bytes(d, spec.bits),
        }))
    },
    ..FormatDesc::BASE
};

#[derive(Debug)]
pub struct Kivi {
    spec: FormatSpec,
    d: usize,
    t: usize,
    g: usize,
    /// Keys: groups along tokens per channel; values: along channels per token.
    per_channel: bool,
    row_bytes: usize,
}

impl Kivi {
    fn n_params(&self) -> usize {
        self.t * self.d / self.g
    }

    /// Index of the (scale, zero) pair of element (token t, channel j).
    #[inline]
    fn param(&self, t: usize, j: usize) -> usize {
        if self.per_channel {
            (t / self.g) * self.d + j
        } else {
            t * (self.d / self.g) + j / self.g
        }
    }

    /// (scale, zero) of parameter p.
    #[inline]
    pub fn scale_zero(&self, page: &[u8], p: usize) -> (f32, f32) {
        let o = self.t * self.row_bytes + 2 * p;
        let z = o + 2 * self.n_params();
        (f16::from_le_bytes([page[o], page[o + 1]]).to_f32(), f16::from_le_bytes([page[z], page[z + 1]]).to_f32())
    }

    /// Stores group p's f16 scale and zero; a zero of −0 is stored as +0: which zero a
    /// min over both returns depends on the order and the machine (Rust's `min`, x86 vs
    /// ARM, the GPU's reductions), and nothing else in the page depends on its sign.
    fn set_scale_zero(&self, page: &mut [u8], p: usize, s: f32, z: f32) -> (f32, f32) {
        let z = if z == 0.0 { 0.0 } else { z };
        let o = self.t * self.row_bytes + 2 * p;
        let zo = o + 2 * self.n_params();
        let (s, z) = (f16::from_f32(s), f16::from_f32(z));
        page[o..o + 2].copy_from_slice(&s.to_le_bytes());
        page[zo..zo + 2].copy_from_slice(&z.to_le_bytes());
        (s.to_f32(), z.to_f32())
    }

    #[inline]
    fn code(&self, page: &[u8], t: usize, j: usize) -> f32 {
        pack::get(&page[t * self.row_bytes..], j, self.spec.bits) as f32
    }
}

impl Format for Kivi {
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
        (self.t * self.row_bytes + 4 * self.n_params()).div_ceil(4) * 4
    }

    fn encode_page(&self, x: &[f32], page: &mut [u8]) -> Result<()> {
        let (d, t) = (self.d, self.t);
        check_len("encode_page input", d * t, x.len())?;
        check_len("encode_page output", self.page_bytes(), page.len())?;
        check_finite("encode_page input", x, d)?;
        page.fill(0);
        let levels = ((1u32 << self.spec.bits) - 1) as f32;
        let n = self.n_params();
        let (mut lo, mut hi) = (vec![f32::INFINITY; n], vec![f32::NEG_INFINITY; n]);
        for (i, v) in x.iter().enumerate() {
            let p = self.param(i / d, i % d);
            lo[p] = lo[p].min(*v);
            hi[p] = hi[p].max(*v);
        }
        let sz: Vec<(f32, f32)> =
            (0..n).map(|p| self.set_scale_zero(page, p, (hi[p] - lo[p]) / levels, lo[p])).collect();
        let mut codes = vec![0u8; d];
        for i in 0..t {
            for (j, c) in codes.iter_mut().enumerate() {
                let (s, z) = sz[self.param(i, j)];
                let u = if s > 0.0 { ((x[i * d + j] - z) / s).round() } else { 0.0 };
                *c = u.clamp(0.0, levels) as u8;
            }
            let rb = self.row_bytes;
            pack::pack(&codes, self.spec.bits, &mut page[i * rb..(i + 1) * rb]).expect("row sized by the layout");
        }
        Ok(())
    }

    fn decode_page(&self, page: &[u8], out: &mut [f32]) {
        for (i, o) in out.chunks_exact_mut(self.d).enumerate() {
            for (j, v) in o.iter_mut().enumerate() {
                let (s, z) = self.scale_zero(page, self.param(i, j));
                *v = s * self.code(page, i, j) + z;
            }
        }
    }

    fn scores(&self, qs: &super::QueryState, page: &[u8], out: &mut [f32]) {
        let (d, t) = (self.d, self.t);
        let mut qsc = vec![0f32; d];
        for h in 0..qs.n_q {
            let q = &qs.q[h * d..(h + 1) * d];
            if self.per_channel {
                for tg in 0..t / self.g {
                    let mut c = 0f32;
                    for (j, o) in qsc.iter_mut().enumerate() {
                        let (s, z) = self.scale_zero(page, tg * d + j);
                        *o = q[j] * s;
                        c += q[j] * z;
                    }
                    for i in tg * self.g..(tg + 1) * self.g {
                        let dot: f32 = (0..d).map(|j| qsc[j] * self.code(page, i, j)).sum();
                        out[h * t + i] = dot + c;
                    }
                }
            } else {
                for i in 0..t {
                    let mut sum = 0f32;
                    for (gi, qg) in q.chunks_exact(self.g).enumerate() {
                        let (s, z) = self.scale_zero(page, i * (d / self.g) + gi);
                        let base = gi * self.g;
                        let (mut a, mut b) = (0f32, 0f32);
                        for (k, qv) in qg.iter().enumerate() {
                            a += qv * self.code(page, i, base + k);
                            b += qv;
                        }
                        sum += s * a + z * b;
                    }
                    out[h * t + i] = sum;
                }
            }
        }
    }

    fn accumulate(&self, w: &[f32], n_q: usize, page: &[u8], acc: &mut [f32]) {
        let (d, t) = (self.d, self.t);
        let mut row = vec![0f32; d];
        for i in 0..t {
            for (j, v) in row.iter_mut().enumerate() {
                let (s, z) = self.scale_zero(page, self.param(i, j));
                *v = s * self.code(page, i, j) + z;
            }
            for h in 0..n_q {
                let wt = w[h * t + i];
                acc[h * d..(h + 1) * d].iter_mut().zip(&row).for_each(|(a, v)| *a += wt * v);
            }
        }
    }
}
