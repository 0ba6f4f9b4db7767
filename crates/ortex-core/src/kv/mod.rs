//! Paged KV, the mechanism: a fixed pool of blocks and the arithmetic that maps token positions
//! to blocks. Which request owns which block lives in each request's block table; the scheduler
//! (policy) decides when to grow a table, and a transaction's reservations are committed or rolled
//! back all at once.

mod pool;

pub use pool::{BlockPool, BlockState};

/// Blocks needed to hold `num_tokens` positions.
pub fn blocks_for_tokens(num_tokens: u32, block_size: u32) -> u32 {
    num_tokens.div_ceil(block_size)
}
