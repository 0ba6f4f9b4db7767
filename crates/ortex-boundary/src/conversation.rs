//! A conversation on one request (the facade's `engine.createChat()` and `Chat.send`): each send
//! renders the whole conversation, but appends only what is not resident yet, so turn N costs
//! its new tokens. One call renders, plans, truncates, tokenizes and begins the turn.
//!
//! ```text
//!   send(input) ──render (marked unless parse_special_tokens)──▶ text
//!        │  the text starts with what is resident (the last prompt's text + the reply's text)?
//!        ├─ yes: append tokenize(the rest); a reply that ended on its end-of-turn token keeps it
//!        └─ no (the template rewrote history, a stop string cut the reply's text, the reply was
//!           cancelled): keep the longest common token prefix, truncate the request there,
//!           append the remainder
//! ```
//!
//! What the comparison needs has one owner each: the last prompt's text and the turn it began
//! are this [`Conversation`]'s (its binding object lives as long as the facade's Chat, which holds
//! the request); the reply, its tokens and why it ended are the core's (`Engine::finished_turn`),
//! and its text is made again from its tokens (`output::turn_text`), as its events carried it.

use ortex_core::events::{FinishReason, StopMatch};
use ortex_core::options::TurnOptions;
use ortex_core::output::turn_text;
use ortex_core::text::TextCodec;
use ortex_core::{Engine, FinishedTurn, RequestId, Result};

use crate::chat::{tokenize_prompt, Chat, ChatRenderInput, EndToken};
use crate::{with_end_tokens, ChatTurnView, TurnOptionsInput};

/// A conversation's memory of its last send; none before the first.
#[derive(Debug, Default)]
pub struct Conversation {
    last: Option<LastPrompt>,
}

/// The prompt text a send rendered, and the turn that answered it.
#[derive(Debug)]
struct LastPrompt {
    text: String,
    turn_id: u32,
}

/// What a send appends: the context is cut to `keep` tokens, then `tokens` begin the turn.
#[derive(Debug, Clone, PartialEq)]
pub struct ConversationPlan {
    /// The rendered prompt (marked unless the send parses special tokens).
    pub text: String,
    pub keep: u32,
    pub tokens: Vec<i32>,
    pub end_token_ids: Vec<i32>,
}

impl Conversation {
    pub fn new() -> Conversation {
        Conversation::default()
    }

    /// Plans what to append for `text` (`Chat::prompt_text` of the whole conversation); reads the
    /// engine, changes nothing.
    pub fn plan(
        &self,
        engine: &Engine,
        chat: &Chat,
        request_id: u32,
        text: String,
        parse_special_tokens: bool,
    ) -> Result<ConversationPlan> {
        let codec = engine.text_codec()?;
        let codec = codec.as_ref();
        let end_tokens = chat.end_tokens(codec)?;
        let tokenize = |text: &str| tokenize_prompt(codec, text, parse_special_tokens);
        let id = RequestId(request_id);
        let appended = match &self.last {
            Some(last) => match engine.finished_turn(id)?.filter(|reply| reply.id.get() == last.turn_id) {
                Some(reply) => append_after_reply(
                    &text,
                    &last.text,
                    &reply,
                    engine.request_tokens(id)?,
                    end_tokens,
                    codec,
                    tokenize,
                )?,
                None => None,
            },
            None => None,
        };
        let (keep, tokens) = match appended {
            Some(appended) => appended,
            None => common_prefix(engine.request_tokens(id)?, tokenize(&text)?),
        };
        let end_token_ids = end_tokens.iter().map(|end| end.id).collect();
        Ok(ConversationPlan { text, keep, tokens, end_token_ids })
    }

    /// Begins the planned turn: the options are checked first (bad ones change nothing), then the
    /// context is cut to `plan.keep` and the turn begins on `plan.tokens`, with the template's end
    /// tokens joining `options.eosTokenIds`.
    pub fn begin(
        &mut self,
        engine: &mut Engine,
        request_id: u32,
        plan: ConversationPlan,
        options: TurnOptionsInput,
    ) -> Result<ChatTurnView> {
        let options = TurnOptions::try_from(with_end_tokens(options, &plan.end_token_ids))?;
        options.resolve(engine.config().vocab_size)?;
        let id = RequestId(request_id);
        if plan.keep < engine.token_count(id)? {
            engine.truncate(id, plan.keep)?;
            // Should the begin still fail (input past the session limit), what is resident no
            // longer ends with the last reply: the next send compares tokens.
            self.last = None;
        }
        let turn_id = engine.begin_turn(id, &plan.tokens, &options)?.get();
        let prompt_tokens = plan.tokens.len() as u32;
        self.last = Some(LastPrompt { text: plan.text, turn_id });
        Ok(ChatTurnView { turn_id, prompt_tokens })
    }
}

