//! Canonical bit packing, shared bit for bit by CPU and GPU.
//!
//! Codes of `bits` bits form one LSB-first bit stream: code i occupies bits
//! [i·bits, (i+1)·bits) of a sequence of little-endian u32 words. 3-bit codes are packed
//! tightly (32 codes in 3 words), so a code may straddle two words. A row of n codes takes
//! ⌈n·bits/32⌉ whole words. Because words are little-endian, the same stream read byte by
//! byte is LSB-first too, which the SIMD paths use.

use crate::error::{Result, VqError};

/// Bit widths with a packed layout.
pub const SUPPORTED_BITS: &str = "1, 2, 3, 4, 8";

pub fn check_bits(bits: u32) -> Result<()> {
    match bits {
        1 | 2 | 3 | 4 | 8 => Ok(()),
        _ => Err(VqError::UnsupportedBits { format: "pack".into(), bits, supported: SUPPORTED_BITS }),
    }
}

/// Bytes taken by `n` codes of `bits` bits (whole u32 words).
pub const fn packed_bytes(n: usize, bits: u32) -> usize {
    (n * bits as usize).div_ceil(32) * 4
}

/// Pack `codes` (each < 2^bits) into `out` (exactly `packed_bytes` long).
pub fn pack(codes: &[u8], bits: u32, out: &mut [u8]) -> Result<()> {
    check_bits(bits)?;
    let need = packed_bytes(codes.len(), bits);
    if out.len() != need {
        return Err(VqError::ShapeMismatch { op: "pack", expected: need, got: out.len() });
    }
    let mask = ((1u32 << bits) - 1) as u8;
    if codes.iter().fold(0u8, |a, &c| a | (c & !mask)) != 0 {
        return Err(VqError::UnsupportedBits {
            format: "pack (code too large)".into(),
            bits,
            supported: SUPPORTED_BITS,
        });
    }
    out.fill(0);
    // Eight codes fill exactly `bits` bytes: one little-endian word per group (a decode step
    // packs a row per stream, head and layer); `put` places the codes after the last group.
    match bits {
        1 => pack_groups::<1>(codes, out),
        2 => pack_groups::<2>(codes, out),
        3 => pack_groups::<3>(codes, out),
        4 => pack_groups::<4>(codes, out),
        _ => pack_groups::<8>(codes, out),
    }
    for (i, &c) in codes.iter().enumerate().skip(codes.len() / 8 * 8) {
        put(out, i, bits, c);
    }
    Ok(())
}

/// The whole groups of eight `B`-bit codes into `out` (a fixed-size copy per group).
fn pack_groups<const B: usize>(codes: &[u8], out: &mut [u8]) {
    for (group, dst) in codes.chunks_exact(8).zip(out.chunks_exact_mut(B)) {
        let word = group.iter().enumerate().fold(0u64, |w, (j, &c)| w | (c as u64) << (j * B));
        dst.copy_from_slice(&word.to_le_bytes()[..B]);
    }
}

/// Unpack `n` codes from `packed`.
pub fn unpack(packed: &[u8], bits: u32, codes: &mut [u8]) -> Result<()> {
    check_bits(bits)?;
    let need = packed_bytes(codes.len(), bits);
    if packed.len() < need {
        return Err(VqError::ShapeMismatch { op: "unpack", expected: need, got: packed.len() });
    }
    for (i, c) in codes.iter_mut().enumerate() {
        *c = get(packed, i, bits);
    }
    Ok(())
}

/// Code `i` of a packed stream. Caller guarantees the stream holds it.
#[inline]
pub fn get(packed: &[u8], i: usize, bits: u32) -> u8 {
    let bit = i * bits as usize;
    let byte = bit / 8;
    let shift = bit % 8;
    // Codes are ≤ 8 bits, so two bytes always cover one code.
    let lo = packed[byte] as u16;
    let hi = if shift + bits as usize > 8 { packed[byte + 1] as u16 } else { 0 };
    (((lo | (hi << 8)) >> shift) & ((1u16 << bits) - 1)) as u8
}

