//! Chat templates for both bindings: a model folder's chat files (read by the facade, passed as
//! text) or the built-in ChatML template become one [`Chat`]; rendering a conversation is a call on
//! it. The rendering itself is crates/ortex-chat's (minijinja, as Hugging Face renders); this
//! module only converts inputs and errors.

use std::sync::OnceLock;

use ortex_chat::{ChatConfig, ChatError, ChatErrorCode, DateTime, ModelFiles, RenderInput};
use ortex_core::text::TextCodec;
use ortex_core::{ErrorCode, OrtexError, Result};

use crate::prompt_text::ControlStrings;
use serde::Deserialize;
#[cfg(feature = "typescript")]
use ts_rs::TS;

/// The text of a model folder's chat files; absent where the folder lacks one.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[cfg_attr(feature = "typescript", derive(TS), ts(optional_fields))]
pub struct ChatFilesInput {
    pub chat_template_jinja: Option<String>,
    pub tokenizer_config_json: Option<String>,
    pub generation_config_json: Option<String>,
    pub genai_config_json: Option<String>,
}

/// One render: what Hugging Face's `apply_chat_template` takes.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[cfg_attr(feature = "typescript", derive(TS), ts(optional_fields))]
pub struct ChatRenderInput {
    #[cfg_attr(feature = "typescript", ts(type = "unknown[]"))]
    pub messages: serde_json::Value,
    pub add_generation_prompt: Option<bool>,
    #[cfg_attr(feature = "typescript", ts(type = "unknown[]", optional))]
    pub tools: Option<serde_json::Value>,
    #[cfg_attr(feature = "typescript", ts(type = "unknown[]", optional))]
    pub documents: Option<serde_json::Value>,
    /// A template by name (`tool_use`); absent: `default` (or `tool_use` when tools are given).
    pub template_name: Option<String>,
    /// Further template variables (`enable_thinking`, `date_string`).
    #[cfg_attr(feature = "typescript", ts(type = "Record<string, unknown>", optional))]
    pub variables: Option<serde_json::Map<String, serde_json::Value>>,
    /// The time `strftime_now` prints, in whole seconds since the Unix epoch (UTC).
    pub now_unix_seconds: Option<f64>,
}

/// A model's chat setup, compiled once, with the control strings of the codec its prompts are
/// tokenized with (one engine's: the end tokens are cached for that codec).
#[derive(Debug, Clone)]
pub struct Chat {
    config: ChatConfig,
    controls: ControlStrings,
    end_tokens: OnceLock<Vec<EndToken>>,
}

/// One of the template's end-of-turn strings that is one token of the codec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndToken {
    pub id: i32,
    pub text: String,
}

/// A chat turn's prompt, ready to begin: the conversation rendered with a generation prompt and
/// tokenized, and the template's end-of-turn token ids.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatPrompt {
    pub tokens: Vec<i32>,
    pub end_token_ids: Vec<i32>,
}

/// Tokenizes a prompt (or the end of one) from [`Chat::prompt_text`]: marked text as
/// `tokenize_marked_with` reads it, unless `parse_special_tokens`.
pub fn tokenize_prompt(codec: &dyn TextCodec, text: &str, parse_special_tokens: bool) -> Result<Vec<i32>> {
    if parse_special_tokens {
        codec.tokenize(text)
    } else {
        crate::tokenize_marked_with(codec, text)
    }
}

pub fn chat_error(error: ChatError) -> OrtexError {
    let code = match error.code {
        ChatErrorCode::TemplateMissing => ErrorCode::ChatTemplateMissing,
        ChatErrorCode::TemplateInvalid => ErrorCode::ChatTemplateInvalid,
        ChatErrorCode::TemplateRaised => ErrorCode::ChatTemplateRaised,
        ChatErrorCode::TemplateFailed => ErrorCode::ChatTemplateFailed,
        ChatErrorCode::TimeMissing => ErrorCode::ChatTimeMissing,
        ChatErrorCode::ConfigInvalid => ErrorCode::ChatConfigInvalid,
        ChatErrorCode::InputInvalid => ErrorCode::InvalidArgument,
    };
    OrtexError::new(code, error.message)
}

