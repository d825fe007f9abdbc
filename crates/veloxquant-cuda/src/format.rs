//! The GPU view of a row format: kernel defines plus the constants taken from the CPU's own
//! objects (`ScaledCodebook`, `Rotation`), so thresholds, centroids and signs are identical.

use half::f16;
use veloxquant::codebook::ScaledCodebook;
use veloxquant::format::rows::{log_u8_edges, RowKind, RowLayout, RowScale};
use veloxquant::format::sketch::Sketch;
use veloxquant::format::Stream;
use veloxquant::pack;
use veloxquant::rng::derive_seed;
use veloxquant::rotate::Rotation;
use veloxquant::{FormatSpec, NormMode, VqError};

use crate::error::{CudaError, Result};

/// Row kind ids shared with the kernels (`KIND`, `KK`, `VK`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelKind {
    F16 = 0,
    Q8_0 = 1,
    Q4_0 = 2,
    Codes = 3,
    /// QJL sign sketch: the decode kernels see it as 1-bit codes with the table {−1, +1}
    /// (KK = 3), the query projected by the sketch instead of rotated; encode has its own
    /// path (KIND = 4).
    Sketch = 4,
    /// turboquant_prod: per row (b−1)-bit codes of the rotated unit vector, then the sign bits
    /// of S·(residual); ‖x‖ and the residual norm γ per token (KIND = KK = 5).
    Prod = 5,
    /// rabitq: the sign bits of R·x, ‖R·x‖ and x0 = ⟨ō, y⟩ per token; decode reads 1-bit codes
    /// {−1, +1} scaled by ‖x‖/(x0·√d) (KK = 3, `KRATIO`) against the 4-bit query (KIND = 6).
    Rabitq = 6,
    /// turboquant_rvq: stage-1 codes, then stage-2 codes of R₂·(residual/‖residual‖); n₁, n₂
    /// per token. Decode reads it as turboquant_prod's two segments (KK = 5) with the second
    /// query R₂·R₁·q and the stage-2 table (KIND = 7).
    Rvq = 7,
    /// kivi: per-row codes u of min/max groups, then the groups' f16 scales s and zeros z
    /// (keys: per channel over GRP tokens; values: per token over GRP channels); x̂ = s·u + z.
    /// A whole page is encoded at once (KIND = KK = VK = 8), so the cache runs in page mode.
    Kivi = 8,
    /// turboquant_frac: per row the codes of y = R·(x − μ)/‖R·(x − μ)‖ in storage order (the
    /// n_hi wide channels at b + 1 bits, then the rest at b, one LSB-first stream of whole
    /// bytes), then per token one log-scale byte; the per-head channel map, μ and the scale
    /// base come from the CPU format's calibrated state (KIND = KK = VK = 9).
    Frac = 9,
    /// vecinfer: per row the b-bit indices (b ∈ {4, 8}) of the nearest centroid of each g-dim
    /// sub-vector of z = R·(x/λ), no per-token sides; the per-head smoothing λ and codebooks
    /// come from the CPU format's calibrated state (KIND = KK = VK = 10).
    Vq = 10,
}

impl KernelKind {
    /// The decode kernels' id (`KK`/`VK`): a sketch's signs are 1-bit codes there.
    pub fn decode_id(self) -> i64 {
        match self {
            KernelKind::Sketch | KernelKind::Rabitq => KernelKind::Codes as i64,
            KernelKind::Rvq => KernelKind::Prod as i64,
            k => k as i64,
        }
    }

