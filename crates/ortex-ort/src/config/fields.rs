//! Which fields genai_config.json may have: every field ortex knows, by its dotted path, and what
//! it does with each (read, accepted as harmless, or refused with a reason). A field not listed
//! fails the load. Keep docs/model-format.md in step. The tensor-name fields' defaults are
//! contract.rs's.

use ortex_core::Result;
use serde_json::Value;

use super::reader::{load_error, Reader};

/// What ortex does with one field of genai_config.json (docs/model-format.md lists them all).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    /// Read and implemented.
    Read,
    /// An object whose own fields are checked against the table.
    Object,
    /// Accepted and not used: it does not change what the model computes (onnxruntime-genai's
    /// session, scheduler and search settings; ortex has its own).
    Harmless,
    /// Would change what the model computes, and ortex does not implement it: `Engine.load` fails
    /// naming the field and this reason.
    Refused(&'static str),
}

/// Every field ortex knows, by its dotted path. A field not listed fails the load as not
/// understood (it may change what the model computes). Keep docs/model-format.md in step; the
/// model tooling's writers are held to it through ts/generated/folder-contract.ts.
pub const FIELDS: &[(&str, Field)] = &[
    ("model", Field::Object),
    ("search", Field::Object),
    ("engine", Field::Object),
    ("speculative", Field::Refused("speculative decoding with a draft model is not implemented")),
    ("model.type", Field::Read),
    ("model.vocab_size", Field::Read),
    ("model.context_length", Field::Read),
    ("model.bos_token_id", Field::Read),
    ("model.eos_token_id", Field::Read),
    ("model.pad_token_id", Field::Read),
    ("model.bot_token_id", Field::Harmless),
    ("model.eot_token_id", Field::Harmless),
    ("model.bor_token_id", Field::Harmless),
    ("model.eor_token_id", Field::Harmless),
    ("model.sep_token_id", Field::Harmless),
    ("model.decoder", Field::Object),
    ("model.encoder", Field::Refused("encoder-decoder models are not implemented (ortex runs one decoder)")),
    ("model.decoder_start_token_id", Field::Refused("encoder-decoder models are not implemented")),
    ("model.vision", Field::Refused("vision parts are not implemented")),
    ("model.speech", Field::Refused("speech parts are not implemented")),
    ("model.embedding", Field::Refused("a separate embedding session is not implemented")),
    ("model.image_token_id", Field::Refused("image inputs are not implemented")),
    ("model.video_token_id", Field::Refused("video inputs are not implemented")),
    ("model.vision_start_token_id", Field::Refused("vision inputs are not implemented")),
    ("model.audio_token_id", Field::Refused("audio inputs are not implemented")),
    ("model.decoder.filename", Field::Read),
    ("model.decoder.head_size", Field::Read),
    ("model.decoder.hidden_size", Field::Read),
    ("model.decoder.num_attention_heads", Field::Read),
    ("model.decoder.num_key_value_heads", Field::Read),
    ("model.decoder.num_hidden_layers", Field::Read),
    ("model.decoder.inputs", Field::Object),
    ("model.decoder.outputs", Field::Object),
    ("model.decoder.session_options", Field::Harmless),
    ("model.decoder.run_options", Field::Harmless),
    ("model.decoder.sliding_window", Field::Object),
    ("model.decoder.pipeline", Field::Refused("a pipeline of several decoder sessions is not implemented")),
    (
        "model.decoder.layer_types",
        Field::Refused("per-layer types (convolution or recurrent layers) are not implemented"),
    ),
    ("model.decoder.conv_cache_size", Field::Refused("convolution layers are not implemented")),
    // One `paged_kv` group over every layer (a paged-attention folder) is read; any other group
    // (convolution or recurrent state) is refused when it is read (mod.rs, read_state_groups).
    ("model.decoder.state_groups", Field::Read),
    ("model.decoder.state_update_capacity", Field::Refused("recurrent state updates are not implemented")),
    ("model.decoder.adapter_filename", Field::Refused("LoRA adapters are not implemented")),
    ("model.decoder.shared_initializers", Field::Refused("initializers shared between sessions are not implemented")),
    ("model.decoder.inputs.input_ids", Field::Read),
    ("model.decoder.inputs.attention_mask", Field::Read),
    ("model.decoder.inputs.position_ids", Field::Read),
    ("model.decoder.inputs.past_key_names", Field::Read),
    ("model.decoder.inputs.past_value_names", Field::Read),
    ("model.decoder.inputs.block_table", Field::Read),
    ("model.decoder.inputs.cumulative_sequence_lengths", Field::Read),
    ("model.decoder.inputs.past_sequence_lengths", Field::Read),
    ("model.decoder.inputs.attention_metadata", Field::Read),
    ("model.decoder.inputs.logits_indices", Field::Read),
    (
        "model.decoder.inputs.block_table_windowed",
        Field::Refused("sliding-window layers served from a ring of blocks (paged attention) are not implemented"),
    ),
    ("model.decoder.outputs.logits", Field::Read),
    ("model.decoder.outputs.present_key_names", Field::Read),
    ("model.decoder.outputs.present_value_names", Field::Read),
    ("model.decoder.sliding_window.window_size", Field::Read),
    ("model.decoder.sliding_window.layers", Field::Read),
    ("model.decoder.sliding_window.slide_key_value_cache", Field::Read),
    ("model.decoder.sliding_window.slide_inputs", Field::Read),
    ("model.decoder.sliding_window.cache_slack", Field::Harmless),
    ("model.decoder.sliding_window.pad_value", Field::Harmless),
    ("model.decoder.sliding_window.alignment", Field::Harmless),
    // A paged-attention folder's pool and scheduler (onnxruntime-genai's Engine): the block size
    // is the graph's and is read; the rest are ortex's own options (numBlocks or kvCacheBytes,
    // maxBatchSize, maxScheduledTokens, prefixCaching), which decide instead.
    ("engine.dynamic_batching", Field::Object),
    ("engine.dynamic_batching.block_size", Field::Read),
    ("engine.dynamic_batching.max_batch_size", Field::Harmless),
    ("engine.dynamic_batching.num_blocks", Field::Harmless),
    ("engine.dynamic_batching.gpu_utilization_factor", Field::Harmless),
    ("engine.dynamic_batching.max_scheduled_tokens", Field::Harmless),
    ("engine.dynamic_batching.prefix_caching", Field::Harmless),
    ("search.diversity_penalty", Field::Harmless),
    ("search.do_sample", Field::Harmless),
    ("search.early_stopping", Field::Harmless),
    ("search.length_penalty", Field::Harmless),
    ("search.max_length", Field::Harmless),
    ("search.min_length", Field::Harmless),
    ("search.no_repeat_ngram_size", Field::Harmless),
    ("search.num_beams", Field::Harmless),
    ("search.num_return_sequences", Field::Harmless),
    ("search.past_present_share_buffer", Field::Harmless),
    ("search.repetition_penalty", Field::Harmless),
    ("search.temperature", Field::Harmless),
    ("search.top_k", Field::Harmless),
    ("search.top_p", Field::Harmless),
    ("search.random_seed", Field::Harmless),
    ("search.chunk_size", Field::Harmless),
];

