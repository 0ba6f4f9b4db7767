//! One full-duplex session: its fence, lease, append counters, engine request bindings,
//! configuration and close phase (vllm-omni's `DuplexSessionRuntimeState`, in
//! `vllm_omni/experimental/fullduplex/engine/duplex_session.py`).
//!
//! ```text
//!   Open ---- begin_close(reason) ----> Closing ---- finalize_close() ----> Closed
//!   (appends, responses, cancels)       (irreversible; bindings kept       (bindings handed
//!                                        until the engine released them)    back, slot freed)
//! ```
//!
//! Every mutating method either applies completely or returns an error and changes nothing, so a
//! refused command can be retried or reported without repairing the session first.

use std::collections::BTreeSet;

use super::append::{
    AppendCounters, AppendPlan, AppendRequest, AppendReservation, AppendResult, CompletedAppendCache,
    CompletedAppendRecord,
};
use super::bindings::{RequestBindings, RequestResource};
use super::config::{ConfigMap, SessionConfigs};
use super::fence::{fence_mismatch, require_current, require_same_epoch, validate_fence, Fence, FenceKey};
use super::lease::{validate_operation_id, Lease, LeaseActivity, LeaseGeneration};
use crate::error::{ErrorCode, OrtexError, Result};

/// The session's externally visible state (api.md's `session.state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SessionState {
    Open,
    Detached,
    Closing,
    Closed,
}

impl SessionState {
    pub const fn as_str(self) -> &'static str {
        match self {
            SessionState::Open => "open",
            SessionState::Detached => "detached",
            SessionState::Closing => "closing",
            SessionState::Closed => "closed",
        }
    }
}

/// What a cancel did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CancelOutcome {
    /// The fence whose response was cancelled.
    pub cancelled: Fence,
    /// The session's fence after the cancel.
    pub fence: Fence,
    /// Whether the session moved to a newer fence; false for a retried cancel of an old fence.
    pub advanced: bool,
    /// Requests bound under the cancelled fence, for the caller to release.
    pub request_ids: Vec<u32>,
}

/// What a new owner needs to continue a session's rules where its old owner left them, which a
/// session store keeps beside the conversation: the fence's position (the new owner's incarnation
/// is its own), the append counters, and the completed appends of the current epoch, oldest first,
/// so that a retry reaching the new owner is still answered from the cache.
///
/// ```text
///   old owner: {inc 2, epoch 1, turn 4, resp 5}  seq 9  cache [a7, a8, a9]
///        continuation() ──▶ store ──▶ restore(.., incarnation 3, Some(&continuation))
///   new owner: {inc 3, epoch 1, turn 4, resp 5}  seq 9  cache [a7, a8, a9] (their fences: inc 2)
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Continuation {
    pub position: FenceKey,
    pub counters: AppendCounters,
    pub completed_appends: Vec<CompletedAppendRecord>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ClosePhase {
    Open,
    Closing,
    Closed,
}

/// One full-duplex session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    fence: Fence,
    lease: Lease,
    phase: ClosePhase,
    counters: AppendCounters,
    completed_appends: CompletedAppendCache,
    configs: SessionConfigs,
    bindings: RequestBindings,
}

impl Session {
    /// A new open session at `fence` with the given lease, remembering up to
    /// `completed_append_limit` completed appends (which must be positive).
    pub fn new(fence: Fence, lease: Lease, completed_append_limit: u32) -> Result<Session> {
        if fence.session_id.is_empty() {
            return Err(OrtexError::invalid("sessionId must not be empty"));
        }
        if lease.is_terminal() {
            return Err(OrtexError::invalid("a session cannot start with an ended lease"));
        }
        Ok(Session {
            fence,
            lease,
            phase: ClosePhase::Open,
            counters: AppendCounters::default(),
            completed_appends: CompletedAppendCache::new(completed_append_limit)?,
            configs: SessionConfigs::default(),
            bindings: RequestBindings::default(),
        })
    }

    // ---- reading -------------------------------------------------------------------------

    pub fn id(&self) -> &str {
        &self.fence.session_id
    }

    pub fn fence(&self) -> &Fence {
        &self.fence
    }

    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    pub fn lease_generation(&self) -> LeaseGeneration {
        self.lease.generation()
    }

    pub fn state(&self) -> SessionState {
        match self.phase {
            ClosePhase::Closed => SessionState::Closed,
            ClosePhase::Closing => SessionState::Closing,
            ClosePhase::Open if self.lease.is_detached() => SessionState::Detached,
            ClosePhase::Open => SessionState::Open,
        }
    }

