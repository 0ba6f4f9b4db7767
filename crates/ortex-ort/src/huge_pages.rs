//! Model weights on transparent huge pages (Linux).
//!
//! A decode step at small batch reads every weight of the model from memory once (62M parameters,
//! 248 MB, per token on the bench model): the step is bound by memory bandwidth, and on 4 KiB pages
//! it also walks the page tables for tens of thousands of pages per step. ONNX Runtime keeps the
//! weights in memory it allocates while it builds the session (prepacked MatMul weights: glibc
//! `mmap`s of a few MB each), and with transparent huge pages in `madvise` mode (the common
//! default) nobody asks for huge pages there. So the executor snapshots its anonymous mappings
//! before the session is built and, once it is, advises the 2 MiB-aligned parts of every mapping
//! that appeared `MADV_HUGEPAGE` and collapses them now (`MADV_COLLAPSE`, Linux 6.1 and later;
//! earlier kernels leave it to khugepaged). Measured in docs/performance.md.
//!
//! Only memory that appeared while the session was built is touched, only its aligned 2 MiB pages,
//! and only those already wholly resident (the weights are: ONNX Runtime wrote them), so resident
//! memory never grows, not even when another engine allocates its KV pool at the same moment.
//! Failures are ignored: huge pages are an optimization, never a requirement.
//! `ORTEX_HUGE_PAGES=0` turns it off.

/// Huge page size on x86-64 and aarch64 (4 KiB base pages).
pub(crate) const HUGE_PAGE_BYTES: usize = 2 << 20;

pub const HUGE_PAGES_ENV: &str = "ORTEX_HUGE_PAGES";

/// Address ranges `[start, end)` of the process's private anonymous writable mappings.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct AnonymousMappings(Vec<(usize, usize)>);

/// What [`back_new_mappings`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct HugePageReport {
    /// Bytes in 2 MiB-aligned ranges of new mappings advised MADV_HUGEPAGE.
    pub advised_bytes: usize,
    /// Of those, bytes the kernel collapsed into huge pages at once.
    pub collapsed_bytes: usize,
}

pub fn enabled() -> bool {
    std::env::var(HUGE_PAGES_ENV).map_or(true, |v| v != "0")
}

/// Parses `/proc/self/maps` text: private anonymous writable mappings (no file, no `[stack]` or
/// other named region).
pub fn parse_maps(maps: &str) -> AnonymousMappings {
    let mut ranges = Vec::new();
    for line in maps.lines() {
        let mut fields = line.split_whitespace();
        let (Some(range), Some(perms), Some(_offset), Some(_dev), Some(inode)) =
            (fields.next(), fields.next(), fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        if fields.next().is_some() || inode != "0" || !perms.starts_with("rw") || !perms.ends_with('p') {
            continue;
        }
        let Some((start, end)) = range.split_once('-') else { continue };
        if let (Ok(start), Ok(end)) = (usize::from_str_radix(start, 16), usize::from_str_radix(end, 16)) {
            ranges.push((start, end));
        }
    }
    ranges.sort_unstable();
    AnonymousMappings(ranges)
}

pub fn snapshot() -> AnonymousMappings {
    std::fs::read_to_string("/proc/self/maps").map(|maps| parse_maps(&maps)).unwrap_or_default()
}

/// The 2 MiB-aligned ranges inside `after` that no range of `before` overlaps.
pub fn new_huge_ranges(before: &AnonymousMappings, after: &AnonymousMappings) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    for &(start, end) in &after.0 {
        // Subtract every earlier mapping from [start, end).
        let mut pieces = vec![(start, end)];
        for &(b_start, b_end) in before.0.iter().filter(|&&(s, e)| s < end && e > start) {
            pieces = pieces
                .into_iter()
                .flat_map(|(s, e)| [(s, e.min(b_start)), (s.max(b_end), e)])
                .filter(|&(s, e)| s < e)
                .collect();
        }
        for (s, e) in pieces {
            let aligned_start = s.next_multiple_of(HUGE_PAGE_BYTES);
            let aligned_end = e / HUGE_PAGE_BYTES * HUGE_PAGE_BYTES;
            if aligned_start < aligned_end {
                out.push((aligned_start, aligned_end));
            }
        }
    }
    out
}

/// Returns to the kernel the heap pages glibc keeps for memory freed so far (`malloc_trim`). A
/// session's build frees most of what it allocated (the parsed model, and with weights inside the
/// .onnx file their unpacked copies: hundreds of MB), and glibc's adaptive mmap threshold keeps
/// much of it resident in its heaps: measured on the bench model with its weights embedded,
/// 534-660 MB resident after the load without this, 451-487 with it (docs/performance.md).
/// Called after a build and before the collapse, so that freed pages are not collapsed and kept.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn return_freed_heap() {
    // SAFETY: malloc_trim has no preconditions; it only releases free memory.
    unsafe { libc::malloc_trim(0) };
}

/// Elsewhere: nothing (the addon is built for Linux glibc only).
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn return_freed_heap() {}

/// The kernel's base page size, when it divides a huge page (always, on the platforms built for).
pub(crate) fn base_page_bytes() -> Option<usize> {
    // SAFETY: sysconf has no preconditions.
    let bytes = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).ok()?;
    (bytes > 0 && HUGE_PAGE_BYTES.is_multiple_of(bytes)).then_some(bytes)
}

