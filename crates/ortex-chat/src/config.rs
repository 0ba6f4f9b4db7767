//! What a model folder says about chat: its templates, its special tokens, and the strings that end a turn.
//!
//! The caller reads the files; this module only parses their text, so it runs the same on every target.
//!
//! Where the template comes from, as Hugging Face's `from_pretrained` and onnxruntime-genai read a folder:
//! `chat_template.jinja` when the folder has one (it then replaces any template in tokenizer_config.json),
//! else `chat_template` in `tokenizer_config.json`, a string or a list of `{name, template}` (then the one
//! named `default` is the default and `tool_use` the one for calls with tools).
//!
//! The strings that end a generation ([`ChatConfig::stop_strings`]):
//! 1. `eos_token` from tokenizer_config.json;
//! 2. the `eos_token_id`s of generation_config.json and of genai_config.json (`model.eos_token_id`), each
//!    an id or a list, turned into text through tokenizer_config.json's `added_tokens_decoder` (ids it
//!    lacks are skipped: there is no vocabulary here). These lists are what Hugging Face's `generate` and
//!    onnxruntime-genai stop on, so when either file names ids, nothing is guessed;
//! 3. only when neither file names any: the end-of-turn markers of [`END_OF_TURN_MARKERS`] that the
//!    template itself writes and that `added_tokens_decoder` (when present) lists as special tokens. This
//!    catches Llama 3 folders whose `eos_token` is `<|end_of_text|>` while turns end with `<|eot_id|>`.
//!
//! The order is that of the rules, without repeats.

use std::collections::BTreeMap;

use serde_json::{Map, Value as JsonValue};

use crate::chatml::CHATML_TEMPLATE;
use crate::error::{ChatError, ChatErrorCode};
use crate::template::{ChatTemplate, SpecialTokens};

/// Turn-ending special tokens that templates write after a message: ChatML's, Llama 3's (end of turn,
/// end of a tool-calling message), Gemma's, Phi-3's and gpt-oss's.
pub const END_OF_TURN_MARKERS: [&str; 6] =
    ["<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|return|>"];

/// The text of the files of a model folder that matter for chat; `None` where the folder lacks the file.
#[derive(Debug, Clone, Copy, Default)]
pub struct ModelFiles<'a> {
    /// `chat_template.jinja`.
    pub chat_template_jinja: Option<&'a str>,
    /// `tokenizer_config.json`.
    pub tokenizer_config_json: Option<&'a str>,
    /// `generation_config.json` (Hugging Face), for its `eos_token_id`.
    pub generation_config_json: Option<&'a str>,
    /// `genai_config.json` (onnxruntime-genai), for its `model.eos_token_id`.
    pub genai_config_json: Option<&'a str>,
}

/// A model folder's chat setup: its templates by name (`default` for a single one), its special tokens
/// and its stop strings. A folder without a template loads; asking it for a template fails with
/// [`ChatErrorCode::TemplateMissing`].
#[derive(Debug, Clone)]
pub struct ChatConfig {
    templates: BTreeMap<String, ChatTemplate>,
    special_tokens: SpecialTokens,
    stop_strings: Vec<String>,
    /// What was looked at, for the missing-template error.
    searched: String,
}

