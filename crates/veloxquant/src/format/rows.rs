//! Row-coded page layouts shared by fp16, q8_0, q4_0, turboquant_mse and turboquant_frac:
//! every token is one fixed-size row of codes, optionally followed (after all T rows) by one
//! f16 scale per token. The fused CPU kernels in `cpu/` read exactly these bytes; the GPU
//! kernels will too.
//!
//! | kind     | row bytes                  | per-token tail  |
//! |----------|----------------------------|-----------------|
//! | F16      | 2·d (f16 LE)               | –               |
//! | Q8_0     | d/32 blocks × 34 (f16 scale, 32 × i8)      | – |
//! | Q4_0     | d/32 blocks × 18 (f16 scale, 16 B nibbles) | – |
//! | Codes(b) | ⌈d·b/32⌉·4 (pack.rs stream) | f16 norm       |
//! | Split(b+1, n) | (n·(b+1) + (d−n)·b)/8: one pack.rs stream, n codes of b+1 bits then d−n of b | f16 norm |
//!
//! Split rows are whole bytes, not whole words (n and d are multiples of 8), so a fractional
//! width costs exactly its bits; the second segment starts on a byte boundary.
//!
//! The per-token scales are f16 ([`RowScale::F16`]) or one byte each on a log scale around a
//! calibrated base ([`RowScale::LogU8`]: code c → base·2^((c − 128)/16), c = 0 → 0; steps of
//! 1/16 octave, ±8 octaves), padded to ≥ 8 bytes and a multiple of 4.

use half::f16;

use crate::cpu;
use crate::pack;

#[derive(Clone, Debug)]
pub enum RowKind {
    F16,
    Q8_0,
    Q4_0,
    /// Packed b-bit indices into a 16-entry centroid table (b ≤ 4).
    Codes {
        bits: u32,
        table: [f32; 16],
    },
    /// The first `n_hi` values coded at `hi_bits`, the other d − n_hi at `hi_bits − 1`
    /// (2 ≤ hi_bits ≤ 4), each into its own 16-entry table; n_hi and d multiples of 8.
    Split {
        hi_bits: u32,
        n_hi: usize,
        hi_table: [f32; 16],
        lo_table: [f32; 16],
    },
}

/// out[i] = table[code i] of a pack.rs stream of `bits` ≤ 4 bit codes. Eight codes fill
/// exactly `bits` bytes, so each group comes from one little-endian word rather than a bit
/// address per code (a prefill decodes every page of the context per layer).
fn lookup_codes(packed: &[u8], bits: u32, table: &[f32; 16], out: &mut [f32]) {
    let b = bits as usize;
    let mask = (1u64 << bits) - 1;
    let done = out.len() / 8 * 8;
    let mut groups = out.chunks_exact_mut(8);
    for (g, o) in (&mut groups).enumerate() {
        let mut w = [0u8; 8];
        w[..b].copy_from_slice(&packed[g * b..(g + 1) * b]);
        let w = u64::from_le_bytes(w);
        for (i, x) in o.iter_mut().enumerate() {
            *x = table[((w >> (i * b)) & mask & 15) as usize];
        }
    }
    for (i, x) in groups.into_remainder().iter_mut().enumerate() {
        *x = table[pack::get(packed, done + i, bits) as usize];
    }
}

impl RowKind {
    /// Byte offset of a split row's second segment (the low-width codes).
    pub fn lo_offset(&self) -> usize {
        match self {
            RowKind::Split { hi_bits, n_hi, .. } => n_hi * *hi_bits as usize / 8,
            _ => 0,
        }
    }
}

/// How the per-token scales are stored.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RowScale {
    F16,
    /// One byte: base·2^((c − 128)/16) for c ≥ 1, 0 for c = 0. Relative rounding error
    /// ≤ 2^(1/32) − 1 ≈ 2.2 %; values beyond base·2^(±127/16) clamp to the end codes.
    LogU8 {
        base: f32,
    },
}

/// Octaves per log-scale step's inverse (1/16 octave steps).
const LOG_STEPS: f32 = 16.0;

/// The log scale's 254 code edges, ascending: code c + 1 (c ≥ 1) holds the ratios s/base
/// from edge c − 1 = 2^((c − 127.5)/16) up (f64 exp2, rounded once to f32). The GPU encoder
/// takes this table from the host.
pub fn log_u8_edges() -> &'static [f32; 254] {
    static EDGES: std::sync::OnceLock<[f32; 254]> = std::sync::OnceLock::new();
    EDGES.get_or_init(|| std::array::from_fn(|i| (((i + 1) as f64 - 127.5) / LOG_STEPS as f64).exp2() as f32))
}

