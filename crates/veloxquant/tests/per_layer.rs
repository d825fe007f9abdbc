//! Per-layer K/V formats: the config accessor, each layer behaving exactly as a uniform
//! cache of its own specs, save → load of per-layer caches (file version 2), and the
//! version 1 files written before per-layer specs existed.

use std::io::Cursor;

use veloxquant::attn::decode_attention;
use veloxquant::cache::{LoadCheck, SaveInfo};
use veloxquant::rng::SplitMix64;
use veloxquant::{CacheConfig, Calibration, FormatSpec, LayerSpec, PagedCache, Stream, VqError};

const D: usize = 64;
const N_KV: usize = 2;

fn spec(s: &str) -> FormatSpec {
    FormatSpec::parse(s).unwrap()
}

fn layer(k: &str, v: &str) -> LayerSpec {
    LayerSpec::new(spec(k), spec(v))
}

/// Three layers with different formats, calibrated ones included.
fn per_layer_config() -> CacheConfig {
    let mut cfg = CacheConfig::new(3, N_KV, D, spec("turboquant_mse:3"), spec("turboquant_mse:3"));
    cfg.layers = Some(vec![
        layer("q4_0:rot", "turboquant_mse:2"),
        layer("turboquant_frac:3.5:center:eden", "turboquant_frac:2.5:center"),
        layer("turboquant_mse:4:eden", "fp16"),
    ]);
    (cfg.recent, cfg.sink) = (5, 2);
    let mut rng = SplitMix64::new(3);
    let mut cal = Calibration::new();
    cal.insert_for_all(Stream::Keys, rng.gaussian_vec(256 * D));
    cal.insert_for_all(Stream::Values, rng.gaussian_vec(256 * D));
    cfg.calibration = Some(cal.into());
    cfg
}

fn fill(cache: &mut PagedCache, n: usize, seed: u64) {
    let mut rng = SplitMix64::new(seed);
    for l in 0..cache.config().n_layers {
        cache.append(l, &rng.gaussian_vec(N_KV * n * D), &rng.gaussian_vec(N_KV * n * D), n).unwrap();
    }
}

#[test]
fn each_layer_is_its_own_uniform_cache() {
    let cfg = per_layer_config();
    assert_eq!(cfg.spec(0, Stream::Keys), &spec("q4_0:rot"));
    assert_eq!(cfg.spec(1, Stream::Values), &spec("turboquant_frac:2.5:center"));
    assert!(!cfg.is_uniform());
    let mut mixed = PagedCache::new(cfg.clone()).unwrap();
    fill(&mut mixed, 77, 1);
    let q = SplitMix64::new(9).gaussian_vec(4 * D);
    let layers = cfg.layers.clone().unwrap();
    for (l, ls) in layers.iter().enumerate() {
        // The same seed and calibration, every layer on this layer's specs.
        let mut uni = cfg.clone();
        (uni.k, uni.v, uni.layers) = (ls.k.clone(), ls.v.clone(), None);
        let mut uniform = PagedCache::new(uni).unwrap();
        fill(&mut uniform, 77, 1);
        assert_eq!(
            decode_attention(&mixed, l, &q, 4).unwrap(),
            decode_attention(&uniform, l, &q, 4).unwrap(),
            "layer {l}"
        );
        let (mk, uk) = (mixed.layer(l).unwrap(), uniform.layer(l).unwrap());
        assert_eq!(mk.keys[1].pages(), uk.keys[1].pages());
        assert_eq!(mk.values[0].resident_bytes(), uk.values[0].resident_bytes());
    }
    // Bits per value: the layers' mean.
    let want_k = layers.iter().map(|ls| bits(&ls.k)).sum::<f64>() / 3.0;
    assert!((mixed.bits_per_value().0 - want_k).abs() < 1e-12);
    // A list that does not cover the layers is refused.
    let mut short = cfg.clone();
    short.layers.as_mut().unwrap().pop();
    assert!(matches!(PagedCache::new(short), Err(VqError::InvalidConfig(_))));
}

fn bits(s: &FormatSpec) -> f64 {
    let mut ctx = veloxquant::format::FormatCtx::new(D, 32, Stream::Keys, 1);
    ctx.calibration = Some(SplitMix64::new(3).gaussian_vec(256 * D).into());
    s.build(&ctx).unwrap().bits_per_value()
}