    /// Whether `begin_close` has happened (the session is closing or closed).
    pub fn is_closing_or_closed(&self) -> bool {
        self.phase != ClosePhase::Open
    }

    /// The reason given to the one `begin_close` that took effect.
    pub fn close_reason(&self) -> Option<&str> {
        self.lease.terminal_reason()
    }

    pub fn counters(&self) -> AppendCounters {
        self.counters
    }

    pub fn num_completed_appends(&self) -> usize {
        self.completed_appends.len()
    }

    /// What a new owner continues from (see `Continuation`).
    pub fn continuation(&self) -> Continuation {
        Continuation {
            position: self.fence.key(),
            counters: self.counters,
            completed_appends: self.completed_appends.records(),
        }
    }

    /// Takes up `continuation` in a session just opened for it (a restore): its fence moves to the
    /// stored position, its counters and cache to the stored ones. A continuation that breaks the
    /// rules the old owner kept (it came from outside: a store) is INVALID_ARGUMENT, and the
    /// session is left as it was. Of more appends than this session remembers, the latest are kept.
    pub(super) fn continue_from(&mut self, continuation: &Continuation) -> Result<()> {
        let Continuation { position, counters, completed_appends } = continuation;
        let fence = Fence {
            session_id: self.fence.session_id.clone(),
            incarnation: self.fence.incarnation,
            epoch: position.epoch,
            turn_id: position.turn_id,
            response_seq: position.response_seq,
        };
        check_stored_counters(counters, &fence)?;
        let mut cache = CompletedAppendCache::new(self.completed_appends.limit() as u32)?;
        let mut seen = BTreeSet::new();
        let kept = completed_appends.len().saturating_sub(cache.limit());
        for record in &completed_appends[kept..] {
            check_stored_append(record, &fence, counters)?;
            if !seen.insert(record.operation_id.as_str()) {
                return Err(invalid_continuation(format!("operation {:?} is remembered twice", record.operation_id)));
            }
            cache.record(record.operation_id.clone(), record.metadata.clone(), record.result);
        }
        self.fence = fence;
        self.counters = *counters;
        self.completed_appends = cache;
        Ok(())
    }

    pub fn config_generation(&self) -> u64 {
        self.configs.generation()
    }

    pub fn session_config(&self) -> &ConfigMap {
        self.configs.session()
    }

    pub fn runtime_config(&self) -> &ConfigMap {
        self.configs.runtime()
    }

    /// The bound requests in request id order.
    pub fn resources(&self) -> impl Iterator<Item = &RequestResource> {
        self.bindings.iter()
    }

    /// Request ids bound under exactly `fence` (all when `None`) with the given submitted flag
    /// (either when `None`), in ascending order.
    pub fn request_ids(&self, fence: Option<&Fence>, submitted: Option<bool>) -> Vec<u32> {
        self.bindings.request_ids(fence, submitted)
    }

    // ---- fences ------------------------------------------------------------------------------

    /// vllm-omni's `_validate_fence` against the current fence.
    pub fn validate_fence(&self, fence: &Fence) -> Result<()> {
        validate_fence(&self.fence, fence)
    }

    /// Moves the session to `fence` after validating it. An epoch change starts a new user turn
    /// (turn_seq restarts) and clears the completed-append cache, because nothing of an older
    /// epoch may be replayed into a newer one; `seq` keeps counting the session's appends (api.md:
    /// "seq counts appends per session", where vllm-omni's `duplex_session.py` restarts it per
    /// epoch).
    pub fn accept_fence(&mut self, fence: Fence) -> Result<()> {
        self.require_accepting()?;
        validate_fence(&self.fence, &fence)?;
        if fence.epoch != self.fence.epoch {
            self.counters = self.counters.after_epoch_change();
            self.completed_appends.clear();
        }
        self.fence = fence;
        Ok(())
    }

    // ---- lease ---------------------------------------------------------------------------------

    /// Records client or engine activity that keeps the session alive.
    pub fn touch(&mut self, now_ms: u64, activity: LeaseActivity) -> Result<()> {
        self.lease.touch(now_ms, activity)
    }

    /// The client went away; the session waits for a resume until the disconnect grace ends.
    pub fn detach(&mut self, now_ms: u64) -> Result<()> {
        self.lease.detach(now_ms)
    }

