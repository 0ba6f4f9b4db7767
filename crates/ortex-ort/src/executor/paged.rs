//! [`PagedStep`]: a step of a paged-attention graph, ALL its rows (decodes and prefill chunks
//! together, any lengths) in ONE invocation on an [`IoBinding`] that holds the KV pool.
//!
//! ```text
//!   load     pool tensors allocated once in the session's memory (kv_pool.rs), each bound as
//!            past_key_values.{l}.* AND present.{l}.* (bindings persist across runs)
//!   per step the plan packed into small host inputs (paged_inputs.rs) and bound (ONNX Runtime
//!            copies them to the device), logits bound to CPU memory, run, the sampled rows'
//!            logits into the step output
//! ```
//!
//! Nothing of the KV crosses between the host and the model: the graph writes each new
//! position into its slot of the pool (in place) and reads each row's past through the block
//! table. What does cross is counted: `hostInputBytes` and `logitsBytes` (stats.rs).

use ort::memory::MemoryInfo;
use ort::session::{IoBinding, Session};
use ort::value::Tensor;
use ortex_core::executor::{ExecError, KvGeometry, StepOutput, StepPlan};
use ortex_core::Result;

use super::paged_inputs::PagedInputs;
use super::signature::Names;
use super::stats::{now, Counter, ExecutorStats};
use super::{fatal, ort_error};
use crate::config::PagedNames;
use crate::kv_element::{self, KvElement};
use crate::kv_pool::{KvPool, PoolShape};
use crate::runtime::ExecutionProvider;

/// Which optional inputs the graph takes (the signature check saw them at load).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PagedInputsTaken {
    /// `attention_metadata` int32 [3] (onnxruntime-genai's builder always adds it).
    pub(super) metadata: bool,
    /// `logits_indices` int32 [num_logits] (`prune_lm_head=true`): logits come back for the
    /// sampled rows only; without it the graph returns every position's, `[num_tokens, vocab]`.
    pub(super) logits_indices: bool,
}

impl PagedInputsTaken {
    /// Which of the optional inputs `session`'s graph has.
    pub(super) fn of(session: &Session, names: &PagedNames) -> PagedInputsTaken {
        let has = |name: &str| session.inputs().iter().any(|o| o.name() == name);
        PagedInputsTaken { metadata: has(&names.attention_metadata), logits_indices: has(&names.logits_indices) }
    }
}

pub(super) struct PagedStep {
    names: PagedNames,
    taken: PagedInputsTaken,
    pool: KvPool,
    binding: IoBinding,
    /// Whether `binding` holds the pool as past and present (bound on the first run).
    pool_bound: bool,
    inputs: PagedInputs,
    /// Where the logits are bound: CPU memory, whatever the provider.
    cpu: MemoryInfo<'static>,
}

impl PagedStep {
    /// Allocates the pool of `geometry` in the session's memory and a binding for it.
    pub(super) fn new(
        session: &Session,
        provider: ExecutionProvider,
        geometry: KvGeometry,
        shape: PoolShape,
        names: PagedNames,
        taken: PagedInputsTaken,
    ) -> Result<PagedStep> {
        let pool = KvPool::new(session, provider, geometry, shape)?;
        let binding =
            session.create_binding().map_err(|e| super::load_error(format!("cannot bind the KV pool: {e}")))?;
        Ok(PagedStep {
            names,
            taken,
            pool,
            binding,
            pool_bound: false,
            inputs: PagedInputs::default(),
            cpu: MemoryInfo::default(),
        })
    }

    pub(super) fn pool_bytes(&self) -> u64 {
        self.pool.bytes()
    }

    /// Runs every row of `plan` in one invocation; the sampled rows' logits go into `out` (which
    /// the caller sized: one `vocab`-wide row per sampled row, in plan order).
    pub(super) fn run(
        &mut self,
        plan: &StepPlan,
        session: &mut Session,
        names: &Names,
        logits_element: KvElement,
        out: &mut StepOutput,
        stats: &ExecutorStats,
    ) -> Result<(), ExecError> {
        let gather_started = now();
        self.inputs.fill(plan);
        let sent = self.bind_inputs(names).map_err(ort_error("cannot bind the model's inputs"))?;
        stats.add(Counter::HostInputBytes, sent);
        stats.add_since(Counter::GatherNs, gather_started);

        let run_started = now();
        let outputs = session.run_binding(&self.binding).map_err(ort_error("the model run failed"))?;
        stats.add_since(Counter::RunNs, run_started);

        let scatter_started = now();
        let value = outputs.get(&names.logits).ok_or_else(|| fatal("the model returned no logits"))?;
        let (shape, logits) = kv_element::value_bytes(value, logits_element).map_err(ort_error("logits"))?;
        stats.add(Counter::LogitsBytes, logits.len() as u64);
        self.copy_logits(&shape, logits, logits_element, out)?;
        stats.add_since(Counter::ScatterNs, scatter_started);
        Ok(())
    }

