//! Prefix sharing: prompts are cut into page-aligned blocks of T tokens, each block's hash
//! chained on the one before, so the hash of block j names the whole prefix `[0, (j+1)·T)`.
//! A prefilling sequence leaves checkpoints — forks of itself, sharing its pages — at
//! chunk boundaries and at its last page boundary; a later prompt starting with a
//! checkpointed prefix forks it and computes only the rest. A checkpoint is a real state
//! of a fresh prefill (never a trim), so the continuation attends exactly as if the
//! prefix had been computed again.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use crate::engine::SeqId;

/// The chained hash of every whole block of `tokens` (`result[j]` covers `[0, (j+1)·t)`).
pub fn block_hashes(tokens: &[u32], t: usize) -> Vec<u64> {
    let mut out = Vec::with_capacity(tokens.len() / t.max(1));
    let mut h = 0x9E37_79B9_7F4A_7C15u64;
    for block in tokens.chunks_exact(t.max(1)) {
        let mut s = DefaultHasher::new();
        h.hash(&mut s);
        block.hash(&mut s);
        h = s.finish();
        out.push(h);
    }
    out
}

/// Leading blocks two hash lists share.
pub fn common_blocks(a: &[u64], b: &[u64]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

struct Entry {
    seq: SeqId,
    /// The prefix itself (hashes can collide; a hit is checked token by token).
    tokens: Vec<u32>,
    last_used: u64,
}

/// Checkpointed prefixes by the hash of their last block.
pub struct PrefixCache {
    page_tokens: usize,
    max_entries: usize,
    entries: HashMap<u64, Entry>,
    clock: u64,
}

/// A usable checkpoint: fork `seq`, which holds the first `n_tokens` of the prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hit {
    pub seq: SeqId,
    pub n_tokens: usize,
}

impl PrefixCache {
    pub fn new(page_tokens: usize, max_entries: usize) -> Self {
        Self { page_tokens, max_entries, entries: HashMap::new(), clock: 0 }
    }

    /// The longest checkpoint that is a prefix of `prompt` and leaves at least one prompt
    /// token to compute (its logits choose the first generated token).
    pub fn lookup(&mut self, prompt: &[u32], hashes: &[u64]) -> Option<Hit> {
        let t = self.page_tokens;
        let max_blocks = prompt.len().saturating_sub(1) / t;
        for j in (1..=max_blocks.min(hashes.len())).rev() {
            if let Some(e) = self.entries.get_mut(&hashes[j - 1]) {
                if e.tokens[..] == prompt[..j * t] {
                    self.clock += 1;
                    e.last_used = self.clock;
                    return Some(Hit { seq: e.seq, n_tokens: j * t });
                }
            }
        }
        None
    }

    pub fn contains(&self, hash: u64) -> bool {
        self.entries.contains_key(&hash)
    }

    /// Records `seq` (already forked, holding exactly `tokens`, a whole number of blocks).
    /// Returns the sequences the caller must free: an evicted entry's, or `seq` itself when
    /// the prefix is already cached.
    pub fn insert(&mut self, hash: u64, seq: SeqId, tokens: Vec<u32>) -> Vec<SeqId> {
        if self.entries.contains_key(&hash) || self.max_entries == 0 {
            return vec![seq];
        }
        let mut freed = Vec::new();
        while self.entries.len() >= self.max_entries {
            match self.evict_lru() {
                Some(s) => freed.push(s),
                None => break,
            }
        }
        self.clock += 1;
        self.entries.insert(hash, Entry { seq, tokens, last_used: self.clock });
        freed
    }

    /// Drops the least recently used entry; returns its sequence to free.
    pub fn evict_lru(&mut self) -> Option<SeqId> {
        let (&h, _) = self.entries.iter().min_by_key(|(_, e)| e.last_used)?;
        self.entries.remove(&h).map(|e| e.seq)
    }

    /// Every entry's sequence (to count their bytes).
    pub fn seqs(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.entries.values().map(|e| e.seq)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_chain_and_lookup_checks_tokens() {
        let t = 4;
        let a: Vec<u32> = (0..17).collect();
        let mut b = a.clone();
        b[9] = 99; // differs in block 2
        let (ha, hb) = (block_hashes(&a, t), block_hashes(&b, t));
        assert_eq!(ha.len(), 4);
        assert_eq!(common_blocks(&ha, &hb), 2);
        let mut c = PrefixCache::new(t, 8);
        assert!(c.insert(ha[2], 7, a[..12].to_vec()).is_empty());
        assert_eq!(c.lookup(&a, &ha), Some(Hit { seq: 7, n_tokens: 12 }));
        assert_eq!(c.lookup(&b, &hb), None, "b shares only 8 tokens; no checkpoint there");
        // A prompt of exactly 12 tokens must keep one token to compute: no hit at 12.
        assert_eq!(c.lookup(&a[..12], &ha[..3]), None);
        assert_eq!(c.insert(ha[2], 8, a[..12].to_vec()), vec![8], "a duplicate is handed back");
    }

    #[test]
    fn lru_eviction_bounds_entries() {
        let t = 2;
        let p: Vec<u32> = (0..10).collect();
        let h = block_hashes(&p, t);
        let mut c = PrefixCache::new(t, 2);
        c.insert(h[0], 1, p[..2].to_vec());
        c.insert(h[1], 2, p[..4].to_vec());
        assert_eq!(c.lookup(&p[..3], &h[..1]).map(|x| x.seq), Some(1)); // touch entry 1
        assert_eq!(c.insert(h[2], 3, p[..6].to_vec()), vec![2], "least recently used goes");
        assert_eq!(c.len(), 2);
        let mut left: Vec<_> = c.seqs().collect();
        left.sort();
        assert_eq!(left, vec![1, 3]);
    }
}
