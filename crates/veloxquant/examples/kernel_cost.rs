//! Per-page cost of the fused kernels, single thread, L1/L2-resident (min over many runs):
//! the compute ceiling of decode attention, separate from memory bandwidth.
use std::time::Instant;
use veloxquant::format::{FormatCtx, FormatSpec, Stream};
use veloxquant::rng::SplitMix64;

fn main() {
    let specs = std::env::args().skip(1).collect::<Vec<_>>();
    let specs = if specs.is_empty() {
        vec![
            "fp16".into(),
            "q8_0".into(),
            "q4_0".into(),
            "turboquant_mse:4".into(),
            "turboquant_mse:3".into(),
            "turboquant_mse:2".into(),
        ]
    } else {
        specs
    };
    for (d, g) in [(128usize, 4usize), (64, 3)] {
        for s in &specs {
            let f = FormatSpec::parse(s).unwrap().build(&FormatCtx::new(d, 32, Stream::Keys, 1)).unwrap();
            let mut rng = SplitMix64::new(1);
            let pages: Vec<Vec<u8>> = (0..16)
                .map(|_| {
                    let mut p = vec![0u8; f.page_bytes()];
                    f.encode_page(&rng.gaussian_vec(32 * d), &mut p).unwrap();
                    p
                })
                .collect();
            let qs = f.prepare_query(&rng.gaussian_vec(g * d), g);
            let mut out = vec![0f32; g * 32];
            let w = vec![0.01f32; g * 32];
            let mut acc = vec![0f32; g * d];
            let (mut best_s, mut best_a) = (f64::MAX, f64::MAX);
            for _ in 0..200 {
                let t = Instant::now();
                for p in &pages {
                    f.scores(&qs, p, &mut out);
                }
                best_s = best_s.min(t.elapsed().as_secs_f64());
                let t = Instant::now();
                for p in &pages {
                    f.accumulate(&w, g, p, &mut acc);
                }
                best_a = best_a.min(t.elapsed().as_secs_f64());
            }
            let per_tok = |x: f64| x / (16.0 * 32.0) * 1e9;
            println!(
                "d={d} g={g} {s:>18}: scores {:6.1} ns/token, accumulate {:6.1} ns/token",
                per_tok(best_s),
                per_tok(best_a)
            );
        }
    }
}
