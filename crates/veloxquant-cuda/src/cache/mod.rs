//! The device-resident paged cache: every layer, a set of sequence slots, the CPU cache's
//! semantics (`veloxquant::cache`): sinks S, the fp16 window R, row or page mode, pages shared
//! by reference count between forks.
//!
//! - One page table for all layers, `[slot][kv_head][page]` → physical page: every layer
//!   appends the same tokens, so a logical page of a slot is one *group* id `g` for all layers,
//!   head h's page being `g · n_kv_heads + h` in each layer's pool. The allocator (free list,
//!   reference counts) is over groups; the host holds the truth and the device gets deltas.
//! - Per layer and stream (K, V): a pool of pages in the format's canonical layout
//!   (byte-identical to the CPU's), and the exact buffer `[slot][kv_head][S + C][d]` f16: the
//!   sinks, then the window as a ring of C = R + 1 (row mode) or R + T (page mode) slots.
//! - Device metadata `meta` = [page table | seq_len per slot | coded per slot] (i32), written
//!   only by `apply_deltas` (kernels/model.cu) from an uploaded list, so a captured step
//!   replays with fresh tables.
//!
//! An append of n tokens (`AppendRow`) is planned on the host (pages allocated, deltas
//! recorded), then executed per layer by `kv_append` (kernels/kv.cu), which encodes the tokens
//! leaving the window from the same f16 values the CPU encodes.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits};
use veloxquant::format::FormatCtx;
use veloxquant::format::Stream as StreamKind;
use veloxquant::rng::derive_seed;
use veloxquant::{CacheConfig, Calibration, FormatSpec};

use crate::device::{Family, GpuDevice};
use crate::encode::{GpuEncoder, InputKind};
use crate::error::{drv, CudaError, Result};
use crate::format::GpuFormat;

mod launch;
mod transfer;

/// Shape of a device cache. Sizes are fixed at creation (see [`GpuCacheConfig::device_bytes`]).
#[derive(Clone, Debug)]
pub struct GpuCacheConfig {
    pub n_layers: usize,
    /// Sequence slots.
    pub max_seqs: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub page_tokens: usize,
    /// Newest tokens kept exact (R).
    pub recent: usize,
    /// First tokens kept exact (S).
    pub sink: usize,
    pub k: FormatSpec,
    pub v: FormatSpec,
    /// Base seed: rotations match `PagedCache` built with the same seed.
    pub seed: u64,
    /// Row mode when both formats allow it (as `CacheConfig::encode_rows`).
    pub encode_rows: bool,
    /// Logical pages per slot (page-table width): bounds a sequence's coded tokens.
    pub max_pages_per_seq: usize,
    /// Page groups in the pool (one page per KV head each), shared by all slots.
    pub pool_groups: usize,
    /// Calibration for calibrated formats (turboquant_frac), as the CPU cache takes it: each
    /// (layer, head, stream) instance is built by the CPU format from it and its state moved
    /// to the device.
    pub calibration: Option<Arc<Calibration>>,
}

/// The device's exact-window bound (the combine kernel scores sinks + ring in shared memory).
pub const MAX_EXACT_TOKENS: usize = 8192;

impl GpuCacheConfig {
    /// The device twin of a CPU cache config, with `max_seqs` slots of up to `max_tokens`
    /// tokens each and a pool for `pool_tokens` coded tokens in all (per KV head).
    pub fn from_cpu(cpu: &CacheConfig, max_seqs: usize, max_tokens: usize, pool_tokens: usize) -> Self {
        let t = cpu.page_tokens.max(1);
        Self {
            n_layers: cpu.n_layers,
            max_seqs,
            n_kv_heads: cpu.n_kv_heads,
            head_dim: cpu.head_dim,
            page_tokens: cpu.page_tokens,
            recent: cpu.recent,
            sink: cpu.sink,
            k: cpu.k.clone(),
            v: cpu.v.clone(),
            seed: cpu.seed,
            encode_rows: cpu.encode_rows,
            max_pages_per_seq: max_tokens.div_ceil(t) + 1,
            pool_groups: pool_tokens.div_ceil(t) + max_seqs,
            calibration: cpu.calibration.clone(),
        }
    }

