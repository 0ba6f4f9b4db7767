//! A transaction's draws: sampling travels with the step. What each sampled row needs (its
//! turn's parameters, its generator, its history where penalties read it) is copied from the turn
//! when the step is planned; the draws run where the model ran, right after it (the engine's own
//! thread on native, not the JS thread); the commit hands each drawn token, the advanced generator
//! and the logprobs back to a turn that is still the one planned.
//!
//! ```text
//!   run_begin: plan ──▶ Draws::take_from(turn) per sampled row (params, rng clone, history)
//!   execute:   model ──▶ Draws::sample(output)    (same RNG stream, same arithmetic)
//!   run_commit:        ──▶ turn.rng = draw.rng, token, logprobs   (skipped for a cancelled turn)
//! ```
//!
//! A turn's generator is used by its draws only, so a copy taken at plan time and handed back at
//! commit gives every trace exactly as sampling at commit did.

use crate::executor::StepOutput;
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
    pub token: u32,
    pub logprobs: Option<TokenLogprobs>,
}

/// The draws of one step, with the sampler's reusable buffers.
#[derive(Debug, Default)]
pub struct Draws {
    rows: Vec<RowDraw>,
    scratch: SamplerScratch,
    logprob_scratch: Vec<(u32, f32)>,
}

impl Draws {
    pub fn clear(&mut self) {
        self.rows.clear();
    }

    /// The next sampled row's draw, taken from its turn as planned.
    pub fn push(&mut self, params: SamplingParams, rng: &Rng, history: History<'_>, top_logprobs: Option<u32>) {
        let context = if params.penalties.is_none() { Vec::new() } else { history.context.to_vec() };
        self.rows.push(RowDraw {
            params,
            rng: rng.clone(),
            context,
            generated: history.generated,
            top_logprobs,
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

    /// Samples every row from the model's output (row i of the output is draw i).
    pub fn sample(&mut self, output: &StepOutput) {
        for (index, draw) in self.rows.iter_mut().enumerate() {
            let logits = output.row(index);
            let history = History { context: &draw.context, generated: draw.generated };
            draw.token = sampling::sample(logits, &draw.params, history, &mut draw.rng, &mut self.scratch);
            draw.logprobs =
                draw.top_logprobs.map(|top| sampling::logprobs(logits, draw.token, top, &mut self.logprob_scratch));
        }
    }

    /// Draw `index`, to hand back to its turn at commit.
    pub fn row_mut(&mut self, index: usize) -> &mut RowDraw {
        &mut self.rows[index]
    }
}
