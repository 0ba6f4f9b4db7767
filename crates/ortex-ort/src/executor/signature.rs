//! The model's signature: the tensor names genai_config.json gives, expanded per layer; the
//! attention form; and the check at load that the session has exactly those inputs and outputs,
//! of the types and shapes ortex feeds and reads (docs/model-format.md), which also gives the
//! KV tensors' element type ([`KvSpec`]).

mod paged;

use ort::session::Session;
use ort::value::{Outlet, TensorElementType, ValueType};
use ortex_core::{OrtexError, Result};

use super::{load_error, AttentionForm};
use crate::config::{ModelConfig, TensorNames};
use crate::kv_element::KvElement;
use crate::layer_attention::AttentionPlan;
use crate::past_present_buffer;

/// What the model's KV tensors and logits are, beyond their names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvSpec {
    /// The element type of every past input and present output (the KV store keeps this type).
    pub element: KvElement,
    /// The logits' element type (converted to f32 for sampling).
    pub logits: KvElement,
    /// Per KV input (`Names::past` order): the least sequence width its past tensor may have,
    /// 0 for none. A GroupQueryAttention layer with `sliding_window_cache = 1` needs a buffer
    /// at least as wide as its window (ONNX Runtime refuses narrower ones); ortex also keeps it
    /// wider than every row's positions, so the kernel never compacts it and row b's positions
    /// stay at `[0, past_b + n_b)` as in every other layer.
    pub min_width: Vec<usize>,
}

impl KvSpec {
    /// The sequence width of past input `index` for an invocation whose longest row ends at
    /// `end` (= P + S) with the longest past `past`: `past` for ordinary layers; for windowed
    /// caches at least the window and `end`, with headroom so that carried decodes keep fitting.
    pub fn past_width(&self, index: usize, past: usize, end: usize, context_length: usize) -> usize {
        match self.min_width[index] {
            0 => past,
            window => window.max(past_present_buffer::width_for(end.saturating_sub(1), context_length)),
        }
    }

    /// The widest window any past input needs (0 for none).
    pub fn widest_window(&self) -> usize {
        self.min_width.iter().copied().max().unwrap_or(0)
    }

    /// Bytes of the KV of one position, all layers, keys and values.
    pub fn bytes_per_position(&self, config: &ModelConfig) -> u64 {
        2 * u64::from(config.num_hidden_layers) * config.kv_width() as u64 * self.element.bytes() as u64
    }
}
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

/// A graph that takes a block table is paged (onnxruntime-genai's `use_paged_attention`, or
/// `ortex make-model --attention paged`); else metadata `ortex.attention` when the model has it
/// (ortex make-model); otherwise a model without `position_ids` is a builder
/// GroupQueryAttention model (docs/model-format.md).
pub(super) fn detect_form(config: &ModelConfig, session: &Session) -> AttentionForm {
    if session.inputs().iter().any(|o| o.name() == config.names.paged.block_table) {
        return AttentionForm::Paged;
    }
    let declared = session.metadata().ok().and_then(|m| m.custom("ortex.attention"));
    match declared.as_deref() {
        Some("mha") => AttentionForm::Mha,
        Some("gqa") => AttentionForm::Gqa,
        _ if config.names.position_ids.is_some() => AttentionForm::Mha,
        _ => AttentionForm::Gqa,
    }
}

