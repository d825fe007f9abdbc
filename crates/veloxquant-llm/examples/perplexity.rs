//! cargo run --release --example perplexity -- MODEL.gguf TEXT [n_ctx] [n_windows] [quant]
use std::path::Path;
use veloxquant_llm::{perplexity, Fp16Store, KvStore, Llama, Tokenizer, WeightMode};

fn main() -> veloxquant_llm::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let model_path = Path::new(&args[1]);
    let text = std::fs::read(&args[2]).expect("read text");
    let text = String::from_utf8_lossy(&text);
    let n_ctx: usize = args.get(3).map_or(512, |s| s.parse().unwrap());
    let n_windows: usize = args.get(4).map_or(80, |s| s.parse().unwrap());
    let mode = if args.get(5).is_some_and(|s| s == "quant") { WeightMode::Quantized } else { WeightMode::DequantF32 };
    let t = std::time::Instant::now();
    let tok = Tokenizer::from_gguf_path(model_path)?;
    let model = Llama::load(model_path, mode)?;
    println!("loaded in {:.2}s: {:?}", t.elapsed().as_secs_f64(), model.config);
    let t = std::time::Instant::now();
    let tokens = tok.encode(&text)?;
    println!("{} tokens in {:.2}s", tokens.len(), t.elapsed().as_secs_f64());
    let c = model.config.clone();
    let mut factory = || -> veloxquant_llm::Result<Box<dyn KvStore>> {
        Ok(Box::new(Fp16Store::with_capacity(c.n_layers, c.n_kv_heads, c.head_dim, n_ctx)))
    };
    let stats = veloxquant_llm::eval::perplexity_with_progress(
        &model,
        &tokens,
        n_ctx,
        n_windows,
        tok.add_bos,
        &mut factory,
        &mut |w, s| eprintln!("[{w}] ppl {:.4} ± {:.4}  {:.1} tok/s", s.ppl, s.ppl_stderr, s.tokens_per_s),
    )?;
    let _ = perplexity;
    println!("{stats:?}");
    Ok(())
}
