//! Prints one digest per seed of the whole event trace of a randomized workload: every event's
//! fields, every call's result (accepted, or its error code) and the engine's counters after
//! every run. A refactor that must not change behaviour keeps every line identical:
//!
//! ```text
//!   cargo run --release -p ortex-core --example trace_digest -- 400 > before.txt
//!   ... change the code ...
//!   cargo run --release -p ortex-core --example trace_digest -- 400 | diff before.txt -
//! ```
//!
//! `TRACE_PREFIX_CACHING=off` runs every seed without the prefix cache (the engine as it was
//! before the cache existed); `on` with it; unset, even seeds have it.
//!
//! To compare across a change that adds event words, hash only the words both sides have:
//! `TRACE_EVENT_WORDS=10 cargo run ...` hashes each event's first 10 words (the stride before
//! the stop kind and index were added).
//!
//! The workload covers what the scheduler and the KV accounting decide: arrivals, continuations,
//! prefills, truncations, cancels, closes and abandoned requests, greedy and sampled turns with
//! limits and stop sequences, chunked prefill under a token budget, KV pressure (preemption),
//! static and dynamic batching, injected retryable, capacity and fatal faults, and random buffer
//! capacities.

use ortex_core::rng::{hash2, Rng};
use ortex_core::{Engine, RequestId, RequestOptions, SimOptions, TurnId, TurnOptions, EVENT_STRIDE_WORDS};

