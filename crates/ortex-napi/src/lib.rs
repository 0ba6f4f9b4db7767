//! ortex's Node-API addon: a thin napi-rs binding over ortex-core. The interface it exports is
//! ts/binding.ts (`NativeBinding`); the TypeScript facade is its only caller.
//!
//! Shape: the logic of each method is a plain function in [`boundary`] (crates/ortex-boundary, which the
//! WebAssembly binding calls too); the `#[napi]` wrappers below only convert (a JavaScript object
//! into a `boundary` input and a `boundary` view back, through serde), run the call under [`guarded`] (a
//! panic becomes an ENGINE_UNHEALTHY error and marks the engine unhealthy: it never unwinds into
//! Node) and turn an [`OrtexError`] into a JS `Error` whose `code` is the core's
//! `ErrorCode::as_str()`.
//!
//! Threads: the engine lives on the JS thread. `run` plans on the JS thread (`run_begin`), sends
//! only the [`Transaction`](ortex_core::Transaction) (which carries the executor) off it, and commits on the JS thread
//! again (`run_commit`), which is also where the events are written into the caller's
//! `Int32Array`. Off the JS thread means the engine's own step thread for a model (its
//! completions bring each run back), the libuv thread pool for the simulated model
//! (step_thread.rs says why; run.rs holds that plumbing). Between the two halves every other
//! method keeps working; the core applies them at the transaction boundary. The engine sits in an
//! `Arc<Mutex<_>>` only so the commit can find it again; the lock is never taken off the JS
//! thread, so it is never contended.
//!
//! Files: this one holds `CoreEngine` (its methods and the conversions they share); run.rs, where
//! a `run`'s transaction executes and how it commits; sessions.rs, `CoreSessions` (the session
//! rules); model.rs, loading an ONNX model folder; chat.rs, the chat template calls.

mod chat;
mod completions;
mod model;
mod run;
mod sessions;
mod step_thread;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use napi::bindgen_prelude::*;
use napi::JsValue;
use napi_derive::napi;
use ortex_boundary as boundary;
use ortex_core::{Engine, ErrorCode, OrtexError, RunStart};
use run::{OffThread, RunPromise, RunTask};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use sessions::CoreSessions;

/// A JavaScript object as one of boundary's typed inputs; a wrong shape is INVALID_ARGUMENT.
///
/// The methods take their object arguments as `Unknown` and convert them here, not as `Value`
/// parameters: napi-rs converts those before the method runs and throws its own status as the
/// error's code (`InvalidArg` for a function, a BigInt, NaN, nesting past 128 levels or a cycle),
/// a code the caller was never told about. Converted here, every such value is INVALID_ARGUMENT.
fn input<T: DeserializeOwned>(what: &str, value: Unknown<'_>) -> ortex_core::Result<T> {
    serde_json::from_value(json(what, value)?).map_err(|error| boundary::invalid_input(what, error))
}

/// A JavaScript value as JSON (napi-rs's conversion: bounded in depth and size).
fn json(what: &str, value: Unknown<'_>) -> ortex_core::Result<Value> {
    let raw = value.value();
    // SAFETY: `raw` is an argument of the method running now on the JS thread, in its own env.
    unsafe { Value::from_napi_value(raw.env, raw.value) }
        .map_err(|error| OrtexError::invalid(format!("{what} cannot be read as JSON: {}", error.reason)))
}

/// One of boundary's views as a JavaScript object.
fn view(value: impl Serialize) -> Value {
    serde_json::to_value(value).expect("views serialize: they hold only strings, numbers and lists")
}

/// A JS error carrying the core's code (`err.code === error.code.as_str()`). Spelled
/// `napi::Result<T, String>` at each method: napi-derive recognizes a result by its name.
type CodedError = napi::Error<String>;

fn coded(error: OrtexError) -> CodedError {
    napi::Error::new(error.code.as_str().to_string(), error.message)
}

/// The same error as a `napi::Error` holding the JS error object, for the places napi-rs wants
/// its default status type (an async task's settlement).
fn coded_js(env: &Env, error: OrtexError) -> napi::Error {
    // SAFETY: `env` is the live environment of the JS thread this runs on.
    let value = unsafe { ToNapiValue::to_napi_value(env.raw(), coded(error)) }
        .and_then(|value| unsafe { Unknown::from_napi_value(env.raw(), value) });
    match value {
        Ok(value) => napi::Error::from(value),
        Err(error) => error,
    }
}

