//! A request and its turns: the state machine.
//!
//! ```text
//!   Created ──begin_turn──▶ Queued ──first token──▶ Active ──finish──▶ TurnComplete
//!                              ▲                                           │
//!                              └──────────────── begin_turn ───────────────┘
//!   any state ──close──▶ Closed
//! ```
//!
//! `tokens` is the whole context: every prompt, prefill and generated token. `kv_len` of them
//! have their KV computed and committed; the rest are pending. While a turn runs there is always
//! at least one pending token: its input, or the last sampled token (not yet in the KV).
//!
//! A request's KV blocks are the KV manager's (kv/manager.rs), its place in the waiting order
//! the scheduler's, its undelivered events the retained queue's: here is only what the request
//! is. Its life:
//!
//! ```text
//!   Open ──handle dropped──▶ Abandoned ──next owner boundary──▶ Closed ──unpinned──▶ removed
//!     └─────────────────────── close ────────────────────────────▶┘   (by the engine only)
//! ```

use crate::constraint::TurnConstraint;
use crate::events::{FinishReason, StopMatch, Usage};
use crate::ids::{RequestId, TurnId};
use crate::kv::KvHandle;
use crate::options::ResolvedTurnOptions;
use crate::output::TurnText;
use crate::rng::Rng;

/// The public view of a request's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestState {
    Created,
    Queued,
    Active,
    TurnComplete,
    Closed,
}

impl RequestState {
    /// Every state, indexed by its code.
    pub const ALL: [RequestState; 5] = [
        RequestState::Created,
        RequestState::Queued,
        RequestState::Active,
        RequestState::TurnComplete,
        RequestState::Closed,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            RequestState::Created => "created",
            RequestState::Queued => "queued",
            RequestState::Active => "active",
            RequestState::TurnComplete => "turn-complete",
            RequestState::Closed => "closed",
        }
    }

    pub const fn code(self) -> u32 {
        self as u32
    }
}

#[derive(Debug, Clone)]
pub struct Turn {
    pub id: TurnId,
    pub options: ResolvedTurnOptions,
    /// This turn's new input only: `tokens[prompt_start..prompt_start + prompt_tokens]`.
    pub prompt_tokens: u32,
    pub prompt_start: u32,
    /// Of those, the tokens whose KV came from the prefix cache instead of being computed.
    pub cached_prompt_tokens: u32,
    pub generated_tokens: u32,
    pub rng: Rng,
    /// Held by its consumer (Engine::hold_turn): the scheduler plans no row for it until it is
    /// released. It lives on the turn, so that it ends with it (finish, cancel, close).
    pub held: bool,
    /// Its text so far: the detokenizer and stop strings (output.rs).
    pub text: TurnText,
    /// The turn's constraint, where its grammar is; None also while its row's draw carries it
    /// (draws.rs), from plan to commit.
    pub constraint: Option<Box<TurnConstraint>>,
}

impl Turn {
    pub fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens,
            generated_tokens: self.generated_tokens,
            cached_prompt_tokens: self.cached_prompt_tokens,
        }
    }
}

/// What a finished turn leaves on its request: which turn it was, why it ended, and where its
/// generated tokens are in the context (until a truncation or a later input moves past them). A
/// conversation (crates/ortex-boundary/src/conversation.rs) reads it to tell whether the context
/// still ends with the reply as the model wrote it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FinishedTurn {
    pub id: TurnId,
    pub reason: FinishReason,
    /// `tokens[generated_start..generated_start + generated_tokens]`.
    pub generated_start: u32,
    pub generated_tokens: u32,
}

/// Where a request is in its life (see the module diagram).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifecycle {
    Open,
    /// The caller dropped its last handle; the engine closes it at its next owner boundary.
    Abandoned,
    /// Closed; its blocks wait for the step in flight or its static batch to let go of them.
    Closed,
}

#[derive(Debug, Clone)]
// A request holds one slot, live while its turn runs: boxing the turn would add an allocation
// and an indirection per turn to save memory only on requests between turns.
#[allow(clippy::large_enum_variant)]
pub enum TurnSlot {
    /// No turn was ever begun.
    Never,
    Running(Turn),
    Complete(FinishedTurn),
}

