//! Penalties (repetition, presence, frequency), then greedy, or temperature with top-k, top-p and
//! min-p, over one row of logits, with the request's own seeded generator. The math goes through
//! `libm` so native and wasm agree bit for bit; ties are broken by the lower token id.

use crate::error::{OrtexError, Result};
use crate::executor::RowLogits;
use crate::options::TurnOptions;
use crate::rng::Rng;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// None (or 0): greedy.
    pub temperature: Option<f64>,
    /// 0: no top-k cut.
    pub top_k: u32,
    /// 1.0: no nucleus cut.
    pub top_p: f64,
    /// 0.0: no cut. Drops every token whose probability is below `min_p` times the best one's
    /// (after temperature), as llama.cpp and vLLM do.
    pub min_p: f64,
    pub penalties: Penalties,
}

/// Penalties on tokens already seen, applied to the logits before anything else (so greedy
/// decoding feels them too). The neutral values (1, 0, 0) leave the logits untouched.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Penalties {
    /// Above 0; 1.0: none. A token anywhere in the request's context (prompts and generated tokens)
    /// has its logit divided by this when positive and multiplied when negative (CTRL, as Hugging
    /// Face's `repetition_penalty` and llama.cpp's `repeat_penalty`).
    pub repetition: f64,
    /// In [-2, 2]; subtracted once from the logit of each token this turn has generated (OpenAI's
    /// `presence_penalty`).
    pub presence: f64,
    /// In [-2, 2]; subtracted once per occurrence of a token this turn has generated (OpenAI's
    /// `frequency_penalty`).
    pub frequency: f64,
}

impl Penalties {
    pub const NONE: Penalties = Penalties { repetition: 1.0, presence: 0.0, frequency: 0.0 };

    pub fn is_none(&self) -> bool {
        *self == Penalties::NONE
    }
}

/// Largest repetition penalty accepted: past it every seen token is as good as banned already.
pub const MAX_REPETITION_PENALTY: f64 = 100.0;
/// OpenAI's range for presence and frequency penalties.
pub const MAX_ABS_OPENAI_PENALTY: f64 = 2.0;

fn in_range(name: &str, value: Option<f64>, min: f64, max: f64, neutral: f64) -> Result<f64> {
    match value {
        None => Ok(neutral),
        Some(v) if v.is_finite() && v >= min && v <= max => Ok(v),
        Some(v) => Err(OrtexError::invalid(format!("{name} must be a number in [{min}, {max}], got {v}"))),
    }
}

