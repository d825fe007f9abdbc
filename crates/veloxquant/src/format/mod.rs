//! The central abstraction: a *format* encodes one stream (keys or values) of one KV head,
//! a page of `T` tokens at a time, and runs the attention verbs directly on its bytes.
//!
//! Adding a format = one module here + one line in [`REGISTRY`]. Every format provides the
//! readable reference verbs (`encode_page`, `decode_page`); the fused verbs (`scores`,
//! `accumulate`, `finish`) default to decode-then-compute and are overridden where a fast
//! path exists. `tests/conformance.rs` runs every registered format through the same checks.

/// The `Format` methods of a format whose tokens are coded independently (`sketch::TokenLayout`
/// rows): `encode_page`, `row_granular`, `encode_row` and `clear_rows_from`, all from the
/// type's `encode_row_unchecked(x, page, i)` and its `layout` field. The cache fills such pages
/// a token at a time (row mode), as the GPU's cache does.
macro_rules! token_rows_methods {
    () => {
        fn encode_page(&self, x: &[f32], page: &mut [u8]) -> $crate::error::Result<()> {
            $crate::format::check_page_input(self, x, page)?;
            page.fill(0);
            for (i, row) in x.chunks_exact(self.head_dim()).enumerate() {
                self.encode_row_unchecked(row, page, i);
            }
            Ok(())
        }

        fn row_granular(&self) -> bool {
            true
        }

        fn encode_row(&self, x: &[f32], page: &mut [u8], row: usize) -> $crate::error::Result<()> {
            $crate::format::check_row_input(self, x, page, row)?;
            self.encode_row_unchecked(x, page, row);
            Ok(())
        }

        fn clear_rows_from(&self, page: &mut [u8], from: usize) {
            self.layout.clear_rows_from(page, from);
        }
    };
}

pub mod fp16;
pub mod kivi;
pub mod q4_0;
pub mod q8_0;
pub mod qjl;
pub mod rabitq;
pub mod rows;
pub mod sketch;
pub mod turboquant_frac;
pub mod turboquant_mse;
pub mod turboquant_prod;
pub mod turboquant_rvq;
pub mod vecinfer;

use std::fmt;
use std::sync::Arc;

use crate::error::{Result, VqError};

/// Largest head size a format is built for: far above real models (≤ 256), low enough that
/// a dense d × d rotation (4 MiB) and its Gram–Schmidt stay cheap.
pub const MAX_HEAD_DIM: usize = 1 << 10;
/// Largest page size T.
pub const MAX_PAGE_TOKENS: usize = 1 << 12;

/// Which stream a format instance serves (rotation seeds differ per stream).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stream {
    Keys,
    Values,
}

/// Static facts about a format family.
#[derive(Debug)]
pub struct FormatDesc {
    /// One snake_case name everywhere: module, CLI value, kernel key, tests.
    pub name: &'static str,
    pub for_keys: bool,
    pub for_values: bool,
    /// Bit widths accepted in the spec (empty: the format has no bits parameter).
    pub bits: &'static [u32],
    pub default_bits: u32,
    /// Whether the `rot` option (Hadamard / dense rotation before quantizing) applies.
    pub rotatable: bool,
    /// Whether the norm mode (`plain` / `eden`) applies.
    pub has_norm_mode: bool,
    /// Second bit widths (e.g. RVQ's stage 2), empty if the format has none.
    pub bits2: &'static [u32],
    pub default_bits2: u32,
    /// Sketch sizes m = mult·d accepted as `:{mult}x` (e.g. QJL), empty if none.
    pub mults: &'static [u32],
    /// Whether the sketch kind (`gauss` / `orth`) applies.
    pub has_sketch: bool,
    /// Group / sub-vector sizes accepted as `:g{n}` (KIVI's G, VecInfer's sub-vector size).
    pub groups: &'static [u32],
    pub default_group: u32,
    /// Whether building needs calibration vectors ([`FormatCtx::calibration`]).
    pub needs_calibration: bool,
    /// Whether fractional widths `b + e/8` (e = 1..7) are accepted: e/8 of the channels are
    /// coded at b + 1 bits ([`FormatSpec::hi_eighths`]).
    pub fractional: bool,
    /// Whether the `center` option (subtract a calibrated mean, added back exactly) applies.
    pub centerable: bool,
    pub build: fn(&FormatSpec, &FormatCtx) -> Result<Arc<dyn Format>>,
}

