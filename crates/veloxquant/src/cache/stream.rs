//! One stream (K or V) of one KV head: optional exact sink tokens (the first S of the
//! sequence), pages in the format, plus the fp16 tail.
//!
//! Two modes, fixed at construction. *Page mode*: the tail collects tokens and whole pages
//! of T are encoded once T tokens are older than the recent window R. *Row mode* (both
//! formats of the layer encode tokens independently): every token older than R is encoded
//! at once into the open (last, partly filled) page, so the tail holds exactly the R newest
//! tokens and no fp16 slack. Row mode produces the same page bytes as page mode.

use std::sync::Arc;

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::Page;
use crate::error::{Result, VqError};
use crate::format::Format;

#[derive(Clone, Debug)]
pub struct StreamStore {
    format: Arc<dyn Format>,
    pages: Vec<Page>,
    /// Rows filled in the last page when it is open (row mode), else 0.
    open_rows: usize,
    /// Newest tokens not yet encoded, n_tail × d, f16.
    tail: Vec<f16>,
    /// The first `n_sink` tokens of the sequence, kept exact (attention sinks), f16.
    sink: Vec<f16>,
    n_sink: usize,
    recent: usize,
    row_mode: bool,
}

impl StreamStore {
    /// An empty stream. The fp16 tail and sinks grow with the tokens they hold (doubling,
    /// capped at their full size R + slack and S), so a large window costs nothing until
    /// it fills; R and S beyond [`MAX_WINDOW_TOKENS`] are an `InvalidConfig` error.
    pub fn new(format: Arc<dyn Format>, recent: usize, row_mode: bool, n_sink: usize) -> Result<Self> {
        check_window(recent, n_sink)?;
        Ok(Self {
            format,
            pages: Vec::new(),
            open_rows: 0,
            tail: Vec::new(),
            sink: Vec::new(),
            n_sink,
            recent,
            row_mode,
        })
    }

    /// The sink tokens held so far (≤ n_sink), exact f16.
    pub fn sink(&self) -> &[f16] {
        &self.sink
    }

    pub fn format(&self) -> &dyn Format {
        self.format.as_ref()
    }

    pub(crate) fn format_arc(&self) -> &Arc<dyn Format> {
        &self.format
    }

    /// All pages; the last one holds only [`rows_in_page`](Self::rows_in_page) rows if open.
    pub fn pages(&self) -> &[Page] {
        &self.pages
    }

    /// Valid rows of page `p`.
    pub fn rows_in_page(&self, p: usize) -> usize {
        if self.open_rows > 0 && p + 1 == self.pages.len() {
            self.open_rows
        } else {
            self.format.page_tokens()
        }
    }

    /// Tokens held in pages (encoded).
    pub fn paged_tokens(&self) -> usize {
        let t = self.format.page_tokens();
        if self.open_rows > 0 {
            (self.pages.len() - 1) * t + self.open_rows
        } else {
            self.pages.len() * t
        }
    }

    pub fn tail(&self) -> &[f16] {
        &self.tail
    }

    pub fn tail_tokens(&self) -> usize {
        self.tail.len() / self.format.head_dim()
    }

    pub fn sink_tokens(&self) -> usize {
        self.sink.len() / self.format.head_dim()
    }

    /// Sinks + paged + tail.
    pub fn n_tokens(&self) -> usize {
        self.sink_tokens() + self.paged_tokens() + self.tail_tokens()
    }

    /// Rows filled in the open last page (row mode), 0 when every page is full.
    pub fn open_rows(&self) -> usize {
        self.open_rows
    }

    /// Tail capacity in tokens (the most the tail holds after an append).
    fn tail_cap(&self) -> usize {
        self.recent + if self.row_mode { 0 } else { self.format.page_tokens() - 1 }
    }

