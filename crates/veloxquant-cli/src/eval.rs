//! `veloxquant eval`: perplexity in llama.cpp's `llama-perplexity` protocol for the fp16 cache
//! and each method on the same windows, with KL divergence and top-1 agreement against fp16,
//! resident bits per value (everything counted at the evaluated context) and speed.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::json;
use veloxquant_llm::{calibrate, compare_many_with_progress, KvStore, StoreFactory};

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
    let mut factories: Vec<Box<StoreFactory>> = methods
        .iter()
        .map(|m| {
            let (m, c, cal, n) = (m.clone(), c.clone(), cal.clone(), a.ctx);
            Box::new(move || m.store(&c, n, cal.as_ref()).map_err(backend)) as Box<dyn FnMut() -> _>
        })
        .collect();
    let mut cands: Vec<&mut StoreFactory> = factories.iter_mut().map(|f| f.as_mut() as &mut StoreFactory).collect();
    let pb = progress(n_windows as u64, "windows");
    let stats =
        compare_many_with_progress(&model, &tokens, a.ctx, n_windows, tok.add_bos, &mut ref_f, &mut cands, &mut |w| {
            pb.set_position(w as u64)
        })?;
    pb.finish_and_clear();

    let held = a.ctx - 1; // tokens a window's cache holds at its end
    let base = &stats[0].reference;
    let mut rows = Vec::new();
    let mut out = Vec::new();
    let fp16_bits = Method::Fp16.resident_bits(&c, held, None)?;
    let mut push = |name: String,
                    recent: usize,
                    (kb, vb, bytes): (f64, f64, usize),
                    ppl: f64,
                    err: f64,
                    kl: f64,
                    top1: f64,
                    tps: f64| {
        let d = 100.0 * (ppl / base.ppl - 1.0);
        rows.push(vec![
            name.clone(),
            format!("{kb:.2}"),
            format!("{vb:.2}"),
            recent.to_string(),
            format!("{:.0}", bytes as f64 / held as f64),
            format!("{ppl:.4} ± {err:.3}"),
            format!("{d:+.2} %"),
            format!("{kl:.5}"),
            format!("{:.2}", 100.0 * top1),
            format!("{tps:.0}"),
        ]);
        out.push(json!({
            "method": name, "k_bits": kb, "v_bits": vb, "window": recent, "bytes_per_token": bytes as f64 / held as f64,
            "ppl": ppl, "ppl_stderr": err, "delta_ppl_pct": d, "kl": kl, "top1": top1, "tokens_per_s": tps,
            "n_ctx": a.ctx, "n_windows": n_windows,
        }));
    };
    push("fp16".into(), 0, fp16_bits, base.ppl, base.ppl_stderr, 0.0, 1.0, base.tokens_per_s);
    for (m, s) in methods.iter().zip(&stats) {
        let bits = m.resident_bits(&c, held, cal.as_ref())?;
        push(
            m.to_string(),
            m.recent(),
            bits,
            s.candidate.ppl,
            s.candidate.ppl_stderr,
            s.kl_mean,
            s.top1_agreement,
            s.candidate.tokens_per_s,
        );
    }
    println!(
        "{} · n_ctx {} · {n_windows} windows · second half of each window scored (llama-perplexity protocol)\n",
        text_path.display(),
        a.ctx
    );
    print_table_to(
        &["method", "K bits/value", "V bits/value", "R", "KV bytes/token", "PPL", "ΔPPL", "KL", "top-1 %", "tokens/s"],
        &rows,
        a.md.as_deref(),
    )?;
    if let Some(p) = &a.json {
        write_json(p, &serde_json::Value::Array(out.clone()))?;
    }
    if let Some(p) = &a.plot {
        let mut series: Vec<Series> = Vec::new();
        for r in out.iter().skip(1) {
            let name = r["method"].as_str().unwrap_or_default();
            let family = if name.starts_with("turboquant") {
                "ours: turboquant_mse"
            } else if name.starts_with("q8_0") || name.starts_with("q4_0") {
                "ours: llama.cpp-style q8_0/q4_0"
            } else {
                "ours: other seed methods"
            };
            let x = (r["k_bits"].as_f64().unwrap_or(0.0) + r["v_bits"].as_f64().unwrap_or(0.0)) / 2.0;
            let y = r["delta_ppl_pct"].as_f64().unwrap_or(0.0);
            match series.iter_mut().find(|s| s.label == family) {
                Some(s) => s.points.push((x, y)),
                None => series.push(Series { label: family.into(), points: vec![(x, y)] }),
            }
        }
        series.push(Series {
            label: "llama.cpp (REFERENCE.md §10)".into(),
            points: LLAMA_CPP_512.iter().filter(|p| p.2 < 10.0).map(|p| (p.1, p.2)).collect(),
        });
        scatter_svg(
            p,
            &format!("ΔPPL vs resident bits/value (SmolLM2-135M, WikiText-2, n_ctx {})", a.ctx),
            "bits/value (K and V averaged, all side information)",
            "ΔPPL %",
            &series,
            &[],
            false,
        )?;
    }
    Ok(())
}

fn backend(e: Box<dyn std::error::Error + Send + Sync>) -> veloxquant_llm::LlmError {
    veloxquant_llm::LlmError::StoreBackend(e)
}