impl FormatDesc {
    /// Defaults for the optional parameters: `..FormatDesc::BASE` in a descriptor.
    pub const BASE: FormatDesc = FormatDesc {
        name: "",
        for_keys: true,
        for_values: true,
        bits: &[],
        default_bits: 0,
        rotatable: false,
        has_norm_mode: false,
        bits2: &[],
        default_bits2: 0,
        mults: &[],
        has_sketch: false,
        groups: &[],
        default_group: 0,
        needs_calibration: false,
        fractional: false,
        centerable: false,
        build: |spec, _| Err(VqError::UnknownFormat(spec.name.into())),
    };
}

/// Every format, in display order.
pub static REGISTRY: &[&FormatDesc] = &[
    &fp16::DESC,
    &q8_0::DESC,
    &q4_0::DESC,
    &turboquant_mse::DESC,
    &turboquant_frac::DESC,
    &turboquant_prod::DESC,
    &turboquant_rvq::DESC,
    &qjl::DESC,
    &kivi::DESC,
    &rabitq::DESC,
    &vecinfer::DESC,
];

/// Every format variant worth measuring: each bit width with the other parameters at their
/// defaults, then each other parameter value (rotation, norm mode, sketch kind and size,
/// second-stage bits, group) varied one at a time. Tests and the CLI's tables use this list.
pub fn variants() -> Vec<FormatSpec> {
    let mut out: Vec<FormatSpec> = Vec::new();
    let mut push = |s: String| {
        let spec = FormatSpec::parse(&s).expect("registry variants parse");
        if !out.contains(&spec) {
            out.push(spec);
        }
    };
    for desc in REGISTRY {
        let base =
            if desc.bits.is_empty() { desc.name.to_string() } else { format!("{}:{}", desc.name, desc.default_bits) };
        let with_bits: Vec<String> = if desc.bits.is_empty() {
            vec![desc.name.to_string()]
        } else {
            desc.bits.iter().map(|b| format!("{}:{b}", desc.name)).collect()
        };
        // Fractional widths: the halves, plain (their options vary below, at one width).
        let halves: Vec<String> = if desc.fractional {
            desc.bits.iter().filter(|&&b| b < 4).map(|b| format!("{}:{b}.5", desc.name)).collect()
        } else {
            Vec::new()
        };
        let n_whole = with_bits.len();
        for (i, b) in with_bits.into_iter().chain(halves).enumerate() {
            push(b.clone());
            if i >= n_whole {
                continue;
            }
            if desc.rotatable {
                push(format!("{b}:rot"));
            }
            // (A fractional format's whole widths are turboquant_mse's: eden varies below.)
            if desc.has_norm_mode && !desc.fractional {
                push(format!("{b}:eden"));
            }
            if desc.has_sketch {
                push(format!("{b}:orth"));
            }
        }
        for b2 in desc.bits2 {
            push(format!("{base}:{b2}"));
        }
        for m in desc.mults {
            push(format!("{base}:{m}x"));
            push(format!("{base}:{m}x:orth"));
        }
        for g in desc.groups {
            push(format!("{base}:g{g}"));
        }
        if desc.centerable {
            push(format!("{base}:center"));
        }
        if desc.fractional {
            push(format!("{}:{}.5:eden", desc.name, desc.default_bits.min(3)));
            push(format!("{}:{}.25:center:eden", desc.name, desc.default_bits.min(3)));
        }
    }
    out
}

