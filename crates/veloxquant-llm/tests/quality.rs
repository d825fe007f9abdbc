//! The quality tooling on the real model: a pass started at a layer from recorded hidden
//! states equals the full pass; a per-layer cache quantizing one layer only changes what
//! that layer's codes change.

mod common;

use veloxquant::{CacheConfig, FormatSpec, LayerSpec};
use veloxquant_llm::{CompressedStore, Fp16Store, KvStore};

#[test]
fn forward_from_a_recorded_layer_equals_the_full_pass() {
    let Some(l) = common::loaded() else { return };
    let (m, c) = (&l.model, &l.model.config);
    let ids = l.tok.encode("The quick brown fox jumps over the lazy dog. In 1889, the tower was finished.").unwrap();
    let mut hidden = vec![Vec::new(); c.n_layers];
    let mut a = Fp16Store::for_config(c, ids.len());
    let full = m.forward_recording(&ids, &mut a, 3, &mut |li, x| hidden[li] = x.to_vec()).unwrap();
    assert_eq!(full, m.forward(&ids, &mut Fp16Store::for_config(c, ids.len()), 3).unwrap());
    for first in [0, 1, 17, c.n_layers - 1] {
        let mut b = Fp16Store::for_config(c, ids.len());
        let from = m.forward_from_layer(hidden[first].clone(), first, &mut b, 3).unwrap();
        assert_eq!(from, full, "starting at layer {first}");
        assert_eq!((b.len(first), b.len(c.n_layers - 1)), (ids.len(), ids.len()));
        if first > 0 {
            assert_eq!(b.len(first - 1), 0, "layers before the start are untouched");
        }
    }
    // A different starting state changes the result; bad arguments are typed errors.
    let mut b = Fp16Store::for_config(c, ids.len());
    let shifted: Vec<f32> = hidden[5].iter().map(|v| v * 1.5).collect();
    assert_ne!(m.forward_from_layer(shifted, 5, &mut b, 3).unwrap(), full);
    let mut b = Fp16Store::for_config(c, ids.len());
    assert!(m.forward_from_layer(hidden[5].clone(), c.n_layers, &mut b, 3).is_err());
    assert!(m.forward_from_layer(hidden[5][1..].to_vec(), 5, &mut b, 3).is_err());
    assert!(m.forward_from_layer(hidden[5].clone(), 5, &mut b, ids.len() + 1).is_err());
}

#[test]
fn a_per_layer_cache_with_one_coded_layer_matches_fp16_before_it() {
    let Some(l) = common::loaded() else { return };
    let (m, c) = (&l.model, &l.model.config);
    let ids = l.tok.encode("Passages of text run through the model one token at a time, then all at once.").unwrap();
    let fp16 = FormatSpec::parse("fp16").unwrap();
    let q = FormatSpec::parse("turboquant_mse:2").unwrap();
    let mut layers = vec![LayerSpec::new(fp16.clone(), fp16.clone()); c.n_layers];
    layers[20] = LayerSpec::new(q.clone(), fp16.clone());
    let mut cfg = CacheConfig::new(c.n_layers, c.n_kv_heads, c.head_dim, fp16.clone(), fp16);
    cfg.layers = Some(layers);
    let mut hidden_a = vec![Vec::new(); c.n_layers];
    let mut hidden_b = vec![Vec::new(); c.n_layers];
    let mut a = CompressedStore::new(cfg.clone()).unwrap();
    cfg.layers = None;
    let mut b = CompressedStore::new(cfg).unwrap();
    let la = m.forward_recording(&ids, &mut a, 0, &mut |li, x| hidden_a[li] = x.to_vec()).unwrap();
    let lb = m.forward_recording(&ids, &mut b, 0, &mut |li, x| hidden_b[li] = x.to_vec()).unwrap();
    // Identical inputs up to and including layer 20; its 2-bit keys change what follows.
    assert_eq!(hidden_a[..=20], hidden_b[..=20]);
    assert_ne!(hidden_a[21], hidden_b[21]);
    assert_ne!(la, lb);
    assert!(a.resident_bytes() < b.resident_bytes());
}
