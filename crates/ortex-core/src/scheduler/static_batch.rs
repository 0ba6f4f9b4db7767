//! Static batching: a batch of up to `max_batch_size` waiting requests is formed at once and runs
//! until no row has work left; only then is it recycled and the next one formed. A closed row
//! keeps its blocks until the batch is recycled, mirroring a physical batch row. A held row has no
//! work (else one held turn would keep every waiting request out): the batch may recycle without
//! it, and once released it waits for a later batch.

use std::collections::BTreeMap;

use super::{PlanInput, Waiting};
use crate::ids::RequestId;
use crate::kv::KvManager;
use crate::request_table::RequestTable;

#[derive(Debug, Default)]
pub(super) struct StaticBatch {
    /// The rows of the current batch, by request id (empty when none is formed).
    members: Vec<RequestId>,
}

impl StaticBatch {
    pub(super) fn contains(&self, id: RequestId) -> bool {
        self.members.contains(&id)
    }

    /// Recycles the batch once no row has work left (giving back its closed rows' blocks, into
    /// `released`), then forms the next one from the waiting requests in arrival order.
    pub(super) fn refresh(
        &mut self,
        input: &mut PlanInput<'_>,
        waiting: &BTreeMap<RequestId, Waiting>,
        released: &mut Vec<RequestId>,
    ) {
        let Some(recycled) = self.recycle_if_done(input.requests, input.kv) else { return };
        released.extend(recycled);
        let arrival = |id: RequestId| waiting.get(&id).map_or(0, |w| w.arrival);
        let mut next: Vec<(u64, RequestId)> =
            input.requests.values().filter(|r| r.wants_step()).map(|r| (arrival(r.id), r.id)).collect();
        next.sort_unstable();
        self.members.extend(next.into_iter().take(input.config.max_batch_size as usize).map(|(_, id)| id));
        self.members.sort_unstable();
    }

    /// Empties the batch when no row has work left; returns its closed rows, whose blocks it gave
    /// back (None while the batch is busy).
    pub(super) fn recycle_if_done(
        &mut self,
        requests: &RequestTable,
        kv: &mut dyn KvManager,
    ) -> Option<Vec<RequestId>> {
        if self.members.iter().any(|id| requests.get(id).is_some_and(|r| r.wants_step())) {
            return None;
        }
        let closed: Vec<RequestId> =
            self.members.drain(..).filter(|id| requests.get(id).is_some_and(|r| r.is_closed())).collect();
        for id in &closed {
            kv.free(requests[id].kv);
        }
        Some(closed)
    }

    /// When nothing can run otherwise, a closed row's blocks are given back early rather than
    /// deadlock the batch. Returns whether any was.
    pub(super) fn release_closed_rows(&mut self, input: &mut PlanInput<'_>, released: &mut Vec<RequestId>) -> bool {
        let requests = &*input.requests;
        let closed: Vec<RequestId> =
            self.members.iter().copied().filter(|id| requests.get(id).is_some_and(|r| r.is_closed())).collect();
        for id in &closed {
            input.kv.free(requests[id].kv);
        }
        self.members.retain(|id| !closed.contains(id));
        released.extend_from_slice(&closed);
        !closed.is_empty()
    }
}
