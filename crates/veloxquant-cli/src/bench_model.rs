//! `veloxquant bench model`: the model's prefill and decode tokens/s per KV-cache method,
//! measured the way llama.cpp's llama-bench measures them, so the two can share a table.
//!
//! `ppN` times one [`Llama::forward`] of N tokens into a cache already holding `depth`
//! tokens; `tgN` times N forwards of one token each (with `--batch B > 1`, B sequences
//! advanced by one `forward_batch` per step; tokens/s counts all B). As in llama-bench, all
//! tokens are random ids (fixed seeds), the depth's context is filled untimed in chunks of
//! 512, and each row has one untimed warm-up on an empty cache (pp: the N tokens, tg: one
//! step). The depth is filled once per method; every rep, and each of the B sequences,
//! then starts from its own untimed copy of that filled cache. Not a trim back to it: a
//! trimmed compressed cache holds a shorter fp16 window than a filled one (and in page mode
//! a partly trimmed page returns to fp16), so later reps would measure another state. Not
//! a fork: forks share their pages, and B sequences reading one set of pages read less
//! memory than B real ones.

use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::ValueEnum;
use serde_json::json;
use veloxquant::rng::{derive_seed, SplitMix64};
use veloxquant::PagedCache;
use veloxquant_llm::{BatchItem, BatchStore, CompressedStore, Fp16Store, KvStore, Llama, LlamaConfig};

use crate::check::{bad, count, methods, nonempty, ArgError, Ctx};
use crate::demo::Weights;
use crate::files::OutputKind;
use crate::model::{Method, ModelArgs, DEFAULT_METHOD};
use crate::util::{print_table_to, write_json, AnyResult};

#[derive(clap::Args)]
pub struct ModelBenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// KV-cache methods: `fp16` or `KSPEC[/VSPEC][@R][+S]`, as `generate --method`.
    #[arg(long, value_delimiter = ',', default_values = ["fp16", DEFAULT_METHOD])]
    methods: Vec<String>,
    /// `ppN`: prefill N tokens in one forward; `tgN`: decode N tokens, one forward each.
    #[arg(long, value_delimiter = ',', default_value = "pp512,tg32")]
    tests: Vec<String>,
    /// Tokens the cache holds before each test (random ids, filled untimed); depth + N must
    /// fit the model's context.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    depths: Vec<usize>,
    /// Sequences decoded together in tg tests, each with its own cache (pp tests run one).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    batch: Vec<usize>,
    /// Timed runs per row (the table gives their median, min and max).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// How the CPU holds the weights, as `generate --weights`.
    #[arg(long, value_enum, default_value_t = Weights::default())]
    weights: Weights,
    /// Threads of the pool every parallel step runs on (default: one per core).
    #[arg(long)]
    threads: Option<usize>,
    /// Rows as JSON: engine, cache, test, depth, tokens_per_s (median), batch, and more.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One test: N tokens prefilled in one forward, or decoded one forward per token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Test {
    Prefill(usize),
    Decode(usize),
}

impl Test {
    pub fn parse(s: &str) -> Result<Self, ArgError> {
        let why = "want ppN (prefill N tokens) or tgN (decode N tokens), N a whole number ≥ 1";
        let (kind, n): (fn(usize) -> Self, &str) = match (s.strip_prefix("pp"), s.strip_prefix("tg")) {
            (Some(n), _) => (Self::Prefill, n),
            (_, Some(n)) => (Self::Decode, n),
            _ => return Err(bad("tests", s, why)),
        };
        match n.parse::<usize>() {
            Ok(v) if v >= 1 && n.bytes().all(|c| c.is_ascii_digit()) => Ok(kind(v)),
            _ => Err(bad("tests", s, why)),
        }
    }

    pub fn n_tokens(self) -> usize {
        match self {
            Self::Prefill(n) | Self::Decode(n) => n,
        }
    }
}

impl std::fmt::Display for Test {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Prefill(n) => write!(f, "pp{n}"),
            Self::Decode(n) => write!(f, "tg{n}"),
        }
    }
}

