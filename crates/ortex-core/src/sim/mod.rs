//! The simulated model: a deterministic next-token function of (seed, whole context), O(1) per
//! token, with a virtual cost per step and fault hooks.
//!
//! Its "KV cache" is real paged storage: each slot holds the rolling hash of the context up to that
//! position, written by the step that computes the position and read back through the block table
//! on the next one. A bug that maps a position to the wrong block therefore changes the tokens,
//! exactly as it would with a real model.

use crate::error::{OrtexError, Result};
use crate::executor::{ExecError, Executor, KvGeometry, LogitsLayout, ModelInfo, PlanRow, StepOutput, StepPlan};
use crate::options::{SimFaults, SimOptions};
use crate::rng::{hash2, mix64, unit_f64};

/// Candidates per sampled row (the sparse logits width).
pub const SIM_CANDIDATES: usize = 8;
const EOS_SALT: u64 = 0x454F_5300;
/// Distinct scores, highest first.
const CANDIDATE_LOGITS: [f32; SIM_CANDIDATES] = [4.0, 3.5, 3.0, 2.5, 2.0, 1.5, 1.0, 0.5];
const CANDIDATE_MULTIPLIERS: [u64; SIM_CANDIDATES] = [
    0x9E37_79B9_7F4A_7C15,
    0xBF58_476D_1CE4_E5B9,
    0x94D0_49BB_1331_11EB,
    0xD6E8_FEB8_6659_FD93,
    0xA076_1D64_78BD_642F,
    0xE703_7ED1_A0B4_28DB,
    0x8EBC_6AF0_9C88_C6E3,
    0x5899_65CC_7537_4CC3,
];
const FAULT_SALT: u64 = 0x4641_554C;
/// The virtual clock stops here: 2^53 - 1, the largest integer a JavaScript number holds exactly.
pub const MAX_VIRTUAL_TIME_US: u64 = (1 << 53) - 1;

#[derive(Debug, Clone)]
pub struct SimModel {
    pub seed: u64,
    pub vocab_size: u32,
    pub eos_token_id: u32,
    pub max_length: u32,
    pub eos_probability: f64,
}

impl SimModel {
    pub fn from_options(options: &SimOptions) -> Result<SimModel> {
        let vocab_size = options.vocab_size.unwrap_or(32_000);
        let eos_token_id = options.eos_token_id.unwrap_or(2);
        let max_length = options.max_length.unwrap_or(2048);
        let eos_probability = options.eos_probability.unwrap_or(0.0);
        if !(2..=(1 << 24)).contains(&vocab_size) {
            return Err(OrtexError::invalid(format!("vocabSize must be in [2, 16777216], got {vocab_size}")));
        }
        if eos_token_id >= vocab_size {
            return Err(OrtexError::invalid(format!(
                "eosTokenId {eos_token_id} is outside the vocabulary of {vocab_size}"
            )));
        }
        if !(1..=(1 << 24)).contains(&max_length) {
            return Err(OrtexError::invalid(format!("maxLength must be in [1, 16777216], got {max_length}")));
        }
        check_probability("eosProbability", eos_probability)?;
        Ok(SimModel { seed: options.seed.unwrap_or(0), vocab_size, eos_token_id, max_length, eos_probability })
    }

    /// Hash of the context after `token` at `position`, given the hash before it.
    fn extend(&self, previous: u64, token: i32, position: u32) -> u64 {
        hash2(previous, u64::from(token as u32) | (u64::from(position) << 32))
    }

    fn empty_context(&self) -> u64 {
        mix64(self.seed ^ 0x5EED)
    }

    /// Writes the next-token candidates for a context hash: distinct scores, highest first, EOS
    /// on top with probability `eos_probability`.
    fn candidates(&self, context: u64, ids: &mut Vec<u32>, logits: &mut Vec<f32>) {
        let eos_first = self.eos_probability > 0.0 && unit_f64(hash2(context, EOS_SALT)) < self.eos_probability;
        // One hash per row; each candidate takes the high bits of a distinct odd multiple of it
        // (a multiplicative hash), which keeps the model O(1) and cheap per token.
        let h = mix64(context);
        let row: [u32; SIM_CANDIDATES] =
            std::array::from_fn(|i| self.non_eos_token(h.wrapping_mul(CANDIDATE_MULTIPLIERS[i])));
        ids.extend_from_slice(&row);
        if eos_first {
            let last = ids.len() - SIM_CANDIDATES;
            ids[last] = self.eos_token_id;
        }
        logits.extend_from_slice(&CANDIDATE_LOGITS);
    }

    /// Maps a hash to a token id other than EOS. Multiply-high instead of `%`: a 64-bit division
    /// per candidate would dominate the simulated model's cost.
    fn non_eos_token(&self, h: u64) -> u32 {
        let id = (((h >> 32) * u64::from(self.vocab_size)) >> 32) as u32;
        if id == self.eos_token_id {
            (id + 1) % self.vocab_size
        } else {
            id
        }
    }
}

fn check_probability(name: &str, p: f64) -> Result<()> {
    if p.is_finite() && (0.0..=1.0).contains(&p) {
        Ok(())
    } else {
        Err(OrtexError::invalid(format!("{name} must be in [0, 1], got {p}")))
    }
}

pub struct SimExecutor {
    model: SimModel,
    faults: SimFaults,
    step_cost_us: u64,
    token_cost_us: u64,
    virtual_time_us: u64,
    geometry: KvGeometry,
    /// One context hash per KV slot, grown as blocks are first written: the pool may be as large
    /// as the options allow (2^28 slots, 2 GiB) while only the blocks in use take memory, so a
    /// large `numBlocks` or `maxLength` costs nothing up front, on WebAssembly too.
    slots: Vec<u64>,
}

