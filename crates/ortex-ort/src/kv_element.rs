//! [`KvElement`]: the element type of a model's KV tensors (float32, float16 or bfloat16), the
//! one place that knows about it.
//!
//! The KV store keeps keys and values in the model's own precision (a float16 model's cache takes
//! half the bytes per token), so every copy between the blocks and the model's tensors moves
//! bytes, whatever the type: nothing is converted on the KV path. Only the logits are converted,
//! to f32 for sampling, as they are copied into the step output anyway.

use half::{bf16, f16, slice::HalfFloatSliceExt};
use ort::memory::Allocator;
use ort::session::SessionInputValue;
use ort::value::{DynTensor, DynValue, TensorElementType, TensorRef, ValueType};

/// A floating-point element type ortex reads and writes KV tensors and logits in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvElement {
    F32,
    F16,
    Bf16,
}

impl KvElement {
    /// The element type of an ONNX tensor, when ortex handles it.
    pub fn of(ty: TensorElementType) -> Option<KvElement> {
        match ty {
            TensorElementType::Float32 => Some(KvElement::F32),
            TensorElementType::Float16 => Some(KvElement::F16),
            TensorElementType::Bfloat16 => Some(KvElement::Bf16),
            _ => None,
        }
    }

    pub fn tensor_type(self) -> TensorElementType {
        match self {
            KvElement::F32 => TensorElementType::Float32,
            KvElement::F16 => TensorElementType::Float16,
            KvElement::Bf16 => TensorElementType::Bfloat16,
        }
    }

    pub fn is_f32(self) -> bool {
        self == KvElement::F32
    }

    /// Bytes of one element.
    pub const fn bytes(self) -> usize {
        match self {
            KvElement::F32 => 4,
            KvElement::F16 | KvElement::Bf16 => 2,
        }
    }

    /// As docs/model-format.md names it.
    pub fn name(self) -> &'static str {
        match self {
            KvElement::F32 => "float32",
            KvElement::F16 => "float16",
            KvElement::Bf16 => "bfloat16",
        }
    }

    /// `src` (elements of this type, as bytes) as f32 into `dst` (as many elements).
    pub fn to_f32(self, src: &[u8], dst: &mut [f32]) {
        match self {
            KvElement::F32 => bytemuck::cast_slice_mut::<f32, u8>(dst).copy_from_slice(src),
            KvElement::F16 => bytemuck::cast_slice::<u8, f16>(src).convert_to_f32_slice(dst),
            KvElement::Bf16 => bytemuck::cast_slice::<u8, bf16>(src).convert_to_f32_slice(dst),
        }
    }

    /// A tensor of this type, allocated by ONNX Runtime's CPU allocator (contents unset).
    pub fn new_tensor(self, shape: [usize; 4]) -> ort::Result<DynTensor> {
        DynTensor::new(&Allocator::default(), self.tensor_type(), shape.map(|d| d as i64).to_vec())
    }

    /// A view of `bytes` (elements of this type) as an input tensor of `shape`.
    pub fn view<'a>(self, shape: [usize; 4], bytes: &'a [u8]) -> ort::Result<SessionInputValue<'a>> {
        Ok(match self {
            KvElement::F32 => TensorRef::from_array_view((shape, bytemuck::cast_slice::<u8, f32>(bytes)))?.into(),
            KvElement::F16 => TensorRef::from_array_view((shape, bytemuck::cast_slice::<u8, f16>(bytes)))?.into(),
            KvElement::Bf16 => TensorRef::from_array_view((shape, bytemuck::cast_slice::<u8, bf16>(bytes)))?.into(),
        })
    }
}

