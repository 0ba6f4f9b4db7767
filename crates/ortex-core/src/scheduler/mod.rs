//! Policy: plan one step. Decides which rows run and reserves their KV blocks (all-or-nothing per
//! request); it never touches model state.
//!
//! Dynamic mode (continuous batching), per step, under a token budget (`max_scheduled_tokens`)
//! and a row cap (`max_batch_size`):
//! 1. waiting prefills that have starved for `max_prefill_wait_steps` steps, oldest first;
//! 2. decodes, in a stable order (request id);
//! 3. waiting prefills in arrival order, each at most `prefill_chunk_size` tokens: a prompt longer
//!    than what is left of the budget is prefilled across steps (chunked prefill).
//!
//! A prefill that cannot get its blocks never hides a later one that fits. When nothing at all can
//! run because the pool is full, the youngest holders of blocks are preempted (their KV is freed
//! and recomputed later; no token is lost) until the oldest blocked row fits.
//!
//! Static mode: a batch of up to `max_batch_size` waiting requests is formed at once and runs
//! until every row is done; only then is it recycled and a new one formed.

use crate::executor::{PlanRow, StepPlan};
use crate::ids::RequestId;
use crate::kv::{blocks_for_tokens, BlockPool};
use crate::options::{BatchingMode, EngineConfig};
use crate::request::Request;
use crate::request_table::RequestTable;

/// What planning found besides the rows.
#[derive(Debug, Default)]
pub struct PlanReport {
    /// Rows that could run but found no free blocks this step.
    pub deferred: Vec<RequestId>,
    /// Requests whose context can never fit the whole pool.
    pub unserviceable: Vec<RequestId>,
    /// Requests whose KV was freed for recomputation.
    pub preempted: Vec<RequestId>,
}

#[derive(Debug, Default)]
pub struct Scheduler {
    /// Static mode: the current batch (empty when none is formed).
    static_batch: Vec<RequestId>,
    /// Table positions of this step's candidates (valid while planning: nothing is removed).
    decodes: Vec<usize>,
    /// (arrival order, table position) of waiting prefills.
    prefills: Vec<(u64, usize)>,
    /// Arrival order of waiting prefills.
    next_waiting_seq: u64,
    /// Rows carry whole block tables (else only the blocks from the one before the row).
    full_block_tables: bool,
}

pub struct PlanInput<'a> {
    pub config: &'a EngineConfig,
    pub requests: &'a mut RequestTable,
    pub pool: &'a mut BlockPool,
}

struct Budget {
    tokens: u32,
    rows: u32,
}

impl Scheduler {
    pub fn new(full_block_tables: bool) -> Scheduler {
        Scheduler { full_block_tables, ..Scheduler::default() }
    }

    /// The next arrival number: a request that starts waiting for a prefill takes one.
    pub fn take_waiting_seq(&mut self) -> u64 {
        self.next_waiting_seq += 1;
        self.next_waiting_seq
    }

    pub fn static_batch(&self) -> &[RequestId] {
        &self.static_batch
    }

    /// Whether `id` holds a row of the current static batch (its blocks stay until recycling).
    pub fn pins(&self, id: RequestId) -> bool {
        self.static_batch.contains(&id)
    }

    /// Plans one step into `plan` (cleared first).
    pub fn plan(&mut self, input: &mut PlanInput<'_>, plan: &mut StepPlan) -> PlanReport {
        plan.clear();
        let mut report = PlanReport::default();
        if input.config.batching == BatchingMode::Static {
            self.refresh_static_batch(input);
        }
        self.collect_candidates(input, &mut report);
        self.schedule(input, plan, &mut report, None);
        // Nothing fits: the oldest blocked request preempts younger ones and goes first. Only
        // younger requests are ever preempted, so the oldest always progresses: no livelock.
        let oldest_blocked = report.deferred.iter().min().copied();
        if let Some(target) = oldest_blocked.filter(|_| plan.rows.is_empty()) {
            if self.preempt_for(target, input, &mut report) {
                let preempted = std::mem::take(&mut report.preempted);
                report = PlanReport { preempted, ..PlanReport::default() };
                self.collect_candidates(input, &mut report);
                self.schedule(input, plan, &mut report, Some(target));
            }
        }
        self.update_starvation(input, plan);
        report
    }

