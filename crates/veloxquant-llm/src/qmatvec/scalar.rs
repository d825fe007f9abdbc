//! The scalar reference: dequantize a block exactly as candle does, then plain f32 dots.

use super::{PackedFormat, RowsParams, BLOCK};
use half::f16;

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// One block's 32 values, rounded as candle's `to_float` rounds them (the f32 path's
/// weights): q4_0 `(q − 8) · d`, q4_1 `q · d + m` (two roundings), q8_0 `q · d`.
pub fn dequantize_block_ref(format: PackedFormat, b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    match format {
        PackedFormat::Q4_0 => {
            for (j, &q) in b[2..18].iter().enumerate() {
                out[j] = ((q & 0x0F) as i32 - 8) as f32 * d;
                out[j + BLOCK / 2] = ((q >> 4) as i32 - 8) as f32 * d;
            }
        }
        PackedFormat::Q4_1 => {
            let m = f16_at(b, 2);
            for (j, &q) in b[4..20].iter().enumerate() {
                out[j] = (q & 0x0F) as f32 * d + m;
                out[j + BLOCK / 2] = (q >> 4) as f32 * d + m;
            }
        }
        PackedFormat::Q8_0 => {
            for (o, &q) in out.iter_mut().zip(&b[2..34]) {
                *o = q as i8 as f32 * d;
            }
        }
    }
}

/// `out[r·n + j] = W_r · x_j` for the rows in `p.w`.
pub(super) fn rows_ref(p: RowsParams<'_>) {
    let bb = p.format.block_bytes();
    let cols = p.n_blocks * BLOCK;
    let mut w = [0f32; BLOCK];
    for (row, out) in p.w.chunks_exact(p.n_blocks * bb).zip(p.out.chunks_exact_mut(p.n)) {
        out.fill(0.0);
        for (bi, block) in row.chunks_exact(bb).enumerate() {
            dequantize_block_ref(p.format, block, &mut w);
            for (j, o) in out.iter_mut().enumerate() {
                let x = &p.x[j * cols + bi * BLOCK..][..BLOCK];
                *o += w.iter().zip(x).map(|(a, b)| a * b).sum::<f32>();
            }
        }
    }
}
