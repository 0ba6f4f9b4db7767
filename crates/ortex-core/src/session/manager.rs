//! The session manager: opens sessions, enforces the session limit, closes them in two phases
//! and collects expired ones (vllm-omni's `DuplexSessionRuntimeManager`, in
//! `duplex_session.py`).
//!
//! A session keeps its slot from `open` until `finalize_close`, including the time it spends
//! closing, because its engine request (and the KV it holds) is only gone once the close is
//! final. Counting closing sessions keeps `max_sessions` a true bound on engine resources.
//!
//! ```text
//!   open ──> Open/Detached ──begin_close / collect_expired──> Closing ──finalize_close──> removed
//!   └──────────────────────────── slot held ──────────────────────────────────┘   (id recorded
//!                                                                                  with its
//!                                                                                  incarnation)
//! ```

use std::collections::{BTreeMap, VecDeque};

use super::append::DEFAULT_COMPLETED_APPEND_LIMIT;
use super::fence::{validate_fence, Fence};
use super::lease::longer_than;
use super::lease::{Lease, LeaseConfig, LeaseGeneration};
use super::state::{Continuation, Session};
use crate::error::{ErrorCode, OrtexError, Result};

/// How many closed session ids the manager remembers with their last incarnation. Older ones are
/// folded into one floor (see `ClosedIdRecord`), so the memory stays bounded however many
/// sessions a long-running server sees.
pub const CLOSED_ID_RECORD_LIMIT: usize = 1024;

/// The longest session id accepted, in characters (Unicode scalar values: what a JavaScript
/// caller counts with `[...id].length`), the unit of every string limit in the protocol.
pub const MAX_SESSION_ID_CHARS: usize = 128;

/// The longest close reason accepted, in characters.
pub const MAX_CLOSE_REASON_CHARS: usize = 256;

/// The close reason used when the engine lost a request that a session owned.
pub const REQUEST_CLEANUP_REASON: &str = "request_cleanup";

/// Why `collect_expired` ended a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ExpiryReason {
    /// Detached for longer than the disconnect grace.
    DisconnectGraceExpired,
    /// No activity for the idle TTL and no operation in flight.
    IdleTtlExpired,
}

impl ExpiryReason {
    /// The stable string used as the session's close reason and in `session.expired` events.
    pub const fn as_str(self) -> &'static str {
        match self {
            ExpiryReason::DisconnectGraceExpired => "disconnect_grace_expired",
            ExpiryReason::IdleTtlExpired => "idle_ttl_expired",
        }
    }
}

/// One session ended by `collect_expired`. Its close has begun; the caller releases the listed
/// requests and then calls `finalize_close`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionExpiry {
    pub session_id: String,
    pub fence: Fence,
    /// The generation after the lease ended (ending bumps it).
    pub lease_generation: LeaseGeneration,
    pub reason: ExpiryReason,
    pub submitted_request_ids: Vec<u32>,
    pub reserved_request_ids: Vec<u32>,
}

/// Remembers the last incarnation of recently closed ids, so that reopening an id starts a new
/// life whose fences cannot be confused with the old one's.
///
/// Only the latest `limit` ids are kept. When an id is forgotten, `incarnation_floor` is raised
/// above its incarnation, and every id not in the record opens at the floor. So even a forgotten
/// id never reuses an incarnation it had before: a stale fence from any earlier life stays stale.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ClosedIdRecord {
    limit: usize,
    order: VecDeque<String>,
    last_incarnation: BTreeMap<String, u64>,
    incarnation_floor: u64,
}

impl ClosedIdRecord {
    fn new(limit: usize) -> ClosedIdRecord {
        assert!(limit > 0, "the closed-id record holds at least one id");
        ClosedIdRecord { limit, order: VecDeque::new(), last_incarnation: BTreeMap::new(), incarnation_floor: 0 }
    }

    fn next_incarnation(&self, session_id: &str) -> Result<u64> {
        match self.last_incarnation.get(session_id) {
            None => Ok(self.incarnation_floor),
            Some(last) => last.checked_add(1).ok_or_else(|| OrtexError::invalid("session incarnation is exhausted")),
        }
    }

    fn record(&mut self, session_id: &str, incarnation: u64) {
        if self.last_incarnation.contains_key(session_id) {
            self.order.retain(|id| id != session_id);
        }
        self.order.push_back(session_id.to_owned());
        self.last_incarnation.insert(session_id.to_owned(), incarnation);
        while self.order.len() > self.limit {
            let oldest = self.order.pop_front().expect("order is longer than the limit");
            let forgotten = self.last_incarnation.remove(&oldest).expect("order and map hold the same ids");
            // Saturating only matters after 2^64 lives of one id, which cannot happen.
            self.incarnation_floor = self.incarnation_floor.max(forgotten.saturating_add(1));
        }
    }

