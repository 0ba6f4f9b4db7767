//! The past gathered: each row's past copied from its blocks in the paged KV store into the
//! model's contiguous past tensors `[B, KH, P, D]`, row b's past at `[0, past_b)`. The way every
//! invocation can take (prefills, and decodes whose rows changed since the last step).
//!
//! The tensors are views of buffers ([`GatheredPast`]) that grow to the largest invocation seen,
//! so nothing is allocated per token beyond what ONNX Runtime allocates for its outputs. A
//! windowed cache's past is wider than `P` (signature.rs, `KvSpec::past_width`).

use std::borrow::Cow;

use ortex_core::executor::ExecError;

use super::batch::{Batch, Inputs};
use super::fatal;
use super::signature::{KvSpec, Names};
use super::tensor_rows::TensorRows;
use crate::kv_element::{KvBuffer, KvElement};
use crate::kv_store::KvStore;

/// One buffer per past input, as `Names::past`, reused from invocation to invocation, with the
/// sequence width each was last gathered at.
pub(super) struct GatheredPast {
    buffers: Vec<KvBuffer>,
    widths: Vec<usize>,
}

impl GatheredPast {
    pub(super) fn new(past_inputs: usize) -> GatheredPast {
        GatheredPast { buffers: (0..past_inputs).map(|_| KvBuffer::default()).collect(), widths: vec![0; past_inputs] }
    }

    fn len(batch: Batch<'_>, width: usize, element: KvElement) -> usize {
        batch.dims.batch * batch.dims.kv_heads * width * batch.dims.head_size * element.bytes()
    }

    /// Copies each row's past from its blocks into the buffers. Padding positions keep whatever
    /// finite values an earlier invocation left there (the mask hides them).
    pub(super) fn gather(&mut self, kv: &KvStore, batch: Batch<'_>, spec: &KvSpec, context_length: usize) {
        let dims = batch.dims;
        for (index, buffer) in self.buffers.iter_mut().enumerate() {
            let width = spec.past_width(index, dims.past, dims.total(), context_length);
            self.widths[index] = width;
            let bytes = buffer.bytes_mut(Self::len(batch, width, kv.element()));
            TensorRows::of(index, width, batch).gather(kv, bytes);
        }
    }

    /// The gathered buffers as the past inputs.
    pub(super) fn push_inputs<'s>(
        &'s self,
        names: &'s Names,
        batch: Batch<'_>,
        element: KvElement,
        inputs: &mut Inputs<'s>,
    ) -> Result<(), ExecError> {
        let dims = batch.dims;
        for ((name, buffer), &width) in names.past.iter().zip(&self.buffers).zip(&self.widths) {
            let shape = [dims.batch, dims.kv_heads, width, dims.head_size];
            let bytes = buffer.bytes(Self::len(batch, width, element));
            let view = element.view(shape, bytes).map_err(|e| fatal(format!("{name}: {e}")))?;
            inputs.push((Cow::Borrowed(name.as_str()), view));
        }
        Ok(())
    }
}
