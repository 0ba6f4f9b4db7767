//! The event record, its encoding into a caller's buffer, and the bounded queue of retained
//! events (those a transaction produced beyond the caller's buffer capacity).
//!
//! Encoding: one event is `EVENT_STRIDE_WORDS` little 32-bit words, so the TypeScript side can
//! read an `Int32Array` lazily without any per-event allocation across the boundary:
//!
//! ```text
//! word  0 flags        (Token 1 | TurnFinished 2 | CapacityBlocked 4 | Failed 8 | Retryable 16)
//!       1 request id   (0: engine-level event)
//!       2 turn id      (0: none)
//!       3 token        (-1: none)
//!       4 finish reason code, 5 error code
//!       6 prompt tokens, 7 generated tokens, 8 cached prompt tokens   (usage; set on TurnFinished)
//!       9 usage present (1) or not (0)
//!      10 stop kind (0 none, 1 a stop token sequence, 2 a stop string), 11 its index (-1: none)
//!      12 text start, 13 text length   (UTF-16 units in the run's text; length 0: no text)
//!      14 logprobs offset               (in the run's logprob numbers; -1: none)
//! ```
//!
//! A run's text is one UTF-8 string ([`RunOutput::text`]): each event's text delta is appended to
//! it and the event records where, in UTF-16 units, so the TypeScript side decodes one string per
//! run and slices it per event. Log-probabilities likewise go into one array of numbers
//! ([`RunOutput::logprobs`]), only for turns that asked, each entry laid out as
//! [`LOGPROB_HEAD`] followed by `topCount` times [`LOGPROB_ALTERNATIVE`] (texts in the run's text).

use std::collections::{BTreeMap, VecDeque};

use crate::ids::{RequestId, TurnId};
use crate::output::LogprobsText;

pub const EVENT_STRIDE_WORDS: usize = 15;

/// Word offsets within one event record (the diagram above).
pub mod word {
    pub const FLAGS: usize = 0;
    pub const REQUEST: usize = 1;
    pub const TURN: usize = 2;
    pub const TOKEN: usize = 3;
    pub const FINISH: usize = 4;
    pub const ERROR: usize = 5;
    pub const PROMPT_TOKENS: usize = 6;
    pub const GENERATED_TOKENS: usize = 7;
    pub const CACHED_PROMPT_TOKENS: usize = 8;
    pub const HAS_USAGE: usize = 9;
    pub const STOP_KIND: usize = 10;
    pub const STOP_INDEX: usize = 11;
    pub const TEXT_START: usize = 12;
    pub const TEXT_LENGTH: usize = 13;
    pub const LOGPROBS: usize = 14;

    /// Every word by the name the TypeScript side reads it under.
    pub const ALL: [(&str, usize); super::EVENT_STRIDE_WORDS] = [
        ("flags", FLAGS),
        ("request", REQUEST),
        ("turn", TURN),
        ("token", TOKEN),
        ("finish", FINISH),
        ("error", ERROR),
        ("promptTokens", PROMPT_TOKENS),
        ("generatedTokens", GENERATED_TOKENS),
        ("cachedPromptTokens", CACHED_PROMPT_TOKENS),
        ("hasUsage", HAS_USAGE),
        ("stopKind", STOP_KIND),
        ("stopIndex", STOP_INDEX),
        ("textStart", TEXT_START),
        ("textLength", TEXT_LENGTH),
        ("logprobs", LOGPROBS),
    ];
}

pub mod flags {
    pub const TOKEN: u32 = 1;
    pub const TURN_FINISHED: u32 = 2;
    pub const CAPACITY_BLOCKED: u32 = 4;
    pub const FAILED: u32 = 8;
    pub const RETRYABLE: u32 = 16;
}

/// Which stop sequence ended a turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StopMatch {
    /// `stopTokenIds[index]`, matched by the core in the generated tokens.
    TokenIds(u32),
    /// `stop[index]`, a stop string the core matched in the turn's text (output.rs).
    Text(u32),
}