/// A tensor value's shape and its elements as bytes, when it is a tensor of `element`.
pub fn value_bytes(value: &DynValue, element: KvElement) -> ort::Result<(Vec<i64>, &[u8])> {
    let (shape, bytes): (&[i64], &[u8]) = match element {
        KvElement::F32 => value.try_extract_tensor::<f32>().map(|(s, d)| (&**s, bytemuck::cast_slice(d)))?,
        KvElement::F16 => value.try_extract_tensor::<f16>().map(|(s, d)| (&**s, bytemuck::cast_slice(d)))?,
        KvElement::Bf16 => value.try_extract_tensor::<bf16>().map(|(s, d)| (&**s, bytemuck::cast_slice(d)))?,
    };
    Ok((shape.to_vec(), bytes))
}

/// A tensor's elements as bytes, to fill it.
pub fn tensor_bytes_mut(tensor: &mut DynTensor, element: KvElement) -> ort::Result<&mut [u8]> {
    Ok(match element {
        KvElement::F32 => bytemuck::cast_slice_mut(tensor.try_extract_tensor_mut::<f32>()?.1),
        KvElement::F16 => bytemuck::cast_slice_mut(tensor.try_extract_tensor_mut::<f16>()?.1),
        KvElement::Bf16 => bytemuck::cast_slice_mut(tensor.try_extract_tensor_mut::<bf16>()?.1),
    })
}

/// The sequence width (dimension 2) of a rank-4 tensor value.
pub fn sequence_width(value: &DynValue) -> Option<usize> {
    match value.dtype() {
        ValueType::Tensor { shape, .. } if shape.len() == 4 => usize::try_from(shape[2]).ok(),
        _ => None,
    }
}

/// A growable buffer of bytes aligned for any [`KvElement`] (it grows in 4-byte words), reused
/// from invocation to invocation.
#[derive(Default)]
pub struct KvBuffer {
    words: Vec<u32>,
}

impl KvBuffer {
    /// The first `len` bytes (`len` a multiple of the element size), grown with zeros as needed.
    pub fn bytes_mut(&mut self, len: usize) -> &mut [u8] {
        let words = len.div_ceil(4);
        if self.words.len() < words {
            self.words.resize(words, 0);
        }
        &mut bytemuck::cast_slice_mut(&mut self.words)[..len]
    }

    /// The first `len` bytes.
    pub fn bytes(&self, len: usize) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logits_convert_to_f32_exactly() {
        let values = [0.0f32, 1.5, -2.25, 65504.0, 1e-3];
        let mut out = [0.0f32; 5];
        KvElement::F32.to_f32(bytemuck::cast_slice(&values), &mut out);
        assert_eq!(out, values);
        let halves: Vec<f16> = values.iter().map(|&v| f16::from_f32(v)).collect();
        KvElement::F16.to_f32(bytemuck::cast_slice(&halves), &mut out);
        assert_eq!(out, halves.iter().map(|h| h.to_f32()).collect::<Vec<_>>().as_slice());
        assert_eq!(&out[..4], &values[..4]); // exactly representable in float16
        let brains: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
        KvElement::Bf16.to_f32(bytemuck::cast_slice(&brains), &mut out);
        assert_eq!(out, brains.iter().map(|h| h.to_f32()).collect::<Vec<_>>().as_slice());
    }

    #[test]
    fn element_types_round_trip() {
        for element in [KvElement::F32, KvElement::F16, KvElement::Bf16] {
            assert_eq!(KvElement::of(element.tensor_type()), Some(element));
        }
        assert_eq!(KvElement::of(TensorElementType::Int64), None);
        assert_eq!((KvElement::F32.bytes(), KvElement::F16.bytes(), KvElement::Bf16.bytes()), (4, 2, 2));
    }

    #[test]
    fn buffers_grow_aligned() {
        let mut buffer = KvBuffer::default();
        assert_eq!(buffer.bytes_mut(6).len(), 6);
        buffer.bytes_mut(6).copy_from_slice(&[1, 2, 3, 4, 5, 6]);
        assert_eq!(buffer.bytes(6), &[1, 2, 3, 4, 5, 6]);
        assert_eq!(buffer.bytes_mut(4096).as_ptr() as usize % 4, 0);
        assert_eq!(&buffer.bytes(4096)[..6], &[1, 2, 3, 4, 5, 6]);
    }
}
