//! Bit allocation across layers: given each (layer, stream)'s measured loss at each width
//! (e.g. the KL of the logits when only that stream is quantized) and each width's resident
//! cost, choose one width per unit minimizing the predicted total loss Σ loss within a
//! total cost — reverse water-filling in its discrete form (RateQuant-style), assuming the
//! units' losses add up.
//!
//! Solver: Lagrangian relaxation (each unit independently minimizes loss + λ·cost; λ found
//! by bisection so the total cost just fits), which is optimal on the lower convex hull of
//! every unit's (cost, loss) curve; then the budget left over is spent greedily on the
//! upgrade with the best loss drop per extra cost that still fits.

use crate::error::{LlmError, Result};

/// One option of a unit: its resident cost (bits) and predicted loss.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Choice {
    pub cost: f64,
    pub loss: f64,
}

/// Index of one option per unit minimizing Σ loss subject to Σ cost ≤ `budget`. Errors
/// when even the cheapest options exceed the budget or an option is not finite.
pub fn water_fill(units: &[Vec<Choice>], budget: f64) -> Result<Vec<usize>> {
    if units.iter().any(|u| u.is_empty()) {
        return Err(LlmError::InvalidArgument("a unit without options".into()));
    }
    if units.iter().flatten().any(|c| !c.cost.is_finite() || !c.loss.is_finite()) {
        return Err(LlmError::InvalidArgument("a non-finite cost or loss".into()));
    }
    let cheapest: f64 = units.iter().map(|u| u.iter().map(|c| c.cost).fold(f64::INFINITY, f64::min)).sum();
    if cheapest > budget {
        return Err(LlmError::InvalidArgument(format!("budget {budget} below the cheapest allocation {cheapest}")));
    }
    let pick = |lambda: f64| -> Vec<usize> {
        units
            .iter()
            .map(|u| {
                (0..u.len())
                    .min_by(|&a, &b| {
                        let f = |c: &Choice| c.loss + lambda * c.cost;
                        f(&u[a]).total_cmp(&f(&u[b])).then(u[a].cost.total_cmp(&u[b].cost))
                    })
                    .unwrap_or(0)
            })
            .collect()
    };
    let total = |p: &[usize]| p.iter().zip(units).map(|(&i, u)| u[i].cost).sum::<f64>();
    // Bisect λ: large λ buys the cheapest options, λ = 0 the lowest loss.
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    while total(&pick(hi)) > budget && hi < 1e30 {
        hi *= 4.0;
    }
    let mut best = if total(&pick(lo)) <= budget { pick(lo) } else { pick(hi) };
    if total(&pick(lo)) > budget {
        for _ in 0..200 {
            let mid = 0.5 * (lo + hi);
            if total(&pick(mid)) <= budget {
                hi = mid;
                best = pick(mid);
            } else {
                lo = mid;
            }
        }
    }
    if total(&best) > budget {
        // λ large enough never fit (ties at huge λ): fall back to the cheapest options.
        best =
            units.iter().map(|u| (0..u.len()).min_by(|&a, &b| u[a].cost.total_cmp(&u[b].cost)).unwrap_or(0)).collect();
    }
    // Spend what is left: best loss drop per extra cost among upgrades that fit.
    loop {
        let left = budget - total(&best);
        let mut step: Option<(usize, usize, f64)> = None;
        for (ui, u) in units.iter().enumerate() {
            let cur = u[best[ui]];
            for (oi, o) in u.iter().enumerate() {
                let (dc, dl) = (o.cost - cur.cost, cur.loss - o.loss);
                if dl > 0.0 && dc <= left + 1e-12 {
                    let gain = if dc <= 0.0 { f64::INFINITY } else { dl / dc };
                    if step.is_none_or(|(_, _, g)| gain > g) {
                        step = Some((ui, oi, gain));
                    }
                }
            }
        }
        match step {
            Some((ui, oi, _)) => best[ui] = oi,
            None => return Ok(best),
        }
    }
}

