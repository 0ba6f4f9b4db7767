//! The block pool: a fixed number of blocks, an index-based free list, and a state per block so
//! that every transition (allocate, commit, roll back, free) asserts where the block comes from.
//!
//! ```text
//!            reserve                 commit
//!   Free  ───────────▶  Reserved  ───────────▶  Committed
//!    ▲                     │                        │
//!    └──── rollback ───────┘                        │
//!    └──────────────────────── free ────────────────┘
//! ```

use crate::ids::BlockId;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockState {
    Free,
    Reserved,
    Committed,
}

#[derive(Debug, Clone)]
pub struct BlockPool {
    num_blocks: u32,
    /// Blocks `0..states.len()` have been handed out at least once; the rest are free and were
    /// never touched, so a pool of 2^24 blocks costs memory only for the blocks in use.
    states: Vec<BlockState>,
    /// Stack of returned block indices; the top is handed out first, before any untouched block.
    free_list: Vec<u32>,
    num_reserved: u32,
    num_committed: u32,
}

impl BlockPool {
    pub fn new(num_blocks: u32) -> Self {
        BlockPool { num_blocks, states: Vec::new(), free_list: Vec::new(), num_reserved: 0, num_committed: 0 }
    }

    pub fn num_total_blocks(&self) -> u32 {
        self.num_blocks
    }

    pub fn num_free_blocks(&self) -> u32 {
        self.free_list.len() as u32 + self.num_untouched_blocks()
    }

    /// Blocks never handed out: block 0 first, so that traces read naturally.
    fn num_untouched_blocks(&self) -> u32 {
        self.num_blocks - self.states.len() as u32
    }

    pub fn num_reserved_blocks(&self) -> u32 {
        self.num_reserved
    }

    pub fn num_committed_blocks(&self) -> u32 {
        self.num_committed
    }

    pub fn state(&self, block: BlockId) -> BlockState {
        assert!(block.0 < self.num_blocks, "block {} is outside the pool of {}", block.0, self.num_blocks);
        self.states.get(block.0 as usize).copied().unwrap_or(BlockState::Free)
    }

    /// Reserves `count` blocks, appending them to `table`, or none at all when fewer are free.
    pub fn reserve(&mut self, count: u32, table: &mut Vec<BlockId>) -> bool {
        if count > self.num_free_blocks() {
            return false;
        }
        for _ in 0..count {
            let index = self.take_free();
            let state = &mut self.states[index as usize];
            assert_eq!(*state, BlockState::Free, "block {index} on the free list but not free");
            *state = BlockState::Reserved;
            table.push(BlockId(index));
        }
        self.num_reserved += count;
        true
    }

    /// A returned block if there is one, else the lowest untouched block.
    fn take_free(&mut self) -> u32 {
        if let Some(index) = self.free_list.pop() {
            return index;
        }
        let index = self.states.len() as u32;
        assert!(index < self.num_blocks, "no free block left");
        self.states.push(BlockState::Free);
        index
    }

    pub fn commit(&mut self, blocks: &[BlockId]) {
        for &block in blocks {
            self.transition(block, BlockState::Reserved, BlockState::Committed);
        }
        self.num_reserved -= blocks.len() as u32;
        self.num_committed += blocks.len() as u32;
    }

    /// Returns reserved blocks to the free list (a transaction rolled back).
    pub fn rollback(&mut self, blocks: &[BlockId]) {
        for &block in blocks {
            self.transition(block, BlockState::Reserved, BlockState::Free);
            self.free_list.push(block.0);
        }
        self.num_reserved -= blocks.len() as u32;
    }

    /// Returns committed blocks to the free list (their request was closed or preempted).
    pub fn free(&mut self, blocks: &[BlockId]) {
        for &block in blocks {
            self.transition(block, BlockState::Committed, BlockState::Free);
            self.free_list.push(block.0);
        }
        self.num_committed -= blocks.len() as u32;
    }

    fn transition(&mut self, block: BlockId, from: BlockState, to: BlockState) {
        let state = self.states.get_mut(block.0 as usize);
        let found = state.as_deref().copied().unwrap_or(BlockState::Free);
        assert_eq!(found, from, "block {} is {:?}, expected {:?} before {:?}", block.0, found, from, to);
        *state.expect("a block that is not free has been handed out") = to;
    }

