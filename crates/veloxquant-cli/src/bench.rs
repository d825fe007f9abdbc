//! `veloxquant bench cpu`: encode throughput and decode attention for each format, against
//! the fp16 cache path (same fused code, fp16 pages) and the plain reference, interleaved in
//! one run over rotating queries; median and p10–p90, bytes read and GB/s next to this
//! machine's measured read and copy bandwidth.

use std::hint::black_box;
use std::path::PathBuf;
use std::time::Instant;

use rayon::prelude::*;
use serde_json::json;
use std::sync::Arc;
use veloxquant::attn::{decode_attention, decode_attention_ref};
use veloxquant::rng::SplitMix64;

use veloxquant::{CacheConfig, Calibration, FormatSpec, PagedCache, Stream};

use crate::check::{bad, count, nonempty, ArgError, Ctx};
use crate::files::OutputKind;
use crate::util::{print_table_to, progress, quantiles, write_json, AnyResult};
use veloxquant::cache::MAX_HEADS;
use veloxquant::format::MAX_HEAD_DIM;

#[derive(clap::Args)]
pub struct CpuArgs {
    /// Context lengths (tokens).
    #[arg(long, value_delimiter = ',', default_value = "4096,16384,32768")]
    context: Vec<usize>,
    /// K/V format pairs `KSPEC[/VSPEC]` (V defaults to K).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "q8_0:rot,q4_0:rot,turboquant_mse:4,turboquant_mse:4:eden/turboquant_mse:3,turboquant_mse:3,turboquant_frac:3.5:center:eden,turboquant_mse:2,turboquant_frac:2.5:center:eden,turboquant_prod:3/turboquant_mse:3,turboquant_rvq:2:2,qjl:1x/turboquant_mse:3,kivi:2,rabitq/turboquant_mse:3,vecinfer:8:g4/vecinfer:8:g8"
    )]
    formats: Vec<String>,
    /// Shapes `HQ:HKV:D`.
    #[arg(long, value_delimiter = ',', default_value = "32:8:128,9:3:64")]
    shapes: Vec<String>,
    /// Timed calls per variant (after one warm-up).
    #[arg(long, default_value_t = 21)]
    reps: usize,
    /// Calls of the (slow, single-threaded f64) reference path per point; 0 skips it.
    #[arg(long, default_value_t = 2)]
    ref_reps: usize,
    /// Recent window R kept in fp16.
    #[arg(long, default_value_t = 0)]
    recent: usize,
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also write the table as Markdown.
    #[arg(long)]
    md: Option<PathBuf>,
}

fn parse_pair(s: &str) -> Result<(FormatSpec, FormatSpec), ArgError> {
    let spec =
        |t: &str| FormatSpec::parse(t).map_err(|source| ArgError::Spec { arg: "formats", value: s.into(), source });
    let mut it = s.splitn(2, '/');
    let k = spec(it.next().unwrap_or_default())?;
    let v = match it.next() {
        Some(v) => spec(v)?,
        None => k.clone(),
    };
    Ok((k, v))
}

fn parse_shape(s: &str) -> Result<(usize, usize, usize), ArgError> {
    let why = format!(
        "want HQ:HKV:D with 1 ≤ HKV ≤ {MAX_HEADS}, HQ a multiple of HKV up to {MAX_HEADS}, 1 ≤ D ≤ {MAX_HEAD_DIM}"
    );
    let p: Vec<usize> = s.split(':').map(str::parse).collect::<Result<_, _>>().map_err(|_| bad("shapes", s, &why))?;
    match p[..] {
        [hq, hkv, d]
            if (1..=MAX_HEADS).contains(&hkv)
                && (1..=MAX_HEADS).contains(&hq)
                && hq % hkv == 0
                && (1..=MAX_HEAD_DIM).contains(&d) =>
        {
            Ok((hq, hkv, d))
        }
        _ => Err(bad("shapes", s, why)),
    }
}

/// Values of K (or V) one benchmark point may hold in f32 (512 MiB; the default largest,
/// 8 KV heads × 32k tokens × 128, is a quarter of it): every format's cache is built
/// from them at once.
const MAX_POINT_VALUES: usize = 1 << 27;
const MAX_REPS: usize = 100_000;

/// A benchmark's checked formats and shapes.
pub struct BenchPlan {
    pairs: Vec<(FormatSpec, FormatSpec)>,
    shapes: Vec<(usize, usize, usize)>,
}

