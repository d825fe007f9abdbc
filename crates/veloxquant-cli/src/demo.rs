//! `veloxquant demo`, `generate`, `passkey` and `fetch-model`: the model with the fp16 cache
//! and with compressed caches, side by side.

use std::io::Write;
use std::path::Path;

use veloxquant_llm::eval::{argmax, kl_divergence, log_softmax_in_place};
use veloxquant_llm::generate::generate_ids;
use veloxquant_llm::passkey::{answer_tokens, extract_passkey};
use veloxquant_llm::{
    passkey_accuracy, passkey_prompt, GenStats, Greedy, KvStore, Llama, PasskeyFormat, TextStream, Tokenizer,
    WeightMode,
};

use crate::check::{bad, count, method, methods, nonempty, ArgError, Ctx};
use crate::files::OutputKind;
use crate::model::{load, load_with, Method, ModelArgs, DEFAULT_METHOD};
use crate::util::{print_table_to, AnyResult};

pub(crate) const DEMO_PROMPT: &str =
    "The lighthouse keeper had lived alone on the island for twenty years. One stormy night,";
/// The demo's long-context case: a passkey prompt of this many tokens (less on a model
/// with a shorter context), where the fp16 window no longer dominates the compressed cache.
pub(crate) const LONG_CONTEXT: usize = 4096;
/// Most passkey trials per depth.
const MAX_TRIALS: usize = 10_000;

#[derive(clap::Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[arg(long, default_value = DEMO_PROMPT)]
    pub prompt: String,
    /// `fp16` or `KSPEC[/VSPEC][@R][+S]`.
    #[arg(long, default_value = DEFAULT_METHOD)]
    pub method: String,
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Where the model runs (cuda: builds with `--features cuda`).
    #[arg(long, value_enum, default_value_t = crate::gpu::Device::Cpu)]
    pub device: crate::gpu::Device,
    /// How the CPU holds the weights: `packed` decodes from the GGUF's blocks (same greedy
    /// tokens as `f32`, ~1/5 of the bytes read per token), `f32` from dequantized weights.
    #[arg(long, value_enum, default_value_t = Weights::Packed)]
    pub weights: Weights,
}

/// `generate --weights`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Weights {
    #[default]
    Packed,
    F32,
}

impl Weights {
    pub(crate) fn mode(self) -> WeightMode {
        match self {
            Weights::Packed => WeightMode::Packed,
            Weights::F32 => WeightMode::DequantF32,
        }
    }
}

/// A generation's checked method and length.
#[derive(Clone, Debug)]
pub struct GenPlan {
    pub method: Method,
    pub max_tokens: usize,
}

impl GenerateArgs {
    /// At least `min_tokens` generated; the prompt's `prompt_tokens` (at least) and the
    /// generated tokens within the context (the exact prompt length is checked once it is
    /// tokenized).
    pub fn plan(&self, ctx: &Ctx, min_tokens: usize, prompt_tokens: usize) -> Result<GenPlan, ArgError> {
        if self.prompt.is_empty() {
            return Err(bad("prompt", "\"\"", "give a prompt"));
        }
        let max_tokens = ctx.within_context("max-tokens", self.max_tokens, min_tokens, prompt_tokens)?;
        Ok(GenPlan { method: method("method", &self.method, ctx.n_ctx(), false)?, max_tokens })
    }
}

struct Run {
    method: Method,
    stats: GenStats,
    resident: usize,
    /// Tokens the cache holds (the last generated one is never fed back).
    held: usize,
    text: String,
}

fn run_one(
    model: &Llama,
    tok: &Tokenizer,
    prompt: &[u32],
    method: &Method,
    max_tokens: usize,
    stream: bool,
) -> AnyResult<Run> {
    let mut store = method.store(&model.config, prompt.len() + max_tokens, None)?;
    let stop = tok.stop_ids();
    let mut out = std::io::stdout();
    let mut text = TextStream::new(tok);
    let mut on_token = |id: u32| {
        // Whole characters only: a byte-level token may hold part of one.
        if stream && !stop.contains(&id) {
            if let Ok(piece) = text.push(id) {
                let _ = write!(out, "{piece}");
                let _ = out.flush();
            }
        }
        true
    };
    let stats = generate_ids(model, prompt, max_tokens, &stop, store.as_mut(), &mut Greedy, &mut on_token)?;
    if stream {
        println!("{}", text.finish()?);
    }
    let text = tok.decode(&stats.tokens)?;
    Ok(Run { method: method.clone(), stats, resident: store.resident_bytes(), held: store.len(0), text })
}

