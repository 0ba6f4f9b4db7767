//! The owner: requests, the block pool, the scheduler, the retained events and the executor.
//!
//! `run` either drains retained events (no model work) or executes at most one transaction:
//! `plan` (scheduler) -> `execute` (executor) -> `commit` (here). The transaction can leave the
//! engine ([`RunStart::Execute`]) so a binding can execute it on another thread while the engine
//! keeps accepting begin / cancel / close calls; [`Engine::run_commit`] applies it afterwards.

use std::sync::Arc;

use crate::constraint::Constraints;
use crate::draws::Draws;
use crate::error::{ErrorCode, OrtexError, Result};
use crate::events::{
    flags, Event, EventErrorCode, FinishReason, RetainedEvents, RunOutput, StopMatch, EVENT_STRIDE_WORDS,
};
use crate::executor::{ExecError, Executor, KvGeometry, StepOutput, StepPlan};
use crate::ids::{RequestId, TurnId};
use crate::kv::{KvManager, PagedKv, StepReservation};
use crate::options::{EngineConfig, EngineOptions, RequestOptions, SimOptions, TurnOptions};
use crate::output::TextStep;
use crate::request::{FinishedTurn, Lifecycle, Request, RequestState, TurnSlot};
use crate::request_table::RequestTable;
use crate::rng::{hash2, Rng};
use crate::sampling;
use crate::scheduler::{PlanInput, PlanReport, Scheduler};
use crate::sim::SimExecutor;
use crate::text::{ClosedCodec, SimText, TextCodec};

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

/// What `run_begin` decided.
// A transaction is moved out at once to wherever it executes; boxing it would cost an allocation
// per run to shrink a value that never sits in a collection.
#[allow(clippy::large_enum_variant)]
pub enum RunStart {
    /// The call is complete: this many events were written (drained, or a no-op).
    Done(usize),
    /// A transaction to execute (on any thread) and hand back to `run_commit`.
    Execute(Transaction),
}

/// One planned step, carrying the executor while it is away from the engine.
pub struct Transaction {
    plan: StepPlan,
    output: StepOutput,
    /// Boxed: the sampler's buffers travel with each step (and come back as the spare).
    draws: Box<Draws>,
    executor: Box<dyn Executor>,
    /// The draws detokenize with it where they run.
    codec: Arc<dyn TextCodec>,
    result: Option<std::result::Result<(), ExecError>>,
}

impl Transaction {
    /// Runs the model, then samples its rows and makes their text (draws.rs). The only part of a
    /// `run` that may happen off the owner thread. Constrained rows' masks are computed before
    /// the model runs.
    pub fn execute(&mut self) {
        self.execute_with(|model, masks| {
            masks();
            model();
        });
    }

    /// `execute`, with the model run and the constrained rows' masks handed to `run_both`, which
    /// may run them at once on two threads (the native binding does; the core has no threads).
    /// A step without a constrained row runs the model alone and never calls `run_both`.
    pub fn execute_with(&mut self, run_both: impl FnOnce(&mut (dyn FnMut() + Send), &mut (dyn FnMut() + Send))) {
        let Transaction { plan, output, draws, executor, codec, result } = self;
        let mut model_result = None;
        if draws.has_constraints() {
            let mut model = || model_result = Some(executor.execute(plan, output));
            let mut masks = || draws.compute_masks();
            run_both(&mut model, &mut masks);
        } else {
            model_result = Some(executor.execute(plan, output));
        }
        let model_result = model_result.expect("run_both runs the model");
        if model_result.is_ok() && output.matches(plan.sampled_rows()) {
            draws.sample(output, codec.as_ref());
        }
        *result = Some(model_result);
    }

    /// Records a failure that happened outside the executor's own error path (a binding caught a
    /// panic in `execute`): `run_commit` then rolls back and publishes a fatal Failed event.
    pub fn fail(&mut self, reason: String) {
        self.result = Some(Err(ExecError::Fatal(reason)));
    }
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

