//! The past carried over: the previous decode invocation's present tensors, passed straight back
//! as this one's past ([`Carry`]).
//!
//! Gathering copies every row's whole past at every step, as much memory traffic as the model's
//! own attention. When the decode rows of a step are exactly the decode rows of the step before
//! (same requests, same order, each one token further), the previous invocation's `present`
//! tensors already are this invocation's past tensors in the padding contract's layout (gqa: each
//! row at `[0, past_b)`; mha: only when every row has the same past length, since mha puts new
//! keys at `P + j`). Then nothing is gathered; the blocks still receive every new position, so
//! the next change of batch composition gathers from them as usual. `ORTEX_CARRY_PRESENT=0`
//! turns carrying off. A windowed cache's present is as wide as its buffer (wider than `T`);
//! it carries while every row's next position still fits in it.

use std::borrow::Cow;

use ort::session::SessionOutputs;
use ort::value::DynValue;
use ortex_core::ids::RequestId;

use super::batch::{Batch, Inputs};
use super::signature::{KvSpec, Names};
use super::AttentionForm;
use crate::kv_element;

/// The present tensors of the last decode invocation, kept to serve as the next one's past.
pub(super) struct Carry {
    /// The step they were computed in.
    step: u64,
    /// The rows, in order, with the position each one's KV now ends at.
    rows: Vec<(RequestId, u32)>,
    /// Their sequence widths, per past input: the next invocation's `P` must equal an ordinary
    /// layer's; a windowed cache's must leave room for the next position.
    widths: Vec<usize>,
    /// One per past input, as `Names::past`.
    values: Vec<DynValue>,
}

impl Carry {
    /// Whether `batch` (a decode invocation) continues exactly these rows in the next step.
    pub(super) fn continues(&self, batch: Batch<'_>, form: AttentionForm, spec: &KvSpec) -> bool {
        let (plan, rows, dims) = (batch.plan, batch.rows, batch.dims);
        let same_rows = self.rows.len() == rows.len()
            && rows.iter().zip(&self.rows).all(|(&i, &(request, end))| {
                let row = &plan.rows[i as usize];
                row.request == request && row.start_position == end
            });
        let widths_fit = self.widths.iter().enumerate().all(|(index, &width)| match spec.min_width[index] {
            0 => width == dims.past,
            _ => width >= dims.total(),
        });
        self.step + 1 == plan.step && widths_fit && same_rows && present_is_past_layout(form, batch)
    }

    /// The present tensors of a decode invocation, taken out of its outputs, when their layout
    /// can be the next past.
    pub(super) fn keep(
        form: AttentionForm,
        names: &Names,
        batch: Batch<'_>,
        outputs: &mut SessionOutputs<'_>,
    ) -> Option<Carry> {
        if !present_is_past_layout(form, batch) {
            return None;
        }
        let mut values = Vec::with_capacity(names.present.len());
        let mut widths = Vec::with_capacity(names.present.len());
        for name in &names.present {
            let value = outputs.remove(name)?;
            widths.push(kv_element::sequence_width(&value)?);
            values.push(value);
        }
        let rows = batch.rows().map(|(_, row)| (row.request, row.start_position + row.token_count)).collect();
        Some(Carry { step: batch.plan.step, rows, widths, values })
    }

    /// The carried tensors as the past inputs.
    pub(super) fn push_inputs<'s>(&'s self, names: &'s Names, inputs: &mut Inputs<'s>) {
        for (name, value) in names.past.iter().zip(&self.values) {
            inputs.push((Cow::Borrowed(name.as_str()), value.into()));
        }
    }
}

/// Whether a decode's present is laid out as a past for the same rows: gqa puts each row's new
/// keys at its own past length; mha puts them at `P`, which is each row's own length only when
/// every row has the same past.
fn present_is_past_layout(form: AttentionForm, batch: Batch<'_>) -> bool {
    match form {
        AttentionForm::Gqa | AttentionForm::Paged => true,
        AttentionForm::Mha => batch.rows().all(|(_, row)| row.start_position as usize == batch.dims.past),
    }
}