/// "3.52× smaller" or "1.20× larger": `ours` against `fp16` bytes.
fn vs_fp16(fp16: usize, ours: usize) -> String {
    let r = fp16 as f64 / ours.max(1) as f64;
    if r >= 1.0 {
        format!("{r:.2}× smaller")
    } else {
        format!("{:.2}× larger", 1.0 / r)
    }
}

pub fn generate(a: &GenerateArgs, p: &GenPlan, model_path: &Path) -> AnyResult {
    if a.device == crate::gpu::Device::Cuda {
        return crate::gpu::generate(a);
    }
    let (model, tok) = load_with(model_path, a.weights.mode())?;
    let prompt = tok.encode(&a.prompt)?;
    print!("{}", a.prompt);
    let r = run_one(&model, &tok, &prompt, &p.method, p.max_tokens, true)?;
    let n = r.held;
    let (_, _, fp16) = Method::Fp16.resident_bits(&model.config, n, None)?;
    let w = model.weight_bytes();
    println!(
        "\n{} · {} prompt + {} generated tokens · prefill {:.0} tokens/s · decode {:.1} tokens/s · KV cache {} B in use for {n} tokens ({:.0} B/token) vs fp16 {} B ({}) · weights {:.0} MB resident, {:.0} MB read per decoded token",
        r.method, prompt.len(), r.stats.tokens.len(), r.stats.prefill_tokens_per_s, r.stats.decode_tokens_per_s,
        r.resident, r.resident as f64 / n as f64, fp16, vs_fp16(fp16, r.resident),
        w.resident as f64 / 1e6, w.per_decode_token as f64 / 1e6
    );
    Ok(())
}

/// Mean KL(fp16 ‖ method) and top-1 agreement over the positions that predict the
/// generated tokens `ids[from + 1..]`, both caches teacher-forced on the same tokens.
fn agreement(model: &Llama, ids: &[u32], from: usize, method: &Method) -> AnyResult<(f64, f64, usize)> {
    // The last token predicts nothing that was generated: not fed.
    let fed = &ids[..ids.len() - 1];
    let logits = |m: &Method| -> AnyResult<Vec<f32>> {
        let mut s: Box<dyn KvStore> = m.store(&model.config, fed.len(), None)?;
        let mut l = model.forward(fed, s.as_mut(), from)?;
        l.chunks_exact_mut(model.config.n_vocab).for_each(log_softmax_in_place);
        Ok(l)
    };
    let (p, q) = (logits(&Method::Fp16)?, logits(method)?);
    let nv = model.config.n_vocab;
    let (mut kl, mut agree, mut n) = (0.0, 0usize, 0usize);
    for (a, b) in p.chunks_exact(nv).zip(q.chunks_exact(nv)) {
        kl += kl_divergence(a, b);
        agree += usize::from(argmax(a) == argmax(b));
        n += 1;
    }
    Ok((kl / n.max(1) as f64, agree as f64 / n.max(1) as f64, n))
}

#[derive(clap::Args)]
pub struct DemoArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[arg(long, default_value_t = 80)]
    max_tokens: usize,
    /// The compressed configuration to show next to fp16.
    #[arg(long, default_value = DEFAULT_METHOD)]
    method: String,
    /// Where the model runs (cuda: builds with `--features cuda`).
    #[arg(long, value_enum, default_value_t = crate::gpu::Device::Cpu)]
    pub(crate) device: crate::gpu::Device,
}

impl DemoArgs {
    pub fn plan(&self, ctx: &Ctx) -> Result<GenPlan, ArgError> {
        // The built-in prompt is 20 tokens with SmolLM2's tokenizer; a byte-level one needs 88.
        let max_tokens = ctx.within_context("max-tokens", self.max_tokens, 1, DEMO_PROMPT.len())?;
        Ok(GenPlan { method: method("method", &self.method, ctx.n_ctx(), false)?, max_tokens })
    }
}

