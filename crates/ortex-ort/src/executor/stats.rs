//! [`ExecutorStats`]: the executor's cumulative counters, shared with whoever wants to read them
//! while the executor is inside the engine (the binding reports them for benchmarks).
//!
//! The counters are one list, [`Counter`]: the atomics, the snapshot and the report keys all come
//! from it, so adding a counter is one line.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// What a counter's value is in, which also ends its report key (units last).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// Things counted: reported as they are, the key is the name.
    Count,
    /// Wall-clock nanoseconds: reported in whole microseconds, the key ends in `Us`.
    Nanoseconds,
    /// Reported as they are, the key ends in `Bytes`.
    Bytes,
}

impl Unit {
    fn key_suffix(self) -> &'static str {
        match self {
            Unit::Count => "",
            Unit::Nanoseconds => "Us",
            Unit::Bytes => "Bytes",
        }
    }

    fn reported(self, value: u64) -> u64 {
        match self {
            Unit::Nanoseconds => value / 1000,
            Unit::Count | Unit::Bytes => value,
        }
    }
}

/// Defines [`Counter`] from one list of `Variant: "name", Unit;` lines: the enum (whose
/// discriminants index the counter arrays), [`Counter::ALL`] in the same order, and each
/// counter's name and unit.
macro_rules! counters {
    ($($(#[doc = $doc:literal])* $variant:ident: $name:literal, $unit:ident;)*) => {
        /// One executor counter. Its discriminant is its index in [`Counter::ALL`].
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum Counter {
            $($(#[doc = $doc])* $variant,)*
        }

        impl Counter {
            /// Every counter, in report order.
            pub const ALL: [Counter; [$(stringify!($variant)),*].len()] = [$(Counter::$variant),*];

            /// The counter's name in reports (camelCase, without its unit).
            pub const fn name(self) -> &'static str {
                match self {
                    $(Counter::$variant => $name,)*
                }
            }

            pub const fn unit(self) -> Unit {
                match self {
                    $(Counter::$variant => Unit::$unit,)*
                }
            }
        }
    };
}

counters! {
    /// Engine steps (transactions) executed.
    Steps: "steps", Count;
    /// Model invocations (session runs); a step runs one per group of its rows.
    Invocations: "invocations", Count;
    /// Plan rows executed.
    Rows: "rows", Count;
    /// New positions executed, all rows together.
    Tokens: "tokens", Count;
    /// Decode invocations that took their past from the previous step's present or shared
    /// buffers (no gather).
    Carried: "carried", Count;
    /// Building the inputs: ids, mask, positions and the past tensors gathered from the blocks.
    GatherNs: "gather", Nanoseconds;
    /// Inside `Session::run`.
    RunNs: "run", Nanoseconds;
    /// Reading the outputs: logits into the step output, present into the blocks.
    ScatterNs: "scatter", Nanoseconds;
    /// The whole `execute`, grouping included.
    ExecuteNs: "execute", Nanoseconds;
    /// Model memory collapsed into 2 MiB pages at load (huge_pages.rs).
    HugePageBytes: "hugePage", Bytes;
    /// Memory ONNX Runtime allocated while the session was built, packed into 2 MiB-aligned
    /// chunks (weight_chunks.rs; freed blocks included).
    WeightChunkBytes: "weightChunk", Bytes;
    /// The paged KV store's arenas, all layers, keys and values (set when the pool is attached).
    KvStoreBytes: "kvStore", Bytes;
    /// The KV of one token position in the store: all layers, keys and values, in the model's
    /// element type (a float16 model's is half a float32 twin's).
    KvPositionBytes: "kvPosition", Bytes;
    /// Rounds of steps run one position per invocation (a model that cannot run a chunk after
    /// a past: probe.rs).
    PositionRounds: "positionRounds", Count;
    /// Host inputs sent to the model: ids, masks, positions, block tables, lengths, logits
    /// indices (what a step moves to the device besides the KV, under CUDA).
    HostInputBytes: "hostInput", Bytes;
    /// Logits the model returned (all positions' for a graph without last-position logits).
    LogitsBytes: "logits", Bytes;
    /// KV copied between the host KV store and the model's tensors: pasts gathered, presents
    /// scattered (0 for a paged-attention graph, whose pool the model reads and writes itself).
    KvCopiedBytes: "kvCopied", Bytes;
}

impl Counter {
    pub const COUNT: usize = Counter::ALL.len();

    /// The key reports print it under: its name, then its reported unit (`gatherUs`).
    pub fn report_key(self) -> String {
        format!("{}{}", self.name(), self.unit().key_suffix())
    }
}

/// The live counters, one atomic per [`Counter`].
#[derive(Debug, Default)]
pub struct ExecutorStats {
    values: [AtomicU64; Counter::COUNT],
}

impl ExecutorStats {
    pub fn add(&self, counter: Counter, value: u64) {
        self.values[counter as usize].fetch_add(value, Ordering::Relaxed);
    }

    pub fn set(&self, counter: Counter, value: u64) {
        self.values[counter as usize].store(value, Ordering::Relaxed);
    }

    /// Adds the nanoseconds since `started` to a timing counter.
    pub(crate) fn add_since(&self, counter: Counter, started: Instant) {
        self.add(counter, elapsed_ns(started));
    }

    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot { values: std::array::from_fn(|i| self.values[i].load(Ordering::Relaxed)) }
    }
}

/// The counters' values at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StatsSnapshot {
    values: [u64; Counter::COUNT],
}

impl StatsSnapshot {
    pub fn get(&self, counter: Counter) -> u64 {
        self.values[counter as usize]
    }

    /// Every counter as (report key, value in its reported unit), in report order.
    pub fn report(&self) -> impl Iterator<Item = (String, u64)> + '_ {
        Counter::ALL.iter().map(|&counter| (counter.report_key(), counter.unit().reported(self.get(counter))))
    }
}

