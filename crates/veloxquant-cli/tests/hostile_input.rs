//! The CLI as a hostile or careless user drives it (issue 14), on a tiny random model
//! written at test time (context 256, so every bound is near): each command either works
//! or exits 1 with a one-line `error:`, never a panic, a signal, an allocation abort or a
//! hang, and no file but the one asked for (and only a replaceable one) is ever written.

#[path = "../../veloxquant-llm/tests/common/tiny.rs"]
mod tiny;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let d = std::env::temp_dir().join(format!("vq-hostile-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        Self(d)
    }
    fn path(&self, name: &str) -> String {
        self.0.join(name).display().to_string()
    }
    fn model(&self) -> String {
        let p = self.path("tiny.gguf");
        if !Path::new(&p).exists() {
            tiny::write_tiny_llama(Path::new(&p), 11);
        }
        p
    }
    /// Every file in the folder (temporary files must not be left behind).
    fn listing(&self) -> Vec<String> {
        let mut v: Vec<String> =
            std::fs::read_dir(&self.0).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into()).collect();
        v.sort();
        v
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

/// Runs the binary; a run past 60 s is killed and fails the test.
fn vq(args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_veloxquant"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > Duration::from_secs(60) {
            child.kill().ok();
            panic!("hung past 60 s: {args:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// Exit code 1 (not a signal) and exactly one line on stderr, `error: …` containing `want`.
fn refused(out: &Output, want: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "status {:?}: {err}", out.status);
    let lines: Vec<&str> = err.lines().collect();
    assert!(lines.len() == 1 && lines[0].starts_with("error: ") && !err.contains("panicked"), "{err}");
    assert!(err.contains(want), "want {want:?} in {err}");
}

fn ok(out: &Output) -> String {
    assert!(out.status.success(), "{:?}: {}", out.status, String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn prompts_shorter_than_the_sinks_just_work() {
    let s = Scratch::new("sinks");
    let m = s.model();
    // "Hello" is 3 tokens (He, ll, o) under the default method's S = 4.
    let out = vq(&["generate", "--model", &m, "--prompt", "Hello", "--max-tokens", "3"]);
    assert!(ok(&out).contains("3 prompt + "), "{}", ok(&out));
    let txt = text(&s);
    // Windows of 4 tokens under S = 6 sinks (eval --ctx 4 --methods …+6).
    let methods = "turboquant_mse:4+6";
    ok(&vq(&["eval", "--model", &m, "--text", &txt, "--ctx", "4", "--windows", "2", "--methods", methods]));
    refused(&vq(&["eval", "--model", &m, "--text", &txt, "--ctx", "3"]), "--ctx 3: must be at least 4");
    let file = s.path("short.vqc");
    ok(&vq(&["cache", "save", &file, "--model", &m, "--prompt", "Hello", "--max-tokens", "2"]));
    ok(&vq(&["cache", "load", &file, "--model", &m, "--max-tokens", "2"]));
}

/// A text for `eval` that the byte-level tiny tokenizer turns into ~1,000 tokens.
fn text(s: &Scratch) -> String {
    let p = s.path("text.txt");
    if !Path::new(&p).exists() {
        std::fs::write(&p, "The quick brown fox jumps over the lazy dog. ".repeat(24)).unwrap();
    }
    p
}

#[test]
fn no_file_is_destroyed() {
    let s = Scratch::new("files");
    let m = s.model();
    let model_bytes = std::fs::read(&m).unwrap();
    // The model as the cache file: refused, also with --force, the model intact.
    for force in [false, true] {
        let mut args: Vec<&str> = vec!["cache", "save", &m, "--model", &m, "--max-tokens", "0"];
        if force {
            args.push("--force");
        }
        refused(&vq(&args), "never overwritten");
    }
    assert_eq!(std::fs::read(&m).unwrap(), model_bytes, "the model file changed");
    // Another name for the model (a hard link: same inode) is refused too.
    let alias = s.path("alias.bin");
    std::fs::hard_link(&m, &alias).unwrap();
    refused(&vq(&["cache", "save", &alias, "--model", &m, "--force"]), "never overwritten");
    // A file that is not a cache: only with --force; a cache file: replaced.
    let notes = s.path("notes.txt");
    std::fs::write(&notes, "my notes").unwrap();
    refused(&vq(&["cache", "save", &notes, "--model", &m, "--max-tokens", "0"]), "pass --force");
    assert_eq!(std::fs::read(&notes).unwrap(), b"my notes");
    let cache = s.path("c.vqc");
    ok(&vq(&["cache", "save", &cache, "--model", &m, "--max-tokens", "0"]));
    ok(&vq(&["cache", "save", &cache, "--model", &m, "--max-tokens", "0", "--prompt", "Hello"]));
    ok(&vq(&["cache", "save", &notes, "--model", &m, "--max-tokens", "0", "--force"]));
    assert!(ok(&vq(&["cache", "inspect", &notes])).contains("checksum ok"));
    // Outputs of other commands: the model and the text input are never written, other
    // kinds need --force; a JSON output is replaced by a JSON output.
    let txt = text(&s);
    refused(&vq(&["distortion", "--n", "64", "--formats", "fp16", "--json", &m, "--force"]), "GGUF");
    refused(&vq(&["eval", "--model", &m, "--text", &txt, "--ctx", "8", "--md", &txt, "--force"]), "input");
    let text_alias = s.path("text-alias.md");
    std::fs::hard_link(&txt, &text_alias).unwrap();
    refused(&vq(&["eval", "--model", &m, "--text", &txt, "--md", &text_alias, "--force"]), "input of this command");
    refused(&vq(&["distortion", "--n", "64", "--formats", "fp16", "--json", &notes]), "pass --force");
    let json = s.path("d.json");
    ok(&vq(&["distortion", "--n", "64", "--d", "32", "--formats", "fp16", "--json", &json]));
    ok(&vq(&["distortion", "--n", "64", "--d", "32", "--formats", "q8_0", "--json", &json, "--md", &s.path("d.md")]));
    refused(&vq(&["distortion", "--n", "64", "--formats", "q8_0", "--json", &json, "--md", &json]), "two outputs");
    assert!(std::fs::read_to_string(&json).unwrap().contains("q8_0"));
    refused(&vq(&["distortion", "--json", "/dev/null", "--force"]), "not a regular file");
    let want = ["alias.bin", "c.vqc", "d.json", "d.md", "notes.txt", "text-alias.md", "text.txt", "tiny.gguf"];
    assert_eq!(s.listing(), want);
}

#[test]
fn corrupt_model_dimensions_are_a_clear_error() {
    let s = Scratch::new("gguf");
    let good = tiny::tiny_llama(2);
    let at = tiny::tensor_dims_offset(&good, "token_embd.weight");
    let mut bad = good.clone();
    bad[at + 15] ^= 1; // n_vocab + 2^56: the byte count wraps to the true one
    let p = s.path("bad.gguf");
    std::fs::write(&p, bad).unwrap();
    refused(&vq(&["generate", "--model", &p, "--prompt", "Hello"]), "token_embd.weight");
}

#[test]
fn sizes_and_counts_are_bounded_before_any_work() {
    let s = Scratch::new("sizes");
    let m = s.model();
    let txt = text(&s);
    let missing = s.path("missing.vqc");
    let (ctx, over) = (format!("the model's context is {}", tiny::N_CTX), (tiny::N_CTX + 1).to_string());
    let near = (tiny::N_CTX - 2).to_string();
    let s_over = format!("turboquant_mse:4+{over}");
    let t0 = Instant::now();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["generate", "--model", &m, "--max-tokens", "18446744073709551615"], "no context longer than"),
        (vec!["generate", "--model", &m, "--max-tokens", &over], &ctx),
        (vec!["generate", "--model", &m, "--max-tokens", "1000000000000"], "--max-tokens 1000000000000"),
        (vec!["generate", "--model", &m, "--prompt", "Hello", "--max-tokens", &near], "exceeds the model's context"),
        (vec!["generate", "--model", &m, "--method", "q4_0@100000000"], "R after '@' is 100000000"),
        (vec!["generate", "--model", &m, "--method", &s_over], "S after '+'"),
        (vec!["generate", "--model", &m, "--prompt", ""], "--prompt"),
        (vec!["passkey", "--model", &m, "--lengths", "1000000000000"], "--lengths 1000000000000"),
        (vec!["passkey", "--model", &m, "--lengths", &over], "less 8 for the rest"),
        (vec!["passkey", "--model", &m, "--lengths", "200", "--n", "0"], "--n 0"),
        (vec!["passkey", "--model", &m, "--lengths", "200", "--depths", "1.5"], "--depths 1.5"),
        (vec!["distortion", "--d", "100000"], "--d 100000: must be in 1..=1024"),
        (vec!["distortion", "--n", "0"], "--n 0"),
        (vec!["bench", "cpu", "--shapes", "1:1:100000"], "--shapes 1:1:100000"),
        (vec!["bench", "cpu", "--shapes", "0:1:64"], "--shapes 0:1:64"),
        (vec!["bench", "cpu", "--context", "100000000"], "values per point"),
        (vec!["bench", "cpu", "--reps", "0"], "--reps 0"),
        (vec!["eval", "--model", &m, "--text", &txt, "--ctx", "0"], "--ctx 0"),
        (vec!["eval", "--model", &m, "--text", &txt, "--ctx", &over], &ctx),
        (
            vec![
                "eval",
                "--model",
                &m,
                "--text",
                &txt,
                "--methods",
                "vecinfer:8:g4",
                "--calib-tokens",
                "18446744073709551615",
            ],
            "--calib-tokens",
        ),
        (vec!["eval", "--model", &m, "--text", "/dev/zero"], "not a regular file"),
        (vec!["eval", "--model", &m, "--methods", "nope:4"], "unknown format"),
        (vec!["cache", "load", "/dev/zero", "--model", &m], "not a regular file"),
        (vec!["cache", "inspect", &missing], "missing.vqc"),
        (vec!["generate", "--model", "/dev/zero"], "not a regular file"),
    ];
    for (args, want) in &cases {
        refused(&vq(args), want);
    }
    // A text past the size bound (sparse: nothing is written).
    let big = s.path("big.txt");
    std::fs::File::create(&big).unwrap().set_len(65 << 20).unwrap();
    refused(&vq(&["eval", "--model", &m, "--text", &big]), "more than");
    assert!(t0.elapsed() < Duration::from_secs(60), "refusals took {:?}", t0.elapsed());
}

#[test]
fn reports_say_what_happened() {
    let s = Scratch::new("reports");
    let m = s.model();
    // fp16 is always the reference row: asked for again, it is not a second row.
    let json = s.path("e.json");
    let out = vq(&[
        "eval",
        "--model",
        &m,
        "--text",
        &text(&s),
        "--ctx",
        "32",
        "--windows",
        "2",
        "--methods",
        "fp16,turboquant_mse:4,turboquant_mse:4",
        "--json",
        &json,
    ]);
    ok(&out);
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["method"].as_str().unwrap()).collect();
    assert_eq!(names, ["fp16", "turboquant_mse:4@0"]);
    // The demo: both runs, the long-context case, and a ratio that says smaller or larger
    // as the bytes in use do.
    let out = ok(&vq(&["demo", "--model", &m, "--max-tokens", "4"]));
    assert!(out.contains("long context: passkey"), "{out}");
    let bytes: Vec<f64> = out
        .lines()
        .skip_while(|l| !l.starts_with("long context"))
        .filter(|l| l.starts_with('|') && !l.contains("KV cache") && !l.contains("---"))
        .map(|l| l.split('|').nth(4).unwrap().trim().parse().unwrap())
        .collect();
    assert_eq!(bytes.len(), 2, "{out}");
    let last = out.lines().rfind(|l| l.contains("than fp16")).unwrap();
    let (ratio, word) = (bytes[0] / bytes[1], if bytes[0] >= bytes[1] { "smaller" } else { "larger" });
    let shown = if ratio >= 1.0 { ratio } else { 1.0 / ratio };
    assert!(last.contains(&format!("{shown:.2}× {word}")), "{last} vs {bytes:?}");
}
