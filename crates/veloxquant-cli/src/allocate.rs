//! `veloxquant allocate --budget B`: per-layer K/V widths for an average resident budget.
//!
//! 1. Sensitivity, on text the evaluation never scores (after its windows and after the
//!    calibration tokens the calibrated formats train on): for every layer, stream and
//!    measured width w, the mean KL of the logits against the fp16 cache when only that
//!    layer's K (or V) is coded at w and everything else stays fp16.
//! 2. Between measured widths the loss is interpolated log-linearly; each width's cost is
//!    its measured resident bits/value at the evaluated context (codes, scales, state, page
//!    table, the fp16 window and sinks).
//! 3. Reverse water-filling ([`veloxquant_llm::allocate::water_fill`]) picks one width per
//!    (layer, stream) minimizing the summed loss with Σ cost ≤ 2·layers·B. The best uniform
//!    choices (one K width, one V width for every layer) under the same budget are listed
//!    with their predicted loss for comparison. Output: `alloc-B.json` per budget (a method
//!    `eval --methods` accepts), `alloc-B.md` (the widths per layer) and the measured table
//!    (`--sensitivity`, reused if present). Each single-layer run starts at its layer from the
//!    fp16 pass's hidden states (`Llama::forward_from_layer`): the layers before it are fp16.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::json;
use veloxquant::{CacheConfig, Calibration, FormatSpec, LayerSpec, Stream};
use veloxquant_llm::allocate::{interpolate_loss, water_fill, Choice};
use veloxquant_llm::eval::{kl_divergence, log_softmax_in_place, WindowPlan};
use veloxquant_llm::{calibrate, CompressedStore, KvStore, Llama, LlamaConfig};

use crate::check::{bad, count, nonempty, ArgError, Ctx};
use crate::files::{check_input, read_bounded, OutputKind, MAX_TEXT_BYTES};
use crate::model::{default_text, load, Method, ModelArgs};
use crate::per_layer;
use crate::util::{print_table_to, progress, write_json, AnyResult};

#[derive(clap::Args)]
pub struct AllocateArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    /// Text (default: ../shared/data/wikitext-2-raw-test.txt when present).
    #[arg(long)]
    text: Option<PathBuf>,
    /// Average resident bits/value over K and V, everything counted (one or more).
    #[arg(long, value_delimiter = ',', required = true)]
    budget: Vec<f64>,
    /// Window size of the evaluation the allocation is for.
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// Windows the evaluation scores: the allocator only reads text after them.
    #[arg(long, default_value_t = 80)]
    windows: usize,
    /// Calibration tokens for the calibrated formats (taken after the windows, as eval does).
    #[arg(long, default_value_t = 2048)]
    calib_tokens: usize,
    /// Windows of n_ctx tokens after the calibration tokens on which sensitivity is measured.
    #[arg(long, default_value_t = 2)]
    sens_windows: usize,
    /// Key format with `{w}` for the width.
    #[arg(long, default_value = "turboquant_frac:{w}:center:eden")]
    k_family: String,
    /// Value format with `{w}` for the width.
    #[arg(long, default_value = "turboquant_frac:{w}:center:eden")]
    v_family: String,
    /// fp16 recent window R and sinks S of the allocated method.
    #[arg(long, default_value_t = 8)]
    recent: usize,
    #[arg(long, default_value_t = 4)]
    sink: usize,
    /// Widths at which the sensitivity is measured.
    #[arg(long, value_delimiter = ',', default_value = "1,1.5,2,3,4")]
    measure: Vec<f64>,
    /// Widths the allocation may choose (between the measured ones: interpolated).
    #[arg(long, value_delimiter = ',', default_value = "1,1.25,1.5,1.75,2,2.25,2.5,2.75,3,3.25,3.5,3.75,4")]
    widths: Vec<f64>,
    /// Measured sensitivities: read from this file if it exists (same model, text, ctx,
    /// families and window), else measured and written to it.
    #[arg(long)]
    sensitivity: Option<PathBuf>,
    /// Where `alloc-B.json` files go.
    #[arg(long, default_value = "benchmarks/results")]
    out_dir: PathBuf,
}

