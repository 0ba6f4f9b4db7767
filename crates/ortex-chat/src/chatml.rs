//! The built-in ChatML template, for models without one of their own and for the simulated engine.

use crate::template::{ChatTemplate, SpecialTokens};

/// ChatML as SmolLM2 and Qwen write it: `<|im_start|>{role}\n{content}<|im_end|>\n` for each message
/// (content as a string, or the text of its `{"type": "text"}` parts), then `<|im_start|>assistant\n` when
/// a generation prompt is asked for. No default system message, no tools. The fixture
/// `tests/fixtures/chatml.json` holds Hugging Face's rendering of this very text.
pub const CHATML_TEMPLATE: &str = include_str!("chatml.jinja");

impl ChatTemplate {
    /// [`CHATML_TEMPLATE`] with the tokens ChatML models use: no `bos_token`, `eos_token` `<|im_end|>`.
    pub fn chatml() -> ChatTemplate {
        let special_tokens = SpecialTokens { eos: Some("<|im_end|>".to_owned()), ..SpecialTokens::default() };
        ChatTemplate::new(CHATML_TEMPLATE, special_tokens).expect("the built-in ChatML template parses")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::template::RenderInput;
    use serde_json::json;

    #[test]
    fn renders_each_message_and_the_generation_prompt() {
        let mut input = RenderInput::new(json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]},
        ]));
        let template = ChatTemplate::chatml();
        assert_eq!(
            template.render(&input).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
        );
        input.add_generation_prompt = true;
        assert!(template.render(&input).unwrap().ends_with("<|im_end|>\n<|im_start|>assistant\n"));
    }
}
