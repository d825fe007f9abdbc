//! Admission: which waiting requests start now. A request reserves its prompt plus
//! `max_tokens` at the engine's bytes-per-token bound; live sequences' remaining growth,
//! prefix checkpoints and slots count against the same budget; checkpoints are evicted
//! (least recently used) to make room; a prefix still being prefilled is waited for.

use super::*;

impl<E: Engine> Scheduler<E> {
    pub(super) fn held_seqs(&self) -> Vec<SeqId> {
        self.prefix.seqs().chain(self.slots.seqs()).collect()
    }

    pub(super) fn live_seqs(&self) -> Vec<SeqId> {
        self.running.iter().map(|a| a.seq).collect()
    }

    /// Bytes live sequences may still add before they end: each one's bound at its
    /// reservation (prompt + max_tokens) less what it holds now, plus one page per stream
    /// for the copy of an open page it shares with a fork (copied on its next write).
    pub(super) fn growth(&self) -> usize {
        let page = self.engine.bytes_for_tokens(self.engine.info().page_tokens) - self.engine.bytes_for_tokens(0);
        self.running
            .iter()
            .map(|a| self.engine.bytes_for_tokens(a.reserve()).saturating_sub(self.engine.kv_bytes(&[a.seq])) + page)
            .sum()
    }

    pub(super) fn used_bytes(&self) -> usize {
        let mut all = self.live_seqs();
        all.extend(self.held_seqs());
        self.engine.kv_bytes(&all)
    }

    pub(super) fn seq_room(&self, extra: usize) -> bool {
        let held = self.running.len() + self.prefix.len() + self.slots.len();
        self.engine.info().max_seqs.is_none_or(|m| held + extra <= m)
    }

    /// Admits waiting requests in order while they fit. A request that shares a prefix with
    /// one still prefilling waits for that one's checkpoint instead of computing it again.
    pub(super) fn admit(&mut self) {
        let t = self.engine.info().page_tokens;
        let mut i = 0;
        let mut used = None;
        while i < self.queue.len() && self.running.len() < self.cfg.max_running {
            let (prompt, slot, max_tokens) = {
                let r = &self.queue[i];
                (r.prompt.clone(), r.slot, r.max_tokens)
            };
            let hashes = block_hashes(&prompt, t);
            let hit = self.prefix_hit(&prompt, &hashes, slot);
            let chunk = self.cfg.prefill_chunk;
            let sharing = self.cfg.max_prefixes > 0;
            let waits = sharing
                && self.running.iter().filter(|a| a.fed < a.req.prompt.len()).any(|a| {
                    let shared = common_blocks(&hashes, &a.hashes) * t;
                    let will = shared.min(a.req.prompt.len() - 1) / chunk * chunk;
                    will > hit.map_or(0, |h| h.1)
                });
            if waits {
                i += 1;
                continue;
            }
            let need = self.engine.bytes_for_tokens(prompt.len() + max_tokens - hit.map_or(0, |h| h.1));
            let mut now = match used {
                Some(u) => u,
                None => self.used_bytes() + self.growth(),
            };
            // Make room: drop least recently used checkpoints (never a slot's cache).
            while (now + need > self.cfg.kv_budget_bytes || !self.seq_room(2)) && !self.prefix.is_empty() {
                if let Some(s) = self.prefix.evict_lru() {
                    self.engine.remove(s);
                }
                now = self.used_bytes() + self.growth();
            }
            if now + need > self.cfg.kv_budget_bytes || !self.seq_room(1) {
                if !self.running.is_empty() {
                    break;
                }
                // Nothing will ever free memory for it: refuse rather than wait forever.
                let Some(r) = self.queue.remove(i) else { break };
                queue_dec(&self.metrics);
                Metrics::inc(&self.metrics.requests_failed_total);
                let msg = format!(
                    "the request needs ~{} KiB of KV cache; the budget is {} KiB (slots hold {} KiB)",
                    need >> 10,
                    self.cfg.kv_budget_bytes >> 10,
                    now >> 10
                );
                let _ = r.events.send(Event::Error(ApiError::bad_request(msg)));
                used = None;
                continue;
            }
            let Some(r) = self.queue.remove(i) else { break };
            queue_dec(&self.metrics);
            // Look up again: eviction may have dropped the checkpoint just found.
            let hit = self.prefix_hit(&prompt, &hashes, slot);
            used = match self.start(r, hashes, hit) {
                Ok(()) => Some(now + need),
                Err(()) => None,
            };
        }
    }

    /// The best cached start for a prompt: (sequence to fork, tokens it holds, tokens to trim).
    pub(super) fn prefix_hit(
        &mut self,
        prompt: &[u32],
        hashes: &[u64],
        slot: Option<usize>,
    ) -> Option<(SeqId, usize, usize)> {
        let from_slot = slot.and_then(|s| self.slots.get(s)).and_then(|e| {
            let n = e.tokens.iter().zip(prompt).take_while(|(a, b)| a == b).count().min(prompt.len() - 1);
            (n > 0).then_some((e.seq, n, e.tokens.len() - n))
        });
        let from_cache = self.prefix.lookup(prompt, hashes).map(|h| (h.seq, h.n_tokens, 0));
        match (from_slot, from_cache) {
            (Some(a), Some(b)) => Some(if a.1 >= b.1 { a } else { b }),
            (a, b) => a.or(b),
        }
    }

    pub(super) fn start(
        &mut self,
        r: GenRequest,
        hashes: Vec<u64>,
        hit: Option<(SeqId, usize, usize)>,
    ) -> Result<(), ()> {
        let made = match hit {
            Some((src, _, trim)) => self.engine.fork(src).and_then(|s| {
                if trim > 0 {
                    self.engine.trim(s, trim).map(|_| s).inspect_err(|_| self.engine.remove(s))
                } else {
                    Ok(s)
                }
            }),
            None => self.engine.add(),
        };
        let seq = match made {
            Ok(s) => s,
            Err(e) => {
                Metrics::inc(&self.metrics.requests_failed_total);
                let _ = r.events.send(Event::Error(ApiError::internal(format!("could not start the sequence: {e}"))));
                return Err(());
            }
        };
        let cached = hit.map_or(0, |h| h.1);
        if cached > 0 {
            Metrics::inc(&self.metrics.prefix_cache_hits_total);
            Metrics::add(&self.metrics.prefix_cache_tokens_total, cached as u64);
        }
        Metrics::add(&self.metrics.prompt_tokens_total, r.prompt.len() as u64);
        self.running.push(Active {
            sampler: Sampler::new(r.sampling),
            stops: StopMatcher::new(r.stop.clone()),
            detok: Detokenizer::new(),
            text_stopped: false,
            req: r,
            seq,
            fed: cached,
            cached,
            hashes,
            generated: Vec::new(),
            next: None,
        });
        Ok(())
    }
}
