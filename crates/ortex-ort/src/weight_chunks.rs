//! Where a session's weights live: packed into 2 MiB-aligned chunks, so that all of them can go on
//! huge pages.
//!
//! ONNX Runtime's own CPU allocator takes its memory from glibc, which maps every large block on
//! its own at whatever 4 KiB boundary comes: a few MB of prepacked weights then straddle their
//! 2 MiB pages, and only the aligned middle of each can be collapsed ([`crate::huge_pages`]; on
//! the bench model 164 of 230 MiB). So ortex registers one CPU allocator of its own in the ONNX
//! Runtime environment (sessions use it through `session.use_env_allocators`). While a thread
//! builds a session ([`LoadScope`]), the allocator hands out memory from chunks it maps 2 MiB
//! aligned, one block after the other, so the weights fill whole aligned pages; the collapse after
//! the build then finds nearly all of them wholly resident. A chunk is unmapped when the last
//! block in it is freed (the session is dropped) and no load still fills it. At any other time,
//! the allocator is glibc's `posix_memalign` and `free`, as ONNX Runtime's allocator is without
//! its arena.
//!
//! A chunk is virtual memory: only what is written becomes resident, so resident memory is what
//! the blocks use, plus what ONNX Runtime frees during the build inside a chunk (kept until the
//! session goes; measured in docs/performance.md). `ORTEX_HUGE_PAGES=0` turns this off with the
//! collapse, and `ORTEX_WEIGHT_CHUNKS=0` alone, for comparison.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::ffi::{c_void, CStr};
use std::sync::{Mutex, OnceLock, PoisonError};

use ort::environment::Environment;
use ort::sys::{OrtAllocator, OrtAllocatorType, OrtMemType, OrtMemoryInfo};
use ort::AsPointer;

use crate::huge_pages::HUGE_PAGE_BYTES;

pub const WEIGHT_CHUNKS_ENV: &str = "ORTEX_WEIGHT_CHUNKS";

/// A chunk's virtual size; a block larger than a quarter of it gets a chunk of its own.
const CHUNK_BYTES: usize = 64 << 20;
/// Every block starts on a cache line (ONNX Runtime's CPU allocator aligns to 64 too).
const BLOCK_ALIGN_BYTES: usize = 64;

pub fn enabled() -> bool {
    crate::huge_pages::enabled() && std::env::var(WEIGHT_CHUNKS_ENV).map_or(true, |v| v != "0")
}

/// One 2 MiB-aligned mapping that blocks are cut from, front to back.
#[derive(Debug)]
struct Chunk {
    len: usize,
    /// Bytes handed out from the start (the next block goes at or after it).
    used: usize,
    /// Blocks not yet freed.
    live: usize,
    /// Whether a load may still cut blocks from it (then it stays mapped even with none live).
    open: bool,
}

/// Every chunk by its start address.
static CHUNKS: Mutex<BTreeMap<usize, Chunk>> = Mutex::new(BTreeMap::new());

thread_local! {
    /// The chunk this thread's load cuts small blocks from; `Some(0)`: loading, none yet;
    /// `None`: not loading.
    static LOADING: Cell<Option<usize>> = const { Cell::new(None) };
}

fn chunks() -> std::sync::MutexGuard<'static, BTreeMap<usize, Chunk>> {
    CHUNKS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// While it lives, the allocations ONNX Runtime makes on this thread go into chunks.
pub struct LoadScope(());

impl LoadScope {
    pub fn begin() -> LoadScope {
        LOADING.set(Some(0));
        LoadScope(())
    }
}

impl Drop for LoadScope {
    fn drop(&mut self) {
        if let Some(start) = LOADING.take().filter(|&s| s != 0) {
            close(&mut chunks(), start);
        }
    }
}

/// No more blocks from the chunk at `start`; unmapped at once when none is live.
fn close(chunks: &mut BTreeMap<usize, Chunk>, start: usize) {
    if let Some(chunk) = chunks.get_mut(&start) {
        chunk.open = false;
        if chunk.live == 0 {
            unmap(start, chunks.remove(&start).expect("found above").len);
        }
    }
}

/// A block of `size` bytes: from this thread's open chunk while it loads, else from glibc.
fn allocate(size: usize) -> *mut c_void {
    match LOADING.get() {
        Some(open) => allocate_in_chunk(open, size).unwrap_or_else(|| allocate_plain(size)),
        None => allocate_plain(size),
    }
}