    /// Whether the cache encodes a token at a time: `encode_rows` and both formats allow it
    /// (the CPU's rule: kivi encodes whole pages).
    pub fn row_mode(&self) -> bool {
        self.encode_rows && [&self.k, &self.v].iter().all(|s| s.name != "kivi")
    }

    /// Ring slots of the exact window.
    pub fn ring_cap(&self, row_mode: bool) -> usize {
        self.recent + if row_mode { 1 } else { self.page_tokens }
    }

    fn check(&self) -> Result<()> {
        let bad = |op: &'static str, expected: usize, got: usize| Err(CudaError::ShapeMismatch { op, expected, got });
        if self.n_layers == 0 || self.max_seqs == 0 || self.n_kv_heads == 0 || self.pool_groups == 0 {
            return bad("cache config: layers, slots, KV heads and pool groups must be > 0", 1, 0);
        }
        if self.page_tokens != 32 {
            return bad("cache config: page tokens (the GPU kernels tile pages of 32)", 32, self.page_tokens);
        }
        if self.max_pages_per_seq == 0 || self.max_pages_per_seq > 1 << 20 {
            return bad("cache config: pages per sequence in 1..=2^20", 1 << 20, self.max_pages_per_seq);
        }
        // A key-only format (qjl, turboquant_prod, rabitq) has no value decode: its codes as
        // values would be read as plain codes, silently wrong.
        for (spec, values) in [(&self.k, false), (&self.v, true)] {
            let desc = spec.desc();
            if !(if values { desc.for_values } else { desc.for_keys }) {
                let why = if values { "keys only: not a value format" } else { "values only: not a key format" };
                return Err(CudaError::UnsupportedFormat { format: spec.to_string(), why });
            }
        }
        if self.sink + self.recent + self.page_tokens > MAX_EXACT_TOKENS {
            return bad("cache config: S + R + T exact tokens", MAX_EXACT_TOKENS, self.sink + self.recent + 32);
        }
        let groups = self.pool_groups.checked_mul(self.n_kv_heads).filter(|&p| p < i32::MAX as usize);
        if groups.is_none()
            || self.max_seqs.saturating_mul(self.n_kv_heads * self.max_pages_per_seq) >= i32::MAX as usize
        {
            return bad("cache config: page ids must fit i32", i32::MAX as usize, self.pool_groups);
        }
        Ok(())
    }

    /// Device bytes `GpuKvCache::new` allocates, computed before allocating anything.
    pub fn device_bytes(&self) -> Result<usize> {
        self.check()?;
        let d = self.head_dim;
        let kf = GpuFormat::for_stream(&self.k, d, self.page_tokens, 0, StreamKind::Keys)?;
        let vf = GpuFormat::for_stream(&self.v, d, self.page_tokens, 0, StreamKind::Values)?;
        let row_mode = self.row_mode();
        let xs = self.sink + self.ring_cap(row_mode);
        let pages = self.pool_groups * self.n_kv_heads;
        let per_layer = pages * (kf.page_bytes + vf.page_bytes) + 2 * self.max_seqs * self.n_kv_heads * xs * d * 2;
        let meta = (self.max_seqs * self.n_kv_heads * self.max_pages_per_seq + 2 * self.max_seqs) * 4;
        let signs = self.n_layers * self.n_kv_heads * (kf.transform_words() + vf.transform_words()) * 4;
        per_layer.checked_mul(self.n_layers).and_then(|b| b.checked_add(meta + signs)).ok_or(CudaError::ShapeMismatch {
            op: "cache bytes overflow",
            expected: 0,
            got: usize::MAX,
        })
    }
}

/// One sequence's append, as the kernels read it (kernels/kv.cu `AppendRow`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AppendRow {
    /// Cache slot; −1: an idle row (the kernels skip it).
    pub slot: i32,
    /// Tokens before the append.
    pub pos0: i32,
    pub n: i32,
    /// Tokens in pages (after the sinks) before and after.
    pub coded0: i32,
    pub coded1: i32,
    /// Row of the first new token in the source buffer.
    pub src_row: i32,
}
// SAFETY: plain i32 fields, `#[repr(C)]`, the layout of kv.cu's struct AppendRow.
unsafe impl DeviceRepr for AppendRow {}
// SAFETY: all-zero bits are a valid AppendRow.
unsafe impl ValidAsZeroBits for AppendRow {}

