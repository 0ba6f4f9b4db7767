//! Structured output: a turn's constraint (any JSON object, a JSON Schema, a regular expression or
//! a Lark grammar), compiled with llguidance over the model's token bytes, and the matcher that
//! masks each of the turn's draws.
//!
//! ```text
//!   begin_turn:  Constraints::compile(constraint) ──▶ TurnConstraint on the turn (or INVALID_ARGUMENT)
//!   run_begin:   turn.constraint ──moved──▶ its row's draw              (draws.rs)
//!   execute:     mask = matcher.compute_mask(); mask the row; sample; matcher.consume(token)
//!   run_commit:  draw.constraint ──moved back──▶ turn; complete ⇒ the turn finishes 'eos'
//! ```
//!
//! The matcher moves with the draw instead of being copied: a step's masks are computed where the
//! model runs (off the JS thread on native), and only one step is ever in flight. A turn cancelled
//! or closed while its step runs drops its matcher with the draw.
//!
//! The token environment (llguidance's trie over every token's bytes) is built from the engine's
//! text codec the first time a turn asks for a constraint, and shared by every later turn.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};

use crate::error::{OrtexError, Result};
use crate::rng::Rng;
use crate::text::TextCodec;

/// What a turn's output must match (`TurnOptions::constraint`).
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    /// Any JSON object.
    Json,
    /// A JSON Schema (draft 2020-12 as llguidance supports it; an `x-guidance` key passes
    /// llguidance's JSON options, such as `whitespace_flexible`).
    JsonSchema(serde_json::Value),
    /// A regular expression the whole output matches.
    Regex(String),
    /// A Lark grammar in llguidance's dialect (`%json { ... }` embeds a schema; a `[lazy]` rule
    /// lets free text run until a trigger, which is how optional tool calls are written).
    Lark(String),
}

impl Constraint {
    /// The name the API gives this kind (`{ type: 'json_schema', ... }`).
    pub fn kind(&self) -> &'static str {
        match self {
            Constraint::Json => "json",
            Constraint::JsonSchema(_) => "json_schema",
            Constraint::Regex(_) => "regex",
            Constraint::Lark(_) => "lark",
        }
    }

    fn grammar(&self) -> Result<TopLevelGrammar> {
        Ok(match self {
            Constraint::Json => TopLevelGrammar::from_json_schema(serde_json::json!({ "type": "object" })),
            Constraint::JsonSchema(schema) => {
                if !schema.is_object() && !schema.is_boolean() {
                    return Err(OrtexError::invalid("constraint.schema must be a JSON Schema: an object or a boolean"));
                }
                TopLevelGrammar::from_json_schema(schema.clone())
            }
            Constraint::Regex(pattern) => TopLevelGrammar::from_regex(pattern),
            Constraint::Lark(grammar) => TopLevelGrammar::from_lark(grammar.clone()),
        })
    }
}

/// Bytes a simulated sparse row prefers when it closes (see `Closing`): a string, an object, an
/// array, a number.
const CLOSING_TEXT: [&[u8]; 4] = [b"\"", b"}", b"]", b"0"];

/// The engine's compiler: the token environment, built on first use.
#[derive(Default)]
pub struct Constraints {
    factory: Option<Arc<Shared>>,
}

/// What every constrained turn of one engine shares.
struct Shared {
    factory: ParserFactory,
    /// The model's end tokens (the trie's EOS set).
    model_end_tokens: Vec<u32>,
    /// Token ids of CLOSING_TEXT, where the vocabulary has them.
    closing: Vec<u32>,
    /// Tokens that are only whitespace: a sparse row's uniform pick passes them over while
    /// anything else is allowed (a JSON grammar allows whitespace almost everywhere).
    blank: SimpleVob,
}

