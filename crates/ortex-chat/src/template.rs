//! One chat template, compiled, and its rendering.
//!
//! The environment is Jinja2 as Hugging Face configures it in `transformers.utils.chat_template_utils`:
//! `trim_blocks` and `lstrip_blocks`, loop controls (`break`, `continue`), `raise_exception`,
//! `strftime_now`, its own `tojson`, the `{% generation %}` block, and Python's methods on strings and dicts
//! (minijinja-contrib's pycompat). The render input goes through what `apply_chat_template` does before it
//! renders: keys whose value is null are dropped from each message, and a message's reasoning is copied
//! under `thinking` and `reasoning_content`.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;

use minijinja::value::{Serde, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, State, UndefinedBehavior, Value};
use serde_json::{Map, Value as JsonValue};

use crate::budget::{self, RENDER_DATA_BYTES, RENDER_FUEL};
use crate::builtins;
use crate::error::{ChatError, ChatErrorCode};
use crate::python;
use crate::strftime::DateTime;

/// The named special tokens a template sees, as Hugging Face's `special_tokens_map` passes them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    /// `bos_token`; undefined in the template when absent (Qwen has none).
    pub bos: Option<String>,
    /// `eos_token`.
    pub eos: Option<String>,
    /// The other named tokens, under the names the template reads: `unk_token`, `pad_token`, and a
    /// model's own (`boi_token` for Gemma 3).
    pub other: BTreeMap<String, String>,
}

/// What one render needs besides the template.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RenderInput {
    /// The conversation: a list of message objects (`role`, `content` as a string or a list of parts,
    /// `tool_calls`, `tool_call_id`, `reasoning_content`, ...), passed to the template as they are.
    pub messages: JsonValue,
    /// Ends the text with the header of an assistant turn, for the model to write that turn.
    pub add_generation_prompt: bool,
    /// Tool definitions (a list of JSON schemas, usually `{"type": "function", "function": {...}}`).
    pub tools: Option<JsonValue>,
    /// Documents for retrieval-augmented templates (a list of objects, usually `title` and `text`).
    pub documents: Option<JsonValue>,
    /// Further variables for the template (Qwen 3's `enable_thinking`, Llama's `date_string`), as the
    /// keyword arguments of `apply_chat_template`. They shadow the special tokens, as there.
    pub extra: Map<String, JsonValue>,
    /// The time `strftime_now` formats. Rendering reads no clock: without it a template that calls
    /// `strftime_now` fails with [`ChatErrorCode::TimeMissing`].
    pub now: Option<DateTime>,
}

impl RenderInput {
    pub fn new(messages: JsonValue) -> RenderInput {
        RenderInput { messages, ..RenderInput::default() }
    }
}

const TEMPLATE_NAME: &str = "chat_template";

/// The variables the renderer sets itself; `RenderInput::extra` may not shadow them.
const RESERVED_VARIABLES: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];

