//! `genai_config.json` -> [`ModelConfig`]: onnxruntime-genai's model configuration, read and
//! checked before anything heavy happens. Every failure is `ErrorCode::ModelLoad` and names the
//! file and the field (docs/model-format.md, "genai_config.json").

use std::path::{Path, PathBuf};

use ortex_core::Result;
use serde_json::Value;

pub mod contract;
mod fields;
mod reader;

use fields::check_fields;
pub use fields::{Field, FIELDS, MODEL_TYPES};
use reader::{load_error, Reader};

pub const CONFIG_FILE: &str = "genai_config.json";
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// Tensor names of the decoder, as genai_config.json gives them (`%d` = layer index in the KV
/// templates).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorNames {
    pub input_ids: String,
    pub attention_mask: String,
    /// Absent for a GroupQueryAttention model with rotary inside (positions come from the mask).
    pub position_ids: Option<String>,
    pub past_key: String,
    pub past_value: String,
    pub logits: String,
    pub present_key: String,
    pub present_value: String,
    /// The inputs of a paged-attention graph (absent from other graphs; the signature check
    /// decides which the graph has).
    pub paged: PagedNames,
}

/// A paged-attention graph's step inputs (onnxruntime-genai's builder names, docs/model-format.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PagedNames {
    pub block_table: String,
    pub cumulative_sequence_lengths: String,
    pub past_sequence_lengths: String,
    pub attention_metadata: String,
    pub logits_indices: String,
}

impl TensorNames {
    /// Expands a `%d` template for layer `layer`.
    pub fn layer(template: &str, layer: usize) -> String {
        template.replacen("%d", &layer.to_string(), 1)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelConfig {
    pub dir: PathBuf,
    /// The decoder graph, `dir` joined with `model.decoder.filename`.
    pub model_file: PathBuf,
    pub vocab_size: u32,
    /// The model's context length: most tokens one request may hold.
    pub context_length: u32,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<i32>,
    pub pad_token_id: u32,
    pub head_size: u32,
    pub hidden_size: u32,
    pub num_attention_heads: u32,
    pub num_key_value_heads: u32,
    pub num_hidden_layers: u32,
    pub names: TensorNames,
    /// `model.type` (one of [`MODEL_TYPES`]).
    pub model_type: String,
    /// `model.decoder.sliding_window`, when the model has one.
    pub sliding_window: Option<SlidingWindow>,
    /// `engine.dynamic_batching.block_size`: the block size a paged-attention graph is built for.
    pub paged_block_size: Option<u32>,
}

/// `model.decoder.sliding_window`: each query of the windowed layers attends to itself and the
/// `window_size - 1` positions before it (Hugging Face's `sliding_window`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlidingWindow {
    pub window_size: u32,
    /// The windowed layers; empty: every layer.
    pub layers: Vec<u32>,
}

impl ModelConfig {
    /// Reads and checks `dir/genai_config.json`. Checks that need the graph or the tokenizer
    /// (tensor names, vocabulary size) happen when those load.
    pub fn load(dir: &Path) -> Result<ModelConfig> {
        if !dir.is_dir() {
            return Err(load_error(dir, "the model folder does not exist or is not a folder"));
        }
        let file = dir.join(CONFIG_FILE);
        let text = match std::fs::read_to_string(&file) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(load_error(&file, "the file is missing (not a model folder)"))
            }
            Err(e) => return Err(load_error(&file, format!("cannot read the file: {e}"))),
        };
        let root: Value =
            serde_json::from_str(&text).map_err(|e| load_error(&file, format!("the file is not valid JSON: {e}")))?;
        ModelConfig::from_json(dir, &file, &root)
    }

    /// The document's fields, checked against [`FIELDS`] first (a field ortex does not implement
    /// must not be skipped silently), then read part by part.
    fn from_json(dir: &Path, file: &Path, root: &Value) -> Result<ModelConfig> {
        if !root.is_object() {
            return Err(load_error(file, "the document must be a JSON object"));
        }
        let r = Reader { file, root };
        r.object("model")?;
        r.object("model.decoder")?;
        check_fields(&r, "", root)?;
        let dims = read_dims(&r)?;
        let tokens = read_special_tokens(&r, dims.vocab_size)?;
        let sliding_window = read_sliding_window(&r, dims.num_hidden_layers)?;
        read_state_groups(&r, dims.num_hidden_layers)?;
        Ok(ModelConfig {
            dir: dir.to_path_buf(),
            model_file: read_model_file(&r, dir)?,
            model_type: read_model_type(&r)?,
            vocab_size: dims.vocab_size,
            context_length: dims.context_length,
            bos_token_id: tokens.bos,
            eos_token_ids: tokens.eos,
            pad_token_id: tokens.pad,
            head_size: dims.head_size,
            hidden_size: dims.hidden_size,
            num_attention_heads: dims.num_attention_heads,
            num_key_value_heads: dims.num_key_value_heads,
            num_hidden_layers: dims.num_hidden_layers,
            names: read_names(&r)?,
            sliding_window,
            paged_block_size: read_paged_block_size(&r)?,
        })
    }

    pub fn config_file(&self) -> PathBuf {
        self.dir.join(CONFIG_FILE)
    }

    pub fn tokenizer_file(&self) -> PathBuf {
        self.dir.join(TOKENIZER_FILE)
    }

    /// Elements of one KV head of one position.
    pub fn kv_width(&self) -> usize {
        self.num_key_value_heads as usize * self.head_size as usize
    }

    /// The sliding window of layer `layer`, if genai_config.json gives it one.
    pub fn window_of(&self, layer: usize) -> Option<u32> {
        let window = self.sliding_window.as_ref()?;
        (window.layers.is_empty() || window.layers.contains(&(layer as u32))).then_some(window.window_size)
    }
}