/// The session's inputs and outputs must be exactly what genai_config.json names, with KV of one
/// float type and the configured shape, and logits as wide as the vocabulary.
pub(super) fn check_signature(
    config: &ModelConfig,
    session: &Session,
    names: &Names,
    plan: &AttentionPlan,
    form: AttentionForm,
) -> Result<KvSpec> {
    let check = SignatureCheck { config, session, names };
    if form == AttentionForm::Paged {
        return check.paged();
    }
    check.names_match()?;
    let element = check.kv_types_and_shapes()?;
    check.id_types()?;
    let logits = check.logits_width()?;
    let min_width = (0..names.past.len()).map(|index| plan.window_cache_width(index / 2)).collect();
    Ok(KvSpec { element, logits, min_width })
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
                "{}: {} must be a {ty:?} tensor of rank {rank} (what ortex feeds)",
                self.config.model_file.display(),
                outlet.name()
            ))),
        }
    }

    /// The tensor's float element type and static shape, when it is a float32, float16 or
    /// bfloat16 tensor of rank `rank`.
    fn expect_float(&self, outlet: &Outlet, rank: usize) -> Result<(KvElement, Vec<i64>)> {
        match outlet.dtype() {
            ValueType::Tensor { ty, shape, .. } if shape.len() == rank => match KvElement::of(*ty) {
                Some(element) => Ok((element, shape.to_vec())),
                None => Err(load_error(format!(
                    "{}: {} is a {ty:?} tensor; ortex runs float32, float16 and bfloat16 KV and logits",
                    self.config.model_file.display(),
                    outlet.name()
                ))),
            },
            _ => Err(load_error(format!(
                "{}: {} must be a tensor of rank {rank}",
                self.config.model_file.display(),
                outlet.name()
            ))),
        }
    }

    /// Every past input and present output of the same element type as the first past input.
    fn same_element(&self, outlet: &Outlet, first: KvElement, rank: usize) -> Result<Vec<i64>> {
        let (element, shape) = self.expect_float(outlet, rank)?;
        if element != first {
            return Err(load_error(format!(
                "{}: {} is {} but {} is {}; ortex keeps one KV element type",
                self.config.model_file.display(),
                outlet.name(),
                element.name(),
                self.names.past[0],
                first.name()
            )));
        }
        Ok(shape)
    }

    /// Past inputs `[B, KH, P, D]` with the configured KV heads and head size; present outputs
    /// of rank 4; all of one float type, which is returned.
    fn kv_types_and_shapes(&self) -> Result<KvElement> {
        let first = self.expect_float(self.find_input(&self.names.past[0]).expect("checked"), 4)?.0;
        for name in &self.names.past {
            let shape = self.same_element(self.find_input(name).expect("checked"), first, 4)?;
            self.check_kv_heads(&shape, name, 1)?;
        }
        for name in &self.names.present {
            self.same_element(self.find_output(name).expect("checked"), first, 4)?;
        }
        Ok(first)
    }

    /// KV tensor `name`'s KV heads (dimension `heads_axis`) and head size (dimension 3) as
    /// configured, where static.
    fn check_kv_heads(&self, shape: &[i64], name: &str, heads_axis: usize) -> Result<()> {
        let (kv_heads, head_size) = (i64::from(self.config.num_key_value_heads), i64::from(self.config.head_size));
        check_dim(shape, heads_axis, kv_heads).map_err(|got| {
            self.mismatch(format!("has model.decoder.num_key_value_heads {kv_heads} but {name} has {got} KV heads"))
        })?;
        check_dim(shape, 3, head_size)
            .map_err(|got| self.mismatch(format!("has model.decoder.head_size {head_size} but {name} has {got}")))
    }

    fn id_types(&self) -> Result<()> {
        let names = self.names;
        for name in std::iter::once(&names.input_ids).chain(&names.position_ids).chain([&names.attention_mask]) {
            self.expect_type(self.find_input(name).expect("checked"), TensorElementType::Int64, 2)?;
        }
        Ok(())
    }

    /// Logits `[B, S, V]` with `V` the configured vocabulary; returns their element type.
    fn logits_width(&self) -> Result<KvElement> {
        let (name, vocab_size) = (&self.names.logits, self.config.vocab_size);
        let outlet = self.find_output(name).expect("checked");
        let (element, shape) = self.expect_float(outlet, 3)?;
        check_dim(&shape, 2, i64::from(vocab_size)).map_err(|got| {
            self.mismatch(format!("has model.vocab_size {vocab_size} but the model's {name} are {got} wide"))
        })?;
        Ok(element)
    }
}