    /// A stream from saved parts, checked against the invariants `append` and `trim`
    /// keep: sinks fill first, at most R (+T−1 in page mode) tail tokens, open rows only
    /// in row mode, every page `page_bytes` long.
    pub(crate) fn from_parts(
        format: Arc<dyn Format>,
        recent: usize,
        row_mode: bool,
        n_sink: usize,
        parts: StreamParts,
    ) -> Result<Self> {
        let mut me = Self::new(format, recent, row_mode, n_sink)?;
        let (d, t, pb) = (me.format.head_dim(), me.format.page_tokens(), me.format.page_bytes());
        let bad = |why: String| Err(VqError::FileCorrupt(why));
        if parts.pages.iter().any(|p| p.len() != pb) {
            return bad(format!("a page is not {pb} bytes"));
        }
        if parts.open_rows >= t || (parts.open_rows > 0 && (!row_mode || parts.pages.is_empty())) {
            return bad(format!("open rows {} invalid for this page mode", parts.open_rows));
        }
        if !parts.tail.len().is_multiple_of(d) || !parts.sink.len().is_multiple_of(d) || parts.sink.len() > n_sink * d {
            return bad("tail or sink length is not whole tokens within the configured sizes".into());
        }
        if parts.tail.len() / d > me.tail_cap() {
            return bad(format!("tail holds {} tokens, more than {}", parts.tail.len() / d, me.tail_cap()));
        }
        let sink_full = parts.sink.len() == n_sink * d;
        if !sink_full && (!parts.pages.is_empty() || !parts.tail.is_empty()) {
            return bad("tokens after unfilled sink slots".into());
        }
        if parts.tail.iter().chain(&parts.sink).any(|v| !v.is_finite()) {
            return bad("non-finite value in the fp16 tail or sinks".into());
        }
        me.pages = parts.pages;
        me.open_rows = parts.open_rows;
        me.tail.extend_from_slice(&parts.tail);
        me.sink.extend_from_slice(&parts.sink);
        Ok(me)
    }

    /// Drop the `n` newest tokens (caller checked `n ≤ n_tokens()`): tail first, then pages,
    /// then sinks. Kept tokens keep their stored form — fp16 stays fp16, codes stay the bytes
    /// decode produced — so attention over them is unchanged; afterwards the tail may hold
    /// fewer than R tokens until appends refill it. In row mode a partly trimmed page stays
    /// as the open page. In page mode (formats encoded a page at a time; for KIVI the codes
    /// depend on the whole page's per-channel scales) a partly trimmed page is not kept, since
    /// it could not be completed by appends: its surviving rows return
    /// to the fp16 tail as the format decodes them, the one lossy step (the exact values
    /// are gone; keeping them would cost an fp16 copy of every page).
    pub(crate) fn trim(&mut self, n: usize) -> Result<()> {
        let (d, t) = (self.format.head_dim(), self.format.page_tokens());
        let from_tail = n.min(self.tail_tokens());
        let from_pages = (n - from_tail).min(self.paged_tokens());
        let from_sink = n - from_tail - from_pages;
        let keep = self.paged_tokens() - from_pages;
        let (full, rows) = (keep / t, keep % t);
        // Page mode: decode the partly kept page first, so an error changes nothing.
        let mut back = Vec::new();
        if !self.row_mode && from_pages > 0 && rows > 0 {
            let mut x = vec![0f32; t * d];
            self.format.decode_page(&self.pages[full], &mut x);
            back = x[..rows * d].iter().map(|&v| f16::from_f32(v)).collect();
            if let Some(i) = back.iter().position(|v| !v.is_finite()) {
                return Err(VqError::NonFinite { what: "trimmed page decoded to fp16", token: i / d, channel: i % d });
            }
        }
        self.tail.truncate(self.tail.len() - from_tail * d);
        if self.row_mode {
            self.pages.truncate(full + usize::from(rows > 0));
            self.open_rows = rows;
        } else if from_pages > 0 {
            self.pages.truncate(full);
            self.tail.clear(); // empty already: pages are trimmed only after the tail
            self.tail.extend_from_slice(&back);
        }
        self.sink.truncate(self.sink.len() - from_sink * d);
        Ok(())
    }

