//! The prefix cache: full KV blocks that later requests find by their contents and attach instead
//! of computing them again (after vLLM's automatic prefix caching).
//!
//! A full block is named by a hash chained over its parent block's hash and its token ids
//! (SHA-256: fixed and seedless, the same on native and WebAssembly, and not forgeable by a
//! client that wants another client's KV). A block is published when the step that filled it
//! commits; a block of a step that was rolled back is never published. The manager
//! ([`super::PagedKv`]) keeps the tables; this module keeps what is shared between them:
//!
//! ```text
//!   by_hash:   hash ──▶ block          every hash names exactly one block
//!   refs:      block ──▶ tables holding it
//!   evictable: when let go ──▶ block   findable, in no table, counted as free; evicted oldest
//!                                       first (a table lets go of its leaf first, so leaves of a
//!                                       chain go before their parents) when a fresh block is needed
//! ```
//!
//! A partial block is never published, so it is never shared; a published block is never written
//! again (a truncation into one drops it, or takes it out of the cache while only one table
//! holds it).

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use sha2::{Digest, Sha256};

use super::BlockPool;
use crate::ids::BlockId;

/// A full block's name: SHA-256 over its parent's name and its token ids.
pub type BlockHash = [u8; 32];

/// The parent of a chain's first block.
pub const ROOT_HASH: BlockHash = [0; 32];

/// The hash of a full block of `tokens` whose parent block has hash `parent`: SHA-256 over the
/// parent's hash and the tokens as little-endian i32, fed 16 tokens at a time.
pub fn chain_hash(parent: &BlockHash, tokens: &[i32]) -> BlockHash {
    let mut hasher = Sha256::new();
    hasher.update(parent);
    let mut bytes = [0u8; 64];
    for chunk in tokens.chunks(16) {
        for (slot, token) in bytes.chunks_exact_mut(4).zip(chunk) {
            slot.copy_from_slice(&token.to_le_bytes());
        }
        hasher.update(&bytes[..4 * chunk.len()]);
    }
    hasher.finalize().into()
}

/// Hashes a [`BlockHash`] for the map by its first eight bytes: they are already SHA-256 output,
/// and a fixed hasher keeps the map free of ambient randomness (it is never iterated).
#[derive(Default)]
struct DigestPrefix(u64);

impl Hasher for DigestPrefix {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes.iter().take(8) {
            self.0 = (self.0 << 8) | u64::from(byte);
        }
    }
}

type ByHash = HashMap<BlockHash, BlockId, BuildHasherDefault<DigestPrefix>>;

/// A published block: its hash, and when it was let go while it is in no table.
#[derive(Debug, Clone, Copy)]
struct Published {
    hash: BlockHash,
    evictable_since: Option<u64>,
}

/// The shared side of the blocks: hashes, reference counts, the evictable list and counters.
#[derive(Debug, Default)]
pub struct PrefixCache {
    by_hash: ByHash,
    /// Indexed by block id, as `refs` (grown as blocks are first published).
    published: Vec<Option<Published>>,
    /// Tables holding each block, indexed by block id (grown as blocks are first handed out).
    refs: Vec<u32>,
    evictable: BTreeMap<u64, BlockId>,
    next_stamp: u64,
    /// Full blocks looked up (a chain hash computed and searched for), every one counted: the
    /// scheduler looks up only for a request whose next token fits, so that a request waiting
    /// for blocks does not look the same block up step after step.
    pub lookups: u64,
    /// Of those, the blocks found and attached.
    pub hits: u64,
}

impl PrefixCache {
    /// Blocks findable by hash, in tables or evictable.
    pub fn num_cached_blocks(&self) -> u32 {
        self.by_hash.len() as u32
    }

    pub fn num_evictable_blocks(&self) -> u32 {
        self.evictable.len() as u32
    }

    pub fn refs(&self, block: BlockId) -> u32 {
        self.refs.get(block.0 as usize).copied().unwrap_or(0)
    }

    pub fn is_published(&self, block: BlockId) -> bool {
        self.published.get(block.0 as usize).is_some_and(Option::is_some)
    }

    fn published_mut(&mut self, block: BlockId) -> Option<&mut Published> {
        self.published.get_mut(block.0 as usize).and_then(Option::as_mut)
    }

    /// Takes `block` out of `published`, returning what it was published as.
    fn take_published(&mut self, block: BlockId) -> Option<Published> {
        self.published.get_mut(block.0 as usize).and_then(Option::take)
    }

    pub fn find(&self, hash: &BlockHash) -> Option<BlockId> {
        self.by_hash.get(hash).copied()
    }

    /// One more table holds `block` (fresh from the pool, or found by hash).
    pub fn add_ref(&mut self, block: BlockId) {
        let index = block.0 as usize;
        if index >= self.refs.len() {
            self.refs.resize(index + 1, 0);
        }
        if self.refs[index] == 0 {
            if let Some(since) = self.published_mut(block).and_then(|p| p.evictable_since.take()) {
                self.evictable.remove(&since);
            }
        }
        self.refs[index] += 1;
    }

