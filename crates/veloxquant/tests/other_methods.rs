//! Must-show numbers of kivi, rabitq and vecinfer (issue 3), fresh random inputs with fixed
//! seeds, against shared/REFERENCE.md §4–6.

mod common;

use half::f16;
use veloxquant::format::vecinfer::VecInfer;
use veloxquant::format::{Format, FormatCtx, Stream};
use veloxquant::kmeans::kmeans;
use veloxquant::rng::SplitMix64;
use veloxquant::{CacheConfig, FormatSpec, PagedCache};

const T: usize = 32;

#[test]
fn kivi_error_is_within_half_a_step_and_bits_are_kivis() {
    let d = 128;
    for (stream, bits) in [(Stream::Keys, 2), (Stream::Keys, 4), (Stream::Values, 2), (Stream::Values, 4)] {
        let spec = FormatSpec::parse(&format!("kivi:{bits}")).unwrap();
        let f = spec.build(&FormatCtx::new(d, T, stream, 1)).unwrap();
        // KIVI's count: b + 32/G with G = 32 → 3 and 5 bits/value.
        assert_eq!(f.bits_per_value(), bits as f64 + 1.0);
        let levels = ((1 << bits) - 1) as f32;
        let mut rng = SplitMix64::new(bits as u64);
        let mut page = vec![0u8; f.page_bytes()];
        let mut back = vec![0f32; T * d];
        let mut worst = 0f32;
        for _ in 0..20 {
            // Outlier channels, as in real keys.
            let x: Vec<f32> =
                (0..T * d).map(|i| rng.next_gaussian() as f32 * if i % d < 4 { 8.0 } else { 1.0 }).collect();
            f.encode_page(&x, &mut page).unwrap();
            f.decode_page(&page, &mut back);
            // Groups: per channel over the page's tokens (keys), per 32 channels (values).
            let group = |t: usize, j: usize| match stream {
                Stream::Keys => j,
                Stream::Values => d + t * (d / 32) + j / 32,
            };
            let mut lo = vec![f32::INFINITY; 2 * d + T * d / 32];
            let mut hi = vec![f32::NEG_INFINITY; lo.len()];
            for (i, v) in x.iter().enumerate() {
                let g = group(i / d, i % d);
                lo[g] = lo[g].min(*v);
                hi[g] = hi[g].max(*v);
            }
            for (i, (v, b)) in x.iter().zip(&back).enumerate() {
                let g = group(i / d, i % d);
                let s = (hi[g] - lo[g]) / levels;
                let s16 = f16::from_f32(s).to_f32();
                let z16 = f16::from_f32(lo[g]).to_f32();
                let bound = s16 / 2.0 + (lo[g] - z16).abs() + levels * (s - s16).abs() + 1e-6;
                assert!((v - b).abs() <= bound, "{spec} {stream:?}: |{v} − {b}| > {bound}");
                worst = worst.max((v - b).abs() / s16.max(1e-12));
            }
        }
        println!("kivi:{bits} {stream:?}: worst |err|/scale = {worst:.4}");
        assert!(worst > 0.45, "the bound must be nearly tight (≈ 0.5): {worst}");
    }
    // Flushes happen only in whole pages: T·⌊(n − R)/T⌋ tokens paged, R = 128 (KIVI's R).
    let spec = FormatSpec::parse("kivi:2").unwrap();
    let mut cfg = CacheConfig::new(1, 1, 64, spec.clone(), spec);
    cfg.recent = 128;
    let mut cache = PagedCache::new(cfg).unwrap();
    let mut rng = SplitMix64::new(9);
    let mut n = 0;
    for step in [1, 100, 27, 5, 31, 1, 200, 64] {
        cache.append(0, &rng.gaussian_vec(step * 64), &rng.gaussian_vec(step * 64), step).unwrap();
        n += step;
        let l = cache.layer(0).unwrap();
        assert_eq!(l.keys[0].pages().len() * T, n.saturating_sub(128) / T * T);
        assert_eq!(l.keys[0].pages().len() * T + l.keys[0].tail_tokens(), n);
    }
    assert_eq!(cache.bits_per_value(), (3.0, 3.0));
}

