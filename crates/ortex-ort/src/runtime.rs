//! ONNX Runtime itself: the shared library, opened once per process by absolute path, and the
//! session options ortex runs models with.
//!
//! Which library: `ORTEX_ORT_DYLIB`, else `ORT_DYLIB_PATH`, else the path the caller passes (the
//! facade passes a `libonnxruntime.so.1` beside the addon when packaged, else the one the npm
//! package onnxruntime-node ships). When onnxruntime-node runs in the same process, loading its
//! very file matters: the dynamic loader then shares one copy of ONNX Runtime.
//! ONNX Runtime 1.24 or newer: ort asks for its C API version 24 (placement.rs reads the node
//! placement through it); ortex ships 1.30 (CPU) and 1.31 (CUDA).
//!
//! No global thread pools: each session owns its intra-op pool, with spinning off by default
//! (spinning threads burn the cores that the JS thread and other sessions need). Spinning on
//! (`intraOpSpinning`) is ONNX Runtime's default: the pool's threads spin between operators and
//! for a short while after a run before they block, so the next engine step finds them awake.
//! (`session.force_spinning_stop`, blocking them as each run returns, measured 7-10% slower per
//! token at concurrency 1 on the bench model: every run then starts by waking its threads.)

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use ort::environment::Environment;
use ort::session::builder::{GraphOptimizationLevel, SessionBuilder};
use ort::session::Session;
use ortex_core::{ErrorCode, OrtexError, Result};
use serde::Deserialize;

use crate::placement::{self, NodePlacement};
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

/// The process's ONNX Runtime environment.
struct Runtime {
    environment: Environment,
    /// Whether ortex's CPU allocator is registered in the environment ([`weight_chunks`]).
    weight_chunks: bool,
}

static RUNTIME: Mutex<Option<Runtime>> = Mutex::new(None);
/// The library RUNTIME came from: apart, so that code running under RUNTIME's lock can read it.
static LIBRARY: OnceLock<PathBuf> = OnceLock::new();

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
        let _ = LIBRARY.set(path); // set once: RUNTIME is set once, under its lock
        *runtime = Some(Runtime { environment, weight_chunks });
    }
    let runtime = runtime.as_ref().expect("set above");
    f(&runtime.environment, runtime.weight_chunks)
}

/// The library the process loaded, once one is.
pub fn loaded_library() -> Option<PathBuf> {
    LIBRARY.get().cloned()
}

/// What ONNX Runtime's CUDA 13 provider (onnxruntime-gpu 1.31) needs from the host, as the
/// dynamic loader names the files, and what provides each (its ELF NEEDED list, plus cuDNN, which
/// it opens itself).
const CUDA_HOST_LIBRARIES: [(&str, &str); 6] = [
    ("libcuda.so.1", "NVIDIA driver"),
    ("libcudart.so.13", "CUDA 13 runtime"),
    ("libcublas.so.13", "CUDA 13 cuBLAS"),
    ("libcublasLt.so.13", "CUDA 13 cuBLAS"),
    ("libcurand.so.10", "CUDA 13 cuRAND"),
    ("libcudnn.so.9", "cuDNN 9"),
];

/// Said after every CUDA failure: what a host needs, and where the libraries may come from.
pub const CUDA_HOST_NEEDS: &str = "executionProvider 'cuda' needs an NVIDIA GPU and driver for CUDA 13 (580 or \
     newer), the CUDA 13 runtime libraries (libcudart.so.13, libcublas.so.13, libcublasLt.so.13, libcurand.so.10) and \
     cuDNN 9 (libcudnn.so.9) where the dynamic loader finds them: the CUDA 13 toolkit's and cuDNN's lib folders, or \
     pip's nvidia-cuda-runtime, nvidia-cublas, nvidia-curand and nvidia-cudnn-cu13 packages with their lib folders, on \
     LD_LIBRARY_PATH; use executionProvider 'cpu' where there is no GPU";

