//! [`OrtExecutor`]: runs one engine step on an ONNX decoder.
//!
//! ONNX Runtime has no CPU kernel for paged attention, so each step maps the engine's paged KV to
//! the model's contiguous past tensors and back (docs/model-format.md, "Padding contract"):
//!
//! ```text
//!   plan rows ──group──> invocations (as few as the attention form allows)
//!   per invocation, B rows, P = longest past, S = most new tokens, T = P + S:
//!     gather   blocks ──> past_key_values.{l}.key/value [B, KH, P, D]   row b's past in [0, past_b)
//!              input_ids [B, S] (pad-filled), attention_mask [B, T] (1 on [0, past_b) and
//!              [P, P + n_b)), position_ids [B, S] = past_b + j (when the model takes them)
//!     run      session.run
//!     scatter  present.{l}.key/value [B, KH, T, D] ──> blocks: new token j of row b is at
//!              P + j (mha: present = [past ; new]) or past_b + j (gqa: each row at its own
//!              length); logits [B, S, V] at (b, n_b - 1) ──> StepOutput (sampled rows only)
//! ```
//!
//! Grouping: decode rows (one new token) always share one invocation. Rows with several new tokens
//! (prefill chunks, continuation turns) are padded to the longest of their group, so they are kept
//! apart from the decodes (padding a decode row to a 500-token chunk would multiply its cost by
//! 500) and grouped by length so padding at most doubles a group's positions. The gqa form also
//! refuses batches of rows with past context and several new tokens (ONNX Runtime's CPU kernel:
//! "batch_size must be 1 when sequence_length > 1 and past context is given"): those run one
//! row per invocation; first prompts (no past) may share one.
//!
//! Shared past/present: on the CPU, gqa decode invocations bind one buffer per KV tensor as both
//! past and present ([`SharedPast`]), so GroupQueryAttention appends in place instead of copying
//! the whole past into a fresh present; the buffers stay from step to step while the decode rows
//! do (below), and are filled from the blocks otherwise.
//!
//! Buffers (ids, mask, positions, past tensors) live in [`Scratch`] and grow to the largest step
//! seen; nothing is allocated per token beyond what ONNX Runtime allocates for its outputs. The
//! time spent gathering, in the session and scattering is counted in [`ExecutorStats`].
//!
//! Carrying present to past: the gather copies every row's whole past at every step, as much
//! memory traffic as the model's own attention. When the decode rows of a step are exactly the
//! decode rows of the step before (same requests, same order, each one token further), the
//! previous invocation's `present` tensors already are this invocation's past tensors in the
//! padding contract's layout (gqa: each row at `[0, past_b)`; mha: only when every row has the
//! same past length, since mha puts new keys at `P + j`). Then they are passed straight back
//! ([`Carry`]) and nothing is gathered; the blocks still receive every new position, so the
//! next change of batch composition gathers from them as usual. gqa decodes on the CPU keep their
//! shared buffers the same way. `ORTEX_CARRY_PRESENT=0` turns both off, `ORTEX_SHARE_PAST=0` the
//! shared buffers (gqa decodes then carry present like mha).

mod grouping;
mod signature;
mod stats;

use std::borrow::Cow;
use std::sync::Arc;

use ort::session::{Session, SessionInputValue};
use ort::value::{DynValue, Tensor, TensorRef};
use ortex_core::executor::{ExecError, Executor, KvGeometry, LogitsLayout, ModelInfo, PlanRow, StepOutput, StepPlan};
use ortex_core::ids::RequestId;
use ortex_core::{ErrorCode, OrtexError, Result};

use crate::config::ModelConfig;
use crate::kv_store::{KvArena, KvStore};
use crate::runtime::ExecutionProvider;
use crate::shared_past::{self, SharedPast};
use grouping::{assign_sampled_slots, check_plan, group_rows, Grouping};
use signature::{check_signature, detect_form, Names};
use stats::now;
pub use stats::{Counter, ExecutorStats, StatsSnapshot, Unit};