/// The sizes of the model.
struct Dims {
    vocab_size: u32,
    context_length: u32,
    head_size: u32,
    hidden_size: u32,
    num_attention_heads: u32,
    num_key_value_heads: u32,
    num_hidden_layers: u32,
}

fn read_dims(r: &Reader<'_>) -> Result<Dims> {
    let dims = Dims {
        vocab_size: r.int("model.vocab_size", 1)?,
        context_length: r.int("model.context_length", 2)?,
        head_size: r.int("model.decoder.head_size", 1)?,
        hidden_size: r.int("model.decoder.hidden_size", 1)?,
        num_attention_heads: r.int("model.decoder.num_attention_heads", 1)?,
        num_key_value_heads: r.int("model.decoder.num_key_value_heads", 1)?,
        num_hidden_layers: r.int("model.decoder.num_hidden_layers", 1)?,
    };
    let (heads, kv_heads) = (dims.num_attention_heads, dims.num_key_value_heads);
    if heads % kv_heads != 0 {
        return Err(load_error(
            r.file,
            format!(
                "model.decoder.num_attention_heads ({heads}) is not a multiple of \
                 model.decoder.num_key_value_heads ({kv_heads})"
            ),
        ));
    }
    Ok(dims)
}

struct SpecialTokens {
    bos: Option<u32>,
    eos: Vec<i32>,
    pad: u32,
}

fn read_special_tokens(r: &Reader<'_>, vocab_size: u32) -> Result<SpecialTokens> {
    let in_vocab = |path: &str, id: u32| -> Result<u32> {
        if id >= vocab_size {
            return Err(load_error(r.file, format!("{path} {id} is outside the vocabulary of {vocab_size}")));
        }
        Ok(id)
    };
    let pad = in_vocab("model.pad_token_id", r.int("model.pad_token_id", 0)?)?;
    let bos = match r.get("model.bos_token_id") {
        None => None,
        Some(v) => Some(in_vocab("model.bos_token_id", r.count("model.bos_token_id", v, 0)?)?),
    };
    Ok(SpecialTokens { bos, eos: read_eos(r, vocab_size)?, pad })
}

