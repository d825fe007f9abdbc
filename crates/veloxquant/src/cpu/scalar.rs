//! Portable kernels: decode one row, then dot / axpy. They define the semantics the SIMD
//! kernels must match.

use super::{axpy, dot};
use crate::format::rows::RowLayout;

pub fn scores(l: &RowLayout, q: &[f32], n_q: usize, page: &[u8], out: &mut [f32]) {
    let mut row = vec![0f32; l.d];
    for t in 0..l.t {
        l.decode_row(page, t, &mut row);
        let s = l.row_scale(page, t);
        for h in 0..n_q {
            out[h * l.t + t] = dot(&q[h * l.d..(h + 1) * l.d], &row) * s;
        }
    }
}

pub fn accumulate(l: &RowLayout, w: &[f32], n_q: usize, page: &[u8], acc: &mut [f32]) {
    let mut row = vec![0f32; l.d];
    for t in 0..l.t {
        l.decode_row(page, t, &mut row);
        let s = l.row_scale(page, t);
        for h in 0..n_q {
            axpy(&mut acc[h * l.d..(h + 1) * l.d], w[h * l.t + t] * s, &row);
        }
    }
}