fn allocate_in_chunk(open: usize, size: usize) -> Option<*mut c_void> {
    // Larger than any address space: let glibc refuse it.
    if size > usize::MAX / 4 {
        return None;
    }
    let size = size.max(1);
    let own_chunk = size > CHUNK_BYTES / 4;
    let mut chunks = chunks();
    if let Some(chunk) = chunks.get_mut(&open).filter(|_| !own_chunk) {
        let at = chunk.used.next_multiple_of(BLOCK_ALIGN_BYTES);
        if at + size <= chunk.len {
            chunk.used = at + size;
            chunk.live += 1;
            return Some((open + at) as *mut c_void);
        }
    }
    let len = if own_chunk { size.next_multiple_of(HUGE_PAGE_BYTES) } else { CHUNK_BYTES };
    let start = map_aligned(len)?;
    chunks.insert(start, Chunk { len, used: size, live: 1, open: !own_chunk });
    if !own_chunk {
        // The rest of the old chunk stays unused (never written, so never resident).
        if open != 0 {
            close(&mut chunks, open);
        }
        LOADING.set(Some(start));
    }
    Some(start as *mut c_void)
}

fn allocate_plain(size: usize) -> *mut c_void {
    let mut out = std::ptr::null_mut();
    // SAFETY: the alignment is a power of two and a multiple of the pointer size.
    match unsafe { libc::posix_memalign(&mut out, BLOCK_ALIGN_BYTES, size.max(1)) } {
        0 => out,
        _ => std::ptr::null_mut(),
    }
}

fn free(block: *mut c_void) {
    if block.is_null() {
        return;
    }
    let address = block as usize;
    {
        let mut chunks = chunks();
        if let Some((&start, chunk)) = chunks.range_mut(..=address).next_back() {
            if address < start + chunk.len {
                chunk.live -= 1;
                if chunk.live == 0 && !chunk.open {
                    unmap(start, chunks.remove(&start).expect("found above").len);
                }
                return;
            }
        }
    }
    // SAFETY: not in a chunk, so it came from posix_memalign and is freed once (ONNX Runtime's
    // contract for an allocator).
    unsafe { libc::free(block) }
}

