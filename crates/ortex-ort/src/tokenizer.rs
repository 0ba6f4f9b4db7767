//! Text <-> token ids for real models: a [`TextCodec`] over the Hugging Face `tokenizers` crate,
//! reading the folder's `tokenizer.json` offline.

use std::ops::Range;
use std::path::Path;
use std::sync::OnceLock;

use ortex_core::text::TextCodec;
use ortex_core::{ErrorCode, OrtexError, Result};
use tokenizers::Tokenizer;

pub struct TokenizerCodec {
    tokenizer: Tokenizer,
    /// The same tokenizer with its special tokens encoded as the text they are, made the first
    /// time a prompt holds a control string that came from a caller's text.
    plain: OnceLock<Tokenizer>,
    /// The special added tokens' ids and strings, by id.
    controls: Vec<(u32, String)>,
    /// The model's vocabulary (genai_config.json); ids at or past the tokenizer's own size but
    /// below this decode to nothing (builders pad the embedding past the tokenizer).
    vocab_size: u32,
    /// The tokenizer.json the codec was read from: constraints read its token bytes from it.
    file: std::path::PathBuf,
    /// The special tokens the tokenizer's post-processor puts before a text (a BOS where the
    /// model wants one: Gemma, Llama), which a prompt that starts a context gets.
    prompt_prefix: Vec<i32>,
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
        let mut controls: Vec<(u32, String)> = tokenizer
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, token)| token.special)
            .map(|(id, token)| (id, token.content))
            .collect();
        controls.sort();
        let prompt_prefix = prompt_prefix(&tokenizer).map_err(|e| load_error(e.to_string()))?;
        Ok(TokenizerCodec { tokenizer, plain: OnceLock::new(), controls, vocab_size, file: file.to_path_buf(), prompt_prefix })
    }

    fn encode(tokenizer: &Tokenizer, text: &str) -> Result<tokenizers::Encoding> {
        tokenizer.encode_fast(text, false).map_err(tokenize_error)
    }

    /// `encode` with the tokens' byte offsets (`encode_fast` leaves them out).
    fn encode_with_offsets(tokenizer: &Tokenizer, text: &str) -> Result<tokenizers::Encoding> {
        tokenizer.encode(text, false).map_err(tokenize_error)
    }

    fn plain(&self) -> &Tokenizer {
        self.plain.get_or_init(|| {
            let mut plain = self.tokenizer.clone();
            plain.set_encode_special_tokens(true);
            plain
        })
    }

    fn is_control(&self, id: u32) -> bool {
        self.controls.binary_search_by_key(&id, |(control, _)| *control).is_ok()
    }

    pub fn tokenizer_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }
}

/// What the post-processor adds before a text: a sample encoded with and without the special
/// tokens, the ids before the plain ones (any it adds after, an EOS, are not a prompt's).
fn prompt_prefix(tokenizer: &Tokenizer) -> Result<Vec<i32>> {
    const SAMPLE: &str = "a";
    let plain = tokenizer.encode_fast(SAMPLE, false).map_err(tokenize_error)?;
    let with = tokenizer.encode_fast(SAMPLE, true).map_err(tokenize_error)?;
    let (plain, with) = (plain.get_ids(), with.get_ids());
    let at = (0..=with.len().saturating_sub(plain.len())).find(|&i| with[i..].starts_with(plain)).unwrap_or(0);
    Ok(with[..at].iter().map(|&id| id as i32).collect())
}

fn tokenize_error(error: tokenizers::Error) -> OrtexError {
    OrtexError::invalid(format!("cannot tokenize the text: {error}"))
}

impl TextCodec for TokenizerCodec {
    /// Read again from the file (once per engine, at its first constrained turn): the tokenizer
    /// crate keeps no per-token bytes, and a byte-level vocabulary's strings need llguidance's
    /// mapping back to bytes.
    fn token_bytes(&self) -> Result<Vec<Vec<u8>>> {
        let json = std::fs::read_to_string(&self.file)
            .map_err(|e| OrtexError::invalid(format!("{}: cannot read the tokenizer: {e}", self.file.display())))?;
        ortex_core::constraint::token_bytes_from_tokenizer_json(&json)
    }

    /// Encodes without adding special tokens (no BOS/EOS): the caller's text is the context.
    fn tokenize(&self, text: &str) -> Result<Vec<i32>> {
        let encoding = Self::encode(&self.tokenizer, text)?;
        Ok(encoding.get_ids().iter().map(|&id| id as i32).collect())
    }

    fn prompt_prefix(&self) -> &[i32] {
        &self.prompt_prefix
    }

    fn control_strings(&self) -> Vec<String> {
        self.controls.iter().map(|(_, text)| text.clone()).collect()
    }

    /// Encodes as `tokenize` does, so a prompt without such spans gets exactly the tokens it
    /// always got. Otherwise the control tokens the template wrote split the text into stretches
    /// (as the tokenizer itself splits at control tokens), and each stretch that holds a literal
    /// span is encoded again as plain text, whole.
    fn tokenize_rendered(&self, text: &str, literals: &[Range<usize>]) -> Result<Vec<i32>> {
        if literals.is_empty() {
            return self.tokenize(text);
        }
        let encoding = Self::encode_with_offsets(&self.tokenizer, text)?;
        let tokens: Vec<(u32, (usize, usize))> =
            encoding.get_ids().iter().copied().zip(encoding.get_offsets().iter().copied()).collect();
        let forged = |&(id, (start, end)): &(u32, (usize, usize))| {
            self.is_control(id) && literals.iter().any(|span| span.start < end && start < span.end)
        };
        let mut ids = Vec::with_capacity(tokens.len());
        // Each stretch ends at a control token the template wrote (or at the end of the text).
        let (mut stretch_byte, mut stretch_token) = (0, 0);
        for index in 0..=tokens.len() {
            let boundary = tokens.get(index).filter(|token| self.is_control(token.0) && !forged(token));
            if index < tokens.len() && boundary.is_none() {
                continue;
            }
            let stretch = &tokens[stretch_token..index];
            if stretch.iter().any(forged) {
                let until_byte = boundary.map_or(text.len(), |&(_, (start, _))| start);
                let plain = Self::encode(self.plain(), &text[stretch_byte..until_byte])?;
                ids.extend(plain.get_ids().iter().map(|&id| id as i32));
            } else {
                ids.extend(stretch.iter().map(|&(id, _)| id as i32));
            }
            if let Some(&(id, (_, end))) = boundary {
                ids.push(id as i32);
                (stretch_byte, stretch_token) = (end, index + 1);
            }
        }
        Ok(ids)
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