    fn check_invariants(&self) {
        assert!(self.order.len() <= self.limit, "the closed-id record is bounded");
        assert_eq!(self.order.len(), self.last_incarnation.len(), "order and map hold the same ids");
        for id in &self.order {
            assert!(self.last_incarnation.contains_key(id), "every ordered id is recorded");
        }
    }
}

/// Owns every session of one engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionManager {
    sessions: BTreeMap<String, Session>,
    max_sessions: Option<u32>,
    completed_append_limit: u32,
    lease_defaults: LeaseConfig,
    closed_ids: ClosedIdRecord,
}

impl Default for SessionManager {
    fn default() -> Self {
        SessionManager::new(None, DEFAULT_COMPLETED_APPEND_LIMIT, LeaseConfig::default())
            .expect("the defaults are valid")
    }
}

impl SessionManager {
    /// A manager with at most `max_sessions` sessions (unlimited when `None`; `Some(0)` is
    /// refused), `completed_append_limit` remembered appends per session (positive), and the
    /// lease configuration used when `open` is given none.
    pub fn new(max_sessions: Option<u32>, completed_append_limit: u32, lease_defaults: LeaseConfig) -> Result<Self> {
        if max_sessions == Some(0) {
            return Err(OrtexError::invalid("maxSessions must be positive or null"));
        }
        if completed_append_limit == 0 {
            return Err(OrtexError::invalid("completedAppendLimit must be positive"));
        }
        lease_defaults.validate()?;
        Ok(SessionManager {
            sessions: BTreeMap::new(),
            max_sessions,
            completed_append_limit,
            lease_defaults,
            closed_ids: ClosedIdRecord::new(CLOSED_ID_RECORD_LIMIT),
        })
    }

    pub fn max_sessions(&self) -> Option<u32> {
        self.max_sessions
    }

    /// Sessions holding a slot, closing ones included.
    pub fn num_sessions(&self) -> usize {
        self.sessions.len()
    }

    pub fn get(&self, session_id: &str) -> Option<&Session> {
        self.sessions.get(session_id)
    }

    pub fn get_mut(&mut self, session_id: &str) -> Option<&mut Session> {
        self.sessions.get_mut(session_id)
    }

    /// The session, or SESSION_CLOSED for an id whose close is final, or INVALID_ARGUMENT for an
    /// id never seen (as far as the bounded record remembers).
    pub fn require_mut(&mut self, session_id: &str) -> Result<&mut Session> {
        if !self.sessions.contains_key(session_id) {
            return Err(self.missing_session_error(session_id));
        }
        Ok(self.sessions.get_mut(session_id).expect("checked just above"))
    }

    /// Every session in id order.
    pub fn sessions(&self) -> impl Iterator<Item = &Session> {
        self.sessions.values()
    }

    /// Opens a session. An id that holds a slot (open or still closing) is SESSION_EXISTS; a full
    /// manager is CAPACITY_EXHAUSTED, which is retryable because a slot frees when a close is
    /// final. A finalized id opens again with the next incarnation.
    pub fn open(&mut self, session_id: &str, now_ms: u64, lease_config: Option<LeaseConfig>) -> Result<&mut Session> {
        validate_session_id(session_id)?;
        if let Some(existing) = self.sessions.get(session_id) {
            let closing = if existing.is_closing_or_closed() { " and is still closing" } else { "" };
            return Err(OrtexError::new(ErrorCode::SessionExists, format!("session {session_id:?} exists{closing}")));
        }
        self.require_free_slot()?;
        let lease = Lease::new(lease_config.unwrap_or(self.lease_defaults), now_ms)?;
        let fence = Fence::initial(session_id, self.closed_ids.next_incarnation(session_id)?);
        let session = Session::new(fence, lease, self.completed_append_limit)?;
        Ok(self.sessions.entry(session_id.to_owned()).or_insert(session))
    }

    /// Opens `session_id` as it was stored by another process: at exactly `incarnation`, its lease
    /// at `lease_generation` (a failover: the caller won the compare-and-set that chose them), and
    /// with `continuation` its fence's position, append counters and completed appends carry on
    /// from the old owner's (without one, they start at zero). An incarnation this manager has
    /// already seen for the id is refused as SESSION_EXISTS, so a restore can never revive a life
    /// that ended here; a continuation that does not fit is INVALID_ARGUMENT.
    pub fn restore(
        &mut self,
        session_id: &str,
        incarnation: u64,
        lease_generation: LeaseGeneration,
        now_ms: u64,
        continuation: Option<&Continuation>,
    ) -> Result<&mut Session> {
        validate_session_id(session_id)?;
        if self.sessions.contains_key(session_id) {
            return Err(OrtexError::new(ErrorCode::SessionExists, format!("session {session_id:?} exists")));
        }
        let next = self.closed_ids.next_incarnation(session_id)?;
        if incarnation < next {
            return Err(OrtexError::new(
                ErrorCode::SessionExists,
                format!(
                    "session {session_id:?} already lived here up to incarnation {}, past the stored {incarnation}",
                    next - 1
                ),
            ));
        }
        self.require_free_slot()?;
        let lease = Lease::at_generation(self.lease_defaults, now_ms, lease_generation)?;
        let mut session = Session::new(Fence::initial(session_id, incarnation), lease, self.completed_append_limit)?;
        if let Some(continuation) = continuation {
            session.continue_from(continuation)?;
        }
        Ok(self.sessions.entry(session_id.to_owned()).or_insert(session))
    }