#[derive(Debug, Clone)]
pub struct Request {
    pub id: RequestId,
    /// The request's table in the KV manager (only the manager reads what it points at).
    pub kv: KvHandle,
    pub max_session_tokens: u32,
    pub tokens: Vec<i32>,
    pub kv_len: u32,
    pub turn: TurnSlot,
    pub last_turn_id: u32,
    /// `prefill()` asked for the KV of `tokens[..prefill_target]` without a turn.
    pub prefill_target: u32,
    pub lifecycle: Lifecycle,
}

impl Request {
    pub fn new(id: RequestId, kv: KvHandle, max_session_tokens: u32) -> Request {
        Request {
            id,
            kv,
            max_session_tokens,
            tokens: Vec::new(),
            kv_len: 0,
            turn: TurnSlot::Never,
            last_turn_id: 0,
            prefill_target: 0,
            lifecycle: Lifecycle::Open,
        }
    }

    pub fn is_closed(&self) -> bool {
        self.lifecycle == Lifecycle::Closed
    }

    pub fn state(&self) -> RequestState {
        if self.is_closed() {
            return RequestState::Closed;
        }
        match &self.turn {
            TurnSlot::Never => RequestState::Created,
            TurnSlot::Running(t) if t.generated_tokens == 0 => RequestState::Queued,
            TurnSlot::Running(_) => RequestState::Active,
            TurnSlot::Complete(_) => RequestState::TurnComplete,
        }
    }

    pub fn running_turn(&self) -> Option<&Turn> {
        match &self.turn {
            TurnSlot::Running(t) => Some(t),
            _ => None,
        }
    }

    /// The last turn, once it has finished.
    pub fn finished_turn(&self) -> Option<&FinishedTurn> {
        match &self.turn {
            TurnSlot::Complete(finished) => Some(finished),
            _ => None,
        }
    }

    pub fn running_turn_mut(&mut self) -> Option<&mut Turn> {
        match &mut self.turn {
            TurnSlot::Running(t) => Some(t),
            _ => None,
        }
    }

    pub fn token_count(&self) -> u32 {
        self.tokens.len() as u32
    }

    /// The end of the tokens this request wants computed now (0 when it wants nothing).
    pub fn compute_target(&self) -> u32 {
        if self.is_closed() {
            return 0;
        }
        match self.turn {
            TurnSlot::Running(_) => self.token_count(),
            _ => self.prefill_target,
        }
    }

    pub fn needs_compute(&self) -> bool {
        self.compute_target() > self.kv_len
    }

    /// Whether its running turn is held (Engine::hold_turn).
    pub fn is_held(&self) -> bool {
        self.running_turn().is_some_and(|t| t.held)
    }

    /// Whether the scheduler may plan a row for it now: it needs compute and is not held. A held
    /// request keeps its blocks and its place in the waiting order, but counts as idle.
    pub fn wants_step(&self) -> bool {
        self.needs_compute() && !self.is_held()
    }

    /// A decode row: a turn that already produced tokens and has only its last one pending.
    pub fn is_decoding(&self) -> bool {
        matches!(&self.turn, TurnSlot::Running(t) if t.generated_tokens > 0) && self.token_count() == self.kv_len + 1
    }

    /// Starts a turn over input already appended to `tokens`.
    pub fn transition_to_queued(
        &mut self,
        options: ResolvedTurnOptions,
        prompt_tokens: u32,
        rng: Rng,
        constraint: Option<Box<TurnConstraint>>,
    ) -> TurnId {
        assert!(
            !self.is_closed() && self.running_turn().is_none(),
            "request {} begins a turn while one runs",
            self.id.0
        );
        self.last_turn_id += 1;
        let id = TurnId(self.last_turn_id);
        let prompt_start = self.token_count() - prompt_tokens;
        let text = TurnText::new(options.stop.clone());
        let turn = Turn {
            id,
            text,
            options,
            prompt_tokens,
            prompt_start,
            cached_prompt_tokens: 0,
            generated_tokens: 0,
            rng,
            held: false,
            constraint,
        };
        self.turn = TurnSlot::Running(turn);
        id
    }

    /// The KV of `tokens[kv_len..kv_len + count]` came from the prefix cache; a running turn
    /// still in its prompt counts what of it is its own prompt (once it has generated, its prompt
    /// was computed, and what a recomputation after preemption attaches is not counted).
    pub fn attach_cached(&mut self, count: u32) {
        let (start, end) = (self.kv_len, self.kv_len + count);
        self.kv_len = end;
        if let Some(turn) = self.running_turn_mut().filter(|turn| turn.generated_tokens == 0) {
            let prompt_end = turn.prompt_start + turn.prompt_tokens;
            turn.cached_prompt_tokens += prompt_end.min(end).saturating_sub(turn.prompt_start.max(start));
        }
    }

