//! `CoreChat`: a model's chat template (boundary::Chat), compiled once. Objects in, text out; a panic
//! inside the renderer becomes a CHAT_TEMPLATE_FAILED error, never an abort.
//!
//! A chat turn begins in one call, `CoreEngine.beginChatTurn`: render, tokenize, the template's end
//! tokens and the turn's start (boundary::Chat::prompt, boundary::begin_chat_turn_impl). Its async form
//! renders and tokenizes on the libuv thread pool: a render costs in proportion to the
//! conversation (a megabyte of messages held the JS thread for over a second), and up to its
//! budget (64 MiB of data, a million instructions) for a hostile template; a megabyte of text
//! costs a real tokenizer about 400 ms. It takes the input as JSON text, which V8 writes in one
//! call, instead of an object converted field by field on the JS thread. The turn begins on the
//! JS thread, where the engine lives, when the task resolves.
//!
//! A conversation's send is one call too, `CoreEngine.beginConversationTurn`, on a
//! `CoreConversation` (boundary::Conversation: what the last send left resident) that the facade's
//! Chat holds: render outside the engine's lock, then plan, tokenize and begin under it.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use std::sync::Mutex;

use napi::bindgen_prelude::{AsyncTask, Env, Task, Unknown};
use napi_derive::napi;
use ortex_boundary as boundary;
use ortex_core::text::TextCodec;
use ortex_core::{Engine, ErrorCode, OrtexError};

use crate::{coded, coded_js, guarded as engine_guarded, input, lock, CoreEngine};

#[napi]
pub struct CoreChat {
    chat: Arc<boundary::Chat>,
}

fn guarded<T>(call: impl FnOnce() -> ortex_core::Result<T>) -> napi::Result<T, String> {
    caught(call).map_err(coded)
}

/// `call`'s result, or CHAT_TEMPLATE_FAILED if it panicked.
fn caught<T>(call: impl FnOnce() -> ortex_core::Result<T>) -> ortex_core::Result<T> {
    catch_unwind(AssertUnwindSafe(call)).unwrap_or_else(|payload| {
        Err(OrtexError::new(
            ErrorCode::ChatTemplateFailed,
            format!("the chat template renderer panicked: {}", boundary::panic_message(payload.as_ref())),
        ))
    })
}

/// A chat turn's prompt (boundary::Chat::prompt), or CHAT_TEMPLATE_FAILED if rendering or tokenizing
/// panicked.
fn prompt(
    chat: &boundary::Chat,
    codec: &dyn TextCodec,
    render_input: impl FnOnce() -> ortex_core::Result<boundary::ChatRenderInput>,
    parse_special_tokens: bool,
) -> ortex_core::Result<boundary::ChatPrompt> {
    caught(|| chat.prompt(codec, render_input()?, parse_special_tokens))
}

/// Begins the turn on the JS thread, under the engine's guard (a panic marks it unhealthy).
fn begin(
    engine: &Mutex<Engine>,
    request_id: u32,
    prompt: boundary::ChatPrompt,
    options: boundary::TurnOptionsInput,
) -> ortex_core::Result<ChatTurn> {
    engine_guarded(&mut lock(engine), |engine| boundary::begin_chat_turn_impl(engine, request_id, prompt, options))
        .map(ChatTurn::from)
}

/// boundary::ChatTurnView as napi-rs converts it (an async task's value must name its type).
#[napi(object)]
pub struct ChatTurn {
    pub turn_id: u32,
    pub prompt_tokens: u32,
}

impl From<boundary::ChatTurnView> for ChatTurn {
    fn from(view: boundary::ChatTurnView) -> ChatTurn {
        ChatTurn { turn_id: view.turn_id, prompt_tokens: view.prompt_tokens }
    }
}

/// A chat turn's prompt made on the libuv thread pool with the engine's codec and the
/// `CoreChat`'s compiled template; the turn begins when it resolves.
pub struct ChatTurnTask {
    engine: Arc<Mutex<Engine>>,
    chat: Arc<boundary::Chat>,
    codec: Arc<dyn TextCodec>,
    request_id: u32,
    input_json: String,
    parse_special_tokens: bool,
    options: Option<boundary::TurnOptionsInput>,
}

impl Task for ChatTurnTask {
    type Output = ortex_core::Result<boundary::ChatPrompt>;
    type JsValue = ChatTurn;

    /// On the libuv thread pool: parse the input, render, tokenize.
    fn compute(&mut self) -> napi::Result<Self::Output> {
        let input_json = std::mem::take(&mut self.input_json);
        let render_input =
            || serde_json::from_str(&input_json).map_err(|error| boundary::invalid_input("chat template input", error));
        Ok(prompt(&self.chat, self.codec.as_ref(), render_input, self.parse_special_tokens))
    }

    /// On the JS thread: begins the turn (ChatTurnView), or rejects with the error's code.
    fn resolve(&mut self, env: Env, output: Self::Output) -> napi::Result<ChatTurn> {
        let options = self.options.take().expect("a task resolves once");
        output
            .and_then(|prompt| begin(&self.engine, self.request_id, prompt, options))
            .map_err(|error| coded_js(&env, error))
    }
}

