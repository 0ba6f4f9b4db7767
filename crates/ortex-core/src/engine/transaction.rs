//! The [`Transaction`]: one planned step, carrying the executor while it is away from the engine
//! (the only part of a `run` that may happen off the owner thread), and [`RunStart`], what
//! `run_begin` decided.

use std::sync::Arc;

use crate::draws::Draws;
use crate::executor::{ExecError, Executor, StepOutput, StepPlan};
use crate::text::TextCodec;

/// What `run_begin` decided.
// A transaction is moved out at once to wherever it executes; boxing it would cost an allocation
// per run to shrink a value that never sits in a collection.
#[allow(clippy::large_enum_variant)]
pub enum RunStart {
    /// The call is complete: this many events were written (drained, or a no-op).
    Done(usize),
    /// A transaction to execute (on any thread) and hand back to `run_commit`.
    Execute(Transaction),
}

/// One planned step, carrying the executor while it is away from the engine.
pub struct Transaction {
    pub(super) plan: StepPlan,
    pub(super) output: StepOutput,
    /// Boxed: the sampler's buffers travel with each step (and come back as the spare).
    pub(super) draws: Box<Draws>,
    pub(super) executor: Box<dyn Executor>,
    /// The draws detokenize with it where they run.
    pub(super) codec: Arc<dyn TextCodec>,
    pub(super) result: Option<std::result::Result<(), ExecError>>,
}

impl Transaction {
    /// Runs the model, then samples its rows and makes their text (draws.rs). The only part of a
    /// `run` that may happen off the owner thread. Constrained rows' masks are computed before
    /// the model runs.
    pub fn execute(&mut self) {
        self.execute_with(|model, masks| {
            masks();
            model();
        });
    }

    /// `execute`, with the model run and the constrained rows' masks handed to `run_both`, which
    /// may run them at once on two threads (the native binding does; the core has no threads).
    /// A step without a constrained row runs the model alone and never calls `run_both`.
    pub fn execute_with(&mut self, run_both: impl FnOnce(&mut (dyn FnMut() + Send), &mut (dyn FnMut() + Send))) {
        let Transaction { plan, output, draws, executor, codec, result } = self;
        let mut model_result = None;
        if draws.has_constraints() {
            let mut model = || model_result = Some(executor.execute(plan, output));
            let mut masks = || draws.compute_masks();
            run_both(&mut model, &mut masks);
        } else {
            model_result = Some(executor.execute(plan, output));
        }
        let model_result = model_result.expect("run_both runs the model");
        if model_result.is_ok() && output.matches(plan.sampled_rows()) {
            draws.sample(output, codec.as_ref());
        }
        *result = Some(model_result);
    }

    /// Records a failure that happened outside the executor's own error path (a binding caught a
    /// panic in `execute`): `run_commit` then rolls back and publishes a fatal Failed event.
    pub fn fail(&mut self, reason: String) {
        self.result = Some(Err(ExecError::Fatal(reason)));
    }
}