impl SamplingParams {
    /// A turn's sampling options, checked; each absent one at its neutral value.
    pub fn from_options(options: &TurnOptions) -> Result<Self> {
        if let Some(t) = options.temperature {
            if !t.is_finite() || t < 0.0 {
                return Err(OrtexError::invalid(format!("temperature must be a finite number >= 0, got {t}")));
            }
        }
        let top_p = options.top_p.unwrap_or(1.0);
        if !top_p.is_finite() || top_p <= 0.0 || top_p > 1.0 {
            return Err(OrtexError::invalid(format!("topP must be in (0, 1], got {top_p}")));
        }
        let min_p = in_range("minP", options.min_p, 0.0, 1.0, 0.0)?;
        let repetition = match options.repetition_penalty {
            None => 1.0,
            Some(v) if v.is_finite() && v > 0.0 && v <= MAX_REPETITION_PENALTY => v,
            Some(v) => {
                return Err(OrtexError::invalid(format!(
                    "repetitionPenalty must be a number in (0, {MAX_REPETITION_PENALTY}], got {v}"
                )))
            }
        };
        let m = MAX_ABS_OPENAI_PENALTY;
        let presence = in_range("presencePenalty", options.presence_penalty, -m, m, 0.0)?;
        let frequency = in_range("frequencyPenalty", options.frequency_penalty, -m, m, 0.0)?;
        Ok(SamplingParams {
            temperature: options.temperature.filter(|&t| t > 0.0),
            top_k: options.top_k.unwrap_or(0),
            top_p,
            min_p,
            penalties: Penalties { repetition, presence, frequency },
        })
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

/// What a row's penalties look at: the request's whole context, whose last `generated` tokens are
/// this turn's output.
#[derive(Debug, Clone, Copy)]
pub struct History<'a> {
    pub context: &'a [i32],
    pub generated: usize,
}

/// Buffers reused across calls so that the hot path does not allocate.
#[derive(Debug, Default)]
pub struct SamplerScratch {
    candidates: Vec<(u32, f32)>,
    /// The candidates with their `rank_key`, as the sampler ranks them.
    keyed: Vec<(u64, f32)>,
    /// (token id, times this turn generated it), sorted by id, one entry per id seen.
    seen: Vec<(u32, u32)>,
}

/// Samples one token id.
pub fn sample(
    row: RowLogits<'_>,
    params: &SamplingParams,
    history: History<'_>,
    rng: &mut Rng,
    scratch: &mut SamplerScratch,
) -> u32 {
    if params.penalties.is_none() && params.temperature.is_none() {
        return argmax(row);
    }
    fill_candidates(row, &params.penalties, history, scratch);
    let Some(temperature) = params.temperature else {
        return argmax_of(scratch.candidates.iter().copied());
    };
    sample_candidates(&scratch.candidates, &mut scratch.keyed, params, temperature, rng)
}

/// `scratch.candidates` = the row's (id, logit) pairs with the penalties applied.
fn fill_candidates(row: RowLogits<'_>, penalties: &Penalties, history: History<'_>, scratch: &mut SamplerScratch) {
    let candidates = &mut scratch.candidates;
    candidates.clear();
    candidates.extend((0..row.len()).map(|i| row.get(i)));
    if penalties.is_none() {
        return;
    }
    collect_seen(penalties, history, &mut scratch.seen);
    match row {
        // Dense rows are indexed by id: touch only the seen ids.
        RowLogits::Dense(_) => {
            for &(id, generated_count) in &scratch.seen {
                if let Some(candidate) = candidates.get_mut(id as usize) {
                    candidate.1 = penalized(candidate.1, generated_count, penalties);
                }
            }
        }
        RowLogits::Sparse { .. } => {
            for candidate in candidates.iter_mut() {
                if let Ok(at) = scratch.seen.binary_search_by_key(&candidate.0, |&(id, _)| id) {
                    candidate.1 = penalized(candidate.1, scratch.seen[at].1, penalties);
                }
            }
        }
    }
}

/// The ids the penalties apply to, with this turn's count of each. The repetition penalty looks at
/// the whole context; presence and frequency at this turn's output only (as vLLM does).
fn collect_seen(penalties: &Penalties, history: History<'_>, seen: &mut Vec<(u32, u32)>) {
    let generated_start = history.context.len() - history.generated.min(history.context.len());
    let (earlier, generated) = history.context.split_at(generated_start);
    seen.clear();
    if penalties.repetition != 1.0 {
        seen.extend(earlier.iter().map(|&t| (t as u32, 0)));
    }
    seen.extend(generated.iter().map(|&t| (t as u32, 1)));
    seen.sort_unstable();
    seen.dedup_by(|later, kept| {
        let same = later.0 == kept.0;
        if same {
            kept.1 += later.1;
        }
        same
    });
}

/// One seen token's logit after the penalties; f64 arithmetic rounded once, the same on every target.
fn penalized(logit: f32, generated_count: u32, penalties: &Penalties) -> f32 {
    let mut value = f64::from(logit);
    if penalties.repetition != 1.0 {
        value = if value > 0.0 { value / penalties.repetition } else { value * penalties.repetition };
    }
    if generated_count > 0 {
        value -= penalties.presence + f64::from(generated_count) * penalties.frequency;
    }
    value as f32
}

/// Temperature, top-k, top-p and min-p over the candidates, then one draw. The arithmetic is that
/// of a walk over the candidates sorted best first; the candidates are only ranked as far as the
/// walks reach (see `Ranking`), and each sum stops where the rest of the tail cannot change it.
fn sample_candidates(
    candidates: &[(u32, f32)],
    keyed: &mut Vec<(u64, f32)>,
    params: &SamplingParams,
    temperature: f64,
    rng: &mut Rng,
) -> u32 {
    keyed.clear();
    keyed.extend(candidates.iter().map(|&c| (rank_key(c), c.1)));
    let mut kept = candidates.len();
    if params.top_k > 0 && (params.top_k as usize) < kept {
        kept = params.top_k as usize;
    }
    let mut ranking = Ranking::new(keyed, kept);
    let max_score = f64::from(ranking.get(0).1);
    if params.top_p < 1.0 {
        kept = nucleus_len(&mut ranking, kept, max_score, temperature, params.top_p);
    }
    if params.min_p > 0.0 {
        // The best candidate's weight is exp(0) = 1, so min_p compares against the weight itself;
        // weights fall along the ranking, so the kept ones are a prefix.
        let below = (0..kept).find(|&i| weight(ranking.get(i).1, max_score, temperature) < params.min_p);
        kept = below.unwrap_or(kept).max(1);
    }
    let kept_total = ranked_weight_sum(&mut ranking, kept, max_score, temperature);
    let mut target = rng.next_f64() * kept_total;
    for i in 0..kept {
        let c = ranking.get(i);
        target -= weight(c.1, max_score, temperature);
        if target < 0.0 {
            return c.0;
        }
    }
    ranking.get(kept - 1).0
}

/// The smallest ranked prefix (of the first `kept`) whose probability mass reaches `top_p`.
fn nucleus_len(ranking: &mut Ranking<'_>, kept: usize, max_score: f64, temperature: f64, top_p: f64) -> usize {
    let weights_total = ranked_weight_sum(ranking, kept, max_score, temperature);
    let mut mass = 0.0;
    for i in 0..kept {
        mass += weight(ranking.get(i).1, max_score, temperature) / weights_total;
        if mass >= top_p {
            return i + 1;
        }
    }
    kept
}

/// The weights of the first `kept` candidates, added best first. Once a weight is under half the
/// float spacing at the running total (a quarter, for the last-bit error of `exp`), adding it
/// rounds back to the same total, and so does every later one (no larger): the sum is final
/// without ranking the tail. A score more than `NEGLIGIBLE_LOG_WEIGHT * temperature` below the
/// best has such a weight at any total >= 1 (the best's weight is 1), which bounds the ranking.
fn ranked_weight_sum(ranking: &mut Ranking<'_>, kept: usize, max_score: f64, temperature: f64) -> f64 {
    if kept > ranking.ranked {
        let mattering = ranking.count_scoring_at_least(max_score + NEGLIGIBLE_LOG_WEIGHT * temperature);
        ranking.rank_first(mattering.min(kept));
    }
    let mut total = 0.0;
    for i in 0..kept {
        let w = weight(ranking.get(i).1, max_score, temperature);
        if total > 0.0 && total < f64::INFINITY && w * 4.0 <= spacing_below(total) {
            break;
        }
        total += w;
    }
    total
}

/// exp(-40) < 2^-55, a quarter of the spacing just below 1.
const NEGLIGIBLE_LOG_WEIGHT: f64 = -40.0;

/// The gap between a positive finite `x` and the next float below it (never above the gap above).
fn spacing_below(x: f64) -> f64 {
    x - f64::from_bits(x.to_bits() - 1)
}

/// The candidates as (`rank_key`, score), ranked best first only as far as asked: `items[..ranked]`
/// is sorted by key and ranks before every later item, which stay in no particular order. Only the
/// first `limit` (the top-k cut) can ever be asked for. The key is computed once per candidate, so
/// that a comparison is one u64 compare; the score stays as it came (NaN, -0.0) for the weights.
///
/// ```text
///   items: [ ranked, sorted | not yet ranked, all after the ranked ones ]
///          0                ranked                                    len
/// ```
struct Ranking<'a> {
    items: &'a mut [(u64, f32)],
    ranked: usize,
    limit: usize,
}

