//! What JavaScript hands in: a mirror of each of the core's option structs, deserialized from a
//! plain JavaScript object (camelCase, unknown fields refused) and converted into the core's type
//! with `TryFrom`, so that serde stays out of ortex-core.
//!
//! A JavaScript number is an f64: 64-bit quantities (seeds, step numbers, costs, fence counters)
//! arrive as `f64` and are converted exactly (an integer in [0, 2^53)) or refused. 32-bit counts
//! arrive as `u32`, which serde refuses when the number is negative, fractional or too large.

use ortex_core::constraint::Constraint;
use ortex_core::options::{BatchingMode, EngineOptions, RequestOptions, SimFaults, SimOptions, TurnOptions};
use ortex_core::session::{
    AppendCounters, AppendMetadata, AppendResult, CompletedAppendRecord, ConfigMap, Continuation, Fence, FenceKey,
    TurnKey,
};
use ortex_core::{OrtexError, Result};
use serde::Deserialize;

#[cfg(feature = "typescript")]
use ts_rs::TS;

/// The largest integer a JavaScript number holds exactly.
pub const MAX_SAFE_INTEGER: f64 = 9_007_199_254_740_991.0;

/// An integer in [0, 2^53) that arrived as a JavaScript number.
pub fn exact_u64(name: &str, value: f64) -> Result<u64> {
    if value.is_finite() && value.fract() == 0.0 && (0.0..=MAX_SAFE_INTEGER).contains(&value) {
        Ok(value as u64)
    } else {
        Err(OrtexError::invalid(format!("{name} must be an integer in [0, 2^53), got {value}")))
    }
}

