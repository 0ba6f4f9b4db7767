//! The one owner of the KV blocks: the block pool, every request's block table and the prefix
//! cache. Nothing else touches them; the scheduler asks whether a row fits ([`KvManager::admit`])
//! and reserves the blocks of its rows into one [`StepReservation`], which the engine commits
//! when the step succeeds or rolls back when it fails.
//!
//! ```text
//!            attach_cached ─▶ admit ─▶ Fits(n) ─▶ reserve(step, n)      commit(step) ─▶ tables keep them,
//!   plan:                                                     execute ─▶   full blocks are published
//!                             admit ─▶ Later / Never                   rollback(step) ─▶ back to the pool
//!
//!   between steps: free(request) on close or preemption, truncate(request, tokens) for truncation
//!   open(request) when the engine creates a request, release(handle) when it removes it
//! ```
//!
//! A table holds the blocks of a request's computed KV (`blocks_for_tokens(computed)` of them)
//! plus, during a step, that step's reservations at its end. Tables live in a slab indexed by the
//! [`KvHandle`] that `open` gave the request, so a row costs no map lookup. With prefix caching
//! ([`PrefixCache`]) a table's full blocks may be shared with other tables; without it every block
//! is in one table and the manager behaves as it did before the cache existed.

use std::collections::BTreeMap;

use super::prefix_cache::{chain_hash, BlockHash, PrefixCache, ROOT_HASH};
use super::{blocks_for_tokens, BlockPool, BlockState};
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
    /// With prefix caching: the tables whose blocks `from..to` the step fills (published when it
    /// commits).
    filled: Vec<(KvHandle, u32, u32)>,
}

impl StepReservation {
    /// Whether the step has a row of `id` (its KV is being computed).
    pub fn holds(&self, id: RequestId) -> bool {
        self.requests.contains(&id)
    }
}

/// The prefix cache's counters, for the engine's stats.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheCounters {
    pub cached_blocks: u32,
    pub lookups: u64,
    pub hits: u64,
}

/// What the invariant check needs to know of a request: its computed tokens and its tokens.
pub type RequestKv<'a> = (u32, &'a [i32]);

/// What the engine and the scheduler need from a KV cache manager: [`PagedKv`], with or without
/// its prefix cache.
pub trait KvManager: Send {
    fn block_size(&self) -> u32;
    fn num_total_blocks(&self) -> u32;
    /// Blocks a new reservation may take (evictable cached blocks included).
    fn num_free_blocks(&self) -> u32;
    fn cache_counters(&self) -> CacheCounters;
    /// A new, empty table for request `id`.
    fn open(&mut self, id: RequestId) -> KvHandle;
    /// Frees the table's blocks and forgets it; the handle is invalid afterwards.
    fn release(&mut self, kv: KvHandle);
    /// Attaches the cached blocks that continue the table's computed KV over `tokens`, short of
    /// the block that holds token `target - 1` (computed anyway: its logits are wanted). Returns
    /// the tokens attached (0 without a prefix cache), which the caller adds to `computed`.
    fn attach_cached(&mut self, kv: KvHandle, tokens: &[i32], computed: u32, target: u32) -> u32;
    /// Whether a context of `tokens` tokens could fit the pool at all (when every block is free).
    fn can_ever_hold(&self, tokens: u32) -> bool;
    /// How many of `wanted` new tokens after `computed` fit now, for a request whose context
    /// will reach `target` tokens.
    fn admit(&self, kv: KvHandle, computed: u32, target: u32, wanted: u32) -> Admission;
    /// Grows the table to hold `computed + count` tokens, recording the row in `step`.
    /// The caller was told `Fits(count)` (or more) by `admit` in the same plan.
    fn reserve(&mut self, step: &mut StepReservation, kv: KvHandle, computed: u32, count: u32);
    /// Keeps the step's blocks; with prefix caching publishes the blocks it filled, named by
    /// their requests' tokens (`tokens_of`).
    fn commit<'a>(&mut self, step: StepReservation, tokens_of: &dyn Fn(RequestId) -> &'a [i32]);
    fn rollback(&mut self, step: StepReservation);
    /// The request's block table: its computed KV (and, during a step, the step's blocks).
    fn table(&self, kv: KvHandle) -> &[BlockId];
    /// Lets go of every block of the table (closed, or preempted for recomputation).
    fn free(&mut self, kv: KvHandle);
    /// Keeps the blocks of the first `computed` tokens and lets go of the rest. Returns the
    /// computed tokens kept: fewer when `computed` ends inside a block other tables share (that
    /// block is let go, and its first tokens are computed again).
    fn truncate(&mut self, kv: KvHandle, computed: u32) -> u32;
    /// The pool balances, tables cover their requests' computed KV (`request_of`: None for a
    /// request the engine no longer holds, which must hold no table), a block is in two tables
    /// only when published, and every published block a table holds is the one its tokens name.
    fn check_invariants<'a>(&self, request_of: &dyn Fn(RequestId) -> Option<RequestKv<'a>>, step_in_flight: bool);
}

