//! ortex-ort: runs real ONNX decoder models under the ortex engine core.
//!
//! - [`config`]: `genai_config.json` (onnxruntime-genai's folder layout) -> [`config::ModelConfig`]
//! - [`runtime`]: the ONNX Runtime library (opened at runtime by absolute path) and session options
//! - [`tokenizer`]: `tokenizer.json` through Hugging Face `tokenizers`, as the engine's text codec
//! - [`kv_store`]: the paged KV storage behind the engine's block pool
//! - [`shared_past`]: past/present buffers shared in place by GroupQueryAttention decodes (CPU)
//! - [`executor`]: [`executor::OrtExecutor`], one engine step = a few model invocations
//!
//! [`load`] puts them together: folder + options -> an engine. Native only (the WebAssembly build
//! has no ONNX Runtime).

pub mod config;
pub mod executor;
pub mod huge_pages;
pub mod kv_store;
pub mod runtime;
pub mod shared_past;
pub mod tokenizer;
pub mod weight_chunks;

use std::path::Path;
use std::sync::Arc;

use ortex_core::options::EngineOptions;
use ortex_core::{Engine, Result};

pub use config::ModelConfig;
pub use executor::{AttentionForm, Counter, ExecutorStats, OrtExecutor, StatsSnapshot, Unit};
pub use runtime::{ExecutionProvider, SessionSettings};
pub use tokenizer::TokenizerCodec;

/// `Engine.load`'s options: the engine's own plus how ONNX Runtime runs the model (the binding
/// builds them from JavaScript's object, crates/ortex-ops `ModelOptionsInput`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoadOptions {
    pub engine: EngineOptions,
    pub execution_provider: Option<ExecutionProvider>,
    /// 0 or absent: ONNX Runtime's default.
    pub intra_op_threads: Option<u32>,
    /// Intra-op threads spin between operators during a run; absent: false.
    pub intra_op_spinning: Option<bool>,
}

/// A loaded model folder: the executor and the text codec an engine is built from.
pub struct Model {
    pub executor: OrtExecutor,
    pub codec: TokenizerCodec,
}

impl Model {
    /// Loads `dir`: genai_config.json first (cheap, and the clearest errors), then the tokenizer,
    /// then ONNX Runtime and the graph. `library` is the ONNX Runtime library to open when the
    /// environment does not name one (see [`runtime`]).
    pub fn load(dir: &Path, settings: SessionSettings, library: Option<&Path>) -> Result<Model> {
        let config = ModelConfig::load(dir)?;
        let codec = TokenizerCodec::load(&config.tokenizer_file(), config.vocab_size)?;
        // The weights ONNX Runtime allocates while it builds the session go on huge pages.
        let before =
            (settings.execution_provider == ExecutionProvider::Cpu && huge_pages::enabled()).then(huge_pages::snapshot);
        let opened = runtime::with_environment(library, |env, chunks| {
            runtime::open_session(env, chunks, &config.model_file, settings)
        })?;
        if settings.execution_provider == ExecutionProvider::Cpu {
            huge_pages::return_freed_heap();
        }
        let huge = before.map(|before| huge_pages::back_new_mappings(&before)).unwrap_or_default();
        let executor = OrtExecutor::new(config, opened.session, settings.execution_provider)?;
        let stats = executor.stats();
        stats.set(Counter::HugePageBytes, huge.collapsed_bytes as u64);
        stats.set(Counter::WeightChunkBytes, opened.weight_chunk_bytes as u64);
        Ok(Model { executor, codec })
    }
}

/// An engine over a model folder, the handle to its executor's timings, and about how much
/// memory it holds outside the JavaScript heap.
pub struct LoadedEngine {
    pub engine: Engine,
    pub stats: Arc<ExecutorStats>,
    /// The model's files (the weights ONNX Runtime holds) plus the KV pool, in bytes.
    pub memory_bytes: u64,
}

pub fn load_engine(dir: &Path, options: &LoadOptions, library: Option<&Path>) -> Result<LoadedEngine> {
    let settings = SessionSettings {
        execution_provider: options.execution_provider.unwrap_or_default(),
        intra_op_threads: options.intra_op_threads,
        intra_op_spinning: options.intra_op_spinning.unwrap_or(false),
    };
    let model = Model::load(dir, settings, library)?;
    let stats = model.executor.stats();
    let kv_bytes_per_token =
        2 * u64::from(model.executor.config().num_hidden_layers) * model.executor.config().kv_width() as u64 * 4;
    let engine = Engine::new(&options.engine, Box::new(model.executor), Box::new(model.codec), 0)?;
    let kv_tokens = u64::from(engine.config().num_blocks) * u64::from(engine.config().block_size);
    let memory_bytes = folder_bytes(dir) + kv_tokens * kv_bytes_per_token;
    Ok(LoadedEngine { engine, stats, memory_bytes })
}

/// The bytes of the regular files directly in `dir` (0 for what cannot be read).
fn folder_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries.flatten().filter_map(|entry| entry.metadata().ok()).filter(|m| m.is_file()).map(|m| m.len()).sum()
}