/// Where `present` puts a row's new keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionForm {
    /// Plain ONNX operators: `present = Concat(past, new)`, new token j at `P + j`.
    Mha,
    /// `com.microsoft.GroupQueryAttention`: new token j at the row's own `past_b + j`; batches
    /// of rows with past and several new tokens are refused.
    Gqa,
}

impl AttentionForm {
    pub fn as_str(self) -> &'static str {
        match self {
            AttentionForm::Mha => "mha",
            AttentionForm::Gqa => "gqa",
        }
    }
}

/// Buffers reused from step to step.
#[derive(Default)]
struct Scratch {
    input_ids: Vec<i64>,
    attention_mask: Vec<i64>,
    position_ids: Vec<i64>,
    /// One per past input, as `Names::past`.
    past: Vec<Vec<f32>>,
}

/// The present tensors of the last decode invocation, kept to serve as the next one's past.
struct Carry {
    /// The step they were computed in.
    step: u64,
    /// The rows, in order, with the position each one's KV now ends at.
    rows: Vec<(RequestId, u32)>,
    /// Their sequence width (the next invocation's `P` must equal it).
    width: usize,
    /// One per past input, as `Names::past`.
    values: Vec<DynValue>,
}

impl Carry {
    /// Whether `rows` (a decode invocation of step `step`) continue exactly these rows.
    fn continues(&self, step: u64, plan: &StepPlan, rows: &[u32], dims: Dims, form: AttentionForm) -> bool {
        let same_rows = self.rows.len() == rows.len()
            && rows.iter().zip(&self.rows).all(|(&i, &(request, end))| {
                let row = &plan.rows[i as usize];
                row.request == request && row.start_position == end
            });
        let layout_fits = match form {
            AttentionForm::Gqa => true,
            AttentionForm::Mha => rows.iter().all(|&i| plan.rows[i as usize].start_position as usize == dims.past),
        };
        self.step + 1 == step && self.width == dims.past && same_rows && layout_fits
    }
}

pub struct OrtExecutor {
    config: ModelConfig,
    form: AttentionForm,
    session: Session,
    names: Names,
    kv: Option<KvStore>,
    scratch: Scratch,
    grouping: Grouping,
    carry: Option<Carry>,
    /// `ORTEX_CARRY_PRESENT=0` turns carrying off (to measure what it saves).
    carry_enabled: bool,
    /// gqa on the CPU: decode invocations run on shared past/present buffers.
    shared: Option<SharedPast>,
    stats: Arc<ExecutorStats>,
}

fn load_error(message: impl Into<String>) -> OrtexError {
    OrtexError::new(ErrorCode::ModelLoad, message)
}

fn fatal(message: impl Into<String>) -> ExecError {
    ExecError::Fatal(message.into())
}

