//! Times batched decode steps alone (no model load in the timed part; a target for
//! `perf record`): B sequences, one `forward_batch` per step, q8 weights, over fp16 caches
//! or a compressed one given as `K/V@R+S` (formats as `FormatSpec::parse` reads them):
//! `cargo run --release -p veloxquant-llm --example batch_step_bench PATH [B] [steps] [reps] [K/V@R+S]`.
//! Prints the median and range of the reps' tokens/s.

use std::time::Instant;
use veloxquant::{CacheConfig, FormatSpec};
use veloxquant_llm::{BatchItem, BatchStore, CompressedStore, Fp16Store, Llama, LlamaConfig, WeightMode};

/// A fresh store for `method` (`fp16` or `K/V@R+S`).
fn store(c: &LlamaConfig, method: &str, n_tokens: usize) -> Box<dyn BatchStore> {
    if method == "fp16" {
        return Box::new(Fp16Store::for_config(c, n_tokens));
    }
    let (rest, sink) = method.split_once('+').map_or((method, 0), |(a, s)| (a, s.parse().unwrap()));
    let (kv, recent) = rest.split_once('@').map_or((rest, 0), |(a, r)| (a, r.parse().unwrap()));
    let (k, v) = kv.split_once('/').unwrap_or((kv, kv));
    let mut cfg = CacheConfig::new(
        c.n_layers,
        c.n_kv_heads,
        c.head_dim,
        FormatSpec::parse(k).unwrap(),
        FormatSpec::parse(v).unwrap(),
    );
    (cfg.recent, cfg.sink) = (recent, sink);
    Box::new(CompressedStore::new(cfg).unwrap())
}

fn main() {
    let mut args = std::env::args().skip(1);
    let path = std::path::PathBuf::from(args.next().expect("model path"));
    let b: usize = args.next().map_or(16, |a| a.parse().unwrap());
    let steps: usize = args.next().map_or(32, |a| a.parse().unwrap());
    let reps: usize = args.next().map_or(5, |a| a.parse().unwrap());
    let method = args.next().unwrap_or_else(|| "fp16".into());
    let m = Llama::load(&path, WeightMode::PackedQ8).unwrap();
    let c = &m.config;
    let mut rates = Vec::new();
    for rep in 0..=reps {
        let mut stores: Vec<Box<dyn BatchStore>> = (0..b).map(|_| store(c, &method, steps + 1)).collect();
        let t = Instant::now();
        for step in 0..steps {
            let toks: Vec<[u32; 1]> = (0..b).map(|i| [((step * 7919 + i * 104_729) % c.n_vocab) as u32]).collect();
            let mut items: Vec<BatchItem> = stores
                .iter_mut()
                .zip(&toks)
                .map(|(s, t)| BatchItem { tokens: t, store: s.as_mut(), logits_from: 0 })
                .collect();
            std::hint::black_box(m.forward_batch(&mut items).unwrap());
        }
        if rep > 0 {
            rates.push((steps * b) as f64 / t.elapsed().as_secs_f64()); // rep 0 warms up
        }
    }
    rates.sort_by(f64::total_cmp);
    println!(
        "{method} B={b}: {:.1} tokens/s median ({:.1}–{:.1}, {reps} reps of {steps} steps)",
        rates[rates.len() / 2],
        rates[0],
        rates[rates.len() - 1]
    );
}
