//! Small deterministic generators for seeded rotations, sketches and tests.
//!
//! SplitMix64 (Steele, Lea, Flood 2014): tiny, fast, and its stream is fixed forever, so a
//! seed written in a cache file reproduces the same rotation on any machine.

#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Standard normal by Box–Muller (one of the pair; simplicity over speed).
    pub fn next_gaussian(&mut self) -> f64 {
        let u1 = 1.0 - self.next_f64(); // (0, 1]
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// Vector of i.i.d. N(0,1) as f32.
    pub fn gaussian_vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next_gaussian() as f32).collect()
    }

    /// Uniform random unit vector in R^d.
    pub fn unit_vec(&mut self, d: usize) -> Vec<f32> {
        let v: Vec<f64> = (0..d).map(|_| self.next_gaussian()).collect();
        let n = v.iter().map(|x| x * x).sum::<f64>().sqrt();
        v.iter().map(|x| (x / n) as f32).collect()
    }
}

/// Derive an independent seed for (layer, head, stream) from a base seed.
pub fn derive_seed(base: u64, parts: &[u64]) -> u64 {
    let mut s = SplitMix64::new(base);
    let mut h = s.next_u64();
    for &p in parts {
        s = SplitMix64::new(h ^ p.wrapping_mul(0xD6E8_FEB8_6659_FD93));
        h = s.next_u64();
    }
    h
}