impl RowScale {
    fn bytes(self) -> usize {
        match self {
            Self::F16 => 2,
            Self::LogU8 { .. } => 1,
        }
    }

    /// The stored form of `s` (≥ 0) decoded back: what `row_scale` returns after
    /// `set_row_scale(s)`.
    pub fn round(self, s: f32) -> f32 {
        match self {
            Self::F16 => f16::from_f32(s).to_f32(),
            Self::LogU8 { base } => Self::log_decode(base, Self::log_code(base, s)),
        }
    }

    /// The code of s: 1 + the number of edges [`log_u8_edges`] that s/base reaches (= round(16·log2(s/base)) + 128,
    /// clamped to 1..=255, decided by comparisons against f32 edges instead of a libm log2,
    /// so every platform and the GPU encoder give the same byte); 0 for s ≤ 0 or NaN.
    fn log_code(base: f32, s: f32) -> u8 {
        if s.is_nan() || s <= 0.0 || base.is_nan() || base <= 0.0 {
            return 0;
        }
        let r = s / base;
        1 + log_u8_edges().partition_point(|&e| e <= r) as u8
    }

    #[inline]
    fn log_decode(base: f32, c: u8) -> f32 {
        if c == 0 {
            0.0
        } else {
            base * ((c as f32 - 128.0) / LOG_STEPS).exp2()
        }
    }
}

#[derive(Clone, Debug)]
pub struct RowLayout {
    pub kind: RowKind,
    pub d: usize,
    pub t: usize,
    pub row_bytes: usize,
    /// Offset of the T per-token scales, if the kind has them.
    pub scales_at: Option<usize>,
    pub scale: RowScale,
}

pub const Q8_BLOCK_BYTES: usize = 34;
pub const Q4_BLOCK_BYTES: usize = 18;
pub const QBLOCK: usize = 32;

impl RowLayout {
    pub fn new(kind: RowKind, d: usize, t: usize) -> Self {
        let row_bytes = match &kind {
            RowKind::F16 => 2 * d,
            RowKind::Q8_0 => d / QBLOCK * Q8_BLOCK_BYTES,
            RowKind::Q4_0 => d / QBLOCK * Q4_BLOCK_BYTES,
            RowKind::Codes { bits, .. } => pack::packed_bytes(d, *bits),
            RowKind::Split { hi_bits, n_hi, .. } => {
                (n_hi * *hi_bits as usize + (d - n_hi) * (*hi_bits as usize - 1)) / 8
            }
        };
        let scales_at = matches!(kind, RowKind::Codes { .. } | RowKind::Split { .. }).then_some(row_bytes * t);
        Self { kind, d, t, row_bytes, scales_at, scale: RowScale::F16 }
    }

    /// A view of a page's first `rows` ≤ T rows (the scales stay where the page has them):
    /// what the kernels read for an open page, whose other rows hold nothing.
    pub fn first_rows(&self, rows: usize) -> Self {
        assert!(rows <= self.t, "{rows} rows of a {}-row page", self.t);
        Self { t: rows, ..self.clone() }
    }

    /// The same layout with `scale`-coded per-token scales.
    pub fn with_scale(mut self, scale: RowScale) -> Self {
        self.scale = scale;
        self
    }

    pub fn page_bytes(&self) -> usize {
        let rows = self.row_bytes * self.t;
        match self.scales_at {
            // ≥ 8 bytes after the last row: the SIMD code loads read a whole qword.
            Some(_) => (rows + (self.scale.bytes() * self.t).max(8)).div_ceil(4) * 4,
            None => rows,
        }
    }

    /// Per-token scale (the stored norm), 1 for kinds without one.
    #[inline]
    pub fn row_scale(&self, page: &[u8], t: usize) -> f32 {
        match (self.scales_at, self.scale) {
            (Some(o), RowScale::F16) => f16::from_le_bytes([page[o + 2 * t], page[o + 2 * t + 1]]).to_f32(),
            (Some(o), RowScale::LogU8 { base }) => RowScale::log_decode(base, page[o + t]),
            (None, _) => 1.0,
        }
    }

