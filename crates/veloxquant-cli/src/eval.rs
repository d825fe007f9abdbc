//! `veloxquant eval`: perplexity in llama.cpp's `llama-perplexity` protocol for the fp16 cache
//! and each method on the same windows, with llama-perplexity's `--kl-divergence` report
//! against fp16 (PPL ratio, KL mean ± err and its order statistics, same top token, RMS Δp;
//! `veloxquant_llm::report`), resident bits per value (everything counted at the evaluated
//! context) and speed. `--kl-base FILE` saves the fp16 log-probs once and reuses them.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::json;
use veloxquant_llm::kl_base::{KlBaseHeader, KlBaseReader, KlBaseWriter};
use veloxquant_llm::report::{compare_report, Base, KlReport};
use veloxquant_llm::{calibrate, KvStore, StoreFactory};

use crate::check::{bad, methods, ArgError, Ctx};
use crate::files::{check_input, read_bounded, OutputKind, MAX_TEXT_BYTES};
use crate::model::{default_text, load, Method, ModelArgs};
use crate::plot::{scatter_svg, Series};
use crate::util::{print_table_to, progress, write_json, AnyResult};

/// llama.cpp's own KV-cache types on this model, text, n_ctx 512 and 80 windows
/// (shared/REFERENCE.md §10): (type, bits/value, ΔPPL %). Plotted as the published peer run.
const LLAMA_CPP_512: [(&str, f64, f64); 7] = [
    ("q8_0", 8.5, 0.03),
    ("K q8_0 / V q4_0", 6.5, 0.15),
    ("q5_0", 5.5, 1.02),
    ("q4_1", 5.0, 3.49),
    ("iq4_nl", 4.5, 3.57),
    ("q4_0 (rotated)", 4.5, 4.03),
    ("q4_0 (no rotation)", 4.5, 17.8),
];

pub const DEFAULT_METHODS: &str = "q8_0:rot,q8_0:rot/q4_0:rot,q4_0:rot,q4_0,turboquant_mse:4,turboquant_mse:4:eden,turboquant_mse:4:eden/turboquant_mse:3,turboquant_mse:4:eden/turboquant_mse:2,turboquant_mse:3:eden,turboquant_mse:3:eden/turboquant_mse:2,turboquant_mse:4:eden/turboquant_mse:3@16";

#[derive(clap::Args)]
pub struct EvalArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    /// Text to score (default: ../shared/data/wikitext-2-raw-test.txt when present).
    #[arg(long)]
    pub(crate) text: Option<PathBuf>,
    /// Window size n_ctx; the second half of each window is scored.
    #[arg(long, default_value_t = 512)]
    pub(crate) ctx: usize,
    /// Windows to evaluate (0 = all the text holds).
    #[arg(long, default_value_t = 80)]
    pub(crate) windows: usize,
    /// Methods `fp16` or `KSPEC[/VSPEC][@R]`, comma-separated (fp16 is always the reference).
    #[arg(long, value_delimiter = ',', default_value = DEFAULT_METHODS)]
    pub(crate) methods: Vec<String>,
    /// Calibration tokens for calibrated formats, taken after the evaluated windows.
    #[arg(long, default_value_t = 2048)]
    calib_tokens: usize,
    #[arg(long)]
    pub(crate) json: Option<PathBuf>,
    /// SVG: ΔPPL vs bits/value (K and V averaged), with llama.cpp's published peers.
    #[arg(long)]
    plot: Option<PathBuf>,
    #[arg(long)]
    pub(crate) md: Option<PathBuf>,
    /// Where the model runs (cuda: builds with `--features cuda`).
    #[arg(long, value_enum, default_value_t = crate::gpu::Device::Cpu)]
    pub(crate) device: crate::gpu::Device,
    /// Windows per batched prefill on the GPU.
    #[arg(long, default_value_t = 16)]
    pub(crate) batch: usize,
    /// fp16 log-probs of the windows: read from FILE when it was written for these windows,
    /// else computed and saved there (llama-perplexity's `--kl-divergence-base`).
    #[arg(long)]
    kl_base: Option<PathBuf>,
    /// Merge earlier `--json` outputs of the same windows and fp16 base (e.g. one method per
    /// process on a many-core host, all reading one `--kl-base`) into one table, JSON and
    /// plot; nothing is run.
    #[arg(long, value_delimiter = ',')]
    pub(crate) merge: Vec<PathBuf>,
}

/// Checked `eval` arguments: the methods (fp16, always the reference, and duplicates
/// dropped) and the text file.
pub struct EvalPlan {
    pub(crate) methods: Vec<Method>,
    pub(crate) text: PathBuf,
}

