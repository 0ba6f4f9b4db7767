//! The logic of every binding method, as plain functions over `ortex_core::Engine`: parse the
//! JSON options, convert ids, call the core, format the JSON answers. Both bindings compile this
//! one file (crates/ortex-wasm includes it with `#[path]`), so the native addon and the
//! WebAssembly build cannot drift apart in behaviour or in the shapes of their JSON.
//!
//! Nothing here knows about JavaScript: each binding only converts arguments, catches panics
//! (native) and turns an [`OrtexError`] into a JS error whose `code` is `ErrorCode::as_str()`.

use ortex_core::options::{RequestOptions, SimOptions, TurnOptions};
use ortex_core::{Engine, OrtexError, RequestId, Result, TurnId};
use serde::de::DeserializeOwned;
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
