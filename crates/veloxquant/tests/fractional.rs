//! turboquant_frac: the split-row byte layout by hand, the calibrated channel map and mean
//! against data built to have a known answer, spec parsing, and the typed errors. (Sizes,
//! fused-vs-reference and SIMD parity run in conformance.rs and simd_levels.rs.)

use std::sync::Arc;

use veloxquant::format::rows::{RowKind, RowLayout, RowScale};
use veloxquant::format::{FormatCtx, FormatSpec, Stream};
use veloxquant::rng::SplitMix64;
use veloxquant::rotate::Rotation;
use veloxquant::VqError;

const T: usize = 32;
const D: usize = 64;

#[test]
fn split_row_layout_by_hand() {
    // d = 16, 8 channels at 2 bits then 8 at 1 bit: 16 + 8 bits = 3 bytes per row.
    let hi: [f32; 16] = std::array::from_fn(|i| 10.0 + (i % 4) as f32);
    let lo: [f32; 16] = std::array::from_fn(|i| -1.0 - (i % 2) as f32);
    let l = RowLayout::new(RowKind::Split { hi_bits: 2, n_hi: 8, hi_table: hi, lo_table: lo }, 16, 1);
    assert_eq!(l.row_bytes, 3);
    // LSB first: byte 0 = codes 0,1,2,3; byte 1 = 3,2,1,0; byte 2 = bits 1,0,1,0,0,1,0,1.
    let mut page = vec![0u8; l.page_bytes()];
    page[..3].copy_from_slice(&[0b1110_0100, 0b0001_1011, 0b1010_0101]);
    let mut out = vec![0f32; 16];
    l.decode_row(&page, 0, &mut out);
    let want = [10., 11., 12., 13., 13., 12., 11., 10., -2., -1., -2., -1., -1., -2., -1., -2.];
    assert_eq!(out, want);
}

#[test]
fn log_scale_bytes_by_hand() {
    let l =
        RowLayout::new(RowKind::Codes { bits: 2, table: [0.0; 16] }, 64, 4).with_scale(RowScale::LogU8 { base: 2.0 });
    // 4 rows of 16 bytes, then max(4, 8) scale bytes: 72 bytes.
    assert_eq!((l.row_bytes, l.page_bytes()), (16, 72));
    let mut page = vec![0u8; l.page_bytes()];
    // code = 128 + 16·log2(s / base), rounded, clamped to 1..=255; 0 encodes exactly 0.
    for (t, s, code) in [(0, 2.0f32, 128u8), (1, 8.0, 160), (2, 0.0, 0), (3, 1e9, 255)] {
        l.set_row_scale(&mut page, t, s);
        assert_eq!(page[64 + t], code, "s = {s}");
    }
    assert_eq!(l.row_scale(&page, 0), 2.0);
    assert_eq!(l.row_scale(&page, 1), 8.0);
    assert_eq!(l.row_scale(&page, 2), 0.0);
    assert!((l.row_scale(&page, 3) - 2.0 * 2f32.powf(127.0 / 16.0)).abs() < 1e-2);
    // Inside the range the relative rounding error is at most half a step, 2^(1/32) − 1.
    let mut worst = 0f64;
    for i in 0..4000 {
        let s = 2.0 * 2f32.powf(-7.0 + i as f32 * 14.0 / 4000.0);
        l.set_row_scale(&mut page, 0, s);
        worst = worst.max((l.row_scale(&page, 0) as f64 / s as f64 - 1.0).abs());
    }
    assert!(worst <= 2f64.powf(1.0 / 32.0) - 1.0 + 1e-6, "{worst}");
    // Clearing rows 2.. zeroes their codes and their one-byte scales, nothing else.
    let mut page: Vec<u8> = (0..l.page_bytes()).map(|i| i as u8 | 1).collect();
    let before = page.clone();
    l.clear_rows_from(&mut page, 2);
    for (i, (a, b)) in page.iter().zip(&before).enumerate() {
        let cleared = (32..64).contains(&i) || (66..68).contains(&i);
        assert_eq!(*a, if cleared { 0 } else { *b }, "byte {i}");
    }
}

/// Vectors whose rotated coordinates (the format's own rotation, seed `seed`) have standard
/// deviation `big` on `wide` and 1 elsewhere, plus an optional mean `offset` per channel.
fn shaped(n: usize, seed: u64, rot_seed: u64, wide: &[usize], big: f32, offset: &[f32]) -> Vec<f32> {
    let r = Rotation::new(D, rot_seed).unwrap();
    let mut rng = SplitMix64::new(seed);
    (0..n)
        .flat_map(|_| {
            let mut z: Vec<f32> =
                (0..D).map(|j| rng.next_gaussian() as f32 * if wide.contains(&j) { big } else { 1.0 }).collect();
            r.apply_inverse(&mut z);
            z.iter().zip(offset).map(|(a, b)| a + b).collect::<Vec<f32>>()
        })
        .collect()
}

