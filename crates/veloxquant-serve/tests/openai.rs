//! The official `openai` Python client (PyPI) against the server: runs
//! `openai_client.py` when python3 can import `openai`, otherwise says why it skipped.

mod common;

use std::process::Command;

#[test]
fn official_openai_client() {
    let Some(l) = common::loaded() else { return };
    let probe = Command::new("python3").args(["-c", "import openai"]).output();
    match probe {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            let why = String::from_utf8_lossy(&o.stderr);
            eprintln!("SKIP: python3 cannot import openai (`pip install openai`): {}", why.trim());
            return;
        }
        Err(e) => {
            eprintln!("SKIP: no python3: {e}");
            return;
        }
    }
    let mut cfg = common::config(l);
    cfg.api_key = Some("test-key".into());
    let srv = common::spawn(l, cfg, false);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py");
    let out = Command::new("python3")
        .args([script, &format!("http://{}/v1", srv.addr), "test-model", "test-key"])
        .output()
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the openai client checks failed:\n{stdout}");
    assert!(stdout.contains(" passed, 0 failed"), "{stdout}");
    // Pages freed afterwards (/metrics needs the key here, so read the counters directly).
    let m = &srv.metrics;
    for _ in 0..100 {
        if veloxquant_serve::Metrics::get(&m.sequences_running) == 0
            && veloxquant_serve::Metrics::get(&m.kv_bytes_in_use) == 0
        {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    panic!("sequences or KV bytes left after the client finished");
}