impl EvalArgs {
    /// Windows of 4..=n_ctx tokens, methods whose R and S fit the context, calibration within
    /// it, a regular text file of bounded size, outputs that may be written.
    pub fn plan(&self, ctx: &Ctx) -> Result<EvalPlan, ArgError> {
        if !self.merge.is_empty() {
            crate::check::merge_plan(&self.merge, [self.json.as_ref(), self.md.as_ref(), self.plot.as_ref()], ctx)?;
            return Ok(EvalPlan { methods: Vec::new(), text: PathBuf::new() });
        }
        ctx.within_context("ctx", self.ctx, 4, 0)?;
        crate::check::count("batch", self.batch, 1..=1024)?;
        // R and S beyond a window are valid (the window stays exact): bounded by the model.
        let methods = methods("methods", &self.methods, ctx.n_ctx(), true, true)?;
        if methods.iter().any(Method::needs_calibration) {
            ctx.within_context("calib-tokens", self.calib_tokens, 64, 0)?;
        }
        let text = self.text.clone().or_else(default_text).ok_or_else(|| {
            bad("text", "(none)", "no --text given and ../shared/data/wikitext-2-raw-test.txt not found")
        })?;
        let len = check_input(&text, "text")?;
        if len > MAX_TEXT_BYTES {
            return Err(bad("text", text.display(), format!("{len} B, more than {MAX_TEXT_BYTES} B")));
        }
        crate::check::distinct(&[self.json.as_ref(), self.plot.as_ref(), self.md.as_ref()])?;
        ctx.output(self.json.as_ref(), OutputKind::Json, &[&text])?;
        ctx.output(self.plot.as_ref(), OutputKind::Svg, &[&text])?;
        ctx.output(self.md.as_ref(), OutputKind::Markdown, &[&text])?;
        Ok(EvalPlan { methods, text })
    }
}

pub fn run(a: &EvalArgs, p: &EvalPlan, model_path: &Path) -> AnyResult {
    if a.device == crate::gpu::Device::Cuda {
        return crate::gpu::eval(a);
    }
    let (methods, text_path) = (&p.methods, &p.text);
    let bytes = read_bounded(text_path, "text", MAX_TEXT_BYTES)?;
    let text = String::from_utf8_lossy(&bytes);
    let (model, tok) = load(model_path)?;
    let c = model.config.clone();
    let tokens = tok.encode(&text)?;
    let n_windows = veloxquant_llm::eval::WindowPlan::for_model(&model, tokens.len(), a.ctx, a.windows)
        .map_err(|e| format!("{}: {e}", text_path.display()))?
        .n_windows;
    // Calibrated formats learn from text that is never scored: right after the windows.
    let cal = if methods.iter().any(Method::needs_calibration) {
        let from = n_windows * a.ctx;
        let calib = tokens.get(from..from.saturating_add(a.calib_tokens).min(tokens.len())).unwrap_or(&[]);
        if calib.len() < 64 {
            return Err("no text left after the evaluated windows to calibrate on: use fewer --windows".into());
        }
        eprintln!("calibrating on {} tokens after the evaluated windows", calib.len());
        Some(Arc::new(calibrate(&model, calib)?))
    } else {
        None
    };
    eprintln!("{} tokens; {n_windows} windows of {}; {} methods + fp16", tokens.len(), a.ctx, methods.len());
    let reference = |n: usize| Method::Fp16.store(&c, n, None);
    let mut ref_f = || -> veloxquant_llm::Result<Box<dyn KvStore>> { reference(a.ctx).map_err(backend) };
    let header = KlBaseHeader {
        n_ctx: a.ctx as u32,
        n_windows: n_windows as u32,
        first: (a.ctx / 2) as u32,
        n_vocab: c.n_vocab as u32,
        scored: (a.ctx - 1 - a.ctx / 2) as u32,
        tokens_hash: KlBaseHeader::hash_tokens(&tokens[..n_windows * a.ctx], tok.add_bos),
    };
    let base = match &a.kl_base {
        Some(p) if p.exists() => {
            eprintln!("fp16 log-probs from {}", p.display());
            Base::File(KlBaseReader::open(p, header)?)
        }
        Some(p) => Base::Run(&mut ref_f, Some(KlBaseWriter::create(p, header)?)),
        None => Base::Run(&mut ref_f, None),
    };
    let mut factories: Vec<Box<StoreFactory>> = methods
        .iter()
        .map(|m| {
            let (m, c, cal, n) = (m.clone(), c.clone(), cal.clone(), a.ctx);
            Box::new(move || m.store(&c, n, cal.as_ref()).map_err(backend)) as Box<dyn FnMut() -> _>
        })
        .collect();
    let mut cands: Vec<&mut StoreFactory> = factories.iter_mut().map(|f| f.as_mut() as &mut StoreFactory).collect();
    let pb = progress(n_windows as u64, "windows");
    let (base, reports) = compare_report(&model, &tokens, a.ctx, n_windows, tok.add_bos, base, &mut cands, &mut |w| {
        pb.set_position(w as u64)
    })?;
    pb.finish_and_clear();
    if let Some(p) = a.kl_base.as_ref().filter(|p| p.exists()) {
        eprintln!("fp16 log-probs in {}", p.display());
    }

    let held = a.ctx - 1; // tokens a window's cache holds at its end
    let fp16_bits = Method::Fp16.resident_bits(&c, held, None)?;
    let exact = KlReport {
        ppl: base.ppl,
        ppl_stderr: base.ppl_stderr,
        ppl_ratio: 1.0,
        same_top_pct: 100.0,
        ..Default::default()
    };
    let mut out = Vec::new();
    let mut push = |m: &Method, bits: (f64, f64, usize), r: &KlReport, tps: Option<f64>| {
        let mut row =
            json!({"n_ctx": a.ctx, "n_windows": n_windows, "ppl_base": base.ppl, "ppl_base_stderr": base.ppl_stderr});
        if let (Some(o), serde_json::Value::Object(e)) = (row.as_object_mut(), result_json(m, bits, r, tps, held)) {
            o.extend(e);
        }
        out.push(row);
    };
    push(&Method::Fp16, fp16_bits, &exact, base.tokens_per_s);
    for (m, r) in methods.iter().zip(&reports) {
        push(m, m.resident_bits(&c, held, cal.as_ref())?, &r.report, Some(r.tokens_per_s));
    }
    report(a, &text_path.display().to_string(), &out)
}

