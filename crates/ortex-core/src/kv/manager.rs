//! The one owner of the KV blocks: the block pool and every request's block table. Nothing else
//! touches either; the scheduler asks it whether a row fits ([`KvManager::admit`]) and reserves
//! the blocks of its rows into one [`StepReservation`], which the engine commits when the step
//! succeeds or rolls back when it fails.
//!
//! ```text
//!            admit ─▶ Fits(n) ─▶ reserve(step, n)            commit(step) ─▶ tables keep them
//!   plan:                                          execute ─▶
//!            admit ─▶ Later / Never                          rollback(step) ─▶ blocks back to the pool
//!
//!   between steps: free(request) on close or preemption, truncate(request, tokens) for truncation
//!   open(request) when the engine creates a request, release(handle) when it removes it
//! ```
//!
//! A table holds the blocks of a request's computed KV (`blocks_for_tokens(computed)` of them)
//! plus, during a step, that step's reservations at its end. Tables live in a slab indexed by the
//! [`KvHandle`] that `open` gave the request, so a row costs no map lookup.

use std::collections::BTreeMap;

use super::{blocks_for_tokens, BlockPool};
use crate::ids::{BlockId, RequestId};

/// Whether a request's next tokens fit the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// This many of the wanted tokens fit now (at least one).
    Fits(u32),
    /// Not one fits now; blocks may be freed later.
    Later,
    /// The request's whole context can never fit the pool.
    Never,
}

/// A request's key into the manager's tables: given by `open`, valid until `release`. The
/// request carries it; only the manager reads what it points at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct KvHandle(u32);

/// The blocks one step reserved, row by row. It must be committed or rolled back, consuming it.
#[must_use = "a step's reservation is committed or rolled back"]
#[derive(Debug, Default)]
pub struct StepReservation {
    /// Each planned row's request.
    requests: Vec<RequestId>,
    /// The tables that took blocks, with their lengths before the step (most decode rows take
    /// none, and then commit and rollback have nothing to do for them).
    grown: Vec<(KvHandle, u32)>,
}

impl StepReservation {
    /// Whether the step has a row of `id` (its KV is being computed).
    pub fn holds(&self, id: RequestId) -> bool {
        self.requests.contains(&id)
    }
}

/// What the engine and the scheduler need from a KV cache manager. One implementation today
/// ([`PagedKv`]); a prefix-caching manager implements the same calls.
pub trait KvManager: Send {
    fn block_size(&self) -> u32;
    fn num_total_blocks(&self) -> u32;
    /// Blocks a new reservation may take.
    fn num_free_blocks(&self) -> u32;
    /// A new, empty table for request `id`.
    fn open(&mut self, id: RequestId) -> KvHandle;
    /// Frees the table's blocks and forgets it; the handle is invalid afterwards.
    fn release(&mut self, kv: KvHandle);
    /// Whether a context of `tokens` tokens could fit the pool at all (when every block is free).
    fn can_ever_hold(&self, tokens: u32) -> bool;
    /// How many of `wanted` new tokens after `computed` fit now, for a request whose context
    /// will reach `target` tokens.
    fn admit(&self, kv: KvHandle, computed: u32, target: u32, wanted: u32) -> Admission;
    /// Grows the table to hold `computed + count` tokens, recording the row in `step`.
    /// The caller was told `Fits(count)` (or more) by `admit` in the same plan.
    fn reserve(&mut self, step: &mut StepReservation, kv: KvHandle, computed: u32, count: u32);
    fn commit(&mut self, step: StepReservation);
    fn rollback(&mut self, step: StepReservation);
    /// The request's block table: its computed KV (and, during a step, the step's blocks).
    fn table(&self, kv: KvHandle) -> &[BlockId];
    /// Returns every block of the table (closed, or preempted for recomputation).
    fn free(&mut self, kv: KvHandle);
    /// Keeps the blocks of the first `computed` tokens and returns the rest.
    fn truncate(&mut self, kv: KvHandle, computed: u32);
    /// The pool balances, no block is in two tables, and every table covers its request's
    /// computed KV (`computed_of` answers a request's computed token count; None for a request
    /// the engine no longer holds, which must hold no table).
    fn check_invariants(&self, computed_of: &dyn Fn(RequestId) -> Option<u32>, step_in_flight: bool);
}

/// One request's table in the slab.
#[derive(Debug)]
struct Table {
    owner: RequestId,
    blocks: Vec<BlockId>,
}

/// The paged KV cache: a fixed pool of blocks and one table per open request.
#[derive(Debug)]
pub struct PagedKv {
    pool: BlockPool,
    block_size: u32,
    /// Indexed by handle; None where a released handle waits in `vacant` to be reused.
    tables: Vec<Option<Table>>,
    vacant: Vec<u32>,
}