/// A compiled chat template with the special tokens it renders with. Cheap to clone (the environment is
/// shared).
#[derive(Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    special_tokens: SpecialTokens,
    /// Whether the template walks a message's content parts itself (see [`takes_content_parts`]).
    takes_content_parts: bool,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .field("special_tokens", &self.special_tokens)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`; fails with [`ChatErrorCode::TemplateInvalid`] if it does not parse.
    pub fn new(source: impl Into<String>, special_tokens: SpecialTokens) -> Result<ChatTemplate, ChatError> {
        let source = source.into();
        let mut env = environment();
        env.add_template_owned(TEMPLATE_NAME, rewrite_generation_blocks(&source).into_owned()).map_err(|error| {
            ChatError::new(ChatErrorCode::TemplateInvalid, format!("the chat template does not parse: {error}"))
        })?;
        let takes_content_parts = takes_content_parts(&source);
        Ok(ChatTemplate { env, source, special_tokens, takes_content_parts })
    }

    /// The template's text, as given.
    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.special_tokens
    }

    /// Renders the conversation to the prompt text, as Hugging Face's
    /// `apply_chat_template(messages, tools=..., documents=..., add_generation_prompt=..., tokenize=False,
    /// **extra)` does.
    pub fn render(&self, input: &RenderInput) -> Result<String, ChatError> {
        let context = self.context(input)?;
        let template = self.env.get_template(TEMPLATE_NAME).map_err(render_error)?;
        template.render(context).map_err(render_error)
    }

    fn context(&self, input: &RenderInput) -> Result<Value, ChatError> {
        let messages = normalize_messages(&input.messages, self.takes_content_parts)?;
        let tools = list_of_objects("tools", input.tools.as_ref())?;
        let documents = list_of_objects("documents", input.documents.as_ref())?;
        if let Some(name) = RESERVED_VARIABLES.iter().find(|name| input.extra.contains_key(**name)) {
            return Err(ChatError::new(
                ChatErrorCode::InputInvalid,
                format!("the extra template variable `{name}` would shadow the one the renderer sets; pass it in its own field"),
            ));
        }

        let mut context: BTreeMap<String, Value> = BTreeMap::new();
        let tokens = &self.special_tokens;
        let named = [("bos_token", &tokens.bos), ("eos_token", &tokens.eos)];
        for (name, token) in named {
            if let Some(token) = token {
                context.insert(name.to_owned(), Value::from(token.as_str()));
            }
        }
        for (name, token) in &tokens.other {
            context.insert(name.clone(), Value::from(token.as_str()));
        }
        context.insert("strftime_now".to_owned(), strftime_now(input.now));
        for (name, value) in &input.extra {
            context.insert(name.clone(), json_to_value(value));
        }
        context.insert("messages".to_owned(), json_to_value(&messages));
        // Hugging Face always passes `tools` and `documents`, as None when there are none, so
        // `tools is defined` holds and `tools is none` tells whether any were given.
        context.insert("tools".to_owned(), tools.map_or(Value::from(()), json_to_value));
        context.insert("documents".to_owned(), documents.map_or(Value::from(()), json_to_value));
        context.insert("add_generation_prompt".to_owned(), Value::from(input.add_generation_prompt));
        Ok(Value::from_object(context))
    }
}

/// JSON objects keep their key order (serde_json's `preserve_order`), as Python dicts do: templates that
/// print a message or `tojson` a tool show the keys as the caller wrote them.
fn json_to_value(json: &JsonValue) -> Value {
    Value::from(Serde(json))
}

fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .expect("the default delimiters form a valid syntax");
    env.set_syntax(syntax);
    env.set_auto_escape_callback(|_| AutoEscape::None);
    // Jinja2's default `Undefined`: printing it gives nothing, using it in an operation fails.
    env.set_undefined_behavior(UndefinedBehavior::Lenient);
    // The render budget (budget.rs): instructions and the data the render creates.
    env.set_fuel(Some(RENDER_FUEL));
    env.set_unknown_method_callback(builtins::method_callback);
    // Jinja2's `cycler`, `joiner`, `truncate`, `striptags`, `filesizeformat` (and `pluralize`). The
    // contrib's clock and randomness need features this crate does not enable.
    minijinja_contrib::add_to_environment(&mut env);
    env.set_formatter(|out, state, value| match value.as_str() {
        // The output charges the render's budget for every byte it takes.
        Some(text) if value.kind() == ValueKind::String => out.write_str(text).map_err(Error::from),
        _ => out.write_str(&python::py_str(state, value)?).map_err(Error::from),
    });
    env.add_filter("tojson", python::tojson_filter);
    env.add_filter("string", python::py_str);
    env.add_filter("split", builtins::split_filter);
    env.add_filter("lines", builtins::lines_filter);
    env.add_function("raise_exception", raise_exception);
    env
}

/// The error `raise_exception` carries, so that rendering can tell it from the engine's own failures.
#[derive(Debug)]
struct RaisedByTemplate(String);

impl fmt::Display for RaisedByTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedByTemplate {}

/// The error `strftime_now` carries when the render input has no time.
#[derive(Debug)]
struct TimeNotGiven;

impl fmt::Display for TimeNotGiven {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the template calls strftime_now but the render input carries no time")
    }
}

impl std::error::Error for TimeNotGiven {}

fn raise_exception(state: &State, message: &Value) -> Result<Value, Error> {
    let message = budget::display(state, message, "raise_exception's message")?;
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(RaisedByTemplate(message)))
}