/// `eval --merge`: the fp16 row once, then every method once, all from the same windows and
/// fp16 base (checked: n_ctx, windows and the base's PPL equal in every row).
pub fn merge(a: &EvalArgs) -> AnyResult {
    let mut out: Vec<serde_json::Value> = Vec::new();
    let key = |r: &serde_json::Value| (r["n_ctx"].clone(), r["n_windows"].clone(), r["ppl_base"].clone());
    for r in crate::util::read_json_rows(&a.merge)? {
        if r["method"].as_str().is_none() || r["n_ctx"].as_u64().is_none() {
            return Err("eval --merge: a row without method or n_ctx (not an eval --json output)".into());
        }
        if let Some(first) = out.first().filter(|f| key(f) != key(&r)) {
            return Err(format!(
                "eval --merge: {} was run on other windows or another fp16 base than {} (n_ctx, windows, base PPL)",
                r["method"], first["method"]
            )
            .into());
        }
        if !out.iter().any(|o| o["method"] == r["method"]) {
            out.push(r);
        }
    }
    // The fp16 reference first, as a run prints it.
    out.sort_by_key(|r| r["method"] != "fp16");
    let names: Vec<String> = a.merge.iter().map(|p| p.display().to_string()).collect();
    report(a, &format!("merged from {}", names.join(", ")), &out)
}

/// The table, JSON and plot of eval rows (fp16 first): printed and written the same for a
/// run and a merge.
fn report(a: &EvalArgs, source: &str, out: &[serde_json::Value]) -> AnyResult {
    let (ctx, n_windows) = (out[0]["n_ctx"].as_u64().unwrap_or(0), out[0]["n_windows"].as_u64().unwrap_or(0));
    println!("{source} · n_ctx {ctx} · {n_windows} windows · second half of each window scored (llama-perplexity protocol)\n");
    let rows: Vec<Vec<String>> = out.iter().map(table_row).collect();
    print_table_to(&HEADER, &rows, a.md.as_deref())?;
    if let Some(p) = &a.json {
        write_json(p, &serde_json::Value::Array(out.to_vec()))?;
    }
    if let Some(p) = &a.plot {
        frontier_plot(p, out, ctx as usize)?;
    }
    Ok(())
}

const HEADER: [&str; 16] = [
    "method",
    "K bits/value",
    "V bits/value",
    "R",
    "KV bytes/token",
    "PPL",
    "ΔPPL",
    "PPL ratio",
    "KL",
    "KL median",
    "KL p99",
    "KL p99.9",
    "KL max",
    "same top %",
    "RMS Δp %",
    "tokens/s",
];