const MAX_REPS: usize = 1000;
const MAX_BATCH: usize = 256;
const MAX_THREADS: usize = 1024;
/// The depth is filled in chunks of this many tokens (llama-bench's default micro-batch).
const FILL_CHUNK: usize = 512;
/// Most fp16-equivalent KV bytes all caches of one row may hold together (the filled one
/// and B copies): beyond it a run would exhaust memory rather than measure anything.
const MAX_KV_BYTES: usize = 8 << 30;
const FILL_SEED: u64 = 0x5eed_f111;

/// The checked methods, tests (duplicates dropped, order kept) and thread count.
#[derive(Debug)]
pub struct ModelBenchPlan {
    pub methods: Vec<Method>,
    pub tests: Vec<Test>,
    pub threads: usize,
}

impl ModelBenchArgs {
    pub fn plan(&self, ctx: &Ctx) -> Result<ModelBenchPlan, ArgError> {
        let n_ctx = ctx.n_ctx();
        let methods = methods("methods", &self.methods, n_ctx, false, false)?;
        nonempty("tests", &self.tests)?;
        let mut tests: Vec<Test> = Vec::new();
        for s in &self.tests {
            let t = Test::parse(s)?;
            if !tests.contains(&t) {
                tests.push(t);
            }
        }
        nonempty("depths", &self.depths)?;
        for &d in &self.depths {
            for t in &tests {
                let need = d.saturating_add(t.n_tokens());
                if need > n_ctx {
                    let limit = match ctx.model {
                        Some(m) => format!("the model's context is {} tokens", m.n_ctx),
                        None => format!("no context longer than {n_ctx} tokens is supported"),
                    };
                    return Err(bad("depths", d, format!("{t} after {d} tokens needs {need} positions: {limit}")));
                }
            }
        }
        nonempty("batch", &self.batch)?;
        for &b in &self.batch {
            count("batch", b, 1..=MAX_BATCH)?;
        }
        count("reps", self.reps, 1..=MAX_REPS)?;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = count("threads", self.threads.unwrap_or(cores), 1..=MAX_THREADS)?;
        ctx.output(self.json.as_ref(), OutputKind::Json, &[])?;
        Ok(ModelBenchPlan { methods, tests, threads })
    }
}

/// A cache filled to a depth, and independent copies of it (see the module doc).
enum Filled {
    Fp16(Fp16Store),
    Compressed(CompressedStore),
}

impl Filled {
    fn empty(m: &Method, c: &LlamaConfig, n_tokens: usize) -> AnyResult<Self> {
        Ok(match m.cache_config_for(c, None) {
            None => Self::Fp16(Fp16Store::for_config(c, n_tokens)),
            Some(cfg) => Self::Compressed(CompressedStore::new(cfg)?),
        })
    }

    fn store(&mut self) -> &mut dyn KvStore {
        match self {
            Self::Fp16(s) => s,
            Self::Compressed(s) => s,
        }
    }

    /// A copy holding the same tokens in memory of its own, with room for `room` more.
    fn copy(&self, room: usize) -> AnyResult<Box<dyn BatchStore>> {
        Ok(match self {
            Self::Fp16(s) => Box::new(s.copy_with_room(room)),
            Self::Compressed(s) => {
                let c = s.cache();
                Box::new(CompressedStore::from_cache(PagedCache::from_contents(c.config().clone(), c.contents())?))
            }
        })
    }
}

fn random_ids(rng: &mut SplitMix64, n: usize, n_vocab: usize) -> Vec<u32> {
    (0..n).map(|_| (rng.next_u64() % n_vocab as u64) as u32).collect()
}

/// `depth` random tokens (the same for every method) through the model into a new cache.
fn fill(model: &Llama, m: &Method, depth: usize, room: usize) -> AnyResult<Filled> {
    let c = &model.config;
    let mut f = Filled::empty(m, c, depth + room)?;
    let ids = random_ids(&mut SplitMix64::new(FILL_SEED), depth, c.n_vocab);
    let t = Instant::now();
    for chunk in ids.chunks(FILL_CHUNK) {
        model.forward(chunk, f.store(), chunk.len())?;
    }
    if depth > 0 {
        eprintln!("{m}: filled {depth} tokens in {:.1} s (untimed)", t.elapsed().as_secs_f64());
    }
    Ok(f)
}

