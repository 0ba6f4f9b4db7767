//! When nothing at all can run because the pool is full, the oldest blocked request takes blocks
//! from others: idle requests first (a held turn counts as idle: its blocks never wait on its
//! consumer while another request cannot run), then running ones younger than it, then (static mode)
//! requests outside the batch, youngest first, until its next token fits. A victim's KV is freed
//! and recomputed later (no token is lost), and it moves to the back of the waiting order.

use std::cmp::Reverse;

use super::{PlanInput, Scheduler, Waiting};
use crate::ids::RequestId;
use crate::kv::Admission;
use crate::options::BatchingMode;

impl Scheduler {
    /// Frees KV until `target`'s next token fits. Returns whether anything was freed; closed rows
    /// of a static batch whose blocks it gave back go to `released`.
    pub(super) fn preempt_for(
        &mut self,
        target: RequestId,
        input: &mut PlanInput<'_>,
        released: &mut Vec<RequestId>,
    ) -> bool {
        let mut preempted_any = self.static_batch.release_closed_rows(input, released);
        for id in self.victims(target, input) {
            if self.fits_next_token(target, input) {
                break;
            }
            let victim = input.requests.get_mut(&id).expect("victim exists");
            input.kv.free(victim.kv);
            victim.transition_to_preempted();
            self.requeue(id);
            preempted_any = true;
        }
        preempted_any
    }

    /// Who may lose its KV for `target`, in the order they do: idle before running, younger
    /// (higher id) first.
    fn victims(&self, target: RequestId, input: &PlanInput<'_>) -> Vec<RequestId> {
        let is_static = input.config.batching == BatchingMode::Static;
        let mut victims: Vec<(bool, Reverse<RequestId>)> = input
            .requests
            .values()
            .filter(|r| r.id != target && !r.is_closed() && !input.kv.table(r.kv).is_empty())
            // Idle requests, younger ones, and (static mode) requests outside the batch, which
            // cannot run before it is recycled anyway.
            .filter(|r| !r.wants_step() || r.id > target || (is_static && !self.static_batch.contains(r.id)))
            .map(|r| (r.wants_step(), Reverse(r.id)))
            .collect();
        victims.sort_unstable();
        victims.into_iter().map(|(_, Reverse(id))| id).collect()
    }

    fn fits_next_token(&self, target: RequestId, input: &PlanInput<'_>) -> bool {
        let request = &input.requests[&target];
        let next = request.kv_len + 1;
        matches!(input.kv.admit(request.kv, request.kv_len, next, 1), Admission::Fits(_))
    }

    /// A preempted request waits again, behind everyone (how long it starved is kept).
    fn requeue(&mut self, id: RequestId) {
        self.next_arrival += 1;
        let arrival = self.next_arrival;
        self.waiting.entry(id).and_modify(|w| w.arrival = arrival).or_insert(Waiting { arrival, starved_steps: 0 });
    }
}