/// `model.decoder.filename`, a file inside the folder.
fn read_model_file(r: &Reader<'_>, dir: &Path) -> Result<PathBuf> {
    let filename = r
        .name("model.decoder.filename", None)?
        .ok_or_else(|| load_error(r.file, "model.decoder.filename is missing"))?;
    if Path::new(&filename).is_absolute() || filename.split(['/', '\\']).any(|part| part == "..") {
        return Err(load_error(
            r.file,
            format!("model.decoder.filename must name a file inside the folder, got {filename:?}"),
        ));
    }
    Ok(dir.join(&filename))
}

/// `model.type`: one of [`MODEL_TYPES`].
fn read_model_type(r: &Reader<'_>) -> Result<String> {
    let model_type = r.name("model.type", None)?.ok_or_else(|| load_error(r.file, "model.type is missing"))?;
    if !MODEL_TYPES.contains(&model_type.as_str()) {
        return Err(load_error(
            r.file,
            format!(
                "model.type {model_type:?} is not a model type ortex has been checked with ({})",
                MODEL_TYPES.join(", ")
            ),
        ));
    }
    Ok(model_type)
}

fn read_names(r: &Reader<'_>) -> Result<TensorNames> {
    use contract::*;
    r.object("model.decoder.inputs")?;
    r.object("model.decoder.outputs")?;
    let named = |f: NameField| -> Result<String> { Ok(r.name(f.path, Some(f.default))?.expect("defaulted")) };
    let template = |f: NameField| r.layer_template(f.path, f.default);
    Ok(TensorNames {
        input_ids: named(INPUT_IDS)?,
        attention_mask: named(ATTENTION_MASK)?,
        position_ids: r.name(POSITION_IDS.path, None)?,
        past_key: template(PAST_KEY_NAMES)?,
        past_value: template(PAST_VALUE_NAMES)?,
        logits: named(LOGITS)?,
        present_key: template(PRESENT_KEY_NAMES)?,
        present_value: template(PRESENT_VALUE_NAMES)?,
        paged: PagedNames {
            block_table: named(BLOCK_TABLE)?,
            cumulative_sequence_lengths: named(CUMULATIVE_SEQUENCE_LENGTHS)?,
            past_sequence_lengths: named(PAST_SEQUENCE_LENGTHS)?,
            attention_metadata: named(ATTENTION_METADATA)?,
            logits_indices: named(LOGITS_INDICES)?,
        },
    })
}

/// `engine.dynamic_batching.block_size`, at least 1 and at most the engine's largest block.
/// (ONNX Runtime's PagedAttention wants a power of two of at least 16, which its session checks;
/// a reference-kernel folder runs any size.)
fn read_paged_block_size(r: &Reader<'_>) -> Result<Option<u32>> {
    const PATH: &str = "engine.dynamic_batching.block_size";
    const MAX_BLOCK_SIZE: u32 = 4096;
    let Some(value) = r.get(PATH) else { return Ok(None) };
    let block_size = r.count(PATH, value, 1)?;
    if block_size > MAX_BLOCK_SIZE {
        return Err(load_error(r.file, format!("{PATH} must be at most {MAX_BLOCK_SIZE}, got {block_size}")));
    }
    Ok(Some(block_size))
}

