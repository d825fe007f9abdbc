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

use super::Page;
use crate::error::Result;
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
    pub fn new(format: Arc<dyn Format>, recent: usize, row_mode: bool, n_sink: usize) -> Self {
        let slack = if row_mode { 1 } else { format.page_tokens() };
        let d = format.head_dim();
        let tail = Vec::with_capacity((recent + slack) * d);
        let sink = Vec::with_capacity(n_sink * d);
        Self { format, pages: Vec::new(), open_rows: 0, tail, sink, n_sink, recent, row_mode }
    }

    /// The sink tokens held so far (≤ n_sink), exact f16.
    pub fn sink(&self) -> &[f16] {
        &self.sink
    }

    pub fn format(&self) -> &dyn Format {
        self.format.as_ref()
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

    /// Append n×d values (already checked finite), encoding what ages out of the window.
    pub fn append(&mut self, x: &[f32]) -> Result<()> {
        let (d, t) = (self.format.head_dim(), self.format.page_tokens());
        let cap_tokens = self.recent + if self.row_mode { 1 } else { t };
        let room = (self.n_sink * d).saturating_sub(self.sink.len()).min(x.len());
        self.sink.extend(x[..room].iter().map(|&v| f16::from_f32(v)));
        let mut rest = &x[room..];
        while !rest.is_empty() {
            let room = cap_tokens - self.tail_tokens();
            let take = room.min(rest.len() / d);
            self.tail.extend(rest[..take * d].iter().map(|&v| f16::from_f32(v)));
            rest = &rest[take * d..];
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        let (d, t) = (self.format.head_dim(), self.format.page_tokens());
        if self.row_mode {
            while self.tail_tokens() > self.recent {
                let x: Vec<f32> = self.tail[..d].iter().map(|v| v.to_f32()).collect();
                if self.open_rows == 0 {
                    self.pages.push(vec![0u8; self.format.page_bytes()].into());
                }
                let page = self.pages.last_mut().expect("a page was just ensured");
                // Copy on write if a fork shares this page.
                if Arc::get_mut(page).is_none() {
                    *page = Arc::from(&page[..]);
                }
                let buf = Arc::get_mut(page).expect("unique after copy");
                self.format.encode_row(&x, buf, self.open_rows)?;
                self.open_rows = (self.open_rows + 1) % t;
                self.tail.drain(..d);
            }
            return Ok(());
        }
        while self.tail_tokens() >= self.recent + t {
            // Pages are encoded from the f16 values decode would have stored.
            let x: Vec<f32> = self.tail[..t * d].iter().map(|v| v.to_f32()).collect();
            let mut page = vec![0u8; self.format.page_bytes()];
            self.format.encode_page(&x, &mut page)?;
            self.pages.push(page.into());
            self.tail.drain(..t * d);
        }
        Ok(())
    }

    /// Pages + page table + tail capacity + format state, as allocated.
    pub fn resident_bytes(&self) -> usize {
        const ARC_HEADER: usize = 2 * std::mem::size_of::<usize>();
        self.pages.iter().map(|p| p.len() + ARC_HEADER).sum::<usize>()
            + self.pages.capacity() * std::mem::size_of::<Page>()
            + self.tail.capacity() * 2
            + self.sink.capacity() * 2
            + self.format.state_bytes()
    }
}
