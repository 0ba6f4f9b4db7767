//! [`TensorRows`]: one KV tensor of an invocation seen row by row, and the copies between it and
//! the blocks: every way of providing the past gathers into such tensors or scatters out of them.

use std::ops::Range;

use ortex_core::executor::PlanRow;

use super::batch::Batch;
use super::AttentionForm;
use crate::kv_store::{KvArena, KvStore};

/// One KV tensor of an invocation, `[B, KH, width, D]` (as bytes of its elements): KV input or
/// output `index` (layer `index / 2`, key then value) over the invocation's rows, row `b` at
/// `[b * row_bytes, ..)`.
pub(super) struct TensorRows<'p> {
    arena: KvArena,
    width: usize,
    batch: Batch<'p>,
}

impl<'p> TensorRows<'p> {
    pub(super) fn of(index: usize, width: usize, batch: Batch<'p>) -> Self {
        TensorRows { arena: KvArena::of_index(index), width, batch }
    }

    /// Each row with the range of the tensor it takes.
    fn each(&self, element_bytes: usize) -> impl Iterator<Item = (&'p PlanRow, Range<usize>)> + '_ {
        let dims = self.batch.dims;
        let row_bytes = dims.kv_heads * self.width * dims.head_size * element_bytes;
        self.batch.rows().map(move |(b, row)| (row, b * row_bytes..(b + 1) * row_bytes))
    }

    /// Each row's past from its blocks into the tensor at `[0, past_b)`; positions beyond keep
    /// what they held (the mask, or seqlens_k, hides them).
    pub(super) fn gather(&self, kv: &KvStore, dst: &mut [u8]) {
        for (row, range) in self.each(kv.element().bytes()) {
            let blocks = self.batch.plan.row_blocks(row);
            kv.gather(self.arena, blocks, row.start_position as usize, &mut dst[range], self.width);
        }
    }

    /// The tensor's new positions (a present output) into each row's blocks: new token j of row
    /// b sits at `P + j` (mha) or at `past_b + j` (gqa).
    pub(super) fn scatter(&self, kv: &mut KvStore, form: AttentionForm, data: &[u8]) {
        for (row, range) in self.each(kv.element().bytes()) {
            let (past, count) = (row.start_position as usize, row.token_count as usize);
            let at = match form {
                AttentionForm::Mha => self.batch.dims.past,
                AttentionForm::Gqa | AttentionForm::Paged => past,
            };
            let blocks = self.batch.plan.row_blocks(row);
            kv.scatter(self.arena, blocks, past..past + count, &data[range], self.width, at);
        }
    }
}
