//! The cache's fixed cost per decode step at short contexts (a `perf record` target): B
//! caches of SmolLM2-135M's shape (30 layers, 3 KV heads, 9 query heads, d 64), each step
//! one token appended and one decode attention per layer, `steps` steps from empty:
//! `cargo run --release -p veloxquant --example short_step_cost [K/V@R+S] [B] [steps] [reps]`.
//! Prints µs per (sequence, layer) for the appends and the attentions apart, and the wall
//! time of a step with the sequences of each layer in parallel (as a batched forward runs
//! them), medians of reps.

use std::time::Instant;
use veloxquant::attn::decode_attention;
use veloxquant::rng::SplitMix64;
use veloxquant::{CacheConfig, FormatSpec, PagedCache};

fn main() {
    let mut args = std::env::args().skip(1);
    let method = args.next().unwrap_or_else(|| "turboquant_mse:4:eden/turboquant_mse:3@8+4".into());
    let b: usize = args.next().map_or(16, |a| a.parse().unwrap());
    let steps: usize = args.next().map_or(32, |a| a.parse().unwrap());
    let reps: usize = args.next().map_or(7, |a| a.parse().unwrap());
    let (layers, n_kv, n_q, d) = (30, 3, 9, 64);
    let (rest, sink) = method.split_once('+').map_or((method.as_str(), 0), |(a, s)| (a, s.parse().unwrap()));
    let (kv, recent) = rest.split_once('@').map_or((rest, 0), |(a, r)| (a, r.parse().unwrap()));
    let (k, v) = kv.split_once('/').unwrap_or((kv, kv));
    let mut cfg = CacheConfig::new(layers, n_kv, d, FormatSpec::parse(k).unwrap(), FormatSpec::parse(v).unwrap());
    (cfg.recent, cfg.sink) = (recent, sink);
    let mut rng = SplitMix64::new(7);
    let mut vec = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.next_f64() as f32 * 2.0 - 1.0).collect() };
    let (kx, vx, q) = (vec(n_kv * d), vec(n_kv * d), vec(n_q * d));
    let (mut t_app, mut t_att) = (Vec::new(), Vec::new());
    let t = Instant::now();
    drop(std::hint::black_box(PagedCache::new(cfg.clone()).unwrap()));
    println!("one empty cache built in {:.1} µs", t.elapsed().as_secs_f64() * 1e6);
    for _ in 0..reps {
        let mut caches: Vec<PagedCache> = (0..b).map(|_| PagedCache::new(cfg.clone()).unwrap()).collect();
        let (mut a, mut s) = (0.0, 0.0);
        for _ in 0..steps {
            for l in 0..layers {
                for c in caches.iter_mut() {
                    let t = Instant::now();
                    c.append(l, &kx, &vx, 1).unwrap();
                    a += t.elapsed().as_secs_f64();
                    let t = Instant::now();
                    std::hint::black_box(decode_attention(c, l, &q, n_q).unwrap());
                    s += t.elapsed().as_secs_f64();
                }
            }
        }
        let per = 1e6 / (steps * layers * b) as f64;
        t_app.push(a * per);
        t_att.push(s * per);
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    // The same steps as a batched forward runs them: per layer, the sequences in parallel.
    let mut t_par = Vec::new();
    for _ in 0..reps {
        use rayon::prelude::*;
        let mut caches: Vec<PagedCache> = (0..b).map(|_| PagedCache::new(cfg.clone()).unwrap()).collect();
        let t = Instant::now();
        for _ in 0..steps {
            for l in 0..layers {
                caches.par_iter_mut().for_each(|c| {
                    c.append(l, &kx, &vx, 1).unwrap();
                    std::hint::black_box(decode_attention(c, l, &q, n_q).unwrap());
                });
            }
        }
        t_par.push(t.elapsed().as_secs_f64() * 1e3 / steps as f64);
    }
    println!(
        "{method}: append {:.2} µs, attention {:.2} µs per (sequence, layer); {b} in parallel: {:.3} ms per step ({} threads)",
        med(&mut t_app),
        med(&mut t_att),
        med(&mut t_par),
        rayon::current_num_threads()
    );
}
