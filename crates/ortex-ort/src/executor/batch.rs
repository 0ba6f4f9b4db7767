//! What one invocation runs on, shared by every way of providing the past: its plan rows and
//! shape ([`Batch`], [`Dims`]), its token inputs ([`TokenInputs`]) and its session inputs by name
//! ([`Inputs`]). A leaf: it uses nothing else of the executor.

use std::borrow::Cow;

use ort::session::SessionInputValue;
use ortex_core::executor::{PlanRow, StepPlan};

use crate::config::ModelConfig;

/// Shape of one invocation: `B` rows, `P` the longest past, `S` the most new tokens.
#[derive(Debug, Clone, Copy)]
pub(super) struct Dims {
    pub(super) batch: usize,
    pub(super) past: usize,
    pub(super) new: usize,
    pub(super) kv_heads: usize,
    pub(super) head_size: usize,
}

impl Dims {
    /// `T = P + S`, the width of the mask and of `present`.
    pub(super) fn total(&self) -> usize {
        self.past + self.new
    }
}

/// The plan rows of one invocation, in batch order (row `b` of every tensor is plan row
/// `rows[b]`), with the invocation's shape.
#[derive(Clone, Copy)]
pub(super) struct Batch<'p> {
    pub(super) plan: &'p StepPlan,
    pub(super) rows: &'p [u32],
    pub(super) dims: Dims,
}

impl<'p> Batch<'p> {
    pub(super) fn new(plan: &'p StepPlan, rows: &'p [u32], config: &ModelConfig) -> Batch<'p> {
        let row = |i: u32| -> &PlanRow { &plan.rows[i as usize] };
        let dims = Dims {
            batch: rows.len(),
            past: rows.iter().map(|&i| row(i).start_position as usize).max().unwrap_or(0),
            new: rows.iter().map(|&i| row(i).token_count as usize).max().unwrap_or(0),
            kv_heads: config.num_key_value_heads as usize,
            head_size: config.head_size as usize,
        };
        Batch { plan, rows, dims }
    }

    /// Each plan row with its index `b` in the batch.
    pub(super) fn rows(&self) -> impl Iterator<Item = (usize, &'p PlanRow)> + 'p {
        let plan = self.plan;
        self.rows.iter().enumerate().map(move |(b, &i)| (b, &plan.rows[i as usize]))
    }

    /// A decode invocation: every row has one new token.
    pub(super) fn is_decode(&self) -> bool {
        self.dims.new == 1
    }
}

/// input_ids `[B, S]` (pad-filled), attention_mask `[B, T]` (1 on `[0, past_b)` and
/// `[P, P + n_b)`), position_ids `[B, S]` = `past_b + j`, by the padding contract. The buffers
/// grow to the largest invocation seen and are reused.
#[derive(Default)]
pub(super) struct TokenInputs {
    input_ids: Vec<i64>,
    attention_mask: Vec<i64>,
    position_ids: Vec<i64>,
}

impl TokenInputs {
    pub(super) fn fill(&mut self, batch: Batch<'_>, pad_token_id: i64) {
        let Dims { batch: b_n, past: p, new: s, .. } = batch.dims;
        let t = batch.dims.total();
        reset(&mut self.input_ids, b_n * s, pad_token_id);
        reset(&mut self.attention_mask, b_n * t, 0);
        reset(&mut self.position_ids, b_n * s, 0);
        for (b, row) in batch.rows() {
            let past = row.start_position as usize;
            for (j, &token) in batch.plan.row_tokens(row).iter().enumerate() {
                self.input_ids[b * s + j] = i64::from(token);
                self.position_ids[b * s + j] = (past + j) as i64;
                self.attention_mask[b * t + p + j] = 1;
            }
            self.attention_mask[b * t..b * t + past].fill(1);
        }
    }

    /// `[B * S]`, as filled last.
    pub(super) fn input_ids(&self) -> &[i64] {
        &self.input_ids
    }

    /// `[B * T]`, as filled last.
    pub(super) fn attention_mask(&self) -> &[i64] {
        &self.attention_mask
    }

    /// `[B * S]`, as filled last.
    pub(super) fn position_ids(&self) -> &[i64] {
        &self.position_ids
    }
}

fn reset<T: Copy>(buffer: &mut Vec<T>, len: usize, value: T) {
    buffer.clear();
    buffer.resize(len, value);
}

/// Session inputs by name, as views of buffers that outlive the run.
pub(super) type Inputs<'s> = Vec<(Cow<'s, str>, SessionInputValue<'s>)>;
