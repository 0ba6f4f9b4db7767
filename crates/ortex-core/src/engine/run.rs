//! `run`: drain retained events, or plan, execute and commit one transaction. Its two halves
//! (`run_begin` on the owner thread, `run_commit` back on it) and the events a run stages,
//! writes into the caller's buffer or retains for the next.

use std::sync::Arc;

use crate::error::{ErrorCode, OrtexError, Result};
use crate::events::{flags, Event, EventErrorCode, FinishReason, RunOutput, EVENT_STRIDE_WORDS};
use crate::executor::ExecError;
use crate::ids::TurnId;
use crate::kv::StepReservation;
use crate::request::Request;
use crate::scheduler::{PlanInput, PlanReport};

use super::commit::finish_text;
use super::transaction::{RunStart, Transaction};
use super::{Engine, Health, InFlight};

impl Engine {
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
