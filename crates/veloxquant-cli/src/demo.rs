//! `veloxquant demo`, `generate`, `passkey` and `fetch-model`: the model with the fp16 cache
//! and with compressed caches, side by side.

use std::io::Write;

use veloxquant_llm::eval::{argmax, kl_divergence, log_softmax_in_place};
use veloxquant_llm::generate::generate_ids;
use veloxquant_llm::{passkey_accuracy, GenStats, Greedy, KvStore, Llama, PasskeyFormat, Tokenizer};

use crate::model::{Method, ModelArgs, DEFAULT_METHOD};
use crate::util::{print_table_to, AnyResult};

const DEMO_PROMPT: &str = "The lighthouse keeper had lived alone on the island for twenty years. One stormy night,";

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
}

struct Run {
    method: Method,
    stats: GenStats,
    resident: usize,
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
    let stop: Vec<u32> = tok.eos.into_iter().chain(tok.token_id("<|im_end|>")).collect();
    let mut out = std::io::stdout();
    let mut on_token = |id: u32| {
        if stream {
            if let Ok(piece) = tok.decode(&[id]) {
                let _ = write!(out, "{piece}");
                let _ = out.flush();
            }
        }
        true
    };
    let stats = generate_ids(model, prompt, max_tokens, &stop, store.as_mut(), &mut Greedy, &mut on_token)?;
    if stream {
        println!();
    }
    let text = tok.decode(&stats.tokens)?;
    Ok(Run { method: method.clone(), stats, resident: store.resident_bytes(), text })
}

pub fn generate(a: &GenerateArgs) -> AnyResult {
    let method = Method::parse(&a.method)?;
    if method.needs_calibration() {
        return Err("generate does not calibrate: pick a method without vecinfer".into());
    }
    let (model, tok) = a.model.load()?;
    let prompt = tok.encode(&a.prompt)?;
    print!("{}", a.prompt);
    let r = run_one(&model, &tok, &prompt, &method, a.max_tokens, true)?;
    let n = prompt.len() + r.stats.tokens.len();
    let (_, _, fp16) = Method::Fp16.resident_bits(&model.config, n, None)?;
    println!(
        "\n{} · {} prompt + {} generated tokens · prefill {:.0} tokens/s · decode {:.1} tokens/s · KV cache {} B resident ({:.0} B/token) vs fp16 {} B ({:.2}× smaller)",
        r.method, prompt.len(), r.stats.tokens.len(), r.stats.prefill_tokens_per_s, r.stats.decode_tokens_per_s,
        r.resident, r.resident as f64 / n as f64, fp16, fp16 as f64 / r.resident as f64
    );
    Ok(())
}

/// Mean KL(fp16 ‖ method) and top-1 agreement over the generated positions, both caches
/// teacher-forced on the same tokens (the fp16 run's text).
fn agreement(model: &Llama, ids: &[u32], from: usize, method: &Method) -> AnyResult<(f64, f64)> {
    let logits = |m: &Method| -> AnyResult<Vec<f32>> {
        let mut s: Box<dyn KvStore> = m.store(&model.config, ids.len(), None)?;
        let mut l = model.forward(ids, s.as_mut(), from)?;
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
    Ok((kl / n.max(1) as f64, agree as f64 / n.max(1) as f64))
}

#[derive(clap::Args)]
pub struct DemoArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, default_value_t = 80)]
    max_tokens: usize,
    /// The compressed configuration to show next to fp16.
    #[arg(long, default_value = DEFAULT_METHOD)]
    method: String,
}