impl Constraints {
    /// Compiles `constraint` for a turn whose end tokens (besides the model's) are
    /// `turn_end_tokens`. A malformed or unsupported constraint is INVALID_ARGUMENT naming what.
    pub fn compile(
        &mut self,
        constraint: &Constraint,
        codec: &dyn TextCodec,
        vocab_size: u32,
        model_end_tokens: &[i32],
        turn_end_tokens: &[i32],
    ) -> Result<TurnConstraint> {
        let grammar = constraint.grammar()?;
        let shared = match &self.factory {
            Some(shared) => Arc::clone(shared),
            None => {
                let shared = Arc::new(Shared::build(codec, vocab_size, model_end_tokens)?);
                self.factory = Some(Arc::clone(&shared));
                shared
            }
        };
        let parser = shared
            .factory
            .create_parser(grammar)
            .map_err(|e| OrtexError::invalid(format!("constraint ({}) cannot be compiled: {e}", constraint.kind())))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(error) = matcher.get_error() {
            return Err(OrtexError::invalid(format!("constraint ({}) cannot be compiled: {error}", constraint.kind())));
        }
        let mut end_tokens = shared.model_end_tokens.clone();
        end_tokens.extend(turn_end_tokens.iter().map(|&t| t as u32));
        end_tokens.sort_unstable();
        end_tokens.dedup();
        Ok(TurnConstraint { matcher, end_tokens, shared, complete: false, failure: None })
    }
}

impl Shared {
    fn build(codec: &dyn TextCodec, vocab_size: u32, model_end_tokens: &[i32]) -> Result<Shared> {
        let Some(&first_end) = model_end_tokens.first() else {
            return Err(OrtexError::invalid("constraints need the model's end token, and this model names none"));
        };
        let mut words = codec.token_bytes()?;
        words.resize(vocab_size as usize, Vec::new());
        // The model's end tokens are control tokens whatever their text: marked, they never match
        // a grammar's text, only its end.
        for &end in model_end_tokens {
            let word = &mut words[end as usize];
            if word.first() != Some(&TokTrie::SPECIAL_TOKEN_MARKER) {
                *word = format!("\u{0}<|end {end}|>").into_bytes();
                word[0] = TokTrie::SPECIAL_TOKEN_MARKER;
            }
        }
        let model_end_tokens: Vec<u32> = model_end_tokens.iter().map(|&t| t as u32).collect();
        let trie =
            TokTrie::from(&TokRxInfo::new(vocab_size, first_end as u32), &words).with_eos_tokens(&model_end_tokens);
        let closing = CLOSING_TEXT.iter().filter_map(|text| trie.token_id(text)).collect();
        let mut blank = trie.alloc_token_set();
        for (id, word) in words.iter().enumerate() {
            if !word.is_empty() && word.iter().all(u8::is_ascii_whitespace) {
                blank.allow_token(id as u32);
            }
        }
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| OrtexError::invalid(format!("constraints are unavailable for this vocabulary: {e}")))?;
        factory.quiet();
        Ok(Shared { factory, model_end_tokens, closing, blank })
    }
}

/// One turn's constraint: its matcher, where the turn is in the grammar.
#[derive(Clone)]
pub struct TurnConstraint {
    matcher: Matcher,
    /// Every token that ends the turn (the model's and the turn's own), sorted: allowed whenever
    /// the grammar may end.
    end_tokens: Vec<u32>,
    shared: Arc<Shared>,
    /// The grammar can take nothing more: the turn finishes 'eos' at this commit.
    pub complete: bool,
    /// llguidance's error (a limit of the grammar hit mid-turn): the turn fails.
    pub failure: Option<String>,
}

impl std::fmt::Debug for TurnConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TurnConstraint").field("complete", &self.complete).field("failure", &self.failure).finish()
    }
}

/// Which tokens a row may take this step.
#[derive(Debug)]
pub struct TokenMask {
    allowed: SimpleVob,
}

impl TokenMask {
    pub fn allows(&self, token: u32) -> bool {
        (token as usize) < self.allowed.len() && self.allowed.is_allowed(token)
    }

    /// How many tokens the row may take: 1 is a token the grammar forces.
    pub fn allowed_count(&self) -> usize {
        self.allowed.as_slice().iter().map(|word| word.count_ones() as usize).sum()
    }

    /// Sets every disallowed score of a dense row (indexed by token id) to -inf.
    pub fn apply_dense(&self, logits: &mut [f32]) {
        let words = self.allowed.as_slice();
        for (chunk_index, chunk) in logits.chunks_mut(32).enumerate() {
            let bits = words.get(chunk_index).copied().unwrap_or(0);
            if bits == u32::MAX {
                continue;
            }
            for (bit, logit) in chunk.iter_mut().enumerate() {
                if bits & (1 << bit) == 0 {
                    *logit = f32::NEG_INFINITY;
                }
            }
        }
    }

