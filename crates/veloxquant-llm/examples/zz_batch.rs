use veloxquant::{CacheConfig, FormatSpec};
use veloxquant_llm::{BatchItem, BatchStore, CompressedStore, Llama, WeightMode};
fn main() {
    let path = std::path::PathBuf::from(std::env::args().nth(1).unwrap());
    let mode = match std::env::args().nth(2).as_deref() {
        Some("f32") => WeightMode::DequantF32,
        Some("packed") => WeightMode::Packed,
        _ => WeightMode::PackedQ8,
    };
    let m = Llama::load(&path, mode).unwrap();
    let c = m.config.clone();
    for b in [1usize, 8, 16] {
        let cfg = CacheConfig::new(
            c.n_layers,
            c.n_kv_heads,
            c.head_dim,
            FormatSpec::parse("fp16").unwrap(),
            FormatSpec::parse("fp16").unwrap(),
        );
        let mut stores: Vec<CompressedStore> = (0..b).map(|_| CompressedStore::new(cfg.clone()).unwrap()).collect();
        let prompt: Vec<u32> = (0..64).map(|i| 300 + i * 7).collect();
        for s in stores.iter_mut() {
            m.forward(&prompt, s, prompt.len()).unwrap();
        }
        let steps = 24;
        let t0 = std::time::Instant::now();
        for step in 0..steps {
            let toks: Vec<[u32; 1]> = (0..b).map(|i| [(500 + i * 13 + step * 3) as u32]).collect();
            let mut items: Vec<BatchItem> = stores
                .iter_mut()
                .zip(&toks)
                .map(|(s, t)| BatchItem { tokens: t, store: s as &mut dyn BatchStore, logits_from: 0 })
                .collect();
            m.forward_batch(&mut items).unwrap();
        }
        let dt = t0.elapsed().as_secs_f64();
        println!("{mode:?} B={b}: {:.1} tokens/s ({:.1} ms/step)", (b * steps) as f64 / dt, dt / steps as f64 * 1e3);
    }
}
