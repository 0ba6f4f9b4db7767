//! Where a session's weights live: packed into 2 MiB-aligned chunks, so that all of them can go on
//! huge pages.
//!
//! ONNX Runtime's own CPU allocator takes its memory from glibc, which maps every large block on
//! its own at whatever 4 KiB boundary comes: a few MB of prepacked weights then straddle their
//! 2 MiB pages, and only the aligned middle of each can be collapsed ([`crate::huge_pages`]; on
//! the bench model 160 of 230 MiB). So ortex registers one CPU allocator of its own in the ONNX
//! Runtime environment (sessions use it through `session.use_env_allocators`). While a thread
//! builds a session ([`LoadScope`]), the allocator cuts blocks one after the other from chunks it
//! maps 2 MiB aligned, so the weights fill whole aligned pages and the collapse after the build
//! finds nearly all of them wholly resident. At any other time (the runs) a block of at least
//! 256 KiB gets a mapping of its own, unmapped when it is freed, and smaller ones are glibc's
//! `posix_memalign` and `free` (ONNX Runtime's arena is not used for these sessions, at inference
//! either). glibc keeps such blocks in its heap after they are freed (its mmap threshold rises to
//! the largest block freed), so the activations of one long prefill stayed resident for the
//! process's life: 165 MiB on SmolLM2 at 16 requests (docs/performance.md, issue 22). The last few
//! run mappings freed are kept for reuse (16 MiB at most), so a decode step's logits, allocated
//! afresh at every step, do not fault their pages in again each time.
//!
//! A chunk is virtual memory: only what is written becomes resident. What ONNX Runtime frees
//! during the build (an initializer it has prepacked, say) goes back at once: the last block cut
//! is cut again, and the whole base pages inside any other are released (`MADV_DONTNEED`). A
//! chunk is unmapped when its last block is freed (the session is dropped) and no load still cuts
//! from it. `ORTEX_HUGE_PAGES=0` turns this off with the collapse, `ORTEX_WEIGHT_CHUNKS=0` alone.
//!
//! A chunk, and one block in it (every block starts on a cache line after a 64-byte header that
//! holds its size, so that `free` knows how much it held):
//!
//! ```text
//!  start (2 MiB aligned)                                   start + used_bytes    start + len_bytes
//!  |[hdr|block][hdr|block]...[pad][hdr|block            ]|........................|
//!                                       ^ the pointer ONNX Runtime gets
//! ```

use std::cell::Cell;
use std::collections::BTreeMap;
use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};

use ort::environment::Environment;
use ort::sys::{OrtAllocator, OrtAllocatorType, OrtMemType, OrtMemoryInfo};
use ort::AsPointer;

use crate::huge_pages::HUGE_PAGE_BYTES;

pub const WEIGHT_CHUNKS_ENV: &str = "ORTEX_WEIGHT_CHUNKS";

/// A chunk's virtual size; a block larger than a quarter of it gets a chunk of its own.
const CHUNK_BYTES: usize = 64 << 20;
/// Blocks start on a cache line (ONNX Runtime's CPU allocator aligns to 64 too), after a header
/// of the same size holding the block's size.
const BLOCK_ALIGN_BYTES: usize = 64;
const HEADER_BYTES: usize = BLOCK_ALIGN_BYTES;
/// Larger than any address space: such a request goes to glibc, which refuses it.
const MAX_BLOCK_BYTES: usize = usize::MAX / 4;
/// Outside a load, blocks at least this large get a chunk of their own.
const RUN_CHUNK_MIN_BYTES: usize = 256 << 10;
/// Freed chunks of one block kept mapped for reuse, at most this many bytes in all.
const SPARE_MAX_BYTES: usize = 16 << 20;

/// Whether sessions should be built into chunks: on, unless turned off or transparent huge pages
/// are (then chunks would cost ONNX Runtime's arena for nothing).
pub fn enabled() -> bool {
    crate::huge_pages::enabled()
        && std::env::var(WEIGHT_CHUNKS_ENV).map_or(true, |v| v != "0")
        && !std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .is_ok_and(|mode| mode.contains("[never]"))
}

/// One 2 MiB-aligned mapping that blocks are cut from, front to back.
#[derive(Debug)]
struct Chunk {
    len_bytes: usize,
    /// Bytes cut from the start; the next block goes at or after it.
    used_bytes: usize,
    /// Blocks cut and not yet freed.
    live_blocks: usize,
    /// Whether a load may still cut blocks from it (then it stays mapped even with none live).
    open: bool,
}

