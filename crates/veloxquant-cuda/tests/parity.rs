//! GPU parity: encode bit-identical to the CPU for every format the GPU supports (the rest
//! are listed as skipped), d ∈ {64, 128}, all bit widths; decode attention vs the CPU reference ≤ 2e-3 relative across batch, GQA ratio,
//! lengths off the page grid and the recent window R. Skips with a message without a GPU.

use std::sync::Arc;

use veloxquant::attn::decode_attention_ref;
use veloxquant::format::{Format, FormatCtx, FormatSpec, Stream, REGISTRY};
use veloxquant::rng::SplitMix64;
use veloxquant::{CacheConfig, PagedCache};
use veloxquant_cuda::{attn, GpuCacheConfig, GpuDevice, GpuEncoder, GpuFormat, GpuKvCache, InputKind};

fn device() -> Option<Arc<GpuDevice>> {
    match GpuDevice::new(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("SKIPPED: no usable GPU ({e})");
            None
        }
    }
}

/// `f` over every item on worker threads, each with its own device (its own stream and module
/// cache: the cases' NVRTC compiles dominate the suite's time); results in item order. Items
/// are whole groups of cases that share kernels (a format pair), so workers rarely compile the
/// same module twice. `PARITY_WORKERS` sets the count (default: a quarter of the host's cores,
/// as the harness runs tests side by side too).
fn par_cases<T: Sync, R: Send>(items: &[T], f: impl Fn(&Arc<GpuDevice>, &T) -> R + Sync) -> Vec<R> {
    par_cases_with(veloxquant_cuda::Tuning::default(), items, f)
}

/// [`par_cases`] on devices built with `tuning`.
fn par_cases_with<T: Sync, R: Send>(
    tuning: veloxquant_cuda::Tuning,
    items: &[T],
    f: impl Fn(&Arc<GpuDevice>, &T) -> R + Sync,
) -> Vec<R> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let workers = std::env::var("PARITY_WORKERS")
        .ok()
        .and_then(|s| s.parse::<usize>().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()).div_ceil(4))
        .clamp(1, items.len().max(1));
    let next = AtomicUsize::new(0);
    let out: std::sync::Mutex<Vec<Option<R>>> = std::sync::Mutex::new((0..items.len()).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                let dev = GpuDevice::new_with(0, tuning, None).expect("a device handle on the GPU the test found");
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(item) = items.get(i) else { break };
                    let r = f(&dev, item);
                    out.lock().expect("no worker panicked holding the results")[i] = Some(r);
                }
            });
        }
    });
    out.into_inner().expect("workers done").into_iter().map(|r| r.expect("every item ran")).collect()
}

fn all_specs() -> Vec<FormatSpec> {
    let mut out = Vec::new();
    for desc in REGISTRY {
        let bits: Vec<Option<u32>> =
            if desc.bits.is_empty() { vec![None] } else { desc.bits.iter().map(|&b| Some(b)).collect() };
        for b in bits {
            let base = match b {
                Some(b) => format!("{}:{b}", desc.name),
                None => desc.name.to_string(),
            };
            // Every second bit width (turboquant_rvq's stage 2).
            for b2 in desc.bits2 {
                out.push(FormatSpec::parse(&format!("{base}:{b2}")).unwrap());
            }
            if !desc.bits2.is_empty() {
                continue;
            }
            out.push(FormatSpec::parse(&base).unwrap());
            if desc.rotatable {
                out.push(FormatSpec::parse(&format!("{base}:rot")).unwrap());
            }
            if desc.has_norm_mode {
                out.push(FormatSpec::parse(&format!("{base}:eden")).unwrap());
            }
            if desc.has_sketch {
                out.push(FormatSpec::parse(&format!("{base}:orth")).unwrap());
            }
            // Wider sketches (qjl:2x), plain and orthogonalized.
            for m in desc.mults.iter().filter(|&&m| m != 1) {
                out.push(FormatSpec::parse(&format!("{base}:{m}x")).unwrap());
                out.push(FormatSpec::parse(&format!("{base}:{m}x:orth")).unwrap());
            }
            for g in desc.groups.iter().filter(|&&g| g != desc.default_group) {
                out.push(FormatSpec::parse(&format!("{base}:g{g}")).unwrap());
            }
        }
    }
    out
}

/// Both streams where their layouts differ (kivi: keys grouped per channel, values per
/// token); `one` for every other format.
fn streams(spec: &FormatSpec, one: Stream) -> Vec<Stream> {
    if spec.name == "kivi" {
        vec![Stream::Keys, Stream::Values]
    } else {
        vec![one]
    }
}

/// Rows that stress rounding: Gaussian with outlier channels, zeros, ties, tiny and huge.
fn awkward_rows(rng: &mut SplitMix64, n_rows: usize, d: usize) -> Vec<f32> {
    let mut x = Vec::with_capacity(n_rows * d);
    for r in 0..n_rows {
        for i in 0..d {
            let g = rng.next_gaussian() as f32;
            x.push(match r % 8 {
                0 => 0.0,
                1 => {
                    if i % 2 == 0 {
                        3.0
                    } else {
                        -3.0
                    }
                }
                2 => g * 1e-4,
                3 => g * if i < 4 { 40.0 } else { 1.0 },
                4 => (g * 4.0).round() / 4.0,
                _ => g,
            });
        }
    }
    x
}

/// f16 input (what the cache feeds the encoder), with the same awkward rows rounded to f16:
/// exact zeros after the rotation, f16 subnormals, ties; bit-identical to the CPU on the
/// f32 values of those f16s.
#[test]
fn encode_f16_input_bit_identical_to_cpu() {
    if device().is_none() {
        return;
    }
    let t = 32;
    // Calibrated formats (turboquant_frac, vecinfer) have their own tests.
    let specs: Vec<FormatSpec> = all_specs().into_iter().filter(|s| !s.desc().needs_calibration).collect();
    // The sketch on CUDA cores: the tensor-core one (the default for f16 pages of 32 at d 64
    // and 128) has its own test.
    let tuning = veloxquant_cuda::Tuning { encode_sketch_mma: false, ..Default::default() };
    let per_spec = par_cases_with(tuning, &specs, |dev, spec| {
        let (mut checked, mut failures) = (0, Vec::new());
        let one = if spec.desc().for_values { Stream::Values } else { Stream::Keys };
        for (d, stream) in [64usize, 80, 96, 112, 128, 256]
            .into_iter()
            .flat_map(|d| streams(spec, one).into_iter().map(move |s| (d, s)))
        {
            let seed = 0x4321 + d as u64;
            let gf = match GpuFormat::for_stream(spec, d, t, seed, stream) {
                Ok(f) => f,
                Err(veloxquant_cuda::CudaError::UnsupportedFormat { .. }) => continue,
                Err(e) => panic!("{spec} d={d}: {e}"),
            };
            let cpu = spec.build(&FormatCtx::new(d, t, stream, seed)).unwrap();
            let enc = GpuEncoder::new(dev, &gf, InputKind::F16).unwrap();
            let mut rng = SplitMix64::new(seed ^ 99);
            let n_pages = 8;
            let x16: Vec<u16> =
                awkward_rows(&mut rng, n_pages * t, d).iter().map(|&v| half::f16::from_f32(v).to_bits()).collect();
            let x: Vec<f32> = x16.iter().map(|&b| half::f16::from_bits(b).to_f32()).collect();
            let got = enc.encode_pages_f16(&x16).unwrap();
            let pb = cpu.page_bytes();
            let mut want = vec![0u8; pb];
            let bad = (0..n_pages).find(|&p| {
                cpu.encode_page(&x[p * t * d..(p + 1) * t * d], &mut want).unwrap();
                got[p * pb..(p + 1) * pb] != want[..]
            });
            if let Some(p) = bad {
                eprintln!("MISMATCH (f16 input) {spec} d={d} {stream:?} page {p} [{}]", enc.kernel());
                failures.push(format!("{spec} d={d} {stream:?}"));
                continue;
            }
            checked += 1;
        }
        (checked, failures)
    });
    let checked: usize = per_spec.iter().map(|r| r.0).sum();
    let failures: Vec<String> = per_spec.into_iter().flat_map(|r| r.1).collect();
    eprintln!("encode parity (f16 input): {checked} (format, d) cases bit-identical; failures: {failures:?}");
    assert!(failures.is_empty(), "encode mismatches (f16 input): {failures:?}");
}

#[test]
fn encode_bit_identical_to_cpu() {
    if device().is_none() {
        return;
    }
    let t = 32;
    let specs: Vec<FormatSpec> = all_specs().into_iter().filter(|s| !s.desc().needs_calibration).collect();
    let per_spec = par_cases(&specs, |dev, spec| {
        let (mut checked, mut failures) = (0, Vec::new());
        let one = Stream::Keys;
        for (d, stream) in [64usize, 80, 96, 112, 128, 256]
            .into_iter()
            .flat_map(|d| streams(spec, one).into_iter().map(move |s| (d, s)))
        {
            let seed = 0x1234 + d as u64;
            let gf = match GpuFormat::for_stream(spec, d, t, seed, stream) {
                Ok(f) => f,
                Err(veloxquant_cuda::CudaError::UnsupportedFormat { why, .. }) => {
                    eprintln!("skip {spec} d={d}: {why}");
                    continue;
                }
                Err(e) => panic!("{spec} d={d}: {e}"),
            };
            let cpu = spec.build(&FormatCtx::new(d, t, stream, seed)).unwrap();
            assert_eq!(gf.page_bytes, cpu.page_bytes(), "{spec} d={d} page bytes");
            let enc = GpuEncoder::new(dev, &gf, InputKind::F32).unwrap();
            let mut rng = SplitMix64::new(seed ^ 77);
            let n_pages = 6;
            let x = awkward_rows(&mut rng, n_pages * t, d);
            let got = enc.encode_pages_f32(&x).unwrap();
            let pb = cpu.page_bytes();
            let mut bad = None;
            for p in 0..n_pages {
                let mut want = vec![0u8; pb];
                cpu.encode_page(&x[p * t * d..(p + 1) * t * d], &mut want).unwrap();
                if let Some(i) = (0..pb).find(|&i| got[p * pb + i] != want[i]) {
                    let r0 = i / gf.row_bytes.max(1) * gf.row_bytes;
                    let r1 = (r0 + gf.row_bytes).min(pb);
                    bad = Some(format!(
                        "{spec} d={d} {stream:?} page {p}: byte {i} (row {}) gpu {:#04x} cpu {:#04x}\n gpu row {:02x?}\n cpu row {:02x?}",
                        i / gf.row_bytes.max(1), got[p * pb + i], want[i],
                        &got[p * pb + r0..p * pb + r1], &want[r0..r1]
                    ));
                    break;
                }
            }
            if let Some(b) = bad {
                eprintln!("MISMATCH {b}");
                failures.push(format!("{spec} d={d} {stream:?}"));
                continue;
            }
            checked += 1;
        }
        (checked, failures)
    });
    let checked: usize = per_spec.iter().map(|r| r.0).sum();
    let failures: Vec<String> = per_spec.into_iter().flat_map(|r| r.1).collect();
    eprintln!("encode parity: {checked} (format, d) cases bit-identical; failures: {failures:?}");
    assert!(failures.is_empty(), "encode mismatches: {failures:?}");
}