/// The fewest candidates ranked at a time: a partial sort of a few is as cheap as a select.
const MIN_RANKED: usize = 64;

impl<'a> Ranking<'a> {
    fn new(items: &'a mut [(u64, f32)], limit: usize) -> Self {
        assert!(limit > 0 && limit <= items.len(), "a ranking keeps at least one candidate and at most all");
        Ranking { items, ranked: 0, limit }
    }

    /// The candidate of rank `i` (0: the best), for `i` below the limit.
    fn get(&mut self, i: usize) -> (u32, f32) {
        if i >= self.ranked {
            // Grow four-fold: walking the whole row then costs a few selects and one sort.
            self.rank_first((i + 1).max(self.ranked * 4).max(MIN_RANKED));
        }
        let (key, score) = self.items[i];
        (key as u32, score)
    }

    /// Ranks the first `count` candidates (at most the limit; past half the row, all of it).
    fn rank_first(&mut self, count: usize) {
        let mut end = count.min(self.limit);
        if end <= self.ranked {
            return;
        }
        if end > self.items.len() / 2 {
            end = self.limit;
        }
        let rest = &mut self.items[self.ranked..];
        let wanted = end - self.ranked;
        if wanted < rest.len() {
            rest.select_nth_unstable_by_key(wanted - 1, |c| c.0);
        }
        rest[..wanted].sort_unstable_by_key(|c| c.0);
        self.ranked = end;
    }

