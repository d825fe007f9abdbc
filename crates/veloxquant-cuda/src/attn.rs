//! Decode attention on the GPU: a plan (split sizes, buffers, compiled kernels) made once
//! per batch shape, then `run` (or `run_on` a stream, e.g. one being captured into a CUDA
//! graph) per step: prep_query → decode_pages → combine (prep_query fused into decode_pages
//! on the 2/4-bit codes path; combine launched as a programmatic dependent of decode_pages).

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{
    sys, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig,
    PushKernelArg,
};

use crate::cache::GpuKvCache;
use crate::device::{Family, GpuDevice};
use crate::error::{drv, CudaError, Result};
use crate::format::{GpuFormat, KernelKind};
use crate::tuning::Tuning;

/// Warps per decode block (each owns pages of the block's split in turn).
pub const NWARPS: usize = 4;
/// Warps per block of the pipelined 2/4-bit path: one block of 12 per SM shares one lookup
/// table (measured on the H200: 4 and 8 warps per block were slower).
pub const PIPE_WARPS: usize = 12;
/// Sequences per step the stream grid takes (decode.cu SKMAXB: its prefix sums in shared
/// memory); larger batches run split-K.
const SKMAXB: usize = 512;

/// Splits per (sequence, KV head) row: the fewest that fill the last wave of `target`
/// resident blocks to ≥ 90 % (a split-K grid of rows·s blocks runs in ⌈rows·s / target⌉
/// waves), at most `max_splits`; the best fill when none reaches it. Measured on the H200
/// (SmolLM2 shape, B = 64, S = 8k: 192 rows on 132 one-block SMs ran 1.45 waves at one split).
fn splits_for_waves(rows: usize, target: usize, max_splits: usize) -> usize {
    let fill = |s: usize| (rows * s) as f64 / ((rows * s).div_ceil(target) * target) as f64;
    let max_splits = max_splits.clamp(1, 64);
    (1..=max_splits)
        .find(|&s| fill(s) >= 0.9)
        .unwrap_or_else(|| (1..=max_splits).max_by(|&a, &b| fill(a).total_cmp(&fill(b)).then(b.cmp(&a))).unwrap_or(1))
}

/// Whether the decode kernel's FAST path (2–4-bit codes dequantized in registers) applies;
/// must agree with decode.cu's `FAST`.
fn fast_path(kf: &GpuFormat, vf: &GpuFormat) -> bool {
    matches!(kf.d, 64 | 128)
        && matches!(kf.decode_kind(), 3 | 5)
        && vf.kind == KernelKind::Codes
        && (matches!(kf.bits, 2..=4) || (kf.bits == 1 && symmetric_1bit(kf)))
        && (!kf.two_queries() || second_like_first(kf) || (kf.bits2 == 1 && symmetric_1bit_table(&kf.table2_f16)))
        && matches!(vf.bits, 2..=4)
        && (kf.bits != 4 || vf.bits != 4 || kf.table_f16 == vf.table_f16)
}

/// vecinfer's codebooks staged in the generic path's dynamic shared memory (decode.cu
/// `VQSM`: f16, 2^b·d halves per vecinfer stream), or 0 where they would pass 128 KiB (d = 256,
/// 8-bit keys and values: read from the transforms instead).
fn vq_shared_bytes(kf: &GpuFormat, vf: &GpuFormat) -> usize {
    let bytes: usize = [kf, vf].iter().filter(|f| f.kind == KernelKind::Vq).map(|f| (2usize << f.bits) * f.d).sum();
    if bytes <= 128 << 10 {
        bytes
    } else {
        0
    }
}

/// A 1-bit table {c, −c} (f16 bits differ in the sign only): the FAST path's sign-flip
/// dequantization (decode.cu `K1SYM`) applies.
fn symmetric_1bit(f: &GpuFormat) -> bool {
    f.bits == 1 && symmetric_1bit_table(&f.table_f16)
}

fn symmetric_1bit_table(t: &[u16; 16]) -> bool {
    t[1] == t[0] ^ 0x8000
}

/// A two-segment key (turboquant_rvq b₁ = b₂) whose second segment is dequantized as the
/// first (same bits and table: decode.cu `K2SAME`).
fn second_like_first(f: &GpuFormat) -> bool {
    f.two_queries() && f.bits2 == f.bits && f.table2_f16 == f.table_f16
}

/// The FAST path (2/4-bit codes dequantized in registers): pages streamed through a per-warp
/// ring of `stages` slots in dynamic shared memory by bulk copies, codes looked up by byte in
/// a 64-KiB lane-replicated table (decode.cu, FAST). Tuning overrides (benchmarks only;
/// defaults measured best): `VELOXQUANT_DECODE_STAGES`, `_WARPS`, `_MINB` (blocks/SM the
/// registers are held to), `_FUSEQ` (0 = separate prep_query launch).
#[derive(Clone, Copy, Debug)]
struct Pipe {
    fast: bool,
    stages: usize,
    warps: usize,
    minb: i64,
    /// prep_query fused into the decode kernel (one launch fewer).
    fuse_q: bool,
    /// The persistent stream grid (decode.cu STREAMK) instead of split-K blocks.
    stream: bool,
    /// Split-K blocks dealt by the step's pages (decode.cu BALANCE; batches ≤ SKMAXB): the
    /// split-K grid's, never the stream grid's.
    balance: bool,
    /// vecinfer's codebooks staged in shared memory (decode.cu VQSM; generic path).
    vq_stage: bool,
}

/// Whether the device runs the Hopper-only parts: the FAST path's bulk copies and mbarrier
/// transactions, and PDL's griddepcontrol (sm_90 and newer). Older GPUs (sm_80–89) take the
/// generic path and plain stream order.
pub fn hopper(cc: (i32, i32)) -> bool {
    cc.0 >= 9
}

