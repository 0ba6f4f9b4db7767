//! The trial runs at load (CPU): a short prompt, a 2-token chunk after it, and a decode step.
//!
//! Run for a model whose KV or logits are float16 or bfloat16, and for one whose attention is
//! not GroupQueryAttention. ONNX Runtime builds such sessions, but some fail only when they run:
//!
//! - some CPU kernels do not take some float16 graphs (onnxruntime-genai's builder emits
//!   MultiHeadAttention for CPU float16 folders, and with grouped KV heads they fail, in
//!   onnxruntime-genai the same way): the prompt or the decode fails, and so does `Engine.load`,
//!   saying which kernel and why, instead of every turn;
//! - the builder's MultiHeadAttention graphs build their causal mask for a prompt without past or
//!   a single new token, not both ("invalid expand shape" for a chunk with past): then the
//!   executor runs such rows (later prefill chunks, continuation turns) one position per
//!   invocation ([`Probe::chunks_with_past`] false; mod.rs).

use std::borrow::Cow;

use ort::logging::LogLevel;
use ort::session::{RunOptions, Session, SessionInputValue};
use ort::value::{DynValue, TensorRef};
use ortex_core::{OrtexError, Result};

use super::batch::Inputs;
use super::load_error;
use super::signature::{KvSpec, Names};
use crate::config::ModelConfig;
use crate::kv_element::{KvBuffer, KvElement};
use crate::layer_attention::{AttentionOp, AttentionPlan};

/// What the trial runs found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Probe {
    /// Whether a row with past and several new tokens runs in one invocation.
    pub(super) chunks_with_past: bool,
}

/// Whether a model needs the trial runs.
pub(super) fn needed(spec: &KvSpec, plan: &AttentionPlan) -> bool {
    !spec.element.is_f32() || !spec.logits.is_f32() || plan.layers.iter().any(|l| l.op != AttentionOp::GroupQuery)
}

/// The positions of one trial run.
struct Trial<'p> {
    /// Past tensors (the previous run's presents), or none for zeros of the minimum widths.
    past: Option<&'p [DynValue]>,
    past_len: usize,
    new: usize,
}

struct Runner<'a> {
    config: &'a ModelConfig,
    names: &'a Names,
    spec: &'a KvSpec,
    plan: &'a AttentionPlan,
}

/// Why a trial run failed, as `Engine.load` says it: ONNX Runtime's message `what`, and what it
/// means for the builder's float16 MultiHeadAttention folders with grouped KV heads.
fn kernel_failure(config: &ModelConfig, element: KvElement, plan: &AttentionPlan, what: &str) -> String {
    let element = element.name();
    let mut message =
        format!("{}: ONNX Runtime's CPU kernels cannot run this {element} graph ({what})", config.model_file.display());
    if plan.uses(AttentionOp::MultiHead) && config.num_key_value_heads < config.num_attention_heads {
        message.push_str(&format!(
            "; its MultiHeadAttention layers have grouped KV heads (num_key_value_heads {} < num_attention_heads \
             {}), which ONNX Runtime's CPU kernels do not run in {element} (onnxruntime-genai fails the same \
             way); use this model's float32 or int4 folder on the CPU",
            config.num_key_value_heads, config.num_attention_heads
        ));
    }
    message
}