/// Every chunk by its start address.
static CHUNKS: Mutex<BTreeMap<usize, Chunk>> = Mutex::new(BTreeMap::new());

fn chunks() -> MutexGuard<'static, BTreeMap<usize, Chunk>> {
    CHUNKS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Mappings of freed one-block chunks, `(start, len_bytes)`, oldest first, not in [`CHUNKS`]:
/// the next block that needs a chunk of that length takes one instead of mapping a new one.
/// Lock order: [`CHUNKS`] before this one, never the other way.
static SPARE: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

fn spare() -> MutexGuard<'static, Vec<(usize, usize)>> {
    SPARE.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What the allocator does on this thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LoadState {
    /// glibc.
    Idle,
    /// Building a session: blocks come from chunks. `open_chunk` is the start of the one small
    /// blocks are cut from (none yet at first).
    Loading { open_chunk: Option<usize>, chunked_bytes: usize },
}

thread_local! {
    // Const-initialized and without a destructor, so ONNX Runtime may allocate on this thread
    // even while it exits: keep it that way.
    static LOAD_STATE: Cell<LoadState> = const { Cell::new(LoadState::Idle) };
}

/// While it lives, the allocations ONNX Runtime makes on this thread go into chunks. Not `Send`:
/// it ends the load of the thread that began it. A scope begun inside another does nothing.
pub(crate) struct LoadScope {
    outermost: bool,
    _same_thread: PhantomData<*const ()>,
}

impl LoadScope {
    pub(crate) fn begin() -> LoadScope {
        let outermost = LOAD_STATE.get() == LoadState::Idle;
        if outermost {
            LOAD_STATE.set(LoadState::Loading { open_chunk: None, chunked_bytes: 0 });
        }
        LoadScope { outermost, _same_thread: PhantomData }
    }

    /// Bytes of blocks cut from chunks since the load began (freed ones included).
    pub(crate) fn chunked_bytes(&self) -> usize {
        match LOAD_STATE.get() {
            LoadState::Loading { chunked_bytes, .. } => chunked_bytes,
            LoadState::Idle => 0,
        }
    }
}

impl Drop for LoadScope {
    fn drop(&mut self) {
        if !self.outermost {
            return;
        }
        if let LoadState::Loading { open_chunk: Some(start), .. } = LOAD_STATE.replace(LoadState::Idle) {
            close(&mut chunks(), start);
        }
    }
}

/// No more blocks from the chunk at `start`; unmapped at once when none is live.
fn close(chunks: &mut BTreeMap<usize, Chunk>, start: usize) {
    if let Some(chunk) = chunks.get_mut(&start) {
        chunk.open = false;
        unmap_if_unused(chunks, start);
    }
}

/// Unmaps the chunk at `start` once it is closed and none of its blocks is live (a small one is
/// kept for reuse instead, the oldest spare unmapped to make room).
fn unmap_if_unused(chunks: &mut BTreeMap<usize, Chunk>, start: usize) {
    if let Some(chunk) = chunks.get(&start).filter(|c| c.live_blocks == 0 && !c.open) {
        let len_bytes = chunk.len_bytes;
        chunks.remove(&start);
        if len_bytes > SPARE_MAX_BYTES {
            return unmap(start, len_bytes);
        }
        let mut spare = spare();
        spare.push((start, len_bytes));
        while spare.iter().map(|&(_, len)| len).sum::<usize>() > SPARE_MAX_BYTES {
            let (oldest, len) = spare.remove(0);
            unmap(oldest, len);
        }
    }
}

/// A block of `size_bytes`: from this thread's chunks while it loads; else a chunk of its own
/// when it is large, and glibc's when not.
fn allocate(size_bytes: usize) -> *mut c_void {
    let LoadState::Loading { open_chunk, chunked_bytes } = LOAD_STATE.get() else {
        let own = (size_bytes >= RUN_CHUNK_MIN_BYTES).then(|| allocate_own_chunk(size_bytes)).flatten();
        return own.map_or_else(|| allocate_plain(size_bytes), |block| block as *mut c_void);
    };
    match allocate_in_chunk(open_chunk, size_bytes) {
        Some((block, open_chunk)) => {
            LOAD_STATE.set(LoadState::Loading { open_chunk, chunked_bytes: chunked_bytes + size_bytes });
            block as *mut c_void
        }
        None => allocate_plain(size_bytes),
    }
}

