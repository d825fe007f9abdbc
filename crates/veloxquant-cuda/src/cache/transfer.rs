//! Moving data in and out of the device cache: host appends (tests, uploads), the
//! benchmark's random fill, downloads to the CPU cache's contents and uploads from them.

use half::f16;
use veloxquant::cache::{CacheContents, StreamContents};
use veloxquant::{CacheConfig, PagedCache};

use super::{AppendSrc, GpuKvCache};
use crate::error::{drv, CudaError, Result};

impl GpuKvCache {
    /// Host convenience (tests, uploads): append `n` tokens to `slot`, one `(k, v)` pair per
    /// layer, each `[kv_head][n][d]` f32 (the CPU cache's layout), finite.
    pub fn append(&mut self, slot: usize, kv: &[(&[f32], &[f32])], n: usize) -> Result<()> {
        let (hk, d) = (self.cfg.n_kv_heads, self.cfg.head_dim);
        if kv.len() != self.cfg.n_layers {
            return Err(CudaError::ShapeMismatch { op: "append: layers", expected: self.cfg.n_layers, got: kv.len() });
        }
        for (k, v) in kv {
            for x in [k, v] {
                if x.len() != hk * n * d {
                    return Err(CudaError::ShapeMismatch {
                        op: "append: [kv][n][d]",
                        expected: hk * n * d,
                        got: x.len(),
                    });
                }
            }
            veloxquant::cache::check_kv_finite(k, v, d)?;
        }
        if n == 0 {
            return Ok(());
        }
        let row = self.plan_append(slot, n, 0)?;
        self.sync_meta()?;
        let st = self.dev.stream.clone();
        let rows = st.clone_htod(&[row]).map_err(drv("htod"))?;
        let tok_major = |x: &[f32]| -> Vec<f32> {
            let mut o = vec![0f32; x.len()];
            for h in 0..hk {
                for t in 0..n {
                    o[(t * hk + h) * d..(t * hk + h + 1) * d].copy_from_slice(&x[(h * n + t) * d..(h * n + t + 1) * d]);
                }
            }
            o
        };
        for (layer, (k, v)) in kv.iter().enumerate() {
            let kd = st.clone_htod(&tok_major(k)).map_err(drv("htod"))?;
            let vd = st.clone_htod(&tok_major(v)).map_err(drv("htod"))?;
            let ks = AppendSrc { data: kd.slice(..), stride: hk * d };
            let vs = AppendSrc { data: vd.slice(..), stride: hk * d };
            let enc = (row.coded1 - row.coded0) as usize;
            self.launch_append(layer, &rows.slice(..), 1, n, enc, &ks, &vs, &st)?;
        }
        Ok(())
    }

    /// Benchmark fill: every slot `b < lens.len()` becomes a sequence of `lens[b]` tokens of
    /// N(0,1) data generated on the device (pages shuffled across the pool so the page table
    /// really scatters), for every layer. Returns the K encode time of layer 0's first chunk in ms.
    pub fn fill_random(&mut self, lens: &[usize], seed: u64) -> Result<f32> {
        let (hk, d, t) = (self.cfg.n_kv_heads, self.cfg.head_dim, self.cfg.page_tokens);
        let mut slots = Vec::new();
        for &n in lens {
            let s = self.add_seq()?;
            slots.push((s, n));
        }
        // Shuffle the free list so consecutive logical pages land far apart.
        let mut rng = veloxquant::rng::SplitMix64::new(seed ^ 0xABCD);
        for i in (1..self.free.len()).rev() {
            let j = (rng.next_u64() % (i as u64 + 1)) as usize;
            self.free.swap(i, j);
        }
        let mut jobs = Vec::new(); // (slot, head, physical page)
        for &(s, n) in &slots {
            let coded = self.coded_after(n, 0);
            let full = coded.div_ceil(t);
            for p in 0..full {
                let g = self.alloc_group()?;
                self.slots[s].groups.push(g);
                self.set_page(s, p, g);
                for h in 0..hk {
                    jobs.push((s, h, g as usize * hk + h));
                }
            }
            let sl = &mut self.slots[s];
            sl.n_tokens = n;
            sl.coded = coded;
            self.set_counts(s);
        }
        self.sync_meta()?;
        let st = self.dev.stream.clone();
        // Encoded in chunks of at most CHUNK pages (the N(0,1) input is generated per chunk).
        const CHUNK: usize = 1 << 15;
        let n_chunk = jobs.len().clamp(1, CHUNK);
        let mut x = st.alloc_zeros::<u16>(n_chunk * t * d).map_err(drv("alloc"))?;
        let mut ms = 0.0;
        let xs = self.exact_slots();
        for layer in 0..self.cfg.n_layers {
            for (si, strm) in [&mut self.k, &mut self.v].into_iter().enumerate() {
                let lseed = seed.wrapping_add((layer * 2 + si) as u64 * 7919);
                for (ci, chunk) in jobs.chunks(CHUNK).enumerate() {
                    let pid: Vec<i32> = chunk.iter().map(|j| j.2 as i32).collect();
                    let hid: Vec<i32> = chunk.iter().map(|j| j.1 as i32).collect();
                    let pid = st.clone_htod(&pid).map_err(drv("htod"))?;
                    let hid = st.clone_htod(&hid).map_err(drv("htod"))?;
                    let n_vals = chunk.len() * t * d;
                    crate::bench_util::fill_normal_f16(&self.dev, &mut x, n_vals, lseed.wrapping_add(ci as u64))?;
                    let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
                    let e0 = self.dev.ctx.new_event(timing).map_err(drv("event"))?;
                    let e1 = self.dev.ctx.new_event(timing).map_err(drv("event"))?;
                    e0.record(&st).map_err(drv("record"))?;
                    let signs = super::layer_transform(&strm.signs, &strm.fmt, layer, hk);
                    strm.enc.launch(&x, chunk.len(), &pid, &hid, &mut strm.pools[layer], &signs, strm.rot_scale)?;
                    e1.record(&st).map_err(drv("record"))?;
                    if layer == 0 && si == 0 && ci == 0 {
                        e1.synchronize().map_err(drv("sync"))?;
                        ms = e0.elapsed_ms(&e1).map_err(drv("elapsed"))?;
                    }
                }
                // The exact tokens (sinks and window): random, from the host.
                let mut buf = vec![0u16; self.cfg.max_seqs * hk * xs * d];
                let mut hr = veloxquant::rng::SplitMix64::new(lseed ^ 0x7A11);
                for &(s, _) in &slots {
                    for v in &mut buf[s * hk * xs * d..(s + 1) * hk * xs * d] {
                        *v = f16::from_f32(hr.next_gaussian() as f32).to_bits();
                    }
                }
                st.memcpy_htod(&buf, &mut strm.exact[layer]).map_err(drv("htod exact"))?;
            }
        }
        st.synchronize().map_err(drv("sync"))?;
        Ok(ms)
    }

