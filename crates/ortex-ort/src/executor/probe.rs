//! The one-token run at load of a model whose KV or logits are float16 or bfloat16, on the CPU.
//!
//! ONNX Runtime builds such a session, but some of its CPU kernels fail only when they run (the
//! CPU MultiHeadAttention takes no grouped KV heads, for one: onnxruntime-genai's builder emits it
//! for CPU float16 folders, and onnxruntime-genai fails on them the same way). A model that would
//! fail every turn fails `Engine.load` instead, saying which kernel and why.

use std::borrow::Cow;

use ort::session::Session;
use ort::value::TensorRef;
use ortex_core::Result;

use super::invocation::Inputs;
use super::load_error;
use super::signature::{KvSpec, Names};
use crate::config::ModelConfig;
use crate::kv_element::KvBuffer;
use crate::layer_attention::{AttentionOp, AttentionPlan};

/// Runs the pad token alone (batch 1, no past) and drops the outputs.
pub(super) fn run_one_token(
    config: &ModelConfig,
    session: &mut Session,
    names: &Names,
    spec: &KvSpec,
    plan: &AttentionPlan,
) -> Result<()> {
    let fail = |what: String| {
        let element = spec.element.name();
        let mut message = format!(
            "{}: ONNX Runtime's CPU kernels cannot run this {element} graph ({what})",
            config.model_file.display()
        );
        if plan.uses(AttentionOp::MultiHead) && config.num_key_value_heads < config.num_attention_heads {
            message.push_str(&format!(
                "; its MultiHeadAttention layers have grouped KV heads (num_key_value_heads {} < num_attention_heads \
                 {}), which the CPU MultiHeadAttention kernel does not take; use this model's float32 or int4 folder \
                 on the CPU",
                config.num_key_value_heads, config.num_attention_heads
            ));
        }
        load_error(message)
    };
    let ids = [i64::from(config.pad_token_id)];
    let (kv_heads, head_size) = (config.num_key_value_heads as usize, config.head_size as usize);
    let mut zeros: Vec<KvBuffer> = names.past.iter().map(|_| KvBuffer::default()).collect();
    let lens: Vec<usize> = spec.min_width.iter().map(|&w| kv_heads * w * head_size * spec.element.bytes()).collect();
    for (buffer, &len) in zeros.iter_mut().zip(&lens) {
        buffer.bytes_mut(len);
    }
    let id_tensor = |name: &str| {
        TensorRef::from_array_view(([1usize, 1], &ids[..])).map_err(|e| fail(format!("{name}: {e}")))
    };
    let zero_tensor = TensorRef::from_array_view(([1usize, 1], &[0i64][..])).map_err(|e| fail(e.to_string()))?;
    let one_tensor = TensorRef::from_array_view(([1usize, 1], &[1i64][..])).map_err(|e| fail(e.to_string()))?;
    let mut inputs: Inputs<'_> = Vec::new();
    inputs.push((Cow::Borrowed(names.input_ids.as_str()), id_tensor(&names.input_ids)?.into()));
    inputs.push((Cow::Borrowed(names.attention_mask.as_str()), one_tensor.into()));
    if let Some(name) = &names.position_ids {
        inputs.push((Cow::Borrowed(name.as_str()), zero_tensor.into()));
    }
    for (index, name) in names.past.iter().enumerate() {
        let shape = [1, kv_heads, spec.min_width[index], head_size];
        let view = spec.element.view(shape, zeros[index].bytes(lens[index])).map_err(|e| fail(e.to_string()))?;
        inputs.push((Cow::Borrowed(name.as_str()), view));
    }
    session.run(inputs).map(drop).map_err(|e| fail(e.to_string().trim().to_string()))
}