impl OrtExecutor {
    /// Wraps an opened session after checking its signature against the config.
    pub fn new(config: ModelConfig, session: Session, provider: ExecutionProvider) -> Result<OrtExecutor> {
        let names = Names::of(&config);
        check_signature(&config, &session, &names)?;
        let form = detect_form(&config, &session);
        let scratch = Scratch { past: vec![Vec::new(); names.past.len()], ..Scratch::default() };
        let carry_enabled = env_flag("ORTEX_CARRY_PRESENT");
        // CUDA would want device buffers; it keeps ONNX Runtime's own present tensors.
        let shared = if form == AttentionForm::Gqa && provider == ExecutionProvider::Cpu && env_flag("ORTEX_SHARE_PAST")
        {
            let model_file = config.model_file.display().to_string();
            Some(SharedPast::new(&session).map_err(|e| load_error(format!("{model_file}: cannot bind buffers: {e}")))?)
        } else {
            None
        };
        Ok(OrtExecutor {
            config,
            form,
            session,
            names,
            kv: None,
            scratch,
            grouping: Grouping::default(),
            carry: None,
            carry_enabled,
            shared,
            stats: Arc::default(),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn attention_form(&self) -> AttentionForm {
        self.form
    }

    /// The timing counters; the handle stays valid after the executor moves into an engine.
    pub fn stats(&self) -> Arc<ExecutorStats> {
        Arc::clone(&self.stats)
    }
}

/// An on/off switch read from the environment: on unless set to "0".
fn env_flag(name: &str) -> bool {
    std::env::var(name).map_or(true, |v| v != "0")
}

// ------------------------------------------------------------------------------------------------
// One step
// ------------------------------------------------------------------------------------------------

impl Executor for OrtExecutor {
    fn model_info(&self) -> ModelInfo {
        ModelInfo {
            vocab_size: self.config.vocab_size,
            eos_token_ids: self.config.eos_token_ids.clone(),
            max_length: self.config.context_length,
        }
    }

    fn attach_kv(&mut self, geometry: KvGeometry) -> Result<()> {
        let c = &self.config;
        self.kv = Some(KvStore::new(
            geometry,
            c.num_hidden_layers as usize,
            c.num_key_value_heads as usize,
            c.head_size as usize,
        )?);
        self.carry = None;
        if let Some(shared) = &mut self.shared {
            shared.invalidate();
        }
        Ok(())
    }

    fn execute(&mut self, plan: &StepPlan, out: &mut StepOutput) -> Result<(), ExecError> {
        let started = now();
        let kv = self.kv.as_mut().ok_or_else(|| fatal("execute before attach_kv"))?;
        check_plan(plan, kv, self.config.context_length)?;
        let vocab = self.config.vocab_size as usize;
        let scratch = &mut self.scratch;
        let grouping = &mut self.grouping;
        let sampled = assign_sampled_slots(plan, &mut grouping.sampled_slot);
        out.clear();
        out.layout = LogitsLayout::Dense;
        out.width = vocab;
        out.logits.resize(sampled * vocab, 0.0);
        group_rows(plan, self.form, grouping);
        let mut step = Step {
            config: &self.config,
            form: self.form,
            names: &self.names,
            session: &mut self.session,
            kv,
            carry: &mut self.carry,
            carry_enabled: self.carry_enabled,
            shared: self.shared.as_mut(),
            stats: &self.stats,
        };
        for i in 0..grouping.len() {
            let result = step.invoke(plan, grouping.group(i), &grouping.sampled_slot, scratch, out);
            if result.is_err() {
                *step.carry = None;
                if let Some(shared) = step.shared.as_deref_mut() {
                    shared.invalidate();
                }
            }
            result?;
        }
        let s = &self.stats;
        s.add(Counter::Steps, 1);
        s.add(Counter::Invocations, grouping.len() as u64);
        s.add(Counter::Rows, plan.rows.len() as u64);
        s.add(Counter::Tokens, u64::from(plan.total_tokens()));
        s.add_since(Counter::ExecuteNs, started);
        Ok(())
    }
}

/// What one invocation needs, borrowed from the executor.
struct Step<'a> {
    config: &'a ModelConfig,
    form: AttentionForm,
    names: &'a Names,
    session: &'a mut Session,
    kv: &'a mut KvStore,
    carry: &'a mut Option<Carry>,
    carry_enabled: bool,
    shared: Option<&'a mut SharedPast>,
    stats: &'a ExecutorStats,
}

/// Shape of one invocation.
#[derive(Debug, Clone, Copy)]
struct Dims {
    batch: usize,
    past: usize,
    new: usize,
    kv_heads: usize,
    head_size: usize,
}

impl Dims {
    fn total(&self) -> usize {
        self.past + self.new
    }

    fn past_floats_per_row(&self) -> usize {
        self.kv_heads * self.past * self.head_size
    }
}

fn ort_error(what: &str) -> impl FnOnce(ort::Error) -> ExecError + '_ {
    move |e| fatal(format!("{what}: {e}"))
}

impl<'a> Step<'a> {
    fn invoke(
        &mut self,
        plan: &StepPlan,
        rows: &[u32],
        sampled_slot: &[u32],
        scratch: &mut Scratch,
        out: &mut StepOutput,
    ) -> Result<(), ExecError> {
        let dims = self.dims(plan, rows);
        let decode = dims.new == 1;
        if decode && self.shared.is_some() {
            return self.invoke_shared(plan, rows, dims, sampled_slot, scratch, out);
        }
        let carried =
            decode && self.carry.as_ref().is_some_and(|c| c.continues(plan.step, plan, rows, dims, self.form));
        let gather_started = now();
        self.fill_inputs(plan, rows, dims, scratch);
        if !carried {
            self.gather_past(plan, rows, dims, scratch);
        }
        let carry_values = if carried { self.carry.as_ref().map(|c| c.values.as_slice()) } else { None };
        let inputs = self.input_values(dims, scratch, carry_values)?;
        self.stats.add_since(Counter::GatherNs, gather_started);
        self.stats.add(Counter::Carried, u64::from(carried));

        let run_started = now();
        let mut outputs = self.session.run(inputs).map_err(ort_error("the model run failed"))?;
        self.stats.add_since(Counter::RunNs, run_started);

        let scatter_started = now();
        let vocab = self.config.vocab_size as usize;
        Self::copy_logits(&outputs, &self.names.logits, vocab, plan, rows, dims, sampled_slot, out)?;
        Self::scatter_present(&outputs, &self.names.present, self.form, self.kv, plan, rows, dims)?;
        if decode && self.carry_enabled {
            *self.carry = Self::keep_present(self.form, self.names, plan, rows, dims, &mut outputs);
        }
        self.stats.add_since(Counter::ScatterNs, scatter_started);
        Ok(())
    }