pub fn lookup(name: &str) -> Result<&'static FormatDesc> {
    REGISTRY.iter().copied().find(|d| d.name == name).ok_or_else(|| VqError::UnknownFormat(name.into()))
}

/// How a norm is stored: the plain ‖x‖, or EDEN-corrected ‖x‖/⟨y,ŷ⟩ which makes the inner
/// product estimate unbiased (shared/REFERENCE.md §2) at no extra storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum NormMode {
    #[default]
    Plain,
    Eden,
}

/// Random sketch matrix kind for QJL-style 1-bit projections: i.i.d. Gaussian rows, or
/// Haar-orthogonal blocks rescaled so the estimator stays unbiased (see `sketch.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum SketchKind {
    #[default]
    Gauss,
    Orth,
}

/// A user's choice of format:
/// `name[:bits[:bits2]][:{mult}x][:gauss|:orth][:g{group}][:rot][:center][:plain|:eden]`,
/// e.g. `turboquant_mse:4:eden`, `q4_0:rot`, `fp16`, `turboquant_rvq:2:2`, `qjl:2x:orth`,
/// `kivi:2`, `vecinfer:8:g4`, `turboquant_frac:3.5:center`. Options may come in any order;
/// `Display` writes the canonical order, and `parse(spec.to_string()) == spec`. Parameters a
/// format does not take are 0. A fractional width of `turboquant_mse` (`turboquant_mse:3.5`)
/// names `turboquant_frac` at that width: the whole-bit format has no channel split.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FormatSpec {
    pub name: &'static str,
    pub bits: u32,
    /// Second bit width (RVQ stage 2).
    pub bits2: u32,
    /// Sketch rows per dimension (m = mult·d).
    pub mult: u32,
    pub sketch: SketchKind,
    /// Group or sub-vector size.
    pub group: u32,
    pub rotate: bool,
    pub norm: NormMode,
    /// Eighths of the channels coded at `bits + 1` (fractional formats): the width is
    /// `bits + hi_eighths/8`, e.g. 3.5 = 3 bits with half the channels at 4.
    pub hi_eighths: u32,
    /// Subtract a calibrated per-channel mean before coding; decode adds it back exactly.
    pub center: bool,
}

/// `"3"` → (3, 0), `"3.5"` → (3, 4): a width in whole eighths of a bit.
fn parse_width(t: &str) -> Option<(u32, u32)> {
    let (int, frac) = t.split_once('.').unwrap_or((t, ""));
    let b: u32 = int.parse().ok()?;
    if frac.is_empty() {
        return (!t.ends_with('.')).then_some((b, 0));
    }
    const EIGHTHS: [&str; 8] = ["0", "125", "25", "375", "5", "625", "75", "875"];
    let frac = match frac.trim_end_matches('0') {
        "" => "0",
        f => f,
    };
    let e = EIGHTHS.iter().position(|&f| f == frac)?;
    Some((b, e as u32))
}