    /// A table lets go of `block`. Returns true when the block goes back to the pool (no table
    /// holds it and it is not published); a published block becomes evictable instead.
    pub fn release(&mut self, block: BlockId) -> bool {
        let refs = &mut self.refs[block.0 as usize];
        assert!(*refs > 0, "block {} released by no table", block.0);
        *refs -= 1;
        if *refs > 0 {
            return false;
        }
        let stamp = self.next_stamp;
        let Some(published) = self.published_mut(block) else { return true };
        published.evictable_since = Some(stamp);
        self.next_stamp += 1;
        self.evictable.insert(stamp, block);
        false
    }

    /// Makes `block` findable as `hash`, unless another block already is (then it stays private:
    /// two requests computed the same prefix at once). Returns whether it was published.
    pub fn publish(&mut self, block: BlockId, hash: BlockHash) -> bool {
        if self.by_hash.contains_key(&hash) {
            return false;
        }
        assert!(!self.is_published(block), "block {} published twice", block.0);
        let index = block.0 as usize;
        if index >= self.published.len() {
            self.published.resize(index + 1, None);
        }
        self.by_hash.insert(hash, block);
        self.published[index] = Some(Published { hash, evictable_since: None });
        true
    }

    /// Takes a block held by one table out of the cache, so that its table may write it again.
    pub fn unpublish(&mut self, block: BlockId) {
        assert_eq!(self.refs(block), 1, "block {} is unpublished while shared", block.0);
        let published = self.take_published(block).expect("an unpublished block was published");
        self.by_hash.remove(&published.hash);
    }

    /// Gives the oldest evictable block back to the pool. Returns false when none is left.
    pub fn evict_oldest(&mut self, pool: &mut BlockPool) -> bool {
        let Some((_, block)) = self.evictable.pop_first() else { return false };
        let published = self.take_published(block).expect("an evictable block is published");
        self.by_hash.remove(&published.hash);
        pool.free(&[block]);
        true
    }

    /// Every hash names one block and back; evictable blocks are published, in no table and
    /// committed in the pool; the reference counts are `expected_refs` (counted from the tables).
    pub fn check_invariants(&self, pool: &BlockPool, expected_refs: &BTreeMap<BlockId, u32>) {
        let published =
            || self.published.iter().enumerate().filter_map(|(i, p)| Some((BlockId(i as u32), p.as_ref()?)));
        assert_eq!(self.by_hash.len(), published().count(), "hashes and published blocks disagree");
        for (block, p) in published() {
            assert_eq!(self.by_hash.get(&p.hash), Some(&block), "hash of block {} names another block", block.0);
        }
        for (i, &refs) in self.refs.iter().enumerate() {
            let block = BlockId(i as u32);
            assert_eq!(refs, expected_refs.get(&block).copied().unwrap_or(0), "refs of block {i} are not its tables");
        }
        assert!(expected_refs.keys().all(|b| (b.0 as usize) < self.refs.len()), "a table holds an uncounted block");
        for (&stamp, &block) in &self.evictable {
            let since = self.published[block.0 as usize].as_ref().and_then(|p| p.evictable_since);
            assert_eq!(since, Some(stamp), "block {} evictable twice", block.0);
            assert_eq!(self.refs(block), 0, "evictable block {} is in a table", block.0);
            assert_eq!(pool.state(block), super::BlockState::Committed, "evictable block {} not committed", block.0);
        }
        let evictable = published().filter(|(_, p)| p.evictable_since.is_some()).count();
        assert_eq!(evictable, self.evictable.len(), "evictable list and blocks disagree");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chain_hash_depends_on_the_parent_and_every_token() {
        let first = chain_hash(&ROOT_HASH, &[1, 2, 3, 4]);
        assert_ne!(first, chain_hash(&ROOT_HASH, &[1, 2, 3, 5]));
        assert_ne!(chain_hash(&first, &[5, 6]), chain_hash(&ROOT_HASH, &[5, 6]));
        assert_eq!(first, chain_hash(&ROOT_HASH, &[1, 2, 3, 4]), "seedless: the same every time");
        // Pinned so that the native and WebAssembly builds (and later versions) agree.
        assert_eq!(first[..4], [0xd8, 0xfa, 0xa8, 0xec]);
    }

    #[test]
    fn a_released_published_block_is_evictable_until_found_again() {
        let mut pool = BlockPool::new(2);
        let mut cache = PrefixCache::default();
        let mut table = Vec::new();
        assert!(pool.reserve(2, &mut table));
        pool.commit(&table);
        let (a, b) = (table[0], table[1]);
        cache.add_ref(a);
        cache.add_ref(b);
        assert!(cache.publish(a, [1; 32]));
        assert!(!cache.publish(b, [1; 32]), "one block per hash");
        assert!(!cache.release(a), "published: kept");
        assert!(cache.release(b), "private: back to the pool");
        pool.free(&[b]);
        assert_eq!(cache.num_evictable_blocks(), 1);
        cache.add_ref(a);
        assert_eq!(cache.num_evictable_blocks(), 0, "found again: in use");
        assert!(!cache.release(a));
        assert!(cache.evict_oldest(&mut pool));
        assert_eq!(cache.find(&[1; 32]), None);
        assert_eq!(pool.num_free_blocks(), 2);
        cache.check_invariants(&pool, &BTreeMap::new());
    }
}
