//! Every kernel against the scalar reference and against the f64 product of the
//! dequantized matrix, over every packed format, awkward row counts and n = 1..=11.

use super::*;
use candle_core::{Device, Tensor};
use half::f16;
use veloxquant::rng::SplitMix64;

/// Random but valid blocks: random code bytes, f16 scales in ±[0.004, 0.05] and q4_1
/// minimums in ±0.5 (a real model's range), so products stay far from f32 overflow.
fn random_matrix(format: PackedFormat, rows: usize, cols: usize, seed: u64) -> PackedMatrix {
    let mut rng = SplitMix64::new(seed);
    let bb = format.block_bytes();
    let mut data = vec![0u8; rows * cols / BLOCK * bb];
    for block in data.chunks_exact_mut(bb) {
        block.iter_mut().for_each(|b| *b = rng.next_u64() as u8);
        let sign = if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 };
        let d = f16::from_f64(sign * (0.004 + 0.046 * rng.next_f64()));
        block[..2].copy_from_slice(&d.to_bits().to_le_bytes());
        if format == PackedFormat::Q4_1 {
            let m = f16::from_f64(rng.next_f64() - 0.5);
            block[2..4].copy_from_slice(&m.to_bits().to_le_bytes());
        }
    }
    PackedMatrix::from_bytes(format, rows, cols, data).unwrap()
}

/// Relative tolerance against the f64 product, per output, of Σ|w_i·x_i|: f32 sums over
/// ≤ 1536 terms in ≥ 4 chains stay well under 2⁻¹⁷ of that (the f32 ε is 2⁻²⁴).
const REL_TOL: f64 = 1e-5;

/// The f64 product of the dequantized weights, `[n][rows]`, and per output Σ|w_i·x_i|.
fn exact_product(w: &[f32], rows: usize, cols: usize, x: &[f32], n: usize) -> (Vec<f64>, Vec<f64>) {
    let (mut exact, mut scale) = (vec![0f64; n * rows], vec![0f64; n * rows]);
    for j in 0..n {
        for r in 0..rows {
            for (&a, &b) in w[r * cols..][..cols].iter().zip(&x[j * cols..][..cols]) {
                exact[j * rows + r] += a as f64 * b as f64;
                scale[j * rows + r] += (a as f64 * b as f64).abs();
            }
        }
    }
    (exact, scale)
}

