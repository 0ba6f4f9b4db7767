//! A transaction's draws: sampling, and the text of what was sampled, travel with the step. What
//! each sampled row needs (its turn's parameters, its generator, its history where penalties read
//! it, its text state) is copied from the turn when the step is planned; the draws run where the
//! model ran, right after it (the engine's own thread on native, not the JS thread); the commit
//! hands each drawn token, the advanced generator, the text state and the logprobs back to a turn
//! that is still the one planned.
//!
//! ```text
//!   run_begin: plan ──▶ Draws::push per sampled row (params, rng clone, history, text clone)
//!   execute:   model ──▶ Draws::sample(output, codec)  (same RNG stream, same arithmetic;
//!                                                       then the token's text, output.rs)
//!   run_commit:        ──▶ turn.rng = draw.rng, turn.text = draw.text, token, text, logprobs
//!                          (skipped for a cancelled turn)
//! ```
//!
//! A turn's generator and text state are used by its draws only, so a copy taken at plan time and
//! handed back at commit gives every trace exactly as sampling at commit did; a turn cancelled
//! while the step ran keeps its own, untouched, to flush its held-back text.

use crate::executor::StepOutput;
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
}

impl Draws {
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// The next sampled row's draw, taken from its turn as planned.
    pub fn push(
        &mut self,
        params: SamplingParams,
        rng: &Rng,
        history: History<'_>,
        top_logprobs: Option<u32>,
        text: &TurnText,
    ) {
        let context = if params.penalties.is_none() { &[][..] } else { history.context };
        if self.len == self.rows.len() {
            self.rows.push(RowDraw {
                params,
                rng: rng.clone(),
                context: context.to_vec(),
                generated: history.generated,
                top_logprobs,
                text: text.clone(),
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

    /// Samples every row from the model's output (row i of the output is draw i) and makes the
    /// text each token adds to its turn's.
    pub fn sample(&mut self, output: &StepOutput, codec: &dyn TextCodec) {
        for (index, draw) in self.rows[..self.len].iter_mut().enumerate() {
            let logits = output.row(index);
            let history = History { context: &draw.context, generated: draw.generated };
            draw.token = sampling::sample(logits, &draw.params, history, &mut draw.rng, &mut self.scratch);
            draw.step = draw.text.push(codec, draw.token as i32);
            draw.logprobs = draw.top_logprobs.map(|top| {
                LogprobsText::new(codec, sampling::logprobs(logits, draw.token, top, &mut self.logprob_scratch))
            });
        }
    }

    /// Draw `index`, to hand back to its turn at commit.
    pub fn row_mut(&mut self, index: usize) -> &mut RowDraw {
        &mut self.rows[..self.len][index]
    }
}
