//! CPU kernels for the row-coded layouts: feature detection once, then the widest path the
//! machine has (AVX2+FMA+F16C on x86-64), with a portable scalar path that defines the
//! semantics.

mod scalar;
#[cfg(target_arch = "x86_64")]
mod x86;

use std::sync::OnceLock;

use crate::format::rows::RowLayout;

/// Instruction sets the fused kernels can use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimdLevel {
    Scalar,
    Avx2,
}

/// Detected once per process.
pub fn simd_level() -> SimdLevel {
    static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            return SimdLevel::Avx2;
        }
        SimdLevel::Scalar
    })
}

/// out[h·T + t] = q_h · (scale_t · row_t) for n_q queries of d floats.
pub fn scores(l: &RowLayout, q: &[f32], n_q: usize, page: &[u8], out: &mut [f32]) {
    assert!(page.len() >= l.page_bytes() && q.len() >= n_q * l.d && out.len() >= n_q * l.t);
    #[cfg(target_arch = "x86_64")]
    if simd_level() == SimdLevel::Avx2 && l.d % 8 == 0 {
        // SAFETY: AVX2/FMA/F16C were detected at run time; the assert above gives the
        // buffer sizes the kernel's unchecked loads rely on.
        unsafe { x86::scores(l, q, n_q, page, out) };
        return;
    }
    scalar::scores(l, q, n_q, page, out)
}

/// acc[h·d ..] += Σ_t w[h·T + t] · scale_t · row_t.
pub fn accumulate(l: &RowLayout, w: &[f32], n_q: usize, page: &[u8], acc: &mut [f32]) {
    assert!(page.len() >= l.page_bytes() && w.len() >= n_q * l.t && acc.len() >= n_q * l.d);
    #[cfg(target_arch = "x86_64")]
    if simd_level() == SimdLevel::Avx2 && l.d % 8 == 0 {
        // SAFETY: as in `scores`.
        unsafe { x86::accumulate(l, w, n_q, page, acc) };
        return;
    }
    scalar::accumulate(l, w, n_q, page, acc)
}

/// Dense f32 helpers used by the fp16 tail and the reference path.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Four partial sums: lets the compiler vectorize without reassociation licence.
    let mut s = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            s[i] += x[i] * y[i];
        }
    }
    let mut tail = 0.0;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    s.iter().sum::<f32>() + tail
}

pub fn axpy(acc: &mut [f32], w: f32, x: &[f32]) {
    acc.iter_mut().zip(x).for_each(|(a, b)| *a += w * b);
}
