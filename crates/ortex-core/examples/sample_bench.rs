//! Times one `sampling::sample` call on a 49,152-entry vocabulary (SmolLM2's), as a model row
//! would reach it: temperature 0.7 with top-p 0.9, with top-k 40, and with min-p 0.05.
//!
//! ```text
//!   cargo run --release -p ortex-core --example sample_bench [-- RUNS]
//! ```
//!
//! The row is synthetic but shaped like a language model's: a bulk of roughly normal logits
//! (standard deviation 2.5) and a head of 16 tokens 10 to 16 above it. Each setting prints the
//! median, the 10th and the 90th percentile of RUNS timed calls (default 400) after 20 untimed.

// A benchmark reads the wall clock, which the core itself never does.
#![allow(clippy::disallowed_methods)]

use ortex_core::rng::Rng;
use ortex_core::executor::RowLogits;
use ortex_core::sampling::{sample, History, SamplerScratch, SamplingParams};
use ortex_core::TurnOptions;
use std::time::Instant;

const VOCAB: usize = 49_152;

fn synthetic_row(seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    // A sum of 4 uniforms: near normal, variance 4/12.
    let mut row: Vec<f32> =
        (0..VOCAB).map(|_| ((0..4).map(|_| rng.next_f64()).sum::<f64>() - 2.0) as f32 * 2.5 * 1.732).collect();
    for _ in 0..16 {
        let at = rng.below(VOCAB as u64) as usize;
        row[at] = 10.0 + (rng.next_f64() * 6.0) as f32;
    }
    row
}

fn median_micros(row: &[f32], params: &SamplingParams, runs: usize) -> (f64, f64, f64) {
    let mut rng = Rng::new(7);
    let mut scratch = SamplerScratch::default();
    let mut call = |rng: &mut Rng| {
        sample(RowLogits::Dense(row), params, History { context: &[], generated: 0 }, rng, &mut scratch)
    };
    for _ in 0..20 {
        std::hint::black_box(call(&mut rng));
    }
    let mut times: Vec<f64> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            std::hint::black_box(call(&mut rng));
            start.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    times.sort_by(f64::total_cmp);
    (times[runs / 10], times[runs / 2], times[runs * 9 / 10])
}

fn main() {
    let runs: usize = std::env::args().nth(1).map_or(400, |n| n.parse().expect("RUNS is a number"));
    let row = synthetic_row(29);
    let settings = [
        (
            "temperature 0.7, top_p 0.9",
            TurnOptions { temperature: Some(0.7), top_p: Some(0.9), ..TurnOptions::default() },
        ),
        (
            "temperature 0.7, top_k 40",
            TurnOptions { temperature: Some(0.7), top_k: Some(40), ..TurnOptions::default() },
        ),
        (
            "temperature 0.7, min_p 0.05",
            TurnOptions { temperature: Some(0.7), min_p: Some(0.05), ..TurnOptions::default() },
        ),
        ("temperature 0.7 alone", TurnOptions { temperature: Some(0.7), ..TurnOptions::default() }),
    ];
    for (name, options) in settings {
        let params = SamplingParams::from_options(&options).expect("valid options");
        let (p10, p50, p90) = median_micros(&row, &params, runs);
        println!("{name:<30} median {p50:8.1} us  (p10 {p10:.1}, p90 {p90:.1}; {runs} runs)");
    }
}
