use super::*;

const MB: usize = 1 << 20;

/// Held by the tests that allocate outside a load: they share the spare mappings.
static OUTSIDE_A_LOAD: Mutex<()> = Mutex::new(());

fn outside_a_load() -> MutexGuard<'static, ()> {
    OUTSIDE_A_LOAD.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The chunk a block lies in: (start, len_bytes, live_blocks, open).
fn chunk_of(block: *mut c_void) -> Option<(usize, usize, usize, bool)> {
    let address = block as usize;
    let chunks = chunks();
    let (&start, chunk) = chunks.range(..=address).next_back()?;
    (address < start + chunk.len_bytes).then_some((start, chunk.len_bytes, chunk.live_blocks, chunk.open))
}

fn fill(block: *mut c_void, size_bytes: usize, byte: u8) {
    // SAFETY: `block` holds at least `size_bytes` bytes.
    unsafe { std::ptr::write_bytes(block.cast::<u8>(), byte, size_bytes) }
}

/// Whether every base page of `[from, from + len)` is resident.
fn resident(from: usize, len: usize) -> bool {
    let mut pages = vec![0u8; len.div_ceil(crate::huge_pages::base_page_bytes().expect("a base page size"))];
    // SAFETY: a page-aligned range of a live mapping, one byte per page.
    let ok = unsafe { libc::mincore(from as *mut c_void, len, pages.as_mut_ptr()) } == 0;
    assert!(ok);
    pages.iter().all(|&p| p & 1 == 1)
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
    assert_eq!(scope.chunked_bytes(), sizes.iter().sum::<usize>());
    let (start, len, live, open) = chunk_of(blocks[0]).expect("in a chunk");
    assert_eq!((start % HUGE_PAGE_BYTES, len, live, open), (0, CHUNK_BYTES, 4, true));
    assert_eq!(start + HEADER_BYTES, blocks[0] as usize);
    // One after the other, each after its header on the next cache line.
    for (pair, &size) in blocks.windows(2).zip(&sizes) {
        assert_eq!(pair[1] as usize - pair[0] as usize, size.next_multiple_of(BLOCK_ALIGN_BYTES) + HEADER_BYTES);
    }
    drop(scope);
    blocks[..3].iter().for_each(|&b| free(b));
    assert_eq!(chunk_of(blocks[3]).map(|c| (c.2, c.3)), Some((1, false)), "closed, one block live");
    free(blocks[3]);
    assert_eq!(chunk_of(blocks[3]), None, "unmapped with its last block");
    check_invariants();
}

#[test]
fn a_large_block_gets_a_chunk_of_its_own_and_small_ones_keep_filling_theirs() {
    let scope = LoadScope::begin();
    let small = allocate(1000);
    let large = allocate(CHUNK_BYTES / 2);
    let next = allocate(1000);
    let (start, len, _, open) = chunk_of(large).expect("in a chunk");
    let own_len = (HEADER_BYTES + CHUNK_BYTES / 2).next_multiple_of(HUGE_PAGE_BYTES);
    assert_eq!((start + HEADER_BYTES, len, open), (large as usize, own_len, false));
    assert_eq!(next as usize, small as usize + 1024 + HEADER_BYTES, "the small blocks' chunk is still open");
    fill(large, CHUNK_BYTES / 2, 1);
    free(large);
    assert_eq!(chunk_of(large), None);
    free(small);
    free(next);
    assert!(chunk_of(small).is_some(), "an open chunk stays mapped with no block live");
    drop(scope);
    assert_eq!(chunk_of(small), None, "and goes when its load ends");
}

#[test]
fn a_full_chunk_is_closed_and_the_next_block_starts_another() {
    let scope = LoadScope::begin();
    let blocks: Vec<_> = (0..16).map(|_| allocate(4 * MB)).collect();
    // 15 blocks of 4 MiB and their headers fit in 64 MiB; the 16th does not.
    let first = chunk_of(blocks[0]).expect("in a chunk").0;
    assert!(blocks[..15].iter().all(|&b| chunk_of(b).map(|c| c.0) == Some(first)));
    let (second, _, live, open) = chunk_of(blocks[15]).expect("in a chunk");
    assert_ne!(second, first);
    assert_eq!((live, open), (1, true));
    assert_eq!(chunk_of(blocks[0]).map(|c| (c.2, c.3)), Some((15, false)), "the full chunk is closed");
    blocks.iter().for_each(|&b| free(b));
    assert_eq!(chunk_of(blocks[0]), None, "closed and empty: unmapped");
    assert!(chunk_of(blocks[15]).is_some(), "open: kept until the load ends");
    drop(scope);
    assert_eq!(chunk_of(blocks[15]), None);
}

#[test]
fn memory_freed_during_a_load_goes_back_at_once() {
    let scope = LoadScope::begin();
    let first = allocate(MB);
    let middle = allocate(MB);
    let last = allocate(MB);
    for block in [first, middle, last] {
        fill(block, MB, 9);
    }
    let page = crate::huge_pages::base_page_bytes().expect("a base page size");
    let page_after = |b: *mut c_void| (b as usize).next_multiple_of(page);
    assert!(resident(page_after(middle), MB - page));
    free(middle);
    assert!(!resident(page_after(middle), MB - page), "a block in the middle: its pages released");
    free(last);
    assert_eq!(allocate(100), last, "the last block is cut again");
    // SAFETY: the first block is live and holds a MiB.
    assert_eq!(unsafe { *first.cast::<u8>().add(MB - 1) }, 9, "its neighbour is untouched");
    drop(scope);
    free(first);
    free(last);
    assert_eq!(chunk_of(first), None);
}

