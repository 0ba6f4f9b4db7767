//! `CoreChat`: a model's chat template (ops::Chat), compiled once. Objects in, text out; a panic
//! inside the renderer becomes a CHAT_TEMPLATE_FAILED error, never an abort.
//!
//! `renderAsync` renders on the libuv thread pool: a render costs in proportion to the conversation
//! (a megabyte of messages held the JS thread for over a second), and up to its budget (64 MiB of
//! data, a million instructions) for a hostile template. It takes the input as JSON text, which V8
//! writes in one call, instead of an object converted field by field on the JS thread.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use napi::bindgen_prelude::{AsyncTask, Env, Task, Unknown};
use napi_derive::napi;
use ortex_boundary as ops;
use ortex_core::{ErrorCode, OrtexError};

use crate::{coded, coded_js, input};

#[napi]
pub struct CoreChat {
    chat: Arc<ops::Chat>,
}

fn guarded<T>(call: impl FnOnce() -> ortex_core::Result<T>) -> napi::Result<T, String> {
    caught(call).map_err(coded)
}

/// `call`'s result, or CHAT_TEMPLATE_FAILED if it panicked.
fn caught<T>(call: impl FnOnce() -> ortex_core::Result<T>) -> ortex_core::Result<T> {
    catch_unwind(AssertUnwindSafe(call)).unwrap_or_else(|payload| {
        Err(OrtexError::new(
            ErrorCode::ChatTemplateFailed,
            format!("the chat template renderer panicked: {}", ops::panic_message(payload.as_ref())),
        ))
    })
}

/// One render on the libuv thread pool, sharing the `CoreChat`'s compiled template.
pub struct RenderTask {
    chat: Arc<ops::Chat>,
    input_json: String,
    marked: bool,
}

impl Task for RenderTask {
    type Output = ortex_core::Result<String>;
    type JsValue = String;

    /// On the libuv thread pool: parse the input, render.
    fn compute(&mut self) -> napi::Result<Self::Output> {
        let input_json = std::mem::take(&mut self.input_json);
        Ok(caught(|| {
            let input =
                serde_json::from_str(&input_json).map_err(|error| ops::invalid_input("chat template input", error))?;
            if self.marked {
                self.chat.render_marked(input)
            } else {
                self.chat.render(input)
            }
        }))
    }

    /// On the JS thread: the text, or the error with its code (CHAT_TEMPLATE_FAILED, ...).
    fn resolve(&mut self, env: Env, output: Self::Output) -> napi::Result<String> {
        output.map_err(|error| coded_js(&env, error))
    }
}

#[napi]
impl CoreChat {
    /// A model folder's chat files (ChatFilesInput: their text, absent where missing);
    /// `controls`: the control strings of the engine that tokenizes its prompts.
    #[napi(factory)]
    pub fn from_files(files: Unknown<'_>, controls: Vec<String>) -> napi::Result<Self, String> {
        let chat = guarded(|| ops::Chat::from_files(&input("chat files", files)?))?;
        Ok(CoreChat { chat: Arc::new(chat.with_control_strings(controls)) })
    }

    /// The built-in ChatML template.
    #[napi(factory)]
    pub fn chatml(controls: Vec<String>) -> Self {
        CoreChat { chat: Arc::new(ops::Chat::chatml().with_control_strings(controls)) }
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

    /// `render` (or `renderMarked`) off the JS thread: the same input as JSON text; resolves
    /// with the text or rejects with the same codes.
    #[napi(ts_return_type = "Promise<string>")]
    pub fn render_async(&self, input_json: String, marked: bool) -> AsyncTask<RenderTask> {
        AsyncTask::new(RenderTask { chat: Arc::clone(&self.chat), input_json, marked })
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
