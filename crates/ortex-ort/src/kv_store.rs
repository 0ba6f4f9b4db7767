//! The paged KV storage behind the engine's block pool: for every layer, one key and one value
//! arena of `num_blocks` blocks. The engine decides which block belongs to whom; this only holds
//! the elements, in the model's own type ([`KvElement`]: the copies below move bytes).
//!
//! One block of one layer's keys (or values), `[kv_heads, block_size, head_size]` elements:
//!
//! ```text
//!   block b:  | head 0: slot 0 .. slot bs-1 | head 1: slot 0 .. slot bs-1 | ...
//!                       ^ each slot is head_size elements
//! ```
//!
//! A head's slots are contiguous, so a row's past for one head is a few block-sized runs
//! (`block_size * head_size` elements each) and the model's `[batch, kv_heads, seq, head]` tensors
//! are filled with one copy per (head, block).

use std::cell::Cell;
use std::ops::Range;

use ortex_core::executor::KvGeometry;
use ortex_core::ids::BlockId;
use ortex_core::{ErrorCode, OrtexError, Result};

use crate::kv_element::KvElement;

/// Keys or values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvKind {
    Key,
    Value,
}

/// Which arena: one layer's keys or values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvArena {
    pub layer: usize,
    pub kind: KvKind,
}

impl KvArena {
    /// The models' KV tensor `index` (past or present): layer `index / 2`, key then value.
    pub fn of_index(index: usize) -> KvArena {
        const KINDS: [KvKind; 2] = [KvKind::Key, KvKind::Value];
        KvArena { layer: index / 2, kind: KINDS[index % 2] }
    }

    /// Its place in `KvStore::arenas`.
    fn index(self) -> usize {
        2 * self.layer + self.kind as usize
    }
}

pub struct KvStore {
    block_size: usize,
    kv_heads: usize,
    /// Bytes of one head of one position: `head_size` elements.
    row_bytes: usize,
    num_blocks: usize,
    element: KvElement,
    /// `arenas[2 * layer]` = keys, `arenas[2 * layer + 1]` = values.
    arenas: Vec<Box<[u8]>>,
    /// Bytes gathered out of and scattered into the arenas since the last
    /// [`KvStore::take_copied_bytes`] (the executor's `kvCopiedBytes`).
    copied_bytes: Cell<u64>,
}

/// A zeroed arena of `len` bytes, or an error when memory cannot be had (never an abort: the
/// size comes from caller options). Zeroed pages come lazily from the OS; all-zero bits are 0.0
/// in every [`KvElement`].
fn zeroed_arena(len: usize) -> Option<Box<[u8]>> {
    if len == 0 {
        return Some(Box::default());
    }
    let layout = std::alloc::Layout::array::<u8>(len).ok()?;
    // SAFETY: `layout` has a non-zero size; the pointer, when not null, points to `len` zeroed
    // bytes allocated with the global allocator and the layout of a `[u8]` of that length, which
    // is what `Box<[u8]>` frees with.
    unsafe {
        let ptr = std::alloc::alloc_zeroed(layout);
        if ptr.is_null() {
            return None;
        }
        Some(Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, len)))
    }
}

impl KvStore {
    pub fn new(
        geometry: KvGeometry,
        num_layers: usize,
        kv_heads: usize,
        head_size: usize,
        element: KvElement,
    ) -> Result<KvStore> {
        let block_size = geometry.block_size as usize;
        let num_blocks = geometry.num_blocks as usize;
        let too_big = || {
            OrtexError::new(
                ErrorCode::CapacityExhausted,
                format!(
                    "cannot allocate the KV cache: {num_blocks} blocks of {block_size} tokens x {num_layers} layers x \
                     {kv_heads} KV heads x {head_size} {} elements, keys and values; lower numBlocks",
                    element.name()
                ),
            )
        };
        let row_bytes = head_size * element.bytes();
        let per_arena = num_blocks
            .checked_mul(block_size)
            .and_then(|n| n.checked_mul(kv_heads))
            .and_then(|n| n.checked_mul(row_bytes))
            .ok_or_else(too_big)?;
        let mut arenas = Vec::with_capacity(2 * num_layers);
        for _ in 0..2 * num_layers {
            arenas.push(zeroed_arena(per_arena).ok_or_else(too_big)?);
        }
        Ok(KvStore { block_size, kv_heads, row_bytes, num_blocks, element, arenas, copied_bytes: Cell::new(0) })
    }

