//! ortex's WebAssembly build: a thin wasm-bindgen binding over ortex-core and its simulated
//! model. The interface it exports is ts/binding.ts (`WasmBinding`); the TypeScript facade is
//! its only caller.
//!
//! Same shape as the native addon: the logic of each method is a plain function in `boundary`
//! (crates/ortex-boundary, which crates/ortex-napi calls too, so both backends behave and answer
//! alike); the wrappers below only convert (a JavaScript object into a `boundary` input and a `boundary`
//! view back, through serde-wasm-bindgen), and turn an [`OrtexError`] into a JS `Error` whose
//! `code` is the core's `ErrorCode::as_str()`. There is no asynchronous `run` (one thread), and a
//! panic aborts (this build uses panic=abort), which traps as a `WebAssembly.RuntimeError`.

use js_sys::{Int32Array, Reflect};
use ortex_boundary as boundary;
use ortex_core::{Engine, OrtexError, EVENT_STRIDE_WORDS};
use serde::de::DeserializeOwned;
use serde::Serialize;
use wasm_bindgen::prelude::*;

/// A JavaScript object as one of boundary's typed inputs; a wrong shape is INVALID_ARGUMENT.
fn input<T: DeserializeOwned>(what: &str, value: JsValue) -> Result<T, JsValue> {
    serde_wasm_bindgen::from_value(value).map_err(|error| coded(boundary::invalid_input(what, error)))
}

/// An optional one: `null` and `undefined` are None.
fn optional_input<T: DeserializeOwned>(what: &str, value: JsValue) -> Result<Option<T>, JsValue> {
    if value.is_null() || value.is_undefined() {
        return Ok(None);
    }
    input(what, value).map(Some)
}

/// One of boundary's views as a plain JavaScript object (maps as objects, as the native addon gives).
fn view(value: &impl Serialize) -> JsValue {
    let serializer = serde_wasm_bindgen::Serializer::new().serialize_maps_as_objects(true);
    value.serialize(&serializer).expect("views serialize: they hold only strings, numbers and lists")
}

fn coded(error: OrtexError) -> JsValue {
    let js_error = js_sys::Error::new(&error.message);
    // Setting a property on a fresh Error object cannot fail.
    let _ = Reflect::set(&js_error, &JsValue::from_str("code"), &JsValue::from_str(error.code.as_str()));
    js_error.into()
}

/// Words of an event buffer that `events` events take (saturating: wasm32's usize is 32 bits).
fn event_words(events: u32) -> usize {
    (events as usize).saturating_mul(EVENT_STRIDE_WORDS)
}

#[wasm_bindgen]
pub struct CoreEngine {
    engine: Engine,
    /// Events are encoded here, in wasm memory, and only the written words are copied into the
    /// caller's Int32Array: one copy out, none in.
    scratch: Vec<i32>,
}

#[wasm_bindgen]
impl CoreEngine {
    /// An engine over the deterministic simulated model; `options` is a SimOptions object.
    pub fn simulated(options: JsValue) -> Result<CoreEngine, JsValue> {
        let engine = boundary::simulated_impl(input("engine options", options)?).map_err(coded)?;
        Ok(CoreEngine { engine, scratch: Vec::new() })
    }

    pub fn config(&self) -> JsValue {
        view(&boundary::config_impl(&self.engine))
    }

    #[wasm_bindgen(js_name = createRequest)]
    pub fn create_request(&mut self, options: JsValue) -> Result<u32, JsValue> {
        boundary::create_request_impl(&mut self.engine, input("request options", options)?).map_err(coded)
    }

    #[wasm_bindgen(js_name = beginTurn)]
    pub fn begin_turn(&mut self, request_id: u32, tokens: &[i32], options: JsValue) -> Result<u32, JsValue> {
        let options = input("turn options", options)?;
        boundary::begin_turn_impl(&mut self.engine, request_id, tokens, options).map_err(coded)
    }

