//! `PagedCache::contents` / `from_contents`: the form a sequence takes between devices. A
//! cache rebuilt from its contents holds the same pages, windows and sinks and attends to the
//! bit; malformed contents are typed errors.

use veloxquant::attn::decode_attention;
use veloxquant::rng::SplitMix64;
use veloxquant::{CacheConfig, FormatSpec, PagedCache, VqError};

fn cfg(k: &str, v: &str, recent: usize, sink: usize, rows: bool) -> CacheConfig {
    let mut c = CacheConfig::new(2, 2, 64, FormatSpec::parse(k).unwrap(), FormatSpec::parse(v).unwrap());
    (c.recent, c.sink, c.encode_rows) = (recent, sink, rows);
    c
}

#[test]
fn contents_round_trip_to_the_bit() {
    for (k, v, r, s, rows) in [
        ("turboquant_mse:4:eden", "turboquant_mse:3", 8, 4, true),
        ("q8_0:rot", "q4_0", 0, 0, true),
        ("kivi:2:g32", "kivi:4:g32", 16, 2, false),
    ] {
        let c = cfg(k, v, r, s, rows);
        let mut cache = PagedCache::new(c.clone()).unwrap();
        let mut rng = SplitMix64::new(4);
        for n in [70usize, 1, 1, 33] {
            for l in 0..2 {
                cache.append(l, &rng.gaussian_vec(2 * n * 64), &rng.gaussian_vec(2 * n * 64), n).unwrap();
            }
        }
        if rows {
            cache.trim(9).unwrap(); // leaves an open page with stale rows past its valid ones
        }
        let back = PagedCache::from_contents(c.clone(), cache.contents()).unwrap();
        assert_eq!(back.contents(), cache.contents(), "{k}/{v}");
        assert_eq!(back.n_tokens(1).unwrap(), cache.n_tokens(1).unwrap());
        let q = rng.gaussian_vec(4 * 64);
        for l in 0..2 {
            let a = decode_attention(&cache, l, &q, 4).unwrap();
            let b = decode_attention(&back, l, &q, 4).unwrap();
            assert_eq!(
                a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                b.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            );
        }
    }
}

#[test]
fn malformed_contents_are_typed_errors() {
    let c = cfg("turboquant_mse:4", "turboquant_mse:4", 8, 0, true);
    let mut cache = PagedCache::new(c.clone()).unwrap();
    let mut rng = SplitMix64::new(5);
    for l in 0..2 {
        cache.append(l, &rng.gaussian_vec(2 * 50 * 64), &rng.gaussian_vec(2 * 50 * 64), 50).unwrap();
    }
    let good = cache.contents();
    let mut short = good.clone();
    short.pop();
    assert!(matches!(PagedCache::from_contents(c.clone(), short), Err(VqError::InvalidConfig(_))));
    let mut bad_page = good.clone();
    bad_page[0][0].0.pages[0].pop();
    assert!(matches!(PagedCache::from_contents(c.clone(), bad_page), Err(VqError::FileCorrupt(_))));
    let mut uneven = good.clone();
    uneven[1][1].1.tail.truncate(64);
    assert!(matches!(PagedCache::from_contents(c.clone(), uneven), Err(VqError::FileCorrupt(_))));
    let mut too_long = good;
    too_long[0][1].0.tail.extend(std::iter::repeat_n(half::f16::ONE, 64 * 20));
    assert!(PagedCache::from_contents(c, too_long).is_err());
}
