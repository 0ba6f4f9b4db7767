//! [`PagedInputs`]: a step's small host inputs for a paged-attention graph, packed from the plan.
//! Pure: no tensors, no session; the paged invocation (paged.rs) binds them.
//!
//! Every row of the step goes into ONE invocation, its new tokens packed after the previous
//! row's (onnxruntime-genai's varlen decoder contract, docs/model-format.md):
//!
//! ```text
//!   plan rows:  A decode (past 7, 1 new)  B chunk (past 32, 3 new)  C prompt (past 0, 2 new)
//!   input_ids                   [a0  b0 b1 b2  c0 c1]                 int64 [num_tokens]
//!   cumulative_sequence_lengths [0, 1, 4, 6]                          int32 [batch + 1]
//!   past_sequence_lengths       [7, 32, 0]                            int32 [batch]
//!   block_table                 [[A's blocks, 0 ...], [B's ...], [C's ...]]  int32 [batch, widest]
//!   attention_metadata          [3, 35, 35]: longest query, longest kv, a lower bound of the longest kv
//!   logits_indices              [0, 3, 5]: each sampled row's last new token    int32 [num_logits]
//! ```
//!
//! New token j of row b sits at position `past_b + j`, in block `block_table[b][(past_b + j) /
//! block_size]`; the graph derives positions and slots from these, so the plan's full block
//! tables ([`Executor::needs_full_block_tables`](ortex_core::executor::Executor)) are all it needs.

use ortex_core::executor::StepPlan;

/// The packed inputs of one step, reused from step to step.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PagedInputs {
    pub input_ids: Vec<i64>,
    pub cumulative_lengths: Vec<i32>,
    pub past_lengths: Vec<i32>,
    /// `[batch, table_width]`, row-major; entries past a row's blocks are 0 (never read: the
    /// graph reads only the blocks of positions below `past_b + n_b`).
    pub block_table: Vec<i32>,
    pub table_width: usize,
    /// `[max_query_len, max_kv_len, max_kv_len_lower_bound]`: the longest row's new tokens, the
    /// longest row's positions after the step, and that again (exact bounds are valid bounds;
    /// onnxruntime-genai's eager steps pass the same).
    pub attention_metadata: [i32; 3],
    /// Indices into the packed token axis of each sampled row's last new token, in plan order
    /// (the order of [`StepOutput`](ortex_core::executor::StepOutput)'s rows).
    pub logits_indices: Vec<i32>,
}

impl PagedInputs {
    /// Packs `plan` (whose rows carry whole block tables) into the buffers.
    pub fn fill(&mut self, plan: &StepPlan) {
        self.clear();
        self.table_width = plan.rows.iter().map(|r| r.block_count as usize).max().unwrap_or(0).max(1);
        self.cumulative_lengths.push(0);
        let mut packed = 0i32;
        for row in &plan.rows {
            debug_assert_eq!(row.first_block, 0, "paged inputs need whole block tables");
            self.input_ids.extend(plan.row_tokens(row).iter().map(|&t| i64::from(t)));
            packed += row.token_count as i32;
            self.cumulative_lengths.push(packed);
            self.past_lengths.push(row.start_position as i32);
            let blocks = plan.row_blocks(row);
            self.block_table.extend(blocks.iter().map(|b| b.0 as i32));
            self.block_table.resize(self.block_table.len() + self.table_width - blocks.len(), 0);
            if row.sample {
                self.logits_indices.push(packed - 1);
            }
            let kv_len = (row.start_position + row.token_count) as i32;
            let [query, kv, lower] = &mut self.attention_metadata;
            *query = (*query).max(row.token_count as i32);
            *kv = (*kv).max(kv_len);
            *lower = *kv;
        }
    }

    fn clear(&mut self) {
        self.input_ids.clear();
        self.cumulative_lengths.clear();
        self.past_lengths.clear();
        self.block_table.clear();
        self.logits_indices.clear();
        self.attention_metadata = [0; 3];
        self.table_width = 0;
    }

    pub fn batch(&self) -> usize {
        self.past_lengths.len()
    }

