//! The session fence: the identity and position that a command claims to act on.
//!
//! Every command that reaches a session names the fence it was issued under. The fence lets the
//! session refuse commands that were meant for an older life of the session (a lower
//! `incarnation`), for a response that a barge-in already cancelled (a lower `epoch`), or for a
//! user turn or response that has already moved on (a lower `turn_id` or `response_seq`).
//!
//! ```text
//!   identity                 position (compared within one identity)
//!   +------------+-------------+-------+---------+--------------+
//!   | session_id | incarnation | epoch | turn_id | response_seq |
//!   +------------+-------------+-------+---------+--------------+
//!                                  ^       ^          ^
//!                   changed only by cancel |          each response advances it
//!                                the final append of a user turn advances it
//! ```
//!
//! Validation follows `_validate_fence` in vllm-omni's `duplex_session.py`: the identity must
//! match exactly; a lower epoch is refused; within the same epoch a lower `turn_id` *or* a lower
//! `response_seq` is refused, so the two counters are each monotonic within an epoch rather than
//! compared as one tuple.

use std::fmt;

use crate::error::{ErrorCode, OrtexError, Result};

/// The identity and position a session command is issued under.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Fence {
    pub session_id: String,
    /// Counts the lives of one session id: a closed id that is opened again gets the next value,
    /// so that commands addressed to the earlier session can never touch the new one.
    pub incarnation: u64,
    /// Advanced only by a cancel (barge-in); everything issued under an older epoch is stale.
    pub epoch: u64,
    /// The user turn that input belongs to; the final append of a turn advances it.
    pub turn_id: u64,
    /// Counts responses; starting a response advances it.
    pub response_seq: u64,
}

/// The ordered part of a fence. The derived `Ord` compares the fields in declaration order, which
/// is vllm-omni's tuple comparison `(epoch, turn_id, response_seq)` used by cancellation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FenceKey {
    pub epoch: u64,
    pub turn_id: u64,
    pub response_seq: u64,
}

impl Fence {
    /// The fence of a freshly opened session: every counter at zero for the given incarnation.
    pub fn initial(session_id: impl Into<String>, incarnation: u64) -> Fence {
        Fence { session_id: session_id.into(), incarnation, epoch: 0, turn_id: 0, response_seq: 0 }
    }

    /// The position of this fence, for tuple comparison.
    pub fn key(&self) -> FenceKey {
        FenceKey { epoch: self.epoch, turn_id: self.turn_id, response_seq: self.response_seq }
    }

    /// Whether both fences name the same life of the same session.
    pub fn same_identity(&self, other: &Fence) -> bool {
        self.session_id == other.session_id && self.incarnation == other.incarnation
    }

    /// The fence a cancel of `self` moves to: the next epoch with the same turn and response
    /// counters. Keeping the counters means that turn ids and response numbers never go backwards
    /// over the whole life of a session, so a fence minted by the session before a cancel is
    /// always at or below every fence minted after it.
    pub fn next_epoch(&self) -> Result<Fence> {
        let epoch = checked_increment(self.epoch, "epoch")?;
        Ok(Fence { epoch, ..self.clone() })
    }

    pub(crate) fn with_next_turn(&self) -> Result<Fence> {
        let turn_id = checked_increment(self.turn_id, "turn id")?;
        Ok(Fence { turn_id, ..self.clone() })
    }

    pub(crate) fn with_next_response(&self) -> Result<Fence> {
        let response_seq = checked_increment(self.response_seq, "response seq")?;
        Ok(Fence { response_seq, ..self.clone() })
    }
}

impl fmt::Display for Fence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{{sessionId: {:?}, incarnation: {}, epoch: {}, turnId: {}, responseSeq: {}}}",
            self.session_id, self.incarnation, self.epoch, self.turn_id, self.response_seq
        )
    }
}

/// The error for a fence that does not fit: it names both fences so that a client can see which
/// part of its view is out of date.
pub fn fence_mismatch(expected: &Fence, actual: &Fence) -> OrtexError {
    OrtexError::new(ErrorCode::FenceMismatch, format!("fence mismatch: expected {expected}, got {actual}"))
}

/// vllm-omni's `_validate_fence`: refuses a candidate with another identity, a lower epoch, or
/// (within the same epoch) a lower turn id or a lower response number. A candidate ahead of
/// `current` passes; whether it may then be accepted is the caller's decision.
pub fn validate_fence(current: &Fence, candidate: &Fence) -> Result<()> {
    if !current.same_identity(candidate) {
        return Err(fence_mismatch(current, candidate));
    }
    let lower_epoch = candidate.epoch < current.epoch;
    let lower_within_epoch = candidate.epoch == current.epoch
        && (candidate.turn_id < current.turn_id || candidate.response_seq < current.response_seq);
    if lower_epoch || lower_within_epoch {
        return Err(fence_mismatch(current, candidate));
    }
    Ok(())
}