/// One run of `test` over `stores` (one for pp) with fresh random `ids`; returns seconds.
fn run_test(model: &Llama, test: Test, stores: &mut [Box<dyn BatchStore>], ids: &[u32]) -> AnyResult<f64> {
    let t = Instant::now();
    match (test, stores) {
        (Test::Prefill(n), [s]) => drop(black_box(model.forward(ids, s.as_mut(), n - 1)?)),
        (Test::Decode(_), [s]) => {
            for id in ids.chunks(1) {
                black_box(model.forward(id, s.as_mut(), 0)?);
            }
        }
        (Test::Decode(_), stores) => {
            let b = stores.len();
            for step in ids.chunks(b) {
                let mut items: Vec<BatchItem> = stores
                    .iter_mut()
                    .zip(step.chunks(1))
                    .map(|(s, tokens)| BatchItem { tokens, store: s.as_mut(), logits_from: 0 })
                    .collect();
                black_box(model.forward_batch(&mut items)?);
            }
        }
        (Test::Prefill(_), _) => return Err("internal: a prefill test runs one sequence".into()),
    }
    Ok(t.elapsed().as_secs_f64())
}

/// Tokens/s of each rep and the tokens the caches gained over all reps, for each batch size
/// of `batches`: after one warm-up each, the reps alternate between the batch sizes (rep r
/// of every size, then rep r + 1), so a drift in the machine's speed reaches all sizes
/// alike and their ratio stays fair.
fn measure(
    model: &Llama,
    m: &Method,
    base: &Filled,
    depth: usize,
    test: Test,
    batches: &[usize],
    reps: usize,
) -> AnyResult<Vec<(Vec<f64>, usize)>> {
    let (n, nv) = (test.n_tokens(), model.config.n_vocab);
    let ids_per_run = |b: usize| match test {
        Test::Prefill(_) => n,
        Test::Decode(_) => n * b,
    };
    let seed = |b: usize, rep: u64| derive_seed(FILL_SEED, &[depth as u64, n as u64, b as u64, rep]);
    let empty = Filled::empty(m, &model.config, n)?;
    for &b in batches {
        // Warm-up on empty caches: the N prompt tokens, or one decode step.
        let (warm_test, warm_ids) = match test {
            Test::Prefill(_) => (test, n),
            Test::Decode(_) => (Test::Decode(1), b),
        };
        let mut warm: Vec<Box<dyn BatchStore>> = (0..b).map(|_| empty.copy(n)).collect::<AnyResult<_>>()?;
        run_test(model, warm_test, &mut warm, &random_ids(&mut SplitMix64::new(seed(b, u64::MAX)), warm_ids, nv))?;
    }
    let mut out: Vec<(Vec<f64>, usize)> = batches.iter().map(|_| (Vec::with_capacity(reps), 0)).collect();
    for rep in 0..reps {
        for (&b, (rates, counted)) in batches.iter().zip(out.iter_mut()) {
            let mut stores: Vec<Box<dyn BatchStore>> = (0..b).map(|_| base.copy(n)).collect::<AnyResult<_>>()?;
            let ids = random_ids(&mut SplitMix64::new(seed(b, rep as u64)), ids_per_run(b), nv);
            let secs = run_test(model, test, &mut stores, &ids)?;
            let gained: usize = stores.iter().map(|s| s.len(0) - depth).sum();
            *counted += gained;
            rates.push(gained as f64 / secs);
        }
    }
    Ok(out)
}

/// (median, min, max); the median of an even count is the mean of the middle two.
fn median_min_max(xs: &[f64]) -> (f64, f64, f64) {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let k = v.len();
    let med = if k % 2 == 1 { v[k / 2] } else { (v[k / 2 - 1] + v[k / 2]) / 2.0 };
    (med, v[0], v[k - 1])
}

/// Bytes the fp16 cache takes per token (an upper bound for the compressed ones).
fn fp16_bytes_per_token(c: &LlamaConfig) -> usize {
    2 * c.n_layers * c.n_kv_heads * c.head_dim * 2
}

