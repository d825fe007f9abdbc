//! The server end to end on loopback, with the real model (skips when it is absent).

mod common;

use std::io::Read;
use std::time::Duration;

use common::{loaded, post, request, spawn, wait_idle, Loaded};
use serde_json::{json, Value};
use veloxquant_llm::generate::generate_ids;
use veloxquant_llm::{CompressedStore, Fp16Store, Greedy, KvStore};

const PROMPTS: [&str; 3] = [
    "The lighthouse keeper had lived alone on the island for twenty years. One stormy night,",
    "Rust is a systems programming language that",
    "In 1889, the tower was finished and the people of Paris",
];

/// What `veloxquant generate` produces: greedy ids without the stop id.
fn reference(l: &Loaded, prompt: &[u32], max_tokens: usize, fp16: bool) -> Vec<u32> {
    let mut store: Box<dyn KvStore> = if fp16 {
        Box::new(Fp16Store::for_config(&l.model.config, prompt.len() + max_tokens))
    } else {
        Box::new(CompressedStore::new(common::cache_config(l, false)).unwrap())
    };
    let stop = veloxquant_serve::default_stop_ids(&l.tok);
    let g = generate_ids(&l.model, prompt, max_tokens, &stop, store.as_mut(), &mut Greedy, &mut |_| true).unwrap();
    g.tokens.into_iter().filter(|t| !stop.contains(t)).collect()
}