    /// A client comes back; it must name the current lease generation (compare-and-swap).
    pub fn resume(&mut self, now_ms: u64, expected: LeaseGeneration) -> Result<LeaseGeneration> {
        self.lease.resume(now_ms, expected)
    }

    pub fn begin_operation(&mut self, now_ms: u64, operation_id: &str) -> Result<()> {
        self.lease.begin_operation(now_ms, operation_id)
    }

    pub fn end_operation(&mut self, now_ms: u64, operation_id: &str) -> Result<()> {
        self.lease.end_operation(now_ms, operation_id)
    }

    // ---- configuration -------------------------------------------------------------------------

    /// Publishes new configurations as one generation: a reader never sees a new session
    /// configuration paired with an old runtime one. With neither given nothing changes. Returns
    /// the generation in effect afterwards.
    pub fn replace_configs(
        &mut self,
        session_config: Option<ConfigMap>,
        runtime_config: Option<ConfigMap>,
    ) -> Result<u64> {
        self.require_accepting()?;
        self.configs.replace(session_config, runtime_config)
    }

    // ---- engine request bindings ---------------------------------------------------------------

    /// Reserves `request_id` for this session under the current `fence`, before it is submitted.
    /// Reserving the same id again in the same epoch is a no-op, so a retried reservation is safe.
    pub fn reserve_request(&mut self, request_id: u32, fence: &Fence) -> Result<()> {
        self.require_accepting()?;
        require_current(&self.fence, fence)?;
        self.bindings.reserve(request_id, fence)
    }

    /// Records that `request_id` was submitted to the engine under the current `fence`.
    pub fn bind_request(&mut self, request_id: u32, fence: &Fence) -> Result<()> {
        self.reserve_request(request_id, fence)?;
        self.bindings.mark_submitted(request_id, fence);
        Ok(())
    }

    /// Forgets the given requests once the engine has released them. Unknown ids are ignored, so
    /// a release retried after a partial failure is safe.
    pub fn release_request_ids(&mut self, request_ids: &[u32]) {
        self.bindings.release(request_ids);
    }

    /// Forgets and returns the requests bound under exactly `fence`.
    pub fn release_fence(&mut self, fence: &Fence) -> Vec<u32> {
        let released = self.request_ids(Some(fence), None);
        self.release_request_ids(&released);
        released
    }

    // ---- appends -------------------------------------------------------------------------------

    /// Plans an append without changing anything (see the `append` module for the protocol).
    ///
    /// A replay is looked up before the fence is checked against the present, unlike in vllm-omni's
    /// `duplex_session.py`: in ortex the final append itself advances the turn id, so the retry of
    /// a final append carries a fence that is no longer current, and it must still be answered
    /// from the cache. A fence from another incarnation or epoch is refused before the lookup
    /// (the cache never holds appends of another epoch), except the exact fence an operation was
    /// recorded under: after a move, the retry of an append the old owner applied carries the old
    /// owner's incarnation.
    pub fn prepare_append(&self, request: &AppendRequest) -> Result<AppendPlan> {
        self.require_accepting()?;
        if let Some(fence) = &request.fence {
            let recorded =
                request.operation_id.as_deref().is_some_and(|id| self.completed_appends.recorded_under(id, fence));
            if !recorded {
                require_same_epoch(&self.fence, fence)?;
            }
        }
        if let Some(operation_id) = &request.operation_id {
            validate_operation_id(operation_id)?;
            if let Some(replay) = self.completed_appends.lookup(operation_id, request)? {
                return Ok(AppendPlan::Replay(replay));
            }
        }
        if let Some(fence) = &request.fence {
            require_current(&self.fence, fence)?;
        }
        if request.is_final {
            self.fence.with_next_turn()?;
        }
        Ok(AppendPlan::Reserved(self.reserve_append(request)?))
    }

    fn reserve_append(&self, request: &AppendRequest) -> Result<AppendReservation> {
        let counters = self.counters.after_append(&self.fence)?;
        let result = AppendResult {
            seq: counters.seq,
            turn_seq: counters.turn_seq,
            turn_id: self.fence.turn_id,
            is_final: request.is_final,
            replayed: false,
        };
        Ok(AppendReservation {
            base_fence: self.fence.clone(),
            base_counters: self.counters,
            counters,
            operation_id: request.operation_id.clone(),
            input_digest: request.input_digest,
            result,
        })
    }

