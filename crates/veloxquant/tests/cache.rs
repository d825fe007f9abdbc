//! The paged cache's bookkeeping: paging rule, byte accounting, append equivalence, errors.

use veloxquant::rng::SplitMix64;
use veloxquant::{CacheConfig, FormatSpec, PagedCache, VqError};

fn cfg(k: &str, v: &str, recent: usize) -> CacheConfig {
    let mut c = CacheConfig::new(2, 3, 64, FormatSpec::parse(k).unwrap(), FormatSpec::parse(v).unwrap());
    c.recent = recent;
    c
}

#[test]
fn row_mode_keeps_exactly_the_recent_window_in_fp16() {
    for recent in [0, 5, 32, 100] {
        let mut cache = PagedCache::new(cfg("turboquant_mse:3", "q4_0", recent)).unwrap();
        assert!(cache.row_mode());
        let mut rng = SplitMix64::new(1);
        let mut n = 0;
        for step in [1, 31, 1, 40, 200, 3] {
            cache.append(1, &rng.gaussian_vec(3 * step * 64), &rng.gaussian_vec(3 * step * 64), step).unwrap();
            n += step;
            let l = cache.layer(1).unwrap();
            assert_eq!(l.keys[0].paged_tokens(), n.saturating_sub(recent), "R={recent} n={n}");
            assert_eq!(l.values[2].tail_tokens(), recent.min(n));
            assert_eq!(cache.paged_tokens(n), n.saturating_sub(recent));
            assert_eq!(l.keys[0].pages().len(), n.saturating_sub(recent).div_ceil(32));
        }
    }
}

#[test]
fn row_mode_and_page_mode_store_identical_full_pages() {
    let mut rng = SplitMix64::new(8);
    let n = 200;
    let (k, v) = (rng.gaussian_vec(3 * n * 64), rng.gaussian_vec(3 * n * 64));
    let mut rows = PagedCache::new(cfg("turboquant_mse:4:eden", "q8_0:rot", 3)).unwrap();
    let mut c = cfg("turboquant_mse:4:eden", "q8_0:rot", 3);
    c.encode_rows = false;
    let mut pages = PagedCache::new(c).unwrap();
    assert!(rows.row_mode() && !pages.row_mode());
    rows.append(0, &k, &v, n).unwrap();
    pages.append(0, &k, &v, n).unwrap();
    for h in 0..3 {
        let (kr, vr) = rows.pages(0, h);
        let (kp, vp) = pages.pages(0, h);
        assert_eq!(kp.len(), (n - 3) / 32);
        assert_eq!(&kr[..kp.len()], kp);
        assert_eq!(&vr[..vp.len()], vp);
    }
}

#[test]
fn pages_follow_the_recent_window_rule() {
    for recent in [0, 5, 32, 100] {
        let mut c = cfg("turboquant_mse:3", "q4_0", recent);
        c.encode_rows = false;
        let mut cache = PagedCache::new(c).unwrap();
        let mut rng = SplitMix64::new(1);
        let mut n = 0;
        for step in [1, 31, 1, 40, 200, 3] {
            cache.append(1, &rng.gaussian_vec(3 * step * 64), &rng.gaussian_vec(3 * step * 64), step).unwrap();
            n += step;
            let l = cache.layer(1).unwrap();
            let paged = l.keys[0].pages().len() * 32;
            // T·⌊max(0, n − R)/T⌋ tokens paged, the rest (≥ R of them) exact in the tail.
            assert_eq!(paged, n.saturating_sub(recent) / 32 * 32, "R={recent} n={n}");
            assert_eq!(paged + l.keys[0].tail_tokens(), n);
            assert!(l.values[2].tail_tokens() >= recent.min(n));
            assert_eq!(cache.n_tokens(1).unwrap(), n);
            assert_eq!(cache.n_tokens(0).unwrap(), 0);
        }
    }
}

#[test]
fn chunked_and_token_by_token_appends_store_identical_pages() {
    let mut rng = SplitMix64::new(4);
    let n = 150;
    let k = rng.gaussian_vec(3 * n * 64);
    let v = rng.gaussian_vec(3 * n * 64);
    let mut a = PagedCache::new(cfg("turboquant_mse:4:eden", "q8_0:rot", 16)).unwrap();
    let mut b = PagedCache::new(cfg("turboquant_mse:4:eden", "q8_0:rot", 16)).unwrap();
    a.append(0, &k, &v, n).unwrap();
    for t in 0..n {
        let pick = |x: &[f32]| -> Vec<f32> {
            (0..3).flat_map(|h| x[(h * n + t) * 64..(h * n + t + 1) * 64].to_vec()).collect()
        };
        b.append(0, &pick(&k), &pick(&v), 1).unwrap();
    }
    for h in 0..3 {
        let (ka, va) = a.pages(0, h);
        let (kb, vb) = b.pages(0, h);
        assert_eq!(ka, kb);
        assert_eq!(va, vb);
    }
}