/// The sketch encoders' sign test (qjl's sketch_signs_rows: FMA sums, the CPU's order redone
/// for a row where some output lies within the FMA sum's error bound) on rows made to put
/// one output (S·x)_i at the rounding level: x = g − (⟨g, S_i⟩/‖S_i‖²)·S_i in f64, then f32.
/// The test first checks on the host that FMA sums (f32::mul_add, e ascending: the kernel's)
/// give a different sign bit than the CPU's sum on some of these rows — so a GPU path
/// without the exact redo would fail here — then that the GPU's pages equal the CPU's.
#[test]
fn sketch_signs_at_the_rounding_level_bit_identical() {
    let t = 32;
    let n_pages = 16;
    let mut cases = Vec::new();
    for spec in ["qjl", "qjl:orth"].map(|s| FormatSpec::parse(s).unwrap()) {
        for d in [64usize, 128, 256] {
            let seed = 0x51 + d as u64;
            let gf = GpuFormat::new(&spec, d, t, seed).unwrap();
            let (st, _) = gf.sketch.clone().unwrap();
            let s_row = |i: usize| (0..d).map(|e| st[e * d + i] as f64).collect::<Vec<f64>>();
            let mut rng = SplitMix64::new(seed ^ 0x5e);
            let mut x = Vec::with_capacity(n_pages * t * d);
            let mut fma_differs = 0;
            for r in 0..n_pages * t {
                let i = (r * 37) % d;
                let si = s_row(i);
                let g: Vec<f64> = (0..d).map(|_| rng.next_gaussian()).collect();
                let c = g.iter().zip(&si).map(|(a, b)| a * b).sum::<f64>() / si.iter().map(|v| v * v).sum::<f64>();
                let row: Vec<f32> = g.iter().zip(&si).map(|(a, b)| (a - c * b) as f32).collect();
                // The CPU's sum (sketch.rs project) and the FMA chain, for output i.
                let cpu_sum: f32 = row.iter().enumerate().map(|(e, v)| st[e * d + i] * v).sum();
                let fma_sum = row.iter().enumerate().fold(0f32, |acc, (e, v)| st[e * d + i].mul_add(*v, acc));
                fma_differs += usize::from((cpu_sum >= 0.0) != (fma_sum > 0.0));
                x.extend(row);
            }
            assert!(fma_differs > 0, "{spec} d={d}: no row where the FMA sum's sign differs (test too weak)");
            eprintln!("{spec} d={d}: FMA sums alone differ on {fma_differs} of {} rows", n_pages * t);
            cases.push((spec.clone(), d, seed, gf, x, fma_differs));
        }
    }
    let Some(dev) = device() else { return };
    for (spec, d, seed, gf, x, fma_differs) in cases {
        let cpu = spec.build(&FormatCtx::new(d, t, Stream::Keys, seed)).unwrap();
        let enc = GpuEncoder::new(&dev, &gf, InputKind::F32).unwrap();
        let got = enc.encode_pages_f32(&x).unwrap();
        let pb = cpu.page_bytes();
        let mut want = vec![0u8; pb];
        for p in 0..n_pages {
            cpu.encode_page(&x[p * t * d..(p + 1) * t * d], &mut want).unwrap();
            assert!(got[p * pb..(p + 1) * pb] == want[..], "{spec} d={d} page {p} differs from the CPU's");
        }
        eprintln!("{spec} d={d}: {} rows bit-identical ({fma_differs} where FMA sums alone would differ)", n_pages * t);
    }
}

/// kernels/formats/qjl.cuh's bound per unit ‖x̃‖ (SK_EPS · 2^13 and its margins; no S' entry
/// below 2⁻¹⁴); `prod`: 2⁻¹¹ more for the residual rounded to f16 (SK_XEPS).
fn sketch_mma_eps(d: usize, prod: bool) -> f64 {
    let x_eps = if prod { 2f32.powi(-11) } else { 0.0 };
    let eps = (2f32.powi(-11) + x_eps + d as f32 * 2f32.powi(-20) + d as f32 * 2f32.powi(-24)) * 1.01;
    (eps * 8192.0 * 1.001 * 1.001) as f64
}

/// The host part of the sketch kernel's test for turboquant_prod: its stage 1 as the CPU's
/// (rotation, y = r·(1/‖r‖), codes, e = y − ŷ), e scaled by 2^k to [2^14, 2^15) and rounded
/// to f16 as the kernel does, and each output's sign from those f16 operands summed exactly
/// against the CPU page's sign bit: where they differ, |z| must lie within the kernel's bound.
/// Returns (outputs whose f16 sign differs, outputs within the bound, worst |z|/bound of a
/// differing one).
fn prod_bound_check(spec: &FormatSpec, gf: &GpuFormat, seed: u64, x: &[f32]) -> (usize, usize, f64) {
    let (d, t, mse_bytes, row_bytes) = (gf.d, 32, gf.mse_bytes, gf.row_bytes);
    let st = &gf.sketch.as_ref().unwrap().0;
    let cpu = spec.build(&FormatCtx::new(d, t, Stream::Keys, seed)).unwrap();
    let mut page = vec![0u8; cpu.page_bytes()];
    cpu.encode_page(x, &mut page).unwrap();
    let rot = veloxquant::rotate::Rotation::new(d, seed).unwrap();
    let cb = veloxquant::codebook::ScaledCodebook::new(spec.bits - 1, d);
    let s_norm: Vec<f64> = (0..d).map(|i| (0..d).map(|e| (st[e * d + i] as f64).powi(2)).sum::<f64>().sqrt()).collect();
    let (mut differs_n, mut unsure, mut worst) = (0, 0, 0f64);
    for r in 0..t {
        let mut v = x[r * d..(r + 1) * d].to_vec();
        rot.apply(&mut v);
        let norm = veloxquant::reduce::sum_sq_canonical(&v).sqrt();
        let inv = if norm > 0.0 { 1.0 / norm } else { 0.0 };
        let e: Vec<f32> = v
            .iter()
            .map(|&a| {
                let y = a * inv;
                if norm > 0.0 {
                    y - cb.centroids[cb.quantize(y) as usize]
                } else {
                    0.0
                }
            })
            .collect();
        let mx = e.iter().fold(0f32, |m, a| m.max(a.abs()));
        let ex = ((mx.to_bits() >> 23) & 255) as i32 - 127;
        if !(-113..=127).contains(&ex) {
            continue; // redone whole by the kernel
        }
        let sc = 2f32.powi(14 - ex);
        let xt: Vec<f64> = e.iter().map(|&a| half::f16::from_f32(a * sc).to_f64()).collect();
        let nrm = (veloxquant::reduce::sum_sq_canonical(&e).sqrt() * sc) as f64;
        let bound = sketch_mma_eps(d, true) * nrm + 0.505 * (d as f64).sqrt();
        if bound * (d as f64).sqrt() > 1024.0 * nrm {
            continue; // redone whole by the kernel
        }
        let signs = &page[r * row_bytes + mse_bytes..(r + 1) * row_bytes];
        for i in 0..d {
            let cpu_pos = signs[i / 8] >> (i % 8) & 1 == 1;
            let tc: f64 =
                (0..d).map(|k| half::f16::from_f64(st[k * d + i] as f64 * 8192.0 / s_norm[i]).to_f64() * xt[k]).sum();
            let differs = cpu_pos != (tc > 0.0) && tc != 0.0;
            differs_n += usize::from(differs);
            unsure += usize::from(tc.abs() <= bound);
            if differs {
                worst = worst.max(tc.abs() / bound);
            }
            assert!(
                !differs || tc.abs() <= bound,
                "{spec} d={d} row {r} output {i}: sign differs beyond the bound ({tc} vs {bound})"
            );
        }
    }
    (differs_n, unsure, worst)
}