/// OR code `c` (< 2^bits) into slot `i` of a zeroed stream. Caller guarantees the stream
/// holds it.
#[inline]
pub(crate) fn put(out: &mut [u8], i: usize, bits: u32, c: u8) {
    let bit = i * bits as usize;
    let byte = bit / 8;
    let shift = bit % 8;
    let v = (c as u16) << shift;
    out[byte] |= v as u8;
    if shift + bits as usize > 8 {
        out[byte + 1] |= (v >> 8) as u8;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn words(bytes: &[u8]) -> Vec<u32> {
        bytes.chunks(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }

    #[test]
    fn hand_computed_layouts() {
        // 1 bit: codes 1,0,1,1 → bits 0,2,3 set → 0b1101.
        let mut o = vec![0; 4];
        pack(&[1, 0, 1, 1], 1, &mut o).unwrap();
        assert_eq!(words(&o), vec![0b1101]);
        // 2 bits: 3,1,2 → 0b10_01_11.
        pack(&[3, 1, 2], 2, &mut o).unwrap();
        assert_eq!(words(&o), vec![0b100111]);
        // 4 bits: 0xA,0x3 → 0x3A.
        pack(&[0xA, 0x3], 4, &mut o).unwrap();
        assert_eq!(words(&o), vec![0x3A]);
        // 8 bits: bytes in order.
        pack(&[0x11, 0x22, 0x33, 0x44], 8, &mut o).unwrap();
        assert_eq!(words(&o), vec![0x4433_2211]);
        // 3 bits, tight: 32 codes in 3 words; code 10 straddles word 0 and 1
        // (bits 30..33): value 0b111 → bits 30,31 of word 0 and bit 0 of word 1.
        let mut codes = [0u8; 32];
        codes[10] = 7;
        codes[31] = 5; // bits 93..96 → word 2 bits 29..32 = 0b101 << 29
        let mut o3 = vec![0; 12];
        pack(&codes, 3, &mut o3).unwrap();
        assert_eq!(words(&o3), vec![0xC000_0000, 0x1, 0b101 << 29]);
        assert_eq!(packed_bytes(32, 3), 12);
        assert_eq!(packed_bytes(80, 3), 32); // 240 bits → 8 words
    }

    #[test]
    fn rejects_bad_input() {
        let mut o = vec![0; 4];
        assert!(matches!(pack(&[4], 2, &mut o), Err(VqError::UnsupportedBits { .. })));
        assert!(matches!(pack(&[1], 5, &mut o), Err(VqError::UnsupportedBits { .. })));
        assert!(matches!(pack(&[1], 2, &mut [0u8; 3]), Err(VqError::ShapeMismatch { .. })));
    }

    proptest! {
        #[test]
        fn round_trip(bits in prop::sample::select(vec![1u32, 2, 3, 4, 8]), raw in prop::collection::vec(any::<u8>(), 0..300)) {
            let mask = ((1u32 << bits) - 1) as u8;
            let codes: Vec<u8> = raw.iter().map(|c| c & mask).collect();
            let mut packed = vec![0; packed_bytes(codes.len(), bits)];
            pack(&codes, bits, &mut packed).unwrap();
            let mut back = vec![0; codes.len()];
            unpack(&packed, bits, &mut back).unwrap();
            prop_assert_eq!(&back, &codes);
            // The stream as u32 words: code i is bits [i*b, (i+1)*b).
            let w = words(&packed);
            for (i, &c) in codes.iter().enumerate() {
                let bit = i * bits as usize;
                let mut v = 0u64;
                for k in 0..bits as usize {
                    let b = bit + k;
                    v |= (((w[b / 32] >> (b % 32)) & 1) as u64) << k;
                }
                prop_assert_eq!(v as u8, c);
            }
        }
    }
}