impl StopMatch {
    /// The names of the kinds, indexed by the event's stop-kind word (0: no stop).
    pub const KIND_NAMES: [&'static str; 3] = ["none", "token-ids", "string"];

    const fn kind_code(self) -> i32 {
        match self {
            StopMatch::TokenIds(_) => 1,
            StopMatch::Text(_) => 2,
        }
    }

    const fn index(self) -> u32 {
        match self {
            StopMatch::TokenIds(index) | StopMatch::Text(index) => index,
        }
    }
}

/// Why a turn ended; a stop carries which stop sequence it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum FinishReason {
    #[default]
    None,
    Eos,
    Stop(StopMatch),
    MaxGeneratedTokens,
    MaxSessionTokens,
    Cancelled,
    Failed,
}

impl FinishReason {
    /// The names of the reasons, indexed by their code (the event's finish word).
    pub const NAMES: [&'static str; 7] =
        ["none", "eos", "stop", "max-generated-tokens", "max-session-tokens", "cancelled", "failed"];

    pub const fn code(self) -> u32 {
        match self {
            FinishReason::None => 0,
            FinishReason::Eos => 1,
            FinishReason::Stop(_) => 2,
            FinishReason::MaxGeneratedTokens => 3,
            FinishReason::MaxSessionTokens => 4,
            FinishReason::Cancelled => 5,
            FinishReason::Failed => 6,
        }
    }

    pub const fn as_str(self) -> &'static str {
        Self::NAMES[self.code() as usize]
    }