impl CpuArgs {
    pub fn plan(&self, ctx: &Ctx) -> Result<BenchPlan, ArgError> {
        nonempty("context", &self.context)?;
        nonempty("formats", &self.formats)?;
        nonempty("shapes", &self.shapes)?;
        count("reps", self.reps, 1..=MAX_REPS)?;
        count("ref-reps", self.ref_reps, 0..=MAX_REPS)?;
        count("recent", self.recent, 0..=veloxquant::cache::MAX_WINDOW_TOKENS)?;
        let pairs = self.formats.iter().map(|s| parse_pair(s)).collect::<Result<_, _>>()?;
        let shapes: Vec<_> = self.shapes.iter().map(|s| parse_shape(s)).collect::<Result<_, _>>()?;
        for &n in &self.context {
            count("context", n, 1..=MAX_POINT_VALUES)?;
            for &(_, hkv, d) in &shapes {
                if hkv * d * n > MAX_POINT_VALUES {
                    let why =
                        format!("{hkv} KV heads × {n} tokens × d {d} exceeds {MAX_POINT_VALUES} values per point");
                    return Err(bad("context", n, why));
                }
            }
        }
        crate::check::distinct(&[self.json.as_ref(), self.md.as_ref()])?;
        ctx.output(self.json.as_ref(), OutputKind::Json, &[])?;
        ctx.output(self.md.as_ref(), OutputKind::Markdown, &[])?;
        Ok(BenchPlan { pairs, shapes })
    }
}

/// GB/s of a parallel read (wrapping u64 sum, which vectorizes; an f32 sum would be
/// latency-bound and understate the bandwidth) and of a copy over 512 MiB, best of 5.
pub fn memory_bandwidth() -> (f64, f64) {
    let n = 64 << 20; // u64s
    let src: Vec<u64> = (0..n as u64).collect();
    let mut dst = vec![0u64; n];
    let mut best_read = f64::MAX;
    let mut best_copy = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        let s: u64 = src
            .par_chunks(1 << 16)
            .map(|c| c.iter().fold(0u64, |a, &b| a.wrapping_add(b)))
            .reduce(|| 0, u64::wrapping_add);
        black_box(s);
        best_read = best_read.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        dst.par_chunks_mut(1 << 16).zip(src.par_chunks(1 << 16)).for_each(|(d, s)| d.copy_from_slice(s));
        black_box(&dst);
        best_copy = best_copy.min(t.elapsed().as_secs_f64());
    }
    let bytes = (n * 8) as f64;
    (bytes / best_read / 1e9, bytes / best_copy / 1e9)
}

fn layer_bytes(c: &PagedCache) -> usize {
    let l = c.layer(0).expect("one layer");
    l.keys.iter().chain(&l.values).map(|s| s.pages().iter().map(|p| p.len()).sum::<usize>() + s.tail().len() * 2).sum()
}

fn time_us(f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64() * 1e6
}

