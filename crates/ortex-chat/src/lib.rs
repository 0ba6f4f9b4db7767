//! Chat templates for ortex: the Jinja templates that Hugging Face model folders carry, rendered as
//! Hugging Face's `tokenizer.apply_chat_template(..., tokenize=False)` renders them.
//!
//! Pure and deterministic: no I/O (the caller reads the files and passes their text), no clock (the time
//! `strftime_now` prints is part of the input), the same output on native and WebAssembly.
//!
//! - [`ChatTemplate`] is one compiled template; [`ChatTemplate::render`] turns a [`RenderInput`] into text.
//! - [`ChatError`] carries a stable [`ChatErrorCode`].

mod error;
mod python;
mod strftime;
mod template;

pub use error::{ChatError, ChatErrorCode};
pub use strftime::DateTime;
pub use template::{ChatTemplate, RenderInput, SpecialTokens};
