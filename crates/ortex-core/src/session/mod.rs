//! Full-duplex session state: fences, leases, idempotent appends, cancellation, two-phase close
//! and expiry, after vllm-omni's `vllm_omni/experimental/fullduplex/engine/duplex_session.py`.
//!
//! This module is pure bookkeeping. It never reads a clock (time arrives as `now_ms` values),
//! never does I/O, never spawns and iterates only ordered maps, so that the same sequence of
//! calls gives the same results on native and WebAssembly builds and in the seeded simulation.
//! The engine integration calls it to decide whether a command may act and what to release; it
//! does the engine work itself.
//!
//! ```text
//!   fence     who and where a command is addressed (incarnation, epoch, turn, response)
//!   lease     idle TTL, disconnect grace, resume by generation, one-shot end
//!   append    seq / turn_seq counters, prepare -> commit reservations, replay cache
//!   state     one session: the above plus request bindings, configs and its close phase
//!   manager   all sessions of an engine: capacity, two-phase close, expiry collection
//! ```
//!
//! A typical life, with the fence after each step:
//!
//! ```text
//!   open("s")                      {inc 0, epoch 0, turn 0, resp 0}
//!   append "hel", append "lo" final   turn 0 gets seq 1, 2; the final append ends it -> turn 1
//!   start_response                 {epoch 0, turn 1, resp 1}
//!   cancel (barge-in)              {epoch 1, turn 1, resp 1}: counters and replay cache reset
//!   detach ... resume(0) -> 1      lease generation 0 -> 1
//!   continuation() ... restore(inc 1) another process takes the session over: {inc 1, epoch 1,
//!                                  turn 1, resp 1}, counters and replay cache carried along
//!   begin_close -> finalize_close  slot freed, "s" remembered with incarnation 0
//!   open("s")                      {inc 1, epoch 0, turn 0, resp 0}
//! ```

pub mod append;
pub mod bindings;
pub mod config;
pub mod fence;
pub mod lease;
pub mod manager;
pub mod state;

pub use append::{
    AppendCounters, AppendMetadata, AppendPlan, AppendRequest, AppendReservation, AppendResult, CompletedAppendCache,
    CompletedAppendRecord, TurnKey, DEFAULT_COMPLETED_APPEND_LIMIT,
};
pub use bindings::{RequestBindings, RequestResource, MAX_REQUESTS_PER_SESSION};
pub use config::{ConfigMap, SessionConfigs, MAX_CONFIG_ENTRIES};
pub use fence::{fence_mismatch, require_current, require_same_epoch, validate_fence, Fence, FenceKey};
pub use lease::{
    Lease, LeaseActivity, LeaseConfig, LeaseGeneration, DEFAULT_DISCONNECT_GRACE_MS, DEFAULT_IDLE_TTL_MS,
    MAX_OPERATIONS_IN_FLIGHT, MAX_OPERATION_ID_CHARS,
};
pub use manager::{
    ExpiryReason, SessionExpiry, SessionManager, CLOSED_ID_RECORD_LIMIT, MAX_CLOSE_REASON_CHARS, MAX_SESSION_ID_CHARS,
    REQUEST_CLEANUP_REASON,
};
pub use state::{CancelOutcome, Continuation, Session, SessionState};
