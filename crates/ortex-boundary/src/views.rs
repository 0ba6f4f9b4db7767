//! What JavaScript gets back: one serializable view per answer, built from the core's types. The
//! TypeScript side's types are generated from these (crates/ortex-typegen writes
//! ts/generated/boundary.ts), so a field added here and not there fails its test.
//!
//! Numbers are JavaScript numbers: counters that may pass 2^32 are `f64`, exact below 2^53.

use ortex_core::session::{
    AppendResult, CancelOutcome, CompletedAppendRecord, Continuation, Fence, Session, SessionExpiry,
};
use ortex_core::{EngineConfig, EngineStats};
use serde::Serialize;

#[cfg(feature = "typescript")]
use ts_rs::TS;

/// The engine's resolved configuration (`engine.config`).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
#[cfg_attr(feature = "typescript", derive(TS))]
pub struct ConfigView {
    #[cfg_attr(feature = "typescript", ts(type = "'dynamic' | 'static'"))]
    pub batching: &'static str,
    pub block_size: u32,
    pub num_blocks: u32,
    pub kv_cache_bytes: f64,
    pub kv_position_bytes: f64,
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

impl From<&EngineConfig> for ConfigView {
    fn from(config: &EngineConfig) -> ConfigView {
        ConfigView {
            batching: config.batching.as_str(),
            block_size: config.block_size,
            num_blocks: config.num_blocks,
            kv_cache_bytes: config.kv_cache_bytes as f64,
            kv_position_bytes: config.kv_position_bytes as f64,
            max_batch_size: config.max_batch_size,
            max_scheduled_tokens: config.max_scheduled_tokens,
            prefill_chunk_size: config.prefill_chunk_size,
            max_prefill_wait_steps: config.max_prefill_wait_steps,
            max_requests: config.max_requests,
            prefix_caching: config.prefix_caching,
            vocab_size: config.vocab_size,
            eos_token_ids: config.eos_token_ids.clone(),
            max_length: config.max_length,
        }
    }
}

/// The engine's counters (`engine.stats()`).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
#[cfg_attr(feature = "typescript", derive(TS))]
pub struct StatsView {
    pub total_blocks: u32,
    pub free_blocks: u32,
    pub active_requests: u32,
    pub pending_turns: u32,
    pub retained_events: u32,
    pub steps: f64,
    pub prompt_tokens: f64,
    pub generated_tokens: f64,
    pub virtual_time_us: f64,
    pub cached_blocks: u32,
    pub prefix_cache_lookups: f64,
    pub prefix_cache_hits: f64,
}

impl From<EngineStats> for StatsView {
    fn from(stats: EngineStats) -> StatsView {
        StatsView {
            total_blocks: stats.total_blocks,
            free_blocks: stats.free_blocks,
            active_requests: stats.active_requests,
            pending_turns: stats.pending_turns,
            retained_events: stats.retained_events,
            steps: stats.steps as f64,
            prompt_tokens: stats.prompt_tokens as f64,
            generated_tokens: stats.generated_tokens as f64,
            virtual_time_us: stats.virtual_time_us as f64,
            cached_blocks: stats.cached_blocks,
            prefix_cache_lookups: stats.prefix_cache_lookups as f64,
            prefix_cache_hits: stats.prefix_cache_hits as f64,
        }
    }
}

/// A fence as JavaScript names it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
#[cfg_attr(feature = "typescript", derive(TS))]
pub struct FenceView {
    pub session_id: String,
    pub incarnation: f64,
    pub epoch: f64,
    pub turn_id: f64,
    pub response_seq: f64,
}

impl From<&Fence> for FenceView {
    fn from(fence: &Fence) -> FenceView {
        FenceView {
            session_id: fence.session_id.clone(),
            incarnation: fence.incarnation as f64,
            epoch: fence.epoch as f64,
            turn_id: fence.turn_id as f64,
            response_seq: fence.response_seq as f64,
        }
    }
}

/// One session as the core's rules see it after a call.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
#[cfg_attr(feature = "typescript", derive(TS))]
pub struct SessionView {
    pub fence: FenceView,
    #[cfg_attr(feature = "typescript", ts(type = "'open' | 'detached' | 'closing' | 'closed'"))]
    pub state: &'static str,
    pub lease_generation: f64,
    pub config_generation: f64,
    pub close_reason: Option<String>,
    pub seq: f64,
    pub turn_seq: f64,
    pub last_activity_ms: f64,
    pub detached_at_ms: Option<f64>,
    pub operations_in_flight: u32,
}

impl From<&Session> for SessionView {
    fn from(session: &Session) -> SessionView {
        let lease = session.lease();
        let counters = session.counters();
        SessionView {
            fence: session.fence().into(),
            state: session.state().as_str(),
            lease_generation: session.lease_generation().get() as f64,
            config_generation: session.config_generation() as f64,
            close_reason: session.close_reason().map(str::to_owned),
            seq: counters.seq as f64,
            turn_seq: counters.turn_seq as f64,
            last_activity_ms: lease.last_activity_ms() as f64,
            detached_at_ms: lease.detached_at_ms().map(|ms| ms as f64),
            operations_in_flight: lease.num_operations_in_flight() as u32,
        }
    }
}

/// What a new owner continues a session's rules from (ortex-core's `Continuation`): a session
/// store keeps it as JSON, and `ContinuationInput` reads the same object back.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
#[cfg_attr(feature = "typescript", derive(TS))]
pub struct ContinuationView {
    pub epoch: f64,
    pub turn_id: f64,
    pub response_seq: f64,
    pub seq: f64,
    pub turn_seq: f64,
    /// The user turn of the epoch's latest append (null before the first).
    pub turn_key: Option<TurnKeyView>,
    /// Oldest first.
    pub completed_appends: Vec<CompletedAppendView>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
#[cfg_attr(feature = "typescript", derive(TS))]
pub struct TurnKeyView {
    pub epoch: f64,
    pub turn_id: f64,
}

/// One remembered append: its operation id, what it was applied with, and its result.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
#[cfg_attr(feature = "typescript", derive(TS))]
pub struct CompletedAppendView {
    pub operation_id: String,
    pub fence: FenceView,
    #[serde(rename = "final")]
    pub is_final: bool,
    pub input_digest: f64,
    pub seq: f64,
    pub turn_seq: f64,
}

impl From<&CompletedAppendRecord> for CompletedAppendView {
    fn from(record: &CompletedAppendRecord) -> CompletedAppendView {
        CompletedAppendView {
            operation_id: record.operation_id.clone(),
            fence: (&record.metadata.fence).into(),
            is_final: record.metadata.is_final,
            input_digest: record.metadata.input_digest as f64,
            seq: record.result.seq as f64,
            turn_seq: record.result.turn_seq as f64,
        }
    }
}

impl From<&Continuation> for ContinuationView {
    fn from(continuation: &Continuation) -> ContinuationView {
        let counters = continuation.counters;
        ContinuationView {
            epoch: continuation.position.epoch as f64,
            turn_id: continuation.position.turn_id as f64,
            response_seq: continuation.position.response_seq as f64,
            seq: counters.seq as f64,
            turn_seq: counters.turn_seq as f64,
            turn_key: counters.turn_key.map(|key| TurnKeyView { epoch: key.epoch as f64, turn_id: key.turn_id as f64 }),
            completed_appends: continuation.completed_appends.iter().map(CompletedAppendView::from).collect(),
        }
    }
}

/// One append's place in its session.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
#[cfg_attr(feature = "typescript", derive(TS))]
pub struct AppendResultView {
    pub seq: f64,
    pub turn_seq: f64,
    pub turn_id: f64,
    #[serde(rename = "final")]
    pub is_final: bool,
    pub replayed: bool,
}

impl From<&AppendResult> for AppendResultView {
    fn from(result: &AppendResult) -> AppendResultView {
        AppendResultView {
            seq: result.seq as f64,
            turn_seq: result.turn_seq as f64,
            turn_id: result.turn_id as f64,
            is_final: result.is_final,
            replayed: result.replayed,
        }
    }
}

/// What preparing an append decided: a replay of an append already applied, or a reservation to
/// commit (or discard) once the engine work is done.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
#[cfg_attr(feature = "typescript", derive(TS))]
pub struct AppendPlanView {
    /// 0 for a replay: nothing to commit.
    pub reservation: u32,
    pub result: AppendResultView,
}

/// A committed append and the session after it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
#[cfg_attr(feature = "typescript", derive(TS))]
pub struct CommitView {
    pub result: AppendResultView,
    pub session: SessionView,
}

/// A cancel: the fence it cancelled, the session's fence after it, whether the epoch advanced,
/// and the requests bound to the cancelled fence (to release).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
#[cfg_attr(feature = "typescript", derive(TS))]
pub struct CancelView {
    pub cancelled: FenceView,
    pub fence: FenceView,
    pub advanced: bool,
    pub request_ids: Vec<u32>,
    pub session: SessionView,
}

impl CancelView {
    pub fn new(outcome: &CancelOutcome, session: &Session) -> CancelView {
        CancelView {
            cancelled: (&outcome.cancelled).into(),
            fence: (&outcome.fence).into(),
            advanced: outcome.advanced,
            request_ids: outcome.request_ids.clone(),
            session: session.into(),
        }
    }
}

/// A session whose lease ran out; its close has begun.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
#[cfg_attr(feature = "typescript", derive(TS))]
pub struct ExpiryView {
    pub session_id: String,
    pub fence: FenceView,
    pub lease_generation: f64,
    #[cfg_attr(feature = "typescript", ts(type = "'disconnect_grace_expired' | 'idle_ttl_expired'"))]
    pub reason: &'static str,
    pub submitted_request_ids: Vec<u32>,
    pub reserved_request_ids: Vec<u32>,
}

impl From<&SessionExpiry> for ExpiryView {
    fn from(expiry: &SessionExpiry) -> ExpiryView {
        ExpiryView {
            session_id: expiry.session_id.clone(),
            fence: (&expiry.fence).into(),
            lease_generation: expiry.lease_generation.get() as f64,
            reason: expiry.reason.as_str(),
            submitted_request_ids: expiry.submitted_request_ids.clone(),
            reserved_request_ids: expiry.reserved_request_ids.clone(),
        }
    }
}

/// A chat turn that began (`beginChatTurn`): its id and how many prompt tokens it read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
#[cfg_attr(feature = "typescript", derive(TS))]
pub struct ChatTurnView {
    pub turn_id: u32,
    pub prompt_tokens: u32,
}