/// Loss at `w` from losses measured at widths `at` (ascending): piecewise log-linear (the
/// distortion of a b-bit scalar quantizer falls ≈ 4× per bit, so log-loss is ≈ linear in
/// the width), made non-increasing in the width first; clamped outside the measured range.
pub fn interpolate_loss(at: &[f64], loss: &[f64], w: f64) -> f64 {
    debug_assert_eq!(at.len(), loss.len());
    let mut mono: Vec<f64> = Vec::with_capacity(loss.len());
    for &l in loss {
        let floor = mono.last().copied().unwrap_or(f64::INFINITY);
        mono.push(l.max(0.0).min(floor));
    }
    let tiny = 1e-12;
    let ln = |v: f64| (v + tiny).ln();
    match at.iter().position(|&a| a >= w) {
        None => mono[mono.len() - 1],
        Some(0) => mono[0],
        Some(i) if at[i] == w => mono[i],
        Some(i) => {
            let t = (w - at[i - 1]) / (at[i] - at[i - 1]);
            ((1.0 - t) * ln(mono[i - 1]) + t * ln(mono[i])).exp() - tiny
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every combination (small instances only).
    fn brute(units: &[Vec<Choice>], budget: f64) -> f64 {
        let mut best = f64::INFINITY;
        let n: usize = units.iter().map(|u| u.len()).product();
        for mut code in 0..n {
            let (mut c, mut l) = (0.0, 0.0);
            for u in units {
                let o = u[code % u.len()];
                code /= u.len();
                c += o.cost;
                l += o.loss;
            }
            if c <= budget + 1e-12 {
                best = best.min(l);
            }
        }
        best
    }

    fn loss_of(units: &[Vec<Choice>], p: &[usize]) -> (f64, f64) {
        p.iter().zip(units).fold((0.0, 0.0), |(c, l), (&i, u)| (c + u[i].cost, l + u[i].loss))
    }

    #[test]
    fn matches_exhaustive_search_on_rate_distortion_curves() {
        // Units with loss a·4^−w at widths 1.5..4 (convex in cost): the exact optimum is
        // found for every budget, and more budget never costs loss.
        let widths = [1.5, 2.0, 2.5, 3.0, 3.5, 4.0];
        let mut rng = crate::test_util::pseudo(16, 3).into_iter();
        let units: Vec<Vec<Choice>> = (0..5)
            .map(|_| {
                let a = 10f64.powf(2.0 * rng.next().unwrap() as f64);
                widths.iter().map(|&w| Choice { cost: w + 0.4, loss: a * 4f64.powf(-w) }).collect()
            })
            .collect();
        let mut last = f64::INFINITY;
        for budget in [9.5, 11.0, 12.3, 14.0, 15.5, 17.0, 22.0] {
            let p = water_fill(&units, budget).unwrap();
            let (c, l) = loss_of(&units, &p);
            assert!(c <= budget + 1e-9, "budget {budget}: cost {c}");
            assert!((l - brute(&units, budget)).abs() <= 1e-9 * l.max(1e-12), "budget {budget}: {l} vs optimum");
            assert!(l <= last + 1e-12);
            last = l;
        }
        // The sensitive unit gets at least the width of every less sensitive one.
        let p = water_fill(&units, 14.0).unwrap();
        let a: Vec<f64> = units.iter().map(|u| u[0].loss).collect();
        let most = (0..5).max_by(|&i, &j| a[i].total_cmp(&a[j])).unwrap();
        assert!(p.iter().all(|&i| i <= p[most]));
    }

    #[test]
    fn greedy_fill_uses_leftover_budget_and_errors_are_typed() {
        // Non-convex: the hull skips the middle option; the leftover buys it.
        let units = vec![
            vec![Choice { cost: 1.0, loss: 10.0 }, Choice { cost: 2.0, loss: 9.5 }, Choice { cost: 3.0, loss: 0.0 }],
            vec![Choice { cost: 1.0, loss: 1.0 }, Choice { cost: 2.0, loss: 0.5 }],
        ];
        let p = water_fill(&units, 4.0).unwrap();
        assert_eq!(loss_of(&units, &p).1, brute(&units, 4.0));
        assert!(water_fill(&units, 1.5).is_err());
        assert!(water_fill(&[vec![]], 1.0).is_err());
        assert!(water_fill(&[vec![Choice { cost: 1.0, loss: f64::NAN }]], 2.0).is_err());
    }

    #[test]
    fn interpolation_is_log_linear_and_monotone() {
        let at = [2.0, 3.0, 4.0];
        // loss 0.16, 0.04, 0.01: halfway is the geometric mean.
        assert!((interpolate_loss(&at, &[0.16, 0.04, 0.01], 2.5) - 0.08).abs() < 1e-9);
        assert!((interpolate_loss(&at, &[0.16, 0.04, 0.01], 3.75) - 0.04 * 0.25f64.powf(0.75)).abs() < 1e-9);
        assert_eq!(interpolate_loss(&at, &[0.16, 0.04, 0.01], 1.0), 0.16);
        assert_eq!(interpolate_loss(&at, &[0.16, 0.04, 0.01], 5.0), 0.01);
        // A measured rise (noise) is flattened: never more loss for more bits.
        assert!(interpolate_loss(&at, &[0.1, 0.2, 0.05], 3.0) <= 0.1);
    }
}
