//! [`OrtExecutor`]: runs one engine step on an ONNX decoder, as a few model invocations.
//!
//! Words: a *step* is one engine transaction (a [`StepPlan`], one `execute`); an *invocation* is
//! one run of the model (`Session::run`). A step runs one invocation per group of its rows.
//!
//! A paged-attention graph (AttentionForm::Paged) reads and writes the engine's blocks itself: its
//! KV pool lives in the session's memory (kv_pool.rs) and a step is ONE invocation of all its rows
//! on small host inputs (paged.rs, paged_inputs.rs). Every other graph takes contiguous past
//! tensors, so each invocation maps the engine's paged KV to them and back (docs/model-format.md,
//! "Padding contract"):
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
//! The parts, policy first:
//!
//! - grouping.rs: which rows run together (pure), where their logits go, whether the plan fits
//! - invocation.rs: one invocation: its inputs, the choice of how to provide the past, its outputs
//! - the ways of providing the past, one file each: in_place.rs (gqa decodes on the CPU: buffers
//!   that GroupQueryAttention appends to in place), carried.rs (the previous invocation's
//!   present taken as the past), gathered.rs (copied from the blocks into new tensors)
//! - tensor_rows.rs: the copies between one KV tensor and the blocks, row by row
//! - paged.rs: a paged graph's step on the KV pool; paged_inputs.rs: its packed inputs (pure)
//! - signature.rs: the tensor names, the KV element type and widths, the checks at load;
//!   probe.rs: the trial run at load of a float16 or bfloat16 model; stats.rs: the counters

mod batch;
mod carried;
mod gathered;
mod grouping;
mod in_place;
mod invocation;
mod paged;
mod paged_inputs;
mod probe;
mod signature;
mod stats;
mod tensor_rows;

use std::sync::Arc;

use ort::session::Session;
use ortex_core::executor::{ExecError, Executor, KvGeometry, LogitsLayout, ModelInfo, PlanRow, StepOutput, StepPlan};
use ortex_core::{ErrorCode, OrtexError, Result};

use crate::config::ModelConfig;
use crate::kv_element::KvElement;
use crate::kv_pool::PoolShape;
use crate::kv_store::KvStore;
use crate::layer_attention::AttentionPlan;
use crate::runtime::ExecutionProvider;
use batch::{Batch, TokenInputs};
use gathered::GatheredPast;
use grouping::{assign_sampled_slots, check_plan, group_rows, prefill_positions_budget, Grouping};
use invocation::{Invocation, LogitsOut, PastSources};
use paged::{PagedInputsTaken, PagedStep};
use signature::{check_signature, detect_form, KvSpec, Names};
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
    /// A paged-attention graph (a `block_table` input): the KV is a pool of blocks the graph
    /// reads and writes in place; all rows of a step run packed in one invocation.
    Paged,
}

impl AttentionForm {
    pub fn as_str(self) -> &'static str {
        match self {
            AttentionForm::Mha => "mha",
            AttentionForm::Gqa => "gqa",
            AttentionForm::Paged => "paged",
        }
    }
}

pub struct OrtExecutor {
    config: ModelConfig,
    form: AttentionForm,
    provider: ExecutionProvider,
    session: Session,
    names: Names,
    spec: KvSpec,
    plan: AttentionPlan,
    /// Whether a row with past and several new tokens runs in one invocation (probe.rs); if not,
    /// such rows run one position per invocation ([`OrtExecutor::execute_by_positions`]).
    chunks_with_past: bool,
    /// The rounds of such a step, reused.
    rounds: StepPlan,
    /// The pool's shape, once attached.
    geometry: Option<KvGeometry>,
    /// The host KV store (every form but paged) ...
    kv: Option<KvStore>,
    /// ... or the paged graph's own pool and its step (one owner of the KV either way).
    paged: Option<PagedStep>,
    /// The buffers below are reused from step to step.
    grouping: Grouping,
    tokens: TokenInputs,
    past: PastSources,
    stats: Arc<ExecutorStats>,
}

fn load_error(message: impl Into<String>) -> OrtexError {
    OrtexError::new(ErrorCode::ModelLoad, message)
}

fn fatal(message: impl Into<String>) -> ExecError {
    ExecError::Fatal(message.into())
}

fn ort_error(what: &str) -> impl FnOnce(ort::Error) -> ExecError + '_ {
    move |e| fatal(format!("{what}: {e}"))
}

/// An on/off switch read from the environment: on unless set to "0".
fn env_flag(name: &str) -> bool {
    std::env::var(name).map_or(true, |v| v != "0")
}

