//! The logic of every binding method, as plain functions over `ortex_core::Engine` (and, for
//! full-duplex sessions, methods of [`Sessions`] over the core's `SessionManager`): parse the
//! JSON options, convert ids, call the core, format the JSON answers. Both bindings compile this
//! one file (crates/ortex-wasm includes it with `#[path]`), so the native addon and the
//! WebAssembly build cannot drift apart in behaviour or in the shapes of their JSON.
//!
//! Nothing here knows about JavaScript: each binding only converts arguments, catches panics
//! (native) and turns an [`OrtexError`] into a JS error whose `code` is `ErrorCode::as_str()`.

use std::collections::BTreeMap;

use ortex_core::options::{RequestOptions, SimOptions, TurnOptions};
use ortex_core::session::{
    AppendPlan, AppendRequest, AppendReservation, AppendResult, ConfigMap, Fence, LeaseActivity, LeaseConfig,
    LeaseGeneration, Session, SessionManager, DEFAULT_COMPLETED_APPEND_LIMIT, DEFAULT_DISCONNECT_GRACE_MS,
    DEFAULT_IDLE_TTL_MS,
};
use ortex_core::{Engine, ErrorCode, OrtexError, RequestId, Result, TurnId};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::json;

/// Parses caller options; malformed JSON, wrong types and unknown fields are INVALID_ARGUMENT.
pub fn parse_options<T: DeserializeOwned>(what: &str, options_json: &str) -> Result<T> {
    serde_json::from_str(options_json).map_err(|error| OrtexError::invalid(format!("invalid {what}: {error}")))
}

pub fn simulated_impl(options_json: &str) -> Result<Engine> {
    let options: SimOptions = parse_options("engine options", options_json)?;
    Engine::simulated(&options)
}

pub fn config_json_impl(engine: &Engine) -> String {
    let config = engine.config();
    json!({
        "batching": config.batching.as_str(),
        "blockSize": config.block_size,
        "numBlocks": config.num_blocks,
        "maxBatchSize": config.max_batch_size,
        "maxScheduledTokens": config.max_scheduled_tokens,
        "prefillChunkSize": config.prefill_chunk_size,
        "maxPrefillWaitSteps": config.max_prefill_wait_steps,
        "maxRequests": config.max_requests,
        "vocabSize": config.vocab_size,
        "eosTokenIds": config.eos_token_ids,
        "maxLength": config.max_length,
    })
    .to_string()
}

pub fn stats_json_impl(engine: &Engine) -> String {
    let stats = engine.stats();
    json!({
        "totalBlocks": stats.total_blocks,
        "freeBlocks": stats.free_blocks,
        "activeRequests": stats.active_requests,
        "pendingTurns": stats.pending_turns,
        "retainedEvents": stats.retained_events,
        "steps": stats.steps,
        "promptTokens": stats.prompt_tokens,
        "generatedTokens": stats.generated_tokens,
        "virtualTimeUs": stats.virtual_time_us,
    })
    .to_string()
}

pub fn create_request_impl(engine: &mut Engine, options_json: &str) -> Result<u32> {
    let options: RequestOptions = parse_options("request options", options_json)?;
    Ok(engine.create_request(&options)?.get())
}

pub fn begin_turn_impl(engine: &mut Engine, request_id: u32, tokens: &[i32], options_json: &str) -> Result<u32> {
    let options: TurnOptions = parse_options("turn options", options_json)?;
    Ok(engine.begin_turn(RequestId(request_id), tokens, &options)?.get())
}

pub fn prefill_impl(engine: &mut Engine, request_id: u32, tokens: &[i32]) -> Result<()> {
    engine.prefill(RequestId(request_id), tokens)
}

pub fn cancel_turn_impl(engine: &mut Engine, request_id: u32, turn_id: u32) -> Result<bool> {
    engine.cancel_turn(RequestId(request_id), TurnId(turn_id))
}

pub fn close_request_impl(engine: &mut Engine, request_id: u32) -> Result<()> {
    engine.close_request(RequestId(request_id))
}