    /// Every token's [`row_scale`](Self::row_scale) into `out[..T]` (one pass over the page's
    /// scales, for kernels that apply them per token and head).
    pub fn row_scales(&self, page: &[u8], out: &mut [f32]) {
        let out = &mut out[..self.t];
        match (self.scales_at, self.scale) {
            (Some(o), RowScale::F16) => {
                for (s, b) in out.iter_mut().zip(page[o..o + 2 * self.t].chunks_exact(2)) {
                    *s = f16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            (Some(o), RowScale::LogU8 { base }) => {
                out.iter_mut().zip(&page[o..o + self.t]).for_each(|(s, &c)| *s = RowScale::log_decode(base, c));
            }
            (None, _) => out.fill(1.0),
        }
    }

    pub fn set_row_scale(&self, page: &mut [u8], t: usize, s: f32) {
        match (self.scales_at, self.scale) {
            (Some(o), RowScale::F16) => page[o + 2 * t..o + 2 * t + 2].copy_from_slice(&f16::from_f32(s).to_le_bytes()),
            (Some(o), RowScale::LogU8 { base }) => page[o + t] = RowScale::log_code(base, s),
            (None, _) => {}
        }
    }

    /// Zero rows `from..` and their scales: an open page as a fresh one holds it.
    pub fn clear_rows_from(&self, page: &mut [u8], from: usize) {
        let (t, rb) = (self.t, self.row_bytes);
        if from >= t || page.len() < self.page_bytes() {
            return;
        }
        page[from * rb..t * rb].fill(0);
        if let Some(at) = self.scales_at {
            let w = self.scale.bytes();
            page[at + w * from..at + w * t].fill(0);
        }
    }

    pub fn row<'a>(&self, page: &'a [u8], t: usize) -> &'a [u8] {
        &page[t * self.row_bytes..(t + 1) * self.row_bytes]
    }