impl FormatSpec {
    pub fn desc(&self) -> &'static FormatDesc {
        lookup(self.name).expect("a spec is only built from a registered name")
    }

    pub fn parse(s: &str) -> Result<Self> {
        let mut parts = s.trim().split(':');
        let mut desc = lookup(parts.next().unwrap_or(""))?;
        let parts: Vec<&str> = parts.collect();
        let fractional_token = |p: &&str| parse_width(p).is_some_and(|(_, e)| e > 0);
        if desc.name == turboquant_mse::DESC.name && parts.iter().any(fractional_token) {
            desc = &turboquant_frac::DESC;
        }
        let mut spec = Self {
            name: desc.name,
            bits: desc.default_bits,
            bits2: desc.default_bits2,
            mult: if desc.mults.is_empty() { 0 } else { 1 },
            sketch: SketchKind::Gauss,
            group: desc.default_group,
            rotate: false,
            norm: NormMode::Plain,
            hi_eighths: 0,
            center: false,
        };
        let bad = |why: String| VqError::InvalidSpec { spec: s.into(), why };
        let mut n_numbers = 0;
        for p in parts {
            let num = |t: &str| t.parse::<u32>().ok();
            match p {
                "rot" if desc.rotatable => spec.rotate = true,
                "eden" if desc.has_norm_mode => spec.norm = NormMode::Eden,
                "plain" if desc.has_norm_mode => spec.norm = NormMode::Plain,
                "gauss" if desc.has_sketch => spec.sketch = SketchKind::Gauss,
                "orth" if desc.has_sketch => spec.sketch = SketchKind::Orth,
                "center" if desc.centerable => spec.center = true,
                _ if !desc.mults.is_empty() && p.strip_suffix('x').and_then(num).is_some() => {
                    spec.mult = p.strip_suffix('x').and_then(num).unwrap_or(0);
                    if !desc.mults.contains(&spec.mult) {
                        return Err(bad(format!("sketch size {p} not in {:?}", desc.mults)));
                    }
                }
                _ if !desc.groups.is_empty() && p.strip_prefix('g').and_then(num).is_some() => {
                    spec.group = p.strip_prefix('g').and_then(num).unwrap_or(0);
                    if !desc.groups.contains(&spec.group) {
                        return Err(bad(format!("group {p} not in {:?}", desc.groups)));
                    }
                }
                _ => match (num(p), n_numbers) {
                    (Some(b), 0) if !desc.bits.is_empty() => {
                        spec.bits = b;
                        n_numbers = 1;
                    }
                    (None, 0) if desc.fractional && parse_width(p).is_some() => {
                        (spec.bits, spec.hi_eighths) = parse_width(p).unwrap_or_default();
                        n_numbers = 1;
                    }
                    (Some(b), 1) if !desc.bits2.is_empty() => {
                        spec.bits2 = b;
                        n_numbers = 2;
                    }
                    _ => return Err(bad(format!("option {p:?} does not apply to {}", desc.name))),
                },
            }
        }
        for (bits, allowed) in [(spec.bits, desc.bits), (spec.bits2, desc.bits2)] {
            if !allowed.is_empty() && !allowed.contains(&bits) {
                return Err(VqError::UnsupportedBits { format: desc.name.into(), bits, supported: bits_list(allowed) });
            }
        }
        if spec.hi_eighths > 0 && !desc.bits.contains(&(spec.bits + 1)) {
            return Err(bad(format!("width {} needs {} bits for its wider channels", spec.width(), spec.bits + 1)));
        }
        Ok(spec)
    }

    /// Bits per coded value before side information: `bits + hi_eighths/8`.
    pub fn width(&self) -> f64 {
        self.bits as f64 + self.hi_eighths as f64 / 8.0
    }

    pub fn build(&self, ctx: &FormatCtx) -> Result<Arc<dyn Format>> {
        if ctx.head_dim == 0 || ctx.head_dim > MAX_HEAD_DIM {
            let why = "d must be in 1..=MAX_HEAD_DIM (1024)";
            return Err(VqError::UnsupportedHeadDim { format: self.name.into(), d: ctx.head_dim, why });
        }
        if ctx.page_tokens == 0 || ctx.page_tokens > MAX_PAGE_TOKENS {
            return Err(VqError::InvalidConfig(format!(
                "page size T = {} not in 1..={MAX_PAGE_TOKENS}",
                ctx.page_tokens
            )));
        }
        let desc = self.desc();
        let ok_stream = match ctx.stream {
            Stream::Keys => desc.for_keys,
            Stream::Values => desc.for_values,
        };
        if !ok_stream {
            return Err(VqError::InvalidSpec {
                spec: self.to_string(),
                why: format!("not usable for {:?}", ctx.stream),
            });
        }
        (desc.build)(self, ctx)
    }
}