    /// free + reserved + committed = total, and the counters agree with the per-block states.
    pub fn check_invariants(&self) {
        let total = self.num_total_blocks();
        assert_eq!(self.num_free_blocks() + self.num_reserved + self.num_committed, total, "block accounting broken");
        let mut counts = [0u32; 3];
        for s in &self.states {
            counts[*s as usize] += 1;
        }
        counts[BlockState::Free as usize] += self.num_untouched_blocks();
        assert_eq!(
            counts,
            [self.num_free_blocks(), self.num_reserved, self.num_committed],
            "block states disagree with counters"
        );
        let mut seen = vec![false; self.states.len()];
        for &i in &self.free_list {
            assert!((i as usize) < self.states.len(), "untouched block {i} on the free list");
            assert!(!seen[i as usize], "block {i} twice on the free list");
            seen[i as usize] = true;
            assert_eq!(self.states[i as usize], BlockState::Free);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;
    use std::collections::BTreeMap;

    #[test]
    fn reservation_is_all_or_nothing() {
        let mut pool = BlockPool::new(4);
        let mut table = Vec::new();
        assert!(pool.reserve(3, &mut table));
        assert!(!pool.reserve(2, &mut table), "only one block is left");
        assert_eq!(table.len(), 3);
        assert_eq!(pool.num_free_blocks(), 1);
        pool.check_invariants();
    }

    #[test]
    fn a_huge_pool_costs_only_the_blocks_in_use() {
        let mut pool = BlockPool::new(1 << 24);
        let mut table = Vec::new();
        assert!(pool.reserve(3, &mut table));
        assert_eq!(table, [BlockId(0), BlockId(1), BlockId(2)]);
        assert_eq!(pool.states.len(), 3);
        assert_eq!(pool.num_free_blocks(), (1 << 24) - 3);
        pool.rollback(&table[1..]);
        let mut again = Vec::new();
        assert!(pool.reserve(3, &mut again));
        assert_eq!(again, [BlockId(2), BlockId(1), BlockId(3)], "returned blocks first, the last returned on top");
        pool.check_invariants();
    }

    #[test]
    #[should_panic(expected = "expected Committed")]
    fn double_free_is_caught() {
        let mut pool = BlockPool::new(2);
        let mut table = Vec::new();
        pool.reserve(1, &mut table);
        pool.commit(&table);
        pool.free(&table);
        pool.free(&table);
    }

    /// Model-based test: random operations on the real pool and on a trivial model (a map from
    /// block to owner), compared after every operation.
    #[test]
    fn pool_matches_reference_model_under_random_operations() {
        for seed in 0..200u64 {
            let mut rng = Rng::new(seed);
            let total = 1 + rng.below(32) as u32;
            let mut pool = BlockPool::new(total);
            // owner -> (committed blocks, reserved blocks); the model of who holds what.
            let mut owners: BTreeMap<u32, (Vec<BlockId>, Vec<BlockId>)> = BTreeMap::new();
            for _ in 0..300 {
                let owner = rng.below(6) as u32;
                let entry = owners.entry(owner).or_default();
                match rng.below(4) {
                    0 => {
                        let want = rng.below(u64::from(total) + 2) as u32;
                        let model_free = total - owners.values().map(|(c, r)| (c.len() + r.len()) as u32).sum::<u32>();
                        let entry = owners.entry(owner).or_default();
                        let ok = pool.reserve(want, &mut entry.1);
                        assert_eq!(ok, want <= model_free, "seed {seed}: reserve {want} with {model_free} free");
                    }
                    1 => {
                        let reserved = std::mem::take(&mut entry.1);
                        pool.commit(&reserved);
                        entry.0.extend(reserved);
                    }
                    2 => {
                        let reserved = std::mem::take(&mut entry.1);
                        pool.rollback(&reserved);
                    }
                    _ => {
                        let committed = std::mem::take(&mut entry.0);
                        pool.free(&committed);
                    }
                }
                pool.check_invariants();
                let held: Vec<BlockId> = owners.values().flat_map(|(c, r)| c.iter().chain(r).copied()).collect();
                let mut unique = held.clone();
                unique.sort();
                unique.dedup();
                assert_eq!(unique.len(), held.len(), "seed {seed}: a block is in two tables");
                let committed: u32 = owners.values().map(|(c, _)| c.len() as u32).sum();
                let reserved: u32 = owners.values().map(|(_, r)| r.len() as u32).sum();
                assert_eq!(pool.num_committed_blocks(), committed);
                assert_eq!(pool.num_reserved_blocks(), reserved);
                for (c, r) in owners.values() {
                    assert!(c.iter().all(|&b| pool.state(b) == BlockState::Committed));
                    assert!(r.iter().all(|&b| pool.state(b) == BlockState::Reserved));
                }
            }
        }
    }
}
