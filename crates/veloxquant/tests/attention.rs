//! Fused decode attention against the reference path over the whole test matrix: every
//! format and bit width, d ∈ {64, 128, 96}, GQA 1/3/4, lengths off the page grid, R ∈ {0, 32},
//! row mode (per-token encoding into an open page) and page mode.

mod common;

use common::{all_specs, cache_config, rel_err, unsupported, usable_for};
use veloxquant::attn::{decode_attention, decode_attention_ref};
use veloxquant::rng::SplitMix64;
use veloxquant::{CacheConfig, FormatSpec, PagedCache, Stream, VqError};

fn filled(k: &FormatSpec, v: &FormatSpec, d: usize, n_kv: usize, recent: usize, n: usize, seed: u64) -> PagedCache {
    let mut cfg = cache_config(n_kv, d, k, v);
    cfg.recent = recent;
    let mut cache = PagedCache::new(cfg).unwrap();
    let mut rng = SplitMix64::new(seed);
    // Keys with a few large channels, like real models; values Gaussian.
    let keys: Vec<f32> =
        (0..n_kv * n * d).map(|i| rng.next_gaussian() as f32 * if i % d < 4 { 6.0 } else { 1.0 }).collect();
    let vals = rng.gaussian_vec(n_kv * n * d);
    // Two appends: a prefill chunk, then single tokens.
    let first = n * 2 / 3;
    let per = |x: &[f32], lo: usize, hi: usize| -> Vec<f32> {
        (0..n_kv).flat_map(|h| x[(h * n + lo) * d..(h * n + hi) * d].to_vec()).collect()
    };
    cache.append(0, &per(&keys, 0, first), &per(&vals, 0, first), first).unwrap();
    for t in first..n {
        cache.append(0, &per(&keys, t, t + 1), &per(&vals, t, t + 1), 1).unwrap();
    }
    cache
}

/// Keys with a few large channels, like real models; values Gaussian.
fn append_random(cache: &mut PagedCache, rng: &mut SplitMix64, n_kv: usize, d: usize, n: usize) {
    let keys: Vec<f32> =
        (0..n_kv * n * d).map(|i| rng.next_gaussian() as f32 * if i % d < 4 { 6.0 } else { 1.0 }).collect();
    let vals = rng.gaussian_vec(n_kv * n * d);
    cache.append(0, &keys, &vals, n).unwrap();
}

#[test]
fn fused_matches_reference_everywhere() {
    let specs = all_specs();
    let values: Vec<&FormatSpec> = specs.iter().filter(|s| usable_for(s, Stream::Values)).collect();
    let mut worst = 0f64;
    let mut skipped = Vec::new();
    for (i, k) in specs.iter().enumerate() {
        // Each key format with itself as value format (or fp16 for key-only formats), and
        // with a value format from elsewhere in the list.
        let own = if usable_for(k, Stream::Values) { k } else { values[0] };
        let v = values[(i * 7 + 3) % values.len()];
        for (kf, vf) in [(k, own), (k, v)] {
            for d in [64, 128, 96] {
                if unsupported(kf, d, Stream::Keys) || unsupported(vf, d, Stream::Values) {
                    // Documented shape limits: building must fail with the typed error.
                    let cfg = cache_config(2, d, kf, vf);
                    assert!(matches!(PagedCache::new(cfg), Err(VqError::UnsupportedHeadDim { .. })));
                    skipped.push(format!("K {kf} V {vf} d={d}"));
                    continue;
                }
                for (recent, rows) in [(0, true), (32, true), (0, false), (32, false)] {
                    // One cache per (K, V, d, R, mode), grown through the lengths under test:
                    // off the page grid, chunked prefill then single-token decode steps.
                    let n_kv = 2;
                    let mut cfg = cache_config(n_kv, d, kf, vf);
                    cfg.recent = recent;
                    cfg.encode_rows = rows;
                    let mut cache = PagedCache::new(cfg).unwrap();
                    let mut rng = SplitMix64::new((d * 1000 + recent) as u64);
                    let mut len = 0;
                    for n in [1, 17, 97, 200] {
                        let chunk = n - len;
                        let first = chunk - chunk / 4;
                        append_random(&mut cache, &mut rng, n_kv, d, first);
                        for _ in first..chunk {
                            append_random(&mut cache, &mut rng, n_kv, d, 1);
                        }
                        len = n;
                        for gqa in [1, 3, 4] {
                            let q = SplitMix64::new(n as u64).gaussian_vec(n_kv * gqa * d);
                            let got = decode_attention(&cache, 0, &q, n_kv * gqa).unwrap();
                            let want = decode_attention_ref(&cache, 0, &q, n_kv * gqa).unwrap();
                            let e = rel_err(&got, &want);
                            worst = worst.max(e);
                            assert!(
                                e <= 1e-4,
                                "K {kf} V {vf} d={d} gqa={gqa} n={n} R={recent} rows={rows}: rel err {e}"
                            );
                        }
                    }
                }
            }
        }
    }
    println!("worst fused-vs-reference relative error: {worst:.2e}");
    println!("skipped (UnsupportedHeadDim, checked): {skipped:?}");
}