/// The load error for a CUDA provider ONNX Runtime could not register or start: what is missing,
/// from ONNX Runtime's `reason` and a probe of the host's libraries, then what the host needs.
pub fn cuda_unavailable(reason: &str, library: Option<&Path>) -> String {
    let missing = missing_cuda_pieces(reason, library);
    format!("executionProvider 'cuda' is unavailable: {missing}. {CUDA_HOST_NEEDS} (ONNX Runtime said: {reason})")
}

/// The first thing that keeps CUDA from running, in words.
fn missing_cuda_pieces(reason: &str, library: Option<&Path>) -> String {
    let beside = library.and_then(Path::parent);
    let library = library.map_or_else(|| "the ONNX Runtime library".to_string(), |p| p.display().to_string());
    if reason.contains("libonnxruntime_providers_shared.so")
        || reason.contains("libonnxruntime_providers_cuda.so: cannot open")
    {
        return format!(
            "{library} is a build without the CUDA provider (no libonnxruntime_providers_cuda.so beside it): install \
             the package ortex-linux-x64-gnu-cuda beside ortex, or set {LIBRARY_ENV} to onnxruntime-gpu 1.31's \
             libonnxruntime.so.1"
        );
    }
    let absent: Vec<String> = CUDA_HOST_LIBRARIES
        .iter()
        .filter(|(file, _)| reason.contains(&format!("{file}: cannot open")) || !loadable(file, beside))
        .map(|(file, what)| format!("{file} ({what})"))
        .collect();
    if !absent.is_empty() {
        return format!("the dynamic loader cannot find {}", absent.join(", "));
    }
    if reason.contains("no CUDA-capable device") || reason.contains("CUDA failure 100") {
        return "no CUDA device is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)".to_string();
    }
    if reason.contains("driver version is insufficient") || reason.contains("CUDA failure 35") {
        return "the NVIDIA driver is older than CUDA 13 needs".to_string();
    }
    "ONNX Runtime could not start its CUDA provider".to_string()
}

/// Whether the dynamic loader finds and loads `file` by its name, as the CUDA provider asks for it
/// (the provider also looks in its own folder, `beside`); the probe closes it again.
fn loadable(file: &str, beside: Option<&Path>) -> bool {
    if beside.is_some_and(|dir| dir.join(file).is_file()) {
        return true;
    }
    let Ok(name) = std::ffi::CString::new(file) else { return false };
    // SAFETY: dlopen with a NUL-terminated name; a handle it returns is closed once.
    unsafe {
        let handle = libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
        if handle.is_null() {
            return false;
        }
        libc::dlclose(handle);
    }
    true
}

fn mentions_cuda(reason: &str) -> bool {
    ["CUDA", "cuda", "CUDNN", "cudnn"].iter().any(|word| reason.contains(word))
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
    /// Which provider runs each node ([`placement`]).
    pub placement: NodePlacement,
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
        builder = builder
            .with_execution_providers([cuda])
            .map_err(|e| load_error(cuda_unavailable(e.to_string().trim(), loaded_library().as_deref())))?;
    }
    // Which provider runs each node (placement.rs): a few bytes per node, kept by the session.
    builder = builder
        .with_config_entry(placement::RECORD_ASSIGNMENT_CONFIG, "1")
        .map_err(builder_error(model_file, "record the node placement"))?;
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
        if settings.execution_provider == ExecutionProvider::Cuda && mentions_cuda(&reason) {
            // The provider registered, then failed to start (no device, an old driver, cuDNN...).
            return load_error(format!(
                "{}: {}",
                model_file.display(),
                cuda_unavailable(&reason, loaded_library().as_deref())
            ));
        }
        load_error(format!("{}: ONNX Runtime cannot load the model: {reason}", model_file.display()))
    })?;
    let weight_chunk_bytes = scope.as_ref().map_or(0, weight_chunks::LoadScope::chunked_bytes);
    let placement = placement::read(&session)
        .map_err(|reason| load_error(format!("{}: the node placement: {reason}", model_file.display())))?;
    Ok(OpenedSession { session, weight_chunk_bytes, placement })
}