/// `model.decoder.state_groups` (onnxruntime-genai's builder writes it for paged-attention
/// folders): one `paged_kv` group holding every layer is the paged KV ortex keeps; any other
/// group is state ortex does not implement.
fn read_state_groups(r: &Reader<'_>, num_layers: u32) -> Result<()> {
    const PATH: &str = "model.decoder.state_groups";
    let Some(value) = r.get(PATH) else { return Ok(()) };
    let refuse = |what: String| {
        Err(load_error(r.file, format!("{PATH}: {what}; ortex refuses the model rather than run it wrong")))
    };
    let Some(groups) = value.as_array() else { return refuse(format!("must be an array, got {value}")) };
    let mut layers = Vec::new();
    for group in groups {
        match group.get("kind").and_then(Value::as_str) {
            Some("paged_kv") => {}
            kind => {
                return refuse(format!("the state group {kind:?} (convolution or recurrent state) is not implemented"))
            }
        }
        for id in group.get("layer_ids").and_then(Value::as_array).into_iter().flatten() {
            layers.push(r.count(&format!("{PATH}.layer_ids"), id, 0)?);
        }
    }
    layers.sort_unstable();
    if layers != (0..num_layers).collect::<Vec<u32>>() {
        return refuse(format!("paged_kv groups must hold each of the {num_layers} layers once, got {layers:?}"));
    }
    Ok(())
}

/// `model.decoder.sliding_window`: the window size and the layers it applies to (none listed:
/// every layer, as onnxruntime-genai reads it). Sliding the inputs or the cache along a long
/// prompt (an older scheme for fixed-size graphs) is refused.
fn read_sliding_window(r: &Reader<'_>, num_layers: u32) -> Result<Option<SlidingWindow>> {
    const PATH: &str = "model.decoder.sliding_window";
    if r.get(PATH).is_none() {
        return Ok(None);
    }
    r.object(PATH)?;
    for flag in ["slide_key_value_cache", "slide_inputs"] {
        let path = format!("{PATH}.{flag}");
        match r.get(&path) {
            None | Some(Value::Bool(false)) => {}
            Some(Value::Bool(true)) => {
                return Err(load_error(
                    r.file,
                    format!("{path} is true: sliding the inputs or the KV cache along the prompt is not implemented"),
                ))
            }
            Some(other) => return Err(load_error(r.file, format!("{path} must be true or false, got {other}"))),
        }
    }
    let window_size = r.int(&format!("{PATH}.window_size"), 1)?;
    let layers_path = format!("{PATH}.layers");
    let layers = match r.get(&layers_path) {
        None => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| {
                let layer = r.count(&layers_path, v, 0)?;
                if layer >= num_layers {
                    return Err(load_error(r.file, format!("{layers_path} names layer {layer} of {num_layers}")));
                }
                Ok(layer)
            })
            .collect::<Result<Vec<u32>>>()?,
        Some(other) => {
            return Err(load_error(r.file, format!("{layers_path} must be an array of layer indices, got {other}")))
        }
    };
    Ok(Some(SlidingWindow { window_size, layers }))
}

impl ModelConfig {
    /// The tiny model's config (2 layers, 4 heads, 2 KV heads of 16), for other modules' tests.
    #[cfg(test)]
    pub(crate) fn for_tests(sliding_window: Option<SlidingWindow>) -> ModelConfig {
        use contract::*;
        let names = TensorNames {
            input_ids: INPUT_IDS.default.into(),
            attention_mask: ATTENTION_MASK.default.into(),
            position_ids: None,
            past_key: PAST_KEY_NAMES.default.into(),
            past_value: PAST_VALUE_NAMES.default.into(),
            logits: LOGITS.default.into(),
            present_key: PRESENT_KEY_NAMES.default.into(),
            present_value: PRESENT_VALUE_NAMES.default.into(),
            paged: PagedNames {
                block_table: BLOCK_TABLE.default.into(),
                cumulative_sequence_lengths: CUMULATIVE_SEQUENCE_LENGTHS.default.into(),
                past_sequence_lengths: PAST_SEQUENCE_LENGTHS.default.into(),
                attention_metadata: ATTENTION_METADATA.default.into(),
                logits_indices: LOGITS_INDICES.default.into(),
            },
        };
        ModelConfig {
            dir: "m".into(),
            model_file: "m/model.onnx".into(),
            vocab_size: 512,
            context_length: 2048,
            bos_token_id: None,
            eos_token_ids: vec![2],
            pad_token_id: 0,
            head_size: 16,
            hidden_size: 64,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            num_hidden_layers: 2,
            names,
            model_type: "llama".into(),
            sliding_window,
            paged_block_size: None,
        }
    }
}