/// One request's table in the slab.
#[derive(Debug)]
struct Table {
    owner: RequestId,
    blocks: Vec<BlockId>,
    /// With prefix caching: the chain hash of each full computed block, in order.
    hashes: Vec<BlockHash>,
}

/// The paged KV cache: a fixed pool of blocks, one table per open request, and optionally the
/// prefix cache that lets tables share full blocks.
#[derive(Debug)]
pub struct PagedKv {
    pool: BlockPool,
    block_size: u32,
    /// Indexed by handle; None where a released handle waits in `vacant` to be reused.
    tables: Vec<Option<Table>>,
    vacant: Vec<u32>,
    cache: Option<PrefixCache>,
}

/// Table `kv` of `tables`, by field so that the pool and the cache stay borrowable beside it.
fn open_table(tables: &[Option<Table>], kv: KvHandle) -> &Table {
    tables[kv.0 as usize].as_ref().expect("an open KV handle")
}

fn open_table_mut(tables: &mut [Option<Table>], kv: KvHandle) -> &mut Table {
    tables[kv.0 as usize].as_mut().expect("an open KV handle")
}

impl PagedKv {
    pub fn new(num_blocks: u32, block_size: u32, prefix_caching: bool) -> PagedKv {
        let cache = prefix_caching.then(PrefixCache::default);
        PagedKv { pool: BlockPool::new(num_blocks), block_size, tables: Vec::new(), vacant: Vec::new(), cache }
    }

    fn entry(&self, kv: KvHandle) -> &Table {
        open_table(&self.tables, kv)
    }

    fn entry_mut(&mut self, kv: KvHandle) -> &mut Table {
        open_table_mut(&mut self.tables, kv)
    }

    /// Gives `blocks` back, the last first (so that a chain's leaves are evicted before its
    /// parents): to the pool, or with prefix caching to whoever else holds them or the cache.
    fn let_go(&mut self, blocks: &[BlockId]) {
        let Some(cache) = &mut self.cache else {
            self.pool.free(blocks);
            return;
        };
        for &block in blocks.iter().rev() {
            if cache.release(block) {
                self.pool.free(&[block]);
            }
        }
    }

    /// Takes `count` fresh blocks into table `kv`, evicting cached blocks when the pool's own
    /// free blocks are too few.
    fn take_fresh(&mut self, kv: KvHandle, count: u32) {
        if let Some(cache) = &mut self.cache {
            while self.pool.num_free_blocks() < count && cache.evict_oldest(&mut self.pool) {}
        }
        let table = &mut open_table_mut(&mut self.tables, kv).blocks;
        let start = table.len();
        assert!(self.pool.reserve(count, table), "a reservation admitted by admit() failed");
        if let Some(cache) = &mut self.cache {
            table[start..].iter().for_each(|&block| cache.add_ref(block));
        }
    }

