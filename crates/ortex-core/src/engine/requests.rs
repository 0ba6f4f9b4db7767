//! The request and turn API of the [`Engine`]: creating a request, beginning, prefilling,
//! truncating, cancelling and holding its turns, closing it; and the owner boundary's reclaiming
//! (a request whose handles were dropped is closed there, a closed one is removed once nothing
//! pins its blocks).

use crate::error::{ErrorCode, OrtexError, Result};
use crate::events::{flags, Event, EventErrorCode, FinishReason};
use crate::ids::{RequestId, TurnId};
use crate::options::{RequestOptions, TurnOptions};
use crate::request::{FinishedTurn, Lifecycle, Request, RequestState};
use crate::rng::{hash2, Rng};
use crate::scheduler::PlanInput;

use super::commit::finish_text;
use super::{Engine, Health};

impl Engine {
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
    pub(super) fn reclaim_abandoned(&mut self) {
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
    pub(super) fn reclaim_abandoned_if_unhealthy(&mut self) {
        if self.health != Health::Healthy {
            self.reclaim_abandoned();
        }
    }

    /// Removes closed requests whose blocks nothing pins any more (the step in flight, a static
    /// batch), giving their blocks back.
    pub(super) fn release_closed(&mut self) {
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
    pub(super) fn remove_released(&mut self, released: &[RequestId]) {
        for &id in released {
            let request = self.requests.remove(&id).expect("a released request is in the table");
            self.kv.release(request.kv);
            assert!(request.is_closed(), "request {} released while open", id.0);
            self.num_closed -= 1;
            self.scheduler.forget(id);
        }
    }
}
