//! Hostile templates against the render budget: every builtin or operator that can make a small
//! template allocate gigabytes fails with CHAT_TEMPLATE_FAILED naming the budget, and the render's
//! allocations stay within it. This test binary counts what each thread allocates (its own global
//! allocator), so each case measures the peak of its own render.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::{Duration, Instant};

use ortex_chat::{ChatErrorCode, ChatTemplate, RenderInput, SpecialTokens, RENDER_DATA_BYTES};
use serde_json::json;

/// The system allocator, counting the bytes the current thread holds and the most it held.
struct PerThreadPeak;

thread_local! {
    static HELD_BYTES: Cell<isize> = const { Cell::new(0) };
    static PEAK_BYTES: Cell<isize> = const { Cell::new(0) };
}

fn track(delta: isize) {
    // `try_with`: a thread's last frees come after its thread-locals are gone.
    let _ = HELD_BYTES.try_with(|held| {
        let now = held.get() + delta;
        held.set(now);
        let _ = PEAK_BYTES.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

unsafe impl GlobalAlloc for PerThreadPeak {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let block = unsafe { System.alloc(layout) };
        if !block.is_null() {
            track(layout.size() as isize);
        }
        block
    }

    unsafe fn dealloc(&self, block: *mut u8, layout: Layout) {
        unsafe { System.dealloc(block, layout) };
        track(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, block: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let moved = unsafe { System.realloc(block, layout, new_size) };
        if !moved.is_null() {
            track(new_size as isize - layout.size() as isize);
        }
        moved
    }
}

#[global_allocator]
static ALLOCATOR: PerThreadPeak = PerThreadPeak;

/// What one render allocated at its peak, above what the thread held before it.
struct Measured<T> {
    result: T,
    peak_bytes: u64,
    elapsed: Duration,
}

// A test of how long a hostile render runs reads the clock; the renderer itself reads none.
#[allow(clippy::disallowed_methods)]
fn measure<T>(render: impl FnOnce() -> T) -> Measured<T> {
    let before = HELD_BYTES.with(Cell::get);
    PEAK_BYTES.with(|peak| peak.set(before));
    let started = Instant::now();
    let result = render();
    let elapsed = started.elapsed();
    let peak = PEAK_BYTES.with(Cell::get);
    Measured { result, peak_bytes: (peak - before).max(0) as u64, elapsed }
}

/// A render's allocations peak at twice the data it may create (budget.rs says why), plus the input
/// and the environment, which 16 MiB covers.
const PEAK_LIMIT_BYTES: u64 = 2 * RENDER_DATA_BYTES + (16 << 20);

/// Renders `source` (one short user message) and checks that it failed on the budget, within it, and
/// that the message says where (`detail`: the builtin that refused, when it was one of the renderer's).
#[track_caller]
fn assert_over_budget(source: &str, detail: Option<&str>) {
    let template = ChatTemplate::new(source, SpecialTokens::default()).expect("the template parses");
    let input = RenderInput::new(json!([{"role": "user", "content": "hi"}]));
    let measured = measure(|| template.render(&input));
    let error = measured.result.expect_err("a hostile template fails");
    assert_eq!(error.code, ChatErrorCode::TemplateFailed, "{source}: {}", error.message);
    assert!(
        error.message.contains("render budget of 1048576 fuel") && error.message.contains("64 MiB"),
        "the message names the limit: {}",
        error.message
    );
    if let Some(detail) = detail {
        assert!(error.message.contains(detail), "{source}: {}", error.message);
    }
    assert!(
        measured.peak_bytes <= PEAK_LIMIT_BYTES,
        "{source}: allocated {} MiB at its peak, past {} MiB",
        measured.peak_bytes >> 20,
        PEAK_LIMIT_BYTES >> 20
    );
    // Generous (each case takes well under a second in a release build); it catches a render that
    // ran on for minutes, not a slow machine.
    assert!(measured.elapsed < Duration::from_secs(30), "{source}: took {:?}", measured.elapsed);
}

#[test]
fn the_issues_template_fails_within_the_budget() {
    assert_over_budget("{{ ('a ' * 50000000).split()|length }}", None);
    assert_over_budget("{{ ('a\\n' * 50000000).splitlines()|length }}", None);
}

#[test]
fn str_split_is_paid_for_before_the_list_is_made() {
    assert_over_budget("{{ ('a ' * 5000000).split()|length }}", Some("str.split would create a list of 5000000 items"));
    assert_over_budget("{{ ('a,' * 5000000).split(',')|length }}", Some("str.split"));
    assert_over_budget("{{ ('a ' * 5000000).split(none, 4000000)|length }}", Some("str.split"));
    assert_over_budget("{{ ('a' * 10000000).split('')|length }}", Some("str.split"));
}

#[test]
fn str_splitlines_is_paid_for_before_the_list_is_made() {
    assert_over_budget("{{ ('a\\n' * 5000000).splitlines()|length }}", Some("str.splitlines"));
    assert_over_budget("{{ ('a\\n' * 5000000).splitlines(true)|length }}", Some("str.splitlines"));
}

#[test]
fn the_split_and_lines_filters_are_paid_for_before_the_list_is_made() {
    assert_over_budget("{{ ('a ' * 5000000)|split|length }}", Some("split would create"));
    assert_over_budget("{{ ('a\\n' * 5000000)|lines|length }}", Some("lines would create"));
}

#[test]
fn str_join_stops_at_the_budget() {
    assert_over_budget("{{ ' '.join(['x' * 1000000] * 1000)|length }}", Some("str.join"));
    // A join that writes nothing still pays for the items it visits.
    assert_over_budget("{{ ''.join([''] * 100000000)|length }}", None);
}

#[test]
fn the_join_filter_stops_at_the_budget() {
    assert_over_budget("{{ (['x' * 1000000] * 1000)|join(' ')|length }}", None);
}

#[test]
fn str_replace_pays_for_its_growth() {
    assert_over_budget("{{ ('a' * 10000000).replace('a', 'bbbbbbbbbb')|length }}", None);
}

#[test]
fn str_format_pays_for_its_widths_and_arguments() {
    assert_over_budget("{{ '{:>1000000000}'.format(1)|length }}", Some("str.format"));
    assert_over_budget("{{ '{}'.format(['x' * 1000000] * 1000)|length }}", Some("str.format"));
}

#[test]
fn case_changes_are_paid_for() {
    assert_over_budget("{% set s = 'a' * 30000000 %}{{ s.upper()|length }}", Some("str.upper"));
}

#[test]
fn string_repetition_and_concatenation_stop_at_the_budget() {
    assert_over_budget("{{ 'ab' * 50000000 }}", None);
    assert_over_budget("{{ ('ab' * 20000000)|length }}{{ ('ab' * 20000000)|length }}", None);
    assert_over_budget(
        "{% set ns = namespace(s='a' * 1000000) %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
        None,
    );
    assert_over_budget(
        "{% set ns = namespace(s='a' * 1000000) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
        None,
    );
}

#[test]
fn loops_that_append_stop_at_the_budget() {
    assert_over_budget(
        "{% set ns = namespace(items=[]) %}{% for i in range(100000) %}{% set ns.items = ns.items + ['x' * 10000] %}{% endfor %}{{ ns.items|length }}",
        None,
    );
    assert_over_budget(
        "{% set ns = namespace(s='') %}{% for i in range(100000) %}{% set ns.s = ns.s ~ ('x' * 10000) %}{% endfor %}{{ ns.s|length }}",
        None,
    );
}

#[test]
fn printing_a_lazily_repeated_list_stops_at_the_budget() {
    assert_over_budget("{{ ['x' * 1000000] * 1000 }}", Some("printing a value"));
    assert_over_budget("{{ (['x' * 1000000] * 1000)|string|length }}", Some("printing a value"));
    assert_over_budget("{{ (['x' * 1000000] * 1000)|tojson|length }}", Some("tojson"));
    assert_over_budget("{{ ([['x' * 1000] * 1000] * 1000)|tojson(indent=2)|length }}", Some("tojson"));
    assert_over_budget("{{ raise_exception(['x' * 1000000] * 1000) }}", Some("raise_exception"));
}

#[test]
fn materializing_a_lazily_repeated_list_stops_at_the_budget() {
    assert_over_budget("{{ ([0] * 100000000)|list|length }}", None);
}

#[test]
fn the_output_stops_at_the_budget() {
    assert_over_budget("{% for i in range(100000) %}{{ 'x' * 10000 }}{% endfor %}", None);
}

#[test]
fn methods_python_has_but_the_renderer_lacks_fail_without_allocating() {
    for source in ["{{ 'a'.center(1000000000) }}", "{{ 'a'.ljust(1000000000) }}", "{{ 'a'.zfill(1000000000) }}"] {
        let template = ChatTemplate::new(source, SpecialTokens::default()).unwrap();
        let measured = measure(|| template.render(&RenderInput::new(json!([{"role": "user", "content": "hi"}]))));
        assert_eq!(measured.result.unwrap_err().code, ChatErrorCode::TemplateFailed);
        assert!(measured.peak_bytes < 1 << 20, "{source}: {} bytes", measured.peak_bytes);
    }
}

#[test]
fn a_large_conversation_renders_within_the_budget() {
    // 10,000 short messages and a 4 MB one: more than a big chat request holds, rendered as before.
    let mut messages: Vec<_> = (0..10_000)
        .map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": format!("message {i}")}))
        .collect();
    messages.push(json!({"role": "user", "content": "word ".repeat(800_000)}));
    let text = ChatTemplate::chatml().render(&RenderInput::new(json!(messages))).unwrap();
    assert!(text.len() > 4_000_000 && text.ends_with("<|im_end|>\n"), "{}", text.len());
}
