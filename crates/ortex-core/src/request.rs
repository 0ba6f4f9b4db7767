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

use crate::events::{FinishReason, Usage};
use crate::ids::{BlockId, RequestId, TurnId};
use crate::kv::blocks_for_tokens;
use crate::options::ResolvedTurnOptions;
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
    /// This turn's new input only.
    pub prompt_tokens: u32,
    pub generated_tokens: u32,
    pub rng: Rng,
}

impl Turn {
    pub fn usage(&self) -> Usage {
        Usage { prompt_tokens: self.prompt_tokens, generated_tokens: self.generated_tokens, cached_prompt_tokens: 0 }
    }
}

#[derive(Debug, Clone)]
pub enum TurnSlot {
    /// No turn was ever begun.
    Never,
    Running(Turn),
    Complete,
}

#[derive(Debug, Clone)]
pub struct Request {
    pub id: RequestId,
    pub max_session_tokens: u32,
    pub tokens: Vec<i32>,
    pub kv_len: u32,
    pub blocks: Vec<BlockId>,
    /// Table length before the current transaction: blocks past it are this step's reservations.
    pub blocks_before_step: u32,
    pub turn: TurnSlot,
    pub last_turn_id: u32,
    /// `prefill()` asked for the KV of `tokens[..prefill_target]` without a turn.
    pub prefill_target: u32,
    /// Events of this request still in the engine's retained queue.
    pub retained_events: u32,
    /// Arrival order among waiting prefills (set when the request starts waiting).
    pub waiting_seq: u64,
    /// Consecutive steps this request waited for a prefill row without getting one.
    pub starved_steps: u32,
    /// A CapacityBlocked event was already published for the current wait.
    pub capacity_notified: bool,
    /// The step whose plan gave this request a row (guards against two rows in one step).
    pub planned_step: Option<u64>,
    pub closed: bool,
    pub abandoned: bool,
}

impl Request {
    pub fn new(id: RequestId, max_session_tokens: u32) -> Request {
        Request {
            id,
            max_session_tokens,
            tokens: Vec::new(),
            kv_len: 0,
            blocks: Vec::new(),
            blocks_before_step: 0,
            turn: TurnSlot::Never,
            last_turn_id: 0,
            prefill_target: 0,
            retained_events: 0,
            waiting_seq: 0,
            starved_steps: 0,
            capacity_notified: false,
            planned_step: None,
            closed: false,
            abandoned: false,
        }
    }

    pub fn state(&self) -> RequestState {
        if self.closed {
            return RequestState::Closed;
        }
        match &self.turn {
            TurnSlot::Never => RequestState::Created,
            TurnSlot::Running(t) if t.generated_tokens == 0 => RequestState::Queued,
            TurnSlot::Running(_) => RequestState::Active,
            TurnSlot::Complete => RequestState::TurnComplete,
        }
    }

    pub fn running_turn(&self) -> Option<&Turn> {
        match &self.turn {
            TurnSlot::Running(t) => Some(t),
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
        if self.closed {
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

    /// A decode row: a turn that already produced tokens and has only its last one pending.
    pub fn is_decoding(&self) -> bool {
        matches!(&self.turn, TurnSlot::Running(t) if t.generated_tokens > 0) && self.token_count() == self.kv_len + 1
    }

    /// Starts a turn over input already appended to `tokens`.
    pub fn transition_to_queued(&mut self, options: ResolvedTurnOptions, prompt_tokens: u32, rng: Rng) -> TurnId {
        assert!(!self.closed && self.running_turn().is_none(), "request {} begins a turn while one runs", self.id.0);
        self.last_turn_id += 1;
        let id = TurnId(self.last_turn_id);
        self.turn = TurnSlot::Running(Turn { id, options, prompt_tokens, generated_tokens: 0, rng });
        id
    }

    /// Ends the running turn, returning its id and usage.
    pub fn transition_to_turn_complete(&mut self, reason: FinishReason) -> (TurnId, Usage) {
        let TurnSlot::Running(turn) = std::mem::replace(&mut self.turn, TurnSlot::Complete) else {
            panic!("request {} finishes ({}) with no running turn", self.id.0, reason.as_str());
        };
        (turn.id, turn.usage())
    }

    pub fn transition_to_closed(&mut self) {
        assert!(!self.closed, "request {} closed twice", self.id.0);
        self.closed = true;
        if self.running_turn().is_some() {
            self.turn = TurnSlot::Complete;
        }
        self.prefill_target = 0;
    }

    /// Drops the tokens past `token_count` between turns. The computed KV shrinks with them, a
    /// pending prefill shrinks to what is left of it, and the blocks past the last one the
    /// remaining KV needs are returned for the caller to free.
    ///
    /// ```text
    ///   before:  tokens [0 ............................ n)   kv_len k, blocks ceil(k / B)
    ///   after:   tokens [0 ......... c)                      kv_len min(k, c), blocks ceil(kv_len / B)
    /// ```
    pub fn truncate_to(&mut self, token_count: u32, block_size: u32) -> Vec<BlockId> {
        assert!(!self.closed, "request {} truncated after close", self.id.0);
        assert!(self.running_turn().is_none(), "request {} truncated while a turn runs", self.id.0);
        assert!(token_count <= self.token_count(), "request {} truncated past its end", self.id.0);
        let kept_blocks = blocks_for_tokens(self.kv_len, block_size) as usize;
        assert_eq!(kept_blocks, self.blocks.len(), "request {} holds blocks past its KV between steps", self.id.0);
        self.tokens.truncate(token_count as usize);
        self.kv_len = self.kv_len.min(token_count);
        let prefill_target = self.prefill_target.min(token_count);
        self.prefill_target = if prefill_target > self.kv_len { prefill_target } else { 0 };
        let keep = blocks_for_tokens(self.kv_len, block_size) as usize;
        self.blocks.split_off(keep)
    }

    /// Why the turn ends after `token` was appended, if it does. Order: eos, stop,
    /// max-generated-tokens, max-session-tokens.
    pub fn finish_reason_after(&self, token: i32, eos_token_ids: &[i32]) -> Option<FinishReason> {
        let turn = self.running_turn()?;
        if !turn.options.ignore_eos && eos_token_ids.contains(&token) {
            return Some(FinishReason::Eos);
        }
        let generated = &self.tokens[self.tokens.len() - turn.generated_tokens as usize..];
        if turn.options.stop_token_ids.iter().any(|s| generated.ends_with(s)) {
            return Some(FinishReason::Stop);
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
