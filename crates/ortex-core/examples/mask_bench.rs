//! Times a constraint's mask per token over a real tokenizer's vocabulary: the JSON Schema of
//! bench/constraints.ts compiled over a `tokenizer.json` (SmolLM2's 49,152 tokens), then a walk of
//! TURNS constrained turns, each token chosen by the simulated model's rule
//! (`TurnConstraint::sparse_choice`) so that every turn ends; prints the compile time and the
//! mask time per token (p50, p90, p99, max), and how many tokens the grammar forced (a mask that
//! allows one token: what could be appended without a model step).
//!
//! ```text
//!   cargo run --release -p ortex-core --example mask_bench -- TOKENIZER_JSON [TURNS]
//! ```

// A benchmark reads the wall clock, which the core itself never does.
#![allow(clippy::disallowed_methods)]

use std::time::Instant;

use ortex_core::constraint::{token_bytes_from_tokenizer_json, Constraint, Constraints};
use ortex_core::rng::Rng;
use ortex_core::text::TextCodec;
use ortex_core::Result;

/// A codec that knows only its tokens' bytes: all the constraint compiler asks of it.
struct TokenBytes(Vec<Vec<u8>>);

impl TextCodec for TokenBytes {
    fn tokenize(&self, _text: &str) -> Result<Vec<i32>> {
        unreachable!("the mask bench never tokenizes")
    }
    fn detokenize(&self, _tokens: &[i32]) -> Result<String> {
        unreachable!("the mask bench never detokenizes")
    }
    fn token_bytes(&self) -> Result<Vec<Vec<u8>>> {
        Ok(self.0.clone())
    }
}

const SCHEMA: &str = r#"{"type":"object","properties":{"name":{"type":"string","maxLength":24},"age":{"type":"integer","minimum":0,"maximum":150},"city":{"type":"string","maxLength":24},"hobbies":{"type":"array","items":{"type":"string","maxLength":16},"maxItems":4}},"required":["name","age","city"],"additionalProperties":false}"#;

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = args.get(1).expect("usage: mask_bench TOKENIZER_JSON [TURNS]");
    let turns: u64 = args.get(2).map_or(200, |t| t.parse().expect("TURNS is a count"));
    let words = token_bytes_from_tokenizer_json(&std::fs::read_to_string(path).expect("the tokenizer file")).unwrap();
    let vocab_size = words.len() as u32;
    let codec = TokenBytes(words);
    let constraint = Constraint::JsonSchema(serde_json::from_str(SCHEMA).unwrap());
    let mut constraints = Constraints::default();
    // SmolLM2's <|endoftext|> (0) and <|im_end|> (2).
    let (model_end, turn_end) = ([0], [2]);
    let started = Instant::now();
    let first = constraints.compile(&constraint, &codec, vocab_size, &model_end, &turn_end).unwrap();
    let first_ms = started.elapsed().as_secs_f64() * 1e3;
    let started = Instant::now();
    let _ = constraints.compile(&constraint, &codec, vocab_size, &model_end, &turn_end).unwrap();
    let again_ms = started.elapsed().as_secs_f64() * 1e3;
    drop(first);
    let mut mask_us = Vec::new();
    let mut forced = 0usize;
    for turn in 0..turns {
        let mut rng = Rng::new(turn);
        let mut matcher = constraints.compile(&constraint, &codec, vocab_size, &model_end, &turn_end).unwrap();
        while !matcher.complete {
            let started = Instant::now();
            let mask = matcher.compute_mask().expect("the walk never fails");
            mask_us.push(started.elapsed().as_secs_f64() * 1e6);
            forced += usize::from(mask.allowed_count() == 1);
            let token = matcher.sparse_choice(&mask, false, &mut rng).expect("a token is allowed");
            matcher.consume(token);
        }
    }
    mask_us.sort_by(f64::total_cmp);
    println!("vocabulary {vocab_size} tokens; first compile (builds the token environment) {first_ms:.1} ms, later compiles {again_ms:.2} ms");
    println!(
        "mask per token over {} tokens of {turns} turns: p50 {:.1} us, p90 {:.1} us, p99 {:.1} us, max {:.1} us",
        mask_us.len(),
        percentile(&mask_us, 0.5),
        percentile(&mask_us, 0.9),
        percentile(&mask_us, 0.99),
        mask_us[mask_us.len() - 1]
    );
    println!(
        "forced tokens (a mask allowing exactly one): {forced} of {} ({:.1}%)",
        mask_us.len(),
        100.0 * forced as f64 / mask_us.len() as f64
    );
}