impl ChatConfig {
    /// Parses the files and compiles every template; fails on JSON that does not parse or a field of the
    /// wrong type ([`ChatErrorCode::ConfigInvalid`]) and on a template that does not parse
    /// ([`ChatErrorCode::TemplateInvalid`]).
    pub fn load(files: &ModelFiles<'_>) -> Result<ChatConfig, ChatError> {
        let tokenizer_config = match files.tokenizer_config_json {
            Some(text) => parse_object("tokenizer_config.json", text)?,
            None => Map::new(),
        };
        let special_tokens = special_tokens(&tokenizer_config)?;
        let added_tokens = added_tokens(&tokenizer_config)?;

        let sources = match files.chat_template_jinja {
            Some(text) => vec![("default".to_owned(), text.to_owned())],
            None => template_sources(&tokenizer_config)?,
        };
        let mut templates = BTreeMap::new();
        for (name, source) in sources {
            let template = ChatTemplate::new(source, special_tokens.clone())
                .map_err(|error| ChatError::new(error.code, format!("template `{name}`: {}", error.message)))?;
            templates.insert(name, template);
        }

        let mut eos_ids = Vec::new();
        if let Some(text) = files.generation_config_json {
            let config = parse_object("generation_config.json", text)?;
            eos_ids.extend(token_ids("generation_config.json eos_token_id", config.get("eos_token_id"))?);
        }
        if let Some(text) = files.genai_config_json {
            let config = parse_object("genai_config.json", text)?;
            let model = config.get("model").and_then(JsonValue::as_object);
            eos_ids
                .extend(token_ids("genai_config.json model.eos_token_id", model.and_then(|m| m.get("eos_token_id")))?);
        }
        let has_eos_ids = !eos_ids.is_empty();
        let mut stop_strings = Vec::new();
        push_unique(&mut stop_strings, special_tokens.eos.iter().cloned());
        push_unique(
            &mut stop_strings,
            eos_ids.iter().filter_map(|id| added_tokens.get(id).map(|token| token.content.clone())),
        );
        if !has_eos_ids {
            let sources: Vec<&str> = templates.values().map(ChatTemplate::source).collect();
            push_unique(&mut stop_strings, turn_markers(&sources, files.tokenizer_config_json.map(|_| &added_tokens)));
        }

        let searched = match (files.chat_template_jinja, files.tokenizer_config_json) {
            (None, Some(_)) => "no chat_template.jinja, and tokenizer_config.json has no chat_template".to_owned(),
            _ => "no chat_template.jinja, and no tokenizer_config.json".to_owned(),
        };
        Ok(ChatConfig { templates, special_tokens, stop_strings, searched })
    }

    /// The built-in ChatML template ([`CHATML_TEMPLATE`]) as a folder would give it: no `bos_token`,
    /// `eos_token` `<|im_end|>`, which is also its one stop string.
    pub fn chatml() -> ChatConfig {
        let special_tokens = SpecialTokens { eos: Some("<|im_end|>".to_owned()), ..SpecialTokens::default() };
        let template =
            ChatTemplate::new(CHATML_TEMPLATE, special_tokens.clone()).expect("the built-in ChatML template parses");
        ChatConfig {
            templates: BTreeMap::from([("default".to_owned(), template)]),
            special_tokens,
            stop_strings: vec!["<|im_end|>".to_owned()],
            searched: String::new(),
        }
    }

    /// The template a chat call uses, chosen as Hugging Face's `get_chat_template` does: the one named
    /// `name` when given; else `tool_use` for a call with tools when there is one; else `default`.
    pub fn template(&self, name: Option<&str>, with_tools: bool) -> Result<&ChatTemplate, ChatError> {
        if self.templates.is_empty() {
            return Err(ChatError::new(
                ChatErrorCode::TemplateMissing,
                format!("the model has no chat template ({}); pass a template to use chat", self.searched),
            ));
        }
        let chosen = match name {
            Some(name) => name,
            None if with_tools && self.templates.contains_key("tool_use") => "tool_use",
            None => "default",
        };
        self.templates.get(chosen).ok_or_else(|| {
            let names: Vec<&str> = self.templates.keys().map(String::as_str).collect();
            ChatError::new(
                ChatErrorCode::TemplateMissing,
                format!("the model has no chat template named `{chosen}`; it has {}", names.join(", ")),
            )
        })
    }

    /// The names of the templates, in order.
    pub fn template_names(&self) -> impl Iterator<Item = &str> {
        self.templates.keys().map(String::as_str)
    }

    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.special_tokens
    }

    /// The strings whose generation ends a turn (see the module documentation for where they come from).
    pub fn stop_strings(&self) -> &[String] {
        &self.stop_strings
    }
}

impl ChatTemplate {
    /// The default template of a tokenizer_config.json (for a call without tools), with its special
    /// tokens. Fails with [`ChatErrorCode::TemplateMissing`] when it has none.
    pub fn from_tokenizer_config(json: &str) -> Result<ChatTemplate, ChatError> {
        let files = ModelFiles { tokenizer_config_json: Some(json), ..ModelFiles::default() };
        ChatConfig::load(&files)?.template(None, false).cloned()
    }
}