    /// A slot's contents, `[layer][head]` × (K, V), downloaded (synchronizes the stream).
    pub fn download(&self, slot: usize) -> Result<CacheContents> {
        let s = self.slot(slot)?.clone();
        let (hk, d, t, sink) = (self.cfg.n_kv_heads, self.cfg.head_dim, self.cfg.page_tokens, self.cfg.sink);
        let xs = self.exact_slots();
        let ring = self.ring_cap();
        let st = self.dev.stream.clone();
        let n_sink = s.n_tokens.min(sink);
        let w0 = sink + s.coded;
        let n_tail = s.n_tokens.saturating_sub(w0);
        let open = if self.row_mode { s.coded % t } else { 0 };
        let mut out = Vec::with_capacity(self.cfg.n_layers);
        for layer in 0..self.cfg.n_layers {
            let mut heads = Vec::with_capacity(hk);
            for h in 0..hk {
                let mut pair: [StreamContents; 2] = Default::default();
                let to_f16 = |x: &[u16]| x.iter().map(|&b| f16::from_bits(b)).collect::<Vec<f16>>();
                for (si, strm) in [&self.k, &self.v].into_iter().enumerate() {
                    let pb = strm.fmt.page_bytes;
                    let mut pages = Vec::with_capacity(s.groups.len());
                    for (p, &g) in s.groups.iter().enumerate() {
                        let phys = g as usize * hk + h;
                        let mut bytes = vec![0u8; pb];
                        st.memcpy_dtoh(&strm.pools[layer].slice(phys * pb..(phys + 1) * pb), &mut bytes)
                            .map_err(drv("dtoh page"))?;
                        if open > 0 && p + 1 == s.groups.len() {
                            strm.fmt.clear_rows_from(&mut bytes, open);
                        }
                        pages.push(bytes);
                    }
                    let base = (slot * hk + h) * xs * d;
                    let mut ex = vec![0u16; xs * d];
                    st.memcpy_dtoh(&strm.exact[layer].slice(base..base + xs * d), &mut ex)
                        .map_err(drv("dtoh exact"))?;
                    let sink_v = to_f16(&ex[..n_sink * d]);
                    let mut tail = Vec::with_capacity(n_tail * d);
                    for j in w0..w0 + n_tail {
                        let x = sink + (j - sink) % ring;
                        tail.extend(to_f16(&ex[x * d..(x + 1) * d]));
                    }
                    pair[si] = StreamContents { pages, open_rows: open, tail, sink: sink_v };
                }
                let [k, v] = pair;
                heads.push((k, v));
            }
            out.push(heads);
        }
        Ok(out)
    }

