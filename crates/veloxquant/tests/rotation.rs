//! Rotations on anisotropic input: keys with a few large channels (as real models have)
//! must cost a rotated format what isotropic keys cost, since the rotation spreads every
//! channel over all coordinates. Without the rotation the outliers dominate the error, so
//! removing a rotation fails here (isotropic inputs cannot tell).

mod common;

use common::{all_specs, ctx_for, unsupported};
use veloxquant::format::{Format, Stream};
use veloxquant::rng::SplitMix64;
use veloxquant::FormatSpec;

const T: usize = 32;

/// Whether the format rotates before quantizing (always, or with `:rot`).
fn rotates(spec: &FormatSpec) -> bool {
    spec.rotate || matches!(spec.name, "turboquant_mse" | "turboquant_prod" | "turboquant_rvq" | "rabitq")
}

/// Σ‖x − x̂‖² / Σ‖x‖² over Gaussian keys whose first 4 channels are `outlier`× larger.
fn rel_mse(f: &dyn Format, d: usize, outlier: f32, seed: u64) -> f64 {
    let mut rng = SplitMix64::new(seed);
    let (mut se, mut ss) = (0f64, 0f64);
    let mut page = vec![0u8; f.page_bytes()];
    let mut back = vec![0f32; T * d];
    for _ in 0..48 {
        let x: Vec<f32> =
            (0..T * d).map(|i| rng.next_gaussian() as f32 * if i % d < 4 { outlier } else { 1.0 }).collect();
        f.encode_page(&x, &mut page).unwrap();
        f.decode_page(&page, &mut back);
        se += x.iter().zip(&back).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>();
        ss += x.iter().map(|a| (*a as f64).powi(2)).sum::<f64>();
    }
    se / ss
}

#[test]
fn rotated_formats_cost_the_same_on_outlier_channels() {
    for spec in all_specs().into_iter().filter(|s| s.desc().for_keys && s.name != "vecinfer") {
        for d in [128, 96] {
            if unsupported(&spec, d, Stream::Keys) {
                continue;
            }
            let f = spec.build(&ctx_for(d, T, Stream::Keys, 3)).unwrap();
            let (iso, aniso) = (rel_mse(f.as_ref(), d, 1.0, 1), rel_mse(f.as_ref(), d, 10.0, 2));
            let ratio = aniso / iso;
            println!("{spec} d={d}: relative mse iso {iso:.5}, outliers {aniso:.5}, ratio {ratio:.3}");
            // Measured 0.78–1.11 for every rotated format (Hadamard at 128 spreads 4 channels
            // over clustered coordinates and does better; dense at 96 ≈ 1).
            if rotates(&spec) {
                assert!(ratio < 1.2, "{spec} d={d}: outlier channels cost {ratio:.2}× the error");
            }
            // The control: without rotation the per-block scales follow the outliers (2.6–2.9×).
            if matches!(spec.name, "q8_0" | "q4_0") && !spec.rotate {
                assert!(ratio > 2.0, "{spec} d={d}: input not anisotropic enough ({ratio:.2})");
            }
        }
    }
}
