//! One stream (K or V) of one KV head: full pages in the format, plus the fp16 tail.

use std::sync::Arc;

use half::f16;

use crate::error::Result;
use crate::format::Format;

#[derive(Clone, Debug)]
pub struct StreamStore {
    format: Arc<dyn Format>,
    pages: Vec<Arc<[u8]>>,
    /// Newest tokens not yet paged, n_tail × d, f16.
    tail: Vec<f16>,
    recent: usize,
}

impl StreamStore {
    pub fn new(format: Arc<dyn Format>, recent: usize) -> Self {
        let cap = (recent + format.page_tokens()) * format.head_dim();
        Self { format, pages: Vec::new(), tail: Vec::with_capacity(cap), recent }
    }

    pub fn format(&self) -> &dyn Format {
        self.format.as_ref()
    }

    pub fn pages(&self) -> &[Arc<[u8]>] {
        &self.pages
    }

    pub fn tail(&self) -> &[f16] {
        &self.tail
    }

    pub fn tail_tokens(&self) -> usize {
        self.tail.len() / self.format.head_dim()
    }

    /// Append n×d values (already checked finite), flushing whole pages as they age out.
    pub fn append(&mut self, x: &[f32]) -> Result<()> {
        let (d, t) = (self.format.head_dim(), self.format.page_tokens());
        let cap_tokens = self.recent + t;
        let mut rest = x;
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
            + self.pages.capacity() * std::mem::size_of::<Arc<[u8]>>()
            + self.tail.capacity() * 2
            + self.format.state_bytes()
    }
}