fn family(template: &str, w: f64) -> AnyResult<FormatSpec> {
    if !template.contains("{w}") {
        return Err(format!("family {template:?} has no {{w}} for the width").into());
    }
    Ok(FormatSpec::parse(&template.replace("{w}", &format!("{w}")))?)
}

/// Mean KL vs fp16 per (layer, stream, measured width), measured or read back.
struct Table {
    /// kl[layer][stream][i] at `measure[i]`; `floor`: an all-fp16 per-layer cache's KL.
    kl: Vec<[Vec<f64>; 2]>,
    floor: f64,
}

/// Widths (bits/value) a format family is measured or chosen at.
const WIDTHS: std::ops::RangeInclusive<f64> = 1.0..=8.0;

impl AllocateArgs {
    /// Budgets and widths in range, windows within the model's context, R and S within a
    /// window, a bounded regular text file, outputs (per budget, and the sensitivity table
    /// unless it is read back) that may be written. Returns the text's path.
    pub fn plan(&self, ctx: &Ctx) -> Result<PathBuf, ArgError> {
        ctx.within_context("ctx", self.ctx, 4, 0)?;
        count("windows", self.windows, 1..=1 << 20)?;
        count("sens-windows", self.sens_windows, 1..=1024)?;
        ctx.within_context("calib-tokens", self.calib_tokens, 64, 0)?;
        count("recent", self.recent, 0..=self.ctx)?;
        count("sink", self.sink, 0..=self.ctx)?;
        for (arg, list) in [("budget", &self.budget), ("measure", &self.measure), ("widths", &self.widths)] {
            nonempty(arg, list)?;
            if let Some(w) = list.iter().find(|w| !WIDTHS.contains(*w)) {
                return Err(bad(arg, w, "must be a number of bits/value in 1..=8"));
            }
        }
        for (arg, f) in [("k-family", &self.k_family), ("v-family", &self.v_family)] {
            family(f, self.widths[0]).map_err(|e| bad(arg, f, e.to_string()))?;
        }
        let text = self.text.clone().or_else(default_text).ok_or_else(|| {
            bad("text", "(none)", "no --text given and ../shared/data/wikitext-2-raw-test.txt not found")
        })?;
        check_input(&text, "text")?;
        for b in &self.budget {
            ctx.output(Some(&self.out_dir.join(format!("alloc-{b}.json"))), OutputKind::Json, &[&text])?;
            ctx.output(Some(&self.out_dir.join(format!("alloc-{b}.md"))), OutputKind::Markdown, &[&text])?;
        }
        match &self.sensitivity {
            Some(p) if p.exists() => {
                check_input(p, "sensitivity")?;
            }
            s => ctx.output(s.as_ref(), OutputKind::Json, &[&text])?,
        }
        Ok(text)
    }
}