    // ----------------------------------------------------------------------------------------
    // Requests and turns
    // ----------------------------------------------------------------------------------------

    pub fn create_request(&mut self, options: &RequestOptions) -> Result<RequestId> {
        self.check_usable()?;
        self.reclaim_abandoned();
        let max_length = self.config.max_length;
        let max_session_tokens = match options.max_session_tokens {
            None | Some(0) => max_length,
            Some(n) if n > max_length => {
                return Err(OrtexError::invalid(format!(
                    "maxSessionTokens {n} is above the model's max length {max_length}"
                )))
            }
            Some(n) => n,
        };
        if self.requests.len() >= self.config.max_requests as usize {
            return Err(OrtexError::new(
                ErrorCode::CapacityExhausted,
                format!("{} requests are alive, the engine's maxRequests; close one first", self.config.max_requests),
            ));
        }
        if self.next_request_id == i32::MAX as u32 {
            return Err(OrtexError::new(ErrorCode::CapacityExhausted, "request ids are exhausted"));
        }
        let id = RequestId(self.next_request_id);
        self.next_request_id += 1;
        let kv = self.kv.open(id);
        self.requests.insert(id, Request::new(id, kv, max_session_tokens));
        Ok(id)
    }

    pub fn begin_turn(&mut self, id: RequestId, tokens: &[i32], options: &TurnOptions) -> Result<TurnId> {
        self.check_usable()?;
        let resolved = options.resolve(self.config.vocab_size)?;
        let request = self.open_request(id)?;
        if request.running_turn().is_some() {
            return Err(OrtexError::new(
                ErrorCode::TurnActive,
                format!("request {} already has a turn queued or running", id.0),
            ));
        }
        let undelivered = self.retained.count_for(id);
        if undelivered > 0 {
            return Err(OrtexError::new(
                ErrorCode::EventsPending,
                format!("request {} still has {undelivered} undelivered event(s); run the engine first", id.0),
            ));
        }
        self.check_input(id, tokens)?;
        let constraint = match &options.constraint {
            None => None,
            Some(constraint) => Some(Box::new(self.constraints.compile(
                constraint,
                self.codec.as_ref(),
                self.config.vocab_size,
                &self.config.eos_token_ids,
                &resolved.eos_token_ids,
            )?)),
        };
        let engine_seed = self.seed;
        let request = self.requests.get_mut(&id).expect("checked");
        let turn_number = request.last_turn_id + 1;
        let rng_seed =
            resolved.seed.unwrap_or_else(|| hash2(hash2(engine_seed, u64::from(id.0)), u64::from(turn_number)));
        if !request.needs_compute() {
            self.scheduler.enqueue(id);
        }
        request.tokens.extend_from_slice(tokens);
        Ok(request.transition_to_queued(resolved, tokens.len() as u32, Rng::new(rng_seed), constraint))
    }

    /// Adds context without starting a turn; the scheduler prefills it like a prompt.
    pub fn prefill(&mut self, id: RequestId, tokens: &[i32]) -> Result<()> {
        self.check_usable()?;
        let request = self.open_request(id)?;
        if request.running_turn().is_some() {
            return Err(OrtexError::new(
                ErrorCode::TurnActive,
                format!("request {} has a turn running; prefill after it ends", id.0),
            ));
        }
        self.check_input(id, tokens)?;
        let request = self.requests.get_mut(&id).expect("checked");
        if !request.needs_compute() {
            self.scheduler.enqueue(id);
        }
        request.tokens.extend_from_slice(tokens);
        request.prefill_target = request.token_count();
        Ok(())
    }