    /// Begins a chat turn in one call (the native addon's `beginChatTurn`): `chat` renders
    /// `render_input` with a generation prompt, marked unless `parse_special_tokens`; the
    /// engine's codec tokenizes it; the template's end tokens join `options.eosTokenIds`.
    /// Returns a ChatTurnView.
    #[wasm_bindgen(js_name = beginChatTurn)]
    pub fn begin_chat_turn(
        &mut self,
        request_id: u32,
        chat: &CoreChat,
        render_input: JsValue,
        parse_special_tokens: bool,
        options: JsValue,
    ) -> Result<JsValue, JsValue> {
        let options = input("turn options", options)?;
        let render_input = input("chat template input", render_input)?;
        let prompt =
            boundary::chat_prompt_impl(&self.engine, &chat.chat, render_input, parse_special_tokens).map_err(coded)?;
        Ok(view(&boundary::begin_chat_turn_impl(&mut self.engine, request_id, prompt, options).map_err(coded)?))
    }

    /// A conversation's memory of its last send (the native addon's `createConversation`).
    #[wasm_bindgen(js_name = createConversation)]
    pub fn create_conversation(&self) -> CoreConversation {
        CoreConversation { conversation: boundary::Conversation::new() }
    }

    /// A conversation's send in one call (the native addon's `beginConversationTurn`): render,
    /// plan what is not resident yet, cut the context where the render no longer matches it,
    /// begin. Returns a ChatTurnView.
    #[wasm_bindgen(js_name = beginConversationTurn)]
    pub fn begin_conversation_turn(
        &mut self,
        request_id: u32,
        conversation: &mut CoreConversation,
        chat: &CoreChat,
        render_input: JsValue,
        parse_special_tokens: bool,
        options: JsValue,
    ) -> Result<JsValue, JsValue> {
        let options = input("turn options", options)?;
        let render_input = input("chat template input", render_input)?;
        let conversation = &mut conversation.conversation;
        let begun = boundary::begin_conversation_turn_impl(
            &mut self.engine,
            &chat.chat,
            conversation,
            request_id,
            render_input,
            parse_special_tokens,
            options,
        );
        Ok(view(&begun.map_err(coded)?))
    }

    /// Turn options checked as `beginTurn` checks them, beginning nothing.
    #[wasm_bindgen(js_name = validateTurnOptions)]
    pub fn validate_turn_options(&self, options: JsValue) -> Result<(), JsValue> {
        boundary::validate_turn_options_impl(&self.engine, input("turn options", options)?).map_err(coded)
    }

    pub fn prefill(&mut self, request_id: u32, tokens: &[i32]) -> Result<(), JsValue> {
        boundary::prefill_impl(&mut self.engine, request_id, tokens).map_err(coded)
    }

    #[wasm_bindgen(js_name = cancelTurn)]
    pub fn cancel_turn(&mut self, request_id: u32, turn_id: u32) -> Result<bool, JsValue> {
        boundary::cancel_turn_impl(&mut self.engine, request_id, turn_id).map_err(coded)
    }

    #[wasm_bindgen(js_name = holdTurn)]
    pub fn hold_turn(&mut self, request_id: u32, turn_id: u32) -> Result<bool, JsValue> {
        boundary::hold_turn_impl(&mut self.engine, request_id, turn_id).map_err(coded)
    }

    #[wasm_bindgen(js_name = releaseTurn)]
    pub fn release_turn(&mut self, request_id: u32, turn_id: u32) -> Result<bool, JsValue> {
        boundary::release_turn_impl(&mut self.engine, request_id, turn_id).map_err(coded)
    }

    #[wasm_bindgen(js_name = closeRequest)]
    pub fn close_request(&mut self, request_id: u32) -> Result<(), JsValue> {
        boundary::close_request_impl(&mut self.engine, request_id).map_err(coded)
    }

    #[wasm_bindgen(js_name = abandonRequest)]
    pub fn abandon_request(&mut self, request_id: u32) {
        boundary::abandon_request_impl(&mut self.engine, request_id);
    }

    #[wasm_bindgen(js_name = requestState)]
    pub fn request_state(&self, request_id: u32) -> Result<u32, JsValue> {
        boundary::request_state_impl(&self.engine, request_id).map_err(coded)
    }