    /// The invocation's shape: `P` the longest past, `S` the most new tokens.
    fn dims(&self, plan: &StepPlan, rows: &[u32]) -> Dims {
        let row = |i: u32| -> &PlanRow { &plan.rows[i as usize] };
        Dims {
            batch: rows.len(),
            past: rows.iter().map(|&i| row(i).start_position as usize).max().unwrap_or(0),
            new: rows.iter().map(|&i| row(i).token_count as usize).max().unwrap_or(0),
            kv_heads: self.config.num_key_value_heads as usize,
            head_size: self.config.head_size as usize,
        }
    }

    /// A gqa decode invocation on the shared past/present buffers: filled from the blocks unless
    /// they continue the previous step's rows, bound as both past and present, run; the new
    /// positions then go from the buffers into the blocks.
    fn invoke_shared(
        &mut self,
        plan: &StepPlan,
        rows: &[u32],
        dims: Dims,
        sampled_slot: &[u32],
        scratch: &mut Scratch,
        out: &mut StepOutput,
    ) -> Result<(), ExecError> {
        let gather_started = now();
        self.fill_inputs(plan, rows, dims, scratch);
        let context_length = self.config.context_length as usize;
        let Step { names, session, kv, shared, stats, carry_enabled, config, .. } = self;
        let shared = shared.as_deref_mut().expect("the caller checked");
        let carried = *carry_enabled && shared.continues(plan.step, plan, rows);
        if !carried {
            let width = shared_past::width_for(dims.past, context_length);
            let tensors = shared
                .reshape(names.past.len(), dims.batch, dims.kv_heads, width, dims.head_size)
                .map_err(ort_error("cannot allocate the KV buffers"))?;
            for (index, tensor) in tensors.iter_mut().enumerate() {
                TensorRows::of(index, width, plan, rows, dims).gather(kv, tensor.extract_tensor_mut().1);
            }
        }
        bind_shared(names, shared, dims, scratch).map_err(ort_error("cannot bind the model's inputs"))?;
        stats.add_since(Counter::GatherNs, gather_started);
        stats.add(Counter::Carried, u64::from(carried));

        let run_started = now();
        let outputs = session.run_binding(&shared.binding).map_err(ort_error("the model run failed"))?;
        stats.add_since(Counter::RunNs, run_started);

        let scatter_started = now();
        let vocab = config.vocab_size as usize;
        Self::copy_logits(&outputs, &names.logits, vocab, plan, rows, dims, sampled_slot, out)?;
        let width = shared.width();
        for (index, (name, tensor)) in names.present.iter().zip(shared.tensors()).enumerate() {
            let data = tensor.extract_tensor().1;
            let written = outputs.get(name).and_then(|v| v.try_extract_tensor::<f32>().ok()).map(|(_, d)| d.as_ptr());
            if written != Some(data.as_ptr()) {
                return Err(fatal(format!("ONNX Runtime did not write {name} into the buffer bound to it")));
            }
            TensorRows::of(index, width, plan, rows, dims).scatter(kv, AttentionForm::Gqa, data);
        }
        drop(outputs);
        shared.record(plan.step, plan, rows);
        stats.add_since(Counter::ScatterNs, scatter_started);
        Ok(())
    }