    /// Drops the request's tokens past `token_count` and frees the KV blocks past the last one
    /// still needed, so that a later turn continues from the shorter context. A full-duplex client
    /// uses it to keep only what it played of a response (the OpenAI Realtime API's
    /// `conversation.item.truncate`).
    ///
    /// Allowed only between turns (TURN_ACTIVE otherwise). A request whose row is in the step in
    /// flight is refused with RUN_IN_PROGRESS, which is retryable: that step commits KV for
    /// positions the truncation would drop, so the call must wait until it has committed.
    pub fn truncate(&mut self, id: RequestId, token_count: u32) -> Result<()> {
        self.check_usable()?;
        let request = self.open_request(id)?;
        if request.running_turn().is_some() {
            return Err(OrtexError::new(
                ErrorCode::TurnActive,
                format!("request {} has a turn queued or running; truncate after it ends", id.0),
            ));
        }
        if token_count > request.token_count() {
            return Err(OrtexError::invalid(format!(
                "cannot truncate request {} to {token_count} tokens: it holds {}",
                id.0,
                request.token_count()
            )));
        }
        if self.computing_in_flight(id) {
            return Err(OrtexError::new(
                ErrorCode::RunInProgress,
                format!("request {} has a row in the step in flight; truncate after it commits", id.0),
            ));
        }
        let request = self.requests.get_mut(&id).expect("checked");
        request.truncate_to(token_count);
        // A truncation inside a block that other requests share keeps less: what it had computed
        // past the block's start is prefilled again, as caching off would have kept it.
        let computed = request.kv_len;
        request.kv_len = self.kv.truncate(request.kv, computed);
        if request.kv_len < computed {
            if !request.needs_compute() {
                self.scheduler.enqueue(id);
            }
            request.prefill_target = request.prefill_target.max(computed);
        }
        Ok(())
    }

    /// Cancels the request's queued or active turn `turn`. Publishes exactly one TurnFinished
    /// (reason cancelled), merged into a still-undelivered token event when there is one.
    pub fn cancel_turn(&mut self, id: RequestId, turn: TurnId) -> Result<bool> {
        self.check_open()?;
        let request = self.open_request(id)?;
        if request.running_turn().map(|t| t.id) != Some(turn) {
            return Ok(false);
        }
        self.finish_turn_now(id, FinishReason::Cancelled);
        Ok(true)
    }

    /// Holds the request's running turn `turn`: the scheduler plans no row for it until
    /// `release_turn`, so it generates nothing while its consumer reads nothing (a streaming
    /// client that stopped reading). The request stays admitted with its KV, and keeps its place
    /// in the waiting order; under KV pressure its blocks may be preempted as an idle request's
    /// are (recomputed after the release, no token lost), so a hold never blocks another request.
    /// A step already in flight still commits its token. Cancel and close work as on any turn;
    /// the hold ends with the turn. Returns false (and holds nothing) when `turn` is not running.
    pub fn hold_turn(&mut self, id: RequestId, turn: TurnId) -> Result<bool> {
        self.set_held(id, turn, true)
    }

    /// Ends a hold (`hold_turn`): the turn is scheduled again from where it stopped, with the
    /// tokens an unheld run would have produced. Returns false when `turn` is not running.
    pub fn release_turn(&mut self, id: RequestId, turn: TurnId) -> Result<bool> {
        self.set_held(id, turn, false)
    }

    pub fn is_turn_held(&self, id: RequestId) -> Result<bool> {
        self.check_known(id)?;
        Ok(self.requests.get(&id).is_some_and(Request::is_held))
    }

    /// Closes a request: idempotent, from every state. Its blocks are freed at once unless a step
    /// in flight or a static batch still holds its row; then when that ends.
    pub fn close_request(&mut self, id: RequestId) -> Result<()> {
        self.check_known(id)?;
        let Some(request) = self.requests.get_mut(&id) else {
            return Ok(());
        };
        match request.lifecycle {
            Lifecycle::Closed => return Ok(()),
            Lifecycle::Abandoned => self.num_abandoned -= 1,
            Lifecycle::Open => {}
        }
        request.transition_to_closed();
        self.num_closed += 1;
        self.retained.remove_request(id);
        self.release_closed();
        Ok(())
    }