pub fn abandon_request_impl(engine: &mut Engine, request_id: u32) {
    engine.abandon_request(RequestId(request_id));
}

/// 0 created, 1 queued, 2 active, 3 turn-complete, 4 closed.
pub fn request_state_impl(engine: &Engine, request_id: u32) -> Result<u32> {
    Ok(engine.request_state(RequestId(request_id))?.code())
}

pub fn request_token_count_impl(engine: &Engine, request_id: u32) -> Result<u32> {
    engine.token_count(RequestId(request_id))
}

pub fn run_sync_impl(engine: &mut Engine, events: &mut [i32], capacity: u32) -> Result<u32> {
    Ok(engine.run(events, capacity as usize)? as u32)
}

pub fn has_pending_work_impl(engine: &mut Engine) -> bool {
    engine.has_pending_work()
}

pub fn tokenize_impl(engine: &Engine, text: &str) -> Result<Vec<i32>> {
    engine.tokenize(text)
}

pub fn detokenize_impl(engine: &Engine, tokens: &[i32]) -> Result<String> {
    engine.detokenize(tokens)
}

pub fn close_impl(engine: &mut Engine) {
    engine.close();
}

/// The core asserts its invariants (a broken one panics); the binding turns that into an error.
pub fn check_invariants_impl(engine: &Engine) {
    engine.check_invariants();
}

/// The text of a caught panic's payload.
#[allow(dead_code)] // the wasm build aborts on panic and never has a payload to read
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(message) = payload.downcast_ref::<&str>() {
        (*message).to_string()
    } else if let Some(message) = payload.downcast_ref::<String>() {
        message.clone()
    } else {
        "a panic without a message".to_string()
    }
}

// ---- requests: truncation and context --------------------------------------------------------

pub fn truncate_impl(engine: &mut Engine, request_id: u32, token_count: u32) -> Result<()> {
    engine.truncate(RequestId(request_id), token_count)
}

/// `tokens[start..end]` of the request's context, clamped to its length.
pub fn request_tokens_impl(engine: &Engine, request_id: u32, start: u32, end: u32) -> Result<Vec<i32>> {
    let tokens = engine.request_tokens(RequestId(request_id))?;
    let end = (end as usize).min(tokens.len());
    let start = (start as usize).min(end);
    Ok(tokens[start..end].to_vec())
}

// ---- full-duplex sessions --------------------------------------------------------------------
//
// The session rules are ortex-core's `session` module; `Sessions` only adds what a binding needs
// to hold between calls: the append reservations a caller holds between `prepare_append` and
// `commit_append` (it does its engine work in between), named by small integer ids. Fences,
// views and results cross the boundary as camelCase JSON; time arrives as a JS number of
// milliseconds.

/// Reservations held between prepare and commit. A caller does its engine work synchronously in
/// between, so it holds one at a time; the bound turns a leak into a visible, retryable refusal.
pub const MAX_PENDING_RESERVATIONS: usize = 64;

/// The largest time value accepted: JS numbers are exact up to 2^53.
const MAX_NOW_MS: f64 = 9_007_199_254_740_991.0;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct SessionsOptions {
    /// Absent or null: unlimited.
    #[serde(default)]
    max_sessions: Option<u32>,
    /// Absent: the default TTL; null: idle expiry disabled.
    #[serde(default = "default_idle_ttl_ms")]
    idle_ttl_ms: Option<u64>,
    #[serde(default = "default_disconnect_grace_ms")]
    disconnect_grace_ms: u64,
    #[serde(default = "default_completed_append_limit")]
    completed_append_limit: u32,
}

fn default_idle_ttl_ms() -> Option<u64> {
    Some(DEFAULT_IDLE_TTL_MS)
}

fn default_disconnect_grace_ms() -> u64 {
    DEFAULT_DISCONNECT_GRACE_MS
}

