//! Text <-> token ids. Real models use their tokenizer.json (ortex-ort); the simulated model uses
//! [`SimText`]: bytes are tokens `3 + byte`, and every id past the bytes reads as a made-up
//! syllable pair, so generated text is readable in demos and multi-byte characters really do span
//! tokens.

use std::ops::Range;

use crate::error::{OrtexError, Result};

/// Sync: a binding may tokenize off the engine's thread through a shared handle
/// (`Engine::text_codec`).
pub trait TextCodec: Send + Sync {
    /// Encodes text; the codec's control strings in it become control tokens.
    fn tokenize(&self, text: &str) -> Result<Vec<i32>>;
    /// Decodes ids to text; an incomplete UTF-8 sequence at the end decodes to U+FFFD, which a
    /// streaming caller holds back until the next token completes it.
    fn detokenize(&self, tokens: &[i32]) -> Result<String>;

    /// Appends what `detokenize` returns to `out`. The streaming detokenizer (output.rs) decodes
    /// twice per generated token into buffers it reuses; a codec that can write into them
    /// without a new string each time does so here.
    fn detokenize_into(&self, tokens: &[i32], out: &mut String) -> Result<()> {
        out.push_str(&self.detokenize(tokens)?);
        Ok(())
    }

    /// The tokens a text that starts a context gets before its own: the BOS a tokenizer's
    /// post-processor adds (Hugging Face's `add_special_tokens`), none where it adds none.
    fn prompt_prefix(&self) -> &[i32] {
        &[]
    }

    /// Encodes a text that starts a context: [`TextCodec::prompt_prefix`], then `tokenize`.
    fn tokenize_prompt(&self, text: &str) -> Result<Vec<i32>> {
        let mut tokens = self.prompt_prefix().to_vec();
        tokens.extend(self.tokenize(text)?);
        Ok(tokens)
    }

    /// The strings `tokenize` turns into control tokens wherever they occur (a tokenizer's
    /// special added tokens), in a fixed order; none where the codec has none.
    fn control_strings(&self) -> Vec<String> {
        Vec::new()
    }

    /// Encodes a rendered prompt in which the byte ranges `literals` hold control strings that
    /// came from a caller's text (a chat message): those encode as plain text, never as control
    /// tokens. Everything else encodes as `tokenize` would.
    fn tokenize_rendered(&self, text: &str, literals: &[Range<usize>]) -> Result<Vec<i32>> {
        debug_assert!(literals.is_empty() || !self.control_strings().is_empty());
        self.tokenize(text)
    }

    /// Every token's bytes, by id, for compiling constraints (constraint.rs): a control token's
    /// start with the byte 0xFF (llguidance's marker, never valid UTF-8), so that grammar text
    /// never matches it. A codec that cannot tell refuses, and so do constraints on its model.
    fn token_bytes(&self) -> Result<Vec<Vec<u8>>> {
        Err(OrtexError::invalid("this model's tokenizer gives no token bytes, so it takes no constraint"))
    }
}

/// What a closed engine keeps instead of its codec (a real model's tokenizer is megabytes): the
/// engine refuses text calls once closed, so this is never asked.
pub struct ClosedCodec;

impl TextCodec for ClosedCodec {
    fn tokenize(&self, _text: &str) -> Result<Vec<i32>> {
        Err(OrtexError::new(crate::error::ErrorCode::EngineClosed, "the engine is closed"))
    }

    fn detokenize(&self, _tokens: &[i32]) -> Result<String> {
        Err(OrtexError::new(crate::error::ErrorCode::EngineClosed, "the engine is closed"))
    }
}

/// The simulated model's text codec.
#[derive(Debug, Clone)]
pub struct SimText {
    pub vocab_size: u32,
}

/// Ids 0, 1 and 2 are pad, bos and eos; bytes follow.
pub const SIM_BYTE_OFFSET: u32 = 3;
const SIM_FIRST_WORD: u32 = SIM_BYTE_OFFSET + 256;
const CONSONANTS: &[u8; 16] = b"bdfgklmnprstvzhj";
const VOWELS: &[u8; 5] = b"aeiou";

impl SimText {
    /// The bytes of `tokens`, appended to `bytes` (those before an invalid id are kept).
    fn push_bytes(&self, tokens: &[i32], bytes: &mut Vec<u8>) -> Result<()> {
        for &t in tokens {
            if t < 0 || t as u32 >= self.vocab_size {
                return Err(OrtexError::invalid(format!("token {t} is outside the vocabulary of {}", self.vocab_size)));
            }
            let id = t as u32;
            if id >= SIM_FIRST_WORD {
                self.push_word(id, bytes);
            } else if id >= SIM_BYTE_OFFSET {
                bytes.push((id - SIM_BYTE_OFFSET) as u8);
            }
        }
        Ok(())
    }