    /// Begins closing a session; returns whether this call made the transition. With a fence,
    /// the fence is validated first, so a close issued for an earlier life or epoch of the id
    /// (a stale close) is refused and leaves the live session untouched.
    pub fn begin_close(&mut self, session_id: &str, fence: Option<&Fence>, reason: &str) -> Result<bool> {
        validate_close_reason(reason)?;
        let session = self.require_mut(session_id)?;
        if let Some(fence) = fence {
            validate_fence(session.fence(), fence)?;
        }
        Ok(session.begin_close(reason))
    }

    /// Completes a begun close: frees the slot, records the id's incarnation and returns the
    /// requests still bound, for release.
    pub fn finalize_close(&mut self, session_id: &str) -> Result<Vec<u32>> {
        let session = self.require_mut(session_id)?;
        let request_ids = session.finalize_close()?;
        let incarnation = session.fence().incarnation;
        let removed = self.sessions.remove(session_id);
        assert!(removed.is_some(), "a finalized session leaves the manager");
        self.closed_ids.record(session_id, incarnation);
        Ok(request_ids)
    }

    /// Begins the close of every session whose disconnect grace (checked first) or idle TTL has
    /// run out at `now_ms`, in session id order. The slots stay held until `finalize_close`.
    pub fn collect_expired(&mut self, now_ms: u64) -> Vec<SessionExpiry> {
        let mut expired = Vec::new();
        for session in self.sessions.values_mut() {
            let Some(reason) = expiry_reason(session.lease(), now_ms) else { continue };
            let submitted_request_ids = session.request_ids(None, Some(true));
            let reserved_request_ids = session.request_ids(None, Some(false));
            let began = session.begin_close(reason.as_str());
            assert!(began, "an expiring session has not begun closing");
            expired.push(SessionExpiry {
                session_id: session.id().to_owned(),
                fence: session.fence().clone(),
                lease_generation: session.lease_generation(),
                reason,
                submitted_request_ids,
                reserved_request_ids,
            });
        }
        expired
    }

    /// Checks the manager and every session; panics on a broken invariant.
    pub fn check_invariants(&self) {
        if let Some(max_sessions) = self.max_sessions {
            assert!(self.sessions.len() <= max_sessions as usize, "sessions never exceed max_sessions");
        }
        for (session_id, session) in &self.sessions {
            assert_eq!(session_id, session.id(), "sessions are keyed by their id");
            assert!(!matches!(session.state(), super::state::SessionState::Closed), "a closed session is removed");
            if let Some(last) = self.closed_ids.last_incarnation.get(session_id) {
                assert!(session.fence().incarnation > *last, "a reopened id is a new incarnation");
            }
            session.check_invariants();
        }
        self.closed_ids.check_invariants();
    }

    fn require_free_slot(&self) -> Result<()> {
        match self.max_sessions {
            Some(max_sessions) if self.sessions.len() >= max_sessions as usize => Err(OrtexError::new(
                ErrorCode::CapacityExhausted,
                format!("session capacity exhausted: limit={max_sessions}"),
            )),
            _ => Ok(()),
        }
    }

    fn missing_session_error(&self, session_id: &str) -> OrtexError {
        if self.closed_ids.last_incarnation.contains_key(session_id) {
            OrtexError::new(ErrorCode::SessionClosed, format!("session {session_id:?} is closed"))
        } else {
            OrtexError::invalid(format!("unknown session {session_id:?}"))
        }
    }
}

/// The disconnect grace is checked before the idle TTL, so that a session that was dropped is
/// reported as dropped even when it was also idle long enough.
fn expiry_reason(lease: &Lease, now_ms: u64) -> Option<ExpiryReason> {
    if lease.disconnect_grace_expired(now_ms) {
        Some(ExpiryReason::DisconnectGraceExpired)
    } else if lease.idle_expired(now_ms) {
        Some(ExpiryReason::IdleTtlExpired)
    } else {
        None
    }
}