/// `strftime_now(format)` over the time the caller passed, or a function that fails if there is none.
fn strftime_now(now: Option<DateTime>) -> Value {
    Value::from_function(move |format: &str| -> Result<String, Error> {
        let Some(now) = now else {
            return Err(Error::new(ErrorKind::InvalidOperation, TimeNotGiven.to_string()).with_source(TimeNotGiven));
        };
        now.strftime(format).map_err(|error| Error::new(ErrorKind::InvalidOperation, error.message))
    })
}

fn render_error(error: Error) -> ChatError {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&error);
    while let Some(current) = cause {
        if let Some(raised) = current.downcast_ref::<RaisedByTemplate>() {
            return ChatError::new(ChatErrorCode::TemplateRaised, raised.0.clone());
        }
        if current.downcast_ref::<TimeNotGiven>().is_some() {
            return ChatError::new(ChatErrorCode::TimeMissing, TimeNotGiven.to_string());
        }
        cause = current.source();
    }
    if error.kind() == ErrorKind::OutOfFuel {
        return over_budget(&error);
    }
    ChatError::new(ChatErrorCode::TemplateFailed, format!("the chat template failed: {error}"))
}

/// A render that ran out of its budget: the message names the limit and where the template was.
fn over_budget(error: &Error) -> ChatError {
    let detail = error.detail().map(|detail| format!(" ({detail})")).unwrap_or_default();
    let place = match (error.name(), error.line()) {
        (Some(name), Some(line)) => format!(" at {name}:{line}"),
        _ => String::new(),
    };
    ChatError::new(
        ChatErrorCode::TemplateFailed,
        format!(
            "the chat template exceeded the render budget of {RENDER_FUEL} fuel (one an instruction, one for every {} bytes it creates: at most {} MiB of data){detail}{place}",
            budget::BYTES_PER_FUEL,
            RENDER_DATA_BYTES >> 20
        ),
    )
}

