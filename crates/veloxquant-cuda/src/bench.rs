//! GPU decode-attention and encode benchmarks, behind `veloxquant bench cuda` (CLI feature
//! `cuda`) and the standalone `veloxquant-cuda-bench`:
//!
//!   veloxquant bench cuda run --out ours.json [--iters 100] [--formats f1,f2] [--no-encode]
//!       [--shapes 0,2,ragged,1x32x8x1024]
//!   veloxquant bench cuda report --ours a.json,b.json --peer p.json,q.json --out final.json
//!       [--commit C] [--date D]
//!
//! `run` measures the read bandwidth (probe kernel) and copy bandwidth, encode throughput
//! per format at 2M vectors, and decode time per (shape, format) as the median of CUDA-event
//! timings after warm-up, rotating among up to 16 caches that together hold ≥ 256 MiB (5× an H200's
//! L2; each row records how many and their bytes) so L2 cannot help, three ways: one
//! synchronized step per event pair, ten back-to-back steps, ten steps captured in a CUDA graph
//! and replayed. `--shapes` picks rows of the table (indices, `ragged`) or adds probes (BxHQxHKVxS); the
//! default is every shape and the ragged case (unequal lengths with page tails, sinks, a window).
//! `report` merges rounds of ours and the peer's (peer_sdpa.py, timed the same three ways),
//! taking each side's best median per mode, and prints the table.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::attn::{DecodeOptions, DecodePlan};
use crate::bench_util::{fill_normal_f16, read_probe};
use crate::{GpuCacheConfig, GpuDevice, GpuEncoder, GpuFormat, GpuKvCache, InputKind, Result};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaStream;
use serde_json::{json, Value};
use veloxquant::FormatSpec;

const SHAPES: [(usize, usize, usize, usize); 5] =
    [(1, 32, 8, 32768), (1, 32, 8, 131072), (8, 32, 8, 32768), (32, 32, 8, 8192), (1, 32, 32, 32768)];
/// The ragged case (`--shapes 5` or `ragged`; peer_sdpa.py's RAGGED): eight sequences of unequal
/// lengths, none a whole number of pages, with StreamingLLM's 4 sinks and KIVI's 128-token
/// exact window, as a served batch looks (Hq 32, Hkv 8).
const RAGGED_LENS: [usize; 8] = [32768, 30103, 26001, 20517, 14339, 9001, 4099, 1031];
const RAGGED_SINK: usize = 4;
const RAGGED_RECENT: usize = 128;

/// One decode case: a sequence length per batch entry, Hq query heads over Hkv KV heads, the
/// first `sink` and newest `recent` tokens kept exact.
#[derive(Clone, Debug, PartialEq)]
pub struct Case {
    hq: usize,
    hkv: usize,
    lens: Vec<usize>,
    sink: usize,
    recent: usize,
}

impl Case {
    fn uniform((b, hq, hkv, s): (usize, usize, usize, usize)) -> Self {
        Self { hq, hkv, lens: vec![s; b], sink: 0, recent: 0 }
    }

    fn ragged() -> Self {
        Self { hq: 32, hkv: 8, lens: RAGGED_LENS.to_vec(), sink: RAGGED_SINK, recent: RAGGED_RECENT }
    }

    /// The default rows: SHAPES, then the ragged case.
    fn all() -> Vec<Self> {
        SHAPES.iter().map(|&s| Self::uniform(s)).chain([Self::ragged()]).collect()
    }