fn exact_u64_list(name: &str, values: Vec<f64>) -> Result<Vec<u64>> {
    values.into_iter().map(|v| exact_u64(name, v)).collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[cfg_attr(feature = "typescript", derive(TS))]
pub enum BatchingInput {
    Dynamic,
    Static,
}

/// Defines an options struct that takes the engine's options (one list, here) beside its own,
/// with `engine()` returning them. serde's `flatten` would not refuse unknown fields, so the
/// engine's fields are written into each struct instead.
macro_rules! with_engine_options {
    ($(#[$meta:meta])* pub struct $name:ident { $($(#[$field_meta:meta])* pub $field:ident: $ty:ty,)* }) => {
        $(#[$meta])*
        pub struct $name {
            pub batching: Option<BatchingInput>,
            pub block_size: Option<u32>,
            pub num_blocks: Option<u32>,
            pub kv_cache_bytes: Option<f64>,
            pub max_batch_size: Option<u32>,
            pub max_scheduled_tokens: Option<u32>,
            pub prefill_chunk_size: Option<u32>,
            pub max_prefill_wait_steps: Option<u32>,
            pub max_requests: Option<u32>,
            pub prefix_caching: Option<bool>,
            $($(#[$field_meta])* pub $field: $ty,)*
        }

        impl $name {
            /// The engine's options among these.
            pub fn engine(&self) -> Result<EngineOptions> {
                Ok(EngineOptions {
                    batching: self.batching.map(BatchingMode::from),
                    block_size: self.block_size,
                    num_blocks: self.num_blocks,
                    kv_cache_bytes: self.kv_cache_bytes.map(|b| exact_u64("kvCacheBytes", b)).transpose()?,
                    max_batch_size: self.max_batch_size,
                    max_scheduled_tokens: self.max_scheduled_tokens,
                    prefill_chunk_size: self.prefill_chunk_size,
                    max_prefill_wait_steps: self.max_prefill_wait_steps,
                    max_requests: self.max_requests,
                    prefix_caching: self.prefix_caching,
                })
            }
        }
    };
}

impl From<BatchingInput> for BatchingMode {
    fn from(batching: BatchingInput) -> BatchingMode {
        match batching {
            BatchingInput::Dynamic => BatchingMode::Dynamic,
            BatchingInput::Static => BatchingMode::Static,
        }
    }
}

with_engine_options! {
    /// `EngineOptions` (docs/api.md): every field optional; an absent one takes the core's default.
    #[derive(Debug, Clone, Default, Deserialize)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    #[cfg_attr(feature = "typescript", derive(TS), ts(optional_fields))]
    pub struct EngineOptionsInput {}
}

/// The simulated model's injected faults.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[cfg_attr(feature = "typescript", derive(TS), ts(optional_fields))]
pub struct FaultsInput {
    pub retryable_steps: Option<Vec<f64>>,
    pub fatal_steps: Option<Vec<f64>>,
    pub capacity_steps: Option<Vec<f64>>,
    pub retryable_rate: Option<f64>,
    pub capacity_rate: Option<f64>,
    pub fatal_rate: Option<f64>,
    pub seed: Option<f64>,
}

impl TryFrom<FaultsInput> for SimFaults {
    type Error = OrtexError;

    fn try_from(input: FaultsInput) -> Result<SimFaults> {
        Ok(SimFaults {
            retryable_steps: exact_u64_list("faults.retryableSteps", input.retryable_steps.unwrap_or_default())?,
            fatal_steps: exact_u64_list("faults.fatalSteps", input.fatal_steps.unwrap_or_default())?,
            capacity_steps: exact_u64_list("faults.capacitySteps", input.capacity_steps.unwrap_or_default())?,
            retryable_rate: input.retryable_rate.unwrap_or(0.0),
            capacity_rate: input.capacity_rate.unwrap_or(0.0),
            fatal_rate: input.fatal_rate.unwrap_or(0.0),
            seed: input.seed.map(|s| exact_u64("faults.seed", s)).transpose()?.unwrap_or(0),
        })
    }
}

with_engine_options! {
    /// `SimulatedOptions`: the engine's options plus the simulated model's.
    #[derive(Debug, Clone, Default, Deserialize)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    #[cfg_attr(feature = "typescript", derive(TS), ts(optional_fields))]
    pub struct SimOptionsInput {
        pub seed: Option<f64>,
        pub vocab_size: Option<u32>,
        pub eos_token_id: Option<u32>,
        pub max_length: Option<u32>,
        pub eos_probability: Option<f64>,
        pub faults: Option<FaultsInput>,
        pub step_cost_us: Option<f64>,
        pub token_cost_us: Option<f64>,
    }
}

impl TryFrom<SimOptionsInput> for SimOptions {
    type Error = OrtexError;

    fn try_from(input: SimOptionsInput) -> Result<SimOptions> {
        let cost = |name: &str, value: Option<f64>| value.map(|v| exact_u64(name, v)).transpose();
        Ok(SimOptions {
            engine: input.engine()?,
            seed: cost("seed", input.seed)?,
            vocab_size: input.vocab_size,
            eos_token_id: input.eos_token_id,
            max_length: input.max_length,
            eos_probability: input.eos_probability,
            faults: input.faults.map(SimFaults::try_from).transpose()?,
            step_cost_us: cost("stepCostUs", input.step_cost_us)?,
            token_cost_us: cost("tokenCostUs", input.token_cost_us)?,
        })
    }
}

/// `RequestOptions`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[cfg_attr(feature = "typescript", derive(TS), ts(optional_fields))]
pub struct RequestOptionsInput {
    pub max_session_tokens: Option<u32>,
}

impl From<RequestOptionsInput> for RequestOptions {
    fn from(input: RequestOptionsInput) -> RequestOptions {
        RequestOptions { max_session_tokens: input.max_session_tokens }
    }
}

/// `TurnOptions` as the core takes them: the facade keeps `signal` itself.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[cfg_attr(feature = "typescript", derive(TS), ts(optional_fields))]
pub struct TurnOptionsInput {
    pub max_generated_tokens: Option<u32>,
    pub temperature: Option<f64>,
    pub top_k: Option<u32>,
    pub top_p: Option<f64>,
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub seed: Option<f64>,
    pub ignore_eos: Option<bool>,
    pub stop_token_ids: Option<Vec<Vec<i32>>>,
    pub eos_token_ids: Option<Vec<i32>>,
    pub logprobs: Option<u32>,
    pub stop: Option<Vec<String>>,
    pub constraint: Option<ConstraintInput>,
}

/// `TurnOptions.constraint`: what the turn's output must match, by `type`.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
#[cfg_attr(feature = "typescript", derive(TS))]
pub enum ConstraintInput {
    /// Any JSON object.
    Json {},
    /// A JSON Schema (an object, or a boolean schema).
    JsonSchema {
        #[cfg_attr(feature = "typescript", ts(type = "Record<string, unknown> | boolean"))]
        schema: serde_json::Value,
    },
    /// A regular expression the whole output matches.
    Regex { pattern: String },
    /// A Lark grammar (llguidance's dialect).
    Lark { grammar: String },
}

impl From<ConstraintInput> for Constraint {
    fn from(input: ConstraintInput) -> Constraint {
        match input {
            ConstraintInput::Json {} => Constraint::Json,
            ConstraintInput::JsonSchema { schema } => Constraint::JsonSchema(schema),
            ConstraintInput::Regex { pattern } => Constraint::Regex(pattern),
            ConstraintInput::Lark { grammar } => Constraint::Lark(grammar),
        }
    }
}

impl TryFrom<TurnOptionsInput> for TurnOptions {
    type Error = OrtexError;

    fn try_from(input: TurnOptionsInput) -> Result<TurnOptions> {
        Ok(TurnOptions {
            max_generated_tokens: input.max_generated_tokens,
            temperature: input.temperature,
            top_k: input.top_k,
            top_p: input.top_p,
            min_p: input.min_p,
            repetition_penalty: input.repetition_penalty,
            presence_penalty: input.presence_penalty,
            frequency_penalty: input.frequency_penalty,
            seed: input.seed.map(|s| exact_u64("seed", s)).transpose()?,
            ignore_eos: input.ignore_eos,
            stop_token_ids: input.stop_token_ids,
            eos_token_ids: input.eos_token_ids,
            logprobs: input.logprobs,
            stop: input.stop,
            constraint: input.constraint.map(Constraint::from),
        })
    }
}

/// The session manager's options. Absent fields take the core's defaults (limits.rs); an
/// `idleTtlMs` of null disables idle expiry.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[cfg_attr(feature = "typescript", derive(TS), ts(optional_fields))]
pub struct SessionsOptionsInput {
    pub max_sessions: Option<u32>,
    #[serde(default)]
    #[cfg_attr(feature = "typescript", ts(type = "number | null", optional))]
    pub idle_ttl_ms: IdleTtlInput,
    pub disconnect_grace_ms: Option<f64>,
    pub completed_append_limit: Option<u32>,
}

/// `idleTtlMs`: absent (the default TTL), null (idle expiry disabled) or milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub enum IdleTtlInput {
    #[default]
    Default,
    Disabled,
    Ms(f64),
}

/// It may be left out, as an Option may: in TypeScript the field is optional.
#[cfg(feature = "typescript")]
impl ts_rs::IsOption for IdleTtlInput {}

impl<'de> Deserialize<'de> for IdleTtlInput {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        Ok(Option::<f64>::deserialize(deserializer)?.map_or(IdleTtlInput::Disabled, IdleTtlInput::Ms))
    }
}

/// A fence as JavaScript names it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[cfg_attr(feature = "typescript", derive(TS))]
pub struct FenceInput {
    pub session_id: String,
    pub incarnation: f64,
    pub epoch: f64,
    pub turn_id: f64,
    pub response_seq: f64,
}

impl TryFrom<FenceInput> for Fence {
    type Error = OrtexError;

    fn try_from(input: FenceInput) -> Result<Fence> {
        Ok(Fence {
            session_id: input.session_id,
            incarnation: exact_u64("fence.incarnation", input.incarnation)?,
            epoch: exact_u64("fence.epoch", input.epoch)?,
            turn_id: exact_u64("fence.turnId", input.turn_id)?,
            response_seq: exact_u64("fence.responseSeq", input.response_seq)?,
        })
    }
}

/// A stored `ContinuationView`, read back for a restore (the store hands back what the view wrote).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[cfg_attr(feature = "typescript", derive(TS))]
pub struct ContinuationInput {
    pub epoch: f64,
    pub turn_id: f64,
    pub response_seq: f64,
    pub seq: f64,
    pub turn_seq: f64,
    pub turn_key: Option<TurnKeyInput>,
    pub completed_appends: Vec<CompletedAppendInput>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[cfg_attr(feature = "typescript", derive(TS))]
pub struct TurnKeyInput {
    pub epoch: f64,
    pub turn_id: f64,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[cfg_attr(feature = "typescript", derive(TS))]
pub struct CompletedAppendInput {
    pub operation_id: String,
    pub fence: FenceInput,
    #[serde(rename = "final")]
    pub is_final: bool,
    pub input_digest: f64,
    pub seq: f64,
    pub turn_seq: f64,
}

impl TryFrom<ContinuationInput> for Continuation {
    type Error = OrtexError;

    /// Numbers only; whether the continuation fits the session is the core's to decide.
    fn try_from(input: ContinuationInput) -> Result<Continuation> {
        let turn_key = input
            .turn_key
            .map(|key| -> Result<TurnKey> {
                Ok(TurnKey {
                    epoch: exact_u64("continuation.turnKey.epoch", key.epoch)?,
                    turn_id: exact_u64("continuation.turnKey.turnId", key.turn_id)?,
                })
            })
            .transpose()?;
        let completed_appends = input
            .completed_appends
            .into_iter()
            .map(|append| -> Result<CompletedAppendRecord> {
                let fence = Fence::try_from(append.fence)?;
                let result = AppendResult {
                    seq: exact_u64("continuation.completedAppends.seq", append.seq)?,
                    turn_seq: exact_u64("continuation.completedAppends.turnSeq", append.turn_seq)?,
                    turn_id: fence.turn_id,
                    is_final: append.is_final,
                    replayed: false,
                };
                let input_digest = exact_u64("continuation.completedAppends.inputDigest", append.input_digest)?;
                let metadata = AppendMetadata { fence, is_final: append.is_final, input_digest };
                Ok(CompletedAppendRecord { operation_id: append.operation_id, metadata, result })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Continuation {
            position: FenceKey {
                epoch: exact_u64("continuation.epoch", input.epoch)?,
                turn_id: exact_u64("continuation.turnId", input.turn_id)?,
                response_seq: exact_u64("continuation.responseSeq", input.response_seq)?,
            },
            counters: AppendCounters {
                seq: exact_u64("continuation.seq", input.seq)?,
                turn_seq: exact_u64("continuation.turnSeq", input.turn_seq)?,
                turn_key,
            },
            completed_appends,
        })
    }
}

/// A session's configuration replacement: both maps published as one generation.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[cfg_attr(feature = "typescript", derive(TS), ts(optional_fields))]
pub struct ConfigsInput {
    pub session: Option<ConfigMap>,
    pub runtime: Option<ConfigMap>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
#[cfg_attr(feature = "typescript", derive(TS))]
pub enum ExecutionProviderInput {
    Cpu,
    Cuda,
}

with_engine_options! {
    /// `Engine.load`'s options: the engine's own, plus how ONNX Runtime runs the model (the native
    /// binding turns them into ortex-ort's load options).
    #[derive(Debug, Clone, Default, Deserialize)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    #[cfg_attr(feature = "typescript", derive(TS), ts(optional_fields))]
    pub struct ModelOptionsInput {
        pub execution_provider: Option<ExecutionProviderInput>,
        /// 0 or absent: ONNX Runtime's default.
        pub intra_op_threads: Option<u32>,
        /// Intra-op threads spin between operators during a run; absent: false.
        pub intra_op_spinning: Option<bool>,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_options_split_engine_and_model_settings() {
        let json = r#"{"maxBatchSize":4,"executionProvider":"cuda","intraOpThreads":2,"intraOpSpinning":true}"#;
        let options: ModelOptionsInput = crate::from_json("engine options", json).unwrap();
        assert_eq!(options.engine().unwrap().max_batch_size, Some(4));
        assert_eq!(options.execution_provider, Some(ExecutionProviderInput::Cuda));
        assert_eq!((options.intra_op_threads, options.intra_op_spinning), (Some(2), Some(true)));
        for bad in [
            r#"{"unknown":1}"#,
            r#"{"executionProvider":"tpu"}"#,
            r#"{"intraOpThreads":-1}"#,
            r#"{"intraOpSpinning":1}"#,
            "nope",
        ] {
            assert!(crate::from_json::<ModelOptionsInput>("engine options", bad).is_err(), "{bad}");
        }
    }
}