pub fn demo(a: &DemoArgs, p: &GenPlan, model_path: &Path) -> AnyResult {
    if a.device == crate::gpu::Device::Cuda {
        return crate::gpu::demo(p, model_path);
    }
    let t0 = std::time::Instant::now();
    let method = &p.method;
    // Decode from the GGUF's own blocks, as `generate` does (the same greedy tokens).
    let (model, tok) = load_with(model_path, WeightMode::Packed)?;
    let prompt = tok.encode(DEMO_PROMPT)?;
    println!("prompt: {DEMO_PROMPT}\n");
    let runs: Vec<Run> = [Method::Fp16, method.clone()]
        .iter()
        .map(|m| run_one(&model, &tok, &prompt, m, p.max_tokens, false))
        .collect::<AnyResult<_>>()?;
    for r in &runs {
        println!("── {} ──\n{DEMO_PROMPT}{}\n", r.method, r.text);
    }
    let ids: Vec<u32> = prompt.iter().chain(&runs[0].stats.tokens).copied().collect();
    let (kl, top1, n_compared) = agreement(&model, &ids, prompt.len() - 1, method)?;
    let c = &model.config;
    let rows: Vec<Vec<String>> = runs
        .iter()
        .map(|r| {
            let n = r.held;
            let (kb, vb, _) = r.method.resident_bits(c, n, None).unwrap_or((f64::NAN, f64::NAN, 0));
            vec![
                r.method.to_string(),
                format!("{kb:.2} / {vb:.2}"),
                format!("{:.0}", r.resident as f64 / n as f64),
                r.resident.to_string(),
                format!("{:.1}", r.stats.decode_tokens_per_s),
            ]
        })
        .collect();
    print_table_to(&["KV cache", "bits/value K / V", "bytes/token", "bytes in use", "decode tokens/s"], &rows, None)?;
    println!(
        "\n{method} vs fp16 on the same {n_compared} generated positions (teacher-forced): mean KL {kl:.5} nats, top-1 agreement {:.1} %",
        100.0 * top1
    );
    // Both caches measured at the same length (their runs may stop at different tokens).
    let n = runs[0].held;
    let (fp16, ours) = (Method::Fp16.resident_bits(c, n, None)?.2, method.resident_bits(c, n, None)?.2);
    println!("at {n} tokens the cache is {} than fp16\n", vs_fp16(fp16, ours));
    long_context(&model, &tok, method)?;
    println!("\ndemo took {:.0} s", t0.elapsed().as_secs_f64());
    Ok(())
}

/// The point of a compressed cache: a long prompt (a passkey hidden in ~4k tokens of
/// filler) through fp16 and `method`, both answers, the bytes each holds and their ratio.
fn long_context(model: &Llama, tok: &Tokenizer, method: &Method) -> AnyResult {
    let answer = answer_tokens(PasskeyFormat::Plain);
    let len = LONG_CONTEXT.min(model.config.n_ctx_train - answer);
    let p = passkey_prompt(tok, len, 0.5, 7, PasskeyFormat::Plain)?;
    println!("long context: passkey {} hidden halfway through a {}-token prompt", p.passkey, p.tokens.len());
    let stop = tok.stop_ids();
    let mut rows = Vec::new();
    let mut bytes = Vec::new();
    for m in [Method::Fp16, method.clone()] {
        let mut store = m.store(&model.config, p.tokens.len() + answer, None)?;
        let g = generate_ids(model, &p.tokens, answer, &stop, store.as_mut(), &mut Greedy, &mut |_| true)?;
        let said: Vec<u32> = g.tokens.iter().copied().filter(|t| !stop.contains(t)).collect();
        let text = tok.decode(&said)?;
        let right = extract_passkey(&text) == Some(p.passkey);
        let n = store.len(0);
        bytes.push(store.resident_bytes());
        rows.push(vec![
            m.to_string(),
            format!("{:?}", text.trim_end()),
            if right { "yes".into() } else { "no".into() },
            store.resident_bytes().to_string(),
            format!("{:.0}", store.resident_bytes() as f64 / n as f64),
            format!("{:.0}", g.prefill_tokens_per_s),
        ]);
    }
    print_table_to(&["KV cache", "answer", "correct", "bytes in use", "bytes/token", "prefill tokens/s"], &rows, None)?;
    println!("at {} tokens the cache is {} than fp16", p.tokens.len(), vs_fp16(bytes[0], bytes[1]));
    Ok(())
}

