//! Cache lifecycle: save → load round trips for every format, every kind of corrupted file,
//! trim / fork against a model of the cache (the tokens it should hold), batched attention.

mod common;

use std::io::Cursor;

use common::{all_specs, cache_config, unsupported, usable_for};
use half::f16;
use proptest::prelude::*;
use veloxquant::attn::{decode_attention, decode_attention_batch, materialize};
use veloxquant::cache::{LoadCheck, SaveInfo};
use veloxquant::rng::SplitMix64;
use veloxquant::{CacheConfig, FormatSpec, PagedCache, Stream, VqError};

const D: usize = 64;
const N_KV: usize = 2;
const N_HEADS: usize = 4;

fn append_random(cache: &mut PagedCache, n: usize, rng: &mut SplitMix64) -> (Vec<f32>, Vec<f32>) {
    let cfg = cache.config().clone();
    let len = cfg.n_kv_heads * n * cfg.head_dim;
    let (k, v) = (rng.gaussian_vec(len), rng.gaussian_vec(len));
    for l in 0..cfg.n_layers {
        cache.append(l, &k, &v, n).unwrap();
    }
    (k, v)
}

fn attention_all_layers(cache: &PagedCache, q: &[f32]) -> Vec<Vec<f32>> {
    (0..cache.config().n_layers).map(|l| decode_attention(cache, l, q, N_HEADS).unwrap()).collect()
}

fn save_to_vec(cache: &PagedCache, info: &SaveInfo) -> Vec<u8> {
    let mut buf = Vec::new();
    let n = cache.save(&mut buf, info).unwrap();
    assert_eq!(n as usize, buf.len());
    buf
}

/// A key spec usable for keys and a value spec usable for values, from one variant.
fn kv_specs(spec: &FormatSpec) -> (FormatSpec, FormatSpec) {
    let fallback = FormatSpec::parse("turboquant_mse:3").unwrap();
    let k = if usable_for(spec, Stream::Keys) { spec.clone() } else { fallback.clone() };
    let v = if usable_for(spec, Stream::Values) { spec.clone() } else { fallback };
    (k, v)
}

#[test]
fn save_load_round_trip_is_bit_identical_for_every_format() {
    let mut rng = SplitMix64::new(0x5A7E);
    let q = rng.gaussian_vec(N_HEADS * D);
    for spec in all_specs() {
        if unsupported(&spec, D, Stream::Keys) || unsupported(&spec, D, Stream::Values) {
            continue;
        }
        let (k, v) = kv_specs(&spec);
        for (recent, sink, n) in [(0, 0, 75), (8, 4, 101)] {
            let mut cfg = cache_config(N_KV, D, &k, &v);
            cfg.n_layers = 2;
            (cfg.recent, cfg.sink) = (recent, sink);
            let mut cache = PagedCache::new(cfg).unwrap();
            append_random(&mut cache, n, &mut rng);
            let info = SaveInfo { model: Some("test-model".into()), user: [("tokens".into(), "1,2,3".into())].into() };
            let bytes = save_to_vec(&cache, &info);
            let check = LoadCheck {
                n_layers: Some(2),
                n_kv_heads: Some(N_KV),
                head_dim: Some(D),
                model: Some("test-model".into()),
            };
            let (back, back_info) = PagedCache::load(&mut Cursor::new(&bytes), &check).unwrap();
            assert_eq!(back_info, info, "{spec}");
            assert_eq!(attention_all_layers(&back, &q), attention_all_layers(&cache, &q), "{spec} R={recent} S={sink}");
            assert_eq!(back.resident_bytes(), cache.resident_bytes(), "{spec}");
            assert!(same_file(&save_to_vec(&back, &info), &bytes), "{spec}: re-saving gives the same file");
            // Appending after a load continues exactly as the original would.
            let (mut a, mut b) = (cache.fork(), back);
            let mut r1 = SplitMix64::new(7);
            let mut r2 = SplitMix64::new(7);
            append_random(&mut a, 40, &mut r1);
            append_random(&mut b, 40, &mut r2);
            assert_eq!(attention_all_layers(&a, &q), attention_all_layers(&b, &q), "{spec}: after more appends");
        }
    }
}

