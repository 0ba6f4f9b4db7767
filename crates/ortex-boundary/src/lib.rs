//! ortex-boundary: what both bindings share. Each binding (crates/ortex-napi, crates/ortex-wasm) turns
//! a JavaScript value into one of the typed inputs here and a view here back into a JavaScript
//! value, and calls these functions for everything in between; so the native addon and the
//! WebAssembly build cannot drift apart in behaviour or in the shapes they answer with.
//!
//! ```text
//!   JS object ──(binding: serde)──▶ inputs::*Input ──TryFrom──▶ ortex-core options
//!                                                                     │ ortex-core call
//!   JS object ◀──(binding: serde)── views::*View ◀──From── ortex-core types
//! ```
//!
//! The TypeScript side's types for every input and view, and the constants in [`limits`], are
//! generated from this crate (crates/ortex-typegen, ts/generated/boundary.ts): one definition.

pub mod chat;
pub mod conversation;
pub mod inputs;
pub mod limits;
pub mod prompt_text;
pub mod sessions;
pub mod views;

use ortex_core::options::{RequestOptions, SimOptions, TurnOptions};
use ortex_core::text::TextCodec;
use ortex_core::{Engine, OrtexError, RequestId, Result, TurnId};
use serde::de::DeserializeOwned;

pub use chat::{Chat, ChatFilesInput, ChatPrompt, ChatRenderInput};
pub use conversation::{begin_conversation_turn_impl, Conversation, ConversationPlan};
pub use inputs::*;
pub use sessions::Sessions;
pub use views::*;

/// Turns a deserialization failure of `what` into INVALID_ARGUMENT (wrong type, unknown field).
pub fn invalid_input(what: &str, error: impl std::fmt::Display) -> OrtexError {
    OrtexError::invalid(format!("invalid {what}: {error}"))
}

/// Options from JSON text (tests, examples and the CLI tools build them this way).
pub fn from_json<T: DeserializeOwned>(what: &str, json: &str) -> Result<T> {
    serde_json::from_str(json).map_err(|error| invalid_input(what, error))
}

/// The simulated model's options from JSON text.
pub fn sim_options_from_json(json: &str) -> Result<SimOptions> {
    SimOptions::try_from(from_json::<SimOptionsInput>("engine options", json)?)
}

/// Turn options from JSON text.
pub fn turn_options_from_json(json: &str) -> Result<TurnOptions> {
    TurnOptions::try_from(from_json::<TurnOptionsInput>("turn options", json)?)
}

pub fn simulated_impl(options: SimOptionsInput) -> Result<Engine> {
    Engine::simulated(&SimOptions::try_from(options)?)
}

pub fn config_impl(engine: &Engine) -> ConfigView {
    engine.config().into()
}

pub fn stats_impl(engine: &Engine) -> StatsView {
    engine.stats().into()
}

pub fn create_request_impl(engine: &mut Engine, options: RequestOptionsInput) -> Result<u32> {
    Ok(engine.create_request(&RequestOptions::from(options))?.get())
}

pub fn begin_turn_impl(engine: &mut Engine, request_id: u32, tokens: &[i32], options: TurnOptionsInput) -> Result<u32> {
    Ok(engine.begin_turn(RequestId(request_id), tokens, &TurnOptions::try_from(options)?)?.get())
}

/// Checks turn options as `begin_turn_impl` would (every rule, the vocabulary's included) without
/// beginning anything: for a caller that must refuse them before it changes state (a
/// conversation's truncation, the OpenAI server's parser). The one place the rules live is
/// `TurnOptions::resolve`.
pub fn validate_turn_options_impl(engine: &Engine, options: TurnOptionsInput) -> Result<()> {
    TurnOptions::try_from(options)?.resolve(engine.config().vocab_size).map(|_| ())
}

