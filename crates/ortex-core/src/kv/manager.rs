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
//! ```
//!
//! A table holds the blocks of a request's computed KV (`blocks_for_tokens(computed)` of them)
//! plus, during a step, that step's reservations at its end.

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

/// The blocks one step reserved, row by row. It must be committed or rolled back, consuming it.
#[must_use = "a step's reservation is committed or rolled back"]
#[derive(Debug, Default)]
pub struct StepReservation {
    /// Each planned row's request and its table's length before the step.
    rows: Vec<(RequestId, u32)>,
}

impl StepReservation {
    /// Whether the step has a row of `id` (its KV is being computed).
    pub fn holds(&self, id: RequestId) -> bool {
        self.rows.iter().any(|&(row, _)| row == id)
    }
}

/// What the engine and the scheduler need from a KV cache manager. One implementation today
/// ([`PagedKv`]); a prefix-caching manager implements the same calls.
pub trait KvManager: Send {
    fn block_size(&self) -> u32;
    fn num_total_blocks(&self) -> u32;
    /// Blocks a new reservation may take.
    fn num_free_blocks(&self) -> u32;
    /// How many of `wanted` new tokens after `computed` fit now, for a request whose context
    /// will reach `target` tokens.
    fn admit(&self, id: RequestId, computed: u32, target: u32, wanted: u32) -> Admission;
    /// Grows `id`'s table to hold `computed + count` tokens, recording the row in `step`.
    /// The caller was told `Fits(count)` (or more) by `admit` in the same plan.
    fn reserve(&mut self, step: &mut StepReservation, id: RequestId, computed: u32, count: u32);
    fn commit(&mut self, step: StepReservation);
    fn rollback(&mut self, step: StepReservation);
    /// The request's block table: its computed KV (and, during a step, the step's blocks).
    fn table(&self, id: RequestId) -> &[BlockId];
    /// Returns every block of `id` (closed, or preempted for recomputation).
    fn free(&mut self, id: RequestId);
    /// Keeps the blocks of the first `computed` tokens of `id` and returns the rest.
    fn truncate(&mut self, id: RequestId, computed: u32);
    /// The pool balances, no block is in two tables, and every table covers its request's
    /// computed KV (`computed_of` answers a request's computed token count; None for a request
    /// the engine no longer holds, which must hold no blocks).
    fn check_invariants(&self, computed_of: &dyn Fn(RequestId) -> Option<u32>, step_in_flight: bool);
}

/// The paged KV cache: a fixed pool of blocks and one table per request that holds blocks.
#[derive(Debug)]
pub struct PagedKv {
    pool: BlockPool,
    block_size: u32,
    tables: BTreeMap<RequestId, Vec<BlockId>>,
}

impl PagedKv {
    pub fn new(num_blocks: u32, block_size: u32) -> PagedKv {
        PagedKv { pool: BlockPool::new(num_blocks), block_size, tables: BTreeMap::new() }
    }