/// A small file with every section present: sinks, pages (an open one), tail, and a
/// calibrated format's trained state.
fn sample_file() -> (PagedCache, Vec<u8>) {
    let k = FormatSpec::parse("turboquant_mse:4").unwrap();
    let v = FormatSpec::parse("vecinfer:4:g4").unwrap();
    let mut cfg = cache_config(N_KV, D, &k, &v);
    cfg.page_tokens = 8;
    (cfg.recent, cfg.sink) = (3, 2);
    let mut cache = PagedCache::new(cfg).unwrap();
    append_random(&mut cache, 21, &mut SplitMix64::new(3));
    let bytes = save_to_vec(&cache, &SaveInfo { model: Some("m".into()), user: Default::default() });
    (cache, bytes)
}

/// Same header entries (JSON object order aside) and byte-identical payload.
fn same_file(a: &[u8], b: &[u8]) -> bool {
    let (ha, hb) = (header_len(a), header_len(b));
    let parse = |x: &[u8]| serde_json::from_slice::<serde_json::Value>(x).unwrap();
    parse(&a[8..ha]) == parse(&b[8..hb]) && a[ha..] == b[hb..]
}

fn header_len(bytes: &[u8]) -> usize {
    8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize
}

fn load(bytes: &[u8]) -> Result<PagedCache, VqError> {
    PagedCache::load(&mut Cursor::new(bytes), &LoadCheck::default()).map(|(c, _)| c)
}

#[test]
fn every_truncation_is_a_typed_error() {
    let (_, bytes) = sample_file();
    assert!(load(&bytes).is_ok());
    for cut in 0..bytes.len() {
        match load(&bytes[..cut]) {
            Err(VqError::FileTruncated { .. }) => {}
            other => panic!("cut at {cut} of {}: {other:?}", bytes.len()),
        }
    }
}

#[test]
fn every_flipped_header_byte_and_sampled_payload_byte_is_a_typed_error() {
    let (_, bytes) = sample_file();
    let h = header_len(&bytes);
    let mut rng = SplitMix64::new(9);
    let payload_positions = (0..400).map(|_| h + (rng.next_u64() as usize) % (bytes.len() - h));
    for pos in (0..h).chain(payload_positions) {
        for mask in [0x01u8, 0x80] {
            let mut bad = bytes.clone();
            bad[pos] ^= mask;
            let err = load(&bad).expect_err(&format!("flip {mask:#x} at {pos} (header {h}) loaded"));
            assert!(
                matches!(
                    err,
                    VqError::FileCorrupt(_)
                        | VqError::FileChecksum { .. }
                        | VqError::FileTruncated { .. }
                        | VqError::FileVersion { .. }
                ),
                "flip at {pos}: {err:?}"
            );
            if pos >= h {
                assert!(matches!(err, VqError::FileChecksum { .. }), "payload flip at {pos}: {err:?}");
            }
        }
    }
}

/// A file from a header (JSON, padded to 8 bytes as safetensors does) and a payload.
fn rebuild(header: &serde_json::Value, payload: &[u8]) -> Vec<u8> {
    let mut hb = serde_json::to_vec(header).unwrap();
    hb.resize(hb.len().next_multiple_of(8), b' ');
    let mut out = (hb.len() as u64).to_le_bytes().to_vec();
    out.extend(hb);
    out.extend(payload);
    out
}

/// Rewrite one `__metadata__` entry (header rebuilt, payload kept).
fn with_meta(bytes: &[u8], key: &str, edit: impl Fn(&str) -> String) -> Vec<u8> {
    let h = header_len(bytes);
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..h]).unwrap();
    let old = header["__metadata__"][key].as_str().unwrap().to_string();
    header["__metadata__"][key] = serde_json::Value::String(edit(&old));
    rebuild(&header, &bytes[h..])
}

/// `crc32` recomputed as the loader does (sorted metadata entries, then the payload), so an
/// edited header passes the checksum and reaches the checks behind it.
fn reseal(bytes: &[u8]) -> Vec<u8> {
    let h = header_len(bytes);
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..h]).unwrap();
    let meta = header["__metadata__"].as_object_mut().unwrap();
    let sorted: std::collections::BTreeMap<String, String> =
        meta.iter().filter(|(k, _)| *k != "crc32").map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string())).collect();
    let mut crc = crc32fast::Hasher::new();
    for (k, v) in &sorted {
        crc.update(k.as_bytes());
        crc.update(&[0]);
        crc.update(v.as_bytes());
        crc.update(&[0]);
    }
    crc.update(&bytes[h..]);
    meta.insert("crc32".into(), format!("{:08x}", crc.finalize()).into());
    rebuild(&header, &bytes[h..])
}