/// The usual case: the new render extends the last prompt and its reply as they are, and the
/// context still ends with that reply. `(keep, tokens)`, or None where tokens must decide.
fn append_after_reply(
    text: &str,
    last_text: &str,
    reply: &FinishedTurn,
    context: &[i32],
    end_tokens: &[EndToken],
    codec: &dyn TextCodec,
    tokenize: impl Fn(&str) -> Result<Vec<i32>>,
) -> Result<Option<(u32, Vec<i32>)>> {
    // A stop string cut the reply's text short of its tokens; a cancelled turn may hold back
    // part of a character: both leave text and tokens apart, so the token comparison decides.
    let text_matches_tokens = matches!(
        reply.reason,
        FinishReason::Eos | FinishReason::MaxGeneratedTokens | FinishReason::Stop(StopMatch::TokenIds(_))
    );
    // A prefill or a truncation since the reply (on the Chat's request) moved the context.
    let resident = context.len() as u32;
    if !text_matches_tokens || reply.generated_start + reply.generated_tokens != resident {
        return Ok(None);
    }
    let generated = &context[reply.generated_start as usize..];
    let reply_text = turn_text(codec, generated);
    let Some(mut rest) = text.strip_prefix(last_text).and_then(|rest| rest.strip_prefix(reply_text.as_str())) else {
        return Ok(None);
    };
    let mut keep = resident;
    if let (FinishReason::Eos, Some(&last_token)) = (reply.reason, generated.last()) {
        let end_text = end_tokens.iter().find(|end| end.id == last_token).map(|end| end.text.as_str());
        // The reply's own end-of-turn token is what the template writes next: keep it. A model's
        // EOS without that text (the simulated model's) goes, and the template's end follows.
        match end_text.and_then(|end| rest.strip_prefix(end)) {
            Some(after_end) => rest = after_end,
            None => keep -= 1,
        }
    }
    let tokens = if rest.is_empty() { Vec::new() } else { tokenize(rest)? };
    Ok((!tokens.is_empty()).then_some((keep, tokens)))
}

/// Keeps the longest common prefix of the context and the rendered prompt's tokens, at least one
/// token short of the prompt (a turn needs input), and appends the rest of the prompt.
fn common_prefix(context: &[i32], prompt: Vec<i32>) -> (u32, Vec<i32>) {
    let limit = context.len().min(prompt.len().saturating_sub(1));
    let keep = (0..limit).find(|&i| context[i] != prompt[i]).unwrap_or(limit);
    (keep as u32, prompt[keep..].to_vec())
}