/// Cuts a block from the open chunk, or from a new one; returns it and the chunk to cut the next
/// small block from.
fn allocate_in_chunk(open_chunk: Option<usize>, size_bytes: usize) -> Option<(usize, Option<usize>)> {
    if size_bytes > MAX_BLOCK_BYTES {
        return None;
    }
    if HEADER_BYTES + size_bytes.max(1) > CHUNK_BYTES / 4 {
        return Some((allocate_own_chunk(size_bytes)?, open_chunk));
    }
    if let Some(start) = open_chunk {
        // An open chunk stays mapped (only its own load closes it); `None` would start a new one.
        if let Some(block) = chunks().get_mut(&start).and_then(|chunk| cut(chunk, start, size_bytes)) {
            return Some((block, open_chunk));
        }
    }
    let start = map_aligned(CHUNK_BYTES)?;
    let mut chunks = chunks();
    let mut chunk = Chunk { len_bytes: CHUNK_BYTES, used_bytes: 0, live_blocks: 0, open: true };
    let block = cut(&mut chunk, start, size_bytes).expect("a new chunk holds its first block");
    chunks.insert(start, chunk);
    // The rest of the old chunk stays unused (never written, so never resident).
    if let Some(old) = open_chunk {
        close(&mut chunks, old);
    }
    Some((block, Some(start)))
}

/// A block in a chunk of its own (closed: it goes with its block), from a spare mapping of that
/// length when there is one.
fn allocate_own_chunk(size_bytes: usize) -> Option<usize> {
    if size_bytes > MAX_BLOCK_BYTES {
        return None;
    }
    let len_bytes = (HEADER_BYTES + size_bytes.max(1)).next_multiple_of(HUGE_PAGE_BYTES);
    // Mapped before the chunks are locked, as a load's chunks are: other threads allocate meanwhile.
    let start = take_spare(len_bytes).or_else(|| map_aligned(len_bytes))?;
    let mut chunk = Chunk { len_bytes, used_bytes: 0, live_blocks: 0, open: false };
    let block = cut(&mut chunk, start, size_bytes).expect("a new chunk holds its first block");
    chunks().insert(start, chunk);
    Some(block)
}

/// A spare mapping of exactly `len_bytes`, the newest first (its pages are the likeliest still
/// resident).
fn take_spare(len_bytes: usize) -> Option<usize> {
    let mut spare = spare();
    let index = spare.iter().rposition(|&(_, len)| len == len_bytes)?;
    Some(spare.remove(index).0)
}

/// The next block of `size_bytes` in `chunk` (at `start`), its size written in its header.
fn cut(chunk: &mut Chunk, start: usize, size_bytes: usize) -> Option<usize> {
    let header = chunk.used_bytes.next_multiple_of(BLOCK_ALIGN_BYTES);
    let end = header + HEADER_BYTES + size_bytes.max(1);
    if end > chunk.len_bytes {
        return None;
    }
    chunk.used_bytes = end;
    chunk.live_blocks += 1;
    // SAFETY: the header lies inside the chunk's mapping, 64-byte aligned, before the block.
    unsafe { ((start + header) as *mut usize).write(size_bytes) };
    Some(start + header + HEADER_BYTES)
}

fn allocate_plain(size_bytes: usize) -> *mut c_void {
    let mut out = std::ptr::null_mut();
    // SAFETY: the alignment is a power of two and a multiple of the pointer size.
    match unsafe { libc::posix_memalign(&mut out, BLOCK_ALIGN_BYTES, size_bytes.max(1)) } {
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
            if address < start + chunk.len_bytes {
                free_in_chunk(chunk, start, address);
                unmap_if_unused(&mut chunks, start);
                return;
            }
        }
    }
    // SAFETY: not in a chunk, so it came from posix_memalign and is freed once (ONNX Runtime's
    // contract for an allocator).
    unsafe { libc::free(block) }
}

