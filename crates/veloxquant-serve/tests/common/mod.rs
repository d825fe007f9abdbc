//! Test helpers: the model (loaded once, skipping when absent), servers on ephemeral
//! loopback ports, and a minimal HTTP/1.1 client over `TcpStream`.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use serde_json::Value;
use veloxquant::{CacheConfig, FormatSpec};
use veloxquant_llm::{Llama, Tokenizer, WeightMode};
use veloxquant_serve::{CpuEngine, ServeConfig, Server};

pub const METHOD_K: &str = "turboquant_mse:4:eden";
pub const METHOD_V: &str = "turboquant_mse:3";

pub struct Loaded {
    pub path: PathBuf,
    pub model: Arc<Llama>,
    pub tok: Arc<Tokenizer>,
}

/// VELOXQUANT_MODEL, else fetch into $HOME/.cache/veloxquant (tests only read the env).
pub fn loaded() -> Option<&'static Loaded> {
    static CELL: OnceLock<Option<Loaded>> = OnceLock::new();
    CELL.get_or_init(|| {
        let path = match std::env::var("VELOXQUANT_MODEL") {
            Ok(p) => PathBuf::from(p),
            Err(_) => {
                let home = std::env::var("HOME").ok()?;
                match veloxquant_llm::fetch_model(&PathBuf::from(home).join(".cache/veloxquant")) {
                    Ok(p) => p,
                    Err(e) => {
                        eprintln!("SKIP: model unavailable: {e}");
                        return None;
                    }
                }
            }
        };
        Some(Loaded {
            model: Arc::new(Llama::load(&path, WeightMode::DequantF32).expect("load model")),
            tok: Arc::new(Tokenizer::from_gguf_path(&path).expect("load tokenizer")),
            path,
        })
    })
    .as_ref()
}

/// The default method (`turboquant_mse:4:eden/turboquant_mse:3@8+4`), or fp16.
pub fn cache_config(l: &Loaded, fp16: bool) -> CacheConfig {
    let c = &l.model.config;
    let (k, v) = if fp16 { ("fp16", "fp16") } else { (METHOD_K, METHOD_V) };
    let mut cfg = CacheConfig::new(
        c.n_layers,
        c.n_kv_heads,
        c.head_dim,
        FormatSpec::parse(k).unwrap(),
        FormatSpec::parse(v).unwrap(),
    );
    if !fp16 {
        cfg.recent = 8;
        cfg.sink = 4;
    }
    cfg
}

pub fn config(l: &Loaded) -> ServeConfig {
    let tmpl = veloxquant_serve::chat_template(&l.path).unwrap();
    let mut cfg = ServeConfig::new("test-model", &l.tok, tmpl);
    cfg.sched.kv_budget_bytes = 256 << 20;
    cfg
}

pub fn spawn(l: &Loaded, cfg: ServeConfig, fp16: bool) -> Server {
    let (model, cache) = (l.model.clone(), cache_config(l, fp16));
    Server::spawn(cfg, move || CpuEngine::new(model, cache), l.tok.clone(), "127.0.0.1:0".parse().unwrap()).unwrap()
}

#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
    /// The `data:` payloads of an SSE body, in order.
    pub fn sse(&self) -> Vec<String> {
        self.body.lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_string).collect()
    }
}

pub fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    s
}

pub fn send(s: &mut TcpStream, method: &str, path: &str, body: &str, extra: &[(&str, &str)]) {
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in extra {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).unwrap();
}

pub fn request(addr: SocketAddr, method: &str, path: &str, body: &str, extra: &[(&str, &str)]) -> Resp {
    let mut s = connect(addr);
    send(&mut s, method, path, body, extra);
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let status: u16 = line.split_whitespace().nth(1).and_then(|x| x.parse().ok()).unwrap_or(0);
    let mut headers = Vec::new();
    loop {
        line.clear();
        r.read_line(&mut line).unwrap();
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    let chunked = headers.iter().any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let mut body = Vec::new();
    if chunked {
        loop {
            line.clear();
            if r.read_line(&mut line).unwrap() == 0 {
                break;
            }
            let n = usize::from_str_radix(line.trim(), 16).unwrap_or(0);
            if n == 0 {
                break;
            }
            let mut buf = vec![0u8; n + 2];
            r.read_exact(&mut buf).unwrap();
            body.extend_from_slice(&buf[..n]);
        }
    } else {
        r.read_to_end(&mut body).unwrap();
    }
    Resp { status, headers, body: String::from_utf8_lossy(&body).into_owned() }
}

pub fn post(addr: SocketAddr, path: &str, body: &Value) -> Resp {
    request(addr, "POST", path, &body.to_string(), &[])
}

pub fn metric(addr: SocketAddr, name: &str) -> u64 {
    let r = request(addr, "GET", "/metrics", "", &[]);
    r.body
        .lines()
        .find_map(|l| l.strip_prefix(&format!("veloxquant_{name} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("metric {name} missing"))
}

/// Polls until the server holds no live sequence and no live KV bytes (or panics).
pub fn wait_idle(addr: SocketAddr) {
    for _ in 0..200 {
        if metric(addr, "sequences_running") == 0
            && metric(addr, "kv_bytes_in_use") == 0
            && metric(addr, "queue_length") == 0
        {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!(
        "server did not return to idle: running {}, kv in use {}",
        metric(addr, "sequences_running"),
        metric(addr, "kv_bytes_in_use")
    );
}
