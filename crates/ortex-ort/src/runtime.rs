//! ONNX Runtime itself: the shared library, opened once per process by absolute path, and the
//! session options ortex runs models with.
//!
//! Which library: `ORTEX_ORT_DYLIB`, else `ORT_DYLIB_PATH`, else the path the caller passes (the
//! facade passes a `libonnxruntime.so.1` beside the addon when packaged, else the one the npm
//! package onnxruntime-node ships). When onnxruntime-node runs in the same process, loading its
//! very file matters: the dynamic loader then shares one copy of ONNX Runtime.
//!
//! No global thread pools: each session owns its intra-op pool, with spinning off by default
//! (spinning threads burn the cores that the JS thread and other sessions need). Spinning on
//! (`intraOpSpinning`) is ONNX Runtime's default: the pool's threads spin between operators and
//! for a short while after a run before they block, so the next engine step finds them awake.
//! (`session.force_spinning_stop`, blocking them as each run returns, measured 7-10% slower per
//! token at concurrency 1 on the bench model: every run then starts by waking its threads.)

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use ort::environment::Environment;
use ort::session::builder::{GraphOptimizationLevel, SessionBuilder};
use ort::session::Session;
use ortex_core::{ErrorCode, OrtexError, Result};
use serde::Deserialize;

use crate::weight_chunks;

pub const LIBRARY_ENV: &str = "ORTEX_ORT_DYLIB";
pub const ORT_LIBRARY_ENV: &str = "ORT_DYLIB_PATH";
/// A file prefix: when set, every session ortex opens writes ONNX Runtime's own profile (a
/// Chrome trace of each operator's time, `PREFIX_<date>.json`) when it is closed. A diagnostic
/// (docs/performance.md, "The batch-16 step against onnxruntime-genai's"), slow: never in production.
pub const PROFILE_ENV: &str = "ORTEX_ORT_PROFILE";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ExecutionProvider {
    #[default]
    Cpu,
    Cuda,
}

impl ExecutionProvider {
    pub fn as_str(self) -> &'static str {
        match self {
            ExecutionProvider::Cpu => "cpu",
            ExecutionProvider::Cuda => "cuda",
        }
    }
}

/// How a session runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SessionSettings {
    pub execution_provider: ExecutionProvider,
    /// Intra-op threads; `None` or 0: ONNX Runtime's default (one per physical core).
    pub intra_op_threads: Option<u32>,
    /// Whether intra-op threads spin between operators while a run is going.
    pub intra_op_spinning: bool,
}

fn load_error(message: impl Into<String>) -> OrtexError {
    OrtexError::new(ErrorCode::ModelLoad, message)
}

/// The process's ONNX Runtime environment and the library it came from.
struct Runtime {
    environment: Environment,
    library: PathBuf,
    /// Whether ortex's CPU allocator is registered in the environment ([`weight_chunks`]).
    weight_chunks: bool,
}

static RUNTIME: Mutex<Option<Runtime>> = Mutex::new(None);

/// The library to open: the environment overrides win over the caller's path.
fn choose_library(given: Option<&Path>) -> Result<(PathBuf, &'static str)> {
    let from_env =
        |name: &'static str| std::env::var_os(name).filter(|v| !v.is_empty()).map(|v| (PathBuf::from(v), name));
    let (path, source) = from_env(LIBRARY_ENV)
        .or_else(|| from_env(ORT_LIBRARY_ENV))
        .or_else(|| given.map(|p| (p.to_path_buf(), "the path given by the caller")))
        .ok_or_else(|| {
            load_error(format!(
                "no ONNX Runtime library: install the npm package onnxruntime-node, or set {LIBRARY_ENV} to the \
                 absolute path of libonnxruntime.so.1"
            ))
        })?;
    // A relative path would resolve against the node binary's folder inside ort; make it
    // relative to the working directory, as a user means it.
    let path = std::path::absolute(&path)
        .map_err(|e| load_error(format!("ONNX Runtime library path {} (from {source}): {e}", path.display())))?;
    if !path.is_file() {
        return Err(load_error(format!("ONNX Runtime library {} (from {source}) does not exist", path.display())));
    }
    Ok((path, source))
}

/// Opens the library once per process and creates the environment; later calls reuse it (a
/// different path then changes nothing: one process has one ONNX Runtime).
///
/// `f` also learns whether ortex's own CPU allocator is registered (see [`open_session`]).
pub fn with_environment<T>(library: Option<&Path>, f: impl FnOnce(&Environment, bool) -> Result<T>) -> Result<T> {
    let mut runtime = RUNTIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if runtime.is_none() {
        let (path, source) = choose_library(library)?;
        let builder = ort::init_from(&path).map_err(|e| {
            load_error(format!("cannot load the ONNX Runtime library {} (from {source}): {e}", path.display()))
        })?;
        let environment = builder
            .with_name("ortex")
            .with_telemetry(false)
            .build()
            .map_err(|e| load_error(format!("cannot create the ONNX Runtime environment: {e}")))?;
        let weight_chunks = weight_chunks::register(&environment).is_ok();
        *runtime = Some(Runtime { environment, library: path, weight_chunks });
    }
    let runtime = runtime.as_ref().expect("set above");
    f(&runtime.environment, runtime.weight_chunks)
}