    /// f16 side values per token after the rows (norms, residual norms).
    pub fn token_sides(self) -> usize {
        match self {
            KernelKind::Codes | KernelKind::Sketch => 1,
            KernelKind::Prod | KernelKind::Rabitq | KernelKind::Rvq => 2,
            // turboquant_frac's scales are bytes (cleared by `GpuFormat::clear_rows_from`).
            _ => 0,
        }
    }
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
    /// Hadamard signs (±1) and scale when the format rotates; a dense rotation's are ones and
    /// 1 (exact no-ops in the kernels' sign and scale steps), its matrix in `dense`.
    pub rotation: Option<(Vec<f32>, f32)>,
    /// turboquant_prod and turboquant_rvq: bytes of a row's first code segment (the sign bits
    /// or the stage-2 codes follow); 0 otherwise.
    pub mse_bytes: usize,
    /// Bits and f16 table (padded to 16) of the second segment: turboquant_prod's signs (1,
    /// {−1, +1}), turboquant_rvq's stage 2; 0 otherwise.
    pub bits2: u32,
    pub table2_f16: [u16; 16],
    /// turboquant_rvq: the stage-2 rotation's Hadamard signs (same scale as the first).
    pub rotation2: Option<Vec<f32>>,
    /// Head sizes that are not a power of two (96): the rotations' dense matrices R (d × d,
    /// row-major, as the CPU's `Rotation::Dense`), R₁ then turboquant_rvq's R₂; empty for a
    /// Hadamard rotation. The kernels read them after the format's own transform words
    /// (`DENSE_W` floats at the end of [`Self::transform`]).
    pub dense: Vec<f32>,
    /// QJL and turboquant_prod: the sketch S transposed (d × m, element [e][i] = S[i][e]: the kernels read one
    /// input dimension's m entries in one coalesced load) and the estimator's scale √(π/2)/m.
    pub sketch: Option<(Vec<f32>, f32)>,
    pub eden: bool,
    /// The codebook's thresholds and centroids (turboquant_rvq: stage 1's, then stage 2's).
    pub thresholds: Vec<f32>,
    pub centroids: Vec<f32>,
    /// Centroids as f16 bits, padded to 16 (decode table); kivi: the integers 0..16.
    pub table_f16: [u16; 16],
    /// kivi: the group size and whether groups run along tokens per channel (keys).
    pub group: usize,
    pub per_channel: bool,
    /// Lloyd-Max cell lookup for the thread-per-row encoder (codes only; `None` when some bin
    /// of width 1/`BIN_QS` would hold two thresholds): see [`bin_table`].
    pub bins: Option<Vec<u32>>,
    /// turboquant_frac: the calibrated per-head state (`None` for every other format).
    pub frac: Option<FracState>,
    /// vecinfer: the calibrated per-head state (`None` for every other format).
    pub vq: Option<VqState>,
}

/// vecinfer's per-head state as the kernels take it: the smoothing λ (d) and the codebooks
/// ((d/g) × 2^b × g, sub-space major), from the CPU format's `export_state`.
#[derive(Clone, Debug)]
pub struct VqState {
    /// False for [`GpuFormat::for_stream`]'s placeholder.
    pub calibrated: bool,
    pub lambda: Vec<f32>,
    pub codebooks: Vec<f32>,
}

impl VqState {
    /// `state`: λ then the codebooks (vecinfer.rs `export_state`), checked as the CPU's
    /// restore checks it (the state may come from a file).
    fn from_export(spec: &FormatSpec, d: usize, state: &[f32]) -> Result<Self> {
        let bad = |why: String| CudaError::Core(VqError::InvalidConfig(format!("{spec}: saved state {why}")));
        let want = d + d * (1usize << spec.bits);
        if state.len() != want {
            return Err(bad(format!("has {} floats, expected {want} (λ and codebooks)", state.len())));
        }
        if state.iter().any(|v| !v.is_finite()) {
            return Err(bad("is not finite".into()));
        }
        let (lambda, codebooks) = state.split_at(d);
        if lambda.iter().any(|&l| l <= 0.0) {
            return Err(bad("has smoothing factors ≤ 0".into()));
        }
        Ok(Self { calibrated: true, lambda: lambda.to_vec(), codebooks: codebooks.to_vec() })
    }

    /// A placeholder (λ = 1, zero codebooks): for layouts and kernel configurations only.
    fn layout_only(spec: &FormatSpec, d: usize) -> Self {
        Self { calibrated: false, lambda: vec![1.0; d], codebooks: vec![0.0; d << spec.bits] }
    }
}

/// turboquant_frac's per-head state as the kernels take it: the storage slot of each rotated
/// channel (wide channels ascending, then the rest), μ (zeros without `center`), the
/// log-scale base, and the wide channels' count. From the CPU format's `export_state`.
#[derive(Clone, Debug)]
pub struct FracState {
    /// False for [`GpuFormat::for_stream`]'s placeholder.
    pub calibrated: bool,
    pub n_hi: usize,
    pub slot_of: Vec<u32>,
    pub mean: Vec<f32>,
    pub base: f32,
}

