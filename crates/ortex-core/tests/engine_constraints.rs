//! Constrained turns on the simulated model (issue 31): every sampling mode ends valid, the
//! constraint is refused before anything runs when it is malformed, and unconstrained turns draw
//! exactly what they drew before.

mod common;

use common::*;
use ortex_core::{Engine, ErrorCode, FinishReason, RequestOptions};

fn engine(seed: u64) -> Engine {
    sim(&format!(r#"{{"seed":{seed},"maxLength":4096}}"#))
}

/// One turn on a fresh request: (text, finish reason).
fn turn(engine: &mut Engine, options: &str) -> (String, String) {
    let r = engine.create_request(&RequestOptions::default()).unwrap();
    let prompt = engine.tokenize("Answer in JSON: ").unwrap();
    let t = engine.begin_turn(r, &prompt, &turn_opts(options)).unwrap();
    let events = run_all(engine, 16);
    let text = engine.detokenize(&tokens_of(&events, r, t)).unwrap();
    let finish = finish_of(&events, r, t);
    assert_eq!(finish.len(), 1, "one finish");
    (text, FinishReason::NAMES[finish[0].finish as usize].to_string())
}

const SAMPLING: [&str; 4] = [
    "",
    r#""temperature":1,"#,
    r#""temperature":0.7,"topK":3,"topP":0.9,"#,
    r#""temperature":1.5,"minP":0.05,"repetitionPenalty":1.3,"frequencyPenalty":0.5,"#,
];

#[test]
fn a_json_schema_turn_ends_valid_in_every_sampling_mode() {
    let schema = r#"{"type":"object","properties":{"name":{"type":"string","maxLength":12},"age":{"type":"integer","minimum":0},"tags":{"type":"array","items":{"enum":["a","b"]}}},"required":["name","age"],"additionalProperties":false}"#;
    for seed in 0..20 {
        for mode in SAMPLING {
            let mut e = engine(seed);
            let options = format!(
                r#"{{{mode}"seed":{seed},"maxGeneratedTokens":400,"constraint":{{"type":"json_schema","schema":{schema}}}}}"#
            );
            let (text, finish) = turn(&mut e, &options);
            assert_eq!(finish, "eos", "seed {seed} {mode}: {text:?}");
            let value: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            assert!(value["name"].is_string() && value["age"].is_u64(), "seed {seed}: {text}");
            assert!(value.as_object().unwrap().keys().all(|k| ["name", "age", "tags"].contains(&k.as_str())));
        }
    }
}

#[test]
fn json_regex_and_lark_turns_end_valid() {
    for seed in 0..20 {
        let mut e = engine(seed);
        let (text, finish) = turn(&mut e, r#"{"temperature":1,"constraint":{"type":"json"}}"#);
        assert_eq!(finish, "eos");
        assert!(serde_json::from_str::<serde_json::Value>(&text).unwrap().is_object(), "{text}");
        let (text, finish) =
            turn(&mut e, r#"{"temperature":1,"constraint":{"type":"regex","pattern":"[a-c]+-[0-9]{2}"}}"#);
        assert_eq!(finish, "eos");
        let (head, digits) = text.split_once('-').unwrap_or_else(|| panic!("{text:?}"));
        assert!(!head.is_empty() && head.bytes().all(|b| (b'a'..=b'c').contains(&b)), "{text:?}");
        assert!(digits.len() == 2 && digits.bytes().all(|b| b.is_ascii_digit()), "{text:?}");
        let lark = r#"start: \"yes\" | \"no\" | \"maybe \" NUMBER\nNUMBER: /[1-9][0-9]?/"#;
        let (text, finish) =
            turn(&mut e, &format!(r#"{{"temperature":1,"constraint":{{"type":"lark","grammar":"{lark}"}}}}"#));
        assert_eq!(finish, "eos");
        assert!(text == "yes" || text == "no" || text.starts_with("maybe "), "{text:?}");
    }
}

#[test]
fn the_same_seed_gives_the_same_constrained_text() {
    let options = r#"{"temperature":1,"seed":7,"constraint":{"type":"json"}}"#;
    let first = turn(&mut engine(3), options);
    assert_eq!(turn(&mut engine(3), options), first);
}

#[test]
fn a_constrained_turn_at_its_token_limit_finishes_max_generated_tokens() {
    let mut e = engine(1);
    let (text, finish) = turn(&mut e, r#"{"maxGeneratedTokens":3,"constraint":{"type":"regex","pattern":"a{10}"}}"#);
    assert_eq!((text.as_str(), finish.as_str()), ("aaa", "max-generated-tokens"));
}

#[test]
fn a_malformed_constraint_is_refused_at_begin_turn_naming_what() {
    let mut e = engine(1);
    let r = e.create_request(&RequestOptions::default()).unwrap();
    for (constraint, says) in [
        (r#"{"type":"regex","pattern":"(unclosed"}"#, "regex"),
        (r#"{"type":"lark","grammar":"start: nothing_defined"}"#, "lark"),
        (r#"{"type":"json_schema","schema":{"type":"no-such-type"}}"#, "json_schema"),
        (r#"{"type":"json_schema","schema":7}"#, "constraint.schema"),
    ] {
        let options = turn_opts(&format!(r#"{{"constraint":{constraint}}}"#));
        let error = e.begin_turn(r, &[5, 6], &options).expect_err(constraint);
        assert_eq!(error.code, ErrorCode::InvalidArgument);
        assert!(error.message.contains(says), "{}", error.message);
    }
    assert_eq!(e.token_count(r).unwrap(), 0, "nothing ran");
    let both = turn_opts(r#"{"ignoreEos":true,"constraint":{"type":"json"}}"#);
    assert!(e.begin_turn(r, &[5], &both).unwrap_err().message.contains("ignoreEos"));
    for bad in [r#"{"type":"xml"}"#, r#"{"type":"regex"}"#, r#"{"type":"json","schema":{}}"#] {
        let error = ortex_boundary::turn_options_from_json(&format!(r#"{{"constraint":{bad}}}"#)).unwrap_err();
        assert_eq!(error.code, ErrorCode::InvalidArgument, "{bad}");
    }
}

#[test]
fn retryable_failures_keep_the_constraint_with_its_turn() {
    let mut e = sim(r#"{"seed":4,"faults":{"retryableRate":0.3,"seed":9}}"#);
    let (text, finish) = turn(&mut e, r#"{"temperature":1,"constraint":{"type":"json"}}"#);
    assert_eq!(finish, "eos");
    assert!(serde_json::from_str::<serde_json::Value>(&text).unwrap().is_object(), "{text}");
}