fn ids_of(v: &Value) -> Vec<u32> {
    v["choices"][0]["token_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn greedy(prompt: &str, n: usize) -> Value {
    json!({"prompt": prompt, "max_tokens": n, "temperature": 0})
}

#[test]
fn greedy_output_equals_generate_alone_and_batched() {
    let Some(l) = loaded() else { return };
    let n = 24;
    let want: Vec<Vec<u32>> = PROMPTS.iter().map(|p| reference(l, &l.tok.encode(p).unwrap(), n, false)).collect();
    let srv = spawn(l, common::config(l), false);
    for (p, w) in PROMPTS.iter().zip(&want) {
        let r = post(srv.addr, "/v1/completions", &greedy(p, n));
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(&ids_of(&r.json()), w, "alone: {p}");
        assert_eq!(r.json()["choices"][0]["text"], l.tok.decode(w).unwrap());
    }
    // Batched: the three at once, with a long prompt prefilling in chunks beside them.
    let long = "word ".repeat(700);
    let addr = srv.addr;
    let hs: Vec<_> = PROMPTS
        .iter()
        .map(|p| greedy(p, n))
        .chain([greedy(&long, 4)])
        .map(|b| std::thread::spawn(move || post(addr, "/v1/completions", &b)))
        .collect();
    let rs: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    for (r, w) in rs.iter().zip(&want) {
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(&ids_of(&r.json()), w, "batched");
    }
    assert!(common::metric(addr, "step_rows_total") > common::metric(addr, "steps_total"), "some steps were batched");
    wait_idle(addr);
}

#[test]
fn fp16_method_equals_generate() {
    let Some(l) = loaded() else { return };
    let srv = spawn(l, common::config(l), true);
    let ids = l.tok.encode(PROMPTS[0]).unwrap();
    let r = post(srv.addr, "/v1/completions", &greedy(PROMPTS[0], 16));
    assert_eq!(ids_of(&r.json()), reference(l, &ids, 16, true));
}

#[test]
fn prefix_hit_forks_pages_and_keeps_greedy_output() {
    let Some(l) = loaded() else { return };
    let srv = spawn(l, common::config(l), false);
    let shared = "The history of the city begins with a small fishing village. ".repeat(30);
    let a = format!("{shared}Question one: what came first?");
    let b = format!("{shared}Question two: who ruled it?");
    let ra = post(srv.addr, "/v1/completions", &greedy(&a, 8));
    let rb = post(srv.addr, "/v1/completions", &greedy(&b, 8));
    let (ua, ub) = (&ra.json()["usage"], &rb.json()["usage"]);
    assert_eq!(ua["prompt_tokens_details"]["cached_tokens"], 0);
    let cached = ub["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached >= 256, "second request reused {cached} tokens");
    assert_eq!(cached % 32, 0, "page-aligned");
    assert!(common::metric(srv.addr, "prefix_cache_hits_total") >= 1);
    let want = reference(l, &l.tok.encode(&b).unwrap(), 8, false);
    assert_eq!(ids_of(&rb.json()), want, "output after a prefix hit equals a fresh prefill's");
    wait_idle(srv.addr);
    assert!(common::metric(srv.addr, "kv_bytes_cached") > 0, "checkpoints stay cached");
}

#[test]
fn streaming_matches_whole_and_ends_with_done() {
    let Some(l) = loaded() else { return };
    let srv = spawn(l, common::config(l), false);
    let mut body = greedy(PROMPTS[1], 12);
    let whole = post(srv.addr, "/v1/completions", &body).json();
    body["stream"] = json!(true);
    let r = post(srv.addr, "/v1/completions", &body);
    assert_eq!(r.status, 200);
    assert!(r.header("content-type").unwrap().starts_with("text/event-stream"));
    let events = r.sse();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    let text: String = chunks.iter().map(|c| c["choices"][0]["text"].as_str().unwrap_or("")).collect();
    assert_eq!(text, whole["choices"][0]["text"].as_str().unwrap());
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(last["usage"]["completion_tokens"], 12);
    // Chat: the first delta carries the role, content follows, usage chunk when asked.
    let chat = json!({"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 6, "temperature": 0,
                      "stream": true, "stream_options": {"include_usage": true}});
    let events = post(srv.addr, "/v1/chat/completions", &chat).sse();
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(first["object"], "chat.completion.chunk");
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert!(usage["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
}

#[test]
fn stop_sequences_cut_text_across_tokens() {
    let Some(l) = loaded() else { return };
    let srv = spawn(l, common::config(l), false);
    let full = post(srv.addr, "/v1/completions", &greedy(PROMPTS[0], 24)).json();
    let text = full["choices"][0]["text"].as_str().unwrap().to_string();
    // A stop string that starts inside one token and ends in another: the last two characters
    // of a token's text and the first three after it (the first boundary with room for both).
    let ids: Vec<u32> = full["choices"][0]["token_ids"]
        .as_array()
        .expect("token ids in the response")
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let stop = (2..ids.len())
        .find_map(|k| {
            let b = l.tok.decode(&ids[..k]).ok()?.chars().count();
            let chars: Vec<char> = text.chars().collect();
            let piece = l.tok.decode(&ids[k - 1..k]).ok()?.chars().count();
            (piece >= 2 && b + 3 <= chars.len() && text.starts_with(&l.tok.decode(&ids[..k]).ok()?))
                .then(|| chars[b - 2..b + 3].iter().collect::<String>())
        })
        .expect("a token boundary inside the greedy text");
    let at = text.find(&stop).unwrap();
    for stream in [false, true] {
        let mut b = greedy(PROMPTS[0], 24);
        b["stop"] = json!([stop, "zzzz"]);
        b["stream"] = json!(stream);
        let r = post(srv.addr, "/v1/completions", &b);
        let (got, finish) = if stream {
            let ev = r.sse();
            let cs: Vec<Value> = ev[..ev.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
            let t: String = cs.iter().map(|c| c["choices"][0]["text"].as_str().unwrap_or("")).collect();
            (t, cs.last().unwrap()["choices"][0]["finish_reason"].clone())
        } else {
            let j = r.json();
            (j["choices"][0]["text"].as_str().unwrap().to_string(), j["choices"][0]["finish_reason"].clone())
        };
        assert_eq!(got, text[..at], "stream {stream}");
        assert_eq!(finish, "stop");
    }
}

#[test]
fn same_seed_same_text() {
    let Some(l) = loaded() else { return };
    let srv = spawn(l, common::config(l), false);
    let body = |seed: u64| json!({"prompt": PROMPTS[2], "max_tokens": 16, "temperature": 1.0, "top_p": 0.95, "top_k": 50, "seed": seed});
    let a = post(srv.addr, "/v1/completions", &body(7)).json();
    let b = post(srv.addr, "/v1/completions", &body(7)).json();
    let c = post(srv.addr, "/v1/completions", &body(8)).json();
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    assert_ne!(a["choices"][0]["token_ids"], c["choices"][0]["token_ids"], "another seed, another text");
}

#[test]
fn errors_are_openai_objects_with_status_codes() {
    let Some(l) = loaded() else { return };
    let mut cfg = common::config(l);
    cfg.max_context = Some(64);
    cfg.max_body_bytes = 4096;
    let srv = spawn(l, cfg, false);
    let a = srv.addr;
    let check = |r: common::Resp, status: u16, kind: &str| {
        assert_eq!(r.status, status, "{}", r.body);
        assert_eq!(r.json()["error"]["type"], kind, "{}", r.body);
    };
    check(request(a, "POST", "/v1/completions", "{not json", &[]), 400, "invalid_request_error");
    check(post(a, "/v1/completions", &json!({"model": "gpt-4", "prompt": "x"})), 404, "not_found_error");
    check(post(a, "/v1/completions", &json!({"prompt": "word ".repeat(100)})), 400, "invalid_request_error");
    assert_eq!(
        post(a, "/v1/completions", &json!({"prompt": "word ".repeat(100)})).json()["error"]["code"],
        "context_length_exceeded"
    );
    check(post(a, "/v1/completions", &json!({"prompt": "x", "n": 2})), 400, "invalid_request_error");
    check(post(a, "/v1/completions", &json!({"prompt": "x", "temperature": -1})), 400, "invalid_request_error");
    check(post(a, "/v1/completions", &json!({"prompt": ""})), 400, "invalid_request_error");
    check(post(a, "/v1/completions", &json!({"prompt": [999999]})), 400, "invalid_request_error");
    check(post(a, "/v1/chat/completions", &json!({"messages": "hi"})), 400, "invalid_request_error");
    check(request(a, "POST", "/v1/completions", &"x".repeat(5000), &[]), 413, "invalid_request_error");
    check(request(a, "GET", "/v1/nothing", "", &[]), 404, "not_found_error");
    // max_tokens past the context: generation stops at the context (finish "length" with
    // every free position used), or earlier at an end-of-sequence token ("stop") — which
    // one depends on the model's greedy path, not on the server.
    let r = post(a, "/v1/completions", &json!({"prompt": "Hi", "max_tokens": 500, "temperature": 0})).json();
    let (used, prompt) =
        (r["usage"]["completion_tokens"].as_u64().unwrap(), r["usage"]["prompt_tokens"].as_u64().unwrap());
    assert!(prompt + used <= 64, "{r}");
    match r["choices"][0]["finish_reason"].as_str() {
        Some("length") => assert_eq!(prompt + used, 64, "{r}"),
        Some("stop") => assert!(prompt + used < 64, "{r}"),
        other => panic!("finish_reason {other:?}: {r}"),
    }
    // API key: constant-time checked; /health stays open.
    let mut cfg = common::config(l);
    cfg.api_key = Some("sekret".into());
    let srv = spawn(l, cfg, false);
    check(post(srv.addr, "/v1/completions", &greedy("x", 1)), 401, "authentication_error");
    let bad = request(
        srv.addr,
        "POST",
        "/v1/completions",
        &greedy("x", 1).to_string(),
        &[("Authorization", "Bearer sekreT")],
    );
    check(bad, 401, "authentication_error");
    let ok = request(
        srv.addr,
        "POST",
        "/v1/completions",
        &greedy("x", 1).to_string(),
        &[("Authorization", "Bearer sekret")],
    );
    assert_eq!(ok.status, 200);
    assert_eq!(request(srv.addr, "GET", "/health", "", &[]).status, 200);
}

#[test]
fn full_queue_answers_503_with_retry_after() {
    let Some(l) = loaded() else { return };
    let mut cfg = common::config(l);
    cfg.sched.max_running = 1;
    cfg.max_queue = 1;
    let srv = spawn(l, cfg, false);
    let addr = srv.addr;
    let long = std::thread::spawn(move || post(addr, "/v1/completions", &greedy(PROMPTS[0], 60)));
    while common::metric(addr, "sequences_running") == 0 {
        std::thread::sleep(Duration::from_millis(20));
    }
    let queued = std::thread::spawn(move || post(addr, "/v1/completions", &greedy(PROMPTS[1], 2)));
    while common::metric(addr, "queue_length") == 0 {
        std::thread::sleep(Duration::from_millis(20));
    }
    let r = post(addr, "/v1/completions", &greedy(PROMPTS[2], 2));
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.json()["error"]["code"], "server_busy");
    assert_eq!(long.join().unwrap().status, 200);
    assert_eq!(queued.join().unwrap().status, 200);
    wait_idle(addr);
}

#[test]
fn client_disconnect_cancels_and_frees_pages() {
    let Some(l) = loaded() else { return };
    let srv = spawn(l, common::config(l), false);
    let mut s = common::connect(srv.addr);
    let mut b = greedy(PROMPTS[0], 2000);
    b["stream"] = json!(true);
    common::send(&mut s, "POST", "/v1/completions", &b.to_string(), &[]);
    let mut seen = Vec::new();
    let mut buf = [0u8; 512];
    while seen.windows(5).filter(|w| w == b"data:").count() < 3 {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "stream ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    assert_eq!(common::metric(srv.addr, "sequences_running"), 1);
    assert!(common::metric(srv.addr, "kv_bytes_in_use") > 0);
    drop(s);
    wait_idle(srv.addr);
    assert_eq!(common::metric(srv.addr, "requests_cancelled_total"), 1);
    assert!(common::metric(srv.addr, "generated_tokens_total") < 2000);
}

#[test]
fn timeout_and_graceful_shutdown() {
    let Some(l) = loaded() else { return };
    let mut cfg = common::config(l);
    cfg.sched.request_timeout = Duration::from_millis(700);
    let srv = spawn(l, cfg, false);
    let r = post(srv.addr, "/v1/completions", &greedy(PROMPTS[0], 2000));
    assert_eq!(r.status, 504, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "timeout");
    wait_idle(srv.addr);
    // Shutdown while a request runs: it still completes, then the server stops.
    let srv = spawn(l, common::config(l), false);
    let addr = srv.addr;
    let h = std::thread::spawn(move || post(addr, "/v1/completions", &greedy(PROMPTS[1], 20)));
    while common::metric(addr, "sequences_running") == 0 {
        std::thread::sleep(Duration::from_millis(10));
    }
    srv.shutdown().unwrap();
    let r = h.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["usage"]["completion_tokens"], 20);
    assert!(std::net::TcpStream::connect(addr).is_err(), "no longer accepting");
}

#[test]
fn kv_budget_bounds_memory_under_load() {
    let Some(l) = loaded() else { return };
    let mut cfg = common::config(l);
    let budget = 6 << 20;
    cfg.sched.kv_budget_bytes = budget;
    let srv = spawn(l, cfg, false);
    let addr = srv.addr;
    let hs: Vec<_> = (0..8)
        .map(|i| {
            let p = format!("{} {}", "story ".repeat(40 + 30 * i), i);
            std::thread::spawn(move || post(addr, "/v1/completions", &greedy(&p, 24)))
        })
        .collect();
    for h in hs {
        assert_eq!(h.join().unwrap().status, 200);
    }
    let peak = common::metric(addr, "kv_bytes_peak");
    assert!(peak > 0 && peak <= budget as u64, "peak {peak} B over the budget {budget} B");
    // One request that can never fit is refused, not queued forever.
    let r = post(addr, "/v1/completions", &greedy(&"story ".repeat(1500), 2000));
    assert_eq!(r.status, 400, "{}", r.body);
    wait_idle(addr);
}

#[test]
fn slots_save_restore_erase() {
    let Some(l) = loaded() else { return };
    let dir = std::env::temp_dir().join(format!("vq-slots-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut cfg = common::config(l);
    cfg.slot_dir = Some(dir.clone());
    let srv = spawn(l, cfg, false);
    let a = srv.addr;
    let first = format!("{} Then", "The river ran north through the valley. ".repeat(12));
    let mut b = greedy(&first, 8);
    b["id_slot"] = json!(3);
    let r1 = post(a, "/v1/completions", &b).json();
    let slot = |q: &str, body: Value| post(a, &format!("/slots/3?action={q}"), &body);
    let saved = slot("save", json!({"filename": "conv.bin"}));
    assert_eq!(saved.status, 200, "{}", saved.body);
    assert!(saved.json()["n_saved"].as_u64().unwrap() > 100);
    assert_eq!(slot("erase", json!({})).json()["n_erased"], saved.json()["n_saved"]);
    assert_eq!(slot("save", json!({"filename": "x.bin"})).status, 404, "erased slot is empty");
    let restored = slot("restore", json!({"filename": "conv.bin"}));
    assert_eq!(restored.status, 200, "{}", restored.body);
    assert_eq!(restored.json()["n_restored"], saved.json()["n_saved"]);
    // The conversation goes on from the restored cache.
    let next = format!("{first}{} and", r1["choices"][0]["text"].as_str().unwrap());
    let mut b = greedy(&next, 4);
    b["id_slot"] = json!(3);
    let r2 = post(a, "/v1/completions", &b).json();
    assert!(r2["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() > 100, "{r2}");
    for bad in ["../escape.bin", "/etc/passwd", ".hidden", "a/b"] {
        let r = slot("restore", json!({"filename": bad}));
        assert_eq!(r.status, 400, "{bad}: {}", r.body);
    }
    assert_eq!(slot("restore", json!({"filename": "missing.bin"})).status, 404);
    assert_eq!(slot("explode", json!({})).status, 400);
    assert_eq!(post(a, "/slots/999?action=erase", &json!({})).status, 400);
    std::fs::write(dir.join("junk.bin"), b"not a cache file").unwrap();
    assert_eq!(slot("restore", json!({"filename": "junk.bin"})).status, 400);
    // Without --slot-dir, file actions are not offered.
    let plain = spawn(l, common::config(l), false);
    assert_eq!(post(plain.addr, "/slots/0?action=save", &json!({"filename": "a.bin"})).status, 501);
    let _ = std::fs::remove_dir_all(&dir);
}
