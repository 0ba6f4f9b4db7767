//! Full-duplex sessions for a binding: ortex-core's session rules (fences, leases, appends,
//! cancel, two-phase close, expiry) plus what a binding must hold between calls: the append
//! reservations a caller holds between `prepare_append` and `commit_append` (it does its engine
//! work in between), named by small integer ids. Times arrive as JavaScript numbers of
//! milliseconds; fences and configurations as typed inputs; answers leave as views.

use std::collections::BTreeMap;

use ortex_core::session::{
    AppendPlan, AppendRequest, AppendReservation, Continuation, Fence, LeaseActivity, LeaseConfig, LeaseGeneration,
    Session, SessionManager, DEFAULT_COMPLETED_APPEND_LIMIT, DEFAULT_DISCONNECT_GRACE_MS, DEFAULT_IDLE_TTL_MS,
};
use ortex_core::{ErrorCode, OrtexError, Result};

use crate::inputs::{
    exact_u64, ConfigsInput, ContinuationInput, FenceInput, IdleTtlInput, SessionsOptionsInput, MAX_SAFE_INTEGER,
};
use crate::views::{
    AppendPlanView, AppendResultView, CancelView, CommitView, ContinuationView, ExpiryView, SessionView,
};

/// Reservations held between prepare and commit. A caller does its engine work synchronously in
/// between, so it holds one at a time; the bound turns a leak into a visible, retryable refusal.
pub const MAX_PENDING_RESERVATIONS: usize = 64;

/// The session manager of one binding object, plus the reservations its caller holds.
pub struct Sessions {
    manager: SessionManager,
    reservations: BTreeMap<u32, AppendReservation>,
    next_reservation: u32,
}

/// A clock value in milliseconds (fractions are dropped).
fn now_ms(value: f64) -> Result<u64> {
    if !value.is_finite() || !(0.0..=MAX_SAFE_INTEGER).contains(&value) {
        return Err(OrtexError::invalid(format!("nowMs must be a finite number in [0, 2^53), got {value}")));
    }
    Ok(value.floor() as u64)
}

