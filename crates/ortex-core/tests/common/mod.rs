//! Helpers shared by the engine's integration tests.
#![allow(dead_code)]

use ortex_core::events::flags;
use ortex_core::{Engine, RequestId, SimOptions, TurnId, TurnOptions, EVENT_STRIDE_WORDS};

/// A decoded event, as the tests read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ev {
    pub flags: u32,
    pub request: u32,
    pub turn: u32,
    pub token: i32,
    pub finish: i32,
    pub error: i32,
    pub usage: Option<(u32, u32, u32)>,
}

impl Ev {
    pub fn is_token(&self) -> bool {
        self.flags & flags::TOKEN != 0
    }
    pub fn is_finished(&self) -> bool {
        self.flags & flags::TURN_FINISHED != 0
    }
}

pub fn decode(words: &[i32], count: usize) -> Vec<Ev> {
    (0..count)
        .map(|i| {
            let w = &words[i * EVENT_STRIDE_WORDS..(i + 1) * EVENT_STRIDE_WORDS];
            Ev {
                flags: w[0] as u32,
                request: w[1] as u32,
                turn: w[2] as u32,
                token: w[3],
                finish: w[4],
                error: w[5],
                usage: (w[9] == 1).then(|| (w[6] as u32, w[7] as u32, w[8] as u32)),
            }
        })
        .collect()
}

pub fn sim(json: &str) -> Engine {
    let options: SimOptions = ortex_boundary::sim_options_from_json(json).expect("test options parse");
    Engine::simulated(&options).expect("test engine builds")
}

pub fn turn_opts(json: &str) -> TurnOptions {
    ortex_boundary::turn_options_from_json(json).expect("test turn options parse")
}

/// One run with a buffer of `capacity`, decoded.
pub fn run(engine: &mut Engine, capacity: usize) -> Vec<Ev> {
    let mut buf = vec![0i32; capacity * EVENT_STRIDE_WORDS];
    let n = engine.run(&mut buf, capacity).expect("run succeeds");
    engine.check_invariants();
    decode(&buf, n)
}

/// Runs until no work is pending, collecting every event (bounded: panics after `max_runs`).
pub fn run_all(engine: &mut Engine, capacity: usize) -> Vec<Ev> {
    let mut events = Vec::new();
    let mut runs = 0;
    while engine.has_pending_work() {
        events.extend(run(engine, capacity));
        runs += 1;
        assert!(runs < 100_000, "engine did not settle");
    }
    events
}

pub fn tokens_of(events: &[Ev], request: RequestId, turn: TurnId) -> Vec<i32> {
    events.iter().filter(|e| e.request == request.0 && e.turn == turn.0 && e.is_token()).map(|e| e.token).collect()
}

pub fn finish_of(events: &[Ev], request: RequestId, turn: TurnId) -> Vec<Ev> {
    events.iter().filter(|e| e.request == request.0 && e.turn == turn.0 && e.is_finished()).copied().collect()
}

pub const FINISH_EOS: i32 = 1;
pub const FINISH_STOP: i32 = 2;
pub const FINISH_MAX_GENERATED: i32 = 3;
pub const FINISH_MAX_SESSION: i32 = 4;
pub const FINISH_CANCELLED: i32 = 5;
pub const FINISH_FAILED: i32 = 6;

pub const ERR_CAPACITY_DEFERRED: i32 = 1;
pub const ERR_EXEC_CAPACITY: i32 = 2;
pub const ERR_RETRYABLE: i32 = 3;
pub const ERR_UNSERVICEABLE: i32 = 4;
pub const ERR_FATAL: i32 = 6;
