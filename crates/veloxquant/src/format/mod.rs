//! The central abstraction: a *format* encodes one stream (keys or values) of one KV head,
//! a page of `T` tokens at a time, and runs the attention verbs directly on its bytes.
//!
//! Adding a format = one module here + one line in [`REGISTRY`]. Every format provides the
//! readable reference verbs (`encode_page`, `decode_page`); the fused verbs (`scores`,
//! `accumulate`, `finish`) default to decode-then-compute and are overridden where a fast
//! path exists. `tests/conformance.rs` runs every registered format through the same checks.

pub mod fp16;
pub mod kivi;
pub mod q4_0;
pub mod q8_0;
pub mod qjl;
pub mod rabitq;
pub mod rows;
pub mod sketch;
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
        build: |spec, _| Err(VqError::UnknownFormat(spec.name.into())),
    };
}

/// Every format, in display order.
pub static REGISTRY: &[&FormatDesc] = &[
    &fp16::DESC,
    &q8_0::DESC,
    &q4_0::DESC,
    &turboquant_mse::DESC,
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
        for b in with_bits {
            push(b.clone());
            if desc.rotatable {
                push(format!("{b}:rot"));
            }
            if desc.has_norm_mode {
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
/// `name[:bits[:bits2]][:{mult}x][:gauss|:orth][:g{group}][:rot][:plain|:eden]`, e.g.
/// `turboquant_mse:4:eden`, `q4_0:rot`, `fp16`, `turboquant_rvq:2:2`, `qjl:2x:orth`,
/// `kivi:2`, `vecinfer:8:g4`. Options may come in any order; `Display` writes the canonical
/// order, and `parse(spec.to_string()) == spec`. Parameters a format does not take are 0.
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
}

impl FormatSpec {
    pub fn desc(&self) -> &'static FormatDesc {
        lookup(self.name).expect("a spec is only built from a registered name")
    }

    pub fn parse(s: &str) -> Result<Self> {
        let mut parts = s.trim().split(':');
        let desc = lookup(parts.next().unwrap_or(""))?;
        let mut spec = Self {
            name: desc.name,
            bits: desc.default_bits,
            bits2: desc.default_bits2,
            mult: if desc.mults.is_empty() { 0 } else { 1 },
            sketch: SketchKind::Gauss,
            group: desc.default_group,
            rotate: false,
            norm: NormMode::Plain,
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
        Ok(spec)
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
        if desc.bits.len() > 1 {
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
}

impl FormatCtx {
    pub fn new(head_dim: usize, page_tokens: usize, stream: Stream, seed: u64) -> Self {
        Self { head_dim, page_tokens, stream, seed, calibration: None, state: None }
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
    match x.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(i) => Err(VqError::NonFinite { what, token: i / d.max(1), channel: i % d.max(1) }),
    }
}

pub(crate) fn check_len(op: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(VqError::ShapeMismatch { op, expected, got })
    }
}