    /// The caller dropped its last handle: the request is closed at the next owner boundary, or
    /// at once on an engine that runs no more steps (unhealthy: it has no boundary left).
    pub fn abandon_request(&mut self, id: RequestId) {
        if self.requests.get_mut(&id).is_some_and(Request::transition_to_abandoned) {
            self.num_abandoned += 1;
        }
        self.reclaim_abandoned_if_unhealthy();
    }

    pub fn request_state(&self, id: RequestId) -> Result<RequestState> {
        self.check_known(id)?;
        Ok(self.requests.get(&id).map_or(RequestState::Closed, |r| r.state()))
    }

    pub fn token_count(&self, id: RequestId) -> Result<u32> {
        self.check_known(id)?;
        Ok(self.requests.get(&id).map_or(0, |r| r.token_count()))
    }

    /// The request's last turn, once it has finished (None while one runs, before the first, and
    /// for a closed request).
    pub fn finished_turn(&self, id: RequestId) -> Result<Option<FinishedTurn>> {
        self.check_known(id)?;
        Ok(self.requests.get(&id).filter(|r| !r.is_closed()).and_then(|r| r.finished_turn().copied()))
    }

    /// The request's whole context (prompts, prefills and generated tokens).
    pub fn request_tokens(&self, id: RequestId) -> Result<&[i32]> {
        self.check_known(id)?;
        Ok(self.requests.get(&id).map_or(&[][..], |r| &r.tokens))
    }

    // ----------------------------------------------------------------------------------------
    // run: drain or execute
    // ----------------------------------------------------------------------------------------

    /// Runs synchronously: drains retained events or executes one transaction on this thread.
    pub fn run(&mut self, out: &mut [i32], capacity: usize) -> Result<usize> {
        match self.run_begin(out, capacity)? {
            RunStart::Done(count) => Ok(count),
            RunStart::Execute(mut transaction) => {
                transaction.execute();
                Ok(self.run_commit(transaction, out, capacity))
            }
        }
    }

    /// The text and log-probabilities of the events the last run wrote, which the records' text
    /// and logprobs words point into (events.rs); valid until the next run.
    pub fn run_output(&self) -> &RunOutput {
        &self.run_output
    }

    /// The owner-thread half before execution. The buffer is validated before any progress.
    pub fn run_begin(&mut self, out: &mut [i32], capacity: usize) -> Result<RunStart> {
        self.check_open()?;
        self.run_output.clear();
        if out.len() < capacity.saturating_mul(EVENT_STRIDE_WORDS) {
            return Err(OrtexError::invalid(format!(
                "event buffer of {} words cannot hold {capacity} events of {EVENT_STRIDE_WORDS} words",
                out.len()
            )));
        }
        if self.in_flight.is_some() {
            return Err(OrtexError::new(ErrorCode::RunInProgress, "a transaction is still executing"));
        }
        if capacity == 0 {
            return Ok(RunStart::Done(0));
        }
        self.check_healthy()?;
        self.reclaim_abandoned();
        self.requests.compact_if_sparse();
        if !self.retained.is_empty() {
            return Ok(RunStart::Done(self.drain_retained(out, capacity)));
        }
        let (mut plan, output, mut draws) = self.spare.take().expect("spare step buffers");
        plan.step = self.stats.steps;
        let mut reservation = StepReservation::default();
        let report = self.scheduler.plan(
            &mut PlanInput { config: &self.config, requests: &mut self.requests, kv: self.kv.as_mut() },
            &mut plan,
            &mut reservation,
        );
        self.remove_released(&report.released);
        self.stage_plan_report(&report);
        if plan.rows.is_empty() {
            // Nothing was reserved: a plan without rows reserved no blocks.
            self.kv.commit(reservation, &|_| &[]);
            self.spare = Some((plan, output, draws));
            return Ok(RunStart::Done(self.publish(out, capacity)));
        }
        self.take_draws(&plan, &mut draws);
        self.in_flight = Some(InFlight { step: plan.step, reservation });
        let executor = self.executor.take().expect("executor is home when nothing is in flight");
        let codec = Arc::clone(&self.codec);
        Ok(RunStart::Execute(Transaction { plan, output, draws, executor, codec, result: None }))
    }