/// The f32 path: candle's GEMM over the dequantized matrix, `[n][rows]`.
fn f32_gemm(w: &[f32], rows: usize, cols: usize, x: &[f32], n: usize) -> Vec<f32> {
    let w = Tensor::from_slice(w, (rows, cols), &Device::Cpu).unwrap();
    let x = Tensor::from_slice(x, (n, cols), &Device::Cpu).unwrap();
    x.matmul(&w.t().unwrap()).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

#[test]
fn kernels_match_reference_gemm_and_f64_on_every_format() {
    // Row counts: one row, fewer than a task, a task ± 1, several tasks and a remainder.
    let shapes = [(1, 32), (7, 64), (63, 96), (65, 576), (197, 160), (130, 1536)];
    let mut kernels = vec![Kernel::Scalar];
    if Kernel::best() == Kernel::Avx2 {
        kernels.push(Kernel::Avx2);
    } else {
        eprintln!("SKIP avx2 kernel: this CPU lacks AVX2/FMA/F16C; scalar only");
    }
    for (fi, format) in PackedFormat::ALL.into_iter().enumerate() {
        for (si, &(rows, cols)) in shapes.iter().enumerate() {
            let m = random_matrix(format, rows, cols, 1000 + (fi * 100 + si) as u64);
            let w = m.dequantize_ref();
            for n in 1..=11 {
                let x = SplitMix64::new(7 + n as u64).gaussian_vec(n * cols);
                let (exact, scale) = exact_product(&w, rows, cols, &x, n);
                let mut outputs = vec![("f32 gemm".to_string(), f32_gemm(&w, rows, cols, &x, n))];
                outputs.extend(kernels.iter().map(|&k| (format!("{k:?}"), m.matvec_with(k, &x, n).unwrap())));
                for (what, y) in &outputs {
                    for (i, &got) in y.iter().enumerate() {
                        assert!(
                            (got as f64 - exact[i]).abs() <= REL_TOL * scale[i] + 1e-30,
                            "{what} {format:?} {rows}×{cols} n={n} output {i}: {got} vs {} (scale {})",
                            exact[i],
                            scale[i]
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn packed_values_equal_candle_dequantize_bitwise() {
    for format in PackedFormat::ALL {
        let (rows, cols) = (37, 96);
        let w = SplitMix64::new(3).gaussian_vec(rows * cols);
        let t = QTensor::quantize(&Tensor::from_vec(w, (rows, cols), &Device::Cpu).unwrap(), format.ggml()).unwrap();
        let m = PackedMatrix::from_qtensor(&t).unwrap().expect("packed format");
        assert_eq!(m.bytes(), t.storage_size_in_bytes());
        let ours: Vec<u32> = m.dequantize_ref().iter().map(|v| v.to_bits()).collect();
        let candle: Vec<u32> = t
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect();
        assert!(ours == candle, "{format:?}: dequantized values differ from candle's");
    }
}

#[test]
fn concat_rows_stacks_and_refuses_mixed_formats() {
    let a = random_matrix(PackedFormat::Q4_1, 5, 64, 1);
    let b = random_matrix(PackedFormat::Q4_1, 3, 64, 2);
    let ab = PackedMatrix::concat_rows(&[a.clone(), b.clone()]).unwrap();
    let x = SplitMix64::new(9).gaussian_vec(2 * 64);
    let (ya, yb, yab) = (a.matvec(&x, 2).unwrap(), b.matvec(&x, 2).unwrap(), ab.matvec(&x, 2).unwrap());
    for j in 0..2 {
        assert_eq!(&yab[j * 8..j * 8 + 5], &ya[j * 5..j * 5 + 5]);
        assert_eq!(&yab[j * 8 + 5..j * 8 + 8], &yb[j * 3..j * 3 + 3]);
    }
    assert!(PackedMatrix::concat_rows(&[a, random_matrix(PackedFormat::Q8_0, 3, 64, 3)]).is_none());
}

#[test]
fn bad_shapes_are_errors() {
    assert!(PackedMatrix::from_bytes(PackedFormat::Q4_0, 2, 48, vec![0; 2 * 18]).is_err());
    assert!(PackedMatrix::from_bytes(PackedFormat::Q4_0, 2, 64, vec![0; 3 * 18]).is_err());
    assert!(PackedMatrix::from_bytes(PackedFormat::Q4_0, 2, 0, Vec::new()).is_err());
    let m = random_matrix(PackedFormat::Q8_0, 2, 32, 4);
    assert!(m.matvec(&[0.0; 33], 1).is_err());
}

/// 8-bit x: integer dots are exact, so a kernel's error against the f64 product of W with
/// x̂ is only the per-block f32 scaling; 1e-4 of Σ|w·x̂| leaves room for the q4 formats'
/// offset and code terms partly cancelling.
const REL_TOL_Q8: f64 = 1e-4;

#[test]
fn int8_kernels_match_the_exact_product_with_quantized_x() {
    // Even block counts up to 64 run the repacked kernel; odd ones (1, 3, 5) and 66 the per-block one.
    let shapes = [(1, 32), (7, 64), (63, 96), (65, 576), (197, 160), (130, 1536), (3, 2048), (3, 2112)];
    let kernels = Int8Kernel::available();
    if kernels.len() < 3 {
        eprintln!("SKIP some int8 kernels: this CPU runs only {kernels:?}");
    }
    for (fi, format) in PackedFormat::ALL.into_iter().enumerate() {
        for (si, &(rows, cols)) in shapes.iter().enumerate() {
            let m = random_matrix(format, rows, cols, 2000 + (fi * 100 + si) as u64);
            let w = m.dequantize_ref();
            for n in (1..=11).chain([16, 19]) {
                let mut x = SplitMix64::new(70 + n as u64).gaussian_vec(n * cols);
                x[..BLOCK.min(cols)].fill(0.0); // an all-zero block: scale 0, codes 0
                let xq = QuantX::new(&x).dequantize();
                let (exact, scale) = exact_product(&w, rows, cols, &xq, n);
                for &k in &kernels {
                    let y = m.matvec_q8_with(k, &x, n).unwrap();
                    for (i, &got) in y.iter().enumerate() {
                        assert!(
                            (got as f64 - exact[i]).abs() <= REL_TOL_Q8 * scale[i] + 1e-30,
                            "{k:?} {format:?} {rows}×{cols} n={n} output {i}: {got} vs {}",
                            exact[i]
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn int8_quantization_rounds_to_the_nearest_code_of_its_block_scale() {
    let mut x = SplitMix64::new(5).gaussian_vec(4 * BLOCK);
    x[BLOCK..2 * BLOCK].fill(0.0);
    x[2 * BLOCK + 3] = -9.0; // the block's largest magnitude gets code −127
    let q = QuantX::new(&x);
    let xq = q.dequantize();
    for (b, xb) in x.chunks_exact(BLOCK).enumerate() {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert_eq!(q.scale[b], amax / 127.0, "block {b} scale");
        let sum: i32 = q.q[b * BLOCK..][..BLOCK].iter().map(|&c| c as i32).sum();
        assert!((q.sum[b] - q.scale[b] * sum as f32).abs() <= 1e-6 * q.scale[b] * 127.0 * 32.0);
        for i in 0..BLOCK {
            let e = (x[b * BLOCK + i] - xq[b * BLOCK + i]).abs();
            assert!(e <= 0.5 * q.scale[b] * (1.0 + 1e-5), "block {b} value {i}: error {e}");
        }
    }
    assert_eq!(q.q[2 * BLOCK + 3], -127);
    assert!(q.q[BLOCK..2 * BLOCK].iter().all(|&c| c == 0) && q.scale[1] == 0.0);
    // The product's error against f32 x is bounded by Σ|w|·dx/2 per block.
    let m = random_matrix(PackedFormat::Q4_1, 9, 4 * BLOCK, 8);
    let w = m.dequantize_ref();
    let y = m.matvec_q8(&x, 1).unwrap();
    let (exact, _) = exact_product(&w, 9, 4 * BLOCK, &x, 1);
    for r in 0..9 {
        let bound: f64 =
            (0..4 * BLOCK).map(|i| w[r * 4 * BLOCK + i].abs() as f64 * 0.5 * q.scale[i / BLOCK] as f64).sum();
        assert!((y[r] as f64 - exact[r]).abs() <= bound * 1.01 + 1e-6, "row {r}");
    }
    assert!(m.matvec_q8(&x[..5], 1).is_err());
}

/// The batched VNNI kernel (16 interleaved weight rows per register, x in passes of 8,
/// or of 6 over two tiles at once) against the scalar reference and the exact product,
/// for every batch size 1..=17 (one pass, a pass and a remainder, two and three passes,
/// two calls of the 16-row limit), row counts that end mid-tile and mid-task, tasks of
/// several tiles (even and odd counts, more tiles than tasks), odd block counts and rows
/// wider than the AVX2 kernel's limit; and each row of x's result is the same bits at
/// every batch size.
#[test]
fn vnni_batched_kernel_matches_reference_for_every_batch_size() {
    if !Int8Kernel::available().contains(&Int8Kernel::Vnni) {
        eprintln!("SKIP vnni batched kernel: this CPU lacks AVX512F/BW/VL + VNNI");
        return;
    }
    let shapes = [(1, 32), (15, 96), (17, 64), (63, 160), (129, 576), (200, 2112), (601, 96), (1040, 64)];
    for (fi, format) in PackedFormat::ALL.into_iter().enumerate() {
        for (si, &(rows, cols)) in shapes.iter().enumerate() {
            let m = random_matrix(format, rows, cols, 3000 + (fi * 100 + si) as u64).with_q8_activations(true);
            let w = m.dequantize_ref();
            let mut x = SplitMix64::new(90 + si as u64).gaussian_vec(17 * cols);
            x[BLOCK..2 * BLOCK].fill(0.0); // an all-zero block of x row 0 (cols ≥ 64)
            x[2 * cols + 5] = 40.0; // one large value: the rest of its block gets small codes
            let alone: Vec<Vec<f32>> =
                (0..17).map(|j| m.matvec_q8_with(Int8Kernel::Vnni, &x[j * cols..(j + 1) * cols], 1).unwrap()).collect();
            for n in 1..=17 {
                let xs = &x[..n * cols];
                let y = m.matvec_q8_with(Int8Kernel::Vnni, xs, n).unwrap();
                let y_ref = m.matvec_q8_with(Int8Kernel::Scalar, xs, n).unwrap();
                let (exact, scale) = exact_product(&w, rows, cols, &QuantX::new(xs).dequantize(), n);
                for (i, (&got, &want)) in y.iter().zip(&y_ref).enumerate() {
                    let what = format!("{format:?} {rows}×{cols} n={n} output {i}");
                    assert!((got - want).abs() as f64 <= REL_TOL_Q8 * scale[i] + 1e-30, "{what}: {got} vs ref {want}");
                    assert!(
                        (got as f64 - exact[i]).abs() <= REL_TOL_Q8 * scale[i] + 1e-30,
                        "{what}: {got} vs {}",
                        exact[i]
                    );
                    assert_eq!(got.to_bits(), alone[i / rows][i % rows].to_bits(), "{what}: differs from n = 1");
                }
            }
        }
    }
}

#[test]
fn int8_quantization_is_the_reference_bit_for_bit() {
    // 1,031 blocks: more than one thread's share, split unevenly (a batched step's x).
    let mut x = SplitMix64::new(11).gaussian_vec(1031 * BLOCK);
    x[1000 * BLOCK + 3] = f32::NAN;
    x[BLOCK..2 * BLOCK].fill(0.0);
    // Ties: max|x| = 127 gives inv = 1, so k + 0.5 rounds to even.
    for (i, v) in x[2 * BLOCK..3 * BLOCK].iter_mut().enumerate() {
        *v = if i == 0 { 127.0 } else { i as f32 - 15.5 };
    }
    x[3 * BLOCK + 7] = f32::NAN;
    x[4 * BLOCK + 1] = f32::INFINITY;
    x[5 * BLOCK + 2] = 1e30;
    x[6 * BLOCK..7 * BLOCK].iter_mut().for_each(|v| *v *= 1e-30);
    let (fast, reference) = (QuantX::new(&x), QuantX::new_ref(&x));
    assert_eq!(fast.q, reference.q);
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&fast.scale), bits(&reference.scale));
    assert_eq!(bits(&fast.sum), bits(&reference.sum));
    assert_eq!(reference.q[3 * BLOCK + 7], 0);
}

/// `product_into` writes exactly what `product` returns, into separate row buffers, and
/// rejects mismatched shapes.
#[test]
fn product_into_equals_product() {
    for (i, format) in PackedFormat::ALL.into_iter().enumerate() {
        for q8 in [false, true] {
            let m = random_matrix(format, 83, 96, 50 + i as u64).with_q8_activations(q8);
            for n in [1, 5, m.max_rows_per_pass()] {
                let x: Vec<f32> = SplitMix64::new(n as u64).gaussian_vec(n * 96);
                let want = m.product(&x, n).unwrap();
                let mut bufs = vec![vec![f32::NAN; 83]; n];
                let mut ys: Vec<&mut [f32]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
                m.product_into(&x, &mut ys).unwrap();
                let got: Vec<u32> = bufs.concat().iter().map(|v| v.to_bits()).collect();
                assert_eq!(got, want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "{format:?} q8 {q8} n {n}");
            }
            let mut short = vec![0f32; 82];
            assert!(m.product_into(&[0.0; 96], &mut [short.as_mut_slice()]).is_err());
            let mut one = vec![0f32; 83];
            assert!(m.product_into(&[0.0; 95], &mut [one.as_mut_slice()]).is_err());
        }
    }
}