fn bits_list(bits: &[u32]) -> &'static str {
    match bits {
        [1, 2, 3, 4] => "1, 2, 3, 4",
        [2, 3, 4] => "2, 3, 4",
        [2, 4] => "2, 4",
        [4, 8] => "4, 8",
        [1] => "1",
        [4] => "4",
        [8] => "8",
        [16] => "16",
        _ => "see the format's docs",
    }
}

impl fmt::Display for FormatSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)?;
        let desc = self.desc();
        if self.hi_eighths > 0 {
            write!(f, ":{}", self.width())?;
        } else if desc.bits.len() > 1 {
            write!(f, ":{}", self.bits)?;
        }
        if !desc.bits2.is_empty() {
            write!(f, ":{}", self.bits2)?;
        }
        if !desc.mults.is_empty() {
            write!(f, ":{}x", self.mult)?;
        }
        if self.sketch == SketchKind::Orth {
            f.write_str(":orth")?;
        }
        if !desc.groups.is_empty() {
            write!(f, ":g{}", self.group)?;
        }
        if self.rotate {
            f.write_str(":rot")?;
        }
        if self.center {
            f.write_str(":center")?;
        }
        if self.norm == NormMode::Eden {
            f.write_str(":eden")?;
        }
        Ok(())
    }
}

impl std::str::FromStr for FormatSpec {
    type Err = VqError;
    fn from_str(s: &str) -> Result<Self> {
        Self::parse(s)
    }
}

/// Where a format instance lives: head size, page size, stream, its seed, and (for
/// calibrated formats such as vecinfer) the calibration vectors of this (layer, KV head,
/// stream): `n × head_dim` f32, row-major. The cache fills `calibration` from
/// [`crate::cache::Calibration`]; a calibrated format built without it fails with
/// [`VqError::MissingCalibration`].
#[derive(Clone, Debug)]
pub struct FormatCtx {
    pub head_dim: usize,
    pub page_tokens: usize,
    pub stream: Stream,
    pub seed: u64,
    pub calibration: Option<Arc<[f32]>>,
    /// Trained state saved by [`Format::export_state`] (a cache file being loaded): a
    /// calibrated format restores it instead of training, and needs no calibration.
    pub state: Option<Arc<[f32]>>,
    /// E[q qᵀ] (d × d, row-major) of the queries that score this KV head's keys, from the
    /// calibration text; formats that weigh channels by query energy use it (keys only).
    pub query_moments: Option<Arc<[f32]>>,
}

impl FormatCtx {
    pub fn new(head_dim: usize, page_tokens: usize, stream: Stream, seed: u64) -> Self {
        Self { head_dim, page_tokens, stream, seed, calibration: None, state: None, query_moments: None }
    }
}

/// A query prepared once per decode step and reused for every page (rotated, scaled, or
/// turned into lookup tables).
#[derive(Clone, Debug, Default)]
pub struct QueryState {
    pub n_q: usize,
    /// n_q × d, in the format's domain (e.g. rotated).
    pub q: Vec<f32>,
    /// Format-defined extra per-query data (sketch projections S·q, lookup tables, a
    /// quantized query), empty by default.
    pub aux: Vec<f32>,
}

impl QueryState {
    pub fn plain(q: Vec<f32>, n_q: usize) -> Self {
        Self { n_q, q, aux: Vec::new() }
    }
}

/// One format instance for one (layer, KV head, stream).
pub trait Format: Send + Sync + fmt::Debug {
    fn spec(&self) -> &FormatSpec;
    fn head_dim(&self) -> usize;
    fn page_tokens(&self) -> usize;
    /// Fixed size of an encoded page: codes plus all per-token / per-group side information.
    fn page_bytes(&self) -> usize;
    /// Bytes of state shared by all pages of this instance (trained codebooks), 0 if none.
    fn state_bytes(&self) -> usize {
        0
    }
    /// Trained state that the seed cannot regenerate (codebooks, smoothing), for saving;
    /// building with it in [`FormatCtx::state`] gives an identical instance. Empty if none.
    fn export_state(&self) -> Vec<f32> {
        Vec::new()
    }