    /// Reference decode of row t, without the per-token scale.
    pub fn decode_row(&self, page: &[u8], t: usize, out: &mut [f32]) {
        let row = self.row(page, t);
        match &self.kind {
            RowKind::F16 => {
                for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                    *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            RowKind::Q8_0 => {
                for (blk, o) in row.chunks_exact(Q8_BLOCK_BYTES).zip(out.chunks_exact_mut(QBLOCK)) {
                    let s = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                    for (v, &q) in o.iter_mut().zip(&blk[2..]) {
                        *v = s * (q as i8) as f32;
                    }
                }
            }
            RowKind::Q4_0 => {
                // llama.cpp layout: byte j holds element j (low nibble) and j+16 (high).
                for (blk, o) in row.chunks_exact(Q4_BLOCK_BYTES).zip(out.chunks_exact_mut(QBLOCK)) {
                    let s = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                    for j in 0..16 {
                        o[j] = s * ((blk[2 + j] & 0xF) as i32 - 8) as f32;
                        o[j + 16] = s * ((blk[2 + j] >> 4) as i32 - 8) as f32;
                    }
                }
            }
            RowKind::Codes { bits, table } => {
                for (i, o) in out.iter_mut().enumerate() {
                    *o = table[pack::get(row, i, *bits) as usize];
                }
            }
            RowKind::Split { hi_bits, n_hi, hi_table, lo_table } => {
                let (hi, lo) = out.split_at_mut(*n_hi);
                for (i, o) in hi.iter_mut().enumerate() {
                    *o = hi_table[pack::get(row, i, *hi_bits) as usize];
                }
                let rest = &row[self.kind.lo_offset()..];
                for (i, o) in lo.iter_mut().enumerate() {
                    *o = lo_table[pack::get(rest, i, hi_bits - 1) as usize];
                }
            }
        }
    }

    /// Reference decode of a whole page, scales applied: T×d.
    pub fn decode_page(&self, page: &[u8], out: &mut [f32]) {
        self.decode_page_with(page, out, |t, o| self.decode_row(page, t, o));
    }

    /// [`decode_page`](Self::decode_page), bit for bit, with code rows unpacked eight codes
    /// per word instead of one bit address per code.
    pub fn decode_page_fast(&self, page: &[u8], out: &mut [f32]) {
        self.decode_page_with(page, out, |t, o| match &self.kind {
            RowKind::Codes { bits, table } => lookup_codes(self.row(page, t), *bits, table, o),
            RowKind::Split { hi_bits, n_hi, hi_table, lo_table } => {
                let row = self.row(page, t);
                let (hi, lo) = o.split_at_mut(*n_hi);
                lookup_codes(row, *hi_bits, hi_table, hi);
                lookup_codes(&row[self.kind.lo_offset()..], hi_bits - 1, lo_table, lo);
            }
            _ => self.decode_row(page, t, o),
        });
    }

    fn decode_page_with(&self, page: &[u8], out: &mut [f32], decode_row: impl Fn(usize, &mut [f32])) {
        for (t, o) in out.chunks_exact_mut(self.d).enumerate().take(self.t) {
            decode_row(t, o);
            let s = self.row_scale(page, t);
            if s != 1.0 {
                o.iter_mut().for_each(|v| *v *= s);
            }
        }
    }

    /// out[h·T + t] = q_h · row_t (fast path where the CPU has one).
    pub fn scores(&self, q: &[f32], n_q: usize, page: &[u8], out: &mut [f32]) {
        cpu::scores(self, q, n_q, page, out)
    }

    /// acc[h·d ..] += Σ_t w[h·T + t] · row_t.
    pub fn accumulate(&self, w: &[f32], n_q: usize, page: &[u8], acc: &mut [f32]) {
        cpu::accumulate(self, w, n_q, page, acc)
    }
}

use std::sync::Arc;

use super::{check_page_input, check_row_input, Format, FormatCtx, FormatSpec, QueryState};
use crate::codebook::ScaledCodebook;
use crate::error::{Result, VqError};
use crate::rotate::Rotation;

/// Encodes one (already rotated) row into its code bytes; returns the per-token scale to
/// store (ignored by kinds without one).
pub type RowEncoder = fn(&RowFormat, &[f32], &mut [u8]) -> f32;

/// A format whose pages are [`RowLayout`]s, optionally rotated first. fp16, q8_0, q4_0 and
/// turboquant_mse are all this, differing only in their row encoder.
#[derive(Debug)]
pub struct RowFormat {
    pub spec: FormatSpec,
    pub layout: RowLayout,
    pub rot: Option<Rotation>,
    /// Thresholds and centroids for `Codes` kinds.
    pub codebook: Option<ScaledCodebook>,
    pub row_encoder: RowEncoder,
}

impl RowFormat {
    pub fn build(
        spec: &FormatSpec,
        ctx: &FormatCtx,
        kind: RowKind,
        row_encoder: RowEncoder,
    ) -> Result<Arc<dyn Format>> {
        let rot = if spec.rotate { Some(Rotation::new(ctx.head_dim, ctx.seed)?) } else { None };
        let codebook = match &kind {
            RowKind::Codes { bits, .. } => Some(ScaledCodebook::new(*bits, ctx.head_dim)),
            _ => None,
        };
        let layout = RowLayout::new(kind, ctx.head_dim, ctx.page_tokens);
        Ok(Arc::new(Self { spec: spec.clone(), layout, rot, codebook, row_encoder }))
    }

    /// Formats built on llama.cpp-style blocks of 32 need d to be a multiple of 32.
    pub fn require_blocks(spec: &FormatSpec, d: usize) -> Result<()> {
        if !d.is_multiple_of(QBLOCK) {
            return Err(VqError::UnsupportedHeadDim { format: spec.to_string(), d, why: "needs a multiple of 32" });
        }
        Ok(())
    }

    /// Rotate and encode one checked row into its bytes and scale slot.
    fn encode_row_unchecked(&self, x: &[f32], page: &mut [u8], i: usize) {
        let d = self.layout.d;
        let (mut stack, mut heap) = ([0f32; 256], Vec::new());
        let row = if d <= stack.len() {
            &mut stack[..d]
        } else {
            heap.resize(d, 0.0);
            &mut heap[..]
        };
        row.copy_from_slice(&x[..d]);
        self.rotate_rows(row);
        let rb = self.layout.row_bytes;
        let s = (self.row_encoder)(self, row, &mut page[i * rb..(i + 1) * rb]);
        self.layout.set_row_scale(page, i, s);
    }

    fn rotate_rows(&self, x: &mut [f32]) {
        if let Some(r) = &self.rot {
            x.chunks_exact_mut(self.layout.d).for_each(|row| r.apply(row));
        }
    }

