//! The step between parsing and any work: every subcommand's arguments are checked here
//! (and in each command's `plan`), giving a plan of validated values or a one-line typed
//! error. Runs twice: before the model is fetched (everything that needs no model), then
//! with the model's context from its GGUF metadata (lengths bounded by it).

use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};

use veloxquant::VqError;

use crate::files::{check_output, OutputKind};
use crate::model::{Method, ModelArgs};

/// Why arguments were refused; the message names the argument and the bound.
#[derive(Debug, thiserror::Error)]
pub enum ArgError {
    #[error("--{arg} {value}: {why}")]
    Bad { arg: &'static str, value: String, why: String },
    #[error("--{arg} {value:?}: {source}")]
    Spec { arg: &'static str, value: String, source: VqError },
    #[error("{}: {why}", path.display())]
    File { path: PathBuf, why: String },
}

pub fn bad(arg: &'static str, value: impl std::fmt::Display, why: impl Into<String>) -> ArgError {
    ArgError::Bad { arg, value: value.to_string(), why: why.into() }
}

/// What the model brings to the checks: its file (never overwritten) and its context.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    pub path: PathBuf,
    pub n_ctx: usize,
}

impl ModelInfo {
    /// The model's file (fetched when it is the default) and its context from the GGUF
    /// header; no weight is read.
    pub fn open(args: &ModelArgs) -> crate::util::AnyResult<Self> {
        let path = args.path()?;
        crate::files::check_input(&path, "model")?;
        let g = veloxquant_llm::gguf::Gguf::open(&path)?;
        let c = veloxquant_llm::LlamaConfig::from_metadata(&g)?;
        Ok(Self { path, n_ctx: c.n_ctx_train })
    }
}

/// What every check may use: `--force`, and the model once it is known.
#[derive(Clone, Copy, Debug)]
pub struct Ctx<'a> {
    pub force: bool,
    pub model: Option<&'a ModelInfo>,
}

impl Ctx<'_> {
    /// The model's context, or (before the model is known) the largest window a cache
    /// takes, so that the first pass only refuses what no model could accept.
    pub fn n_ctx(&self) -> usize {
        self.model.map_or(veloxquant::cache::MAX_WINDOW_TOKENS, |m| m.n_ctx)
    }

    /// A length in `lo..=` the context less `reserve` tokens (the prompt, the answer), with
    /// a message that names the context.
    pub fn within_context(&self, arg: &'static str, v: usize, lo: usize, reserve: usize) -> Result<usize, ArgError> {
        let hi = self.n_ctx().saturating_sub(reserve);
        if v < lo {
            return Err(bad(arg, v, format!("must be at least {lo}")));
        }
        if v <= hi {
            return Ok(v);
        }
        let less = if reserve > 0 { format!(", less {reserve} for the rest of the text") } else { String::new() };
        let why = match self.model {
            Some(m) => format!("must be at most {hi}: the model's context is {} tokens{less}", m.n_ctx),
            None => format!("must be at most {hi}: no context longer than {} tokens is supported", self.n_ctx()),
        };
        Err(bad(arg, v, why))
    }

    /// An output file, checked against the model file and `inputs`.
    pub fn output(&self, path: Option<&PathBuf>, kind: OutputKind, inputs: &[&Path]) -> Result<(), ArgError> {
        let Some(path) = path else { return Ok(()) };
        let mut all: Vec<&Path> = inputs.to_vec();
        all.extend(self.model.map(|m| m.path.as_path()));
        check_output(path, kind, &all, self.force)
    }
}

/// A count within `range`.
pub fn count(arg: &'static str, v: usize, range: RangeInclusive<usize>) -> Result<usize, ArgError> {
    if range.contains(&v) {
        Ok(v)
    } else {
        Err(bad(arg, v, format!("must be in {}..={}", range.start(), range.end())))
    }
}