/// Advises and collapses the aligned parts of the mappings that appeared since `before`, one
/// 2 MiB page at a time and only where every base page is already resident.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn back_new_mappings(before: &AnonymousMappings) -> HugePageReport {
    let mut report = HugePageReport::default();
    let Some(base_page) = base_page_bytes() else { return report };
    // One byte per base page of a huge page, for mincore.
    let mut residency = vec![0u8; HUGE_PAGE_BYTES / base_page];
    for (start, end) in new_huge_ranges(before, &snapshot()) {
        for page in (start..end).step_by(HUGE_PAGE_BYTES) {
            if !resident(page, &mut residency) {
                continue;
            }
            let pointer = page as *mut libc::c_void;
            // SAFETY: advice on a 2 MiB range of this process's own anonymous private mappings;
            // it changes how the memory is backed, never its contents.
            if unsafe { libc::madvise(pointer, HUGE_PAGE_BYTES, libc::MADV_HUGEPAGE) } != 0 {
                continue;
            }
            report.advised_bytes += HUGE_PAGE_BYTES;
            // SAFETY: as above; the collapse copies the pages into a huge page, contents kept.
            if unsafe { libc::madvise(pointer, HUGE_PAGE_BYTES, libc::MADV_COLLAPSE) } == 0 {
                report.collapsed_bytes += HUGE_PAGE_BYTES;
            }
        }
    }
    report
}

/// Whether every base page of the 2 MiB page at `start` is in memory (`pages`: one byte per base
/// page). Only those are collapsed:
/// collapsing fills the missing ones, and an allocation another thread made meanwhile and has not
/// touched yet (an engine's KV pool, say) must not grow.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn resident(start: usize, pages: &mut [u8]) -> bool {
    // SAFETY: `start` is page aligned, the range lies in one of our mappings, and `pages` has one
    // byte per base page of it.
    let ok = unsafe { libc::mincore(start as *mut libc::c_void, HUGE_PAGE_BYTES, pages.as_mut_ptr()) } == 0;
    ok && pages.iter().all(|&p| p & 1 == 1)
}

/// Elsewhere: nothing (the addon is built for Linux glibc only).
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn back_new_mappings(_before: &AnonymousMappings) -> HugePageReport {
    HugePageReport::default()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: usize = 1 << 20;

    #[test]
    fn maps_keep_private_anonymous_writable_mappings_only() {
        let maps = "\
00400000-00452000 r-xp 00000000 08:02 173521      /usr/bin/node
7f0000000000-7f0000400000 rw-p 00000000 00:00 0
7f0000400000-7f0000500000 r--p 00000000 00:00 0
7f0000600000-7f0000800000 rw-s 00000000 00:01 0
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0          [stack]
7f1000000000-7f1000200000 rw-p 00000000 00:00 0
";
        assert_eq!(
            parse_maps(maps),
            AnonymousMappings(vec![(0x7f00_0000_0000, 0x7f00_0040_0000), (0x7f10_0000_0000, 0x7f10_0020_0000)])
        );
    }

    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn a_new_mapping_is_advised_and_keeps_its_contents() {
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
        if thp.is_empty() || thp.contains("[never]") {
            return; // no transparent huge pages here: madvise refuses, nothing to check
        }
        let before = snapshot();
        // 12 MB: glibc maps it on its own, so at least 8 MB of it lies in whole aligned 2 MiB pages.
        let mut weights: Vec<f32> = (0..3 << 20).map(|i| i as f32).collect();
        weights[12_345] = -1.0;
        let report = back_new_mappings(&before);
        assert!(report.advised_bytes >= 8 * MB, "{report:?}");
        assert!(report.collapsed_bytes <= report.advised_bytes);
        assert_eq!(weights[12_345], -1.0);
        assert!(weights.iter().enumerate().all(|(i, &w)| i == 12_345 || w == i as f32));
    }

    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn memory_not_wholly_resident_is_left_alone() {
        let before = snapshot();
        let length = 8 * MB;
        // SAFETY: a fresh private anonymous mapping, unmapped below.
        let pointer = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                length,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(pointer, libc::MAP_FAILED);
        // One base page touched in every 2 MiB, as a pool another engine has just begun to use.
        let start = pointer as usize;
        for offset in (0..length).step_by(HUGE_PAGE_BYTES) {
            // SAFETY: inside the mapping.
            unsafe { *((start + offset) as *mut u8) = 1 };
        }
        let report = back_new_mappings(&before);
        let mut pages = vec![0u8; length / 4096];
        // SAFETY: the mapping made above, one byte per 4 KiB page.
        assert_eq!(unsafe { libc::mincore(pointer, length, pages.as_mut_ptr()) }, 0);
        let resident = pages.iter().filter(|&&p| p & 1 == 1).count();
        // SAFETY: the mapping made above.
        unsafe { libc::munmap(pointer, length) };
        assert!(resident <= length / HUGE_PAGE_BYTES + 1, "{resident} pages resident after {report:?}");
    }

    #[test]
    fn only_new_aligned_ranges_are_taken() {
        let base = 0x7f00_0000_0000usize;
        let before = AnonymousMappings(vec![(base, base + 3 * MB)]);
        // The old mapping grew by 5 MB; a new unaligned 5 MB mapping; a new 1 MB one.
        let after = AnonymousMappings(vec![
            (base, base + 8 * MB),
            (base + 16 * MB + 4096, base + 21 * MB + 4096),
            (base + 32 * MB, base + 33 * MB),
        ]);
        assert_eq!(
            new_huge_ranges(&before, &after),
            vec![(base + 4 * MB, base + 8 * MB), (base + 18 * MB, base + 20 * MB)]
        );
        assert!(new_huge_ranges(&after, &after).is_empty());
    }
}