    /// Publishes a reservation made by `prepare_append`. A reservation whose base (the fence or
    /// the counters) has changed since it was made is refused with STALE_RESERVATION, because
    /// the numbers it would publish were computed from a state that no longer exists.
    pub fn commit_append(&mut self, reservation: AppendReservation, now_ms: u64) -> Result<AppendResult> {
        self.require_accepting()?;
        if self.fence != reservation.base_fence || self.counters != reservation.base_counters {
            return Err(OrtexError::new(ErrorCode::StaleReservation, "append reservation is stale"));
        }
        let next_fence = if reservation.result.is_final { Some(self.fence.with_next_turn()?) } else { None };
        self.lease.touch(now_ms, LeaseActivity::Append)?;
        self.counters = reservation.counters;
        if let Some(operation_id) = &reservation.operation_id {
            self.completed_appends.record(operation_id.clone(), reservation.metadata(), reservation.result);
        }
        if let Some(fence) = next_fence {
            self.fence = fence;
        }
        Ok(reservation.result)
    }

    /// Prepares and commits in one call. A replay consumes no sequence number but still counts as
    /// activity: a client that retries is alive.
    pub fn append(&mut self, request: &AppendRequest, now_ms: u64) -> Result<AppendResult> {
        match self.prepare_append(request)? {
            AppendPlan::Replay(result) => {
                self.lease.touch(now_ms, LeaseActivity::Append)?;
                Ok(result)
            }
            AppendPlan::Reserved(reservation) => self.commit_append(reservation, now_ms),
        }
    }

    // ---- responses and cancellation ------------------------------------------------------------

    /// Starts a response: advances `response_seq` and returns the fence the response runs under.
    pub fn start_response(&mut self, now_ms: u64) -> Result<Fence> {
        self.require_accepting()?;
        let fence = self.fence.with_next_response()?;
        self.lease.touch(now_ms, LeaseActivity::Respond)?;
        self.fence = fence;
        Ok(self.fence.clone())
    }

    /// vllm-omni's `prepare_cancel_fence`: moves the session past `cancelled` to `next` and returns
    /// the requests bound under `cancelled`, which stay bound until `release_fence` or
    /// `release_request_ids` confirms their release (so a failed release can be retried).
    ///
    /// `next` must be in a later epoch than `cancelled`; `cancelled` may not be newer than the
    /// session; the session advances only when `next` is newer than it. A retried cancel of an
    /// old fence therefore reports that fence's requests again but never moves a session that
    /// has already passed `next`.
    pub fn prepare_cancel_fence(&mut self, cancelled: &Fence, next: &Fence, now_ms: u64) -> Result<CancelOutcome> {
        self.require_accepting()?;
        if !cancelled.same_identity(&self.fence) {
            return Err(fence_mismatch(&self.fence, cancelled));
        }
        if !next.same_identity(&self.fence) || next.epoch <= cancelled.epoch {
            return Err(fence_mismatch(cancelled, next));
        }
        if cancelled.key() > self.fence.key() {
            return Err(fence_mismatch(&self.fence, cancelled));
        }
        let advanced = next.key() > self.fence.key();
        if advanced {
            validate_fence(&self.fence, next)?;
        }
        self.lease.touch(now_ms, LeaseActivity::Cancel)?;
        if advanced {
            self.accept_fence(next.clone())?;
        }
        Ok(CancelOutcome {
            cancelled: cancelled.clone(),
            fence: self.fence.clone(),
            advanced,
            request_ids: self.request_ids(Some(cancelled), None),
        })
    }

    /// vllm-omni's `cancel_fence`: `prepare_cancel_fence`, then forgets the cancelled fence's
    /// requests at once, for callers whose release cannot fail.
    pub fn cancel_fence(&mut self, cancelled: &Fence, next: &Fence, now_ms: u64) -> Result<CancelOutcome> {
        let outcome = self.prepare_cancel_fence(cancelled, next, now_ms)?;
        let released = self.release_fence(cancelled);
        assert_eq!(released, outcome.request_ids, "cancel releases exactly what it reported");
        Ok(outcome)
    }

    /// api.md's `session.cancel(cancelled?)`: cancels `cancelled` (the current fence when `None`)
    /// and moves to the epoch after it. For an old fence, the epoch after it is at or below the
    /// session's, so the call only reports that fence's requests for cleanup.
    pub fn cancel(&mut self, cancelled: Option<&Fence>, now_ms: u64) -> Result<CancelOutcome> {
        let cancelled = cancelled.unwrap_or(&self.fence).clone();
        let next = cancelled.next_epoch()?;
        self.prepare_cancel_fence(&cancelled, &next, now_ms)
    }

    // ---- close ---------------------------------------------------------------------------------

