//! Which rows of a step run together, and where their logits go: pure functions of the plan.
//!
//! Decode rows (one new token) always share one invocation. Rows with several new tokens
//! (prefill chunks, continuation turns) are padded to the longest of their group, so they are kept
//! apart from the decodes (padding a decode row to a 500-token chunk would multiply its cost by
//! 500) and grouped by length so padding at most doubles a group's positions, and so that a
//! group's logits (the graph computes them at every position, `[B, S, vocab]`) stay within
//! [`PREFILL_LOGITS_BUDGET_BYTES`]: a prompt burst of 16 requests on SmolLM2 padded to 1,080
//! positions asked for 200 MiB of logits at once, the process's peak (docs/performance.md, issue
//! 22). A row longer than the budget still runs, alone. The gqa form also
//! refuses batches of rows with past context and several new tokens (ONNX Runtime's CPU kernel:
//! "batch_size must be 1 when sequence_length > 1 and past context is given"): those run one
//! row per invocation; first prompts (no past) may share one, except in a model with a windowed
//! cache (`sliding_window_cache = 1`), whose kernel refuses rows shorter than the batch's longest
//! ("seqlens_k[b] is too small for sequence_length"): there every row with several new tokens
//! runs alone.

use ortex_core::executor::{ExecError, KvGeometry, StepPlan};

/// The most bytes of logits one invocation of rows with several new tokens may compute (unless
/// one row alone needs more).
pub(super) const PREFILL_LOGITS_BUDGET_BYTES: u64 = 64 << 20;

/// How many padded positions a group of prefill rows may hold: the budget over one position's
/// logits, at least 1.
pub(super) fn prefill_positions_budget(vocab_size: u64, logits_element_bytes: u64) -> u64 {
    (PREFILL_LOGITS_BUDGET_BYTES / (vocab_size * logits_element_bytes).max(1)).max(1)
}

use super::{fatal, AttentionForm};

/// A step's rows split into invocations, and each row's logits slot; the buffers are reused from
/// step to step.
#[derive(Default)]
pub(super) struct Grouping {
    /// Plan row indices, grouped: invocation `i` is `rows[bounds[i].0 .. bounds[i].1]`.
    rows: Vec<u32>,
    bounds: Vec<(u32, u32)>,
    /// Prefill candidates, sorted by length before grouping.
    pending: Vec<u32>,
    /// Per plan row: its logits row in the step output (`u32::MAX` when not sampled).
    pub(super) sampled_slot: Vec<u32>,
}

impl Grouping {
    /// How many invocations the step runs.
    pub(super) fn len(&self) -> usize {
        self.bounds.len()
    }

    /// The plan rows of invocation `i`, in batch order.
    pub(super) fn group(&self, i: usize) -> &[u32] {
        let (start, end) = self.bounds[i];
        &self.rows[start as usize..end as usize]
    }
}

/// The plan must fit the model and the pool: tables cover every new position, positions stay
/// inside the context (the rotary tables end there).
pub(super) fn check_plan(plan: &StepPlan, kv: KvGeometry, context_length: u32) -> Result<(), ExecError> {
    for row in &plan.rows {
        let end = u64::from(row.start_position) + u64::from(row.token_count);
        let covered = u64::from(row.block_count) * u64::from(kv.block_size);
        let blocks_ok = plan.row_blocks(row).iter().all(|b| b.0 < kv.num_blocks);
        if row.token_count == 0
            || row.first_block != 0
            || covered < end
            || end > u64::from(context_length)
            || !blocks_ok
        {
            return Err(fatal(format!(
                "plan row of request {} does not fit: positions {}..{end}, {} blocks of {} from block {}, context {}",
                row.request.0, row.start_position, row.block_count, kv.block_size, row.first_block, context_length
            )));
        }
    }
    Ok(())
}

/// Numbers the sampled rows in plan order (the order of the step output's logits rows).
pub(super) fn assign_sampled_slots(plan: &StepPlan, slots: &mut Vec<u32>) -> usize {
    slots.clear();
    let mut next = 0u32;
    for row in &plan.rows {
        slots.push(if row.sample { next } else { u32::MAX });
        next += u32::from(row.sample);
    }
    next as usize
}

/// Splits the plan's rows into invocations (see the module comment): the decodes first, then the
/// rows that must run alone, then the batchable prefills. `window_cache`: the model has a
/// windowed cache; `max_positions`: a prefill group's most padded positions
/// ([`prefill_positions_budget`]).
pub(super) fn group_rows(
    plan: &StepPlan,
    form: AttentionForm,
    window_cache: bool,
    max_positions: u64,
    grouping: &mut Grouping,
) {
    let Grouping { rows, bounds, pending, .. } = grouping;
    rows.clear();
    bounds.clear();
    pending.clear();
    // Decodes: one invocation.
    for (i, row) in plan.rows.iter().enumerate() {
        if row.token_count == 1 {
            rows.push(i as u32);
        }
    }
    close_group(rows, bounds);
    // Several new tokens: batchable ones grouped by length, the rest one by one.
    for (i, row) in plan.rows.iter().enumerate() {
        if row.token_count > 1 {
            if form == AttentionForm::Gqa && (row.start_position > 0 || window_cache) {
                rows.push(i as u32);
                close_group(rows, bounds);
            } else {
                pending.push(i as u32);
            }
        }
    }
    group_by_length(plan, pending, max_positions, rows, bounds);
}

/// Ends the open group (the rows pushed since the last bound), when it has any.
fn close_group(rows: &[u32], bounds: &mut Vec<(u32, u32)>) {
    let start = bounds.last().map_or(0, |b| b.1);
    if rows.len() as u32 > start {
        bounds.push((start, rows.len() as u32));
    }
}

