//! Paged KV. The mechanism is a fixed pool of blocks ([`BlockPool`]); the one owner of the pool,
//! of every request's block table and of the prefix cache ([`PrefixCache`]: full blocks shared
//! between requests by their contents) is the manager ([`PagedKv`], behind [`KvManager`]), which
//! the scheduler (policy) asks for room and the engine commits or rolls back step by step.

mod manager;
mod pool;
mod prefix_cache;

#[cfg(test)]
mod cache_model_tests;

pub use manager::{Admission, CacheCounters, KvHandle, KvManager, PagedKv, RequestKv, StepReservation};
pub use pool::{BlockPool, BlockState};
pub use prefix_cache::{chain_hash, BlockHash, PrefixCache, ROOT_HASH};

/// Blocks needed to hold `num_tokens` positions.
pub fn blocks_for_tokens(num_tokens: u32, block_size: u32) -> u32 {
    num_tokens.div_ceil(block_size)
}
