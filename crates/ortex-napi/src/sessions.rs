//! `CoreSessions`: the binding of ortex-core's full-duplex session rules (`boundary::Sessions`),
//! which `CoreEngine.createSessions` makes. It owns the session manager and whether a panic broke
//! it; every method only converts.

use std::panic::{catch_unwind, AssertUnwindSafe};

use napi::bindgen_prelude::*;
use napi_derive::napi;
use ortex_boundary as boundary;
use ortex_core::{ErrorCode, OrtexError};
use serde_json::Value;

use crate::{coded, input, view};

fn sessions_panic(message: &str) -> OrtexError {
    OrtexError::new(ErrorCode::EngineUnhealthy, format!("the session manager panicked and is unusable: {message}"))
}

/// ortex-core's full-duplex session rules (fences, leases, appends, cancel, two-phase close,
/// expiry). Objects in and out; every method lives in `boundary::Sessions`. A panic (a broken session
/// invariant) becomes an ENGINE_UNHEALTHY error, and every later call is refused the same way.
#[napi]
pub struct CoreSessions {
    sessions: boundary::Sessions,
    broken: Option<String>,
}

impl CoreSessions {
    /// A session manager for `options` (CoreEngine.createSessions).
    pub(crate) fn create(options: Unknown<'_>) -> napi::Result<CoreSessions, String> {
        let sessions = catch_unwind(|| boundary::Sessions::new(input("session manager options", options)?))
            .unwrap_or_else(|payload| Err(sessions_panic(&boundary::panic_message(payload.as_ref()))))
            .map_err(coded)?;
        Ok(CoreSessions { sessions, broken: None })
    }

    fn call<T>(
        &mut self,
        call: impl FnOnce(&mut boundary::Sessions) -> ortex_core::Result<T>,
    ) -> napi::Result<T, String> {
        if let Some(message) = &self.broken {
            return Err(coded(sessions_panic(message)));
        }
        match catch_unwind(AssertUnwindSafe(|| call(&mut self.sessions))) {
            Ok(result) => result.map_err(coded),
            Err(payload) => {
                let message = boundary::panic_message(payload.as_ref());
                self.broken = Some(message.clone());
                Err(coded(sessions_panic(&message)))
            }
        }
    }
}

#[napi]
impl CoreSessions {
    #[napi(ts_return_type = "SessionView")]
    pub fn open(&mut self, session_id: String, now_ms: f64) -> napi::Result<Value, String> {
        self.call(|sessions| sessions.open(&session_id, now_ms).map(view))
    }

    #[napi(ts_return_type = "SessionView")]
    pub fn restore(
        &mut self,
        session_id: String,
        now_ms: f64,
        incarnation: f64,
        lease_generation: f64,
        continuation: Option<Unknown<'_>>,
    ) -> napi::Result<Value, String> {
        self.call(|sessions| {
            let continuation = continuation.map(|c| input("continuation", c)).transpose()?;
            sessions.restore(&session_id, now_ms, incarnation, lease_generation, continuation).map(view)
        })
    }

    #[napi(ts_return_type = "ContinuationView")]
    pub fn continuation(&mut self, session_id: String) -> napi::Result<Value, String> {
        self.call(|sessions| sessions.continuation(&session_id).map(view))
    }

    #[napi(ts_return_type = "SessionView")]
    pub fn get(&mut self, session_id: String) -> napi::Result<Value, String> {
        self.call(|sessions| sessions.get(&session_id).map(view))
    }

    #[napi]
    pub fn bind_request(&mut self, session_id: String, request_id: u32) -> napi::Result<(), String> {
        self.call(|sessions| sessions.bind_request(&session_id, request_id))
    }

    #[napi(ts_return_type = "AppendPlanView")]
    pub fn prepare_append(
        &mut self,
        session_id: String,
        is_final: bool,
        operation_id: Option<String>,
        input_digest: f64,
        fence: Option<Unknown<'_>>,
    ) -> napi::Result<Value, String> {
        self.call(|sessions| {
            let fence = fence.map(|f| input("fence", f)).transpose()?;
            sessions.prepare_append(&session_id, is_final, operation_id, input_digest, fence).map(view)
        })
    }

