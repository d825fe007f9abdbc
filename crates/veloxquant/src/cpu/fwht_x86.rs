//! The Walsh–Hadamard butterflies with AVX2: strides 1, 2 and 4 inside each 8-lane register
//! (partner lanes by permute, sum and difference blended), larger strides between whole
//! registers. Every element takes the same additions, in the same order and with the same
//! operands, as `rotate::fwht_ref`, so the results are the same bits.

use std::arch::x86_64::*;

/// One in-register stage: lanes without bit `h` get x + partner, lanes with it partner − x
/// (the scalar butterfly's a + b and a − b, a the lower element).
#[inline(always)]
unsafe fn stage<const MASK: i32>(v: __m256, partner: __m256) -> __m256 {
    _mm256_blend_ps::<MASK>(_mm256_add_ps(v, partner), _mm256_sub_ps(partner, v))
}

/// Safety: AVX2 detected; `x.len()` a power of two ≥ 8.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn fwht(x: &mut [f32]) {
    let n = x.len();
    debug_assert!(n >= 8 && n.is_power_of_two());
    let p = x.as_mut_ptr();
    for i in (0..n).step_by(8) {
        let mut v = _mm256_loadu_ps(p.add(i));
        v = stage::<0xAA>(v, _mm256_permute_ps::<0xB1>(v)); // h = 1: swap lanes 2k ↔ 2k+1
        v = stage::<0xCC>(v, _mm256_permute_ps::<0x4E>(v)); // h = 2: swap pairs
        v = stage::<0xF0>(v, _mm256_permute2f128_ps::<0x01>(v, v)); // h = 4: swap halves
        _mm256_storeu_ps(p.add(i), v);
    }
    let mut h = 8;
    while h < n {
        for i in (0..n).step_by(2 * h) {
            for j in (i..i + h).step_by(8) {
                let (a, b) = (_mm256_loadu_ps(p.add(j)), _mm256_loadu_ps(p.add(j + h)));
                _mm256_storeu_ps(p.add(j), _mm256_add_ps(a, b));
                _mm256_storeu_ps(p.add(j + h), _mm256_sub_ps(a, b));
            }
        }
        h *= 2;
    }
}