/// A non-empty list.
pub fn nonempty<T>(arg: &'static str, v: &[T]) -> Result<(), ArgError> {
    if v.is_empty() {
        return Err(bad(arg, "(empty)", "give at least one value"));
    }
    Ok(())
}

/// A method, with R and S at most `n_ctx` (the tokens the cache will ever hold) and, unless
/// `calibrated` is allowed, no format that needs calibration.
pub fn method(arg: &'static str, s: &str, n_ctx: usize, calibrated: bool) -> Result<Method, ArgError> {
    let m = Method::parse(arg, s)?;
    if let Method::Compressed { recent, sink, .. } | Method::PerLayer { recent, sink, .. } = &m {
        for (what, v) in [("R after '@'", *recent), ("S after '+'", *sink)] {
            if v > n_ctx {
                return Err(bad(arg, s, format!("{what} is {v}, more than the {n_ctx} tokens the cache can hold")));
            }
        }
    }
    if !calibrated && m.needs_calibration() {
        return Err(bad(
            arg,
            s,
            "this command does not calibrate: pick a method without a calibrated format (vecinfer, turboquant_frac)",
        ));
    }
    Ok(m)
}

/// Several methods, duplicates (and the always-present fp16 reference when `drop_fp16`)
/// removed, order kept.
pub fn methods(
    arg: &'static str,
    list: &[String],
    n_ctx: usize,
    calibrated: bool,
    drop_fp16: bool,
) -> Result<Vec<Method>, ArgError> {
    nonempty(arg, list)?;
    let mut out: Vec<Method> = Vec::new();
    for s in list {
        let m = method(arg, s, n_ctx, calibrated)?;
        let skip = out.contains(&m) || (drop_fp16 && m == Method::Fp16);
        if !skip {
            out.push(m);
        }
    }
    Ok(out)
}

/// Output paths of one command must differ (the later write would replace the earlier).
pub fn distinct(paths: &[Option<&PathBuf>]) -> Result<(), ArgError> {
    let given: Vec<&PathBuf> = paths.iter().flatten().copied().collect();
    for (i, p) in given.iter().enumerate() {
        if given[..i].contains(p) {
            return Err(ArgError::File { path: p.to_path_buf(), why: "named for two outputs".into() });
        }
    }
    Ok(())
}

/// `--merge` of earlier outputs: regular input files, outputs that differ from each other
/// and may be written (never over an input).
pub fn merge_plan(inputs: &[PathBuf], outputs: [Option<&PathBuf>; 3], ctx: &Ctx) -> Result<(), ArgError> {
    for p in inputs {
        crate::files::check_input(p, "merge")?;
    }
    let ins: Vec<&Path> = inputs.iter().map(PathBuf::as_path).collect();
    distinct(&outputs)?;
    let kinds = [OutputKind::Json, OutputKind::Markdown, OutputKind::Svg];
    for (o, k) in outputs.into_iter().zip(kinds) {
        ctx.output(o, k, &ins)?;
    }
    Ok(())
}

/// A command's checked values (what it needs beyond its parsed arguments).
pub enum Plan {
    Gen(crate::demo::GenPlan),
    Methods(Vec<Method>),
    Eval(crate::eval::EvalPlan),
    Specs(Vec<veloxquant::FormatSpec>),
    Cache(Option<crate::demo::GenPlan>),
    Bench(crate::bench::BenchPlan),
    ModelBench(crate::bench_model::ModelBenchPlan),
    /// A checked input text.
    Text(PathBuf),
    Nothing,
}