/// Refuses a candidate that is not exactly `current`. The ortex session mints every fence itself,
/// so a fence ahead of it was never issued and is as wrong as a stale one; commands that act on
/// the present (append, request binding) use this stricter check.
pub fn require_current(current: &Fence, candidate: &Fence) -> Result<()> {
    validate_fence(current, candidate)?;
    if candidate != current {
        return Err(fence_mismatch(current, candidate));
    }
    Ok(())
}

/// Refuses a candidate from another identity or another epoch, ignoring the turn and response
/// counters. Replays are looked up under this check: a retried append may carry the fence it was
/// first sent with, whose turn id the append itself has since advanced.
pub fn require_same_epoch(current: &Fence, candidate: &Fence) -> Result<()> {
    if !current.same_identity(candidate) || candidate.epoch != current.epoch {
        return Err(fence_mismatch(current, candidate));
    }
    Ok(())
}

fn checked_increment(value: u64, what: &str) -> Result<u64> {
    value.checked_add(1).ok_or_else(|| OrtexError::invalid(format!("session {what} is exhausted")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fence(epoch: u64, turn_id: u64, response_seq: u64) -> Fence {
        Fence { session_id: "s".into(), incarnation: 1, epoch, turn_id, response_seq }
    }

    #[test]
    fn lower_epoch_is_refused_with_fence_mismatch() {
        let err = validate_fence(&fence(2, 0, 0), &fence(1, 9, 9)).unwrap_err();
        assert_eq!(err.code, ErrorCode::FenceMismatch);
    }

    #[test]
    fn same_epoch_lower_turn_or_lower_response_is_refused() {
        let current = fence(1, 3, 3);
        assert!(validate_fence(&current, &fence(1, 2, 9)).is_err());
        // vllm-omni's `_validate_fence` compares the counters one by one, not as a tuple: a
        // higher turn id does not excuse a lower response number.
        assert!(validate_fence(&current, &fence(1, 9, 2)).is_err());
        assert!(validate_fence(&current, &fence(1, 3, 3)).is_ok());
    }

    #[test]
    fn other_session_or_incarnation_is_refused() {
        let current = fence(1, 0, 0);
        let mut other_id = current.clone();
        other_id.session_id = "t".into();
        let mut other_incarnation = current.clone();
        other_incarnation.incarnation = 2;
        assert!(validate_fence(&current, &other_id).is_err());
        assert!(validate_fence(&current, &other_incarnation).is_err());
    }

    #[test]
    fn newer_fence_passes_validation_but_not_require_current() {
        let current = fence(1, 1, 1);
        assert!(validate_fence(&current, &fence(2, 0, 0)).is_ok());
        assert!(validate_fence(&current, &fence(1, 2, 1)).is_ok());
        assert_eq!(require_current(&current, &fence(1, 2, 1)).unwrap_err().code, ErrorCode::FenceMismatch);
    }

    #[test]
    fn same_epoch_check_ignores_turn_and_response_counters() {
        let current = fence(1, 5, 5);
        assert!(require_same_epoch(&current, &fence(1, 0, 0)).is_ok());
        assert!(require_same_epoch(&current, &fence(0, 5, 5)).is_err());
        assert!(require_same_epoch(&current, &fence(2, 5, 5)).is_err());
    }

    #[test]
    fn mismatch_message_names_expected_and_actual() {
        let err = validate_fence(&fence(2, 0, 0), &fence(1, 0, 0)).unwrap_err();
        assert!(err.message.contains("expected {sessionId: \"s\", incarnation: 1, epoch: 2"), "{}", err.message);
        assert!(err.message.contains("got {sessionId: \"s\", incarnation: 1, epoch: 1"), "{}", err.message);
    }

    #[test]
    fn key_orders_as_epoch_turn_response_tuple() {
        assert!(fence(2, 0, 0).key() > fence(1, 9, 9).key());
        assert!(fence(1, 2, 0).key() > fence(1, 1, 9).key());
        assert!(fence(1, 1, 2).key() > fence(1, 1, 1).key());
    }

    #[test]
    fn next_epoch_keeps_turn_and_response_counters() {
        let next = fence(1, 4, 7).next_epoch().unwrap();
        assert_eq!(next, fence(2, 4, 7));
        assert_eq!(fence(u64::MAX, 0, 0).next_epoch().unwrap_err().code, ErrorCode::InvalidArgument);
    }
}
