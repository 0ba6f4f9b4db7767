//! [`Invocation`]: one model run inside a step. A step (one engine transaction) runs one
//! invocation per group of its rows (grouping.rs); each invocation
//!
//! ```text
//!   inputs   ids, mask, positions ([`TokenInputs`]) and the past, provided one of three ways:
//!            in_place.rs (buffers bound as past and present), carried.rs (the previous
//!            invocation's present), gathered.rs (copied from the blocks)
//!   run      Session::run (or run_binding)
//!   outputs  the sampled rows' logits into the step output ([`LogitsOut`]), the new positions'
//!            keys and values into the blocks
//! ```

use std::borrow::Cow;

use ort::session::{Session, SessionInputValue, SessionOutputs};
use ort::value::TensorRef;
use ortex_core::executor::{ExecError, StepOutput};

use super::batch::{Batch, Dims, Inputs, TokenInputs};
use super::carried::Carry;
use super::gathered::GatheredPast;
use super::signature::{KvSpec, Names};
use super::stats::{now, Counter, ExecutorStats};
use super::tensor_rows::TensorRows;
use super::{fatal, ort_error, AttentionForm};
use crate::config::ModelConfig;
use crate::kv_element::{self, KvElement};
use crate::kv_store::KvStore;
use crate::past_present_buffer::PastPresentBuffer;

/// The three ways of providing the past, and what each keeps from invocation to invocation.
pub(super) struct PastSources {
    pub(super) gathered: GatheredPast,
    /// The last decode invocation's present, when it can be the next one's past.
    pub(super) carry: Option<Carry>,
    /// `ORTEX_CARRY_PRESENT=0` turns off carrying and the reuse of shared buffers (to measure
    /// what they save).
    pub(super) carry_enabled: bool,
    /// gqa on the CPU: decode invocations run on shared past/present buffers.
    pub(super) shared: Option<PastPresentBuffer>,
}

impl PastSources {
    /// Drops what the last invocations left (a failed run may have half written it; a new KV
    /// store makes it stale).
    pub(super) fn forget(&mut self) {
        self.carry = None;
        if let Some(shared) = &mut self.shared {
            shared.invalidate();
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PastSource {
    Shared,
    Carried,
    Gathered,
}

/// The step output's logits rows and the slot each plan row's logits go to.
pub(super) struct LogitsOut<'a> {
    pub(super) vocab: usize,
    /// The model's logits type (converted to f32 here).
    pub(super) element: KvElement,
    /// Per plan row (grouping.rs's `sampled_slot`).
    pub(super) sampled_slot: &'a [u32],
    pub(super) out: &'a mut StepOutput,
}

impl LogitsOut<'_> {
    /// The last new position's logits of each sampled row, into its slot of the step output (as
    /// f32); returns the bytes of logits the model returned.
    pub(super) fn copy_from(
        &mut self,
        outputs: &SessionOutputs<'_>,
        name: &str,
        batch: Batch<'_>,
    ) -> Result<u64, ExecError> {
        let (vocab, dims, element) = (self.vocab, batch.dims, self.element);
        let value = outputs.get(name).ok_or_else(|| fatal("the model returned no logits"))?;
        let (shape, logits) = kv_element::value_bytes(value, element).map_err(ort_error("logits"))?;
        if *shape != [dims.batch as i64, dims.new as i64, vocab as i64] {
            return Err(fatal(format!(
                "logits have shape {shape:?}, expected [{}, {}, {vocab}]",
                dims.batch, dims.new
            )));
        }
        for (b, &i) in batch.rows.iter().enumerate() {
            let slot = self.sampled_slot[i as usize];
            if slot != u32::MAX {
                let from = (b * dims.new + batch.plan.rows[i as usize].token_count as usize - 1) * vocab;
                let bytes = &logits[from * element.bytes()..(from + vocab) * element.bytes()];
                element.to_f32(bytes, &mut self.out.logits[slot as usize * vocab..(slot as usize + 1) * vocab]);
            }
        }
        Ok(logits.len() as u64)
    }
}

/// One invocation, with what it borrows from the executor.
pub(super) struct Invocation<'a> {
    pub(super) config: &'a ModelConfig,
    pub(super) form: AttentionForm,
    pub(super) names: &'a Names,
    pub(super) spec: &'a KvSpec,
    pub(super) batch: Batch<'a>,
    pub(super) session: &'a mut Session,
    pub(super) kv: &'a mut KvStore,
    pub(super) tokens: &'a mut TokenInputs,
    pub(super) past: &'a mut PastSources,
    pub(super) logits: LogitsOut<'a>,
    pub(super) stats: &'a ExecutorStats,
}

