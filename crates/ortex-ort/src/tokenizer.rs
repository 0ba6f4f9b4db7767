//! Text <-> token ids for real models: a [`TextCodec`] over the Hugging Face `tokenizers` crate,
//! reading the folder's `tokenizer.json` offline.

use std::path::Path;

use ortex_core::text::TextCodec;
use ortex_core::{ErrorCode, OrtexError, Result};
use tokenizers::Tokenizer;

pub struct TokenizerCodec {
    tokenizer: Tokenizer,
    /// The model's vocabulary (genai_config.json); ids at or past the tokenizer's own size but
    /// below this decode to nothing (builders pad the embedding past the tokenizer).
    vocab_size: u32,
}

impl TokenizerCodec {
    /// Loads `file` and checks it against the model's vocabulary: a tokenizer that can produce
    /// ids the model does not have is refused.
    pub fn load(file: &Path, vocab_size: u32) -> Result<TokenizerCodec> {
        let load_error =
            |reason: String| OrtexError::new(ErrorCode::ModelLoad, format!("{}: {reason}", file.display()));
        if !file.is_file() {
            return Err(load_error("the tokenizer file is missing".into()));
        }
        let tokenizer =
            Tokenizer::from_file(file).map_err(|e| load_error(format!("cannot read the tokenizer: {e}")))?;
        let size = tokenizer.get_vocab_size(true);
        if size > vocab_size as usize {
            return Err(load_error(format!(
                "the tokenizer has {size} tokens (added tokens included) but genai_config.json's model.vocab_size \
                 is {vocab_size}"
            )));
        }
        Ok(TokenizerCodec { tokenizer, vocab_size })
    }

    pub fn tokenizer_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }
}

impl TextCodec for TokenizerCodec {
    /// Encodes without adding special tokens (no BOS/EOS): the caller's text is the context.
    fn tokenize(&self, text: &str) -> Result<Vec<i32>> {
        let encoding = self
            .tokenizer
            .encode_fast(text, false)
            .map_err(|e| OrtexError::invalid(format!("cannot tokenize the text: {e}")))?;
        Ok(encoding.get_ids().iter().map(|&id| id as i32).collect())
    }

    /// Decodes, skipping special tokens (an EOS the model emitted is not text). An incomplete
    /// UTF-8 sequence at the end decodes to U+FFFD (the byte-level decoder is lossy), which the
    /// facade's streaming decoder holds back.
    fn detokenize(&self, tokens: &[i32]) -> Result<String> {
        let mut ids = Vec::with_capacity(tokens.len());
        for &t in tokens {
            if t < 0 || t as u32 >= self.vocab_size {
                return Err(OrtexError::invalid(format!("token {t} is outside the vocabulary of {}", self.vocab_size)));
            }
            ids.push(t as u32);
        }
        self.tokenizer.decode(&ids, true).map_err(|e| OrtexError::invalid(format!("cannot detokenize: {e}")))
    }
}