/// The library the process loaded, once one is.
pub fn loaded_library() -> Option<PathBuf> {
    RUNTIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner).as_ref().map(|r| r.library.clone())
}

fn builder_error<'a>(
    model_file: &'a Path,
    what: &'a str,
) -> impl FnOnce(ort::Error<SessionBuilder>) -> OrtexError + 'a {
    move |e| load_error(format!("{}: cannot {what}: {e}", model_file.display()))
}

/// A session just built, and how many bytes of what ONNX Runtime allocated meanwhile went into
/// weight chunks.
pub struct OpenedSession {
    pub session: Session,
    pub weight_chunk_bytes: usize,
}

/// Opens `model_file` (from its path, so ONNX Runtime finds the external weights beside it), or
/// `edited`, the file's bytes as ortex changed them (layer_attention.rs), with the external
/// weights still read from the file's folder.
/// With `weight_chunks` (the allocator is registered), a CPU session allocates through it, so its
/// weights are packed into 2 MiB-aligned chunks while it is built.
pub fn open_session(
    environment: &Environment,
    weight_chunks: bool,
    model_file: &Path,
    edited: Option<&[u8]>,
    settings: SessionSettings,
) -> Result<OpenedSession> {
    if !model_file.is_file() {
        return Err(load_error(format!("{}: the model file is missing", model_file.display())));
    }
    let mut builder = Session::builder(environment)
        .map_err(|e| load_error(format!("{}: cannot create session options: {e}", model_file.display())))?
        .with_optimization_level(GraphOptimizationLevel::All)
        .map_err(builder_error(model_file, "set the optimization level"))?
        .with_inter_threads(1)
        .map_err(builder_error(model_file, "set inter-op threads"))?
        .with_intra_op_spinning(settings.intra_op_spinning)
        .map_err(builder_error(model_file, "set intra-op spinning"))?
        .with_inter_op_spinning(false)
        .map_err(builder_error(model_file, "turn inter-op spinning off"))?;
    if let Some(threads) = settings.intra_op_threads.filter(|&t| t > 0) {
        builder =
            builder.with_intra_threads(threads as usize).map_err(builder_error(model_file, "set intra-op threads"))?;
    }
    if let Some(prefix) = std::env::var_os(PROFILE_ENV).filter(|v| !v.is_empty()) {
        builder = builder.with_profiling(prefix).map_err(builder_error(model_file, "turn profiling on"))?;
    }
    if settings.execution_provider == ExecutionProvider::Cuda {
        // error_on_failure: without it ort logs the failure and silently runs on the CPU.
        let cuda = ort::ep::CUDA::default().build().error_on_failure();
        builder = builder.with_execution_providers([cuda]).map_err(|e| {
            load_error(format!(
                "executionProvider 'cuda' is unavailable: ONNX Runtime could not register the CUDA execution \
                 provider ({}). It needs libonnxruntime_providers_cuda.so and libonnxruntime_providers_shared.so \
                 beside the ONNX Runtime library, and the CUDA and cuDNN libraries; use executionProvider 'cpu' \
                 where they are missing",
                e.to_string().trim()
            ))
        })?;
    }
    let chunked = weight_chunks && settings.execution_provider == ExecutionProvider::Cpu && weight_chunks::enabled();
    if chunked {
        // The session then allocates everything through ortex's allocator, at inference too
        // (glibc there, instead of ONNX Runtime's arena: no cost measured, docs/performance.md).
        builder = builder
            .with_config_entry("session.use_env_allocators", "1")
            .map_err(builder_error(model_file, "use ortex's allocator"))?;
    }
    if edited.is_some() {
        let folder = model_file.parent().unwrap_or(Path::new("."));
        builder = builder
            .with_config_entry("session.model_external_initializers_file_folder_path", folder.to_string_lossy())
            .map_err(builder_error(model_file, "name the folder of the external weights"))?;
    }
    let scope = chunked.then(weight_chunks::LoadScope::begin);
    let committed = match edited {
        Some(bytes) => builder.commit_from_memory(bytes),
        None => builder.commit_from_file(model_file),
    };
    let session = committed.map_err(|e| {
        let reason = e.to_string().trim().to_string();
        let hint = if settings.execution_provider == ExecutionProvider::Cuda && reason.contains("CUDA") {
            " (executionProvider 'cuda')"
        } else {
            ""
        };
        load_error(format!("{}: ONNX Runtime cannot load the model{hint}: {reason}", model_file.display()))
    })?;
    let weight_chunk_bytes = scope.as_ref().map_or(0, weight_chunks::LoadScope::chunked_bytes);
    Ok(OpenedSession { session, weight_chunk_bytes })
}
