//! The owner: requests, the block pool, the scheduler, the retained events and the executor.
//!
//! `run` either drains retained events (no model work) or executes at most one transaction:
//! `plan` (scheduler) -> `execute` (executor) -> `commit` (here). The transaction can leave the
//! engine ([`RunStart::Execute`]) so a binding can execute it on another thread while the engine
//! keeps accepting begin / cancel / close calls; [`Engine::run_commit`] applies it afterwards.
//!
//! The [`Engine`] is the one owner of all of that state; its methods are grouped by what they do:
//!
//! - this file: construction, close and health, the text codec, the checks every call starts with,
//!   and the accounting invariants;
//! - requests.rs: the request and turn API (create, begin, prefill, truncate, cancel, hold, close)
//!   and the owner boundary's reclaiming of abandoned and closed requests;
//! - run.rs: `run` and its two halves, `run_begin` (drain or plan) and `run_commit`, and how
//!   events are staged, published or retained;
//! - commit.rs: what a committed step does to its rows' requests and turns (tokens, text, endings);
//! - transaction.rs: the [`Transaction`] that leaves the engine to execute, and [`RunStart`].

use std::sync::Arc;

use crate::constraint::Constraints;
use crate::draws::Draws;
use crate::error::{ErrorCode, OrtexError, Result};
use crate::events::{Event, RetainedEvents, RunOutput};
use crate::executor::{Executor, KvGeometry, StepOutput, StepPlan};
use crate::ids::RequestId;
use crate::kv::{KvManager, PagedKv, StepReservation};
use crate::options::{EngineConfig, EngineOptions, SimOptions};
use crate::request::{Lifecycle, Request};
use crate::request_table::RequestTable;
use crate::scheduler::Scheduler;
use crate::sim::SimExecutor;
use crate::text::{ClosedCodec, SimText, TextCodec};

mod commit;
mod requests;
mod run;
mod transaction;

