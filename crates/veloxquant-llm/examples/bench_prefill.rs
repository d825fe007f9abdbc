//! Times one layer's prefill (append + attend of a chunk after `depth` tokens) through the
//! fp16 store and the default compressed store, at SmolLM2-135M's attention shape.
//! `cargo run --release -p veloxquant-llm --example bench_prefill [depth] [chunk] [reps]`
use std::time::Instant;
use veloxquant::rng::SplitMix64;
use veloxquant::{CacheConfig, FormatSpec};
use veloxquant_llm::{CompressedStore, Fp16Store, KvStore};

const HEADS: usize = 9;
const KV_HEADS: usize = 3;
const HEAD_DIM: usize = 64;

fn fill(store: &mut dyn KvStore, rng: &mut SplitMix64, depth: usize) {
    for n in (0..depth).step_by(512).map(|at| 512.min(depth - at)) {
        let (k, v) = (rng.gaussian_vec(KV_HEADS * n * HEAD_DIM), rng.gaussian_vec(KV_HEADS * n * HEAD_DIM));
        store.append(0, &k, &v, n).unwrap();
        store.attend(0, &rng.gaussian_vec(HEADS * n * HEAD_DIM), n).unwrap();
    }
}

/// Median seconds of (append, attend) over `reps` runs, each on a fresh copy.
fn time(copy: &dyn Fn() -> Box<dyn KvStore>, n: usize, reps: usize) -> (f64, f64) {
    let mut rng = SplitMix64::new(7);
    let (k, v) = (rng.gaussian_vec(KV_HEADS * n * HEAD_DIM), rng.gaussian_vec(KV_HEADS * n * HEAD_DIM));
    let q = rng.gaussian_vec(HEADS * n * HEAD_DIM);
    let mut runs: Vec<(f64, f64)> = (0..reps)
        .map(|_| {
            let mut s = copy();
            let t = Instant::now();
            s.append(0, &k, &v, n).unwrap();
            let a = t.elapsed().as_secs_f64();
            std::hint::black_box(s.attend(0, &q, n).unwrap());
            (a, t.elapsed().as_secs_f64() - a)
        })
        .collect();
    runs.sort_by(|x, y| (x.0 + x.1).total_cmp(&(y.0 + y.1)));
    runs[reps / 2]
}

fn main() {
    let arg = |i: usize, default: usize| std::env::args().nth(i).map_or(default, |s| s.parse().unwrap());
    let (depth, n, reps) = (arg(1, 4096), arg(2, 512), arg(3, 5));
    let mut rng = SplitMix64::new(1);
    let mut fp16 = Fp16Store::with_capacity(1, KV_HEADS, HEAD_DIM, depth + n);
    fill(&mut fp16, &mut rng, depth);
    let spec = |s: &str| FormatSpec::parse(s).unwrap();
    let mut cfg = CacheConfig::new(1, KV_HEADS, HEAD_DIM, spec("turboquant_mse:4:eden"), spec("turboquant_mse:3"));
    (cfg.recent, cfg.sink) = (8, 4);
    let mut rng = SplitMix64::new(1);
    let mut tq = CompressedStore::new(cfg).unwrap();
    fill(&mut tq, &mut rng, depth);
    let f = time(&|| Box::new(fp16.copy_with_room(n)), n, reps);
    let c = time(&|| Box::new(tq.fork()), n, reps);
    for (name, (a, b)) in [("fp16", f), ("turboquant_mse:4:eden/turboquant_mse:3@8+4", c)] {
        println!("{name}: {n} tokens after {depth}: append {:.2} ms, attend {:.2} ms", a * 1e3, b * 1e3);
    }
    println!("compressed / fp16: {:.2}x", (c.0 + c.1) / (f.0 + f.1));
}