/// A group whose minimum is a zero stores +0 as its zero point, whichever zeros it holds and in
/// whatever order (the CPU's `min`, other machines' and the GPU's reductions disagree on the
/// sign of a zero min; the page must not).
#[test]
fn kivi_zero_point_of_a_signed_zero_minimum_is_plus_zero() {
    let d = 64;
    for stream in [Stream::Keys, Stream::Values] {
        let f = FormatSpec::parse("kivi:2").unwrap().build(&FormatCtx::new(d, T, stream, 1)).unwrap();
        let mut rng = SplitMix64::new(4);
        let base: Vec<f32> = (0..T * d).map(|_| (rng.next_gaussian() as f32).abs() + 0.1).collect();
        let mut pages = Vec::new();
        for order in [[0.0f32, -0.0], [-0.0, 0.0], [-0.0, -0.0]] {
            let mut x = base.clone();
            // Every key channel's tokens 0 and 1, every value token's channels 0 and 1.
            for (k, z) in order.iter().enumerate() {
                for j in 0..if stream == Stream::Keys { d } else { T } {
                    let i = if stream == Stream::Keys { k * d + j } else { j * d + k };
                    x[i] = *z;
                }
            }
            let mut page = vec![0u8; f.page_bytes()];
            f.encode_page(&x, &mut page).unwrap();
            pages.push(page);
        }
        assert_eq!(pages[0], pages[1], "{stream:?}");
        assert_eq!(pages[0], pages[2], "{stream:?}");
    }
}

#[test]
fn rabitq_correction_factor_error_bound_and_unbiasedness() {
    let d = 128;
    let mut rng = SplitMix64::new(21);
    let (mut x0_sum, mut n) = (0f64, 0usize);
    let (mut within, mut within_q) = (0usize, 0usize);
    let (mut errs, mut errs_q) = (Vec::new(), Vec::new());
    for s in 0..160 {
        let f = FormatSpec::parse("rabitq").unwrap().build(&FormatCtx::new(d, T, Stream::Keys, 500 + s)).unwrap();
        let mut page = vec![0u8; f.page_bytes()];
        let x: Vec<f32> = (0..T).flat_map(|_| rng.unit_vec(d)).collect();
        let q: Vec<f32> = (0..T).flat_map(|_| rng.unit_vec(d)).collect();
        f.encode_page(&x, &mut page).unwrap();
        let mut back = vec![0f32; T * d];
        f.decode_page(&page, &mut back);
        let qs = f.prepare_query(&q, T);
        let mut sc = vec![0f32; T * T];
        f.scores(&qs, &page, &mut sc);
        let x0_at = page.len() - 2 * T; // the second f16 side array: ⟨ō, o⟩
        let off = f.page_bytes() - 4 * T + 2 * T; // rows are whole words: no padding here
        assert_eq!(off, x0_at);
        for i in 0..T {
            let x0 = f16::from_le_bytes([page[x0_at + 2 * i], page[x0_at + 2 * i + 1]]).to_f32();
            x0_sum += x0 as f64;
            n += 1;
            let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(u, v)| (u * v) as f64).sum();
            let exact: f64 = dot(&q[i * d..(i + 1) * d], &x[i * d..(i + 1) * d]);
            let est: f64 = dot(&q[i * d..(i + 1) * d], &back[i * d..(i + 1) * d]);
            let x0 = x0 as f64;
            let bound = ((1.0 - x0 * x0) / (x0 * x0)).sqrt() * 1.9 / ((d - 1) as f64).sqrt();
            within += ((est - exact).abs() <= bound) as usize;
            within_q += ((sc[i * T + i] as f64 - exact).abs() <= bound) as usize;
            errs.push(est - exact);
            errs_q.push(sc[i * T + i] as f64 - exact);
        }
    }
    let mean_x0 = x0_sum / n as f64;
    let frac = within as f64 / n as f64;
    let frac_q = within_q as f64 / n as f64;
    let stats = |e: &[f64]| {
        let m = e.iter().sum::<f64>() / e.len() as f64;
        let v = e.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (e.len() - 1) as f64;
        (m, (v / e.len() as f64).sqrt())
    };
    let ((m, se), (mq, seq)) = (stats(&errs), stats(&errs_q));
    println!(
        "rabitq d={d}: mean x0 {mean_x0:.4}; within 1.9-bound: exact q {frac:.4}, 4-bit q \
         {frac_q:.4}; bias {m:.2e} ± {se:.1e} (4-bit q {mq:.2e} ± {seq:.1e}), n = {n}"
    );
    assert!((mean_x0 - 0.80).abs() <= 0.01, "mean ⟨ō,o⟩ {mean_x0}");
    assert!(m.abs() <= 3.0 * se && mq.abs() <= 3.0 * seq, "biased");
    // The error is ≈ √((1−x0²)/x0²)·N(0,1)/√(d−1) (REFERENCE.md §5), so ε0 = 1.9 covers
    // P(|N| ≤ 1.9) ≈ 94.3 % of random pairs, not 99.9 %: pinned here.
    assert!((frac - 0.943).abs() <= 0.01, "coverage {frac}");
    assert!(frac_q >= frac - 0.02, "4-bit query coverage {frac_q}");
}