    /// Publishes blocks `from..to` of table `kv`, which a committed step filled.
    fn publish(&mut self, kv: KvHandle, from: u32, to: u32, tokens: &[i32]) {
        let block_size = self.block_size as usize;
        let cache = self.cache.as_mut().expect("only a prefix cache records filled blocks");
        let table = open_table_mut(&mut self.tables, kv);
        assert_eq!(table.hashes.len(), from as usize, "a table's hashes cover its full blocks");
        for index in from as usize..to as usize {
            let parent = table.hashes.last().unwrap_or(&ROOT_HASH);
            let hash = chain_hash(parent, &tokens[index * block_size..(index + 1) * block_size]);
            cache.publish(table.blocks[index], hash);
            table.hashes.push(hash);
        }
    }

    /// With prefix caching, a truncation that ends inside a published block must not leave it
    /// writable while shared: returns the computed tokens to keep.
    fn keep_writable(&mut self, kv: KvHandle, computed: u32) -> u32 {
        let block_size = self.block_size;
        let Some(cache) = &mut self.cache else { return computed };
        let table = open_table_mut(&mut self.tables, kv);
        let last = (computed / block_size) as usize;
        if computed.is_multiple_of(block_size) || last >= table.blocks.len() || !cache.is_published(table.blocks[last])
        {
            return computed;
        }
        if cache.refs(table.blocks[last]) == 1 {
            cache.unpublish(table.blocks[last]);
            return computed;
        }
        computed - computed % block_size
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
        self.pool.num_free_blocks() + self.cache.as_ref().map_or(0, PrefixCache::num_evictable_blocks)
    }

    fn cache_counters(&self) -> CacheCounters {
        self.cache.as_ref().map_or(CacheCounters::default(), |cache| CacheCounters {
            cached_blocks: cache.num_cached_blocks(),
            lookups: cache.lookups,
            hits: cache.hits,
        })
    }

    fn open(&mut self, id: RequestId) -> KvHandle {
        let table = Some(Table { owner: id, blocks: Vec::new(), hashes: Vec::new() });
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

    fn attach_cached(&mut self, kv: KvHandle, tokens: &[i32], computed: u32, target: u32) -> u32 {
        let block_size = self.block_size;
        let Some(cache) = &mut self.cache else { return 0 };
        let table = open_table_mut(&mut self.tables, kv);
        let attachable = target.saturating_sub(1) / block_size;
        if !computed.is_multiple_of(block_size) || table.blocks.len() as u32 * block_size != computed {
            return 0;
        }
        let first = computed / block_size;
        let mut index = first;
        while index < attachable {
            let span = (index * block_size) as usize..((index + 1) * block_size) as usize;
            let hash = chain_hash(table.hashes.last().unwrap_or(&ROOT_HASH), &tokens[span]);
            cache.lookups += 1;
            let Some(block) = cache.find(&hash) else { break };
            cache.add_ref(block);
            cache.hits += 1;
            table.blocks.push(block);
            table.hashes.push(hash);
            index += 1;
        }
        (index - first) * block_size
    }

    fn can_ever_hold(&self, tokens: u32) -> bool {
        u64::from(tokens) <= u64::from(self.pool.num_total_blocks()) * u64::from(self.block_size)
    }

    fn admit(&self, kv: KvHandle, computed: u32, target: u32, wanted: u32) -> Admission {
        if !self.can_ever_hold(target) {
            return Admission::Never;
        }
        let reachable_blocks = u64::from(self.entry(kv).blocks.len() as u32 + self.num_free_blocks());
        let capacity_tokens = (reachable_blocks * u64::from(self.block_size)).saturating_sub(u64::from(computed));
        match wanted.min(capacity_tokens.min(u64::from(u32::MAX)) as u32) {
            0 => Admission::Later,
            count => Admission::Fits(count),
        }
    }

    fn reserve(&mut self, step: &mut StepReservation, kv: KvHandle, computed: u32, count: u32) {
        let block_size = self.block_size;
        let table = self.entry(kv);
        let held = table.blocks.len() as u32;
        step.requests.push(table.owner);
        let needed = blocks_for_tokens(computed + count, block_size).saturating_sub(held);
        if needed > 0 {
            step.grown.push((kv, held));
            self.take_fresh(kv, needed);
        }
        let (full_before, full_after) = (computed / block_size, (computed + count) / block_size);
        if self.cache.is_some() && full_after > full_before {
            step.filled.push((kv, full_before, full_after));
        }
    }

    fn commit<'a>(&mut self, step: StepReservation, tokens_of: &dyn Fn(RequestId) -> &'a [i32]) {
        for (kv, before) in step.grown {
            let table = &open_table(&self.tables, kv).blocks;
            self.pool.commit(&table[before as usize..]);
        }
        for (kv, from, to) in step.filled {
            let tokens = tokens_of(self.entry(kv).owner);
            self.publish(kv, from, to, tokens);
        }
    }

