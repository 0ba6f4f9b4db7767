//! Tokenizing a long prompt on the libuv thread pool: a megabyte of text costs a real tokenizer
//! about 400 ms, which on the JS thread would hold every other request of a server. The task
//! shares the engine's codec (`Engine::text_codec`), not the engine, so the engine goes on
//! meanwhile.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use napi::bindgen_prelude::{Env, Int32Array, Task};
use ortex_boundary as ops;
use ortex_core::text::TextCodec;
use ortex_core::{ErrorCode, OrtexError};

use crate::coded_js;

pub struct TokenizeTask {
    pub(crate) codec: Arc<dyn TextCodec>,
    pub(crate) text: String,
    /// A prompt from `CoreChat.renderMarked` (its marked control strings stay text) or plain text.
    pub(crate) marked: bool,
}

impl Task for TokenizeTask {
    type Output = ortex_core::Result<Vec<i32>>;
    type JsValue = Int32Array;

    /// On the libuv thread pool.
    fn compute(&mut self) -> napi::Result<Self::Output> {
        let text = std::mem::take(&mut self.text);
        let codec = self.codec.as_ref();
        let tokenize = || if self.marked { ops::tokenize_marked_with(codec, &text) } else { codec.tokenize(&text) };
        Ok(catch_unwind(AssertUnwindSafe(tokenize)).unwrap_or_else(|payload| {
            Err(OrtexError::new(
                ErrorCode::InvalidArgument,
                format!("the tokenizer panicked: {}", ops::panic_message(payload.as_ref())),
            ))
        }))
    }

    /// On the JS thread: the ids, or the error with its code.
    fn resolve(&mut self, env: Env, output: Self::Output) -> napi::Result<Int32Array> {
        output.map(Int32Array::new).map_err(|error| coded_js(&env, error))
    }
}