    /// The report's key for the case beyond (B, Hq, Hkv, S): "uniform" or "ragged".
    fn name(&self) -> &'static str {
        if self.is_ragged() {
            "ragged"
        } else {
            "uniform"
        }
    }

    fn is_ragged(&self) -> bool {
        self.sink > 0 || self.recent > 0 || self.lens.iter().any(|&l| l != self.lens[0])
    }

    /// One `--shapes` entry: an index into [`Case::all`], `ragged` (or `ragged:S:R`), or a probe
    /// BxHQxHKVxS.
    fn parse(x: &str) -> std::result::Result<Self, String> {
        let all = Self::all();
        if x == "ragged" {
            return Ok(Self::ragged());
        }
        // ragged:S:R — the ragged lengths with S sinks and R recent tokens exact (the exact
        // tokens' share of the step apart from the lengths').
        if let Some(sr) = x.strip_prefix("ragged:") {
            return match sr.split(':').map(str::parse).collect::<std::result::Result<Vec<usize>, _>>().as_deref() {
                Ok(&[sink, recent]) if sink <= 64 && recent <= 4096 => Ok(Self { sink, recent, ..Self::ragged() }),
                _ => Err(format!("bad shape `{x}`: ragged:S:R with S ≤ 64 sinks and R ≤ 4096 recent tokens")),
            };
        }
        if let Ok(i) = x.parse::<usize>() {
            return all.get(i).cloned().ok_or_else(|| format!("no shape {i} (0–{})", all.len() - 1));
        }
        let v = x.split('x').map(str::parse).collect::<std::result::Result<Vec<usize>, _>>();
        match v.as_deref() {
            Ok(&[b, hq, hkv, s]) if b > 0 && hkv > 0 && (1..=256).contains(&hq) && hq % hkv == 0 && b <= 1024 && s > 0 && s <= 1 << 20 => {
                Ok(Self::uniform((b, hq, hkv, s)))
            }
            _ => Err(format!(
                "bad shape `{x}`: an index, `ragged`, or BxHQxHKVxS with B ≤ 1024, Hq ≤ 256, 0 < S ≤ 2^20, Hkv dividing Hq"
            )),
        }
    }
}
const FORMATS: [&str; 6] = ["fp16", "q8_0", "q4_0", "turboquant_mse:4", "turboquant_mse:3", "turboquant_mse:2"];
/// Decode rows beyond FORMATS: `K/V` pairs for key-only formats; the calibrated formats
/// (random calibration vectors: their speed, not their quality).
const KV_PAIRS: [&str; 10] = [
    "qjl/turboquant_mse:2",
    "qjl:2x/turboquant_mse:2",
    "turboquant_prod:3/turboquant_mse:2",
    "rabitq/turboquant_mse:2",
    "turboquant_rvq:2:2/turboquant_mse:2",
    "turboquant_mse:2/turboquant_rvq:2:2",
    "kivi:2",
    "kivi:4",
    "turboquant_frac:3.5:center:eden/turboquant_frac:2.5:center:eden",
    "vecinfer:8",
];
/// Encode rows beyond FORMATS.
const ENCODE_EXTRA: [&str; 10] = [
    "turboquant_mse:4:eden",
    "qjl",
    "qjl:orth",
    "qjl:2x",
    "turboquant_prod:3",
    "rabitq",
    "turboquant_rvq:2:2",
    "kivi:2",
    "turboquant_frac:3.5:center:eden",
    "vecinfer:8",
];

/// Random calibration vectors for both streams (each format instance calibrates on them).
fn random_calibration(seed: u64) -> Arc<veloxquant::Calibration> {
    use veloxquant::format::Stream;
    let mut rng = veloxquant::rng::SplitMix64::new(seed);
    let mut cal = veloxquant::Calibration::new();
    cal.insert_for_all(Stream::Keys, rng.gaussian_vec(256 * D));
    cal.insert_for_all(Stream::Values, rng.gaussian_vec(256 * D));
    Arc::new(cal)
}

/// The benchmark's format for `spec` (one head, seed `seed`): calibrated ones with their
/// state from random calibration vectors.
fn bench_format(spec: &FormatSpec, t: usize, seed: u64) -> Result<GpuFormat> {
    use veloxquant::format::{FormatCtx, Stream};
    if !spec.desc().needs_calibration {
        return GpuFormat::new(spec, D, t, seed);
    }
    let mut ctx = FormatCtx::new(D, t, Stream::Keys, seed);
    ctx.calibration = random_calibration(seed).get(0, 0, Stream::Keys);
    let state = spec.build(&ctx)?.export_state();
    GpuFormat::with_state(spec, D, t, seed, Stream::Keys, Some(&state))
}
const D: usize = 128;