impl AppendRow {
    pub const IDLE: AppendRow = AppendRow { slot: -1, pos0: 0, n: 0, coded0: 0, coded1: 0, src_row: 0 };
}

/// One stream (K or V) on the device.
pub struct Stream {
    pub fmt: GpuFormat,
    /// Whole-page encoder (benchmark fills, uploads).
    pub enc: GpuEncoder,
    f_append: CudaFunction,
    f_window: CudaFunction,
    f_dense: CudaFunction,
    thresholds: CudaSlice<f32>,
    centroids: CudaSlice<f32>,
    /// Per layer: `pool_groups · n_kv_heads` pages.
    pub pools: Vec<CudaSlice<u8>>,
    /// Per layer: `[slot][kv_head][S + C][d]` f16 bits.
    pub exact: Vec<CudaSlice<u16>>,
    /// Per layer and KV head the format's transform, `fmt.transform_words()` floats each:
    /// rotation signs (ones when the format does not rotate) or a sketch's Sᵀ.
    pub signs: CudaSlice<f32>,
    pub rot_scale: f32,
    /// A calibrated format's exported state per (layer, KV head) (empty otherwise): what a
    /// CPU cache moving to or from this one must hold.
    pub states: Vec<Vec<f32>>,
}

impl Stream {
    /// The transforms of `layer` (offset view for the kernels).
    pub fn layer_signs(&self, layer: usize, n_kv: usize) -> cudarc::driver::CudaView<'_, f32> {
        layer_transform(&self.signs, &self.fmt, layer, n_kv)
    }
}

/// `layer`'s part of a stream's transform buffer (a free function so launches can borrow the
/// buffer while they hold the stream's pools mutably).
pub(crate) fn layer_transform<'a>(
    signs: &'a CudaSlice<f32>,
    fmt: &GpuFormat,
    layer: usize,
    n_kv: usize,
) -> cudarc::driver::CudaView<'a, f32> {
    let w = n_kv * fmt.transform_words();
    signs.slice(layer * w..(layer + 1) * w)
}

#[derive(Clone, Debug, Default)]
struct Slot {
    active: bool,
    n_tokens: usize,
    coded: usize,
    /// Group id of each logical page.
    groups: Vec<u32>,
}

pub struct GpuKvCache {
    pub dev: Arc<GpuDevice>,
    /// Unique per cache: plans made for one refuse another.
    pub id: u64,
    pub cfg: GpuCacheConfig,
    pub row_mode: bool,
    pub k: Stream,
    pub v: Stream,
    /// [page table | seq_len | coded] on the device.
    pub meta: CudaSlice<i32>,
    table: Vec<i32>,
    slots: Vec<Slot>,
    free: Vec<u32>,
    refs: Vec<u32>,
    /// (meta index, value) writes not yet on the device.
    deltas: Vec<(i32, i32)>,
    f_deltas: CudaFunction,
    delta_buf: CudaSlice<i32>,
}