    /// How many candidates score `threshold` or more (NaN never does).
    fn count_scoring_at_least(&self, threshold: f64) -> usize {
        self.items.iter().filter(|c| f64::from(c.1) >= threshold).count()
    }
}

/// A candidate's place, smallest first: higher score, then lower token id, as `ranks_before`. NaN
/// ranks with -inf, and -0.0 with 0.0 (they compare equal), so equal keys differ in no weight.
fn rank_key((id, score): (u32, f32)) -> u64 {
    let score = if score.is_nan() { f32::NEG_INFINITY } else { score + 0.0 };
    let bits = score.to_bits();
    // Flipping makes the bits order as the floats do: negatives reversed, then positives.
    let ascending = if bits >> 31 == 1 { !bits } else { bits | 1 << 31 };
    (u64::from(!ascending) << 32) | u64::from(id)
}

/// Most alternatives a turn may ask log-probabilities for (OpenAI's `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// One generated token's log-probability under the model's own distribution (the log-softmax of
/// the row's raw logits: before penalties, temperature and cuts, as vLLM reports by default), and
/// the most likely alternatives, best first, ties to the lower id. A sparse row (the simulated
/// model) is a distribution over its candidates.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f64,
    pub top: Vec<(u32, f64)>,
}

/// `token`'s entry of `row` (which must hold it) with the `top` best alternatives.
pub fn logprobs(row: RowLogits<'_>, token: u32, top: u32, best: &mut Vec<(u32, f32)>) -> TokenLogprobs {
    let score = |s: f32| if s.is_nan() { f32::NEG_INFINITY } else { s };
    let max = (0..row.len()).map(|i| score(row.get(i).1)).fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        // Every score masked (a constrained simulated row whose token came from outside its
        // candidates): nothing in the row has any probability.
        return TokenLogprobs { token, logprob: f64::NEG_INFINITY, top: Vec::new() };
    }
    let max = f64::from(max);
    let mut sum = 0.0;
    let mut token_score = f32::NEG_INFINITY;
    best.clear();
    for i in 0..row.len() {
        let (id, s) = row.get(i);
        let s = score(s);
        sum += libm::exp(f64::from(s) - max);
        if id == token {
            token_score = s;
        }
        keep_best(best, (id, s), top as usize);
    }
    let log_total = max + libm::log(sum);
    TokenLogprobs {
        token,
        logprob: f64::from(token_score) - log_total,
        top: best.iter().map(|&(id, s)| (id, f64::from(s) - log_total)).collect(),
    }
}

