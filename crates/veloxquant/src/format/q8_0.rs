//! q8_0: llama.cpp's 8-bit block format, a peer at equal bits (ggml-quants.c,
//! `quantize_row_q8_0_ref`). Blocks of 32 values: f16 scale d = absmax/127, then 32 × i8
//! q = round(x/d). 34 bytes per 32 values = 8.5 bits/value. Optional `rot`: a seeded
//! Hadamard rotation first, as llama.cpp applies to quantized KV caches.
//! Anchor: essentially lossless (+0.03 % PPL, shared/REFERENCE.md §10).

use half::f16;

use super::rows::{RowFormat, RowKind, Q8_BLOCK_BYTES, QBLOCK};
use super::FormatDesc;

pub static DESC: FormatDesc = FormatDesc {
    name: "q8_0",
    for_keys: true,
    for_values: true,
    bits: &[],
    default_bits: 8,
    rotatable: true,
    has_norm_mode: false,
    build: |spec, ctx| {
        RowFormat::require_blocks(spec, ctx.head_dim)?;
        RowFormat::build(spec, ctx, RowKind::Q8_0, encode_row)
    },
    ..FormatDesc::BASE
};

fn encode_row(_: &RowFormat, x: &[f32], out: &mut [u8]) -> f32 {
    for (blk, o) in x.chunks_exact(QBLOCK).zip(out.chunks_exact_mut(Q8_BLOCK_BYTES)) {
        let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        o[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
        for (q, v) in o[2..].iter_mut().zip(blk) {
            *q = (v * id).round() as i8 as u8;
        }
    }
    1.0
}