fn make_stream(
    dev: &Arc<GpuDevice>,
    cfg: &GpuCacheConfig,
    spec: &FormatSpec,
    stream: StreamKind,
    row_mode: bool,
) -> Result<Stream> {
    let sid = stream as u64;
    let (d, t) = (cfg.head_dim, cfg.page_tokens);
    let mut signs = Vec::new();
    let mut states = Vec::new();
    let mut fmt0 = None;
    // Fail before any calibration work where the GPU has no kernel for the format.
    GpuFormat::for_stream(spec, d, t, cfg.seed, stream)?;
    let mut rot_scale = 1.0;
    for l in 0..cfg.n_layers {
        for h in 0..cfg.n_kv_heads {
            let seed = derive_seed(cfg.seed, &[l as u64, h as u64, sid]);
            // A calibrated format: the CPU's instance (PagedCache::build_formats' context), its state.
            let state = if spec.desc().needs_calibration {
                let mut ctx = FormatCtx::new(d, t, stream, seed);
                ctx.calibration = cfg.calibration.as_ref().and_then(|c| c.get(l, h, stream));
                ctx.query_moments = cfg.calibration.as_ref().and_then(|c| c.query_moments(l, h));
                Some(spec.build(&ctx)?.export_state())
            } else {
                None
            };
            let f = GpuFormat::with_state(spec, d, t, seed, stream, state.as_deref())?;
            states.extend(state);
            let (s, sc) = f.transform();
            signs.extend(s);
            rot_scale = sc;
            fmt0.get_or_insert(f);
        }
    }
    let fmt = fmt0.ok_or(CudaError::ShapeMismatch { op: "cache heads", expected: 1, got: 0 })?;
    let enc = GpuEncoder::new(dev, &fmt, InputKind::F16)?;
    let ring = cfg.ring_cap(row_mode);
    let defines = kv_defines(cfg, &fmt, row_mode);
    let defines: Vec<(&str, i64)> = defines.iter().map(|(k, v)| (*k, *v)).collect();
    let s = &dev.stream;
    let xs = cfg.sink + ring;
    let pages = cfg.pool_groups * cfg.n_kv_heads;
    let mut pools = Vec::with_capacity(cfg.n_layers);
    let mut exact = Vec::with_capacity(cfg.n_layers);
    for _ in 0..cfg.n_layers {
        pools.push(s.alloc_zeros::<u8>(pages * fmt.page_bytes).map_err(drv("alloc pool"))?);
        exact.push(s.alloc_zeros::<u16>(cfg.max_seqs * cfg.n_kv_heads * xs * d).map_err(drv("alloc exact"))?);
    }
    Ok(Stream {
        f_append: dev.function(Family::Kv, &defines, "kv_append")?,
        f_window: dev.function(Family::Kv, &defines, "kv_window")?,
        f_dense: dev.function(Family::Kv, &defines, "kv_dense")?,
        thresholds: s.clone_htod(&fmt.thresholds).map_err(drv("htod"))?,
        centroids: s.clone_htod(&fmt.centroids).map_err(drv("htod"))?,
        signs: s.clone_htod(&signs).map_err(drv("htod"))?,
        pools,
        exact,
        rot_scale,
        states,
        fmt,
        enc,
    })
}

/// The defines of a stream's kv.cu module (its format's, the cache's shape).
pub fn kv_defines(cfg: &GpuCacheConfig, fmt: &GpuFormat, row_mode: bool) -> Vec<(&'static str, i64)> {
    vec![
        ("D", fmt.d as i64),
        ("T", fmt.t as i64),
        ("KIND", fmt.kind as i64),
        ("BITS", fmt.bits.max(1) as i64),
        ("ROT", fmt.rotation.is_some() as i64),
        ("EDEN", fmt.eden as i64),
        ("IN_KIND", 1),
        ("ROW_BYTES", fmt.row_bytes as i64),
        ("PAGE_BYTES", fmt.page_bytes as i64),
        ("MSE_BYTES", fmt.mse_bytes as i64),
        ("BITS2", fmt.bits2.max(1) as i64),
        ("GRP", fmt.group.max(1) as i64),
        ("PERCH", fmt.per_channel as i64),
        ("NHI", fmt.frac.as_ref().map_or(0, |f| f.n_hi) as i64),
        ("CENTER", fmt.spec.center as i64),
        ("NKV", cfg.n_kv_heads as i64),
        ("NSINK", cfg.sink as i64),
        ("RING", cfg.ring_cap(row_mode) as i64),
        ("DENSE_W", fmt.dense.len() as i64),
    ]
}

/// Kernel arguments of one stream's append (the source rows: f32, `stride` elements per token).
pub struct AppendSrc<'a> {
    pub data: cudarc::driver::CudaView<'a, f32>,
    pub stride: usize,
}

impl GpuKvCache {
    pub fn new(dev: &Arc<GpuDevice>, cfg: GpuCacheConfig) -> Result<Self> {
        cfg.device_bytes()?;
        let row_mode = cfg.row_mode();
        let k = make_stream(dev, &cfg, &cfg.k, StreamKind::Keys, row_mode)?;
        let v = make_stream(dev, &cfg, &cfg.v, StreamKind::Values, row_mode)?;
        let n_table = cfg.max_seqs * cfg.n_kv_heads * cfg.max_pages_per_seq;
        let s = &dev.stream;
        let max_deltas = 1 + 2 * Self::max_deltas_per_step(&cfg);
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Ok(Self {
            dev: dev.clone(),
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            row_mode,
            k,
            v,
            meta: s.alloc_zeros::<i32>(n_table + 2 * cfg.max_seqs).map_err(drv("alloc meta"))?,
            table: vec![0; n_table],
            slots: vec![Slot::default(); cfg.max_seqs],
            free: (0..cfg.pool_groups as u32).rev().collect(),
            refs: vec![0; cfg.pool_groups],
            deltas: Vec::new(),
            f_deltas: dev.function(Family::Model, &[], "apply_deltas")?,
            delta_buf: s.alloc_zeros::<i32>(max_deltas).map_err(drv("alloc deltas"))?,
            cfg,
        })
    }

