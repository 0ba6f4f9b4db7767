//! The model's signature: the tensor names genai_config.json gives, expanded per layer; the
//! attention form; and the check at load that the session has exactly those inputs and outputs,
//! of the types and shapes ortex feeds and reads (docs/model-format.md).

use ort::session::Session;
use ort::value::{Outlet, TensorElementType, ValueType};
use ortex_core::{OrtexError, Result};

use super::{load_error, AttentionForm};
use crate::config::{ModelConfig, TensorNames};

/// Tensor names, expanded per layer once at load.
pub(super) struct Names {
    pub(super) input_ids: String,
    pub(super) attention_mask: String,
    pub(super) position_ids: Option<String>,
    pub(super) logits: String,
    /// `past[2 * layer + kind]`, `present[2 * layer + kind]` (kind 0 = key, 1 = value).
    pub(super) past: Vec<String>,
    pub(super) present: Vec<String>,
}

impl Names {
    pub(super) fn of(config: &ModelConfig) -> Names {
        let layers = config.num_hidden_layers as usize;
        let n = &config.names;
        let mut past = Vec::with_capacity(2 * layers);
        let mut present = Vec::with_capacity(2 * layers);
        for layer in 0..layers {
            past.push(TensorNames::layer(&n.past_key, layer));
            past.push(TensorNames::layer(&n.past_value, layer));
            present.push(TensorNames::layer(&n.present_key, layer));
            present.push(TensorNames::layer(&n.present_value, layer));
        }
        Names {
            input_ids: n.input_ids.clone(),
            attention_mask: n.attention_mask.clone(),
            position_ids: n.position_ids.clone(),
            logits: n.logits.clone(),
            past,
            present,
        }
    }
}

/// Metadata `ortex.attention` when the model has it (ortex make-model); otherwise a model
/// without `position_ids` is a builder GroupQueryAttention model (docs/model-format.md).
pub(super) fn detect_form(config: &ModelConfig, session: &Session) -> AttentionForm {
    let declared = session.metadata().ok().and_then(|m| m.custom("ortex.attention"));
    match declared.as_deref() {
        Some("mha") => AttentionForm::Mha,
        Some("gqa") => AttentionForm::Gqa,
        _ if config.names.position_ids.is_some() => AttentionForm::Mha,
        _ => AttentionForm::Gqa,
    }
}

/// The session's inputs and outputs must be exactly what genai_config.json names, with float32
/// KV of the configured shape and logits as wide as the vocabulary.
pub(super) fn check_signature(config: &ModelConfig, session: &Session, names: &Names) -> Result<()> {
    let check = SignatureCheck { config, session, names };
    check.names_match()?;
    check.kv_types_and_shapes()?;
    check.id_types()?;
    check.logits_width()
}

/// A static dimension must equal `want`; a symbolic one (-1) passes. Err carries the actual.
fn check_dim(shape: &[i64], axis: usize, want: i64) -> Result<(), i64> {
    match shape.get(axis) {
        Some(&d) if d >= 0 && d != want => Err(d),
        _ => Ok(()),
    }
}

struct SignatureCheck<'a> {
    config: &'a ModelConfig,
    session: &'a Session,
    names: &'a Names,
}

impl SignatureCheck<'_> {
    /// genai_config.json says something the model contradicts.
    fn mismatch(&self, what: String) -> OrtexError {
        let (config_file, model_file) = (self.config.config_file(), &self.config.model_file);
        load_error(format!("{}: {what} ({} does not match it)", config_file.display(), model_file.display()))
    }

    fn find_input(&self, name: &str) -> Option<&Outlet> {
        self.session.inputs().iter().find(|o| o.name() == name)
    }

    fn find_output(&self, name: &str) -> Option<&Outlet> {
        self.session.outputs().iter().find(|o| o.name() == name)
    }

    /// Every input named is fed and nothing else; every output named exists.
    fn names_match(&self) -> Result<()> {
        let names = self.names;
        let mut fed: Vec<&str> = vec![&names.input_ids, &names.attention_mask];
        fed.extend(names.position_ids.as_deref());
        fed.extend(names.past.iter().map(String::as_str));
        for name in &fed {
            if self.find_input(name).is_none() {
                return Err(self.mismatch(format!("names the input {name:?}, which the model does not have")));
            }
        }
        if let Some(extra) = self.session.inputs().iter().find(|o| !fed.contains(&o.name())) {
            return Err(self.mismatch(format!("does not name the model's input {:?}", extra.name())));
        }
        for name in std::iter::once(&names.logits).chain(&names.present) {
            if self.find_output(name).is_none() {
                return Err(self.mismatch(format!("names the output {name:?}, which the model does not have")));
            }
        }
        Ok(())
    }

    /// The tensor's static shape when it has the element type and rank ortex feeds or reads.
    fn expect_type(&self, outlet: &Outlet, ty: TensorElementType, rank: usize) -> Result<Vec<i64>> {
        match outlet.dtype() {
            ValueType::Tensor { ty: t, shape, .. } if *t == ty && shape.len() == rank => Ok(shape.to_vec()),
            _ => Err(load_error(format!(
                "{}: {} must be a {ty:?} tensor of rank {rank}; ortex runs float32 KV and logits and int64 ids",
                self.config.model_file.display(),
                outlet.name()
            ))),
        }
    }

    /// Past inputs `[B, KH, P, D]` with the configured KV heads and head size; present outputs
    /// float32 of rank 4.
    fn kv_types_and_shapes(&self) -> Result<()> {
        let kv_heads = i64::from(self.config.num_key_value_heads);
        let head_size = i64::from(self.config.head_size);
        for name in &self.names.past {
            let shape = self.expect_type(self.find_input(name).expect("checked"), TensorElementType::Float32, 4)?;
            check_dim(&shape, 1, kv_heads).map_err(|got| {
                self.mismatch(format!("has model.decoder.num_key_value_heads {kv_heads} but {name} has {got} KV heads"))
            })?;
            check_dim(&shape, 3, head_size).map_err(|got| {
                self.mismatch(format!("has model.decoder.head_size {head_size} but {name} has {got}"))
            })?;
        }
        for name in &self.names.present {
            self.expect_type(self.find_output(name).expect("checked"), TensorElementType::Float32, 4)?;
        }
        Ok(())
    }

    fn id_types(&self) -> Result<()> {
        let names = self.names;
        for name in std::iter::once(&names.input_ids).chain(&names.position_ids).chain([&names.attention_mask]) {
            self.expect_type(self.find_input(name).expect("checked"), TensorElementType::Int64, 2)?;
        }
        Ok(())
    }

    /// Logits `[B, S, V]` with `V` the configured vocabulary.
    fn logits_width(&self) -> Result<()> {
        let (name, vocab_size) = (&self.names.logits, self.config.vocab_size);
        let outlet = self.find_output(name).expect("checked");
        let shape = self.expect_type(outlet, TensorElementType::Float32, 3)?;
        check_dim(&shape, 2, i64::from(vocab_size)).map_err(|got| {
            self.mismatch(format!("has model.vocab_size {vocab_size} but the model's {name} are {got} wide"))
        })
    }
}