/// The benchmark's device: kernel variants from `VELOXQUANT_DECODE_{STAGES,WARPS,MINB,FUSEQ,
/// EXPFTZ,SLACK,PDL,STREAM,BALANCE,LUT2,LUT1V}`, `VELOXQUANT_ENCODE_{WARPS,LOCKSTEP,MINB,PF,TPR2,
/// FRAC_PAGES,SKETCH_MMA,SKETCH_MMA_2X,SKETCH_WARPS,VQ_PAIRS,WARPS2,MINB2}`, `VELOXQUANT_SMEM_LIMIT` and
/// `VELOXQUANT_PREFILL_WARPS`,
/// PTX kept in `VELOXQUANT_PTX_DIR` (A/B runs of variants; the library reads none of these).
pub fn bench_device() -> Result<Arc<GpuDevice>> {
    let knob = |name: &str, default: i64| -> i64 {
        std::env::var(format!("VELOXQUANT_{name}")).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
    };
    let d = crate::Tuning::default();
    let t = crate::Tuning {
        decode_stages: knob("DECODE_STAGES", d.decode_stages as i64) as usize,
        decode_warps: knob("DECODE_WARPS", d.decode_warps as i64) as usize,
        decode_minb: knob("DECODE_MINB", d.decode_minb),
        decode_fuse_q: knob("DECODE_FUSEQ", d.decode_fuse_q as i64) != 0,
        decode_expftz: knob("DECODE_EXPFTZ", d.decode_expftz as i64) != 0,
        decode_slack: knob("DECODE_SLACK", d.decode_slack),
        decode_pdl: knob("DECODE_PDL", d.decode_pdl as i64) != 0,
        decode_stream: knob("DECODE_STREAM", d.decode_stream as i64) != 0,
        decode_balance: knob("DECODE_BALANCE", d.decode_balance as i64) != 0,
        decode_lut2: knob("DECODE_LUT2", d.decode_lut2 as i64) != 0,
        decode_lut1v: knob("DECODE_LUT1V", d.decode_lut1v as i64) != 0,
        encode_warps: knob("ENCODE_WARPS", d.encode_warps as i64) as usize,
        encode_lockstep: knob("ENCODE_LOCKSTEP", d.encode_lockstep as i64) != 0,
        encode_minb: knob("ENCODE_MINB", d.encode_minb),
        encode_prefetch: knob("ENCODE_PF", d.encode_prefetch as i64) != 0,
        encode_two_per_row: knob("ENCODE_TPR2", d.encode_two_per_row as i64) != 0,
        encode_frac_pages: knob("ENCODE_FRAC_PAGES", d.encode_frac_pages as i64) != 0,
        encode_sketch_mma: knob("ENCODE_SKETCH_MMA", d.encode_sketch_mma as i64) != 0,
        encode_sketch_warps: knob("ENCODE_SKETCH_WARPS", d.encode_sketch_warps as i64) as usize,
        encode_vq_pairs: knob("ENCODE_VQ_PAIRS", d.encode_vq_pairs as i64) != 0,
        encode_sketch_mma_2x: knob("ENCODE_SKETCH_MMA_2X", d.encode_sketch_mma_2x as i64) != 0,
        encode_warps2: knob("ENCODE_WARPS2", d.encode_warps2 as i64) as usize,
        encode_minb2: knob("ENCODE_MINB2", d.encode_minb2),
        prefill_warps: knob("PREFILL_WARPS", d.prefill_warps as i64) as usize,
        smem_limit: knob("SMEM_LIMIT", d.smem_limit as i64).max(0) as usize,
    };
    GpuDevice::new_with(0, t, std::env::var_os("VELOXQUANT_PTX_DIR").map(std::path::PathBuf::from))
}

/// `bench cuda`'s command line.
#[derive(clap::Parser, Debug)]
#[command(name = "bench cuda", about = "GPU decode-attention and encode benchmarks")]
pub struct BenchCli {
    #[command(subcommand)]
    pub cmd: BenchCmd,
}

#[derive(clap::Subcommand, Debug)]
pub enum BenchCmd {
    /// Measure bandwidth, encode and decode; write the rows as JSON.
    Run(RunArgs),
    /// Merge rounds of ours and the peer's into one table (no GPU needed).
    Report(ReportArgs),
    /// REPS launches of one format's encoder on 2M f16 vectors (for profilers).
    Encode {
        #[arg(default_value = "turboquant_mse:4")]
        format: String,
        #[arg(default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100_000))]
        reps: u32,
    },
}

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    #[arg(long, default_value = "ours.json")]
    pub out: std::path::PathBuf,
    /// Timed steps per measurement (≥ 1).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub iters: u32,
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub blocks_per_sm: Option<u32>,
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub min_pages: Option<u32>,
    /// Only these formats (comma-separated specs).
    #[arg(long)]
    pub formats: Option<String>,
    /// Rows of the shape table (indices), `ragged`, or probes BxHQxHKVxS, comma-separated.
    #[arg(long, value_delimiter = ',', value_parser = Case::parse)]
    pub shapes: Option<Vec<Case>>,
    /// The FAST path's grid: auto (by the split-K wave count), split-k or stream.
    #[arg(long, default_value = "auto", value_parser = ["auto", "split-k", "stream"])]
    pub grid: String,
    #[arg(long)]
    pub no_decode: bool,
    #[arg(long)]
    pub no_encode: bool,
}

#[derive(clap::Args, Debug)]
pub struct ReportArgs {
    /// Our `run` outputs (rounds), comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    pub ours: Vec<std::path::PathBuf>,
    /// The peer's outputs (peer_sdpa.py), comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub peer: Vec<std::path::PathBuf>,
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
    #[arg(long, default_value = "")]
    pub date: String,
    #[arg(long, default_value = "")]
    pub commit: String,
}

