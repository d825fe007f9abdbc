//! Passkey retrieval on the GPU: every trial of a length is a sequence of one engine,
//! prefilled together and decoded greedily in batched steps (the CPU harness's prompts and
//! scoring, `passkey.rs`).

use super::engine::GpuEngine;
use crate::error::Result;
use crate::eval::argmax;
use crate::passkey::{
    answer_tokens, check_trials, extract_passkey, passkey_prompt, trial_seed, PasskeyFormat, PasskeyStats,
};
use crate::tokenizer::Tokenizer;

/// As `passkey_accuracy`, through `engine` (empty, with a slot per trial and room for the
/// prompt and the answer).
pub fn passkey_accuracy_gpu(
    engine: &mut GpuEngine,
    tok: &Tokenizer,
    target_tokens: usize,
    depths: &[f64],
    n: usize,
    seed: u64,
    format: PasskeyFormat,
) -> Result<PasskeyStats> {
    check_trials(n, depths)?;
    let answer = answer_tokens(format);
    let stop = tok.stop_ids();
    let mut trials = Vec::new();
    for (di, &depth) in depths.iter().enumerate() {
        for t in 0..n {
            trials.push((di, passkey_prompt(tok, target_tokens, depth, trial_seed(seed, di, t), format)?));
        }
    }
    let slots: Vec<usize> = trials.iter().map(|_| engine.add_sequence()).collect::<Result<_>>()?;
    let items: Vec<(usize, &[u32], usize)> =
        slots.iter().zip(&trials).map(|(&s, (_, p))| (s, &p.tokens[..], p.tokens.len() - 1)).collect();
    let first = engine.prefill(&items);
    let mut said: Vec<Vec<u32>> = vec![Vec::new(); trials.len()];
    let result = first.and_then(|lg| {
        let mut next: Vec<u32> = lg.iter().map(|l| argmax(l) as u32).collect();
        let mut live: Vec<bool> = vec![true; trials.len()];
        for step in 0..answer {
            for (i, &t) in next.iter().enumerate() {
                if live[i] {
                    if stop.contains(&t) {
                        live[i] = false;
                    } else {
                        said[i].push(t);
                    }
                }
            }
            let batch: Vec<(usize, u32)> =
                (0..trials.len()).filter(|&i| live[i]).map(|i| (slots[i], next[i])).collect();
            if batch.is_empty() || step + 1 == answer {
                break;
            }
            let out = engine.step(&batch, false)?;
            for (k, &(s, _)) in batch.iter().enumerate() {
                let i = slots.iter().position(|&x| x == s).unwrap_or(0);
                next[i] = out.ids[k];
            }
        }
        Ok(())
    });
    for s in slots {
        engine.remove_sequence(s)?;
    }
    result?;
    let mut stats = PasskeyStats { target_tokens, ..Default::default() };
    for (di, &depth) in depths.iter().enumerate() {
        let mut correct = 0;
        for (i, (dj, p)) in trials.iter().enumerate() {
            if *dj != di {
                continue;
            }
            let text = tok.decode(&said[i])?;
            if extract_passkey(&text) == Some(p.passkey) {
                correct += 1;
            } else {
                stats.failures.push((depth, p.passkey, text));
            }
        }
        stats.per_depth.push((depth, n, correct));
        stats.n_trials += n;
        stats.n_correct += correct;
    }
    Ok(stats)
}