impl FracState {
    /// `state`: [base, d channel flags (1 = wide), μ (d, with `center`)], as
    /// `TurboFrac::export_state` writes it; checked as the CPU's restore checks it.
    fn from_export(spec: &FormatSpec, d: usize, n_hi: usize, state: &[f32]) -> Result<Self> {
        let bad = |why: String| CudaError::Core(VqError::InvalidConfig(format!("{spec}: saved state {why}")));
        let want = 1 + d + if spec.center { d } else { 0 };
        if state.len() != want {
            return Err(bad(format!("has {} floats, expected {want}", state.len())));
        }
        let base = state[0];
        if !(base.is_finite() && base > 0.0) {
            return Err(bad(format!("scale base {base} must be finite and > 0")));
        }
        let flags = &state[1..1 + d];
        if flags.iter().any(|&f| f != 0.0 && f != 1.0) || flags.iter().filter(|&&f| f == 1.0).count() != n_hi {
            return Err(bad(format!("channel map is not {n_hi} ones among zeros")));
        }
        let mean: Vec<f32> = if spec.center { state[1 + d..].to_vec() } else { vec![0.0; d] };
        if mean.iter().any(|m| !m.is_finite()) {
            return Err(bad("mean is not finite".into()));
        }
        // Storage order: the wide channels ascending, then the others (turboquant_frac.rs order()).
        let mut slot_of = vec![0u32; d];
        let (mut wide, mut narrow) = (0u32, n_hi as u32);
        for (j, &f) in flags.iter().enumerate() {
            let next = if f == 1.0 { &mut wide } else { &mut narrow };
            slot_of[j] = *next;
            *next += 1;
        }
        // The CPU keeps μ in f16; the state holds those f16 values as f32.
        let mean = mean.iter().map(|&m| f16::from_f32(m).to_f32()).collect();
        Ok(Self { calibrated: true, n_hi, slot_of, mean, base })
    }

    /// A placeholder (the first n_hi channels wide, μ = 0, base 1): for layouts and kernel
    /// configurations only, never for coding data.
    fn layout_only(d: usize, n_hi: usize) -> Self {
        Self { calibrated: false, n_hi, slot_of: (0..d as u32).collect(), mean: vec![0.0; d], base: 1.0 }
    }
}

/// Bins per unit of y in the encoder's cell table, and the bins either side of zero.
pub const BIN_QS: u32 = 128;
pub const BIN_QK: i32 = 129;

/// The encoder's cell table over y = r/‖r‖ ∈ [−1, 1]: bin i (i = round(y·BIN_QS) + BIN_QK + 1,
/// exactly as the kernel computes it) holds 4 words [thr, base, centroid(base),
/// centroid(base + 1)] such that the CPU's code, the count of thresholds strictly below y,
/// is `base + (thr < y)` for every y in the bin (thr = +inf when the bin holds none).
/// `None` if a bin holds two thresholds.
pub fn bin_table(thresholds: &[f32], centroids: &[f32]) -> Option<Vec<u32>> {
    let nb = (2 * BIN_QK + 3) as usize;
    let qs = BIN_QS as f64;
    let mut out = Vec::with_capacity(nb * 4);
    for i in 0..nb {
        let b = i as i32 - BIN_QK - 1;
        // All y that round to b (ties either way, so both ends are included); the end bins
        // are open.
        let lo = if i == 0 { f64::NEG_INFINITY } else { (b as f64 - 0.5) / qs };
        let hi = if i == nb - 1 { f64::INFINITY } else { (b as f64 + 0.5) / qs };
        let inside: Vec<f32> = thresholds.iter().copied().filter(|&t| (t as f64) >= lo && (t as f64) <= hi).collect();
        if inside.len() > 1 {
            return None;
        }
        let base = thresholds.iter().filter(|&&t| (t as f64) < lo).count();
        let thr = inside.first().copied().unwrap_or(f32::INFINITY);
        let c_lo = centroids[base.min(centroids.len() - 1)];
        let c_hi = centroids[(base + 1).min(centroids.len() - 1)];
        out.extend_from_slice(&[thr.to_bits(), base as u32, c_lo.to_bits(), c_hi.to_bits()]);
    }
    Some(out)
}

/// The kernel's lookup, on the CPU (tests): the code of y and its centroid.
pub fn bin_lookup(table: &[u32], y: f32) -> (u32, f32) {
    let z = y * BIN_QS as f32 + 12_582_912.0f32;
    let i = (z.to_bits() as i32 - (0x4B40_0000 - BIN_QK - 1)) as usize;
    let e = &table[4 * i..4 * i + 4];
    let up = f32::from_bits(e[0]) < y;
    (e[1] + up as u32, f32::from_bits(if up { e[3] } else { e[2] }))
}

impl GpuFormat {
    /// The same format the CPU builds for `spec` at head size `d`, page `t`, rotation `seed`,
    /// as a key stream (the only stream whose layout differs is kivi's: see [`Self::for_stream`]).
    pub fn new(spec: &FormatSpec, d: usize, t: usize, seed: u64) -> Result<Self> {
        Self::for_stream(spec, d, t, seed, Stream::Keys)
    }

    /// As [`Self::new`], for the key or the value stream. A calibrated format (turboquant_frac)
    /// gets a placeholder state: right layout and kernels, not the CPU's codes
    /// ([`Self::calibrated`] is false; encoders refuse it): use [`Self::with_state`] for data.
    pub fn for_stream(spec: &FormatSpec, d: usize, t: usize, seed: u64, stream: Stream) -> Result<Self> {
        Self::with_state(spec, d, t, seed, stream, None)
    }

