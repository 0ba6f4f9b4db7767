//! Model-based test of the prefix cache: random attach / extend (commit or roll back) / truncate /
//! free operations on [`PagedKv`] against a model that knows only hashes and counts (no block ids):
//! which hashes are cached, how many tables hold each, when each was let go, how many private
//! blocks are in use. After every operation the two must agree on what is free, what is cached,
//! what an attach finds, and the manager's own invariants must hold.

use std::collections::BTreeMap;

use super::{chain_hash, BlockHash, KvHandle, KvManager, PagedKv, StepReservation, ROOT_HASH};
use crate::ids::RequestId;
use crate::rng::Rng;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Slot {
    Cached(BlockHash),
    Private,
}

#[derive(Debug, Default)]
struct Table {
    tokens: Vec<i32>,
    computed: u32,
    slots: Vec<Slot>,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    holders: u32,
    released: Option<u64>,
}

struct Model {
    block_size: u32,
    total: u32,
    entries: BTreeMap<BlockHash, Entry>,
    private: u32,
    stamp: u64,
    lookups: u64,
    hits: u64,
}

impl Model {
    fn evictable(&self) -> u32 {
        self.entries.values().filter(|e| e.holders == 0).count() as u32
    }

    fn pool_free(&self) -> u32 {
        self.total - self.private - self.entries.len() as u32
    }

    fn hash_of(&self, table: &Table, index: usize) -> BlockHash {
        let bs = self.block_size as usize;
        (0..=index).fold(ROOT_HASH, |parent, i| chain_hash(&parent, &table.tokens[i * bs..(i + 1) * bs]))
    }

    fn attach(&mut self, table: &mut Table, target: u32) -> u32 {
        let bs = self.block_size;
        if !table.computed.is_multiple_of(bs) || table.slots.len() as u32 * bs != table.computed {
            return 0;
        }
        let first = table.computed / bs;
        let mut index = first;
        while index < target.saturating_sub(1) / bs {
            let hash = self.hash_of(table, index as usize);
            self.lookups += 1;
            let Some(entry) = self.entries.get_mut(&hash) else { break };
            entry.holders += 1;
            entry.released = None;
            self.hits += 1;
            table.slots.push(Slot::Cached(hash));
            index += 1;
        }
        table.computed = index.max(first) * bs;
        (index - first) * bs
    }

    fn take_fresh(&mut self, count: u32) {
        while self.pool_free() < count {
            let oldest = self.entries.iter().filter_map(|(h, e)| e.released.map(|r| (r, *h))).min();
            let (_, hash) = oldest.expect("admit promised the blocks");
            self.entries.remove(&hash);
        }
        self.private += count;
    }

    fn publish(&mut self, table: &mut Table, from: u32, to: u32) {
        for index in from..to {
            let hash = self.hash_of(table, index as usize);
            if let std::collections::btree_map::Entry::Vacant(slot) = self.entries.entry(hash) {
                slot.insert(Entry { holders: 1, released: None });
                self.private -= 1;
                table.slots[index as usize] = Slot::Cached(hash);
            }
        }
    }

    fn let_go(&mut self, slots: &[Slot]) {
        for slot in slots.iter().rev() {
            match slot {
                Slot::Private => self.private -= 1,
                Slot::Cached(hash) => {
                    let entry = self.entries.get_mut(hash).expect("a held hash is cached");
                    entry.holders -= 1;
                    if entry.holders == 0 {
                        entry.released = Some(self.stamp);
                        self.stamp += 1;
                    }
                }
            }
        }
    }

    fn truncate(&mut self, table: &mut Table, mut computed: u32) -> u32 {
        let bs = self.block_size;
        let last = (computed / bs) as usize;
        if !computed.is_multiple_of(bs) && last < table.slots.len() {
            if let Slot::Cached(hash) = table.slots[last] {
                if self.entries[&hash].holders == 1 {
                    self.entries.remove(&hash);
                    self.private += 1;
                    table.slots[last] = Slot::Private;
                } else {
                    computed -= computed % bs;
                }
            }
        }
        let keep = computed.div_ceil(bs) as usize;
        let freed = table.slots.split_off(keep.min(table.slots.len()));
        self.let_go(&freed);
        table.computed = computed;
        computed
    }
}

/// Tokens of three documents that tables mostly copy, so that prefixes are shared.
fn next_token(rng: &mut Rng, position: usize, document: usize) -> i32 {
    if rng.below(10) == 0 {
        return 1000 + rng.below(4) as i32;
    }
    (document * 100 + position % 7) as i32
}

