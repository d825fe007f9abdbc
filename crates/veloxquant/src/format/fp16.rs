//! fp16: the uncompressed baseline (16 bits/value), also the layout of the cache's tail.
//! Rounding: IEEE round-to-nearest-even through `half`; inputs are checked finite first, so
//! only overflow past ±65504 can produce ±Inf (documented, not an error: such keys do not
//! occur in fp16-trained models).

use half::f16;

use super::rows::{RowFormat, RowKind};
use super::FormatDesc;

pub static DESC: FormatDesc = FormatDesc {
    name: "fp16",
    for_keys: true,
    for_values: true,
    bits: &[],
    default_bits: 16,
    rotatable: false,
    has_norm_mode: false,
    build: |spec, ctx| RowFormat::build(spec, ctx, RowKind::F16, encode_row),
    ..FormatDesc::BASE
};

fn encode_row(_: &RowFormat, x: &[f32], out: &mut [u8]) -> f32 {
    for (o, v) in out.chunks_exact_mut(2).zip(x) {
        o.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
    }
    1.0
}