    /// The owner-thread half after execution: commit or roll back, publish events.
    pub fn run_commit(&mut self, transaction: Transaction, out: &mut [i32], capacity: usize) -> usize {
        let Transaction { plan, output, mut draws, executor, result, .. } = transaction;
        let in_flight = self.in_flight.take().expect("a transaction returns to the engine it left");
        assert_eq!(in_flight.step, plan.step, "a transaction returned to the wrong engine state");
        self.stats.steps += 1;
        self.stats.virtual_time_us = executor.virtual_time_us();
        // A closed engine keeps nothing of its model: the executor (its KV storage, a real model's
        // session and threads) goes as soon as the step that carried it returns.
        self.executor = (!self.closed).then_some(executor);
        // What planning staged may have gone stale while the step ran (a close or a cancel);
        // what this commit stages is checked as it is made.
        self.drop_stale_staged();
        match result.expect("a transaction is executed before it is committed") {
            Ok(()) if output.matches(plan.sampled_rows()) => {
                let requests = &self.requests;
                self.kv.commit(in_flight.reservation, &|id| requests[&id].tokens.as_slice());
                self.commit_rows(&plan, &mut draws);
            }
            Ok(()) => {
                self.kv.rollback(in_flight.reservation);
                self.return_constraints(&plan, &mut draws);
                self.fail_engine(
                    EventErrorCode::EngineContractFailure,
                    "executor output does not match the plan".into(),
                );
            }
            Err(error) => {
                self.kv.rollback(in_flight.reservation);
                self.return_constraints(&plan, &mut draws);
                self.stage_execution_error(error);
            }
        }
        self.spare = Some((plan, output, draws));
        self.release_closed();
        if self.closed {
            self.staged.clear();
            return 0;
        }
        let capacity = capacity.min(out.len() / EVENT_STRIDE_WORDS);
        self.publish(out, capacity)
    }