    fn table_len(&self, id: RequestId) -> u32 {
        self.tables.get(&id).map_or(0, |t| t.len() as u32)
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

    fn admit(&self, id: RequestId, computed: u32, target: u32, wanted: u32) -> Admission {
        let pool_tokens = u64::from(self.pool.num_total_blocks()) * u64::from(self.block_size);
        if u64::from(target) > pool_tokens {
            return Admission::Never;
        }
        let reachable_blocks = self.table_len(id) + self.pool.num_free_blocks();
        let capacity_tokens = (reachable_blocks * self.block_size).saturating_sub(computed);
        match wanted.min(capacity_tokens) {
            0 => Admission::Later,
            count => Admission::Fits(count),
        }
    }

    fn reserve(&mut self, step: &mut StepReservation, id: RequestId, computed: u32, count: u32) {
        let table = self.tables.entry(id).or_default();
        let held = table.len() as u32;
        step.rows.push((id, held));
        let needed = blocks_for_tokens(computed + count, self.block_size).saturating_sub(held);
        assert!(self.pool.reserve(needed, table), "a reservation admitted by admit() failed");
    }

    fn commit(&mut self, step: StepReservation) {
        for (id, before) in step.rows {
            let table = &self.tables[&id];
            self.pool.commit(&table[before as usize..]);
        }
    }

    fn rollback(&mut self, step: StepReservation) {
        for (id, before) in step.rows {
            let table = self.tables.get_mut(&id).expect("a reserved row has a table");
            self.pool.rollback(&table[before as usize..]);
            table.truncate(before as usize);
        }
        self.tables.retain(|_, table| !table.is_empty());
    }

    fn table(&self, id: RequestId) -> &[BlockId] {
        self.tables.get(&id).map_or(&[], Vec::as_slice)
    }

    fn free(&mut self, id: RequestId) {
        if let Some(table) = self.tables.remove(&id) {
            self.pool.free(&table);
        }
    }

    fn truncate(&mut self, id: RequestId, computed: u32) {
        let keep = blocks_for_tokens(computed, self.block_size) as usize;
        let Some(table) = self.tables.get_mut(&id) else { return };
        let freed = table.split_off(keep.min(table.len()));
        self.pool.free(&freed);
        if table.is_empty() {
            self.tables.remove(&id);
        }
    }

    fn check_invariants(&self, computed_of: &dyn Fn(RequestId) -> Option<u32>, step_in_flight: bool) {
        self.pool.check_invariants();
        let mut owner = BTreeMap::new();
        let mut held = 0u32;
        for (&id, table) in &self.tables {
            assert!(!table.is_empty(), "request {} keeps an empty table", id.0);
            for block in table {
                let previous = owner.insert(*block, id);
                assert!(previous.is_none(), "block {} in the tables of {:?} and {}", block.0, previous, id.0);
            }
            held += table.len() as u32;
            let computed = computed_of(id).unwrap_or_else(|| panic!("request {} holds blocks but is gone", id.0));
            assert!(
                blocks_for_tokens(computed, self.block_size) <= table.len() as u32,
                "request {} KV outside its table",
                id.0
            );
        }
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
        let a = RequestId(1);
        assert_eq!(kv.admit(a, 0, 17, 17), Admission::Never, "17 tokens never fit 16 slots");
        assert_eq!(kv.admit(a, 0, 16, 10), Admission::Fits(10));
        let mut step = StepReservation::default();
        kv.reserve(&mut step, a, 0, 10);
        kv.commit(step);
        assert_eq!(kv.table(a).len(), 3);
        assert_eq!(kv.admit(RequestId(2), 0, 8, 8), Admission::Fits(4), "one block is left");
        assert_eq!(kv.admit(a, 10, 16, 9), Admission::Fits(6), "its own last block has room for 2");
        kv.truncate(a, 3);
        assert_eq!(kv.table(a).len(), 1);
        kv.free(a);
        assert!(kv.table(a).is_empty());
        kv.check_invariants(&|_| Some(0), false);
    }

    #[test]
    fn a_rolled_back_step_leaves_the_tables_as_they_were() {
        let mut kv = PagedKv::new(8, 2);
        let mut step = StepReservation::default();
        kv.reserve(&mut step, RequestId(1), 0, 3);
        kv.commit(step);
        let before = kv.table(RequestId(1)).to_vec();
        let mut step = StepReservation::default();
        kv.reserve(&mut step, RequestId(1), 3, 4);
        kv.reserve(&mut step, RequestId(2), 0, 2);
        assert!(step.holds(RequestId(2)));
        kv.rollback(step);
        assert_eq!(kv.table(RequestId(1)), before.as_slice());
        assert!(kv.table(RequestId(2)).is_empty());
        assert_eq!(kv.num_free_blocks(), 6);
        kv.check_invariants(&|id| (id == RequestId(1)).then_some(3), false);
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
                    if let Admission::Fits(n) = kv.admit(id, done, done + wanted, wanted) {
                        assert!(n <= wanted, "seed {seed}");
                        kv.reserve(&mut step, id, done, n);
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
                        kv.free(id);
                        computed.remove(&id);
                    }
                    1 => {
                        let keep = rng.below(u64::from(computed.get(&id).copied().unwrap_or(0)) + 1) as u32;
                        kv.truncate(id, keep);
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