impl Pipe {
    /// `split_k`: no stream grid even where the tuning asks for it.
    fn new(kf: &GpuFormat, vf: &GpuFormat, cc: (i32, i32), generic: bool, split_k: bool, t: &Tuning) -> Self {
        let fast = fast_path(kf, vf) && hopper(cc) && !generic;
        let stream = fast && t.decode_stream && !split_k;
        let vq_stage = !fast && vq_shared_bytes(kf, vf) > 0;
        Self {
            fast,
            stages: t.decode_stages,
            // Staged vecinfer codebooks hold a block per SM: 8 warps to hide latency (the
            // static merge buffer, 32 KiB at d = 128, allows no more).
            warps: if fast {
                t.decode_warps
            } else if vq_stage && kf.d <= 128 {
                8
            } else {
                NWARPS
            },
            minb: t.decode_minb,
            // The fused prep rotates by Hadamard; a sketch's projection, a second query and
            // rabitq's quantized query stay in prep_query (then launched as decode_pages'
            // programmatic primary).
            fuse_q: fast && t.decode_fuse_q && kf.plain_query_prep(),
            stream,
            balance: t.decode_balance,
            vq_stage,
        }
    }
    /// Whether the kernel deals its split-K blocks by the step's pages (BALANCE).
    fn splits_balanced(&self) -> bool {
        self.balance && !self.stream
    }

    /// One warp's ring of page slots (bytes).
    fn ring(&self, kf: &GpuFormat, vf: &GpuFormat) -> usize {
        self.stages * (kf.page_bytes.div_ceil(128) * 128 + vf.page_bytes.div_ceil(128) * 128)
    }

    /// Dynamic shared memory of one block, given the kernel's static shared memory and the
    /// space needed after the loop (the warps' accumulators).
    /// FAST: the table at the first 64-KiB boundary of the shared window past the static part,
    /// as many rings below it as fit (1 KiB reserved + alignment assumed before the dynamic
    /// part), the others above; `post` must fit in the table's 64 KiB. Else vecinfer's staged
    /// codebooks, or none.
    fn smem(&self, kf: &GpuFormat, vf: &GpuFormat, static_bytes: usize, post: usize) -> Option<usize> {
        if !self.fast {
            return Some(if self.vq_stage { vq_shared_bytes(kf, vf) } else { 0 });
        }
        let ring = self.ring(kf, vf);
        let pad_max = (65536 - static_bytes % 65536) % 65536;
        let below_min = pad_max.saturating_sub(1024 + 128).checked_div(ring).map_or(self.warps, |n| n.min(self.warps));
        (post <= 65536).then_some(pad_max + 65536 + (self.warps - below_min) * ring)
    }
}

/// Softmax variants (`Tuning`; defaults are the measured best on the H200,
/// benchmarks/results/cuda-decode.md).
#[derive(Clone, Copy, Debug)]
struct Variants {
    expftz: bool,
    /// Headroom of the running max (log2 units, 0 = off).
    slack: i64,
    /// FAST 2-bit codes by byte lookups (Tuning::decode_lut2, decode_lut1v).
    lut2: bool,
    lut1v: bool,
}

impl Variants {
    fn new(t: &Tuning) -> Self {
        Self { expftz: t.decode_expftz, slack: t.decode_slack, lut2: t.decode_lut2, lut1v: t.decode_lut1v }
    }
}

/// The decode module's defines for K/V formats `kf`/`vf` and GQA group `g` (`Pipe`,
/// `Variants` and PDL as the plan picks them).
fn decode_defines(
    kf: &GpuFormat,
    vf: &GpuFormat,
    g: usize,
    pipe: &Pipe,
    var: &Variants,
    pdl: bool,
) -> Vec<(String, i64)> {
    let d = kf.d;
    let mut defs: Vec<(String, i64)> =
        vec![("D".into(), d as i64), ("T".into(), 32), ("G".into(), g as i64), ("NWARPS".into(), pipe.warps as i64)];
    defs.extend(kind_defines('K', kf));
    defs.extend(kind_defines('V', vf));
    defs.push(("KVSAME".into(), (kf.table_f16 == vf.table_f16) as i64));
    defs.push(("K1SYM".into(), symmetric_1bit(kf) as i64));
    if kf.two_queries() {
        defs.push(("K_MSE_BYTES".into(), kf.mse_bytes as i64));
        defs.push(("K2B".into(), kf.bits2 as i64));
        defs.push(("K2SAME".into(), second_like_first(kf) as i64));
        if kf.kind == KernelKind::Sketch {
            defs.push(("K2ONE".into(), 1)); // qjl:2x: no second side, both halves weighted alike
        }
    }
    // turboquant_rvq values: stage 2's codes after V_MSE_BYTES, V2B bits each.
    if vf.kind == KernelKind::Rvq {
        defs.push(("V_MSE_BYTES".into(), vf.mse_bytes as i64));
        defs.push(("V2B".into(), vf.bits2 as i64));
    }
    defs.push(("KRATIO".into(), (kf.kind == KernelKind::Rabitq) as i64));
    // turboquant_frac: the wide channels' count and the narrow ones' bits (KB/VB: the wide).
    for (p, f) in [('K', kf), ('V', vf)] {
        if let Some(fs) = &f.frac {
            defs.push((format!("{p}NHI"), fs.n_hi as i64));
            defs.push((format!("{p}LB"), f.bits2 as i64));
        }
    }
    if pipe.vq_stage {
        defs.push(("VQSM".into(), 1));
    }
    defs.push(("KG".into(), kf.group.max(1) as i64));
    defs.push(("VG".into(), vf.group.max(1) as i64));
    if !pipe.fast && fast_path(kf, vf) {
        defs.push(("NOFAST".into(), 1)); // a pre-Hopper device: the generic path
    }
    defs.push(("KROT".into(), kf.rotation.is_some() as i64));
    defs.push(("KDENSE_W".into(), kf.dense.len() as i64));
    defs.push(("VDENSE_W".into(), vf.dense.len() as i64));
    defs.push(("EXPFTZ".into(), var.expftz as i64));
    defs.push(("SLACK".into(), var.slack));
    if pipe.fuse_q {
        defs.push(("FUSEQ".into(), 1));
    }
    if pdl {
        defs.push(("PDL".into(), 1));
    }
    if pipe.stream {
        defs.push(("STREAMK".into(), 1));
    }
    if pipe.splits_balanced() {
        defs.push(("BALANCE".into(), 1));
    }
    if pipe.fast {
        if !var.lut2 {
            defs.push(("NOLUT2".into(), 1));
        }
        if var.lut1v && kf.bits == 1 && vf.bits == 2 {
            defs.push(("LUT1V".into(), 1));
        }
        defs.push(("STAGES".into(), pipe.stages as i64));
        if pipe.minb > 0 {
            defs.push(("PMINB".into(), pipe.minb));
        }
    }
    defs
}