    /// Whether a `run` would do anything: a held turn alone is no pending work.
    pub fn has_pending_work(&mut self) -> bool {
        if self.closed || self.health != Health::Healthy {
            return false;
        }
        self.reclaim_abandoned();
        self.in_flight.is_some() || !self.retained.is_empty() || self.requests.values().any(Request::wants_step)
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
    // Internals
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

    fn check_input(&self, id: RequestId, tokens: &[i32]) -> Result<()> {
        if tokens.is_empty() {
            return Err(OrtexError::invalid("input is empty"));
        }
        let vocab = self.config.vocab_size;
        if let Some((i, t)) = tokens.iter().enumerate().find(|(_, &t)| t < 0 || t as u32 >= vocab) {
            return Err(OrtexError::invalid(format!("token {t} at index {i} is outside the vocabulary of {vocab}")));
        }
        let request = &self.requests[&id];
        let total = u64::from(request.token_count()) + tokens.len() as u64;
        if total >= u64::from(request.max_session_tokens) {
            return Err(OrtexError::invalid(format!(
                "request {} would hold {total} tokens, leaving no room to generate under its limit of {}",
                id.0, request.max_session_tokens
            )));
        }
        Ok(())
    }

    /// Ends a running turn outside a transaction (cancel): one finish event, merged into a
    /// pending token event of the same turn when there is one.
    /// Its text held back so far comes with the finish.
    fn finish_turn_now(&mut self, id: RequestId, reason: FinishReason) {
        let request = self.requests.get_mut(&id).expect("open request");
        let rest = finish_text(request, self.codec.as_ref());
        let (turn, usage) = request.transition_to_turn_complete(reason);
        if let Some(event) = self.retained.last_for_mut(id).filter(|e| e.turn == turn && e.flags == flags::TOKEN) {
            event.finish(reason, usage);
            event.append_text(&rest.text);
            return;
        }
        let mut event = Event::request(id, turn, 0, EventErrorCode::None);
        event.finish(reason, usage);
        event.append_text(&rest.text);
        self.retained.push(event);
    }

    /// The one writer of a turn's hold flag. A closed request or another turn holds nothing.
    fn set_held(&mut self, id: RequestId, turn: TurnId, held: bool) -> Result<bool> {
        self.check_open()?;
        self.check_known(id)?;
        let running = self.requests.get_mut(&id).and_then(Request::running_turn_mut).filter(|t| t.id == turn);
        let Some(running) = running else { return Ok(false) };
        running.held = held;
        Ok(true)
    }

    /// Whether the step in flight computes KV of `id`.
    fn computing_in_flight(&self, id: RequestId) -> bool {
        self.in_flight.as_ref().is_some_and(|step| step.reservation.holds(id))
    }

    /// Closes the requests whose handles were dropped (at an owner boundary).
    fn reclaim_abandoned(&mut self) {
        if self.num_abandoned == 0 {
            return;
        }
        let abandoned: Vec<RequestId> =
            self.requests.values().filter(|r| r.lifecycle == Lifecycle::Abandoned).map(|r| r.id).collect();
        for id in abandoned {
            self.close_request(id).expect("abandoned ids are known");
        }
    }

    /// An unhealthy engine refuses every call that is an owner boundary (run, createRequest) and
    /// reports no pending work, so a request abandoned there (or before the failure, while the
    /// failing step was in flight) would hold its blocks and its slot until the engine closes:
    /// it is closed now instead, as an explicit close would be.
    fn reclaim_abandoned_if_unhealthy(&mut self) {
        if self.health != Health::Healthy {
            self.reclaim_abandoned();
        }
    }

    /// Removes closed requests whose blocks nothing pins any more (the step in flight, a static
    /// batch), giving their blocks back.
    fn release_closed(&mut self) {
        if self.in_flight.is_none() {
            let recycled = self.scheduler.recycle_static_batch_if_done(&mut PlanInput {
                config: &self.config,
                requests: &mut self.requests,
                kv: self.kv.as_mut(),
            });
            self.remove_released(&recycled);
        }
        if self.num_closed == 0 {
            return;
        }
        let releasable: Vec<RequestId> = self
            .requests
            .values()
            .filter(|r| r.is_closed() && !self.computing_in_flight(r.id) && !self.scheduler.pins(r.id))
            .map(|r| r.id)
            .collect();
        self.remove_released(&releasable);
    }

    /// Removes closed requests whose blocks are already given back: only the engine removes.
    fn remove_released(&mut self, released: &[RequestId]) {
        for &id in released {
            let request = self.requests.remove(&id).expect("a released request is in the table");
            self.kv.release(request.kv);
            assert!(request.is_closed(), "request {} released while open", id.0);
            self.num_closed -= 1;
            self.scheduler.forget(id);
        }
    }

    fn drain_retained(&mut self, out: &mut [i32], capacity: usize) -> usize {
        let mut written = 0;
        while written < capacity {
            let Some(event) = self.retained.pop() else { break };
            event.encode(&mut out[written * EVENT_STRIDE_WORDS..], &mut self.run_output);
            written += 1;
        }
        written
    }

    /// Writes staged events into the buffer up to its capacity and retains the rest.
    fn publish(&mut self, out: &mut [i32], capacity: usize) -> usize {
        let mut written = 0;
        for event in self.staged.drain(..) {
            if written < capacity {
                event.encode(&mut out[written * EVENT_STRIDE_WORDS..], &mut self.run_output);
                written += 1;
            } else {
                self.retained.push(event);
            }
        }
        written
    }

    /// Drops what planning staged for a request that a call while the step was in flight closed,
    /// or for a turn it ended (a cancel publishes the turn's finish at once): nothing of a turn
    /// follows its finish, and nothing reaches a closed request.
    fn drop_stale_staged(&mut self) {
        let requests = &self.requests;
        self.staged.retain(|event| {
            let Some(id) = event.request else { return true };
            let Some(request) = requests.get(&id).filter(|r| !r.is_closed()) else { return false };
            // A finish (an unserviceable turn, failed at planning) ends its turn: always kept.
            event.is_turn_finished() || event.turn.0 == 0 || request.running_turn().map(|t| t.id) == Some(event.turn)
        });
    }

    fn stage_plan_report(&mut self, report: &PlanReport) {
        for &id in &report.unserviceable {
            let request = self.requests.get_mut(&id).expect("planned request exists");
            if request.running_turn().is_some() {
                let rest = finish_text(request, self.codec.as_ref());
                let (turn, usage) = request.transition_to_turn_complete(FinishReason::Failed);
                let mut event = Event::request(id, turn, 0, EventErrorCode::RequestUnserviceable);
                event.finish(FinishReason::Failed, usage);
                event.append_text(&rest.text);
                self.staged.push(event);
            } else {
                request.prefill_target = 0;
                self.staged.push(Event::request(id, TurnId(0), flags::FAILED, EventErrorCode::RequestUnserviceable));
            }
        }
        // The scheduler reports a wait once, until the request gets a row again.
        for &id in &report.deferred {
            let turn = self.requests[&id].running_turn().map_or(TurnId(0), |t| t.id);
            self.staged.push(Event::request(id, turn, flags::CAPACITY_BLOCKED, EventErrorCode::CapacityDeferred));
        }
    }

    /// What each sampled row's draw needs, from its turn as planned (draws.rs); its constraint
    /// moves to the draw until the commit.
    fn take_draws(&mut self, plan: &StepPlan, draws: &mut Draws) {
        draws.clear();
        for row in plan.rows.iter().filter(|row| row.sample) {
            let request = self.requests.at_mut(row.request_position as usize);
            let TurnSlot::Running(turn) = &mut request.turn else { unreachable!("a sampled row has a running turn") };
            let history = sampling::History { context: &request.tokens, generated: turn.generated_tokens as usize };
            draws.push(
                turn.options.sampling,
                &turn.rng,
                history,
                turn.options.logprobs,
                &turn.text,
                turn.constraint.take(),
            );
        }
    }

    /// A step that did not commit (rolled back) hands each constraint back to its turn unchanged:
    /// nothing was sampled, so no matcher moved.
    fn return_constraints(&mut self, plan: &StepPlan, draws: &mut Draws) {
        if !draws.has_constraints() {
            return;
        }
        for (index, row) in plan.rows.iter().filter(|row| row.sample).enumerate() {
            let constraint = draws.row_mut(index).constraint.take();
            let request = self.requests.at_mut(row.request_position as usize);
            if let Some(turn) = request.running_turn_mut().filter(|turn| turn.id == row.turn) {
                turn.constraint = constraint;
            }
        }
    }

    fn commit_rows(&mut self, plan: &StepPlan, draws: &mut Draws) {
        let mut sampled_index = 0;
        for row in &plan.rows {
            let planned_turn = row.turn;
            let request = self.requests.at_mut(row.request_position as usize);
            if !request.is_decoding() {
                self.stats.prompt_tokens += u64::from(row.token_count);
            }
            request.kv_len += row.token_count;
            if request.prefill_target <= request.kv_len {
                request.prefill_target = 0;
            }
            if !row.sample {
                continue;
            }
            let draw = draws.row_mut(sampled_index);
            sampled_index += 1;
            if request.is_closed() || request.running_turn().map(|t| t.id) != Some(planned_turn) {
                continue; // closed or cancelled while the step was in flight
            }
            let TurnSlot::Running(turn) = &mut request.turn else { unreachable!("checked above") };
            turn.rng = draw.rng.clone();
            turn.text.clone_from(&draw.text);
            turn.constraint = draw.constraint.take();
            if turn.constraint.as_ref().is_some_and(|c| c.failure.is_some()) {
                let mut event = Event::request(row.request, planned_turn, 0, EventErrorCode::ConstraintFailed);
                event.text = finish_text(request, self.codec.as_ref()).text;
                let (_, usage) = request.transition_to_turn_complete(FinishReason::Failed);
                event.finish(FinishReason::Failed, usage);
                self.staged.push(event);
                continue;
            }
            let token = draw.token as i32;
            turn.generated_tokens += 1;
            request.tokens.push(token);
            self.stats.generated_tokens += 1;
            let mut event = Event::token(row.request, planned_turn, token);
            event.logprobs = draw.logprobs.take().map(Box::new);
            let mut step = std::mem::take(&mut draw.step);
            if let Some(reason) =
                turn_ending(request, token, &mut step, &self.config.eos_token_ids, self.codec.as_ref())
            {
                let (_, usage) = request.transition_to_turn_complete(reason);
                event.finish(reason, usage);
            }
            event.text = step.text;
            self.staged.push(event);
        }
    }

    fn stage_execution_error(&mut self, error: ExecError) {
        match error {
            ExecError::Retryable(_) => {
                self.staged.push(Event::engine(flags::RETRYABLE, EventErrorCode::RetryableExecution))
            }
            ExecError::CapacityExceeded(_) => {
                self.staged.push(Event::engine(flags::CAPACITY_BLOCKED, EventErrorCode::ExecutionCapacityExceeded))
            }
            ExecError::Fatal(reason) => self.fail_engine(EventErrorCode::EngineExecutionFailure, reason),
        }
    }

    /// The engine-level Failed event goes first: later runs refuse with ENGINE_UNHEALTHY without
    /// draining, so it must fit in this run's buffer (whose capacity is at least one).
    fn fail_engine(&mut self, code: EventErrorCode, reason: String) {
        self.staged.insert(0, Event::engine(flags::FAILED, code));
        self.health = Health::Unhealthy(reason);
        // Requests abandoned while the failing step was in flight are closed now: nothing of
        // them may be published after that.
        self.reclaim_abandoned_if_unhealthy();
        self.drop_stale_staged();
    }
}

/// The held-back text of a request's running turn, at its end (output.rs).
fn finish_text(request: &mut Request, codec: &dyn TextCodec) -> TextStep {
    request.running_turn_mut().map_or_else(TextStep::default, |turn| turn.text.finish(codec))
}

/// Whether the turn ends with `token`, which `step` is the text of: a stop string in it ends
/// the turn; so do the reasons `finish_reason_after` finds, and then the text held back is
/// flushed into `step` (where a stop string may still appear). A stop string wins over every
/// other reason but a stop token sequence (a stop either way, and the core's own).
fn turn_ending(
    request: &mut Request,
    token: i32,
    step: &mut TextStep,
    eos_token_ids: &[i32],
    codec: &dyn TextCodec,
) -> Option<FinishReason> {
    let natural = natural_ending(request, token, eos_token_ids);
    let text_stop = match (step.stop, natural) {
        (Some(index), _) => Some(index),
        (None, Some(_)) => {
            let rest = finish_text(request, codec);
            step.text.push_str(&rest.text);
            rest.stop
        }
        (None, None) => None,
    };
    match (natural, text_stop) {
        (Some(reason @ FinishReason::Stop(StopMatch::TokenIds(_))), _) | (Some(reason), None) => Some(reason),
        (_, Some(index)) => Some(FinishReason::Stop(StopMatch::Text(index))),
        (None, None) => None,
    }
}

/// Why the turn ends after `token` was appended, its text aside: a completed constraint ends it
/// 'eos' (its output is whole, whatever limit the same token reached); otherwise the request's
/// own order.
fn natural_ending(request: &Request, token: i32, eos_token_ids: &[i32]) -> Option<FinishReason> {
    let complete = request.running_turn()?.constraint.as_ref().is_some_and(|c| c.complete);
    if complete {
        return Some(FinishReason::Eos);
    }
    request.finish_reason_after(token, eos_token_ids)
}