#[test]
fn wrong_version_fingerprint_and_huge_sizes_are_refused_without_allocating() {
    let (_, bytes) = sample_file();
    let v3 = with_meta(&bytes, "version", |_| "3".into());
    assert!(matches!(load(&v3), Err(VqError::FileVersion { ref found, supported: 2 }) if found == "3"));

    let fp = |check: LoadCheck| PagedCache::load(&mut Cursor::new(&bytes), &check).map(|_| ()).unwrap_err();
    assert!(matches!(
        fp(LoadCheck { n_layers: Some(30), ..Default::default() }),
        VqError::FileMismatch { what: "n_layers", .. }
    ));
    assert!(matches!(
        fp(LoadCheck { head_dim: Some(128), ..Default::default() }),
        VqError::FileMismatch { what: "head_dim", .. }
    ));
    assert!(matches!(
        fp(LoadCheck { n_kv_heads: Some(3), ..Default::default() }),
        VqError::FileMismatch { what: "n_kv_heads", .. }
    ));
    assert!(matches!(
        fp(LoadCheck { model: Some("other".into()), ..Default::default() }),
        VqError::FileMismatch { what: "model", .. }
    ));

    // Declared sizes far beyond the data: a header length of 2^63, and a config whose
    // counts imply terabytes. Both fail at once, before anything of that size exists.
    let mut huge = bytes.clone();
    huge[..8].copy_from_slice(&(1u64 << 63).to_le_bytes());
    assert!(matches!(load(&huge), Err(VqError::FileCorrupt(_))));
    let big_count = with_meta(&bytes, "config", |c| c.replacen("\"n_tokens\":21", "\"n_tokens\":4000000000000", 1));
    assert!(load(&big_count).is_err());
    let big_dims = with_meta(&bytes, "config", |c| c.replacen("\"n_kv_heads\":2", "\"n_kv_heads\":100000000", 1));
    assert!(matches!(load(&big_dims), Err(VqError::FileCorrupt(_))));
    // A header that declares far more structure than its data (huge windows, so every
    // stream would reserve gigabytes), with a valid checksum: refused before building.
    let big_window = reseal(&with_meta(&bytes, "config", |c| c.replacen("\"recent\":3", "\"recent\":1000000000", 1)));
    match load(&big_window) {
        Err(VqError::FileCorrupt(why)) => assert!(why.contains("structure"), "{why}"),
        other => panic!("{:?}", other.map(|_| ())),
    }
    let mut cfg = CacheConfig::new(1, 1, D, FormatSpec::parse("fp16").unwrap(), FormatSpec::parse("fp16").unwrap());
    cfg.recent = usize::MAX / 4;
    assert!(matches!(PagedCache::new(cfg), Err(VqError::InvalidConfig(_))));

    // The last tensor of the table declares 1 TB (offsets consistent, so the table is
    // valid): the read stops at the end of the input, having allocated one chunk at most.
    let h = header_len(&bytes);
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..h]).unwrap();
    let last = header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .max_by_key(|(_, t)| t["data_offsets"][1].as_u64().unwrap())
        .map(|(k, _)| k.clone())
        .unwrap();
    assert!(last.ends_with(".state"), "{last}");
    let start = header[&last]["data_offsets"][0].as_u64().unwrap();
    let floats = 1u64 << 38;
    header[&last]["shape"] = serde_json::json!([floats]);
    header[&last]["data_offsets"] = serde_json::json!([start, start + 4 * floats]);
    let lying = rebuild(&header, &bytes[h..]);
    assert!(matches!(load(&lying), Err(VqError::FileTruncated { .. })));
}

