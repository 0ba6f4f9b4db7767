//! Greedy, temperature, top-k and top-p sampling over one row of logits, with the request's own
//! seeded generator. The math goes through `libm` so native and wasm agree bit for bit; ties are
//! broken by the lower token id.

use crate::error::{OrtexError, Result};
use crate::rng::Rng;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// None (or 0): greedy.
    pub temperature: Option<f64>,
    /// 0: no top-k cut.
    pub top_k: u32,
    /// 1.0: no nucleus cut.
    pub top_p: f64,
}

impl SamplingParams {
    pub fn new(temperature: Option<f64>, top_k: Option<u32>, top_p: Option<f64>) -> Result<Self> {
        if let Some(t) = temperature {
            if !t.is_finite() || t < 0.0 {
                return Err(OrtexError::invalid(format!("temperature must be a finite number >= 0, got {t}")));
            }
        }
        let top_p = top_p.unwrap_or(1.0);
        if !top_p.is_finite() || top_p <= 0.0 || top_p > 1.0 {
            return Err(OrtexError::invalid(format!("topP must be in (0, 1], got {top_p}")));
        }
        Ok(SamplingParams { temperature: temperature.filter(|&t| t > 0.0), top_k: top_k.unwrap_or(0), top_p })
    }

    pub const GREEDY: SamplingParams = SamplingParams { temperature: None, top_k: 0, top_p: 1.0 };

    pub fn is_greedy(&self) -> bool {
        self.temperature.is_none()
    }
}

/// One row of next-token scores: the full vocabulary (a real model) or a few candidates (the
/// simulated model, which must stay O(1) per token).
#[derive(Debug, Clone, Copy)]
pub enum RowLogits<'a> {
    Dense(&'a [f32]),
    Sparse { ids: &'a [u32], logits: &'a [f32] },
}

impl RowLogits<'_> {
    fn len(&self) -> usize {
        match self {
            RowLogits::Dense(v) => v.len(),
            RowLogits::Sparse { ids, .. } => ids.len(),
        }
    }

    fn get(&self, i: usize) -> (u32, f32) {
        match self {
            RowLogits::Dense(v) => (i as u32, v[i]),
            RowLogits::Sparse { ids, logits } => (ids[i], logits[i]),
        }
    }
}

/// `a` ranks before `b`: higher score, then lower token id. NaN scores rank last.
fn ranks_before(a: (u32, f32), b: (u32, f32)) -> bool {
    let (sa, sb) =
        (if a.1.is_nan() { f32::NEG_INFINITY } else { a.1 }, if b.1.is_nan() { f32::NEG_INFINITY } else { b.1 });
    sa > sb || (sa == sb && a.0 < b.0)
}

pub fn argmax(row: RowLogits<'_>) -> u32 {
    assert!(row.len() > 0, "a logits row is never empty");
    match row {
        // One loop per layout: the per-element layout match would cost more than the compare.
        RowLogits::Dense(logits) => argmax_of(logits.iter().enumerate().map(|(i, &l)| (i as u32, l))),
        RowLogits::Sparse { ids, logits } => argmax_of(ids.iter().copied().zip(logits.iter().copied())),
    }
}

/// Highest score, ties to the lower id; NaN never wins (if every score is NaN, the first id).
fn argmax_of(candidates: impl Iterator<Item = (u32, f32)>) -> u32 {
    let mut best_id = u32::MAX;
    let mut first_id = u32::MAX;
    let mut best = f32::NEG_INFINITY;
    for (id, score) in candidates {
        if first_id == u32::MAX {
            first_id = id;
        }
        if score > best || (score == best && id < best_id) {
            best = score;
            best_id = id;
        }
    }
    if best_id == u32::MAX {
        first_id
    } else {
        best_id
    }
}

