//! A device-resident paged cache for one layer and a batch of sequences.
//!
//! Page table = metadata (host copy + device copy, `[seq][kv_head][page]` → physical page);
//! stores = one device allocation of pages per stream (K, V); the fp16 tail of each
//! (sequence, KV head) lives on device in `[seq][kv_head][R + T][d]`. Tokens flush to pages
//! exactly as in the CPU cache (`paged_tokens(n) = T·⌊max(0, n − R)/T⌋`), encoded on the GPU
//! from the same f16 values the CPU encodes, so pages are byte-identical to the CPU's.

use std::sync::Arc;

use cudarc::driver::CudaSlice;
use half::f16;
use veloxquant::rng::derive_seed;
use veloxquant::FormatSpec;

use crate::device::GpuDevice;
use crate::encode::{GpuEncoder, InputKind};
use crate::error::{drv, CudaError, Result};
use crate::format::GpuFormat;

#[derive(Clone, Debug)]
pub struct GpuCacheConfig {
    pub n_seqs: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub page_tokens: usize,
    pub recent: usize,
    pub k: FormatSpec,
    pub v: FormatSpec,
    /// Base seed and layer index: rotations match `PagedCache` with the same seed.
    pub seed: u64,
    pub layer: usize,
    /// Page-table width per (sequence, KV head).
    pub max_pages_per_seq: usize,
}

impl GpuCacheConfig {
    pub fn paged_tokens(&self, n: usize) -> usize {
        n.saturating_sub(self.recent) / self.page_tokens * self.page_tokens
    }
}

pub struct Stream {
    pub fmt: GpuFormat,
    pub enc: GpuEncoder,
    pub pool: CudaSlice<u8>,
    pub signs: CudaSlice<f32>,
    pub rot_scale: f32,
    pub tail: CudaSlice<u16>,
}

pub struct GpuPagedCache {
    pub dev: Arc<GpuDevice>,
    pub cfg: GpuCacheConfig,
    pub k: Stream,
    pub v: Stream,
    pub capacity_pages: usize,
    next_page: usize,
    page_table: Vec<i32>,
    n_pages: Vec<i32>,
    n_tail: Vec<i32>,
    pub page_table_dev: CudaSlice<i32>,
    pub n_pages_dev: CudaSlice<i32>,
    pub n_tail_dev: CudaSlice<i32>,
    host_tails: Vec<[Vec<u16>; 2]>,
    n_tokens: Vec<usize>,
    dirty: bool,
}

fn make_stream(
    dev: &Arc<GpuDevice>,
    cfg: &GpuCacheConfig,
    spec: &FormatSpec,
    stream_id: u64,
    capacity_pages: usize,
) -> Result<Stream> {
    let (d, t) = (cfg.head_dim, cfg.page_tokens);
    let mut signs = Vec::with_capacity(cfg.n_kv_heads * d);
    let mut fmt0 = None;
    let mut rot_scale = 1.0;
    for h in 0..cfg.n_kv_heads {
        let seed = derive_seed(cfg.seed, &[cfg.layer as u64, h as u64, stream_id]);
        let f = GpuFormat::new(spec, d, t, seed)?;
        let (s, sc) = f.signs_or_ones();
        signs.extend(s);
        rot_scale = sc;
        fmt0.get_or_insert(f);
    }
    let fmt = fmt0.ok_or(CudaError::ShapeMismatch { op: "cache heads", expected: 1, got: 0 })?;
    let enc = GpuEncoder::new(dev, &fmt, InputKind::F16)?;
    let s = &dev.stream;
    let tail_cap = cfg.recent + t;
    Ok(Stream {
        pool: s.alloc_zeros::<u8>(capacity_pages.max(1) * fmt.page_bytes).map_err(drv("alloc pool"))?,
        signs: s.clone_htod(&signs).map_err(drv("htod"))?,
        rot_scale,
        tail: s.alloc_zeros::<u16>(cfg.n_seqs * cfg.n_kv_heads * tail_cap * d).map_err(drv("alloc tail"))?,
        fmt,
        enc,
    })
}

impl GpuPagedCache {
    pub fn new(dev: &Arc<GpuDevice>, cfg: GpuCacheConfig) -> Result<Self> {
        let capacity_pages = cfg.n_seqs * cfg.n_kv_heads * cfg.max_pages_per_seq;
        let k = make_stream(dev, &cfg, &cfg.k, 0, capacity_pages)?;
        let v = make_stream(dev, &cfg, &cfg.v, 1, capacity_pages)?;
        let s = &dev.stream;
        let n_rows = cfg.n_seqs * cfg.n_kv_heads;
        let page_table = vec![0i32; n_rows * cfg.max_pages_per_seq.max(1)];
        Ok(Self {
            dev: dev.clone(),
            k,
            v,
            capacity_pages,
            next_page: 0,
            page_table_dev: s.clone_htod(&page_table).map_err(drv("htod"))?,
            n_pages_dev: s.alloc_zeros::<i32>(cfg.n_seqs).map_err(drv("alloc"))?,
            n_tail_dev: s.alloc_zeros::<i32>(cfg.n_seqs).map_err(drv("alloc"))?,
            page_table,
            n_pages: vec![0; cfg.n_seqs],
            n_tail: vec![0; cfg.n_seqs],
            host_tails: (0..n_rows).map(|_| [Vec::new(), Vec::new()]).collect(),
            n_tokens: vec![0; cfg.n_seqs],
            dirty: false,
            cfg,
        })
    }