    const fn stop(self) -> Option<StopMatch> {
        match self {
            FinishReason::Stop(stop) => Some(stop),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(u8)]
pub enum EventErrorCode {
    #[default]
    None = 0,
    CapacityDeferred = 1,
    ExecutionCapacityExceeded = 2,
    RetryableExecution = 3,
    RequestUnserviceable = 4,
    EngineContractFailure = 5,
    EngineExecutionFailure = 6,
    /// A turn's constraint failed mid-turn (a grammar limit of llguidance's); the turn fails.
    ConstraintFailed = 7,
}

impl EventErrorCode {
    /// Every code, indexed by its value (the event's error word).
    pub const ALL: [EventErrorCode; 8] = [
        EventErrorCode::None,
        EventErrorCode::CapacityDeferred,
        EventErrorCode::ExecutionCapacityExceeded,
        EventErrorCode::RetryableExecution,
        EventErrorCode::RequestUnserviceable,
        EventErrorCode::EngineContractFailure,
        EventErrorCode::EngineExecutionFailure,
        EventErrorCode::ConstraintFailed,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            EventErrorCode::None => "none",
            EventErrorCode::CapacityDeferred => "capacity-deferred",
            EventErrorCode::ExecutionCapacityExceeded => "execution-capacity-exceeded",
            EventErrorCode::RetryableExecution => "retryable-execution",
            EventErrorCode::RequestUnserviceable => "request-unserviceable",
            EventErrorCode::EngineContractFailure => "engine-contract-failure",
            EventErrorCode::EngineExecutionFailure => "engine-execution-failure",
            EventErrorCode::ConstraintFailed => "constraint-failed",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Usage {
    /// This turn's new input only.
    pub prompt_tokens: u32,
    pub generated_tokens: u32,
    pub cached_prompt_tokens: u32,
}

/// The numbers of one log-probability entry in [`RunOutput::logprobs`], by name, before its
/// alternatives.
pub const LOGPROB_HEAD: [&str; 5] = ["token", "logprob", "textStart", "textLength", "topCount"];
/// The numbers of one alternative, `topCount` of them after the head.
pub const LOGPROB_ALTERNATIVE: [&str; 4] = ["token", "logprob", "textStart", "textLength"];

#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub flags: u32,
    pub request: Option<RequestId>,
    pub turn: TurnId,
    pub token: i32,
    pub finish_reason: FinishReason,
    pub error: EventErrorCode,
    pub usage: Option<Usage>,
    /// The text this event adds to its turn's (empty: none).
    pub text: String,
    /// The token's log-probabilities, when its turn asked for them.
    pub logprobs: Option<Box<LogprobsText>>,
}

impl Event {
    pub fn token(request: RequestId, turn: TurnId, token: i32) -> Event {
        Event { token, ..Event::request(request, turn, flags::TOKEN, EventErrorCode::None) }
    }

    /// A request-less event: capacity, retryable, contract or fatal failures of a transaction.
    pub fn engine(flags: u32, error: EventErrorCode) -> Event {
        Event {
            flags,
            request: None,
            turn: TurnId(0),
            token: -1,
            finish_reason: FinishReason::None,
            error,
            usage: None,
            text: String::new(),
            logprobs: None,
        }
    }

    /// A request-scoped event without a token (capacity deferral, a finish with no token).
    pub fn request(request: RequestId, turn: TurnId, flags: u32, error: EventErrorCode) -> Event {
        Event { request: Some(request), turn, ..Event::engine(flags, error) }
    }

    /// Marks this event as the turn's last: adds TurnFinished, the reason and the usage.
    pub fn finish(&mut self, reason: FinishReason, usage: Usage) {
        self.flags |= flags::TURN_FINISHED;
        self.finish_reason = reason;
        self.usage = Some(usage);
        if reason == FinishReason::Failed {
            self.flags |= flags::FAILED;
        }
    }

    /// Adds `more` to the event's text (a finish's held-back text after its token's).
    pub fn append_text(&mut self, more: &str) {
        self.text.push_str(more);
    }

    pub fn is_turn_finished(&self) -> bool {
        self.flags & flags::TURN_FINISHED != 0
    }

    /// Writes the record into `out` and its text and log-probabilities into `run`.
    pub fn encode(&self, out: &mut [i32], run: &mut RunOutput) {
        let usage = self.usage.unwrap_or_default();
        let record = &mut out[..EVENT_STRIDE_WORDS];
        record[word::FLAGS] = self.flags as i32;
        record[word::REQUEST] = self.request.map_or(0, |r| r.0 as i32);
        record[word::TURN] = self.turn.0 as i32;
        record[word::TOKEN] = self.token;
        record[word::FINISH] = self.finish_reason.code() as i32;
        record[word::ERROR] = self.error as i32;
        record[word::PROMPT_TOKENS] = usage.prompt_tokens as i32;
        record[word::GENERATED_TOKENS] = usage.generated_tokens as i32;
        record[word::CACHED_PROMPT_TOKENS] = usage.cached_prompt_tokens as i32;
        record[word::HAS_USAGE] = i32::from(self.usage.is_some());
        let stop = self.finish_reason.stop();
        record[word::STOP_KIND] = stop.map_or(0, StopMatch::kind_code);
        record[word::STOP_INDEX] = stop.map_or(-1, |s| s.index() as i32);
        let (start, length) = run.push_text(&self.text);
        record[word::TEXT_START] = start;
        record[word::TEXT_LENGTH] = length;
        record[word::LOGPROBS] = self.logprobs.as_deref().map_or(-1, |entry| run.push_logprobs(entry));
    }

    /// A 64-bit digest of every field, for cross-target trace comparison.
    pub fn digest(&self, seed: u64) -> u64 {
        let mut words = [0i32; EVENT_STRIDE_WORDS];
        let mut run = RunOutput::default();
        self.encode(&mut words, &mut run);
        let digest = words.iter().fold(seed, |h, &w| crate::rng::hash2(h, w as u32 as u64));
        run.text.bytes().fold(digest, |h, b| crate::rng::hash2(h, u64::from(b)))
    }
}

/// What a run hands over besides its event records: the text of its events, as one string, and
/// the log-probabilities of its token events, as one array of numbers (the module comment).
#[derive(Debug, Default)]
pub struct RunOutput {
    pub text: String,
    /// The length of `text` in UTF-16 units: where the next event's text starts.
    text_units: usize,
    pub logprobs: Vec<f64>,
}

impl RunOutput {
    pub fn clear(&mut self) {
        self.text.clear();
        self.text_units = 0;
        self.logprobs.clear();
    }

    /// Appends `text`; its start and length in UTF-16 units.
    fn push_text(&mut self, text: &str) -> (i32, i32) {
        let start = self.text_units;
        let units = if text.is_ascii() { text.len() } else { text.encode_utf16().count() };
        self.text.push_str(text);
        self.text_units += units;
        (start as i32, units as i32)
    }

    /// Appends one entry (LOGPROB_HEAD, then its alternatives); its offset.
    fn push_logprobs(&mut self, entry: &LogprobsText) -> i32 {
        let offset = self.logprobs.len() as i32;
        let (start, length) = self.push_text(&entry.token_text);
        let head = [f64::from(entry.entry.token), entry.entry.logprob, start.into(), length.into()];
        self.logprobs.extend_from_slice(&head);
        self.logprobs.push(entry.entry.top.len() as f64);
        for (&(token, logprob), text) in entry.entry.top.iter().zip(&entry.top_texts) {
            let (start, length) = self.push_text(text);
            self.logprobs.extend_from_slice(&[f64::from(token), logprob, start.into(), length.into()]);
        }
        offset
    }
}

/// FIFO of events a transaction could not hand over. Bounded at construction: the engine drains
/// it before executing again, so it never holds more than one event per live request per
/// transaction plus one cancellation event per turn and one engine-level event. It also counts
/// each request's events in it (a request with undelivered events may not begin a turn).
#[derive(Debug)]
pub struct RetainedEvents {
    queue: VecDeque<Event>,
    capacity: usize,
    per_request: BTreeMap<RequestId, u32>,
}

impl RetainedEvents {
    pub fn with_capacity(capacity: usize) -> Self {
        RetainedEvents { queue: VecDeque::new(), capacity, per_request: BTreeMap::new() }
    }

    pub fn len(&self) -> usize {
        self.queue.len()
    }

    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    pub fn push(&mut self, event: Event) {
        assert!(self.queue.len() < self.capacity, "retained event queue over its bound of {}", self.capacity);
        if let Some(id) = event.request {
            *self.per_request.entry(id).or_default() += 1;
        }
        self.queue.push_back(event);
    }

    pub fn pop(&mut self) -> Option<Event> {
        let event = self.queue.pop_front()?;
        if let Some(id) = event.request {
            let count = self.per_request.get_mut(&id).expect("a retained event is counted");
            *count -= 1;
            if *count == 0 {
                self.per_request.remove(&id);
            }
        }
        Some(event)
    }

    /// The newest retained event of `request`, for merging a cancellation into a pending token.
    pub fn last_for_mut(&mut self, request: RequestId) -> Option<&mut Event> {
        self.queue.iter_mut().rev().find(|e| e.request == Some(request))
    }

    /// Events of `request` still waiting to be delivered.
    pub fn count_for(&self, request: RequestId) -> u32 {
        self.per_request.get(&request).copied().unwrap_or(0)
    }

    /// Drops every event of `request` (it was closed), returning how many were dropped.
    pub fn remove_request(&mut self, request: RequestId) -> usize {
        let Some(count) = self.per_request.remove(&request) else { return 0 };
        self.queue.retain(|e| e.request != Some(request));
        count as usize
    }

    /// The per-request counts agree with the queue.
    pub fn check_invariants(&self) {
        let mut counted = BTreeMap::<RequestId, u32>::new();
        for id in self.queue.iter().filter_map(|e| e.request) {
            *counted.entry(id).or_default() += 1;
        }
        assert_eq!(counted, self.per_request, "retained event counts drifted");
        assert!(self.queue.len() <= self.capacity, "retained events over their bound");
    }
}