/// Begins a chat turn on `prompt` (Chat::prompt): the template's end tokens join the caller's
/// `eosTokenIds`, so the turn ends with 'eos' on either.
pub fn begin_chat_turn_impl(
    engine: &mut Engine,
    request_id: u32,
    prompt: ChatPrompt,
    options: TurnOptionsInput,
) -> Result<ChatTurnView> {
    let options = with_end_tokens(options, &prompt.end_token_ids);
    let turn_id = begin_turn_impl(engine, request_id, &prompt.tokens, options)?;
    Ok(ChatTurnView { turn_id, prompt_tokens: prompt.tokens.len() as u32 })
}

/// `options` with the template's end tokens joining its `eosTokenIds` (each once).
pub fn with_end_tokens(mut options: TurnOptionsInput, end_token_ids: &[i32]) -> TurnOptionsInput {
    let mut eos_token_ids = options.eos_token_ids.take().unwrap_or_default();
    for &id in end_token_ids {
        if !eos_token_ids.contains(&id) {
            eos_token_ids.push(id);
        }
    }
    options.eos_token_ids = Some(eos_token_ids);
    options
}

/// A chat turn's prompt with the engine's codec, on the calling thread (a binding that can,
/// renders off it: `Engine::text_codec` and `Chat::prompt`).
pub fn chat_prompt_impl(
    engine: &Engine,
    chat: &Chat,
    input: ChatRenderInput,
    parse_special_tokens: bool,
) -> Result<ChatPrompt> {
    chat.prompt(engine.text_codec()?.as_ref(), input, parse_special_tokens)
}

pub fn prefill_impl(engine: &mut Engine, request_id: u32, tokens: &[i32]) -> Result<()> {
    engine.prefill(RequestId(request_id), tokens)
}

pub fn cancel_turn_impl(engine: &mut Engine, request_id: u32, turn_id: u32) -> Result<bool> {
    engine.cancel_turn(RequestId(request_id), TurnId(turn_id))
}

pub fn hold_turn_impl(engine: &mut Engine, request_id: u32, turn_id: u32) -> Result<bool> {
    engine.hold_turn(RequestId(request_id), TurnId(turn_id))
}

pub fn release_turn_impl(engine: &mut Engine, request_id: u32, turn_id: u32) -> Result<bool> {
    engine.release_turn(RequestId(request_id), TurnId(turn_id))
}

pub fn close_request_impl(engine: &mut Engine, request_id: u32) -> Result<()> {
    engine.close_request(RequestId(request_id))
}

pub fn abandon_request_impl(engine: &mut Engine, request_id: u32) {
    engine.abandon_request(RequestId(request_id));
}

/// The request state's code: an index into `limits::event_layout().request_states`.
pub fn request_state_impl(engine: &Engine, request_id: u32) -> Result<u32> {
    Ok(engine.request_state(RequestId(request_id))?.code())
}

pub fn request_token_count_impl(engine: &Engine, request_id: u32) -> Result<u32> {
    engine.token_count(RequestId(request_id))
}

pub fn run_sync_impl(engine: &mut Engine, events: &mut [i32], capacity: u32) -> Result<u32> {
    Ok(engine.run(events, capacity as usize)? as u32)
}

/// The text of the last run's events (their text words point into it, in UTF-16 units).
pub fn run_text_impl(engine: &Engine) -> &str {
    &engine.run_output().text
}

/// The log-probability numbers of the last run's events (their logprobs words point into them).
pub fn run_logprobs_impl(engine: &Engine) -> &[f64] {
    &engine.run_output().logprobs
}

pub fn has_pending_work_impl(engine: &mut Engine) -> bool {
    engine.has_pending_work()
}

pub fn tokenize_impl(engine: &Engine, text: &str) -> Result<Vec<i32>> {
    engine.tokenize(text)
}

/// Tokenizes a text that starts a request's context: the tokenizer's BOS first, where it has one.
pub fn tokenize_prompt_impl(engine: &Engine, text: &str) -> Result<Vec<i32>> {
    engine.tokenize_prompt(text)
}