/// Every module a decode plan for `kf`/`vf` and group `g` compiles, and the benchmark's
/// lookup variants: (family, defines), for compile-only checks (CPU-side test).
pub fn decode_modules(kf: &GpuFormat, vf: &GpuFormat, g: usize, cc: (i32, i32)) -> Vec<(Family, Vec<(String, i64)>)> {
    let t = Tuning::default();
    let pipe = Pipe::new(kf, vf, cc, false, false, &t);
    let var = Variants::new(&t);
    let pdl = hopper(cc) && t.decode_pdl;
    let mut m = vec![
        (Family::Decode, decode_defines(kf, vf, g, &pipe, &var, pdl)),
        (Family::Attn, attn_defines(kf, vf, g, pdl)),
    ];
    // Split-K as well (batches past the stream grid's bound, fewer waves than
    // STREAM_MIN_WAVES, `DecodeGrid::SplitK`), dealt by pages and (batches past SKMAXB) not.
    let split = Pipe::new(kf, vf, cc, false, true, &t);
    // And vecinfer's unstaged fallback (devices with less shared memory).
    let mut pipes = vec![split, Pipe { balance: false, ..split }];
    if split.vq_stage {
        let unstaged = Pipe { vq_stage: false, warps: NWARPS, ..split };
        pipes.extend([unstaged, Pipe { balance: false, ..unstaged }]);
    }
    for p in pipes {
        let defs = decode_defines(kf, vf, g, &p, &var, pdl);
        if !m.iter().any(|(_, d)| *d == defs) {
            m.push((Family::Decode, defs));
        }
    }
    // The benchmark's code-path variants of the FAST 2-bit lookups (Tuning::decode_lut2,
    // decode_lut1v), so that they compile wherever the defaults do.
    for v in [Variants { lut2: false, ..var }, Variants { lut1v: false, ..var }] {
        let defs = decode_defines(kf, vf, g, &pipe, &v, pdl);
        if !m.iter().any(|(_, d)| *d == defs) {
            m.push((Family::Decode, defs));
        }
    }
    m
}

fn attn_defines(kf: &GpuFormat, vf: &GpuFormat, g: usize, pdl: bool) -> Vec<(String, i64)> {
    let mut defs: Vec<(String, i64)> = [
        ("D", kf.d as i64),
        ("G", g as i64),
        ("KROT", kf.rotation.is_some() as i64),
        // qjl: the sketch's blocks of d rows (2 at m = 2d: a second prepared query).
        ("KSKETCH", if kf.kind == KernelKind::Sketch { kf.sketch_halves() as i64 } else { 0 }),
        ("KPROD", (kf.kind == KernelKind::Prod) as i64),
        ("KRVQ", (kf.kind == KernelKind::Rvq) as i64),
        ("KRABITQ", (kf.kind == KernelKind::Rabitq) as i64),
        ("VRVQ", (vf.kind == KernelKind::Rvq) as i64),
        ("KFRAC", (kf.kind == KernelKind::Frac) as i64),
        ("KCENTER", (kf.kind == KernelKind::Frac && kf.spec.center) as i64),
        ("VROT", vf.rotation.is_some() as i64),
        ("VFRAC", (vf.kind == KernelKind::Frac) as i64),
        ("VCENTER", (vf.kind == KernelKind::Frac && vf.spec.center) as i64),
        ("PDL", pdl as i64),
        ("KDENSE_W", kf.dense.len() as i64),
        ("VDENSE_W", vf.dense.len() as i64),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), *v))
    .collect();
    // vecinfer: its code bits give the transform's size (λ and the codebooks per head).
    for (p, f) in [('K', kf), ('V', vf)] {
        if f.kind == KernelKind::Vq {
            defs.push((format!("{p}VQ"), 1));
            defs.push((format!("{p}VQB"), f.bits as i64));
        }
    }
    defs
}

#[derive(Clone, Copy, Debug)]
pub struct DecodeOptions {
    /// Blocks per SM the split count aims for (flash-decoding fills the GPU at batch 1).
    pub blocks_per_sm: usize,
    /// Fewest pages per split (bounds the partials' traffic).
    pub min_pages_per_split: usize,
    /// Take the generic path even where the Hopper-only FAST path applies (what pre-Hopper
    /// GPUs run; tests check it on Hopper).
    pub generic: bool,
    /// Which grid the FAST path runs (tests check both).
    pub grid: DecodeGrid,
    /// At most this many blocks in the stream grid (0: as many as are resident at once);
    /// tests use a few, so that each warp's run spans many rows.
    pub max_blocks: usize,
    /// `decode_with`: plan for at least this many pages per sequence (a serving engine's page
    /// bucket, longer than the rows it runs; 0: the longest row's).
    pub cover_pages: usize,
}

impl Default for DecodeOptions {
    fn default() -> Self {
        Self {
            blocks_per_sm: 4,
            min_pages_per_split: 16,
            generic: false,
            grid: DecodeGrid::Auto,
            max_blocks: 0,
            cover_pages: 0,
        }
    }
}

/// The FAST path's grid: split-K blocks of (sequence, KV head, split), or the persistent
/// stream grid (decode.cu STREAMK).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeGrid {
    /// The stream grid where split-K would run at least `STREAM_MIN_WAVES` waves of blocks
    /// (and the tuning enables it), else split-K.
    Auto,
    SplitK,
    Stream,
}