fn fence_of(fence: Option<FenceInput>) -> Result<Option<Fence>> {
    fence.map(Fence::try_from).transpose()
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
    pub fn new(options: SessionsOptionsInput) -> Result<Sessions> {
        let idle_ttl_ms = match options.idle_ttl_ms {
            IdleTtlInput::Default => Some(DEFAULT_IDLE_TTL_MS),
            IdleTtlInput::Disabled => None,
            IdleTtlInput::Ms(ttl) => Some(exact_u64("idleTtlMs", ttl)?),
        };
        let grace_ms = options.disconnect_grace_ms.map(|g| exact_u64("disconnectGraceMs", g)).transpose()?;
        let lease = LeaseConfig::new(idle_ttl_ms, grace_ms.unwrap_or(DEFAULT_DISCONNECT_GRACE_MS))?;
        let limit = options.completed_append_limit.unwrap_or(DEFAULT_COMPLETED_APPEND_LIMIT);
        let manager = SessionManager::new(options.max_sessions, limit, lease)?;
        Ok(Sessions { manager, reservations: BTreeMap::new(), next_reservation: 1 })
    }

    fn session(&mut self, session_id: &str) -> Result<&mut Session> {
        self.manager.require_mut(session_id)
    }

    pub fn open(&mut self, session_id: &str, now: f64) -> Result<SessionView> {
        let now = now_ms(now)?;
        Ok(SessionView::from(&*self.manager.open(session_id, now, None)?))
    }

    /// Opens a session stored by another process at its incarnation and lease generation, its
    /// rules carrying on from `continuation` (what `continuation()` gave the old owner).
    pub fn restore(
        &mut self,
        session_id: &str,
        now: f64,
        incarnation: f64,
        lease_generation: f64,
        continuation: Option<ContinuationInput>,
    ) -> Result<SessionView> {
        let now = now_ms(now)?;
        let incarnation = exact_u64("incarnation", incarnation)?;
        let generation = LeaseGeneration(exact_u64("leaseGeneration", lease_generation)?);
        let continuation = continuation.map(Continuation::try_from).transpose()?;
        let session = self.manager.restore(session_id, incarnation, generation, now, continuation.as_ref())?;
        Ok(SessionView::from(&*session))
    }

    /// What a session store keeps of the session's rules, for a new owner's `restore`.
    pub fn continuation(&mut self, session_id: &str) -> Result<ContinuationView> {
        Ok(ContinuationView::from(&self.session(session_id)?.continuation()))
    }

    pub fn get(&mut self, session_id: &str) -> Result<SessionView> {
        Ok(SessionView::from(&*self.session(session_id)?))
    }

    /// Records the engine request the session owns, under its current fence.
    pub fn bind_request(&mut self, session_id: &str, request_id: u32) -> Result<()> {
        let session = self.session(session_id)?;
        let fence = session.fence().clone();
        session.bind_request(request_id, &fence)
    }

    /// Plans an append and changes nothing: a replay of an append already applied (reservation
    /// 0), or a reservation to commit or discard once the engine work is done.
    pub fn prepare_append(
        &mut self,
        session_id: &str,
        is_final: bool,
        operation_id: Option<String>,
        input_digest: f64,
        fence: Option<FenceInput>,
    ) -> Result<AppendPlanView> {
        let request = AppendRequest {
            fence: fence_of(fence)?,
            is_final,
            operation_id,
            input_digest: exact_u64("inputDigest", input_digest)?,
        };
        if self.reservations.len() >= MAX_PENDING_RESERVATIONS {
            return Err(OrtexError::new(ErrorCode::CapacityExhausted, "too many append reservations are held"));
        }
        match self.session(session_id)?.prepare_append(&request)? {
            AppendPlan::Replay(result) => Ok(AppendPlanView { reservation: 0, result: (&result).into() }),
            AppendPlan::Reserved(reservation) => {
                let id = self.next_reservation;
                self.next_reservation = self.next_reservation.checked_add(1).unwrap_or(1);
                let result = AppendResultView::from(&reservation.result());
                self.reservations.insert(id, reservation);
                Ok(AppendPlanView { reservation: id, result })
            }
        }
    }

    /// Publishes a reservation (STALE_RESERVATION when its base moved); it is spent either way.
    pub fn commit_append(&mut self, reservation_id: u32, now: f64) -> Result<CommitView> {
        let now = now_ms(now)?;
        let reservation = self
            .reservations
            .remove(&reservation_id)
            .ok_or_else(|| OrtexError::new(ErrorCode::StaleReservation, "unknown or spent append reservation"))?;
        let session_id = reservation.fence().session_id.clone();
        let session = self.session(&session_id)?;
        let result = session.commit_append(reservation, now)?;
        Ok(CommitView { result: (&result).into(), session: SessionView::from(&*session) })
    }

    /// Drops a reservation whose engine work failed. Unknown ids are ignored.
    pub fn discard_reservation(&mut self, reservation_id: u32) {
        self.reservations.remove(&reservation_id);
    }

    /// Starts a response: advances responseSeq.
    pub fn start_response(&mut self, session_id: &str, now: f64) -> Result<SessionView> {
        let now = now_ms(now)?;
        let session = self.session(session_id)?;
        session.start_response(now)?;
        Ok(SessionView::from(&*session))
    }

    /// api.md's cancel: `cancelled` is a fence, or None for the current one.
    pub fn cancel(&mut self, session_id: &str, cancelled: Option<FenceInput>, now: f64) -> Result<CancelView> {
        let now = now_ms(now)?;
        let cancelled = fence_of(cancelled)?;
        let session = self.session(session_id)?;
        let outcome = session.cancel(cancelled.as_ref(), now)?;
        Ok(CancelView::new(&outcome, session))
    }

    /// Refuses a fence that is stale for the session (`_validate_fence` in vllm-omni's
    /// `duplex_session.py`).
    pub fn validate_fence(&mut self, session_id: &str, fence: FenceInput) -> Result<()> {
        let fence = Fence::try_from(fence)?;
        self.session(session_id)?.validate_fence(&fence)
    }

    pub fn touch(&mut self, session_id: &str, now: f64, activity_name: &str) -> Result<()> {
        let now = now_ms(now)?;
        let activity = activity(activity_name)?;
        self.session(session_id)?.touch(now, activity)
    }

    pub fn detach(&mut self, session_id: &str, now: f64) -> Result<SessionView> {
        let now = now_ms(now)?;
        let session = self.session(session_id)?;
        session.detach(now)?;
        Ok(SessionView::from(&*session))
    }

    /// Compare-and-swap on the lease generation; the view has the new generation.
    pub fn resume(&mut self, session_id: &str, now: f64, expected_generation: f64) -> Result<SessionView> {
        let now = now_ms(now)?;
        let expected = exact_u64("expectedLeaseGeneration", expected_generation)?;
        let session = self.session(session_id)?;
        session.resume(now, LeaseGeneration(expected))?;
        Ok(SessionView::from(&*session))
    }

    pub fn begin_operation(&mut self, session_id: &str, now: f64, operation_id: &str) -> Result<()> {
        let now = now_ms(now)?;
        self.session(session_id)?.begin_operation(now, operation_id)
    }

    pub fn end_operation(&mut self, session_id: &str, now: f64, operation_id: &str) -> Result<()> {
        let now = now_ms(now)?;
        self.session(session_id)?.end_operation(now, operation_id)
    }

    /// Publishes both configurations as one generation; returns the generation in effect.
    pub fn replace_configs(&mut self, session_id: &str, configs: ConfigsInput) -> Result<f64> {
        let generation = self.session(session_id)?.replace_configs(configs.session, configs.runtime)?;
        Ok(generation as f64)
    }

    /// The first phase of close; a stale `fence` is refused. Returns whether this call began it.
    pub fn begin_close(&mut self, session_id: &str, fence: Option<FenceInput>, reason: &str) -> Result<bool> {
        let fence = fence_of(fence)?;
        self.manager.begin_close(session_id, fence.as_ref(), reason)
    }

    /// The second phase: frees the slot. Returns the request ids still bound, for release.
    pub fn finalize_close(&mut self, session_id: &str) -> Result<Vec<u32>> {
        self.manager.finalize_close(session_id)
    }

    /// Begins the close of every expired session.
    pub fn collect_expired(&mut self, now: f64) -> Result<Vec<ExpiryView>> {
        let now = now_ms(now)?;
        Ok(self.manager.collect_expired(now).iter().map(ExpiryView::from).collect())
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
    use super::*;

    fn sessions(json: &str) -> Result<Sessions> {
        Sessions::new(crate::from_json("session manager options", json)?)
    }

    fn fence(view: &SessionView) -> FenceInput {
        let f = &view.fence;
        FenceInput {
            session_id: f.session_id.clone(),
            incarnation: f.incarnation,
            epoch: f.epoch,
            turn_id: f.turn_id,
            response_seq: f.response_seq,
        }
    }

    #[test]
    fn sessions_options_default_and_validate() {
        assert!(sessions("{}").is_ok());
        assert!(sessions(r#"{"idleTtlMs":null,"maxSessions":null}"#).is_ok());
        for bad in [r#"{"maxSessions":0}"#, r#"{"idleTtlMs":0}"#, r#"{"disconnectGraceMs":0}"#, r#"{"x":1}"#, "nope"] {
            assert_eq!(sessions(bad).err().unwrap().code, ErrorCode::InvalidArgument, "{bad}");
        }
    }

    #[test]
    fn append_prepare_commit_replay_and_stale_reservations() {
        let mut sessions = sessions(r#"{"maxSessions":1}"#).unwrap();
        let view = sessions.open("s", 10.0).unwrap();
        assert_eq!((view.fence.epoch, view.state), (0.0, "open"));
        assert_eq!(sessions.open("t", 10.0).unwrap_err().code, ErrorCode::CapacityExhausted);
        let planned = sessions.prepare_append("s", true, Some("op".into()), 7.0, None).unwrap();
        let committed = sessions.commit_append(planned.reservation, 11.0).unwrap();
        assert_eq!(committed.result.seq, 1.0);
        assert_eq!(committed.session.fence.turn_id, 1.0, "a final append ends the user turn");
        assert_eq!(sessions.commit_append(planned.reservation, 11.0).unwrap_err().code, ErrorCode::StaleReservation);
        let replay = sessions.prepare_append("s", true, Some("op".into()), 7.0, None).unwrap();
        assert!(replay.reservation == 0 && replay.result.replayed);
        let reused = sessions.prepare_append("s", true, Some("op".into()), 8.0, None);
        assert_eq!(reused.unwrap_err().code, ErrorCode::OperationReused);
        assert_eq!(sessions.commit_append(0, f64::NAN).unwrap_err().code, ErrorCode::InvalidArgument);
        sessions.check_invariants();
    }

    #[test]
    fn a_continuation_goes_through_json_to_a_restore_elsewhere() {
        let mut old = sessions("{}").unwrap();
        old.open("s", 0.0).unwrap();
        let planned = old.prepare_append("s", true, Some("op".into()), 7.0, None).unwrap();
        let first = old.commit_append(planned.reservation, 1.0).unwrap().result;
        old.start_response("s", 1.0).unwrap();
        let stored = serde_json::to_string(&old.continuation("s").unwrap()).unwrap();

        let mut new = sessions("{}").unwrap();
        let input: ContinuationInput = crate::from_json("continuation", &stored).unwrap();
        let view = new.restore("s", 2.0, 1.0, 1.0, Some(input)).unwrap();
        assert_eq!(
            (view.fence.incarnation, view.fence.turn_id, view.fence.response_seq, view.seq),
            (1.0, 1.0, 1.0, 1.0)
        );
        let replay = new.prepare_append("s", true, Some("op".into()), 7.0, None).unwrap();
        assert_eq!((replay.reservation, replay.result.seq, replay.result.replayed), (0, first.seq, true));
        let tampered = stored.replace(r#""seq":1"#, r#""seq":-1"#);
        let input: ContinuationInput = crate::from_json("continuation", &tampered).unwrap();
        assert_eq!(new.restore("t", 2.0, 1.0, 1.0, Some(input)).unwrap_err().code, ErrorCode::InvalidArgument);
        new.check_invariants();
    }

    #[test]
    fn cancel_close_and_expiry() {
        let mut sessions = sessions(r#"{"idleTtlMs":100,"disconnectGraceMs":10}"#).unwrap();
        sessions.open("s", 0.0).unwrap();
        sessions.bind_request("s", 4).unwrap();
        let before = fence(&sessions.get("s").unwrap());
        let outcome = sessions.cancel("s", None, 1.0).unwrap();
        assert!(outcome.advanced);
        assert_eq!(outcome.fence.epoch, 1.0);
        assert_eq!(sessions.validate_fence("s", before.clone()).unwrap_err().code, ErrorCode::FenceMismatch);
        assert!(!sessions.cancel("s", Some(before), 2.0).unwrap().advanced);
        sessions.detach("s", 3.0).unwrap();
        assert_eq!(sessions.resume("s", 4.0, 5.0).unwrap_err().code, ErrorCode::LeaseGenerationMismatch);
        assert_eq!(sessions.resume("s", 4.0, 0.0).unwrap().lease_generation, 1.0);
        sessions.detach("s", 5.0).unwrap();
        let expired = sessions.collect_expired(15.0).unwrap();
        assert_eq!(
            (expired[0].reason, expired[0].submitted_request_ids.clone()),
            ("disconnect_grace_expired", vec![4])
        );
        assert_eq!(sessions.num_sessions(), 1, "the slot is held until the close is final");
        assert_eq!(sessions.finalize_close("s").unwrap(), vec![4]);
        assert_eq!(sessions.num_sessions(), 0);
        assert_eq!(sessions.open("s", 20.0).unwrap().fence.incarnation, 1.0, "a reused id is a new incarnation");
        sessions.check_invariants();
    }
}
