//! The past gathered: each row's past copied from its blocks in the paged KV store into the
//! model's contiguous past tensors `[B, KH, P, D]`, row b's past at `[0, past_b)`. The way every
//! invocation can take (prefills, and decodes whose rows changed since the last step).
//!
//! The tensors are views of buffers ([`GatheredPast`]) that grow to the largest invocation seen,
//! so nothing is allocated per token beyond what ONNX Runtime allocates for its outputs.

use std::borrow::Cow;

use ort::value::TensorRef;
use ortex_core::executor::ExecError;

use super::fatal;
use super::invocation::{Batch, Dims, Inputs};
use super::signature::Names;
use super::tensor_rows::TensorRows;
use crate::kv_store::KvStore;

/// One buffer per past input, as `Names::past`, reused from invocation to invocation.
pub(super) struct GatheredPast {
    buffers: Vec<Vec<f32>>,
}

impl GatheredPast {
    pub(super) fn new(past_inputs: usize) -> GatheredPast {
        GatheredPast { buffers: vec![Vec::new(); past_inputs] }
    }

    /// Copies each row's past from its blocks into the buffers. Padding positions keep whatever
    /// finite values an earlier invocation left there (the mask hides them).
    pub(super) fn gather(&mut self, kv: &KvStore, batch: Batch<'_>) {
        let len = batch.dims.batch * batch.dims.past_floats_per_row();
        for (index, buffer) in self.buffers.iter_mut().enumerate() {
            if buffer.len() < len {
                buffer.resize(len, 0.0);
            }
            TensorRows::of(index, batch.dims.past, batch).gather(kv, &mut buffer[..len]);
        }
    }

    /// The gathered buffers as the past inputs.
    pub(super) fn push_inputs<'s>(
        &'s self,
        names: &'s Names,
        dims: Dims,
        inputs: &mut Inputs<'s>,
    ) -> Result<(), ExecError> {
        let shape = [dims.batch, dims.kv_heads, dims.past, dims.head_size];
        let len = dims.batch * dims.past_floats_per_row();
        for (name, buffer) in names.past.iter().zip(&self.buffers) {
            let view =
                TensorRef::from_array_view((shape, &buffer[..len])).map_err(|e| fatal(format!("{name}: {e}")))?;
            inputs.push((Cow::Borrowed(name.as_str()), view.into()));
        }
        Ok(())
    }
}
