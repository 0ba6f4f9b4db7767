//! The signature of a paged-attention graph (docs/model-format.md, "Paged attention"): all rows'
//! new tokens packed on one axis, the KV as pools of blocks, small int32 step inputs, and logits
//! of rank 2.

use ort::value::TensorElementType;
use ortex_core::Result;

use super::{check_dim, KvSpec, SignatureCheck};
use crate::kv_element::KvElement;

impl SignatureCheck<'_> {
    /// Checks a paged graph's inputs and outputs; returns its KV spec (no layer has a window
    /// cache: a paged folder with sliding-window layers is refused by its config).
    pub(super) fn paged(&self) -> Result<KvSpec> {
        let block_size = self.config.paged_block_size.ok_or_else(|| {
            self.mismatch(
                "has no engine.dynamic_batching.block_size, which a paged-attention graph needs (its KV is in \
                 blocks of that size)"
                    .into(),
            )
        })?;
        self.paged_names_match()?;
        let element = self.paged_kv(block_size)?;
        self.paged_int_inputs()?;
        let logits = self.paged_logits()?;
        Ok(KvSpec { element, logits, min_width: vec![0; self.names.past.len()] })
    }

    /// The required inputs are there (attention_metadata and logits_indices may be), nothing else
    /// is; every output named exists.
    fn paged_names_match(&self) -> Result<()> {
        let (names, paged) = (self.names, &self.config.names.paged);
        let mut required: Vec<&str> = vec![
            &names.input_ids,
            &paged.block_table,
            &paged.cumulative_sequence_lengths,
            &paged.past_sequence_lengths,
        ];
        required.extend(names.past.iter().map(String::as_str));
        for name in &required {
            if self.find_input(name).is_none() {
                return Err(self.mismatch(format!("names the input {name:?}, which the paged model does not have")));
            }
        }
        let optional = [paged.attention_metadata.as_str(), paged.logits_indices.as_str()];
        let known = |name: &str| required.contains(&name) || optional.contains(&name);
        if let Some(extra) = self.session.inputs().iter().find(|o| !known(o.name())) {
            return Err(self.mismatch(format!(
                "does not name the paged model's input {:?} (a paged graph takes packed ids, block tables and \
                 sequence lengths, no mask or positions)",
                extra.name()
            )));
        }
        for name in std::iter::once(&names.logits).chain(&names.present) {
            if self.find_output(name).is_none() {
                return Err(self.mismatch(format!("names the output {name:?}, which the model does not have")));
            }
        }
        Ok(())
    }

    /// Past inputs and present outputs `[num_blocks, block_size, kv_heads, head_size]` of one
    /// float type, with the configured block size, KV heads and head size where static.
    fn paged_kv(&self, block_size: u32) -> Result<KvElement> {
        let first = self.expect_float(self.find_input(&self.names.past[0]).expect("checked"), 4)?.0;
        let inputs = self.names.past.iter().map(|name| (name, self.find_input(name).expect("checked")));
        let outputs = self.names.present.iter().map(|name| (name, self.find_output(name).expect("checked")));
        for (name, outlet) in inputs.chain(outputs) {
            let shape = self.same_element(outlet, first, 4)?;
            check_dim(&shape, 1, i64::from(block_size)).map_err(|got| {
                self.mismatch(format!(
                    "has engine.dynamic_batching.block_size {block_size} but {name} has blocks of {got}"
                ))
            })?;
            self.check_kv_heads(&shape, name, 2)?;
        }
        Ok(first)
    }

    /// `input_ids` int64 `[num_tokens]`; `block_table` int32 `[batch, max_blocks]`; the lengths,
    /// metadata and logits indices int32 vectors.
    fn paged_int_inputs(&self) -> Result<()> {
        let paged = &self.config.names.paged;
        let input = |name: &str| self.find_input(name).expect("checked");
        self.expect_type(input(&self.names.input_ids), TensorElementType::Int64, 1)?;
        self.expect_type(input(&paged.block_table), TensorElementType::Int32, 2)?;
        for name in [&paged.cumulative_sequence_lengths, &paged.past_sequence_lengths] {
            self.expect_type(input(name), TensorElementType::Int32, 1)?;
        }
        for name in [&paged.attention_metadata, &paged.logits_indices] {
            if let Some(outlet) = self.find_input(name) {
                self.expect_type(outlet, TensorElementType::Int32, 1)?;
            }
        }
        Ok(())
    }

    /// Logits `[num_logits or num_tokens, V]` with `V` the configured vocabulary.
    fn paged_logits(&self) -> Result<KvElement> {
        let (name, vocab_size) = (&self.names.logits, self.config.vocab_size);
        let (element, shape) = self.expect_float(self.find_output(name).expect("checked"), 2)?;
        check_dim(&shape, 1, i64::from(vocab_size)).map_err(|got| {
            self.mismatch(format!("has model.vocab_size {vocab_size} but the model's {name} are {got} wide"))
        })?;
        Ok(element)
    }
}