/// Inserts `candidate` into `best` (sorted, best first, at most `limit` long): O(limit) per call,
/// and `limit` is at most MAX_TOP_LOGPROBS.
fn keep_best(best: &mut Vec<(u32, f32)>, candidate: (u32, f32), limit: usize) {
    if limit == 0 || (best.len() == limit && !ranks_before(candidate, best[limit - 1])) {
        return;
    }
    let at = best.iter().position(|&b| ranks_before(candidate, b)).unwrap_or(best.len());
    best.insert(at, candidate);
    best.truncate(limit);
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

    // Shorthands for the tests: the engine builds its parameters only from a turn's options.
    impl SamplingParams {
        fn new(temperature: Option<f64>, top_k: Option<u32>, top_p: Option<f64>) -> Result<Self> {
            Self::from_options(&TurnOptions { temperature, top_k, top_p, ..TurnOptions::default() })
        }

        const GREEDY: SamplingParams =
            SamplingParams { temperature: None, top_k: 0, top_p: 1.0, min_p: 0.0, penalties: Penalties::NONE };
    }

    impl History<'_> {
        const EMPTY: History<'static> = History { context: &[], generated: 0 };
    }

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
        let mut s = SamplerScratch::default();
        for _ in 0..50 {
            assert_eq!(sample(RowLogits::Dense(&logits), &p, History::EMPTY, &mut rng, &mut s), 1);
        }
    }

    #[test]
    fn tiny_top_p_keeps_only_the_best() {
        let logits = [0.0f32, 5.0, 1.0];
        let p = SamplingParams::new(Some(1.0), None, Some(0.01)).unwrap();
        let mut rng = Rng::new(5);
        let mut s = SamplerScratch::default();
        for _ in 0..50 {
            assert_eq!(sample(RowLogits::Dense(&logits), &p, History::EMPTY, &mut rng, &mut s), 1);
        }
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_varied() {
        let logits = [1.0f32, 1.0, 1.0, 1.0];
        let p = SamplingParams::new(Some(1.0), None, None).unwrap();
        let run = |seed| {
            let mut rng = Rng::new(seed);
            let mut s = SamplerScratch::default();
            (0..64).map(|_| sample(RowLogits::Dense(&logits), &p, History::EMPTY, &mut rng, &mut s)).collect::<Vec<_>>()
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
        assert_eq!(SamplingParams::new(Some(0.0), None, None).unwrap(), SamplingParams::GREEDY);
    }

    #[test]
    fn repetition_penalty_steers_greedy_away_from_seen_tokens() {
        let logits = [1.0f32, 3.0, 2.9, -1.0];
        let input = TurnOptions { repetition_penalty: Some(1.5), ..TurnOptions::default() };
        let p = SamplingParams::from_options(&input).unwrap();
        let mut rng = Rng::new(1);
        let mut s = SamplerScratch::default();
        // Token 1 is in the prompt: 3.0 / 1.5 = 2.0 < 2.9.
        let history = History { context: &[1, 3], generated: 0 };
        assert_eq!(sample(RowLogits::Dense(&logits), &p, history, &mut rng, &mut s), 2);
        assert_eq!(sample(RowLogits::Dense(&logits), &p, History::EMPTY, &mut rng, &mut s), 1);
        // A negative logit is multiplied: token 3 falls further.
        assert!((penalized(-1.0, 0, &p.penalties) - -1.5).abs() < 1e-6);
    }

    #[test]
    fn presence_and_frequency_count_only_this_turns_output() {
        let input =
            TurnOptions { presence_penalty: Some(0.5), frequency_penalty: Some(0.25), ..TurnOptions::default() };
        let p = SamplingParams::from_options(&input).unwrap();
        let logits = [0.0f32, 2.0, 1.0];
        let mut rng = Rng::new(1);
        let mut s = SamplerScratch::default();
        // Token 1 in the prompt only: no penalty.
        let prompt_only = History { context: &[1, 1, 1], generated: 0 };
        assert_eq!(sample(RowLogits::Dense(&logits), &p, prompt_only, &mut rng, &mut s), 1);
        // Generated twice: 2.0 - 0.5 - 2 * 0.25 = 1.0, tied with token 2, which loses the tie to... token 1 (lower id).
        let twice = History { context: &[1, 1], generated: 2 };
        assert_eq!(sample(RowLogits::Dense(&logits), &p, twice, &mut rng, &mut s), 1);
        let thrice = History { context: &[1, 1, 1], generated: 3 };
        assert_eq!(sample(RowLogits::Dense(&logits), &p, thrice, &mut rng, &mut s), 2);
        // Sparse rows (the simulated model) are penalized by id too.
        let ids = [7u32, 9];
        let sparse = [2.0f32, 1.0];
        let seen_seven = History { context: &[7, 7, 7], generated: 3 };
        assert_eq!(sample(RowLogits::Sparse { ids: &ids, logits: &sparse }, &p, seen_seven, &mut rng, &mut s), 9);
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        // At temperature 1, token 0 has weight 1 and token 1 exp(-3) ~ 0.05 of it.
        let logits = [3.0f32, 0.0];
        let input = TurnOptions { temperature: Some(1.0), min_p: Some(0.1), ..TurnOptions::default() };
        let p = SamplingParams::from_options(&input).unwrap();
        let mut rng = Rng::new(9);
        let mut s = SamplerScratch::default();
        for _ in 0..200 {
            assert_eq!(sample(RowLogits::Dense(&logits), &p, History::EMPTY, &mut rng, &mut s), 0);
        }
        let loose = SamplingParams::from_options(&TurnOptions { min_p: Some(0.01), ..input }).unwrap();
        let picks: Vec<u32> =
            (0..400).map(|_| sample(RowLogits::Dense(&logits), &loose, History::EMPTY, &mut rng, &mut s)).collect();
        assert!(picks.contains(&1), "min_p 0.01 keeps a token of relative weight 0.05");
    }

    #[test]
    fn bad_penalties_and_min_p_are_refused() {
        let bad = [
            TurnOptions { repetition_penalty: Some(0.0), ..TurnOptions::default() },
            TurnOptions { repetition_penalty: Some(f64::INFINITY), ..TurnOptions::default() },
            TurnOptions { presence_penalty: Some(2.5), ..TurnOptions::default() },
            TurnOptions { frequency_penalty: Some(-2.01), ..TurnOptions::default() },
            TurnOptions { frequency_penalty: Some(f64::NAN), ..TurnOptions::default() },
            TurnOptions { min_p: Some(1.5), ..TurnOptions::default() },
            TurnOptions { min_p: Some(-0.1), ..TurnOptions::default() },
        ];
        for input in bad {
            let error = SamplingParams::from_options(&input).err().unwrap_or_else(|| panic!("{input:?} accepted"));
            assert_eq!(error.code, crate::error::ErrorCode::InvalidArgument);
        }
        let neutral = TurnOptions {
            repetition_penalty: Some(1.0),
            presence_penalty: Some(0.0),
            frequency_penalty: Some(0.0),
            min_p: Some(0.0),
            ..TurnOptions::default()
        };
        assert_eq!(SamplingParams::from_options(&neutral).unwrap(), SamplingParams::GREEDY);
    }

    /// The sampler as it was before partial ranking: a full sort, then the same walks. The model
    /// the ranked sampler must match token for token.
    fn full_sort_sample(
        candidates: &mut [(u32, f32)],
        params: &SamplingParams,
        temperature: f64,
        rng: &mut Rng,
    ) -> u32 {
        candidates.sort_by(|a, b| {
            if ranks_before(*a, *b) {
                std::cmp::Ordering::Less
            } else if ranks_before(*b, *a) {
                std::cmp::Ordering::Greater
            } else {
                std::cmp::Ordering::Equal
            }
        });
        let mut kept = candidates.len();
        if params.top_k > 0 && (params.top_k as usize) < kept {
            kept = params.top_k as usize;
        }
        let max_score = f64::from(candidates[0].1);
        if params.top_p < 1.0 {
            kept = full_sort_nucleus_len(&candidates[..kept], max_score, temperature, params.top_p);
        }
        if params.min_p > 0.0 {
            let below = candidates[..kept].iter().position(|c| weight(c.1, max_score, temperature) < params.min_p);
            kept = below.unwrap_or(kept).max(1);
        }
        let kept_total: f64 = candidates[..kept].iter().map(|c| weight(c.1, max_score, temperature)).sum();
        let mut target = rng.next_f64() * kept_total;
        for c in &candidates[..kept] {
            target -= weight(c.1, max_score, temperature);
            if target < 0.0 {
                return c.0;
            }
        }
        candidates[kept - 1].0
    }

    fn full_sort_nucleus_len(sorted: &[(u32, f32)], max_score: f64, temperature: f64, top_p: f64) -> usize {
        let weights_total: f64 = sorted.iter().map(|c| weight(c.1, max_score, temperature)).sum();
        let mut mass = 0.0;
        for (i, c) in sorted.iter().enumerate() {
            mass += weight(c.1, max_score, temperature) / weights_total;
            if mass >= top_p {
                return i + 1;
            }
        }
        sorted.len()
    }

    /// A row with ties (scores from a small grid), spreads from a few hundredths to hundreds (so
    /// that some tails are negligible and some are not), and now and then -inf.
    fn random_row(rng: &mut Rng) -> Vec<(u32, f32)> {
        let len = [1, 2, 3, 8, 40, 64, 65, 200, 1000, 5000][rng.below(10) as usize];
        let spread = [0.01, 0.5, 3.0, 30.0, 300.0][rng.below(5) as usize];
        let grid = [0, 4, 64][rng.below(3) as usize];
        let sparse = rng.below(3) == 0;
        let mut ids: Vec<u32> = (0..len as u32).collect();
        if sparse {
            // Distinct ids in no particular order, as the simulated model gives them.
            for id in &mut ids {
                *id = id.wrapping_mul(2_654_435_761) % 1_000_003;
            }
        }
        ids.into_iter()
            .map(|id| {
                let u = rng.next_f64();
                let u = if grid > 0 { (u * grid as f64).floor() / grid as f64 } else { u };
                let score = if rng.below(50) == 0 { f32::NEG_INFINITY } else { ((u - 0.5) * spread) as f32 };
                (id, score)
            })
            .collect()
    }

    fn random_params(rng: &mut Rng, len: usize) -> (SamplingParams, f64) {
        let temperature = [0.05, 0.3, 0.7, 1.0, 1.5, 4.0][rng.below(6) as usize];
        let top_k = [0, 0, 1, 2, 40, len as u32, len as u32 + 1][rng.below(7) as usize];
        let top_p = [1.0, 1.0, 0.01, 0.5, 0.9, 0.95, 0.999_999_999][rng.below(7) as usize];
        let min_p = [0.0, 0.0, 0.01, 0.05, 0.5, 1.0][rng.below(6) as usize];
        let params = SamplingParams { temperature: Some(temperature), top_k, top_p, min_p, ..SamplingParams::GREEDY };
        (params, temperature)
    }

    #[test]
    fn ranked_sampling_draws_what_a_full_sort_draws() {
        let seeds = std::env::var("ORTEX_SEEDS").map_or(600, |n| n.parse::<u64>().expect("ORTEX_SEEDS is a number"));
        for seed in 1..=seeds {
            let mut rng = Rng::new(seed);
            let row = random_row(&mut rng);
            let (params, temperature) = random_params(&mut rng, row.len());
            for draw in 0..8u64 {
                let (mut keyed, mut sorted) = (Vec::new(), row.clone());
                let (mut ranked_rng, mut sorted_rng) = (Rng::new(hash(seed, draw)), Rng::new(hash(seed, draw)));
                let got = sample_candidates(&row, &mut keyed, &params, temperature, &mut ranked_rng);
                let want = full_sort_sample(&mut sorted, &params, temperature, &mut sorted_rng);
                assert_eq!(got, want, "seed {seed} draw {draw}: {params:?} over {} candidates", row.len());
                assert_eq!(ranked_rng, sorted_rng, "seed {seed}: one draw each");
            }
        }
    }

    #[test]
    fn ranked_weight_sums_are_the_full_sorts_bit_for_bit() {
        let seeds = std::env::var("ORTEX_SEEDS").map_or(600, |n| n.parse::<u64>().expect("ORTEX_SEEDS is a number"));
        for seed in 1..=seeds {
            let mut rng = Rng::new(seed);
            let row = random_row(&mut rng);
            let (params, temperature) = random_params(&mut rng, row.len());
            let kept = if params.top_k == 0 { row.len() } else { row.len().min(params.top_k as usize) };
            let mut sorted = row.clone();
            sorted.sort_by(
                |a, b| if ranks_before(*a, *b) { std::cmp::Ordering::Less } else { std::cmp::Ordering::Greater },
            );
            let max_score = f64::from(sorted[0].1);
            let want: f64 = sorted[..kept].iter().map(|c| weight(c.1, max_score, temperature)).sum();
            let mut items: Vec<(u64, f32)> = row.iter().map(|&c| (rank_key(c), c.1)).collect();
            let mut ranking = Ranking::new(&mut items, kept);
            assert_eq!(ranking.get(0), sorted[0], "seed {seed}: the best candidate");
            let got = ranked_weight_sum(&mut ranking, kept, max_score, temperature);
            assert_eq!(got.to_bits(), want.to_bits(), "seed {seed}: {got} != {want} over {kept} of {}", row.len());
            for (i, &want) in sorted[..kept].iter().enumerate() {
                assert_eq!(ranking.get(i), want, "seed {seed}: rank {i}");
            }
        }
    }

    fn hash(seed: u64, draw: u64) -> u64 {
        crate::rng::hash2(seed, draw)
    }

    #[test]
    fn logprobs_are_a_log_softmax_with_the_best_alternatives_first() {
        let logits = [1.0f32, 3.0, 2.0, 3.0];
        let mut best = Vec::new();
        let entry = logprobs(RowLogits::Dense(&logits), 2, 3, &mut best);
        let total: f64 = logits.iter().map(|&l| libm::exp(f64::from(l))).sum();
        assert!((entry.logprob - (2.0 - libm::log(total))).abs() < 1e-12);
        assert_eq!(entry.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 3, 2]);
        let mass: f64 = (0..4).map(|t| libm::exp(logprobs(RowLogits::Dense(&logits), t, 0, &mut best).logprob)).sum();
        assert!((mass - 1.0).abs() < 1e-12);
        let ids = [9u32, 4];
        let sparse = [0.0f32, 0.0];
        let entry = logprobs(RowLogits::Sparse { ids: &ids, logits: &sparse }, 9, 20, &mut best);
        assert!((entry.logprob - libm::log(0.5)).abs() < 1e-12);
        assert_eq!(entry.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![4, 9]);
    }
}
