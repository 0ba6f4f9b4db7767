//! Policy: plan one step. Decides which rows run and reserves their KV blocks through the KV
//! manager (all-or-nothing per row); it never touches model state, and it never removes a
//! request (the engine does, with what the plan reports it released).
//!
//! Dynamic mode (continuous batching), per step, under a token budget (`max_scheduled_tokens`)
//! and a row cap (`max_batch_size`), in dynamic.rs:
//! 1. waiting prefills that have starved for `max_prefill_wait_steps` steps, oldest first;
//! 2. decodes, in a stable order (request id);
//! 3. waiting prefills in arrival order, each at most `prefill_chunk_size` tokens: a prompt longer
//!    than what is left of the budget is prefilled across steps (chunked prefill).
//!
//! A prefill that cannot get its blocks never hides a later one that fits. When nothing at all can
//! run because the pool is full, the oldest blocked request preempts younger holders of blocks
//! (preemption.rs: their KV is freed and recomputed later; no token is lost) until it fits.
//!
//! Static mode (static_batch.rs): a batch of up to `max_batch_size` waiting requests is formed at
//! once and runs until every row is done; only then is it recycled and a new one formed.
//!
//! The scheduler's own state is the order requests wait in: their arrival stamps, how many steps
//! each prefill went without a row, and which were already told they wait for capacity.

mod dynamic;
mod preemption;
mod static_batch;

use std::collections::{BTreeMap, BTreeSet};

use crate::executor::StepPlan;
use crate::ids::RequestId;
use crate::kv::{KvManager, StepReservation};
use crate::options::{BatchingMode, EngineConfig};
use crate::request_table::RequestTable;
use static_batch::StaticBatch;

/// What planning found besides the rows.
#[derive(Debug, Default)]
pub struct PlanReport {
    /// Rows that could run but found no free blocks this step, told for the first time.
    pub deferred: Vec<RequestId>,
    /// Requests whose context can never fit the whole pool.
    pub unserviceable: Vec<RequestId>,
    /// Closed requests whose blocks the plan gave back (rows of a static batch): the engine
    /// removes them.
    pub released: Vec<RequestId>,
}

/// Where a request waits for its prefill rows.
#[derive(Debug, Clone, Copy)]
struct Waiting {
    /// Arrival order (a later stamp waits behind an earlier one).
    arrival: u64,
    /// Consecutive steps it went without a prefill row.
    starved_steps: u32,
}

#[derive(Debug, Default)]
pub struct Scheduler {
    static_batch: StaticBatch,
    waiting: BTreeMap<RequestId, Waiting>,
    /// Requests already told (CapacityBlocked) that they wait for blocks, until they get a row.
    notified: BTreeSet<RequestId>,
    next_arrival: u64,
    /// Rows carry whole block tables (else only the blocks from the one before the row).
    full_block_tables: bool,
    /// Table positions of this step's candidates (valid while planning: nothing is removed).
    decodes: Vec<usize>,
    /// (arrival, table position) of waiting prefills.
    prefills: Vec<(u64, usize)>,
}

pub struct PlanInput<'a> {
    pub config: &'a EngineConfig,
    pub requests: &'a mut RequestTable,
    pub kv: &'a mut dyn KvManager,
}

impl Scheduler {
    pub fn new(full_block_tables: bool) -> Scheduler {
        Scheduler { full_block_tables, ..Scheduler::default() }
    }

    /// `id` starts waiting for compute (new input arrived while it needed none): it takes the
    /// next place in the arrival order.
    pub fn enqueue(&mut self, id: RequestId) {
        self.next_arrival += 1;
        self.waiting.insert(id, Waiting { arrival: self.next_arrival, starved_steps: 0 });
    }

    /// The engine removed `id`: the scheduler forgets it.
    pub fn forget(&mut self, id: RequestId) {
        self.waiting.remove(&id);
        self.notified.remove(&id);
    }

    /// Whether `id` holds a row of the current static batch (its blocks stay until recycling).
    pub fn pins(&self, id: RequestId) -> bool {
        self.static_batch.contains(id)
    }

    /// Static mode: recycles the batch when no row has work left, giving back the blocks of its
    /// closed rows; returns those rows for the engine to remove.
    pub fn recycle_static_batch_if_done(&mut self, input: &mut PlanInput<'_>) -> Vec<RequestId> {
        self.static_batch.recycle_if_done(input.requests, input.kv).unwrap_or_default()
    }

    /// Plans one step into `plan` (cleared first) and reserves its blocks in `reservation`.
    pub fn plan(
        &mut self,
        input: &mut PlanInput<'_>,
        plan: &mut StepPlan,
        reservation: &mut StepReservation,
    ) -> PlanReport {
        plan.clear();
        let mut report = PlanReport::default();
        if input.config.batching == BatchingMode::Static {
            self.static_batch.refresh(input, &self.waiting, &mut report.released);
        }
        let mut deferred = Vec::new();
        self.collect_candidates(input, &mut report);
        self.schedule(input, plan, reservation, &mut deferred, None);
        // Nothing fits: the oldest blocked request preempts younger ones and goes first. Only
        // younger requests are ever preempted, so the oldest always progresses: no livelock.
        let oldest_blocked = deferred.iter().min().copied();
        if let Some(target) = oldest_blocked.filter(|_| plan.rows.is_empty()) {
            if self.preempt_for(target, input, &mut report.released) {
                deferred.clear();
                report.unserviceable.clear();
                self.collect_candidates(input, &mut report);
                self.schedule(input, plan, reservation, &mut deferred, Some(target));
            }
        }
        self.update_starvation(input, plan);
        report.deferred = deferred.into_iter().filter(|&id| self.notified.insert(id)).collect();
        report
    }

    fn arrival(&self, id: RequestId) -> u64 {
        self.waiting.get(&id).map_or(0, |w| w.arrival)
    }

    fn starved_steps(&self, id: RequestId) -> u32 {
        self.waiting.get(&id).map_or(0, |w| w.starved_steps)
    }

    /// A prefill that got no row this step starves one step more; one that got a row is fed.
    fn update_starvation(&mut self, input: &PlanInput<'_>, plan: &StepPlan) {
        for &(_, position) in &self.prefills {
            let id = input.requests.at(position).id;
            let scheduled = plan.rows.iter().any(|row| row.request == id);
            if let Some(waiting) = self.waiting.get_mut(&id) {
                waiting.starved_steps = if scheduled { 0 } else { waiting.starved_steps.saturating_add(1) };
            }
        }
    }
}