fn parse_object(file: &str, text: &str) -> Result<Map<String, JsonValue>, ChatError> {
    match serde_json::from_str::<JsonValue>(text) {
        Ok(JsonValue::Object(map)) => Ok(map),
        Ok(_) => Err(config_invalid(format!("{file} must hold a JSON object"))),
        Err(error) => Err(config_invalid(format!("{file} is not valid JSON: {error}"))),
    }
}

fn config_invalid(message: String) -> ChatError {
    ChatError::new(ChatErrorCode::ConfigInvalid, message)
}

/// `chat_template`: absent or null, a string, or a list of `{"name": ..., "template": ...}`.
fn template_sources(config: &Map<String, JsonValue>) -> Result<Vec<(String, String)>, ChatError> {
    match config.get("chat_template") {
        None | Some(JsonValue::Null) => Ok(Vec::new()),
        Some(JsonValue::String(source)) => Ok(vec![("default".to_owned(), source.clone())]),
        Some(JsonValue::Array(entries)) => entries
            .iter()
            .enumerate()
            .map(|(index, entry)| {
                let name = entry.get("name").and_then(JsonValue::as_str);
                let template = entry.get("template").and_then(JsonValue::as_str);
                match (name, template) {
                    (Some(name), Some(template)) => Ok((name.to_owned(), template.to_owned())),
                    _ => Err(config_invalid(format!(
                        "tokenizer_config.json chat_template[{index}] must be an object with string fields name and template"
                    ))),
                }
            })
            .collect(),
        Some(_) => Err(config_invalid("tokenizer_config.json chat_template must be a string or a list of {name, template}".to_owned())),
    }
}

/// The named special tokens Hugging Face passes to templates (`special_tokens_map`): bos, eos, unk, sep,
/// pad, cls and mask, each a string or an AddedToken object `{"content": ...}`, plus the model's own named
/// ones given as an object under `extra_special_tokens` (transformers 5). Tokenizer classes that add
/// tokens in code (Gemma's `mask_token`) are beyond a config reader.
fn special_tokens(config: &Map<String, JsonValue>) -> Result<SpecialTokens, ChatError> {
    const NAMED: [&str; 7] =
        ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"];
    let mut tokens = SpecialTokens::default();
    for name in NAMED {
        let Some(content) = token_content(name, config.get(name))? else { continue };
        match name {
            "bos_token" => tokens.bos = Some(content),
            "eos_token" => tokens.eos = Some(content),
            _ => {
                tokens.other.insert(name.to_owned(), content);
            }
        }
    }
    if let Some(JsonValue::Object(extra)) = config.get("extra_special_tokens") {
        for (name, token) in extra {
            if NAMED.contains(&name.as_str()) {
                continue;
            }
            if let Some(content) = token_content(name, Some(token))? {
                tokens.other.insert(name.clone(), content);
            }
        }
    }
    Ok(tokens)
}

fn token_content(name: &str, value: Option<&JsonValue>) -> Result<Option<String>, ChatError> {
    match value {
        None | Some(JsonValue::Null) => Ok(None),
        Some(JsonValue::String(content)) => Ok(Some(content.clone())),
        Some(JsonValue::Object(fields)) => match fields.get("content") {
            Some(JsonValue::String(content)) => Ok(Some(content.clone())),
            _ => Err(config_invalid(format!("tokenizer_config.json {name} is an object without a string content"))),
        },
        Some(_) => {
            Err(config_invalid(format!("tokenizer_config.json {name} must be a string or an AddedToken object")))
        }
    }
}

#[derive(Debug)]
struct AddedToken {
    content: String,
    special: bool,
}

/// `added_tokens_decoder`: `{"<id>": {"content": ..., "special": ...}}`.
fn added_tokens(config: &Map<String, JsonValue>) -> Result<BTreeMap<u64, AddedToken>, ChatError> {
    let mut tokens = BTreeMap::new();
    let Some(decoder) = config.get("added_tokens_decoder") else { return Ok(tokens) };
    let Some(decoder) = decoder.as_object() else {
        return Err(config_invalid("tokenizer_config.json added_tokens_decoder must be an object".to_owned()));
    };
    for (id, token) in decoder {
        let parsed_id = id.parse::<u64>().ok();
        let content = token.get("content").and_then(JsonValue::as_str);
        let (Some(parsed_id), Some(content)) = (parsed_id, content) else {
            return Err(config_invalid(format!(
                "tokenizer_config.json added_tokens_decoder[{id:?}] must map an id to an object with a content"
            )));
        };
        let special = token.get("special").and_then(JsonValue::as_bool).unwrap_or(false);
        tokens.insert(parsed_id, AddedToken { content: content.to_owned(), special });
    }
    Ok(tokens)
}

