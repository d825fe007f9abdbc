//! Shared helpers for the integration tests: every registered format with each parameter,
//! calibration data for calibrated formats, and the explicit list of unsupported shapes.

#![allow(dead_code)] // each test binary uses a different subset

use std::sync::Arc;

use veloxquant::format::{FormatCtx, FormatSpec, Stream, REGISTRY};
use veloxquant::rng::SplitMix64;
use veloxquant::{CacheConfig, Calibration};

/// Every registered variant (`format::variants`), each checked to round-trip through its
/// spec string.
pub fn all_specs() -> Vec<FormatSpec> {
    let out = veloxquant::format::variants();
    for spec in &out {
        assert_eq!(&FormatSpec::parse(&spec.to_string()).unwrap(), spec, "{spec}");
    }
    assert!(REGISTRY.iter().all(|d| out.iter().any(|s| s.name == d.name)), "every format has a variant");
    out
}

/// Whether building `spec` at head size d for `stream` must fail with
/// `UnsupportedHeadDim` (the formats' documented shape limits; tests skip exactly these).
pub fn unsupported(spec: &FormatSpec, d: usize, stream: Stream) -> bool {
    match spec.name {
        "q8_0" | "q4_0" => !d.is_multiple_of(32),
        "kivi" => stream == Stream::Values && !d.is_multiple_of(spec.group as usize),
        "vecinfer" => !d.is_multiple_of(spec.group as usize),
        // Both channel sets of a fractional width are multiples of 8.
        "turboquant_frac" => {
            let de = d * spec.hi_eighths as usize; // 8 × the wide channel count
            spec.hi_eighths > 0 && !(de.is_multiple_of(64) && d.is_multiple_of(8))
        }
        _ => false,
    }
}

pub fn usable_for(spec: &FormatSpec, stream: Stream) -> bool {
    match stream {
        Stream::Keys => spec.desc().for_keys,
        Stream::Values => spec.desc().for_values,
    }
}

/// Synthetic calibration vectors (Gaussian with 4 large channels, like the test keys).
/// Tests only: real use feeds model keys from calibration text.
pub fn calib_vectors(d: usize, n: usize, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    (0..n * d).map(|i| rng.next_gaussian() as f32 * if i % d < 4 { 6.0 } else { 1.0 }).collect()
}

pub fn calibration(d: usize) -> Arc<Calibration> {
    let mut c = Calibration::new();
    c.insert_for_all(Stream::Keys, calib_vectors(d, 512, 11));
    c.insert_for_all(Stream::Values, calib_vectors(d, 512, 12));
    Arc::new(c)
}

/// A format context with calibration attached (ignored by uncalibrated formats).
pub fn ctx_for(d: usize, t: usize, stream: Stream, seed: u64) -> FormatCtx {
    let mut c = FormatCtx::new(d, t, stream, seed);
    c.calibration = calibration(d).get(0, 0, stream);
    c
}

/// A cache config with calibration attached.
pub fn cache_config(n_kv: usize, d: usize, k: &FormatSpec, v: &FormatSpec) -> CacheConfig {
    let mut cfg = CacheConfig::new(1, n_kv, d, k.clone(), v.clone());
    cfg.calibration = Some(calibration(d));
    cfg
}

/// max |a − b| / max |b|: relative error against the reference's scale.
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs() as f64)).max(1e-30);
    a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((*x as f64 - *y as f64).abs())) / scale
}
