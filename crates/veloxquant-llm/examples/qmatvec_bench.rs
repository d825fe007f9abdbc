//! Times the packed products one SmolLM2-135M decode step makes (30 layers of Q4_1 QKV,
//! output, gate/up and down; the tied Q8_0 output projection), on random blocks:
//! `cargo run --release -p veloxquant-llm --example qmatvec_bench [n_rows_of_x] [q8]`
//! (`q8`: the 8-bit-activation products `--weights q8` decodes with, as the model calls
//! them, each of the 30 layers' four, then the output projection; else the f32-x kernel
//! against the scalar one). The kernel's own ceiling, without attention, norms and the
//! rest of the forward. In q8 mode: `REPS` runs (default 20); `EACH=1` times each shape
//! alone (µs per call, and x's quantization), `ONLY=ROWS` just the shapes of that many rows.

use std::time::Instant;
use veloxquant_llm::qmatvec::{Kernel, PackedFormat, PackedMatrix, BLOCK};

fn random(format: PackedFormat, rows: usize, cols: usize) -> PackedMatrix {
    static SEED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0x9E37_79B9_7F4A_7C15);
    let bb = format.block_bytes();
    let mut s = SEED.fetch_add(0x1234_5678_9ABC_DEF1, std::sync::atomic::Ordering::Relaxed);
    let mut data: Vec<u8> = (0..rows * cols / BLOCK * bb)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s as u8
        })
        .collect();
    for block in data.chunks_exact_mut(bb) {
        block[..2].copy_from_slice(&half::f16::from_f32(0.01).to_bits().to_le_bytes());
        if format == PackedFormat::Q4_1 {
            block[2..4].copy_from_slice(&half::f16::from_f32(-0.05).to_bits().to_le_bytes());
        }
    }
    PackedMatrix::from_bytes(format, rows, cols, data).unwrap()
}

fn main() {
    let n: usize = std::env::args().nth(1).map_or(1, |a| a.parse().unwrap());
    let q8 = std::env::args().nth(2).as_deref() == Some("q8");
    let q = PackedFormat::Q4_1;
    let layer = [random(q, 960, 576), random(q, 576, 576), random(q, 3072, 576), random(q, 576, 1536)]
        .map(|m| m.with_q8_activations(q8));
    let output = random(PackedFormat::Q8_0, 49152, 576).with_q8_activations(q8);
    let bytes: usize = 30 * layer.iter().map(|m| m.bytes()).sum::<usize>() + output.bytes();
    if q8 {
        // 30 layers of their own, as the model's (their weights come from L3 or DRAM, not
        // from the core's L2 as one layer's four matrices would).
        let layers: Vec<PackedMatrix> = (0..30)
            .flat_map(|_| [(960, 576), (576, 576), (3072, 576), (576, 1536)])
            .map(|(r, c)| random(q, r, c).with_q8_activations(true))
            .collect();
        // The model runs a step's products while the pool's other thread polls for tasks
        // (`pool::polling`); so here, lest each product wait for a parked thread to wake.
        use std::sync::atomic::{AtomicBool, Ordering};
        let done = AtomicBool::new(false);
        rayon::scope(|s| {
            s.spawn(|_| {
                while !done.load(Ordering::Acquire) {
                    if rayon::yield_now() != Some(rayon::Yield::Executed) {
                        std::thread::yield_now();
                    }
                }
            });
            q8_products(n, &layers, &output);
            done.store(true, Ordering::Release);
        });
        return;
    }
    for kernel in [Kernel::best(), Kernel::Scalar] {
        let mut best = f64::MAX;
        for _ in 0..if kernel == Kernel::Scalar { 2 } else { 10 } {
            let t = Instant::now();
            for _ in 0..30 {
                for m in &layer {
                    std::hint::black_box(m.matvec_with(kernel, &vec![0.5; n * m.cols()], n).unwrap());
                }
            }
            std::hint::black_box(output.matvec_with(kernel, &vec![0.5; n * 576], n).unwrap());
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!(
            "{kernel:?} n={n}: {:.2} ms per step ({:.0} steps/s, {:.1} GB/s of {:.0} MB)",
            best * 1e3,
            1.0 / best,
            bytes as f64 / best / 1e9,
            bytes as f64 / 1e6
        );
    }
}

/// The q8 products of one decode step (`layer`: 30 layers' four): median and range of
/// 20 runs; with EACH set, each shape alone.
fn q8_products(n: usize, layer: &[PackedMatrix], output: &PackedMatrix) {
    let reps: usize = std::env::var("REPS").map_or(20, |r| r.parse().unwrap());
    if std::env::var("EACH").is_ok() {
        // Each product alone, 300 times: µs per call.
        let x: Vec<f32> = (0..n * 1536).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 500.0).collect();
        let only: Option<usize> = std::env::var("ONLY").ok().map(|r| r.parse().unwrap());
        for m in layer[..4].iter().chain([output]).filter(|m| only.is_none_or(|r| r == m.rows())) {
            let mut ts: Vec<f64> = (0..if only.is_some() { 30_000 } else { 300 })
                .map(|_| {
                    let t = Instant::now();
                    std::hint::black_box(m.product(&x[..n * m.cols()], n).unwrap());
                    t.elapsed().as_secs_f64() * 1e6
                })
                .collect();
            ts.sort_by(f64::total_cmp);
            let mut tq: Vec<f64> = (0..300)
                .map(|_| {
                    let t = Instant::now();
                    std::hint::black_box(veloxquant_llm::qmatvec::QuantX::new(&x[..n * m.cols()]));
                    t.elapsed().as_secs_f64() * 1e6
                })
                .collect();
            tq.sort_by(f64::total_cmp);
            println!(
                "{}x{} n={n}: {:.1} µs median, {:.1} min (quantizing x: {:.1})",
                m.rows(),
                m.cols(),
                ts[ts.len() / 2],
                ts[0],
                tq[150]
            );
        }
        return;
    }
    let x: Vec<f32> = (0..n * 1536).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 500.0).collect();
    let mut logits = vec![0f32; n * output.rows()];
    let (mut layers_s, mut out_s) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        let t = Instant::now();
        for m in layer {
            std::hint::black_box(m.product(&x[..n * m.cols()], n).unwrap());
        }
        let t1 = Instant::now();
        let mut ys: Vec<&mut [f32]> = logits.chunks_mut(output.rows()).collect();
        output.product_into(&x[..n * 576], &mut ys).unwrap();
        std::hint::black_box(&logits);
        layers_s.push((t1 - t).as_secs_f64());
        out_s.push(t1.elapsed().as_secs_f64());
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        (v[v.len() / 2] * 1e3, v[0] * 1e3, v[v.len() - 1] * 1e3)
    };
    let ((l, l0, l1), (o, o0, o1)) = (med(&mut layers_s), med(&mut out_s));
    println!("q8 n={n}: layers {l:.2} ms ({l0:.2}–{l1:.2}), output {o:.2} ms ({o0:.2}–{o1:.2}), step {:.2} ms", l + o);
}