    #[wasm_bindgen(js_name = requestTokenCount)]
    pub fn request_token_count(&self, request_id: u32) -> Result<u32, JsValue> {
        boundary::request_token_count_impl(&self.engine, request_id).map_err(coded)
    }

    /// Drains retained events or executes one transaction, writing the events into `events`.
    #[wasm_bindgen(js_name = runSync)]
    pub fn run_sync(&mut self, events: &Int32Array, capacity: u32) -> Result<u32, JsValue> {
        // The scratch buffer has the caller's length (up to what `capacity` needs), so the core
        // sees, and rejects, a buffer too small for `capacity` exactly as the native addon does.
        let words = (events.length() as usize).min(event_words(capacity));
        if self.scratch.len() < words {
            self.scratch.resize(words, 0);
        }
        let scratch = &mut self.scratch[..words];
        let written = boundary::run_sync_impl(&mut self.engine, scratch, capacity).map_err(coded)?;
        let written_words = event_words(written);
        if written_words > 0 {
            events.subarray(0, written_words as u32).copy_from(&scratch[..written_words]);
        }
        Ok(written)
    }

    /// The text of the last run's events, which their text words point into (UTF-16 units).
    #[wasm_bindgen(js_name = runText)]
    pub fn run_text(&self) -> String {
        boundary::run_text_impl(&self.engine).to_string()
    }

    /// The log-probability numbers of the last run's events (their logprobs words point in).
    #[wasm_bindgen(js_name = runLogprobs)]
    pub fn run_logprobs(&self) -> Vec<f64> {
        boundary::run_logprobs_impl(&self.engine).to_vec()
    }

    #[wasm_bindgen(js_name = hasPendingWork)]
    pub fn has_pending_work(&mut self) -> bool {
        boundary::has_pending_work_impl(&mut self.engine)
    }

    pub fn stats(&self) -> JsValue {
        view(&boundary::stats_impl(&self.engine))
    }

    /// Returns an Int32Array.
    pub fn tokenize(&self, text: &str) -> Result<Vec<i32>, JsValue> {
        boundary::tokenize_impl(&self.engine, text).map_err(coded)
    }

    /// Returns an Int32Array.
    #[wasm_bindgen(js_name = tokenizePrompt)]
    pub fn tokenize_prompt(&self, text: &str) -> Result<Vec<i32>, JsValue> {
        boundary::tokenize_prompt_impl(&self.engine, text).map_err(coded)
    }

    #[wasm_bindgen(js_name = tokenizeMarked)]
    pub fn tokenize_marked(&self, marked: &str) -> Result<Vec<i32>, JsValue> {
        boundary::tokenize_marked_impl(&self.engine, marked).map_err(coded)
    }

    #[wasm_bindgen(js_name = controlStrings)]
    pub fn control_strings(&self) -> Result<Vec<String>, JsValue> {
        self.engine.control_strings().map_err(coded)
    }

    pub fn detokenize(&self, tokens: &[i32]) -> Result<String, JsValue> {
        boundary::detokenize_impl(&self.engine, tokens).map_err(coded)
    }

    pub fn close(&mut self) {
        boundary::close_impl(&mut self.engine);
    }

    /// Test hook: a broken invariant panics, which traps (panic=abort).
    #[wasm_bindgen(js_name = checkInvariants)]
    pub fn check_invariants(&self) {
        boundary::check_invariants_impl(&self.engine);
    }

    /// Drops the request's tokens past `tokenCount` between turns and frees the KV blocks past them.
    pub fn truncate(&mut self, request_id: u32, token_count: u32) -> Result<(), JsValue> {
        boundary::truncate_impl(&mut self.engine, request_id, token_count).map_err(coded)
    }

    /// The latest turn's log-probabilities of its generated tokens [start, end), clamped
    /// (TokenLogprobsView[]).
    /// `tokens[start..end]` of the request's context (clamped). Returns an Int32Array.
    #[wasm_bindgen(js_name = requestTokens)]
    pub fn request_tokens(&self, request_id: u32, start: u32, end: u32) -> Result<Vec<i32>, JsValue> {
        boundary::request_tokens_impl(&self.engine, request_id, start, end).map_err(coded)
    }