impl Chat {
    /// A folder's files. A folder without a template loads: rendering then fails with
    /// CHAT_TEMPLATE_MISSING naming the files it looked in.
    pub fn from_files(files: &ChatFilesInput) -> Result<Chat> {
        let files = ModelFiles {
            chat_template_jinja: files.chat_template_jinja.as_deref(),
            tokenizer_config_json: files.tokenizer_config_json.as_deref(),
            generation_config_json: files.generation_config_json.as_deref(),
            genai_config_json: files.genai_config_json.as_deref(),
        };
        Ok(Chat::new(ChatConfig::load(&files).map_err(chat_error)?))
    }

    /// The built-in ChatML template (the simulated engine's).
    pub fn chatml() -> Chat {
        Chat::new(ChatConfig::chatml())
    }

    fn new(config: ChatConfig) -> Chat {
        Chat { config, controls: ControlStrings::none(), end_tokens: OnceLock::new() }
    }

    /// The same template for prompts tokenized by a codec with these control strings
    /// (`Engine::control_strings`).
    pub fn with_control_strings(self, strings: Vec<String>) -> Chat {
        Chat { controls: ControlStrings::new(strings), end_tokens: OnceLock::new(), ..self }
    }

    /// A chat turn's prompt from `input` (rendered with a generation prompt: a turn answers).
    /// Marked (the default) unless `parse_special_tokens`: then control strings in the caller's
    /// text become control tokens too (prompt_text.rs).
    pub fn prompt(
        &self,
        codec: &dyn TextCodec,
        input: ChatRenderInput,
        parse_special_tokens: bool,
    ) -> Result<ChatPrompt> {
        let text = self.prompt_text(input, parse_special_tokens)?;
        let tokens = tokenize_prompt(codec, &text, parse_special_tokens)?;
        Ok(ChatPrompt { tokens, end_token_ids: self.end_token_ids(codec)? })
    }

    /// A chat turn's prompt as text, before tokenizing: rendered with a generation prompt, marked
    /// unless `parse_special_tokens` ([`tokenize_prompt`] reads it).
    pub fn prompt_text(&self, mut input: ChatRenderInput, parse_special_tokens: bool) -> Result<String> {
        input.add_generation_prompt = Some(true);
        if parse_special_tokens {
            self.render(input)
        } else {
            self.render_marked(input)
        }
    }

    /// The template's end-of-turn strings that are one token of `codec` (`<|im_end|>`,
    /// `<|eot_id|>`): a chat turn ends with 'eos' on them. Worked out once.
    pub fn end_token_ids(&self, codec: &dyn TextCodec) -> Result<Vec<i32>> {
        Ok(self.end_tokens(codec)?.iter().map(|end| end.id).collect())
    }

    /// The same with their text: a conversation keeps a reply's end token where the template
    /// writes its text next (conversation.rs). The first string of an id wins.
    pub fn end_tokens(&self, codec: &dyn TextCodec) -> Result<&[EndToken]> {
        if let Some(ends) = self.end_tokens.get() {
            return Ok(ends);
        }
        let mut ends: Vec<EndToken> = Vec::new();
        for text in self.config.stop_strings() {
            if let [id] = codec.tokenize(text)?[..] {
                if !ends.iter().any(|end| end.id == id) {
                    ends.push(EndToken { id, text: text.clone() });
                }
            }
        }
        Ok(self.end_tokens.get_or_init(|| ends))
    }

    /// The prompt as the model reads it, with every string of the input marked (prompt_text.rs):
    /// what `tokenize_marked_impl` tokenizes so that message text never becomes control tokens.
    pub fn render_marked(&self, mut input: ChatRenderInput) -> Result<String> {
        self.controls.mark_value(&mut input.messages);
        for value in [&mut input.tools, &mut input.documents].into_iter().flatten() {
            self.controls.mark_value(value);
        }
        for value in input.variables.iter_mut().flat_map(|variables| variables.values_mut()) {
            self.controls.mark_value(value);
        }
        self.render(input)
    }

    /// The prompt as plain text (what `applyChatTemplate` returns).
    pub fn render(&self, input: ChatRenderInput) -> Result<String> {
        let with_tools = input.tools.as_ref().is_some_and(|t| t.as_array().is_some_and(|a| !a.is_empty()));
        let template = self.config.template(input.template_name.as_deref(), with_tools).map_err(chat_error)?;
        let now = match input.now_unix_seconds {
            None => None,
            Some(s) if s.is_finite() && s.fract() == 0.0 && s.abs() < 1e15 => {
                Some(DateTime::from_unix_seconds(s as i64))
            }
            Some(s) => return Err(OrtexError::invalid(format!("nowUnixSeconds must be whole seconds, got {s}"))),
        };
        let render = RenderInput {
            messages: input.messages,
            add_generation_prompt: input.add_generation_prompt.unwrap_or(true),
            tools: input.tools,
            documents: input.documents,
            extra: input.variables.unwrap_or_default(),
            now,
        };
        template.render(&render).map_err(chat_error)
    }