/// Wall-clock reads for the timing counters. The executor measures real time on purpose (the
/// core's ban on clocks keeps the engine deterministic; timings never feed back into it).
#[allow(clippy::disallowed_methods)]
pub(crate) fn now() -> Instant {
    Instant::now()
}

fn elapsed_ns(since: Instant) -> u64 {
    since.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discriminants_index_the_list() {
        for (i, counter) in Counter::ALL.iter().enumerate() {
            assert_eq!(*counter as usize, i, "{counter:?}");
        }
    }

    #[test]
    fn reports_keep_the_keys_and_units_the_typescript_side_reads() {
        let stats = ExecutorStats::default();
        for (i, &counter) in Counter::ALL.iter().enumerate() {
            stats.add(counter, 1000 * (i as u64 + 1) + 999);
        }
        let report: Vec<(String, u64)> = stats.snapshot().report().collect();
        let expected = [
            ("steps", 1999),
            ("invocations", 2999),
            ("rows", 3999),
            ("tokens", 4999),
            ("carried", 5999),
            ("gatherUs", 6),
            ("runUs", 7),
            ("scatterUs", 8),
            ("executeUs", 9),
            ("hugePageBytes", 10999),
            ("weightChunkBytes", 11999),
            ("kvStoreBytes", 12999),
            ("kvPositionBytes", 13999),
            ("positionRounds", 14999),
            ("hostInputBytes", 15999),
            ("logitsBytes", 16999),
            ("kvCopiedBytes", 17999),
        ];
        let expected: Vec<(String, u64)> = expected.iter().map(|&(key, value)| (key.to_string(), value)).collect();
        assert_eq!(report, expected);
    }

    #[test]
    fn set_replaces_and_add_accumulates() {
        let stats = ExecutorStats::default();
        stats.add(Counter::Rows, 3);
        stats.add(Counter::Rows, 4);
        stats.set(Counter::HugePageBytes, 5);
        stats.set(Counter::HugePageBytes, 6);
        let snapshot = stats.snapshot();
        assert_eq!((snapshot.get(Counter::Rows), snapshot.get(Counter::HugePageBytes)), (7, 6));
        assert_eq!(snapshot.get(Counter::Steps), 0);
    }
}
