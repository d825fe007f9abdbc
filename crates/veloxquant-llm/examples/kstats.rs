// scratch analysis (not committed): spread of residual norms per head
use veloxquant_llm::*;
fn main() {
    let path = std::path::PathBuf::from(std::env::var("HOME").unwrap())
        .join(".cache/veloxquant/SmolLM2-135M-Instruct.Q4_1.gguf");
    let tok = Tokenizer::from_gguf_path(&path).unwrap();
    let model = Llama::load(&path, WeightMode::DequantF32).unwrap();
    let text = std::fs::read_to_string("../shared/data/wikitext-2-raw-test.txt").unwrap();
    let tokens = tok.encode(&text).unwrap();
    let c = model.config.clone();
    let d = c.head_dim;
    let cal = calibrate(&model, &tokens[40960..40960 + 2048]).unwrap();
    let test = calibrate(&model, &tokens[0..2048]).unwrap();
    let mut worst = (0f64, 0f64);
    for l in 0..c.n_layers {
        for h in 0..c.n_kv_heads {
            for s in [veloxquant::Stream::Keys, veloxquant::Stream::Values] {
                let x = cal.get(l, h, s).unwrap();
                let n = x.len() / d;
                let mut mu = vec![0f64; d];
                for r in x.chunks(d) {
                    for j in 0..d {
                        mu[j] += r[j] as f64 / n as f64;
                    }
                }
                let norms = |x: &[f32]| {
                    let mut v: Vec<f64> = x
                        .chunks(d)
                        .map(|r| r.iter().zip(&mu).map(|(a, b)| (*a as f64 - b).powi(2)).sum::<f64>().sqrt())
                        .collect();
                    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
                    v
                };
                let nc = norms(&x);
                let med = nc[nc.len() / 2];
                let nt = norms(&test.get(l, h, s).unwrap());
                let (lo, hi) = ((nt[0] / med).log2(), (nt[nt.len() - 1] / med).log2());
                worst = (worst.0.min(lo), worst.1.max(hi));
                if l % 10 == 0 && h == 0 {
                    println!("L{l} {s:?} med {med:.3} test range log2 [{lo:.2}, {hi:.2}]");
                }
            }
        }
    }
    println!("worst over all heads: log2(norm/median) in [{:.2}, {:.2}]", worst.0, worst.1);
}
