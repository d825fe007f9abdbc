//! `veloxquant bench model` end to end: bad arguments refused with one line before any
//! work, and runs whose JSON rows count exactly the tokens the tests ask for — on the tiny
//! random model (always) and on the real model (skipped with a message when it is absent).

#[path = "../../veloxquant-llm/tests/common/tiny.rs"]
mod tiny;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn vq(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_veloxquant")).args(args).output().unwrap()
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vq-bench-model-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn tiny_model(dir: &Path) -> String {
    let p = dir.join("tiny.gguf");
    tiny::write_tiny_llama(&p, 3);
    p.display().to_string()
}

/// The real model where `fetch-model` keeps it, if it is there.
fn real_model() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    let p = base.join("veloxquant").join("SmolLM2-135M-Instruct.Q4_1.gguf");
    p.exists().then_some(p)
}

fn failed_with(out: &Output, want: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.starts_with("error: ") && err.contains(want) && !err.contains("panicked"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
}

#[test]
fn bad_arguments_are_refused_before_any_work() {
    let dir = scratch("bad");
    let model = tiny_model(&dir);
    let json = dir.join("out.json").display().to_string();
    let run = |extra: &[&str]| {
        let mut args = vec!["bench", "model", "--model", &model, "--json", &json];
        args.extend(extra);
        vq(&args)
    };
    failed_with(&run(&["--tests", "pp512,warp9"]), "--tests warp9: want ppN");
    failed_with(&run(&["--tests", "pp0"]), "--tests pp0: want ppN");
    // The tiny model's context is 1024 tokens.
    failed_with(
        &run(&["--tests", "tg8,pp64", "--depths", "0,1000"]),
        "--depths 1000: pp64 after 1000 tokens needs 1064 positions: the model's context is 1024 tokens",
    );
    failed_with(&run(&["--batch", "0"]), "--batch 0");
    assert!(!Path::new(&json).exists(), "no output after a refusal");
    std::fs::remove_dir_all(&dir).ok();
}

/// Keys every row has, and tokens counted from the caches' lengths equal N × B × reps.
fn check_rows(rows: &[serde_json::Value], want: &[(&str, u64, u64)], reps: u64, caches: &[&str]) {
    assert_eq!(rows.len(), want.len() * caches.len(), "{rows:?}");
    for (r, (cache, &(test, depth, b))) in
        rows.iter().zip(caches.iter().flat_map(|c| std::iter::repeat(c).zip(want.iter())))
    {
        for key in ["engine", "cache", "test", "depth", "tokens_per_s", "batch", "reps", "min", "max", "threads"] {
            assert!(r.get(key).is_some(), "missing {key}: {r}");
        }
        assert_eq!(r["engine"], "veloxquant");
        assert_eq!((r["cache"].as_str(), r["test"].as_str()), (Some(*cache), Some(test)), "{r}");
        assert_eq!((r["depth"].as_u64(), r["batch"].as_u64(), r["reps"].as_u64()), (Some(depth), Some(b), Some(reps)));
        let n: u64 = test[2..].parse().unwrap();
        assert_eq!(r["tokens"].as_u64(), Some(n * b * reps), "{r}");
        let (med, lo, hi) =
            (r["tokens_per_s"].as_f64().unwrap(), r["min"].as_f64().unwrap(), r["max"].as_f64().unwrap());
        assert!(lo > 0.0 && lo <= med && med <= hi && hi.is_finite(), "{r}");
    }
}

fn run_and_rows(args: &[&str], json: &Path) -> Vec<serde_json::Value> {
    let out = vq(args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains(" cache |") && table.contains("| t/s (median) |"), "{table}");
    serde_json::from_slice(&std::fs::read(json).unwrap()).unwrap()
}

#[test]
fn tiny_run_counts_every_token() {
    let dir = scratch("tiny");
    let model = tiny_model(&dir);
    let json = dir.join("rows.json");
    let caches = ["fp16", "turboquant_mse:4:eden/turboquant_mse:3@8+4"];
    let args = [
        "bench",
        "model",
        "--model",
        &model,
        "--methods",
        &caches.join(","),
        "--tests",
        "pp16,tg5",
        "--depths",
        "0,40",
        "--batch",
        "1,3",
        "--reps",
        "2",
        "--threads",
        "1",
        "--json",
    ];
    let rows = run_and_rows(&[&args[..], &[json.to_str().unwrap()]].concat(), &json);
    let want = [("pp16", 0, 1), ("tg5", 0, 1), ("tg5", 0, 3), ("pp16", 40, 1), ("tg5", 40, 1), ("tg5", 40, 3)];
    check_rows(&rows, &want, 2, &caches);
    assert!(rows.iter().all(|r| r["threads"] == 1 && r["weights"] == "q8"), "generate's default weights");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn real_model_run_counts_every_token() {
    let Some(model) = real_model() else {
        let name = std::thread::current().name().unwrap_or("test").to_string();
        let _ = writeln!(std::io::stderr(), "SKIP {name}: no SmolLM2-135M-Instruct.Q4_1.gguf in the cache");
        return;
    };
    let dir = scratch("real");
    let json = dir.join("rows.json");
    let args = [
        "bench",
        "model",
        "--model",
        model.to_str().unwrap(),
        "--tests",
        "pp32,tg4",
        "--depths",
        "64",
        "--batch",
        "1,2",
        "--reps",
        "2",
        "--json",
    ];
    let rows = run_and_rows(&[&args[..], &[json.to_str().unwrap()]].concat(), &json);
    check_rows(
        &rows,
        &[("pp32", 64, 1), ("tg4", 64, 1), ("tg4", 64, 2)],
        2,
        &["fp16", "turboquant_mse:4:eden/turboquant_mse:3@8+4"],
    );
    std::fs::remove_dir_all(&dir).ok();
}
