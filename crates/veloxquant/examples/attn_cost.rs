//! Per-token cost of a whole fused decode step, single thread, small cache (min of many):
//! compare with `kernel_cost` to see what the orchestration adds.
use std::time::Instant;
use veloxquant::attn::decode_attention;
use veloxquant::rng::SplitMix64;
use veloxquant::{CacheConfig, FormatSpec, PagedCache};

fn main() {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    for spec in ["fp16", "turboquant_mse:4", "turboquant_mse:2"] {
        let (hkv, hq, d, n) = (8, 32, 128, 2048);
        let s = FormatSpec::parse(spec).unwrap();
        let mut c = PagedCache::new(CacheConfig::new(1, hkv, d, s.clone(), s)).unwrap();
        let mut rng = SplitMix64::new(1);
        c.append(0, &rng.gaussian_vec(hkv * n * d), &rng.gaussian_vec(hkv * n * d), n).unwrap();
        let q = rng.gaussian_vec(hq * d);
        let best = pool.install(|| {
            (0..100)
                .map(|_| {
                    let t = Instant::now();
                    std::hint::black_box(decode_attention(&c, 0, &q, hq).unwrap());
                    t.elapsed().as_secs_f64()
                })
                .fold(f64::MAX, f64::min)
        });
        println!("{spec:>18}: {:.1} ns per (token, kv head), K+V", best / (n * hkv) as f64 * 1e9);
    }
}