/// Longest first; a row joins the group while the padded positions stay within twice the real
/// and within `max_positions`.
fn group_by_length(
    plan: &StepPlan,
    pending: &mut [u32],
    max_positions: u64,
    rows: &mut Vec<u32>,
    bounds: &mut Vec<(u32, u32)>,
) {
    pending.sort_by_key(|&i| (std::cmp::Reverse(plan.rows[i as usize].token_count), i));
    let (mut width, mut real, mut count) = (0u64, 0u64, 0u64);
    for &i in pending.iter() {
        let n = u64::from(plan.rows[i as usize].token_count);
        let padded = (count + 1) * width;
        if count > 0 && (padded > 2 * (real + n) || padded > max_positions) {
            close_group(rows, bounds);
            count = 0;
            real = 0;
        }
        if count == 0 {
            width = n;
        }
        rows.push(i);
        count += 1;
        real += n;
    }
    close_group(rows, bounds);
}

#[cfg(test)]
mod tests {
    use super::*;
    use ortex_core::executor::PlanRow;
    use ortex_core::ids::{RequestId, TurnId};

    fn plan(rows: &[(u32, u32)]) -> StepPlan {
        let mut plan = StepPlan::default();
        for (i, &(start, count)) in rows.iter().enumerate() {
            plan.rows.push(PlanRow {
                request: RequestId(i as u32 + 1),
                turn: TurnId(1),
                first_block: 0,
                request_position: i as u32,
                start_position: start,
                token_start: 0,
                token_count: count,
                block_start: 0,
                block_count: 0,
                sample: true,
            });
        }
        plan
    }

    fn groups(rows: &[(u32, u32)], form: AttentionForm) -> Vec<Vec<u32>> {
        groups_within(rows, form, u64::MAX)
    }

    fn groups_within(rows: &[(u32, u32)], form: AttentionForm, max_positions: u64) -> Vec<Vec<u32>> {
        let plan = plan(rows);
        let mut grouping = Grouping::default();
        group_rows(&plan, form, false, max_positions, &mut grouping);
        (0..grouping.len()).map(|i| grouping.group(i).to_vec()).collect()
    }

    #[test]
    fn decodes_share_one_invocation_and_chunks_stay_apart() {
        // rows: decode, decode, first prompt 8, chunk with past 5 x 4, first prompt 6, decode
        let rows = [(10, 1), (3, 1), (0, 8), (5, 4), (0, 6), (0, 1)];
        assert_eq!(groups(&rows, AttentionForm::Mha), vec![vec![0, 1, 5], vec![2, 4, 3]]);
        assert_eq!(groups(&rows, AttentionForm::Gqa), vec![vec![0, 1, 5], vec![3], vec![2, 4]]);
        // A windowed cache: every row with several new tokens alone.
        let mut grouping = Grouping::default();
        group_rows(&plan(&rows), AttentionForm::Gqa, true, u64::MAX, &mut grouping);
        let windowed: Vec<Vec<u32>> = (0..grouping.len()).map(|i| grouping.group(i).to_vec()).collect();
        assert_eq!(windowed, vec![vec![0, 1, 5], vec![2], vec![3], vec![4]]);
    }

    #[test]
    fn prefill_groups_pad_at_most_twice_their_tokens() {
        let rows = [(0, 100), (0, 10), (0, 90), (0, 3)];
        // 100 + 90 = 190 real in 200 padded; adding 10 gives 300 padded for 200 real: still fine
        // (300 <= 400); adding 3 gives 400 for 203: also fine (400 <= 406).
        assert_eq!(groups(&rows, AttentionForm::Gqa), vec![vec![0, 2, 1, 3]]);
        // 100 + 2: 200 padded for 102 real; a third row would pad 300 for 104: a new group.
        let rows = [(0, 100), (0, 2), (0, 2), (0, 2)];
        assert_eq!(groups(&rows, AttentionForm::Gqa), vec![vec![0, 1], vec![2, 3]]);
        assert!(groups(&[], AttentionForm::Mha).is_empty());
    }

    #[test]
    fn prefill_groups_keep_their_logits_within_the_budget() {
        // 15 prompts of 72..58 tokens (a burst): 1,080 padded positions at most in one group
        // without a budget; 341 positions each with SmolLM2's 64 MiB (vocab 49,152, float32).
        let rows: Vec<(u32, u32)> = (0..15).map(|i| (0, 72 - i)).collect();
        assert_eq!(groups(&rows, AttentionForm::Gqa).len(), 1);
        let budget = prefill_positions_budget(49_152, 4);
        assert_eq!(budget, 341);
        let within = groups_within(&rows, AttentionForm::Gqa, budget);
        assert_eq!(within.iter().map(Vec::len).collect::<Vec<_>>(), vec![4, 5, 5, 1]);
        for group in &within {
            let width = group.iter().map(|&i| rows[i as usize].1).max().unwrap();
            assert!(u64::from(width) * group.len() as u64 <= budget, "{group:?}");
        }
        // A row longer than the budget runs alone; the decodes are never split.
        let rows = [(0, 500), (0, 400), (7, 1), (9, 1)];
        assert_eq!(groups_within(&rows, AttentionForm::Gqa, 341), vec![vec![2, 3], vec![0], vec![1]]);
        assert_eq!(prefill_positions_budget(1 << 30, 4), 1);
    }

    #[test]
    fn sampled_rows_are_numbered_in_plan_order() {
        let mut plan = plan(&[(0, 3), (4, 1), (2, 2)]);
        plan.rows[0].sample = false;
        let mut slots = Vec::new();
        assert_eq!(assign_sampled_slots(&plan, &mut slots), 2);
        assert_eq!(slots, vec![u32::MAX, 0, 1]);
    }
}