    /// The last new position's logits of each sampled row, into its slot of the step output.
    #[allow(clippy::too_many_arguments)] // the invocation's pieces, borrowed apart from the session
    fn copy_logits(
        outputs: &ort::session::SessionOutputs<'_>,
        name: &str,
        vocab: usize,
        plan: &StepPlan,
        rows: &[u32],
        dims: Dims,
        sampled_slot: &[u32],
        out: &mut StepOutput,
    ) -> Result<(), ExecError> {
        let (shape, logits) = outputs
            .get(name)
            .ok_or_else(|| fatal("the model returned no logits"))?
            .try_extract_tensor::<f32>()
            .map_err(ort_error("logits"))?;
        if **shape != [dims.batch as i64, dims.new as i64, vocab as i64] {
            return Err(fatal(format!(
                "logits have shape {shape:?}, expected [{}, {}, {vocab}]",
                dims.batch, dims.new
            )));
        }
        for (b, &i) in rows.iter().enumerate() {
            let slot = sampled_slot[i as usize];
            if slot != u32::MAX {
                let from = (b * dims.new + plan.rows[i as usize].token_count as usize - 1) * vocab;
                out.logits[slot as usize * vocab..(slot as usize + 1) * vocab]
                    .copy_from_slice(&logits[from..from + vocab]);
            }
        }
        Ok(())
    }

    /// Each row's new keys and values from `present` into its blocks: new token j of row b sits
    /// at `P + j` (mha) or at `past_b + j` (gqa).
    fn scatter_present(
        outputs: &ort::session::SessionOutputs<'_>,
        present: &[String],
        form: AttentionForm,
        kv: &mut KvStore,
        plan: &StepPlan,
        rows: &[u32],
        dims: Dims,
    ) -> Result<(), ExecError> {
        for (index, name) in present.iter().enumerate() {
            let (shape, data) = outputs
                .get(name)
                .ok_or_else(|| fatal(format!("the model returned no {name}")))?
                .try_extract_tensor::<f32>()
                .map_err(ort_error(name))?;
            let width = present_width(shape, dims).ok_or_else(|| {
                fatal(format!(
                    "{name} has shape {shape:?}, expected [{}, {}, >= {}, {}]",
                    dims.batch,
                    dims.kv_heads,
                    dims.total(),
                    dims.head_size
                ))
            })?;
            TensorRows::of(index, width, plan, rows, dims).scatter(kv, form, data);
        }
        Ok(())
    }

    /// The present tensors of a decode invocation, when their layout can be the next past.
    fn keep_present(
        form: AttentionForm,
        names: &Names,
        plan: &StepPlan,
        rows: &[u32],
        dims: Dims,
        outputs: &mut ort::session::SessionOutputs<'_>,
    ) -> Option<Carry> {
        let contiguous = form == AttentionForm::Gqa
            || rows.iter().all(|&i| plan.rows[i as usize].start_position as usize == dims.past);
        if !contiguous {
            return None;
        }
        let mut values = Vec::with_capacity(names.present.len());
        let mut width = None;
        for name in &names.present {
            let value = outputs.remove(name)?;
            let w = value.try_extract_tensor::<f32>().ok()?.0.get(2).copied()?;
            if *width.get_or_insert(w) != w {
                return None;
            }
            values.push(value);
        }
        let rows = rows
            .iter()
            .map(|&i| {
                let row = &plan.rows[i as usize];
                (row.request, row.start_position + row.token_count)
            })
            .collect();
        Some(Carry { step: plan.step, rows, width: usize::try_from(width?).ok()?, values })
    }

