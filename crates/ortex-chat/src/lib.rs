//! Chat templates for ortex: the Jinja templates that Hugging Face model folders carry, rendered as
//! Hugging Face's `tokenizer.apply_chat_template(..., tokenize=False)` renders them.
//!
//! Pure and deterministic: no I/O (the caller reads the files and passes their text), no clock (the time
//! `strftime_now` prints is part of the input), the same output on native and WebAssembly.
//!
//! ```
//! use ortex_chat::{ChatTemplate, RenderInput};
//! use serde_json::json;
//!
//! let mut input = RenderInput::new(json!([{"role": "user", "content": "Hi!"}]));
//! input.add_generation_prompt = true;
//! let text = ChatTemplate::chatml().render(&input).unwrap();
//! assert_eq!(text, "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n");
//! ```
//!
//! - [`ChatConfig::load`] reads a model folder's files ([`ModelFiles`]): its templates, special tokens and
//!   the strings that end a turn.
//! - [`ChatTemplate`] is one compiled template; [`ChatTemplate::render`] turns a [`RenderInput`] into text.
//! - [`CHATML_TEMPLATE`] is the built-in template of models without one and of the simulated engine.
//! - [`ChatError`] carries a stable [`ChatErrorCode`].
//! - A render is bounded: at most [`RENDER_FUEL`] fuel, so at most [`RENDER_DATA_BYTES`] of data (budget.rs);
//!   past it, it fails with [`ChatErrorCode::TemplateFailed`].

mod budget;
mod builtins;
mod chatml;
mod config;
mod error;
mod python;
mod strftime;
mod template;

pub use budget::{RENDER_DATA_BYTES, RENDER_FUEL};
pub use chatml::CHATML_TEMPLATE;
pub use config::{ChatConfig, ModelFiles, END_OF_TURN_MARKERS};
pub use error::{ChatError, ChatErrorCode};
pub use strftime::DateTime;
pub use template::{ChatTemplate, RenderInput, SpecialTokens};