    /// Delta capacity of one uploaded batch: a page and two counters per head of every slot.
    fn max_deltas_per_step(cfg: &GpuCacheConfig) -> usize {
        cfg.max_seqs * (cfg.n_kv_heads * 2 + 2)
    }

    pub fn n_table(&self) -> usize {
        self.table.len()
    }
    /// Offsets of seq_len and coded in `meta`.
    pub fn seq_len_at(&self) -> usize {
        self.table.len()
    }
    pub fn coded_at(&self) -> usize {
        self.table.len() + self.cfg.max_seqs
    }
    pub fn exact_slots(&self) -> usize {
        self.cfg.sink + self.cfg.ring_cap(self.row_mode)
    }
    pub fn ring_cap(&self) -> usize {
        self.cfg.ring_cap(self.row_mode)
    }

    fn slot(&self, slot: usize) -> Result<&Slot> {
        self.slots.get(slot).filter(|s| s.active).ok_or(CudaError::ShapeMismatch {
            op: "active cache slot",
            expected: self.cfg.max_seqs,
            got: slot,
        })
    }

    pub fn n_tokens(&self, slot: usize) -> Result<usize> {
        Ok(self.slot(slot)?.n_tokens)
    }
    /// Tokens held as codes (after the sinks).
    pub fn coded(&self, slot: usize) -> Result<usize> {
        Ok(self.slot(slot)?.coded)
    }
    pub fn is_active(&self, slot: usize) -> bool {
        self.slots.get(slot).is_some_and(|s| s.active)
    }
    pub fn free_groups(&self) -> usize {
        self.free.len()
    }

    /// A free slot, empty; `OutOfSlots` when all are in use.
    pub fn add_seq(&mut self) -> Result<usize> {
        let i = self
            .slots
            .iter()
            .position(|s| !s.active)
            .ok_or(CudaError::OutOfCapacity { what: "sequence slots", capacity: self.cfg.max_seqs })?;
        self.slots[i] = Slot { active: true, ..Slot::default() };
        self.set_counts(i);
        Ok(i)
    }

    /// Free a slot and release its pages (shared pages stay while a fork holds them).
    pub fn remove_seq(&mut self, slot: usize) -> Result<()> {
        self.slot(slot)?;
        let groups = std::mem::take(&mut self.slots[slot].groups);
        for g in groups {
            self.release(g);
        }
        self.slots[slot] = Slot::default();
        self.set_counts(slot);
        Ok(())
    }

    fn release(&mut self, g: u32) {
        let r = &mut self.refs[g as usize];
        *r -= 1;
        if *r == 0 {
            self.free.push(g);
        }
    }

    fn set_counts(&mut self, slot: usize) {
        let s = &self.slots[slot];
        let (n, c) = (s.n_tokens as i32, s.coded as i32);
        self.deltas.push(((self.seq_len_at() + slot) as i32, n));
        self.deltas.push(((self.coded_at() + slot) as i32, c));
    }

    fn set_page(&mut self, slot: usize, page: usize, group: u32) {
        let hk = self.cfg.n_kv_heads;
        for h in 0..hk {
            let idx = (slot * hk + h) * self.cfg.max_pages_per_seq + page;
            let phys = (group as usize * hk + h) as i32;
            self.table[idx] = phys;
            self.deltas.push((idx as i32, phys));
        }
    }

    fn alloc_group(&mut self) -> Result<u32> {
        let g = self
            .free
            .pop()
            .ok_or(CudaError::OutOfCapacity { what: "cache page pool", capacity: self.cfg.pool_groups })?;
        self.refs[g as usize] = 1;
        Ok(g)
    }

