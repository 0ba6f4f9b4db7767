//! The past shared with the present: gqa decode invocations on the CPU bind one buffer per KV
//! tensor ([`PastPresentBuffer`]) as both past and present, so GroupQueryAttention appends the new
//! position in place instead of copying the whole past into a fresh present.
//!
//! The buffers stay from step to step while the decode rows do (same requests, same order, each
//! one token further; `ORTEX_CARRY_PRESENT=0` turns that off), and are filled from the blocks
//! otherwise; the blocks receive every new position all along. `ORTEX_SHARE_PAST=0` turns the
//! shared buffers off (gqa decodes then carry present like mha).

use ort::session::{Session, SessionOutputs};
use ort::value::Tensor;
use ortex_core::executor::ExecError;
use ortex_core::Result;

use super::batch::{Batch, Dims, TokenInputs};
use super::invocation::{token_input_bytes, Invocation};
use super::signature::{KvSpec, Names};
use super::stats::{now, Counter};
use super::tensor_rows::TensorRows;
use super::{env_flag, fatal, load_error, ort_error, AttentionForm};
use crate::config::ModelConfig;
use crate::kv_element;
use crate::kv_store::KvStore;
use crate::past_present_buffer::{self, PastPresentBuffer};
use crate::runtime::ExecutionProvider;

/// The shared buffers for gqa on the CPU unless `ORTEX_SHARE_PAST=0`. CUDA would want device
/// buffers; it keeps ONNX Runtime's own present tensors.
pub(super) fn buffer_for(
    config: &ModelConfig,
    form: AttentionForm,
    provider: ExecutionProvider,
    session: &Session,
    spec: &KvSpec,
) -> Result<Option<PastPresentBuffer>> {
    if form != AttentionForm::Gqa || provider != ExecutionProvider::Cpu || !env_flag("ORTEX_SHARE_PAST") {
        return Ok(None);
    }
    let model_file = config.model_file.display().to_string();
    let shared = PastPresentBuffer::new(session, spec.element)
        .map_err(|e| load_error(format!("{model_file}: cannot bind buffers: {e}")))?;
    Ok(Some(shared))
}

impl Invocation<'_> {
    /// A gqa decode invocation on the shared past/present buffers: filled from the blocks unless
    /// they continue the previous step's rows, bound as both past and present, run; the new
    /// positions then go from the buffers into the blocks.
    pub(super) fn run_shared(self) -> Result<(), ExecError> {
        let Invocation { config, names, spec, batch, session, kv, tokens, past, mut logits, stats, .. } = self;
        let (plan, rows) = (batch.plan, batch.rows);
        let gather_started = now();
        tokens.fill(batch, i64::from(config.pad_token_id));
        let shared = past.shared.as_mut().expect("the caller checked");
        let reused = past.carry_enabled && shared.continues(plan.step, plan, rows);
        if !reused {
            refill(shared, kv, batch, config.context_length as usize, names.past.len(), spec)?;
        }
        bind(names, shared, batch.dims, tokens).map_err(ort_error("cannot bind the model's inputs"))?;
        stats.add_since(Counter::GatherNs, gather_started);
        stats.add(Counter::Carried, u64::from(reused));

        let run_started = now();
        let outputs = session.run_binding(&shared.binding).map_err(ort_error("the model run failed"))?;
        stats.add_since(Counter::RunNs, run_started);

        let scatter_started = now();
        stats.add(Counter::LogitsBytes, logits.copy_from(&outputs, &names.logits, batch)?);
        stats.add(Counter::HostInputBytes, token_input_bytes(names, batch.dims));
        scatter_buffers(&outputs, &names.present, shared, kv, batch)?;
        drop(outputs);
        shared.record(plan.step, plan, rows);
        stats.add_since(Counter::ScatterNs, scatter_started);
        Ok(())
    }
}

/// Fresh buffers wide enough for the rows and some headroom (and for the widest windowed cache,
/// so that every buffer has one width), filled from the blocks.
fn refill(
    shared: &mut PastPresentBuffer,
    kv: &KvStore,
    batch: Batch<'_>,
    context_length: usize,
    past_inputs: usize,
    spec: &KvSpec,
) -> Result<(), ExecError> {
    let dims = batch.dims;
    let width = past_present_buffer::width_for(dims.past, context_length).max(spec.widest_window());
    shared
        .reshape(past_inputs, dims.batch, dims.kv_heads, width, dims.head_size)
        .map_err(ort_error("cannot allocate the KV buffers"))?;
    for index in 0..past_inputs {
        let bytes = shared.bytes_mut(index).map_err(ort_error("the KV buffers"))?;
        TensorRows::of(index, width, batch).gather(kv, bytes);
    }
    Ok(())
}

/// Binds a shared decode invocation: ids, mask (and positions) from `tokens`, the logits to the
/// CPU, and (when not bound already) each KV buffer as its past input and its present output.
fn bind(names: &Names, shared: &mut PastPresentBuffer, dims: Dims, tokens: &TokenInputs) -> ort::Result<()> {
    let (b, s, t) = (dims.batch, dims.new, dims.total());
    // Owned copies (a few hundred bytes): ort clones a borrowed input it binds, and that clone
    // deadlocks in rc.15 (`IdentitySessionHandle::new` binds a borrowed input itself).
    fn ids(data: &[i64], rows: usize, cols: usize) -> ort::Result<Tensor<i64>> {
        Tensor::from_array(([rows, cols], data.to_vec()))
    }
    let PastPresentBuffer { binding, cpu, .. } = shared;
    binding.bind_input(names.input_ids.as_str(), &ids(&tokens.input_ids()[..b * s], b, s)?)?;
    binding.bind_input(names.attention_mask.as_str(), &ids(&tokens.attention_mask()[..b * t], b, t)?)?;
    if let Some(name) = &names.position_ids {
        binding.bind_input(name.as_str(), &ids(&tokens.position_ids()[..b * s], b, s)?)?;
    }
    binding.bind_output_to_device(names.logits.as_str(), cpu)?;
    if shared.buffers_bound {
        return Ok(());
    }
    shared.buffers_bound = true;
    let (binding, tensors) = shared.binding_and_tensors();
    for ((past, present), tensor) in names.past.iter().zip(&names.present).zip(tensors.iter_mut()) {
        binding.bind_input(past.as_str(), &*tensor)?;
        binding.bind_output(present.as_str(), &mut *tensor)?;
    }
    Ok(())
}

/// The new positions from the buffers (which ONNX Runtime must have written as the present
/// outputs) into the blocks.
fn scatter_buffers(
    outputs: &SessionOutputs<'_>,
    present: &[String],
    shared: &PastPresentBuffer,
    kv: &mut KvStore,
    batch: Batch<'_>,
) -> Result<(), ExecError> {
    let (width, element) = (shared.width(), shared.element());
    for (index, (name, tensor)) in present.iter().zip(shared.tensors()).enumerate() {
        let written = outputs.get(name).and_then(|v| kv_element::value_bytes(v, element).ok()).map(|(_, d)| d.as_ptr());
        if written != Some(tensor.data_ptr().cast::<u8>()) {
            return Err(fatal(format!("ONNX Runtime did not write {name} into the buffer bound to it")));
        }
        let (_, data) =
            kv_element::value_bytes(outputs.get(name).expect("checked"), element).map_err(ort_error(name))?;
        TensorRows::of(index, width, batch).scatter(kv, AttentionForm::Gqa, data);
    }
    Ok(())
}
