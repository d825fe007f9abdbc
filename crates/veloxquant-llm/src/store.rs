//! The KV-cache contract the model calls, and the fp16 reference cache.

use crate::error::{LlmError, Result};
use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

pub use crate::attention::causal_attention_f32;

/// One sequence's KV cache for all layers. Layouts are row-major f32.
pub trait KvStore {
    /// Append `n_tokens` new tokens to `layer`. k, v: `[n_kv_heads][n_tokens][head_dim]`, keys already RoPE'd.
    fn append(&mut self, layer: usize, k: &[f32], v: &[f32], n_tokens: usize) -> Result<()>;
    /// Causal attention of the `n_q` newest positions of `layer` (already appended). q: `[n_heads][n_q][head_dim]`, RoPE'd, not pre-scaled.
    /// Query i is at absolute position len - n_q + i and attends to keys 0..=that position, softmax scale 1/sqrt(head_dim).
    /// Returns [n_q][n_heads * head_dim].
    fn attend(&mut self, layer: usize, q: &[f32], n_q: usize) -> Result<Vec<f32>>;
    fn len(&self, layer: usize) -> usize;
    /// Bytes the held tokens occupy: keys, values and side information (room reserved ahead
    /// of the tokens is not counted).
    fn resident_bytes(&self) -> usize;
}

/// Builds a fresh, empty store (one per evaluated sequence).
pub type StoreFactory<'a> = dyn FnMut() -> Result<Box<dyn KvStore>> + 'a;

/// How a dense store keeps one value: f16 (the reference cache) or f32 (an exact oracle).
pub trait StoredValue: Copy + Default + Send + Sync + 'static {
    /// Append `src` to `dst`, converted.
    fn extend_from_f32(dst: &mut Vec<Self>, src: &[f32]);
    /// The values as f32 (borrowed when no conversion is needed).
    fn to_f32(x: &[Self]) -> std::borrow::Cow<'_, [f32]>;
    /// The values as the core's f16 rows (little-endian bytes), for the fused decode
    /// kernels; `None` for a type they do not read.
    fn f16_bytes(_x: &[Self]) -> Option<&[u8]> {
        None
    }
}

impl StoredValue for f16 {
    fn extend_from_f32(dst: &mut Vec<Self>, src: &[f32]) {
        let start = dst.len();
        dst.resize(start + src.len(), f16::ZERO);
        dst[start..].convert_from_f32_slice(src);
    }
    #[cfg(target_endian = "little")]
    fn f16_bytes(x: &[Self]) -> Option<&[u8]> {
        // SAFETY: f16 is a repr(transparent) u16: 2·len initialized bytes, no padding, u8
        // has alignment 1 and every value valid; on a little-endian target they are the LE
        // rows the core's F16 layout reads. The borrow keeps x alive and unchanged.
        Some(unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<u8>(), std::mem::size_of_val(x)) })
    }
    fn to_f32(x: &[Self]) -> std::borrow::Cow<'_, [f32]> {
        let mut out = vec![0f32; x.len()];
        x.convert_to_f32_slice(&mut out);
        out.into()
    }
}

impl StoredValue for f32 {
    fn extend_from_f32(dst: &mut Vec<Self>, src: &[f32]) {
        dst.extend_from_slice(src);
    }
    fn to_f32(x: &[Self]) -> std::borrow::Cow<'_, [f32]> {
        x.into()
    }
}

/// Caches holding fewer values than this widen on the calling thread (a short decode
/// context's few µs of conversions cost less than handing them to the pool).
const PAR_MIN_WIDEN: usize = 1 << 15;

fn widen<T: StoredValue>(heads: &[Vec<T>]) -> Vec<std::borrow::Cow<'_, [f32]>> {
    if heads.iter().map(Vec::len).sum::<usize>() < PAR_MIN_WIDEN {
        return heads.iter().map(|h| T::to_f32(h)).collect();
    }
    heads.par_iter().map(|h| T::to_f32(h)).collect()
}

fn f16_rows<T: StoredValue>(heads: &[Vec<T>]) -> Option<Vec<&[u8]>> {
    heads.iter().map(|h| T::f16_bytes(h)).collect()
}

/// An uncompressed cache: keys and values kept as `T`, attention computed in f32.
pub struct DenseStore<T: StoredValue> {
    n_kv_heads: usize,
    head_dim: usize,
    /// [layer][kv head] → [len][head_dim]
    keys: Vec<Vec<Vec<T>>>,
    values: Vec<Vec<Vec<T>>>,
    lens: Vec<usize>,
}