#[test]
fn trim_then_append_matches_a_cache_that_never_saw_the_trimmed_tokens() {
    // Row mode, rollback within the window (the speculative-decoding case): after trim(k)
    // and k new tokens the cache is the one that got the accepted tokens directly.
    let mut rng = SplitMix64::new(21);
    let q = rng.gaussian_vec(N_HEADS * D);
    for spec in ["turboquant_mse:4", "q4_0:rot", "fp16"] {
        let s = FormatSpec::parse(spec).unwrap();
        let mut cfg = CacheConfig::new(1, N_KV, D, s.clone(), s);
        cfg.recent = 8;
        let mut a = PagedCache::new(cfg.clone()).unwrap();
        let mut b = PagedCache::new(cfg).unwrap();
        let (k, v) = (rng.gaussian_vec(N_KV * 90 * D), rng.gaussian_vec(N_KV * 90 * D));
        let per_head = |x: &[f32], t0: usize, t1: usize| -> Vec<f32> {
            (0..N_KV).flat_map(|h| x[(h * 90 + t0) * D..(h * 90 + t1) * D].to_vec()).collect()
        };
        a.append(0, &per_head(&k, 0, 80), &per_head(&v, 0, 80), 80).unwrap();
        let (dk, dv) = (rng.gaussian_vec(N_KV * 5 * D), rng.gaussian_vec(N_KV * 5 * D)); // rejected draft
        a.append(0, &dk, &dv, 5).unwrap();
        a.trim(5).unwrap();
        a.append(0, &per_head(&k, 80, 90), &per_head(&v, 80, 90), 10).unwrap();
        b.append(0, &per_head(&k, 0, 90), &per_head(&v, 0, 90), 90).unwrap();
        assert_eq!(
            decode_attention(&a, 0, &q, N_HEADS).unwrap(),
            decode_attention(&b, 0, &q, N_HEADS).unwrap(),
            "{spec}"
        );
    }
    let mut c = PagedCache::new(CacheConfig::new(
        2,
        N_KV,
        D,
        FormatSpec::parse("fp16").unwrap(),
        FormatSpec::parse("fp16").unwrap(),
    ))
    .unwrap();
    c.append(0, &rng.gaussian_vec(N_KV * 3 * D), &rng.gaussian_vec(N_KV * 3 * D), 3).unwrap();
    assert!(matches!(c.trim(1), Err(VqError::TrimTooFar { layer: 1, requested: 1, held: 0 })));
    assert_eq!(c.n_tokens(0).unwrap(), 3, "a refused trim changes nothing");
}

#[test]
fn forks_share_pages_and_batched_attention_equals_single_calls() {
    let s = FormatSpec::parse("turboquant_mse:4").unwrap();
    let mut cfg = CacheConfig::new(1, N_KV, D, s.clone(), s);
    cfg.recent = 4;
    let mut a = PagedCache::new(cfg).unwrap();
    let mut rng = SplitMix64::new(5);
    append_random(&mut a, 32 * 10 + 4, &mut rng); // 10 full pages
    let alone = a.resident_bytes();
    let mut b = a.fork();
    assert_eq!(PagedCache::resident_bytes_shared(&[&a, &b]), alone + (b.resident_bytes() - page_and_state_bytes(&b)));
    append_random(&mut b, 3 * 32, &mut rng); // 3 pages of its own
    let (pa_k, pb_k) = (a.pages(0, 0).0, b.pages(0, 0).0);
    assert!(pa_k.iter().zip(pb_k).all(|(x, y)| std::sync::Arc::ptr_eq(x, y)), "full pages are shared");
    let own_pages = 3 * 2 * N_KV * (b.pages(0, 0).0[0].len() + 16);
    let together = PagedCache::resident_bytes_shared(&[&a, &b]);
    let b_own = together - alone;
    assert!(b_own <= own_pages + (b.resident_bytes() - page_and_state_bytes(&b)) + 1024, "fork costs {b_own} B");
    assert!(b_own < b.resident_bytes() / 3, "fork costs {b_own} of {} B", b.resident_bytes());
    // The original is unaffected by the fork's appends.
    let q = rng.gaussian_vec(N_HEADS * D);
    let before = decode_attention(&a, 0, &q, N_HEADS).unwrap();
    let mut c = b.fork();
    c.trim(100).unwrap();
    let (q2, q3) = (rng.gaussian_vec(N_HEADS * D), rng.gaussian_vec(N_HEADS * D));
    let batch = decode_attention_batch(&[(&a, &q), (&b, &q2), (&c, &q3)], 0, N_HEADS).unwrap();
    assert_eq!(batch[0], before);
    assert_eq!(batch[1], decode_attention(&b, 0, &q2, N_HEADS).unwrap());
    assert_eq!(batch[2], decode_attention(&c, 0, &q3, N_HEADS).unwrap());
}

