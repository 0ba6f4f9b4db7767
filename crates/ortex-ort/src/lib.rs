//! ortex-ort: runs real ONNX decoder models under the ortex engine core.
//!
//! - [`config`]: `genai_config.json` (onnxruntime-genai's folder layout) -> [`config::ModelConfig`]
//! - [`runtime`]: the ONNX Runtime library (opened at runtime by absolute path) and session options
//! - [`tokenizer`]: `tokenizer.json` through Hugging Face `tokenizers`, as the engine's text codec
//! - [`onnx_graph`]: the graph's nodes read from model.onnx, and the one edit ortex makes
//! - [`layer_attention`]: each layer's attention and window, reconciled with genai_config.json
//! - [`kv_element`]: the KV and logits element type (float32, float16, bfloat16)
//! - [`kv_store`]: the paged KV storage behind the engine's block pool
//! - [`kv_pool`]: a paged-attention graph's KV blocks, in the session's memory (device under CUDA)
//! - [`past_present_buffer`]: past/present buffers shared in place by GroupQueryAttention decodes (CPU)
//! - [`placement`]: which execution provider runs each node, as ONNX Runtime assigned them
//! - [`executor`]: [`executor::OrtExecutor`], one engine step = a few model invocations
//!
//! [`load`] puts them together: folder + options -> an engine. Native only (the WebAssembly build
//! has no ONNX Runtime).

pub mod config;
pub mod executor;
pub mod huge_pages;
pub mod kv_element;
pub mod kv_pool;
pub mod kv_store;
pub mod layer_attention;
pub mod onnx_graph;
pub mod past_present_buffer;
pub mod placement;
pub mod runtime;
pub mod tokenizer;
pub mod weight_chunks;

use std::path::Path;
use std::sync::Arc;

use ortex_core::options::EngineOptions;
use ortex_core::{Engine, ErrorCode, OrtexError, Result};

pub use config::ModelConfig;
pub use executor::{AttentionForm, Counter, ExecutorStats, OrtExecutor, StatsSnapshot, Unit};
pub use layer_attention::AttentionPlan;
pub use placement::NodePlacement;
pub use runtime::{ExecutionProvider, SessionSettings};
pub use tokenizer::TokenizerCodec;

/// `Engine.load`'s options: the engine's own plus how ONNX Runtime runs the model (the binding
/// builds them from JavaScript's object, crates/ortex-boundary `ModelOptionsInput`).
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
    /// Which execution provider runs each node of the session.
    pub placement: NodePlacement,
}

impl Model {
    /// Loads `dir`: genai_config.json first (cheap, and the clearest errors), then the tokenizer,
    /// then the graph's attention nodes, then ONNX Runtime and the session. `library` is the ONNX
    /// Runtime library to open when the environment does not name one (see [`runtime`]).
    pub fn load(dir: &Path, settings: SessionSettings, library: Option<&Path>) -> Result<Model> {
        let config = ModelConfig::load(dir)?;
        let codec = TokenizerCodec::load(&config.tokenizer_file(), config.vocab_size)?;
        let (plan, edited) = plan_attention(&config, settings.execution_provider)?;
        // The weights ONNX Runtime allocates while it builds the session go on huge pages.
        let before =
            (settings.execution_provider == ExecutionProvider::Cpu && huge_pages::enabled()).then(huge_pages::snapshot);
        let opened = runtime::with_environment(library, |env, chunks| {
            runtime::open_session(env, chunks, &config.model_file, edited.as_deref(), settings)
        })?;
        drop(edited);
        if settings.execution_provider == ExecutionProvider::Cpu {
            huge_pages::return_freed_heap();
        }
        let huge = before.map(|before| huge_pages::back_new_mappings(&before)).unwrap_or_default();
        let executor = OrtExecutor::new(config, opened.session, settings.execution_provider, plan)?;
        let stats = executor.stats();
        stats.set(Counter::HugePageBytes, huge.collapsed_bytes as u64);
        stats.set(Counter::WeightChunkBytes, opened.weight_chunk_bytes as u64);
        Ok(Model { executor, codec, placement: opened.placement })
    }
}

/// Reads the graph's attention nodes and reconciles them with the config ([`layer_attention`]);
/// returns the plan and, when a window must be set in the graph, the edited model bytes. A graph
/// whose attention runs on CUDA only fails here under another provider, before ONNX Runtime
/// would fail less clearly building the session.
fn plan_attention(config: &ModelConfig, provider: ExecutionProvider) -> Result<(AttentionPlan, Option<Vec<u8>>)> {
    let file = &config.model_file;
    let model_error = |reason: String| OrtexError::new(ErrorCode::ModelLoad, format!("{}: {reason}", file.display()));
    if !file.is_file() {
        return Err(model_error("the model file is missing".into()));
    }
    let bytes = std::fs::read(file).map_err(|e| model_error(format!("cannot read the file: {e}")))?;
    let nodes = onnx_graph::read_nodes(&bytes).map_err(|e| model_error(e.to_string()))?;
    let plan = AttentionPlan::new(config, &nodes).map_err(|reason| {
        OrtexError::new(ErrorCode::ModelLoad, format!("{}: {reason}", config.config_file().display()))
    })?;
    let declared = onnx_graph::read_metadata(&bytes, "ortex.paged_kernel").map_err(|e| model_error(e.to_string()))?;
    check_paged_kernel(&plan, declared.as_deref(), provider).map_err(model_error)?;
    if plan.nodes_to_window.is_empty() {
        return Ok((plan, None));
    }
    let window = i64::from(plan.window_to_set);
    let edited = onnx_graph::set_int_attribute(&bytes, &plan.nodes_to_window, "local_window_size", window)
        .map_err(|e| model_error(e.to_string()))?;
    Ok((plan, Some(edited)))
}