    /// Static mode: recycles the batch when no row has work left, releasing its closed rows.
    /// Returns whether the batch is (now) empty.
    pub fn recycle_static_batch_if_done(&mut self, requests: &mut RequestTable, pool: &mut BlockPool) -> bool {
        let busy = self.static_batch.iter().any(|id| requests.get(id).is_some_and(|r| r.needs_compute()));
        if busy {
            return false;
        }
        for id in self.static_batch.drain(..) {
            if requests.get(&id).is_some_and(|r| r.closed) {
                let request = requests.remove(&id).expect("present");
                pool.free(&request.blocks);
            }
        }
        true
    }

    /// Static mode: recycle the batch once no row has work left, then form the next one.
    fn refresh_static_batch(&mut self, input: &mut PlanInput<'_>) {
        if !self.recycle_static_batch_if_done(input.requests, input.pool) {
            return;
        }
        let mut waiting: Vec<(u64, RequestId)> =
            input.requests.values().filter(|r| r.needs_compute()).map(|r| (r.waiting_seq, r.id)).collect();
        waiting.sort_unstable();
        self.static_batch.extend(waiting.into_iter().take(input.config.max_batch_size as usize).map(|(_, id)| id));
        self.static_batch.sort_unstable();
    }

    fn collect_candidates(&mut self, input: &PlanInput<'_>, report: &mut PlanReport) {
        self.decodes.clear();
        self.prefills.clear();
        let pool_tokens = u64::from(input.pool.num_total_blocks()) * u64::from(input.config.block_size);
        let in_scope =
            |r: &Request| input.config.batching == BatchingMode::Dynamic || self.static_batch.contains(&r.id);
        for (position, request) in input.requests.positions() {
            if !request.needs_compute() || !in_scope(request) {
                continue;
            }
            if u64::from(request.compute_target()) > pool_tokens {
                report.unserviceable.push(request.id);
            } else if request.is_decoding() {
                self.decodes.push(position);
            } else {
                self.prefills.push((request.waiting_seq, position));
            }
        }
        self.prefills.sort_unstable();
    }

    fn schedule(
        &mut self,
        input: &mut PlanInput<'_>,
        plan: &mut StepPlan,
        report: &mut PlanReport,
        first: Option<RequestId>,
    ) {
        let config = input.config;
        let mut budget = Budget { tokens: config.max_scheduled_tokens, rows: config.max_batch_size };
        let first = first.and_then(|id| input.requests.position(&id));
        let mut aged: Vec<usize> = first.into_iter().collect();
        aged.extend(
            self.prefills
                .iter()
                .map(|&(_, p)| p)
                .filter(|&p| Some(p) != first && input.requests.at(p).starved_steps >= config.max_prefill_wait_steps),
        );
        let decodes = self.decodes.iter().copied().filter(|&p| Some(p) != first);
        let rest = self.prefills.iter().map(|&(_, p)| p).filter(|p| !aged.contains(p));
        for position in aged.iter().copied().chain(decodes).chain(rest) {
            if budget.rows == 0 || budget.tokens == 0 {
                break;
            }
            let request = input.requests.at_mut(position);
            let id = request.id;
            let chunk_cap = if request.is_decoding() { 1 } else { config.prefill_chunk_size };
            match reserve_row(request, budget.tokens.min(chunk_cap), config.block_size, input.pool) {
                Some(count) => {
                    push_row(request, position, count, config.block_size, self.full_block_tables, plan);
                    budget.tokens -= count;
                    budget.rows -= 1;
                }
                None => report.deferred.push(id),
            }
        }
    }

    fn update_starvation(&self, input: &mut PlanInput<'_>, plan: &StepPlan) {
        for &(_, position) in &self.prefills {
            let request = input.requests.at_mut(position);
            if request.planned_step == Some(plan.step) {
                request.starved_steps = 0;
            } else {
                request.starved_steps = request.starved_steps.saturating_add(1);
            }
        }
    }
}