    /// Encode T×d finite f32 values into one page (`page.len() == page_bytes()`).
    fn encode_page(&self, x: &[f32], page: &mut [u8]) -> Result<()>;
    /// Reference decode of one page to T×d f32.
    fn decode_page(&self, page: &[u8], out: &mut [f32]);
    /// [`decode_page`](Self::decode_page)'s values bit for bit, by the format's fastest
    /// decoder (what a prefill reads its coded keys and values through); default: it.
    fn decode_page_fast(&self, page: &[u8], out: &mut [f32]) {
        self.decode_page(page, out)
    }

    /// Whether rows (tokens) are encoded independently, so a page may be filled one token at
    /// a time (`encode_row`) and the cache needs no fp16 tail beyond the recent window.
    /// Formats with page-level groups (per-channel scales over T tokens) return false.
    fn row_granular(&self) -> bool {
        false
    }

    /// Encode one token's d values into row `row` of `page` (other rows untouched). Only
    /// called when `row_granular()`; the bytes equal what `encode_page` writes for that row.
    fn encode_row(&self, x: &[f32], page: &mut [u8], row: usize) -> Result<()> {
        let _ = (x, page, row);
        Err(VqError::InvalidSpec { spec: self.spec().to_string(), why: "not row-granular".into() })
    }

    /// Zero rows `from..` of a row-granular page (and their per-token side information): an
    /// open page as a fresh one holds it. Default: nothing (page formats have no open page).
    fn clear_rows_from(&self, page: &mut [u8], from: usize) {
        let _ = (page, from);
    }

    /// Prepare n_q queries (n_q × d) for scoring; default: used as they are.
    fn prepare_query(&self, q: &[f32], n_q: usize) -> QueryState {
        QueryState::plain(q[..n_q * self.head_dim()].to_vec(), n_q)
    }

    /// The query the format's scoring semantics actually use, as a plain n_q × d vector
    /// (default: q itself). Formats that quantize the query for scoring (rabitq's 4-bit
    /// query) return the dequantized query here, so the reference path (decoded keys ·
    /// this query) is the oracle of the fused `scores`.
    fn scoring_query_ref(&self, q: &[f32], n_q: usize) -> Vec<f32> {
        q[..n_q * self.head_dim()].to_vec()
    }

    /// Floats per query head of the value accumulator (default d). A format may accumulate
    /// in a wider domain (e.g. RVQ: one per stage); `finish` brings it back to d.
    fn acc_width(&self) -> usize {
        self.head_dim()
    }

    /// out[h·T + t] = q_h · k_t for every prepared query h and key t of the page.
    fn scores(&self, qs: &QueryState, page: &[u8], out: &mut [f32]) {
        let (d, t) = (self.head_dim(), self.page_tokens());
        let mut k = vec![0f32; t * d];
        self.decode_page(page, &mut k);
        for h in 0..qs.n_q {
            let q = &qs.q[h * d..(h + 1) * d];
            for (i, row) in k.chunks_exact(d).enumerate() {
                out[h * t + i] = q.iter().zip(row).map(|(a, b)| a * b).sum();
            }
        }
    }

    /// acc[h·d ..] += Σ_t w[h·T + t] · v_t, in the format's domain.
    fn accumulate(&self, w: &[f32], n_q: usize, page: &[u8], acc: &mut [f32]) {
        let (d, t) = (self.head_dim(), self.page_tokens());
        let mut v = vec![0f32; t * d];
        self.decode_page(page, &mut v);
        for h in 0..n_q {
            let a = &mut acc[h * d..(h + 1) * d];
            for (i, row) in v.chunks_exact(d).enumerate() {
                let wt = w[h * t + i];
                a.iter_mut().zip(row).for_each(|(x, y)| *x += wt * y);
            }
        }
    }