fn validate_session_id(session_id: &str) -> Result<()> {
    if session_id.is_empty() {
        return Err(OrtexError::invalid("sessionId must not be empty"));
    }
    if longer_than(session_id, MAX_SESSION_ID_CHARS) {
        return Err(OrtexError::invalid(format!("sessionId is longer than {MAX_SESSION_ID_CHARS} characters")));
    }
    Ok(())
}

fn validate_close_reason(reason: &str) -> Result<()> {
    if longer_than(reason, MAX_CLOSE_REASON_CHARS) {
        return Err(OrtexError::invalid(format!("close reason is longer than {MAX_CLOSE_REASON_CHARS} characters")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::append::{AppendRequest, AppendResult};
    use crate::session::fence::FenceKey;
    use crate::session::lease::LeaseActivity;
    use crate::session::state::SessionState;

    const IDLE_TTL_MS: u64 = 1_000;
    const GRACE_MS: u64 = 100;

    fn manager(max_sessions: Option<u32>) -> SessionManager {
        SessionManager::new(max_sessions, 4, LeaseConfig::new(Some(IDLE_TTL_MS), GRACE_MS).unwrap()).unwrap()
    }

    #[test]
    fn new_refuses_zero_limits() {
        let lease = LeaseConfig::default();
        assert_eq!(SessionManager::new(Some(0), 4, lease).unwrap_err().code, ErrorCode::InvalidArgument);
        assert_eq!(SessionManager::new(None, 0, lease).unwrap_err().code, ErrorCode::InvalidArgument);
        let bad_lease = LeaseConfig { idle_ttl_ms: Some(0), disconnect_grace_ms: 1 };
        assert_eq!(SessionManager::new(None, 4, bad_lease).unwrap_err().code, ErrorCode::InvalidArgument);
    }

    #[test]
    fn capacity_rejection_is_retryable() {
        let mut manager = manager(Some(1));
        manager.open("a", 0, None).unwrap();
        let err = manager.open("b", 0, None).unwrap_err();
        assert_eq!(err.code, ErrorCode::CapacityExhausted);
        assert!(err.code.retryable());
        assert!(manager.get("b").is_none());
        manager.begin_close("a", None, "client_close").unwrap();
        assert_eq!(
            manager.open("b", 0, None).unwrap_err().code,
            ErrorCode::CapacityExhausted,
            "closing holds the slot"
        );
        manager.finalize_close("a").unwrap();
        manager.open("b", 0, None).unwrap();
        manager.check_invariants();
    }

    #[test]
    fn open_of_an_existing_id_is_session_exists() {
        let mut manager = manager(None);
        manager.open("a", 0, None).unwrap();
        assert_eq!(manager.open("a", 0, None).unwrap_err().code, ErrorCode::SessionExists);
        manager.begin_close("a", None, "client_close").unwrap();
        assert_eq!(manager.open("a", 0, None).unwrap_err().code, ErrorCode::SessionExists);
        assert_eq!(manager.open("", 0, None).unwrap_err().code, ErrorCode::InvalidArgument);
    }

    #[test]
    fn restore_opens_at_the_stored_incarnation_and_generation() {
        let mut manager = manager(None);
        let session = manager.restore("a", 7, LeaseGeneration(1_000_000), 5, None).unwrap();
        assert_eq!(session.fence().incarnation, 7);
        assert_eq!(session.lease_generation(), LeaseGeneration(1_000_000));
        assert_eq!(session.state(), SessionState::Open);
        assert_eq!(session.resume(6, LeaseGeneration(1_000_000)).unwrap(), LeaseGeneration(1_000_001));
        manager.check_invariants();
        let exists = manager.restore("a", 8, LeaseGeneration(0), 5, None).unwrap_err();
        assert_eq!(exists.code, ErrorCode::SessionExists, "a live id is never restored over");
        manager.begin_close("a", None, "fenced_out").unwrap();
        manager.finalize_close("a").unwrap();
        let revived = manager.restore("a", 7, LeaseGeneration(0), 5, None).unwrap_err();
        assert_eq!(revived.code, ErrorCode::SessionExists, "a life that ended here never comes back");
        assert_eq!(manager.restore("a", 8, LeaseGeneration(0), 5, None).unwrap().fence().incarnation, 8);
        let exhausted = manager.restore("b", 0, LeaseGeneration(u64::MAX), 5, None).unwrap_err();
        assert_eq!(exhausted.code, ErrorCode::InvalidArgument);
        assert!(manager.get("b").is_none());
        manager.check_invariants();
    }

    #[test]
    fn restore_with_a_continuation_carries_on_counters_and_replays() {
        // The old owner: a turn, a barge-in, then a turn whose response was running at the move.
        let mut old = manager(None);
        let session = old.open("a", 0, None).unwrap();
        let first = AppendRequest { fence: None, is_final: true, operation_id: Some("op1".into()), input_digest: 11 };
        session.append(&first, 1).unwrap();
        session.start_response(1).unwrap();
        session.cancel(None, 2).unwrap();
        let applied_under = session.fence().clone();
        let second = AppendRequest {
            fence: Some(applied_under.clone()),
            is_final: true,
            operation_id: Some("op2".into()),
            input_digest: 22,
        };
        let applied = session.append(&second, 3).unwrap();
        session.start_response(3).unwrap();
        let continuation = session.continuation();
        let old_fence = session.fence().clone();

        let mut new = manager(None);
        let moved = new.restore("a", 1, LeaseGeneration(1), 5, Some(&continuation)).unwrap();
        assert_eq!(moved.fence().key(), old_fence.key(), "epoch, turn and response carry on");
        assert_eq!(moved.fence().incarnation, 1);
        assert_eq!(moved.counters(), continuation.counters);
        assert_eq!(moved.continuation(), continuation);
        // The retry with the fence of its first attempt (the old life's) or without one: the
        // first result, nothing applied.
        for fence in [Some(applied_under.clone()), None] {
            let retry = AppendRequest { fence, ..second.clone() };
            assert_eq!(moved.append(&retry, 6).unwrap(), AppendResult { replayed: true, ..applied });
        }
        assert_eq!(moved.counters(), continuation.counters, "nothing was applied again");
        let reused = AppendRequest { input_digest: 23, ..second.clone() };
        assert_eq!(moved.append(&reused, 6).unwrap_err().code, ErrorCode::OperationReused);
        // A fence of the old life is refused for anything else.
        let stale = AppendRequest { fence: Some(old_fence), ..AppendRequest::default() };
        assert_eq!(moved.append(&stale, 7).unwrap_err().code, ErrorCode::FenceMismatch);
        let fresh = AppendRequest { fence: Some(moved.fence().clone()), ..AppendRequest::default() };
        assert_eq!(moved.append(&fresh, 7).unwrap().seq, continuation.counters.seq + 1, "seq carries on");
        new.check_invariants();
    }

    #[test]
    fn restore_refuses_a_continuation_that_does_not_fit_and_keeps_the_latest_appends() {
        let mut old = manager(None);
        let session = old.open("a", 0, None).unwrap();
        for op in ["op1", "op2", "op3", "op4"] {
            session.append(&AppendRequest { operation_id: Some(op.into()), ..AppendRequest::default() }, 1).unwrap();
        }
        let good = session.continuation();
        let mut counters = good.clone();
        counters.counters.turn_seq = good.counters.seq + 1;
        let mut foreign = good.clone();
        foreign.completed_appends[0].metadata.fence.session_id = "b".into();
        let mut uncounted = good.clone();
        uncounted.completed_appends[3].result.seq = good.counters.seq + 1;
        let mut twice = good.clone();
        twice.completed_appends[2] = twice.completed_appends[3].clone();
        for (incarnation, continuation) in [(1, &counters), (1, &foreign), (1, &uncounted), (1, &twice), (0, &good)] {
            let mut new = manager(None);
            let refused = new.restore("a", incarnation, LeaseGeneration(0), 5, Some(continuation)).unwrap_err();
            assert_eq!(refused.code, ErrorCode::InvalidArgument, "{continuation:?} at {incarnation}");
            assert!(new.get("a").is_none(), "a refused restore leaves nothing");
        }
        // A manager that remembers fewer appends keeps the latest.
        let mut small = SessionManager::new(None, 2, LeaseConfig::new(Some(IDLE_TTL_MS), GRACE_MS).unwrap()).unwrap();
        let moved = small.restore("a", 1, LeaseGeneration(0), 5, Some(&good)).unwrap();
        let kept: Vec<String> = moved.continuation().completed_appends.into_iter().map(|r| r.operation_id).collect();
        assert_eq!(kept, ["op3", "op4"]);
        small.check_invariants();
    }

    #[test]
    fn stale_close_keeps_the_live_session() {
        let mut manager = manager(None);
        let old_fence = manager.open("a", 0, None).unwrap().fence().clone();
        manager.begin_close("a", Some(&old_fence), "client_close").unwrap();
        manager.finalize_close("a").unwrap();
        manager.open("a", 1, None).unwrap();
        let err = manager.begin_close("a", Some(&old_fence), "late close").unwrap_err();
        assert_eq!(err.code, ErrorCode::FenceMismatch);
        let live = manager.get("a").unwrap();
        assert_eq!(live.state(), SessionState::Open);
        assert_eq!(live.fence().incarnation, 1);
        manager.check_invariants();
    }

    #[test]
    fn reopen_of_a_closed_id_bumps_incarnation() {
        let mut manager = manager(None);
        for expected_incarnation in 0..3 {
            assert_eq!(manager.open("a", 0, None).unwrap().fence().incarnation, expected_incarnation);
            manager.begin_close("a", None, "client_close").unwrap();
            manager.finalize_close("a").unwrap();
            assert_eq!(manager.finalize_close("a").unwrap_err().code, ErrorCode::SessionClosed);
        }
        assert_eq!(manager.open("b", 0, None).unwrap().fence().incarnation, 0);
    }

    #[test]
    fn closed_id_record_is_bounded_and_forgotten_ids_never_reuse_an_incarnation() {
        let mut record = ClosedIdRecord::new(2);
        record.record("a", 5);
        record.record("b", 0);
        record.record("a", 6);
        record.record("c", 0);
        assert_eq!(record.order.len(), 2);
        assert_eq!(record.next_incarnation("b").unwrap(), 1, "b was forgotten: it opens at the floor");
        assert_eq!(record.next_incarnation("a").unwrap(), 7);
        record.record("d", 0);
        assert_eq!(record.next_incarnation("a").unwrap(), 7, "a is forgotten, and the floor is above 6");
        record.check_invariants();
    }

    #[test]
    fn expiry_holds_slot_until_finalize() {
        let mut manager = manager(Some(1));
        let session = manager.open("a", 0, None).unwrap();
        let fence = session.fence().clone();
        session.bind_request(11, &fence).unwrap();
        session.reserve_request(12, &fence).unwrap();
        let expired = manager.collect_expired(IDLE_TTL_MS);
        assert_eq!(expired.len(), 1);
        let expiry = &expired[0];
        assert_eq!(expiry.reason, ExpiryReason::IdleTtlExpired);
        assert_eq!((expiry.submitted_request_ids.clone(), expiry.reserved_request_ids.clone()), (vec![11], vec![12]));
        assert_eq!(expiry.lease_generation, LeaseGeneration(1), "ending the lease bumps its generation");
        assert_eq!(manager.get("a").unwrap().state(), SessionState::Closing);
        assert_eq!(manager.open("b", 0, None).unwrap_err().code, ErrorCode::CapacityExhausted);
        assert!(manager.collect_expired(u64::MAX).is_empty(), "a session expires once");
        assert_eq!(manager.finalize_close("a").unwrap(), vec![11, 12]);
        manager.open("b", 0, None).unwrap();
        manager.check_invariants();
    }

    #[test]
    fn disconnect_grace_checked_before_idle() {
        let mut manager = manager(None);
        manager.open("a", 0, None).unwrap().detach(IDLE_TTL_MS - GRACE_MS).unwrap();
        let expired = manager.collect_expired(10 * IDLE_TTL_MS);
        assert_eq!(expired[0].reason, ExpiryReason::DisconnectGraceExpired);
        assert_eq!(manager.get("a").unwrap().close_reason(), Some("disconnect_grace_expired"));
    }

    #[test]
    fn idle_ttl_disabled_never_expires() {
        let mut manager = manager(None);
        manager.open("a", 0, Some(LeaseConfig::new(None, GRACE_MS).unwrap())).unwrap();
        assert!(manager.collect_expired(u64::MAX).is_empty());
        manager.get_mut("a").unwrap().detach(10).unwrap();
        assert_eq!(manager.collect_expired(10 + GRACE_MS)[0].reason, ExpiryReason::DisconnectGraceExpired);
    }

    #[test]
    fn an_active_operation_prevents_expiry() {
        let mut manager = manager(None);
        manager.open("a", 0, None).unwrap().begin_operation(0, "prefill").unwrap();
        assert!(manager.collect_expired(100 * IDLE_TTL_MS).is_empty());
        manager.get_mut("a").unwrap().end_operation(50, "prefill").unwrap();
        assert!(manager.collect_expired(50 + IDLE_TTL_MS - 1).is_empty());
        assert_eq!(manager.collect_expired(50 + IDLE_TTL_MS).len(), 1);
    }

    #[test]
    fn expiry_follows_session_id_order() {
        let mut manager = manager(None);
        for id in ["c", "a", "b"] {
            manager.open(id, 0, None).unwrap();
        }
        let ids: Vec<String> = manager.collect_expired(IDLE_TTL_MS).into_iter().map(|e| e.session_id).collect();
        assert_eq!(ids, ["a", "b", "c"]);
    }

    #[test]
    fn missing_sessions_are_told_apart() {
        let mut manager = manager(None);
        assert_eq!(manager.begin_close("x", None, "r").unwrap_err().code, ErrorCode::InvalidArgument);
        manager.open("x", 0, None).unwrap();
        let long_reason = "r".repeat(MAX_CLOSE_REASON_CHARS + 1);
        assert_eq!(manager.begin_close("x", None, &long_reason).unwrap_err().code, ErrorCode::InvalidArgument);
        manager.begin_close("x", None, "r").unwrap();
        manager.finalize_close("x").unwrap();
        assert_eq!(manager.begin_close("x", None, "r").unwrap_err().code, ErrorCode::SessionClosed);
    }

    // ---- seeded random operations --------------------------------------------------------------

    /// A tiny xorshift64 generator: deterministic from its seed on every target.
    struct XorShift64(u64);

    impl XorShift64 {
        fn new(seed: u64) -> XorShift64 {
            XorShift64(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
        }

        fn next_u64(&mut self) -> u64 {
            let mut x = self.0;
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            self.0 = x;
            x
        }

        fn below(&mut self, bound: u64) -> u64 {
            self.next_u64() % bound
        }

        fn percent(&mut self, percent: u64) -> bool {
            self.below(100) < percent
        }
    }

    /// Prints the seed when a model run panics, so that a failure can be replayed.
    struct SeedReport(u64);

    impl Drop for SeedReport {
        fn drop(&mut self) {
            if std::thread::panicking() {
                eprintln!("session model test failed with seed {}", self.0);
            }
        }
    }

    /// One life of a session id.
    type Life = (String, u64);

    const MODEL_MAX_SESSIONS: u32 = 3;
    const MODEL_STALE_FENCES: usize = 8;

    #[derive(Default)]
    struct Model {
        opened: BTreeMap<Life, u32>,
        ended: BTreeMap<Life, u32>,
        finalized: BTreeMap<Life, u32>,
        position: BTreeMap<Life, (FenceKey, u64)>,
        stale_fences: VecDeque<Fence>,
        next_request_id: u32,
    }

    impl Model {
        fn life(session: &Session) -> Life {
            (session.id().to_owned(), session.fence().incarnation)
        }

        fn count_end(&mut self, life: Life) {
            let ended = self.ended.entry(life).or_insert(0);
            *ended += 1;
            assert_eq!(*ended, 1, "every session ends exactly once");
        }

        fn remember(&mut self, fence: Fence) {
            self.stale_fences.push_back(fence);
            if self.stale_fences.len() > MODEL_STALE_FENCES {
                self.stale_fences.pop_front();
            }
        }

        fn some_fence(&self, rng: &mut XorShift64, session: &Session) -> Option<Fence> {
            match rng.below(4) {
                0 => Some(session.fence().clone()),
                1 if !self.stale_fences.is_empty() => {
                    Some(self.stale_fences[rng.below(self.stale_fences.len() as u64) as usize].clone())
                }
                _ => None,
            }
        }

        fn check(&mut self, manager: &SessionManager) {
            manager.check_invariants();
            assert!(manager.num_sessions() <= MODEL_MAX_SESSIONS as usize, "sessions are bounded");
            for session in manager.sessions() {
                let life = Model::life(session);
                let key = session.fence().key();
                let seq = session.counters().seq;
                if let Some((last_key, last_seq)) = self.position.get(&life) {
                    assert!(key >= *last_key, "the fence never moves backwards");
                    if key.epoch == last_key.epoch {
                        assert!(seq >= *last_seq, "seq is monotonic within an epoch");
                    }
                }
                self.position.insert(life.clone(), (key, seq));
                assert!(session.num_completed_appends() <= 4, "the completed-append cache is bounded");
                let ended = self.ended.get(&life).copied().unwrap_or(0);
                assert_eq!(ended, u32::from(session.is_closing_or_closed()), "closing sessions ended once");
            }
        }
    }

    fn step(rng: &mut XorShift64, manager: &mut SessionManager, model: &mut Model, now_ms: u64) -> Result<()> {
        let id = format!("s{}", rng.below(5));
        let action = rng.below(15);
        match action {
            0 | 1 => open(manager, model, &id, now_ms),
            10 => {
                for expiry in manager.collect_expired(now_ms) {
                    model.count_end((expiry.session_id, expiry.fence.incarnation));
                }
                Ok(())
            }
            11 => close(rng, manager, model, &id),
            12 => {
                // Finalize a session that is closing, as the engine does once its request is gone.
                let closing = manager.sessions().find(|session| session.is_closing_or_closed());
                let Some(closing_id) = closing.map(|session| session.id().to_owned()) else { return Ok(()) };
                finalize(manager, model, &closing_id)
            }
            _ => {
                let Some(session) = manager.get_mut(&id) else { return Ok(()) };
                model.remember(session.fence().clone());
                session_step(rng, session, model, action, now_ms)
            }
        }
    }

    fn open(manager: &mut SessionManager, model: &mut Model, id: &str, now_ms: u64) -> Result<()> {
        let session = manager.open(id, now_ms, None)?;
        let opened = model.opened.entry(Model::life(session)).or_insert(0);
        *opened += 1;
        assert_eq!(*opened, 1, "a life is opened once");
        Ok(())
    }

    fn close(rng: &mut XorShift64, manager: &mut SessionManager, model: &mut Model, id: &str) -> Result<()> {
        let Some(session) = manager.get(id) else { return Ok(()) };
        let life = Model::life(session);
        let fence = model.some_fence(rng, session);
        if manager.begin_close(id, fence.as_ref(), "client_close")? {
            model.count_end(life);
        }
        Ok(())
    }

    fn finalize(manager: &mut SessionManager, model: &mut Model, id: &str) -> Result<()> {
        let Some(session) = manager.get(id) else { return Ok(()) };
        let life = Model::life(session);
        manager.finalize_close(id)?;
        assert_eq!(model.ended.get(&life), Some(&1), "only an ended session is finalized");
        *model.finalized.entry(life).or_insert(0) += 1;
        Ok(())
    }

    fn session_step(
        rng: &mut XorShift64,
        session: &mut Session,
        model: &mut Model,
        action: u64,
        now_ms: u64,
    ) -> Result<()> {
        match action {
            2..=4 => append_step(rng, session, model, now_ms),
            5 => session.start_response(now_ms).map(drop),
            6 => session.cancel(model.some_fence(rng, session).as_ref(), now_ms).map(drop),
            7 => session.detach(now_ms),
            8 => {
                let generation = session.lease_generation().get() + rng.below(2);
                session.resume(now_ms, LeaseGeneration(generation)).map(drop)
            }
            9 if rng.percent(50) => session.begin_operation(now_ms, "op"),
            9 => session.end_operation(now_ms, "op"),
            13 => {
                model.next_request_id += 1;
                let fence = session.fence().clone();
                session.bind_request(model.next_request_id, &fence)
            }
            _ if rng.percent(50) => session.touch(now_ms, LeaseActivity::Heartbeat),
            _ => {
                let fence = model.some_fence(rng, session).unwrap_or_else(|| session.fence().clone());
                session.release_fence(&fence);
                Ok(())
            }
        }
    }

    fn append_step(rng: &mut XorShift64, session: &mut Session, model: &Model, now_ms: u64) -> Result<()> {
        // Most appends with an operation id carry that id's own metadata, as a real retry does;
        // the rest reuse the id with random metadata.
        let operation = rng.percent(50).then(|| rng.below(6));
        let retry_like = rng.percent(80);
        let is_final = match operation {
            Some(operation) if retry_like => operation == 5,
            _ => rng.percent(25),
        };
        let input_digest = match operation {
            Some(operation) if retry_like => operation % 2,
            _ => rng.below(2),
        };
        let fence = model.some_fence(rng, session);
        let operation_id = operation.map(|operation| format!("op{operation}"));
        let request = AppendRequest { fence, is_final, operation_id, input_digest };
        let before = session.counters();
        let result = session.append(&request, now_ms)?;
        if result.replayed {
            assert_eq!(session.counters(), before, "a replay consumes nothing");
        } else {
            assert!(result.seq >= 1 && result.turn_seq >= 1 && result.turn_seq <= result.seq);
        }
        Ok(())
    }

    fn run_model(seed: u64, steps: u32) {
        let _report = SeedReport(seed);
        let mut rng = XorShift64::new(seed);
        let mut manager = manager(Some(MODEL_MAX_SESSIONS));
        let mut model = Model { next_request_id: 0, ..Model::default() };
        let mut now_ms = 0;
        for _ in 0..steps {
            now_ms += rng.below(80);
            let before = manager.clone();
            if let Err(err) = step(&mut rng, &mut manager, &mut model, now_ms) {
                assert_eq!(manager, before, "a refused command changes nothing ({err})");
                if err.code == ErrorCode::CapacityExhausted {
                    assert!(err.code.retryable());
                }
            }
            model.check(&manager);
        }
        let ids: Vec<String> = manager.sessions().map(|session| session.id().to_owned()).collect();
        for id in ids {
            let life = Model::life(manager.get(&id).unwrap());
            if manager.begin_close(&id, None, "shutdown").unwrap() {
                model.count_end(life);
            }
            finalize(&mut manager, &mut model, &id).unwrap();
        }
        assert_eq!(manager.num_sessions(), 0);
        assert_eq!(model.opened.keys().collect::<Vec<_>>(), model.ended.keys().collect::<Vec<_>>());
        assert!(model.ended.values().chain(model.finalized.values()).all(|count| *count == 1));
        assert_eq!(model.opened.len(), model.finalized.len(), "every session is finalized once");
    }

    #[test]
    fn seeded_random_operations_keep_invariants() {
        for seed in 1..=200 {
            run_model(seed, 400);
        }
    }
}