impl PagedKv {
    pub fn new(num_blocks: u32, block_size: u32) -> PagedKv {
        PagedKv { pool: BlockPool::new(num_blocks), block_size, tables: Vec::new(), vacant: Vec::new() }
    }

    fn blocks(&self, kv: KvHandle) -> &Vec<BlockId> {
        &self.tables[kv.0 as usize].as_ref().expect("an open KV handle").blocks
    }

    fn blocks_mut(&mut self, kv: KvHandle) -> &mut Vec<BlockId> {
        &mut self.tables[kv.0 as usize].as_mut().expect("an open KV handle").blocks
    }
}

impl KvManager for PagedKv {
    fn block_size(&self) -> u32 {
        self.block_size
    }

    fn num_total_blocks(&self) -> u32 {
        self.pool.num_total_blocks()
    }

    fn num_free_blocks(&self) -> u32 {
        self.pool.num_free_blocks()
    }

    fn open(&mut self, id: RequestId) -> KvHandle {
        let table = Some(Table { owner: id, blocks: Vec::new() });
        match self.vacant.pop() {
            Some(index) => {
                self.tables[index as usize] = table;
                KvHandle(index)
            }
            None => {
                self.tables.push(table);
                KvHandle(self.tables.len() as u32 - 1)
            }
        }
    }

    fn release(&mut self, kv: KvHandle) {
        self.free(kv);
        self.tables[kv.0 as usize] = None;
        self.vacant.push(kv.0);
    }

    fn can_ever_hold(&self, tokens: u32) -> bool {
        u64::from(tokens) <= u64::from(self.pool.num_total_blocks()) * u64::from(self.block_size)
    }

    fn admit(&self, kv: KvHandle, computed: u32, target: u32, wanted: u32) -> Admission {
        if !self.can_ever_hold(target) {
            return Admission::Never;
        }
        let reachable_blocks = self.blocks(kv).len() as u32 + self.pool.num_free_blocks();
        let capacity_tokens = (reachable_blocks * self.block_size).saturating_sub(computed);
        match wanted.min(capacity_tokens) {
            0 => Admission::Later,
            count => Admission::Fits(count),
        }
    }

    fn reserve(&mut self, step: &mut StepReservation, kv: KvHandle, computed: u32, count: u32) {
        let block_size = self.block_size;
        let table = self.tables[kv.0 as usize].as_mut().expect("an open KV handle");
        let held = table.blocks.len() as u32;
        step.requests.push(table.owner);
        let needed = blocks_for_tokens(computed + count, block_size).saturating_sub(held);
        if needed > 0 {
            step.grown.push((kv, held));
            assert!(self.pool.reserve(needed, &mut table.blocks), "a reservation admitted by admit() failed");
        }
    }

    fn commit(&mut self, step: StepReservation) {
        for (kv, before) in step.grown {
            let table = &self.tables[kv.0 as usize].as_ref().expect("an open KV handle").blocks;
            self.pool.commit(&table[before as usize..]);
        }
    }

    fn rollback(&mut self, step: StepReservation) {
        for (kv, before) in step.grown {
            let table = &mut self.tables[kv.0 as usize].as_mut().expect("an open KV handle").blocks;
            self.pool.rollback(&table[before as usize..]);
            table.truncate(before as usize);
        }
    }

    fn table(&self, kv: KvHandle) -> &[BlockId] {
        self.blocks(kv)
    }

    fn free(&mut self, kv: KvHandle) {
        let table = std::mem::take(self.blocks_mut(kv));
        self.pool.free(&table);
    }

    fn truncate(&mut self, kv: KvHandle, computed: u32) {
        let keep = blocks_for_tokens(computed, self.block_size) as usize;
        let table = self.blocks_mut(kv);
        let freed = table.split_off(keep.min(table.len()));
        self.pool.free(&freed);
    }