    /// As [`Self::for_stream`], with a calibrated format's state as the CPU format's
    /// `export_state` gives it (turboquant_frac: scale base, channel map, μ).
    pub fn with_state(
        spec: &FormatSpec,
        d: usize,
        t: usize,
        seed: u64,
        stream: Stream,
        state: Option<&[f32]>,
    ) -> Result<Self> {
        let unsupported = |why| CudaError::UnsupportedFormat { format: spec.to_string(), why };
        // turboquant_frac: (state, wide codebook, narrow codebook).
        let mut frac: Option<(FracState, ScaledCodebook, ScaledCodebook)> = None;
        let mut vq: Option<VqState> = None;
        if !matches!(d, 64 | 80 | 96 | 112 | 128 | 256) {
            return Err(unsupported("head size must be 64, 80, 96, 112, 128 or 256 on the GPU"));
        }
        // Other than powers of two: the warp-per-row encoders, the generic decode path and a
        // dense rotation (kivi at d = 96: its page encoder's strided layout and code-by-code
        // decode readers); turboquant_frac's and vecinfer's layouts are built for powers of
        // two. d = 80 and 112 (a partial last chunk of 32 elements, rows off word
        // boundaries): the formats whose kernels mask the chunk and read rows by bytes.
        if !d.is_power_of_two() && matches!(spec.name, "turboquant_frac" | "vecinfer") {
            return Err(unsupported("on the GPU this format needs a head size of 64, 128 or 256"));
        }
        if !d.is_multiple_of(32)
            && !matches!(spec.name, "fp16" | "turboquant_mse" | "qjl" | "turboquant_prod" | "rabitq" | "turboquant_rvq")
        {
            return Err(unsupported(
                "at d = 80 and 112 the GPU runs fp16, turboquant_mse, qjl, turboquant_prod, rabitq and turboquant_rvq",
            ));
        }
        let (kind, row_kind, rotate) = match spec.name {
            "fp16" => (KernelKind::F16, RowKind::F16, false),
            "q8_0" => (KernelKind::Q8_0, RowKind::Q8_0, spec.rotate),
            "q4_0" => (KernelKind::Q4_0, RowKind::Q4_0, spec.rotate),
            "turboquant_mse" => {
                let table = ScaledCodebook::new(spec.bits, d).table16();
                (KernelKind::Codes, RowKind::Codes { bits: spec.bits, table }, true)
            }
            "qjl" => {
                // m = 2d: whole words per segment, and d ≤ 128 (at 256 its decode failed the
                // parity test on an H100, 2026-12-07: not run there until that is found).
                if spec.mult > 2 || (spec.mult == 2 && !matches!(d, 64 | 96 | 128)) {
                    return Err(unsupported("qjl on the GPU needs m = d, or m = 2d at head size 64, 96 or 128"));
                }
                // The sign rows have the 1-bit codes' layout: ⌈m/32⌉ words, then ‖k‖ in f16;
                // m = 2d as two segments of d signs (below).
                let mut table = [0f32; 16];
                table[..2].copy_from_slice(&[-1.0, 1.0]);
                (KernelKind::Sketch, RowKind::Codes { bits: 1, table }, false)
            }
            "turboquant_prod" => {
                // The code segment's layout; the sign bits and the second side are added below.
                let table = ScaledCodebook::new(spec.bits - 1, d).table16();
                (KernelKind::Prod, RowKind::Codes { bits: spec.bits - 1, table }, true)
            }
            "turboquant_rvq" => {
                // Stage 1's layout; stage 2's codes and the second side are added below.
                let table = ScaledCodebook::new(spec.bits, d).table16();
                (KernelKind::Rvq, RowKind::Codes { bits: spec.bits, table }, true)
            }
            "rabitq" => {
                let mut table = [0f32; 16];
                table[..2].copy_from_slice(&[-1.0, 1.0]);
                (KernelKind::Rabitq, RowKind::Codes { bits: 1, table }, true)
            }
            "kivi" => {
                let g = spec.group as usize;
                // The CPU's constraints (kivi.rs), groups within one warp's 32 lanes, and value
                // groups no narrower than a decode thread's d/8 dims (one scale per row there).
                let fits = match stream {
                    Stream::Keys => t.is_multiple_of(g),
                    Stream::Values => d.is_multiple_of(g) && g >= d / 8,
                };
                if !fits || g > 32 {
                    return Err(unsupported(
                        "kivi on the GPU needs G ≤ 32 dividing T (keys), or d with G ≥ d/8 (values)",
                    ));
                }
                let mut table = [0f32; 16];
                table.iter_mut().enumerate().for_each(|(i, c)| *c = i as f32);
                (KernelKind::Kivi, RowKind::Codes { bits: spec.bits, table }, false)
            }
            "turboquant_frac" => {
                // The CPU's layout (turboquant_frac.rs build): n_hi = d·e/8 wide channels at
                // b + 1 bits; whole widths (e = 0) are plain b-bit codes.
                let (b, e) = (spec.bits, spec.hi_eighths as usize);
                let n_hi = d * e / 8;
                if e > 0 && (!(d * e).is_multiple_of(8) || !n_hi.is_multiple_of(8) || !(d - n_hi).is_multiple_of(8)) {
                    return Err(unsupported("a fractional width needs both channel sets to be multiples of 8"));
                }
                let (hi, lo) = (ScaledCodebook::new(if e > 0 { b + 1 } else { b }, d), ScaledCodebook::new(b, d));
                let row_kind = if e > 0 {
                    RowKind::Split { hi_bits: b + 1, n_hi, hi_table: hi.table16(), lo_table: lo.table16() }
                } else {
                    RowKind::Codes { bits: b, table: lo.table16() }
                };
                let fs = match state {
                    Some(st) => FracState::from_export(spec, d, n_hi, st)?,
                    None => FracState::layout_only(d, n_hi),
                };
                frac = Some((fs, hi, lo));
                (KernelKind::Frac, row_kind, true)
            }
            "vecinfer" => {
                // Sub-vectors of g ≤ d/8 dims: whole ones in each decode thread's dims.
                let g = spec.group as usize;
                if !d.is_multiple_of(g) || g > d / 8 {
                    return Err(unsupported("vecinfer on the GPU needs g dividing d, g ≤ d/8"));
                }
                vq = Some(match state {
                    Some(st) => VqState::from_export(spec, d, st)?,
                    None => VqState::layout_only(spec, d),
                });
                (KernelKind::Vq, RowKind::Codes { bits: spec.bits, table: [0.0; 16] }, true)
            }
            _ => return Err(unsupported("no CUDA kernel for this format yet")),
        };
        let mut layout = RowLayout::new(row_kind, d, t);
        if let Some((fs, ..)) = &frac {
            layout = layout.with_scale(RowScale::LogU8 { base: fs.base });
        }
        // Second segments (sketch.rs TokenLayout: rows of both segments, two f16 sides):
        // turboquant_prod's d sign bits, turboquant_rvq's stage-2 codes.
        // turboquant_frac: the narrow channels are the second segment.
        // qjl:2x: the second d sign bits (of S's rows d..2d).
        let sketch2 = kind == KernelKind::Sketch && spec.mult == 2;
        let bits2 = match kind {
            KernelKind::Prod => 1,
            KernelKind::Sketch if sketch2 => 1,
            KernelKind::Rvq => spec.bits2,
            KernelKind::Frac => spec.bits,
            _ => 0,
        };
        let (mse_bytes, row_bytes, page_bytes) = match kind {
            KernelKind::Prod | KernelKind::Rvq => {
                let rb = layout.row_bytes + pack::packed_bytes(d, bits2);
                (layout.row_bytes, rb, (t * rb + 4 * t).div_ceil(4) * 4)
            }
            // qjl:2x: both halves' signs, then ‖k‖ (d % 32 = 0: whole words).
            KernelKind::Sketch if sketch2 => {
                let rb = 2 * layout.row_bytes;
                (layout.row_bytes, rb, (t * rb + 2 * t).div_ceil(4) * 4)
            }
            // rabitq: the 1-bit rows, then ‖R·x‖ and x0.
            KernelKind::Rabitq => (0, layout.row_bytes, (t * layout.row_bytes + 4 * t).div_ceil(4) * 4),
            // kivi: the code rows, then T·d/G scales and as many zeros (f16).
            KernelKind::Kivi => {
                (0, layout.row_bytes, (t * layout.row_bytes + 4 * t * d / spec.group as usize).div_ceil(4) * 4)
            }
            KernelKind::Frac => (layout.kind.lo_offset(), layout.row_bytes, layout.page_bytes()),
            // vecinfer: d/g codes per row (vecinfer.rs), nothing per token.
            KernelKind::Vq => {
                let rb = pack::packed_bytes(d / spec.group as usize, spec.bits);
                (0, rb, t * rb)
            }
            _ => (0, layout.row_bytes, layout.page_bytes()),
        };
        // The CPU's rotation for `seed`: Hadamard signs and scale, or unit signs, scale 1 and
        // the dense matrix (appended to `dense`).
        let mut dense = Vec::new();
        let mut rotation_of = |seed| -> Result<(Vec<f32>, f32)> {
            Ok(match Rotation::new(d, seed)? {
                Rotation::Hadamard { signs, scale } => (signs, scale),
                Rotation::Dense { m, .. } => {
                    dense.extend_from_slice(&m);
                    (vec![1.0; d], 1.0)
                }
            })
        };
        let rotation = if rotate { Some(rotation_of(seed)?) } else { None };
        // turboquant_rvq's stage-2 rotation (the CPU's derived seed); its scale is 1/√d as the
        // first's (1 for both when dense).
        let rotation2 = if kind == KernelKind::Rvq { Some(rotation_of(derive_seed(seed, &[0x52]))?.0) } else { None };
        let sketch = if matches!(kind, KernelKind::Sketch | KernelKind::Prod) {
            // The CPU's builds: qjl's Sketch::new(kind, m, d, seed) with m = mult·d; prod's
            // m = d sketch of the residual under a derived seed. Sᵀ of each d rows of S in
            // turn (qjl:2x: the second segment's block after the first's).
            let sseed = if kind == KernelKind::Prod { derive_seed(seed, &[0x51]) } else { seed };
            let m = if sketch2 { 2 * d } else { d };
            let sk = Sketch::new(spec.sketch, m, d, sseed);
            let mut st = vec![0f32; m * d];
            for (i, row) in sk.rows.chunks_exact(d).enumerate() {
                for (e, &v) in row.iter().enumerate() {
                    st[(i / d) * d * d + e * d + i % d] = v;
                }
            }
            Some((st, sk.scale()))
        } else {
            None
        };
        // Code bits per value as the kernels see them (qjl's signs: 1; no codes: 0).
        let bits = match &layout.kind {
            RowKind::Codes { bits, .. } => *bits,
            RowKind::Split { hi_bits, .. } => *hi_bits,
            _ => 0,
        };
        let (thresholds, centroids) = match kind {
            KernelKind::Codes | KernelKind::Prod => {
                let cb = ScaledCodebook::new(bits, d);
                (cb.thresholds, cb.centroids)
            }
            KernelKind::Rvq => {
                let (c1, c2) = (ScaledCodebook::new(bits, d), ScaledCodebook::new(bits2, d));
                ([c1.thresholds, c2.thresholds].concat(), [c1.centroids, c2.centroids].concat())
            }
            KernelKind::Sketch | KernelKind::Rabitq => (vec![0.0], vec![-1.0, 1.0]),
            // Both codebooks, then the log scale's edges after the thresholds.
            KernelKind::Frac => frac.as_ref().map_or((vec![0.0], vec![0.0]), |(_, hi, lo)| {
                let thr = [&hi.thresholds[..], &lo.thresholds[..], &log_u8_edges()[..]].concat();
                (thr, [&hi.centroids[..], &lo.centroids[..]].concat())
            }),
            _ => (vec![0.0], vec![0.0]),
        };
        let f16_table = |c: &[f32]| {
            let mut t = [0u16; 16];
            for (o, c) in t.iter_mut().zip(c) {
                *o = f16::from_f32(*c).to_bits();
            }
            t
        };
        let n_first = if matches!(kind, KernelKind::Rvq | KernelKind::Frac) { 1 << bits } else { centroids.len() };
        let table_f16 = f16_table(&centroids[..n_first]);
        let table2_f16 = match kind {
            KernelKind::Prod => f16_table(&[-1.0, 1.0]),
            KernelKind::Sketch if sketch2 => f16_table(&[-1.0, 1.0]),
            KernelKind::Rvq | KernelKind::Frac => f16_table(&centroids[1 << bits..]),
            _ => [0; 16],
        };
        let bins = match kind {
            KernelKind::Codes => bin_table(&thresholds, &centroids),
            // turboquant_frac: the wide codebook's table, then the narrow one's.
            KernelKind::Frac => frac.as_ref().and_then(|(_, hi, lo)| {
                Some([bin_table(&hi.thresholds, &hi.centroids)?, bin_table(&lo.thresholds, &lo.centroids)?].concat())
            }),
            _ => None,
        };
        let table_f16 = match &layout.kind {
            RowKind::Codes { table, .. } if kind == KernelKind::Kivi => f16_table(table),
            _ => table_f16,
        };
        let (group, per_channel) = match kind {
            KernelKind::Kivi => (spec.group as usize, stream == Stream::Keys),
            KernelKind::Vq => (spec.group as usize, false),
            _ => (0, false),
        };
        Ok(Self {
            spec: spec.clone(),
            kind,
            bits,
            d,
            t,
            row_bytes,
            page_bytes,
            rotation,
            mse_bytes,
            bits2,
            table2_f16,
            rotation2,
            dense,
            sketch,
            eden: spec.norm == NormMode::Eden && matches!(kind, KernelKind::Codes | KernelKind::Frac),
            thresholds,
            centroids,
            table_f16,
            bins,
            group,
            per_channel,
            frac: frac.map(|(fs, ..)| fs),
            vq,
        })
    }

