//! The commit of a step's sampled rows: each row's draw state (its turn's RNG, text state and
//! constraint) goes out with the step (`take_draws`) and comes back with its token
//! (`commit_rows`), or unchanged when the step rolls back (`return_constraints`); and how a turn
//! ends with the token it got (a stop string, a stop token, its limits, a completed constraint).

use crate::draws::Draws;
use crate::events::{Event, EventErrorCode, FinishReason, StopMatch};
use crate::executor::StepPlan;
use crate::output::TextStep;
use crate::request::{Request, TurnSlot};
use crate::sampling;
use crate::text::TextCodec;

use super::Engine;

impl Engine {
    /// What each sampled row's draw needs, from its turn as planned (draws.rs); its constraint
    /// moves to the draw until the commit.
    pub(super) fn take_draws(&mut self, plan: &StepPlan, draws: &mut Draws) {
        draws.clear();
        for row in plan.rows.iter().filter(|row| row.sample) {
            let request = self.requests.at_mut(row.request_position as usize);
            let TurnSlot::Running(turn) = &mut request.turn else { unreachable!("a sampled row has a running turn") };
            let history = sampling::History { context: &request.tokens, generated: turn.generated_tokens as usize };
            draws.push(
                turn.options.sampling,
                &turn.rng,
                history,
                turn.options.logprobs,
                &turn.text,
                turn.constraint.take(),
            );
        }
    }

    /// A step that did not commit (rolled back) hands each constraint back to its turn unchanged:
    /// nothing was sampled, so no matcher moved.
    pub(super) fn return_constraints(&mut self, plan: &StepPlan, draws: &mut Draws) {
        if !draws.has_constraints() {
            return;
        }
        for (index, row) in plan.rows.iter().filter(|row| row.sample).enumerate() {
            let constraint = draws.row_mut(index).constraint.take();
            let request = self.requests.at_mut(row.request_position as usize);
            if let Some(turn) = request.running_turn_mut().filter(|turn| turn.id == row.turn) {
                turn.constraint = constraint;
            }
        }
    }

    pub(super) fn commit_rows(&mut self, plan: &StepPlan, draws: &mut Draws) {
        let mut sampled_index = 0;
        for row in &plan.rows {
            let planned_turn = row.turn;
            let request = self.requests.at_mut(row.request_position as usize);
            if !request.is_decoding() {
                self.stats.prompt_tokens += u64::from(row.token_count);
            }
            request.kv_len += row.token_count;
            if request.prefill_target <= request.kv_len {
                request.prefill_target = 0;
            }
            if !row.sample {
                continue;
            }
            let draw = draws.row_mut(sampled_index);
            sampled_index += 1;
            if request.is_closed() || request.running_turn().map(|t| t.id) != Some(planned_turn) {
                continue; // closed or cancelled while the step was in flight
            }
            let TurnSlot::Running(turn) = &mut request.turn else { unreachable!("checked above") };
            turn.rng = draw.rng.clone();
            turn.text.clone_from(&draw.text);
            turn.constraint = draw.constraint.take();
            if turn.constraint.as_ref().is_some_and(|c| c.failure.is_some()) {
                let mut event = Event::request(row.request, planned_turn, 0, EventErrorCode::ConstraintFailed);
                event.text = finish_text(request, self.codec.as_ref()).text;
                let (_, usage) = request.transition_to_turn_complete(FinishReason::Failed);
                event.finish(FinishReason::Failed, usage);
                self.staged.push(event);
                continue;
            }
            let token = draw.token as i32;
            turn.generated_tokens += 1;
            request.tokens.push(token);
            self.stats.generated_tokens += 1;
            let mut event = Event::token(row.request, planned_turn, token);
            event.logprobs = draw.logprobs.take().map(Box::new);
            let mut step = std::mem::take(&mut draw.step);
            if let Some(reason) =
                turn_ending(request, token, &mut step, &self.config.eos_token_ids, self.codec.as_ref())
            {
                let (_, usage) = request.transition_to_turn_complete(reason);
                event.finish(reason, usage);
            }
            event.text = step.text;
            self.staged.push(event);
        }
    }
}

/// The held-back text of a request's running turn, at its end (output.rs).
pub(super) fn finish_text(request: &mut Request, codec: &dyn TextCodec) -> TextStep {
    request.running_turn_mut().map_or_else(TextStep::default, |turn| turn.text.finish(codec))
}

/// Whether the turn ends with `token`, which `step` is the text of: a stop string in it ends
/// the turn; so do the reasons `finish_reason_after` finds, and then the text held back is
/// flushed into `step` (where a stop string may still appear). A stop string wins over every
/// other reason but a stop token sequence (a stop either way, and the core's own).
fn turn_ending(
    request: &mut Request,
    token: i32,
    step: &mut TextStep,
    eos_token_ids: &[i32],
    codec: &dyn TextCodec,
) -> Option<FinishReason> {
    let natural = natural_ending(request, token, eos_token_ids);
    let text_stop = match (step.stop, natural) {
        (Some(index), _) => Some(index),
        (None, Some(_)) => {
            let rest = finish_text(request, codec);
            step.text.push_str(&rest.text);
            rest.stop
        }
        (None, None) => None,
    };
    match (natural, text_stop) {
        (Some(reason @ FinishReason::Stop(StopMatch::TokenIds(_))), _) | (Some(reason), None) => Some(reason),
        (_, Some(index)) => Some(FinishReason::Stop(StopMatch::Text(index))),
        (None, None) => None,
    }
}

/// Why the turn ends after `token` was appended, its text aside: a completed constraint ends it
/// 'eos' (its output is whole, whatever limit the same token reached); otherwise the request's
/// own order.
fn natural_ending(request: &Request, token: i32, eos_token_ids: &[i32]) -> Option<FinishReason> {
    let complete = request.running_turn()?.constraint.as_ref().is_some_and(|c| c.complete);
    if complete {
        return Some(FinishReason::Eos);
    }
    request.finish_reason_after(token, eos_token_ids)
}