    /// Ends the running turn, returning its id and usage.
    pub fn transition_to_turn_complete(&mut self, reason: FinishReason) -> (TurnId, Usage) {
        let TurnSlot::Running(turn) = &self.turn else {
            panic!("request {} finishes ({}) with no running turn", self.id.0, reason.as_str());
        };
        let (id, usage) = (turn.id, turn.usage());
        let generated_start = turn.prompt_start + turn.prompt_tokens;
        assert_eq!(
            generated_start + turn.generated_tokens,
            self.token_count(),
            "request {}: turn {} does not end its context",
            self.id.0,
            id.0
        );
        let finished = FinishedTurn { id, reason, generated_start, generated_tokens: turn.generated_tokens };
        self.turn = TurnSlot::Complete(finished);
        (id, usage)
    }

    /// The caller dropped its last handle; returns whether this call abandoned it.
    pub fn transition_to_abandoned(&mut self) -> bool {
        if self.lifecycle != Lifecycle::Open {
            return false;
        }
        self.lifecycle = Lifecycle::Abandoned;
        true
    }

    pub fn transition_to_closed(&mut self) {
        assert!(!self.is_closed(), "request {} closed twice", self.id.0);
        self.lifecycle = Lifecycle::Closed;
        if self.running_turn().is_some() {
            self.transition_to_turn_complete(FinishReason::Cancelled);
        }
        self.prefill_target = 0;
    }

    /// Drops the tokens past `token_count` between turns. The computed KV shrinks with them (the
    /// caller then truncates the request's blocks to the new `kv_len`), and a pending prefill
    /// shrinks to what is left of it.
    ///
    /// ```text
    ///   before:  tokens [0 ............................ n)   kv_len k
    ///   after:   tokens [0 ......... c)                      kv_len min(k, c)
    /// ```
    pub fn truncate_to(&mut self, token_count: u32) {
        assert!(!self.is_closed(), "request {} truncated after close", self.id.0);
        assert!(self.running_turn().is_none(), "request {} truncated while a turn runs", self.id.0);
        assert!(token_count <= self.token_count(), "request {} truncated past its end", self.id.0);
        self.tokens.truncate(token_count as usize);
        self.kv_len = self.kv_len.min(token_count);
        let prefill_target = self.prefill_target.min(token_count);
        self.prefill_target = if prefill_target > self.kv_len { prefill_target } else { 0 };
    }

    /// Preempted: the KV is given up and recomputed later; a pending prefill without a turn is
    /// given up with it (its caller asked only for the KV).
    pub fn transition_to_preempted(&mut self) {
        self.kv_len = 0;
        // Preempted in its prompt: what the prefix cache gives back at its next admission is
        // counted then.
        if let Some(turn) = self.running_turn_mut().filter(|turn| turn.generated_tokens == 0) {
            turn.cached_prompt_tokens = 0;
        }
        if self.running_turn().is_none() {
            self.prefill_target = 0;
        }
    }

    /// Why the turn ends after `token` was appended, if it does. Order: eos, stop,
    /// max-generated-tokens, max-session-tokens.
    pub fn finish_reason_after(&self, token: i32, eos_token_ids: &[i32]) -> Option<FinishReason> {
        let turn = self.running_turn()?;
        let ends_turn = eos_token_ids.contains(&token) || turn.options.eos_token_ids.contains(&token);
        if !turn.options.ignore_eos && ends_turn {
            return Some(FinishReason::Eos);
        }
        let generated = &self.tokens[self.tokens.len() - turn.generated_tokens as usize..];
        if let Some(index) = turn.options.stop_token_ids.iter().position(|s| generated.ends_with(s)) {
            return Some(FinishReason::Stop(StopMatch::TokenIds(index as u32)));
        }
        if turn.options.max_generated_tokens > 0 && turn.generated_tokens >= turn.options.max_generated_tokens {
            return Some(FinishReason::MaxGeneratedTokens);
        }
        if self.token_count() >= self.max_session_tokens {
            return Some(FinishReason::MaxSessionTokens);
        }
        None
    }
}