pub fn run(a: &AllocateArgs, text_path: &Path, model_path: &Path) -> AnyResult {
    let mut measure = a.measure.clone();
    measure.sort_by(f64::total_cmp);
    let bytes = read_bounded(text_path, "text", MAX_TEXT_BYTES)?;
    let (model, tok) = load(model_path)?;
    let c = model.config.clone();
    let tokens = tok.encode(&String::from_utf8_lossy(&bytes))?;
    let n_windows = a.windows.min(tokens.len() / a.ctx.max(1));
    let (cal_at, sens_at) = (n_windows * a.ctx, n_windows * a.ctx + a.calib_tokens);
    let sens_end = sens_at + a.sens_windows * a.ctx;
    if a.ctx < 4 || a.sens_windows == 0 || sens_end > tokens.len() {
        return Err(format!(
            "{} tokens: not enough text after {n_windows} windows of {} and {} calibration tokens for {} sensitivity windows",
            tokens.len(),
            a.ctx,
            a.calib_tokens,
            a.sens_windows
        )
        .into());
    }
    eprintln!(
        "calibration tokens [{cal_at}, {sens_at}), sensitivity windows [{sens_at}, {sens_end}); scored text [0, {cal_at})"
    );
    let cal = Arc::new(calibrate(&model, &tokens[cal_at..sens_at])?);
    let key = json!({
        "ctx": a.ctx, "windows": n_windows, "calib_tokens": a.calib_tokens, "sens_windows": a.sens_windows,
        "k_family": a.k_family, "v_family": a.v_family, "recent": a.recent, "sink": a.sink, "measure": measure,
        "text": text_path.display().to_string(),
    });
    let table = match a.sensitivity.as_ref().filter(|p| p.exists()) {
        Some(p) => read_table(p, &key, c.n_layers, measure.len())?,
        None => {
            let t = measure_table(a, &model, &tokens[sens_at..sens_end], tok.add_bos, &cal, &measure)?;
            if let Some(p) = &a.sensitivity {
                let kl: Vec<_> = t.kl.iter().map(|[k, v]| json!({"k": k, "v": v})).collect();
                write_json(p, &json!({"key": key, "floor": t.floor, "kl": kl}))?;
            }
            t
        }
    };
    let held = a.ctx - 1;
    let mut widths = a.widths.clone();
    widths.sort_by(f64::total_cmp);
    let (kf, vf) = (&a.k_family, &a.v_family);
    let cost = |stream: Stream, w: f64| {
        stream_bits(
            &c,
            &cal,
            stream,
            &family(if stream == Stream::Keys { kf } else { vf }, w)?,
            (a.recent, a.sink),
            held,
        )
    };
    let costs: [Vec<f64>; 2] = [
        widths.iter().map(|&w| cost(Stream::Keys, w)).collect::<AnyResult<_>>()?,
        widths.iter().map(|&w| cost(Stream::Values, w)).collect::<AnyResult<_>>()?,
    ];
    let loss = |l: usize, s: usize, w: f64| (interpolate_loss(&measure, &table.kl[l][s], w) - table.floor).max(0.0);
    for &budget in &a.budget {
        allocate_one(a, &c, budget, &widths, &costs, &loss)?;
    }
    Ok(())
}

fn allocate_one(
    a: &AllocateArgs,
    c: &LlamaConfig,
    budget: f64,
    widths: &[f64],
    costs: &[Vec<f64>; 2],
    loss: &dyn Fn(usize, usize, f64) -> f64,
) -> AnyResult {
    let n = c.n_layers;
    let units: Vec<Vec<Choice>> = (0..2 * n)
        .map(|u| {
            (0..widths.len()).map(|i| Choice { cost: costs[u % 2][i], loss: loss(u / 2, u % 2, widths[i]) }).collect()
        })
        .collect();
    let pick = water_fill(&units, 2.0 * n as f64 * budget)?;
    let spec = |s: usize, w: f64| family(if s == 0 { &a.k_family } else { &a.v_family }, w);
    let layers: Vec<LayerSpec> = (0..n)
        .map(|l| Ok(LayerSpec::new(spec(0, widths[pick[2 * l]])?, spec(1, widths[pick[2 * l + 1]])?)))
        .collect::<AnyResult<_>>()?;
    let predicted: f64 = pick.iter().zip(&units).map(|(&i, u)| u[i].loss).sum();
    let bits: f64 = pick.iter().zip(&units).map(|(&i, u)| u[i].cost).sum::<f64>() / (2 * n) as f64;
    // Uniform alternatives: one K width and one V width for all layers, within the budget.
    let mut uniform: Vec<(f64, f64, usize, usize)> = Vec::new();
    for (ik, _) in widths.iter().enumerate() {
        for (iv, _) in widths.iter().enumerate() {
            let b = (costs[0][ik] + costs[1][iv]) / 2.0;
            if b <= budget + 1e-9 {
                let p: f64 = (0..n).map(|l| loss(l, 0, widths[ik]) + loss(l, 1, widths[iv])).sum();
                uniform.push((p, b, ik, iv));
            }
        }
    }
    uniform.sort_by(|x, y| x.0.total_cmp(&y.0));
    let uniform_json: Vec<_> = uniform
        .iter()
        .take(3)
        .map(|&(p, b, ik, iv)| -> AnyResult<serde_json::Value> {
            Ok(json!({"method": format!("{}/{}@{}+{}", spec(0, widths[ik])?, spec(1, widths[iv])?, a.recent, a.sink), "bits": b, "predicted_kl": p}))
        })
        .collect::<AnyResult<_>>()?;
    let rows: Vec<Vec<String>> = (0..n)
        .map(|l| {
            let (ik, iv) = (pick[2 * l], pick[2 * l + 1]);
            vec![
                l.to_string(),
                format!("{}", widths[ik]),
                format!("{:.2e}", units[2 * l][ik].loss),
                format!("{}", widths[iv]),
                format!("{:.2e}", units[2 * l + 1][iv].loss),
            ]
        })
        .collect();
    println!("\nbudget {budget} bits/value: predicted KL {predicted:.5} at {bits:.3} bits/value (K and V averaged)\n");
    let md = a.out_dir.join(format!("alloc-{budget}.md"));
    print_table_to(&["layer", "K width", "K predicted KL", "V width", "V predicted KL"], &rows, Some(&md))?;
    if let Some(&(p, b, ik, iv)) = uniform.first() {
        println!("best uniform: K {} / V {} at {b:.3} bits/value, predicted KL {p:.5}", widths[ik], widths[iv]);
    }
    let out = a.out_dir.join(format!("alloc-{budget}.json"));
    let extra =
        json!({"budget": budget, "bits": bits, "predicted_kl": predicted, "ctx": a.ctx, "uniform": uniform_json});
    write_json(&out, &per_layer::to_json(&layers, a.recent, a.sink, extra))
}

