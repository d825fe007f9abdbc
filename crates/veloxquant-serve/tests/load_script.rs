//! A short run of the load-test script (benchmarks/serve_load.py, standard-library Python):
//! concurrent streaming clients, mixed prompt lengths, a quarter disconnecting mid-stream;
//! every request ends cleanly and the server drains to zero sequences and zero KV bytes.

mod common;

use std::process::Command;

#[test]
fn load_script_short_run() {
    let Some(l) = common::loaded() else { return };
    if Command::new("python3").arg("--version").output().is_err() {
        eprintln!("SKIP: no python3 for benchmarks/serve_load.py");
        return;
    }
    let srv = common::spawn(l, common::config(l), false);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../benchmarks/serve_load.py");
    let url = format!("http://{}", srv.addr);
    let args = ["load", "--url", &url, "--clients", "6", "--requests", "16", "--min-prompt", "16"];
    let more = ["--max-prompt", "300", "--max-tokens", "8", "--disconnect", "0.25", "--timeout", "300"];
    let out = Command::new("python3")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .arg(script)
        .args(args)
        .args(more)
        .output()
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "load script failed");
    let rep: serde_json::Value = serde_json::from_str(&stdout).expect("one JSON report");
    assert_eq!(rep["requests"], 16);
    assert_eq!(rep["drained"], true);
    let outcomes = rep["outcomes"].as_object().unwrap();
    let ok = outcomes.get("ok").and_then(|v| v.as_u64()).unwrap_or(0);
    let gone = outcomes.get("disconnected").and_then(|v| v.as_u64()).unwrap_or(0);
    assert_eq!(ok + gone, 16, "every request finished or disconnected on purpose: {outcomes:?}");
    assert!(gone >= 1, "some clients disconnected");
}