    #[napi(ts_return_type = "CommitView")]
    pub fn commit_append(&mut self, reservation_id: u32, now_ms: f64) -> napi::Result<Value, String> {
        self.call(|sessions| sessions.commit_append(reservation_id, now_ms).map(view))
    }

    #[napi]
    pub fn discard_reservation(&mut self, reservation_id: u32) -> napi::Result<(), String> {
        self.call(|sessions| {
            sessions.discard_reservation(reservation_id);
            Ok(())
        })
    }

    #[napi(ts_return_type = "SessionView")]
    pub fn start_response(&mut self, session_id: String, now_ms: f64) -> napi::Result<Value, String> {
        self.call(|sessions| sessions.start_response(&session_id, now_ms).map(view))
    }

    #[napi(ts_return_type = "CancelView")]
    pub fn cancel(
        &mut self,
        session_id: String,
        cancelled: Option<Unknown<'_>>,
        now_ms: f64,
    ) -> napi::Result<Value, String> {
        self.call(|sessions| {
            let cancelled = cancelled.map(|f| input("cancelled fence", f)).transpose()?;
            sessions.cancel(&session_id, cancelled, now_ms).map(view)
        })
    }

    #[napi]
    pub fn validate_fence(&mut self, session_id: String, fence: Unknown<'_>) -> napi::Result<(), String> {
        self.call(|sessions| sessions.validate_fence(&session_id, input("fence", fence)?))
    }

    #[napi]
    pub fn touch(&mut self, session_id: String, now_ms: f64, activity: String) -> napi::Result<(), String> {
        self.call(|sessions| sessions.touch(&session_id, now_ms, &activity))
    }

    #[napi(ts_return_type = "SessionView")]
    pub fn detach(&mut self, session_id: String, now_ms: f64) -> napi::Result<Value, String> {
        self.call(|sessions| sessions.detach(&session_id, now_ms).map(view))
    }

    #[napi(ts_return_type = "SessionView")]
    pub fn resume(&mut self, session_id: String, now_ms: f64, expected_generation: f64) -> napi::Result<Value, String> {
        self.call(|sessions| sessions.resume(&session_id, now_ms, expected_generation).map(view))
    }

    #[napi]
    pub fn begin_operation(
        &mut self,
        session_id: String,
        now_ms: f64,
        operation_id: String,
    ) -> napi::Result<(), String> {
        self.call(|sessions| sessions.begin_operation(&session_id, now_ms, &operation_id))
    }

    #[napi]
    pub fn end_operation(&mut self, session_id: String, now_ms: f64, operation_id: String) -> napi::Result<(), String> {
        self.call(|sessions| sessions.end_operation(&session_id, now_ms, &operation_id))
    }

    #[napi]
    pub fn replace_configs(&mut self, session_id: String, configs: Unknown<'_>) -> napi::Result<f64, String> {
        self.call(|sessions| sessions.replace_configs(&session_id, input("session configs", configs)?))
    }

    #[napi]
    pub fn begin_close(
        &mut self,
        session_id: String,
        fence: Option<Unknown<'_>>,
        reason: String,
    ) -> napi::Result<bool, String> {
        self.call(|sessions| {
            let fence = fence.map(|f| input("fence", f)).transpose()?;
            sessions.begin_close(&session_id, fence, &reason)
        })
    }

    #[napi]
    pub fn finalize_close(&mut self, session_id: String) -> napi::Result<Vec<u32>, String> {
        self.call(|sessions| sessions.finalize_close(&session_id))
    }

    #[napi(ts_return_type = "ExpiryView[]")]
    pub fn collect_expired(&mut self, now_ms: f64) -> napi::Result<Value, String> {
        self.call(|sessions| sessions.collect_expired(now_ms).map(view))
    }

    #[napi]
    pub fn num_sessions(&mut self) -> napi::Result<u32, String> {
        self.call(|sessions| Ok(sessions.num_sessions()))
    }

    /// Test hook: a broken invariant comes back as an ENGINE_UNHEALTHY error.
    #[napi]
    pub fn check_invariants(&mut self) -> napi::Result<(), String> {
        self.call(|sessions| {
            sessions.check_invariants();
            Ok(())
        })
    }
}