/// Split-K waves from which the stream grid runs instead. Measured on the H200 (stream vs
/// split-K, graph replay): 2.9 waves (B = 64, Hkv = 3, S = 4k, d = 64 and 128) and 5.8 (the
/// serving step, B = 256) faster by 6–13 %; 1.0–1.9 waves (B = 1–32, Hkv = 8, d = 128) slower
/// by 10–60 % (a warp's run starts after the grid's prefix sums and its first row's query).
const STREAM_MIN_WAVES: f64 = 2.5;

/// A decode plan with its own query and output buffers (tests, benchmarks); `core` alone
/// serves callers with their own buffers (the engine).
pub struct DecodePlan {
    /// `[batch][n_q_heads][d]` f32.
    pub q: CudaSlice<f32>,
    pub out: CudaSlice<f32>,
    pub core: PlanCore,
}

impl std::ops::Deref for DecodePlan {
    type Target = PlanCore;
    fn deref(&self) -> &PlanCore {
        &self.core
    }
}
impl std::ops::DerefMut for DecodePlan {
    fn deref_mut(&mut self) -> &mut PlanCore {
        &mut self.core
    }
}

impl DecodePlan {
    pub fn new(
        cache: &GpuKvCache,
        n_q_heads: usize,
        batch: usize,
        max_pages: usize,
        opts: DecodeOptions,
    ) -> Result<Self> {
        let core = PlanCore::new(cache, n_q_heads, batch, max_pages, opts)?;
        let nq = batch * n_q_heads * cache.cfg.head_dim;
        let s = &cache.dev.stream;
        Ok(Self { q: s.alloc_zeros(nq).map_err(drv("alloc"))?, out: s.alloc_zeros(nq).map_err(drv("alloc"))?, core })
    }

    /// Launch one decode step of layer 0 over `self.q` into `self.out` (no synchronization).
    pub fn run(&mut self, cache: &GpuKvCache) -> Result<()> {
        let s = self.core.dev.stream.clone();
        self.run_on_stream(cache, &s)
    }

    /// As `run`, on `stream` (e.g. one being captured into a graph).
    pub fn run_on_stream(&mut self, cache: &GpuKvCache, s: &Arc<CudaStream>) -> Result<()> {
        self.core.run_on(cache, 0, &self.q.slice(..), DecodeOut::F32(&mut self.out.slice_mut(..)), s)
    }
}

/// A split-K decode kernel that takes the plan's splits as they are (no BALANCE).
struct PlainDecode {
    f: CudaFunction,
    warps: usize,
    smem: u32,
}

/// Kernels, split layout and work buffers of decode steps over one cache.
pub struct PlanCore {
    pub dev: Arc<GpuDevice>,
    pub n_q_heads: usize,
    pub group: usize,
    /// Step rows (sequences per step).
    pub batch: usize,
    pub n_splits: usize,
    pub pages_per_split: usize,
    /// combine launched as a programmatic dependent (`VELOXQUANT_DECODE_PDL`, default 1).
    pdl: bool,
    pub nwarps: usize,
    smem: u32,
    fuse_q: bool,
    /// The stream grid's blocks (0: split-K).
    stream_blocks: u32,
    /// Split-K blocks dealt by the step's pages (decode.cu BALANCE).
    balanced: bool,
    /// BALANCE plans: the kernel without it, run where every row fills the split layout.
    plain: Option<PlainDecode>,
    /// Stream grid and BALANCE: each row's (first partial, count), written by decode_pages for
    /// combine.
    part_rows: CudaSlice<i32>,
    /// Row b of a step reads cache slot rows[b] (−1: idle); host copy and device copy.
    rows_host: Vec<i32>,
    rows: CudaSlice<i32>,
    cache_id: u64,
    qprep: CudaSlice<f32>,
    part_acc: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
    f_prep: CudaFunction,
    f_decode: CudaFunction,
    f_combine: CudaFunction,
}

/// The decode kernel for `first` (the FAST path at the tuned warp count), else with fewer
/// warps (large pages, e.g. turboquant_rvq 4:4 keys, fill the shared memory with their
/// rings), else the generic path: the first whose shared memory the device grants, with its
/// dynamic shared memory size.
fn pick_decode(
    dev: &GpuDevice,
    kf: &GpuFormat,
    vf: &GpuFormat,
    g: usize,
    first: Pipe,
    var: &Variants,
    pdl: bool,
) -> Result<(Pipe, CudaFunction, usize)> {
    let d = kf.d;
    let mut candidates = vec![first];
    if first.fast {
        candidates.extend([8, 4].iter().filter(|&&w| w < first.warps).map(|&w| Pipe { warps: w, ..first }));
        candidates.push(Pipe { fast: false, stream: false, fuse_q: false, warps: NWARPS, ..first });
    }
    if first.vq_stage {
        // Devices with less shared memory per block (sm_86/89: 99 KiB): the codebooks from
        // global memory.
        candidates.push(Pipe { vq_stage: false, warps: NWARPS, ..first });
    }
    for pipe in candidates {
        // The warps' accumulators after the loop (split-K: in dynamic shared memory).
        let post = if pipe.fast && !pipe.stream { pipe.warps * 8 * d * 4 } else { 0 };
        let defs = decode_defines(kf, vf, g, &pipe, var, pdl);
        let dref: Vec<(&str, i64)> = defs.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        let f = dev.function(Family::Decode, &dref, "decode_pages")?;
        let static_bytes = f.shared_size_bytes().map_err(drv("shared_size_bytes"))? as usize;
        let Some(smem) = pipe.smem(kf, vf, static_bytes, post) else { continue };
        // Past the device's opt-in limit the attribute call fails: not attempted.
        if smem > 0
            && (static_bytes + smem > dev.max_smem_optin
                || f.set_attribute(
                    cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )
                .is_err())
        {
            continue;
        }
        return Ok((pipe, f, smem));
    }
    Err(CudaError::UnsupportedFormat {
        format: format!("decode {}/{}", kf.spec, vf.spec),
        why: "no decode variant's shared memory fits this device",
    })
}

