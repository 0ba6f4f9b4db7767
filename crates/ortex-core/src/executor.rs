//! The seam between planning and computing. The scheduler plans with block ids and counts only;
//! an executor is the only place that touches model state (tensors, or the simulated model's
//! hashes). It owns the KV storage; the engine owns which block belongs to whom.

use crate::error::Result;
use crate::ids::{BlockId, RequestId};

/// What the engine needs to know about a model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelInfo {
    pub vocab_size: u32,
    pub eos_token_ids: Vec<i32>,
    /// Context length: most tokens one request may hold.
    pub max_length: u32,
    /// Bytes the executor's KV store takes per token position (all layers, keys and values);
    /// 0 when it keeps none (the simulated model): a `kvCacheBytes` budget then bounds nothing.
    pub kv_position_bytes: u64,
    /// The block size the model's own graph is built for (a paged-attention folder's KV tensors
    /// are blocks of this many positions): the engine uses it and refuses another. None: any.
    pub required_block_size: Option<u32>,
}

/// Shape of the paged KV pool the executor must back with storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvGeometry {
    pub num_blocks: u32,
    pub block_size: u32,
}

/// One row of a step: `token_count` new tokens of `request`, at positions
/// `start_position .. start_position + token_count`, whose KV lives in the blocks
/// `plan.block_ids[block_start .. block_start + block_count]`: the request's table from its
/// block number `first_block` up to the block of the last new position. `first_block` is 0 for
/// executors that ask for whole tables; otherwise it is the block of the position before the row
/// (all the simulated model reads). `sample` rows produce one logits row each, in plan order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanRow {
    pub request: RequestId,
    /// The turn the row was planned for (0 for a prefill without a turn); the executor ignores it.
    pub turn: crate::ids::TurnId,
    pub first_block: u32,
    /// Engine bookkeeping: where the request sits in the engine's table (the executor ignores it).
    pub request_position: u32,
    pub start_position: u32,
    pub token_start: u32,
    pub token_count: u32,
    pub block_start: u32,
    pub block_count: u32,
    pub sample: bool,
}

/// A planned step. Buffers are reused from step to step.
#[derive(Debug, Clone, Default)]
pub struct StepPlan {
    /// Transaction number (0-based, counts every executed transaction, failed ones too).
    pub step: u64,
    pub rows: Vec<PlanRow>,
    pub tokens: Vec<i32>,
    pub block_ids: Vec<BlockId>,
}

impl StepPlan {
    pub fn clear(&mut self) {
        self.rows.clear();
        self.tokens.clear();
        self.block_ids.clear();
    }

    pub fn row_tokens(&self, row: &PlanRow) -> &[i32] {
        &self.tokens[row.token_start as usize..(row.token_start + row.token_count) as usize]
    }

    pub fn row_blocks(&self, row: &PlanRow) -> &[BlockId] {
        &self.block_ids[row.block_start as usize..(row.block_start + row.block_count) as usize]
    }

    pub fn total_tokens(&self) -> u32 {
        self.rows.iter().map(|r| r.token_count).sum()
    }

    pub fn sampled_rows(&self) -> usize {
        self.rows.iter().filter(|r| r.sample).count()
    }
}

/// Logits of the sampled rows, in plan order: `Dense` rows are `width` scores over the whole
/// vocabulary; `Sparse` rows are `width` (id, score) candidates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogitsLayout {
    #[default]
    Dense,
    Sparse,
}

#[derive(Debug, Clone, Default)]
pub struct StepOutput {
    pub layout: LogitsLayout,
    pub width: usize,
    pub logits: Vec<f32>,
    pub ids: Vec<u32>,
}

impl StepOutput {
    pub fn clear(&mut self) {
        self.logits.clear();
        self.ids.clear();
        self.width = 0;
    }

    pub fn rows(&self) -> usize {
        self.logits.len().checked_div(self.width).unwrap_or(0)
    }

    /// Whether the output has exactly one well-formed row per sampled plan row.
    pub fn matches(&self, sampled_rows: usize) -> bool {
        let shape_ok = self.width > 0 && self.logits.len() == self.width * sampled_rows;
        let ids_ok = match self.layout {
            LogitsLayout::Dense => true,
            LogitsLayout::Sparse => self.ids.len() == self.logits.len(),
        };
        (sampled_rows == 0 && self.logits.is_empty()) || (shape_ok && ids_ok)
    }

    pub fn row(&self, i: usize) -> RowLogits<'_> {
        let range = i * self.width..(i + 1) * self.width;
        match self.layout {
            LogitsLayout::Dense => RowLogits::Dense(&self.logits[range]),
            LogitsLayout::Sparse => RowLogits::Sparse { ids: &self.ids[range.clone()], logits: &self.logits[range] },
        }
    }
}

/// How a transaction failed. Every variant rolls the transaction back; the engine turns it into
/// a typed event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecError {
    /// Try the same step again later; nothing was lost.
    Retryable(String),
    /// The executor could not fit this step (device memory, say); retry later.
    CapacityExceeded(String),
    /// The executor is broken; the engine becomes unhealthy.
    Fatal(String),
}

pub trait Executor: Send {
    fn model_info(&self) -> ModelInfo;

    /// Called once, before any step: back `geometry` with storage.
    fn attach_kv(&mut self, geometry: KvGeometry) -> Result<()>;

    /// Computes one step: writes the KV of every row's new positions into its blocks and the
    /// logits of every sampled row into `out`.
    fn execute(&mut self, plan: &StepPlan, out: &mut StepOutput) -> Result<(), ExecError>;

    /// Whether rows must carry the request's whole block table (a real model gathers all past
    /// KV). An executor that reads only the position before each row says false, and the plan
    /// carries just the blocks it touches.
    fn needs_full_block_tables(&self) -> bool {
        true
    }

    /// Simulated cost so far, in microseconds (0 for real executors, whose cost is real time).
    fn virtual_time_us(&self) -> u64 {
        0
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
    pub(crate) fn len(&self) -> usize {
        match self {
            RowLogits::Dense(v) => v.len(),
            RowLogits::Sparse { ids, .. } => ids.len(),
        }
    }

    pub(crate) fn get(&self, i: usize) -> (u32, f32) {
        match self {
            RowLogits::Dense(v) => (i as u32, v[i]),
            RowLogits::Sparse { ids, logits } => (ids[i], logits[i]),
        }
    }
}