/// Pages (with their reference-count headers) and format state of one cache.
fn page_and_state_bytes(c: &PagedCache) -> usize {
    let cfg = c.config();
    (0..cfg.n_layers)
        .flat_map(|l| (0..cfg.n_kv_heads).map(move |h| (l, h)))
        .map(|(l, h)| {
            let (k, v) = c.pages(l, h);
            let layer = c.layer(l).unwrap();
            let state = layer.keys[h].format().state_bytes() + layer.values[h].format().state_bytes();
            k.iter().chain(v).map(|p| p.len() + 16).sum::<usize>() + state
        })
        .sum()
}

// ---- property test: random append / trim / fork sequences against a model ----

/// The model: the tokens a sequence holds (as stored, f16-rounded), per KV head, and how
/// many of the non-sink tokens are held in pages.
#[derive(Clone, Debug)]
struct Model {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    encoded: usize,
}

impl Model {
    fn n(&self) -> usize {
        self.k[0].len() / D
    }
}

#[derive(Clone, Debug)]
enum Op {
    Append(usize),
    Trim(usize),
    Fork,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![4 => (1usize..70).prop_map(Op::Append), 3 => (0usize..60).prop_map(Op::Trim), 1 => Just(Op::Fork)]
}

const PROP_SPECS: &[&str] =
    &["turboquant_mse:4", "turboquant_mse:2:eden", "q8_0", "q4_0:rot", "fp16", "kivi:2", "turboquant_prod:3", "qjl"];

fn round16(x: &[f32]) -> Vec<f32> {
    x.iter().map(|v| f16::from_f32(*v).to_f32()).collect()
}

/// What `cache` must equal: a fresh cache given the model's tokens with a window that puts
/// exactly `encoded` tokens in pages.
fn oracle(cfg: &CacheConfig, m: &Model) -> PagedCache {
    let n = m.n();
    let mut cfg = cfg.clone();
    let sinks = n.min(cfg.sink);
    cfg.recent = n - sinks - m.encoded;
    let mut c = PagedCache::new(cfg).unwrap();
    let flat = |x: &Vec<Vec<f32>>| x.concat();
    if n > 0 {
        c.append(0, &flat(&m.k), &flat(&m.v), n).unwrap();
    }
    c
}

fn apply(cache: &mut PagedCache, m: &mut Model, op: &Op, rng: &mut SplitMix64) {
    let cfg = cache.config().clone();
    let (t, sink, recent) = (cfg.page_tokens, cfg.sink, cfg.recent);
    match *op {
        Op::Append(n) => {
            let (k, v) = (rng.gaussian_vec(N_KV * n * D), rng.gaussian_vec(N_KV * n * D));
            cache.append(0, &k, &v, n).unwrap();
            for h in 0..N_KV {
                m.k[h].extend(round16(&k[h * n * D..(h + 1) * n * D]));
                m.v[h].extend(round16(&v[h * n * D..(h + 1) * n * D]));
            }
            let old = m.n().saturating_sub(sink);
            if cache.row_mode() {
                m.encoded = m.encoded.max(old.saturating_sub(recent));
            } else {
                while old - m.encoded >= recent + t {
                    m.encoded += t;
                }
            }
        }
        Op::Trim(k) => {
            let n = m.n();
            let k = k.min(n);
            let sinks = n.min(sink);
            let tail = n - sinks - m.encoded;
            let from_pages = k.saturating_sub(tail).min(m.encoded);
            if from_pages > 0 {
                let keep = m.encoded - from_pages;
                if cache.row_mode() {
                    m.encoded = keep;
                } else {
                    // The partly kept page's rows come back as the format decodes them.
                    let (full, rows) = (keep / t * t, keep % t);
                    if rows > 0 {
                        for h in 0..N_KV {
                            for values in [false, true] {
                                let layer = cache.layer(0).unwrap();
                                let (store, toks) = if values {
                                    (&layer.values[h], &mut m.v[h])
                                } else {
                                    (&layer.keys[h], &mut m.k[h])
                                };
                                let f = store.format();
                                let at = (sinks + full) * D;
                                let mut page = vec![0u8; f.page_bytes()];
                                f.encode_page(&toks[at..at + t * D], &mut page).unwrap();
                                let mut dec = vec![0f32; t * D];
                                f.decode_page(&page, &mut dec);
                                toks[at..at + rows * D].copy_from_slice(&round16(&dec[..rows * D]));
                            }
                        }
                    }
                    m.encoded = full;
                }
            }
            cache.trim(k).unwrap();
            for x in m.k.iter_mut().chain(m.v.iter_mut()) {
                x.truncate((n - k) * D);
            }
        }
        Op::Fork => unreachable!("handled by the caller"),
    }
}

