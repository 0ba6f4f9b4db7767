//! Renders every case of every fixture in tests/fixtures and compares the text byte for byte with what
//! Hugging Face transformers rendered (tests/make_fixtures.py wrote them; this test needs no Python).

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use ortex_chat::{ChatErrorCode, ChatTemplate, DateTime, RenderInput, SpecialTokens, CHATML_TEMPLATE};
use serde_json::{Map, Value};

fn fixture_paths() -> Vec<PathBuf> {
    let folder = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut paths: Vec<PathBuf> = fs::read_dir(&folder)
        .expect("tests/fixtures exists")
        .map(|entry| entry.expect("a readable folder entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "json"))
        .collect();
    paths.sort();
    paths
}

fn string_field(value: &Value, name: &str) -> Option<String> {
    value.get(name).and_then(Value::as_str).map(str::to_owned)
}

fn special_tokens(fixture: &Value) -> SpecialTokens {
    let other: BTreeMap<String, String> = fixture
        .get("other_special_tokens")
        .and_then(Value::as_object)
        .map(|tokens| {
            tokens
                .iter()
                .map(|(name, token)| (name.clone(), token.as_str().expect("a token string").to_owned()))
                .collect()
        })
        .unwrap_or_default();
    SpecialTokens { bos: string_field(fixture, "bos_token"), eos: string_field(fixture, "eos_token"), other }
}

/// "2025-03-07T14:05:09", as Python's `datetime.isoformat()` writes it.
fn parse_date(text: &str) -> DateTime {
    let number = |range: std::ops::Range<usize>| text[range].parse::<u32>().expect("an ISO date and time");
    DateTime::new(
        number(0..4) as i32,
        number(5..7) as u8,
        number(8..10) as u8,
        number(11..13) as u8,
        number(14..16) as u8,
        number(17..19) as u8,
    )
    .expect("a valid date")
}

fn render_input(case: &Value) -> RenderInput {
    RenderInput {
        messages: case["messages"].clone(),
        add_generation_prompt: case["add_generation_prompt"].as_bool().expect("add_generation_prompt"),
        tools: case.get("tools").cloned(),
        documents: None,
        extra: case.get("extra").and_then(Value::as_object).cloned().unwrap_or_else(Map::new),
        now: case.get("date").and_then(Value::as_str).map(parse_date),
    }
}

/// Whether a case's messages hold a content part that is not text.
fn has_non_text_part(case: &Value) -> bool {
    let messages = case["messages"].as_array().into_iter().flatten();
    messages.filter_map(|m| m["content"].as_array()).flatten().any(|part| part["type"] != "text")
}

/// Where two texts first differ, with a little context, for a readable failure.
fn first_difference(expected: &str, actual: &str) -> String {
    let at = expected.bytes().zip(actual.bytes()).take_while(|(a, b)| a == b).count();
    let from = at.saturating_sub(40);
    let window = |text: &str| {
        let start = (from..=at.min(text.len())).find(|i| text.is_char_boundary(*i)).unwrap_or(text.len());
        let end = (at + 40).min(text.len());
        let end = (end..=text.len()).find(|i| text.is_char_boundary(*i)).unwrap_or(text.len());
        text[start..end].to_owned()
    };
    format!("first difference at byte {at}:\n  expected …{:?}…\n  actual   …{:?}…", window(expected), window(actual))
}

#[test]
fn every_fixture_renders_as_hugging_face_does() {
    let paths = fixture_paths();
    assert!(paths.len() >= 8, "expected the committed fixtures, found {paths:?}");
    let mut failures = Vec::new();
    let mut cases = 0;
    for path in &paths {
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        let fixture: Value =
            serde_json::from_str(&fs::read_to_string(path).unwrap()).unwrap_or_else(|e| panic!("{name}: {e}"));
        let source = fixture["template"].as_str().expect("a template string");
        let template = ChatTemplate::new(source, special_tokens(&fixture)).unwrap_or_else(|e| panic!("{name}: {e}"));
        for case in fixture["cases"].as_array().expect("a list of cases") {
            cases += 1;
            let case_name = format!("{name}/{}", case["name"].as_str().unwrap_or("?"));
            let rendered = template.render(&render_input(case));
            // Hugging Face renders image parts as the template's placeholder; ortex reads no images,
            // so it refuses them by name instead.
            if has_non_text_part(case) {
                match rendered {
                    Err(error)
                        if error.code == ChatErrorCode::InputInvalid && error.message.contains("only \"text\"") => {}
                    outcome => failures.push(format!("{case_name}: expected the image part refused, got {outcome:?}")),
                }
                continue;
            }
            match (
                case.get("expected").and_then(Value::as_str),
                case.get("expected_error").and_then(Value::as_str),
                rendered,
            ) {
                (Some(expected), _, Ok(actual)) if actual == expected => {}
                (Some(expected), _, Ok(actual)) => {
                    failures.push(format!("{case_name}: {}", first_difference(expected, &actual)))
                }
                (Some(_), _, Err(error)) => failures.push(format!("{case_name}: failed: {error}")),
                (None, Some(expected), Err(error))
                    if error.code == ChatErrorCode::TemplateRaised && error.message == expected => {}
                (None, Some(expected), outcome) => {
                    failures.push(format!("{case_name}: expected the template to raise {expected:?}, got {outcome:?}"))
                }
                (None, None, _) => {
                    failures.push(format!("{case_name}: the case has neither expected nor expected_error"))
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {cases} cases differ from Hugging Face:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn the_chatml_fixture_is_the_built_in_template() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chatml.json");
    let fixture: Value = serde_json::from_str(&fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(fixture["template"].as_str(), Some(CHATML_TEMPLATE), "regenerate tests/fixtures/chatml.json");
    assert_eq!(special_tokens(&fixture), ChatTemplate::chatml().special_tokens().clone());
}
