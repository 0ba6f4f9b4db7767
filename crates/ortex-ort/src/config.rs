//! `genai_config.json` -> [`ModelConfig`]: onnxruntime-genai's model configuration, read and
//! checked before anything heavy happens. Every failure is `ErrorCode::ModelLoad` and names the
//! file and the field (docs/model-format.md, "genai_config.json").

use std::path::{Path, PathBuf};

use ortex_core::{ErrorCode, OrtexError, Result};
use serde_json::{Map, Value};

pub const CONFIG_FILE: &str = "genai_config.json";
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// Largest vocabulary, context, head or layer count accepted (keeps every product in range).
const MAX_DIM: u64 = 1 << 24;

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
}

fn load_error(file: &Path, reason: impl std::fmt::Display) -> OrtexError {
    OrtexError::new(ErrorCode::ModelLoad, format!("{}: {reason}", file.display()))
}

/// Reads a field path such as `model.decoder.head_size` from the parsed document.
struct Reader<'a> {
    file: &'a Path,
    root: &'a Value,
}

impl<'a> Reader<'a> {
    fn get(&self, path: &str) -> Option<&'a Value> {
        let mut at = self.root;
        for key in path.split('.') {
            at = at.as_object()?.get(key)?;
        }
        Some(at).filter(|v| !v.is_null())
    }

    fn required(&self, path: &str) -> Result<&'a Value> {
        self.get(path).ok_or_else(|| load_error(self.file, format!("{path} is missing")))
    }

    fn object(&self, path: &str) -> Result<&'a Map<String, Value>> {
        self.required(path)?.as_object().ok_or_else(|| load_error(self.file, format!("{path} must be an object")))
    }

    fn count(&self, path: &str, value: &Value, min: u64) -> Result<u32> {
        match value.as_u64() {
            Some(n) if n >= min && n <= MAX_DIM => Ok(n as u32),
            Some(n) if n < min => Err(load_error(self.file, format!("{path} must be at least {min}, got {n}"))),
            Some(n) => Err(load_error(self.file, format!("{path} must be at most {MAX_DIM}, got {n}"))),
            None => Err(load_error(self.file, format!("{path} must be a non-negative integer, got {value}"))),
        }
    }

    /// A required integer `>= min`.
    fn int(&self, path: &str, min: u64) -> Result<u32> {
        self.count(path, self.required(path)?, min)
    }

    /// An optional string, `default` when absent.
    fn name(&self, path: &str, default: Option<&str>) -> Result<Option<String>> {
        match self.get(path) {
            None => Ok(default.map(str::to_string)),
            Some(Value::String(s)) if !s.is_empty() => Ok(Some(s.clone())),
            Some(other) => Err(load_error(self.file, format!("{path} must be a non-empty string, got {other}"))),
        }
    }

    fn layer_template(&self, path: &str, default: &str) -> Result<String> {
        let template = self.name(path, Some(default))?.expect("defaulted");
        if !template.contains("%d") {
            return Err(load_error(self.file, format!("{path} must contain %d (the layer index), got {template:?}")));
        }
        Ok(template)
    }
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

    fn from_json(dir: &Path, file: &Path, root: &Value) -> Result<ModelConfig> {
        let r = Reader { file, root };
        if !root.is_object() {
            return Err(load_error(file, "the document must be a JSON object"));
        }
        r.object("model")?;
        r.object("model.decoder")?;
        let vocab_size = r.int("model.vocab_size", 1)?;
        let context_length = r.int("model.context_length", 2)?;
        let head_size = r.int("model.decoder.head_size", 1)?;
        let hidden_size = r.int("model.decoder.hidden_size", 1)?;
        let num_attention_heads = r.int("model.decoder.num_attention_heads", 1)?;
        let num_key_value_heads = r.int("model.decoder.num_key_value_heads", 1)?;
        let num_hidden_layers = r.int("model.decoder.num_hidden_layers", 1)?;
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(load_error(
                file,
                format!(
                    "model.decoder.num_attention_heads ({num_attention_heads}) is not a multiple of \
                     model.decoder.num_key_value_heads ({num_key_value_heads})"
                ),
            ));
        }
        let in_vocab = |path: &str, id: u32| -> Result<u32> {
            if id >= vocab_size {
                return Err(load_error(file, format!("{path} {id} is outside the vocabulary of {vocab_size}")));
            }
            Ok(id)
        };
        let pad_token_id = in_vocab("model.pad_token_id", r.int("model.pad_token_id", 0)?)?;
        let bos_token_id = match r.get("model.bos_token_id") {
            None => None,
            Some(v) => Some(in_vocab("model.bos_token_id", r.count("model.bos_token_id", v, 0)?)?),
        };
        let eos_token_ids = read_eos(&r, vocab_size)?;
        let filename = r
            .name("model.decoder.filename", None)?
            .ok_or_else(|| load_error(file, "model.decoder.filename is missing"))?;
        let model_file = dir.join(&filename);
        if Path::new(&filename).is_absolute() || filename.split(['/', '\\']).any(|part| part == "..") {
            return Err(load_error(
                file,
                format!("model.decoder.filename must name a file inside the folder, got {filename:?}"),
            ));
        }
        r.object("model.decoder.inputs")?;
        r.object("model.decoder.outputs")?;
        let names = TensorNames {
            input_ids: r.name("model.decoder.inputs.input_ids", Some("input_ids"))?.expect("defaulted"),
            attention_mask: r.name("model.decoder.inputs.attention_mask", Some("attention_mask"))?.expect("defaulted"),
            position_ids: r.name("model.decoder.inputs.position_ids", None)?,
            past_key: r.layer_template("model.decoder.inputs.past_key_names", "past_key_values.%d.key")?,
            past_value: r.layer_template("model.decoder.inputs.past_value_names", "past_key_values.%d.value")?,
            logits: r.name("model.decoder.outputs.logits", Some("logits"))?.expect("defaulted"),
            present_key: r.layer_template("model.decoder.outputs.present_key_names", "present.%d.key")?,
            present_value: r.layer_template("model.decoder.outputs.present_value_names", "present.%d.value")?,
        };
        Ok(ModelConfig {
            dir: dir.to_path_buf(),
            model_file,
            vocab_size,
            context_length,
            bos_token_id,
            eos_token_ids,
            pad_token_id,
            head_size,
            hidden_size,
            num_attention_heads,
            num_key_value_heads,
            num_hidden_layers,
            names,
        })
    }

    pub fn config_file(&self) -> PathBuf {
        self.dir.join(CONFIG_FILE)
    }

    pub fn tokenizer_file(&self) -> PathBuf {
        self.dir.join(TOKENIZER_FILE)
    }

    /// Floats of one KV head of one position.
    pub fn kv_width(&self) -> usize {
        self.num_key_value_heads as usize * self.head_size as usize
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
    fn inconsistent_dimensions_are_model_load() {
        expect_error(
            load_json(&edit(|v| v["model"]["decoder"]["num_key_value_heads"] = json!(3))),
            "not a multiple of model.decoder.num_key_value_heads",
        );
        expect_error(load_json(&edit(|v| v["model"]["eos_token_id"] = json!(512))), "outside the vocabulary");
        expect_error(load_json(&edit(|v| v["model"]["pad_token_id"] = json!(9999))), "outside the vocabulary");
    }
}