    fn rollback(&mut self, step: StepReservation) {
        for (kv, before) in step.grown {
            let table = &mut open_table_mut(&mut self.tables, kv).blocks;
            let reserved = table.split_off(before as usize);
            self.pool.rollback(&reserved);
            if let Some(cache) = &mut self.cache {
                reserved.iter().for_each(|&block| assert!(cache.release(block), "a reserved block is private"));
            }
        }
    }

    fn table(&self, kv: KvHandle) -> &[BlockId] {
        &self.entry(kv).blocks
    }

    fn free(&mut self, kv: KvHandle) {
        let table = self.entry_mut(kv);
        let blocks = std::mem::take(&mut table.blocks);
        table.hashes.clear();
        self.let_go(&blocks);
    }

    fn truncate(&mut self, kv: KvHandle, computed: u32) -> u32 {
        let computed = self.keep_writable(kv, computed);
        let keep = blocks_for_tokens(computed, self.block_size) as usize;
        let full = (computed / self.block_size) as usize;
        let table = self.entry_mut(kv);
        let freed = table.blocks.split_off(keep.min(table.blocks.len()));
        table.hashes.truncate(full);
        self.let_go(&freed);
        computed
    }

    fn check_invariants<'a>(&self, request_of: &dyn Fn(RequestId) -> Option<RequestKv<'a>>, step_in_flight: bool) {
        self.pool.check_invariants();
        let mut refs = BTreeMap::<BlockId, u32>::new();
        for table in self.tables.iter().flatten() {
            let (computed, tokens) =
                request_of(table.owner).unwrap_or_else(|| panic!("request {} has a table but is gone", table.owner.0));
            self.check_table(table, computed, tokens);
            for block in &table.blocks {
                assert_ne!(self.pool.state(*block), BlockState::Free, "block {} is in a table and free", block.0);
                *refs.entry(*block).or_default() += 1;
            }
        }
        let referenced = refs.len() as u32;
        let evictable = self.cache.as_ref().map_or(0, PrefixCache::num_evictable_blocks);
        assert_eq!(
            self.pool.num_free_blocks() + evictable + referenced,
            self.pool.num_total_blocks(),
            "free + evictable + referenced blocks are not the pool"
        );
        match &self.cache {
            Some(cache) => {
                cache.check_invariants(&self.pool, &refs);
                let shared_private = refs.iter().find(|&(&block, &n)| n > 1 && !cache.is_published(block));
                assert!(shared_private.is_none(), "block {:?} is in two tables but not published", shared_private);
            }
            None => assert!(refs.values().all(|&n| n == 1), "a block in two tables without a prefix cache"),
        }
        let vacant = self.tables.iter().filter(|t| t.is_none()).count();
        assert_eq!(vacant, self.vacant.len(), "a vacant table slot is not listed for reuse");
        if !step_in_flight {
            assert_eq!(self.pool.num_reserved_blocks(), 0, "reservations outlived their step");
        }
    }
}