/// What `apply_chat_template` does to the conversation before rendering: each message must be an object,
/// keys whose value is null are dropped (templates handle a missing key better than a None), and a
/// message's reasoning is aliased (see [`alias_reasoning`]).
///
/// Content parts: only `{"type": "text"}` parts are taken (nothing here reads an image). A template that
/// walks content parts itself gets them as they are; for any other template they are joined into one
/// string first, as vLLM does for its "string" content format.
fn normalize_messages(messages: &JsonValue, takes_content_parts: bool) -> Result<JsonValue, ChatError> {
    let JsonValue::Array(list) = messages else {
        return Err(ChatError::new(
            ChatErrorCode::InputInvalid,
            format!("messages must be a list of message objects, not {}", json_kind(messages)),
        ));
    };
    if list.is_empty() {
        return Err(ChatError::new(
            ChatErrorCode::InputInvalid,
            "cannot apply a chat template to an empty conversation",
        ));
    }
    let normalized = list
        .iter()
        .enumerate()
        .map(|(index, message)| {
            let JsonValue::Object(fields) = message else {
                return Err(ChatError::new(
                    ChatErrorCode::InputInvalid,
                    format!("message {index} must be an object, not {}", json_kind(message)),
                ));
            };
            let mut kept: Map<String, JsonValue> = fields
                .iter()
                .filter(|(_, value)| !value.is_null())
                .map(|(key, value)| (key.clone(), value.clone()))
                .collect();
            if let Some(JsonValue::Array(parts)) = kept.get("content") {
                let joined = join_text_parts(index, parts)?;
                if !takes_content_parts {
                    kept.insert("content".to_owned(), JsonValue::String(joined));
                }
            }
            Ok(JsonValue::Object(alias_reasoning(kept)))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(JsonValue::Array(normalized))
}

/// Whether a template iterates over a message's content (`{% for part in message['content'] %}`,
/// `message.content`), the test vLLM applies to tell the "openai" content format from the "string" one.
fn takes_content_parts(source: &str) -> bool {
    source.split("{%").skip(1).any(|block| {
        let statement = block.split("%}").next().unwrap_or_default().trim_matches(['-', '+', ' ', '\t', '\n', '\r']);
        let mut words = statement.split_whitespace();
        if words.next() != Some("for") {
            return false;
        }
        let iterable = words.skip_while(|word| *word != "in").nth(1).unwrap_or_default();
        let iterable = iterable.trim_start_matches('(').trim_end_matches(')');
        ["['content']", "[\"content\"]", ".content"].iter().any(|suffix| iterable.ends_with(suffix))
    })
}

/// OpenAI's content parts as the text templates take: the `text` of each `{"type": "text"}`
/// part, joined with newlines (as vLLM and llama.cpp's server join them). Templates would
/// otherwise print the list itself; a part of another type (an image) is refused, since nothing
/// here can read it.
fn join_text_parts(index: usize, parts: &[JsonValue]) -> Result<String, ChatError> {
    let mut texts = Vec::with_capacity(parts.len());
    for (part_index, part) in parts.iter().enumerate() {
        let refuse = |what: String| {
            ChatError::new(ChatErrorCode::InputInvalid, format!("message {index} content part {part_index} {what}"))
        };
        let JsonValue::Object(fields) = part else {
            return Err(refuse(format!(
                "must be an object {{\"type\": \"text\", \"text\": ...}}, not {}",
                json_kind(part)
            )));
        };
        match (fields.get("type"), fields.get("text")) {
            (Some(JsonValue::String(kind)), Some(JsonValue::String(text))) if kind == "text" => {
                texts.push(text.as_str())
            }
            (Some(JsonValue::String(kind)), _) if kind != "text" => {
                return Err(refuse(format!("has type {kind:?}: only \"text\" parts are supported")));
            }
            _ => return Err(refuse("must be {\"type\": \"text\", \"text\": <string>}".to_owned())),
        }
    }
    Ok(texts.join("\n"))
}

/// The names a message's reasoning comes under; the first one present is the reasoning.
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// transformers' `_alias_reasoning_fields`: a message with reasoning becomes
/// `{"thinking": reasoning, **message, "reasoning_content": reasoning}`, keys in that order, so that
/// templates reading either name see it.
fn alias_reasoning(message: Map<String, JsonValue>) -> Map<String, JsonValue> {
    let Some(reasoning) = REASONING_FIELDS.iter().find_map(|name| message.get(*name)).cloned() else {
        return message;
    };
    let mut aliased = Map::with_capacity(message.len() + 2);
    aliased.insert("thinking".to_owned(), reasoning.clone());
    aliased.extend(message);
    aliased.insert("reasoning_content".to_owned(), reasoning);
    aliased
}

/// `tools` and `documents` must be lists of objects when given; JSON null counts as not given.
fn list_of_objects<'a>(what: &str, value: Option<&'a JsonValue>) -> Result<Option<&'a JsonValue>, ChatError> {
    match value {
        None | Some(JsonValue::Null) => Ok(None),
        Some(JsonValue::Array(items)) => match items.iter().position(|item| !item.is_object()) {
            None => Ok(value),
            Some(index) => Err(ChatError::new(
                ChatErrorCode::InputInvalid,
                format!("{what}[{index}] must be an object (a JSON schema), not {}", json_kind(&items[index])),
            )),
        },
        Some(other) => Err(ChatError::new(
            ChatErrorCode::InputInvalid,
            format!("{what} must be a list of objects, not {}", json_kind(other)),
        )),
    }
}

fn json_kind(value: &JsonValue) -> &'static str {
    match value {
        JsonValue::Null => "null",
        JsonValue::Bool(_) => "a boolean",
        JsonValue::Number(_) => "a number",
        JsonValue::String(_) => "a string",
        JsonValue::Array(_) => "a list",
        JsonValue::Object(_) => "an object",
    }
}

