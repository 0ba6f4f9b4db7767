//! `CoreChat`: a model's chat template (ops::Chat), compiled once. Objects in, text out; a panic
//! inside the renderer becomes a CHAT_TEMPLATE_FAILED error, never an abort.

use std::panic::{catch_unwind, AssertUnwindSafe};

use napi::bindgen_prelude::Unknown;
use napi_derive::napi;
use ortex_core::{ErrorCode, OrtexError};
use ortex_ops as ops;

use crate::{coded, input};

#[napi]
pub struct CoreChat {
    chat: ops::Chat,
}

fn guarded<T>(call: impl FnOnce() -> ortex_core::Result<T>) -> napi::Result<T, String> {
    catch_unwind(AssertUnwindSafe(call))
        .unwrap_or_else(|payload| {
            Err(OrtexError::new(
                ErrorCode::ChatTemplateFailed,
                format!("the chat template renderer panicked: {}", ops::panic_message(payload.as_ref())),
            ))
        })
        .map_err(coded)
}

#[napi]
impl CoreChat {
    /// A model folder's chat files (ChatFilesInput: their text, absent where missing);
    /// `controls`: the control strings of the engine that tokenizes its prompts.
    #[napi(factory)]
    pub fn from_files(files: Unknown<'_>, controls: Vec<String>) -> napi::Result<Self, String> {
        let chat = guarded(|| ops::Chat::from_files(&input("chat files", files)?))?;
        Ok(CoreChat { chat: chat.with_control_strings(controls) })
    }

    /// The built-in ChatML template.
    #[napi(factory)]
    pub fn chatml(controls: Vec<String>) -> Self {
        CoreChat { chat: ops::Chat::chatml().with_control_strings(controls) }
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