    /// Makes the close irreversible. Returns true only for the call that made the transition,
    /// so that exactly one caller reports the end of the session. Bindings are kept until
    /// `finalize_close`, so that a release that fails can be retried.
    pub fn begin_close(&mut self, reason: &str) -> bool {
        if self.phase != ClosePhase::Open {
            return false;
        }
        let marked = self.lease.mark_terminal(reason);
        assert!(marked, "an open session's lease has not ended");
        self.transition_to_closing();
        true
    }

    /// Completes a begun close and hands back every request still bound, for release.
    pub fn finalize_close(&mut self) -> Result<Vec<u32>> {
        match self.phase {
            ClosePhase::Open => Err(OrtexError::invalid(format!("session {:?} has not begun closing", self.id()))),
            ClosePhase::Closed => Err(self.closed_error()),
            ClosePhase::Closing => {
                let request_ids = self.bindings.release_all();
                self.completed_appends.clear();
                self.transition_to_closed();
                Ok(request_ids)
            }
        }
    }

    fn transition_to_closing(&mut self) {
        assert_eq!(self.phase, ClosePhase::Open, "only an open session begins closing");
        assert!(self.lease.is_terminal(), "closing follows the end of the lease");
        self.phase = ClosePhase::Closing;
    }

    fn transition_to_closed(&mut self) {
        assert_eq!(self.phase, ClosePhase::Closing, "only a closing session becomes closed");
        assert!(self.bindings.is_empty(), "a closed session holds no request");
        self.phase = ClosePhase::Closed;
    }

    fn require_accepting(&self) -> Result<()> {
        match self.phase {
            ClosePhase::Open => Ok(()),
            ClosePhase::Closing | ClosePhase::Closed => Err(self.closed_error()),
        }
    }

    fn closed_error(&self) -> OrtexError {
        let reason = self.close_reason().unwrap_or("closed");
        OrtexError::new(ErrorCode::SessionClosed, format!("session {:?} is closed: {reason}", self.id()))
    }

    /// Checks every accounting rule of the session; panics on a broken invariant.
    pub fn check_invariants(&self) {
        assert!(!self.fence.session_id.is_empty(), "a session has an id");
        self.lease.check_invariants();
        self.counters.check_invariants(&self.fence);
        self.completed_appends.check_invariants(&self.fence, &self.counters);
        assert_eq!(self.phase != ClosePhase::Open, self.lease.is_terminal(), "close and lease end together");
        if self.phase == ClosePhase::Closed {
            assert!(self.bindings.is_empty(), "a closed session holds no request");
        }
        self.bindings.check_invariants(&self.fence);
        self.configs.check_invariants();
    }
}

fn invalid_continuation(why: String) -> OrtexError {
    OrtexError::invalid(format!("the stored session cannot be continued: {why}"))
}

/// The counters' own rules (`AppendCounters::check_invariants`), as a refusal.
fn check_stored_counters(counters: &AppendCounters, fence: &Fence) -> Result<()> {
    let turn_ok = match counters.turn_key {
        None => counters.turn_seq == 0,
        Some(key) => counters.turn_seq > 0 && key.epoch == fence.epoch && key.turn_id <= fence.turn_id,
    };
    if counters.turn_seq > counters.seq || !turn_ok {
        return Err(invalid_continuation(format!("its append counters {counters:?} do not fit its fence {fence}")));
    }
    Ok(())
}