fn ctx(stream: Stream, seed: u64, calibration: Vec<f32>) -> FormatCtx {
    let mut c = FormatCtx::new(D, T, stream, seed);
    c.calibration = Some(calibration.into());
    c
}

/// Σ‖x − x̂‖² / Σ‖x‖² over whole pages of `x` coded and decoded by `f`.
fn rel_mse(f: &dyn veloxquant::Format, x: &[f32]) -> f64 {
    let mut page = vec![0u8; f.page_bytes()];
    let mut back = vec![0f32; T * D];
    let mut se = 0f64;
    for chunk in x.chunks_exact(T * D) {
        f.encode_page(chunk, &mut page).unwrap();
        f.decode_page(&page, &mut back);
        se += chunk.iter().zip(&back).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>();
    }
    se / x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>()
}

/// The rotated channels the format codes wide (`export_state`: the scale base, then d
/// floats of channel map).
fn wide_channels(f: &dyn veloxquant::Format) -> Vec<usize> {
    f.export_state()[1..=D].iter().enumerate().filter(|(_, &v)| v == 1.0).map(|(j, _)| j).collect()
}

#[test]
fn channel_map_picks_the_high_variance_rotated_channels() {
    let seed = 99;
    let mut rng = SplitMix64::new(5);
    let mut wide: Vec<usize> = Vec::new();
    while wide.len() < 16 {
        let j = (rng.next_u64() % D as u64) as usize;
        if !wide.contains(&j) {
            wide.push(j);
        }
    }
    wide.sort();
    let calib = shaped(512, 1, seed, &wide, 4.0, &[0.0; D]);
    // 2.25 bits: d/4 = 16 channels at 3 bits, exactly the 16 high-variance ones.
    let f = FormatSpec::parse("turboquant_frac:2.25").unwrap().build(&ctx(Stream::Keys, seed, calib)).unwrap();
    assert_eq!(wide_channels(f.as_ref()), wide);
    // ... and coding them wide beats a map that ignores the data (same bits): compare with
    // the same vectors rotated so that the wide channels land elsewhere.
    let test = shaped(256, 2, seed, &wide, 4.0, &[0.0; D]);
    let other: Vec<usize> = (0..D).filter(|j| !wide.contains(j)).take(16).collect();
    let misaligned = FormatSpec::parse("turboquant_frac:2.25")
        .unwrap()
        .build(&ctx(Stream::Keys, seed, shaped(512, 3, seed, &other, 4.0, &[0.0; D])))
        .unwrap();
    assert_eq!(wide_channels(misaligned.as_ref()), other);
    let (good, bad) = (rel_mse(f.as_ref(), &test), rel_mse(misaligned.as_ref(), &test));
    println!("relative mse: matched map {good:.5}, mismatched {bad:.5}");
    assert!(good < 0.8 * bad, "{good} vs {bad}");
}

#[test]
fn key_channels_follow_query_energy_and_value_channels_ignore_it() {
    let seed = 7;
    let calib = shaped(512, 1, seed, &[], 1.0, &[0.0; D]); // isotropic: gains are flat
    let r = Rotation::new(D, seed).unwrap();
    // M = Rᵀ diag(m) R: rotated query energy 25 on channels 40..48, 1 elsewhere.
    let loud: Vec<usize> = (40..48).collect();
    let mut m = vec![0f32; D * D];
    for j in 0..D {
        let mut e = vec![0f32; D];
        e[j] = 1.0;
        r.apply_inverse(&mut e); // row j of R
        let s = if loud.contains(&j) { 25.0 } else { 1.0 };
        for a in 0..D {
            for b in 0..D {
                m[a * D + b] += s * e[a] * e[b];
            }
        }
    }
    let spec = FormatSpec::parse("turboquant_frac:3.125").unwrap(); // 8 wide channels
    let mut k = ctx(Stream::Keys, seed, calib.clone());
    k.query_moments = Some(m.clone().into());
    assert_eq!(wide_channels(spec.build(&k).unwrap().as_ref()), loud);
    let mut v = ctx(Stream::Values, seed, calib);
    v.query_moments = Some(m.into());
    assert_ne!(wide_channels(spec.build(&v).unwrap().as_ref()), loud);
}