/// `model.type` values ortex has been checked with (bench/model_coverage.py, against
/// onnxruntime-genai and transformers; the GGUF importer's architectures against llama.cpp): the
/// graph computes everything for these, so none needs anything done outside it.
pub const MODEL_TYPES: &[&str] = &[
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "phi3",
    "phi",
    "gemma",
    "gemma2",
    "gemma3_text",
    "granite",
    "olmo",
    "olmo2",
    "smollm3",
    "nemotron",
];

fn field(path: &str) -> Option<Field> {
    FIELDS.iter().find(|(p, _)| *p == path).map(|&(_, f)| f)
}

/// Every field of the object at `prefix` (and of the objects below it) must be in [`FIELDS`] and
/// not refused.
pub(super) fn check_fields(r: &Reader<'_>, prefix: &str, object: &Value) -> Result<()> {
    let Some(fields) = object.as_object() else {
        return Err(load_error(r.file, format!("{prefix} must be an object")));
    };
    for (key, value) in fields {
        let path = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
        match field(&path) {
            Some(Field::Read | Field::Harmless) => {}
            Some(Field::Object) => check_fields(r, &path, value)?,
            Some(Field::Refused(reason)) => {
                return Err(load_error(
                    r.file,
                    format!("{path}: {reason}; ortex refuses the model rather than run it wrong"),
                ))
            }
            None => {
                return Err(load_error(
                    r.file,
                    format!(
                        "{path} is not a field ortex understands (it may change what the model computes); \
                         docs/model-format.md lists the fields ortex reads"
                    ),
                ))
            }
        }
    }
    let custom_ops = "model.decoder.session_options.custom_ops_library";
    if prefix.is_empty() && r.get(custom_ops).is_some() {
        return Err(load_error(r.file, format!("{custom_ops}: custom operator libraries are not implemented")));
    }
    Ok(())
}