/// One stored completed append: of this session's earlier lives, of its current epoch, counted.
fn check_stored_append(record: &CompletedAppendRecord, fence: &Fence, counters: &AppendCounters) -> Result<()> {
    validate_operation_id(&record.operation_id)?;
    let recorded = &record.metadata.fence;
    let fits = recorded.session_id == fence.session_id
        && recorded.incarnation < fence.incarnation
        && recorded.epoch == fence.epoch
        && recorded.turn_id <= fence.turn_id
        && recorded.response_seq <= fence.response_seq
        && record.result.seq >= 1
        && record.result.seq <= counters.seq
        && record.result.turn_id == recorded.turn_id
        && record.result.is_final == record.metadata.is_final
        && !record.result.replayed;
    if !fits {
        return Err(invalid_continuation(format!(
            "its append {:?} does not fit its fence {fence}",
            record.operation_id
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::bindings::MAX_REQUESTS_PER_SESSION;
    use crate::session::lease::LeaseConfig;

    fn session() -> Session {
        let lease = Lease::new(LeaseConfig::new(Some(1_000), 100).unwrap(), 0).unwrap();
        Session::new(Fence::initial("s", 0), lease, 4).unwrap()
    }

    fn append(session: &mut Session, is_final: bool) -> AppendResult {
        let request = AppendRequest { is_final, ..AppendRequest::default() };
        session.append(&request, 1).unwrap()
    }

    fn with_op(operation_id: &str, fence: Option<Fence>, is_final: bool, input_digest: u64) -> AppendRequest {
        AppendRequest { fence, is_final, operation_id: Some(operation_id.into()), input_digest }
    }

    #[test]
    fn late_append_after_cancel_refused() {
        let mut session = session();
        let before = session.fence().clone();
        session.cancel(None, 1).unwrap();
        let late = AppendRequest { fence: Some(before), ..AppendRequest::default() };
        assert_eq!(session.append(&late, 2).unwrap_err().code, ErrorCode::FenceMismatch);
        assert_eq!(session.counters().seq, 0, "the refused append was not counted");
        // An append made right after the cancel under the new fence is accepted.
        let fresh = AppendRequest { fence: Some(session.fence().clone()), ..AppendRequest::default() };
        assert_eq!(session.append(&fresh, 2).unwrap().seq, 1);
        session.check_invariants();
    }

    #[test]
    fn epoch_change_resets_counters_and_cache() {
        let mut session = session();
        session.append(&with_op("op", None, false, 1), 1).unwrap();
        append(&mut session, false);
        assert_eq!(session.counters().seq, 2);
        let outcome = session.cancel(None, 2).unwrap();
        assert!(outcome.advanced);
        assert_eq!(session.fence().epoch, 1);
        assert_eq!(
            session.counters(),
            AppendCounters { seq: 2, turn_seq: 0, turn_key: None },
            "seq counts per session"
        );
        assert_eq!(session.num_completed_appends(), 0);
        // The operation id is free again in the new epoch: it is applied, not replayed.
        let again = session.append(&with_op("op", None, false, 1), 3).unwrap();
        assert_eq!((again.seq, again.turn_seq, again.replayed), (3, 1, false));
        session.check_invariants();
    }

    #[test]
    fn retried_cancel_cleans_up_but_never_advances_a_newer_epoch() {
        let mut session = session();
        let first = session.fence().clone();
        session.bind_request(7, &first).unwrap();
        let outcome = session.cancel(None, 1).unwrap();
        assert_eq!(outcome.request_ids, vec![7]);
        let after_first_cancel = session.fence().clone();
        // A second barge-in moves the session further on.
        session.cancel(None, 2).unwrap();
        let newest = session.fence().clone();
        assert_eq!(newest.epoch, 2);
        // The first cancel is retried: it reports its request again for cleanup but does not
        // move the session back to, or forward from, the epoch it first produced.
        let retried = session.cancel(Some(&first), 3).unwrap();
        assert!(!retried.advanced);
        assert_eq!(retried.request_ids, vec![7]);
        assert_eq!(session.fence(), &newest);
        let retried_explicit = session.prepare_cancel_fence(&first, &after_first_cancel, 4).unwrap();
        assert!(!retried_explicit.advanced);
        assert_eq!(session.fence(), &newest);
        session.check_invariants();
    }

    #[test]
    fn cancel_with_next_epoch_not_above_cancelled_refused() {
        let mut session = session();
        let current = session.fence().clone();
        for next in [current.clone(), Fence { turn_id: 5, ..current.clone() }] {
            let err = session.prepare_cancel_fence(&current, &next, 1).unwrap_err();
            assert_eq!(err.code, ErrorCode::FenceMismatch);
        }
        assert_eq!(session.fence(), &current);
    }

    #[test]
    fn cancel_of_a_fence_newer_than_current_refused() {
        let mut session = session();
        let current = session.fence().clone();
        let future = Fence { response_seq: 1, ..current.clone() };
        let next = future.next_epoch().unwrap();
        assert_eq!(session.prepare_cancel_fence(&future, &next, 1).unwrap_err().code, ErrorCode::FenceMismatch);
        let other = Fence::initial("other", 0);
        assert_eq!(session.cancel(Some(&other), 1).unwrap_err().code, ErrorCode::FenceMismatch);
        assert_eq!(session.fence(), &current);
    }

    #[test]
    fn cancelled_resources_are_held_until_released() {
        let mut session = session();
        let fence = session.fence().clone();
        session.reserve_request(3, &fence).unwrap();
        session.bind_request(4, &fence).unwrap();
        let outcome = session.cancel(None, 1).unwrap();
        assert_eq!(outcome.request_ids, vec![3, 4]);
        assert_eq!(session.request_ids(None, None), vec![3, 4], "held until the release succeeds");
        assert_eq!(session.request_ids(None, Some(true)), vec![4]);
        assert_eq!(session.release_fence(&fence), vec![3, 4]);
        assert!(session.request_ids(None, None).is_empty());
        session.check_invariants();
    }

    #[test]
    fn cancel_fence_releases_at_once() {
        let mut session = session();
        let fence = session.fence().clone();
        session.bind_request(9, &fence).unwrap();
        let outcome = session.cancel_fence(&fence, &fence.next_epoch().unwrap(), 1).unwrap();
        assert_eq!(outcome.request_ids, vec![9]);
        assert!(session.request_ids(None, None).is_empty());
    }

    #[test]
    fn stale_reservation_refused() {
        let mut session = session();
        let request = AppendRequest::default();
        let AppendPlan::Reserved(first) = session.prepare_append(&request).unwrap() else { panic!("fresh append") };
        let AppendPlan::Reserved(second) = session.prepare_append(&request).unwrap() else { panic!("fresh append") };
        assert_eq!(session.commit_append(first, 1).unwrap().seq, 1);
        assert_eq!(session.commit_append(second, 1).unwrap_err().code, ErrorCode::StaleReservation);
        let AppendPlan::Reserved(third) = session.prepare_append(&request).unwrap() else { panic!("fresh append") };
        session.start_response(2).unwrap();
        assert_eq!(session.commit_append(third, 2).unwrap_err().code, ErrorCode::StaleReservation);
        assert_eq!(session.counters().seq, 1);
        session.check_invariants();
    }

    #[test]
    fn prepare_append_changes_nothing() {
        let session = session();
        let before = session.clone();
        let request = with_op("op", None, true, 1);
        assert!(matches!(session.prepare_append(&request).unwrap(), AppendPlan::Reserved(_)));
        assert_eq!(session, before);
    }

    #[test]
    fn operation_reused_with_different_metadata_refused() {
        let mut session = session();
        session.append(&with_op("op", None, false, 1), 1).unwrap();
        for reused in [with_op("op", None, false, 2), with_op("op", None, true, 1)] {
            assert_eq!(session.append(&reused, 2).unwrap_err().code, ErrorCode::OperationReused);
        }
        assert_eq!(session.counters().seq, 1);
    }

    #[test]
    fn replay_returns_first_result_with_replayed_and_consumes_no_seq() {
        let mut session = session();
        let fence = session.fence().clone();
        let first = session.append(&with_op("op", Some(fence.clone()), false, 5), 1).unwrap();
        let replay = session.append(&with_op("op", Some(fence), false, 5), 2).unwrap();
        assert_eq!(replay, AppendResult { replayed: true, ..first });
        let replay_without_fence = session.append(&with_op("op", None, false, 5), 3).unwrap();
        assert!(replay_without_fence.replayed);
        assert_eq!(session.counters().seq, 1, "a replay consumes nothing");
        assert_eq!(append(&mut session, false).seq, 2);
    }

    #[test]
    fn replay_of_a_final_append_after_its_turn_advanced() {
        let mut session = session();
        let fence = session.fence().clone();
        let first = session.append(&with_op("end", Some(fence.clone()), true, 5), 1).unwrap();
        assert_eq!(session.fence().turn_id, 1);
        let replay = session.append(&with_op("end", Some(fence), true, 5), 2).unwrap();
        assert_eq!(replay, AppendResult { replayed: true, ..first });
        assert_eq!(session.fence().turn_id, 1, "a replay does not end another turn");
    }

    #[test]
    fn final_append_advances_turn_id_and_restarts_turn_seq() {
        let mut session = session();
        let a = append(&mut session, false);
        let b = append(&mut session, true);
        let c = append(&mut session, false);
        assert_eq!((a.seq, a.turn_seq, a.turn_id), (1, 1, 0));
        assert_eq!((b.seq, b.turn_seq, b.turn_id), (2, 2, 0));
        assert_eq!((c.seq, c.turn_seq, c.turn_id), (3, 1, 1));
        assert_eq!(session.fence().turn_id, 1);
        assert_eq!(session.fence().epoch, 0, "only cancel changes the epoch");
        session.check_invariants();
    }

    #[test]
    fn response_advances_response_seq_without_ending_the_user_turn() {
        let mut session = session();
        append(&mut session, false);
        let fence = session.start_response(1).unwrap();
        assert_eq!(fence.response_seq, 1);
        assert_eq!(session.fence(), &fence);
        let next = append(&mut session, false);
        assert_eq!((next.seq, next.turn_seq), (2, 2));
    }

    #[test]
    fn append_with_a_fence_ahead_of_the_session_refused() {
        let mut session = session();
        let ahead = Fence { turn_id: 3, ..session.fence().clone() };
        let request = AppendRequest { fence: Some(ahead), ..AppendRequest::default() };
        assert_eq!(session.append(&request, 1).unwrap_err().code, ErrorCode::FenceMismatch);
        let next_epoch = session.fence().next_epoch().unwrap();
        let request = AppendRequest { fence: Some(next_epoch), ..AppendRequest::default() };
        assert_eq!(session.append(&request, 1).unwrap_err().code, ErrorCode::FenceMismatch);
        assert_eq!(session.fence().epoch, 0, "only cancel changes the epoch");
    }

    #[test]
    fn close_is_a_single_terminal_transition() {
        let mut session = session();
        let fence = session.fence().clone();
        session.bind_request(2, &fence).unwrap();
        assert_eq!(session.finalize_close().unwrap_err().code, ErrorCode::InvalidArgument);
        assert!(session.begin_close("client_close"));
        assert!(!session.begin_close("idle_ttl_expired"));
        assert_eq!(session.close_reason(), Some("client_close"));
        assert_eq!(session.state(), SessionState::Closing);
        assert_eq!(session.request_ids(None, None), vec![2], "kept for a retried release");
        assert_eq!(session.finalize_close().unwrap(), vec![2]);
        assert_eq!(session.state(), SessionState::Closed);
        assert_eq!(session.finalize_close().unwrap_err().code, ErrorCode::SessionClosed);
        assert!(!session.begin_close("again"));
        session.check_invariants();
    }

    #[test]
    fn appends_cancel_and_respond_refused_after_begin_close() {
        let mut session = session();
        session.begin_close("client_close");
        let closed = ErrorCode::SessionClosed;
        assert_eq!(session.append(&AppendRequest::default(), 1).unwrap_err().code, closed);
        assert_eq!(session.cancel(None, 1).unwrap_err().code, closed);
        assert_eq!(session.start_response(1).unwrap_err().code, closed);
        assert_eq!(session.resume(1, session.lease_generation()).unwrap_err().code, closed);
        assert_eq!(session.replace_configs(Some(ConfigMap::new()), None).unwrap_err().code, closed);
        session.check_invariants();
    }

    #[test]
    fn replace_configs_publishes_one_generation() {
        let mut session = session();
        let config: ConfigMap = [("voice".to_string(), "a".to_string())].into();
        assert_eq!(session.replace_configs(None, None).unwrap(), 0);
        assert_eq!(session.replace_configs(Some(config.clone()), Some(config.clone())).unwrap(), 1);
        assert_eq!(session.replace_configs(None, Some(ConfigMap::new())).unwrap(), 2);
        assert_eq!(session.session_config(), &config);
        assert!(session.runtime_config().is_empty());
    }

    #[test]
    fn detached_state_follows_the_lease() {
        let mut session = session();
        session.detach(5).unwrap();
        assert_eq!(session.state(), SessionState::Detached);
        assert_eq!(session.resume(6, LeaseGeneration(0)).unwrap(), LeaseGeneration(1));
        assert_eq!(session.state(), SessionState::Open);
    }

    #[test]
    fn request_bindings_are_checked() {
        let mut session = session();
        let fence = session.fence().clone();
        assert_eq!(session.reserve_request(0, &fence).unwrap_err().code, ErrorCode::InvalidArgument);
        session.reserve_request(1, &fence).unwrap();
        session.reserve_request(1, &fence).unwrap();
        session.cancel(None, 1).unwrap();
        assert_eq!(session.reserve_request(1, &fence).unwrap_err().code, ErrorCode::FenceMismatch);
        let current = session.fence().clone();
        assert_eq!(session.bind_request(1, &current).unwrap_err().code, ErrorCode::InvalidArgument);
        for request_id in 2..=MAX_REQUESTS_PER_SESSION as u32 {
            session.reserve_request(request_id, &current).unwrap();
        }
        let full = session.reserve_request(1_000, &current).unwrap_err();
        assert!(full.code == ErrorCode::CapacityExhausted && full.code.retryable());
        session.check_invariants();
    }
}
