//! ONNX model folders: `CoreEngine.load`. Native only, so it lives here and not in ortex-boundary (which
//! the WebAssembly build compiles too, and which must not reach ONNX Runtime or tokenizers).
//!
//! Loading reads the config and the tokenizer, opens ONNX Runtime and builds the session: tens of
//! milliseconds for a tiny model, about a second for a 250 MB one. It runs as an async task on the
//! libuv thread pool, so the JS thread keeps going meanwhile.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::atomic::AtomicI64;
use std::sync::Mutex;

use napi::bindgen_prelude::*;
use napi_derive::napi;
use ortex_boundary::{ExecutionProviderInput, ModelOptionsInput};
use ortex_core::{ErrorCode, OrtexError, Result};
use ortex_ort::{ExecutionProvider, ExecutorStats, LoadOptions};

use crate::completions::Completions;
use crate::run::OffThread;
use crate::step_thread::StepThread;
use crate::{boundary, coded_js, unhealthy_after_panic, CoreEngine};

/// Builds the engine: `options` are the engine's plus how ONNX Runtime runs the model;
/// `library` is the ONNX Runtime library to use when neither ORTEX_ORT_DYLIB nor ORT_DYLIB_PATH
/// names one.
pub fn load_impl(
    model_dir: &str,
    options: ModelOptionsInput,
    library: Option<&str>,
) -> Result<ortex_ort::LoadedEngine> {
    let options = LoadOptions {
        engine: options.engine()?,
        execution_provider: options.execution_provider.map(|provider| match provider {
            ExecutionProviderInput::Cpu => ExecutionProvider::Cpu,
            ExecutionProviderInput::Cuda => ExecutionProvider::Cuda,
        }),
        intra_op_threads: options.intra_op_threads,
        intra_op_spinning: options.intra_op_spinning,
    };
    ortex_ort::load_engine(Path::new(model_dir), &options, library.map(Path::new))
}

/// Cumulative executor timings: an object keyed by ortex_ort's counter list (`Counter`), whose
/// timings are whole microseconds (`gatherUs`); ts/generated/boundary.ts names the same keys.
pub fn executor_stats_view(stats: &ExecutorStats) -> serde_json::Value {
    let report: serde_json::Map<String, serde_json::Value> =
        stats.snapshot().report().map(|(key, value)| (key, value.into())).collect();
    serde_json::Value::Object(report)
}

/// Which execution provider runs each node (NodePlacement in ts/types.ts): the provider asked for,
/// per provider its nodes counted by op type, and for CUDA the sentence naming those on the CPU.
pub fn node_placement_view(loaded: &ortex_ort::LoadedEngine) -> serde_json::Value {
    serde_json::json!({
        "executionProvider": loaded.execution_provider.as_str(),
        "providers": loaded.placement.providers,
        "cpuFallback": loaded.cpu_fallback(),
    })
}

pub struct LoadTask {
    model_dir: String,
    options: ModelOptionsInput,
    library: Option<String>,
}

impl Task for LoadTask {
    type Output = Result<(ortex_ort::LoadedEngine, StepThread)>;
    type JsValue = CoreEngine;

    /// On the libuv thread pool.
    fn compute(&mut self) -> napi::Result<Self::Output> {
        let loaded = catch_unwind(AssertUnwindSafe(|| {
            load_impl(&self.model_dir, self.options.clone(), self.library.as_deref())
        }))
        .unwrap_or_else(|payload| Err(unhealthy_after_panic(&boundary::panic_message(payload.as_ref()))));
        Ok(loaded.and_then(|loaded| {
            let steps = StepThread::spawn().map_err(|e| {
                OrtexError::new(ErrorCode::ModelLoad, format!("cannot start the engine's step thread: {e}"))
            })?;
            Ok((loaded, steps))
        }))
    }

    /// On the JS thread: the engine, or the load error with its code (MODEL_LOAD, ...).
    fn resolve(&mut self, env: Env, output: Self::Output) -> napi::Result<CoreEngine> {
        let (loaded, thread) = output.map_err(|error| coded_js(&env, error))?;
        let completions = Completions::new(&env)?;
        let external_bytes = i64::try_from(loaded.memory_bytes).unwrap_or(i64::MAX);
        let node_placement = Some(node_placement_view(&loaded));
        env.adjust_external_memory(external_bytes)?;
        Ok(CoreEngine {
            engine: std::sync::Arc::new(Mutex::new(loaded.engine)),
            executor_stats: Some(loaded.stats),
            node_placement,
            steps: Some(OffThread { thread: Mutex::new(Some(thread)), completions }),
            external_bytes: AtomicI64::new(external_bytes),
        })
    }
}

#[napi]
impl CoreEngine {
    /// An engine over an ONNX model folder (genai_config.json, model.onnx, tokenizer.json).
    /// Throws INVALID_ARGUMENT at once for options of the wrong shape; the promise rejects with
    /// MODEL_LOAD for the folder.
    #[napi(ts_return_type = "Promise<CoreEngine>")]
    pub fn load(
        model_dir: String,
        options: Unknown<'_>,
        ort_library_path: Option<String>,
    ) -> napi::Result<AsyncTask<LoadTask>, String> {
        let options = crate::input("engine options", options).map_err(crate::coded)?;
        Ok(AsyncTask::new(LoadTask { model_dir, options, library: ort_library_path }))
    }

    /// The ONNX Runtime library this process opened (the first model load opens it, for the whole
    /// process); null before any load. The facade checks a CUDA load against it.
    #[napi]
    pub fn loaded_ort_library() -> Option<String> {
        ortex_ort::runtime::loaded_library().map(|path| path.display().to_string())
    }

    /// Which execution provider runs each node (NodePlacementView); null for the simulated model.
    #[napi(ts_return_type = "NodePlacementView | null")]
    pub fn node_placement(&self) -> Option<serde_json::Value> {
        self.node_placement.clone()
    }

    /// The ONNX executor's cumulative timings (ExecutorStatsView); null for the simulated model.
    #[napi(ts_return_type = "ExecutorStatsView | null")]
    pub fn executor_stats(&self) -> Option<serde_json::Value> {
        self.executor_stats.as_deref().map(executor_stats_view)
    }
}
