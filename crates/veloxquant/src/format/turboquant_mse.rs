//! turboquant_mse: TurboQuant's MSE quantizer (Zandieh et al., "Online Vector Quantization
//! with Near-optimal Distortion Rate", arXiv 2504.19874).
//!
//! Per token: r = R·x (seeded randomized Hadamard, dense orthogonal for other d);
//! ‖r‖ by the canonical reduction; y = r/‖r‖; each y_j → b-bit Lloyd-Max code of N(0,1)
//! scaled by 1/√d. Stored per token: ⌈d·b/32⌉ u32 words of packed codes, then one f16 scale:
//! `plain` = ‖x‖, `eden` = ‖x‖/⟨y,ŷ⟩ (removes the (1 − D_mse) shrink of inner products).
//! Bits/value = b + 16/d (4.25 at d = 64, b = 4; 4.125 at d = 128).
//! Anchor: D_mse = 0.3634, 0.1175, 0.0345, 0.0095 for b = 1..4 (shared/REFERENCE.md §2).
//! Zero vectors encode as scale 0 (decode to exactly 0).

use super::rows::{RowFormat, RowKind};
use super::{FormatDesc, NormMode};
use crate::codebook::ScaledCodebook;
use crate::pack;
use crate::reduce::{sum_canonical_by, sum_sq_canonical};

pub static DESC: FormatDesc = FormatDesc {
    name: "turboquant_mse",
    for_keys: true,
    for_values: true,
    bits: &[1, 2, 3, 4],
    default_bits: 4,
    rotatable: false, // always rotated: the method is defined on rotated coordinates
    has_norm_mode: true,
    build: |spec, ctx| {
        let mut spec = spec.clone();
        spec.rotate = true;
        let table = ScaledCodebook::new(spec.bits, ctx.head_dim).table16();
        RowFormat::build(&spec, ctx, RowKind::Codes { bits: spec.bits, table }, encode_row)
    },
    ..FormatDesc::BASE
};

fn encode_row(f: &RowFormat, r: &[f32], out: &mut [u8]) -> f32 {
    // Stack buffers for the usual head sizes: a decode step encodes every token leaving the
    // window, one row at a time (three heap buffers a row were a third of its cost).
    let d = r.len();
    if d <= STACK_DIM {
        let (mut y, mut codes) = ([0f32; STACK_DIM], [0u8; STACK_DIM]);
        encode_row_in(f, r, out, &mut y[..d], &mut codes[..d])
    } else {
        encode_row_in(f, r, out, &mut vec![0f32; d], &mut vec![0u8; d])
    }
}

/// Head sizes up to this encode with stack buffers.
const STACK_DIM: usize = 256;

/// [`encode_row`] with scratch `y` and `codes` of r's length (y zeroed).
fn encode_row_in(f: &RowFormat, r: &[f32], out: &mut [u8], y: &mut [f32], codes: &mut [u8]) -> f32 {
    let cb = f.codebook.as_ref().expect("Codes layouts carry a codebook");
    let norm = sum_sq_canonical(r).sqrt();
    if norm > 0.0 {
        y.iter_mut().zip(r).for_each(|(y, v)| *y = v / norm);
    }
    cb.quantize_into(y, codes);
    pack::pack(codes, cb.bits, out).expect("row buffer sized by the layout");
    match f.spec.norm {
        NormMode::Plain => norm,
        NormMode::Eden => {
            // ⟨y, ŷ⟩ in the canonical order, ŷ the codes' centroids.
            let ip = sum_canonical_by(y.len(), |i| y[i] * cb.centroids[codes[i] as usize]);
            if ip > 0.0 {
                norm / ip
            } else {
                norm
            }
        }
    }
}