/// One method's JSON object (tokens/s: evaluated tokens per second of this method's
/// windows, on a shared machine; null for an fp16 base read from `--kl-base`).
fn result_json(
    m: &Method,
    (kb, vb, bytes): (f64, f64, usize),
    r: &KlReport,
    tps: Option<f64>,
    held: usize,
) -> serde_json::Value {
    let per_layer = match m {
        Method::PerLayer { layers, .. } => Some(crate::per_layer::compact(layers)),
        _ => None,
    };
    json!({
        "method": m.to_string(), "k_bits": kb, "v_bits": vb, "window": m.recent(),
        "bytes_per_token": bytes as f64 / held as f64, "per_layer": per_layer,
        "ppl": r.ppl, "ppl_stderr": r.ppl_stderr, "delta_ppl_pct": r.delta_ppl_pct,
        "delta_ppl_stderr": r.delta_ppl_pct_stderr, "ppl_ratio": r.ppl_ratio, "ppl_ratio_stderr": r.ppl_ratio_stderr,
        "kl": r.kl_mean, "kl_stderr": r.kl_stderr, "kl_median": r.kl_median, "kl_p99": r.kl_p99,
        "kl_p999": r.kl_p999, "kl_max": r.kl_max, "top1": r.same_top_pct / 100.0, "same_top_pct": r.same_top_pct,
        "same_top_stderr": r.same_top_stderr, "rms_dp": r.rms_dp, "rms_dp_stderr": r.rms_dp_stderr,
        "tokens_per_s": tps,
    })
}

/// A JSON row as a table row ("–" for a missing number: tokens/s of an fp16 base read back).
fn table_row(j: &serde_json::Value) -> Vec<String> {
    let f = |k: &str| j[k].as_f64().unwrap_or(f64::NAN);
    vec![
        j["method"].as_str().unwrap_or_default().replace('|', "\\|"), // per-layer lists: a Markdown cell
        format!("{:.2}", f("k_bits")),
        format!("{:.2}", f("v_bits")),
        j["window"].as_u64().unwrap_or(0).to_string(),
        format!("{:.0}", f("bytes_per_token")),
        format!("{:.4} ± {:.3}", f("ppl"), f("ppl_stderr")),
        format!("{:+.2} ± {:.2} %", f("delta_ppl_pct"), f("delta_ppl_stderr")),
        format!("{:.4} ± {:.4}", f("ppl_ratio"), f("ppl_ratio_stderr")),
        format!("{:.5} ± {:.5}", f("kl"), f("kl_stderr")),
        format!("{:.5}", f("kl_median")),
        format!("{:.4}", f("kl_p99")),
        format!("{:.4}", f("kl_p999")),
        format!("{:.3}", f("kl_max")),
        format!("{:.2} ± {:.2}", f("same_top_pct"), f("same_top_stderr")),
        format!("{:.3} ± {:.3}", f("rms_dp"), f("rms_dp_stderr")),
        j["tokens_per_s"].as_f64().map_or("–".into(), |t| format!("{t:.0}")),
    ]
}

/// ΔPPL vs bits/value with ± error bars; at n_ctx 512, llama.cpp's own cache types as
/// llama-perplexity measured them on this model and text (REFERENCE.md §10).
fn frontier_plot(p: &std::path::Path, out: &[serde_json::Value], ctx: usize) -> AnyResult {
    let mut series: Vec<Series> = Vec::new();
    for r in out.iter().skip(1) {
        let name = r["method"].as_str().unwrap_or_default();
        let family = if !r["per_layer"].is_null() {
            "ours: per-layer (veloxquant allocate)"
        } else if name.starts_with("turboquant_frac") {
            "ours: turboquant_frac (fractional, calibrated)"
        } else if name.starts_with("turboquant") {
            "ours: turboquant_mse"
        } else if name.starts_with("q8_0") || name.starts_with("q4_0") {
            "ours: llama.cpp-style q8_0/q4_0"
        } else {
            "ours: other seed methods"
        };
        let x = (r["k_bits"].as_f64().unwrap_or(0.0) + r["v_bits"].as_f64().unwrap_or(0.0)) / 2.0;
        let (y, e) = (r["delta_ppl_pct"].as_f64().unwrap_or(0.0), r["delta_ppl_stderr"].as_f64().unwrap_or(0.0));
        if y > 25.0 {
            continue; // off the useful range (e.g. q4_0 without rotation)
        }
        let s = match series.iter().position(|s| s.label == family) {
            Some(i) => &mut series[i],
            None => {
                series.push(Series::new(family));
                series.last_mut().expect("just pushed")
            }
        };
        s.points.push((x, y));
        s.y_err.push(e);
    }
    if ctx == 512 {
        let mut peers = Series::new("llama.cpp KV types, measured by llama-perplexity (REFERENCE.md §10)");
        peers.points = LLAMA_CPP_512.iter().filter(|p| p.2 < 10.0).map(|p| (p.1, p.2)).collect();
        series.push(peers);
    }
    scatter_svg(
        p,
        &format!("ΔPPL (± err) vs resident bits/value (SmolLM2-135M, WikiText-2, n_ctx {ctx})"),
        "bits/value (K and V averaged, all side information)",
        "ΔPPL %",
        &series,
        &[],
        false,
    )
}

fn backend(e: Box<dyn std::error::Error + Send + Sync>) -> veloxquant_llm::LlmError {
    veloxquant_llm::LlmError::StoreBackend(e)
}