/// Tokenizes a prompt rendered by [`Chat::render_marked`]: control strings that came from the
/// caller's text encode as plain text (prompt_text.rs).
pub fn tokenize_marked_impl(engine: &Engine, marked: &str) -> Result<Vec<i32>> {
    tokenize_marked_with(engine.text_codec()?.as_ref(), marked)
}

/// [`tokenize_marked_impl`] with a codec handle (`Engine::text_codec`), for a binding that
/// tokenizes off the JS thread.
pub fn tokenize_marked_with(codec: &dyn TextCodec, marked: &str) -> Result<Vec<i32>> {
    if !marked.contains(prompt_text::ESCAPE) {
        return codec.tokenize(marked); // nothing was marked: no need for the control strings
    }
    let controls = prompt_text::ControlStrings::new(codec.control_strings());
    let (text, literals) = controls.unmark(marked);
    codec.tokenize_rendered(&text, &literals)
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

/// The text of a caught panic's payload.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(message) = payload.downcast_ref::<&str>() {
        (*message).to_string()
    } else if let Some(message) = payload.downcast_ref::<String>() {
        message.clone()
    } else {
        "a panic without a message".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ortex_core::ErrorCode;

    #[test]
    fn options_are_strict() {
        for bad in ["", "nope", "[]", r#"{"seed":-1}"#, r#"{"unknown":1}"#, r#"{"seed":1.5}"#, r#"{"blockSize":1.5}"#] {
            let error = sim_options_from_json(bad).err().unwrap_or_else(|| panic!("{bad} was accepted"));
            assert_eq!(error.code, ErrorCode::InvalidArgument, "{bad}");
        }
        let options =
            sim_options_from_json(r#"{"seed":9007199254740991,"blockSize":4,"faults":{"fatalSteps":[3]}}"#).unwrap();
        assert_eq!(options.seed, Some((1 << 53) - 1));
        assert_eq!(options.engine.block_size, Some(4));
        assert_eq!(options.faults.unwrap().fatal_steps, vec![3]);
        assert!(turn_options_from_json(r#"{"maxTokens":3}"#).is_err());
    }

    #[test]
    fn turn_options_are_validated_as_a_turn_would_be() {
        let engine = simulated_impl(SimOptionsInput { seed: Some(1.0), ..Default::default() }).unwrap();
        let valid = TurnOptionsInput { temperature: Some(0.5), top_p: Some(1.0), ..Default::default() };
        assert!(validate_turn_options_impl(&engine, valid).is_ok());
        let vocab = engine.config().vocab_size as i32;
        for bad in [
            TurnOptionsInput { top_p: Some(0.0), ..Default::default() },
            TurnOptionsInput { temperature: Some(-1.0), ..Default::default() },
            TurnOptionsInput { presence_penalty: Some(2.5), ..Default::default() },
            TurnOptionsInput { eos_token_ids: Some(vec![vocab]), ..Default::default() },
            TurnOptionsInput { stop_token_ids: Some(vec![vec![]]), ..Default::default() },
            TurnOptionsInput { seed: Some(0.5), ..Default::default() },
        ] {
            let error = validate_turn_options_impl(&engine, bad.clone()).unwrap_err();
            assert_eq!(error.code, ErrorCode::InvalidArgument, "{bad:?}");
        }
    }

    #[test]
    fn views_name_fields_as_javascript_reads_them() {
        let engine = simulated_impl(SimOptionsInput { seed: Some(1.0), ..Default::default() }).unwrap();
        let config = serde_json::to_value(config_impl(&engine)).unwrap();
        assert_eq!(config["batching"], "dynamic");
        assert_eq!(config["eosTokenIds"], serde_json::json!([2]));
        let stats = serde_json::to_value(stats_impl(&engine)).unwrap();
        assert_eq!(stats["totalBlocks"], config["numBlocks"]);
        assert_eq!(stats["virtualTimeUs"], 0.0);
    }
}