    fn push_word(&self, id: u32, out: &mut Vec<u8>) {
        let n = id - SIM_FIRST_WORD;
        out.push(b' ');
        out.push(CONSONANTS[(n % 16) as usize]);
        out.push(VOWELS[((n / 16) % 5) as usize]);
        out.push(CONSONANTS[((n / 80) % 16) as usize]);
        out.push(VOWELS[((n / 1280) % 5) as usize]);
    }
}

impl TextCodec for SimText {
    fn tokenize(&self, text: &str) -> Result<Vec<i32>> {
        if self.vocab_size < SIM_FIRST_WORD {
            return Err(OrtexError::invalid(format!(
                "the simulated vocabulary of {} ids is too small for text (it needs at least {SIM_FIRST_WORD})",
                self.vocab_size
            )));
        }
        Ok(text.bytes().map(|b| (SIM_BYTE_OFFSET + u32::from(b)) as i32).collect())
    }

    fn detokenize(&self, tokens: &[i32]) -> Result<String> {
        let mut text = String::with_capacity(tokens.len() * 2);
        self.detokenize_into(tokens, &mut text)?;
        Ok(text)
    }

    /// Writes the bytes into `out`'s own buffer; only invalid UTF-8 costs a second string.
    fn detokenize_into(&self, tokens: &[i32], out: &mut String) -> Result<()> {
        let start = out.len();
        let mut bytes = std::mem::take(out).into_bytes();
        let pushed = self.push_bytes(tokens, &mut bytes);
        *out = match String::from_utf8(bytes) {
            Ok(text) => text,
            Err(invalid) => {
                let mut bytes = invalid.into_bytes();
                let tail = String::from_utf8_lossy(&bytes[start..]).into_owned();
                bytes.truncate(start);
                let mut text = String::from_utf8(bytes).expect("what `out` held before was a string");
                text.push_str(&tail);
                text
            }
        };
        pushed
    }

    /// Pad, bos and eos are control tokens; bytes are themselves; words their syllables.
    fn token_bytes(&self) -> Result<Vec<Vec<u8>>> {
        let mut words = Vec::with_capacity(self.vocab_size as usize);
        for id in 0..self.vocab_size {
            let mut word = Vec::new();
            if id < SIM_BYTE_OFFSET {
                word.push(0xFF);
                word.extend_from_slice(["<pad>", "<bos>", "<eos>"][id as usize].as_bytes());
            } else if id < SIM_FIRST_WORD {
                word.push((id - SIM_BYTE_OFFSET) as u8);
            } else {
                self.push_word(id, &mut word);
            }
            words.push(word);
        }
        Ok(words)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_round_trips_through_byte_tokens() {
        let codec = SimText { vocab_size: 32000 };
        let ids = codec.tokenize("héllo ✓").unwrap();
        assert_eq!(ids.len(), "héllo ✓".len());
        assert_eq!(codec.detokenize(&ids).unwrap(), "héllo ✓");
    }

    #[test]
    fn a_split_multibyte_character_decodes_to_replacement_until_complete() {
        let codec = SimText { vocab_size: 32000 };
        let ids = codec.tokenize("é").unwrap();
        assert!(codec.detokenize(&ids[..1]).unwrap().ends_with('\u{FFFD}'));
        assert_eq!(codec.detokenize(&ids).unwrap(), "é");
    }

    #[test]
    fn detokenizing_into_a_string_appends_and_replaces_invalid_bytes() {
        let codec = SimText { vocab_size: 32000 };
        let mut out = "é:".to_string();
        codec.detokenize_into(&codec.tokenize("✓").unwrap()[..2], &mut out).unwrap();
        assert_eq!(out, "é:\u{FFFD}");
        codec.detokenize_into(&[259], &mut out).unwrap();
        assert_eq!(out, "é:\u{FFFD} baba");
        assert!(codec.detokenize_into(&[32000], &mut out).is_err());
        assert_eq!(out, "é:\u{FFFD} baba", "left as it was");
    }

    #[test]
    fn word_ids_read_as_syllables() {
        let codec = SimText { vocab_size: 32000 };
        assert_eq!(codec.detokenize(&[259]).unwrap(), " baba");
        assert!(codec.detokenize(&[32000]).is_err());
        assert!(SimText { vocab_size: 100 }.tokenize("a").is_err());
    }
}