fn outlier_data(d: usize, n: usize, seed: u64, outliers: &[usize]) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    (0..n * d).map(|i| rng.next_gaussian() as f32 * if outliers.contains(&(i % d)) { 10.0 } else { 1.0 }).collect()
}

fn pq_rel_mse(f: &dyn Format, x: &[f32]) -> f64 {
    let d = f.head_dim();
    let mut page = vec![0u8; f.page_bytes()];
    let mut back = vec![0f32; T * d];
    let (mut se, mut ss) = (0f64, 0f64);
    for chunk in x.chunks_exact(T * d) {
        f.encode_page(chunk, &mut page).unwrap();
        f.decode_page(&page, &mut back);
        for (a, b) in chunk.iter().zip(&back) {
            se += ((a - b) as f64).powi(2);
            ss += (*a as f64).powi(2);
        }
    }
    se / ss
}

#[test]
fn vecinfer_kmeans_converges_and_smoothing_rotation_beats_plain_pq() {
    // k-means objective is non-increasing.
    let data = outlier_data(4, 2000, 3, &[1]);
    let km = kmeans(&data, 4, 64, 30, 7);
    assert!(km.objective.len() >= 3);
    for w in km.objective.windows(2) {
        assert!(w[1] <= w[0] * (1.0 + 1e-9), "objective rose: {:?}", km.objective);
    }
    println!("kmeans objective {:.1} → {:.1}", km.objective[0], km.objective.last().unwrap());
    // Smoothing + Hadamard vs plain PQ at equal bits (2 bits/value), outlier channels
    // clustered in one sub-vector (channels 0..4) — and, for the record, spread out.
    let d = 64;
    let spec = FormatSpec::parse("vecinfer:8:g4").unwrap();
    for (what, outl) in [("clustered", vec![0, 1, 2, 3]), ("spread", vec![0, 16, 32, 48])] {
        let mut ctx = FormatCtx::new(d, T, Stream::Keys, 5);
        ctx.calibration = Some(outlier_data(d, 2048, 1, &outl).into());
        let test = outlier_data(d, 32 * T, 2, &outl);
        let vi = pq_rel_mse(&VecInfer::train(&spec, &ctx, true).unwrap(), &test);
        let pq = pq_rel_mse(&VecInfer::train(&spec, &ctx, false).unwrap(), &test);
        println!("vecinfer {what} outliers: smoothed+rotated {vi:.4} vs plain PQ {pq:.4}");
        if what == "clustered" {
            assert!(vi < 0.8 * pq, "{vi} vs {pq}");
        }
    }
    // Codebook bytes are resident: 2^b centroids × d floats per (layer, head, stream).
    let fp = FormatSpec::parse("fp16").unwrap();
    let mut cfg = CacheConfig::new(2, 2, d, spec.clone(), fp.clone());
    cfg.calibration = Some(common::calibration(d));
    let cache = PagedCache::new(cfg).unwrap();
    // Same (page) mode for the baseline, so the fp16 tails are sized alike.
    let mut plain_cfg = CacheConfig::new(2, 2, d, fp.clone(), fp);
    plain_cfg.encode_rows = false;
    let plain = PagedCache::new(plain_cfg).unwrap();
    let extra = cache.resident_bytes() - plain.resident_bytes();
    let books = 2 * 2 * 256 * d * 4;
    println!("vecinfer resident extra {extra} B, codebooks {books} B");
    assert!(extra >= books && extra <= books + 2 * 2 * 2 * d * 4, "{extra} vs {books}");
}