    /// Append n×d values (already checked finite), encoding what ages out of the window.
    pub fn append(&mut self, x: &[f32]) -> Result<()> {
        let (d, t) = (self.format.head_dim(), self.format.page_tokens());
        let cap_tokens = self.recent + if self.row_mode { 1 } else { t };
        let room = (self.n_sink * d).saturating_sub(self.sink.len()).min(x.len());
        grow(&mut self.sink, room, self.n_sink * d);
        extend_f16(&mut self.sink, &x[..room]);
        let mut rest = &x[room..];
        while !rest.is_empty() {
            let room = cap_tokens - self.tail_tokens();
            let take = room.min(rest.len() / d);
            grow(&mut self.tail, take * d, cap_tokens * d);
            extend_f16(&mut self.tail, &rest[..take * d]);
            rest = &rest[take * d..];
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        let (d, t) = (self.format.head_dim(), self.format.page_tokens());
        if self.row_mode {
            // One row at a time, on the stack up to d = 256 (a decode step makes one per
            // stream, head and layer).
            let mut row = crate::cpu::Scratch::<256>::new();
            let x = row.zeroed(d);
            while self.tail_tokens() > self.recent {
                self.tail[..d].convert_to_f32_slice(x);
                if self.open_rows == 0 {
                    self.pages.push(zeroed_page(self.format.page_bytes()));
                }
                let page = self.pages.last_mut().expect("a page was just ensured");
                // Copy on write if a fork shares this page.
                if Arc::get_mut(page).is_none() {
                    *page = Arc::from(&page[..]);
                }
                let buf = Arc::get_mut(page).expect("unique after copy");
                self.format.encode_row(x, buf, self.open_rows)?;
                self.open_rows = (self.open_rows + 1) % t;
                self.tail.drain(..d);
            }
            return Ok(());
        }
        while self.tail_tokens() >= self.recent + t {
            // Pages are encoded from the f16 values decode would have stored.
            let mut x = vec![0f32; t * d];
            self.tail[..t * d].convert_to_f32_slice(&mut x);
            let mut page = zeroed_page(self.format.page_bytes());
            // A page just made has no other reference, so get_mut cannot fail.
            self.format.encode_page(&x, Arc::get_mut(&mut page).expect("a new page is unshared"))?;
            self.pages.push(page);
            self.tail.drain(..t * d);
        }
        Ok(())
    }

    /// Each page's allocation (address, length): forks share allocations, and memory
    /// accounting over several caches counts each once.
    pub(crate) fn page_ptrs(&self) -> impl Iterator<Item = (*const u8, usize)> + '_ {
        self.pages.iter().map(|p| (p.as_ptr(), p.len()))
    }

    /// Bytes in use: pages with their counters, page-table entries, the fp16 tokens held
    /// (tail and sinks) and the format state; growth slack of the buffers is not counted.
    pub fn resident_bytes(&self) -> usize {
        self.pages.iter().map(|p| p.len() + ARC_HEADER).sum::<usize>()
            + self.pages.len() * std::mem::size_of::<Page>()
            + std::mem::size_of_val(self.tail.as_slice())
            + std::mem::size_of_val(self.sink.as_slice())
            + self.format.state_bytes()
    }
}

/// Tokens R or S may name: far above any model's context, low enough that R + T and the
/// buffer sizes derived from them cannot overflow.
pub const MAX_WINDOW_TOKENS: usize = 1 << 24;

/// R and S within [`MAX_WINDOW_TOKENS`].
pub(crate) fn check_window(recent: usize, n_sink: usize) -> Result<()> {
    if recent > MAX_WINDOW_TOKENS || n_sink > MAX_WINDOW_TOKENS {
        return Err(VqError::InvalidConfig(format!(
            "window R = {recent} or sinks S = {n_sink} exceed {MAX_WINDOW_TOKENS} tokens"
        )));
    }
    Ok(())
}

/// Appends `x` rounded to f16 (round to nearest even, as `f16::from_f32`; F16C where the
/// CPU has it).
fn extend_f16(v: &mut Vec<f16>, x: &[f32]) {
    let old = v.len();
    v.resize(old + x.len(), f16::ZERO);
    v[old..].convert_from_f32_slice(x);
}

/// Values a window reserves at once when it first grows (16 tokens of d = 128).
const SMALL_WINDOW: usize = 2048;

/// Room for `extra` more values: capacity doubles, but never past `cap` (the buffer's full
/// size), so a full window holds exactly its size and an unfilled one at most twice what
/// it holds, or [`SMALL_WINDOW`] values.
fn grow(v: &mut Vec<f16>, extra: usize, cap: usize) {
    let need = v.len() + extra;
    if need > v.capacity() {
        // Small windows at once (a decode step appends one token: 1, 2, 4, 8 tokens were
        // four reallocations and copies per stream of a short sequence).
        let target = need.max(v.capacity().saturating_mul(2).min(cap)).max(cap.min(SMALL_WINDOW));
        v.reserve_exact(target - v.len());
    }
}

/// A page of `n` zero bytes, allocated once (an exact-size iterator collects in place; a
/// `Vec` into an `Arc` allocates and copies again).
fn zeroed_page(n: usize) -> Page {
    std::iter::repeat_n(0u8, n).collect()
}

/// The strong and weak counts in front of each page's bytes.
pub(crate) const ARC_HEADER: usize = 2 * std::mem::size_of::<usize>();

/// A stream's saved contents (see [`StreamStore::from_parts`]).
pub(crate) struct StreamParts {
    pub pages: Vec<Page>,
    pub open_rows: usize,
    pub tail: Vec<f16>,
    pub sink: Vec<f16>,
}