/// Reference cache: keys and values stored as IEEE fp16.
pub type Fp16Store = DenseStore<f16>;
/// Exact f32 cache (no rounding of K/V): an oracle for tests and for isolating fp16 effects.
pub type F32Store = DenseStore<f32>;

impl<T: StoredValue> DenseStore<T> {
    pub fn new(n_layers: usize, n_kv_heads: usize, head_dim: usize) -> Self {
        Self::with_capacity(n_layers, n_kv_heads, head_dim, 0)
    }

    /// Reserves room for `n_tokens` per layer up front (no regrowth during a window). The
    /// room is a hint: a size that overflows or cannot be reserved reserves nothing.
    pub fn with_capacity(n_layers: usize, n_kv_heads: usize, head_dim: usize, n_tokens: usize) -> Self {
        let room = n_tokens.checked_mul(head_dim).unwrap_or(0);
        let head = || {
            let mut v = Vec::new();
            if v.try_reserve_exact(room).is_err() {
                v = Vec::new();
            }
            v
        };
        let empty = || (0..n_layers).map(|_| (0..n_kv_heads).map(|_| head()).collect()).collect();
        Self { n_kv_heads, head_dim, keys: empty(), values: empty(), lens: vec![0; n_layers] }
    }

    /// Empty cache shaped for `config`, with room for `n_tokens` per layer (at most the
    /// model's context: no more can ever be appended).
    pub fn for_config(config: &crate::model::LlamaConfig, n_tokens: usize) -> Self {
        Self::with_capacity(config.n_layers, config.n_kv_heads, config.head_dim, n_tokens.min(config.n_ctx_train))
    }

    /// An independent copy of the held tokens whose buffers have room for `room` more per
    /// layer (a clone's are exactly full, so its next append would regrow and copy every
    /// head). As in [`with_capacity`](Self::with_capacity), the room is a hint.
    pub fn copy_with_room(&self, room: usize) -> Self {
        let extra = room.checked_mul(self.head_dim).unwrap_or(0);
        let copy = |layers: &[Vec<Vec<T>>]| -> Vec<Vec<Vec<T>>> {
            let head = |h: &Vec<T>| {
                let mut v = Vec::new();
                if v.try_reserve_exact(h.len().saturating_add(extra)).is_err() {
                    v = Vec::with_capacity(h.len());
                }
                v.extend_from_slice(h);
                v
            };
            layers.iter().map(|l| l.iter().map(head).collect()).collect()
        };
        Self {
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            keys: copy(&self.keys),
            values: copy(&self.values),
            lens: self.lens.clone(),
        }
    }

    fn check_layer(&self, layer: usize) -> Result<()> {
        if layer >= self.lens.len() {
            return Err(LlmError::Store(format!("layer {layer} out of range ({} layers)", self.lens.len())));
        }
        Ok(())
    }
}

impl<T: StoredValue> KvStore for DenseStore<T> {
    fn append(&mut self, layer: usize, k: &[f32], v: &[f32], n_tokens: usize) -> Result<()> {
        self.check_layer(layer)?;
        let per_head = n_tokens * self.head_dim;
        let expected = self.n_kv_heads * per_head;
        for (got, op) in [(k.len(), "append: k"), (v.len(), "append: v")] {
            if got != expected {
                return Err(LlmError::ShapeMismatch { op, expected, got });
            }
        }
        for g in 0..self.n_kv_heads {
            T::extend_from_f32(&mut self.keys[layer][g], &k[g * per_head..(g + 1) * per_head]);
            T::extend_from_f32(&mut self.values[layer][g], &v[g * per_head..(g + 1) * per_head]);
        }
        self.lens[layer] += n_tokens;
        Ok(())
    }

    fn attend(&mut self, layer: usize, q: &[f32], n_q: usize) -> Result<Vec<f32>> {
        self.check_layer(layer)?;
        // One query token (decode): fused over the f16 rows, no f32 copy of the cache.
        if n_q == 1 && self.lens[layer] > 0 {
            if let (Some(k), Some(v)) = (f16_rows(&self.keys[layer]), f16_rows(&self.values[layer])) {
                return crate::attention::decode_attention_f16(q, &k, &v, self.lens[layer], self.head_dim);
            }
        }
        let (kf, vf) = (widen(&self.keys[layer]), widen(&self.values[layer]));
        let kr: Vec<&[f32]> = kf.iter().map(|x| x.as_ref()).collect();
        let vr: Vec<&[f32]> = vf.iter().map(|x| x.as_ref()).collect();
        causal_attention_f32(q, n_q, &kr, &vr, self.lens[layer], self.head_dim)
    }