/// Writes `text` to `path` through a temporary file in the same folder and a rename, so a
/// failed run never leaves a half-written report.
fn write_atomic(path: &std::path::Path, text: &str) -> std::result::Result<(), String> {
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    std::fs::write(&tmp, text).map_err(|e| format!("writing {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        format!("renaming onto {}: {e}", path.display())
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Median over `reps` of the event-timed duration (µs) of `body(r)` on `stream`, divided by
/// `per` (the steps one body runs).
fn event_median(
    dev: &Arc<GpuDevice>,
    stream: &CudaStream,
    reps: usize,
    per: usize,
    mut body: impl FnMut(usize) -> Result<()>,
) -> Result<f64> {
    let ev = || dev.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).expect("event");
    let mut ts = Vec::with_capacity(reps);
    for r in 0..reps {
        let (a, b) = (ev(), ev());
        a.record(stream).expect("record");
        body(r)?;
        b.record(stream).expect("record");
        b.synchronize().expect("sync");
        ts.push(a.elapsed_ms(&b).expect("elapsed") as f64 * 1e3 / per as f64);
    }
    Ok(median(ts))
}

/// Median over `iters` of the event-timed duration (µs) of `f(i)`.
fn time_us(dev: &Arc<GpuDevice>, warm: usize, iters: usize, mut f: impl FnMut(usize) -> Result<()>) -> Result<f64> {
    for i in 0..warm {
        f(i)?;
    }
    dev.synchronize()?;
    event_median(dev, &dev.stream, iters, 1, f)
}

/// Median over `reps` of the event-timed duration (µs) of `steps` back-to-back calls
/// `f(i)`, divided by `steps`: the per-step time when the host runs ahead (as in a model's
/// decode loop), without the launch latency of a synchronized single call.
fn time_us_streamed(
    dev: &Arc<GpuDevice>,
    reps: usize,
    steps: usize,
    mut f: impl FnMut(usize) -> Result<()>,
) -> Result<f64> {
    for i in 0..steps {
        f(i)?;
    }
    dev.synchronize()?;
    event_median(dev, &dev.stream, reps, steps, |r| (0..steps).try_for_each(|i| f(r * steps + i)))
}

/// Per-step time (µs) on the GPU alone: `steps` calls `f(i, stream)` captured once into a
/// CUDA graph on a fresh stream, the graph replayed `reps` times between events (median /
/// steps). No host launch cost is in it, as in an engine that replays a captured decode step.
fn time_us_graph(
    dev: &Arc<GpuDevice>,
    reps: usize,
    steps: usize,
    mut f: impl FnMut(usize, &Arc<CudaStream>) -> Result<()>,
) -> Result<f64> {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    dev.synchronize()?;
    let s = dev.ctx.new_stream().expect("stream");
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).expect("capture");
    for i in 0..steps {
        f(i, &s)?;
    }
    let g = s.end_capture(CUgraphInstantiate_flags(0)).expect("end capture").expect("graph");
    g.upload().expect("upload");
    for _ in 0..3 {
        g.launch().expect("graph launch");
    }
    s.synchronize().expect("sync");
    event_median(dev, &s, reps, steps, |_| {
        g.launch().expect("graph launch");
        Ok(())
    })
}

/// Measured (read, copy) bandwidth in TB/s: the read probe over 1 GiB and a device copy.
pub fn bandwidth(dev: &Arc<GpuDevice>) -> Result<(f64, f64)> {
    let bytes = 2usize << 30;
    let s = dev.stream.clone();
    let buf = s.alloc_zeros::<u8>(bytes).expect("alloc");
    let mut dst = s.alloc_zeros::<u8>(bytes).expect("alloc");
    let mut sink = s.alloc_zeros::<u32>(1).expect("alloc");
    let read_us = time_us(dev, 3, 20, |_| read_probe(dev, &buf, bytes / 16, &mut sink))?;
    let copy_us = time_us(dev, 3, 20, |_| {
        s.memcpy_dtod(&buf, &mut dst).expect("dtod");
        Ok(())
    })?;
    Ok((bytes as f64 / read_us / 1e6, 2.0 * bytes as f64 / copy_us / 1e6))
}

fn encode_rows(dev: &Arc<GpuDevice>, read_tbps: f64, copy_tbps: f64) -> Result<Vec<Value>> {
    let n_vec = 1usize << 21;
    let t = 32;
    let jobs = n_vec / t;
    let s = dev.stream.clone();
    let mut x = s.alloc_zeros::<u16>(n_vec * D).expect("alloc");
    fill_normal_f16(dev, &mut x, n_vec * D, 3)?;
    let pid: Vec<i32> = (0..jobs as i32).collect();
    let hid = vec![0i32; jobs];
    let pid = s.clone_htod(&pid).expect("htod");
    let hid = s.clone_htod(&hid).expect("htod");
    let mut rows = Vec::new();
    for f in FORMATS.iter().chain(ENCODE_EXTRA.iter()) {
        let spec = FormatSpec::parse(f)?;
        let gf = bench_format(&spec, t, 11)?;
        let enc = GpuEncoder::new(dev, &gf, InputKind::F16)?;
        let mut pool = s.alloc_zeros::<u8>(jobs * gf.page_bytes).expect("alloc");
        let (signs, sc) = gf.transform();
        let sd = s.clone_htod(&signs).expect("htod");
        let us = time_us(dev, 3, 20, |_| enc.launch(&x, jobs, &pid, &hid, &mut pool, &sd.slice(..), sc))?;
        // The warp-per-row kernel (bit-identical to the CPU): its time, and whether the pages
        // match byte for byte on these 2M f16 vectors.
        let (mut us_warp, mut mismatched_pages) = (us, 0usize);
        if enc.thread_per_row() {
            let mut legacy = GpuEncoder::new(dev, &gf, InputKind::F16)?;
            legacy.force_warp_per_row();
            let mut pool2 = s.alloc_zeros::<u8>(jobs * gf.page_bytes).expect("alloc");
            us_warp = time_us(dev, 3, 20, |_| legacy.launch(&x, jobs, &pid, &hid, &mut pool2, &sd.slice(..), sc))?;
            let a = s.clone_dtoh(&pool).expect("dtoh");
            let b = s.clone_dtoh(&pool2).expect("dtoh");
            mismatched_pages =
                a.chunks_exact(gf.page_bytes).zip(b.chunks_exact(gf.page_bytes)).filter(|(p, q)| p != q).count();
        }
        let in_bytes = (n_vec * D * 2) as f64;
        let out_bytes = (jobs * gf.page_bytes) as f64;
        let moved = (in_bytes + out_bytes) / us / 1e6;
        rows.push(json!({
            "format": f, "vectors": n_vec, "d": D, "input": "f16", "us": us,
            "input_gbps": in_bytes / us / 1e3, "moved_tbps": moved,
            "bw_fraction": moved / copy_tbps, "read_bw_fraction_input": (in_bytes / us / 1e6) / read_tbps,
            "thread_per_row": enc.thread_per_row(), "kernel": enc.kernel(), "us_warp_per_row": us_warp,
            "pages_differing_from_warp_per_row": mismatched_pages,
        }));
        eprintln!(
            "encode {f:>22}: {us:8.1} µs  {:7.1} GB/s input  {:.2} of copy bw  [{}] (warp-per-row {us_warp:.1} µs, {mismatched_pages} pages differ)",
            in_bytes / us / 1e3,
            moved / copy_tbps,
            enc.kernel()
        );
    }
    Ok(rows)
}

/// `encode FORMAT [REPS]`: REPS launches of the encoder on 2M f16 vectors (for profilers).
fn encode_only(f: &str, reps: usize) -> Result<()> {
    let dev = bench_device()?;
    let (n_vec, t) = (1usize << 21, 32);
    let jobs = n_vec / t;
    let s = dev.stream.clone();
    let mut x = s.alloc_zeros::<u16>(n_vec * D).expect("alloc");
    fill_normal_f16(&dev, &mut x, n_vec * D, 3)?;
    let pid = s.clone_htod(&(0..jobs as i32).collect::<Vec<_>>()).expect("htod");
    let hid = s.clone_htod(&vec![0i32; jobs]).expect("htod");
    let gf = bench_format(&FormatSpec::parse(f)?, t, 11)?;
    let enc = GpuEncoder::new(&dev, &gf, InputKind::F16)?;
    let mut pool = s.alloc_zeros::<u8>(jobs * gf.page_bytes).expect("alloc");
    let (signs, sc) = gf.transform();
    let sd = s.clone_htod(&signs).expect("htod");
    let us = time_us(&dev, 1, reps, |_| enc.launch(&x, jobs, &pid, &hid, &mut pool, &sd.slice(..), sc))?;
    eprintln!("encode {f}: {us:.1} µs (median of {reps}) [{}]", enc.kernel());
    Ok(())
}

fn decode_rows(
    dev: &Arc<GpuDevice>,
    iters: usize,
    read_tbps: f64,
    opts: DecodeOptions,
    only: Option<&str>,
    cases: &[Case],
) -> Result<Vec<Value>> {
    let mut rows = Vec::new();
    for case in cases {
        let (b, hq, hkv) = (case.lens.len(), case.hq, case.hkv);
        let sl = case.lens.iter().copied().max().unwrap_or(0);
        let total: usize = case.lens.iter().sum();
        for f in FORMATS.iter().chain(KV_PAIRS.iter()).copied() {
            if only.is_some_and(|o| !o.split(',').any(|x| x == f)) {
                continue;
            }
            let (kname, vname) = f.split_once('/').unwrap_or((f, f));
            let (kspec, vspec) = (FormatSpec::parse(kname)?, FormatSpec::parse(vname)?);
            let mut cpu = veloxquant::CacheConfig::new(1, hkv, D, kspec.clone(), vspec.clone());
            cpu.encode_rows = true;
            cpu.sink = case.sink;
            cpu.recent = case.recent;
            if kspec.desc().needs_calibration || vspec.desc().needs_calibration {
                cpu.calibration = Some(random_calibration(7));
            }
            let cfg = GpuCacheConfig::from_cpu(&cpu, b, sl, total);
            let kf = GpuFormat::for_stream(&kspec, D, 32, 1, veloxquant::format::Stream::Keys)?;
            let vf = GpuFormat::for_stream(&vspec, D, 32, 1, veloxquant::format::Stream::Values)?;
            let bytes_one: usize =
                case.lens.iter().map(|&l| hkv * (l.div_ceil(32) * (kf.page_bytes + vf.page_bytes))).sum();
            // Enough caches that a rotation reads ≥ 256 MiB (5× the H200's 50 MB L2, so no
            // step finds the last one's bytes there); at most 16 (the smallest cache here,
            // 2-bit at B = 1, S = 32k, is 18 MB).
            let n_sets = (256usize << 20).div_ceil(bytes_one).clamp(1, 16);
            let mut caches = Vec::new();
            let mut plans = Vec::new();
            let slots: Vec<usize> = (0..b).collect();
            for i in 0..n_sets {
                let mut c = GpuKvCache::new(dev, cfg.clone())?;
                c.fill_random(&case.lens, 100 + i as u64)?;
                let mut p = DecodePlan::new(&c, hq, b, c.max_pages(&slots), opts)?;
                let mut qd = dev.stream.alloc_zeros::<u16>(b * hq * D).expect("alloc");
                fill_normal_f16(dev, &mut qd, b * hq * D, 5 + i as u64)?;
                let qh: Vec<f32> = dev
                    .stream
                    .clone_dtoh(&qd)
                    .expect("dtoh")
                    .into_iter()
                    .map(|h| half::f16::from_bits(h).to_f32())
                    .collect();
                dev.stream.memcpy_htod(&qh, &mut p.q).expect("htod");
                caches.push(c);
                plans.push(p);
            }
            let us = time_us(dev, 10, iters, |i| {
                let k = i % n_sets;
                plans[k].run(&caches[k])
            })?;
            let stream_us = time_us_streamed(dev, iters, 10, |i| {
                let k = i % n_sets;
                plans[k].run(&caches[k])
            })?;
            let graph_us = time_us_graph(dev, iters, 10, |i, st| {
                let k = i % n_sets;
                plans[k].run_on_stream(&caches[k], st)
            })?;
            let out: Vec<f32> = dev.stream.clone_dtoh(&plans[0].out).expect("dtoh");
            let finite = out.iter().all(|v| v.is_finite());
            let bytes = caches[0].bytes_read(&slots) as f64;
            let tbps = bytes / us / 1e6;
            let label = if case.is_ragged() { format!("≤{sl} ragged") } else { sl.to_string() };
            eprintln!(
                "decode B={b:>2} Hq={hq} Hkv={hkv} S={label:>6} {f:>18}: {us:8.1} µs {tbps:5.2} TB/s ({:.2} of read bw) streamed {stream_us:7.1} µs graph {graph_us:7.1} µs {:?} splits={} finite={finite}",
                tbps / read_tbps,
                plans[0].grid(),
                plans[0].n_splits
            );
            rows.push(json!({
                "b": b, "hq": hq, "hkv": hkv, "d": D, "s": sl, "format": f, "case": case.name(),
                "lens": case.lens, "sink": case.sink, "recent": case.recent,
                "k_bits": kf.bits_per_value(), "v_bits": vf.bits_per_value(),
                "ours_us": us, "ours_stream_us": stream_us, "ours_graph_us": graph_us, "bytes": bytes, "tbps": tbps, "bw_fraction": tbps / read_tbps,
                "n_splits": plans[0].n_splits, "grid": format!("{:?}", plans[0].grid()), "dealt": plans[0].deals_blocks(&caches[0]), "finite": finite, "rotated_caches": n_sets,
                "rotated_bytes": n_sets * bytes_one,
            }));
        }
    }
    Ok(rows)
}

fn run(a: &RunArgs) -> std::result::Result<(), String> {
    let cases = a.shapes.clone().unwrap_or_else(Case::all);
    let v = run_gpu(a, &cases).map_err(|e| e.to_string())?;
    write_atomic(&a.out, &serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?)
}

fn run_gpu(a: &RunArgs, cases: &[Case]) -> Result<Value> {
    let iters = a.iters as usize;
    let mut opts = DecodeOptions::default();
    if let Some(v) = a.blocks_per_sm {
        opts.blocks_per_sm = v as usize;
    }
    if let Some(v) = a.min_pages {
        opts.min_pages_per_split = v as usize;
    }
    opts.grid = match a.grid.as_str() {
        "split-k" => crate::attn::DecodeGrid::SplitK,
        "stream" => crate::attn::DecodeGrid::Stream,
        _ => crate::attn::DecodeGrid::Auto,
    };
    let dev = bench_device()?;
    eprintln!("device: {dev:?}, {} SMs", dev.sm_count);
    let (read_tbps, copy_tbps) = bandwidth(&dev)?;
    eprintln!("read probe {read_tbps:.2} TB/s, device copy {copy_tbps:.2} TB/s (read+write)");
    let decode =
        if a.no_decode { vec![] } else { decode_rows(&dev, iters, read_tbps, opts, a.formats.as_deref(), cases)? };
    let encode = if a.no_encode { vec![] } else { encode_rows(&dev, read_tbps, copy_tbps)? };
    Ok(json!({
        "device": dev.name, "sm_count": dev.sm_count, "read_tbps": read_tbps, "copy_tbps": copy_tbps,
        "iters": iters, "decode": decode, "encode": encode,
    }))
}

fn load(paths: &[std::path::PathBuf]) -> std::result::Result<Vec<Value>, String> {
    paths
        .iter()
        .map(|p| {
            let text = std::fs::read_to_string(p).map_err(|e| format!("reading {}: {e}", p.display()))?;
            serde_json::from_str(&text).map_err(|e| format!("{} is not JSON: {e}", p.display()))
        })
        .collect()
}

/// A number a row must have (a report from another program or version is refused).
fn num(r: &Value, key: &str) -> std::result::Result<f64, String> {
    r[key].as_f64().ok_or_else(|| format!("a decode row has no number `{key}`: {r}"))
}

/// The table's S column: the length, or for the ragged case its longest, sinks and window.
fn s_label(r: &Value) -> String {
    match r["case"].as_str() {
        Some("ragged") => format!(
            "ragged ≤ {} (Σ {}, {} sinks, {} recent)",
            r["s"],
            r["lens"].as_array().map_or(0, |l| l.iter().filter_map(Value::as_u64).sum::<u64>()),
            r["sink"],
            r["recent"]
        ),
        _ => r["s"].to_string(),
    }
}

fn report(a: &ReportArgs) -> std::result::Result<(), String> {
    let ours = load(&a.ours)?;
    let peers = load(&a.peer)?;
    // Rows from before the ragged case have no `case`: they are uniform.
    let key = |r: &Value| {
        format!("{}-{}-{}-{}-{}", r["b"], r["hq"], r["hkv"], r["s"], r["case"].as_str().unwrap_or("uniform"))
    };
    // Per shape and timing mode, the peer's best median over rounds (and its backend).
    let mut peer_best: BTreeMap<(String, &str), (f64, String)> = BTreeMap::new();
    for p in &peers {
        for r in p["rows"].as_array().into_iter().flatten() {
            for (mode, us_key, be_key) in
                [("single", "peer_us", "backend"), ("graph", "peer_graph_us", "graph_backend")]
            {
                let us = r[us_key].as_f64().unwrap_or(f64::INFINITY);
                let e = peer_best.entry((key(r), mode)).or_insert((f64::INFINITY, String::new()));
                if us < e.0 {
                    *e = (us, r[be_key].as_str().unwrap_or("").to_string());
                }
            }
        }
    }
    let read_tbps = ours.iter().map(|o| o["read_tbps"].as_f64().unwrap_or(0.0)).fold(0.0, f64::max);
    // Per (shape, format), our best median over rounds in each timing mode.
    let mut best: BTreeMap<(String, String), (Value, f64, f64)> = BTreeMap::new();
    let mut order = Vec::new();
    for o in &ours {
        for r in o["decode"].as_array().into_iter().flatten() {
            // The exact window apart too (ragged:S:R rounds share the peer's ragged row).
            let k = (key(r), format!("{}|{}|{}", r["format"].as_str().unwrap_or(""), r["sink"], r["recent"]));
            let us = r["ours_us"].as_f64().unwrap_or(f64::INFINITY);
            let gus = r["ours_graph_us"].as_f64().unwrap_or(f64::INFINITY);
            let e = best.entry(k.clone()).or_insert_with(|| {
                order.push(k.clone());
                (r.clone(), f64::INFINITY, f64::INFINITY)
            });
            if us < e.1 {
                e.0 = r.clone();
                e.1 = us;
            }
            e.2 = e.2.min(gus);
        }
    }
    let mut rows = Vec::new();
    println!(
        "| B | Hq | Hkv | d | S | format | bits/value K/V | ours µs | peer µs (backend) | speedup | TB/s read | of read bw | ours µs graph | peer µs graph | speedup graph | of read bw graph |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for k in &order {
        let (r, us, gus) = &best[k];
        let (us, gus) = (*us, *gus);
        let (peer_us, backend) = peer_best.get(&(k.0.clone(), "single")).cloned().unwrap_or((f64::NAN, "-".into()));
        let (peer_gus, gbackend) = peer_best.get(&(k.0.clone(), "graph")).cloned().unwrap_or((f64::NAN, "-".into()));
        let bytes = num(r, "bytes")?;
        let tbps = bytes / us / 1e6;
        let gtbps = bytes / gus / 1e6;
        let row = json!({
            "b": r["b"], "hq": r["hq"], "hkv": r["hkv"], "d": r["d"], "s": r["s"], "format": r["format"],
            "case": r["case"], "lens": r["lens"], "sink": r["sink"], "recent": r["recent"],
            "k_bits": r["k_bits"], "v_bits": r["v_bits"], "ours_us": us, "peer_us": peer_us,
            "peer_backend": backend, "speedup": peer_us / us, "tbps": tbps, "bw_fraction": tbps / read_tbps,
            "ours_graph_us": gus, "peer_graph_us": peer_gus, "peer_graph_backend": gbackend,
            "speedup_graph": peer_gus / gus, "tbps_graph": gtbps, "bw_fraction_graph": gtbps / read_tbps,
        });
        println!(
            "| {} | {} | {} | {} | {} | {} | {:.3}/{:.3} | {:.1} | {:.1} ({}) | {:.2}× | {:.2} | {:.0} % | {:.1} | {:.1} | {:.2}× | {:.0} % |",
            r["b"],
            r["hq"],
            r["hkv"],
            r["d"],
            s_label(r),
            r["format"].as_str().ok_or_else(|| format!("a decode row has no format: {r}"))?,
            num(r, "k_bits")?,
            num(r, "v_bits")?,
            us,
            peer_us,
            backend,
            peer_us / us,
            tbps,
            100.0 * tbps / read_tbps,
            gus,
            peer_gus,
            peer_gus / gus,
            100.0 * gtbps / read_tbps
        );
        rows.push(row);
    }
    let enc = ours.first().map(|o| o["encode"].clone()).unwrap_or(Value::Null);
    if let Some(list) = enc.as_array() {
        println!(
            "\n| encode format (2M vectors, d=128, f16 in) | kernel | µs | GB/s input | of copy bw (in+out) | warp-per-row µs | pages ≠ warp-per-row |"
        );
        println!("|---|---|---|---|---|---|---|");
        for e in list {
            let kernel = e["kernel"].as_str().unwrap_or("warp/row");
            println!(
                "| {} | {} | {:.1} | {:.0} | {:.0} % | {:.1} | {} |",
                e["format"].as_str().unwrap_or(""),
                kernel,
                e["us"].as_f64().unwrap_or(0.0),
                e["input_gbps"].as_f64().unwrap_or(0.0),
                100.0 * e["bw_fraction"].as_f64().unwrap_or(0.0),
                e["us_warp_per_row"].as_f64().unwrap_or(0.0),
                e["pages_differing_from_warp_per_row"].as_u64().unwrap_or(0)
            );
        }
    }
    let v = json!({
        "device": ours.first().map(|o| o["device"].clone()).unwrap_or(Value::Null),
        "date": a.date,
        "commit": a.commit,
        "read_tbps": read_tbps,
        "copy_tbps": ours.first().map(|o| o["copy_tbps"].clone()).unwrap_or(Value::Null),
        "peer": "torch.nn.functional.scaled_dot_product_attention, bf16 K/V, fastest of flash and cuDNN",
        "rows": rows,
        "encode": enc,
    });
    if let Some(p) = &a.out {
        write_atomic(p, &serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?)?;
    }
    Ok(())
}

/// Entry point: `args[0]` is the program name, then a subcommand ([`BenchCli`]). Returns the
/// process exit code: 0, 1 for a failed run, 2 for a bad command line (clap's message).
pub fn main_with_args(args: &[String]) -> i32 {
    use clap::Parser;
    let cli = match BenchCli::try_parse_from(args) {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { 2 } else { 0 };
        }
    };
    let res = match &cli.cmd {
        BenchCmd::Run(a) => run(a),
        BenchCmd::Report(a) => report(a),
        BenchCmd::Encode { format, reps } => encode_only(format, *reps as usize).map_err(|e| e.to_string()),
    };
    match res {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}
