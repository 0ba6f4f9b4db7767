//! Appends of user input: sequence counters, two-phase reservations and the idempotency cache.
//!
//! An append is planned and then applied, so that the engine can do its part (queue the input for
//! prefill) between the two and apply nothing when that part fails:
//!
//! ```text
//!   prepare_append(&session, request)       pure: reads the session, returns a plan
//!     -> Replay(first result)                the operation id was already applied: nothing to do
//!     -> Reserved(reservation)               base fence + base counters + the counters to publish
//!   commit_append(&mut session, reservation) refuses a reservation whose base has moved
//!                                            (STALE_RESERVATION), else publishes it
//! ```
//!
//! `seq` counts the appends of the session and `turn_seq` those of the current user turn:
//!
//! ```text
//!   append            a      b      c(final)  d      cancel  e
//!   seq               1      2      3         4      -       5     (a cancel starts a new epoch)
//!   turn_seq          1      2      3         1      -       1
//!   turn_id (input)   0      0      0         1      -       1
//! ```

use std::collections::{BTreeMap, VecDeque};

use super::fence::Fence;
use crate::error::{ErrorCode, OrtexError, Result};

/// Completed appends remembered per session when none is configured (api.md's default).
pub const DEFAULT_COMPLETED_APPEND_LIMIT: u32 = 256;

/// One append as the caller asks for it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AppendRequest {
    /// The fence the caller believes is current; `None` means "whatever is current now".
    pub fence: Option<Fence>,
    /// Whether this append ends the user turn.
    pub is_final: bool,
    /// Makes the append idempotent: a retry with the same id and metadata is answered from the
    /// cache instead of being applied twice.
    pub operation_id: Option<String>,
    /// A digest of the appended input, computed by the caller. The core never sees the input
    /// itself, so this is how a retry that carries different input is told apart from a replay.
    pub input_digest: u64,
}

/// What an append did, as reported to the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AppendResult {
    /// Position of this append in the current epoch, from 1.
    pub seq: u64,
    /// Position of this append in its user turn, from 1.
    pub turn_seq: u64,
    /// The user turn the input belongs to.
    pub turn_id: u64,
    pub is_final: bool,
    /// True when this result was answered from the cache and nothing was applied.
    pub replayed: bool,
}

/// Identifies one user turn. ortex's api.md defines `turn_seq` per user turn, which ends only
/// with a final append or a cancel; the key in vllm-omni's `duplex_session.py` also holds
/// `response_seq`, which would restart the count when a response is started by hand in the
/// middle of a user turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TurnKey {
    pub epoch: u64,
    pub turn_id: u64,
}

impl TurnKey {
    pub fn of(fence: &Fence) -> TurnKey {
        TurnKey { epoch: fence.epoch, turn_id: fence.turn_id }
    }
}

/// The append counters of a session, reset together when the epoch changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AppendCounters {
    pub seq: u64,
    pub turn_seq: u64,
    /// The turn of the latest append of this epoch, or `None` before the first one.
    pub turn_key: Option<TurnKey>,
}

impl AppendCounters {
    /// The counters after one more append under `fence` (pure).
    pub fn after_append(&self, fence: &Fence) -> Result<AppendCounters> {
        let key = TurnKey::of(fence);
        let turn_seq = if self.turn_key == Some(key) { increment(self.turn_seq)? } else { 1 };
        Ok(AppendCounters { seq: increment(self.seq)?, turn_seq, turn_key: Some(key) })
    }

    /// The counters once a cancel moved the session to a new epoch: `seq` goes on counting the
    /// session's appends, the user turn starts afresh.
    pub fn after_epoch_change(&self) -> AppendCounters {
        AppendCounters { seq: self.seq, turn_seq: 0, turn_key: None }
    }

    /// Checks the counters against the session's current fence; panics on a broken invariant.
    pub fn check_invariants(&self, fence: &Fence) {
        assert!(self.turn_seq <= self.seq, "a turn holds no more appends than the session");
        assert_eq!(self.turn_seq == 0, self.turn_key.is_none(), "the turn key is set by the turn's first append");
        if let Some(key) = self.turn_key {
            assert_eq!(key.epoch, fence.epoch, "counters belong to the current epoch");
            assert!(key.turn_id <= fence.turn_id, "the session's turn never falls behind its input");
        }
    }
}

/// What an append was applied with; a retry must match it to be a replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppendMetadata {
    pub fence: Fence,
    pub is_final: bool,
    pub input_digest: u64,
}