/// A conversation's send in one call: render, plan, begin (a binding that renders outside the
/// engine's lock, or catches a renderer's panic apart from the engine's, calls the three itself).
pub fn begin_conversation_turn_impl(
    engine: &mut Engine,
    chat: &Chat,
    conversation: &mut Conversation,
    request_id: u32,
    input: ChatRenderInput,
    parse_special_tokens: bool,
    options: TurnOptionsInput,
) -> Result<ChatTurnView> {
    let text = chat.prompt_text(input, parse_special_tokens)?;
    let plan = conversation.plan(engine, chat, request_id, text, parse_special_tokens)?;
    conversation.begin(engine, request_id, plan, options)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{create_request_impl, simulated_impl, RequestOptionsInput, SimOptionsInput};
    use ortex_core::ErrorCode;
    use serde_json::{json, Value};

    fn engine() -> Engine {
        simulated_impl(SimOptionsInput { seed: Some(3.0), ..Default::default() }).unwrap()
    }

    fn chat(engine: &Engine) -> Chat {
        Chat::chatml().with_control_strings(engine.text_codec().unwrap().control_strings())
    }

    fn input(messages: &Value) -> ChatRenderInput {
        ChatRenderInput { messages: messages.clone(), ..ChatRenderInput::default() }
    }

    fn options(max_generated_tokens: u32) -> TurnOptionsInput {
        TurnOptionsInput { max_generated_tokens: Some(max_generated_tokens), ..Default::default() }
    }

    /// Runs the engine until the request's turn has finished.
    fn finish(engine: &mut Engine, request_id: u32) -> FinishedTurn {
        let mut events = vec![0; 64 * ortex_core::EVENT_STRIDE_WORDS];
        for _ in 0..1000 {
            if let Some(finished) = engine.finished_turn(RequestId(request_id)).unwrap() {
                return finished;
            }
            engine.run(&mut events, 64).unwrap();
        }
        panic!("the turn did not finish");
    }

    #[test]
    fn common_prefix_keeps_at_least_one_token_to_append() {
        assert_eq!(common_prefix(&[1, 2, 3, 4], vec![1, 2, 9]), (2, vec![9]));
        assert_eq!(common_prefix(&[1, 2, 3], vec![1, 2, 3]), (2, vec![3]));
        assert_eq!(common_prefix(&[], vec![5, 6]), (0, vec![5, 6]));
        assert_eq!(common_prefix(&[1], vec![]), (0, vec![]));
    }

    #[test]
    fn a_second_send_appends_only_what_the_render_adds() {
        let mut engine = engine();
        let chat = chat(&engine);
        let request = create_request_impl(&mut engine, RequestOptionsInput::default()).unwrap();
        let mut conversation = Conversation::new();
        let mut messages = json!([{"role": "user", "content": "Hi"}]);
        let first = begin_conversation_turn_impl(
            &mut engine,
            &chat,
            &mut conversation,
            request,
            input(&messages),
            false,
            options(5),
        )
        .unwrap();
        let reply = finish(&mut engine, request);
        assert_eq!(reply.reason, FinishReason::MaxGeneratedTokens);
        let context = engine.request_tokens(RequestId(request)).unwrap().to_vec();
        let codec = engine.text_codec().unwrap();
        let reply_text = turn_text(codec.as_ref(), &context[reply.generated_start as usize..]);
        messages.as_array_mut().unwrap().push(json!({"role": "assistant", "content": reply_text}));
        messages.as_array_mut().unwrap().push(json!({"role": "user", "content": "More"}));
        let plan = conversation
            .plan(&engine, &chat, request, chat.prompt_text(input(&messages), false).unwrap(), false)
            .unwrap();
        // The previous prompt and reply are resident as they are: nothing is cut.
        assert_eq!(plan.keep, context.len() as u32);
        // What the plan appends: the render's text after the first prompt and its reply.
        let full = chat.prompt_text(input(&messages), false).unwrap();
        let first_text = chat.prompt_text(input(&json!([{"role": "user", "content": "Hi"}])), false).unwrap();
        let rest = &full[first_text.len() + reply_text.len()..];
        assert_eq!(plan.tokens, codec.tokenize(rest).unwrap());
        let second = conversation.begin(&mut engine, request, plan.clone(), options(2)).unwrap();
        assert_eq!(second.prompt_tokens, plan.tokens.len() as u32);
        assert!(second.turn_id > first.turn_id);
    }

    #[test]
    fn bad_options_change_nothing_and_a_moved_context_is_compared_by_tokens() {
        let mut engine = engine();
        let chat = chat(&engine);
        let request = create_request_impl(&mut engine, RequestOptionsInput::default()).unwrap();
        let mut conversation = Conversation::new();
        let one = json!([{"role": "user", "content": "one"}]);
        begin_conversation_turn_impl(&mut engine, &chat, &mut conversation, request, input(&one), false, options(4))
            .unwrap();
        finish(&mut engine, request);
        let before = engine.request_tokens(RequestId(request)).unwrap().to_vec();
        // A history the template renders differently from what is resident.
        let rewritten = json!([{"role": "user", "content": "ONE"}, {"role": "user", "content": "two"}]);
        let bad = TurnOptionsInput { temperature: Some(-1.0), ..Default::default() };
        let error =
            begin_conversation_turn_impl(&mut engine, &chat, &mut conversation, request, input(&rewritten), false, bad)
                .unwrap_err();
        assert_eq!(error.code, ErrorCode::InvalidArgument);
        assert_eq!(engine.request_tokens(RequestId(request)).unwrap(), &before[..]);
        let plan = conversation
            .plan(&engine, &chat, request, chat.prompt_text(input(&rewritten), false).unwrap(), false)
            .unwrap();
        let full = engine.tokenize(&chat.prompt_text(input(&rewritten), false).unwrap()).unwrap();
        assert!(plan.keep < before.len() as u32);
        assert_eq!(&before[..plan.keep as usize], &full[..plan.keep as usize]);
        assert_eq!(plan.tokens, full[plan.keep as usize..]);
        conversation.begin(&mut engine, request, plan, options(1)).unwrap();
        assert_eq!(engine.token_count(RequestId(request)).unwrap() as usize, full.len());
    }
}