    fn len(&self, layer: usize) -> usize {
        self.lens.get(layer).copied().unwrap_or(0)
    }

    /// Bytes of the keys and values held (reserved room not counted, as for the compressed
    /// cache: the same tokens cost the same whatever was reserved).
    fn resident_bytes(&self) -> usize {
        self.keys.iter().chain(self.values.iter()).flatten().map(|h| std::mem::size_of_val(h.as_slice())).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::pseudo;

    #[test]
    fn fp16_store_appends_in_chunks_like_one_shot() {
        let (hd, n_kv, n_heads, len) = (8, 2, 4, 40);
        let k = pseudo(n_kv * len * hd, 1);
        let v = pseudo(n_kv * len * hd, 2);
        let q = pseudo(n_heads * hd, 3);
        let mut one = Fp16Store::new(1, n_kv, hd);
        one.append(0, &k, &v, len).unwrap();
        let mut two = Fp16Store::new(1, n_kv, hd);
        let split = |x: &[f32], a: usize, b: usize| -> Vec<f32> {
            (0..n_kv).flat_map(|g| x[(g * len + a) * hd..(g * len + b) * hd].to_vec()).collect()
        };
        two.append(0, &split(&k, 0, 25), &split(&v, 0, 25), 25).unwrap();
        two.append(0, &split(&k, 25, len), &split(&v, 25, len), len - 25).unwrap();
        assert_eq!(one.len(0), len);
        assert_eq!(two.len(0), len);
        assert_eq!(one.attend(0, &q, 1).unwrap(), two.attend(0, &q, 1).unwrap());
        assert_eq!(one.resident_bytes(), 2 * n_kv * len * hd * 2);
        // A reservation beyond memory, or one whose size overflows, is only a hint.
        assert_eq!(Fp16Store::with_capacity(1, 2, 64, usize::MAX / 8).resident_bytes(), 0);
        assert_eq!(Fp16Store::with_capacity(1, 1, 1 << 20, 1 << 50).resident_bytes(), 0);
    }

    /// A copy continues exactly as the original would, leaves the original alone, and has
    /// its room reserved (no regrowth on the next appends).
    #[test]
    fn copy_with_room_continues_like_the_original() {
        let (hd, n_kv, n_heads) = (8, 2, 4);
        let mut a = Fp16Store::new(2, n_kv, hd);
        for l in 0..2 {
            a.append(l, &pseudo(n_kv * 5 * hd, 1 + l as u32), &pseudo(n_kv * 5 * hd, 3 + l as u32), 5).unwrap();
        }
        let mut b = a.copy_with_room(7);
        assert!(b.keys.iter().chain(&b.values).flatten().all(|h| h.capacity() >= (5 + 7) * hd));
        let (k, v, q) = (pseudo(n_kv * hd, 10), pseudo(n_kv * hd, 11), pseudo(n_heads * hd, 12));
        b.append(1, &k, &v, 1).unwrap();
        assert_eq!((a.len(1), b.len(1), b.len(0)), (5, 6, 5));
        let mut want = Fp16Store::new(2, n_kv, hd);
        want.append(1, &pseudo(n_kv * 5 * hd, 2), &pseudo(n_kv * 5 * hd, 4), 5).unwrap();
        want.append(1, &k, &v, 1).unwrap();
        assert_eq!(b.attend(1, &q, 1).unwrap(), want.attend(1, &q, 1).unwrap());
        assert_eq!(b.resident_bytes(), a.resident_bytes() + 2 * n_kv * hd * 2);
    }

    #[test]
    fn fp16_store_rejects_bad_shapes() {
        let mut s = Fp16Store::new(2, 3, 4);
        assert!(matches!(s.append(0, &[0.0; 11], &[0.0; 12], 1), Err(LlmError::ShapeMismatch { .. })));
        assert!(matches!(s.append(2, &[0.0; 12], &[0.0; 12], 1), Err(LlmError::Store(_))));
        s.append(0, &[0.0; 12], &[0.0; 12], 1).unwrap();
        assert!(s.attend(0, &[0.0; 8], 2).is_err()); // n_q > len
        assert!(s.attend(0, &[0.0; 8], 1).is_err()); // 2 heads not a multiple of 3 kv heads
    }
}