    /// Binds this step's host inputs (owned copies: ort clones a borrowed input it binds, and
    /// that clone deadlocks in rc.15, in_place.rs) and, on the first run, the pool; returns the
    /// bytes of the host inputs.
    fn bind_inputs(&mut self, names: &Names) -> ort::Result<u64> {
        let (inputs, paged, binding) = (&self.inputs, &self.names, &mut self.binding);
        let batch = inputs.batch();
        binding.bind_input(
            names.input_ids.as_str(),
            &Tensor::from_array(([inputs.input_ids.len()], inputs.input_ids.clone()))?,
        )?;
        binding
            .bind_input(paged.cumulative_sequence_lengths.as_str(), &ints([batch + 1], &inputs.cumulative_lengths)?)?;
        binding.bind_input(paged.past_sequence_lengths.as_str(), &ints([batch], &inputs.past_lengths)?)?;
        binding.bind_input(paged.block_table.as_str(), &int_table(batch, inputs.table_width, &inputs.block_table)?)?;
        if self.taken.metadata {
            binding.bind_input(paged.attention_metadata.as_str(), &ints([3], &inputs.attention_metadata)?)?;
        }
        let mut sent = inputs.bytes(self.taken.metadata, self.taken.logits_indices);
        if self.taken.logits_indices {
            let indices = logits_indices(inputs);
            sent += ((indices.len() - inputs.logits_indices.len()) * 4) as u64;
            binding.bind_input(paged.logits_indices.as_str(), &ints([indices.len()], &indices)?)?;
        }
        binding.bind_output_to_device(names.logits.as_str(), &self.cpu)?;
        if !self.pool_bound {
            for ((past, present), tensor) in names.past.iter().zip(&names.present).zip(self.pool.tensors_mut()) {
                binding.bind_input(past.as_str(), &*tensor)?;
                binding.bind_output(present.as_str(), &mut *tensor)?;
            }
            self.pool_bound = true;
        }
        Ok(sent)
    }

    /// The sampled rows' logits, as f32, into `out` in plan order. `shape` is `[num_logits,
    /// vocab]` (one row per bound index) or, for a graph without `logits_indices`,
    /// `[num_tokens, vocab]` (the rows at the indices are taken).
    fn copy_logits(
        &self,
        shape: &[i64],
        logits: &[u8],
        element: KvElement,
        out: &mut StepOutput,
    ) -> Result<(), ExecError> {
        let (vocab, wanted) = (out.width, &self.inputs.logits_indices);
        let rows = if self.taken.logits_indices { wanted.len().max(1) } else { self.inputs.input_ids.len() };
        if *shape != [rows as i64, vocab as i64] {
            return Err(fatal(format!("logits have shape {shape:?}, expected [{rows}, {vocab}]")));
        }
        let bytes = vocab * element.bytes();
        for (slot, &index) in wanted.iter().enumerate() {
            let row = if self.taken.logits_indices { slot } else { index as usize };
            element.to_f32(&logits[row * bytes..(row + 1) * bytes], &mut out.logits[slot * vocab..(slot + 1) * vocab]);
        }
        Ok(())
    }
}

/// The indices to bind: the sampled rows' last tokens, or for a step that samples no row (every
/// row a prefill chunk that does not end its prompt) the first token's, whose logits are not
/// used: a graph's Gather takes empty indices, but not every kernel after it takes zero rows.
fn logits_indices(inputs: &PagedInputs) -> Vec<i32> {
    if inputs.logits_indices.is_empty() {
        vec![0]
    } else {
        inputs.logits_indices.clone()
    }
}

fn ints<const N: usize>(shape: [usize; N], data: &[i32]) -> ort::Result<Tensor<i32>> {
    Tensor::from_array((shape, data.to_vec()))
}

fn int_table(rows: usize, cols: usize, data: &[i32]) -> ort::Result<Tensor<i32>> {
    Tensor::from_array(([rows, cols], data.to_vec()))
}