pub fn run(a: &ModelBenchArgs, p: &ModelBenchPlan, model_path: &Path) -> AnyResult {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(p.threads).build()?;
    pool.install(|| run_in_pool(a, p, model_path))
}

fn run_in_pool(a: &ModelBenchArgs, p: &ModelBenchPlan, model_path: &Path) -> AnyResult {
    let model = Llama::load(model_path, a.weights.mode())?;
    let c = &model.config;
    let room = p.tests.iter().map(|t| t.n_tokens()).max().unwrap_or(0);
    let b_max = a.batch.iter().copied().max().unwrap_or(1);
    for &d in &a.depths {
        let bytes = (b_max + 1).saturating_mul(d + room).saturating_mul(fp16_bytes_per_token(c));
        if bytes > MAX_KV_BYTES {
            let why = format!(
                "{} caches of {} tokens would hold {:.1} GiB, more than {} GiB",
                b_max + 1,
                d + room,
                bytes as f64 / (1u64 << 30) as f64,
                MAX_KV_BYTES >> 30
            );
            return Err(bad("batch", b_max, why).into());
        }
    }
    let threads = rayon::current_num_threads();
    let weights = a.weights.to_possible_value().map_or("?".to_string(), |v| v.get_name().to_string());
    let model_name = model_path.file_name().map_or(String::new(), |f| f.to_string_lossy().into_owned());
    eprintln!("{model_name}: {threads} threads, weights {weights}, {} reps", a.reps);
    let (mut rows, mut out) = (Vec::new(), Vec::new());
    for m in &p.methods {
        for &depth in &a.depths {
            let base = fill(&model, m, depth, room)?;
            for &test in &p.tests {
                let batches: &[usize] = if matches!(test, Test::Decode(_)) { &a.batch } else { &[1] };
                let measured = measure(&model, m, &base, depth, test, batches, a.reps)?;
                for (&b, (rates, tokens)) in batches.iter().zip(measured) {
                    let (med, lo, hi) = median_min_max(&rates);
                    let name = if depth > 0 { format!("{test} @ d{depth}") } else { test.to_string() };
                    let row = vec![
                        m.to_string(),
                        weights.clone(),
                        threads.to_string(),
                        b.to_string(),
                        name,
                        format!("{med:.2}"),
                        format!("{lo:.2}–{hi:.2}"),
                    ];
                    eprintln!("{}", row.join(" | "));
                    rows.push(row);
                    out.push(json!({
                        "engine": "veloxquant", "cache": m.to_string(), "test": test.to_string(), "depth": depth,
                        "tokens_per_s": med, "batch": b, "reps": a.reps, "min": lo, "max": hi,
                        "samples_ts": rates, "tokens": tokens, "threads": threads, "weights": weights,
                        "model": model_name,
                    }));
                }
            }
        }
    }
    print_table_to(&["cache", "weights", "threads", "batch", "test", "t/s (median)", "min–max"], &rows, None)?;
    if let Some(path) = &a.json {
        write_json(path, &serde_json::Value::Array(out))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::check::{plan, ModelInfo, Plan};
    use crate::{BenchCmd, Cli, Cmd};

    fn plan_with(args: &[&str], n_ctx: usize) -> Result<ModelBenchPlan, ArgError> {
        let argv = ["veloxquant", "bench", "model"].iter().chain(args);
        let cli = Cli::try_parse_from(argv).unwrap();
        assert!(matches!(cli.cmd, Cmd::Bench { which: BenchCmd::Model(_) }));
        let info = ModelInfo { path: PathBuf::from("/nonexistent/model.gguf"), n_ctx };
        match plan(&cli.cmd, &Ctx { force: false, model: Some(&info) })? {
            Plan::ModelBench(p) => Ok(p),
            _ => panic!("not a model bench plan"),
        }
    }

    #[test]
    fn test_names_parse_or_are_refused() {
        assert_eq!(Test::parse("pp512").unwrap(), Test::Prefill(512));
        assert_eq!(Test::parse("tg32").unwrap(), Test::Decode(32));
        assert_eq!(Test::parse("tg32").unwrap().to_string(), "tg32");
        for s in ["pp0", "tg0", "pp", "tg", "xx5", "pp+5", "pp-1", "PP5", "pp5 ", "tg18446744073709551616", ""] {
            let e = Test::parse(s).unwrap_err().to_string();
            assert!(e.starts_with(&format!("--tests {s}:")) && e.contains("ppN"), "{s}: {e}");
        }
    }

    #[test]
    fn arguments_are_checked_against_the_model_context() {
        let p = plan_with(&["--tests", "tg32,pp512,tg32", "--depths", "0,4096,8000"], 16_384).unwrap();
        assert_eq!(p.tests, [Test::Decode(32), Test::Prefill(512)]);
        assert_eq!(p.methods.len(), 2);
        assert!(plan_with(&["--tests", "tg32", "--depths", "8000"], 8192).is_ok());
        assert!(plan_with(&["--tests", "tg32", "--depths", "8160"], 8192).is_ok());
        let e = plan_with(&["--tests", "tg32,pp512", "--depths", "0,8000"], 8192).unwrap_err().to_string();
        assert_eq!(
            e,
            "--depths 8000: pp512 after 8000 tokens needs 8512 positions: the model's context is 8192 tokens"
        );
        let e = plan_with(&["--tests", "tg33", "--depths", "8160"], 8192).unwrap_err().to_string();
        assert!(e.contains("needs 8193 positions"), "{e}");
        for (args, want) in [
            (&["--tests", "pp0"][..], "--tests pp0:"),
            (&["--tests", "bogus"], "--tests bogus:"),
            (&["--batch", "0"], "--batch 0:"),
            (&["--batch", "257"], "--batch 257:"),
            (&["--reps", "0"], "--reps 0:"),
            (&["--threads", "0"], "--threads 0:"),
            (&["--methods", "nope:4"], "--methods"),
            (&["--methods", "vecinfer:8:g4"], "does not calibrate"),
            (&["--depths", "18446744073709551615"], "needs 18446744073709551615 positions"),
        ] {
            let e = plan_with(args, 8192).unwrap_err().to_string();
            assert!(e.contains(want), "{args:?}: {e}");
        }
    }

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median_min_max(&[3.0, 1.0, 2.0]), (2.0, 1.0, 3.0));
        assert_eq!(median_min_max(&[4.0, 1.0, 3.0, 2.0]), (2.5, 1.0, 4.0));
        assert_eq!(median_min_max(&[7.0]), (7.0, 7.0, 7.0));
    }

    /// A copy of a filled cache is the filled state itself: the next token's logits through
    /// a copy equal those through a cache filled again from scratch, for the fp16 cache and
    /// a compressed one (row mode with a window and sinks; page mode), and advancing the copy
    /// leaves the filled cache as it was.
    #[test]
    fn copies_continue_like_a_fresh_fill() {
        let path = std::env::temp_dir().join(format!("vq-bench-model-{}.gguf", std::process::id()));
        crate::tiny::write_tiny_llama(&path, 5);
        let model = Llama::load(&path, veloxquant_llm::WeightMode::DequantF32).unwrap();
        std::fs::remove_file(&path).ok();
        for spec in ["fp16", "turboquant_mse:4:eden/turboquant_mse:3@8+4", "kivi:2:g16@5"] {
            let m = Method::parse("methods", spec).unwrap();
            let depth = 70;
            let base = fill(&model, &m, depth, 4).unwrap();
            let mut copy = base.copy(4).unwrap();
            let mut fresh = fill(&model, &m, depth, 4).unwrap();
            for id in [3u32, 17, 250] {
                let a = model.forward(&[id], copy.as_mut(), 0).unwrap();
                let b = model.forward(&[id], fresh.store(), 0).unwrap();
                assert_eq!(a, b, "{spec}");
            }
            let mut again = base.copy(1).unwrap();
            assert_eq!((copy.len(0), again.len(0)), (depth + 3, depth));
            assert_eq!(model.forward(&[3], again.as_mut(), 0).unwrap(), {
                let mut f = fill(&model, &m, depth, 1).unwrap();
                model.forward(&[3], f.store(), 0).unwrap()
            });
        }
    }
}