impl PagedKv {
    /// One table covers its computed KV; with a prefix cache its hashes are the chain of its
    /// tokens, and a shared or published block it holds is the one that chain names.
    fn check_table(&self, table: &Table, computed: u32, tokens: &[i32]) {
        let id = table.owner.0;
        assert!(
            blocks_for_tokens(computed, self.block_size) <= table.blocks.len() as u32,
            "request {id} KV outside its table"
        );
        let Some(cache) = &self.cache else { return };
        let full = (computed / self.block_size) as usize;
        assert_eq!(table.hashes.len(), full, "request {id}: hashes do not cover its full blocks");
        let mut parent = ROOT_HASH;
        for (index, hash) in table.hashes.iter().enumerate() {
            let span = index * self.block_size as usize..(index + 1) * self.block_size as usize;
            assert_eq!(*hash, chain_hash(&parent, &tokens[span]), "request {id}: block {index}'s hash");
            parent = *hash;
        }
        for (index, &block) in table.blocks.iter().enumerate() {
            if cache.is_published(block) {
                assert!(index < full, "request {id} holds published block {} past its full blocks", block.0);
                assert_eq!(
                    cache.find(&table.hashes[index]),
                    Some(block),
                    "request {id}: block {index} is not its tokens' block"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    #[test]
    fn admission_counts_the_table_and_the_free_blocks() {
        let mut kv = PagedKv::new(4, 4, false);
        let a = kv.open(RequestId(1));
        let b = kv.open(RequestId(2));
        assert_eq!(kv.admit(a, 0, 17, 17), Admission::Never, "17 tokens never fit 16 slots");
        assert_eq!(kv.admit(a, 0, 16, 10), Admission::Fits(10));
        let mut step = StepReservation::default();
        kv.reserve(&mut step, a, 0, 10);
        kv.commit(step, &|_| &[]);
        assert_eq!(kv.table(a).len(), 3);
        assert_eq!(kv.admit(b, 0, 8, 8), Admission::Fits(4), "one block is left");
        assert_eq!(kv.admit(a, 10, 16, 9), Admission::Fits(6), "its own last block has room for 2");
        kv.truncate(a, 3);
        assert_eq!(kv.table(a).len(), 1);
        kv.free(a);
        assert!(kv.table(a).is_empty());
        kv.check_invariants(&|_| Some((0, &[])), false);
        kv.release(a);
        assert_eq!(kv.open(RequestId(3)), a, "a released handle is reused");
    }

    #[test]
    fn a_rolled_back_step_leaves_the_tables_as_they_were() {
        let mut kv = PagedKv::new(8, 2, false);
        let (a, b) = (kv.open(RequestId(1)), kv.open(RequestId(2)));
        let mut step = StepReservation::default();
        kv.reserve(&mut step, a, 0, 3);
        kv.commit(step, &|_| &[]);
        let before = kv.table(a).to_vec();
        let mut step = StepReservation::default();
        kv.reserve(&mut step, a, 3, 4);
        kv.reserve(&mut step, b, 0, 2);
        assert!(step.holds(RequestId(2)));
        kv.rollback(step);
        assert_eq!(kv.table(a), before.as_slice());
        assert!(kv.table(b).is_empty());
        assert_eq!(kv.num_free_blocks(), 6);
        kv.check_invariants(&|id| Some((if id == RequestId(1) { 3 } else { 0 }, &[])), false);
    }

    /// Model-based: random admit / reserve / commit / rollback / truncate / free against a
    /// trivial model (each request's computed tokens), compared after every operation.
    #[test]
    fn the_manager_matches_a_model_of_computed_tokens_under_random_operations() {
        for seed in 0..200u64 {
            let mut rng = Rng::new(seed);
            let block_size = 1 + rng.below(4) as u32;
            let num_blocks = 1 + rng.below(16) as u32;
            let mut kv = PagedKv::new(num_blocks, block_size, false);
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
                    kv.commit(step, &|_| &[]);
                    for (id, n) in planned {
                        *computed.entry(id).or_default() += n;
                    }
                }
                kv.check_invariants(&|id| Some((computed.get(&id).copied().unwrap_or(0), &[])), false);
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
                kv.check_invariants(&|id| Some((computed.get(&id).copied().unwrap_or(0), &[])), false);
                let used: u32 = computed.values().map(|&c| blocks_for_tokens(c, block_size)).sum();
                assert_eq!(kv.num_free_blocks(), num_blocks - used, "seed {seed}: free blocks");
            }
        }
    }
}
