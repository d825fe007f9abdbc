//! `veloxquant distortion`: each format on random unit vectors — MSE, inner-product error
//! d·E[(⟨q,x⟩ − ⟨q,x̃⟩)²], inner-product slope (bias), bits/value, theory where known.

use std::path::PathBuf;

use rayon::prelude::*;
use serde_json::json;
use veloxquant::format::{FormatCtx, FormatSpec, NormMode, Stream};
use veloxquant::rng::SplitMix64;

use crate::check::{count, ArgError, Ctx};
use crate::files::OutputKind;
use crate::plot::{scatter_svg, Series};
use crate::util::{parse_specs, print_table_to, progress, write_json, AnyResult};

#[derive(Debug)]
struct Row {
    spec: FormatSpec,
    bits_per_value: f64,
    mse: f64,
    ip_err: f64,
    ip_slope: f64,
    theory_mse: Option<f64>,
}

/// D_mse of TurboQuant with the Gaussian Lloyd-Max codebook, d → ∞ (REFERENCE.md §2).
fn theory(spec: &FormatSpec) -> Option<f64> {
    (spec.name == "turboquant_mse" && spec.norm == NormMode::Plain)
        .then(|| [0.363380, 0.117482, 0.034548, 0.009501][spec.bits as usize - 1])
}

fn measure(spec: &FormatSpec, d: usize, n: usize) -> AnyResult<Row> {
    const T: usize = 32;
    let mut ctx = FormatCtx::new(d, T, Stream::Keys, 1234);
    if spec.desc().needs_calibration {
        // Calibrated formats train on vectors of the same distribution (other seed).
        let mut cal = SplitMix64::new(7);
        ctx.calibration = Some((0..4096).flat_map(|_| cal.unit_vec(d)).collect::<Vec<f32>>().into());
    }
    let f = spec.build(&ctx)?;
    // Same vectors for every format: paired comparison.
    let mut rng = SplitMix64::new(2026);
    let (mut se, mut ip_se, mut sxy, mut sxx) = (0f64, 0f64, 0f64, 0f64);
    let mut page = vec![0u8; f.page_bytes()];
    let mut back = vec![0f32; T * d];
    let pages = n.div_ceil(T);
    for _ in 0..pages {
        let x: Vec<f32> = (0..T).flat_map(|_| rng.unit_vec(d)).collect();
        f.encode_page(&x, &mut page)?;
        f.decode_page(&page, &mut back);
        for t in 0..T {
            let q = rng.unit_vec(d);
            let (xs, ys) = (&x[t * d..(t + 1) * d], &back[t * d..(t + 1) * d]);
            let dot = |a: &[f32]| a.iter().zip(&q).map(|(u, v)| *u as f64 * *v as f64).sum::<f64>();
            let (a, b) = (dot(xs), dot(ys));
            se += xs.iter().zip(ys).map(|(u, v)| (*u as f64 - *v as f64).powi(2)).sum::<f64>();
            ip_se += (a - b).powi(2);
            sxy += a * b;
            sxx += a * a;
        }
    }
    let m = (pages * T) as f64;
    Ok(Row {
        spec: spec.clone(),
        bits_per_value: f.bits_per_value(),
        mse: se / m,
        ip_err: d as f64 * ip_se / m,
        ip_slope: sxy / sxx,
        theory_mse: theory(spec),
    })
}

/// Most random vectors per format (the statistics settle long before).
const MAX_VECTORS: usize = 10_000_000;

/// Head size within the formats' bound (a dense rotation is d² floats), 1 ≤ n, the specs.
pub fn plan(
    (d, n): (usize, usize),
    formats: &Option<Vec<String>>,
    outputs: [Option<&PathBuf>; 3],
    ctx: &Ctx,
) -> Result<Vec<FormatSpec>, ArgError> {
    count("d", d, 1..=veloxquant::format::MAX_HEAD_DIM)?;
    count("n", n, 1..=MAX_VECTORS)?;
    crate::check::distinct(&outputs)?;
    for (p, kind) in outputs.into_iter().zip([OutputKind::Json, OutputKind::Svg, OutputKind::Markdown]) {
        ctx.output(p, kind, &[])?;
    }
    parse_specs("formats", formats)
}

pub fn run(
    d: usize,
    n: usize,
    specs: &[FormatSpec],
    json: Option<PathBuf>,
    plot: Option<PathBuf>,
    md: Option<PathBuf>,
) -> AnyResult {
    let pb = progress(specs.len() as u64, "formats");
    let rows: Vec<Row> = specs
        .par_iter()
        .map(|s| {
            let r = measure(s, d, n);
            pb.inc(1);
            r
        })
        .collect::<AnyResult<_>>()?;
    pb.finish_and_clear();
    let fmt_opt = |v: Option<f64>| v.map_or("–".to_string(), |x| format!("{x:.6}"));
    println!("distortion on {n} random unit vectors, d = {d}");
    print_table_to(
        &["format", "bits/value", "MSE", "theory MSE", "d·E[ip err²]", "ip slope"],
        &rows
            .iter()
            .map(|r| {
                vec![
                    r.spec.to_string(),
                    format!("{:.3}", r.bits_per_value),
                    format!("{:.6}", r.mse),
                    fmt_opt(r.theory_mse),
                    format!("{:.5}", r.ip_err),
                    format!("{:.4}", r.ip_slope),
                ]
            })
            .collect::<Vec<_>>(),
        md.as_deref(),
    )?;
    if let Some(path) = json {
        let arr: Vec<_> = rows
            .iter()
            .map(|r| {
                json!({
                    "format": r.spec.to_string(), "family": r.spec.name, "bits": r.spec.bits, "d": d, "n": n,
                    "bits_per_value": r.bits_per_value, "mse": r.mse, "ip_err": r.ip_err,
                    "ip_slope": r.ip_slope, "theory_mse": r.theory_mse,
                })
            })
            .collect();
        write_json(&path, &serde_json::Value::Array(arr))?;
    }
    if let Some(path) = plot {
        let mut series: Vec<Series> = Vec::new();
        for r in &rows {
            // One series per family and option set: the spec without its numeric parts.
            let label =
                r.spec.to_string().split(':').filter(|p| p.parse::<u32>().is_err()).collect::<Vec<_>>().join(":");
            match series.iter_mut().find(|s| s.label == label) {
                Some(s) => s.points.push((r.bits_per_value, r.mse)),
                None => series.push(Series { points: vec![(r.bits_per_value, r.mse)], ..Series::new(label) }),
            }
        }
        let bound: Vec<(f64, f64)> = (0..=160).map(|i| 1.0 + i as f64 * 0.05).map(|b| (b, 4f64.powf(-b))).collect();
        scatter_svg(
            &path,
            &format!("MSE vs bits/value (d = {d}, unit vectors)"),
            "bits/value",
            "MSE",
            &series,
            &[("lower bound 4^-b", bound)],
            true,
        )?;
    }
    Ok(())
}