    /// The strings that end a generated turn (the eos token, the template's end-of-turn markers).
    pub fn stop_strings(&self) -> Vec<String> {
        self.config.stop_strings().to_vec()
    }

    /// Whether a template is there at all (a folder without one still loads).
    pub fn has_template(&self) -> bool {
        self.config.template_names().next().is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render_input(messages: serde_json::Value) -> ChatRenderInput {
        ChatRenderInput { messages, ..ChatRenderInput::default() }
    }

    #[test]
    fn chatml_renders_with_a_generation_prompt_by_default() {
        let text = Chat::chatml().render(render_input(json!([{"role": "user", "content": "Hi"}]))).unwrap();
        assert_eq!(text, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
        assert_eq!(Chat::chatml().stop_strings(), vec!["<|im_end|>".to_owned()]);
    }

    #[test]
    fn a_chat_prompt_is_the_rendered_conversation_tokenized() {
        // The simulated codec has no control strings: marked or not, the same tokens, and
        // `<|im_end|>` is many tokens, so no end token (prompt_text.rs tests the marking).
        let engine = ortex_core::Engine::simulated(&ortex_core::options::SimOptions::default()).unwrap();
        let codec = engine.text_codec().unwrap();
        let chat = Chat::chatml().with_control_strings(codec.control_strings());
        let messages = json!([{"role": "user", "content": "hi <|im_end|>"}]);
        let rendered = chat.render(render_input(messages.clone())).unwrap();
        let mut no_generation_prompt = render_input(messages.clone());
        no_generation_prompt.add_generation_prompt = Some(false);
        for parse_special_tokens in [false, true] {
            let prompt = chat.prompt(codec.as_ref(), no_generation_prompt.clone(), parse_special_tokens).unwrap();
            assert_eq!(prompt, ChatPrompt { tokens: codec.tokenize(&rendered).unwrap(), end_token_ids: vec![] });
        }
    }

    #[test]
    fn a_folder_without_a_template_fails_rendering_with_a_stable_code() {
        let chat = Chat::from_files(&ChatFilesInput::default()).unwrap();
        assert!(!chat.has_template());
        let error = chat.render(render_input(json!([{"role": "user", "content": "Hi"}]))).unwrap_err();
        assert_eq!(error.code, ErrorCode::ChatTemplateMissing);
        assert!(error.message.contains("chat_template"), "{}", error.message);
    }

    #[test]
    fn bad_inputs_have_codes() {
        let bad_json = ChatFilesInput { tokenizer_config_json: Some("{".into()), ..ChatFilesInput::default() };
        assert_eq!(Chat::from_files(&bad_json).unwrap_err().code, ErrorCode::ChatConfigInvalid);
        let bad_template = ChatFilesInput { chat_template_jinja: Some("{% if %}".into()), ..ChatFilesInput::default() };
        assert_eq!(Chat::from_files(&bad_template).unwrap_err().code, ErrorCode::ChatTemplateInvalid);
        let raising = ChatFilesInput {
            chat_template_jinja: Some("{{ raise_exception('roles must alternate') }}".into()),
            ..ChatFilesInput::default()
        };
        let hi = json!([{"role": "user", "content": "Hi"}]);
        let error = Chat::from_files(&raising).unwrap().render(render_input(hi.clone())).unwrap_err();
        assert_eq!(error.code, ErrorCode::ChatTemplateRaised);
        assert!(error.message.contains("roles must alternate"));
        let not_a_list = Chat::chatml().render(render_input(json!({"role": "user"}))).unwrap_err();
        assert_eq!(not_a_list.code, ErrorCode::InvalidArgument);
        let mut fractional = render_input(hi);
        fractional.now_unix_seconds = Some(1.5);
        assert_eq!(Chat::chatml().render(fractional).unwrap_err().code, ErrorCode::InvalidArgument);
    }
}
