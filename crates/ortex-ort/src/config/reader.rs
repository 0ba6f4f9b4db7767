//! Reading genai_config.json's fields by dotted path (`model.decoder.head_size`), each failure a
//! `ModelLoad` error naming the file and the field.

use std::path::Path;

use ortex_core::{ErrorCode, OrtexError, Result};
use serde_json::{Map, Value};

/// Largest vocabulary, context, head or layer count accepted (keeps every product in range).
const MAX_DIM: u64 = 1 << 24;

pub(super) fn load_error(file: &Path, reason: impl std::fmt::Display) -> OrtexError {
    OrtexError::new(ErrorCode::ModelLoad, format!("{}: {reason}", file.display()))
}

/// Reads a field path such as `model.decoder.head_size` from the parsed document.
pub(super) struct Reader<'a> {
    pub(super) file: &'a Path,
    pub(super) root: &'a Value,
}

impl<'a> Reader<'a> {
    pub(super) fn get(&self, path: &str) -> Option<&'a Value> {
        let mut at = self.root;
        for key in path.split('.') {
            at = at.as_object()?.get(key)?;
        }
        Some(at).filter(|v| !v.is_null())
    }

    pub(super) fn required(&self, path: &str) -> Result<&'a Value> {
        self.get(path).ok_or_else(|| load_error(self.file, format!("{path} is missing")))
    }

    pub(super) fn object(&self, path: &str) -> Result<&'a Map<String, Value>> {
        self.required(path)?.as_object().ok_or_else(|| load_error(self.file, format!("{path} must be an object")))
    }

    pub(super) fn count(&self, path: &str, value: &Value, min: u64) -> Result<u32> {
        match value.as_u64() {
            Some(n) if n >= min && n <= MAX_DIM => Ok(n as u32),
            Some(n) if n < min => Err(load_error(self.file, format!("{path} must be at least {min}, got {n}"))),
            Some(n) => Err(load_error(self.file, format!("{path} must be at most {MAX_DIM}, got {n}"))),
            None => Err(load_error(self.file, format!("{path} must be a non-negative integer, got {value}"))),
        }
    }

    /// A required integer `>= min`.
    pub(super) fn int(&self, path: &str, min: u64) -> Result<u32> {
        self.count(path, self.required(path)?, min)
    }

    /// An optional string, `default` when absent.
    pub(super) fn name(&self, path: &str, default: Option<&str>) -> Result<Option<String>> {
        match self.get(path) {
            None => Ok(default.map(str::to_string)),
            Some(Value::String(s)) if !s.is_empty() => Ok(Some(s.clone())),
            Some(other) => Err(load_error(self.file, format!("{path} must be a non-empty string, got {other}"))),
        }
    }

    pub(super) fn layer_template(&self, path: &str, default: &str) -> Result<String> {
        let template = self.name(path, Some(default))?.expect("defaulted");
        if !template.contains("%d") {
            return Err(load_error(self.file, format!("{path} must contain %d (the layer index), got {template:?}")));
        }
        Ok(template)
    }
}