pub use transaction::{RunStart, Transaction};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineStats {
    pub total_blocks: u32,
    /// Blocks a new reservation may take: never used, or held only by the prefix cache
    /// (evictable).
    pub free_blocks: u32,
    pub active_requests: u32,
    pub pending_turns: u32,
    pub retained_events: u32,
    pub steps: u64,
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    pub virtual_time_us: u64,
    /// Blocks the prefix cache can find by hash (in use or evictable).
    pub cached_blocks: u32,
    /// Full prompt blocks looked up in the prefix cache (every lookup counted).
    pub prefix_cache_lookups: u64,
    /// Of those, the blocks found and attached instead of computed.
    pub prefix_cache_hits: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Health {
    Healthy,
    Unhealthy(String),
}

/// The step that left the engine to execute: its number and the blocks it reserved.
struct InFlight {
    step: u64,
    reservation: StepReservation,
}

pub struct Engine {
    config: EngineConfig,
    seed: u64,
    /// The only owner of requests: only the engine inserts and removes them.
    requests: RequestTable,
    /// The only owner of KV blocks and block tables.
    kv: Box<dyn KvManager>,
    scheduler: Scheduler,
    retained: RetainedEvents,
    executor: Option<Box<dyn Executor>>,
    codec: Arc<dyn TextCodec>,
    /// Compiles turns' constraints (its token environment is built on first use).
    constraints: Constraints,
    spare: Option<(StepPlan, StepOutput, Box<Draws>)>,
    /// Events of the transaction being committed, before they reach the buffer or the queue.
    staged: Vec<Event>,
    /// The text and log-probabilities of the events the last run wrote (events.rs).
    run_output: RunOutput,
    /// Requests in each non-open lifecycle state (counts of what `requests` holds, so that an
    /// owner boundary with nothing to reclaim or release scans nothing; checked by
    /// check_invariants).
    num_abandoned: u32,
    num_closed: u32,
    next_request_id: u32,
    in_flight: Option<InFlight>,
    health: Health,
    closed: bool,
    stats: EngineStats,
}

impl Engine {
    pub fn new(
        options: &EngineOptions,
        mut executor: Box<dyn Executor>,
        codec: Box<dyn TextCodec>,
        seed: u64,
    ) -> Result<Engine> {
        let config = EngineConfig::resolve(options, &executor.model_info())?;
        let full_block_tables = executor.needs_full_block_tables();
        executor.attach_kv(KvGeometry { num_blocks: config.num_blocks, block_size: config.block_size })?;
        let retained_bound = 2 * config.max_requests as usize + 2;
        Ok(Engine {
            kv: Box::new(PagedKv::new(config.num_blocks, config.block_size, config.prefix_caching)),
            stats: EngineStats { total_blocks: config.num_blocks, ..EngineStats::default() },
            config,
            seed,
            requests: RequestTable::default(),
            scheduler: Scheduler::new(full_block_tables),
            retained: RetainedEvents::with_capacity(retained_bound),
            executor: Some(executor),
            codec: Arc::from(codec),
            constraints: Constraints::default(),
            spare: Some(Default::default()),
            staged: Vec::new(),
            run_output: RunOutput::default(),
            num_abandoned: 0,
            num_closed: 0,
            next_request_id: 1,
            in_flight: None,
            health: Health::Healthy,
            closed: false,
        })
    }

    /// An engine over the deterministic simulated model.
    pub fn simulated(options: &SimOptions) -> Result<Engine> {
        let executor = SimExecutor::new(options)?;
        let codec = SimText { vocab_size: executor.model_info().vocab_size };
        Engine::new(&options.engine, Box::new(executor), Box::new(codec), options.seed.unwrap_or(0))
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Closes every request and releases the model (the executor with its KV storage, and the
    /// text codec) at once, or when the step in flight returns; afterwards only `close` and
    /// `close_request` are accepted.
    pub fn close(&mut self) {
        if self.closed {
            return;
        }
        let ids: Vec<RequestId> = self.requests.keys().copied().collect();
        for id in ids {
            self.close_request(id).expect("a live request closes");
        }
        self.closed = true;
        self.executor = None;
        self.codec = Arc::new(ClosedCodec);
    }

    pub fn is_closed(&self) -> bool {
        self.closed
    }

    pub fn is_healthy(&self) -> bool {
        self.health == Health::Healthy
    }

    /// Marks the engine unhealthy from outside (a binding caught a panic, say).
    pub fn mark_unhealthy(&mut self, reason: &str) {
        self.health = Health::Unhealthy(reason.to_string());
        self.reclaim_abandoned_if_unhealthy();
    }

    pub fn stats(&self) -> EngineStats {
        let cache = self.kv.cache_counters();
        EngineStats {
            free_blocks: self.kv.num_free_blocks(),
            active_requests: self.requests.values().filter(|r| !r.is_closed()).count() as u32,
            pending_turns: self.requests.values().filter(|r| r.running_turn().is_some()).count() as u32,
            retained_events: self.retained.len() as u32,
            cached_blocks: cache.cached_blocks,
            prefix_cache_lookups: cache.lookups,
            prefix_cache_hits: cache.hits,
            ..self.stats
        }
    }

    pub fn tokenize(&self, text: &str) -> Result<Vec<i32>> {
        self.check_open()?;
        self.codec.tokenize(text)
    }

    /// A text that starts a context, with the tokenizer's prompt prefix (its BOS).
    pub fn tokenize_prompt(&self, text: &str) -> Result<Vec<i32>> {
        self.check_open()?;
        self.codec.tokenize_prompt(text)
    }

    pub fn detokenize(&self, tokens: &[i32]) -> Result<String> {
        self.check_open()?;
        self.codec.detokenize(tokens)
    }

    /// The text codec, shared: a binding tokenizes a long prompt with it off the JS thread while
    /// the engine goes on (the codec is immutable; closing the engine drops only its own handle).
    pub fn text_codec(&self) -> Result<Arc<dyn TextCodec>> {
        self.check_open()?;
        Ok(Arc::clone(&self.codec))
    }

    /// The codec's control strings (TextCodec::control_strings).
    pub fn control_strings(&self) -> Result<Vec<String>> {
        self.check_open()?;
        Ok(self.codec.control_strings())
    }

    /// Accounting invariants, checked by tests after every step: the KV manager's (the pool
    /// balances, every block is in at most one table, tables cover the computed KV), the retained
    /// queue's counts, the lifecycle counts, and every request within its limits.
    pub fn check_invariants(&self) {
        let requests = &self.requests;
        let request_of = |id: RequestId| requests.get(&id).map(|r| (r.kv_len, r.tokens.as_slice()));
        self.kv.check_invariants(&request_of, self.in_flight.is_some());
        self.retained.check_invariants();
        let mut lifecycles = [0u32; 3];
        for request in self.requests.values() {
            lifecycles[request.lifecycle as usize] += 1;
            assert!(request.kv_len <= request.token_count(), "request {} computed past its tokens", request.id.0);
            assert!(
                request.token_count() <= request.max_session_tokens,
                "request {} over its session limit",
                request.id.0
            );
            if request.is_closed() {
                assert_eq!(self.retained.count_for(request.id), 0, "closed request {} has events", request.id.0);
                assert!(!request.is_held(), "closed request {} is held", request.id.0);
            }
        }
        let counted = [lifecycles[Lifecycle::Abandoned as usize], lifecycles[Lifecycle::Closed as usize]];
        assert_eq!(counted, [self.num_abandoned, self.num_closed], "lifecycle counts drifted");
    }

    // ----------------------------------------------------------------------------------------
    // Checks
    // ----------------------------------------------------------------------------------------

    fn check_open(&self) -> Result<()> {
        if self.closed {
            return Err(OrtexError::new(ErrorCode::EngineClosed, "the engine is closed"));
        }
        Ok(())
    }

    fn check_healthy(&self) -> Result<()> {
        match &self.health {
            Health::Healthy => Ok(()),
            Health::Unhealthy(reason) => {
                Err(OrtexError::new(ErrorCode::EngineUnhealthy, format!("the engine is unhealthy: {reason}")))
            }
        }
    }

    fn check_usable(&self) -> Result<()> {
        self.check_open()?;
        self.check_healthy()
    }

    /// Known = ever created by this engine.
    fn check_known(&self, id: RequestId) -> Result<()> {
        if id.0 == 0 || id.0 >= self.next_request_id {
            return Err(OrtexError::invalid(format!("request {} does not exist in this engine", id.0)));
        }
        Ok(())
    }

    fn open_request(&self, id: RequestId) -> Result<&Request> {
        self.check_known(id)?;
        match self.requests.get(&id) {
            Some(r) if !r.is_closed() => Ok(r),
            _ => Err(OrtexError::new(ErrorCode::RequestClosed, format!("request {} is closed", id.0))),
        }
    }
}