#[test]
fn per_layer_caches_save_and_load_bit_identically() {
    let mut cache = PagedCache::new(per_layer_config()).unwrap();
    fill(&mut cache, 70, 2);
    let mut bytes = Vec::new();
    cache.save(&mut bytes, &SaveInfo::default()).unwrap();
    let (back, _) = PagedCache::load(&mut Cursor::new(&bytes), &LoadCheck::default()).unwrap();
    assert_eq!(back.config().layers, cache.config().layers);
    let q = SplitMix64::new(4).gaussian_vec(4 * D);
    for l in 0..3 {
        assert_eq!(decode_attention(&back, l, &q, 4).unwrap(), decode_attention(&cache, l, &q, 4).unwrap());
    }
    assert_eq!(meta(&bytes)["version"], "2");
    // A per-layer list that does not cover the layers, or per-layer specs in a file that
    // says version 1, is refused (the config is checked before the payload is read).
    let short = edit_meta(&bytes, "config", |c| {
        let mut j: serde_json::Value = serde_json::from_str(c).unwrap();
        j["layer_specs"].as_array_mut().unwrap().pop();
        j.to_string()
    });
    assert!(matches!(PagedCache::load(&mut Cursor::new(&short), &LoadCheck::default()), Err(VqError::FileCorrupt(_))));
    let v1 = edit_meta(&bytes, "version", |_| "1".into());
    match PagedCache::load(&mut Cursor::new(&v1), &LoadCheck::default()) {
        Err(VqError::FileCorrupt(why)) => assert!(why.contains("per-layer"), "{why}"),
        other => panic!("{:?}", other.map(|_| ())),
    }
}

fn header(bytes: &[u8]) -> (serde_json::Value, usize) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    (serde_json::from_slice(&bytes[8..8 + n]).unwrap(), 8 + n)
}

fn meta(bytes: &[u8]) -> serde_json::Map<String, serde_json::Value> {
    header(bytes).0["__metadata__"].as_object().unwrap().clone()
}

/// The file with one `__metadata__` entry rewritten (header re-framed, payload kept).
fn edit_meta(bytes: &[u8], key: &str, f: impl Fn(&str) -> String) -> Vec<u8> {
    let (mut h, end) = header(bytes);
    let old = h["__metadata__"][key].as_str().unwrap().to_string();
    h["__metadata__"][key] = serde_json::Value::String(f(&old));
    let mut hb = serde_json::to_vec(&h).unwrap();
    hb.resize(hb.len().next_multiple_of(8), b' ');
    let mut out = (hb.len() as u64).to_le_bytes().to_vec();
    out.extend(hb);
    out.extend(&bytes[end..]);
    out
}

/// The caches `examples/save_load.rs` writes, rebuilt from its seeded generator (the v1
/// fixtures in tests/data were written by that example before file version 2).
fn example_caches() -> Vec<(PagedCache, Vec<f32>)> {
    let mut rng = SplitMix64::new(1);
    let mut out = Vec::new();
    for (k, v, recent, sink, n) in [
        ("turboquant_mse:4:eden", "turboquant_mse:3", 4, 2, 45),
        ("kivi:2:g16", "q4_0:rot", 3, 1, 40),
        ("fp16", "vecinfer:4:g8", 0, 0, 9),
    ] {
        let mut cfg = CacheConfig::new(1, 1, 32, spec(k), spec(v));
        (cfg.recent, cfg.sink, cfg.page_tokens) = (recent, sink, 16);
        if v.starts_with("vecinfer") {
            let mut cal = Calibration::new();
            cal.insert_for_all(Stream::Values, rng.gaussian_vec(32 * 64));
            cfg.calibration = Some(cal.into());
            // Written when vecinfer coded whole pages only: the file holds a page-mode cache.
            cfg.encode_rows = false;
        }
        let mut cache = PagedCache::new(cfg).unwrap();
        cache.append(0, &rng.gaussian_vec(n * 32), &rng.gaussian_vec(n * 32), n).unwrap();
        let q = rng.gaussian_vec(2 * 32);
        out.push((cache, q));
    }
    out
}

#[test]
fn version_1_files_load_and_match_the_caches_they_were_written_from() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
    for (i, (cache, q)) in example_caches().into_iter().enumerate() {
        let bytes = std::fs::read(dir.join(format!("cache-v1-{i}.vqc"))).unwrap();
        assert_eq!(meta(&bytes)["version"], "1", "fixture {i}");
        let (back, info) = PagedCache::load(&mut Cursor::new(&bytes), &LoadCheck::default()).unwrap();
        assert_eq!(info.model.as_deref(), Some("example"));
        assert!(back.config().layers.is_none());
        assert_eq!(back.config().k, cache.config().k);
        assert_eq!(back.pages(0, 0), cache.pages(0, 0), "fixture {i}");
        assert_eq!(decode_attention(&back, 0, &q, 2).unwrap(), decode_attention(&cache, 0, &q, 2).unwrap());
        // Saved again, it is a version 2 file holding the same cache.
        let mut again = Vec::new();
        back.save(&mut again, &info).unwrap();
        let (re, _) = PagedCache::load(&mut Cursor::new(&again), &LoadCheck::default()).unwrap();
        assert_eq!(decode_attention(&re, 0, &q, 2).unwrap(), decode_attention(&cache, 0, &q, 2).unwrap());
    }
}
