//! The step's rows under a token budget and a row cap: starved prefills first, then decodes in
//! request order, then prefills in arrival order, each prefill chunked to what is left of the
//! budget and of the free blocks. Static mode uses the same pass over its batch's rows only.

use super::{PlanInput, Scheduler};
use crate::executor::{PlanRow, StepPlan};
use crate::ids::{RequestId, TurnId};
use crate::kv::{Admission, StepReservation};
use crate::options::BatchingMode;
use crate::request::Request;

struct Budget {
    tokens: u32,
    rows: u32,
}

impl Scheduler {
    /// This step's candidates: decodes and waiting prefills in scope (never a held turn), and the
    /// requests whose context can never fit the pool (reported unserviceable, never scheduled).
    pub(super) fn collect_candidates(&mut self, input: &PlanInput<'_>, report: &mut super::PlanReport) {
        self.decodes.clear();
        self.prefills.clear();
        let dynamic = input.config.batching == BatchingMode::Dynamic;
        for (position, request) in input.requests.positions() {
            if !request.wants_step() || !(dynamic || self.static_batch.contains(request.id)) {
                continue;
            }
            if !input.kv.can_ever_hold(request.compute_target()) {
                report.unserviceable.push(request.id);
            } else if request.is_decoding() {
                self.decodes.push(position);
            } else {
                self.prefills.push((self.arrival(request.id), position));
            }
        }
        self.prefills.sort_unstable();
    }

    /// Fills `plan` with rows in priority order (`first`, if given, goes before everything: the
    /// request a preemption made room for). Rows that found no blocks go to `deferred`.
    pub(super) fn schedule(
        &mut self,
        input: &mut PlanInput<'_>,
        plan: &mut StepPlan,
        reservation: &mut StepReservation,
        deferred: &mut Vec<RequestId>,
        first: Option<RequestId>,
    ) {
        let config = input.config;
        let mut budget = Budget { tokens: config.max_scheduled_tokens, rows: config.max_batch_size };
        for position in self.priority_order(input, first) {
            if budget.rows == 0 || budget.tokens == 0 {
                break;
            }
            if !next_token_fits(input, position) {
                deferred.push(input.requests.at(position).id);
                continue;
            }
            attach_cached_prefix(input, position);
            let request = input.requests.at(position);
            let chunk_cap = if request.is_decoding() { 1 } else { config.prefill_chunk_size };
            let wanted = (request.compute_target() - request.kv_len).min(budget.tokens.min(chunk_cap));
            match input.kv.admit(request.kv, request.kv_len, request.compute_target(), wanted) {
                Admission::Fits(count) => {
                    input.kv.reserve(reservation, request.kv, request.kv_len, count);
                    self.push_row(input, position, count, plan);
                    budget.tokens -= count;
                    budget.rows -= 1;
                }
                Admission::Later | Admission::Never => deferred.push(request.id),
            }
        }
    }

    /// Starved prefills (oldest first), decodes, then the other prefills in arrival order.
    fn priority_order(&self, input: &PlanInput<'_>, first: Option<RequestId>) -> Vec<usize> {
        let max_wait = input.config.max_prefill_wait_steps;
        let first = first.and_then(|id| input.requests.position(&id));
        let mut order: Vec<usize> = first.into_iter().collect();
        let starved = |position: usize| self.starved_steps(input.requests.at(position).id) >= max_wait;
        order.extend(self.prefills.iter().map(|&(_, p)| p).filter(|&p| Some(p) != first && starved(p)));
        let aged = order.len();
        order.extend(self.decodes.iter().copied().filter(|&p| Some(p) != first));
        let rest: Vec<usize> = self.prefills.iter().map(|&(_, p)| p).filter(|p| !order[..aged].contains(p)).collect();
        order.extend(rest);
        order
    }

    fn push_row(&mut self, input: &mut PlanInput<'_>, position: usize, count: u32, plan: &mut StepPlan) {
        let request = input.requests.at(position);
        let start = request.kv_len;
        let block_size = input.kv.block_size();
        let table = input.kv.table(request.kv);
        let first_block = if self.full_block_tables { 0 } else { start.saturating_sub(1) / block_size };
        plan.rows.push(PlanRow {
            request: request.id,
            turn: request.running_turn().map_or(TurnId(0), |t| t.id),
            first_block,
            request_position: position as u32,
            start_position: start,
            token_start: plan.tokens.len() as u32,
            token_count: count,
            block_start: plan.block_ids.len() as u32,
            block_count: table.len() as u32 - first_block,
            sample: sampled(request, start + count),
        });
        plan.tokens.extend_from_slice(&request.tokens[start as usize..(start + count) as usize]);
        plan.block_ids.extend_from_slice(&table[first_block as usize..]);
        self.notified.remove(&request.id);
    }
}

/// Whether the request's next token fits the pool now. One that does not is deferred before it
/// looks anything up in the prefix cache: attaching cached blocks never makes room (an evictable
/// block it attaches was counted free, and a block another table holds leaves the room as it
/// was), so its admission would fail anyway, and under KV pressure a lookup (a SHA-256 and a
/// search) per waiting request per step made the cache slower than none (issue 30).
fn next_token_fits(input: &PlanInput<'_>, position: usize) -> bool {
    let request = input.requests.at(position);
    matches!(input.kv.admit(request.kv, request.kv_len, request.compute_target(), 1), Admission::Fits(_))
}

/// A prefill first takes what the prefix cache holds of its tokens (at a block boundary; nothing
/// without a cache), so that its row computes only the rest. It happens in priority order, just
/// before the request's blocks are reserved, so that a request ahead in the order (the one a
/// preemption made room for) takes fresh blocks before one behind it takes cached ones back.
fn attach_cached_prefix(input: &mut PlanInput<'_>, position: usize) {
    let request = input.requests.at_mut(position);
    if request.is_decoding() {
        return;
    }
    let attached = input.kv.attach_cached(request.kv, &request.tokens, request.kv_len, request.compute_target());
    if attached > 0 {
        request.attach_cached(attached);
    }
}

/// A row samples when it computes the last pending token of a running turn.
fn sampled(request: &Request, end: u32) -> bool {
    request.running_turn().is_some() && end == request.token_count()
}