/// A planned append: the state it was planned against and what it will publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppendReservation {
    pub(super) base_fence: Fence,
    pub(super) base_counters: AppendCounters,
    pub(super) counters: AppendCounters,
    pub(super) operation_id: Option<String>,
    pub(super) input_digest: u64,
    pub(super) result: AppendResult,
}

impl AppendReservation {
    /// The result the append will report once committed.
    pub fn result(&self) -> AppendResult {
        self.result
    }

    /// The fence the append applies under.
    pub fn fence(&self) -> &Fence {
        &self.base_fence
    }

    /// What the append will be remembered with, for recognizing its retries.
    pub(super) fn metadata(&self) -> AppendMetadata {
        AppendMetadata {
            fence: self.base_fence.clone(),
            is_final: self.result.is_final,
            input_digest: self.input_digest,
        }
    }
}

/// The outcome of `prepare_append`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AppendPlan {
    /// The operation was already applied; this is its first result with `replayed: true`.
    Replay(AppendResult),
    /// A new append to commit.
    Reserved(AppendReservation),
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct CompletedAppend {
    metadata: AppendMetadata,
    result: AppendResult,
}

/// One remembered append as a session store keeps it (`Continuation`), for a new owner's cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompletedAppendRecord {
    pub operation_id: String,
    pub metadata: AppendMetadata,
    pub result: AppendResult,
}

/// The bounded memory of completed appends by operation id, oldest evicted first.
///
/// A lookup does not refresh an entry (as in vllm-omni's `duplex_session.py`, where only
/// recording moves an entry to the end): that keeps `prepare_append` free of side effects, and a
/// replay is rare enough that evicting by insertion order loses nothing in practice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompletedAppendCache {
    limit: usize,
    order: VecDeque<String>,
    entries: BTreeMap<String, CompletedAppend>,
}