    /// Bytes of the inputs a step sends (`with_metadata`, `with_indices`: whether the graph takes
    /// those inputs), for the bytes-moved counter.
    pub fn bytes(&self, with_metadata: bool, with_indices: bool) -> u64 {
        let ints = self.cumulative_lengths.len()
            + self.past_lengths.len()
            + self.block_table.len()
            + if with_metadata { 3 } else { 0 }
            + if with_indices { self.logits_indices.len() } else { 0 };
        (self.input_ids.len() * 8 + ints * 4) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ortex_core::executor::PlanRow;
    use ortex_core::ids::{BlockId, RequestId, TurnId};
    use ortex_core::rng::Rng;

    /// The core's seeded generator, drawing the u32s a plan is made of.
    struct Draws(Rng);

    impl Draws {
        fn below(&mut self, n: u32) -> u32 {
            self.0.below(u64::from(n)) as u32
        }
    }

    /// A random plan: rows of 1..=40 new tokens after a past of 0..=300, blocks of `block_size`,
    /// whole tables of distinct random block ids, random sampled rows.
    fn random_plan(rng: &mut Draws, block_size: u32) -> StepPlan {
        let mut plan = StepPlan::default();
        for r in 0..1 + rng.below(8) {
            let past = if rng.below(3) == 0 { 0 } else { rng.below(300) };
            let count = if rng.below(2) == 0 { 1 } else { 1 + rng.below(40) };
            let blocks = (past + count).div_ceil(block_size);
            let row = PlanRow {
                request: RequestId(r),
                turn: TurnId(0),
                first_block: 0,
                request_position: r,
                start_position: past,
                token_start: plan.tokens.len() as u32,
                token_count: count,
                block_start: plan.block_ids.len() as u32,
                block_count: blocks,
                sample: rng.below(4) != 0,
            };
            plan.tokens.extend((0..count).map(|_| rng.below(512) as i32));
            plan.block_ids.extend((0..blocks).map(|b| BlockId(100 * r + b + rng.below(2))));
            plan.rows.push(row);
        }
        plan
    }

    /// The packing written the plain way: per token, where it goes.
    fn reference(plan: &StepPlan) -> PagedInputs {
        let mut out = PagedInputs::default();
        let width = plan.rows.iter().map(|r| r.block_count as usize).max().unwrap().max(1);
        out.table_width = width;
        out.cumulative_lengths.push(0);
        for row in &plan.rows {
            for j in 0..row.token_count {
                out.input_ids.push(i64::from(plan.tokens[(row.token_start + j) as usize]));
            }
            out.cumulative_lengths.push(out.input_ids.len() as i32);
            out.past_lengths.push(row.start_position as i32);
            for column in 0..width {
                let block = (column < row.block_count as usize)
                    .then(|| plan.block_ids[row.block_start as usize + column].0 as i32);
                out.block_table.push(block.unwrap_or(0));
            }
            if row.sample {
                out.logits_indices.push(out.input_ids.len() as i32 - 1);
            }
        }
        let max_query = plan.rows.iter().map(|r| r.token_count).max().unwrap() as i32;
        let max_kv = plan.rows.iter().map(|r| r.start_position + r.token_count).max().unwrap() as i32;
        out.attention_metadata = [max_query, max_kv, max_kv];
        out
    }

    #[test]
    fn random_plans_pack_as_the_reference_does() {
        let mut inputs = PagedInputs::default();
        for seed in 0..500u64 {
            let mut rng = Draws(Rng::new(seed));
            let block_size = [16, 32, 256][rng.below(3) as usize];
            let plan = random_plan(&mut rng, block_size);
            inputs.fill(&plan);
            assert_eq!(inputs, reference(&plan), "seed {seed}");
            // Each sampled row's index is its last token, inside the packed axis.
            assert_eq!(inputs.logits_indices.len(), plan.sampled_rows(), "seed {seed}");
            assert!(inputs.logits_indices.iter().all(|&i| (i as usize) < inputs.input_ids.len()), "seed {seed}");
        }
    }

    #[test]
    fn a_new_token_finds_its_block_and_slot_through_the_table() {
        // Row B: past 30, 5 new tokens, blocks of 16: positions 30..35 span blocks 1 and 2 of its table.
        let mut plan = StepPlan::default();
        let row = |request, past, count, token_start, block_start, block_count| PlanRow {
            request: RequestId(request),
            turn: TurnId(0),
            first_block: 0,
            request_position: 0,
            start_position: past,
            token_start,
            token_count: count,
            block_start,
            block_count,
            sample: true,
        };
        plan.rows = vec![row(1, 3, 1, 0, 0, 1), row(2, 30, 5, 1, 1, 3)];
        plan.tokens = vec![9, 10, 11, 12, 13, 14];
        plan.block_ids = vec![BlockId(4), BlockId(7), BlockId(2), BlockId(5)];
        let mut inputs = PagedInputs::default();
        inputs.fill(&plan);
        assert_eq!(inputs.input_ids, [9, 10, 11, 12, 13, 14]);
        assert_eq!(inputs.cumulative_lengths, [0, 1, 6]);
        assert_eq!(inputs.past_lengths, [3, 30]);
        assert_eq!((inputs.table_width, inputs.block_table.as_slice()), (3, [4, 0, 0, 7, 2, 5].as_slice()));
        assert_eq!(inputs.attention_metadata, [5, 35, 35]);
        assert_eq!(inputs.logits_indices, [0, 5]);
        let slot_of = |b: usize, j: i32| {
            let position = inputs.past_lengths[b] + j;
            (inputs.block_table[b * inputs.table_width + (position / 16) as usize], position % 16)
        };
        assert_eq!(slot_of(1, 0), (2, 14)); // position 30: block 1 of B's table, slot 14
        assert_eq!(slot_of(1, 4), (5, 2)); // position 34: block 2, slot 2
                                           // 6 ids of 8 bytes; 3 + 2 + 6 + 3 + 2 int32s.
        assert_eq!(inputs.bytes(true, true), 6 * 8 + 16 * 4);
        assert_eq!(inputs.bytes(false, false), 6 * 8 + 11 * 4);
    }
}