fn unhealthy_after_panic(message: &str) -> OrtexError {
    OrtexError::new(ErrorCode::EngineUnhealthy, format!("the engine panicked and is unhealthy: {message}"))
}

/// Runs one call into the core. A panic marks the engine unhealthy and becomes an error, so no
/// panic ever unwinds into Node.
fn guarded<T>(engine: &mut Engine, call: impl FnOnce(&mut Engine) -> ortex_core::Result<T>) -> ortex_core::Result<T> {
    match catch_unwind(AssertUnwindSafe(|| call(&mut *engine))) {
        Ok(result) => result,
        Err(payload) => {
            let message = boundary::panic_message(payload.as_ref());
            let _ = catch_unwind(AssertUnwindSafe(|| engine.mark_unhealthy(&message)));
            Err(unhealthy_after_panic(&message))
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics while holding these locks (calls into the core unwind inside `guarded`,
    // under the guard), so none is ever poisoned; recover anyway rather than panic here.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

#[napi(custom_finalize)]
pub struct CoreEngine {
    engine: Arc<Mutex<Engine>>,
    /// The ONNX executor's timings (model.rs); None for the simulated model.
    executor_stats: Option<Arc<ortex_ort::ExecutorStats>>,
    /// Which execution provider runs each node of the model's session (model.rs); None for the
    /// simulated model.
    node_placement: Option<Value>,
    /// Where a model's transactions execute; None for the simulated model (the libuv pool).
    steps: Option<OffThread>,
    /// What this engine told V8 it holds outside the JavaScript heap (a model's weights and KV),
    /// so that collection is prompted by it; given back on close or finalization.
    external_bytes: AtomicI64,
}

impl CoreEngine {
    /// Gives back what was reported to V8 (on the JS thread).
    fn release_external(&self, env: &Env) {
        let bytes = self.external_bytes.swap(0, Ordering::Relaxed);
        if bytes > 0 {
            let _ = env.adjust_external_memory(-bytes);
        }
    }

    fn call<T>(&self, call: impl FnOnce(&mut Engine) -> ortex_core::Result<T>) -> napi::Result<T, String> {
        guarded(&mut lock(&self.engine), call).map_err(coded)
    }
}

impl ObjectFinalize for CoreEngine {
    fn finalize(self, env: Env) -> napi::Result<()> {
        self.release_external(&env);
        Ok(())
    }
}

#[napi]
impl CoreEngine {
    /// An engine over the deterministic simulated model; `options` is a SimOptions object.
    #[napi(factory)]
    pub fn simulated(options: Unknown<'_>) -> napi::Result<Self, String> {
        let engine = catch_unwind(|| boundary::simulated_impl(input("engine options", options)?))
            .unwrap_or_else(|payload| Err(unhealthy_after_panic(&boundary::panic_message(payload.as_ref()))))
            .map_err(coded)?;
        Ok(CoreEngine {
            engine: Arc::new(Mutex::new(engine)),
            executor_stats: None,
            node_placement: None,
            steps: None,
            external_bytes: AtomicI64::new(0),
        })
    }

    #[napi(ts_return_type = "ConfigView")]
    pub fn config(&self) -> napi::Result<Value, String> {
        self.call(|engine| Ok(view(boundary::config_impl(engine))))
    }

    #[napi]
    pub fn create_request(&self, options: Unknown<'_>) -> napi::Result<u32, String> {
        self.call(|engine| boundary::create_request_impl(engine, input("request options", options)?))
    }

    #[napi]
    pub fn begin_turn(&self, request_id: u32, tokens: &[i32], options: Unknown<'_>) -> napi::Result<u32, String> {
        self.call(|engine| boundary::begin_turn_impl(engine, request_id, tokens, input("turn options", options)?))
    }

    #[napi]
    pub fn validate_turn_options(&self, options: Unknown<'_>) -> napi::Result<(), String> {
        self.call(|engine| boundary::validate_turn_options_impl(engine, input("turn options", options)?))
    }

    #[napi]
    pub fn prefill(&self, request_id: u32, tokens: &[i32]) -> napi::Result<(), String> {
        self.call(|engine| boundary::prefill_impl(engine, request_id, tokens))
    }

    #[napi]
    pub fn cancel_turn(&self, request_id: u32, turn_id: u32) -> napi::Result<bool, String> {
        self.call(|engine| boundary::cancel_turn_impl(engine, request_id, turn_id))
    }

    #[napi]
    pub fn hold_turn(&self, request_id: u32, turn_id: u32) -> napi::Result<bool, String> {
        self.call(|engine| boundary::hold_turn_impl(engine, request_id, turn_id))
    }

    #[napi]
    pub fn release_turn(&self, request_id: u32, turn_id: u32) -> napi::Result<bool, String> {
        self.call(|engine| boundary::release_turn_impl(engine, request_id, turn_id))
    }

    #[napi]
    pub fn close_request(&self, request_id: u32) -> napi::Result<(), String> {
        self.call(|engine| boundary::close_request_impl(engine, request_id))
    }

    #[napi]
    pub fn abandon_request(&self, request_id: u32) -> napi::Result<(), String> {
        self.call(|engine| {
            boundary::abandon_request_impl(engine, request_id);
            Ok(())
        })
    }

    #[napi]
    pub fn request_state(&self, request_id: u32) -> napi::Result<u32, String> {
        self.call(|engine| boundary::request_state_impl(engine, request_id))
    }

    #[napi]
    pub fn request_token_count(&self, request_id: u32) -> napi::Result<u32, String> {
        self.call(|engine| boundary::request_token_count_impl(engine, request_id))
    }

    /// Drains retained events or executes one transaction on the JS thread.
    #[napi]
    pub fn run_sync(&self, mut events: Int32ArraySlice<'_>, capacity: u32) -> napi::Result<u32, String> {
        // SAFETY: the JS thread is inside this call; nothing else touches the buffer now.
        let buffer = unsafe { events.as_mut() };
        self.call(|engine| boundary::run_sync_impl(engine, buffer, capacity))
    }

    /// Drains retained events at once (an already-settled promise), or executes one transaction
    /// off the JS thread and writes its events into `events` when it commits.
    #[napi(ts_return_type = "Promise<number>")]
    pub fn run<'env>(&self, env: &'env Env, mut events: Int32Array, capacity: u32) -> napi::Result<RunPromise<'env>> {
        // SAFETY: the JS thread is inside this call; nothing else touches the buffer now.
        let buffer = unsafe { events.as_mut() };
        let start = guarded(&mut lock(&self.engine), |engine| engine.run_begin(buffer, capacity as usize));
        match start {
            Ok(RunStart::Done(count)) => Ok(Either::B(PromiseRaw::resolve(env, count as u32)?)),
            Ok(RunStart::Execute(transaction)) => match &self.steps {
                Some(steps) => self.execute_on(steps, env, transaction, events, capacity),
                None => Ok(Either::A(AsyncTask::new(RunTask {
                    engine: Arc::clone(&self.engine),
                    transaction: Some(transaction),
                    events: Some(events),
                    capacity,
                }))),
            },
            Err(error) => Ok(Either::B(PromiseRaw::reject(env, coded(error))?)),
        }
    }

    /// The text of the last run's events, which their text words point into (UTF-16 units): one
    /// string per run, however many events it wrote.
    #[napi]
    pub fn run_text(&self) -> napi::Result<String, String> {
        self.call(|engine| Ok(boundary::run_text_impl(engine).to_string()))
    }

    /// The log-probability numbers of the last run's events (their logprobs words point in).
    #[napi]
    pub fn run_logprobs(&self) -> napi::Result<Float64Array, String> {
        self.call(|engine| Ok(Float64Array::new(boundary::run_logprobs_impl(engine).to_vec())))
    }

    #[napi]
    pub fn has_pending_work(&self) -> napi::Result<bool, String> {
        self.call(|engine| Ok(boundary::has_pending_work_impl(engine)))
    }

    #[napi(ts_return_type = "StatsView")]
    pub fn stats(&self) -> napi::Result<Value, String> {
        self.call(|engine| Ok(view(boundary::stats_impl(engine))))
    }

    #[napi]
    pub fn tokenize(&self, text: String) -> napi::Result<Int32Array, String> {
        self.call(|engine| boundary::tokenize_impl(engine, &text)).map(Int32Array::new)
    }

    #[napi]
    pub fn tokenize_prompt(&self, text: String) -> napi::Result<Int32Array, String> {
        self.call(|engine| boundary::tokenize_prompt_impl(engine, &text)).map(Int32Array::new)
    }

    #[napi]
    pub fn tokenize_marked(&self, marked: String) -> napi::Result<Int32Array, String> {
        self.call(|engine| boundary::tokenize_marked_impl(engine, &marked)).map(Int32Array::new)
    }

    #[napi]
    pub fn control_strings(&self) -> napi::Result<Vec<String>, String> {
        self.call(|engine| engine.control_strings())
    }

    #[napi]
    pub fn detokenize(&self, tokens: &[i32]) -> napi::Result<String, String> {
        self.call(|engine| boundary::detokenize_impl(engine, tokens))
    }

    /// Closes the engine and releases its model: the executor (KV storage, ONNX Runtime session
    /// and its threads) at once or when the step in flight returns, and the step thread after
    /// that step.
    #[napi]
    pub fn close(&self, env: Env) -> napi::Result<(), String> {
        let closed = self.call(|engine| {
            boundary::close_impl(engine);
            Ok(())
        });
        if let Some(steps) = &self.steps {
            drop(lock(&steps.thread).take());
        }
        self.release_external(&env);
        closed
    }

    /// Test hook: a broken invariant (a core assertion) comes back as an ENGINE_UNHEALTHY error.
    #[napi]
    pub fn check_invariants(&self) -> napi::Result<(), String> {
        self.call(|engine| {
            boundary::check_invariants_impl(engine);
            Ok(())
        })
    }

    /// Drops the request's tokens past `tokenCount` between turns and frees the KV blocks past them.
    #[napi]
    pub fn truncate(&self, request_id: u32, token_count: u32) -> napi::Result<(), String> {
        self.call(|engine| boundary::truncate_impl(engine, request_id, token_count))
    }

    /// `tokens[start..end]` of the request's context (clamped).
    #[napi]
    pub fn request_tokens(&self, request_id: u32, start: u32, end: u32) -> napi::Result<Int32Array, String> {
        self.call(|engine| boundary::request_tokens_impl(engine, request_id, start, end)).map(Int32Array::new)
    }

    /// A full-duplex session manager (the core's session rules) for this engine's sessions.
    #[napi]
    pub fn create_sessions(&self, options: Unknown<'_>) -> napi::Result<CoreSessions, String> {
        CoreSessions::create(options)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine() -> Engine {
        boundary::simulated_impl(boundary::SimOptionsInput { seed: Some(1.0), ..Default::default() }).unwrap()
    }

    #[test]
    fn a_panic_in_the_core_becomes_engine_unhealthy_and_sticks() {
        let mut engine = engine();
        let error = guarded(&mut engine, |_| -> ortex_core::Result<()> { panic!("boom") }).unwrap_err();
        assert_eq!(error.code, ErrorCode::EngineUnhealthy);
        assert!(error.message.contains("boom"), "{}", error.message);
        assert!(!engine.is_healthy());
        let later = guarded(&mut engine, |engine| engine.create_request(&Default::default())).unwrap_err();
        assert_eq!(later.code, ErrorCode::EngineUnhealthy);
    }

    #[test]
    fn a_transaction_that_panicked_rolls_back_and_reports_a_fatal_event() {
        let mut engine = engine();
        let request = boundary::create_request_impl(&mut engine, Default::default()).unwrap();
        boundary::begin_turn_impl(&mut engine, request, &[5, 6, 7], Default::default()).unwrap();
        let mut events = vec![0; ortex_core::EVENT_STRIDE_WORDS * 8];
        let RunStart::Execute(mut transaction) = engine.run_begin(&mut events, 8).unwrap() else {
            panic!("a queued turn plans a transaction");
        };
        transaction.fail("executor blew up".to_string());
        assert_eq!(engine.run_commit(transaction, &mut events, 8), 1);
        assert_eq!((events[0], events[1], events[5]), (8, 0, 6), "an engine-level Failed event");
        assert!(!engine.is_healthy());
        engine.check_invariants();
        let again = guarded(&mut engine, |engine| engine.run(&mut events, 8)).unwrap_err();
        assert_eq!(again.code, ErrorCode::EngineUnhealthy, "{}", again.message);
        engine.close();
    }
}