/// `len` bytes (a multiple of 2 MiB) of private anonymous memory starting on a 2 MiB boundary.
fn map_aligned(len: usize) -> Option<usize> {
    let padded = len + HUGE_PAGE_BYTES;
    // SAFETY: a fresh private anonymous mapping; the parts outside [start, start + len) are
    // unmapped right away and nothing else refers to them.
    unsafe {
        let base = libc::mmap(
            std::ptr::null_mut(),
            padded,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if base == libc::MAP_FAILED {
            return None;
        }
        let base = base as usize;
        let start = base.next_multiple_of(HUGE_PAGE_BYTES);
        if start > base {
            libc::munmap(base as *mut c_void, start - base);
        }
        let tail = base + padded - (start + len);
        if tail > 0 {
            libc::munmap((start + len) as *mut c_void, tail);
        }
        Some(start)
    }
}

fn unmap(start: usize, len: usize) {
    // SAFETY: a whole chunk this module mapped, none of whose blocks is live any more.
    unsafe { libc::munmap(start as *mut c_void, len) };
}

/// What ONNX Runtime calls: the allocator's table and the memory info it describes itself with.
struct Registered {
    allocator: *mut OrtAllocator,
    info: *const OrtMemoryInfo,
}

// SAFETY: both pointers are leaked, never written after creation, and ONNX Runtime reads them
// from any thread by design.
unsafe impl Send for Registered {}
unsafe impl Sync for Registered {}

static REGISTERED: OnceLock<Registered> = OnceLock::new();

unsafe extern "system" fn ort_alloc(_this: *mut OrtAllocator, size: usize) -> *mut c_void {
    allocate(size)
}

unsafe extern "system" fn ort_free(_this: *mut OrtAllocator, block: *mut c_void) {
    free(block)
}

unsafe extern "system" fn ort_info(_this: *const OrtAllocator) -> *const OrtMemoryInfo {
    REGISTERED.get().map_or(std::ptr::null(), |r| r.info)
}

/// Registers the allocator in the environment (once per process). An error (an ONNX Runtime without the
/// call, say) leaves sessions on ONNX Runtime's own allocator.
pub fn register(environment: &Environment) -> Result<(), String> {
    let api = ort::api();
    let mut info: *mut OrtMemoryInfo = std::ptr::null_mut();
    // SAFETY: plain ONNX Runtime calls with valid out-pointers; the info and the table are leaked
    // on success, so they outlive every session that uses them.
    unsafe {
        check((api.CreateCpuMemoryInfo)(
            OrtAllocatorType::OrtDeviceAllocator,
            OrtMemType::OrtMemTypeDefault,
            &mut info,
        ))?;
        let allocator = Box::into_raw(Box::new(OrtAllocator {
            Alloc: Some(ort_alloc),
            Free: Some(ort_free),
            Info: Some(ort_info),
            ..OrtAllocator::default()
        }));
        let registered = REGISTERED.get_or_init(|| Registered { allocator, info });
        if registered.allocator != allocator {
            drop(Box::from_raw(allocator));
            (api.ReleaseMemoryInfo)(info);
        }
        check((api.RegisterAllocator)(environment.ptr().cast_mut(), registered.allocator))
    }
}

/// # Safety
/// `status` is null or an ONNX Runtime status this call may release.
unsafe fn check(status: ort::sys::OrtStatusPtr) -> Result<(), String> {
    let status = status.0;
    if status.is_null() {
        return Ok(());
    }
    let api = ort::api();
    let message = CStr::from_ptr((api.GetErrorMessage)(status)).to_string_lossy().into_owned();
    (api.ReleaseStatus)(status);
    Err(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: usize = 1 << 20;

    fn chunk_of(block: *mut c_void) -> Option<(usize, usize, usize, bool)> {
        let address = block as usize;
        let chunks = chunks();
        let (&start, chunk) = chunks.range(..=address).next_back()?;
        (address < start + chunk.len).then_some((start, chunk.len, chunk.live, chunk.open))
    }

    fn fill(block: *mut c_void, size: usize, byte: u8) {
        // SAFETY: `block` holds at least `size` bytes.
        unsafe { std::ptr::write_bytes(block.cast::<u8>(), byte, size) }
    }

    #[test]
    fn blocks_made_while_loading_are_packed_into_one_aligned_chunk() {
        let scope = LoadScope::begin();
        let sizes = [3 * MB + 5, 100, 1_700_000, 64];
        let blocks: Vec<_> = sizes.iter().map(|&size| allocate(size)).collect();
        for (&block, &size) in blocks.iter().zip(&sizes) {
            assert_eq!(block as usize % BLOCK_ALIGN_BYTES, 0);
            fill(block, size, 7);
        }
        let (start, len, live, open) = chunk_of(blocks[0]).expect("in a chunk");
        assert_eq!((start % HUGE_PAGE_BYTES, len, live, open), (0, CHUNK_BYTES, 4, true));
        assert_eq!(start, blocks[0] as usize);
        // One after the other, each on the next cache line.
        for pair in blocks.windows(2).zip(&sizes) {
            let (gap, size) = (pair.0[1] as usize - pair.0[0] as usize, *pair.1);
            assert_eq!(gap, size.next_multiple_of(BLOCK_ALIGN_BYTES));
        }
        drop(scope);
        blocks[..3].iter().for_each(|&b| free(b));
        assert_eq!(chunk_of(blocks[3]).map(|c| (c.2, c.3)), Some((1, false)), "closed, one block live");
        free(blocks[3]);
        assert_eq!(chunk_of(blocks[3]), None, "unmapped with its last block");
    }

    #[test]
    fn a_large_block_gets_a_chunk_of_its_own_and_small_ones_keep_filling_theirs() {
        let scope = LoadScope::begin();
        let small = allocate(1000);
        let large = allocate(CHUNK_BYTES / 2 + 1);
        let next = allocate(1000);
        let (start, len, _, open) = chunk_of(large).expect("in a chunk");
        assert_eq!(
            (start, len, open),
            (large as usize, (CHUNK_BYTES / 2 + 1).next_multiple_of(HUGE_PAGE_BYTES), false)
        );
        assert_eq!(next as usize, small as usize + 1024, "the small blocks' chunk is still open");
        fill(large, CHUNK_BYTES / 2 + 1, 1);
        free(large);
        assert_eq!(chunk_of(large), None);
        free(small);
        free(next);
        assert!(chunk_of(small).is_some(), "an open chunk stays mapped with no block live");
        drop(scope);
        assert_eq!(chunk_of(small), None, "and goes when its load ends");
    }

    #[test]
    fn outside_a_load_blocks_come_from_glibc() {
        let block = allocate(5 * MB);
        assert_eq!(block as usize % BLOCK_ALIGN_BYTES, 0);
        assert_eq!(chunk_of(block), None);
        fill(block, 5 * MB, 3);
        free(block);
        free(std::ptr::null_mut());
    }

    #[test]
    fn an_impossible_size_fails_instead_of_wrapping() {
        let _scope = LoadScope::begin();
        assert!(allocate(usize::MAX - 8).is_null());
    }
}