    fn check_invariants(&self, computed_of: &dyn Fn(RequestId) -> Option<u32>, step_in_flight: bool) {
        self.pool.check_invariants();
        let mut owner = BTreeMap::new();
        let mut held = 0u32;
        for table in self.tables.iter().flatten() {
            let id = table.owner;
            for block in &table.blocks {
                let previous = owner.insert(*block, id);
                assert!(previous.is_none(), "block {} in the tables of {:?} and {}", block.0, previous, id.0);
            }
            held += table.blocks.len() as u32;
            let computed = computed_of(id).unwrap_or_else(|| panic!("request {} has a table but is gone", id.0));
            assert!(
                blocks_for_tokens(computed, self.block_size) <= table.blocks.len() as u32,
                "request {} KV outside its table",
                id.0
            );
        }
        let vacant = self.tables.iter().filter(|t| t.is_none()).count();
        assert_eq!(vacant, self.vacant.len(), "a vacant table slot is not listed for reuse");
        assert_eq!(held, self.pool.num_reserved_blocks() + self.pool.num_committed_blocks(), "blocks held by no table");
        if !step_in_flight {
            assert_eq!(self.pool.num_reserved_blocks(), 0, "reservations outlived their step");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    #[test]
    fn admission_counts_the_table_and_the_free_blocks() {
        let mut kv = PagedKv::new(4, 4);
        let a = kv.open(RequestId(1));
        let b = kv.open(RequestId(2));
        assert_eq!(kv.admit(a, 0, 17, 17), Admission::Never, "17 tokens never fit 16 slots");
        assert_eq!(kv.admit(a, 0, 16, 10), Admission::Fits(10));
        let mut step = StepReservation::default();
        kv.reserve(&mut step, a, 0, 10);
        kv.commit(step);
        assert_eq!(kv.table(a).len(), 3);
        assert_eq!(kv.admit(b, 0, 8, 8), Admission::Fits(4), "one block is left");
        assert_eq!(kv.admit(a, 10, 16, 9), Admission::Fits(6), "its own last block has room for 2");
        kv.truncate(a, 3);
        assert_eq!(kv.table(a).len(), 1);
        kv.free(a);
        assert!(kv.table(a).is_empty());
        kv.check_invariants(&|_| Some(0), false);
        kv.release(a);
        assert_eq!(kv.open(RequestId(3)), a, "a released handle is reused");
    }

    #[test]
    fn a_rolled_back_step_leaves_the_tables_as_they_were() {
        let mut kv = PagedKv::new(8, 2);
        let (a, b) = (kv.open(RequestId(1)), kv.open(RequestId(2)));
        let mut step = StepReservation::default();
        kv.reserve(&mut step, a, 0, 3);
        kv.commit(step);
        let before = kv.table(a).to_vec();
        let mut step = StepReservation::default();
        kv.reserve(&mut step, a, 3, 4);
        kv.reserve(&mut step, b, 0, 2);
        assert!(step.holds(RequestId(2)));
        kv.rollback(step);
        assert_eq!(kv.table(a), before.as_slice());
        assert!(kv.table(b).is_empty());
        assert_eq!(kv.num_free_blocks(), 6);
        kv.check_invariants(&|id| Some(if id == RequestId(1) { 3 } else { 0 }), false);
    }

    /// Model-based: random admit / reserve / commit / rollback / truncate / free against a
    /// trivial model (each request's computed tokens), compared after every operation.
    #[test]
    fn the_manager_matches_a_model_of_computed_tokens_under_random_operations() {
        for seed in 0..200u64 {
            let mut rng = Rng::new(seed);
            let block_size = 1 + rng.below(4) as u32;
            let num_blocks = 1 + rng.below(16) as u32;
            let mut kv = PagedKv::new(num_blocks, block_size);
            let handles: Vec<KvHandle> = (1..=5).map(|i| kv.open(RequestId(i))).collect();
            let handle = |id: RequestId| handles[id.0 as usize - 1];
            let mut computed = BTreeMap::<RequestId, u32>::new();
            for _ in 0..300 {
                let mut step = StepReservation::default();
                let mut planned = BTreeMap::new();
                for _ in 0..rng.below(4) {
                    let id = RequestId(1 + rng.below(5) as u32);
                    if planned.contains_key(&id) {
                        continue;
                    }
                    let done = computed.get(&id).copied().unwrap_or(0);
                    let wanted = 1 + rng.below(8) as u32;
                    if let Admission::Fits(n) = kv.admit(handle(id), done, done + wanted, wanted) {
                        assert!(n <= wanted, "seed {seed}");
                        kv.reserve(&mut step, handle(id), done, n);
                        planned.insert(id, n);
                    }
                }
                if rng.below(4) == 0 {
                    kv.rollback(step);
                } else {
                    kv.commit(step);
                    for (id, n) in planned {
                        *computed.entry(id).or_default() += n;
                    }
                }
                kv.check_invariants(&|id| Some(computed.get(&id).copied().unwrap_or(0)), false);
                let id = RequestId(1 + rng.below(5) as u32);
                match rng.below(3) {
                    0 => {
                        kv.free(handle(id));
                        computed.remove(&id);
                    }
                    1 => {
                        let keep = rng.below(u64::from(computed.get(&id).copied().unwrap_or(0)) + 1) as u32;
                        kv.truncate(handle(id), keep);
                        computed.insert(id, keep);
                    }
                    _ => {}
                }
                kv.check_invariants(&|id| Some(computed.get(&id).copied().unwrap_or(0)), false);
                let used: u32 = computed.values().map(|&c| blocks_for_tokens(c, block_size)).sum();
                assert_eq!(kv.num_free_blocks(), num_blocks - used, "seed {seed}: free blocks");
            }
        }
    }
}