#[test]
fn a_scope_begun_inside_another_does_not_end_the_load() {
    let outer = LoadScope::begin();
    drop(LoadScope::begin());
    let block = allocate(1000);
    assert!(chunk_of(block).is_some());
    drop(outer);
    free(block);
    assert_eq!(chunk_of(block), None);
    assert_eq!(LOAD_STATE.get(), LoadState::Idle);
}

#[test]
fn outside_a_load_small_blocks_come_from_glibc() {
    let _serial = outside_a_load();
    let block = allocate(RUN_CHUNK_MIN_BYTES - 1);
    assert_eq!(block as usize % BLOCK_ALIGN_BYTES, 0);
    assert_eq!(chunk_of(block), None);
    fill(block, RUN_CHUNK_MIN_BYTES - 1, 3);
    free(block);
    free(std::ptr::null_mut());
}

/// Whether a freed chunk's mapping at `start` is kept for reuse.
fn spared(start: usize) -> bool {
    spare().iter().any(|&(s, _)| s == start)
}

#[test]
fn outside_a_load_a_large_block_gets_a_chunk_whose_mapping_is_reused_once_freed() {
    let _serial = outside_a_load();
    // 9 MiB: a chunk length (10 MiB) that no other test allocates outside a load.
    let size = 9 * MB;
    let block = allocate(size);
    let (start, len, live, open) = chunk_of(block).expect("a chunk of its own");
    assert_eq!((start % HUGE_PAGE_BYTES, len, live, open), (0, 10 * MB, 1, false));
    fill(block, size, 7);
    free(block);
    assert_eq!(chunk_of(block), None);
    assert!(spared(start));
    // The next block of that length takes the same mapping, its pages still resident.
    let again = allocate(size);
    assert_eq!(again, block);
    assert!(!spared(start));
    assert!(resident(start, size));
    free(again);
}

#[test]
fn a_freed_chunk_larger_than_the_spare_budget_is_not_kept() {
    let _serial = outside_a_load();
    let block = allocate(SPARE_MAX_BYTES + MB);
    let (start, ..) = chunk_of(block).expect("a chunk of its own");
    fill(block, SPARE_MAX_BYTES + MB, 1);
    free(block);
    assert_eq!(chunk_of(block), None);
    assert!(!spared(start));
}

#[test]
fn an_impossible_size_fails_instead_of_wrapping() {
    let _scope = LoadScope::begin();
    assert!(allocate(usize::MAX - 8).is_null());
}

/// Prints the seed when a test fails while it lives.
struct SeedOnFailure(u64);

impl Drop for SeedOnFailure {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("weight_chunks: failing seed {}", self.0);
        }
    }
}

/// Each chunk holding a model block counts exactly the model's blocks in it as live.
fn check_live_counts(live: &[(*mut c_void, usize, u8)]) {
    let mut expected: BTreeMap<usize, usize> = BTreeMap::new();
    for &(block, ..) in live {
        if let Some((start, ..)) = chunk_of(block) {
            *expected.entry(start).or_default() += 1;
        }
    }
    let chunks = chunks();
    for (start, count) in expected {
        assert_eq!(chunks[&start].live_blocks, count, "chunk 0x{start:x}");
    }
}

/// Random allocations and frees, in and out of loads, against a model: the blocks it holds (their
/// bytes must survive every other operation, and each chunk counts its own as live), with the
/// invariants checked after every step. A failing seed prints itself.
#[test]
fn random_operations_keep_blocks_apart_and_chunks_accounted() {
    let _serial = outside_a_load();
    for seed in 1..=8u64 {
        let _seed = SeedOnFailure(seed);
        let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let mut next = move |n: usize| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng % n as u64) as usize
        };
        let mut scope: Option<LoadScope> = None;
        let mut live: Vec<(*mut c_void, usize, u8)> = Vec::new();
        for step in 0..400 {
            match next(10) {
                0 => scope = if scope.is_some() { None } else { Some(LoadScope::begin()) },
                1..=5 => {
                    let size = if next(20) == 0 { 20 * MB } else { 1 + next(3 * MB) };
                    let block = allocate(size);
                    assert!(!block.is_null(), "seed {seed} step {step}");
                    let byte = (step % 251) as u8;
                    fill(block, size, byte);
                    live.push((block, size, byte));
                }
                _ if !live.is_empty() => {
                    let (block, size, byte) = live.swap_remove(next(live.len()));
                    // SAFETY: a live block of `size` bytes.
                    let (head, tail) = unsafe { (*block.cast::<u8>(), *block.cast::<u8>().add(size - 1)) };
                    assert_eq!((head, tail), (byte, byte), "seed {seed} step {step}: a block was overwritten");
                    free(block);
                }
                _ => {}
            }
            check_invariants();
            check_live_counts(&live);
        }
        drop(scope);
        live.into_iter().for_each(|(block, ..)| free(block));
        check_invariants();
    }
}
