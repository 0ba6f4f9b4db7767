//! The paged KV storage behind the engine's block pool: for every layer, one key and one value
//! arena of `num_blocks` blocks. The engine decides which block belongs to whom; this only holds
//! the floats.
//!
//! One block of one layer's keys (or values), `[kv_heads, block_size, head_size]` f32:
//!
//! ```text
//!   block b:  | head 0: slot 0 .. slot bs-1 | head 1: slot 0 .. slot bs-1 | ...
//!                       ^ each slot is head_size floats
//! ```
//!
//! A head's slots are contiguous, so a row's past for one head is a few block-sized runs
//! (`block_size * head_size` floats each) and the model's `[batch, kv_heads, seq, head]` tensors
//! are filled with one copy per (head, block).

use std::ops::Range;

use ortex_core::executor::KvGeometry;
use ortex_core::ids::BlockId;
use ortex_core::{ErrorCode, OrtexError, Result};

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
    head_size: usize,
    num_blocks: usize,
    /// `arenas[2 * layer]` = keys, `arenas[2 * layer + 1]` = values.
    arenas: Vec<Box<[f32]>>,
}

/// A zeroed arena of `len` floats, or an error when memory cannot be had (never an abort: the
/// size comes from caller options). Zeroed pages come lazily from the OS.
fn zeroed_arena(len: usize) -> Option<Box<[f32]>> {
    if len == 0 {
        return Some(Box::default());
    }
    let layout = std::alloc::Layout::array::<f32>(len).ok()?;
    // SAFETY: `layout` has a non-zero size; the pointer, when not null, points to `len` zeroed
    // f32s (all-zero bits are 0.0) allocated with the global allocator and the layout of a
    // `[f32]` of that length, which is what `Box<[f32]>` frees with.
    unsafe {
        let ptr = std::alloc::alloc_zeroed(layout).cast::<f32>();
        if ptr.is_null() {
            return None;
        }
        Some(Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, len)))
    }
}

impl KvStore {
    pub fn new(geometry: KvGeometry, num_layers: usize, kv_heads: usize, head_size: usize) -> Result<KvStore> {
        let block_size = geometry.block_size as usize;
        let num_blocks = geometry.num_blocks as usize;
        let too_big = || {
            OrtexError::new(
                ErrorCode::CapacityExhausted,
                format!(
                    "cannot allocate the KV cache: {num_blocks} blocks of {block_size} tokens x {num_layers} layers x \
                     {kv_heads} KV heads x {head_size} floats, keys and values; lower numBlocks"
                ),
            )
        };
        let per_arena = num_blocks
            .checked_mul(block_size)
            .and_then(|n| n.checked_mul(kv_heads))
            .and_then(|n| n.checked_mul(head_size))
            .ok_or_else(too_big)?;
        let mut arenas = Vec::with_capacity(2 * num_layers);
        for _ in 0..2 * num_layers {
            arenas.push(zeroed_arena(per_arena).ok_or_else(too_big)?);
        }
        Ok(KvStore { block_size, kv_heads, head_size, num_blocks, arenas })
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Bytes held by all arenas.
    pub fn bytes(&self) -> usize {
        self.arenas.iter().map(|a| a.len() * 4).sum()
    }

    fn block_stride(&self) -> usize {
        self.kv_heads * self.block_size * self.head_size
    }

    fn arena(&self, arena: KvArena) -> &[f32] {
        &self.arenas[arena.index()]
    }

    fn arena_mut(&mut self, arena: KvArena) -> &mut [f32] {
        &mut self.arenas[arena.index()]
    }

    /// Copies the first `len` positions of a row (whose table is `blocks`) into `dst`, laid out
    /// `[kv_heads, dst_len, head_size]` (`dst_len >= len`; positions `len..dst_len` untouched).
    pub fn gather(&self, arena: KvArena, blocks: &[BlockId], len: usize, dst: &mut [f32], dst_len: usize) {
        let (bs, d, stride) = (self.block_size, self.head_size, self.block_stride());
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

    /// Writes the new `positions` of a row (whose table is `blocks`) from `src` laid out
    /// `[kv_heads, src_len, head_size]`, where the first of them sits at index `src_at`.
    pub fn scatter(
        &mut self,
        arena: KvArena,
        blocks: &[BlockId],
        positions: Range<usize>,
        src: &[f32],
        src_len: usize,
        src_at: usize,
    ) {
        let (bs, d, stride, heads) = (self.block_size, self.head_size, self.block_stride(), self.kv_heads);
        let (start, count) = (positions.start, positions.len());
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

    fn value(layer: usize, kind: KvKind, head: usize, position: usize, x: usize) -> f32 {
        (layer * 1_000_000 + kind as usize * 100_000 + head * 10_000 + position * 10 + x) as f32
    }

    /// Source tensor `[heads, len, d]` whose entries encode (head, position, x), positions
    /// starting at `first`.
    fn source(layer: usize, kind: KvKind, heads: usize, len: usize, d: usize, first: usize) -> Vec<f32> {
        let mut out = vec![0.0; heads * len * d];
        for h in 0..heads {
            for j in 0..len {
                for x in 0..d {
                    out[(h * len + j) * d + x] = value(layer, kind, h, first + j, x);
                }
            }
        }
        out
    }

    #[test]
    fn scattered_positions_gather_back_in_order_across_blocks() {
        let (heads, d, bs) = (2, 3, 4);
        let mut store = KvStore::new(KvGeometry { num_blocks: 8, block_size: bs as u32 }, 2, heads, d).unwrap();
        let blocks = [BlockId(5), BlockId(1), BlockId(7)];
        // Positions 0..6 in one write (a prefill spanning two blocks), then 6..10 in two writes.
        for (start, count) in [(0, 6), (6, 1), (7, 3)] {
            for layer in 0..2 {
                for kind in [KvKind::Key, KvKind::Value] {
                    // The new positions sit at index 2 of a 2 + count + 1 wide tensor.
                    let width = count + 3;
                    let mut src = vec![-1.0; heads * width * d];
                    let part = source(layer, kind, heads, count, d, start);
                    for h in 0..heads {
                        src[(h * width + 2) * d..(h * width + 2 + count) * d]
                            .copy_from_slice(&part[h * count * d..(h + 1) * count * d]);
                    }
                    store.scatter(KvArena { layer, kind }, &blocks, start..start + count, &src, width, 2);
                }
            }
        }
        for layer in 0..2 {
            for kind in [KvKind::Key, KvKind::Value] {
                let len = 10;
                let dst_len = 12;
                let mut dst = vec![f32::NAN; heads * dst_len * d];
                store.gather(KvArena { layer, kind }, &blocks, len, &mut dst, dst_len);
                for h in 0..heads {
                    for j in 0..len {
                        for x in 0..d {
                            assert_eq!(
                                dst[(h * dst_len + j) * d + x],
                                value(layer, kind, h, j, x),
                                "{layer} {kind:?} {h} {j}"
                            );
                        }
                    }
                    assert!(dst[(h * dst_len + len) * d].is_nan(), "padding is left alone");
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
        let error = KvStore::new(KvGeometry { num_blocks: 1 << 24, block_size: 4096 }, 64, 64, 256).err().unwrap();
        assert_eq!(error.code, ErrorCode::CapacityExhausted);
    }
}
