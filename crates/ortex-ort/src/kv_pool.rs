//! [`KvPool`]: the KV blocks of a paged-attention graph, in the memory its session runs in: per
//! layer one key and one value tensor `[num_blocks, block_size, kv_heads, head_size]`, allocated
//! ONCE through ONNX Runtime's allocator for that memory (CUDA device memory under
//! `executionProvider: 'cuda'`, CPU memory under `'cpu'`) and bound as both the past input and
//! the present output of every run (paged.rs): the graph writes each new position into its slot
//! in place and reads each row's past through the block table. The pool is the only copy of the
//! KV (no host [`KvStore`](crate::kv_store::KvStore) is allocated for a paged folder), so no KV
//! byte crosses between the host and the device.
//!
//! One block of one layer's keys (or values), as the graph's operators index it:
//!
//! ```text
//!   block b:  | slot 0: head 0 .. head kh-1 | slot 1: ... | ... | slot bs-1 |
//!                       ^ each head is head_size elements
//! ```

use ort::memory::{AllocationDevice, Allocator, AllocatorType, MemoryInfo, MemoryType};
use ort::session::Session;
use ort::value::DynTensor;
use ortex_core::executor::KvGeometry;
use ortex_core::{ErrorCode, OrtexError, Result};

use crate::kv_element::KvElement;
use crate::runtime::ExecutionProvider;

pub struct KvPool {
    /// `tensors[2 * layer]` = keys, `tensors[2 * layer + 1]` = values (the executor's
    /// `Names::past` order).
    tensors: Vec<DynTensor>,
    bytes: u64,
}

/// The shape of one of the pool's tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolShape {
    pub num_layers: usize,
    pub kv_heads: usize,
    pub head_size: usize,
    pub element: KvElement,
}

impl PoolShape {
    /// Bytes of one tensor of `geometry`, when they fit a u64.
    fn tensor_bytes(&self, geometry: KvGeometry) -> Option<u64> {
        u64::from(geometry.num_blocks)
            .checked_mul(u64::from(geometry.block_size))?
            .checked_mul(self.kv_heads as u64)?
            .checked_mul(self.head_size as u64)?
            .checked_mul(self.element.bytes() as u64)
    }
}

/// The allocator for the memory the session's KV lives in. On CUDA it is the session's own
/// device allocator (ONNX Runtime's arena for device 0), so the pool and the activations come
/// from one place; on the CPU, ONNX Runtime's CPU allocator (its tensors are zeroed, so slots
/// not written yet hold 0.0, which a reference kernel that reads whole blocks may multiply by
/// a zero weight harmlessly; CUDA's PagedAttention reads only written slots).
fn allocator_for(session: &Session, provider: ExecutionProvider) -> ort::Result<Allocator> {
    match provider {
        ExecutionProvider::Cpu => Ok(Allocator::default()),
        ExecutionProvider::Cuda => Allocator::new(
            session,
            MemoryInfo::new(AllocationDevice::CUDA, 0, AllocatorType::Device, MemoryType::Default)?,
        ),
    }
}

impl KvPool {
    /// Allocates the pool of `geometry`: 2 tensors per layer. Failing to get the memory is
    /// CAPACITY_EXHAUSTED naming the size and what to lower (never an abort).
    pub fn new(
        session: &Session,
        provider: ExecutionProvider,
        geometry: KvGeometry,
        shape: PoolShape,
    ) -> Result<KvPool> {
        let too_big = |reason: String| {
            OrtexError::new(
                ErrorCode::CapacityExhausted,
                format!(
                    "cannot allocate the KV pool in {} memory: {} blocks of {} positions x {} layers x {} KV heads x \
                     {} {} elements, keys and values ({reason}); lower numBlocks or kvCacheBytes",
                    provider.as_str(),
                    geometry.num_blocks,
                    geometry.block_size,
                    shape.num_layers,
                    shape.kv_heads,
                    shape.head_size,
                    shape.element.name()
                ),
            )
        };
        let per_tensor = shape.tensor_bytes(geometry).ok_or_else(|| too_big("too many bytes".into()))?;
        let allocator = allocator_for(session, provider).map_err(|e| too_big(format!("no allocator: {e}")))?;
        let dims = [
            i64::from(geometry.num_blocks),
            i64::from(geometry.block_size),
            shape.kv_heads as i64,
            shape.head_size as i64,
        ];
        let mut tensors = Vec::with_capacity(2 * shape.num_layers);
        for _ in 0..2 * shape.num_layers {
            let tensor = DynTensor::new(&allocator, shape.element.tensor_type(), dims.to_vec())
                .map_err(|e| too_big(e.to_string()))?;
            tensors.push(tensor);
        }
        Ok(KvPool { tensors, bytes: per_tensor * 2 * shape.num_layers as u64 })
    }

    /// Bytes held by all the pool's tensors.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn tensors_mut(&mut self) -> &mut [DynTensor] {
        &mut self.tensors
    }

    pub fn tensors(&self) -> &[DynTensor] {
        &self.tensors
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tensor_too_big_to_count_is_refused_not_wrapped() {
        let shape = PoolShape { num_layers: 2, kv_heads: 2, head_size: 16, element: KvElement::F16 };
        assert_eq!(shape.tensor_bytes(KvGeometry { num_blocks: 64, block_size: 256 }), Some(64 * 256 * 2 * 16 * 2));
        let huge = PoolShape { kv_heads: usize::MAX / 2, ..shape };
        assert_eq!(huge.tensor_bytes(KvGeometry { num_blocks: u32::MAX, block_size: 4096 }), None);
    }
}
