//! Times the packed products one SmolLM2-135M decode step makes (30 layers of Q4_1 QKV,
//! output, gate/up and down; the tied Q8_0 output projection), on random blocks:
//! `cargo run --release -p veloxquant-llm --example qmatvec_bench [n_rows_of_x]`.
//! The kernel's own ceiling, without attention, norms and the rest of the forward.

use std::time::Instant;
use veloxquant_llm::qmatvec::{Kernel, PackedFormat, PackedMatrix, BLOCK};

fn random(format: PackedFormat, rows: usize, cols: usize) -> PackedMatrix {
    let bb = format.block_bytes();
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
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
    let q = PackedFormat::Q4_1;
    let layer = [random(q, 960, 576), random(q, 576, 576), random(q, 3072, 576), random(q, 576, 1536)];
    let output = random(PackedFormat::Q8_0, 49152, 576);
    let bytes: usize = 30 * layer.iter().map(|m| m.bytes()).sum::<usize>() + output.bytes();
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