/// Resident bits/value of one stream coded with `spec` (the other fp16) after `held` tokens.
fn stream_bits(
    c: &LlamaConfig,
    cal: &Arc<Calibration>,
    stream: Stream,
    spec: &FormatSpec,
    (recent, sink): (usize, usize),
    held: usize,
) -> AnyResult<f64> {
    let fp16 = FormatSpec::parse("fp16")?;
    let (k, v) = if stream == Stream::Keys { (spec.clone(), fp16) } else { (fp16, spec.clone()) };
    let mut cfg = CacheConfig::new(1, c.n_kv_heads, c.head_dim, k, v);
    (cfg.recent, cfg.sink, cfg.calibration) = (recent, sink, Some(cal.clone()));
    let mut s = CompressedStore::new(cfg)?;
    let x = vec![0.01f32; c.n_kv_heads * held * c.head_dim];
    s.append(0, &x, &x, held)?;
    let (kb, vb) = s.cache().effective_bits();
    Ok(if stream == Stream::Keys { kb } else { vb })
}

/// One stream of one layer at `spec`, everything else exact fp16.
fn single(c: &LlamaConfig, layer: usize, stream: Stream, spec: &FormatSpec, a: &AllocateArgs) -> AnyResult<Method> {
    let fp16 = FormatSpec::parse("fp16")?;
    let layers = (0..c.n_layers)
        .map(|l| match (l == layer, stream) {
            (true, Stream::Keys) => LayerSpec::new(spec.clone(), fp16.clone()),
            (true, Stream::Values) => LayerSpec::new(fp16.clone(), spec.clone()),
            _ => LayerSpec::new(fp16.clone(), fp16.clone()),
        })
        .collect();
    Ok(Method::PerLayer { layers, recent: a.recent, sink: a.sink, label: format!("l{layer}") })
}