    /// input_ids, attention_mask, position_ids by the padding contract.
    fn fill_inputs(&self, plan: &StepPlan, rows: &[u32], dims: Dims, scratch: &mut Scratch) {
        let (b_n, p, s, t) = (dims.batch, dims.past, dims.new, dims.total());
        let pad = i64::from(self.config.pad_token_id);
        reset(&mut scratch.input_ids, b_n * s, pad);
        reset(&mut scratch.attention_mask, b_n * t, 0);
        reset(&mut scratch.position_ids, b_n * s, 0);
        for (b, &i) in rows.iter().enumerate() {
            let row = &plan.rows[i as usize];
            let past = row.start_position as usize;
            for (j, &token) in plan.row_tokens(row).iter().enumerate() {
                scratch.input_ids[b * s + j] = i64::from(token);
                scratch.position_ids[b * s + j] = (past + j) as i64;
                scratch.attention_mask[b * t + p + j] = 1;
            }
            scratch.attention_mask[b * t..b * t + past].fill(1);
        }
    }

    /// Copies each row's past from its blocks into the past tensors `[B, KH, P, D]`. Padding
    /// positions keep whatever finite values an earlier step left there (the mask hides them).
    fn gather_past(&self, plan: &StepPlan, rows: &[u32], dims: Dims, scratch: &mut Scratch) {
        let len = dims.batch * dims.past_floats_per_row();
        for (index, buffer) in scratch.past.iter_mut().enumerate() {
            if buffer.len() < len {
                buffer.resize(len, 0.0);
            }
            TensorRows::of(index, dims.past, plan, rows, dims).gather(self.kv, &mut buffer[..len]);
        }
    }

    /// The session inputs, as views of the scratch buffers.
    fn input_values<'s>(
        &self,
        dims: Dims,
        scratch: &'s Scratch,
        carried: Option<&'s [DynValue]>,
    ) -> Result<Vec<(Cow<'a, str>, SessionInputValue<'s>)>, ExecError> {
        let names: &'a Names = self.names;
        let (b, s, t) = (dims.batch, dims.new, dims.total());
        let ids = |name: &str, data: &'s [i64], cols: usize| -> Result<SessionInputValue<'s>, ExecError> {
            Ok(TensorRef::from_array_view(([b, cols], data)).map_err(|e| fatal(format!("{name}: {e}")))?.into())
        };
        let mut inputs = Vec::with_capacity(3 + names.past.len());
        inputs.push((Cow::Borrowed(names.input_ids.as_str()), ids("input_ids", &scratch.input_ids[..b * s], s)?));
        inputs.push((
            Cow::Borrowed(names.attention_mask.as_str()),
            ids("attention_mask", &scratch.attention_mask[..b * t], t)?,
        ));
        if let Some(name) = &names.position_ids {
            inputs.push((Cow::Borrowed(name.as_str()), ids("position_ids", &scratch.position_ids[..b * s], s)?));
        }
        if let Some(values) = carried {
            for (name, value) in names.past.iter().zip(values) {
                inputs.push((Cow::Borrowed(name.as_str()), value.into()));
            }
            return Ok(inputs);
        }
        let len = b * dims.past_floats_per_row();
        for (name, buffer) in names.past.iter().zip(&scratch.past) {
            let view = TensorRef::from_array_view(([b, dims.kv_heads, dims.past, dims.head_size], &buffer[..len]))
                .map_err(|e| fatal(format!("{name}: {e}")))?;
            inputs.push((Cow::Borrowed(name.as_str()), view.into()));
        }
        Ok(inputs)
    }
}