    /// Whether the format's kernel file has a thread-per-row page codec (`PAGE_CODEC`, run by
    /// `encode_pages_tpr` for pages of 32 tokens, d ≤ 128); turboquant_mse's needs the cell
    /// table ([`bin_table`]).
    pub fn page_codec(&self) -> bool {
        match self.kind {
            KernelKind::F16 | KernelKind::Sketch | KernelKind::Prod | KernelKind::Kivi | KernelKind::Vq => false,
            KernelKind::Q8_0 | KernelKind::Q4_0 | KernelKind::Rabitq | KernelKind::Rvq => true,
            KernelKind::Codes => self.bins.is_some(),
            // Rows of whole words (the page kernel stores a row as words).
            KernelKind::Frac => {
                self.bins.is_some() && self.row_bytes.is_multiple_of(4) && self.page_bytes.is_multiple_of(4)
            }
        }
    }

    /// Rows of a page one warp of `encode_rows` encodes (`RPW`): 8 for the sketches (4 at
    /// d = 256; their staged rows fill 32 KB of shared memory per block), 1024/d for vecinfer,
    /// where it divides the page, else 1.
    pub fn encode_rows_per_warp(&self) -> usize {
        let rows = match self.kind {
            // d = 80, 112: a row per warp (sketch_signs_rows reads whole chunks of 32).
            KernelKind::Sketch | KernelKind::Prod if !self.d.is_multiple_of(32) => 1,
            KernelKind::Sketch | KernelKind::Prod if self.d > 128 => 4,
            KernelKind::Sketch | KernelKind::Prod => 8,
            // vecinfer: 1024/d rows, 32·d/1024 lanes each (formats/vecinfer.cuh encode_rows_own).
            KernelKind::Vq => 1024 / self.d,
            _ => 1,
        };
        if self.t.is_multiple_of(rows) {
            rows
        } else {
            1
        }
    }

