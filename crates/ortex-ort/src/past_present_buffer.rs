//! [`PastPresentBuffer`]: one buffer per KV tensor, bound as both the past input and the present output
//! of GroupQueryAttention decode invocations (CPU).
//!
//! Given separate past and present tensors, ONNX Runtime's CPU GroupQueryAttention zeroes the
//! whole present and copies every row's whole past into it before appending the new position: at
//! every decode step, as much memory traffic as the attention itself. When past and present are the
//! same memory it writes the new keys and values in place instead (onnxruntime-genai's
//! `past_present_share_buffer`). So the executor keeps, per KV input, an ONNX Runtime tensor
//! `[B, KH, W, D]` whose width `W` leaves room to grow, binds it both ways (an `IoBinding`) and
//! keeps it from step to step while the decode rows stay the same (same requests, same order, each
//! one token further); any change of batch composition, or a row reaching `W`, fills it again from
//! the engine's blocks (which receive every new position all along).
//!
//! The kernel reads row `b` only at `[0, past_b + 1)` (its `seqlens_k`), so what lies beyond (the
//! headroom, shorter rows' tails) is never read and needs no zeroing.

use ort::memory::MemoryInfo;
use ort::session::{IoBinding, Session};
use ort::value::DynTensor;
use ortex_core::executor::StepPlan;
use ortex_core::ids::RequestId;

use crate::kv_element::{self, KvElement};

/// Positions of room a fresh buffer leaves beyond the longest row: at least this many, or an
/// eighth of the row's length when that is more. A refill copies the whole past, so it should
/// come rarely; but every change of batch refills too, and the buffers are a second copy of the
/// rows' KV, so the room is memory held: 128 positions (or a quarter) grew the buffers by 40%
/// when the first of 16 rows of 200 positions ended (docs/performance.md, issue 22).
const MIN_HEADROOM_POSITIONS: usize = 32;

/// Buffer widths are multiples of this many positions.
const WIDTH_QUANTUM_POSITIONS: usize = 32;

pub struct PastPresentBuffer {
    /// One per past input, in the executor's `Names::past` order; `[batch, kv_heads, width, head_size]`
    /// of the model's KV element type.
    tensors: Vec<DynTensor>,
    element: KvElement,
    batch: usize,
    width: usize,
    /// The rows of the last run, in order, with the position each one's KV now ends at; empty
    /// when the buffers hold nothing usable.
    rows: Vec<(RequestId, u32)>,
    /// The step of the last run.
    step: u64,
    pub binding: IoBinding,
    /// Whether `binding` holds these very buffers as past and present (bindings persist from run
    /// to run: only the ids and the mask change at each step).
    pub buffers_bound: bool,
    /// Where ONNX Runtime puts the outputs that are not bound to a buffer (the logits).
    pub cpu: MemoryInfo<'static>,
}

/// A buffer width for rows whose longest past is `past` (one new position each), at most the
/// model's context length (and at least `past + 1`).
pub fn width_for(past: usize, context_length: usize) -> usize {
    let wanted = past + 1 + MIN_HEADROOM_POSITIONS.max(past / 8);
    wanted.next_multiple_of(WIDTH_QUANTUM_POSITIONS).min(context_length).max(past + 1)
}

impl PastPresentBuffer {
    pub fn new(session: &Session, element: KvElement) -> ort::Result<PastPresentBuffer> {
        Ok(PastPresentBuffer {
            tensors: Vec::new(),
            element,
            batch: 0,
            width: 0,
            rows: Vec::new(),
            step: 0,
            binding: session.create_binding()?,
            buffers_bound: false,
            cpu: MemoryInfo::default(),
        })
    }

    pub fn width(&self) -> usize {
        self.width
    }

    pub fn element(&self) -> KvElement {
        self.element
    }

    pub fn tensors(&self) -> &[DynTensor] {
        &self.tensors
    }

    /// Buffer `index`'s elements as bytes.
    pub fn bytes_mut(&mut self, index: usize) -> ort::Result<&mut [u8]> {
        kv_element::tensor_bytes_mut(&mut self.tensors[index], self.element)
    }

    /// The binding and the buffers, to bind them to each other.
    pub fn binding_and_tensors(&mut self) -> (&mut IoBinding, &mut [DynTensor]) {
        (&mut self.binding, &mut self.tensors)
    }

    /// Whether `rows` (a decode invocation of step `step`) continue exactly the rows of the last
    /// run, and every one still fits in the buffers.
    pub fn continues(&self, step: u64, plan: &StepPlan, rows: &[u32]) -> bool {
        self.step + 1 == step
            && self.rows.len() == rows.len()
            && rows.iter().zip(&self.rows).all(|(&i, &(request, end))| {
                let row = &plan.rows[i as usize];
                row.request == request && row.start_position == end && (end as usize) < self.width
            })
    }

    /// Buffers of `[batch, kv_heads, width, head_size]`, one per past input, reused when the
    /// shape is unchanged; their contents are left to the caller to fill.
    pub fn reshape(
        &mut self,
        inputs: usize,
        batch: usize,
        kv_heads: usize,
        width: usize,
        head_size: usize,
    ) -> ort::Result<()> {
        self.rows.clear();
        if self.tensors.len() != inputs || self.batch != batch || self.width != width {
            // The binding holds the old buffers too: release them first, or the process holds
            // two sets of buffers (the whole shared past again) until the next bind.
            self.binding.clear();
            self.buffers_bound = false;
            self.tensors.clear();
            for _ in 0..inputs {
                self.tensors.push(self.element.new_tensor([batch, kv_heads, width, head_size])?);
            }
            self.batch = batch;
            self.width = width;
        }
        Ok(())
    }

    /// Records a run of `rows` in step `step`: each row now ends one position further.
    pub fn record(&mut self, step: u64, plan: &StepPlan, rows: &[u32]) {
        self.step = step;
        self.rows.clear();
        self.rows.extend(rows.iter().map(|&i| {
            let row = &plan.rows[i as usize];
            (row.request, row.start_position + row.token_count)
        }));
    }

    /// Forgets the contents (after a failed run: they may be half written).
    pub fn invalidate(&mut self) {
        self.rows.clear();
        self.binding.clear();
        self.buffers_bound = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widths_leave_headroom_in_quanta_within_the_context() {
        assert_eq!(width_for(0, 2048), 64); // 0 + 1 + 32 -> 33 -> 64
        assert_eq!(width_for(31, 2048), 64);
        assert_eq!(width_for(32, 2048), 96);
        assert_eq!(width_for(199, 2048), 256); // 199 + 1 + 32 -> 232 -> 256
        assert_eq!(width_for(1000, 2048), 1152); // 1000 + 1 + 125 -> 1126 -> 1152
        assert_eq!(width_for(2000, 2048), 2048);
        assert_eq!(width_for(10, 50), 50); // 43 -> 64, held to the context
        for past in 0..3000 {
            let w = width_for(past, 4096.max(past + 1));
            assert!(w > past, "past {past} width {w}");
        }
    }
}
