//! Hostile input on the library's entry points: the spec parser with random strings and
//! numbers gives a spec or a typed error, never a panic; sizes beyond the documented bounds
//! are refused before anything is allocated.

use proptest::prelude::*;
use veloxquant::cache::{is_cache_file, SaveInfo, MAX_HEADS, MAX_LAYERS, MAX_WINDOW_TOKENS};
use veloxquant::format::{FormatCtx, Stream, MAX_HEAD_DIM, MAX_PAGE_TOKENS, REGISTRY};
use veloxquant::{CacheConfig, FormatSpec, PagedCache, VqError};

/// Spec-like strings: a registered name or junk, then options drawn from the grammar's
/// pieces, numbers (0, 1, huge, negative) and random text.
fn spec_string() -> impl Strategy<Value = String> {
    let name =
        prop_oneof![(0..REGISTRY.len()).prop_map(|i| REGISTRY[i].name.to_string()), "[a-z_0-9]{0,12}", ".{0,8}",];
    let number = prop_oneof![
        Just("0".to_string()),
        Just("1".to_string()),
        Just("-1".to_string()),
        Just("4294967296".to_string()),
        Just("18446744073709551616".to_string()),
        any::<u32>().prop_map(|n| n.to_string()),
        any::<i64>().prop_map(|n| n.to_string()),
    ];
    let option = prop_oneof![
        number.clone(),
        number.clone().prop_map(|n| format!("{n}x")),
        number.prop_map(|n| format!("g{n}")),
        prop::sample::select(vec!["rot", "eden", "plain", "gauss", "orth", "", " ", "x", "g"]).prop_map(String::from),
        ".{0,6}",
    ];
    (name, prop::collection::vec(option, 0..5))
        .prop_map(|(n, opts)| std::iter::once(n).chain(opts).collect::<Vec<_>>().join(":"))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4000, ..ProptestConfig::default() })]
    #[test]
    fn spec_parser_gives_a_spec_or_a_typed_error(s in spec_string(), d in prop_oneof![Just(0usize), Just(1), 2usize..200, Just(MAX_HEAD_DIM + 1), Just(usize::MAX)]) {
        match FormatSpec::parse(&s) {
            Ok(spec) => {
                // A parsed spec prints canonically and parses back to itself.
                prop_assert_eq!(FormatSpec::parse(&spec.to_string()), Ok(spec.clone()));
                // Building at any head size gives a format or a typed error (d > 1024 refused).
                let built = spec.build(&FormatCtx::new(d.min(MAX_HEAD_DIM + 1), 32, Stream::Keys, 1));
                if d == 0 || d > MAX_HEAD_DIM {
                    prop_assert!(built.is_err());
                }
            }
            Err(e) => prop_assert!(matches!(
                e,
                VqError::UnknownFormat(_) | VqError::InvalidSpec { .. } | VqError::UnsupportedBits { .. }
            ), "{e:?}"),
        }
    }
}

#[test]
fn sizes_beyond_the_bounds_are_refused_up_front() {
    let fp16 = FormatSpec::parse("fp16").unwrap();
    let huge_d = fp16.build(&FormatCtx::new(100_000, 32, Stream::Keys, 1));
    assert!(matches!(huge_d, Err(VqError::UnsupportedHeadDim { d: 100_000, .. })), "{huge_d:?}");
    let dense = FormatSpec::parse("turboquant_mse:4").unwrap().build(&FormatCtx::new(100_000, 32, Stream::Keys, 1));
    assert!(matches!(dense, Err(VqError::UnsupportedHeadDim { .. })), "an 80 GB dense rotation: {dense:?}");
    let big_page = fp16.build(&FormatCtx::new(64, MAX_PAGE_TOKENS + 1, Stream::Keys, 1));
    assert!(matches!(big_page, Err(VqError::InvalidConfig(_))), "{big_page:?}");
    let cfg = |layers, heads, recent, sink| {
        let mut c = CacheConfig::new(layers, heads, 64, fp16.clone(), fp16.clone());
        (c.recent, c.sink) = (recent, sink);
        c
    };
    for (c, what) in [
        (cfg(MAX_LAYERS + 1, 1, 0, 0), "layers"),
        (cfg(1, MAX_HEADS + 1, 0, 0), "heads"),
        (cfg(1, 1, MAX_WINDOW_TOKENS + 1, 0), "R"),
        (cfg(1, 1, 0, usize::MAX), "S"),
        (cfg(1, 1, usize::MAX, 0), "R"),
    ] {
        assert!(matches!(PagedCache::new(c), Err(VqError::InvalidConfig(_))), "{what}");
    }
    // At the bounds: nothing is reserved for the window until tokens arrive.
    let mut c = PagedCache::new(cfg(1, 1, MAX_WINDOW_TOKENS, MAX_WINDOW_TOKENS)).unwrap();
    assert_eq!(c.resident_bytes(), 0);
    c.append(0, &[0.5; 64], &[0.25; 64], 1).unwrap();
    assert_eq!(c.resident_bytes(), 2 * 64 * 2, "one fp16 sink token for K and V");
}

#[test]
fn cache_files_are_recognized_and_other_files_are_not() {
    let fp16 = FormatSpec::parse("fp16").unwrap();
    let mut c = PagedCache::new(CacheConfig::new(1, 1, 64, fp16.clone(), fp16)).unwrap();
    c.append(0, &[0.5; 64], &[0.25; 64], 1).unwrap();
    let mut file = Vec::new();
    c.save(&mut file, &SaveInfo::default()).unwrap();
    assert!(is_cache_file(&mut file.as_slice()));
    let gguf =
        std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/../../fuzz/seeds/gguf_metadata/tiny-llama.gguf")).unwrap();
    for other in [&gguf[..], b"", b"\x10\0\0\0\0\0\0\0{\"a\":1}", &file[..20]] {
        assert!(!is_cache_file(&mut &other[..]));
    }
}