    /// Whether the cache may encode this format a row at a time (kivi needs whole pages).
    pub fn row_granular(&self) -> bool {
        self.kind != KernelKind::Kivi
    }

    /// Zero rows `from..` of a page (and their per-token scales): an open page as the CPU
    /// holds it.
    pub fn clear_rows_from(&self, page: &mut [u8], from: usize) {
        if from >= self.t {
            return;
        }
        page[from * self.row_bytes..self.t * self.row_bytes].fill(0);
        let at = self.t * self.row_bytes;
        if self.kind == KernelKind::Frac {
            page[at + from..at + self.t].fill(0); // one scale byte per token
        }
        for k in 0..self.kind.token_sides() {
            page[at + 2 * (k * self.t + from)..at + 2 * (k + 1) * self.t].fill(0);
        }
    }

    /// Per-instance state as the CPU counts it (`Format::state_bytes`): rotation signs,
    /// the sketch and the codebook.
    pub fn state_bytes(&self) -> usize {
        let (rot, rot2) = if self.dense.is_empty() {
            (self.rotation.as_ref().map_or(0, |(s, _)| s.len() * 4), self.rotation2.as_ref().map_or(0, |s| s.len() * 4))
        } else {
            (self.dense.len() * 4, 0)
        };
        let sk = self.sketch.as_ref().map_or(0, |(s, _)| s.len() * 4);
        let cb = if matches!(self.kind, KernelKind::Codes | KernelKind::Prod | KernelKind::Rvq | KernelKind::Frac) {
            (self.centroids.len() + self.thresholds.len()) * 4
        } else {
            0
        };
        // turboquant_frac: the slots, μ and the base beside the signs; vecinfer: λ and the
        // codebooks (transform_words).
        let fr = if self.frac.is_some() || self.vq.is_some() { (self.own_transform_words() - self.d) * 4 } else { 0 };
        rot + rot2 + sk + cb + fr
    }

