//! Engine overhead with the simulated executor at zero model cost: microseconds per step and
//! tokens per second at 1, 16, 256 and 1024 running (decoding) requests.
//!
//! Run: `cargo bench -p ortex-core --bench engine_overhead` (writes bench/out/engine-overhead.json).
//! Goal (issue 2): cost per step grows at most linearly with rows and stays under 20 us at 256 rows.

// A benchmark measures wall time; the determinism rule is for the core, not for this program.
#![allow(clippy::disallowed_methods)]

use std::time::Instant;

use ortex_core::{Engine, RequestOptions, SimOptions, TurnOptions, EVENT_STRIDE_WORDS};

struct Measure {
    rows: u32,
    steps: u64,
    us_per_step: f64,
    tokens_per_s: f64,
}

/// `-- --prefix-caching off` measures with the prefix cache off (default: on, the engine's default).
fn prefix_caching() -> bool {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == "--prefix-caching").is_none_or(|i| args.get(i + 1).map(String::as_str) != Some("off"))
}

fn engine_with_decoders(rows: u32, steps: u64) -> Engine {
    let max_length = steps as u32 + 64;
    let json = format!(
        r#"{{"seed":1,"maxLength":{max_length},"blockSize":16,"maxBatchSize":{rows},"maxScheduledTokens":{},"numBlocks":{},"prefixCaching":{}}}"#,
        rows.max(512),
        rows * max_length.div_ceil(16),
        prefix_caching()
    );
    let options: SimOptions = ortex_boundary::sim_options_from_json(&json).unwrap();
    let mut engine = Engine::simulated(&options).unwrap();
    let turn: TurnOptions = ortex_boundary::turn_options_from_json(r#"{"ignoreEos":true}"#).unwrap();
    for i in 0..rows {
        let r = engine.create_request(&RequestOptions::default()).unwrap();
        engine.begin_turn(r, &[3 + (i % 200) as i32; 8], &turn).unwrap();
    }
    engine
}

fn measure(rows: u32, steps: u64) -> Measure {
    let mut engine = engine_with_decoders(rows, steps);
    let capacity = rows as usize;
    let mut buf = vec![0i32; capacity * EVENT_STRIDE_WORDS];
    for _ in 0..20 {
        engine.run(&mut buf, capacity).unwrap();
    }
    let tokens_before = engine.stats().generated_tokens;
    let start = Instant::now();
    for _ in 0..steps {
        let n = engine.run(&mut buf, capacity).unwrap();
        assert_eq!(n, rows as usize, "every row decodes every step");
    }
    let elapsed = start.elapsed().as_secs_f64();
    let tokens = engine.stats().generated_tokens - tokens_before;
    Measure { rows, steps, us_per_step: elapsed * 1e6 / steps as f64, tokens_per_s: tokens as f64 / elapsed }
}

/// The median of several fresh measurements: one short run on a shared 2-core machine is noisy.
fn median_measure(rows: u32, steps: u64, repeats: usize) -> Measure {
    let mut runs: Vec<Measure> = (0..repeats).map(|_| measure(rows, steps)).collect();
    runs.sort_by(|a, b| a.us_per_step.total_cmp(&b.us_per_step));
    runs.swap_remove(repeats / 2)
}

fn main() {
    // `-- --rows N` measures one row count once (for profilers such as callgrind); add
    // `--prefix-caching off` to measure without the prefix cache.
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--rows") {
        let rows: u32 = args[i + 1].parse().expect("--rows takes a number");
        let m = measure(rows, 2_000);
        println!("{} rows: {:.2} us/step", m.rows, m.us_per_step);
        return;
    }
    let cases = [(1u32, 20_000u64), (16, 10_000), (256, 2_000), (1024, 500)];
    let results: Vec<Measure> = cases.iter().map(|&(rows, steps)| median_measure(rows, steps, 9)).collect();
    println!("median of 9 runs per row count");
    println!("{:>6} {:>8} {:>12} {:>14} {:>12}", "rows", "steps", "us/step", "tokens/s", "us/row");
    for m in &results {
        println!(
            "{:>6} {:>8} {:>12.2} {:>14.0} {:>12.3}",
            m.rows,
            m.steps,
            m.us_per_step,
            m.tokens_per_s,
            m.us_per_step / f64::from(m.rows)
        );
    }
    let at_256 = results.iter().find(|m| m.rows == 256).unwrap();
    let per_row_16 = results[1].us_per_step / 16.0;
    let per_row_1024 = results[3].us_per_step / 1024.0;
    println!(
        "goal: < 20 us/step at 256 rows -> {:.2} us ({:.2}x the goal)",
        at_256.us_per_step,
        at_256.us_per_step / 20.0
    );
    println!(
        "linearity: us/row at 1024 rows / us/row at 16 rows = {:.2} (<= ~1 means at most linear)",
        per_row_1024 / per_row_16
    );
    let json: Vec<String> = results
        .iter()
        .map(|m| {
            format!(
                r#"{{"rows":{},"steps":{},"usPerStep":{:.3},"tokensPerSecond":{:.0}}}"#,
                m.rows, m.steps, m.us_per_step, m.tokens_per_s
            )
        })
        .collect();
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/out");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("engine-overhead.json"), format!("[{}]\n", json.join(","))).unwrap();
}