    /// Tokens held as codes after `n` tokens, from `coded0` (the CPU's window rule).
    pub fn coded_after(&self, n: usize, coded0: usize) -> usize {
        let (s, r, t) = (self.cfg.sink, self.cfg.recent, self.cfg.page_tokens);
        let old = n.saturating_sub(s);
        if self.row_mode {
            coded0.max(old.saturating_sub(r))
        } else {
            let ex = old.saturating_sub(coded0);
            if ex >= r + t {
                coded0 + (ex - r) / t * t
            } else {
                coded0
            }
        }
    }

    /// Plan appending `n` tokens to `slot` (same for every layer): pages allocated, the page
    /// table and counters recorded as deltas, a shared open page copied first (copy on
    /// write, on the stream now). The kernels must then run for every layer.
    pub fn plan_append(&mut self, slot: usize, n: usize, src_row: usize) -> Result<AppendRow> {
        let s = self.slot(slot)?.clone();
        let n1 = s.n_tokens + n;
        let coded1 = self.coded_after(n1, s.coded);
        let t = self.cfg.page_tokens;
        let pages1 = coded1.div_ceil(t);
        if pages1 > self.cfg.max_pages_per_seq {
            return Err(CudaError::OutOfCapacity { what: "pages per sequence", capacity: self.cfg.max_pages_per_seq });
        }
        let new_pages = pages1.saturating_sub(s.groups.len());
        if new_pages > self.free.len() {
            return Err(CudaError::OutOfCapacity { what: "cache page pool", capacity: self.cfg.pool_groups });
        }
        // The open page, shared with a fork, is written: give this slot its own copy.
        if coded1 > s.coded && s.coded % t != 0 {
            let p = s.coded / t;
            let g = s.groups[p];
            if self.refs[g as usize] > 1 {
                let ng = self.alloc_group()?;
                self.copy_group(g, ng)?;
                self.release(g);
                self.slots[slot].groups[p] = ng;
                self.set_page(slot, p, ng);
            }
        }
        for p in s.groups.len()..pages1 {
            let g = self.alloc_group()?;
            self.slots[slot].groups.push(g);
            self.set_page(slot, p, g);
        }
        let sl = &mut self.slots[slot];
        sl.n_tokens = n1;
        sl.coded = coded1;
        self.set_counts(slot);
        let i32c = |x: usize| i32::try_from(x).map_err(|_| CudaError::ShapeMismatch { op: "i32", expected: 0, got: x });
        Ok(AppendRow {
            slot: slot as i32,
            pos0: i32c(s.n_tokens)?,
            n: i32c(n)?,
            coded0: i32c(s.coded)?,
            coded1: i32c(coded1)?,
            src_row: i32c(src_row)?,
        })
    }

    /// Copy group `from`'s pages (every layer, both streams) to group `to` (≠ `from`).
    fn copy_group(&mut self, from: u32, to: u32) -> Result<()> {
        let hk = self.cfg.n_kv_heads;
        let st = self.dev.stream.clone();
        let mut copies = Vec::new();
        for strm in [&mut self.k, &mut self.v] {
            let pb = strm.fmt.page_bytes * hk;
            for pool in strm.pools.iter_mut() {
                copies.push(within(&st, pool, from as usize * pb, to as usize * pb, pb)?);
            }
        }
        copy_batch(&st, &copies)
    }

    /// A new slot holding the same tokens: pages shared (reference counts), the exact
    /// buffers copied.
    pub fn fork(&mut self, slot: usize) -> Result<usize> {
        let src = self.slot(slot)?.clone();
        let dst = self.add_seq()?;
        for &g in &src.groups {
            self.refs[g as usize] += 1;
        }
        for (p, &g) in src.groups.iter().enumerate() {
            self.set_page(dst, p, g);
        }
        let n = self.cfg.n_kv_heads * self.exact_slots() * self.cfg.head_dim;
        let st = self.dev.stream.clone();
        let mut copies = Vec::new();
        for strm in [&mut self.k, &mut self.v] {
            for ex in strm.exact.iter_mut() {
                copies.push(within(&st, ex, slot * n, dst * n, n)?);
            }
        }
        copy_batch(&st, &copies)?;
        self.slots[dst] = Slot { active: true, ..src };
        self.set_counts(dst);
        Ok(dst)
    }