fn default_completed_append_limit() -> u32 {
    DEFAULT_COMPLETED_APPEND_LIMIT
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct FenceJson {
    session_id: String,
    incarnation: u64,
    epoch: u64,
    turn_id: u64,
    response_seq: u64,
}

impl From<FenceJson> for Fence {
    fn from(fence: FenceJson) -> Fence {
        Fence {
            session_id: fence.session_id,
            incarnation: fence.incarnation,
            epoch: fence.epoch,
            turn_id: fence.turn_id,
            response_seq: fence.response_seq,
        }
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct AppendJson {
    #[serde(default)]
    fence: Option<FenceJson>,
    #[serde(default, rename = "final")]
    is_final: bool,
    #[serde(default)]
    operation_id: Option<String>,
    #[serde(default)]
    input_digest: u64,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ConfigsJson {
    #[serde(default)]
    session: Option<ConfigMap>,
    #[serde(default)]
    runtime: Option<ConfigMap>,
}

/// The session manager of one binding object, plus the reservations its caller holds.
pub struct Sessions {
    manager: SessionManager,
    reservations: BTreeMap<u32, AppendReservation>,
    next_reservation: u32,
}

fn now_ms(value: f64) -> Result<u64> {
    if !value.is_finite() || !(0.0..=MAX_NOW_MS).contains(&value) {
        return Err(OrtexError::invalid(format!("nowMs must be a finite number in [0, 2^53), got {value}")));
    }
    Ok(value.floor() as u64)
}

fn optional_fence(what: &str, fence_json: &str) -> Result<Option<Fence>> {
    let fence: Option<FenceJson> = parse_options(what, fence_json)?;
    Ok(fence.map(Fence::from))
}

fn fence_value(fence: &Fence) -> serde_json::Value {
    json!({
        "sessionId": fence.session_id,
        "incarnation": fence.incarnation,
        "epoch": fence.epoch,
        "turnId": fence.turn_id,
        "responseSeq": fence.response_seq,
    })
}

fn session_value(session: &Session) -> serde_json::Value {
    let lease = session.lease();
    let counters = session.counters();
    json!({
        "fence": fence_value(session.fence()),
        "state": session.state().as_str(),
        "leaseGeneration": session.lease_generation().get(),
        "configGeneration": session.config_generation(),
        "closeReason": session.close_reason(),
        "seq": counters.seq,
        "turnSeq": counters.turn_seq,
        "lastActivityMs": lease.last_activity_ms(),
        "detachedAtMs": lease.detached_at_ms(),
        "operationsInFlight": lease.num_operations_in_flight(),
    })
}

fn append_value(result: &AppendResult) -> serde_json::Value {
    json!({
        "seq": result.seq,
        "turnSeq": result.turn_seq,
        "turnId": result.turn_id,
        "final": result.is_final,
        "replayed": result.replayed,
    })
}

fn activity(name: &str) -> Result<LeaseActivity> {
    Ok(match name {
        "append" => LeaseActivity::Append,
        "respond" => LeaseActivity::Respond,
        "cancel" => LeaseActivity::Cancel,
        "heartbeat" => LeaseActivity::Heartbeat,
        "attach" => LeaseActivity::Attach,
        "detach" => LeaseActivity::Detach,
        "model-output" => LeaseActivity::ModelOutput,
        "config" => LeaseActivity::Config,
        other => return Err(OrtexError::invalid(format!("unknown lease activity {other:?}"))),
    })
}

impl Sessions {
    /// optionsJson: {maxSessions?, idleTtlMs?, disconnectGraceMs?, completedAppendLimit?}.
    pub fn new(options_json: &str) -> Result<Sessions> {
        let options: SessionsOptions = parse_options("session manager options", options_json)?;
        let lease = LeaseConfig::new(options.idle_ttl_ms, options.disconnect_grace_ms)?;
        let manager = SessionManager::new(options.max_sessions, options.completed_append_limit, lease)?;
        Ok(Sessions { manager, reservations: BTreeMap::new(), next_reservation: 1 })
    }

    fn session(&mut self, session_id: &str) -> Result<&mut Session> {
        self.manager.require_mut(session_id)
    }

    fn view(&mut self, session_id: &str) -> Result<String> {
        Ok(session_value(self.session(session_id)?).to_string())
    }

    /// Opens a session; returns its view.
    pub fn open(&mut self, session_id: &str, now: f64) -> Result<String> {
        let now = now_ms(now)?;
        Ok(session_value(self.manager.open(session_id, now, None)?).to_string())
    }

    /// The session's view: fence, state, lease generation, counters.
    pub fn get(&mut self, session_id: &str) -> Result<String> {
        self.view(session_id)
    }

    /// Records the engine request the session owns, under its current fence.
    pub fn bind_request(&mut self, session_id: &str, request_id: u32) -> Result<()> {
        let session = self.session(session_id)?;
        let fence = session.fence().clone();
        session.bind_request(request_id, &fence)
    }

    /// Plans an append (pure). Returns {"replay": result} for an operation already applied, or
    /// {"reservation": id, "result": result} for one to commit or discard.
    pub fn prepare_append(&mut self, session_id: &str, request_json: &str) -> Result<String> {
        let request: AppendJson = parse_options("append", request_json)?;
        let request = AppendRequest {
            fence: request.fence.map(Fence::from),
            is_final: request.is_final,
            operation_id: request.operation_id,
            input_digest: request.input_digest,
        };
        if self.reservations.len() >= MAX_PENDING_RESERVATIONS {
            return Err(OrtexError::new(ErrorCode::CapacityExhausted, "too many append reservations are held"));
        }
        match self.session(session_id)?.prepare_append(&request)? {
            AppendPlan::Replay(result) => Ok(json!({ "replay": append_value(&result) }).to_string()),
            AppendPlan::Reserved(reservation) => {
                let id = self.next_reservation;
                self.next_reservation = self.next_reservation.checked_add(1).unwrap_or(1);
                let result = append_value(&reservation.result());
                self.reservations.insert(id, reservation);
                Ok(json!({ "reservation": id, "result": result }).to_string())
            }
        }
    }

    /// Publishes a reservation (STALE_RESERVATION when its base moved); the reservation is
    /// spent either way. Returns {"result", "session"}.
    pub fn commit_append(&mut self, reservation_id: u32, now: f64) -> Result<String> {
        let now = now_ms(now)?;
        let reservation = self
            .reservations
            .remove(&reservation_id)
            .ok_or_else(|| OrtexError::new(ErrorCode::StaleReservation, "unknown or spent append reservation"))?;
        let session_id = reservation.fence().session_id.clone();
        let session = self.session(&session_id)?;
        let result = session.commit_append(reservation, now)?;
        Ok(json!({ "result": append_value(&result), "session": session_value(session) }).to_string())
    }

    /// Drops a reservation whose engine work failed. Unknown ids are ignored.
    pub fn discard_reservation(&mut self, reservation_id: u32) {
        self.reservations.remove(&reservation_id);
    }

    /// Starts a response: advances responseSeq. Returns the view.
    pub fn start_response(&mut self, session_id: &str, now: f64) -> Result<String> {
        let now = now_ms(now)?;
        let session = self.session(session_id)?;
        session.start_response(now)?;
        Ok(session_value(session).to_string())
    }

    /// api.md's cancel: `cancelled_json` is a fence or null (the current fence). Returns
    /// {"cancelled", "fence", "advanced", "requestIds", "session"}.
    pub fn cancel(&mut self, session_id: &str, cancelled_json: &str, now: f64) -> Result<String> {
        let now = now_ms(now)?;
        let cancelled = optional_fence("cancelled fence", cancelled_json)?;
        let session = self.session(session_id)?;
        let outcome = session.cancel(cancelled.as_ref(), now)?;
        Ok(json!({
            "cancelled": fence_value(&outcome.cancelled),
            "fence": fence_value(&outcome.fence),
            "advanced": outcome.advanced,
            "requestIds": outcome.request_ids,
            "session": session_value(session),
        })
        .to_string())
    }

    /// Refuses a fence that is stale for the session (seed 003's validation).
    pub fn validate_fence(&mut self, session_id: &str, fence_json: &str) -> Result<()> {
        let fence = optional_fence("fence", fence_json)?;
        let session = self.session(session_id)?;
        match fence {
            Some(fence) => session.validate_fence(&fence),
            None => Ok(()),
        }
    }

    pub fn touch(&mut self, session_id: &str, now: f64, activity_name: &str) -> Result<()> {
        let now = now_ms(now)?;
        let activity = activity(activity_name)?;
        self.session(session_id)?.touch(now, activity)
    }

    pub fn detach(&mut self, session_id: &str, now: f64) -> Result<String> {
        let now = now_ms(now)?;
        let session = self.session(session_id)?;
        session.detach(now)?;
        Ok(session_value(session).to_string())
    }

    /// Compare-and-swap on the lease generation. Returns the view (with the new generation).
    pub fn resume(&mut self, session_id: &str, now: f64, expected_generation: f64) -> Result<String> {
        let now = now_ms(now)?;
        if !expected_generation.is_finite() || !(0.0..=MAX_NOW_MS).contains(&expected_generation) {
            return Err(OrtexError::invalid("expectedLeaseGeneration must be a non-negative integer"));
        }
        if expected_generation.fract() != 0.0 {
            return Err(OrtexError::invalid("expectedLeaseGeneration must be a non-negative integer"));
        }
        let session = self.session(session_id)?;
        session.resume(now, LeaseGeneration(expected_generation as u64))?;
        Ok(session_value(session).to_string())
    }

    pub fn begin_operation(&mut self, session_id: &str, now: f64, operation_id: &str) -> Result<()> {
        let now = now_ms(now)?;
        self.session(session_id)?.begin_operation(now, operation_id)
    }

    pub fn end_operation(&mut self, session_id: &str, now: f64, operation_id: &str) -> Result<()> {
        let now = now_ms(now)?;
        self.session(session_id)?.end_operation(now, operation_id)
    }

    /// configsJson: {"session": {k: v} | null, "runtime": {k: v} | null}, published as one
    /// generation. Returns the generation in effect.
    pub fn replace_configs(&mut self, session_id: &str, configs_json: &str) -> Result<f64> {
        let configs: ConfigsJson = parse_options("session configs", configs_json)?;
        let generation = self.session(session_id)?.replace_configs(configs.session, configs.runtime)?;
        Ok(generation as f64)
    }

    /// The first phase of close; `fence_json` is a fence (validated: a stale close is refused) or
    /// null. Returns whether this call began the close.
    pub fn begin_close(&mut self, session_id: &str, fence_json: &str, reason: &str) -> Result<bool> {
        let fence = optional_fence("fence", fence_json)?;
        self.manager.begin_close(session_id, fence.as_ref(), reason)
    }

    /// The second phase: frees the slot. Returns the request ids still bound, for release.
    pub fn finalize_close(&mut self, session_id: &str) -> Result<String> {
        let request_ids = self.manager.finalize_close(session_id)?;
        Ok(json!(request_ids).to_string())
    }

    /// Begins the close of every expired session. Returns the expiries as a JSON array.
    pub fn collect_expired(&mut self, now: f64) -> Result<String> {
        let now = now_ms(now)?;
        let expired: Vec<serde_json::Value> = self
            .manager
            .collect_expired(now)
            .iter()
            .map(|expiry| {
                json!({
                    "sessionId": expiry.session_id,
                    "fence": fence_value(&expiry.fence),
                    "leaseGeneration": expiry.lease_generation.get(),
                    "reason": expiry.reason.as_str(),
                    "submittedRequestIds": expiry.submitted_request_ids,
                    "reservedRequestIds": expiry.reserved_request_ids,
                })
            })
            .collect();
        Ok(serde_json::Value::from(expired).to_string())
    }

    /// Sessions holding a slot, closing ones included.
    pub fn num_sessions(&self) -> u32 {
        self.manager.num_sessions() as u32
    }

    /// The core's accounting invariants (a broken one panics).
    pub fn check_invariants(&self) {
        self.manager.check_invariants();
        assert!(self.reservations.len() <= MAX_PENDING_RESERVATIONS, "reservations are bounded");
    }
}

#[cfg(test)]
mod tests {
    //! Runs in the wasm crate's native test build (`cargo test -p ortex-wasm`), which compiles this
    //! file too; the napi crate's test binary cannot load without Node.
    use super::*;

    fn value(json: &str) -> serde_json::Value {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn sessions_options_default_and_validate() {
        assert!(Sessions::new("{}").is_ok());
        assert!(Sessions::new(r#"{"idleTtlMs":null,"maxSessions":null}"#).is_ok());
        for bad in [r#"{"maxSessions":0}"#, r#"{"idleTtlMs":0}"#, r#"{"disconnectGraceMs":0}"#, r#"{"x":1}"#, "nope"] {
            assert_eq!(Sessions::new(bad).err().unwrap().code, ErrorCode::InvalidArgument, "{bad}");
        }
    }

    #[test]
    fn append_prepare_commit_replay_and_stale_reservations_over_json() {
        let mut sessions = Sessions::new(r#"{"maxSessions":1}"#).unwrap();
        let view = value(&sessions.open("s", 10.0).unwrap());
        assert_eq!(view["fence"]["epoch"], 0);
        assert_eq!(view["state"], "open");
        assert_eq!(sessions.open("t", 10.0).unwrap_err().code, ErrorCode::CapacityExhausted);
        let request = r#"{"final":true,"operationId":"op","inputDigest":7}"#;
        let planned = value(&sessions.prepare_append("s", request).unwrap());
        let reservation = planned["reservation"].as_u64().unwrap() as u32;
        let committed = value(&sessions.commit_append(reservation, 11.0).unwrap());
        assert_eq!(committed["result"]["seq"], 1);
        assert_eq!(committed["session"]["fence"]["turnId"], 1, "a final append ends the user turn");
        assert_eq!(sessions.commit_append(reservation, 11.0).unwrap_err().code, ErrorCode::StaleReservation);
        let replay = value(&sessions.prepare_append("s", request).unwrap());
        assert_eq!(replay["replay"]["replayed"], true);
        let reused = r#"{"final":true,"operationId":"op","inputDigest":8}"#;
        assert_eq!(sessions.prepare_append("s", reused).unwrap_err().code, ErrorCode::OperationReused);
        assert_eq!(sessions.commit_append(0, f64::NAN).unwrap_err().code, ErrorCode::InvalidArgument);
        sessions.check_invariants();
    }

    #[test]
    fn cancel_close_and_expiry_over_json() {
        let mut sessions = Sessions::new(r#"{"idleTtlMs":100,"disconnectGraceMs":10}"#).unwrap();
        sessions.open("s", 0.0).unwrap();
        sessions.bind_request("s", 4).unwrap();
        let before = value(&sessions.get("s").unwrap())["fence"].to_string();
        let outcome = value(&sessions.cancel("s", "null", 1.0).unwrap());
        assert_eq!(outcome["advanced"], true);
        assert_eq!(outcome["fence"]["epoch"], 1);
        assert_eq!(sessions.validate_fence("s", &before).unwrap_err().code, ErrorCode::FenceMismatch);
        let retried = value(&sessions.cancel("s", &before, 2.0).unwrap());
        assert_eq!(retried["advanced"], false);
        sessions.detach("s", 3.0).unwrap();
        assert_eq!(sessions.resume("s", 4.0, 5.0).unwrap_err().code, ErrorCode::LeaseGenerationMismatch);
        assert_eq!(value(&sessions.resume("s", 4.0, 0.0).unwrap())["leaseGeneration"], 1);
        sessions.detach("s", 5.0).unwrap();
        let expired = value(&sessions.collect_expired(15.0).unwrap());
        assert_eq!(expired[0]["reason"], "disconnect_grace_expired");
        assert_eq!(expired[0]["submittedRequestIds"], json!([4]));
        assert_eq!(sessions.num_sessions(), 1, "the slot is held until the close is final");
        assert_eq!(value(&sessions.finalize_close("s").unwrap()), json!([4]));
        assert_eq!(sessions.num_sessions(), 0);
        let reopened = value(&sessions.open("s", 20.0).unwrap());
        assert_eq!(reopened["fence"]["incarnation"], 1, "a reused id is a new incarnation");
        sessions.check_invariants();
    }
}
