//! Every SIMD level this CPU has (AVX-512, AVX2) against the scalar kernels that define the
//! semantics, for every row kind, odd page sizes (the fp16 tail) and GQA groups > 8.

use veloxquant::codebook::ScaledCodebook;
use veloxquant::cpu::{accumulate_at, available_levels, scores_at, SimdLevel};
use veloxquant::format::rows::{RowKind, RowLayout, RowScale};
use veloxquant::rng::SplitMix64;

fn kinds(d: usize) -> Vec<RowKind> {
    let mut k = vec![RowKind::F16, RowKind::Q8_0, RowKind::Q4_0];
    for bits in 1..=4 {
        k.push(RowKind::Codes { bits, table: ScaledCodebook::new(bits, d).table16() });
    }
    // Split rows (fractional widths): every width pair, wide sets of 8, half and 7/8 of d.
    for hi_bits in 2..=4 {
        for n_hi in [8, d / 2, d - 8] {
            if n_hi.is_multiple_of(8) && d.is_multiple_of(8) {
                let (hi_table, lo_table) =
                    (ScaledCodebook::new(hi_bits, d).table16(), ScaledCodebook::new(hi_bits - 1, d).table16());
                k.push(RowKind::Split { hi_bits, n_hi, hi_table, lo_table });
            }
        }
    }
    k
}

#[test]
fn every_level_matches_scalar() {
    let levels = available_levels();
    println!("levels on this CPU: {levels:?}");
    for d in [64, 128, 96, 80] {
        for kind in kinds(d) {
            if matches!(kind, RowKind::Q8_0 | RowKind::Q4_0) && d % 32 != 0 {
                continue; // block formats need d % 32 == 0 (their builders reject the rest)
            }
            // Split rows with one-byte log scales (as turboquant_frac stores them).
            let scale =
                if matches!(kind, RowKind::Split { .. }) { RowScale::LogU8 { base: 0.7 } } else { RowScale::F16 };
            for t in [32, 7, 1] {
                let l = RowLayout::new(kind.clone(), d, t).with_scale(scale);
                let mut rng = SplitMix64::new((d * t) as u64);
                let page: Vec<u8> = (0..l.page_bytes()).map(|_| rng.next_u64() as u8).collect();
                // Random bytes make NaN/Inf f16 values; give the F16 kind finite data instead.
                let page = if matches!(kind, RowKind::F16) {
                    (0..l.page_bytes() / 2)
                        .flat_map(|_| half::f16::from_f32(rng.next_gaussian() as f32).to_le_bytes())
                        .collect()
                } else {
                    let mut p = page;
                    // Block scales must be finite f16s too.
                    let blk = match kind {
                        RowKind::Q8_0 => 34,
                        RowKind::Q4_0 => 18,
                        _ => 0,
                    };
                    if blk > 0 {
                        for o in (0..p.len()).step_by(blk) {
                            p[o..o + 2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
                        }
                    }
                    if let (Some(o), RowScale::F16) = (l.scales_at, l.scale) {
                        for i in 0..t {
                            // A different scale per token: a kernel applying token i's to
                            // another token's score fails.
                            let sc = half::f16::from_f32(0.5 + 0.25 * i as f32);
                            p[o + 2 * i..o + 2 * i + 2].copy_from_slice(&sc.to_le_bytes());
                        }
                    }
                    p
                };
                for g in [1, 2, 3, 4, 6, 8, 9] {
                    let q = rng.gaussian_vec(g * d);
                    let w: Vec<f32> = (0..g * t).map(|_| rng.next_f64() as f32).collect();
                    let mut want_s = vec![0f32; g * t];
                    let mut want_a = vec![0.5f32; g * d];
                    scores_at(SimdLevel::Scalar, &l, &q, g, &page, &mut want_s);
                    accumulate_at(SimdLevel::Scalar, &l, &w, g, &page, &mut want_a);
                    for &lv in &levels {
                        let mut s = vec![0f32; g * t];
                        let mut a = vec![0.5f32; g * d];
                        scores_at(lv, &l, &q, g, &page, &mut s);
                        accumulate_at(lv, &l, &w, g, &page, &mut a);
                        for (x, y) in s.iter().zip(&want_s).chain(a.iter().zip(&want_a)) {
                            assert!(
                                (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
                                "{lv:?} {kind:?} d={d} t={t} g={g}: {x} vs {y}"
                            );
                        }
                    }
                }
            }
        }
    }
}