    pub fn bits_per_value(&self) -> f64 {
        (self.page_bytes * 8) as f64 / (self.t * self.d) as f64
    }

    /// The per-head transform the kernels take (`signs` arguments, [`Self::transform_words`]
    /// floats): the rotation's signs (all ones when the format does not rotate) and scale, or
    /// the sketch Sᵀ and the estimator's scale.
    /// turboquant_prod: the signs, then Sᵀ, with the rotation's scale (the sketch's is a
    /// constant of d the kernels compute). turboquant_rvq: both rotations' signs.
    /// turboquant_frac: the signs, μ, each rotated channel's storage slot (as f32), then the
    /// scale base and three zeros (16-byte rows). vecinfer: the signs, λ, the codebooks.
    /// Then, for a dense rotation, its matrices ([`Self::dense`]).
    pub fn transform(&self) -> (Vec<f32>, f32) {
        let (mut words, scale) = self.own_transform();
        words.extend_from_slice(&self.dense);
        (words, scale)
    }

    /// [`Self::transform`] without the dense matrices.
    fn own_transform(&self) -> (Vec<f32>, f32) {
        if let (Some((r, sc)), Some(vq)) = (&self.rotation, &self.vq) {
            return ([&r[..], &vq.lambda[..], &vq.codebooks[..]].concat(), *sc);
        }
        if let (Some((r, sc)), Some(fs)) = (&self.rotation, &self.frac) {
            let slots = fs.slot_of.iter().map(|&s| s as f32);
            let tail = [fs.base, 0.0, 0.0, 0.0];
            return (r.iter().chain(&fs.mean).copied().chain(slots).chain(tail).collect(), *sc);
        }
        if let (Some((r, sc)), Some(r2)) = (&self.rotation, &self.rotation2) {
            return ([&r[..], &r2[..]].concat(), *sc);
        }
        match (&self.rotation, &self.sketch) {
            (Some((r, sc)), Some((s, _))) => ([&r[..], &s[..]].concat(), *sc),
            (None, Some((s, sc))) | (Some((s, sc)), None) => (s.clone(), *sc),
            (None, None) => (vec![1.0; self.d], 1.0),
        }
    }