impl Runner<'_> {
    fn error(&self, what: &str) -> OrtexError {
        load_error(kernel_failure(self.config, self.spec.element, self.plan, what))
    }

    /// Runs pad tokens at `trial`'s positions; the presents, or ONNX Runtime's message.
    fn run(&self, session: &mut Session, trial: Trial<'_>, quiet: bool) -> std::result::Result<Vec<DynValue>, String> {
        let (kv_heads, head_size) = (self.config.num_key_value_heads as usize, self.config.head_size as usize);
        let total = trial.past_len + trial.new;
        let ids = vec![i64::from(self.config.pad_token_id); trial.new];
        let mask = vec![1i64; total];
        let positions: Vec<i64> = (trial.past_len as i64..total as i64).collect();
        let mut zeros: Vec<KvBuffer> = self.names.past.iter().map(|_| KvBuffer::default()).collect();
        let e = |error: ort::Error| error.to_string();
        fn int_view(data: &[i64]) -> std::result::Result<SessionInputValue<'_>, String> {
            Ok(TensorRef::from_array_view(([1usize, data.len()], data)).map_err(|e| e.to_string())?.into())
        }
        let mut inputs: Inputs<'_> = vec![
            (Cow::Borrowed(self.names.input_ids.as_str()), int_view(&ids)?),
            (Cow::Borrowed(self.names.attention_mask.as_str()), int_view(&mask)?),
        ];
        if let Some(name) = &self.names.position_ids {
            inputs.push((Cow::Borrowed(name.as_str()), int_view(&positions)?));
        }
        match trial.past {
            Some(presents) => {
                for (name, value) in self.names.past.iter().zip(presents) {
                    inputs.push((Cow::Borrowed(name.as_str()), value.into()));
                }
            }
            None => {
                for (index, buffer) in zeros.iter_mut().enumerate() {
                    let width = self.spec.min_width[index];
                    buffer.bytes_mut(kv_heads * width * head_size * self.spec.element.bytes());
                }
                for (index, name) in self.names.past.iter().enumerate() {
                    let width = self.spec.min_width[index];
                    let len = kv_heads * width * head_size * self.spec.element.bytes();
                    let view =
                        self.spec.element.view([1, kv_heads, width, head_size], zeros[index].bytes(len)).map_err(e)?;
                    inputs.push((Cow::Borrowed(name.as_str()), view));
                }
            }
        }
        // A chunk that may fail by design (the mask subgraph) should not print ONNX Runtime's
        // error log at every load.
        let mut options = RunOptions::new().map_err(e)?;
        if quiet {
            options.set_log_level(LogLevel::Fatal).map_err(e)?;
        }
        let mut outputs =
            session.run_with_options(inputs, &options).map_err(|error| error.to_string().trim().to_string())?;
        let presents: Vec<DynValue> = self.names.present.iter().filter_map(|name| outputs.remove(name)).collect();
        if presents.len() != self.names.present.len() {
            return Err("the model returned no present".into());
        }
        Ok(presents)
    }
}

/// A 3-token prompt, then a 2-token chunk on it, then a decode step (on the chunk's presents, or
/// on the prompt's when the chunk failed). The prompt and the decode must run.
pub(super) fn run(
    config: &ModelConfig,
    session: &mut Session,
    names: &Names,
    spec: &KvSpec,
    plan: &AttentionPlan,
) -> Result<Probe> {
    let runner = Runner { config, names, spec, plan };
    let prompt =
        runner.run(session, Trial { past: None, past_len: 0, new: 3 }, false).map_err(|what| runner.error(&what))?;
    let chunk = runner.run(session, Trial { past: Some(&prompt), past_len: 3, new: 2 }, true);
    let (past, past_len) = match &chunk {
        Ok(presents) => (presents, 5),
        Err(_) => (&prompt, 3),
    };
    runner.run(session, Trial { past: Some(past), past_len, new: 1 }, false).map_err(|what| runner.error(&what))?;
    Ok(Probe { chunks_with_past: chunk.is_ok() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layer_attention::LayerAttention;

    fn plan(op: AttentionOp) -> AttentionPlan {
        let layer = LayerAttention { op, window: None, window_cache: false };
        AttentionPlan { layers: vec![layer.clone(), layer], nodes_to_window: vec![], window_to_set: 0 }
    }

    #[test]
    fn a_kernel_failure_names_the_graph_and_the_grouped_heads() {
        let config = ModelConfig::for_tests(None);
        let message = kernel_failure(&config, KvElement::F16, &plan(AttentionOp::MultiHead), "Shape mismatch");
        assert!(
            message.starts_with("m/model.onnx: ONNX Runtime's CPU kernels cannot run this float16 graph"),
            "{message}"
        );
        assert!(message.contains("(Shape mismatch)"), "{message}");
        assert!(message.contains("grouped KV heads (num_key_value_heads 2 < num_attention_heads 4)"), "{message}");
        // Not MultiHeadAttention, or no grouped heads: ONNX Runtime's message alone.
        let plain = kernel_failure(&config, KvElement::Bf16, &plan(AttentionOp::Plain), "no kernel");
        assert!(plain.contains("bfloat16 graph (no kernel)") && !plain.contains("grouped"), "{plain}");
        let mut ungrouped = config.clone();
        ungrouped.num_key_value_heads = 4;
        assert!(!kernel_failure(&ungrouped, KvElement::F16, &plan(AttentionOp::MultiHead), "x").contains("grouped"));
    }

    #[test]
    fn trial_runs_for_half_precision_or_attention_other_than_gqa() {
        let spec = |element| KvSpec { element, logits: element, min_width: vec![0; 4] };
        assert!(!needed(&spec(KvElement::F32), &plan(AttentionOp::GroupQuery)));
        assert!(needed(&spec(KvElement::F16), &plan(AttentionOp::GroupQuery)));
        assert!(needed(&spec(KvElement::F32), &plan(AttentionOp::MultiHead)));
        assert!(needed(&spec(KvElement::F32), &plan(AttentionOp::Plain)));
    }
}