    pub fn tail_cap(&self) -> usize {
        self.cfg.recent + self.cfg.page_tokens
    }
    pub fn n_tokens(&self, seq: usize) -> usize {
        self.n_tokens[seq]
    }
    pub fn n_pages(&self, seq: usize) -> usize {
        self.n_pages[seq] as usize
    }
    pub fn max_pages(&self) -> usize {
        self.n_pages.iter().copied().max().unwrap_or(0) as usize
    }

    fn alloc_page(&mut self) -> Result<i32> {
        if self.next_page >= self.capacity_pages {
            return Err(CudaError::ShapeMismatch {
                op: "page pool capacity",
                expected: self.capacity_pages,
                got: self.next_page + 1,
            });
        }
        self.next_page += 1;
        Ok((self.next_page - 1) as i32)
    }

    /// Append `n` tokens to sequence `seq`: k and v are [n_kv_heads][n][d] f32 (finite).
    pub fn append(&mut self, seq: usize, k: &[f32], v: &[f32], n: usize) -> Result<()> {
        let (hk, d, t, r) = (self.cfg.n_kv_heads, self.cfg.head_dim, self.cfg.page_tokens, self.cfg.recent);
        for x in [k, v] {
            if x.len() != hk * n * d {
                return Err(CudaError::ShapeMismatch { op: "gpu append", expected: hk * n * d, got: x.len() });
            }
        }
        veloxquant::cache::check_kv_finite(k, v, d)?;
        let mut jobs: Vec<(i32, i32)> = Vec::new();
        let (mut kx, mut vx) = (Vec::<u16>::new(), Vec::<u16>::new());
        let mut new_pages = 0usize;
        for h in 0..hk {
            let row = seq * hk + h;
            for (si, x) in [k, v].into_iter().enumerate() {
                self.host_tails[row][si]
                    .extend(x[h * n * d..(h + 1) * n * d].iter().map(|&y| f16::from_f32(y).to_bits()));
            }
            let mut flushed = 0;
            while self.host_tails[row][0].len() / d >= r + t {
                let pidx = self.n_pages[seq] as usize + flushed;
                if pidx >= self.cfg.max_pages_per_seq {
                    return Err(CudaError::ShapeMismatch {
                        op: "max_pages_per_seq",
                        expected: self.cfg.max_pages_per_seq,
                        got: pidx + 1,
                    });
                }
                let phys = self.alloc_page()?;
                self.page_table[row * self.cfg.max_pages_per_seq + pidx] = phys;
                jobs.push((phys, h as i32));
                kx.extend(self.host_tails[row][0].drain(..t * d));
                vx.extend(self.host_tails[row][1].drain(..t * d));
                flushed += 1;
            }
            new_pages = flushed;
        }
        self.n_pages[seq] += new_pages as i32;
        self.n_tokens[seq] += n;
        self.n_tail[seq] = (self.host_tails[seq * hk][0].len() / d) as i32;
        if !jobs.is_empty() {
            self.encode_jobs(&jobs, &kx, &vx)?;
        }
        self.upload_tail(seq)?;
        self.dirty = true;
        Ok(())
    }

    fn encode_jobs(&mut self, jobs: &[(i32, i32)], kx: &[u16], vx: &[u16]) -> Result<()> {
        let s = self.dev.stream.clone();
        let pid: Vec<i32> = jobs.iter().map(|j| j.0).collect();
        let hid: Vec<i32> = jobs.iter().map(|j| j.1).collect();
        let pid = s.clone_htod(&pid).map_err(drv("htod"))?;
        let hid = s.clone_htod(&hid).map_err(drv("htod"))?;
        let kd = s.clone_htod(kx).map_err(drv("htod"))?;
        let vd = s.clone_htod(vx).map_err(drv("htod"))?;
        let k = &mut self.k;
        k.enc.launch(&kd, jobs.len(), &pid, &hid, &mut k.pool, &k.signs, k.rot_scale)?;
        let v = &mut self.v;
        v.enc.launch(&vd, jobs.len(), &pid, &hid, &mut v.pool, &v.signs, v.rot_scale)?;
        Ok(())
    }

    fn upload_tail(&mut self, seq: usize) -> Result<()> {
        let (hk, d, cap) = (self.cfg.n_kv_heads, self.cfg.head_dim, self.tail_cap());
        let mut kbuf = vec![0u16; hk * cap * d];
        let mut vbuf = vec![0u16; hk * cap * d];
        for h in 0..hk {
            let tails = &self.host_tails[seq * hk + h];
            kbuf[h * cap * d..h * cap * d + tails[0].len()].copy_from_slice(&tails[0]);
            vbuf[h * cap * d..h * cap * d + tails[1].len()].copy_from_slice(&tails[1]);
        }
        let at = seq * hk * cap * d;
        let s = self.dev.stream.clone();
        s.memcpy_htod(&kbuf, &mut self.k.tail.slice_mut(at..at + kbuf.len())).map_err(drv("htod tail"))?;
        s.memcpy_htod(&vbuf, &mut self.v.tail.slice_mut(at..at + vbuf.len())).map_err(drv("htod tail"))?;
        Ok(())
    }