struct Harness {
    kv: PagedKv,
    model: Model,
    handles: Vec<KvHandle>,
    tables: Vec<Table>,
    documents: Vec<usize>,
}

impl Harness {
    fn new(rng: &mut Rng) -> Harness {
        let block_size = 1 + rng.below(4) as u32;
        let total = 2 + rng.below(24) as u32;
        let mut kv = PagedKv::new(total, block_size, true);
        let handles: Vec<KvHandle> = (1..=5).map(|i| kv.open(RequestId(i))).collect();
        let model = Model { block_size, total, entries: BTreeMap::new(), private: 0, stamp: 0, lookups: 0, hits: 0 };
        let documents = (0..5).map(|_| rng.below(3) as usize).collect();
        Harness { kv, model, handles, tables: (0..5).map(|_| Table::default()).collect(), documents }
    }

    fn extend(&mut self, rng: &mut Rng, t: usize) {
        let table = &mut self.tables[t];
        for _ in 0..1 + rng.below(9) {
            let position = table.tokens.len();
            table.tokens.push(next_token(rng, position, self.documents[t]));
        }
        let target = table.tokens.len() as u32;
        let attached = self.kv.attach_cached(self.handles[t], &table.tokens, table.computed, target);
        assert_eq!(attached, self.model.attach(table, target), "attached tokens");
        let wanted = target - table.computed;
        let super::Admission::Fits(count) = self.kv.admit(self.handles[t], table.computed, target, wanted) else {
            return;
        };
        let mut step = StepReservation::default();
        self.kv.reserve(&mut step, self.handles[t], table.computed, count);
        let fresh = (table.computed + count).div_ceil(self.model.block_size) - table.slots.len() as u32;
        self.model.take_fresh(fresh);
        if rng.below(4) == 0 {
            self.kv.rollback(step);
            self.model.private -= fresh;
            return;
        }
        let tokens = table.tokens.clone();
        self.kv.commit(step, &|_| tokens.as_slice());
        table.slots.extend((0..fresh).map(|_| Slot::Private));
        let bs = self.model.block_size;
        let (from, to) = (table.computed / bs, (table.computed + count) / bs);
        table.computed += count;
        self.model.publish(table, from, to);
    }

    fn act(&mut self, rng: &mut Rng) {
        let t = rng.below(5) as usize;
        match rng.below(6) {
            0 => {
                self.kv.free(self.handles[t]);
                let table = &mut self.tables[t];
                let slots = std::mem::take(&mut table.slots);
                self.model.let_go(&slots);
                *table = Table::default();
                self.documents[t] = rng.below(3) as usize;
            }
            1 => {
                let table = &mut self.tables[t];
                let keep = rng.below(u64::from(table.computed) + 1) as u32;
                table.tokens.truncate(keep as usize);
                let kept = self.kv.truncate(self.handles[t], keep);
                assert_eq!(kept, self.model.truncate(table, keep), "kept tokens");
            }
            _ => self.extend(rng, t),
        }
    }

    fn check(&self) {
        let counters = self.kv.cache_counters();
        assert_eq!(self.kv.num_free_blocks(), self.model.pool_free() + self.model.evictable(), "free blocks");
        assert_eq!(counters.cached_blocks, self.model.entries.len() as u32, "cached blocks");
        assert_eq!((counters.lookups, counters.hits), (self.model.lookups, self.model.hits), "lookups and hits");
        for (t, table) in self.tables.iter().enumerate() {
            assert_eq!(self.kv.table(self.handles[t]).len(), table.slots.len(), "table {t}'s blocks");
        }
        let tables = &self.tables;
        self.kv.check_invariants(
            &|id| tables.get(id.0 as usize - 1).map(|t| (t.computed, &t.tokens[..t.computed as usize])),
            false,
        );
    }
}

#[test]
fn the_prefix_cache_matches_a_model_of_hashes_and_counts_under_random_operations() {
    let (mut hits, mut evictions_seen) = (0, 0);
    for seed in 0..300u64 {
        let mut rng = Rng::new(seed);
        let mut harness = Harness::new(&mut rng);
        for operation in 0..200 {
            let cached_before = harness.model.entries.len();
            harness.act(&mut rng);
            if harness.model.entries.len() < cached_before {
                evictions_seen += 1;
            }
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| harness.check()));
            assert!(result.is_ok(), "seed {seed}, operation {operation}");
        }
        hits += harness.model.hits;
    }
    assert!(
        hits > 1000 && evictions_seen > 100,
        "the workload exercises the cache: {hits} hits, {evictions_seen} evictions"
    );
}