    fn unrotate_rows(&self, x: &mut [f32]) {
        if let Some(r) = &self.rot {
            x.chunks_exact_mut(self.layout.d).for_each(|row| r.apply_inverse(row));
        }
    }
}

impl Format for RowFormat {
    fn spec(&self) -> &FormatSpec {
        &self.spec
    }
    fn head_dim(&self) -> usize {
        self.layout.d
    }
    fn page_tokens(&self) -> usize {
        self.layout.t
    }
    fn page_bytes(&self) -> usize {
        self.layout.page_bytes()
    }
    fn state_bytes(&self) -> usize {
        self.rot.as_ref().map_or(0, Rotation::state_bytes)
            + self.codebook.as_ref().map_or(0, ScaledCodebook::state_bytes)
    }

    fn encode_page(&self, x: &[f32], page: &mut [u8]) -> Result<()> {
        check_page_input(self, x, page)?;
        let d = self.layout.d;
        page.fill(0);
        for (i, row) in x.chunks_exact(d).enumerate() {
            self.encode_row_unchecked(row, page, i);
        }
        Ok(())
    }

    fn row_granular(&self) -> bool {
        true
    }

    fn clear_rows_from(&self, page: &mut [u8], from: usize) {
        self.layout.clear_rows_from(page, from);
    }

    fn encode_row(&self, x: &[f32], page: &mut [u8], row: usize) -> Result<()> {
        check_row_input(self, x, page, row)?;
        self.encode_row_unchecked(x, page, row);
        Ok(())
    }

    fn decode_page(&self, page: &[u8], out: &mut [f32]) {
        self.layout.decode_page(page, out);
        self.unrotate_rows(out);
    }

    fn decode_page_fast(&self, page: &[u8], out: &mut [f32]) {
        self.layout.decode_page_fast(page, out);
        self.unrotate_rows(out);
    }

    fn prepare_query(&self, q: &[f32], n_q: usize) -> QueryState {
        let mut q = q[..n_q * self.layout.d].to_vec();
        self.rotate_rows(&mut q);
        QueryState::plain(q, n_q)
    }

    fn scores(&self, qs: &QueryState, page: &[u8], out: &mut [f32]) {
        self.layout.scores(&qs.q, qs.n_q, page, out)
    }

    fn accumulate(&self, w: &[f32], n_q: usize, page: &[u8], acc: &mut [f32]) {
        self.layout.accumulate(w, n_q, page, acc)
    }

    fn scores_rows(&self, qs: &QueryState, page: &[u8], rows: usize, out: &mut [f32]) {
        self.layout.first_rows(rows).scores(&qs.q, qs.n_q, page, out)
    }

    fn accumulate_rows(&self, w: &[f32], n_q: usize, page: &[u8], rows: usize, acc: &mut [f32]) {
        self.layout.first_rows(rows).accumulate(w, n_q, page, acc)
    }

    fn finish(&self, acc: &mut [f32], n_q: usize) {
        self.unrotate_rows(&mut acc[..n_q * self.layout.d]);
    }
}

#[cfg(test)]
mod log_scale_tests {
    use super::*;
    use crate::rng::SplitMix64;

    /// The edge comparisons give round(16·log2(s/base)) + 128 clamped to 1..=255 (computed
    /// here in f64) wherever s/base is not within 1e-9 relative of an edge; s ≤ 0 and NaN
    /// give 0; the edges ascend strictly.
    #[test]
    fn log_code_is_the_rounded_log_step() {
        let edges = log_u8_edges();
        assert!(edges.windows(2).all(|w| w[0] < w[1]));
        let mut rng = SplitMix64::new(7);
        let base = 3.7f32;
        let mut checked = 0;
        for _ in 0..200_000 {
            let s = base * (rng.next_gaussian() * 3.0).exp2() as f32;
            let x = 16.0 * ((s / base) as f64).log2() + 128.0;
            if (x - x.floor() - 0.5).abs() < 1e-7 {
                continue;
            }
            let want = x.round().clamp(1.0, 255.0) as u8;
            assert_eq!(RowScale::log_code(base, s), want, "s = {s}");
            checked += 1;
        }
        assert!(checked > 199_000);
        for s in [0.0, -1.0, f32::NAN, -0.0] {
            assert_eq!(RowScale::log_code(base, s), 0);
        }
        assert_eq!(RowScale::log_code(base, f32::INFINITY), 255);
        assert_eq!(RowScale::log_code(base, f32::MIN_POSITIVE), 1);
    }
}