/// qjl (m = d and 2d; `Tuning::encode_sketch_mma_2x`) and turboquant_prod with their sketch on
/// tensor cores (`Tuning::encode_sketch_mma`: f16 input, d 64 and 128): pages of two heads interleaved (the kernel's blocks share one head's
/// S' at a time), of the awkward rows (zeros, f16 subnormals, outliers), N(0, 1) rows, and for
/// qjl rows with one output at the f16 rounding level (x = g − (⟨g, S_i⟩/‖S_i‖²)·S_i, then
/// f16), bit-identical to the CPU. The host
/// first checks that the tensor cores' operands alone (S rounded to f16, x as is, summed
/// exactly) give a sign other than the CPU's on some rows, so a kernel without the CPU-order
/// redo of uncertain outputs would fail here.
#[test]
fn sketch_mma_encode_bit_identical_to_cpu() {
    let t = 32;
    let n_pages = 24;
    let mut cases = Vec::new();
    for spec in ["qjl", "qjl:orth", "qjl:2x", "qjl:2x:orth"].map(|s| FormatSpec::parse(s).unwrap()) {
        for d in [64usize, 128] {
            let seeds = [0x61 + d as u64, 0x7a + d as u64];
            let gfs = seeds.map(|seed| GpuFormat::new(&spec, d, t, seed).unwrap());
            // m = d outputs, or 2d (qjl:2x: Sᵀ's second block of d rows after the first's).
            let m = gfs[0].sketch_halves() * d;
            // Page p's head: runs of one and of several, so rounds see one head and two.
            let head_of: fn(usize) -> usize = |p| [0, 1, 1, 0, 0, 0, 1, 0][p % 8];
            let mut rng = SplitMix64::new(d as u64 ^ 0x6d6d);
            let mut x16 = Vec::with_capacity(n_pages * t * d);
            let (mut tc_differs, mut unsure, mut worst) = (0, 0, 0f64);
            for p in 0..n_pages {
                let (st, _) = gfs[head_of(p)].sketch.clone().unwrap();
                let s_at = |e: usize, i: usize| st[(i / d) * d * d + e * d + i % d];
                let s_row = |i: usize| (0..d).map(|e| s_at(e, i) as f64).collect::<Vec<f64>>();
                let rows: Vec<f32> = match p % 3 {
                    0 => awkward_rows(&mut rng, t, d),
                    1 => (0..t * d).map(|_| rng.next_gaussian() as f32).collect(),
                    _ => (0..t)
                        .flat_map(|r| {
                            let si = s_row((r * 37 + p) % d);
                            let g: Vec<f64> = (0..d).map(|_| rng.next_gaussian()).collect();
                            let c = g.iter().zip(&si).map(|(a, b)| a * b).sum::<f64>()
                                / si.iter().map(|v| v * v).sum::<f64>();
                            g.iter().zip(&si).map(|(a, b)| (a - c * b) as f32).collect::<Vec<f32>>()
                        })
                        .collect(),
                };
                for r in 0..t {
                    let row: Vec<u16> =
                        rows[r * d..(r + 1) * d].iter().map(|&v| half::f16::from_f32(v).to_bits()).collect();
                    let xv: Vec<f32> = row.iter().map(|&b| half::f16::from_bits(b).to_f32()).collect();
                    // Output by output: the CPU's sign against the tensor cores' operands' (their
                    // exact sum), and the kernel's test: beyond its bound the signs must agree.
                    let nrm = xv.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
                    let bound = sketch_mma_eps(d, false) * nrm + 0.505 * (d as f64).sqrt();
                    for i in 0..m {
                        let si = s_row(i);
                        let norm = si.iter().map(|v| v * v).sum::<f64>().sqrt();
                        let cpu: f32 = xv.iter().enumerate().map(|(e, v)| s_at(e, i) * v).sum();
                        let tc: f64 = xv
                            .iter()
                            .zip(&si)
                            .map(|(v, s)| half::f16::from_f64(s * 8192.0 / norm).to_f64() * *v as f64)
                            .sum();
                        let differs = (cpu >= 0.0) != (tc > 0.0);
                        tc_differs += usize::from(differs && tc != 0.0);
                        if differs && tc != 0.0 {
                            worst = worst.max(tc.abs() / bound);
                        }
                        unsure += usize::from(tc.abs() <= bound);
                        assert!(
                            !differs || tc.abs() <= bound,
                            "{spec} d={d} page {p} row {r} output {i}: sign differs beyond the bound ({tc} vs {bound})"
                        );
                    }
                    x16.extend(row);
                }
            }
            assert!(tc_differs > 0, "{spec} d={d}: no output where the f16 operands' sign differs (test too weak)");
            eprintln!(
                "{spec} d={d}: the f16 operands alone differ in {tc_differs} outputs, all within the bound (at most \
                 {worst:.3} of it); {unsure} of {} outputs within it",
                n_pages * t * m
            );
            cases.push((spec.clone(), d, seeds, gfs, x16, head_of));
        }
    }
    // turboquant_prod: the sketch of its residuals (awkward and N(0, 1) rows).
    for spec in
        ["turboquant_prod:3", "turboquant_prod:2", "turboquant_prod:4:orth"].map(|s| FormatSpec::parse(s).unwrap())
    {
        for d in [64usize, 128] {
            let seeds = [0x91 + d as u64, 0xa4 + d as u64];
            let gfs = seeds.map(|seed| GpuFormat::new(&spec, d, t, seed).unwrap());
            let head_of: fn(usize) -> usize = |p| [1, 1, 0, 1, 0, 0, 0, 1][p % 8];
            let mut rng = SplitMix64::new(d as u64 ^ 0x7072);
            let x16: Vec<u16> = (0..n_pages)
                .flat_map(|p| match p % 2 {
                    0 => awkward_rows(&mut rng, t, d),
                    _ => (0..t * d).map(|_| rng.next_gaussian() as f32).collect(),
                })
                .map(|v| half::f16::from_f32(v).to_bits())
                .collect();
            let (mut differs, mut unsure, mut worst) = (0, 0, 0f64);
            for p in 0..n_pages {
                let x: Vec<f32> =
                    x16[p * t * d..(p + 1) * t * d].iter().map(|&b| half::f16::from_bits(b).to_f32()).collect();
                let (a, b, w) = prod_bound_check(&spec, &gfs[head_of(p)], seeds[head_of(p)], &x);
                (differs, unsure, worst) = (differs + a, unsure + b, worst.max(w));
            }
            eprintln!(
                "{spec} d={d}: the f16 residuals alone differ in {differs} outputs, all within the bound (at most \
                 {worst:.3} of it); {unsure} of {} outputs within it",
                n_pages * t * d
            );
            cases.push((spec.clone(), d, seeds, gfs, x16, head_of));
        }
    }
    let tuning = veloxquant_cuda::Tuning { encode_sketch_mma: true, encode_sketch_mma_2x: true, ..Default::default() };
    let Ok(dev) = GpuDevice::new_with(0, tuning, None) else {
        eprintln!("SKIPPED: no usable GPU");
        return;
    };
    for (spec, d, seeds, gfs, x16, head_of) in cases {
        let enc = GpuEncoder::new(&dev, &gfs[0], InputKind::F16).unwrap();
        assert_eq!(enc.kernel(), "tensor cores", "{spec} d={d}");
        let s = &dev.stream;
        let signs: Vec<f32> = gfs.iter().flat_map(|g| g.transform().0).collect();
        let pid: Vec<i32> = (0..n_pages as i32).rev().collect();
        let hid: Vec<i32> = (0..n_pages).map(|p| head_of(p) as i32).collect();
        let xd = s.clone_htod(&x16).unwrap();
        let (pd, hd, sd) = (s.clone_htod(&pid).unwrap(), s.clone_htod(&hid).unwrap(), s.clone_htod(&signs).unwrap());
        let pb = gfs[0].page_bytes;
        let mut pool = s.clone_htod(&vec![0xA5u8; n_pages * pb]).unwrap();
        enc.launch(&xd, n_pages, &pd, &hd, &mut pool, &sd.slice(..), gfs[0].transform().1).unwrap();
        let got = s.clone_dtoh(&pool).unwrap();
        let cpus = seeds.map(|seed| spec.build(&FormatCtx::new(d, t, Stream::Keys, seed)).unwrap());
        let mut want = vec![0u8; pb];
        for p in 0..n_pages {
            let x: Vec<f32> =
                x16[p * t * d..(p + 1) * t * d].iter().map(|&b| half::f16::from_bits(b).to_f32()).collect();
            cpus[head_of(p)].encode_page(&x, &mut want).unwrap();
            let slot = pid[p] as usize;
            assert!(got[slot * pb..(slot + 1) * pb] == want[..], "{spec} d={d} page {p} (head {}) differs", head_of(p));
        }
        eprintln!("{spec} d={d}: {n_pages} pages of two heads bit-identical with the sketch on tensor cores");
    }
}

/// kivi's encoders (the blocked page kernel, the strided one at d = 96, the Markstein quotients) on many pages of
/// values on half-integer grids, where (x − z)/s lands on and beside the ties between codes,
/// mixed with the awkward rows; f32 and f16 input, both streams, every bit width and group.
#[test]
fn kivi_encode_bit_identical_on_grid_values() {
    let Some(dev) = device() else { return };
    let t = 32;
    let mut checked = 0;
    for spec in ["kivi:2", "kivi:4", "kivi:2:g16", "kivi:4:g16"].map(|s| FormatSpec::parse(s).unwrap()) {
        // d = 96: the strided page encoder (a lane's codes are not whole bytes).
        for d in [64usize, 96, 128, 256] {
            for stream in [Stream::Keys, Stream::Values] {
                let Ok(gf) = GpuFormat::for_stream(&spec, d, t, 5, stream) else { continue };
                let cpu = spec.build(&FormatCtx::new(d, t, stream, 5)).unwrap();
                let n_pages = 64;
                let mut rng = SplitMix64::new(d as u64 * 31 + spec.bits as u64);
                let mut x = awkward_rows(&mut rng, n_pages * t, d);
                for (i, v) in x.iter_mut().enumerate() {
                    let page = i / (t * d);
                    if page % 4 != 3 {
                        // steps of 2^-(page % 3) on a band that moves with the page
                        let step = 0.5f32.powi((page % 3) as i32);
                        *v = (rng.next_gaussian() as f32 * 5.0).round() * step + (page % 7) as f32;
                    }
                }
                let pb = cpu.page_bytes();
                let mut want = vec![0u8; n_pages * pb];
                for p in 0..n_pages {
                    cpu.encode_page(&x[p * t * d..(p + 1) * t * d], &mut want[p * pb..(p + 1) * pb]).unwrap();
                }
                let got = GpuEncoder::new(&dev, &gf, InputKind::F32).unwrap().encode_pages_f32(&x).unwrap();
                let bad = (0..n_pages).find(|&p| got[p * pb..(p + 1) * pb] != want[p * pb..(p + 1) * pb]);
                assert!(bad.is_none(), "{spec} d={d} {stream:?} f32: page {bad:?} differs");
                // f16 input: the same values rounded to f16 (the grids are exact in f16).
                let x16: Vec<u16> = x.iter().map(|&v| half::f16::from_f32(v).to_bits()).collect();
                let xr: Vec<f32> = x16.iter().map(|&b| half::f16::from_bits(b).to_f32()).collect();
                for p in 0..n_pages {
                    cpu.encode_page(&xr[p * t * d..(p + 1) * t * d], &mut want[p * pb..(p + 1) * pb]).unwrap();
                }
                let got = GpuEncoder::new(&dev, &gf, InputKind::F16).unwrap().encode_pages_f16(&x16).unwrap();
                let bad = (0..n_pages).find(|&p| got[p * pb..(p + 1) * pb] != want[p * pb..(p + 1) * pb]);
                assert!(bad.is_none(), "{spec} d={d} {stream:?} f16: page {bad:?} differs");
                checked += 1;
            }
        }
    }
    eprintln!("kivi encode: {checked} (format, d, stream) cases × 64 pages bit-identical (f32 and f16 input)");
    assert!(checked >= 20, "{checked}");
}

/// The GPU's pages of `x` (f32, and f16 rounded) are the CPU format's, byte for byte.
fn assert_encodes_like_cpu(dev: &Arc<GpuDevice>, cpu: &dyn Format, gf: &GpuFormat, x: &[f32], what: &str) {
    let (pb, per) = (cpu.page_bytes(), cpu.page_tokens() * cpu.head_dim());
    let check = |x: &[f32], got: &[u8], input: &str| {
        let mut want = vec![0u8; pb];
        for (p, xp) in x.chunks_exact(per).enumerate() {
            cpu.encode_page(xp, &mut want).unwrap();
            assert!(got[p * pb..(p + 1) * pb] == want[..], "{what} {input}: page {p} differs");
        }
    };
    let got = GpuEncoder::new(dev, gf, InputKind::F32).unwrap().encode_pages_f32(x).unwrap();
    check(x, &got, "f32");
    let x16: Vec<u16> = x.iter().map(|&v| half::f16::from_f32(v).to_bits()).collect();
    let xr: Vec<f32> = x16.iter().map(|&b| half::f16::from_bits(b).to_f32()).collect();
    let got = GpuEncoder::new(dev, gf, InputKind::F16).unwrap().encode_pages_f16(&x16).unwrap();
    check(&xr, &got, "f16");
}