/// Where a decode step writes `[batch][n_q_heads][d]`: f32, or f16 (the next matrix
/// product's input).
pub enum DecodeOut<'a, 'b> {
    F32(&'a mut CudaViewMut<'b, f32>),
    F16(&'a mut CudaViewMut<'b, u16>),
}

fn kind_defines(prefix: char, f: &GpuFormat) -> [(String, i64); 4] {
    [
        (format!("{prefix}K"), f.decode_kind()),
        (format!("{prefix}B"), f.bits.max(1) as i64),
        (format!("{}_ROW_BYTES", prefix), f.row_bytes as i64),
        (format!("{}_PAGE_BYTES", prefix), f.page_bytes as i64),
    ]
}

impl PlanCore {
    /// A plan for steps of `batch` rows over `cache`, covering sequences of up to `max_pages`
    /// coded pages (the split layout is chosen for that length; `run_on` refuses longer).
    pub fn new(
        cache: &GpuKvCache,
        n_q_heads: usize,
        batch: usize,
        max_pages: usize,
        opts: DecodeOptions,
    ) -> Result<Self> {
        let cfg = &cache.cfg;
        let dev = cache.dev.clone();
        if n_q_heads == 0 || !n_q_heads.is_multiple_of(cfg.n_kv_heads) || n_q_heads / cfg.n_kv_heads > 8 {
            return Err(CudaError::ShapeMismatch {
                op: "GQA group (n_q_heads / n_kv_heads must be 1..=8)",
                expected: cfg.n_kv_heads,
                got: n_q_heads,
            });
        }
        if batch == 0 || batch > 65535 {
            return Err(CudaError::ShapeMismatch { op: "decode plan batch (1..=65535)", expected: 1, got: batch });
        }
        let g = n_q_heads / cfg.n_kv_heads;
        let d = cfg.head_dim;
        let (kf, vf) = (&cache.k.fmt, &cache.v.fmt);
        let cc = dev.compute_capability;
        let t = dev.tuning;
        let var = Variants::new(&t);
        let b = batch;
        let max_pages = max_pages.clamp(1, cfg.max_pages_per_seq);
        let pdl = hopper(cc) && t.decode_pdl;
        // The stream grid's prefix sums hold SKMAXB sequences, its page indices are i32.
        let flat_pages = b.saturating_mul(cfg.n_kv_heads).saturating_mul(cfg.max_pages_per_seq);
        let no_stream = opts.grid == DecodeGrid::SplitK || b > SKMAXB || flat_pages > i32::MAX as usize / 2;
        // BALANCE's prefix sums hold SKMAXB sequences too.
        let pick = |split_k: bool| {
            let pipe = Pipe::new(kf, vf, cc, opts.generic, split_k, &t);
            pick_decode(&dev, kf, vf, g, Pipe { balance: pipe.balance && b <= SKMAXB, ..pipe }, &var, pdl)
        };
        let (mut pipe, mut f_decode, mut smem) = pick(no_stream)?;
        // Whole waves: as many blocks as fit at once (the kernel's occupancy, capped by
        // blocks_per_sm), rounded down to a multiple of the (sequence, KV head) rows.
        let resident_of = |f: &CudaFunction, pipe: &Pipe, smem: usize| {
            f.occupancy_max_active_blocks_per_multiprocessor((pipe.warps * 32) as u32, smem, None)
                .map(|n| n as usize)
                .unwrap_or(opts.blocks_per_sm)
                .clamp(1, opts.blocks_per_sm.max(1))
        };
        let rows = b * cfg.n_kv_heads;
        let split_layout = |target: usize| {
            let per_head = splits_for_waves(rows, target, max_pages.div_ceil(opts.min_pages_per_split.max(1)));
            let pps = opts.min_pages_per_split.max(max_pages.div_ceil(per_head));
            (max_pages.div_ceil(pps).max(1), pps)
        };
        let mut target = dev.sm_count * resident_of(&f_decode, &pipe, smem);
        if pipe.stream && opts.grid == DecodeGrid::Auto {
            let (n_splits, _) = split_layout(target);
            if ((rows * n_splits) as f64) < STREAM_MIN_WAVES * target as f64 {
                (pipe, f_decode, smem) = pick(true)?;
                target = dev.sm_count * resident_of(&f_decode, &pipe, smem);
            }
        }
        let adefs = attn_defines(kf, vf, g, pdl);
        let adefs: Vec<(&str, i64)> = adefs.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        let f_prep = dev.function(Family::Attn, &adefs, "prep_query")?;
        let f_combine = dev.function(Family::Attn, &adefs, "combine")?;

        let stream_blocks = if opts.max_blocks > 0 { target.min(opts.max_blocks) } else { target };
        let (n_splits, pps, n_parts) = if pipe.stream {
            // One split covering every page; partials (warp + row) for the grid's warps.
            (1, max_pages, stream_blocks * pipe.warps + rows)
        } else {
            let (n_splits, pps) = split_layout(target);
            (n_splits, pps, rows * n_splits)
        };
        // Beside a BALANCE kernel, the same pipe without it, for steps whose rows all fill the
        // split layout (nothing to deal: it saves BALANCE's set-up, ~2.5 µs on the H100).
        let plain = if pipe.splits_balanced() {
            let (p, f, sm) = pick_decode(&dev, kf, vf, g, Pipe { balance: false, ..pipe }, &var, pdl)?;
            (!p.stream && !p.splits_balanced() && p.fuse_q == pipe.fuse_q).then_some(PlainDecode {
                f,
                warps: p.warps,
                smem: sm as u32,
            })
        } else {
            None
        };
        let s = &dev.stream;
        let nq = b * n_q_heads * d;
        let rows_host: Vec<i32> = (0..b).map(|i| if i < cfg.max_seqs { i as i32 } else { -1 }).collect();
        Ok(Self {
            n_q_heads,
            group: g,
            batch: b,
            n_splits,
            pages_per_split: pps,
            pdl,
            nwarps: pipe.warps,
            smem: smem as u32,
            fuse_q: pipe.fuse_q,
            stream_blocks: if pipe.stream { stream_blocks as u32 } else { 0 },
            balanced: pipe.splits_balanced(),
            plain,
            part_rows: s.alloc_zeros(2 * rows).map_err(drv("alloc"))?,
            rows: s.clone_htod(&rows_host).map_err(drv("htod"))?,
            rows_host,
            cache_id: cache.id,
            // turboquant_prod, turboquant_rvq: a second prepared query after the first.
            qprep: s.alloc_zeros(if cache.k.fmt.two_queries() { 2 * nq } else { nq }).map_err(drv("alloc"))?,
            // turboquant_rvq values: both domains' accumulators per head (decode.cu VACC).
            part_acc: s.alloc_zeros(n_parts * g * cache.v.fmt.value_acc_width()).map_err(drv("alloc"))?,
            part_ml: s.alloc_zeros(n_parts * g * 2).map_err(drv("alloc"))?,
            f_prep,
            f_decode,
            f_combine,
            dev,
        })
    }