    /// Drop the `n` newest tokens. Surviving tokens keep their stored form (the window's
    /// ring slots do not move; a partly kept page stays open in row mode). Page mode cannot
    /// keep a partly trimmed page on the device: refused, as the CPU would decode it back.
    pub fn trim(&mut self, slot: usize, n: usize) -> Result<()> {
        let s = self.slot(slot)?.clone();
        if n > s.n_tokens {
            return Err(CudaError::ShapeMismatch { op: "trim: tokens held", expected: s.n_tokens, got: n });
        }
        let n1 = s.n_tokens - n;
        let (sink, t) = (self.cfg.sink, self.cfg.page_tokens);
        let coded1 = s.coded.min(n1.saturating_sub(sink));
        if !self.row_mode && coded1 % t != 0 {
            return Err(CudaError::UnsupportedFormat {
                format: format!("{}/{}", self.cfg.k, self.cfg.v),
                why: "trimming into a page in page mode (the CPU decodes it back to fp16)",
            });
        }
        let keep = coded1.div_ceil(t);
        let dropped: Vec<u32> = self.slots[slot].groups.drain(keep..).collect();
        for g in dropped {
            self.release(g);
        }
        let sl = &mut self.slots[slot];
        sl.n_tokens = n1;
        sl.coded = coded1;
        self.set_counts(slot);
        Ok(())
    }

    /// Upload the pending deltas and apply them on the stream (outside captured graphs).
    pub fn sync_meta(&mut self) -> Result<()> {
        let cap = (self.delta_buf.len() - 1) / 2;
        while !self.deltas.is_empty() {
            let take = self.deltas.len().min(cap);
            let buf = encode_deltas(&self.deltas[..take]);
            self.deltas.drain(..take);
            let st = self.dev.stream.clone();
            st.memcpy_htod(&buf, &mut self.delta_buf.slice_mut(..buf.len())).map_err(drv("htod deltas"))?;
            self.launch_deltas(&st)?;
        }
        Ok(())
    }

    /// Table and counter writes waiting for `sync_meta` (or a step's upload).
    pub fn pending_deltas(&self) -> usize {
        self.deltas.len()
    }

    /// Whether table or counter writes wait for `sync_meta` (or a step's upload).
    pub fn has_pending_deltas(&self) -> bool {
        !self.deltas.is_empty()
    }

    /// The pending deltas as [count, (index, value)…] for a step's upload; the caller applies
    /// them with [`Self::launch_deltas_from`] inside its step.
    pub fn take_deltas(&mut self) -> Vec<(i32, i32)> {
        std::mem::take(&mut self.deltas)
    }