    /// A full-duplex session manager (the core's session rules) for this engine's sessions.
    #[wasm_bindgen(js_name = createSessions)]
    pub fn create_sessions(&self, options: JsValue) -> Result<CoreSessions, JsValue> {
        let options = input("session manager options", options)?;
        Ok(CoreSessions { sessions: boundary::Sessions::new(options).map_err(coded)? })
    }
}

/// ortex-core's full-duplex session rules (fences, leases, appends, cancel, two-phase close,
/// expiry). Objects in and out; every method lives in `boundary::Sessions`.
#[wasm_bindgen]
pub struct CoreSessions {
    sessions: boundary::Sessions,
}

#[wasm_bindgen]
impl CoreSessions {
    pub fn open(&mut self, session_id: &str, now_ms: f64) -> Result<JsValue, JsValue> {
        self.sessions.open(session_id, now_ms).map(|v| view(&v)).map_err(coded)
    }

    pub fn restore(
        &mut self,
        session_id: &str,
        now_ms: f64,
        incarnation: f64,
        lease_generation: f64,
        continuation: JsValue,
    ) -> Result<JsValue, JsValue> {
        let continuation = optional_input("continuation", continuation)?;
        let restored = self.sessions.restore(session_id, now_ms, incarnation, lease_generation, continuation);
        restored.map(|v| view(&v)).map_err(coded)
    }

    pub fn continuation(&mut self, session_id: &str) -> Result<JsValue, JsValue> {
        self.sessions.continuation(session_id).map(|v| view(&v)).map_err(coded)
    }

    pub fn get(&mut self, session_id: &str) -> Result<JsValue, JsValue> {
        self.sessions.get(session_id).map(|v| view(&v)).map_err(coded)
    }

    #[wasm_bindgen(js_name = bindRequest)]
    pub fn bind_request(&mut self, session_id: &str, request_id: u32) -> Result<(), JsValue> {
        self.sessions.bind_request(session_id, request_id).map_err(coded)
    }

    #[wasm_bindgen(js_name = prepareAppend)]
    pub fn prepare_append(
        &mut self,
        session_id: &str,
        is_final: bool,
        operation_id: Option<String>,
        input_digest: f64,
        fence: JsValue,
    ) -> Result<JsValue, JsValue> {
        let fence = optional_input("fence", fence)?;
        let plan = self.sessions.prepare_append(session_id, is_final, operation_id, input_digest, fence);
        plan.map(|v| view(&v)).map_err(coded)
    }

    #[wasm_bindgen(js_name = commitAppend)]
    pub fn commit_append(&mut self, reservation_id: u32, now_ms: f64) -> Result<JsValue, JsValue> {
        self.sessions.commit_append(reservation_id, now_ms).map(|v| view(&v)).map_err(coded)
    }

    #[wasm_bindgen(js_name = discardReservation)]
    pub fn discard_reservation(&mut self, reservation_id: u32) {
        self.sessions.discard_reservation(reservation_id);
    }

    #[wasm_bindgen(js_name = startResponse)]
    pub fn start_response(&mut self, session_id: &str, now_ms: f64) -> Result<JsValue, JsValue> {
        self.sessions.start_response(session_id, now_ms).map(|v| view(&v)).map_err(coded)
    }

    pub fn cancel(&mut self, session_id: &str, cancelled: JsValue, now_ms: f64) -> Result<JsValue, JsValue> {
        let cancelled = optional_input("cancelled fence", cancelled)?;
        self.sessions.cancel(session_id, cancelled, now_ms).map(|v| view(&v)).map_err(coded)
    }

    #[wasm_bindgen(js_name = validateFence)]
    pub fn validate_fence(&mut self, session_id: &str, fence: JsValue) -> Result<(), JsValue> {
        self.sessions.validate_fence(session_id, input("fence", fence)?).map_err(coded)
    }

    pub fn touch(&mut self, session_id: &str, now_ms: f64, activity: &str) -> Result<(), JsValue> {
        self.sessions.touch(session_id, now_ms, activity).map_err(coded)
    }

    pub fn detach(&mut self, session_id: &str, now_ms: f64) -> Result<JsValue, JsValue> {
        self.sessions.detach(session_id, now_ms).map(|v| view(&v)).map_err(coded)
    }