impl SimExecutor {
    pub fn new(options: &SimOptions) -> Result<SimExecutor> {
        let faults = options.faults.clone().unwrap_or_default();
        for (name, p) in [
            ("faults.retryableRate", faults.retryable_rate),
            ("faults.capacityRate", faults.capacity_rate),
            ("faults.fatalRate", faults.fatal_rate),
        ] {
            check_probability(name, p)?;
        }
        Ok(SimExecutor {
            model: SimModel::from_options(options)?,
            faults,
            step_cost_us: options.step_cost_us.unwrap_or(0),
            token_cost_us: options.token_cost_us.unwrap_or(0),
            virtual_time_us: 0,
            geometry: KvGeometry { num_blocks: 0, block_size: 1 },
            slots: Vec::new(),
        })
    }

    /// A slot never written reads as 0, as it did when every slot was allocated up front.
    /// Writes the contexts of one row's tokens into its KV slots and returns the last one.
    /// Walks the row's positions as (block index in the row's table, offset in the block),
    /// starting at the position before the row: one division per row, not per token.
    fn write_row(&mut self, plan: &StepPlan, row: &PlanRow) -> u64 {
        let block_size = self.geometry.block_size;
        let blocks = plan.row_blocks(row);
        let (mut block, mut offset, mut context) = if row.start_position == 0 {
            (0, 0, self.model.empty_context())
        } else {
            let previous = row.start_position - 1;
            let (block, offset) = (previous / block_size - row.first_block, previous % block_size);
            let context = self.slot((blocks[block as usize].0 * block_size + offset) as usize);
            if offset + 1 == block_size {
                (block + 1, 0, context)
            } else {
                (block, offset + 1, context)
            }
        };
        for (i, &token) in plan.row_tokens(row).iter().enumerate() {
            context = self.model.extend(context, token, row.start_position + i as u32);
            *self.slot_mut((blocks[block as usize].0 * block_size + offset) as usize) = context;
            offset += 1;
            if offset == block_size {
                block += 1;
                offset = 0;
            }
        }
        context
    }

    fn slot(&self, index: usize) -> u64 {
        self.slots.get(index).copied().unwrap_or(0)
    }

    /// Grows the slots to cover `index` (doubling, so growth costs O(1) per slot written).
    fn slot_mut(&mut self, index: usize) -> &mut u64 {
        if index >= self.slots.len() {
            let total = (self.geometry.num_blocks as usize) * (self.geometry.block_size as usize);
            let len = (index + 1).next_power_of_two().max(self.geometry.block_size as usize).min(total);
            self.slots.resize(len, 0);
        }
        &mut self.slots[index]
    }

    fn injected_fault(&self, step: u64) -> Option<ExecError> {
        let f = &self.faults;
        let roll = |salt: u64| unit_f64(hash2(hash2(f.seed ^ FAULT_SALT, step), salt));
        if f.fatal_steps.contains(&step) || roll(3) < f.fatal_rate {
            return Some(ExecError::Fatal(format!("injected fatal failure at step {step}")));
        }
        if f.capacity_steps.contains(&step) || roll(2) < f.capacity_rate {
            return Some(ExecError::CapacityExceeded(format!("injected capacity failure at step {step}")));
        }
        if f.retryable_steps.contains(&step) || roll(1) < f.retryable_rate {
            return Some(ExecError::Retryable(format!("injected retryable failure at step {step}")));
        }
        None
    }
}

impl Executor for SimExecutor {
    fn model_info(&self) -> ModelInfo {
        ModelInfo {
            vocab_size: self.model.vocab_size,
            eos_token_ids: vec![self.model.eos_token_id as i32],
            max_length: self.model.max_length,
            kv_position_bytes: 0,
            required_block_size: None,
        }
    }

    fn attach_kv(&mut self, geometry: KvGeometry) -> Result<()> {
        let slots = u64::from(geometry.num_blocks) * u64::from(geometry.block_size);
        if slots > (1 << 28) {
            return Err(OrtexError::invalid(format!(
                "numBlocks * blockSize = {slots} slots is more than the simulator holds (2^28)"
            )));
        }
        self.geometry = geometry;
        self.slots = Vec::new();
        Ok(())
    }

    fn execute(&mut self, plan: &StepPlan, out: &mut StepOutput) -> Result<(), ExecError> {
        let cost_us =
            self.token_cost_us.saturating_mul(u64::from(plan.total_tokens())).saturating_add(self.step_cost_us);
        // Saturates where JavaScript numbers stop being exact, so the clock never wraps around.
        self.virtual_time_us = self.virtual_time_us.saturating_add(cost_us).min(MAX_VIRTUAL_TIME_US);
        if let Some(fault) = self.injected_fault(plan.step) {
            return Err(fault);
        }
        out.clear();
        out.layout = LogitsLayout::Sparse;
        out.width = SIM_CANDIDATES;
        out.ids.reserve(plan.rows.len() * SIM_CANDIDATES);
        out.logits.reserve(plan.rows.len() * SIM_CANDIDATES);
        for row in &plan.rows {
            let context = self.write_row(plan, row);
            if row.sample {
                self.model.candidates(context, &mut out.ids, &mut out.logits);
            }
        }
        Ok(())
    }

    fn needs_full_block_tables(&self) -> bool {
        false
    }

    fn virtual_time_us(&self) -> u64 {
        self.virtual_time_us
    }
}