/// `model.eos_token_id`: a number or an array of numbers (onnxruntime-genai accepts both).
fn read_eos(r: &Reader<'_>, vocab_size: u32) -> Result<Vec<i32>> {
    const PATH: &str = "model.eos_token_id";
    let value = r.required(PATH)?;
    let items: Vec<&Value> = match value {
        Value::Array(items) if !items.is_empty() => items.iter().collect(),
        Value::Array(_) => return Err(load_error(r.file, format!("{PATH} must not be an empty array"))),
        single => vec![single],
    };
    items
        .into_iter()
        .map(|v| {
            let id = r.count(PATH, v, 0)?;
            if id >= vocab_size {
                return Err(load_error(r.file, format!("{PATH} {id} is outside the vocabulary of {vocab_size}")));
            }
            Ok(id as i32)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ortex_core::ErrorCode;
    use serde_json::json;

    /// A fresh folder under the system temp dir, removed on drop.
    pub(crate) struct TempDir(pub PathBuf);

    impl TempDir {
        pub fn new(tag: &str) -> TempDir {
            static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let dir = std::env::temp_dir().join(format!("ortex-ort-{tag}-{}-{n}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn tiny() -> Value {
        json!({
            "model": {
                "bos_token_id": 1,
                "context_length": 2048,
                "decoder": {
                    "session_options": { "log_id": "onnxruntime-genai", "provider_options": [] },
                    "filename": "model.onnx",
                    "head_size": 16,
                    "hidden_size": 64,
                    "inputs": {
                        "input_ids": "input_ids",
                        "attention_mask": "attention_mask",
                        "position_ids": "position_ids",
                        "past_key_names": "past_key_values.%d.key",
                        "past_value_names": "past_key_values.%d.value"
                    },
                    "outputs": {
                        "logits": "logits",
                        "present_key_names": "present.%d.key",
                        "present_value_names": "present.%d.value"
                    },
                    "num_attention_heads": 4,
                    "num_hidden_layers": 2,
                    "num_key_value_heads": 2
                },
                "eos_token_id": 2,
                "pad_token_id": 0,
                "type": "llama",
                "vocab_size": 512
            },
            "search": { "max_length": 2048, "past_present_share_buffer": false }
        })
    }

    fn load_text(text: &str) -> Result<ModelConfig> {
        let dir = TempDir::new("config");
        std::fs::write(dir.0.join(CONFIG_FILE), text).unwrap();
        ModelConfig::load(&dir.0)
    }

    fn load_json(value: &Value) -> Result<ModelConfig> {
        load_text(&value.to_string())
    }

    /// The error is MODEL_LOAD, names genai_config.json, and says `reason`.
    fn expect_error(result: Result<ModelConfig>, reason: &str) {
        let error = result.expect_err("the config was accepted");
        assert_eq!(error.code, ErrorCode::ModelLoad, "{}", error.message);
        assert!(error.message.contains(CONFIG_FILE), "the file is not named: {}", error.message);
        assert!(error.message.contains(reason), "expected {reason:?} in: {}", error.message);
    }

    fn edit(f: impl FnOnce(&mut Value)) -> Value {
        let mut value = tiny();
        f(&mut value);
        value
    }

    #[test]
    fn reads_a_builder_config() {
        let config = load_json(&tiny()).unwrap();
        assert_eq!(config.vocab_size, 512);
        assert_eq!(config.context_length, 2048);
        assert_eq!(config.eos_token_ids, vec![2]);
        assert_eq!(config.pad_token_id, 0);
        assert_eq!(config.bos_token_id, Some(1));
        assert_eq!((config.head_size, config.num_key_value_heads, config.num_hidden_layers), (16, 2, 2));
        assert_eq!(config.names.position_ids.as_deref(), Some("position_ids"));
        assert_eq!(TensorNames::layer(&config.names.present_value, 1), "present.1.value");
        assert!(config.model_file.ends_with("model.onnx"));
        assert_eq!(config.kv_width(), 32);
    }

    #[test]
    fn accepts_an_eos_array_and_no_position_ids() {
        let value = edit(|v| {
            v["model"]["eos_token_id"] = json!([2, 5]);
            v["model"]["decoder"]["inputs"].as_object_mut().unwrap().remove("position_ids");
        });
        let config = load_json(&value).unwrap();
        assert_eq!(config.eos_token_ids, vec![2, 5]);
        assert_eq!(config.names.position_ids, None);
    }

    #[test]
    fn a_missing_folder_or_file_is_model_load() {
        let missing = std::env::temp_dir().join("ortex-ort-no-such-folder-ever");
        let error = ModelConfig::load(&missing).unwrap_err();
        assert_eq!(error.code, ErrorCode::ModelLoad);
        assert!(error.message.contains("does not exist"), "{}", error.message);

        let empty = TempDir::new("empty");
        expect_error(ModelConfig::load(&empty.0), "missing");
    }

    #[test]
    fn corrupt_json_is_model_load() {
        expect_error(load_text("{\"model\": {"), "not valid JSON");
        expect_error(load_text(""), "not valid JSON");
        expect_error(load_text("[1, 2]"), "JSON object");
        expect_error(load_text("{}"), "model is missing");
    }

    #[test]
    fn missing_and_mistyped_fields_are_model_load() {
        expect_error(
            load_json(&edit(|v| {
                v["model"]["decoder"].as_object_mut().unwrap().remove("head_size");
            })),
            "model.decoder.head_size is missing",
        );
        expect_error(load_json(&edit(|v| v["model"]["vocab_size"] = json!("512"))), "model.vocab_size must be");
        expect_error(load_json(&edit(|v| v["model"]["vocab_size"] = json!(-1))), "model.vocab_size must be");
        expect_error(load_json(&edit(|v| v["model"]["vocab_size"] = json!(1.5))), "model.vocab_size must be");
        expect_error(load_json(&edit(|v| v["model"]["decoder"]["num_hidden_layers"] = json!(0))), "at least 1");
        expect_error(
            load_json(&edit(|v| v["model"]["decoder"]["filename"] = json!(7))),
            "model.decoder.filename must be",
        );
        expect_error(
            load_json(&edit(|v| v["model"]["decoder"]["filename"] = json!("../elsewhere.onnx"))),
            "inside the folder",
        );
        expect_error(
            load_json(&edit(|v| v["model"]["decoder"]["inputs"]["past_key_names"] = json!("past.key"))),
            "must contain %d",
        );
        expect_error(load_json(&edit(|v| v["model"]["eos_token_id"] = json!([]))), "empty array");
    }

    #[test]
    fn every_field_a_builder_writes_is_in_the_table() {
        // What onnxruntime-genai 0.18's builder writes for a CPU decoder (docs/model-format.md).
        let value = edit(|v| {
            v["model"]["eot_token_id"] = json!(3);
            v["search"] = json!({
                "diversity_penalty": 0.0, "do_sample": false, "early_stopping": true, "length_penalty": 1.0,
                "max_length": 2048, "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
                "num_return_sequences": 1, "past_present_share_buffer": true, "repetition_penalty": 1.0,
                "temperature": 1.0, "top_k": 50, "top_p": 1.0
            });
            v["model"]["decoder"]["session_options"]["intra_op_num_threads"] = json!(2);
            v["model"]["decoder"]["session_options"]["ep.cuda.fpa_intb_gemm"] = json!("1");
        });
        let config = load_json(&value).unwrap();
        assert_eq!(config.model_type, "llama");
        assert_eq!(config.sliding_window, None);
        assert_eq!(config.window_of(0), None);
    }

    #[test]
    fn a_field_that_is_not_understood_fails_naming_it() {
        expect_error(
            load_json(&edit(|v| v["model"]["decoder"]["final_logit_softcapping"] = json!(30.0))),
            "model.decoder.final_logit_softcapping is not a field ortex understands",
        );
        expect_error(
            load_json(&edit(|v| v["model"]["rope_scaling"] = json!({"type": "yarn", "factor": 4.0}))),
            "model.rope_scaling is not a field ortex understands",
        );
        expect_error(
            load_json(&edit(|v| v["model"]["decoder"]["inputs"]["inputs_embeds"] = json!("inputs_embeds"))),
            "model.decoder.inputs.inputs_embeds is not a field",
        );
        expect_error(
            load_json(&edit(|v| v["model"]["decoder"]["outputs"]["output_cross_qk_names"] = json!("x.%d"))),
            "model.decoder.outputs.output_cross_qk_names",
        );
        expect_error(load_json(&edit(|v| v["search"]["beam_magic"] = json!(1))), "search.beam_magic");
        expect_error(load_json(&edit(|v| v["extra"] = json!({}))), "extra is not a field");
    }

    #[test]
    fn parts_ortex_does_not_implement_are_refused_with_a_reason() {
        let cases = [
            ("vision", "model.vision: vision parts are not implemented"),
            ("speech", "model.speech: speech parts are not implemented"),
            ("encoder", "model.encoder: encoder-decoder"),
            ("embedding", "model.embedding"),
        ];
        for (key, reason) in cases {
            expect_error(load_json(&edit(|v| v["model"][key] = json!({"filename": "x.onnx"}))), reason);
        }
        expect_error(
            load_json(&edit(|v| v["model"]["decoder"]["pipeline"] = json!([{"a": {}}, {"b": {}}]))),
            "model.decoder.pipeline: a pipeline of several decoder sessions",
        );
        expect_error(
            load_json(&edit(|v| v["model"]["decoder"]["layer_types"] = json!(["conv", "full_attention"]))),
            "model.decoder.layer_types",
        );
        expect_error(
            load_json(&edit(|v| v["model"]["decoder"]["session_options"]["custom_ops_library"] = json!("x.so"))),
            "custom_ops_library",
        );
        expect_error(load_json(&edit(|v| v["model"]["type"] = json!("whisper"))), "model.type \"whisper\"");
        expect_error(
            load_json(&edit(|v| {
                v["model"]["decoder"].as_object_mut().unwrap().remove("filename");
            })),
            "model.decoder.filename is missing",
        );
    }

    #[test]
    fn a_sliding_window_is_read_with_its_layers() {
        let window = |w: Value| edit(|v| v["model"]["decoder"]["sliding_window"] = w);
        let config = load_json(&window(json!({
            "window_size": 512, "slide_key_value_cache": false, "slide_inputs": false, "layers": [0], "cache_slack": 0
        })))
        .unwrap();
        assert_eq!(config.sliding_window, Some(SlidingWindow { window_size: 512, layers: vec![0] }));
        assert_eq!((config.window_of(0), config.window_of(1)), (Some(512), None));
        // No layers listed: every layer (as onnxruntime-genai allocates it).
        let all = load_json(&window(json!({"window_size": 64, "layers": []}))).unwrap();
        assert_eq!((all.window_of(0), all.window_of(1)), (Some(64), Some(64)));
        expect_error(load_json(&window(json!({"window_size": 64, "layers": [2]}))), "names layer 2 of 2");
        expect_error(load_json(&window(json!({"window_size": 0}))), "window_size must be at least 1");
        expect_error(
            load_json(&window(json!({"window_size": 64, "slide_key_value_cache": true}))),
            "slide_key_value_cache is true",
        );
        expect_error(load_json(&window(json!({"window_size": 64, "stride": 2}))), "sliding_window.stride");
    }

    /// What onnxruntime-genai 0.18's builder writes for `use_paged_attention=true prune_lm_head=true`.
    fn paged() -> Value {
        edit(|v| {
            v["model"]["decoder"]["inputs"] = json!({
                "input_ids": "input_ids",
                "block_table": "block_table",
                "cumulative_sequence_lengths": "cumulative_sequence_lengths",
                "past_sequence_lengths": "past_sequence_lengths",
                "attention_metadata": "attention_metadata",
                "logits_indices": "logits_indices",
                "past_key_names": "past_key_values.%d.key",
                "past_value_names": "past_key_values.%d.value"
            });
            v["model"]["decoder"]["state_groups"] = json!([{"kind": "paged_kv", "layer_ids": [0, 1]}]);
            v["engine"] = json!({"dynamic_batching": {
                "block_size": 256, "max_batch_size": 100, "gpu_utilization_factor": 0.6, "max_scheduled_tokens": 2048
            }});
            v["search"]["chunk_size"] = json!(512);
        })
    }

    #[test]
    fn a_paged_builder_config_gives_its_block_size_and_input_names() {
        let config = load_json(&paged()).unwrap();
        assert_eq!(config.paged_block_size, Some(256));
        assert_eq!(config.names.paged.block_table, "block_table");
        assert_eq!(config.names.paged.logits_indices, "logits_indices");
        assert_eq!(load_json(&tiny()).unwrap().paged_block_size, None);
        let with_pins = edit(|v| v["engine"] = json!({"dynamic_batching": {"block_size": 16, "num_blocks": 64}}));
        assert_eq!(load_json(&with_pins).unwrap().paged_block_size, Some(16));
        let renamed = load_json(&edit(|v| v["model"]["decoder"]["inputs"]["block_table"] = json!("tables"))).unwrap();
        assert_eq!(renamed.names.paged.block_table, "tables");
    }

    #[test]
    fn paged_configs_ortex_cannot_run_are_refused_naming_the_field() {
        let paged_with = |f: fn(&mut Value)| {
            let mut value = paged();
            f(&mut value);
            load_json(&value)
        };
        expect_error(
            paged_with(|v| v["engine"]["dynamic_batching"]["block_size"] = json!(8192)),
            "engine.dynamic_batching.block_size must be at most 4096",
        );
        expect_error(paged_with(|v| v["engine"]["dynamic_batching"]["block_size"] = json!(0)), "at least 1");
        expect_error(
            paged_with(|v| v["model"]["decoder"]["inputs"]["block_table_windowed"] = json!("block_table_windowed")),
            "block_table_windowed: sliding-window layers served from a ring of blocks",
        );
        expect_error(
            paged_with(|v| {
                v["model"]["decoder"]["state_groups"] = json!([
                    {"kind": "paged_kv", "layer_ids": [1]}, {"kind": "fixed_conv", "layer_ids": [0]}
                ])
            }),
            "state group Some(\"fixed_conv\")",
        );
        expect_error(
            paged_with(|v| v["model"]["decoder"]["state_groups"] = json!([{"kind": "paged_kv", "layer_ids": [0]}])),
            "each of the 2 layers once",
        );
        expect_error(
            paged_with(|v| v["engine"]["static_batching"] = json!({})),
            "engine.static_batching is not a field",
        );
    }

    #[test]
    fn inconsistent_dimensions_are_model_load() {
        expect_error(
            load_json(&edit(|v| v["model"]["decoder"]["num_key_value_heads"] = json!(3))),
            "not a multiple of model.decoder.num_key_value_heads",
        );
        expect_error(load_json(&edit(|v| v["model"]["eos_token_id"] = json!(512))), "outside the vocabulary");
        expect_error(load_json(&edit(|v| v["model"]["pad_token_id"] = json!(9999))), "outside the vocabulary");
    }
}