fn measure_table(
    a: &AllocateArgs,
    model: &Llama,
    text: &[u32],
    bos: Option<u32>,
    cal: &Arc<Calibration>,
    measure: &[f64],
) -> AnyResult<Table> {
    let c = &model.config;
    let plan = WindowPlan::new(text.len(), a.ctx, a.sens_windows)?;
    let n_vocab = c.n_vocab;
    // Candidate 0: every layer fp16 through the compressed store (the floor); then one run
    // per (layer, stream, width), starting at that layer.
    let mut cands: Vec<(Method, usize)> = vec![(single(c, 0, Stream::Keys, &FormatSpec::parse("fp16")?, a)?, 0)];
    for l in 0..c.n_layers {
        for (s, fam) in [(Stream::Keys, &a.k_family), (Stream::Values, &a.v_family)] {
            for &w in measure {
                cands.push((single(c, l, s, &family(fam, w)?, a)?, l));
            }
        }
    }
    let pb = progress((plan.n_windows * cands.len()) as u64, "sensitivity");
    let mut kl_sum = vec![0f64; cands.len()];
    let mut n_pos = 0usize;
    for w in 0..plan.n_windows {
        let mut window = text[w * a.ctx..(w + 1) * a.ctx - 1].to_vec(); // the last position predicts nothing
        if let Some(b) = bos {
            window[0] = b;
        }
        // The fp16 pass, keeping every layer's input: a run that quantizes only layer l
        // starts at layer l (the layers before it are the fp16 ones).
        let mut hidden: Vec<Vec<f32>> = vec![Vec::new(); c.n_layers];
        let mut reference = veloxquant_llm::Fp16Store::for_config(c, a.ctx);
        let mut lr =
            model.forward_recording(&window, &mut reference, plan.first, &mut |l, x| hidden[l] = x.to_vec())?;
        lr.chunks_mut(n_vocab).for_each(log_softmax_in_place);
        n_pos += lr.len() / n_vocab;
        for (i, (m, first)) in cands.iter().enumerate() {
            let mut store = m.store(c, a.ctx, Some(cal))?;
            let mut lc = model.forward_from_layer(hidden[*first].clone(), *first, store.as_mut(), plan.first)?;
            lc.chunks_mut(n_vocab).for_each(log_softmax_in_place);
            kl_sum[i] +=
                lr.chunks_exact(n_vocab).zip(lc.chunks_exact(n_vocab)).map(|(p, q)| kl_divergence(p, q)).sum::<f64>();
            pb.inc(1);
            if pb.is_hidden() && (w * cands.len() + i + 1).is_multiple_of(50) {
                eprintln!("sensitivity: {} of {} runs", w * cands.len() + i + 1, plan.n_windows * cands.len());
            }
        }
    }
    pb.finish_and_clear();
    let kl: Vec<f64> = kl_sum.iter().map(|s| s / n_pos.max(1) as f64).collect();
    let per = measure.len();
    let table = (0..c.n_layers)
        .map(|l| {
            let at = |s: usize| kl[1 + (2 * l + s) * per..1 + (2 * l + s + 1) * per].to_vec();
            [at(0), at(1)]
        })
        .collect();
    Ok(Table { kl: table, floor: kl[0] })
}

fn read_table(p: &std::path::Path, key: &serde_json::Value, n_layers: usize, per: usize) -> AnyResult<Table> {
    let j: serde_json::Value = serde_json::from_slice(&read_bounded(p, "sensitivity", 64 << 20)?)?;
    if &j["key"] != key {
        return Err(format!("{}: measured for other settings ({}), not {key}", p.display(), j["key"]).into());
    }
    let nums = |v: &serde_json::Value| -> Option<Vec<f64>> { v.as_array()?.iter().map(|x| x.as_f64()).collect() };
    let rows = j["kl"].as_array().filter(|r| r.len() == n_layers).ok_or("sensitivity file: wrong layer count")?;
    let kl = rows
        .iter()
        .map(|r| match (nums(&r["k"]), nums(&r["v"])) {
            (Some(k), Some(v)) if k.len() == per && v.len() == per => Ok([k, v]),
            _ => Err("sensitivity file: malformed row".into()),
        })
        .collect::<AnyResult<_>>()?;
    eprintln!("sensitivities read from {}", p.display());
    Ok(Table { kl, floor: j["floor"].as_f64().unwrap_or(0.0) })
}
