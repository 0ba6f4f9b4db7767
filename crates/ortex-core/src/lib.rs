//! ortex-core: the pure, synchronous, deterministic heart of ortex.
//!
//! No I/O, no clocks, no threads, no ONNX Runtime. Time is a value passed in, randomness comes
//! from seeded generators, maps iterate in a defined order. That is what lets the native addon and
//! the WebAssembly build produce the same event trace for the same seed.
//!
//! The life of a token: [`engine::Engine::run`] asks the [`scheduler`] to plan one step
//! (`plan`), hands the plan to an [`executor::Executor`] (`execute`), then applies the output and
//! publishes events (`commit`).
//!
//! One owner per piece of state: the [`engine::Engine`] owns the requests (and is the only code
//! that removes one), [`kv::manager`] owns the block pool and every block table (admit, reserve a
//! step, commit or roll it back, free, truncate), the [`scheduler`] owns its waiting order and
//! starvation counts, [`events`] owns the retained events, and [`session`] the duplex rules.

pub mod constraint;
pub mod draws;
pub mod engine;
pub mod error;
pub mod events;
pub mod executor;
pub mod ids;
pub mod kv;
pub mod options;
pub mod output;
pub mod request;
pub mod request_table;
pub mod rng;
pub mod sampling;
pub mod scheduler;
pub mod session;
pub mod sim;
pub mod text;

pub use engine::{Engine, EngineStats, RunStart, Transaction};
pub use error::{ErrorCode, OrtexError, Result};
pub use events::{Event, EventErrorCode, FinishReason, StopMatch, Usage, EVENT_STRIDE_WORDS};
pub use executor::{ExecError, Executor, KvGeometry, ModelInfo, StepOutput};
pub use ids::{BlockId, RequestId, TurnId};
pub use options::{BatchingMode, EngineConfig, EngineOptions, RequestOptions, SimFaults, SimOptions, TurnOptions};
pub use request::{FinishedTurn, RequestState};