impl CompletedAppendCache {
    /// An empty cache holding at most `limit` entries; `limit` must be positive.
    pub fn new(limit: u32) -> Result<CompletedAppendCache> {
        if limit == 0 {
            return Err(OrtexError::invalid("completedAppendLimit must be positive"));
        }
        Ok(CompletedAppendCache { limit: limit as usize, order: VecDeque::new(), entries: BTreeMap::new() })
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn contains(&self, operation_id: &str) -> bool {
        self.entries.contains_key(operation_id)
    }

    /// Whether `operation_id` was applied under exactly `fence`: its retry, carrying the fence of
    /// its first attempt, is a replay even when that fence belongs to the session's previous life
    /// on another process (a move carries the cache along).
    pub fn recorded_under(&self, operation_id: &str, fence: &Fence) -> bool {
        self.entries.get(operation_id).is_some_and(|completed| completed.metadata.fence == *fence)
    }

    /// Every remembered append, oldest first.
    pub fn records(&self) -> Vec<CompletedAppendRecord> {
        self.order
            .iter()
            .map(|id| {
                let completed = self.entries.get(id).expect("every ordered id has an entry");
                CompletedAppendRecord {
                    operation_id: id.clone(),
                    metadata: completed.metadata.clone(),
                    result: completed.result,
                }
            })
            .collect()
    }

    /// The first result of `operation_id` marked as a replay, `None` when the id is unknown, or
    /// OPERATION_REUSED when the id was applied with other metadata. A retry without a fence
    /// matches on the final flag and the input digest alone, because "the current fence" has moved
    /// on when the first attempt was a final append.
    pub fn lookup(&self, operation_id: &str, request: &AppendRequest) -> Result<Option<AppendResult>> {
        let Some(completed) = self.entries.get(operation_id) else { return Ok(None) };
        let metadata = &completed.metadata;
        let fence_matches = request.fence.as_ref().is_none_or(|fence| *fence == metadata.fence);
        if !fence_matches || metadata.is_final != request.is_final || metadata.input_digest != request.input_digest {
            return Err(OrtexError::new(
                ErrorCode::OperationReused,
                format!("append operation {operation_id:?} was reused with different metadata"),
            ));
        }
        Ok(Some(AppendResult { replayed: true, ..completed.result }))
    }

    /// Remembers a newly applied append, evicting the oldest entries beyond the limit.
    pub fn record(&mut self, operation_id: String, metadata: AppendMetadata, result: AppendResult) {
        assert!(!self.entries.contains_key(&operation_id), "an operation id is recorded once per epoch");
        assert!(!result.replayed, "only applied appends are recorded");
        self.order.push_back(operation_id.clone());
        self.entries.insert(operation_id, CompletedAppend { metadata, result });
        while self.entries.len() > self.limit {
            let oldest = self.order.pop_front().expect("order and entries hold the same ids");
            let removed = self.entries.remove(&oldest);
            assert!(removed.is_some(), "order and entries hold the same ids");
        }
    }

    /// Forgets everything; used when the epoch changes, since no append of an older epoch may be
    /// replayed into a newer one.
    pub fn clear(&mut self) {
        self.order.clear();
        self.entries.clear();
    }

    /// Checks the cache against the session's fence and counters; panics on a broken invariant.
    pub fn check_invariants(&self, fence: &Fence, counters: &AppendCounters) {
        assert!(self.entries.len() <= self.limit, "the completed-append cache is bounded");
        assert_eq!(self.order.len(), self.entries.len(), "order and entries hold the same ids");
        for id in &self.order {
            let completed = self.entries.get(id).expect("every ordered id has an entry");
            let recorded = &completed.metadata.fence;
            // A moved session's cache holds appends of its earlier lives (lower incarnations).
            assert!(
                recorded.session_id == fence.session_id && recorded.incarnation <= fence.incarnation,
                "cached appends belong to this session"
            );
            assert_eq!(completed.metadata.fence.epoch, fence.epoch, "cached appends belong to this epoch");
            assert!(completed.result.seq <= counters.seq, "a cached append was counted");
        }
    }
}

fn increment(value: u64) -> Result<u64> {
    value.checked_add(1).ok_or_else(|| OrtexError::invalid("session append counter is exhausted"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fence(epoch: u64, turn_id: u64) -> Fence {
        Fence { session_id: "s".into(), incarnation: 0, epoch, turn_id, response_seq: 0 }
    }

    fn result(seq: u64) -> AppendResult {
        AppendResult { seq, turn_seq: seq, turn_id: 0, is_final: false, replayed: false }
    }

    fn metadata(digest: u64) -> AppendMetadata {
        AppendMetadata { fence: fence(0, 0), is_final: false, input_digest: digest }
    }

    fn request(fence: Option<Fence>, is_final: bool, digest: u64) -> AppendRequest {
        AppendRequest { fence, is_final, operation_id: None, input_digest: digest }
    }

    #[test]
    fn completed_append_cache_is_bounded() {
        let mut cache = CompletedAppendCache::new(2).unwrap();
        for seq in 1..=3 {
            cache.record(format!("op{seq}"), metadata(seq), result(seq));
        }
        assert_eq!(cache.len(), 2);
        assert!(!cache.contains("op1"), "the oldest entry is evicted first");
        assert!(cache.contains("op2") && cache.contains("op3"));
        let counters = AppendCounters { seq: 3, turn_seq: 3, turn_key: Some(TurnKey::of(&fence(0, 0))) };
        cache.check_invariants(&fence(0, 0), &counters);
    }

    #[test]
    fn cache_limit_must_be_positive() {
        assert_eq!(CompletedAppendCache::new(0).unwrap_err().code, ErrorCode::InvalidArgument);
    }

    #[test]
    fn lookup_replays_matching_metadata_and_refuses_other_metadata() {
        let mut cache = CompletedAppendCache::new(4).unwrap();
        cache.record("op".into(), metadata(7), result(1));
        let replay = cache.lookup("op", &request(Some(fence(0, 0)), false, 7)).unwrap().unwrap();
        assert_eq!(replay, AppendResult { replayed: true, ..result(1) });
        assert!(cache.lookup("op", &request(None, false, 7)).unwrap().is_some());
        assert!(cache.lookup("other", &request(None, false, 7)).unwrap().is_none());
        for reused in [request(None, false, 8), request(None, true, 7), request(Some(fence(0, 1)), false, 7)] {
            assert_eq!(cache.lookup("op", &reused).unwrap_err().code, ErrorCode::OperationReused);
        }
    }

    #[test]
    fn counters_restart_turn_seq_on_a_new_turn_key() {
        let first = AppendCounters::default().after_append(&fence(0, 0)).unwrap();
        let second = first.after_append(&fence(0, 0)).unwrap();
        let next_turn = second.after_append(&fence(0, 1)).unwrap();
        assert_eq!((first.seq, first.turn_seq), (1, 1));
        assert_eq!((second.seq, second.turn_seq), (2, 2));
        assert_eq!((next_turn.seq, next_turn.turn_seq), (3, 1));
        next_turn.check_invariants(&fence(0, 1));
    }
}
