//! Times the pieces of one 512-token prefill: dense matmul, attention.
use candle_core::{Device, Tensor};
use std::time::Instant;
use veloxquant_llm::causal_attention_f32;

fn main() {
    let n = 512;
    let dev = Device::Cpu;
    for (out, inp) in [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152 / 8, 576)] {
        let x = Tensor::randn(0f32, 1.0, (n, inp), &dev).unwrap();
        let w = Tensor::randn(0f32, 1.0, (out, inp), &dev).unwrap();
        let _ = x.matmul(&w.t().unwrap()).unwrap();
        let t = Instant::now();
        let reps = 10;
        for _ in 0..reps {
            let _ = x.matmul(&w.t().unwrap()).unwrap().to_vec2::<f32>().unwrap();
        }
        let s = t.elapsed().as_secs_f64() / reps as f64;
        println!("matmul {n}x{inp}x{out}: {:.2} ms, {:.1} GFLOP/s", s * 1e3, 2.0 * (n * inp * out) as f64 / s / 1e9);
    }
    let hd = 64;
    let q: Vec<f32> = (0..9 * n * hd).map(|i| ((i * 7919) % 1000) as f32 / 1000.0).collect();
    let k: Vec<Vec<f32>> = (0..3).map(|g| (0..n * hd).map(|i| ((i * 31 + g) % 997) as f32 / 997.0).collect()).collect();
    let kr: Vec<&[f32]> = k.iter().map(|x| x.as_slice()).collect();
    let t = Instant::now();
    for _ in 0..10 {
        let _ = causal_attention_f32(&q, n, &kr, &kr, n, hd).unwrap();
    }
    println!("attention 512: {:.2} ms", t.elapsed().as_secs_f64() / 10.0 * 1e3);
}