/// Samples one token id. `scratch` is reused across calls to avoid allocation on the hot path.
pub fn sample(row: RowLogits<'_>, params: &SamplingParams, rng: &mut Rng, scratch: &mut Vec<(u32, f32)>) -> u32 {
    let Some(temperature) = params.temperature else {
        return argmax(row);
    };
    scratch.clear();
    scratch.extend((0..row.len()).map(|i| row.get(i)));
    scratch.sort_by(|a, b| {
        if ranks_before(*a, *b) {
            std::cmp::Ordering::Less
        } else if ranks_before(*b, *a) {
            std::cmp::Ordering::Greater
        } else {
            std::cmp::Ordering::Equal
        }
    });
    if params.top_k > 0 && (params.top_k as usize) < scratch.len() {
        scratch.truncate(params.top_k as usize);
    }
    let max_score = f64::from(scratch[0].1);
    let weights_total: f64 = scratch.iter().map(|c| weight(c.1, max_score, temperature)).sum();
    // Nucleus: keep the smallest prefix whose probability mass reaches top_p.
    let mut kept = scratch.len();
    if params.top_p < 1.0 {
        let mut mass = 0.0;
        for (i, c) in scratch.iter().enumerate() {
            mass += weight(c.1, max_score, temperature) / weights_total;
            if mass >= params.top_p {
                kept = i + 1;
                break;
            }
        }
    }
    let kept_total: f64 = scratch[..kept].iter().map(|c| weight(c.1, max_score, temperature)).sum();
    let mut target = rng.next_f64() * kept_total;
    for c in &scratch[..kept] {
        target -= weight(c.1, max_score, temperature);
        if target < 0.0 {
            return c.0;
        }
    }
    scratch[kept - 1].0
}

fn weight(score: f32, max_score: f64, temperature: f64) -> f64 {
    if score.is_nan() {
        return 0.0;
    }
    libm::exp((f64::from(score) - max_score) / temperature)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_highest_and_breaks_ties_by_lower_id() {
        let logits = [0.5f32, 2.0, 2.0, -1.0];
        assert_eq!(argmax(RowLogits::Dense(&logits)), 1);
        let ids = [9u32, 4, 7];
        let l = [1.0f32, 1.0, 0.0];
        assert_eq!(argmax(RowLogits::Sparse { ids: &ids, logits: &l }), 4);
    }

    #[test]
    fn greedy_never_picks_nan_and_survives_all_nan() {
        let logits = [f32::NAN, 1.0, f32::NAN];
        assert_eq!(argmax(RowLogits::Dense(&logits)), 1);
        let all_nan = [f32::NAN, f32::NAN];
        assert_eq!(argmax(RowLogits::Dense(&all_nan)), 0);
        let neg = [f32::NEG_INFINITY, f32::NEG_INFINITY];
        assert_eq!(argmax(RowLogits::Dense(&neg)), 0);
    }

    #[test]
    fn top_k_one_is_greedy() {
        let logits = [0.1f32, 0.3, 0.2];
        let p = SamplingParams::new(Some(1.0), Some(1), None).unwrap();
        let mut rng = Rng::new(3);
        let mut s = Vec::new();
        for _ in 0..50 {
            assert_eq!(sample(RowLogits::Dense(&logits), &p, &mut rng, &mut s), 1);
        }
    }

    #[test]
    fn tiny_top_p_keeps_only_the_best() {
        let logits = [0.0f32, 5.0, 1.0];
        let p = SamplingParams::new(Some(1.0), None, Some(0.01)).unwrap();
        let mut rng = Rng::new(5);
        let mut s = Vec::new();
        for _ in 0..50 {
            assert_eq!(sample(RowLogits::Dense(&logits), &p, &mut rng, &mut s), 1);
        }
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_varied() {
        let logits = [1.0f32, 1.0, 1.0, 1.0];
        let p = SamplingParams::new(Some(1.0), None, None).unwrap();
        let run = |seed| {
            let mut rng = Rng::new(seed);
            let mut s = Vec::new();
            (0..64).map(|_| sample(RowLogits::Dense(&logits), &p, &mut rng, &mut s)).collect::<Vec<_>>()
        };
        assert_eq!(run(11), run(11));
        let seen: std::collections::BTreeSet<u32> = run(11).into_iter().collect();
        assert_eq!(seen.len(), 4, "uniform logits should reach every token");
    }

    #[test]
    fn bad_parameters_are_refused() {
        assert!(SamplingParams::new(Some(f64::NAN), None, None).is_err());
        assert!(SamplingParams::new(Some(-1.0), None, None).is_err());
        assert!(SamplingParams::new(None, None, Some(0.0)).is_err());
        assert!(SamplingParams::new(None, None, Some(1.5)).is_err());
        assert!(SamplingParams::new(Some(0.0), None, None).unwrap().is_greedy());
    }
}
