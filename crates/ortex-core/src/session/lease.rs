//! The session lease: who may drive a session, and when an abandoned one may be reclaimed.
//!
//! This follows `DuplexLeaseState` in vllm-omni's
//! `vllm_omni/experimental/fullduplex/engine/lease.py`, with time passed in as milliseconds
//! instead of read from a clock.
//!
//! ```text
//!             detach(now)                        resume(now, g) with g == generation
//!   attached ------------> detached(at = now) -----------------------------------> attached
//!      |                      |                                    (generation = g + 1)
//!      | idle: now >= last_activity + idle_ttl and no operation in flight
//!      |                      | grace: now >= detached_at + disconnect_grace
//!      v                      v
//!   mark_terminal(reason): one-shot; generation + 1, detached and operations cleared
//! ```
//!
//! A detached lease can also expire through the idle rule (as in the seed): detaching is itself
//! an activity, so with the usual configuration (grace shorter than the idle TTL) the grace ends
//! first, and when both are due the caller reports the disconnect grace.

use std::collections::BTreeSet;

use crate::error::{ErrorCode, OrtexError, Result};

/// The longest operation id the lease keeps, in characters, so that a misbehaving client cannot
/// make the set of operations in flight grow without bound per entry.
pub const MAX_OPERATION_ID_CHARS: usize = 256;

/// The most operations one lease keeps in flight; beyond it `begin_operation` is refused as
/// retryable capacity, because finishing an operation makes room again.
pub const MAX_OPERATIONS_IN_FLIGHT: usize = 1024;

/// The highest generation a resume may produce. The value above it is kept for the bump of
/// `mark_terminal`, so that ending a lease can never overflow.
pub const MAX_RESUMED_GENERATION: u64 = u64::MAX - 1;

/// Idle TTL used when none is configured: five minutes, as in api.md.
pub const DEFAULT_IDLE_TTL_MS: u64 = 300_000;

/// Disconnect grace used when none is configured: thirty seconds, as in api.md.
pub const DEFAULT_DISCONNECT_GRACE_MS: u64 = 30_000;

/// How long a session may stay idle or disconnected before it expires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseConfig {
    /// `None` disables idle expiry; `Some` must be positive.
    pub idle_ttl_ms: Option<u64>,
    /// Must be positive: a zero grace would expire a session in the same instant it detached,
    /// leaving no window in which a resume could succeed.
    pub disconnect_grace_ms: u64,
}

impl Default for LeaseConfig {
    fn default() -> Self {
        LeaseConfig { idle_ttl_ms: Some(DEFAULT_IDLE_TTL_MS), disconnect_grace_ms: DEFAULT_DISCONNECT_GRACE_MS }
    }
}

impl LeaseConfig {
    /// Builds a validated configuration.
    pub fn new(idle_ttl_ms: Option<u64>, disconnect_grace_ms: u64) -> Result<LeaseConfig> {
        let config = LeaseConfig { idle_ttl_ms, disconnect_grace_ms };
        config.validate()?;
        Ok(config)
    }

    /// Refuses a zero idle TTL and a zero grace (seed: both must be positive; the TTL may be null).
    pub fn validate(&self) -> Result<()> {
        if self.idle_ttl_ms == Some(0) {
            return Err(OrtexError::invalid("idleTtlMs must be positive or null"));
        }
        if self.disconnect_grace_ms == 0 {
            return Err(OrtexError::invalid("disconnectGraceMs must be positive"));
        }
        Ok(())
    }
}

/// Counts the attachments of a session: `resume` succeeds only for the caller that names the
/// current value, so of two clients racing to resume the same session exactly one wins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct LeaseGeneration(pub u64);

impl LeaseGeneration {
    pub const fn get(self) -> u64 {
        self.0
    }
}

/// What kept the session alive. The kind does not change the lease arithmetic (every activity
/// refreshes `last_activity_ms`); the latest one is kept so that a diagnosis of an expiry can say
/// what the session last did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LeaseActivity {
    Append,
    Respond,
    Cancel,
    Heartbeat,
    Attach,
    Detach,
    ModelOutput,
    Config,
}

/// The lease of one session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    config: LeaseConfig,
    generation: LeaseGeneration,
    last_activity_ms: u64,
    last_activity: LeaseActivity,
    detached_at_ms: Option<u64>,
    operations_in_flight: BTreeSet<String>,
    terminal_reason: Option<String>,
}