/// A calibrated turboquant_frac case: the CPU format (calibrated on rows with a per-channel
/// mean), its GPU twin, and 8 pages of the awkward rows, every other page around the mean (rows
/// equal to μ become zero after centering).
fn frac_case(spec: &FormatSpec, d: usize, t: usize) -> (Arc<dyn Format>, GpuFormat, Vec<f32>) {
    let seed = 0x7ac + d as u64;
    let mut rng = SplitMix64::new(seed);
    let mean: Vec<f32> = (0..d).map(|j| 2.0 * (j as f32 * 0.37).cos()).collect();
    let mut ctx = FormatCtx::new(d, t, Stream::Keys, seed);
    ctx.calibration = Some(
        (0..300 * d)
            .map(|i| rng.next_gaussian() as f32 * (1 + i % 5) as f32 + mean[i % d])
            .collect::<Vec<f32>>()
            .into(),
    );
    let cpu = spec.build(&ctx).unwrap();
    let gf = GpuFormat::with_state(spec, d, t, seed, Stream::Keys, Some(&cpu.export_state())).unwrap();
    assert_eq!(gf.page_bytes, cpu.page_bytes(), "{spec} d={d}");
    let mut x = awkward_rows(&mut rng, 8 * t, d);
    for (i, v) in x.iter_mut().enumerate() {
        if (i / (t * d)) % 2 == 1 {
            *v += mean[i % d];
        }
    }
    (cpu, gf, x)
}

/// turboquant_frac (calibrated: channel map, μ and scale base from the CPU format's state)
/// encodes bit-identically to the CPU: wide and narrow channels, whole widths, centered or
/// not, plain and EDEN scales, rows that need byte reads (d = 64 at 2.25 bits: 18-byte rows),
/// f32 and f16 input, d ∈ {64, 128, 256}.
#[test]
fn frac_encode_bit_identical_to_cpu() {
    if device().is_none() {
        return;
    }
    let t = 32;
    let specs = [
        "turboquant_frac:3.5:center:eden",
        "turboquant_frac:2.5:center",
        "turboquant_frac:3",
        "turboquant_frac:2.25:eden",
        "turboquant_frac:1.5:center:eden",
        "turboquant_frac:3.75",
    ]
    .map(|s| FormatSpec::parse(s).unwrap());
    let cases: Vec<(&FormatSpec, usize)> = specs.iter().flat_map(|s| [64usize, 128, 256].map(|d| (s, d))).collect();
    // Explicit: the thread-per-row encoder is what this test checks, whatever the default.
    let tuning = veloxquant_cuda::Tuning { encode_frac_pages: true, ..Default::default() };
    let checked = par_cases_with(tuning, &cases, |dev, &(spec, d)| {
        let (cpu, gf, x) = frac_case(spec, d, t);
        assert_encodes_like_cpu(dev, cpu.as_ref(), &gf, &x, &format!("{spec} d={d}"));
        // Rows of whole words at d ≤ 128 take the thread-per-row kernel (its slow rows,
        // zeros here, the warp-per-row code), the others a warp per row.
        let kernel = GpuEncoder::new(dev, &gf, InputKind::F32).unwrap().kernel();
        let want = if d <= 128 && gf.row_bytes.is_multiple_of(4) { "thread/row" } else { "warp/row" };
        assert_eq!(kernel, want, "{spec} d={d}");
        kernel
    });
    let tpr = checked.iter().filter(|&&k| k == "thread/row").count();
    eprintln!(
        "turboquant_frac encode: {} (format, d) cases × 8 pages bit-identical (f32 and f16 input), {tpr} by the thread-per-row kernel",
        checked.len()
    );
    assert_eq!((checked.len(), tpr), (18, 10));
}

/// On a device that allows 99 KiB of shared memory per block (sm_86/89; emulated here by
/// `Tuning::smem_limit`) the page encoders run with the warps that fit (or a warp per row),
/// bit-identical to the CPU (f32 and f16 input), and decode picks variants that fit, within
/// 2e-3 of the CPU reference (vecinfer's codebooks from global memory: 128 KiB staged would
/// not fit).
#[test]
fn a_99_kib_device_encodes_and_decodes_like_the_cpu() {
    if device().is_none() {
        return;
    }
    let tuning = veloxquant_cuda::Tuning { smem_limit: 99 * 1024, encode_frac_pages: true, ..Default::default() };
    let small = GpuDevice::new_with(0, tuning, None).unwrap();
    assert_eq!(small.max_smem_optin, 99 * 1024, "the device allows at least 99 KiB");
    let t = 32;
    let mut kernels = Vec::new();
    for (spec, d) in [
        ("turboquant_mse:4:eden", 128),
        ("turboquant_mse:3", 64),
        ("q4_0", 128),
        ("rabitq", 128),
        ("turboquant_rvq:2:2", 128),
        ("turboquant_frac:3.5:center:eden", 128),
        ("turboquant_frac:2.5:center", 64),
    ] {
        let spec = FormatSpec::parse(spec).unwrap();
        let (cpu, gf, x) = if spec.desc().needs_calibration {
            frac_case(&spec, d, t)
        } else {
            let cpu = spec.build(&FormatCtx::new(d, t, Stream::Keys, 9)).unwrap();
            (cpu, GpuFormat::new(&spec, d, t, 9).unwrap(), awkward_rows(&mut SplitMix64::new(d as u64), 8 * t, d))
        };
        assert_encodes_like_cpu(&small, cpu.as_ref(), &gf, &x, &format!("{spec} d={d} at 99 KiB"));
        for input in [InputKind::F32, InputKind::F16] {
            kernels.push(format!("{spec} d={d} {input:?}: {}", GpuEncoder::new(&small, &gf, input).unwrap().kernel()));
        }
    }
    eprintln!("encoders at 99 KiB: {kernels:#?}");
    let mut worst = 0f64;
    for (k, v) in [
        ("vecinfer:8", "vecinfer:8"),
        ("turboquant_mse:4", "turboquant_mse:4"),
        ("turboquant_mse:3", "turboquant_mse:2"),
    ] {
        let c = Case { k, v, d: 128, gqa: 4, recent: 8, sink: 4, page_mode: false, lens: &[300, 33, 1] };
        worst = worst.max(run_case(&small, &c, 3));
    }
    assert!(worst <= DECODE_TOL, "{worst:.2e}");
    eprintln!("decode at 99 KiB: worst rel err {worst:.2e}");
}

/// vecinfer (calibrated: λ and k-means codebooks from the CPU format's state) encodes
/// bit-identically to the CPU: the nearest centroid by the CPU's f64 distances (first index on
/// ties), 4- and 8-bit indices of 2-, 4- and 8-dim sub-vectors, f32 and f16 input, d ∈ {64,
/// 128, 256}; rows far outside the calibration (zeros, tiny, huge, ties) included. Both page
/// kernels: a row per lane (`encode_vq_pages`) and two (`encode_vq_pages2`,
/// `Tuning::encode_vq_pairs`).
#[test]
fn vecinfer_encode_bit_identical_to_cpu() {
    let Some(dev) = device() else { return };
    let t = 32;
    let specs = ["vecinfer:8", "vecinfer:4:g2", "vecinfer:8:g8", "vecinfer:4", "vecinfer:8:g2"]
        .map(|s| FormatSpec::parse(s).unwrap());
    let cases: Vec<(&FormatSpec, usize)> = specs.iter().flat_map(|s| [64usize, 128, 256].map(|d| (s, d))).collect();
    let pairs = veloxquant_cuda::Tuning { encode_vq_pairs: true, ..Default::default() };
    let checked = par_cases(&cases, |dev, &(spec, d)| {
        let pairs_dev = GpuDevice::new_with(0, pairs, None).expect("a second device handle");
        let seed = 0x7e0 + d as u64;
        let mut rng = SplitMix64::new(seed);
        let mut ctx = FormatCtx::new(d, t, Stream::Values, seed);
        // Channels of unequal scales (λ ≠ 1).
        ctx.calibration =
            Some((0..300 * d).map(|i| rng.next_gaussian() as f32 * (1 + i % 7) as f32).collect::<Vec<f32>>().into());
        let cpu = spec.build(&ctx).unwrap();
        let state = cpu.export_state();
        let gf = GpuFormat::with_state(spec, d, t, seed, Stream::Values, Some(&state)).unwrap();
        assert_eq!(gf.page_bytes, cpu.page_bytes(), "{spec} d={d}");
        let n_pages = 8;
        let x = awkward_rows(&mut rng, n_pages * t, d);
        for (dev, kernel) in [(dev, "block/page"), (&pairs_dev, "block/page, 2 rows a lane")] {
            assert_eq!(GpuEncoder::new(dev, &gf, InputKind::F16).unwrap().kernel(), kernel, "{spec} d={d}");
            assert_encodes_like_cpu(dev, cpu.as_ref(), &gf, &x, &format!("{spec} d={d} {kernel}"));
        }
    })
    .len();
    // The placeholder state (no calibration) codes nothing: refused, typed.
    let ph = GpuFormat::new(&FormatSpec::parse("vecinfer:8").unwrap(), 128, t, 1).unwrap();
    assert!(matches!(
        GpuEncoder::new(&dev, &ph, InputKind::F32),
        Err(veloxquant_cuda::CudaError::Core(veloxquant::VqError::MissingCalibration { .. }))
    ));
    eprintln!("vecinfer encode: {checked} (format, d) cases × 8 pages bit-identical (f32 and f16 input)");
    assert_eq!(checked, 15);
}

struct Case {
    k: &'static str,
    v: &'static str,
    d: usize,
    gqa: usize,
    recent: usize,
    sink: usize,
    page_mode: bool,
    lens: &'static [usize],
}

fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs() as f64)).max(1e-30);
    a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((*x as f64 - *y as f64).abs())) / scale
}

fn cpu_config(c: &Case, n_kv: usize) -> CacheConfig {
    let mut cfg = CacheConfig::new(1, n_kv, c.d, FormatSpec::parse(c.k).unwrap(), FormatSpec::parse(c.v).unwrap());
    cfg.recent = c.recent;
    cfg.sink = c.sink;
    cfg.encode_rows = !c.page_mode;
    cfg
}

/// `[kv][lo..hi][d]` of x laid out `[kv][n][d]`.
fn per_head(x: &[f32], n_kv: usize, n: usize, d: usize, lo: usize, hi: usize) -> Vec<f32> {
    (0..n_kv).flat_map(|h| x[(h * n + lo) * d..(h * n + hi) * d].to_vec()).collect()
}

