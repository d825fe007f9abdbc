//! The batched int8 kernel's layout: weight rows in tiles of 16, interleaved so that one
//! 512-bit register holds 4 consecutive codes of each of the 16 rows (lane r = row r).
//! One `vpdpbusd` of such a register with 4 codes of one row of x broadcast to every lane
//! is 64 multiply-adds into 16 row sums, and the 8 registers of a block serve every row
//! of x: per block and row of x, 8 `vpdpbusd`, one convert, one scale multiply and one
//! FMA (q4_1: a second FMA for the offset), ≈ 40 multiply-adds per instruction, where
//! the kernel it replaced (each weight row alone, two blocks per `vpdpbusd`, over
//! [`super::int8::Repacked`]'s pairwise layout, now the AVX2 kernel's only) spent as many
//! instructions again on per-row scales and a horizontal sum per output. Measured on the
//! 2-core AVX-512 VM, one SmolLM2-135M decode step's products (random blocks, 2 threads):
//! 16 rows of x 68 → 12 ms, 1 row 8.2 → 2.5 ms. Same values as the GGUF blocks; rows past
//! the last (up to 15, padding the final tile) have scale 0 and are never written out.
//!
//! Per tile and block (tiles in row order, blocks in column order), 64-byte lines:
//!
//! | format     | lines | line h (lane r = row r of the tile, 4 bytes)                 |
//! |------------|-------|--------------------------------------------------------------|
//! | q4_0, q4_1 | 4 + 1 | h < 4: the block's code bytes `4h..4h+4` as in GGUF (low    |
//! |            |       | nibbles values `4h..`, high nibbles values `16 + 4h..`)      |
//! | q8_0       | 8 + 1 | h < 8: codes `4h..4h+4` plus 128 (`q ^ 0x80`: unsigned)      |
//!
//! The last line holds the 16 rows' f16 scales `d` (bytes 0..32) and, for q4_1, the 16
//! minimums `m` (bytes 32..64; zero otherwise). Bytes per row and block: q4_1 20 (as the
//! GGUF), q4_0 20 (GGUF 18), q8_0 36 (GGUF 34).
//!
//! The integer dot is u8 (weights) × s8 (x), so the formats whose values are not the
//! unsigned codes times d carry an integer offset per block of x ([`x_offsets`]):
//! q4_0 `d·(q − 8)` gives `Σ q·qx − 8·Σqx`, q8_0 `d·q` stored as `q + 128` gives
//! `Σ (q + 128)·qx − 128·Σqx`; both exact in i32, so every format's block dot is the same
//! integer as [`super::int8::rows_ref`]'s.

use super::int8::QuantX;
use super::{PackedFormat, BLOCK};

/// Weight rows per tile: one 512-bit register of i32 row sums.
pub const TILE: usize = 16;

/// One cache line of the layout (64-byte aligned, so each code register is one aligned load).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(super) struct Line(pub [u8; 64]);

/// A matrix in the interleaved layout; see the module docs.
#[derive(Clone)]
pub struct Interleaved {
    format: PackedFormat,
    rows: usize,
    nb: usize,
    lines: Vec<Line>,
}

impl std::fmt::Debug for Interleaved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Interleaved")
            .field("format", &self.format)
            .field("rows", &self.rows)
            .field("nb", &self.nb)
            .finish()
    }
}

/// Lines per tile and block: the code registers, then the scale line.
pub(super) const fn lines_per_block(format: PackedFormat) -> usize {
    match format {
        PackedFormat::Q8_0 => 9,
        _ => 5,
    }
}

impl Interleaved {
    /// From GGUF blocks `data` (`rows` rows of `nb` blocks).
    pub(super) fn new(format: PackedFormat, data: &[u8], rows: usize, nb: usize) -> Self {
        let bb = format.block_bytes();
        let lpb = lines_per_block(format);
        let n_tiles = rows.div_ceil(TILE);
        let mut lines = vec![Line([0; 64]); n_tiles * nb * lpb];
        for (r, row) in data.chunks_exact(nb * bb).enumerate() {
            let (tile, lane) = (r / TILE, r % TILE);
            for (b, block) in row.chunks_exact(bb).enumerate() {
                let at = (tile * nb + b) * lpb;
                let (codes, scale) = lines[at..at + lpb].split_at_mut(lpb - 1);
                let qs = match format {
                    PackedFormat::Q4_0 => &block[2..18],
                    PackedFormat::Q4_1 => &block[4..20],
                    PackedFormat::Q8_0 => &block[2..34],
                };
                for (h, line) in codes.iter_mut().enumerate() {
                    for i in 0..4 {
                        let q = qs[4 * h + i];
                        line.0[4 * lane + i] = if format == PackedFormat::Q8_0 { q ^ 0x80 } else { q };
                    }
                }
                scale[0].0[2 * lane..2 * lane + 2].copy_from_slice(&block[0..2]);
                if format == PackedFormat::Q4_1 {
                    scale[0].0[32 + 2 * lane..32 + 2 * lane + 2].copy_from_slice(&block[2..4]);
                }
            }
        }
        Self { format, rows, nb, lines }
    }

    pub fn format(&self) -> PackedFormat {
        self.format
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Blocks per row.
    pub fn n_blocks(&self) -> usize {
        self.nb
    }

    /// The lines, tile by tile (see the module docs).
    pub(super) fn lines(&self) -> &[Line] {
        &self.lines
    }

    pub fn bytes(&self) -> usize {
        self.lines.len() * std::mem::size_of::<Line>()
    }
}

/// The integer each block of x starts its dot product from: `−8·Σqx` (q4_0), `−128·Σqx`
/// (q8_0), none for q4_1 (its offset `m·dx·Σqx` is added in f32). `[row of x][block]`.
pub(super) fn x_offsets(format: PackedFormat, x: &QuantX) -> Vec<i32> {
    let bias = match format {
        PackedFormat::Q4_0 => 8,
        PackedFormat::Q8_0 => 128,
        PackedFormat::Q4_1 => return Vec::new(),
    };
    x.q.chunks_exact(BLOCK).map(|b| -bias * b.iter().map(|&q| q as i32).sum::<i32>()).collect()
}
