//! A transaction's draws: sampling travels with the step. What each sampled row needs (its
//! turn's parameters, its generator, its history where penalties read it, its constraint) is
//! taken from the turn when the step is planned; the draws run where the model ran, right after
//! it (the engine's own thread on native, not the JS thread); the commit hands each drawn token,
//! the advanced generator, the logprobs and the constraint back to a turn that is still the one
//! planned.
//!
//! ```text
//!   run_begin: plan ──▶ Draws::push(turn) per sampled row (params, rng clone, history, constraint)
//!   execute:   masks (constrained rows) ∥ model ──▶ Draws::sample(output)
//!   run_commit:        ──▶ turn.rng = draw.rng, token, logprobs, constraint (skipped for a cancelled turn)
//! ```
//!
//! A turn's generator is used by its draws only, so a copy taken at plan time and handed back at
//! commit gives every trace exactly as sampling at commit did. A constrained row's mask depends
//! only on its grammar's state, not on this step's logits, so it may be computed while the model
//! runs (`Transaction::execute_with`).

use crate::constraint::{TokenMask, TurnConstraint};
use crate::executor::{LogitsLayout, StepOutput};
use crate::rng::Rng;
use crate::sampling::{self, History, SamplerScratch, SamplingParams, TokenLogprobs};

/// One sampled row's draw.
#[derive(Debug)]
pub struct RowDraw {
    params: SamplingParams,
    /// The turn's generator as the plan found it; advanced by the draw.
    pub rng: Rng,
    /// The request's tokens, kept only where a penalty reads them.
    context: Vec<i32>,
    generated: usize,
    top_logprobs: Option<u32>,
    /// The turn's constraint, moved here for the step and back at commit.
    pub constraint: Option<Box<TurnConstraint>>,
    /// This step's mask of a constrained row (None until computed, or when the matcher failed).
    mask: Option<TokenMask>,
    pub token: u32,
    pub logprobs: Option<TokenLogprobs>,
}

/// The draws of one step, with the sampler's reusable buffers.
#[derive(Debug, Default)]
pub struct Draws {
    rows: Vec<RowDraw>,
    scratch: SamplerScratch,
    logprob_scratch: Vec<(u32, f32)>,
    /// Rows that carry a constraint (0: the step pays nothing for constraints).
    num_constrained: usize,
}

impl Draws {
    pub fn clear(&mut self) {
        self.rows.clear();
        self.num_constrained = 0;
    }

    /// The next sampled row's draw, taken from its turn as planned.
    pub fn push(
        &mut self,
        params: SamplingParams,
        rng: &Rng,
        history: History<'_>,
        top_logprobs: Option<u32>,
        constraint: Option<Box<TurnConstraint>>,
    ) {
        let context = if params.penalties.is_none() { Vec::new() } else { history.context.to_vec() };
        self.num_constrained += usize::from(constraint.is_some());
        self.rows.push(RowDraw {
            params,
            rng: rng.clone(),
            context,
            generated: history.generated,
            top_logprobs,
            constraint,
            mask: None,
            token: 0,
            logprobs: None,
        });
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    pub fn has_constraints(&self) -> bool {
        self.num_constrained > 0
    }

    /// Each constrained row's mask for this step. Reads nothing of the model's output, so it may
    /// run while the model does.
    pub fn compute_masks(&mut self) {
        if !self.has_constraints() {
            return;
        }
        for draw in &mut self.rows {
            if let Some(constraint) = draw.constraint.as_deref_mut() {
                draw.mask = constraint.compute_mask();
            }
        }
    }

    /// Samples every row from the model's output (row i of the output is draw i). A constrained
    /// row's disallowed scores are set to -inf first, so every sampling mode (greedy included)
    /// and its logprobs see only what the grammar allows; its token then advances the grammar.
    pub fn sample(&mut self, output: &mut StepOutput) {
        let width = output.width;
        for (index, draw) in self.rows.iter_mut().enumerate() {
            let history = History { context: &draw.context, generated: draw.generated };
            let forced = match (draw.constraint.as_deref(), draw.mask.take()) {
                (None, _) => None,
                (Some(constraint), Some(mask)) => mask_row(constraint, &mask, output, index, width, &mut draw.rng),
                // The matcher failed: the commit fails the turn; the token is never used.
                (Some(_), None) => continue,
            };
            let logits = output.row(index);
            draw.token = forced.unwrap_or_else(|| {
                sampling::sample(logits, &draw.params, history, &mut draw.rng, &mut self.scratch)
            });
            draw.logprobs =
                draw.top_logprobs.map(|top| sampling::logprobs(logits, draw.token, top, &mut self.logprob_scratch));
            if let Some(constraint) = draw.constraint.as_deref_mut() {
                constraint.consume(draw.token);
            }
        }
    }

    /// Draw `index`, to hand back to its turn at commit.
    pub fn row_mut(&mut self, index: usize) -> &mut RowDraw {
        &mut self.rows[index]
    }
}

/// Applies a constrained row's mask to its logits; a sparse row (the simulated model) may choose
/// its token by the rule that keeps it satisfiable (TurnConstraint::sparse_choice).
fn mask_row(
    constraint: &TurnConstraint,
    mask: &TokenMask,
    output: &mut StepOutput,
    index: usize,
    width: usize,
    rng: &mut Rng,
) -> Option<u32> {
    let range = index * width..(index + 1) * width;
    match output.layout {
        LogitsLayout::Dense => {
            mask.apply_dense(&mut output.logits[range]);
            None
        }
        LogitsLayout::Sparse => {
            let any = mask.apply_sparse(&output.ids[range.clone()], &mut output.logits[range]);
            constraint.sparse_choice(mask, any, rng)
        }
    }
}