#[derive(clap::Args)]
pub struct PasskeyArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt lengths in tokens (each at most the model's context less the answer's 8).
    #[arg(long, value_delimiter = ',', default_value = "1024,2048,4096")]
    pub(crate) lengths: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "fp16,turboquant_mse:4:eden/turboquant_mse:3,q4_0:rot")]
    methods: Vec<String>,
    /// Depths of the hidden number (fraction of the filler).
    #[arg(long, value_delimiter = ',', default_value = "0.1,0.5,0.9")]
    pub(crate) depths: Vec<f64>,
    /// Trials per depth.
    #[arg(long, default_value_t = 1)]
    pub(crate) n: usize,
    #[arg(long, default_value_t = 7)]
    pub(crate) seed: u64,
    #[arg(long)]
    pub(crate) json: Option<std::path::PathBuf>,
    #[arg(long)]
    pub(crate) md: Option<std::path::PathBuf>,
    /// Where the model runs (cuda: builds with `--features cuda`; the trials of a length
    /// run as one batch).
    #[arg(long, value_enum, default_value_t = crate::gpu::Device::Cpu)]
    pub(crate) device: crate::gpu::Device,
    /// Calibration text for calibrated formats (default: ../shared/data/wikitext-2-raw-test.txt).
    #[arg(long)]
    text: Option<std::path::PathBuf>,
    /// First calibration token in that text (default: where `eval`'s default run calibrates,
    /// after its 80 windows of 512) and how many.
    #[arg(long, default_value_t = 80 * 512)]
    calib_from: usize,
    #[arg(long, default_value_t = 2048)]
    calib_tokens: usize,
    /// Merge earlier `--json` outputs (e.g. one method or length per process on a many-core
    /// host) into one table and JSON; nothing is run.
    #[arg(long, value_delimiter = ',')]
    pub(crate) merge: Vec<std::path::PathBuf>,
}

impl PasskeyArgs {
    pub fn plan(&self, ctx: &Ctx) -> Result<Vec<Method>, ArgError> {
        if !self.merge.is_empty() {
            return crate::check::merge_plan(&self.merge, [self.json.as_ref(), self.md.as_ref(), None], ctx)
                .map(|_| vec![]);
        }
        nonempty("lengths", &self.lengths)?;
        for &len in &self.lengths {
            ctx.within_context("lengths", len, 1, answer_tokens(PasskeyFormat::Plain))?;
        }
        nonempty("depths", &self.depths)?;
        if let Some(d) = self.depths.iter().find(|d| !(0.0..=1.0).contains(*d)) {
            return Err(bad("depths", d, "must be in [0, 1]"));
        }
        count("n", self.n, 1..=MAX_TRIALS)?;
        crate::check::distinct(&[self.json.as_ref(), self.md.as_ref()])?;
        ctx.output(self.json.as_ref(), OutputKind::Json, &[])?;
        ctx.output(self.md.as_ref(), OutputKind::Markdown, &[])?;
        methods("methods", &self.methods, ctx.n_ctx(), true, false)
    }
}

pub fn passkey(a: &PasskeyArgs, methods: &[Method], model_path: &Path) -> AnyResult {
    if a.device == crate::gpu::Device::Cuda {
        return crate::gpu::passkey(a, methods, model_path);
    }
    let (model, tok) = load(model_path)?;
    let cal = if methods.iter().any(Method::needs_calibration) {
        Some(crate::model::calibration_from_text(&model, &tok, a.text.as_deref(), a.calib_from, a.calib_tokens)?)
    } else {
        None
    };
    let mut out = Vec::new();
    for m in methods {
        for &len in &a.lengths {
            let (mm, c, cal) = (m.clone(), model.config.clone(), cal.clone());
            let mut f = move || mm.store(&c, len + 64, cal.as_ref()).map_err(veloxquant_llm::LlmError::StoreBackend);
            let s = passkey_accuracy(&model, &tok, &mut f, len, &a.depths, a.n, a.seed, PasskeyFormat::Plain)?;
            eprintln!("{m} @ {len}: {}/{}", s.n_correct, s.n_trials);
            out.push(serde_json::json!({"method": m.to_string(), "tokens": len, "correct": s.n_correct, "trials": s.n_trials, "accuracy": s.accuracy()}));
        }
    }
    passkey_report(a, &out)
}