impl Invocation<'_> {
    pub(super) fn run(self) -> Result<(), ExecError> {
        match self.past_source() {
            PastSource::Shared => self.run_shared(),
            source => self.run_on_allocated_present(source),
        }
    }

    /// Decodes run on the shared buffers when there are any; otherwise on the carried present
    /// when it continues exactly these rows; everything else gathers.
    fn past_source(&self) -> PastSource {
        if !self.batch.is_decode() {
            return PastSource::Gathered;
        }
        if self.past.shared.is_some() {
            return PastSource::Shared;
        }
        match &self.past.carry {
            Some(carry) if carry.continues(self.batch, self.form, self.spec) => PastSource::Carried,
            _ => PastSource::Gathered,
        }
    }

    /// An invocation whose present ONNX Runtime allocates, its past carried or gathered; a
    /// decode's present is then kept to be the next decode's past.
    fn run_on_allocated_present(self, source: PastSource) -> Result<(), ExecError> {
        let Invocation { config, form, names, spec, batch, session, kv, tokens, past, mut logits, stats } = self;
        let carried = source == PastSource::Carried;
        let gather_started = now();
        tokens.fill(batch, i64::from(config.pad_token_id));
        if !carried {
            past.gathered.gather(kv, batch, spec, config.context_length as usize);
        }
        let mut inputs = token_inputs(names, tokens, batch.dims)?;
        match (source, &past.carry) {
            (PastSource::Carried, Some(carry)) => carry.push_inputs(names, &mut inputs),
            _ => past.gathered.push_inputs(names, batch, spec.element, &mut inputs)?,
        }
        stats.add_since(Counter::GatherNs, gather_started);
        stats.add(Counter::Carried, u64::from(carried));

        let run_started = now();
        let mut outputs = session.run(inputs).map_err(ort_error("the model run failed"))?;
        stats.add_since(Counter::RunNs, run_started);

        let scatter_started = now();
        stats.add(Counter::LogitsBytes, logits.copy_from(&outputs, &names.logits, batch)?);
        stats.add(Counter::HostInputBytes, token_input_bytes(names, batch.dims));
        scatter_present(&outputs, &names.present, form, kv, batch)?;
        if batch.is_decode() && past.carry_enabled {
            past.carry = Carry::keep(form, names, batch, &mut outputs);
        }
        stats.add_since(Counter::ScatterNs, scatter_started);
        Ok(())
    }
}

/// Bytes of an invocation's ids, mask (and positions): int64 `[B, S]`, `[B, T]` (and `[B, S]`).
pub(super) fn token_input_bytes(names: &Names, dims: Dims) -> u64 {
    let per_row = dims.new * (1 + usize::from(names.position_ids.is_some())) + dims.total();
    (dims.batch * per_row * 8) as u64
}

/// ids, mask (and positions) as views of `tokens`, in a list with room for the past inputs.
fn token_inputs<'s>(names: &'s Names, tokens: &'s TokenInputs, dims: Dims) -> Result<Inputs<'s>, ExecError> {
    let (b, s, t) = (dims.batch, dims.new, dims.total());
    let ids = |name: &str, data: &'s [i64], cols: usize| -> Result<SessionInputValue<'s>, ExecError> {
        Ok(TensorRef::from_array_view(([b, cols], data)).map_err(|e| fatal(format!("{name}: {e}")))?.into())
    };
    let mut inputs = Vec::with_capacity(3 + names.past.len());
    inputs.push((Cow::Borrowed(names.input_ids.as_str()), ids("input_ids", &tokens.input_ids()[..b * s], s)?));
    inputs.push((
        Cow::Borrowed(names.attention_mask.as_str()),
        ids("attention_mask", &tokens.attention_mask()[..b * t], t)?,
    ));
    if let Some(name) = &names.position_ids {
        inputs.push((Cow::Borrowed(name.as_str()), ids("position_ids", &tokens.position_ids()[..b * s], s)?));
    }
    Ok(inputs)
}

/// Each row's new keys and values from `present` into its blocks: new token j of row b sits
/// at `P + j` (mha) or at `past_b + j` (gqa).
fn scatter_present(
    outputs: &SessionOutputs<'_>,
    present: &[String],
    form: AttentionForm,
    kv: &mut KvStore,
    batch: Batch<'_>,
) -> Result<(), ExecError> {
    let dims = batch.dims;
    let element = kv.element();
    for (index, name) in present.iter().enumerate() {
        let value = outputs.get(name).ok_or_else(|| fatal(format!("the model returned no {name}")))?;
        let (shape, data) = kv_element::value_bytes(value, element).map_err(ort_error(name))?;
        let width = present_width(&shape, dims).ok_or_else(|| {
            fatal(format!(
                "{name} has shape {shape:?}, expected [{}, {}, >= {}, {}]",
                dims.batch,
                dims.kv_heads,
                dims.total(),
                dims.head_size
            ))
        })?;
        TensorRows::of(index, width, batch).scatter(kv, form, data);
    }
    Ok(())
}

/// `present`'s sequence width when its shape is `[B, KH, >= T, D]`.
fn present_width(shape: &[i64], dims: Dims) -> Option<usize> {
    let ok = shape.len() == 4
        && shape[0] == dims.batch as i64
        && shape[1] == dims.kv_heads as i64
        && shape[2] >= dims.total() as i64
        && shape[3] == dims.head_size as i64;
    ok.then_some(shape[2] as usize)
}