pub fn run_cpu(a: &CpuArgs, p: &BenchPlan) -> AnyResult {
    let (pairs, shapes) = (&p.pairs, &p.shapes);
    let (read_bw, copy_bw) = memory_bandwidth();
    let threads = rayon::current_num_threads();
    println!("CPU: {threads} threads; measured read {read_bw:.1} GB/s, copy {copy_bw:.1} GB/s; R = {}", a.recent);
    let fp16 = FormatSpec::parse("fp16")?;
    let mut rows_json = Vec::new();
    let mut rows = Vec::new();
    let pb = progress((shapes.len() * a.context.len()) as u64, "bench cpu");
    for &(hq, hkv, d) in shapes.iter() {
        for &n in &a.context {
            let mut rng = SplitMix64::new((n * d) as u64);
            // Keys with a few outlier channels (as in real models), Gaussian values.
            let k: Vec<f32> =
                (0..hkv * n * d).map(|i| rng.next_gaussian() as f32 * if i % d < 4 { 5.0 } else { 1.0 }).collect();
            let v = rng.gaussian_vec(hkv * n * d);
            let input_bytes = (2 * hkv * n * d * 4) as f64;
            // Calibrated formats (vecinfer) train on other vectors of the same distribution.
            let mut cal = Calibration::new();
            cal.insert_for_all(Stream::Keys, k[..(4096.min(n) * d)].iter().map(|x| x * 0.9).collect());
            cal.insert_for_all(Stream::Values, v[..(4096.min(n) * d)].iter().map(|x| x * 1.1).collect());
            let cal = Arc::new(cal);
            let build = |ks: &FormatSpec, vs: &FormatSpec| -> AnyResult<(PagedCache, f64)> {
                let mut cfg = CacheConfig::new(1, hkv, d, ks.clone(), vs.clone());
                cfg.recent = a.recent;
                cfg.calibration = Some(cal.clone());
                let mut c = PagedCache::new(cfg)?;
                let t = Instant::now();
                c.append(0, &k, &v, n)?;
                Ok((c, t.elapsed().as_secs_f64()))
            };
            let (base, base_enc) = build(&fp16, &fp16)?;
            let caches: Vec<(PagedCache, f64)> =
                pairs.iter().map(|(ks, vs)| build(ks, vs)).collect::<AnyResult<_>>()?;
            let queries: Vec<Vec<f32>> = (0..4).map(|_| rng.gaussian_vec(hq * d)).collect();
            // Warm-up, then interleave: every rep times fp16 and each format once, in rotating order.
            let mut t_base = Vec::new();
            let mut t_fmt = vec![Vec::new(); caches.len()];
            black_box(decode_attention(&base, 0, &queries[0], hq)?);
            for (c, _) in &caches {
                black_box(decode_attention(c, 0, &queries[0], hq)?);
            }
            for r in 0..a.reps {
                let q = &queries[r % queries.len()];
                for j in 0..=caches.len() {
                    let i = (j + r) % (caches.len() + 1);
                    if i == caches.len() {
                        t_base.push(time_us(|| drop(black_box(decode_attention(&base, 0, q, hq)))));
                    } else {
                        t_fmt[i].push(time_us(|| drop(black_box(decode_attention(&caches[i].0, 0, q, hq)))));
                    }
                }
            }
            let (base_med, base_lo, base_hi) = quantiles(&t_base);
            let base_bytes = layer_bytes(&base);
            let mut push =
                |name: String, kb: f64, vb: f64, times: &[f64], bytes: usize, enc_s: f64, ref_us: Option<f64>| {
                    let (med, lo, hi) = quantiles(times);
                    let gbps = bytes as f64 / med / 1e3;
                    rows.push(vec![
                        format!("{hq}/{hkv}/{d}"),
                        n.to_string(),
                        name.clone(),
                        format!("{kb:.2}/{vb:.2}"),
                        format!("{:.1}", bytes as f64 / 1e6),
                        format!("{med:.0} ({lo:.0}–{hi:.0})"),
                        format!("{base_med:.0}"),
                        format!("{:.2}×", base_med / med),
                        ref_us.map_or("–".into(), |r| format!("{r:.0}")),
                        format!("{gbps:.1} ({:.0} %)", 100.0 * gbps / read_bw),
                        format!("{:.2}", input_bytes / enc_s / 1e9),
                    ]);
                    rows_json.push(json!({
                        "format": name, "k_bits": kb, "v_bits": vb, "hq": hq, "hkv": hkv, "d": d, "context": n,
                        "recent": a.recent, "ours_us": med, "ours_p10_us": lo, "ours_p90_us": hi,
                        "fp16_us": base_med, "fp16_p10_us": base_lo, "fp16_p90_us": base_hi,
                        "speedup_vs_fp16": base_med / med, "ref_us": ref_us, "bytes_read": bytes,
                        "gbps": gbps, "read_bw_gbps": read_bw, "copy_bw_gbps": copy_bw,
                        "encode_gbps": input_bytes / enc_s / 1e9, "threads": threads,
                    }));
                };
            let ref_time = |c: &PagedCache| -> AnyResult<Option<f64>> {
                if a.ref_reps == 0 {
                    return Ok(None);
                }
                let mut ts = Vec::new();
                for r in 0..a.ref_reps {
                    let q = &queries[r % queries.len()];
                    let t = Instant::now();
                    black_box(decode_attention_ref(c, 0, q, hq)?);
                    ts.push(t.elapsed().as_secs_f64() * 1e6);
                }
                Ok(Some(quantiles(&ts).0))
            };
            push("fp16".into(), 16.0, 16.0, &t_base, base_bytes, base_enc, ref_time(&base)?);
            for ((c, enc), ((ks, vs), ts)) in caches.iter().zip(pairs.iter().zip(&t_fmt)) {
                let (kb, vb) = c.bits_per_value();
                let name = if ks == vs { ks.to_string() } else { format!("{ks}/{vs}") };
                push(name, kb, vb, ts, layer_bytes(c), *enc, ref_time(c)?);
            }
            pb.inc(1);
        }
    }
    pb.finish_and_clear();
    print_table_to(
        &[
            "Hq/Hkv/d",
            "context",
            "K/V format",
            "bits K/V",
            "MB read",
            "ours µs (p10–p90)",
            "fp16 µs",
            "vs fp16",
            "ref µs",
            "GB/s (% read bw)",
            "encode GB/s",
        ],
        &rows,
        a.md.as_deref(),
    )?;
    if let Some(p) = &a.json {
        write_json(
            p,
            &json!({ "read_bw_gbps": read_bw, "copy_bw_gbps": copy_bw, "threads": threads, "rows": rows_json }),
        )?;
    }
    Ok(())
}