impl Lease {
    /// A fresh, attached lease at generation 0 whose last activity is `now_ms`.
    pub fn new(config: LeaseConfig, now_ms: u64) -> Result<Lease> {
        config.validate()?;
        Ok(Lease {
            config,
            generation: LeaseGeneration(0),
            last_activity_ms: now_ms,
            last_activity: LeaseActivity::Attach,
            detached_at_ms: None,
            operations_in_flight: BTreeSet::new(),
            terminal_reason: None,
        })
    }

    /// A lease taken over at `generation` (a session restored from a store on another process):
    /// attached, as after the resume that brought it here.
    pub fn at_generation(config: LeaseConfig, now_ms: u64, generation: LeaseGeneration) -> Result<Lease> {
        if generation.0 > MAX_RESUMED_GENERATION {
            return Err(OrtexError::invalid("lease generation is exhausted"));
        }
        Ok(Lease { generation, ..Lease::new(config, now_ms)? })
    }

    pub fn config(&self) -> LeaseConfig {
        self.config
    }

    pub fn generation(&self) -> LeaseGeneration {
        self.generation
    }

    pub fn last_activity_ms(&self) -> u64 {
        self.last_activity_ms
    }

    /// The kind of the latest activity, for diagnostics.
    pub fn last_activity(&self) -> LeaseActivity {
        self.last_activity
    }

    pub fn detached_at_ms(&self) -> Option<u64> {
        self.detached_at_ms
    }

    pub fn is_detached(&self) -> bool {
        self.detached_at_ms.is_some()
    }

    pub fn is_terminal(&self) -> bool {
        self.terminal_reason.is_some()
    }

    pub fn terminal_reason(&self) -> Option<&str> {
        self.terminal_reason.as_deref()
    }

    pub fn num_operations_in_flight(&self) -> usize {
        self.operations_in_flight.len()
    }

    /// The instant from which the idle rule applies, or `None` when idle expiry is disabled (or
    /// the deadline is past the end of `u64` time, which means never).
    pub fn idle_expires_at_ms(&self) -> Option<u64> {
        let ttl_ms = self.config.idle_ttl_ms?;
        self.last_activity_ms.checked_add(ttl_ms)
    }

    /// Records an activity at `now_ms`. The last activity never moves backwards, so that a caller
    /// whose clock values arrive out of order cannot shorten a lease it has already extended.
    pub fn touch(&mut self, now_ms: u64, activity: LeaseActivity) -> Result<()> {
        self.require_open()?;
        self.last_activity = activity;
        self.last_activity_ms = self.last_activity_ms.max(now_ms);
        Ok(())
    }

    /// Marks the client as gone. The generation is kept: the next `resume` must name it.
    pub fn detach(&mut self, now_ms: u64) -> Result<()> {
        self.touch(now_ms, LeaseActivity::Detach)?;
        self.detached_at_ms = Some(now_ms);
        Ok(())
    }

    /// Compare-and-swap on the generation: succeeds only when `expected` is the current value,
    /// then clears the detachment, increments the generation and returns the new value.
    pub fn resume(&mut self, now_ms: u64, expected: LeaseGeneration) -> Result<LeaseGeneration> {
        self.require_open()?;
        if expected != self.generation {
            return Err(OrtexError::new(
                ErrorCode::LeaseGenerationMismatch,
                format!("lease generation mismatch: expected {}, got {}", self.generation.0, expected.0),
            ));
        }
        if self.generation.0 >= MAX_RESUMED_GENERATION {
            return Err(OrtexError::invalid("lease generation is exhausted"));
        }
        let next = self.generation.0 + 1;
        self.touch(now_ms, LeaseActivity::Attach)?;
        self.generation = LeaseGeneration(next);
        self.detached_at_ms = None;
        Ok(self.generation)
    }

    /// Starts an operation that must not be cut short by idle expiry (a long prefill, a client
    /// request being served). The same id may not be in flight twice.
    pub fn begin_operation(&mut self, now_ms: u64, operation_id: &str) -> Result<()> {
        self.require_open()?;
        validate_operation_id(operation_id)?;
        if self.operations_in_flight.contains(operation_id) {
            return Err(OrtexError::invalid(format!("lease operation already in flight: {operation_id:?}")));
        }
        if self.operations_in_flight.len() >= MAX_OPERATIONS_IN_FLIGHT {
            return Err(OrtexError::new(ErrorCode::CapacityExhausted, "too many lease operations in flight"));
        }
        self.touch(now_ms, LeaseActivity::Heartbeat)?;
        self.operations_in_flight.insert(operation_id.to_owned());
        Ok(())
    }

