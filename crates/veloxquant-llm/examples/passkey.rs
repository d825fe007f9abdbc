//! cargo run --release --example passkey -- MODEL.gguf LEN [n] [chat]
use std::path::Path;
use veloxquant_llm::{passkey_accuracy, Fp16Store, KvStore, Llama, PasskeyFormat, Tokenizer, WeightMode};

fn main() -> veloxquant_llm::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let path = Path::new(&args[1]);
    let len: usize = args[2].parse().unwrap();
    let n: usize = args.get(3).map_or(2, |s| s.parse().unwrap());
    let format = if args.get(4).is_some_and(|s| s == "chat") { PasskeyFormat::Chat } else { PasskeyFormat::Plain };
    let tok = Tokenizer::from_gguf_path(path)?;
    let model = Llama::load(path, WeightMode::DequantF32)?;
    let c = model.config.clone();
    let mut f = || -> veloxquant_llm::Result<Box<dyn KvStore>> {
        Ok(Box::new(Fp16Store::with_capacity(c.n_layers, c.n_kv_heads, c.head_dim, len)))
    };
    let t = std::time::Instant::now();
    let s = passkey_accuracy(&model, &tok, &mut f, len, &[0.1, 0.5, 0.9], n, 42, format)?;
    println!(
        "len {len} {format:?}: accuracy {:.2} {:?} ({:.1}s)\nfailures {:?}",
        s.accuracy(),
        s.per_depth,
        t.elapsed().as_secs_f64(),
        s.failures
    );
    Ok(())
}