#[test]
fn centering_codes_only_what_varies() {
    // x = μ + noise, ‖μ‖² ≈ 3·E‖noise‖². Centered, the error is D(3) of the residual alone:
    // relative MSE ≈ D(3) · Σ‖x − μ‖² / Σ‖x‖² (REFERENCE.md §2: D(3) = 0.0334 at d = 64).
    let mut rng = SplitMix64::new(11);
    let mu: Vec<f32> = (0..D).map(|_| rng.next_gaussian() as f32 * 3f32.sqrt()).collect();
    let calib = shaped(1024, 1, 0, &[], 1.0, &mu);
    let test = shaped(256, 2, 0, &[], 1.0, &mu);
    let energy = |x: &[f32], m: &[f32]| -> f64 {
        x.chunks_exact(D).flat_map(|r| r.iter().zip(m).map(|(a, b)| ((a - b) as f64).powi(2))).sum()
    };
    let share = energy(&test, &mu) / energy(&test, &[0.0; D]);
    let err = |s: &str| {
        let f = FormatSpec::parse(s).unwrap().build(&ctx(Stream::Values, 3, calib.clone())).unwrap();
        rel_mse(f.as_ref(), &test)
    };
    let (plain, centered) = (err("turboquant_frac:3"), err("turboquant_frac:3:center"));
    let want = 0.0334 * share;
    println!("relative mse: plain {plain:.5}, centered {centered:.5}, predicted {want:.5} (residual share {share:.3})");
    assert!((centered / want - 1.0).abs() < 0.12, "centered {centered} vs {want}");
    assert!(plain > 0.0334 * 0.95, "plain {plain}: the mean is not free without centering");
}

#[test]
fn specs_parse_print_and_fail_typed() {
    for (given, canonical) in [
        ("turboquant_mse:3.5", "turboquant_frac:3.5"),
        ("turboquant_mse:eden:2.5", "turboquant_frac:2.5:eden"),
        ("turboquant_frac:eden:center:3.125", "turboquant_frac:3.125:center:eden"),
        ("turboquant_frac:3.50", "turboquant_frac:3.5"),
        ("turboquant_frac:2", "turboquant_frac:2"),
    ] {
        let s = FormatSpec::parse(given).unwrap();
        assert_eq!(s.to_string(), canonical);
        assert_eq!(FormatSpec::parse(canonical).unwrap(), s);
    }
    assert_eq!(FormatSpec::parse("turboquant_frac:3.375").unwrap().width(), 3.375);
    for bad in ["turboquant_frac:4.5", "turboquant_mse:3.3", "turboquant_frac:0.5", "turboquant_frac:3.", "q4_0:3.5"] {
        assert!(
            matches!(FormatSpec::parse(bad), Err(VqError::InvalidSpec { .. } | VqError::UnsupportedBits { .. })),
            "{bad}"
        );
    }
    assert!(FormatSpec::parse("turboquant_mse:3:center").is_err(), "center is turboquant_frac's option");
    // d = 32 at 3.125 would need 4 wide channels: not a multiple of 8.
    let s = FormatSpec::parse("turboquant_frac:3.125").unwrap();
    let mut c = FormatCtx::new(32, T, Stream::Keys, 1);
    c.calibration = Some(vec![0.5f32; 32 * 64].into());
    assert!(matches!(s.build(&c), Err(VqError::UnsupportedHeadDim { d: 32, .. })));
    // No calibration (or too little): every instance calibrates (its scale base at least).
    for s in ["turboquant_frac:3.5", "turboquant_frac:3:center", "turboquant_frac:3"] {
        let spec = FormatSpec::parse(s).unwrap();
        assert!(matches!(spec.build(&FormatCtx::new(D, T, Stream::Keys, 1)), Err(VqError::MissingCalibration { .. })));
        let few = ctx(Stream::Keys, 1, vec![0.5; D * 8]);
        assert!(matches!(spec.build(&few), Err(VqError::MissingCalibration { .. })));
    }
}

#[test]
fn saved_state_restores_the_same_instance_and_bad_state_is_refused() {
    let calib = shaped(256, 1, 4, &[1, 2, 3], 3.0, &[0.25; D]);
    let spec = FormatSpec::parse("turboquant_frac:2.5:center:eden").unwrap();
    let a = spec.build(&ctx(Stream::Keys, 4, calib)).unwrap();
    let state = a.export_state();
    assert_eq!(state.len(), 1 + 2 * D);
    let mut c = FormatCtx::new(D, T, Stream::Keys, 4);
    c.state = Some(state.clone().into());
    let b = spec.build(&c).unwrap();
    let x = shaped(T, 9, 4, &[1, 2, 3], 3.0, &[0.25; D]);
    let (mut pa, mut pb) = (vec![0u8; a.page_bytes()], vec![0u8; b.page_bytes()]);
    a.encode_page(&x, &mut pa).unwrap();
    b.encode_page(&x, &mut pb).unwrap();
    assert_eq!(pa, pb);
    let edits: [fn(&mut Vec<f32>); 5] = [
        |s| s[1] = 0.5,                                          // a map entry neither 0 nor 1
        |s| s.iter_mut().skip(1).take(D).for_each(|v| *v = 1.0), // too many wide channels
        |s| s[D + 3] = f32::NAN,                                 // a non-finite mean
        |s| s.truncate(1 + D),                                   // the mean missing
        |s| s[0] = -1.0,                                         // a scale base ≤ 0
    ];
    for edit in edits {
        let mut bad = state.clone();
        edit(&mut bad);
        c.state = Some(Arc::from(bad));
        assert!(matches!(spec.build(&c), Err(VqError::InvalidConfig(_) | VqError::NonFinite { .. })));
    }
}