    pub fn resume(&mut self, session_id: &str, now_ms: f64, expected_generation: f64) -> Result<JsValue, JsValue> {
        self.sessions.resume(session_id, now_ms, expected_generation).map(|v| view(&v)).map_err(coded)
    }

    #[wasm_bindgen(js_name = beginOperation)]
    pub fn begin_operation(&mut self, session_id: &str, now_ms: f64, operation_id: &str) -> Result<(), JsValue> {
        self.sessions.begin_operation(session_id, now_ms, operation_id).map_err(coded)
    }

    #[wasm_bindgen(js_name = endOperation)]
    pub fn end_operation(&mut self, session_id: &str, now_ms: f64, operation_id: &str) -> Result<(), JsValue> {
        self.sessions.end_operation(session_id, now_ms, operation_id).map_err(coded)
    }

    #[wasm_bindgen(js_name = replaceConfigs)]
    pub fn replace_configs(&mut self, session_id: &str, configs: JsValue) -> Result<f64, JsValue> {
        let configs = input("session configs", configs)?;
        self.sessions.replace_configs(session_id, configs).map_err(coded)
    }

    #[wasm_bindgen(js_name = beginClose)]
    pub fn begin_close(&mut self, session_id: &str, fence: JsValue, reason: &str) -> Result<bool, JsValue> {
        let fence = optional_input("fence", fence)?;
        self.sessions.begin_close(session_id, fence, reason).map_err(coded)
    }

    #[wasm_bindgen(js_name = finalizeClose)]
    pub fn finalize_close(&mut self, session_id: &str) -> Result<JsValue, JsValue> {
        self.sessions.finalize_close(session_id).map(|ids| view(&ids)).map_err(coded)
    }

    #[wasm_bindgen(js_name = collectExpired)]
    pub fn collect_expired(&mut self, now_ms: f64) -> Result<JsValue, JsValue> {
        self.sessions.collect_expired(now_ms).map(|v| view(&v)).map_err(coded)
    }

    #[wasm_bindgen(js_name = numSessions)]
    pub fn num_sessions(&self) -> u32 {
        self.sessions.num_sessions()
    }

    /// Test hook: a broken invariant panics, which traps (panic=abort).
    #[wasm_bindgen(js_name = checkInvariants)]
    pub fn check_invariants(&self) {
        self.sessions.check_invariants();
    }
}

/// A conversation's memory of its last send (boundary::Conversation), held by the facade's Chat.
#[wasm_bindgen]
pub struct CoreConversation {
    conversation: boundary::Conversation,
}

/// A model's chat template (boundary::Chat), compiled once: the same calls as the native addon's.
#[wasm_bindgen]
pub struct CoreChat {
    chat: boundary::Chat,
}

#[wasm_bindgen]
impl CoreChat {
    /// `controls`: the control strings of the engine that tokenizes its prompts.
    #[wasm_bindgen(js_name = fromFiles)]
    pub fn from_files(files: JsValue, controls: Vec<String>) -> Result<CoreChat, JsValue> {
        let chat = boundary::Chat::from_files(&input("chat files", files)?).map_err(coded)?;
        Ok(CoreChat { chat: chat.with_control_strings(controls) })
    }

    pub fn chatml(controls: Vec<String>) -> CoreChat {
        CoreChat { chat: boundary::Chat::chatml().with_control_strings(controls) }
    }

    pub fn render(&self, render_input: JsValue) -> Result<String, JsValue> {
        self.chat.render(input("chat template input", render_input)?).map_err(coded)
    }

    #[wasm_bindgen(js_name = renderMarked)]
    pub fn render_marked(&self, render_input: JsValue) -> Result<String, JsValue> {
        self.chat.render_marked(input("chat template input", render_input)?).map_err(coded)
    }

    #[wasm_bindgen(js_name = stopStrings)]
    pub fn stop_strings(&self) -> Vec<String> {
        self.chat.stop_strings()
    }

    #[wasm_bindgen(js_name = hasTemplate)]
    pub fn has_template(&self) -> bool {
        self.chat.has_template()
    }
}