/// Every subcommand's checks: a plan, or the first argument refused.
pub fn plan(cmd: &crate::Cmd, ctx: &Ctx) -> Result<Plan, ArgError> {
    use crate::{BenchCmd, Cmd};
    Ok(match cmd {
        Cmd::Demo(a) => Plan::Gen(a.plan(ctx)?),
        Cmd::Eval(a) => Plan::Eval(a.plan(ctx)?),
        Cmd::Allocate(a) => Plan::Text(a.plan(ctx)?),
        Cmd::Generate(a) => Plan::Gen(a.plan(ctx, 1, 1)?),
        Cmd::Passkey(a) => Plan::Methods(a.plan(ctx)?),
        Cmd::FetchModel(a) => {
            if let Some(p) = &a.model {
                crate::files::check_input(p, "model")?;
            }
            Plan::Nothing
        }
        Cmd::Distortion { d, n, formats, json, plot, md } => {
            Plan::Specs(crate::distortion::plan((*d, *n), formats, [json.as_ref(), plot.as_ref(), md.as_ref()], ctx)?)
        }
        Cmd::Cache { which } => Plan::Cache(which.plan(ctx)?),
        // Checked by the serve command itself (and per request by the server).
        Cmd::Serve(_) => Plan::Nothing,
        Cmd::Bench { which: BenchCmd::Cpu(a) } => Plan::Bench(a.plan(ctx)?),
        Cmd::Bench { which: BenchCmd::Model(a) } => Plan::ModelBench(a.plan(ctx)?),
        // Parsed and checked by veloxquant-cuda's own bench driver.
        Cmd::Bench { which: BenchCmd::Cuda { .. } } => Plan::Nothing,
        Cmd::Bench { which: BenchCmd::E2e(a) } => {
            e2e(a, ctx)?;
            Plan::Nothing
        }
        Cmd::Bench { which: BenchCmd::E2eReport(a) } => {
            e2e_report(a, ctx)?;
            Plan::Nothing
        }
    })
}

/// `bench e2e`: batches, contexts, methods, replays and the fit budget, bounded.
fn e2e(a: &crate::gpu::E2eArgs, ctx: &Ctx) -> Result<(), ArgError> {
    for (arg, list, max) in
        [("batch", &a.batch, 1 << 12), ("context", &a.context, veloxquant::cache::MAX_WINDOW_TOKENS)]
    {
        nonempty(arg, list)?;
        for &v in list.iter() {
            count(arg, v, 1..=max)?;
        }
    }
    methods("methods", &a.methods, veloxquant::cache::MAX_WINDOW_TOKENS, false, false)?;
    count("iters", a.iters, 1..=100_000)?;
    let window = veloxquant::cache::MAX_WINDOW_TOKENS;
    count("prefill-tokens", a.prefill_tokens, 0..=window)?;
    count("prefill-seqs", a.prefill_seqs, 1..=1 << 12)?;
    count("prefill-chunk", a.prefill_chunk, 1..=window)?;
    if let Some(r) = a.prefill_rows {
        count("prefill-rows", r, a.prefill_chunk.min(a.prefill_tokens.max(1))..=1 << 20)?;
    }
    if let Some(f) = a.fit.filter(|f| !(f.is_finite() && *f > 0.0)) {
        return Err(bad("fit", f, "must be a positive number of GiB"));
    }
    ctx.output(a.json.as_ref(), OutputKind::Json, &[])
}

/// `bench e2e-report`: regular input files, outputs that may be written.
fn e2e_report(a: &crate::gpu::E2eReportArgs, ctx: &Ctx) -> Result<(), ArgError> {
    nonempty("ours", &a.ours)?;
    let inputs: Vec<&Path> = a.ours.iter().chain(&a.hf).map(PathBuf::as_path).collect();
    for p in &inputs {
        crate::files::check_input(p, "bench output")?;
    }
    count("svg-context", a.svg_context, 1..=veloxquant::cache::MAX_WINDOW_TOKENS)?;
    distinct(&[Some(&a.json), a.md.as_ref(), a.svg.as_ref()])?;
    ctx.output(Some(&a.json), OutputKind::Json, &inputs)?;
    ctx.output(a.md.as_ref(), OutputKind::Markdown, &inputs)?;
    ctx.output(a.svg.as_ref(), OutputKind::Svg, &inputs)
}

#[cfg(test)]
#[path = "check_tests.rs"]
mod tests;
