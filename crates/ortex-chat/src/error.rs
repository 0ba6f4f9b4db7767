//! The one error type of this crate's boundary. Every code has a stable string, for the engine to carry
//! into `OrtexError.code` (or to map onto one of the core's codes).

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ChatErrorCode {
    /// The model folder has no chat template, or not the one asked for by name.
    TemplateMissing,
    /// The template does not parse.
    TemplateInvalid,
    /// The template called `raise_exception(message)`: the conversation is one the template rejects (roles
    /// out of order, an unsupported role, a malformed tool call). The message is the template's own.
    TemplateRaised,
    /// Rendering failed for another reason: a method or filter this renderer lacks, a type error, an
    /// undefined value used where the template needs one, the render budget spent.
    TemplateFailed,
    /// The template calls `strftime_now` and the render input carries no time.
    TimeMissing,
    /// The render input is malformed: messages that are not a list of objects, tools that are not a list,
    /// an extra variable that would shadow one the renderer sets.
    InputInvalid,
    /// `tokenizer_config.json`, `generation_config.json` or `genai_config.json` is not valid JSON or has a
    /// field of the wrong type.
    ConfigInvalid,
}

impl ChatErrorCode {
    pub const fn as_str(self) -> &'static str {
        match self {
            ChatErrorCode::TemplateMissing => "CHAT_TEMPLATE_MISSING",
            ChatErrorCode::TemplateInvalid => "CHAT_TEMPLATE_INVALID",
            ChatErrorCode::TemplateRaised => "CHAT_TEMPLATE_RAISED",
            ChatErrorCode::TemplateFailed => "CHAT_TEMPLATE_FAILED",
            ChatErrorCode::TimeMissing => "CHAT_TIME_MISSING",
            ChatErrorCode::InputInvalid => "CHAT_INPUT_INVALID",
            ChatErrorCode::ConfigInvalid => "CHAT_CONFIG_INVALID",
        }
    }
}

impl fmt::Display for ChatErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatError {
    pub code: ChatErrorCode,
    pub message: String,
}

impl ChatError {
    pub fn new(code: ChatErrorCode, message: impl Into<String>) -> ChatError {
        ChatError { code, message: message.into() }
    }
}

impl fmt::Display for ChatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code.as_str(), self.message)
    }
}

impl std::error::Error for ChatError {}