/// An `eos_token_id`: absent, null, an id or a list of ids.
fn token_ids(what: &str, value: Option<&JsonValue>) -> Result<Vec<u64>, ChatError> {
    let invalid = || config_invalid(format!("{what} must be a token id or a list of them"));
    match value {
        None | Some(JsonValue::Null) => Ok(Vec::new()),
        Some(JsonValue::Number(id)) => id.as_u64().map(|id| vec![id]).ok_or_else(invalid),
        Some(JsonValue::Array(ids)) => ids.iter().map(|id| id.as_u64().ok_or_else(invalid)).collect(),
        Some(_) => Err(invalid()),
    }
}

/// The markers of [`END_OF_TURN_MARKERS`] that one of the templates writes and, when the folder has a
/// tokenizer_config.json, that it lists as a special token (a marker that is plain text to the tokenizer
/// would never come out as one token).
fn turn_markers<'a>(
    sources: &'a [&str],
    added_tokens: Option<&'a BTreeMap<u64, AddedToken>>,
) -> impl Iterator<Item = String> + 'a {
    END_OF_TURN_MARKERS
        .iter()
        .filter(move |marker| sources.iter().any(|source| source.contains(**marker)))
        .filter(move |marker| match added_tokens {
            None => true,
            Some(tokens) => tokens.values().any(|token| token.special && token.content == **marker),
        })
        .map(|marker| (*marker).to_owned())
}