    /// A slot as a CPU cache (`PagedCache::from_contents`): save it with the cache file
    /// format, continue it on the CPU. `cpu` must be the config this cache mirrors.
    pub fn to_paged_cache(&self, slot: usize, cpu: &CacheConfig) -> Result<PagedCache> {
        self.check_mirrors(cpu)?;
        let cache = PagedCache::from_contents(cpu.clone(), self.download(slot)?)?;
        self.check_states(&cache)?;
        Ok(cache)
    }

    /// A new slot holding what `cache` holds (e.g. one loaded from a cache file): pages
    /// uploaded to freshly allocated pages, the window into its ring slots, the sinks.
    pub fn upload(&mut self, cache: &PagedCache) -> Result<usize> {
        self.check_mirrors(cache.config())?;
        self.check_states(cache)?;
        if cache.row_mode() != self.row_mode {
            return Err(CudaError::UnsupportedFormat {
                format: format!("{}", cache.config().k),
                why: "row mode differs",
            });
        }
        let contents = cache.contents();
        let (hk, d, t, sink) = (self.cfg.n_kv_heads, self.cfg.head_dim, self.cfg.page_tokens, self.cfg.sink);
        let n = cache.n_tokens(0)?;
        let first = &contents[0][0].0;
        let coded = first.pages.len() * t - if first.open_rows > 0 { t - first.open_rows } else { 0 };
        let pages = first.pages.len();
        if pages > self.cfg.max_pages_per_seq || pages > self.free.len() || n > sink + coded + self.ring_cap() {
            return Err(CudaError::OutOfCapacity {
                what: "cache slot for the upload",
                capacity: self.cfg.max_pages_per_seq,
            });
        }
        let slot = self.add_seq()?;
        for p in 0..pages {
            let g = self.alloc_group()?;
            self.slots[slot].groups.push(g);
            self.set_page(slot, p, g);
        }
        {
            let sl = &mut self.slots[slot];
            sl.n_tokens = n;
            sl.coded = coded;
        }
        self.set_counts(slot);
        let st = self.dev.stream.clone();
        let (xs, ring) = (self.exact_slots(), self.ring_cap());
        let groups = self.slots[slot].groups.clone();
        let w0 = sink + coded;
        for (layer, heads) in contents.iter().enumerate() {
            for (h, (k, v)) in heads.iter().enumerate() {
                for (strm, c) in [(&mut self.k, k), (&mut self.v, v)] {
                    let pb = strm.fmt.page_bytes;
                    for (p, bytes) in c.pages.iter().enumerate() {
                        let phys = groups[p] as usize * hk + h;
                        st.memcpy_htod(bytes, &mut strm.pools[layer].slice_mut(phys * pb..(phys + 1) * pb))
                            .map_err(drv("htod page"))?;
                    }
                    let mut ex = vec![0u16; xs * d];
                    for (i, x) in c.sink.iter().enumerate() {
                        ex[i] = x.to_bits();
                    }
                    for (i, tok) in c.tail.chunks_exact(d).enumerate() {
                        let x = sink + (w0 + i - sink) % ring;
                        for (e, v) in tok.iter().enumerate() {
                            ex[x * d + e] = v.to_bits();
                        }
                    }
                    let base = (slot * hk + h) * xs * d;
                    st.memcpy_htod(&ex, &mut strm.exact[layer].slice_mut(base..base + xs * d))
                        .map_err(drv("htod exact"))?;
                }
            }
        }
        Ok(slot)
    }

    /// Whether a calibrated format's instances in `cpu` hold this cache's states (their codes
    /// mean what this cache's kernels read).
    fn check_states(&self, cpu: &PagedCache) -> Result<()> {
        let hk = self.cfg.n_kv_heads;
        for (strm, values) in [(&self.k, false), (&self.v, true)] {
            for (i, want) in strm.states.iter().enumerate() {
                let layer = cpu.layer(i / hk)?;
                let store = if values { &layer.values[i % hk] } else { &layer.keys[i % hk] };
                if store.format().export_state() != *want {
                    return Err(CudaError::UnsupportedFormat {
                        format: strm.fmt.spec.to_string(),
                        why: "the CPU cache's calibrated state differs from this device cache's",
                    });
                }
            }
        }
        Ok(())
    }

    /// Whether `cpu` describes this cache (formats, shape, windows, seed).
    fn check_mirrors(&self, cpu: &CacheConfig) -> Result<()> {
        let c = &self.cfg;
        let same = cpu.n_layers == c.n_layers
            && cpu.n_kv_heads == c.n_kv_heads
            && cpu.head_dim == c.head_dim
            && cpu.page_tokens == c.page_tokens
            && cpu.recent == c.recent
            && cpu.sink == c.sink
            && cpu.k == c.k
            && cpu.v == c.v
            && cpu.seed == c.seed
            // The device cache has one K and one V format for every layer.
            && cpu.is_uniform();
        if !same {
            return Err(CudaError::UnsupportedFormat {
                format: format!("{}/{}", cpu.k, cpu.v),
                why: "the CPU cache's config is not the one this device cache mirrors",
            });
        }
        Ok(())
    }
}