    /// Ends an operation started by `begin_operation`; ending one that is not in flight is a
    /// caller error, not a no-op, so that a double end is seen.
    pub fn end_operation(&mut self, now_ms: u64, operation_id: &str) -> Result<()> {
        self.require_open()?;
        if !self.operations_in_flight.contains(operation_id) {
            return Err(OrtexError::invalid(format!("lease operation is not in flight: {operation_id:?}")));
        }
        self.touch(now_ms, LeaseActivity::Heartbeat)?;
        let removed = self.operations_in_flight.remove(operation_id);
        assert!(removed, "an operation checked to be in flight must be removable");
        Ok(())
    }

    /// Whether a detached lease has outlived its disconnect grace: `now >= detached_at + grace`.
    pub fn disconnect_grace_expired(&self, now_ms: u64) -> bool {
        if self.is_terminal() {
            return false;
        }
        let Some(detached_at_ms) = self.detached_at_ms else { return false };
        detached_at_ms.checked_add(self.config.disconnect_grace_ms).is_some_and(|deadline_ms| now_ms >= deadline_ms)
    }

    /// Whether the lease has been idle too long: the idle TTL is set, no operation is in flight,
    /// and `now >= last_activity + idle_ttl`.
    pub fn idle_expired(&self, now_ms: u64) -> bool {
        if self.is_terminal() || !self.operations_in_flight.is_empty() {
            return false;
        }
        self.idle_expires_at_ms().is_some_and(|deadline_ms| now_ms >= deadline_ms)
    }

    /// Ends the lease for good. Returns true only the first time, so exactly one caller gets to
    /// report the end of the session. The generation is bumped so that any resume token issued
    /// before the end is refused, and the in-flight operations are dropped because nothing will
    /// end them now.
    pub fn mark_terminal(&mut self, reason: &str) -> bool {
        if self.terminal_reason.is_some() {
            return false;
        }
        self.terminal_reason = Some(reason.to_owned());
        assert!(self.generation.0 < u64::MAX, "resume keeps the last generation for the terminal bump");
        self.generation = LeaseGeneration(self.generation.0 + 1);
        self.detached_at_ms = None;
        self.operations_in_flight.clear();
        true
    }

    /// Checks the lease's own accounting; panics on a broken invariant.
    pub fn check_invariants(&self) {
        assert!(self.config.validate().is_ok(), "lease config must stay valid");
        assert!(self.operations_in_flight.len() <= MAX_OPERATIONS_IN_FLIGHT, "operations in flight are bounded");
        if self.is_terminal() {
            assert!(self.detached_at_ms.is_none(), "a terminal lease is not detached");
            assert!(self.operations_in_flight.is_empty(), "a terminal lease has no operation in flight");
        }
        if let Some(detached_at_ms) = self.detached_at_ms {
            assert!(detached_at_ms <= self.last_activity_ms, "detaching is an activity");
        }
    }

    fn require_open(&self) -> Result<()> {
        match &self.terminal_reason {
            Some(reason) => {
                Err(OrtexError::new(ErrorCode::SessionClosed, format!("session lease has ended: {reason}")))
            }
            None => Ok(()),
        }
    }
}

/// Refuses empty and oversized operation ids.
pub fn validate_operation_id(operation_id: &str) -> Result<()> {
    if operation_id.is_empty() {
        return Err(OrtexError::invalid("operationId must not be empty"));
    }
    if longer_than(operation_id, MAX_OPERATION_ID_CHARS) {
        return Err(OrtexError::invalid(format!("operationId is longer than {MAX_OPERATION_ID_CHARS} characters")));
    }
    Ok(())
}