    /// The grid this plan runs (`Auto` resolved).
    pub fn grid(&self) -> DecodeGrid {
        if self.stream_blocks > 0 {
            DecodeGrid::Stream
        } else {
            DecodeGrid::SplitK
        }
    }

    /// Whether a step over the current rows deals its split-K blocks by their pages
    /// (decode.cu BALANCE).
    pub fn deals_blocks(&self, cache: &GpuKvCache) -> bool {
        self.balanced && !(self.plain.is_some() && self.rows_fill_splits(cache))
    }

    /// Every row active with the same pages, each of its splits some: a BALANCE plan then runs
    /// its plain kernel (a step captured into a graph keeps the choice: it picks the speed,
    /// not the result).
    fn rows_fill_splits(&self, cache: &GpuKvCache) -> bool {
        // Runs per step and layer: no allocation.
        let t = cache.cfg.page_tokens;
        let pages = |r: i32| if r >= 0 { cache.coded(r as usize).ok().map(|c| c.div_ceil(t)) } else { None };
        let lo = (self.n_splits - 1) * self.pages_per_split;
        match self.rows_host.first().copied().and_then(pages) {
            Some(p0) => p0 > lo && self.rows_host.iter().all(|&r| pages(r) == Some(p0)),
            None => false,
        }
    }

    /// Pages per sequence the split layout covers.
    pub fn covered_pages(&self) -> usize {
        self.pages_per_split * self.n_splits
    }

    /// The slot each step row reads (`batch` entries; −1: an idle row, output zero).
    pub fn set_rows(&mut self, cache: &GpuKvCache, rows: &[i32]) -> Result<()> {
        if rows.len() != self.batch {
            return Err(CudaError::ShapeMismatch { op: "decode rows", expected: self.batch, got: rows.len() });
        }
        if let Some(&bad) = rows.iter().find(|&&r| r >= 0 && !cache.is_active(r as usize)) {
            return Err(CudaError::ShapeMismatch {
                op: "decode row's slot (active)",
                expected: cache.cfg.max_seqs,
                got: bad as usize,
            });
        }
        self.rows_host = rows.to_vec();
        let s = self.dev.stream.clone();
        s.memcpy_htod(rows, &mut self.rows).map_err(drv("htod rows"))
    }

    /// The step's rows on the device (e.g. the target of a step upload).
    pub fn rows_mut(&mut self) -> &mut CudaSlice<i32> {
        &mut self.rows
    }

    /// Record that the device rows were written (by a step upload) with `rows`.
    pub fn note_rows(&mut self, rows: &[i32]) {
        self.rows_host.clear();
        self.rows_host.extend_from_slice(rows);
    }

