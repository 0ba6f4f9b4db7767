//! Options as callers give them (every field optional, as in docs/api.md) and the resolved,
//! validated configuration the engine runs with. Options are snapshotted: the engine copies them,
//! so a caller changing its object later changes nothing. The bindings deserialize JavaScript's
//! objects into their own mirrors of these (crates/ortex-boundary), so the core carries no serde.

use std::sync::Arc;

use crate::constraint::Constraint;
use crate::error::{OrtexError, Result};
use crate::executor::ModelInfo;

/// Largest value any count option may take; keeps every product of two counts inside u64 and
/// every single count inside JavaScript's 31-bit small-integer range.
pub const MAX_COUNT: u32 = i32::MAX as u32;

/// Most stop sequences per turn: stop token sequences, and stop strings.
pub const MAX_STOP_ENTRIES: usize = 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BatchingMode {
    /// Continuous batching: rows join and leave the batch at every step.
    #[default]
    Dynamic,
    /// A batch is formed at once and recycled only when all its rows are done.
    Static,
}

impl BatchingMode {
    pub fn as_str(self) -> &'static str {
        match self {
            BatchingMode::Dynamic => "dynamic",
            BatchingMode::Static => "static",
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineOptions {
    pub batching: Option<BatchingMode>,
    pub block_size: Option<u32>,
    pub num_blocks: Option<u32>,
    /// Most bytes the KV pool may reserve: the default pool shrinks to fit it (numBlocks instead
    /// sets the pool's size outright; the two are not given together).
    pub kv_cache_bytes: Option<u64>,
    pub max_batch_size: Option<u32>,
    pub max_scheduled_tokens: Option<u32>,
    pub prefill_chunk_size: Option<u32>,
    /// Steps a waiting prefill may go without progress before it is scheduled ahead of decodes.
    pub max_prefill_wait_steps: Option<u32>,
    /// Most requests alive at once (bounds the engine's tables and its retained-event queue).
    pub max_requests: Option<u32>,
    /// Requests that share a prompt prefix reuse its full KV blocks; absent: true.
    pub prefix_caching: Option<bool>,
}

/// Injected failures of the simulated executor, for simulation tests.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SimFaults {
    /// Transaction numbers (0-based, counting every executed transaction) that fail retryably.
    pub retryable_steps: Vec<u64>,
    /// Transaction numbers that fail fatally (the engine becomes unhealthy).
    pub fatal_steps: Vec<u64>,
    /// Transaction numbers that report execution capacity exceeded.
    pub capacity_steps: Vec<u64>,
    /// Chance per transaction of a retryable failure, decided by a hash of (seed, step).
    pub retryable_rate: f64,
    /// Chance per transaction of an execution-capacity failure.
    pub capacity_rate: f64,
    /// Chance per transaction of a fatal failure.
    pub fatal_rate: f64,
    /// Seed of the rate decisions (independent of the model seed).
    pub seed: u64,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct SimOptions {
    pub engine: EngineOptions,
    pub seed: Option<u64>,
    pub vocab_size: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub max_length: Option<u32>,
    pub eos_probability: Option<f64>,
    pub faults: Option<SimFaults>,
    /// Virtual cost of one step and of one token, accumulated in `virtualTimeUs` (nothing sleeps).
    pub step_cost_us: Option<u64>,
    pub token_cost_us: Option<u64>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestOptions {
    /// 0 or absent: the model's max length. Bounds prompt + generated + continuation tokens.
    pub max_session_tokens: Option<u32>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct TurnOptions {
    /// 0 or absent: until the session limit.
    pub max_generated_tokens: Option<u32>,
    /// Absent: greedy decoding.
    pub temperature: Option<f64>,
    pub top_k: Option<u32>,
    pub top_p: Option<f64>,
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub seed: Option<u64>,
    pub ignore_eos: Option<bool>,
    pub stop_token_ids: Option<Vec<Vec<i32>>>,
    /// Tokens that end this turn with reason eos besides the model's own (a chat template's
    /// end-of-turn token such as `<|im_end|>`); `ignore_eos` ignores them too.
    pub eos_token_ids: Option<Vec<i32>>,
    /// Log-probabilities of each generated token and of this many alternatives (0..=20).
    pub logprobs: Option<u32>,
    /// Strings that end the turn when they appear in its text (output.rs); the text ends before.
    pub stop: Option<Vec<String>>,
    /// What the output must match (constraint.rs); compiled when the turn begins.
    pub constraint: Option<Constraint>,
}

/// The resolved configuration an engine runs with.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    pub batching: BatchingMode,
    pub block_size: u32,
    pub num_blocks: u32,
    /// What the pool reserves: num_blocks * block_size * kv_position_bytes (0 for the simulated model).
    pub kv_cache_bytes: u64,
    pub kv_position_bytes: u64,
    pub max_batch_size: u32,
    pub max_scheduled_tokens: u32,
    pub prefill_chunk_size: u32,
    pub max_prefill_wait_steps: u32,
    pub max_requests: u32,
    pub prefix_caching: bool,
    pub vocab_size: u32,
    pub eos_token_ids: Vec<i32>,
    pub max_length: u32,
}

const DEFAULT_BLOCK_SIZE: u32 = 16;
const DEFAULT_MAX_BATCH_SIZE: u32 = 16;
const DEFAULT_MAX_SCHEDULED_TOKENS: u32 = 512;
const DEFAULT_MAX_PREFILL_WAIT_STEPS: u32 = 4;
const DEFAULT_MAX_REQUESTS: u32 = 65_536;
/// The pool must stay addressable by u32 block ids and by a 32-bit wasm memory.
const MAX_NUM_BLOCKS: u32 = 1 << 24;
const MAX_BLOCK_SIZE: u32 = 4096;

fn positive(name: &str, value: Option<u32>, default: u32, max: u32) -> Result<u32> {
    match value {
        None => Ok(default),
        Some(0) => Err(OrtexError::invalid(format!("{name} must be a positive integer"))),
        Some(v) if v > max => Err(OrtexError::invalid(format!("{name} must be at most {max}, got {v}"))),
        Some(v) => Ok(v),
    }
}

/// The default pool: every row at the model's full length, `maxBatchSize * ceil(maxLength /
/// blockSize)` blocks, fewer where the budget holds fewer (at least one block).
fn default_num_blocks(model: &ModelInfo, block_size: u32, max_batch_size: u32, budget_bytes: Option<u64>) -> u32 {
    let blocks_per_row = model.max_length.div_ceil(block_size);
    let full = u64::from(max_batch_size) * u64::from(blocks_per_row);
    let block_bytes = u64::from(block_size) * model.kv_position_bytes;
    let affordable = match budget_bytes {
        Some(budget) if block_bytes > 0 => budget / block_bytes,
        _ => u64::MAX,
    };
    full.min(affordable).clamp(1, u64::from(MAX_NUM_BLOCKS)) as u32
}

/// `blockSize`: the model's own block size when it requires one (a paged-attention graph reads
/// its KV in blocks of that size), which an explicit other value contradicts; else the option.
fn resolve_block_size(given: Option<u32>, required: Option<u32>) -> Result<u32> {
    match (given, required) {
        (Some(given), Some(required)) if given != required => Err(OrtexError::invalid(format!(
            "blockSize {given} conflicts with the model's block size {required} (its paged-attention graph \
             reads the KV cache in blocks of {required}); leave blockSize out or give {required}"
        ))),
        (None, Some(required)) => {
            positive("the model's block size", Some(required), DEFAULT_BLOCK_SIZE, MAX_BLOCK_SIZE)
        }
        (given, _) => positive("blockSize", given, DEFAULT_BLOCK_SIZE, MAX_BLOCK_SIZE),
    }
}

impl EngineConfig {
    pub fn resolve(options: &EngineOptions, model: &ModelInfo) -> Result<EngineConfig> {
        let block_size = resolve_block_size(options.block_size, model.required_block_size)?;
        let max_batch_size = positive("maxBatchSize", options.max_batch_size, DEFAULT_MAX_BATCH_SIZE, 65_536)?;
        let max_scheduled_tokens =
            positive("maxScheduledTokens", options.max_scheduled_tokens, DEFAULT_MAX_SCHEDULED_TOKENS, MAX_COUNT)?;
        let prefill_chunk_size =
            positive("prefillChunkSize", options.prefill_chunk_size, max_scheduled_tokens, MAX_COUNT)?;
        let num_blocks = match (options.num_blocks, options.kv_cache_bytes) {
            (Some(_), Some(_)) => {
                return Err(OrtexError::invalid(
                    "give numBlocks (the pool's size) or kvCacheBytes (a budget for its default size), not both",
                ))
            }
            (_, Some(0)) => return Err(OrtexError::invalid("kvCacheBytes must be a positive integer")),
            (Some(given), None) => positive("numBlocks", Some(given), 1, MAX_NUM_BLOCKS)?,
            (None, budget) => default_num_blocks(model, block_size, max_batch_size, budget),
        };
        let max_prefill_wait_steps = match options.max_prefill_wait_steps {
            None => DEFAULT_MAX_PREFILL_WAIT_STEPS,
            Some(v) if v > 1_000_000 => return Err(OrtexError::invalid("maxPrefillWaitSteps must be at most 1000000")),
            Some(v) => v,
        };
        let max_requests = positive("maxRequests", options.max_requests, DEFAULT_MAX_REQUESTS, 1 << 22)?;
        Ok(EngineConfig {
            batching: options.batching.unwrap_or_default(),
            block_size,
            num_blocks,
            kv_cache_bytes: u64::from(num_blocks) * u64::from(block_size) * model.kv_position_bytes,
            kv_position_bytes: model.kv_position_bytes,
            max_batch_size,
            max_scheduled_tokens,
            prefill_chunk_size,
            max_prefill_wait_steps,
            max_requests,
            prefix_caching: options.prefix_caching.unwrap_or(true),
            vocab_size: model.vocab_size,
            eos_token_ids: model.eos_token_ids.clone(),
            max_length: model.max_length,
        })
    }
}

/// Per-turn options after validation, in the units the engine uses.
#[derive(Debug, Clone, PartialEq)]
pub struct ResolvedTurnOptions {
    /// 0: no per-turn limit (the session limit applies).
    pub max_generated_tokens: u32,
    pub sampling: crate::sampling::SamplingParams,
    pub seed: Option<u64>,
    pub ignore_eos: bool,
    pub stop_token_ids: Vec<Vec<i32>>,
    pub eos_token_ids: Vec<i32>,
    /// None: no log-probabilities recorded (the default, and free).
    pub logprobs: Option<u32>,
    /// None: no stop strings. Shared: a transaction's draws carry them (draws.rs).
    pub stop: Option<Arc<[String]>>,
}

impl TurnOptions {
    pub fn resolve(&self, vocab_size: u32) -> Result<ResolvedTurnOptions> {
        let max_generated_tokens = self.max_generated_tokens.unwrap_or(0);
        if max_generated_tokens > MAX_COUNT {
            return Err(OrtexError::invalid("maxGeneratedTokens is too large"));
        }
        let sampling = crate::sampling::SamplingParams::from_options(self)?;
        let stop_token_ids = checked_stop_token_ids(self.stop_token_ids.clone().unwrap_or_default(), vocab_size)?;
        let eos_token_ids = checked_eos_token_ids(self.eos_token_ids.clone().unwrap_or_default(), vocab_size)?;
        if let Some(top) = self.logprobs.filter(|&top| top > crate::sampling::MAX_TOP_LOGPROBS) {
            return Err(OrtexError::invalid(format!(
                "logprobs asks for at most {} alternatives, got {top}",
                crate::sampling::MAX_TOP_LOGPROBS
            )));
        }
        if self.constraint.is_some() && self.ignore_eos == Some(true) {
            return Err(OrtexError::invalid(
                "ignoreEos cannot be combined with a constraint: a constrained turn ends when its grammar does",
            ));
        }
        Ok(ResolvedTurnOptions {
            max_generated_tokens,
            sampling,
            seed: self.seed,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            stop_token_ids,
            eos_token_ids,
            logprobs: self.logprobs,
            stop: checked_stop_strings(self.stop.as_deref().unwrap_or_default())?,
        })
    }
}

/// `stopTokenIds`: non-empty sequences of ids in the vocabulary, at most MAX_STOP_ENTRIES.
fn checked_stop_token_ids(sequences: Vec<Vec<i32>>, vocab_size: u32) -> Result<Vec<Vec<i32>>> {
    for sequence in &sequences {
        if sequence.is_empty() {
            return Err(OrtexError::invalid("stopTokenIds may not contain an empty sequence"));
        }
        if let Some(bad) = sequence.iter().find(|&&t| t < 0 || t as u32 >= vocab_size) {
            return Err(OrtexError::invalid(format!(
                "stopTokenIds contains {bad}, outside the vocabulary of {vocab_size}"
            )));
        }
    }
    if sequences.len() > MAX_STOP_ENTRIES {
        return Err(OrtexError::invalid(format!("stopTokenIds holds at most {MAX_STOP_ENTRIES} sequences")));
    }
    Ok(sequences)
}

/// `stop`: non-empty strings, at most MAX_STOP_ENTRIES; none given is None.
fn checked_stop_strings(stops: &[String]) -> Result<Option<Arc<[String]>>> {
    if stops.len() > MAX_STOP_ENTRIES {
        return Err(OrtexError::invalid(format!("stop holds at most {MAX_STOP_ENTRIES} strings")));
    }
    if let Some(index) = stops.iter().position(String::is_empty) {
        return Err(OrtexError::invalid(format!("stop[{index}] must be a non-empty string")));
    }
    Ok((!stops.is_empty()).then(|| stops.iter().cloned().collect()))
}

/// `eosTokenIds`: ids in the vocabulary, at most MAX_STOP_ENTRIES.
fn checked_eos_token_ids(ids: Vec<i32>, vocab_size: u32) -> Result<Vec<i32>> {
    if ids.len() > MAX_STOP_ENTRIES {
        return Err(OrtexError::invalid(format!("eosTokenIds holds at most {MAX_STOP_ENTRIES} ids")));
    }
    if let Some(bad) = ids.iter().find(|&&t| t < 0 || t as u32 >= vocab_size) {
        return Err(OrtexError::invalid(format!("eosTokenIds contains {bad}, outside the vocabulary of {vocab_size}")));
    }
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(kv_position_bytes: u64) -> ModelInfo {
        ModelInfo {
            vocab_size: 100,
            eos_token_ids: vec![2],
            max_length: 1000,
            kv_position_bytes,
            required_block_size: None,
        }
    }

    fn resolve(num_blocks: Option<u32>, kv_cache_bytes: Option<u64>, kv_position_bytes: u64) -> Result<EngineConfig> {
        let options = EngineOptions { num_blocks, kv_cache_bytes, max_batch_size: Some(4), ..EngineOptions::default() };
        EngineConfig::resolve(&options, &model(kv_position_bytes))
    }

    #[test]
    fn the_default_pool_holds_every_row_at_full_length_within_the_budget() {
        // 4 rows of ceil(1000 / 16) = 63 blocks; a block of 16 positions at 100 bytes is 1600 bytes.
        let unbounded = resolve(None, None, 100).unwrap();
        assert_eq!((unbounded.num_blocks, unbounded.kv_cache_bytes), (252, 252 * 1600));
        assert_eq!(resolve(None, Some(1 << 40), 100).unwrap().num_blocks, 252);
        let bounded = resolve(None, Some(100 * 1600 + 1599), 100).unwrap();
        assert_eq!((bounded.num_blocks, bounded.kv_cache_bytes, bounded.kv_position_bytes), (100, 100 * 1600, 100));
        assert_eq!(resolve(None, Some(1), 100).unwrap().num_blocks, 1);
    }

    #[test]
    fn a_budget_bounds_nothing_without_kv_bytes_and_numblocks_excludes_it() {
        let sim = resolve(None, Some(1), 0).unwrap();
        assert_eq!((sim.num_blocks, sim.kv_cache_bytes), (252, 0));
        assert_eq!(resolve(Some(7), None, 100).unwrap().kv_cache_bytes, 7 * 1600);
        for (blocks, budget) in [(Some(7), Some(1 << 20)), (None, Some(0)), (Some(0), None)] {
            let error = resolve(blocks, budget, 100).unwrap_err();
            assert_eq!(error.code, crate::ErrorCode::InvalidArgument, "{blocks:?} {budget:?}");
        }
    }

    #[test]
    fn a_model_that_requires_a_block_size_gets_it_and_refuses_another() {
        let paged = ModelInfo { required_block_size: Some(256), ..model(100) };
        let with_block = |block_size| EngineOptions { block_size, max_batch_size: Some(4), ..EngineOptions::default() };
        let config = EngineConfig::resolve(&with_block(None), &paged).unwrap();
        // 4 rows of ceil(1000 / 256) = 4 blocks.
        assert_eq!((config.block_size, config.num_blocks), (256, 16));
        assert_eq!(EngineConfig::resolve(&with_block(Some(256)), &paged).unwrap(), config);
        let error = EngineConfig::resolve(&with_block(Some(16)), &paged).unwrap_err();
        assert_eq!(error.code, crate::ErrorCode::InvalidArgument);
        assert!(
            error.message.contains("blockSize 16") && error.message.contains("block size 256"),
            "{}",
            error.message
        );
        // A model without a requirement keeps the option's default and bounds.
        assert_eq!(EngineConfig::resolve(&with_block(None), &model(100)).unwrap().block_size, 16);
        assert_eq!(
            EngineConfig::resolve(&with_block(Some(0)), &paged).unwrap_err().code,
            crate::ErrorCode::InvalidArgument
        );
    }
}