#[test]
fn resident_bytes_is_the_sum_of_the_buffers() {
    let mut c = cfg("turboquant_mse:4", "fp16", 8);
    c.encode_rows = false;
    let mut cache = PagedCache::new(c).unwrap();
    let fresh = cache.resident_bytes();
    let mut rng = SplitMix64::new(2);
    let n = 1000;
    cache.append(0, &rng.gaussian_vec(3 * n * 64), &rng.gaussian_vec(3 * n * 64), n).unwrap();
    let grown = cache.resident_bytes() - fresh;
    // Independent count of the bytes in use: 31 pages per head and stream, each with its
    // Arc counters (16 B) and page-table entry (16 B); K page = 32·(32 B codes + 2 B norm),
    // V page = 32·128 B; the tail holds the 8 newest tokens in fp16 (128 B each).
    let pages = (n - 8) / 32;
    let (k_page, v_page, overhead, tail) = (32 * 34, 32 * 128, 16 + 16, 8 * 128);
    let k_bytes = 3 * (pages * (k_page + overhead) + tail);
    assert_eq!(grown, k_bytes + 3 * (pages * (v_page + overhead) + tail));
    let (kb, vb) = cache.bits_per_value();
    assert!((kb - 4.25).abs() < 1e-9 && (vb - 16.0).abs() < 1e-9);
    // Effective bits: those bytes plus the K formats' state (the Hadamard signs and the
    // 16 + 15 codebook entries, f32, for each of 2 layers × 3 heads) over the values held.
    let (ek, _) = cache.effective_bits();
    let k_state = 2 * 3 * (64 + 31) * 4;
    let want = 8.0 * (k_bytes + k_state) as f64 / (3 * n * 64) as f64;
    assert!((ek - want).abs() < 1e-9, "effective K bits {ek}, want {want}");
    // A window of any size costs only the tokens it holds (nothing is reserved up front).
    let mut big = cfg("turboquant_mse:4", "fp16", 1 << 24);
    big.sink = 1 << 24;
    let big = PagedCache::new(big).unwrap();
    assert_eq!(big.resident_bytes(), fresh);
}

#[test]
fn append_rejects_bad_input_without_storing() {
    let mut cache = PagedCache::new(cfg("turboquant_mse:2", "fp16", 0)).unwrap();
    let good = vec![0.5f32; 3 * 64];
    assert!(matches!(cache.append(0, &good[1..], &good, 1), Err(VqError::ShapeMismatch { .. })));
    assert!(matches!(cache.append(0, &good, &good, 2), Err(VqError::ShapeMismatch { .. })));
    assert!(matches!(cache.append(5, &good, &good, 1), Err(VqError::OutOfRange { .. })));
    let mut bad = good.clone();
    bad[64 + 3] = f32::INFINITY;
    assert_eq!(
        cache.append(0, &good, &bad, 1),
        Err(VqError::NonFinite { what: "appended values", token: 1, channel: 3 })
    );
    assert_eq!(cache.n_tokens(0).unwrap(), 0);
    assert!(matches!(
        PagedCache::new(CacheConfig::new(
            0,
            1,
            64,
            FormatSpec::parse("fp16").unwrap(),
            FormatSpec::parse("fp16").unwrap()
        )),
        Err(VqError::InvalidConfig(_))
    ));
    let kv_only = FormatSpec::parse("fp16").unwrap();
    assert!(matches!(
        PagedCache::new(CacheConfig::new(1, 1, 0, kv_only.clone(), kv_only)),
        Err(VqError::UnsupportedHeadDim { .. })
    ));
}

/// Caches of one configuration share their (uncalibrated) format instances — one rotation
/// and codebook per (layer, head, stream) for all of a server's sequences — and attend
/// exactly as a cache alone would; another seed or spec builds its own.
#[test]
fn caches_of_one_configuration_share_format_instances() {
    let a = PagedCache::new(cfg("turboquant_mse:4:eden", "turboquant_mse:3", 4)).unwrap();
    let mut b = PagedCache::new(cfg("turboquant_mse:4:eden", "turboquant_mse:3", 4)).unwrap();
    let mut other_seed = cfg("turboquant_mse:4:eden", "turboquant_mse:3", 4);
    other_seed.seed ^= 1;
    let c = PagedCache::new(other_seed).unwrap();
    let d = PagedCache::new(cfg("turboquant_mse:3", "turboquant_mse:3", 4)).unwrap();
    fn fmt(p: &PagedCache, l: usize) -> *const u8 {
        (p.layer(l).unwrap().keys[1].format() as *const dyn veloxquant::Format).cast()
    }
    for l in 0..2 {
        assert!(std::ptr::eq(fmt(&a, l), fmt(&b, l)), "layer {l}: not shared");
        assert!(!std::ptr::eq(fmt(&a, l), fmt(&c, l)), "layer {l}: another seed shared");
        assert!(!std::ptr::eq(fmt(&a, l), fmt(&d, l)), "layer {l}: another spec shared");
    }
    assert!(!std::ptr::eq(fmt(&a, 0), fmt(&a, 1)), "layers share a rotation");
    // Alone (a fresh one after every other is gone) and shared, the same bits.
    let mut rng = veloxquant::rng::SplitMix64::new(5);
    let (k, v, q) = (rng.gaussian_vec(3 * 40 * 64), rng.gaussian_vec(3 * 40 * 64), rng.gaussian_vec(6 * 64));
    b.append(0, &k, &v, 40).unwrap();
    let shared = veloxquant::attn::decode_attention(&b, 0, &q, 6).unwrap();
    drop((a, b, c, d));
    let mut alone = PagedCache::new(cfg("turboquant_mse:4:eden", "turboquant_mse:3", 4)).unwrap();
    alone.append(0, &k, &v, 40).unwrap();
    let fresh = veloxquant::attn::decode_attention(&alone, 0, &q, 6).unwrap();
    assert_eq!(
        shared.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        fresh.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
}