/// The table (a row per method, a column per length, in order of first appearance) and the
/// JSON of passkey results, from the JSON rows: runs and `--merge` print the same.
pub fn passkey_report(a: &PasskeyArgs, out: &[serde_json::Value]) -> AnyResult {
    let mut methods: Vec<&str> = Vec::new();
    let mut lengths: Vec<u64> = Vec::new();
    for r in out {
        let (m, n) = (
            r["method"].as_str().ok_or("passkey row without a method")?,
            r["tokens"].as_u64().ok_or("passkey row without tokens")?,
        );
        if !methods.contains(&m) {
            methods.push(m);
        }
        if !lengths.contains(&n) {
            lengths.push(n);
        }
    }
    lengths.sort_unstable();
    let cell = |m: &str, n: u64| {
        out.iter().find(|r| r["method"] == m && r["tokens"] == n).map_or("–".to_string(), |r| {
            format!("{}/{}", r["correct"].as_u64().unwrap_or(0), r["trials"].as_u64().unwrap_or(0))
        })
    };
    let rows: Vec<Vec<String>> = methods
        .iter()
        .map(|m| std::iter::once(m.to_string()).chain(lengths.iter().map(|&n| cell(m, n))).collect())
        .collect();
    let header: Vec<String> =
        std::iter::once("method".to_string()).chain(lengths.iter().map(|l| format!("{l} tokens"))).collect();
    let header: Vec<&str> = header.iter().map(String::as_str).collect();
    print_table_to(&header, &rows, a.md.as_deref())?;
    if let Some(p) = &a.json {
        crate::util::write_json(p, &serde_json::Value::Array(out.to_vec()))?;
    }
    Ok(())
}

/// `passkey --merge`: the rows of every file, a (method, length) given twice refused.
pub fn passkey_merge(a: &PasskeyArgs) -> AnyResult {
    let mut out: Vec<serde_json::Value> = Vec::new();
    for r in crate::util::read_json_rows(&a.merge)? {
        if out.iter().any(|o| o["method"] == r["method"] && o["tokens"] == r["tokens"]) {
            return Err(format!("passkey --merge: {} at {} tokens given twice", r["method"], r["tokens"]).into());
        }
        out.push(r);
    }
    passkey_report(a, &out)
}

pub fn fetch(model_path: &Path) -> AnyResult {
    println!("{}", model_path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The demo's KL and top-1 cover exactly the positions that predict generated tokens:
    /// the mean over those positions computed independently, feeding the tokens one at a
    /// time through both caches (the old code averaged one position more).
    #[test]
    fn agreement_scores_the_generated_positions() {
        let path = std::env::temp_dir().join(format!("vq-demo-agree-{}.gguf", std::process::id()));
        crate::tiny::write_tiny_llama(&path, 4);
        let (model, tok) = load(&path).unwrap();
        std::fs::remove_file(&path).ok();
        let prompt = tok.encode("Hello").unwrap();
        let generated = [40u32, 101, 7, 200, 33];
        let ids: Vec<u32> = prompt.iter().chain(&generated).copied().collect();
        let method = Method::parse("method", "turboquant_mse:2").unwrap();
        let (kl, top1, n) = agreement(&model, &ids, prompt.len() - 1, &method).unwrap();
        assert_eq!(n, generated.len());
        let c = &model.config;
        let (mut a, mut b) =
            (Method::Fp16.store(c, ids.len(), None).unwrap(), method.store(c, ids.len(), None).unwrap());
        let (mut kls, mut agree) = (Vec::new(), 0);
        for (i, &t) in ids[..ids.len() - 1].iter().enumerate() {
            let mut la = model.forward(&[t], a.as_mut(), 0).unwrap();
            let mut lb = model.forward(&[t], b.as_mut(), 0).unwrap();
            if i + 1 >= prompt.len() {
                log_softmax_in_place(&mut la);
                log_softmax_in_place(&mut lb);
                kls.push(kl_divergence(&la, &lb));
                agree += usize::from(argmax(&la) == argmax(&lb));
            }
        }
        let want = kls.iter().sum::<f64>() / kls.len() as f64;
        println!("teacher-forced {kl:.6} vs token by token {want:.6} over {kls:?}");
        assert!((kl - want).abs() <= 0.02 * want, "KL {kl} vs {want}");
        assert_eq!(top1, agree as f64 / kls.len() as f64);
    }
}