/// The GPU slot holds what the CPU cache holds: every page byte-identical (the open page's
/// valid rows), the window and sinks bit-identical.
fn assert_same_contents(gpu: &GpuKvCache, slot: usize, cpu: &PagedCache, what: &str) {
    let got = gpu.download(slot).unwrap();
    for (l, heads) in got.iter().enumerate() {
        let lc = cpu.layer(l).unwrap();
        for (h, pair) in heads.iter().enumerate() {
            for (si, s) in [&lc.keys[h], &lc.values[h]].into_iter().enumerate() {
                let g = if si == 0 { &pair.0 } else { &pair.1 };
                // The open page's valid rows only (a trimmed CPU page keeps stale rows past them).
                let fmt = if si == 0 { &gpu.k.fmt } else { &gpu.v.fmt };
                let want: Vec<Vec<u8>> = s
                    .pages()
                    .iter()
                    .enumerate()
                    .map(|(p, pg)| {
                        let mut x = pg.to_vec();
                        if s.open_rows() > 0 && p + 1 == s.pages().len() {
                            fmt.clear_rows_from(&mut x, s.open_rows());
                        }
                        x
                    })
                    .collect();
                assert_eq!(g.pages.len(), want.len(), "{what}: layer {l} head {h} stream {si}: page count");
                for (p, (a, b)) in g.pages.iter().zip(&want).enumerate() {
                    assert!(a[..] == b[..], "{what}: layer {l} head {h} stream {si}: page {p} differs");
                }
                assert_eq!(g.open_rows, s.open_rows(), "{what}: open rows");
                let bits = |x: &[half::f16]| x.iter().map(|v| v.to_bits()).collect::<Vec<u16>>();
                assert_eq!(bits(&g.tail), bits(s.tail()), "{what}: layer {l} head {h} stream {si}: window");
                assert_eq!(bits(&g.sink), bits(s.sink()), "{what}: layer {l} head {h} stream {si}: sinks");
            }
        }
    }
}

fn run_case(dev: &Arc<GpuDevice>, c: &Case, seed: u64) -> f64 {
    run_case_with(dev, c, seed, attn::DecodeOptions::default())
}

fn run_case_with(dev: &Arc<GpuDevice>, c: &Case, seed: u64, opts: attn::DecodeOptions) -> f64 {
    let n_kv = 2;
    let d = c.d;
    let hq = n_kv * c.gqa;
    let max_len = *c.lens.iter().max().unwrap();
    let mut cfg = cpu_config(c, n_kv);
    // Calibrated formats (turboquant_frac): keys with a per-channel mean (what `center`
    // removes), calibrated on other draws of the same distributions.
    let calibrated = cfg.k.desc().needs_calibration || cfg.v.desc().needs_calibration;
    let key_mean = |i: usize| if calibrated { 3.0 * ((i % d) as f32 * 0.7).sin() } else { 0.0 };
    let key_at =
        |rng: &mut SplitMix64, i: usize| rng.next_gaussian() as f32 * if i % d < 4 { 6.0 } else { 1.0 } + key_mean(i);
    if calibrated {
        let mut rng = SplitMix64::new(seed ^ 0xca1);
        let mut cal = veloxquant::Calibration::new();
        cal.insert_for_all(Stream::Keys, (0..256 * d).map(|i| key_at(&mut rng, i)).collect());
        cal.insert_for_all(Stream::Values, rng.gaussian_vec(256 * d));
        cfg.calibration = Some(Arc::new(cal));
    }
    let total: usize = c.lens.iter().sum();
    // Room for the pages the plan covers (32-token pages), beyond the longest row if asked.
    let cap = max_len.max(32 * opts.cover_pages);
    let mut gpu = GpuKvCache::new(dev, GpuCacheConfig::from_cpu(&cfg, c.lens.len(), cap, total)).unwrap();
    let mut cpus = Vec::new();
    let mut slots = Vec::new();
    let mut rng = SplitMix64::new(seed);
    for &n in c.lens {
        let slot = gpu.add_seq().unwrap();
        let mut cpu = PagedCache::new(cfg.clone()).unwrap();
        let keys: Vec<f32> = (0..n_kv * n * d).map(|i| key_at(&mut rng, i)).collect();
        let vals = rng.gaussian_vec(n_kv * n * d);
        // A prefill-sized chunk (two-phase append), then token by token (one-launch append).
        let first = n * 2 / 3;
        let mut chunks = vec![(0, first)];
        chunks.extend((first..n).map(|t| (t, t + 1)));
        for (lo, hi) in chunks {
            if hi == lo {
                continue;
            }
            let (kk, vv) = (per_head(&keys, n_kv, n, d, lo, hi), per_head(&vals, n_kv, n, d, lo, hi));
            cpu.append(0, &kk, &vv, hi - lo).unwrap();
            gpu.append(slot, &[(&kk, &vv)], hi - lo).unwrap();
        }
        assert_same_contents(&gpu, slot, &cpu, &format!("{}/{} d={d} n={n}", c.k, c.v));
        cpus.push(cpu);
        slots.push(slot);
    }
    let q = rng.gaussian_vec(c.lens.len() * hq * d);
    let out = attn::decode_with(&mut gpu, &slots, 0, &q, hq, opts).unwrap();
    let mut worst = 0f64;
    for (b, cpu) in cpus.iter().enumerate() {
        let qb = &q[b * hq * d..(b + 1) * hq * d];
        let want = decode_attention_ref(cpu, 0, qb, hq).unwrap();
        let got = &out[b * hq * d..(b + 1) * hq * d];
        assert!(got.iter().all(|v| v.is_finite()), "non-finite output");
        worst = worst.max(rel_err(got, &want));
    }
    worst
}

