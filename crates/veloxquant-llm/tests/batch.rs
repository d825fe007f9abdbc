//! The batched forward equals each sequence's own forward (up to GEMM rounding).

mod common;

use veloxquant::{CacheConfig, FormatSpec};
use veloxquant_llm::eval::argmax;
use veloxquant_llm::{BatchItem, CompressedStore, Fp16Store, KvStore, LlmError};

fn compressed(c: &veloxquant_llm::LlamaConfig) -> CompressedStore {
    let mut cfg = CacheConfig::new(
        c.n_layers,
        c.n_kv_heads,
        c.head_dim,
        FormatSpec::parse("turboquant_mse:4:eden").unwrap(),
        FormatSpec::parse("turboquant_mse:3").unwrap(),
    );
    cfg.recent = 8;
    cfg.sink = 4;
    CompressedStore::new(cfg).unwrap()
}

fn rel(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

#[test]
fn batched_prefill_and_decode_match_one_sequence_at_a_time() {
    let Some(l) = common::loaded() else { return };
    let (m, c) = (&l.model, &l.model.config);
    let prompts = [
        "The lighthouse keeper had lived alone on the island for twenty years.",
        "In 1889 the tower was finished, and",
        "Rust is a systems programming language that",
    ];
    let ids: Vec<Vec<u32>> = prompts.iter().map(|p| l.tok.encode(p).unwrap()).collect();
    // Reference: each sequence alone, prefill then 6 greedy decode steps.
    let mut want = Vec::new();
    for (i, p) in ids.iter().enumerate() {
        let mut s: Box<dyn KvStore> =
            if i == 1 { Box::new(Fp16Store::for_config(c, 64)) } else { Box::new(compressed(c)) };
        let mut lg = m.forward(p, s.as_mut(), p.len() - 1).unwrap();
        let mut toks = vec![argmax(&lg) as u32];
        let mut rows = vec![lg.clone()];
        for _ in 0..6 {
            lg = m.forward(&[*toks.last().unwrap()], s.as_mut(), 0).unwrap();
            toks.push(argmax(&lg) as u32);
            rows.push(lg.clone());
        }
        want.push((toks, rows));
    }
    // Batched: sequence 0 prefills alone first; then its decode steps share a forward with
    // sequence 1's and 2's prefill chunks (mixed), then all three decode together.
    let mut s0 = compressed(c);
    let mut s1 = Fp16Store::for_config(c, 64);
    let mut s2 = compressed(c);
    let p0 = &ids[0];
    let mut out = m.forward_batch(&mut [BatchItem { tokens: p0, store: &mut s0, logits_from: p0.len() - 1 }]).unwrap();
    let mut got: Vec<(Vec<u32>, Vec<Vec<f32>>)> = vec![(vec![argmax(&out[0]) as u32], vec![out.remove(0)])];
    let (a1, b1) = ids[1].split_at(ids[1].len() / 2);
    let t0 = *got[0].0.last().unwrap();
    let out = m
        .forward_batch(&mut [
            BatchItem { tokens: &[t0], store: &mut s0, logits_from: 0 },
            BatchItem { tokens: a1, store: &mut s1, logits_from: a1.len() },
            BatchItem { tokens: &ids[2], store: &mut s2, logits_from: ids[2].len() - 1 },
        ])
        .unwrap();
    assert!(out[1].is_empty(), "no logits asked for the first chunk");
    got[0].0.push(argmax(&out[0]) as u32);
    got[0].1.push(out[0].clone());
    got.push((vec![], vec![]));
    got.push((vec![argmax(&out[2]) as u32], vec![out[2].clone()]));
    let t0 = *got[0].0.last().unwrap();
    let t2 = *got[2].0.last().unwrap();
    let out = m
        .forward_batch(&mut [
            BatchItem { tokens: &[t0], store: &mut s0, logits_from: 0 },
            BatchItem { tokens: b1, store: &mut s1, logits_from: b1.len() - 1 },
            BatchItem { tokens: &[t2], store: &mut s2, logits_from: 0 },
        ])
        .unwrap();
    for (i, o) in out.into_iter().enumerate() {
        got[i].0.push(argmax(&o) as u32);
        got[i].1.push(o);
    }
    while got.iter().any(|g| g.0.len() < 7) {
        let last: Vec<u32> = got.iter().map(|g| *g.0.last().unwrap()).collect();
        let stores: [&mut dyn veloxquant_llm::BatchStore; 3] = [&mut s0, &mut s1, &mut s2];
        let mut items: Vec<BatchItem> = Vec::new();
        let mut which = Vec::new();
        for (i, s) in stores.into_iter().enumerate() {
            if got[i].0.len() < 7 {
                items.push(BatchItem { tokens: std::slice::from_ref(&last[i]), store: s, logits_from: 0 });
                which.push(i);
            }
        }
        for (i, o) in which.into_iter().zip(m.forward_batch(&mut items).unwrap()) {
            got[i].0.push(argmax(&o) as u32);
            got[i].1.push(o);
        }
    }
    for (i, ((wt, wr), (gt, gr))) in want.iter().zip(&got).enumerate() {
        assert_eq!(wt, gt, "sequence {i}: greedy tokens differ");
        for (j, (a, b)) in gr.iter().zip(wr).enumerate() {
            let r = rel(a, b);
            assert!(r < 2e-3, "sequence {i} step {j}: relative logits difference {r:.2e}");
        }
    }
}

#[test]
fn batched_forward_rejects_bad_items_before_appending() {
    let Some(l) = common::loaded() else { return };
    let c = &l.model.config;
    let mut a = compressed(c);
    let mut b = compressed(c);
    let bad = [c.n_vocab as u32];
    let err = l
        .model
        .forward_batch(&mut [
            BatchItem { tokens: &[1, 2, 3], store: &mut a, logits_from: 2 },
            BatchItem { tokens: &bad, store: &mut b, logits_from: 0 },
        ])
        .unwrap_err();
    assert!(matches!(err, LlmError::TokenOutOfRange { .. }), "{err}");
    assert_eq!(a.len(0), 0, "nothing appended when any item is bad");
    let err = l.model.forward_batch(&mut [BatchItem { tokens: &[], store: &mut a, logits_from: 0 }]).unwrap_err();
    assert!(matches!(err, LlmError::InvalidArgument(_)), "{err}");
}