pub fn demo(a: &DemoArgs) -> AnyResult {
    let t0 = std::time::Instant::now();
    let method = Method::parse(&a.method)?;
    let (model, tok) = a.model.load()?;
    let prompt = tok.encode(DEMO_PROMPT)?;
    println!("prompt: {DEMO_PROMPT}\n");
    let runs: Vec<Run> = [Method::Fp16, method.clone()]
        .iter()
        .map(|m| run_one(&model, &tok, &prompt, m, a.max_tokens, false))
        .collect::<AnyResult<_>>()?;
    for r in &runs {
        println!("── {} ──\n{DEMO_PROMPT}{}\n", r.method, r.text);
    }
    let ids: Vec<u32> = prompt.iter().chain(&runs[0].stats.tokens).copied().collect();
    let (kl, top1) = agreement(&model, &ids, prompt.len() - 1, &method)?;
    let c = &model.config;
    let rows: Vec<Vec<String>> = runs
        .iter()
        .map(|r| {
            let n = prompt.len() + r.stats.tokens.len();
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
    print_table_to(&["KV cache", "bits/value K / V", "bytes/token", "resident bytes", "decode tokens/s"], &rows, None)?;
    println!(
        "\n{} vs fp16 on the same {} generated positions (teacher-forced): mean KL {kl:.5} nats, top-1 agreement {:.1} %",
        method, runs[0].stats.tokens.len(), 100.0 * top1
    );
    println!(
        "cache {:.2}× smaller than fp16 · demo took {:.0} s",
        runs[0].resident as f64 / runs[1].resident as f64,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

#[derive(clap::Args)]
pub struct PasskeyArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt lengths in tokens.
    #[arg(long, value_delimiter = ',', default_value = "1024,2048,4096,8192")]
    lengths: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "fp16,turboquant_mse:4:eden/turboquant_mse:3,q4_0:rot")]
    methods: Vec<String>,
    /// Depths of the hidden number (fraction of the filler).
    #[arg(long, value_delimiter = ',', default_value = "0.1,0.5,0.9")]
    depths: Vec<f64>,
    /// Trials per depth.
    #[arg(long, default_value_t = 1)]
    n: usize,
    #[arg(long, default_value_t = 7)]
    seed: u64,
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    #[arg(long)]
    md: Option<std::path::PathBuf>,
    /// Calibration text for calibrated formats (default: ../shared/data/wikitext-2-raw-test.txt).
    #[arg(long)]
    text: Option<std::path::PathBuf>,
    /// First calibration token in that text (default: where `eval`'s default run calibrates,
    /// after its 80 windows of 512) and how many.
    #[arg(long, default_value_t = 80 * 512)]
    calib_from: usize,
    #[arg(long, default_value_t = 2048)]
    calib_tokens: usize,
}

pub fn passkey(a: &PasskeyArgs) -> AnyResult {
    let methods: Vec<Method> = a.methods.iter().map(|m| Method::parse(m)).collect::<AnyResult<_>>()?;
    let (model, tok) = a.model.load()?;
    let cal = if methods.iter().any(Method::needs_calibration) {
        Some(crate::model::calibration_from_text(&model, &tok, a.text.as_deref(), a.calib_from, a.calib_tokens)?)
    } else {
        None
    };
    let mut rows = Vec::new();
    let mut out = Vec::new();
    for m in &methods {
        let mut row = vec![m.to_string()];
        for &len in &a.lengths {
            let (mm, c, cal) = (m.clone(), model.config.clone(), cal.clone());
            let mut f = move || mm.store(&c, len + 64, cal.as_ref()).map_err(veloxquant_llm::LlmError::StoreBackend);
            let s = passkey_accuracy(&model, &tok, &mut f, len, &a.depths, a.n, a.seed, PasskeyFormat::Plain)?;
            eprintln!("{m} @ {len}: {}/{}", s.n_correct, s.n_trials);
            row.push(format!("{}/{}", s.n_correct, s.n_trials));
            out.push(serde_json::json!({"method": m.to_string(), "tokens": len, "correct": s.n_correct, "trials": s.n_trials, "accuracy": s.accuracy()}));
        }
        rows.push(row);
    }
    let header: Vec<String> =
        std::iter::once("method".to_string()).chain(a.lengths.iter().map(|l| format!("{l} tokens"))).collect();
    let header: Vec<&str> = header.iter().map(String::as_str).collect();
    print_table_to(&header, &rows, a.md.as_deref())?;
    if let Some(p) = &a.json {
        crate::util::write_json(p, &serde_json::Value::Array(out))?;
    }
    Ok(())
}

pub fn fetch(a: &ModelArgs) -> AnyResult {
    let p = a.path()?;
    println!("{}", p.display());
    Ok(())
}
