//! The constants both sides read: limits and defaults the facade checks or reports, the event
//! record's layout and the names of the codes it carries. Each is defined once, in ortex-core;
//! crates/ortex-typegen writes them into ts/generated/boundary.ts for the TypeScript side.

use ortex_core::events::{flags, word, FinishReason, StopMatch, LOGPROB_ALTERNATIVE, LOGPROB_HEAD};
use ortex_core::options::MAX_STOP_ENTRIES;
use ortex_core::sampling::{MAX_ABS_OPENAI_PENALTY, MAX_REPETITION_PENALTY, MAX_TOP_LOGPROBS};
use ortex_core::session::{
    DEFAULT_COMPLETED_APPEND_LIMIT, DEFAULT_DISCONNECT_GRACE_MS, DEFAULT_IDLE_TTL_MS, MAX_CLOSE_REASON_CHARS,
    MAX_OPERATION_ID_CHARS, MAX_SESSION_ID_CHARS,
};
use ortex_core::{ErrorCode, EventErrorCode, RequestState, EVENT_STRIDE_WORDS};
use serde::Serialize;

/// Limits and defaults, as one value (serialized into the TypeScript constants).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Limits {
    /// Most stop strings, and most stop token sequences, per turn.
    pub max_stop_entries: usize,
    pub max_session_id_chars: usize,
    pub max_operation_id_chars: usize,
    pub max_close_reason_chars: usize,
    pub default_idle_ttl_ms: u64,
    pub default_disconnect_grace_ms: u64,
    pub default_completed_append_limit: u32,
    /// `repetitionPenalty` is in (0, this].
    pub max_repetition_penalty: f64,
    /// `presencePenalty` and `frequencyPenalty` are in [-this, this] (OpenAI's range).
    pub max_abs_presence_frequency_penalty: f64,
    /// `logprobs` asks for at most this many alternatives per token.
    pub max_top_logprobs: u32,
}

pub const LIMITS: Limits = Limits {
    max_stop_entries: MAX_STOP_ENTRIES,
    max_session_id_chars: MAX_SESSION_ID_CHARS,
    max_operation_id_chars: MAX_OPERATION_ID_CHARS,
    max_close_reason_chars: MAX_CLOSE_REASON_CHARS,
    default_idle_ttl_ms: DEFAULT_IDLE_TTL_MS,
    default_disconnect_grace_ms: DEFAULT_DISCONNECT_GRACE_MS,
    default_completed_append_limit: DEFAULT_COMPLETED_APPEND_LIMIT,
    max_repetition_penalty: MAX_REPETITION_PENALTY,
    max_abs_presence_frequency_penalty: MAX_ABS_OPENAI_PENALTY,
    max_top_logprobs: MAX_TOP_LOGPROBS,
};

/// The event record's layout and code names (events.rs), as the TypeScript side decodes them.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EventLayout {
    pub stride_words: usize,
    /// Word offsets within one record, by field.
    pub words: Vec<(&'static str, usize)>,
    /// Flag bits, by name.
    pub flags: Vec<(&'static str, u32)>,
    /// Finish reason names, indexed by their code.
    pub finish_reasons: Vec<&'static str>,
    /// What a stop was (a stop token sequence or a stop string), indexed by the stop-kind word.
    pub stop_kinds: Vec<&'static str>,
    /// Event error code names, indexed by their code.
    pub event_error_codes: Vec<&'static str>,
    /// The error codes of every thrown `OrtexError`.
    pub error_codes: Vec<&'static str>,
    /// Those a caller may retry (the same call may succeed later).
    pub retryable_error_codes: Vec<&'static str>,
    /// Request state names, indexed by their code.
    pub request_states: Vec<&'static str>,
    /// One log-probability entry's numbers in a run's logprobs, by name, before its alternatives.
    pub logprob_head: Vec<&'static str>,
    /// One alternative's numbers, `topCount` of them after the head.
    pub logprob_alternative: Vec<&'static str>,
}

pub fn event_layout() -> EventLayout {
    EventLayout {
        stride_words: EVENT_STRIDE_WORDS,
        words: word::ALL.to_vec(),
        flags: vec![
            ("Token", flags::TOKEN),
            ("TurnFinished", flags::TURN_FINISHED),
            ("CapacityBlocked", flags::CAPACITY_BLOCKED),
            ("Failed", flags::FAILED),
            ("Retryable", flags::RETRYABLE),
        ],
        finish_reasons: FinishReason::NAMES.to_vec(),
        stop_kinds: StopMatch::KIND_NAMES.to_vec(),
        event_error_codes: EventErrorCode::ALL.iter().map(|c| c.as_str()).collect(),
        error_codes: ErrorCode::ALL.iter().map(|c| c.as_str()).collect(),
        retryable_error_codes: ErrorCode::ALL.iter().filter(|c| c.retryable()).map(|c| c.as_str()).collect(),
        request_states: RequestState::ALL.iter().map(|s| s.as_str()).collect(),
        logprob_head: LOGPROB_HEAD.to_vec(),
        logprob_alternative: LOGPROB_ALTERNATIVE.to_vec(),
    }
}