#[test]
fn decode_matches_cpu_reference() {
    if device().is_none() {
        return;
    }
    let pairs: &[(&str, &str)] = &[
        ("fp16", "fp16"),
        ("q8_0", "q8_0"),
        ("q4_0", "q4_0"),
        ("q8_0:rot", "q4_0:rot"),
        ("turboquant_mse:4", "turboquant_mse:4"),
        ("turboquant_mse:3:eden", "turboquant_mse:2"),
        ("turboquant_mse:2", "turboquant_mse:1"),
        ("turboquant_mse:4:eden", "q8_0"),
        ("turboquant_mse:2", "turboquant_mse:2"),
        ("turboquant_mse:4", "turboquant_mse:2"),
        ("turboquant_mse:2", "turboquant_mse:4:eden"),
        ("turboquant_mse:4:eden", "turboquant_mse:3"),
        ("turboquant_mse:2", "turboquant_mse:3:eden"),
        ("turboquant_mse:3", "turboquant_mse:3"),
        ("qjl", "turboquant_mse:2"),
        ("qjl:orth", "q8_0"),
        ("qjl", "fp16"),
        ("qjl:orth", "turboquant_mse:4:eden"),
        ("turboquant_mse:1", "turboquant_mse:2"),
        ("turboquant_prod:3", "turboquant_mse:3"),
        ("turboquant_prod:2:orth", "q8_0"),
        ("turboquant_prod:4", "fp16"),
        ("rabitq", "turboquant_mse:2"),
        ("rabitq", "fp16"),
        ("turboquant_rvq:2:2", "turboquant_mse:2"),
        ("turboquant_rvq:3:1", "q8_0"),
        ("turboquant_rvq:4:4", "turboquant_mse:4"),
        ("turboquant_rvq:1:1", "turboquant_mse:3"),
        ("turboquant_rvq:3:3", "turboquant_mse:3:eden"),
        ("kivi:2", "kivi:2"),
        ("kivi:4:g16", "kivi:4"),
        ("kivi:2:g16", "turboquant_mse:3"),
        ("turboquant_mse:4:eden", "kivi:2:g16"),
        ("kivi:4", "fp16"),
        ("q8_0", "kivi:2"),
    ];
    let lens: &[&'static [usize]] = &[&[17, 97, 200], &[1], &[33, 4097], &[3, 40]];
    let indexed: Vec<(usize, (&str, &str))> = pairs.iter().copied().enumerate().collect();
    let per_pair = par_cases(&indexed, |dev, &(pi, (k, v))| {
        let mut errs = Vec::new();
        for d in [64, 128] {
            for gqa in [1, 4] {
                for (recent, sink, page_mode) in [(0, 0, false), (8, 4, false), (32, 0, true)] {
                    let l = lens[(pi + d / 64 + gqa + recent / 8) % lens.len()];
                    let c = Case { k, v, d, gqa, recent, sink, page_mode, lens: l };
                    let e = run_case(dev, &c, (pi * 1000 + d + gqa * 10 + recent) as u64);
                    errs.push((format!("{k}/{v} d={d} g={gqa} R={recent} S={sink} page={page_mode} lens={l:?}"), e));
                }
            }
        }
        errs
    });
    let n: usize = per_pair.iter().map(Vec::len).sum();
    let (worst_all, bad) = worst_and_failures(per_pair.into_iter().flatten());
    eprintln!("decode parity: {n} cases (pages and windows bit-identical to the CPU), worst rel err {worst_all:.2e}, failures {}", bad.len());
    assert!(bad.is_empty(), "decode failures: {bad:#?}");
}

/// Decode attention's tolerance against the CPU reference (relative error).
const DECODE_TOL: f64 = 2e-3;

/// The worst error and the cases out of tolerance (> DECODE_TOL, or NaN) of labelled errors.
fn worst_and_failures(errs: impl IntoIterator<Item = (String, f64)>) -> (f64, Vec<String>) {
    let (mut worst, mut bad) = (0f64, Vec::new());
    for (what, e) in errs {
        #[allow(clippy::neg_cmp_op_on_partial_ord)]
        if !(e <= DECODE_TOL) {
            bad.push(format!("{what}: {e:.2e}"));
        }
        worst = worst.max(e);
    }
    (worst, bad)
}

/// A decode sweep against the CPU reference (each case ≤ 2e-3): every (K, V) pair × d × G ×
/// (recent, sink, page mode), ragged lengths by G, minus the cases `skip` names. Returns the
/// cases run and the worst error; panics listing the failures.
struct Sweep {
    pairs: &'static [(&'static str, &'static str)],
    ds: &'static [usize],
    gqas: &'static [usize],
    windows: &'static [(usize, usize, bool)],
    lens: fn(usize) -> &'static [usize],
    skip: fn(&str, usize) -> bool,
    /// Print each case's error as it finishes (a run cut by a time limit still tells).
    verbose: bool,
}

impl Sweep {
    fn run(&self) -> (usize, f64) {
        let groups: Vec<(usize, (&str, &str), usize)> =
            self.pairs.iter().enumerate().flat_map(|(pi, &kv)| self.ds.iter().map(move |&d| (pi, kv, d))).collect();
        let per_group = par_cases(&groups, |dev, &(pi, (k, v), d)| {
            let mut errs = Vec::new();
            for &gqa in self.gqas {
                for &(recent, sink, page_mode) in self.windows {
                    if (self.skip)(v, d) {
                        continue;
                    }
                    let c = Case { k, v, d, gqa, recent, sink, page_mode, lens: (self.lens)(gqa) };
                    let e = run_case(dev, &c, (pi * 100 + d + gqa + recent) as u64);
                    let what = format!("{k}/{v} d={d} G={gqa} R={recent} S={sink} pages={page_mode}");
                    if self.verbose {
                        eprintln!("{what}: {e:.2e}");
                    }
                    errs.push((what, e));
                }
            }
            errs
        });
        let n: usize = per_group.iter().map(Vec::len).sum();
        let (worst, bad) = worst_and_failures(per_group.into_iter().flatten());
        assert!(n > 0 && bad.is_empty(), "{n} cases: {bad:#?}");
        (n, worst)
    }
}

/// kivi keys (per-channel groups of 16 or 32 tokens) against the CPU reference: both group
/// sizes and bit widths, d ∈ {64, 96, 128, 256} (96: code-by-code readers beside the paired
/// ones, value groups straddling a thread's dims), every G the engine uses (QPACK's column layouts
/// and the rest), windows, sinks and ragged lengths.
#[test]
fn decode_kivi_keys_match_cpu_reference() {
    if device().is_none() {
        return;
    }
    let (n, worst) = Sweep {
        pairs: &[
            ("kivi:2", "kivi:2"),
            ("kivi:4", "kivi:4:g16"),
            ("kivi:2:g16", "turboquant_mse:3"),
            ("kivi:4:g16", "fp16"),
        ],
        ds: &[64, 96, 128, 256],
        gqas: &[1, 2, 3, 4, 8],
        windows: &[(0, 0, false), (8, 4, true)],
        lens: |gqa| if gqa % 2 == 0 { &[17, 97, 300] } else { &[33, 64, 1] },
        skip: |v, d| d == 256 && v.ends_with("g16"), // values need G ≥ d/8
        verbose: false,
    }
    .run();
    eprintln!("kivi keys decode: {n} cases, worst rel err {worst:.2e}");
}

/// turboquant_frac (calibrated, keys with a per-channel mean) as keys and values, beside
/// itself and other formats: the cache's pages bit-identical to the CPU's (row appends), decode
/// within 2e-3 of the CPU reference — the keys' ⟨q, μ⟩ against the exact window's scores, the
/// values' μ by the codes' weight, byte-read rows, d ∈ {64, 128, 256}, G ∈ {1, 4} (each case compiles its modules: ~1.5 s each).
#[test]
fn decode_frac_matches_cpu_reference() {
    if device().is_none() {
        return;
    }
    let (n, worst) = Sweep {
        pairs: &[
            ("turboquant_frac:3.5:center:eden", "turboquant_frac:2.5:center:eden"),
            ("turboquant_frac:2.25:eden", "turboquant_frac:3"),
            ("turboquant_frac:3.5:center", "turboquant_mse:3"),
            ("turboquant_mse:4", "turboquant_frac:2.5:center"),
            ("turboquant_frac:1.5:center", "fp16"),
        ],
        ds: &[64, 128, 256],
        gqas: &[1, 4],
        windows: &[(8, 4, false), (32, 0, true)],
        lens: |gqa| if gqa % 2 == 0 { &[17, 97, 300] } else { &[33, 64, 1] },
        skip: |_, _| false,
        verbose: true,
    }
    .run();
    eprintln!("turboquant_frac decode: {n} cases, worst rel err {worst:.2e}");
}

/// vecinfer (calibrated) as keys and values, beside itself and other formats: the cache's
/// pages bit-identical to the CPU's (row appends), decode within 2e-3 of the CPU reference —
/// keys scored against R·(q ⊙ λ), values accumulated in the z domain and mapped back by Rᵀ
/// and λ in combine; 8- and 4-bit indices, sub-vectors of 2, 4 and 8 dims, d ∈ {64, 128, 256}.
#[test]
fn decode_vecinfer_matches_cpu_reference() {
    if device().is_none() {
        return;
    }
    let (n, worst) = Sweep {
        pairs: &[
            ("vecinfer:8", "vecinfer:8"),
            ("vecinfer:4:g2", "turboquant_mse:3"),
            ("turboquant_mse:4", "vecinfer:8:g8"),
            ("vecinfer:8:g8", "fp16"),
        ],
        ds: &[64, 128, 256],
        gqas: &[1, 4],
        windows: &[(8, 4, false), (32, 0, true)],
        lens: |gqa| if gqa % 2 == 0 { &[17, 97, 300] } else { &[33, 64, 1] },
        skip: |_, _| false,
        verbose: true,
    }
    .run();
    eprintln!("vecinfer decode: {n} cases, worst rel err {worst:.2e}");
}

/// The block formats (q4_0's 18-byte and q8_0's 34-byte blocks) as keys and values beside each
/// other and other formats, d ∈ {64, 128, 256}, G ∈ {1, 4, 8}, with and without the window and
/// sinks, ragged lengths.
#[test]
fn decode_block_formats_match_cpu_reference() {
    if device().is_none() {
        return;
    }
    let (n, worst) = Sweep {
        pairs: &[
            ("q4_0", "q4_0"),
            ("q8_0", "q4_0"),
            ("q4_0", "q8_0"),
            ("q4_0:rot", "fp16"),
            ("turboquant_mse:4", "q4_0"),
            ("q8_0", "q8_0"),
        ],
        ds: &[64, 128, 256],
        gqas: &[1, 4, 8],
        windows: &[(0, 0, false), (8, 4, false)],
        lens: |gqa| if gqa == 4 { &[17, 97, 300] } else { &[33, 64, 1] },
        skip: |_, _| false,
        verbose: false,
    }
    .run();
    eprintln!("block formats decode: {n} cases, worst rel err {worst:.2e}");
}

/// d = 256 (the generic path: the FAST path's register layouts stop at 128) for every kind
/// of key and value reading, G ∈ {1, 2, 8}, the window and sinks, ragged lengths.
#[test]
fn decode_d256_matches_cpu_reference() {
    if device().is_none() {
        return;
    }
    let pairs: Vec<(usize, (&str, &str))> = [
        ("fp16", "fp16"),
        ("q8_0", "q4_0"),
        ("q4_0:rot", "q8_0:rot"),
        ("turboquant_mse:4", "turboquant_mse:4"),
        ("turboquant_mse:3:eden", "turboquant_mse:2"),
        ("turboquant_mse:1", "turboquant_mse:3"),
        ("qjl", "turboquant_mse:2"),
        ("turboquant_prod:3", "turboquant_mse:3"),
        ("rabitq", "q8_0"),
        ("turboquant_rvq:2:2", "turboquant_mse:2"),
        ("kivi:2:g16", "kivi:4"),
    ]
    .into_iter()
    .enumerate()
    .collect();
    let per_pair = par_cases(&pairs, |dev, &(pi, (k, v))| {
        [1, 2, 8].map(|gqa| {
            let c = Case { k, v, d: 256, gqa, recent: 8, sink: 4, page_mode: false, lens: &[300, 33, 1] };
            (format!("{k}/{v} g={gqa}"), run_case(dev, &c, (pi * 10 + gqa) as u64))
        })
    });
    let (worst, bad) = worst_and_failures(per_pair.into_iter().flatten());
    eprintln!("decode parity, d = 256: worst rel err {worst:.2e}, failures {}", bad.len());
    assert!(bad.is_empty(), "decode failures: {bad:#?}");
}

/// Head sizes that are not powers of two (a dense rotation: the CPU's matrix; the warp-per-row
/// encoders; the generic decode path) for every format the GPU runs there, keys and values,
/// G ∈ {1, 3, 4}, the window and sinks, ragged lengths, row and page mode: the cache's pages
/// byte-identical to the CPU's (run_case), decode within 2e-3 of the CPU reference. d = 80
/// and 112 also end in a partial chunk of 32 elements (a partial warp in the query's block
/// reductions), and their 3-bit rows (30 and 42 bytes), sign rows (10 and 14) and second
/// segments start mid-word.
#[test]
fn decode_dense_rotation_sizes_match_cpu_reference() {
    if device().is_none() {
        return;
    }
    let d96 = [
        ("fp16", "fp16"),
        ("q8_0", "q4_0:rot"),
        ("q8_0:rot", "q8_0"),
        ("turboquant_mse:4", "turboquant_mse:4"),
        ("turboquant_mse:3:eden", "turboquant_mse:2"),
        ("turboquant_mse:2", "turboquant_mse:3"),
        ("qjl", "turboquant_mse:2"),
        ("turboquant_prod:3", "turboquant_mse:2"),
        ("rabitq", "turboquant_mse:2"),
        ("turboquant_rvq:2:2", "turboquant_mse:2"),
    ]
    .map(|(k, v)| (96, k, v));
    let d80_d112 = [80usize, 112].into_iter().flat_map(|d| {
        [
            ("fp16", "fp16"),
            ("turboquant_mse:4", "turboquant_mse:3"),
            ("turboquant_mse:3:eden", "turboquant_mse:2"),
            ("turboquant_mse:2", "turboquant_mse:4"),
            ("qjl", "turboquant_mse:2"),
            ("turboquant_prod:3", "turboquant_mse:3"),
            ("turboquant_prod:2", "fp16"),
            ("rabitq", "turboquant_mse:2"),
            ("turboquant_rvq:3:1", "turboquant_mse:3"),
            ("turboquant_rvq:2:2", "fp16"),
        ]
        .map(|(k, v)| (d, k, v))
    });
    let pairs: Vec<(usize, (usize, &str, &str))> = d96.into_iter().chain(d80_d112).enumerate().collect();
    let per_pair = par_cases(&pairs, |dev, &(pi, (d, k, v))| {
        [(1, false), (3, true), (4, false)].map(|(gqa, page_mode)| {
            let c = Case { k, v, d, gqa, recent: 8, sink: 4, page_mode, lens: &[300, 33, 1] };
            let seed = (pi * 10 + gqa) as u64;
            let e = run_case(dev, &c, seed);
            let mut what = format!("d={d} {k}/{v} g={gqa} page_mode={page_mode}");
            #[allow(clippy::neg_cmp_op_on_partial_ord)] // NaN counts as a failure too
            if !(e <= DECODE_TOL) {
                // Still a failure; the reruns tell a wrong result every time from one that
                // comes and goes (two d ∈ {96, 112} turboquant_rvq-key cases failed once each
                // under load and passed when run again, 2026-12-07 and -08).
                let again: Vec<String> = (0..2).map(|_| format!("{:.2e}", run_case(dev, &c, seed))).collect();
                what += &format!(" (the same case again: {})", again.join(", "));
            }
            (what, e)
        })
    });
    let (worst, bad) = worst_and_failures(per_pair.into_iter().flatten());
    eprintln!("decode parity, d = 80, 96, 112: worst rel err {worst:.2e}, failures {}", bad.len());
    assert!(bad.is_empty(), "decode failures: {bad:#?}");
}

/// 1-bit keys with 2-bit values by prmt from registers, the tuning's other choice
/// (`Tuning::decode_lut1v` off; the default, byte lookups (decode.cu V1L), is what the other
/// tests run): the FAST path's pairs at d ∈ {64, 128}, every G, windows, sinks, ragged lengths,
/// row and page mode, split-K and stream grids.
#[test]
fn decode_lut1v_off_matches_cpu_reference() {
    if device().is_none() {
        return;
    }
    let tuning = veloxquant_cuda::Tuning { decode_lut1v: false, ..Default::default() };
    let pairs = [
        ("qjl", "turboquant_mse:2"),
        ("qjl:orth", "turboquant_mse:2"),
        ("rabitq", "turboquant_mse:2"),
        ("turboquant_mse:1", "turboquant_mse:2"),
    ];
    let groups: Vec<(usize, (usize, &str, &str))> =
        pairs.into_iter().flat_map(|(k, v)| [64, 128].map(|d| (d, k, v))).enumerate().collect();
    let per_group = par_cases_with(tuning, &groups, |dev, &(pi, (d, k, v))| {
        let mut errs = Vec::new();
        let cases: [(usize, bool, &'static [usize]); 5] = [
            (1, false, &[300, 33, 1]),
            (2, true, &[97, 4097]),
            (3, false, &[200, 17, 64]),
            (4, true, &[300, 33, 1]),
            (8, false, &[2900, 40, 1513]),
        ];
        for (gqa, page_mode, lens) in cases {
            for grid in [attn::DecodeGrid::SplitK, attn::DecodeGrid::Stream] {
                let opts = attn::DecodeOptions { grid, ..Default::default() };
                let c = Case { k, v, d, gqa, recent: 8, sink: 4, page_mode, lens };
                let e = run_case_with(dev, &c, (pi * 10 + gqa) as u64, opts);
                errs.push((format!("d={d} {k}/{v} g={gqa} page_mode={page_mode} {grid:?}"), e));
            }
        }
        errs
    });
    let (worst, bad) = worst_and_failures(per_group.into_iter().flatten());
    eprintln!("decode parity, 1-bit keys with 2-bit values by prmt: worst rel err {worst:.2e}, failures {}", bad.len());
    assert!(bad.is_empty(), "decode failures: {bad:#?}");
}

/// turboquant_rvq values (decode.cu V2SEG: both stages' accumulators, combine's
/// R₁ᵀ·(a₁ + R₂ᵀ·a₂)) at every stage-2 width, with rvq and other keys, d ∈ {64, 80, 96, 112,
/// 128, 256} (dense rotations and byte-read rows included), and qjl:2x keys at d ≤ 128 (two
/// segments of signs against two prepared queries; the FAST path at d = 64 and 128 beside
/// 2–4-bit codes),
/// G ∈ {1, 2, 3, 4, 8}, the window and sinks, ragged lengths, row and page mode: pages
/// byte-identical to the CPU's (run_case), decode within 2e-3 of the CPU reference.
#[test]
fn decode_rvq_values_and_qjl_2x_match_cpu_reference() {
    if device().is_none() {
        return;
    }
    let pairs = [
        (64, "turboquant_rvq:2:2", "turboquant_rvq:2:2"),
        (64, "turboquant_mse:3", "turboquant_rvq:3:1"),
        (128, "turboquant_rvq:2:2", "turboquant_rvq:2:2"),
        (128, "fp16", "turboquant_rvq:4:2"),
        (128, "q8_0", "turboquant_rvq:1:1"),
        (128, "turboquant_prod:3", "turboquant_rvq:3:3"),
        (128, "turboquant_mse:4", "turboquant_rvq:2:4"),
        (256, "turboquant_rvq:2:2", "turboquant_rvq:2:2"),
        (96, "turboquant_mse:2", "turboquant_rvq:2:2"),
        (80, "turboquant_rvq:3:1", "turboquant_rvq:3:1"),
        (112, "fp16", "turboquant_rvq:2:2"),
        (64, "qjl:2x", "turboquant_mse:2"),
        (128, "qjl:2x", "turboquant_mse:3"),
        (128, "qjl:2x:orth", "turboquant_mse:4"),
        (128, "qjl:2x", "fp16"),
        (96, "qjl:2x", "turboquant_mse:2"),
        (128, "qjl:2x:orth", "turboquant_rvq:2:2"),
    ];
    let pairs: Vec<(usize, (usize, &str, &str))> = pairs.into_iter().enumerate().collect();
    let per_pair = par_cases(&pairs, |dev, &(pi, (d, k, v))| {
        [(1, false), (2, true), (3, false), (4, true), (8, false)].map(|(gqa, page_mode)| {
            let c = Case { k, v, d, gqa, recent: 8, sink: 4, page_mode, lens: &[300, 33, 1] };
            (format!("d={d} {k}/{v} g={gqa} page_mode={page_mode}"), run_case(dev, &c, (pi * 10 + gqa) as u64))
        })
    });
    let (worst, bad) = worst_and_failures(per_pair.into_iter().flatten());
    eprintln!(
        "decode parity, turboquant_rvq values and qjl:2x keys: worst rel err {worst:.2e}, failures {}",
        bad.len()
    );
    assert!(bad.is_empty(), "decode failures: {bad:#?}");
}

/// The pipelined 1/2/3/4-bit path over long ragged rows: 8 rows of up to ~90 pages in splits of 16,
/// sequences ending inside a split or before it starts (warps and blocks with no pages), G = 8;
/// split-K blocks (the default stream grid is checked by the other decode tests), dealt by the
/// rows' pages (BALANCE), by the plan's splits (the tuning's other choice, batches > 512) on
/// the first pairs, and dealt for a plan covering 4× the longest row (a serving page bucket).
#[test]
fn decode_long_ragged_rows_match_cpu_reference() {
    if device().is_none() {
        return;
    }
    let plain_tuning = veloxquant_cuda::Tuning { decode_balance: false, ..Default::default() };
    let opts = attn::DecodeOptions { grid: attn::DecodeGrid::SplitK, ..Default::default() };
    let pairs = [
        ("turboquant_mse:4", "turboquant_mse:4"),
        ("turboquant_mse:2", "turboquant_mse:2"),
        ("turboquant_mse:4", "turboquant_mse:2"),
        ("turboquant_mse:4:eden", "turboquant_mse:3"),
        ("turboquant_mse:3", "turboquant_mse:3"),
        ("turboquant_mse:3:eden", "turboquant_mse:4"),
        ("qjl:orth", "turboquant_mse:2"),
        ("turboquant_mse:1", "turboquant_mse:3"),
        ("turboquant_prod:3", "turboquant_mse:2"),
        ("rabitq", "turboquant_mse:3"),
        ("turboquant_rvq:2:2", "turboquant_mse:2"),
        ("kivi:2", "kivi:2:g16"),
    ];
    let indexed: Vec<(usize, (&str, &str))> = pairs.into_iter().enumerate().collect();
    let per_pair = par_cases(&indexed, |dev, &(pi, (k, v))| {
        let plain = (pi < 3).then(|| GpuDevice::new_with(0, plain_tuning, None).unwrap());
        let mut errs = Vec::new();
        for d in [64, 128] {
            for gqa in [1, 8] {
                let lens: &'static [usize] = if gqa == 1 { &[2900, 700, 1513, 40] } else { &[300, 2900, 1513, 2897] };
                let c = Case { k, v, d, gqa, recent: 32 * (d / 128), sink: 4, page_mode: false, lens };
                let seed = (pi * 100 + d + gqa) as u64;
                let mut runs = vec![("dealt", run_case_with(dev, &c, seed, opts))];
                if let Some(plain) = &plain {
                    runs.push(("plan's splits", run_case_with(plain, &c, seed, opts)));
                    let wide = attn::DecodeOptions { cover_pages: 4 * 91, ..opts };
                    runs.push(("dealt, 4× plan", run_case_with(dev, &c, seed, wide)));
                }
                errs.extend(runs.into_iter().map(|(how, e)| (format!("{k}/{v} d={d} g={gqa} lens={lens:?} {how}"), e)));
            }
        }
        errs
    });
    let (worst_all, bad) = worst_and_failures(per_pair.into_iter().flatten());
    eprintln!("decode parity, long ragged rows: worst rel err {worst_all:.2e}, failures {}", bad.len());
    assert!(bad.is_empty(), "decode failures: {bad:#?}");
}

/// The stream grid with few blocks, so that each warp's run of pages crosses many rows (and
/// rows with no coded pages, pages filled in part): every row's partials merged, G ∈ {1, 3, 8}.
#[test]
fn decode_stream_runs_across_rows_match_cpu_reference() {
    if device().is_none() {
        return;
    }
    let lens: &'static [usize] = &[1, 17, 33, 300, 900, 40, 700, 64, 513, 5, 200, 96, 31, 400];
    let pairs: Vec<(usize, (&str, &str))> = [
        ("turboquant_mse:4:eden", "turboquant_mse:3"),
        ("turboquant_mse:4", "turboquant_mse:4"),
        ("turboquant_mse:2", "turboquant_mse:2"),
        ("turboquant_mse:3", "turboquant_mse:3"),
        ("turboquant_mse:4", "turboquant_mse:2"),
        ("turboquant_mse:1", "turboquant_mse:3"),
        ("qjl:orth", "turboquant_mse:2"),
        ("turboquant_prod:3", "turboquant_mse:2"),
        ("rabitq", "turboquant_mse:3"),
        ("turboquant_rvq:2:2", "turboquant_mse:2"),
    ]
    .into_iter()
    .enumerate()
    .collect();
    let per_pair = par_cases(&pairs, |dev, &(pi, (k, v))| {
        let mut errs = Vec::new();
        for (d, gqa) in [(64, 3), (128, 1), (128, 8)] {
            for max_blocks in [1, 0] {
                let opts = attn::DecodeOptions { grid: attn::DecodeGrid::Stream, max_blocks, ..Default::default() };
                let c = Case { k, v, d, gqa, recent: 8, sink: 4, page_mode: false, lens };
                let e = run_case_with(dev, &c, (pi * 100 + d + gqa + max_blocks) as u64, opts);
                errs.push((format!("{k}/{v} d={d} g={gqa} blocks={max_blocks}"), e));
            }
        }
        errs
    });
    let (worst, bad) = worst_and_failures(per_pair.into_iter().flatten());
    eprintln!("decode parity, stream runs across rows: worst rel err {worst:.2e}, failures {}", bad.len());
    assert!(bad.is_empty(), "decode failures: {bad:#?}");
}

/// The generic path pre-Hopper GPUs run (no bulk copies, no PDL) for the formats Hopper takes
/// on the FAST path, checked here on Hopper against the CPU reference.
#[test]
fn decode_generic_path_matches_cpu_reference() {
    if device().is_none() {
        return;
    }
    let opts = attn::DecodeOptions { generic: true, ..Default::default() };
    let pairs = [
        ("turboquant_mse:4", "turboquant_mse:4"),
        ("turboquant_mse:2", "turboquant_mse:2"),
        ("turboquant_mse:4:eden", "turboquant_mse:2"),
        ("turboquant_mse:4:eden", "turboquant_mse:3"),
        ("turboquant_mse:3", "turboquant_mse:3"),
        ("qjl", "turboquant_mse:3"),
        ("rabitq", "turboquant_mse:2"),
        ("turboquant_rvq:2:2", "turboquant_mse:2"),
        ("turboquant_prod:3", "turboquant_mse:4"),
    ];
    let per_pair = par_cases(&pairs, |dev, &(k, v)| {
        let mut errs = Vec::new();
        for d in [64, 128] {
            for gqa in [1, 3, 8] {
                let c = Case { k, v, d, gqa, recent: 8, sink: 4, page_mode: false, lens: &[700, 33, 1] };
                errs.push((format!("{k}/{v} d={d} g={gqa}"), run_case_with(dev, &c, (d + gqa) as u64, opts)));
            }
        }
        errs
    });
    let (worst, bad) = worst_and_failures(per_pair.into_iter().flatten());
    eprintln!("decode parity, generic path: worst rel err {worst:.2e}");
    assert!(bad.is_empty(), "decode failures: {bad:#?}");
}

/// Fork shares pages; appending into a shared open page copies it first; trim keeps what
/// survives; after each, the GPU slots hold exactly what the CPU caches doing the same hold,
/// and attention agrees. Removing every slot frees the pool.
#[test]
fn fork_trim_and_copy_on_write_match_cpu() {
    let Some(dev) = device() else { return };
    let (n_kv, d, hq) = (2, 64, 4);
    let c = Case {
        k: "turboquant_mse:4:eden",
        v: "turboquant_mse:3",
        d,
        gqa: 2,
        recent: 8,
        sink: 4,
        page_mode: false,
        lens: &[],
    };
    let cfg = cpu_config(&c, n_kv);
    let mut gpu = GpuKvCache::new(&dev, GpuCacheConfig::from_cpu(&cfg, 4, 512, 2048)).unwrap();
    let mut rng = SplitMix64::new(77);
    let mut kv = |n: usize| (rng.gaussian_vec(n_kv * n * d), rng.gaussian_vec(n_kv * n * d));
    let a = gpu.add_seq().unwrap();
    let mut cpu_a = PagedCache::new(cfg.clone()).unwrap();
    let (k, v) = kv(150);
    gpu.append(a, &[(&k, &v)], 150).unwrap();
    cpu_a.append(0, &k, &v, 150).unwrap();
    let b = gpu.fork(a).unwrap();
    let mut cpu_b = cpu_a.fork();
    assert!(gpu.group_refs(a).unwrap().iter().all(|&r| r == 2), "forked pages are shared");
    let used_after_fork = gpu.pool_usage().0;
    // b appends into the shared open page: b gets its own copy, a keeps its bytes.
    let (k, v) = kv(5);
    gpu.append(b, &[(&k, &v)], 5).unwrap();
    cpu_b.append(0, &k, &v, 5).unwrap();
    assert_eq!(gpu.pool_usage().0, used_after_fork + 1, "one page copied on write");
    gpu.trim(a, 20).unwrap();
    cpu_a.trim(20).unwrap();
    let (k, v) = kv(3);
    gpu.append(a, &[(&k, &v)], 3).unwrap();
    cpu_a.append(0, &k, &v, 3).unwrap();
    gpu.sync_meta().unwrap();
    assert_same_contents(&gpu, a, &cpu_a, "trimmed then appended");
    assert_same_contents(&gpu, b, &cpu_b, "fork after copy on write");
    let q = rng.gaussian_vec(2 * hq * d);
    let out = attn::decode(&mut gpu, &[a, b], 0, &q, hq).unwrap();
    for (i, cpu) in [&cpu_a, &cpu_b].into_iter().enumerate() {
        let want = decode_attention_ref(cpu, 0, &q[i * hq * d..(i + 1) * hq * d], hq).unwrap();
        let e = rel_err(&out[i * hq * d..(i + 1) * hq * d], &want);
        assert!(e <= DECODE_TOL, "sequence {i}: rel err {e:.2e}");
    }
    gpu.remove_seq(a).unwrap();
    gpu.remove_seq(b).unwrap();
    assert_eq!(gpu.pool_usage().0, 0, "every page freed");
    eprintln!("fork / copy-on-write / trim: contents bit-identical to the CPU, attention within 2e-3");
}

/// A step captured into a CUDA graph (combine a programmatic dependent of decode_pages)
/// replays to the same bits as `run`; a plan refuses a cache that grew past its pages, a
/// cache it was not made for, and pending table writes.
#[test]
fn decode_graph_replay_matches_run() {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let Some(dev) = device() else { return };
    let (n_kv, d, hq) = (2, 128, 8);
    let spec = FormatSpec::parse("turboquant_mse:4").unwrap();
    let cfg = CacheConfig::new(1, n_kv, d, spec.clone(), spec);
    let mut cache = GpuKvCache::new(&dev, GpuCacheConfig::from_cpu(&cfg, 2, 8192, 8192)).unwrap();
    let mut rng = SplitMix64::new(11);
    let mut slots = Vec::new();
    for n in [3000, 1234] {
        let s = cache.add_seq().unwrap();
        cache.append(s, &[(&rng.gaussian_vec(n_kv * n * d), &rng.gaussian_vec(n_kv * n * d))], n).unwrap();
        slots.push(s);
    }
    cache.sync_meta().unwrap();
    let mut plan =
        attn::DecodePlan::new(&cache, hq, 2, cache.max_pages(&slots), attn::DecodeOptions::default()).unwrap();
    plan.set_rows(&cache, &[slots[0] as i32, slots[1] as i32]).unwrap();
    let s0 = dev.stream.clone();
    s0.memcpy_htod(&rng.gaussian_vec(2 * hq * d), &mut plan.q).unwrap();
    plan.run(&cache).unwrap();
    let want = s0.clone_dtoh(&plan.out).unwrap();
    s0.memset_zeros(&mut plan.out).unwrap();
    dev.synchronize().unwrap();
    s0.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
    plan.run_on_stream(&cache, &s0).unwrap();
    let graph = s0.end_capture(CUgraphInstantiate_flags(0)).unwrap().expect("a captured graph");
    graph.launch().unwrap();
    s0.synchronize().unwrap();
    let got = s0.clone_dtoh(&plan.out).unwrap();
    assert!(want.iter().all(|x| x.is_finite()) && want.iter().any(|&x| x != 0.0));
    assert_eq!(
        got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        want.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
    eprintln!("graph replay: {} outputs bit-identical to run ({} splits)", got.len(), plan.n_splits);

    // Past what any split layout covers (at most pages_per_split − 1 beyond the pages planned).
    let more = (plan.pages_per_split + 2) * 32;
    cache.append(slots[0], &[(&rng.gaussian_vec(n_kv * more * d), &rng.gaussian_vec(n_kv * more * d))], more).unwrap();
    assert!(plan.run(&cache).is_err(), "a plan must refuse pending table writes");
    cache.sync_meta().unwrap();
    assert!(plan.run(&cache).is_err(), "a plan must refuse pages it does not cover");
    let other = GpuKvCache::new(&dev, GpuCacheConfig::from_cpu(&cfg, 2, 8192, 8192)).unwrap();
    assert!(plan.run(&other).is_err(), "a plan must refuse another cache");
}

/// A few cases of every decode path (FAST with its bulk-copy ring, generic, page mode, kivi,
/// the two-segment formats) and of the encoders, small enough to run under
/// compute-sanitizer's racecheck and memcheck (`parity sanitizer_`); the same tolerances.
#[test]
fn sanitizer_cases_match_cpu() {
    let Some(dev) = device() else { return };
    let mut worst = 0f64;
    for (k, v, d, gqa, page_mode, generic) in [
        ("turboquant_mse:4", "turboquant_mse:4", 128, 4, false, false),
        ("turboquant_mse:4:eden", "turboquant_mse:3", 64, 3, false, false),
        ("turboquant_mse:2", "turboquant_mse:2", 128, 1, false, false),
        ("turboquant_mse:3", "turboquant_mse:3", 64, 3, false, true),
        ("q8_0", "q4_0", 64, 2, false, false),
        ("fp16", "fp16", 128, 8, false, false),
        ("kivi:2", "kivi:4", 128, 4, true, false),
        ("turboquant_prod:3", "turboquant_mse:3", 64, 3, false, false),
        ("rabitq", "turboquant_mse:2", 128, 2, false, false),
        ("turboquant_frac:3.5:center:eden", "turboquant_frac:2.5:center", 64, 2, false, false),
        ("vecinfer:8", "vecinfer:4:g2", 128, 4, false, false),
    ] {
        let c = Case { k, v, d, gqa, recent: 8, sink: 4, page_mode, lens: &[300, 33, 1] };
        let opts = attn::DecodeOptions { generic, ..Default::default() };
        let e = run_case_with(&dev, &c, (d + gqa) as u64, opts);
        eprintln!("sanitizer case {k}/{v} d={d} G={gqa} page_mode={page_mode} generic={generic}: {e:.2e}");
        worst = worst.max(e);
    }
    // The FAST path's split-K grid, and the stream grid with one block (runs across rows).
    for (grid, max_blocks) in [(attn::DecodeGrid::SplitK, 0), (attn::DecodeGrid::Stream, 1)] {
        let c = Case {
            k: "turboquant_mse:4:eden",
            v: "turboquant_mse:3",
            d: 64,
            gqa: 3,
            recent: 8,
            sink: 4,
            page_mode: false,
            lens: &[300, 33, 1],
        };
        let opts = attn::DecodeOptions { grid, max_blocks, ..Default::default() };
        let e = run_case_with(&dev, &c, 7, opts);
        eprintln!("sanitizer case grid={grid:?} max_blocks={max_blocks}: {e:.2e}");
        worst = worst.max(e);
    }
    assert!(worst <= DECODE_TOL, "{worst:.2e}");
    for (spec, d) in [
        ("turboquant_mse:4", 128),
        ("turboquant_mse:3", 64),
        ("kivi:2", 64),
        ("turboquant_rvq:2:2", 128),
        ("turboquant_rvq:4:2", 64),
        ("turboquant_prod:3", 64),
        ("turboquant_prod:4", 128),
    ] {
        let spec = FormatSpec::parse(spec).unwrap();
        let gf = GpuFormat::new(&spec, d, 32, 5).unwrap();
        let cpu = spec.build(&FormatCtx::new(d, 32, Stream::Keys, 5)).unwrap();
        let x = awkward_rows(&mut SplitMix64::new(3), 4 * 32, d);
        let got = GpuEncoder::new(&dev, &gf, InputKind::F32).unwrap().encode_pages_f32(&x).unwrap();
        let pb = cpu.page_bytes();
        for p in 0..4 {
            let mut want = vec![0u8; pb];
            cpu.encode_page(&x[p * 32 * d..(p + 1) * 32 * d], &mut want).unwrap();
            assert_eq!(&got[p * pb..(p + 1) * pb], &want[..], "{spec} d={d} page {p}");
        }
    }
}