fn check_equal(cache: &PagedCache, m: &Model, q: &[f32]) -> Result<(), TestCaseError> {
    let want = oracle(cache.config(), m);
    prop_assert_eq!(cache.n_tokens(0).unwrap(), m.n());
    let layer = cache.layer(0).unwrap();
    let wl = want.layer(0).unwrap();
    for h in 0..N_KV {
        prop_assert_eq!(layer.keys[h].paged_tokens(), wl.keys[h].paged_tokens());
        prop_assert_eq!(materialize(&layer.keys[h]), materialize(&wl.keys[h]));
        prop_assert_eq!(materialize(&layer.values[h]), materialize(&wl.values[h]));
    }
    if m.n() > 0 {
        prop_assert_eq!(
            decode_attention(cache, 0, q, N_HEADS).unwrap(),
            decode_attention(&want, 0, q, N_HEADS).unwrap()
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]
    #[test]
    fn append_trim_fork_sequences_match_the_model(
        spec_i in 0..PROP_SPECS.len(),
        recent in prop_oneof![Just(0usize), Just(5), Just(8)],
        sink in prop_oneof![Just(0usize), Just(3)],
        ops in prop::collection::vec(op(), 1..12),
        seed in any::<u64>(),
    ) {
        let spec = FormatSpec::parse(PROP_SPECS[spec_i]).unwrap();
        let (k, v) = kv_specs(&spec);
        let mut cfg = CacheConfig::new(1, N_KV, D, k, v);
        (cfg.recent, cfg.sink) = (recent, sink);
        let mut rng = SplitMix64::new(seed);
        let q = rng.gaussian_vec(N_HEADS * D);
        let mut seqs = vec![(PagedCache::new(cfg).unwrap(), Model { k: vec![vec![]; N_KV], v: vec![vec![]; N_KV], encoded: 0 })];
        for op in &ops {
            let i = seqs.len() - 1;
            if let Op::Fork = op {
                let (c, m) = &seqs[i];
                let forked = (c.fork(), m.clone());
                seqs.push(forked);
                continue;
            }
            let (c, m) = &mut seqs[i];
            apply(c, m, op, &mut rng);
            for (c, m) in &seqs {
                check_equal(c, m, &q)?;
            }
        }
        // Every fork shares the full pages it has in common with its parent.
        for w in seqs.windows(2) {
            let (a, b) = (&w[0].0, &w[1].0);
            let (pa, pb) = (a.pages(0, 0).0, b.pages(0, 0).0);
            let shared = pa.iter().zip(pb).filter(|(x, y)| std::sync::Arc::ptr_eq(x, y)).count();
            let together = PagedCache::resident_bytes_shared(&[a, b]);
            prop_assert!(together <= a.resident_bytes() + b.resident_bytes());
            if shared > 0 {
                prop_assert!(together < a.resident_bytes() + b.resident_bytes());
            }
        }
    }
}

/// The fuzz seeds (a mode byte, then a cache file from `examples/save_load.rs`) still load,
/// and every input the fuzzer once crashed on (fuzz/regressions/cache_load) now gives a
/// cache or a typed error.
#[test]
fn fuzz_seeds_load_and_fuzz_regressions_stay_fixed() {
    let fuzz = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    let mut seeds = 0;
    for entry in std::fs::read_dir(fuzz.join("seeds/cache_load")).unwrap() {
        let bytes = std::fs::read(entry.unwrap().path()).unwrap();
        assert!(load(&bytes[1..]).is_ok());
        seeds += 1;
    }
    assert!(seeds >= 3);
    if let Ok(dir) = std::fs::read_dir(fuzz.join("regressions/cache_load")) {
        for entry in dir {
            let bytes = std::fs::read(entry.unwrap().path()).unwrap();
            let _ = bytes.split_first().map(|(_, file)| load(file));
            let _ = load(&reseal_or_raw(&bytes[1.min(bytes.len())..]));
        }
    }
}

/// `reseal` for arbitrary bytes: the input itself when it has no parsable header.
fn reseal_or_raw(bytes: &[u8]) -> Vec<u8> {
    let parsable = bytes.len() >= 8
        && usize::try_from(u64::from_le_bytes(bytes[..8].try_into().unwrap()))
            .ok()
            .and_then(|n| n.checked_add(8))
            .filter(|&h| h <= bytes.len())
            .and_then(|h| serde_json::from_slice::<serde_json::Value>(&bytes[8..h]).ok())
            .is_some_and(|v| v["__metadata__"].as_object().is_some_and(|m| m.values().all(|x| x.is_string())));
    if parsable {
        reseal(bytes)
    } else {
        bytes.to_vec()
    }
}

/// Save into one end of a socket and load from the other, with more data after the file:
/// no seeking, the loader reads exactly the file's bytes and leaves the rest unread.
#[cfg(unix)]
#[test]
fn save_and_load_stream_through_a_socket() {
    use std::io::{Read, Write};
    let (cache, _) = sample_file();
    let (mut tx, mut rx) = std::os::unix::net::UnixStream::pair().unwrap();
    let sender = cache.fork();
    let writer = std::thread::spawn(move || {
        sender.save(&mut tx, &SaveInfo::default()).unwrap();
        tx.write_all(b"next message").unwrap();
    });
    let (back, _) = PagedCache::load(&mut rx, &LoadCheck::default()).unwrap();
    writer.join().unwrap();
    let mut rest = String::new();
    rx.read_to_string(&mut rest).unwrap();
    assert_eq!(rest, "next message");
    let q = SplitMix64::new(4).gaussian_vec(N_HEADS * D);
    assert_eq!(decode_attention(&back, 0, &q, N_HEADS).unwrap(), decode_attention(&cache, 0, &q, N_HEADS).unwrap());
}

/// A short context (fewer pages than the batch path hands out) takes the single-sequence
/// path, which must give the batch path's bits: row and page mode, R and S > 0, every
/// kind of query preparation, lengths from one token to past two pages.
#[test]
fn short_context_attention_equals_the_batch_path() {
    let methods = [
        ("turboquant_mse:4:eden", "turboquant_mse:3", 8, 4),
        ("fp16", "fp16", 0, 0),
        ("q8_0", "q4_0", 3, 1),
        ("kivi:2", "kivi:4", 4, 2),
        ("qjl", "turboquant_mse:2", 0, 2),
        ("rabitq", "q8_0", 5, 0),
        ("turboquant_prod:3", "turboquant_rvq:2:2", 2, 3),
    ];
    let mut rng = SplitMix64::new(41);
    for (k, v, recent, sink) in methods {
        let mut cfg = CacheConfig::new(1, N_KV, D, FormatSpec::parse(k).unwrap(), FormatSpec::parse(v).unwrap());
        (cfg.recent, cfg.sink) = (recent, sink);
        let mut a = PagedCache::new(cfg.clone()).unwrap();
        let mut other = PagedCache::new(cfg).unwrap();
        append_random(&mut other, 5, &mut rng);
        for len in 1..=75 {
            append_random(&mut a, 1, &mut rng);
            let (q, q2) = (rng.gaussian_vec(N_HEADS * D), rng.gaussian_vec(N_HEADS * D));
            let alone = decode_attention(&a, 0, &q, N_HEADS).unwrap();
            let batch = decode_attention_batch(&[(&a, &q), (&other, &q2)], 0, N_HEADS).unwrap();
            assert_eq!(alone, batch[0], "{k}/{v}@{recent}+{sink} at {len} tokens");
            assert!(alone.iter().all(|x| x.is_finite()));
        }
    }
}