    /// One decode step of `layer`: q `[batch][n_q_heads][d]` f32 → `out`, on `stream` (e.g.
    /// one being captured into a CUDA graph: a step is kernel launches over the plan's and
    /// the cache's buffers, so a captured step replays correctly while those live and the
    /// device tables are current). Refused: another cache than the plan's, short buffers,
    /// table writes not yet applied, a sequence longer than the plan covers.
    pub fn run_on(
        &mut self,
        cache: &GpuKvCache,
        layer: usize,
        q: &CudaView<'_, f32>,
        out: DecodeOut<'_, '_>,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        let cfg = &cache.cfg;
        if cache.id != self.cache_id {
            return Err(CudaError::ShapeMismatch { op: "decode plan used with another cache", expected: 0, got: 1 });
        }
        if layer >= cfg.n_layers {
            return Err(CudaError::ShapeMismatch { op: "decode layer", expected: cfg.n_layers, got: layer });
        }
        if cache.has_pending_deltas() {
            return Err(CudaError::ShapeMismatch {
                op: "decode with table writes not applied (sync_meta)",
                expected: 0,
                got: 1,
            });
        }
        let nq = self.batch * self.n_q_heads * cfg.head_dim;
        let out_len = match &out {
            DecodeOut::F32(o) => o.len(),
            DecodeOut::F16(o) => o.len(),
        };
        if q.len() < nq || out_len < nq {
            return Err(CudaError::ShapeMismatch {
                op: "decode q/out length",
                expected: nq,
                got: q.len().min(out_len),
            });
        }
        let slots: Vec<usize> = self.rows_host.iter().filter(|&&r| r >= 0).map(|&r| r as usize).collect();
        let covered = self.covered_pages();
        if cache.max_pages(&slots) > covered {
            return Err(CudaError::ShapeMismatch {
                op: "decode plan's pages per sequence (the cache grew: make a new plan)",
                expected: covered,
                got: cache.max_pages(&slots),
            });
        }
        let (b, d, hk) = (self.batch as u32, cfg.head_dim as u32, cfg.n_kv_heads as i32);
        let s = stream.clone();
        let ksigns = cache.k.layer_signs(layer, cfg.n_kv_heads);
        let vsigns = cache.v.layer_signs(layer, cfg.n_kv_heads);
        let per_q = LaunchConfig { grid_dim: (self.n_q_heads as u32, b, 1), block_dim: (d, 1, 1), shared_mem_bytes: 0 };
        if !self.fuse_q {
            let mut l = s.launch_builder(&self.f_prep);
            l.arg(q).arg(&mut self.qprep).arg(&ksigns).arg(&cache.k.rot_scale);
            // SAFETY: matches prep_query(q, qprep, ksigns, krot_scale); sizes from the plan.
            unsafe { l.launch(per_q) }.map_err(drv("prep_query"))?;
        }

        let max_pages = cfg.max_pages_per_seq as i32;
        let batch = b as i32;
        let (pps, ns) = (self.pages_per_split as i32, self.n_splits as i32);
        let plain = self.plain.as_ref().filter(|_| self.rows_fill_splits(cache));
        let (f_dec, warps, smem) = match plain {
            Some(p) => (&p.f, p.warps, p.smem),
            None => (&self.f_decode, self.nwarps, self.smem),
        };
        let cfg_dec = LaunchConfig {
            grid_dim: if self.stream_blocks > 0 {
                (self.stream_blocks, 1, 1)
            } else {
                (self.n_splits as u32, hk as u32, b)
            },
            block_dim: ((warps * 32) as u32, 1, 1),
            shared_mem_bytes: smem,
        };
        let (ktab, vtab) = (Tab16(cache.k.fmt.table_f16), Tab16(cache.v.fmt.table_f16));
        let (k2tab, v2tab) = (Tab16(cache.k.fmt.table2_f16), Tab16(cache.v.fmt.table2_f16));
        let table = cache.meta.slice(..cache.n_table());
        let coded = cache.meta.slice(cache.coded_at()..cache.coded_at() + cfg.max_seqs);
        let seq_len = cache.meta.slice(cache.seq_len_at()..cache.seq_len_at() + cfg.max_seqs);
        let dptr = |x: &CudaView<'_, i32>| x.device_ptr(&s).0;
        let (qprep, kpool, vpool) =
            (self.qprep.device_ptr(&s).0, cache.k.pools[layer].device_ptr(&s).0, cache.v.pools[layer].device_ptr(&s).0);
        let (tab, rows_d, coded_d) = (dptr(&table), self.rows.device_ptr(&s).0, dptr(&coded));
        let (pacc, pml) = (self.part_acc.device_ptr_mut(&s).0, self.part_ml.device_ptr_mut(&s).0);
        let (qd, ksg, prows) = (q.device_ptr(&s).0, ksigns.device_ptr(&s).0, self.part_rows.device_ptr_mut(&s).0);
        let vsg = vsigns.device_ptr(&s).0;
        let mut dparams: [*mut c_void; 22] = [
            arg(&qprep),
            arg(&kpool),
            arg(&vpool),
            arg(&tab),
            arg(&rows_d),
            arg(&coded_d),
            arg(&max_pages),
            arg(&pps),
            arg(&ns),
            arg(&hk),
            arg(&ktab),
            arg(&vtab),
            arg(&k2tab),
            arg(&v2tab),
            arg(&pacc),
            arg(&pml),
            arg(&qd),
            arg(&ksg),
            arg(&cache.k.rot_scale),
            arg(&batch),
            arg(&prows),
            arg(&vsg),
        ];
        // SAFETY: dparams point at live values in decode_pages' parameter order and types
        // (kernels/decode.cu); the rows name active slots (or −1) whose table rows hold valid
        // physical pages for their coded tokens (the device tables are current: no pending
        // deltas), and the split layout covers every row's pages (the stream grid: its
        // partials, grid warps + rows, are allocated for its blocks). As prep_query's
        // programmatic dependent (prep_query ran: no FUSEQ), it waits before reading qprep.
        unsafe { launch_raw(f_dec, cfg_dec, &s, &mut dparams, self.pdl && !self.fuse_q) }
            .map_err(drv("decode_pages"))?;

        let (n_sink, ring) = (cfg.sink as i32, cache.ring_cap() as i32);
        let cfg_comb = LaunchConfig { shared_mem_bytes: cache.exact_slots() as u32 * 4, ..per_q };
        let ptr = |x: &CudaSlice<f32>| x.device_ptr(&s).0;
        let vptr = |x: &CudaView<'_, f32>| x.device_ptr(&s).0;
        let (acc, ml) = (ptr(&self.part_acc), ptr(&self.part_ml));
        let vs = vptr(&vsigns);
        // The rows' (first partial, count): written by the stream grid and by BALANCE's blocks.
        let dealt = self.balanced && plain.is_none();
        let part_rows = if self.stream_blocks > 0 || dealt { self.part_rows.device_ptr(&s).0 } else { 0u64 };
        let (kx, vx) = (cache.k.exact[layer].device_ptr(&s).0, cache.v.exact[layer].device_ptr(&s).0);
        let sl = seq_len.device_ptr(&s).0;
        let (o32, o16) = match out {
            DecodeOut::F32(o) => (o.device_ptr_mut(&s).0, 0u64),
            DecodeOut::F16(o) => (0u64, o.device_ptr_mut(&s).0),
        };
        let mut params: [*mut c_void; 18] = [
            arg(&acc),
            arg(&ml),
            arg(&part_rows),
            arg(&ns),
            arg(&hk),
            arg(&qd),
            arg(&kx),
            arg(&vx),
            arg(&rows_d),
            arg(&sl),
            arg(&coded_d),
            arg(&n_sink),
            arg(&ring),
            arg(&vs),
            arg(&cache.v.rot_scale),
            arg(&ksg),
            arg(&o32),
            arg(&o16),
        ];
        // SAFETY: params point at live values in combine's parameter order and types
        // (kernels/attn.cu); dynamic smem holds the exact tokens' scores (S + C).
        unsafe { launch_raw(&self.f_combine, cfg_comb, &s, &mut params, self.pdl) }.map_err(drv("combine"))
    }
}