#[test]
fn attention_error_shrinks_with_bits() {
    // The whole chain, end to end: more bits per value, closer to the fp16 cache's output.
    let fp = FormatSpec::parse("fp16").unwrap();
    let (d, n) = (128, 500);
    let exact = filled(&fp, &fp, d, 1, 0, n, 9);
    let q = SplitMix64::new(2).gaussian_vec(4 * d);
    let a = decode_attention(&exact, 0, &q, 4).unwrap();
    let errs: Vec<f64> = (1..=4)
        .map(|b| {
            let tq = FormatSpec::parse(&format!("turboquant_mse:{b}:eden")).unwrap();
            let comp = filled(&tq, &tq, d, 1, 0, n, 9);
            rel_err(&decode_attention(&comp, 0, &q, 4).unwrap(), &a)
        })
        .collect();
    assert!(errs.windows(2).all(|w| w[1] < w[0]), "errors by bits 1..4: {errs:?}");
    assert!(errs[3] > 1e-4, "compression must change something: {errs:?}");
}

#[test]
fn attention_bad_input_is_a_typed_error() {
    let fp = FormatSpec::parse("fp16").unwrap();
    let empty = PagedCache::new(CacheConfig::new(2, 2, 64, fp.clone(), fp.clone())).unwrap();
    let q = vec![0.1f32; 4 * 64];
    assert_eq!(decode_attention(&empty, 1, &q, 4), Err(VqError::EmptyCache { layer: 1 }));
    assert!(matches!(decode_attention(&empty, 2, &q, 4), Err(VqError::OutOfRange { .. })));
    let cache = filled(&fp, &fp, 64, 2, 0, 40, 1);
    assert!(matches!(decode_attention(&cache, 0, &q[1..], 4), Err(VqError::ShapeMismatch { .. })));
    assert!(matches!(decode_attention(&cache, 0, &q[..3 * 64], 3), Err(VqError::InvalidConfig(_))));
    let mut bad = q.clone();
    bad[5] = f32::NAN;
    assert!(matches!(decode_attention(&cache, 0, &bad, 4), Err(VqError::NonFinite { .. })));
    assert!(matches!(decode_attention_ref(&cache, 0, &bad, 4), Err(VqError::NonFinite { .. })));
}

#[test]
fn sink_tokens_stay_exact_and_fused_matches_reference() {
    let (d, n_kv) = (64, 2);
    for (spec, rows) in [("turboquant_mse:3", true), ("kivi:2", true), ("q4_0:rot", false)] {
        let s = FormatSpec::parse(spec).unwrap();
        for sink in [1, 4, 40] {
            let mut cfg = CacheConfig::new(1, n_kv, d, s.clone(), s.clone());
            cfg.sink = sink;
            cfg.recent = 3;
            cfg.encode_rows = rows;
            let mut cache = PagedCache::new(cfg).unwrap();
            let mut rng = SplitMix64::new(sink as u64);
            let keys = rng.gaussian_vec(n_kv * 100 * d);
            cache.append(0, &keys, &rng.gaussian_vec(n_kv * 100 * d), 100).unwrap();
            let ks = &cache.layer(0).unwrap().keys[1];
            // The first S keys of head 1, bit for bit as fp16.
            let want: Vec<half::f16> =
                keys[100 * d..(100 + sink) * d].iter().map(|&v| half::f16::from_f32(v)).collect();
            assert_eq!(ks.sink(), &want[..]);
            assert_eq!(ks.sink().len() / d + ks.paged_tokens() + ks.tail_tokens(), 100);
            let q = rng.gaussian_vec(n_kv * 3 * d);
            let e = rel_err(
                &decode_attention(&cache, 0, &q, n_kv * 3).unwrap(),
                &decode_attention_ref(&cache, 0, &q, n_kv * 3).unwrap(),
            );
            assert!(e <= 1e-4, "{spec} S={sink}: {e}");
        }
    }
}
