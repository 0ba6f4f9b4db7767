//! The folder contract's tensor names, defined once: each field of genai_config.json's
//! `model.decoder.inputs` and `model.decoder.outputs` and the name onnxruntime-genai's builder
//! gives that tensor, which ortex reads when the field is absent. The model tooling that writes
//! folders (ts/modelkit: `ortex make-model`, `ortex import`) takes them from
//! ts/generated/folder-contract.ts, which crates/ortex-typegen renders from these tables (with
//! [`super::fields`]' table of every field), so the names a folder is written with are the ones
//! it is read with.

/// A field naming a decoder tensor: its dotted path and the builder's name for the tensor (`%d`:
/// the layer, in the KV templates).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NameField {
    pub path: &'static str,
    pub default: &'static str,
}

impl NameField {
    /// The field's key within its object (`input_ids` of `model.decoder.inputs.input_ids`).
    pub fn key(&self) -> &'static str {
        self.path.rsplit('.').next().expect("a dotted path")
    }
}

const fn field(path: &'static str, default: &'static str) -> NameField {
    NameField { path, default }
}

pub const INPUT_IDS: NameField = field("model.decoder.inputs.input_ids", "input_ids");
pub const ATTENTION_MASK: NameField = field("model.decoder.inputs.attention_mask", "attention_mask");
pub const POSITION_IDS: NameField = field("model.decoder.inputs.position_ids", "position_ids");
pub const BLOCK_TABLE: NameField = field("model.decoder.inputs.block_table", "block_table");
pub const CUMULATIVE_SEQUENCE_LENGTHS: NameField =
    field("model.decoder.inputs.cumulative_sequence_lengths", "cumulative_sequence_lengths");
pub const PAST_SEQUENCE_LENGTHS: NameField =
    field("model.decoder.inputs.past_sequence_lengths", "past_sequence_lengths");
pub const ATTENTION_METADATA: NameField = field("model.decoder.inputs.attention_metadata", "attention_metadata");
pub const LOGITS_INDICES: NameField = field("model.decoder.inputs.logits_indices", "logits_indices");
pub const PAST_KEY_NAMES: NameField = field("model.decoder.inputs.past_key_names", "past_key_values.%d.key");
pub const PAST_VALUE_NAMES: NameField = field("model.decoder.inputs.past_value_names", "past_key_values.%d.value");
pub const LOGITS: NameField = field("model.decoder.outputs.logits", "logits");
pub const PRESENT_KEY_NAMES: NameField = field("model.decoder.outputs.present_key_names", "present.%d.key");
pub const PRESENT_VALUE_NAMES: NameField = field("model.decoder.outputs.present_value_names", "present.%d.value");

/// A paged-attention graph's step inputs, in the order onnxruntime-genai's builder lists them
/// (base.py make_genai_config).
pub const PAGED_INPUTS: &[NameField] =
    &[BLOCK_TABLE, CUMULATIVE_SEQUENCE_LENGTHS, PAST_SEQUENCE_LENGTHS, ATTENTION_METADATA, LOGITS_INDICES];

/// `model.decoder.inputs`, in the order the builder writes them (a graph has those of its form).
pub const DECODER_INPUTS: &[NameField] = &[
    INPUT_IDS,
    ATTENTION_MASK,
    POSITION_IDS,
    BLOCK_TABLE,
    CUMULATIVE_SEQUENCE_LENGTHS,
    PAST_SEQUENCE_LENGTHS,
    ATTENTION_METADATA,
    LOGITS_INDICES,
    PAST_KEY_NAMES,
    PAST_VALUE_NAMES,
];

/// `model.decoder.outputs`, in the order the builder writes them.
pub const DECODER_OUTPUTS: &[NameField] = &[LOGITS, PRESENT_KEY_NAMES, PRESENT_VALUE_NAMES];

#[cfg(test)]
mod tests {
    use super::super::fields::{Field, FIELDS};
    use super::*;

    /// The fields ortex reads under `prefix` (FIELDS' rows of kind Read), sorted.
    fn read_fields(prefix: &str) -> Vec<&'static str> {
        let mut paths: Vec<&str> = FIELDS
            .iter()
            .filter(|(path, f)| *f == Field::Read && path.strip_prefix(prefix).is_some_and(|rest| !rest.contains('.')))
            .map(|(path, _)| *path)
            .collect();
        paths.sort_unstable();
        paths
    }

    fn sorted_paths(fields: &[NameField]) -> Vec<&'static str> {
        let mut paths: Vec<&str> = fields.iter().map(|f| f.path).collect();
        paths.sort_unstable();
        paths
    }

    #[test]
    fn every_name_field_is_a_field_ortex_reads_and_the_reverse() {
        assert_eq!(read_fields("model.decoder.inputs."), sorted_paths(DECODER_INPUTS));
        assert_eq!(read_fields("model.decoder.outputs."), sorted_paths(DECODER_OUTPUTS));
        assert!(PAGED_INPUTS.iter().all(|f| DECODER_INPUTS.contains(f)));
        assert_eq!(PAST_KEY_NAMES.key(), "past_key_names");
    }
}