/// Whether `text` holds more than `max_chars` characters (Unicode scalar values). A string of at
/// most `max_chars` bytes is short enough without counting.
pub fn longer_than(text: &str, max_chars: usize) -> bool {
    text.len() > max_chars && text.chars().count() > max_chars
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(idle_ttl_ms: Option<u64>, disconnect_grace_ms: u64) -> Lease {
        Lease::new(LeaseConfig::new(idle_ttl_ms, disconnect_grace_ms).unwrap(), 1_000).unwrap()
    }

    #[test]
    fn resume_needs_the_expected_generation() {
        let mut lease = lease(Some(100), 10);
        lease.detach(1_005).unwrap();
        let err = lease.resume(1_006, LeaseGeneration(7)).unwrap_err();
        assert_eq!(err.code, ErrorCode::LeaseGenerationMismatch);
        assert!(lease.is_detached(), "a refused resume changes nothing");
        assert_eq!(lease.resume(1_006, LeaseGeneration(0)).unwrap(), LeaseGeneration(1));
        assert!(!lease.is_detached());
        // The old generation is spent: a second client holding it loses the race.
        assert_eq!(lease.resume(1_007, LeaseGeneration(0)).unwrap_err().code, ErrorCode::LeaseGenerationMismatch);
        lease.check_invariants();
    }

    #[test]
    fn detach_keeps_generation() {
        let mut lease = lease(Some(100), 10);
        lease.detach(1_001).unwrap();
        assert_eq!(lease.generation(), LeaseGeneration(0));
        assert_eq!(lease.detached_at_ms(), Some(1_001));
    }

    #[test]
    fn an_active_operation_prevents_expiry() {
        let mut lease = lease(Some(100), 10);
        lease.begin_operation(1_000, "op").unwrap();
        assert!(!lease.idle_expired(5_000));
        lease.end_operation(1_050, "op").unwrap();
        assert!(!lease.idle_expired(1_149));
        assert!(lease.idle_expired(1_150));
    }

    #[test]
    fn idle_ttl_disabled_never_expires() {
        let lease = lease(None, 10);
        assert_eq!(lease.idle_expires_at_ms(), None);
        assert!(!lease.idle_expired(u64::MAX));
    }

    #[test]
    fn idle_expires_exactly_at_the_deadline() {
        let lease = lease(Some(100), 10);
        assert!(!lease.idle_expired(1_099));
        assert!(lease.idle_expired(1_100));
    }

    #[test]
    fn disconnect_grace_expires_at_detached_plus_grace() {
        let mut lease = lease(None, 10);
        assert!(!lease.disconnect_grace_expired(u64::MAX), "an attached lease has no grace deadline");
        lease.detach(2_000).unwrap();
        assert!(!lease.disconnect_grace_expired(2_009));
        assert!(lease.disconnect_grace_expired(2_010));
    }

    #[test]
    fn mark_terminal_is_one_shot() {
        let mut lease = lease(Some(100), 10);
        lease.detach(1_001).unwrap();
        lease.begin_operation(1_001, "op").unwrap();
        assert!(lease.mark_terminal("first"));
        assert!(!lease.mark_terminal("second"));
        assert_eq!(lease.terminal_reason(), Some("first"));
        assert_eq!(lease.generation(), LeaseGeneration(1));
        assert!(!lease.disconnect_grace_expired(u64::MAX));
        assert!(!lease.idle_expired(u64::MAX));
        lease.check_invariants();
    }

    #[test]
    fn terminal_lease_refuses_activity() {
        let mut lease = lease(Some(100), 10);
        lease.mark_terminal("done");
        assert_eq!(lease.touch(1_001, LeaseActivity::Heartbeat).unwrap_err().code, ErrorCode::SessionClosed);
        assert_eq!(lease.resume(1_001, LeaseGeneration(1)).unwrap_err().code, ErrorCode::SessionClosed);
        assert_eq!(lease.begin_operation(1_001, "op").unwrap_err().code, ErrorCode::SessionClosed);
    }

    #[test]
    fn operation_ids_are_checked() {
        let mut lease = lease(Some(100), 10);
        assert_eq!(lease.begin_operation(1_000, "").unwrap_err().code, ErrorCode::InvalidArgument);
        lease.begin_operation(1_000, "op").unwrap();
        assert_eq!(lease.begin_operation(1_000, "op").unwrap_err().code, ErrorCode::InvalidArgument);
        assert_eq!(lease.end_operation(1_000, "other").unwrap_err().code, ErrorCode::InvalidArgument);
        let long = "x".repeat(MAX_OPERATION_ID_CHARS + 1);
        assert_eq!(lease.begin_operation(1_000, &long).unwrap_err().code, ErrorCode::InvalidArgument);
        // The limit counts characters: 256 two-byte characters (512 bytes) are allowed.
        let accented = "é".repeat(MAX_OPERATION_ID_CHARS);
        lease.begin_operation(1_000, &accented).unwrap();
        assert!(
            !longer_than(&accented, MAX_OPERATION_ID_CHARS)
                && longer_than(&format!("{accented}é"), MAX_OPERATION_ID_CHARS)
        );
    }

    #[test]
    fn config_rejects_zero_ttl_and_zero_grace() {
        assert!(LeaseConfig::new(Some(0), 10).is_err());
        assert!(LeaseConfig::new(Some(1), 0).is_err());
        assert!(LeaseConfig::new(None, 1).is_ok());
        assert_eq!(LeaseConfig::default().idle_ttl_ms, Some(300_000));
        assert_eq!(LeaseConfig::default().disconnect_grace_ms, 30_000);
    }

    #[test]
    fn last_activity_never_moves_backwards() {
        let mut lease = lease(Some(100), 10);
        lease.touch(900, LeaseActivity::Append).unwrap();
        assert_eq!(lease.last_activity_ms(), 1_000);
    }
}