/// One KV tensor of an invocation, `[B, KH, width, D]`: KV input or output `index` (layer
/// `index / 2`, key then value) over the invocation's rows, row `b` at `[b * row_floats, ..)`.
struct TensorRows<'p> {
    arena: KvArena,
    width: usize,
    plan: &'p StepPlan,
    rows: &'p [u32],
    dims: Dims,
}

impl<'p> TensorRows<'p> {
    fn of(index: usize, width: usize, plan: &'p StepPlan, rows: &'p [u32], dims: Dims) -> Self {
        TensorRows { arena: KvArena::of_index(index), width, plan, rows, dims }
    }

    /// Each row with the range of the tensor it takes.
    fn each(&self) -> impl Iterator<Item = (&'p PlanRow, std::ops::Range<usize>)> + '_ {
        let row_floats = self.dims.kv_heads * self.width * self.dims.head_size;
        self.rows
            .iter()
            .enumerate()
            .map(move |(b, &i)| (&self.plan.rows[i as usize], b * row_floats..(b + 1) * row_floats))
    }

    /// Each row's past from its blocks into the tensor at `[0, past_b)`; positions beyond keep
    /// what they held (the mask, or seqlens_k, hides them).
    fn gather(&self, kv: &KvStore, dst: &mut [f32]) {
        for (row, range) in self.each() {
            let blocks = self.plan.row_blocks(row);
            kv.gather(self.arena, blocks, row.start_position as usize, &mut dst[range], self.width);
        }
    }

    /// The tensor's new positions (a present output) into each row's blocks: new token j of row
    /// b sits at `P + j` (mha) or at `past_b + j` (gqa).
    fn scatter(&self, kv: &mut KvStore, form: AttentionForm, data: &[f32]) {
        for (row, range) in self.each() {
            let (past, count) = (row.start_position as usize, row.token_count as usize);
            let at = match form {
                AttentionForm::Mha => self.dims.past,
                AttentionForm::Gqa => past,
            };
            let blocks = self.plan.row_blocks(row);
            kv.scatter(self.arena, blocks, past..past + count, &data[range], self.width, at);
        }
    }
}

/// Binds a shared decode invocation: ids, mask (and positions) from the scratch buffers, the
/// logits to the CPU, and (when not bound already) each KV buffer as its past input and its
/// present output.
fn bind_shared(names: &Names, shared: &mut SharedPast, dims: Dims, scratch: &Scratch) -> ort::Result<()> {
    let (b, s, t) = (dims.batch, dims.new, dims.total());
    // Owned copies (a few hundred bytes): ort clones a borrowed input it binds, and that clone
    // deadlocks in rc.15 (`IdentitySessionHandle::new` binds a borrowed input itself).
    fn ids(data: &[i64], rows: usize, cols: usize) -> ort::Result<Tensor<i64>> {
        Tensor::from_array(([rows, cols], data.to_vec()))
    }
    let SharedPast { binding, cpu, .. } = shared;
    binding.bind_input(names.input_ids.as_str(), &ids(&scratch.input_ids[..b * s], b, s)?)?;
    binding.bind_input(names.attention_mask.as_str(), &ids(&scratch.attention_mask[..b * t], b, t)?)?;
    if let Some(name) = &names.position_ids {
        binding.bind_input(name.as_str(), &ids(&scratch.position_ids[..b * s], b, s)?)?;
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

/// `present`'s sequence width when its shape is `[B, KH, >= T, D]`.
fn present_width(shape: &[i64], dims: Dims) -> Option<usize> {
    let ok = shape.len() == 4
        && shape[0] == dims.batch as i64
        && shape[1] == dims.kv_heads as i64
        && shape[2] >= dims.total() as i64
        && shape[3] == dims.head_size as i64;
    ok.then_some(shape[2] as usize)
}

fn reset<T: Copy>(buffer: &mut Vec<T>, len: usize, value: T) {
    buffer.clear();
    buffer.resize(len, value);
}