    /// Sets every disallowed candidate's score of a sparse row to -inf; whether any is left.
    pub fn apply_sparse(&self, ids: &[u32], logits: &mut [f32]) -> bool {
        let mut any = false;
        for (&id, logit) in ids.iter().zip(logits.iter_mut()) {
            if self.allows(id) {
                any = true;
            } else {
                *logit = f32::NEG_INFINITY;
            }
        }
        any
    }

    /// The allowed token of rank `index` (in id order), for a uniform pick among them.
    fn nth_allowed(&self, index: u64) -> Option<u32> {
        let mut left = index;
        for (word_index, &bits) in self.allowed.as_slice().iter().enumerate() {
            let count = u64::from(bits.count_ones());
            if left < count {
                let mut bits = bits;
                for _ in 0..left {
                    bits &= bits - 1;
                }
                return Some(word_index as u32 * 32 + bits.trailing_zeros());
            }
            left -= count;
        }
        None
    }

    fn count(&self) -> u64 {
        self.allowed.as_slice().iter().map(|w| u64::from(w.count_ones())).sum()
    }
}

impl TurnConstraint {
    /// This step's mask, or None when the matcher failed (`failure` says why). The end tokens are
    /// allowed exactly when the grammar may end here.
    pub fn compute_mask(&mut self) -> Option<TokenMask> {
        let mut allowed = match self.matcher.compute_mask_or_eos() {
            Ok(allowed) => allowed,
            Err(error) => {
                self.failure = Some(error.to_string());
                return None;
            }
        };
        let trie_end = self.shared.model_end_tokens[0];
        if allowed.is_allowed(trie_end) {
            for &end in &self.end_tokens {
                allowed.allow_token(end);
            }
        }
        if allowed.is_zero() {
            self.failure = Some("the grammar allows no token here".into());
            return None;
        }
        Some(TokenMask { allowed })
    }

    pub fn is_end_token(&self, token: u32) -> bool {
        self.end_tokens.binary_search(&token).is_ok()
    }

    /// Advances the grammar past the sampled `token`. An end token ends the turn (the engine's
    /// own rule); the grammar completes when it can take nothing more.
    pub fn consume(&mut self, token: u32) {
        if self.is_end_token(token) {
            self.complete = true;
            return;
        }
        match self.matcher.consume_token(token) {
            Ok(()) => self.complete = self.matcher.is_stopped(),
            Err(error) => self.failure = Some(error.to_string()),
        }
    }

    /// The simulated model's rule for a sparse row (a few candidates, not the vocabulary), which
    /// keeps every constrained turn finishing valid: with probability 1/2 the row closes (the
    /// first allowed of: an end token, `"`, `}`, `]`, `0`); otherwise it samples among the
    /// allowed candidates as usual (`None`: the caller does); when none is allowed, it takes an
    /// allowed token uniformly at random, whitespace only where nothing else is allowed. All
    /// draws come from the turn's generator.
    pub fn sparse_choice(&self, mask: &TokenMask, candidates_allowed: bool, rng: &mut Rng) -> Option<u32> {
        if rng.next_f64() < 0.5 {
            let closing = self.end_tokens.iter().chain(&self.shared.closing).copied();
            if let Some(token) = closing.into_iter().find(|&t| mask.allows(t)) {
                return Some(token);
            }
        }
        if candidates_allowed {
            return None;
        }
        let mut visible = TokenMask { allowed: mask.allowed.clone() };
        visible.allowed.sub(&self.shared.blank);
        let pick_from = if visible.allowed.is_zero() { mask } else { &visible };
        pick_from.nth_allowed(rng.below(pick_from.count()))
    }
}

/// Every token's bytes from a Hugging Face `tokenizer.json` (byte-level BPE, or byte fallback
/// with a metaspace), special added tokens marked as control tokens: what a real model's
/// `TextCodec::token_bytes` gives.
pub fn token_bytes_from_tokenizer_json(json: &str) -> Result<Vec<Vec<u8>>> {
    let value: serde_json::Value =
        serde_json::from_str(json).map_err(|e| OrtexError::invalid(format!("the tokenizer file is not JSON: {e}")))?;
    llguidance::token_bytes_from_tokenizer_json(&value).map_err(|e| {
        OrtexError::invalid(format!("this model's tokenizer gives no token bytes, so it takes no constraint: {e}"))
    })
}