impl OrtExecutor {
    /// Wraps an opened session after checking its signature against the config. A model whose
    /// KV is not float32, or whose attention is not GroupQueryAttention, first runs a few trial
    /// positions on the CPU (probe.rs): a graph ONNX Runtime's kernels cannot run fails here,
    /// saying so, rather than at every turn, and one that cannot run a chunk after a past gets
    /// such rows one position at a time.
    pub fn new(
        config: ModelConfig,
        mut session: Session,
        provider: ExecutionProvider,
        plan: AttentionPlan,
    ) -> Result<OrtExecutor> {
        let names = Names::of(&config);
        let form = detect_form(&config, &session);
        let spec = check_signature(&config, &session, &names, &plan, form)?;
        let probe = provider == ExecutionProvider::Cpu && form != AttentionForm::Paged && probe::needed(&spec, &plan);
        let chunks_with_past =
            if probe { probe::run(&config, &mut session, &names, &spec, &plan)?.chunks_with_past } else { true };
        let past = PastSources {
            gathered: GatheredPast::new(names.past.len()),
            carry: None,
            carry_enabled: env_flag("ORTEX_CARRY_PRESENT"),
            shared: in_place::buffer_for(&config, form, provider, &session, &spec)?,
        };
        Ok(OrtExecutor {
            config,
            form,
            provider,
            session,
            names,
            spec,
            plan,
            chunks_with_past,
            rounds: StepPlan::default(),
            geometry: None,
            kv: None,
            paged: None,
            grouping: Grouping::default(),
            tokens: TokenInputs::default(),
            past,
            stats: Arc::default(),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn attention_form(&self) -> AttentionForm {
        self.form
    }

    /// The KV element type (the KV store keeps keys and values in it).
    pub fn kv_element(&self) -> KvElement {
        self.spec.element
    }

    /// Bytes of the KV of one position (all layers, keys and values) in the KV store.
    pub fn kv_bytes_per_position(&self) -> u64 {
        self.spec.bytes_per_position(&self.config)
    }

    /// Each layer's attention, as the session runs it.
    pub fn attention_plan(&self) -> &AttentionPlan {
        &self.plan
    }

    /// The counters; the handle stays valid after the executor moves into an engine.
    pub fn stats(&self) -> Arc<ExecutorStats> {
        Arc::clone(&self.stats)
    }

    /// Runs invocation `group` of the step being executed.
    fn invoke(&mut self, plan: &StepPlan, group: usize, out: &mut StepOutput) -> Result<(), ExecError> {
        let rows = self.grouping.group(group);
        Invocation {
            config: &self.config,
            form: self.form,
            names: &self.names,
            spec: &self.spec,
            batch: Batch::new(plan, rows, &self.config),
            session: &mut self.session,
            kv: self.kv.as_mut().expect("execute checked"),
            tokens: &mut self.tokens,
            past: &mut self.past,
            logits: LogitsOut {
                vocab: self.config.vocab_size as usize,
                element: self.spec.logits,
                sampled_slot: &self.grouping.sampled_slot,
                out,
            },
            stats: &self.stats,
        }
        .run()
    }
}

impl Executor for OrtExecutor {
    fn model_info(&self) -> ModelInfo {
        ModelInfo {
            vocab_size: self.config.vocab_size,
            eos_token_ids: self.config.eos_token_ids.clone(),
            max_length: self.config.context_length,
            kv_position_bytes: self.kv_bytes_per_position(),
            // A paged graph's KV tensors are blocks of the folder's size.
            required_block_size: self.config.paged_block_size.filter(|_| self.form == AttentionForm::Paged),
        }
    }

    fn attach_kv(&mut self, geometry: KvGeometry) -> Result<()> {
        let c = &self.config;
        let (layers, kv_heads, head_size) =
            (c.num_hidden_layers as usize, c.num_key_value_heads as usize, c.head_size as usize);
        let bytes = if self.form == AttentionForm::Paged {
            let shape = PoolShape { num_layers: layers, kv_heads, head_size, element: self.spec.element };
            let taken = PagedInputsTaken::of(&self.session, &c.names.paged);
            let step = PagedStep::new(&self.session, self.provider, geometry, shape, c.names.paged.clone(), taken)?;
            let bytes = step.pool_bytes();
            self.paged = Some(step);
            bytes
        } else {
            let store = KvStore::new(geometry, layers, kv_heads, head_size, self.spec.element)?;
            let bytes = store.bytes() as u64;
            self.kv = Some(store);
            bytes
        };
        self.geometry = Some(geometry);
        self.stats.set(Counter::KvStoreBytes, bytes);
        self.stats.set(Counter::KvPositionBytes, self.kv_bytes_per_position());
        self.past.forget();
        Ok(())
    }

    fn execute(&mut self, plan: &StepPlan, out: &mut StepOutput) -> Result<(), ExecError> {
        let started = now();
        let geometry = self.geometry.ok_or_else(|| fatal("execute before attach_kv"))?;
        check_plan(plan, geometry, self.config.context_length)?;
        let vocab = self.config.vocab_size as usize;
        let sampled = assign_sampled_slots(plan, &mut self.grouping.sampled_slot);
        out.clear();
        out.layout = LogitsLayout::Dense;
        out.width = vocab;
        out.logits.resize(sampled * vocab, 0.0);
        let invocations = if let Some(paged) = &mut self.paged {
            if !plan.rows.is_empty() {
                paged.run(plan, &mut self.session, &self.names, self.spec.logits, out, &self.stats)?;
            }
            usize::from(!plan.rows.is_empty())
        } else if !self.chunks_with_past && plan.rows.iter().any(chunk_with_past) {
            self.execute_by_positions(plan, out)?
        } else {
            self.run_groups(plan, out)?
        };
        if let Some(kv) = &self.kv {
            self.stats.add(Counter::KvCopiedBytes, kv.take_copied_bytes());
        }
        let stats = &self.stats;
        stats.add(Counter::Steps, 1);
        stats.add(Counter::Invocations, invocations as u64);
        stats.add(Counter::Rows, plan.rows.len() as u64);
        stats.add(Counter::Tokens, u64::from(plan.total_tokens()));
        stats.add_since(Counter::ExecuteNs, started);
        Ok(())
    }
}

/// A row with past and several new tokens.
fn chunk_with_past(row: &PlanRow) -> bool {
    row.start_position > 0 && row.token_count > 1
}

impl OrtExecutor {
    /// Groups `plan`'s rows and runs one invocation per group (`grouping.sampled_slot` says
    /// where each row's logits go); returns how many ran.
    fn run_groups(&mut self, plan: &StepPlan, out: &mut StepOutput) -> Result<usize, ExecError> {
        let max_positions =
            prefill_positions_budget(u64::from(self.config.vocab_size), self.spec.logits.bytes() as u64);
        group_rows(plan, self.form, self.spec.widest_window() > 0, max_positions, &mut self.grouping);
        for group in 0..self.grouping.len() {
            let result = self.invoke(plan, group, out);
            if result.is_err() {
                self.past.forget();
            }
            result?;
        }
        Ok(self.grouping.len())
    }

    /// A step of a model that cannot run a chunk after a past, in rounds: round 0 runs the other
    /// rows and position 0 of each chunk with past; round k, position k of the chunks that long.
    /// Each chunk's last position takes its row's logits slot.
    ///
    /// ```text
    ///   plan:    A decode | B chunk p..p+3 | C first prompt
    ///   round 0: A, B@p, C          round 1: B@p+1        round 2: B@p+2 (sampled)
    /// ```
    fn execute_by_positions(&mut self, plan: &StepPlan, out: &mut StepOutput) -> Result<usize, ExecError> {
        let slots = std::mem::take(&mut self.grouping.sampled_slot);
        let mut rounds = std::mem::take(&mut self.rounds);
        rounds.clone_from(plan);
        let longest = plan.rows.iter().filter(|r| chunk_with_past(r)).map(|r| r.token_count).max().unwrap_or(1);
        let mut invocations = 0;
        let mut result = Ok(());
        for k in 0..longest {
            rounds.rows.clear();
            self.grouping.sampled_slot.clear();
            for (row, &slot) in plan.rows.iter().zip(&slots) {
                let sub = if chunk_with_past(row) {
                    (k < row.token_count).then(|| PlanRow {
                        start_position: row.start_position + k,
                        token_start: row.token_start + k,
                        token_count: 1,
                        sample: row.sample && k + 1 == row.token_count,
                        ..*row
                    })
                } else {
                    (k == 0).then_some(*row)
                };
                if let Some(sub) = sub {
                    self.grouping.sampled_slot.push(if sub.sample { slot } else { u32::MAX });
                    rounds.rows.push(sub);
                }
            }
            match self.run_groups(&rounds, out) {
                Ok(n) => invocations += n,
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        self.stats.add(Counter::PositionRounds, u64::from(longest));
        self.rounds = rounds;
        self.grouping.sampled_slot = slots;
        result.map(|()| invocations)
    }
}