/// Reserves the blocks for up to `max_tokens` of the request's pending tokens; shortens a prefill
/// chunk to what the free blocks hold. Returns the token count, or None when not even one fits.
fn reserve_row(request: &mut Request, max_tokens: u32, block_size: u32, pool: &mut BlockPool) -> Option<u32> {
    let pending = request.compute_target() - request.kv_len;
    let capacity_tokens = (request.blocks.len() as u32 + pool.num_free_blocks()) * block_size - request.kv_len;
    let count = pending.min(max_tokens).min(capacity_tokens);
    if count == 0 {
        return None;
    }
    let held = request.blocks.len() as u32;
    request.blocks_before_step = held;
    if request.kv_len + count > held * block_size {
        let needed = blocks_for_tokens(request.kv_len + count, block_size) - held;
        assert!(pool.reserve(needed, &mut request.blocks), "reservation sized to the free blocks failed");
    }
    Some(count)
}

fn push_row(
    request: &mut Request,
    position: usize,
    count: u32,
    block_size: u32,
    full_block_tables: bool,
    plan: &mut StepPlan,
) {
    let start = request.kv_len;
    let first_block = if full_block_tables { 0 } else { start.saturating_sub(1) / block_size };
    let block_count = request.blocks.len() as u32 - first_block;
    plan.rows.push(PlanRow {
        request: request.id,
        turn: request.running_turn().map_or(crate::ids::TurnId(0), |t| t.id),
        first_block,
        request_position: position as u32,
        start_position: start,
        token_start: plan.tokens.len() as u32,
        token_count: count,
        block_start: plan.block_ids.len() as u32,
        block_count,
        sample: request.running_turn().is_some() && start + count == request.token_count(),
    });
    plan.tokens.extend_from_slice(&request.tokens[start as usize..(start + count) as usize]);
    plan.block_ids.extend_from_slice(&request.blocks[first_block as usize..]);
    request.planned_step = Some(plan.step);
    request.capacity_notified = false;
}

impl Scheduler {
    /// Frees the KV of idle requests, of running requests younger than `target` and, in static mode,
    /// of requests outside the batch (idle first, then youngest first) until `target`'s next token fits. A victim moves to the back of the waiting
    /// order. Returns whether anything was preempted.
    fn preempt_for(&mut self, target: RequestId, input: &mut PlanInput<'_>, report: &mut PlanReport) -> bool {
        let block_size = input.config.block_size;
        let mut preempted_any = self.release_closed_static_rows(input);
        let is_static = input.config.batching == BatchingMode::Static;
        let mut victims: Vec<(bool, std::cmp::Reverse<RequestId>)> = input
            .requests
            .values()
            .filter(|r| r.id != target && !r.closed && !r.blocks.is_empty())
            // Idle requests, younger ones, and (static mode) requests outside the batch, which
            // cannot run before it is recycled anyway.
            .filter(|r| !r.needs_compute() || r.id > target || (is_static && !self.static_batch.contains(&r.id)))
            .map(|r| (r.needs_compute(), std::cmp::Reverse(r.id)))
            .collect();
        victims.sort_unstable();
        for (_, std::cmp::Reverse(id)) in victims {
            let fits = {
                let t = &input.requests[&target];
                blocks_for_tokens(t.kv_len + 1, block_size) <= t.blocks.len() as u32 + input.pool.num_free_blocks()
            };
            if fits {
                break;
            }
            let victim = input.requests.get_mut(&id).expect("victim exists");
            input.pool.free(&victim.blocks);
            victim.blocks.clear();
            victim.kv_len = 0;
            if victim.running_turn().is_none() {
                victim.prefill_target = 0;
            }
            victim.waiting_seq = self.take_waiting_seq();
            report.preempted.push(id);
            preempted_any = true;
        }
        preempted_any
    }

    /// A closed row of a static batch keeps its blocks only to mirror a physical batch row. When
    /// nothing can run otherwise, it is released early rather than deadlock the batch.
    fn release_closed_static_rows(&mut self, input: &mut PlanInput<'_>) -> bool {
        let closed: Vec<RequestId> =
            self.static_batch.iter().copied().filter(|id| input.requests.get(id).is_some_and(|r| r.closed)).collect();
        for id in &closed {
            let request = input.requests.remove(id).expect("present");
            input.pool.free(&request.blocks);
        }
        self.static_batch.retain(|id| !closed.contains(id));
        !closed.is_empty()
    }
}