    pub fn element(&self) -> KvElement {
        self.element
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Bytes held by all arenas.
    pub fn bytes(&self) -> usize {
        self.arenas.iter().map(|a| a.len()).sum()
    }

    /// The bytes copied since the last call, and starts counting again.
    pub fn take_copied_bytes(&self) -> u64 {
        self.copied_bytes.take()
    }

    fn count_copied(&self, positions: usize) {
        self.copied_bytes.set(self.copied_bytes.get() + (positions * self.kv_heads * self.row_bytes) as u64);
    }

    fn block_stride(&self) -> usize {
        self.kv_heads * self.block_size * self.row_bytes
    }

    fn arena(&self, arena: KvArena) -> &[u8] {
        &self.arenas[arena.index()]
    }

    fn arena_mut(&mut self, arena: KvArena) -> &mut [u8] {
        &mut self.arenas[arena.index()]
    }

    /// Copies the first `len` positions of a row (whose table is `blocks`) into `dst` (bytes of
    /// elements), laid out `[kv_heads, dst_len, head_size]` (`dst_len >= len`; positions
    /// `len..dst_len` untouched).
    pub fn gather(&self, arena: KvArena, blocks: &[BlockId], len: usize, dst: &mut [u8], dst_len: usize) {
        let (bs, d, stride) = (self.block_size, self.row_bytes, self.block_stride());
        self.count_copied(len);
        let arena = self.arena(arena);
        for (i, block) in blocks.iter().take(len.div_ceil(bs)).enumerate() {
            let run = (len - i * bs).min(bs) * d;
            let base = block.0 as usize * stride;
            for h in 0..self.kv_heads {
                let src = base + h * bs * d;
                let to = (h * dst_len + i * bs) * d;
                dst[to..to + run].copy_from_slice(&arena[src..src + run]);
            }
        }
    }

    /// Writes the new `positions` of a row (whose table is `blocks`) from `src` (bytes of
    /// elements) laid out `[kv_heads, src_len, head_size]`, where the first of them sits at
    /// index `src_at`.
    pub fn scatter(
        &mut self,
        arena: KvArena,
        blocks: &[BlockId],
        positions: Range<usize>,
        src: &[u8],
        src_len: usize,
        src_at: usize,
    ) {
        let (bs, d, stride, heads) = (self.block_size, self.row_bytes, self.block_stride(), self.kv_heads);
        let (start, count) = (positions.start, positions.len());
        self.count_copied(count);
        let arena = self.arena_mut(arena);
        let mut j = 0;
        while j < count {
            let position = start + j;
            let slot = position % bs;
            let run = (bs - slot).min(count - j);
            let base = blocks[position / bs].0 as usize * stride;
            for h in 0..heads {
                let to = base + (h * bs + slot) * d;
                let from = (h * src_len + src_at + j) * d;
                arena[to..to + run * d].copy_from_slice(&src[from..from + run * d]);
            }
            j += run;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An element's bytes that encode (layer, kind, head, position, x) for a store of `element`
    /// (the store copies bytes, so any distinct patterns of the element's size do).
    fn value(element: KvElement, layer: usize, kind: KvKind, head: usize, position: usize, x: usize) -> Vec<u8> {
        let n = (layer * 100_000 + kind as usize * 10_000 + head * 1_000 + position * 10 + x) as u32;
        match element {
            KvElement::F32 => n.to_le_bytes().to_vec(),
            KvElement::F16 | KvElement::Bf16 => (n as u16).to_le_bytes().to_vec(),
        }
    }

    /// Source tensor `[heads, len, d]` whose entries encode (head, position, x), positions
    /// starting at `first`.
    fn source(
        element: KvElement,
        layer: usize,
        kind: KvKind,
        heads: usize,
        len: usize,
        d: usize,
        first: usize,
    ) -> Vec<u8> {
        let mut out = Vec::new();
        for h in 0..heads {
            for j in 0..len {
                for x in 0..d {
                    out.extend(value(element, layer, kind, h, first + j, x));
                }
            }
        }
        out
    }

    #[test]
    fn scattered_positions_gather_back_in_order_across_blocks() {
        for element in [KvElement::F32, KvElement::F16] {
            let (heads, d, bs, e) = (2, 3, 4, element.bytes());
            let geometry = KvGeometry { num_blocks: 8, block_size: bs as u32 };
            let mut store = KvStore::new(geometry, 2, heads, d, element).unwrap();
            assert_eq!(store.bytes(), 2 * 2 * 8 * bs * heads * d * e);
            assert_eq!(store.take_copied_bytes(), 0);
            let blocks = [BlockId(5), BlockId(1), BlockId(7)];
            // Positions 0..6 in one write (a prefill spanning two blocks), then 6..10 in two writes.
            for (start, count) in [(0, 6), (6, 1), (7, 3)] {
                for layer in 0..2 {
                    for kind in [KvKind::Key, KvKind::Value] {
                        // The new positions sit at index 2 of a 2 + count + 1 wide tensor.
                        let width = count + 3;
                        let mut src = vec![0xEE; heads * width * d * e];
                        let part = source(element, layer, kind, heads, count, d, start);
                        for h in 0..heads {
                            src[(h * width + 2) * d * e..(h * width + 2 + count) * d * e]
                                .copy_from_slice(&part[h * count * d * e..(h + 1) * count * d * e]);
                        }
                        store.scatter(KvArena { layer, kind }, &blocks, start..start + count, &src, width, 2);
                    }
                }
            }
            // 10 positions of 2 heads of d elements, into 4 arenas.
            assert_eq!(store.take_copied_bytes(), (4 * 10 * heads * d * e) as u64);
            for layer in 0..2 {
                for kind in [KvKind::Key, KvKind::Value] {
                    let len = 10;
                    let dst_len = 12;
                    let mut dst = vec![0xAB; heads * dst_len * d * e];
                    store.gather(KvArena { layer, kind }, &blocks, len, &mut dst, dst_len);
                    for h in 0..heads {
                        for j in 0..len {
                            for x in 0..d {
                                let at = ((h * dst_len + j) * d + x) * e;
                                assert_eq!(
                                    dst[at..at + e],
                                    value(element, layer, kind, h, j, x),
                                    "{layer} {kind:?} {h} {j}"
                                );
                            }
                        }
                        let pad = (h * dst_len + len) * d * e;
                        assert!(dst[pad..pad + d * e].iter().all(|&b| b == 0xAB), "padding is left alone");
                    }
                }
            }
        }
    }

    #[test]
    fn tensor_indices_name_layers_key_then_value() {
        let arenas: Vec<KvArena> = (0..4).map(KvArena::of_index).collect();
        assert_eq!(
            arenas,
            [(0, KvKind::Key), (0, KvKind::Value), (1, KvKind::Key), (1, KvKind::Value)]
                .map(|(layer, kind)| KvArena { layer, kind })
        );
        assert!(arenas.iter().enumerate().all(|(i, arena)| arena.index() == i));
    }

    #[test]
    fn an_impossible_pool_is_an_error_not_an_abort() {
        let geometry = KvGeometry { num_blocks: 1 << 24, block_size: 4096 };
        let error = KvStore::new(geometry, 64, 64, 256, KvElement::F32).err().unwrap();
        assert_eq!(error.code, ErrorCode::CapacityExhausted);
    }
}
