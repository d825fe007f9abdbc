//! Kernel variants and their parameters, fixed per device. The defaults are the variants
//! measured best on the H200 (benchmarks/results/cuda-decode.md); benchmarks build others
//! explicitly (the library reads no environment: `bench` maps `VELOXQUANT_*` variables to a
//! `Tuning` for its own runs).

/// Every tunable of the decode and encode kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tuning {
    /// FAST decode: page slots in each warp's ring (2..=8).
    pub decode_stages: usize,
    /// FAST decode: warps per block (4..=16).
    pub decode_warps: usize,
    /// FAST decode: blocks per SM the registers are held to (0 = the compiler's bound).
    pub decode_minb: i64,
    /// FAST decode: prep_query fused into the decode kernel.
    pub decode_fuse_q: bool,
    /// Softmax weights by ex2.approx.ftz.
    pub decode_expftz: bool,
    /// Headroom of the running softmax max (log2 units, 0..=12).
    pub decode_slack: i64,
    /// The merge launched as a programmatic dependent of the decode kernel (sm_90).
    pub decode_pdl: bool,
    /// FAST decode: a persistent grid, each warp one equal run of all rows' pages (decode.cu
    /// STREAMK), instead of split-K blocks of (sequence, KV head, split).
    pub decode_stream: bool,
    /// FAST decode, 2-bit keys and values: codes by byte lookups in shared memory (decode.cu
    /// K2L/V2L) rather than selected from registers by prmt.
    pub decode_lut2: bool,
    /// FAST decode, 1-bit keys beside 2-bit values: the values' codes by byte lookups in the
    /// table the keys leave free (decode.cu V1L) rather than by prmt. Measured on an H100 at
    /// (8, 32k), graph replay: qjl keys 74.1 → 63.7 µs, rabitq keys 82.9 → 74.4.
    pub decode_lut1v: bool,
    /// Split-K blocks dealt to the sequences by the pages they hold at each step (decode.cu
    /// BALANCE), not by the plan's longest: ragged batches and sequences shorter than the plan
    /// keep every block busy.
    pub decode_balance: bool,
    /// Thread-per-row encode: warps (pages) per block.
    pub encode_warps: usize,
    /// Keep an encode block's warps in step (one barrier per page).
    pub encode_lockstep: bool,
    /// Blocks per SM the thread-per-row encoder's registers allow.
    pub encode_minb: i64,
    /// Prefetch the next page's rows by cp.async (sm_80+).
    pub encode_prefetch: bool,
    /// turboquant_mse codes: two threads per row.
    pub encode_two_per_row: bool,
    /// turboquant_frac pages by the thread-per-row encoder (rows of whole words, d ≤ 128;
    /// bit-identical to the CPU on an H100, 2026-12-07: 1424 µs against 1767 µs a warp per row
    /// at 2M vectors of 3.5 bits).
    pub encode_frac_pages: bool,
    /// qjl and turboquant_prod pages of f16 input (d 64 or 128, sm_80+) with their sketch on
    /// tensor cores (`encode_sketch_mma`: signs certain beyond an error bound, the rest summed
    /// again in the CPU's order; bit-identical to the CPU on an H100, 2026-12-07: qjl 850 µs
    /// against 2715 µs on CUDA cores at 2M vectors, turboquant_prod:3 2022 against 3270).
    pub encode_sketch_mma: bool,
    /// `encode_sketch_mma`: warps (pages) per block, sharing the head's sketch (1..=8).
    pub encode_sketch_warps: usize,
    /// qjl:2x pages on tensor cores too (`encode_sketch_mma`, each block of S staged as its own
    /// S'; bit-identical to the CPU on an H100, 2026-12-08: 1405 µs against 5030–5063 µs on
    /// CUDA cores at 2M vectors).
    pub encode_sketch_mma_2x: bool,
    /// vecinfer pages by `encode_vq_pages2`: each centroid read once for two rows of a lane
    /// (two sub-vectors per warp) instead of one. Off: bit-identical but slower on an H100,
    /// 2026-12-08 (10240 and 10291 µs against 9851 and 9920 at 2M vectors).
    pub encode_vq_pairs: bool,
    /// Two-threads-per-row encode: warps per block, and blocks per SM.
    pub encode_warps2: usize,
    pub encode_minb2: i64,
    /// Flash prefill: warps per block, 16 query rows each (2, 4 or 8). Fixed per device: the
    /// blocks' row ranges set where the exact-window tiles start, so results differ in rounding.
    pub prefill_warps: usize,
    /// Shared memory per block the kernels may use, bytes (0: the device's opt-in maximum);
    /// below it, the maximum of a smaller GPU (sm_86/89: 99 KiB), as tests emulate one.
    pub smem_limit: usize,
}

impl Default for Tuning {
    fn default() -> Self {
        Self {
            decode_stages: 2,
            // 16 since the 3-bit path (H200, cuda-decode-1202.md): 2/3-bit and the serving
            // shape 4–7 % faster than 12, 4-bit within 1 %.
            decode_warps: 16,
            decode_minb: 0,
            decode_fuse_q: true,
            decode_expftz: true,
            decode_slack: 8,
            decode_pdl: true,
            decode_stream: true,
            decode_lut2: true,
            decode_lut1v: true,
            decode_balance: true,
            encode_warps: 4,
            encode_lockstep: false,
            encode_minb: 2,
            encode_prefetch: true,
            encode_two_per_row: true,
            encode_frac_pages: true,
            encode_sketch_mma: true,
            encode_sketch_warps: 8,
            encode_sketch_mma_2x: true,
            encode_vq_pairs: false,
            encode_warps2: 8,
            encode_minb2: 2,
            prefill_warps: 4,
            smem_limit: 0,
        }
    }
}

impl Tuning {
    /// The same values, each clamped to the range its kernel supports.
    pub fn clamped(self) -> Self {
        Self {
            decode_stages: self.decode_stages.clamp(2, 8),
            decode_warps: self.decode_warps.clamp(4, 16),
            decode_minb: self.decode_minb.clamp(0, 16),
            decode_slack: self.decode_slack.clamp(0, 12),
            encode_warps: self.encode_warps.clamp(1, 16),
            encode_warps2: self.encode_warps2.clamp(1, 16),
            encode_sketch_warps: self.encode_sketch_warps.clamp(1, 8),
            prefill_warps: match self.prefill_warps {
                0..=2 => 2,
                3..=4 => 4,
                _ => 8,
            },
            ..self
        }
    }
}