    fn launch_deltas(&mut self, st: &Arc<cudarc::driver::CudaStream>) -> Result<()> {
        let mut l = st.launch_builder(&self.f_deltas);
        l.arg(&self.delta_buf).arg(&mut self.meta);
        // SAFETY: apply_deltas(d, meta) reads d[0] ≤ capacity pairs; every index was produced
        // by set_page/set_counts, < meta.len().
        unsafe { l.launch(LaunchConfig { grid_dim: (1, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }) }
            .map_err(drv("apply_deltas"))?;
        Ok(())
    }

    /// Bytes one decode step of `slots` reads from layer `0`'s cache: pages and exact tokens.
    pub fn bytes_read(&self, slots: &[usize]) -> usize {
        let (hk, d, t) = (self.cfg.n_kv_heads, self.cfg.head_dim, self.cfg.page_tokens);
        let pb = self.k.fmt.page_bytes + self.v.fmt.page_bytes;
        slots
            .iter()
            .filter_map(|&s| self.slots.get(s).filter(|x| x.active))
            .map(|s| {
                let exact = s.n_tokens - s.coded;
                hk * (s.coded.div_ceil(t) * pb + exact * d * 4)
            })
            .sum()
    }

    /// Longest coded page count over `slots` (what a decode plan must cover).
    pub fn max_pages(&self, slots: &[usize]) -> usize {
        let t = self.cfg.page_tokens;
        slots.iter().filter_map(|&s| self.slots.get(s)).map(|s| s.coded.div_ceil(t)).max().unwrap_or(0)
    }

    /// Device bytes in use by `slot` alone, counted like the CPU's `resident_bytes` (pages,
    /// the page table's entries, the exact window and sinks, the rotation state).
    pub fn slot_bytes(&self, slot: usize) -> Result<usize> {
        let s = self.slot(slot)?;
        let (hk, d, l) = (self.cfg.n_kv_heads, self.cfg.head_dim, self.cfg.n_layers);
        let pb = self.k.fmt.page_bytes + self.v.fmt.page_bytes;
        let pages = s.groups.len() * hk * pb;
        let table = s.groups.len() * hk * 4;
        let exact = 2 * hk * self.exact_slots() * d * 2;
        let state = [&self.k.fmt, &self.v.fmt].iter().map(|f| f.state_bytes()).sum::<usize>() * hk;
        Ok(l * (pages + exact + state) + table)
    }

    /// Pages in use (groups held by some slot) and in the pool.
    pub fn pool_usage(&self) -> (usize, usize) {
        (self.cfg.pool_groups - self.free.len(), self.cfg.pool_groups)
    }

    /// The host's page table entry (tests).
    pub fn table_entry(&self, slot: usize, head: usize, page: usize) -> i32 {
        self.table[(slot * self.cfg.n_kv_heads + head) * self.cfg.max_pages_per_seq + page]
    }

    /// Shared group count (tests of fork).
    pub fn group_refs(&self, slot: usize) -> Result<Vec<u32>> {
        Ok(self.slot(slot)?.groups.iter().map(|&g| self.refs[g as usize]).collect())
    }
}

/// Deltas as the device reads them: [count, index₀, value₀, …], the last write to each index
/// only (the kernel applies them in parallel).
pub fn encode_deltas(d: &[(i32, i32)]) -> Vec<i32> {
    let mut seen = std::collections::HashSet::new();
    let mut last: Vec<(i32, i32)> = d.iter().rev().filter(|(i, _)| seen.insert(*i)).copied().collect();
    last.reverse();
    let mut out = Vec::with_capacity(1 + 2 * last.len());
    out.push(last.len() as i32);
    for (i, v) in last {
        out.push(i);
        out.push(v);
    }
    out
}

/// The device addresses (source, destination, bytes) of `len` elements of `buf` at `from`
/// and at `to`: disjoint ranges inside it (checked).
fn within<T: DeviceRepr>(
    st: &Arc<cudarc::driver::CudaStream>,
    buf: &CudaSlice<T>,
    from: usize,
    to: usize,
    len: usize,
) -> Result<(u64, u64, usize)> {
    let end = from.max(to).saturating_add(len);
    if from.abs_diff(to) < len || end > buf.len() {
        return Err(CudaError::ShapeMismatch { op: "copy within a buffer", expected: buf.len(), got: end });
    }
    let base = buf.device_ptr(st).0;
    let e = std::mem::size_of::<T>();
    Ok((base + (from * e) as u64, base + (to * e) as u64, len * e))
}

/// Device-to-device copies (source, destination, bytes), in stream order, by one driver call
/// (CUDA 13's batched copy): a fork's or a copy-on-write's two copies per layer at once.
fn copy_batch(st: &Arc<cudarc::driver::CudaStream>, copies: &[(u64, u64, usize)]) -> Result<()> {
    use cudarc::driver::sys;
    let copies: Vec<_> = copies.iter().filter(|c| c.2 > 0).collect();
    if copies.is_empty() {
        return Ok(());
    }
    let mut srcs: Vec<sys::CUdeviceptr> = copies.iter().map(|c| c.0).collect();
    let mut dsts: Vec<sys::CUdeviceptr> = copies.iter().map(|c| c.1).collect();
    let mut sizes: Vec<usize> = copies.iter().map(|c| c.2).collect();
    // SAFETY: all-zero bits are valid for this plain C struct (enums with a 0 variant, ints).
    let mut attr: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
    attr.srcAccessOrder = sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
    let mut attr_from = 0usize;
    // SAFETY: the three arrays hold `count` entries each and outlive the call (the driver
    // reads them before returning); every range lies inside a live allocation of this
    // context (`within` checked it) and pairs are disjoint; one attribute applies from copy 0;
    // the copies run in `st`'s order, after the writes queued before.
    unsafe {
        sys::cuMemcpyBatchAsync_v2(
            dsts.as_mut_ptr(),
            srcs.as_mut_ptr(),
            sizes.as_mut_ptr(),
            copies.len(),
            &mut attr,
            &mut attr_from,
            1,
            st.cu_stream(),
        )
    }
    .result()
    .map_err(drv("batched dtod copy"))
}
