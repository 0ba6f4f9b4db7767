//! A transaction's draws: sampling, and the text of what was sampled, travel with the step. What
//! each sampled row needs (its turn's parameters, its generator, its history where penalties read
//! it, its text state, its constraint) is taken from the turn when the step is planned; the draws
//! run where the model ran, right after it (the engine's own thread on native, not the JS thread);
//! the commit hands each drawn token, the advanced generator, the text state, the logprobs and the
//! constraint back to a turn that is still the one planned.
//!
//! ```text
//!   run_begin: plan ──▶ Draws::push per sampled row (params, rng clone, history, text clone,
//!                                                    constraint moved)
//!   execute:   masks (constrained rows) ∥ model ──▶ Draws::sample(output, codec)  (same RNG
//!              stream, same arithmetic; a constrained row masked first; then the token's text)
//!   run_commit:        ──▶ turn.rng = draw.rng, turn.text = draw.text, token, text, logprobs,
//!                          constraint  (skipped for a cancelled turn)
//! ```
//!
//! A turn's generator and text state are used by its draws only, so a copy taken at plan time and
//! handed back at commit gives every trace exactly as sampling at commit did; a turn cancelled
//! while the step ran keeps its own, untouched, to flush its held-back text. A constrained row's
//! mask depends only on its grammar's state, not on this step's logits, so it may be computed
//! while the model runs (`Transaction::execute_with`).

use crate::constraint::{TokenMask, TurnConstraint};
use crate::executor::{LogitsLayout, StepOutput};
use crate::output::{LogprobsText, TextStep, TurnText};
use crate::rng::Rng;
use crate::sampling::{self, History, SamplerScratch, SamplingParams};
use crate::text::TextCodec;

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
    /// The turn's text state as the plan found it; advanced by the draw's token.
    pub text: TurnText,
    /// The turn's constraint, moved here for the step and back at commit.
    pub constraint: Option<Box<TurnConstraint>>,
    /// This step's mask of a constrained row (None until computed, or when the matcher failed).
    mask: Option<TokenMask>,
    pub token: u32,
    /// What the token added to the turn's text.
    pub step: TextStep,
    pub logprobs: Option<LogprobsText>,
}

/// The draws of one step, with the sampler's reusable buffers. The rows of earlier steps are
/// kept and overwritten (`rows[..len]` are this step's), so their buffers (a context, a text
/// state) are reused rather than allocated again at every step.
#[derive(Debug, Default)]
pub struct Draws {
    rows: Vec<RowDraw>,
    len: usize,
    scratch: SamplerScratch,
    logprob_scratch: Vec<(u32, f32)>,
    /// Rows of this step that carry a constraint (0: the step pays nothing for constraints).
    num_constrained: usize,
}

impl Draws {
    pub fn clear(&mut self) {
        self.len = 0;
        self.num_constrained = 0;
    }

    /// The next sampled row's draw, taken from its turn as planned.
    pub fn push(
        &mut self,
        params: SamplingParams,
        rng: &Rng,
        history: History<'_>,
        top_logprobs: Option<u32>,
        text: &TurnText,
        constraint: Option<Box<TurnConstraint>>,
    ) {
        let context = if params.penalties.is_none() { &[][..] } else { history.context };
        self.num_constrained += usize::from(constraint.is_some());
        if self.len == self.rows.len() {
            self.rows.push(RowDraw {
                params,
                rng: rng.clone(),
                context: context.to_vec(),
                generated: history.generated,
                top_logprobs,
                text: text.clone(),
                constraint,
                mask: None,
                token: 0,
                step: TextStep::default(),
                logprobs: None,
            });
        } else {
            let row = &mut self.rows[self.len];
            row.params = params;
            row.rng = rng.clone();
            row.context.clear();
            row.context.extend_from_slice(context);
            row.generated = history.generated;
            row.top_logprobs = top_logprobs;
            row.text.clone_from(text);
            row.constraint = constraint;
            row.mask = None;
            row.token = 0;
            row.step = TextStep::default();
            row.logprobs = None;
        }
        self.len += 1;
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
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
        for draw in &mut self.rows[..self.len] {
            if let Some(constraint) = draw.constraint.as_deref_mut() {
                draw.mask = constraint.compute_mask();
            }
        }
    }

    /// Samples every row from the model's output (row i of the output is draw i) and makes the
    /// text each token adds to its turn's. A constrained row's disallowed scores are set to -inf
    /// first, so every sampling mode (greedy included) and its logprobs see only what the grammar
    /// allows; its token then advances the grammar.
    pub fn sample(&mut self, output: &mut StepOutput, codec: &dyn TextCodec) {
        let width = output.width;
        for (index, draw) in self.rows[..self.len].iter_mut().enumerate() {
            let history = History { context: &draw.context, generated: draw.generated };
            let forced = match (draw.constraint.as_deref(), draw.mask.take()) {
                (None, _) => None,
                (Some(constraint), Some(mask)) => mask_row(constraint, &mask, output, index, width, &mut draw.rng),
                // The matcher failed: the commit fails the turn; the token is never used.
                (Some(_), None) => continue,
            };
            let logits = output.row(index);
            draw.token = forced
                .unwrap_or_else(|| sampling::sample(logits, &draw.params, history, &mut draw.rng, &mut self.scratch));
            draw.step = draw.text.push(codec, draw.token as i32);
            draw.logprobs = draw.top_logprobs.map(|top| {
                LogprobsText::new(codec, sampling::logprobs(logits, draw.token, top, &mut self.logprob_scratch))
            });
            if let Some(constraint) = draw.constraint.as_deref_mut() {
                constraint.consume(draw.token);
            }
        }
    }

    /// Draw `index`, to hand back to its turn at commit.
    pub fn row_mut(&mut self, index: usize) -> &mut RowDraw {
        &mut self.rows[..self.len][index]
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
