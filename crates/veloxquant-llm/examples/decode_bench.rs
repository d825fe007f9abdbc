//! Greedy decode speed of the model at `path` in each weight mode (fp16 cache):
//! `cargo run --release -p veloxquant-llm --example decode_bench PATH [n_tokens] [f32|packed|q8]`.

use veloxquant_llm::generate::generate_ids;
use veloxquant_llm::{Fp16Store, Greedy, Llama, Tokenizer, WeightMode};

fn main() {
    let mut args = std::env::args().skip(1);
    let path = std::path::PathBuf::from(args.next().expect("model path"));
    let n: usize = args.next().map_or(64, |a| a.parse().unwrap());
    let tok = Tokenizer::from_gguf_path(&path).unwrap();
    let prompt =
        tok.encode("The lighthouse keeper had lived alone on the island for twenty years. One stormy night,").unwrap();
    let modes = match args.next().as_deref() {
        Some("packed") => vec![WeightMode::Packed],
        Some("q8") => vec![WeightMode::PackedQ8],
        Some("f32") => vec![WeightMode::DequantF32],
        _ => vec![WeightMode::DequantF32, WeightMode::Packed, WeightMode::PackedQ8],
    };
    for mode in modes {
        let m = Llama::load(&path, mode).unwrap();
        let c = &m.config;
        let mut best = 0f64;
        for _ in 0..3 {
            let mut s = Fp16Store::with_capacity(c.n_layers, c.n_kv_heads, c.head_dim, prompt.len() + n);
            let st = generate_ids(&m, &prompt, n, &[], &mut s, &mut Greedy, &mut |_| true).unwrap();
            best = best.max(st.decode_tokens_per_s);
        }
        println!("{mode:?}: best of 3: {best:.1} decode tokens/s; {:?}", m.weight_bytes());
    }
}