    /// [`scores`](Self::scores) of the page's first `rows` keys only, `out[h·rows + t]`
    /// (an open page's filled rows). Default: the whole page scored, the rows copied out.
    fn scores_rows(&self, qs: &QueryState, page: &[u8], rows: usize, out: &mut [f32]) {
        let t = self.page_tokens();
        if rows == t {
            return self.scores(qs, page, out);
        }
        let mut full = vec![0f32; qs.n_q * t];
        self.scores(qs, page, &mut full);
        for h in 0..qs.n_q {
            out[h * rows..(h + 1) * rows].copy_from_slice(&full[h * t..h * t + rows]);
        }
    }

    /// [`accumulate`](Self::accumulate) with weights for the page's first `rows` keys only,
    /// `w[h·rows + t]`. Default: the weights padded with zeros to the whole page.
    fn accumulate_rows(&self, w: &[f32], n_q: usize, page: &[u8], rows: usize, acc: &mut [f32]) {
        let t = self.page_tokens();
        if rows == t {
            return self.accumulate(w, n_q, page, acc);
        }
        let mut full = vec![0f32; n_q * t];
        for h in 0..n_q {
            full[h * t..h * t + rows].copy_from_slice(&w[h * rows..(h + 1) * rows]);
        }
        self.accumulate(&full, n_q, page, acc)
    }

    /// Bring n_q accumulators (n_q × `acc_width()`) back from the format's domain (e.g. one
    /// inverse rotation); afterwards the first n_q × d floats hold the results.
    fn finish(&self, _acc: &mut [f32], _n_q: usize) {}

    /// Bits per value with all side information counted (per-page bytes; shared state is
    /// amortized by the cache, which knows the context).
    fn bits_per_value(&self) -> f64 {
        (self.page_bytes() * 8) as f64 / (self.page_tokens() * self.head_dim()) as f64
    }
}

/// Reject NaN/Inf before anything is encoded (policy: reject, never encode garbage).
pub fn check_finite(what: &'static str, x: &[f32], d: usize) -> Result<()> {
    if all_finite(x) {
        return Ok(());
    }
    match x.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(i) => Err(VqError::NonFinite { what, token: i / d.max(1), channel: i % d.max(1) }),
    }
}

/// Whether no value is NaN or ±∞ (exponent bits all ones): an OR over the whole slice, so
/// it vectorizes where a search for the first one does not.
pub fn all_finite(x: &[f32]) -> bool {
    const EXP: u32 = 0x7F80_0000;
    x.chunks(64).all(|c| c.iter().fold(0u32, |bad, v| bad | u32::from(v.to_bits() & EXP == EXP)) == 0)
}

/// `encode_page`'s argument checks: T × d finite values into a whole page.
pub(crate) fn check_page_input(f: &(impl Format + ?Sized), x: &[f32], page: &[u8]) -> Result<()> {
    let d = f.head_dim();
    check_len("encode_page input", d * f.page_tokens(), x.len())?;
    check_len("encode_page output", f.page_bytes(), page.len())?;
    check_finite("encode_page input", x, d)
}

/// `encode_row`'s argument checks: d finite values into row `row` of a whole page.
pub(crate) fn check_row_input(f: &(impl Format + ?Sized), x: &[f32], page: &[u8], row: usize) -> Result<()> {
    check_len("encode_row input", f.head_dim(), x.len())?;
    check_len("encode_row output", f.page_bytes(), page.len())?;
    if row >= f.page_tokens() {
        return Err(VqError::OutOfRange { what: "page row", index: row, len: f.page_tokens() });
    }
    check_finite("encode_row input", x, f.head_dim())
}

pub(crate) fn check_len(op: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(VqError::ShapeMismatch { op, expected, got })
    }
}