/// ONNX Runtime has `com.microsoft.PagedAttention` on CUDA only: a folder that uses it (or says
/// `ortex.paged_kernel` = `cuda`) under another provider is refused, saying what runs instead.
fn check_paged_kernel(plan: &AttentionPlan, declared: Option<&str>, provider: ExecutionProvider) -> Result<(), String> {
    let cuda_only = plan.uses(layer_attention::AttentionOp::Paged) || declared == Some("cuda");
    if !cuda_only || provider == ExecutionProvider::Cuda {
        return Ok(());
    }
    Err(format!(
        "the model's attention is com.microsoft.PagedAttention, which ONNX Runtime runs on CUDA only, and \
         executionProvider is '{}'; load it with executionProvider: 'cuda', or on the CPU use a folder with the \
         reference paged kernel (ortex make-model --attention paged --paged-kernel reference) or GroupQueryAttention \
         (--attention gqa)",
        provider.as_str()
    ))
}

/// An engine over a model folder, the handle to its executor's timings, and about how much
/// memory it holds outside the JavaScript heap.
pub struct LoadedEngine {
    pub engine: Engine,
    pub stats: Arc<ExecutorStats>,
    /// The model's files (the weights ONNX Runtime holds) plus the KV pool when it is in host
    /// memory, in bytes.
    pub memory_bytes: u64,
    pub execution_provider: ExecutionProvider,
    /// Which execution provider runs each node (see [`LoadedEngine::cpu_fallback`]).
    pub placement: NodePlacement,
}

impl LoadedEngine {
    /// For a CUDA engine whose session runs some nodes on the CPU: which, counted by op type (one
    /// sentence, [`NodePlacement::fallback_summary`]). None on the CPU or when all run on CUDA.
    pub fn cpu_fallback(&self) -> Option<String> {
        match self.execution_provider {
            ExecutionProvider::Cpu => None,
            ExecutionProvider::Cuda => self.placement.fallback_summary("CUDAExecutionProvider"),
        }
    }
}

pub fn load_engine(dir: &Path, options: &LoadOptions, library: Option<&Path>) -> Result<LoadedEngine> {
    let settings = SessionSettings {
        execution_provider: options.execution_provider.unwrap_or_default(),
        intra_op_threads: options.intra_op_threads,
        intra_op_spinning: options.intra_op_spinning.unwrap_or(false),
    };
    let model = Model::load(dir, settings, library)?;
    let placement = model.placement;
    let stats = model.executor.stats();
    // A paged folder's pool under CUDA is device memory, which is no pressure on the host's heap.
    let kv_on_device = model.executor.attention_form() == AttentionForm::Paged
        && settings.execution_provider == ExecutionProvider::Cuda;
    let kv_bytes_per_token = if kv_on_device { 0 } else { model.executor.kv_bytes_per_position() };
    let engine = Engine::new(&options.engine, Box::new(model.executor), Box::new(model.codec), 0)?;
    let kv_tokens = u64::from(engine.config().num_blocks) * u64::from(engine.config().block_size);
    let memory_bytes = folder_bytes(dir) + kv_tokens * kv_bytes_per_token;
    Ok(LoadedEngine { engine, stats, memory_bytes, execution_provider: settings.execution_provider, placement })
}

/// The bytes of the regular files directly in `dir` (0 for what cannot be read).
fn folder_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries.flatten().filter_map(|entry| entry.metadata().ok()).filter(|m| m.is_file()).map(|m| m.len()).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layer_attention::{AttentionOp, LayerAttention};

    fn plan(op: AttentionOp) -> AttentionPlan {
        let layer = LayerAttention { op, window: None, window_cache: false };
        AttentionPlan { layers: vec![layer.clone(), layer], nodes_to_window: Vec::new(), window_to_set: 0 }
    }

    #[test]
    fn a_cuda_paged_kernel_is_refused_on_the_cpu_saying_what_runs_there() {
        let (cpu, cuda) = (ExecutionProvider::Cpu, ExecutionProvider::Cuda);
        let reason = check_paged_kernel(&plan(AttentionOp::Paged), None, cpu).unwrap_err();
        assert!(reason.contains("CUDA only") && reason.contains("executionProvider is 'cpu'"), "{reason}");
        assert!(reason.contains("--paged-kernel reference"), "{reason}");
        assert!(check_paged_kernel(&plan(AttentionOp::Plain), Some("cuda"), cpu).is_err());
        assert!(check_paged_kernel(&plan(AttentionOp::Paged), Some("cuda"), cuda).is_ok());
        assert!(check_paged_kernel(&plan(AttentionOp::Plain), Some("reference"), cpu).is_ok());
        assert!(check_paged_kernel(&plan(AttentionOp::GroupQuery), None, cpu).is_ok());
    }
}
