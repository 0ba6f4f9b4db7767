//! Paged KV. The mechanism is a fixed pool of blocks ([`BlockPool`]); the one owner of the pool
//! and of every request's block table is the manager ([`PagedKv`], behind [`KvManager`]), which
//! the scheduler (policy) asks for room and the engine commits or rolls back step by step.

mod manager;
mod pool;

pub use manager::{Admission, KvHandle, KvManager, PagedKv, StepReservation};
pub use pool::{BlockPool, BlockState};

/// Blocks needed to hold `num_tokens` positions.
pub fn blocks_for_tokens(num_tokens: u32, block_size: u32) -> u32 {
    num_tokens.div_ceil(block_size)
}