#[napi]
impl CoreEngine {
    /// Begins a chat turn on request `requestId`: `chat` renders `renderInput` (ChatRenderInput)
    /// with a generation prompt, marked unless `parseSpecialTokens`; the engine's codec tokenizes
    /// it; the template's single-token end strings join `options.eosTokenIds`.
    #[napi(ts_return_type = "ChatTurnView")]
    pub fn begin_chat_turn(
        &self,
        request_id: u32,
        chat: &CoreChat,
        render_input: Unknown<'_>,
        parse_special_tokens: bool,
        options: Unknown<'_>,
    ) -> napi::Result<ChatTurn, String> {
        let options = input("turn options", options).map_err(coded)?;
        let codec = self.call(|engine| engine.text_codec())?;
        let render_input = || input("chat template input", render_input);
        let prompt = prompt(&chat.chat, codec.as_ref(), render_input, parse_special_tokens).map_err(coded)?;
        begin(&self.engine, request_id, prompt, options).map_err(coded)
    }

    /// `beginChatTurn` with the render and the tokenizing on the libuv thread pool; the input as
    /// JSON text. Resolves once the turn has begun, or rejects with the same codes.
    #[napi(ts_return_type = "Promise<ChatTurnView>")]
    pub fn begin_chat_turn_async(
        &self,
        request_id: u32,
        chat: &CoreChat,
        input_json: String,
        parse_special_tokens: bool,
        options: Unknown<'_>,
    ) -> napi::Result<AsyncTask<ChatTurnTask>, String> {
        let options = input("turn options", options).map_err(coded)?;
        let codec = self.call(|engine| engine.text_codec())?;
        Ok(AsyncTask::new(ChatTurnTask {
            engine: Arc::clone(&self.engine),
            chat: Arc::clone(&chat.chat),
            codec,
            request_id,
            input_json,
            parse_special_tokens,
            options: Some(options),
        }))
    }
}

/// A conversation's memory of its last send (boundary::Conversation); made by
/// `CoreEngine.createConversation`, held by the facade's Chat, dropped with it.
#[napi]
pub struct CoreConversation {
    conversation: Mutex<boundary::Conversation>,
}

#[napi]
impl CoreEngine {
    #[napi]
    pub fn create_conversation(&self) -> CoreConversation {
        CoreConversation { conversation: Mutex::new(boundary::Conversation::new()) }
    }

    /// A conversation's send (boundary::Conversation): `chat` renders `renderInput` (the whole
    /// conversation) with a generation prompt, marked unless `parseSpecialTokens`; what is not
    /// resident yet on request `requestId` is appended, after cutting the context where the
    /// render no longer matches it; the template's end tokens join `options.eosTokenIds`. Bad
    /// options throw before the context changes.
    #[napi(ts_return_type = "ChatTurnView")]
    pub fn begin_conversation_turn(
        &self,
        request_id: u32,
        conversation: &CoreConversation,
        chat: &CoreChat,
        render_input: Unknown<'_>,
        parse_special_tokens: bool,
        options: Unknown<'_>,
    ) -> napi::Result<ChatTurn, String> {
        let options = input("turn options", options).map_err(coded)?;
        let text =
            guarded(|| chat.chat.prompt_text(input("chat template input", render_input)?, parse_special_tokens))?;
        let mut conversation = lock(&conversation.conversation);
        let mut engine = lock(&self.engine);
        // Planning reads the engine and tokenizes: a panic there is the tokenizer's, as in `prompt`.
        let plan = guarded(|| conversation.plan(&engine, &chat.chat, request_id, text, parse_special_tokens))?;
        engine_guarded(&mut engine, |engine| conversation.begin(engine, request_id, plan, options))
            .map(ChatTurn::from)
            .map_err(coded)
    }
}

#[napi]
impl CoreChat {
    /// A model folder's chat files (ChatFilesInput: their text, absent where missing);
    /// `controls`: the control strings of the engine that tokenizes its prompts.
    #[napi(factory)]
    pub fn from_files(files: Unknown<'_>, controls: Vec<String>) -> napi::Result<Self, String> {
        let chat = guarded(|| boundary::Chat::from_files(&input("chat files", files)?))?;
        Ok(CoreChat { chat: Arc::new(chat.with_control_strings(controls)) })
    }

    /// The built-in ChatML template.
    #[napi(factory)]
    pub fn chatml(controls: Vec<String>) -> Self {
        CoreChat { chat: Arc::new(boundary::Chat::chatml().with_control_strings(controls)) }
    }

    /// Renders a conversation (ChatRenderInput) to the text the model reads.
    #[napi]
    pub fn render(&self, render_input: Unknown<'_>) -> napi::Result<String, String> {
        guarded(|| self.chat.render(input("chat template input", render_input)?))
    }

    /// The same, with the caller's strings marked, for `CoreEngine.tokenizeMarked`.
    #[napi]
    pub fn render_marked(&self, render_input: Unknown<'_>) -> napi::Result<String, String> {
        guarded(|| self.chat.render_marked(input("chat template input", render_input)?))
    }

    /// The strings that end a generated turn.
    #[napi]
    pub fn stop_strings(&self) -> Vec<String> {
        self.chat.stop_strings()
    }

    #[napi]
    pub fn has_template(&self) -> bool {
        self.chat.has_template()
    }
}