    /// Floats per head of [`Self::transform`]: d, d·d for qjl's sketch (2d·d at m = 2d), d + d·d for
    /// turboquant_prod, 2d for turboquant_rvq, 3d + 4 for turboquant_frac, (2 + 2^b)·d for
    /// vecinfer (kernels: `TW`); plus the dense matrices' d² (turboquant_rvq: 2d²) floats.
    pub fn transform_words(&self) -> usize {
        self.own_transform_words() + self.dense.len()
    }

    /// [`Self::transform_words`] without the dense matrices.
    fn own_transform_words(&self) -> usize {
        if self.rotation2.is_some() {
            return 2 * self.d;
        }
        if self.frac.is_some() {
            return 3 * self.d + 4;
        }
        if self.vq.is_some() {
            return (2 + (1 << self.bits)) * self.d;
        }
        match (&self.rotation, &self.sketch) {
            (Some(_), Some(_)) => self.d + self.d * self.d,
            (None, Some(_)) => self.sketch_halves() * self.d * self.d,
            _ => self.d,
        }
    }

    /// Whether this instance holds the data a calibrated format codes with (formats without
    /// calibration always do; [`Self::for_stream`] gives calibrated formats a placeholder).
    pub fn calibrated(&self) -> bool {
        self.frac.as_ref().is_none_or(|f| f.calibrated) && self.vq.as_ref().is_none_or(|v| v.calibrated)
    }

    /// Whether decode needs the second prepared query (turboquant_prod, turboquant_rvq,
    /// qjl:2x).
    pub fn two_queries(&self) -> bool {
        self.decode_kind() == KernelKind::Prod as i64
    }

    /// The decode kernels' id (`KK`/`VK`): the kind's, except that qjl:2x reads as two
    /// segments of signs (KK = 5, the second weighted by 1: `K2ONE`).
    pub fn decode_kind(&self) -> i64 {
        if self.sketch_halves() == 2 {
            KernelKind::Prod as i64
        } else {
            self.kind.decode_id()
        }
    }

    /// qjl's sketch blocks of d rows: 2 for m = 2d (qjl:2x), else 1.
    pub fn sketch_halves(&self) -> usize {
        if self.kind == KernelKind::Sketch && self.bits2 == 1 {
            2
        } else {
            1
        }
    }

    /// Whether the query is prepared by the rotation alone (what decode's fused preparation
    /// does); sketches, two-query formats and rabitq's quantized query take prep_query.
    pub fn plain_query_prep(&self) -> bool {
        matches!(
            self.kind,
            KernelKind::F16 | KernelKind::Q8_0 | KernelKind::Q4_0 | KernelKind::Codes | KernelKind::Kivi
        )
    }

    /// Floats per query head of the value accumulator (decode's partials): turboquant_rvq
    /// accumulates in both stages' domains (turboquant_rvq.rs `acc_width`), the others in one.
    pub fn value_acc_width(&self) -> usize {
        if self.kind == KernelKind::Rvq {
            2 * self.d
        } else {
            self.d
        }
    }
}