fn options_for(seed: u64, rng: &mut Rng) -> String {
    let block_size = [1, 2, 4, 8, 16][rng.below(5) as usize];
    let max_length = [16, 32, 64, 128][rng.below(4) as usize];
    let per_row = (max_length as u64).div_ceil(block_size);
    let num_blocks = 1 + rng.below(per_row * 4);
    let faults = match rng.below(6) {
        0 => r#","faults":{"retryableRate":0.05,"capacityRate":0.05,"seed":11}"#.to_string(),
        1 => format!(r#","faults":{{"fatalSteps":[{}],"seed":3}}"#, rng.below(200)),
        _ => String::new(),
    };
    format!(
        r#"{{"seed":{seed},"prefixCaching":{},"batching":"{}","maxLength":{max_length},"blockSize":{block_size},"numBlocks":{num_blocks},"maxBatchSize":{},"maxScheduledTokens":{},"prefillChunkSize":{},"maxPrefillWaitSteps":{},"eosProbability":{},"vocabSize":{}{faults}}}"#,
        prefix_caching(seed),
        if rng.below(4) == 0 { "static" } else { "dynamic" },
        1 + rng.below(6),
        [1, 2, 8, 32, 512][rng.below(5) as usize],
        1 + rng.below(16),
        rng.below(6),
        [0.0, 0.05, 0.3][rng.below(3) as usize],
        [16, 300, 32000][rng.below(3) as usize],
    )
}

fn turn_options(rng: &mut Rng, vocab: u32) -> TurnOptions {
    let mut json = format!(r#"{{"maxGeneratedTokens":{}"#, rng.below(10));
    if rng.below(2) == 0 {
        json +=
            &format!(r#","temperature":{},"topK":{},"topP":0.9"#, [0.5, 1.0, 1.5][rng.below(3) as usize], rng.below(5));
    }
    if rng.below(4) == 0 {
        json += &format!(r#","stopTokenIds":[[{}]]"#, rng.below(u64::from(vocab.min(12))));
    }
    if rng.below(6) == 0 {
        json += r#","ignoreEos":true"#;
    }
    json += "}";
    ortex_boundary::turn_options_from_json(&json).expect("turn options parse")
}

struct Trace {
    digest: u64,
    event_words: usize,
}

impl Trace {
    fn add(&mut self, value: u64) {
        self.digest = hash2(self.digest, value);
    }

    fn result<T>(&mut self, result: &ortex_core::Result<T>) {
        self.add(match result {
            Ok(_) => 0,
            Err(error) => 1 + error.code as u64,
        });
    }
}

fn act(engine: &mut Engine, rng: &mut Rng, live: &mut Vec<RequestId>, trace: &mut Trace) {
    let vocab = engine.config().vocab_size;
    let pick = |rng: &mut Rng, live: &[RequestId]| live[rng.below(live.len() as u64) as usize];
    match rng.below(12) {
        0 | 1 if live.len() < 10 => {
            let max = [0, 8, 24, 60][rng.below(4) as usize];
            let result = engine.create_request(&RequestOptions { max_session_tokens: Some(max) });
            trace.result(&result);
            if let Ok(id) = result {
                live.push(id);
            }
        }
        2..=4 if !live.is_empty() => {
            let id = pick(rng, live);
            let len = 1 + rng.below(20) as usize;
            let prompt: Vec<i32> = (0..len).map(|_| rng.below(u64::from(vocab)) as i32).collect();
            let options = turn_options(rng, vocab);
            let result = engine.begin_turn(id, &prompt, &options);
            trace.result(&result);
        }
        5 if !live.is_empty() => {
            let id = pick(rng, live);
            let len = 1 + rng.below(12) as usize;
            let tokens: Vec<i32> = (0..len).map(|_| rng.below(u64::from(vocab)) as i32).collect();
            let result = engine.prefill(id, &tokens);
            trace.result(&result);
        }
        6 if !live.is_empty() => {
            let id = pick(rng, live);
            let count = engine.token_count(id).unwrap_or(0);
            let result = engine.truncate(id, rng.below(u64::from(count) + 1) as u32);
            trace.result(&result);
        }
        7 | 8 if !live.is_empty() => {
            let id = pick(rng, live);
            let turn = TurnId(1 + rng.below(4) as u32);
            let result = engine.cancel_turn(id, turn);
            trace.result(&result);
            trace.add(u64::from(result.unwrap_or(false)));
        }
        9 if !live.is_empty() => {
            let id = live.swap_remove(rng.below(live.len() as u64) as usize);
            if rng.below(2) == 0 {
                let result = engine.close_request(id);
                trace.result(&result);
            } else {
                engine.abandon_request(id);
            }
        }
        _ => {}
    }
}

fn run(engine: &mut Engine, rng: &mut Rng, trace: &mut Trace) -> bool {
    let capacity = [1, 2, 3, 8, 64][rng.below(5) as usize];
    let mut words = vec![0i32; capacity * EVENT_STRIDE_WORDS];
    let result = engine.run(&mut words, capacity);
    trace.result(&result);
    let Ok(count) = result else { return false };
    trace.add(count as u64);
    for event in words[..count * EVENT_STRIDE_WORDS].chunks(EVENT_STRIDE_WORDS) {
        for &word in &event[..trace.event_words] {
            trace.add(u64::from(word as u32));
        }
    }
    let stats = engine.stats();
    for value in [
        u64::from(stats.free_blocks),
        u64::from(stats.active_requests),
        u64::from(stats.pending_turns),
        u64::from(stats.retained_events),
        stats.steps,
        stats.prompt_tokens,
        stats.generated_tokens,
    ] {
        trace.add(value);
    }
    engine.check_invariants();
    true
}

fn digest_of(seed: u64) -> u64 {
    let mut rng = Rng::new(seed);
    let options: SimOptions =
        ortex_boundary::sim_options_from_json(&options_for(seed, &mut rng)).expect("options parse");
    let mut trace = Trace { digest: seed, event_words: event_words_hashed() };
    let mut engine = match Engine::simulated(&options) {
        Ok(engine) => engine,
        Err(error) => return hash2(seed, error.code as u64),
    };
    let mut live = Vec::new();
    for _ in 0..250 {
        for _ in 0..rng.below(3) {
            act(&mut engine, &mut rng, &mut live, &mut trace);
        }
        if !run(&mut engine, &mut rng, &mut trace) || !engine.is_healthy() {
            break;
        }
    }
    for _ in 0..2000 {
        if !engine.has_pending_work() || !run(&mut engine, &mut rng, &mut trace) {
            break;
        }
    }
    for id in live {
        let result = engine.close_request(id);
        trace.result(&result);
    }
    trace.add(u64::from(engine.stats().free_blocks));
    trace.digest
}

/// `TRACE_PREFIX_CACHING=off` or `on` for every seed; otherwise on for even seeds (without a
/// draw from the workload's generator, so the workloads are the same either way).
fn prefix_caching(seed: u64) -> bool {
    match std::env::var("TRACE_PREFIX_CACHING").as_deref() {
        Ok("off") => false,
        Ok("on") => true,
        _ => seed.is_multiple_of(2),
    }
}

/// How many leading words of each event the digest covers (all unless `TRACE_EVENT_WORDS` says).
fn event_words_hashed() -> usize {
    std::env::var("TRACE_EVENT_WORDS").map_or(EVENT_STRIDE_WORDS, |n| {
        n.parse::<usize>().expect("TRACE_EVENT_WORDS is a number").min(EVENT_STRIDE_WORDS)
    })
}

fn main() {
    let seeds: u64 = std::env::args().nth(1).map_or(400, |n| n.parse().expect("the seed count is a number"));
    for seed in 1..=seeds {
        println!("{seed} {:016x}", digest_of(seed));
    }
}