/// A format's 16 f16 centroids as one by-value kernel parameter (decode.cu's Tab16).
#[repr(C)]
#[derive(Clone, Copy)]
struct Tab16([u16; 16]);
// SAFETY: plain data with the layout of `struct Tab16 { u16 v[16]; }`.
unsafe impl DeviceRepr for Tab16 {}

/// A kernel parameter for cuLaunchKernelEx: the address of its value.
fn arg<T>(x: &T) -> *mut c_void {
    x as *const T as *mut c_void
}

/// Launch `f` with its parameters as pointers to their values (cuLaunchKernelEx); `dependent`:
/// as a programmatic dependent of the stream's previous kernel, which may still be running
/// when `f` starts (`f` orders its reads of that kernel's output by griddepcontrol.wait).
///
/// # Safety
/// `params` must match `f`'s parameter list in order and types, and `cfg` its resources.
unsafe fn launch_raw(
    f: &CudaFunction,
    cfg: LaunchConfig,
    stream: &CudaStream,
    params: &mut [*mut c_void],
    dependent: bool,
) -> std::result::Result<(), cudarc::driver::DriverError> {
    // SAFETY: a zeroed attribute value is a valid union (plain integers); the attribute array
    // and `params` outlive the call, which copies them.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let lc = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: dependent as u32,
    };
    // SAFETY: per this function's contract.
    unsafe { sys::cuLaunchKernelEx(&lc, f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }.result()
}

/// One decode step of `layer` from the host: sequence b of the batch reads cache slot
/// `slots[b]`; q is `[batch][n_q_heads][d]`; returns the same shape.
pub fn decode(cache: &mut GpuKvCache, slots: &[usize], layer: usize, q: &[f32], n_q_heads: usize) -> Result<Vec<f32>> {
    decode_with(cache, slots, layer, q, n_q_heads, DecodeOptions::default())
}

/// As [`decode`], with explicit options.
pub fn decode_with(
    cache: &mut GpuKvCache,
    slots: &[usize],
    layer: usize,
    q: &[f32],
    n_q_heads: usize,
    opts: DecodeOptions,
) -> Result<Vec<f32>> {
    cache.sync_meta()?;
    let max_pages = cache.max_pages(slots).max(opts.cover_pages);
    let mut plan = PlanCore::new(cache, n_q_heads, slots.len(), max_pages, opts)?;
    let rows: Vec<i32> = slots.iter().map(|&s| s as i32).collect();
    plan.set_rows(cache, &rows)?;
    let want = slots.len() * n_q_heads * cache.cfg.head_dim;
    if q.len() != want {
        return Err(CudaError::ShapeMismatch { op: "gpu decode query", expected: want, got: q.len() });
    }
    let s = cache.dev.stream.clone();
    let qd = s.clone_htod(q).map_err(drv("htod q"))?;
    let mut out = s.alloc_zeros::<f32>(want).map_err(drv("alloc"))?;
    plan.run_on(cache, layer, &qd.slice(..), DecodeOut::F32(&mut out.slice_mut(..)), &s)?;
    s.clone_dtoh(&out).map_err(drv("dtoh out"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use veloxquant::FormatSpec;

    /// The host's dynamic shared-memory size against the kernel's layout rule (decode.cu,
    /// FAST): for every start of the dynamic part the hardware may give (the static part, plus
    /// up to 1 KiB reserved and 128-byte alignment), the table at the next 64-KiB boundary,
    /// min(pad / ring, warps) rings below it and the rest above must fit the allocation (the
    /// kernel traps otherwise), and a block of up to 16 warps must fit the SM's 227 KiB.
    #[test]
    fn splits_fill_the_last_wave() {
        // Fewer rows than resident blocks: enough splits to fill the GPU.
        assert_eq!(splits_for_waves(8, 132, 64), 15); // 120 of 132 blocks
                                                      // 192 rows on 132 blocks: one split runs 1.45 waves; two fill 97 %.
        assert_eq!(splits_for_waves(192, 132, 16), 2);
        // 132 rows: one exact wave.
        assert_eq!(splits_for_waves(132, 132, 16), 1);
        // Short sequences cap the splits; the best fill below the cap is taken.
        assert_eq!(splits_for_waves(8, 132, 4), 4);
    }

    #[test]
    fn plut_layout_fits_its_allocation() {
        for (k, v) in [
            ("turboquant_mse:4", "turboquant_mse:4"),
            ("turboquant_mse:4", "turboquant_mse:2"),
            ("turboquant_mse:4:eden", "turboquant_mse:3"),
            ("turboquant_mse:3", "turboquant_mse:3"),
        ] {
            for d in [64, 128] {
                let kf = GpuFormat::new(&FormatSpec::parse(k).unwrap(), d, 32, 1).unwrap();
                let vf = GpuFormat::new(&FormatSpec::parse(v).unwrap(), d, 32, 2).unwrap();
                for warps in [4, 8, 12, 16] {
                    let pipe = Pipe {
                        fast: true,
                        stages: 2,
                        warps,
                        minb: 0,
                        fuse_q: true,
                        stream: false,
                        balance: true,
                        vq_stage: false,
                    };
                    let ring = pipe.ring(&kf, &vf);
                    let post = warps * 8 * d * 4;
                    for static_bytes in [2048usize, 4096, 4480, 8064, 16000] {
                        let Some(dynb) = pipe.smem(&kf, &vf, static_bytes, post) else {
                            panic!("{k}/{v} d={d} warps={warps}: no layout")
                        };
                        for start in (static_bytes..=static_bytes + 1024 + 128).step_by(16) {
                            let pad = (65536 - start % 65536) % 65536;
                            let below = (pad / ring).min(warps);
                            let used = pad + 65536 + (warps - below) * ring;
                            assert!(
                                used <= dynb,
                                "{k}/{v} d={d} warps={warps} static={static_bytes} start={start}: {used} > {dynb}"
                            );
                        }
                        if warps <= 16 {
                            assert!(
                                dynb + static_bytes <= 227 << 10,
                                "{k}/{v} d={d} warps={warps} static={static_bytes}: {dynb} B"
                            );
                        }
                    }
                }
            }
        }
    }
}