    /// Benchmark fill: every sequence gets `lens[b]` tokens of N(0,1) data generated on the
    /// device and encoded in one launch per stream; physical pages are shuffled so the page
    /// table really scatters. Returns the encode time of the K stream in ms (one launch).
    pub fn fill_random(&mut self, lens: &[usize], seed: u64) -> Result<f32> {
        let (hk, d, t) = (self.cfg.n_kv_heads, self.cfg.head_dim, self.cfg.page_tokens);
        let mut jobs = Vec::new();
        for (b, &n) in lens.iter().enumerate() {
            let np = self.cfg.paged_tokens(n) / t;
            for h in 0..hk {
                for p in 0..np {
                    let phys = self.alloc_page()?;
                    self.page_table[(b * hk + h) * self.cfg.max_pages_per_seq + p] = phys;
                    jobs.push((b, h, p));
                }
            }
            self.n_pages[b] = np as i32;
            self.n_tokens[b] = n;
        }
        // Shuffle physical pages (Fisher–Yates over the used table entries).
        let mut rng = veloxquant::rng::SplitMix64::new(seed ^ 0xABCD);
        let slots: Vec<usize> = jobs.iter().map(|&(b, h, p)| (b * hk + h) * self.cfg.max_pages_per_seq + p).collect();
        for i in (1..slots.len()).rev() {
            let j = (rng.next_u64() % (i as u64 + 1)) as usize;
            self.page_table.swap(slots[i], slots[j]);
        }
        let s = self.dev.stream.clone();
        let pid: Vec<i32> = slots.iter().map(|&i| self.page_table[i]).collect();
        let hid: Vec<i32> = jobs.iter().map(|j| j.1 as i32).collect();
        let pid = s.clone_htod(&pid).map_err(drv("htod"))?;
        let hid = s.clone_htod(&hid).map_err(drv("htod"))?;
        let n_vals = jobs.len() * t * d;
        let mut x = s.alloc_zeros::<u16>(n_vals.max(1)).map_err(drv("alloc"))?;
        let mut ms = 0.0;
        for (si, st) in [&mut self.k, &mut self.v].into_iter().enumerate() {
            crate::bench_util::fill_normal_f16(&self.dev, &mut x, n_vals, seed.wrapping_add(si as u64 * 7919))?;
            let e0 = self
                .dev
                .ctx
                .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(drv("event"))?;
            let e1 = self
                .dev
                .ctx
                .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(drv("event"))?;
            e0.record(&s).map_err(drv("record"))?;
            st.enc.launch(&x, jobs.len(), &pid, &hid, &mut st.pool, &st.signs, st.rot_scale)?;
            e1.record(&s).map_err(drv("record"))?;
            e1.synchronize().map_err(drv("sync"))?;
            if si == 0 {
                ms = e0.elapsed_ms(&e1).map_err(drv("elapsed"))?;
            }
        }
        // Tails: the tokens after the last full page, random on the host.
        let mut hrng = veloxquant::rng::SplitMix64::new(seed ^ 0x7A11);
        for (b, &n) in lens.iter().enumerate() {
            let nt = n - self.cfg.paged_tokens(n);
            for h in 0..hk {
                for si in 0..2 {
                    self.host_tails[b * hk + h][si] =
                        (0..nt * d).map(|_| f16::from_f32(hrng.next_gaussian() as f32).to_bits()).collect();
                }
            }
            self.n_tail[b] = nt as i32;
            self.upload_tail(b)?;
        }
        self.dirty = true;
        self.sync_tables()?;
        Ok(ms)
    }

    /// Upload the page table and counts if they changed.
    pub fn sync_tables(&mut self) -> Result<()> {
        if self.dirty {
            let s = self.dev.stream.clone();
            s.memcpy_htod(&self.page_table, &mut self.page_table_dev).map_err(drv("htod"))?;
            s.memcpy_htod(&self.n_pages, &mut self.n_pages_dev).map_err(drv("htod"))?;
            s.memcpy_htod(&self.n_tail, &mut self.n_tail_dev).map_err(drv("htod"))?;
            self.dirty = false;
        }
        Ok(())
    }

    /// Bytes a decode step reads from the cache: all pages plus the tails.
    pub fn bytes_read(&self) -> usize {
        let pages: usize = self.n_pages.iter().map(|&n| n as usize).sum::<usize>() * self.cfg.n_kv_heads;
        let tail: usize = self.n_tail.iter().map(|&n| n as usize).sum::<usize>() * self.cfg.n_kv_heads;
        pages * (self.k.fmt.page_bytes + self.v.fmt.page_bytes) + tail * self.cfg.head_dim * 4
    }
}