fn push_unique(list: &mut Vec<String>, items: impl IntoIterator<Item = String>) {
    for item in items {
        if !list.contains(&item) {
            list.push(item);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::template::RenderInput;
    use serde_json::json;

    fn tokenizer_config(template: JsonValue) -> String {
        json!({
            "bos_token": {"__type": "AddedToken", "content": "<|begin_of_text|>", "special": true},
            "eos_token": "<|end_of_text|>",
            "pad_token": null,
            "extra_special_tokens": {"boi_token": "<start_of_image>"},
            "added_tokens_decoder": {
                "128000": {"content": "<|begin_of_text|>", "special": true},
                "128001": {"content": "<|end_of_text|>", "special": true},
                "128009": {"content": "<|eot_id|>", "special": true},
                "128010": {"content": "<|im_end|>", "special": false}
            },
            "chat_template": template
        })
        .to_string()
    }

    const LLAMA_LIKE: &str = "{{ bos_token }}{% for m in messages %}{{ m.content }}<|eot_id|><|im_end|>{% endfor %}";

    #[test]
    fn reads_a_string_template_with_added_token_objects() {
        let config = ChatConfig::load(&ModelFiles {
            tokenizer_config_json: Some(&tokenizer_config(json!(LLAMA_LIKE))),
            ..ModelFiles::default()
        })
        .unwrap();
        let tokens = config.special_tokens();
        assert_eq!(tokens.bos.as_deref(), Some("<|begin_of_text|>"));
        assert_eq!(tokens.eos.as_deref(), Some("<|end_of_text|>"));
        assert_eq!(tokens.other, BTreeMap::from([("boi_token".to_owned(), "<start_of_image>".to_owned())]));
        assert_eq!(config.template_names().collect::<Vec<_>>(), ["default"]);
        let text =
            config.template(None, false).unwrap().render(&RenderInput::new(json!([{"role": "user", "content": "hi"}])));
        assert_eq!(text.unwrap(), "<|begin_of_text|>hi<|eot_id|><|im_end|>");
        // <|eot_id|> is written by the template and special; <|im_end|> is written but not special.
        assert_eq!(config.stop_strings(), ["<|end_of_text|>", "<|eot_id|>"]);
    }

    #[test]
    fn generation_config_ids_replace_the_guess() {
        let files = |generation: Option<&'static str>, genai: Option<&'static str>, config: &'static str| ModelFiles {
            tokenizer_config_json: Some(config),
            generation_config_json: generation,
            genai_config_json: genai,
            ..ModelFiles::default()
        };
        let config_text: &'static str = Box::leak(tokenizer_config(json!(LLAMA_LIKE)).into_boxed_str());
        let from_generation =
            ChatConfig::load(&files(Some(r#"{"eos_token_id": [128001, 128000, 5]}"#), None, config_text)).unwrap();
        assert_eq!(from_generation.stop_strings(), ["<|end_of_text|>", "<|begin_of_text|>"]);
        let from_genai =
            ChatConfig::load(&files(None, Some(r#"{"model": {"eos_token_id": 128009}}"#), config_text)).unwrap();
        assert_eq!(from_genai.stop_strings(), ["<|end_of_text|>", "<|eot_id|>"]);
    }

    #[test]
    fn reads_named_templates_and_chooses_like_hugging_face() {
        let text = tokenizer_config(json!([
            {"name": "default", "template": "D{{ tools is none }}"},
            {"name": "tool_use", "template": "T"},
            {"name": "rag", "template": "R"},
        ]));
        let config =
            ChatConfig::load(&ModelFiles { tokenizer_config_json: Some(&text), ..ModelFiles::default() }).unwrap();
        assert_eq!(config.template_names().collect::<Vec<_>>(), ["default", "rag", "tool_use"]);
        let source = |name, tools| config.template(name, tools).unwrap().source().to_owned();
        assert_eq!(source(None, false), "D{{ tools is none }}");
        assert_eq!(source(None, true), "T");
        assert_eq!(source(Some("rag"), true), "R");
        let error = config.template(Some("nope"), false).unwrap_err();
        assert_eq!(error.code, ChatErrorCode::TemplateMissing);
        assert!(error.message.contains("default, rag, tool_use"), "{}", error.message);
    }

    #[test]
    fn chat_template_jinja_wins_over_tokenizer_config() {
        let text = tokenizer_config(json!("from config"));
        let files = ModelFiles {
            chat_template_jinja: Some("from jinja"),
            tokenizer_config_json: Some(&text),
            ..ModelFiles::default()
        };
        let config = ChatConfig::load(&files).unwrap();
        assert_eq!(config.template(None, false).unwrap().source(), "from jinja");
        assert_eq!(config.special_tokens().eos.as_deref(), Some("<|end_of_text|>"));
    }

    #[test]
    fn a_folder_without_a_template_loads_and_fails_chat_naming_what_is_missing() {
        let files = ModelFiles { tokenizer_config_json: Some(r#"{"eos_token": "</s>"}"#), ..ModelFiles::default() };
        let config = ChatConfig::load(&files).unwrap();
        assert_eq!(config.stop_strings(), ["</s>"]);
        let error = config.template(None, false).unwrap_err();
        assert_eq!(error.code, ChatErrorCode::TemplateMissing);
        assert!(
            error.message.contains("chat_template.jinja")
                && error.message.contains("tokenizer_config.json has no chat_template"),
            "{}",
            error.message
        );

        let error = ChatConfig::load(&ModelFiles::default()).unwrap().template(None, false).unwrap_err();
        assert!(error.message.contains("no tokenizer_config.json"), "{}", error.message);
        let error = ChatTemplate::from_tokenizer_config("{}").unwrap_err();
        assert_eq!(error.code, ChatErrorCode::TemplateMissing);
    }

    #[test]
    fn malformed_files_are_config_errors() {
        let load =
            |text: &str| ChatConfig::load(&ModelFiles { tokenizer_config_json: Some(text), ..ModelFiles::default() });
        for text in [
            "not json",
            "[1]",
            r#"{"chat_template": 3}"#,
            r#"{"chat_template": [{"name": "x"}]}"#,
            r#"{"eos_token": 1}"#,
            r#"{"added_tokens_decoder": {"x": {}}}"#,
        ] {
            assert_eq!(load(text).unwrap_err().code, ChatErrorCode::ConfigInvalid, "{text}");
        }
        let files = ModelFiles { generation_config_json: Some(r#"{"eos_token_id": "2"}"#), ..ModelFiles::default() };
        assert_eq!(ChatConfig::load(&files).unwrap_err().code, ChatErrorCode::ConfigInvalid);
        let error = load(r#"{"chat_template": "{% if %}"}"#).unwrap_err();
        assert_eq!(error.code, ChatErrorCode::TemplateInvalid);
        assert!(error.message.starts_with("template `default`"), "{}", error.message);
    }
}