/// Hugging Face's `{% generation %}...{% endgeneration %}` marks the assistant's text for training masks
/// and renders its body unchanged. minijinja has no such tag, so the tag names become `if true` and `endif`,
/// which keep the tags' whitespace control (`{%-`, `-%}`) and `trim_blocks` behaviour exactly. Only whole
/// tags are rewritten; the text `{% generation %}` inside a string literal would be too (no real template
/// has one).
fn rewrite_generation_blocks(source: &str) -> Cow<'_, str> {
    if !source.contains("generation") {
        return Cow::Borrowed(source);
    }
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else { break };
        let inner = &tag[2..end];
        let (open_control, body) = split_control_prefix(inner);
        let (body, close_control) = split_control_suffix(body);
        let replacement = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(name) => {
                out.push_str("{%");
                out.push_str(open_control);
                out.push(' ');
                out.push_str(name);
                out.push(' ');
                out.push_str(close_control);
                out.push_str("%}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    Cow::Owned(out)
}

fn split_control_prefix(inner: &str) -> (&str, &str) {
    match inner.as_bytes().first() {
        Some(b'-' | b'+') => inner.split_at(1),
        _ => ("", inner),
    }
}

fn split_control_suffix(inner: &str) -> (&str, &str) {
    match inner.as_bytes().last() {
        Some(b'-' | b'+') => inner.split_at(inner.len() - 1),
        _ => (inner, ""),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(source: &str, input: &RenderInput) -> Result<String, ChatError> {
        ChatTemplate::new(source, SpecialTokens::default())?.render(input)
    }

    fn user(content: &str) -> JsonValue {
        json!([{"role": "user", "content": content}])
    }

    #[test]
    fn text_content_parts_reach_the_template_joined() {
        let parts =
            json!([{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]);
        let text = render("{{ messages[0].content }}", &RenderInput::new(parts.clone())).unwrap();
        assert_eq!(text, "Hi\nthere");
        // A template that walks the parts itself gets them.
        let walking = "{% for m in messages %}{% for part in m['content'] %}[{{ part.text }}]{% endfor %}{% endfor %}";
        assert_eq!(render(walking, &RenderInput::new(parts)).unwrap(), "[Hi][there]");
    }

    #[test]
    fn templates_that_walk_content_parts_are_told_apart() {
        assert!(takes_content_parts("{%- for item in message['content'] -%}"));
        assert!(takes_content_parts("{% for part in message.content if part['type'] == 'text' %}"));
        assert!(takes_content_parts("{% for c in m[\"content\"] %}"));
        assert!(!takes_content_parts("{% for message in messages %}{{ message['content'] }}{% endfor %}"));
        assert!(!takes_content_parts("{{ 'in' }}{% if 'x' in message.content %}{% endif %}"));
    }

    #[test]
    fn other_content_parts_are_refused_by_name() {
        let image = json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]);
        let error = render("{{ messages[0].content }}", &RenderInput::new(image)).unwrap_err();
        assert_eq!(error.code, ChatErrorCode::InputInvalid);
        assert!(
            error.message.contains("\"image_url\"") && error.message.contains("only \"text\""),
            "{}",
            error.message
        );
        let bare = json!([{"role": "user", "content": ["Hi"]}]);
        let error = render("{{ messages[0].content }}", &RenderInput::new(bare)).unwrap_err();
        assert_eq!(error.code, ChatErrorCode::InputInvalid);
    }

    #[test]
    fn syntax_errors_fail_to_compile() {
        let error = ChatTemplate::new("{% for m in messages %}", SpecialTokens::default()).unwrap_err();
        assert_eq!(error.code, ChatErrorCode::TemplateInvalid);
        assert!(error.message.contains("does not parse"), "{}", error.message);
    }

    #[test]
    fn raise_exception_carries_the_templates_message() {
        let source = "{% if messages[0].role != 'system' %}{{ raise_exception('System first, please.') }}{% endif %}";
        let error = render(source, &RenderInput::new(user("hi"))).unwrap_err();
        assert_eq!(error, ChatError::new(ChatErrorCode::TemplateRaised, "System first, please."));
    }

    #[test]
    fn other_runtime_failures_are_template_failed() {
        let error = render("{{ messages[0].content.no_such_method() }}", &RenderInput::new(user("hi"))).unwrap_err();
        assert_eq!(error.code, ChatErrorCode::TemplateFailed);
        let error = render("{{ messages[0].content + 1 }}", &RenderInput::new(user("hi"))).unwrap_err();
        assert_eq!(error.code, ChatErrorCode::TemplateFailed);
    }

    #[test]
    fn runaway_templates_run_out_of_fuel() {
        let source = "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}";
        let error = render(source, &RenderInput::new(user("hi"))).unwrap_err();
        assert_eq!(error.code, ChatErrorCode::TemplateFailed);
        assert!(error.message.contains("fuel"), "{}", error.message);
    }

    #[test]
    fn strftime_now_formats_the_given_time_and_fails_without_one() {
        let source = "{{ strftime_now('%d %b %Y') }}";
        let mut input = RenderInput::new(user("hi"));
        assert_eq!(render(source, &input).unwrap_err().code, ChatErrorCode::TimeMissing);
        input.now = Some(DateTime::new(2024, 7, 26, 9, 0, 0).unwrap());
        assert_eq!(render(source, &input).unwrap(), "26 Jul 2024");
        assert_eq!(render("{{ strftime_now('%Q') }}", &input).unwrap_err().code, ChatErrorCode::TemplateFailed);
        // Templates that only check for it keep working without a time.
        assert_eq!(render("{{ strftime_now is defined }}", &RenderInput::new(user("hi"))).unwrap(), "True");
    }

    #[test]
    fn malformed_input_is_rejected_before_rendering() {
        let code = |input: RenderInput| render("{{ messages }}", &input).unwrap_err().code;
        assert_eq!(code(RenderInput::new(json!("hi"))), ChatErrorCode::InputInvalid);
        assert_eq!(code(RenderInput::new(json!([]))), ChatErrorCode::InputInvalid);
        assert_eq!(code(RenderInput::new(json!(["hi"]))), ChatErrorCode::InputInvalid);
        let mut input = RenderInput::new(user("hi"));
        input.tools = Some(json!({"name": "f"}));
        assert_eq!(code(input.clone()), ChatErrorCode::InputInvalid);
        input.tools = Some(json!(["f"]));
        assert_eq!(code(input.clone()), ChatErrorCode::InputInvalid);
        input.tools = None;
        input.extra.insert("messages".to_owned(), json!([]));
        assert_eq!(code(input), ChatErrorCode::InputInvalid);
    }

    #[test]
    fn tools_and_documents_are_none_when_absent() {
        let source = "{{ tools is defined }} {{ tools is none }} {{ documents }} {{ add_generation_prompt }}";
        assert_eq!(render(source, &RenderInput::new(user("hi"))).unwrap(), "True True None False");
        let mut input = RenderInput::new(user("hi"));
        input.tools = Some(json!([{"type": "function"}]));
        input.add_generation_prompt = true;
        assert_eq!(render(source, &input).unwrap(), "True False None True");
    }

    #[test]
    fn null_fields_are_dropped_and_reasoning_is_aliased() {
        let messages = json!([{"role": "assistant", "content": null, "reasoning": "why", "tool_calls": []}]);
        let out = render("{{ messages[0] }}", &RenderInput::new(messages)).unwrap();
        assert_eq!(out, "{'thinking': 'why', 'role': 'assistant', 'reasoning': 'why', 'tool_calls': [], 'reasoning_content': 'why'}");
    }

    #[test]
    fn extra_variables_shadow_special_tokens() {
        let tokens = SpecialTokens { bos: Some("<s>".to_owned()), ..SpecialTokens::default() };
        let template = ChatTemplate::new("{{ bos_token }}|{{ eos_token }}|{{ flag }}", tokens).unwrap();
        let mut input = RenderInput::new(user("hi"));
        assert_eq!(template.render(&input).unwrap(), "<s>||");
        input.extra.insert("bos_token".to_owned(), json!("<B>"));
        input.extra.insert("flag".to_owned(), json!(false));
        assert_eq!(template.render(&input).unwrap(), "<B>||False");
    }

    #[test]
    fn generation_blocks_render_their_body_with_the_same_whitespace() {
        assert_eq!(
            rewrite_generation_blocks("a{%- generation -%}b{% endgeneration %}"),
            "a{%- if true -%}b{% endif %}"
        );
        assert_eq!(rewrite_generation_blocks("{% if x %}{{ '%}' }}{% endif %}"), "{% if x %}{{ '%}' }}{% endif %}");
        let source =
            "{% for m in messages %}\n  {% generation %}\n{{ m.content }}\n  {% endgeneration %}\n{% endfor %}";
        assert_eq!(render(source, &RenderInput::new(user("hi"))).unwrap(), "hi\n");
    }
}