/// Accounts for a block of `chunk` freed; while a load still cuts from the chunk, its memory goes
/// back at once: the last block is cut again, any other's whole base pages are released.
fn free_in_chunk(chunk: &mut Chunk, start: usize, block: usize) {
    let Some(live_blocks) = chunk.live_blocks.checked_sub(1) else {
        // A block freed twice: the memory may already belong to another block.
        eprintln!("ortex: a weight-chunk block was freed twice (0x{block:x}); aborting");
        std::process::abort();
    };
    chunk.live_blocks = live_blocks;
    if !chunk.open {
        return; // the chunk goes as a whole with its last block
    }
    // SAFETY: every chunk block is preceded by its header, written when it was cut.
    let size_bytes = unsafe { ((block - HEADER_BYTES) as *const usize).read() };
    let end = block + size_bytes.max(1);
    if end == start + chunk.used_bytes {
        chunk.used_bytes = block - HEADER_BYTES - start;
    } else {
        release_pages(block, end);
    }
}

/// Gives the whole base pages inside `[from, to)` back to the kernel (they read as zeros if
/// touched again; the block is freed, so nothing will until the chunk is unmapped).
fn release_pages(from: usize, to: usize) {
    let Some(page_bytes) = crate::huge_pages::base_page_bytes() else { return };
    let (first, last) = (from.next_multiple_of(page_bytes), to / page_bytes * page_bytes);
    if first < last {
        // SAFETY: whole pages of a freed block in one of this module's mappings; no other block
        // shares them.
        unsafe { libc::madvise(first as *mut c_void, last - first, libc::MADV_DONTNEED) };
    }
}

/// `len_bytes` (a multiple of 2 MiB) of private anonymous memory starting on a 2 MiB boundary:
/// map 2 MiB more, then unmap the head before the first boundary and the tail after the end.
///
/// ```text
///  base            start = base rounded up to 2 MiB        start + len_bytes     base + padded
///  |--- head ------|============ kept ====================|--- tail -------------|
/// ```
fn map_aligned(len_bytes: usize) -> Option<usize> {
    let padded = len_bytes + HUGE_PAGE_BYTES;
    // SAFETY: a fresh private anonymous mapping; the parts outside [start, start + len_bytes) are
    // unmapped right away and nothing else refers to them. NORESERVE: a chunk is mostly never
    // touched, so it should not count against strict overcommit.
    unsafe {
        let base = libc::mmap(
            std::ptr::null_mut(),
            padded,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
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
        let tail = base + padded - (start + len_bytes);
        if tail > 0 {
            libc::munmap((start + len_bytes) as *mut c_void, tail);
        }
        Some(start)
    }
}

fn unmap(start: usize, len_bytes: usize) {
    // SAFETY: a whole chunk this module mapped, none of whose blocks is live any more.
    unsafe { libc::munmap(start as *mut c_void, len_bytes) };
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

/// Registers the allocator in the environment (once per process). An error (an ONNX Runtime
/// without the call, say) leaves sessions on ONNX Runtime's own allocator.
pub fn register(environment: &Environment) -> ort::Result<()> {
    let api = ort::api();
    let mut info: *mut OrtMemoryInfo = std::ptr::null_mut();
    // SAFETY: plain ONNX Runtime calls with valid out-pointers; the info and the table are leaked
    // on success, so they outlive every session that uses them. The table's version is 17 (the
    // ort-sys headers): ONNX Runtime reads no field past `Info` below 18.
    unsafe {
        ort::Error::result_from_status((api.CreateCpuMemoryInfo)(
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
        ort::Error::result_from_status((api.RegisterAllocator)(environment.ptr().cast_mut(), registered.allocator))
    }
}

/// Every chunk is 2 MiB aligned, apart from the others, holds what was cut from it, and is
/// either open or has a live block (one with neither would have been unmapped or spared); the
/// spare mappings are no chunks and stay within their budget.
pub fn check_invariants() {
    let chunks = chunks();
    let mut previous_end = 0;
    for (&start, chunk) in chunks.iter() {
        assert_eq!(start % HUGE_PAGE_BYTES, 0, "chunk 0x{start:x} is not 2 MiB aligned");
        assert!(start >= previous_end, "chunk 0x{start:x} overlaps the one before it");
        assert!(chunk.used_bytes <= chunk.len_bytes, "chunk 0x{start:x}: {chunk:?}");
        assert!(chunk.open || chunk.live_blocks > 0, "chunk 0x{start:x} should have been unmapped");
        previous_end = start + chunk.len_bytes;
    }
    let spare = spare();
    assert!(
        spare.iter().map(|&(_, len)| len).sum::<usize>() <= SPARE_MAX_BYTES,
        "spare mappings past the budget: {spare:?}"
    );
    assert!(spare.iter().all(|&(start, _)| !chunks.contains_key(&start)), "a spare mapping is still a chunk");
}

#[cfg(test)]
mod tests;
