//! [`Completions`]: the way back from a model engine's step thread to the JS thread.
//!
//! A run's promise settles on the JS thread, where the commit happens. napi-rs's
//! `create_deferred` builds a Node-API threadsafe function (and an environment cleanup hook) for
//! every promise and tears it down after its one settlement; at one run per model step, creating,
//! closing and finalizing those took about a fifth of the JS thread's time per step
//! (docs/performance.md). An engine instead keeps one threadsafe function for its whole life. It
//! holds the event loop only while a run is in flight (referenced when a run begins,
//! unreferenced when it settles), so an idle engine never keeps the process alive.
//!
//! Lifetimes: the threadsafe function is released when the engine is collected, or aborted by an
//! environment cleanup hook when the environment (the process, a worker) tears down first. A step
//! that finishes after that finds it gone and drops its settlement; its promise can no longer
//! settle, and nothing is left to observe it. The mutex around the raw handle is what makes that
//! safe: a settlement is queued under it, and the release takes it.

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::{Arc, Mutex};

use napi::bindgen_prelude::*;
use napi::sys;

use crate::lock;

/// Runs on the JS thread when the settlement arrives: the run's count, or its error.
pub type Commit = Box<dyn FnOnce(&Env) -> napi::Result<u32> + Send>;

struct Settlement {
    deferred: sys::napi_deferred,
    commit: Commit,
    /// The handle, to unreference it once the run settles (it is alive inside its callback).
    tsfn: sys::napi_threadsafe_function,
}

/// The raw handle, shared with the jobs in flight and with the environment cleanup hook.
struct Shared {
    /// None once released (engine collected) or aborted (environment teardown).
    tsfn: Mutex<Option<sys::napi_threadsafe_function>>,
    /// The same handle for the JS thread's own uses while the engine is alive (ref and unref),
    /// which must not wait on the mutex a step thread may hold.
    raw: sys::napi_threadsafe_function,
    /// Whether the cleanup hook is still registered (Node-API requires removing only a
    /// registered one); only touched on the JS thread.
    hook_registered: Mutex<bool>,
}

// SAFETY: a threadsafe function may be called from any thread (that is its purpose); the
// deferred inside a settlement is only used on the JS thread, in the callback.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}
unsafe impl Send for Settlement {}

/// One engine's way back; dropped (on the JS thread) when the engine is collected.
pub struct Completions {
    env: sys::napi_env,
    shared: Arc<Shared>,
    /// The `Arc` the cleanup hook's argument points to.
    hook_arg: *const Shared,
}

/// A run's promise, not yet settled: what its job carries to the step thread.
pub struct Pending {
    shared: Arc<Shared>,
    deferred: sys::napi_deferred,
}

// SAFETY: the deferred is only used on the JS thread, in the callback.
unsafe impl Send for Pending {}

impl Completions {
    /// On the JS thread.
    pub fn new(env: &Env) -> napi::Result<Completions> {
        let raw_env = env.raw();
        let name = env.create_string("ortex-step")?;
        let mut raw: sys::napi_threadsafe_function = ptr::null_mut();
        // SAFETY: a valid env and name; no JS function (the callback settles a promise itself);
        // unlimited queue, one owning "thread" (the engine).
        check(unsafe {
            sys::napi_create_threadsafe_function(
                raw_env,
                ptr::null_mut(),
                ptr::null_mut(),
                name.raw(),
                0,
                1,
                ptr::null_mut(),
                None,
                ptr::null_mut(),
                Some(settle_on_js_thread),
                &mut raw,
            )
        })?;
        let shared = Arc::new(Shared { tsfn: Mutex::new(Some(raw)), raw, hook_registered: Mutex::new(false) });
        // Idle: the event loop may exit.
        // SAFETY: `raw` was just created on this thread's env.
        unsafe { sys::napi_unref_threadsafe_function(raw_env, raw) };
        let hook_arg = Arc::into_raw(Arc::clone(&shared));
        // SAFETY: the hook's argument stays alive until the hook is removed or has run.
        let hooked = check(unsafe {
            sys::napi_add_env_cleanup_hook(raw_env, Some(environment_teardown), hook_arg as *mut c_void)
        });
        if let Err(error) = hooked {
            // SAFETY: the Arc leaked just above, never handed out.
            drop(unsafe { Arc::from_raw(hook_arg) });
            release(&shared, sys::ThreadsafeFunctionReleaseMode::release);
            return Err(error);
        }
        *lock(&shared.hook_registered) = true;
        Ok(Completions { env: raw_env, shared, hook_arg })
    }

    /// On the JS thread: a promise for one run, and what its job settles it with. The event loop
    /// stays alive until the run settles.
    pub fn begin<'env>(&self, env: &'env Env) -> napi::Result<(Pending, PromiseRaw<'env, u32>)> {
        let mut deferred: sys::napi_deferred = ptr::null_mut();
        let mut promise: sys::napi_value = ptr::null_mut();
        // SAFETY: a valid env on its own thread.
        check(unsafe { sys::napi_create_promise(env.raw(), &mut deferred, &mut promise) })?;
        // SAFETY: the threadsafe function is alive while its engine is (this is the JS thread).
        check(unsafe { sys::napi_ref_threadsafe_function(env.raw(), self.shared.raw) })?;
        Ok((Pending { shared: Arc::clone(&self.shared), deferred }, PromiseRaw::new(env.raw(), promise)))
    }
}

impl Pending {
    /// From any thread: queues `commit` for the JS thread, which settles the promise with its
    /// result. If the environment is gone the commit is dropped (nothing can await the promise).
    pub fn settle(self, commit: Commit) {
        let guard = lock(&self.shared.tsfn);
        let Some(tsfn) = *guard else { return };
        let data = Box::into_raw(Box::new(Settlement { deferred: self.deferred, commit, tsfn: self.shared.raw }));
        // SAFETY: the handle is alive while the lock holds it; `data` is reclaimed by the callback,
        // or below when it was not queued.
        let status = unsafe {
            sys::napi_call_threadsafe_function(tsfn, data.cast(), sys::ThreadsafeFunctionCallMode::nonblocking)
        };
        drop(guard);
        if status != sys::Status::napi_ok {
            // SAFETY: not queued, so still ours.
            drop(unsafe { Box::from_raw(data) });
        }
    }
}

impl Drop for Completions {
    /// On the JS thread (the engine's finalizer): releases the handle, and the cleanup hook with it.
    fn drop(&mut self) {
        release(&self.shared, sys::ThreadsafeFunctionReleaseMode::release);
        let mut registered = lock(&self.shared.hook_registered);
        if *registered {
            *registered = false;
            drop(registered);
            // SAFETY: the hook is registered with exactly this function and argument.
            unsafe {
                sys::napi_remove_env_cleanup_hook(self.env, Some(environment_teardown), self.hook_arg as *mut c_void)
            };
            // SAFETY: the hook's Arc, which the hook can no longer reclaim.
            drop(unsafe { Arc::from_raw(self.hook_arg) });
        }
    }
}

/// The environment tears down before the engine was collected: abort the handle, so that Node
/// finalizes it and a step finishing later drops its settlement.
unsafe extern "C" fn environment_teardown(arg: *mut c_void) {
    // SAFETY: the Arc leaked for the hook in `Completions::new`; the hook runs once.
    let shared = unsafe { Arc::from_raw(arg as *const Shared) };
    *lock(&shared.hook_registered) = false;
    release(&shared, sys::ThreadsafeFunctionReleaseMode::abort);
}

fn release(shared: &Shared, mode: sys::napi_threadsafe_function_release_mode) {
    if let Some(tsfn) = lock(&shared.tsfn).take() {
        // SAFETY: taken out under the lock, so released exactly once and never used after.
        unsafe { sys::napi_release_threadsafe_function(tsfn, mode) };
    }
}

/// The threadsafe function's callback, on the JS thread (inside a callback scope, so the promise's
/// reactions run right after it). A null env means Node is tearing the handle down.
unsafe extern "C" fn settle_on_js_thread(
    env: sys::napi_env,
    _js: sys::napi_value,
    _context: *mut c_void,
    data: *mut c_void,
) {
    if data.is_null() {
        return;
    }
    // SAFETY: every queued pointer is a Box<Settlement> from `Pending::settle`.
    let settlement = unsafe { Box::from_raw(data as *mut Settlement) };
    if env.is_null() {
        return;
    }
    // Never unwind into Node: a panic here (the commit has its own guard) leaves the promise
    // pending rather than aborting the process.
    let _ = catch_unwind(AssertUnwindSafe(|| settle(env, *settlement)));
}

fn settle(raw_env: sys::napi_env, settlement: Settlement) {
    let env = Env::from_raw(raw_env);
    let Settlement { deferred, commit, tsfn } = settlement;
    // The run settled: the event loop may exit once nothing else holds it.
    // SAFETY: the handle is alive inside its own callback.
    unsafe { sys::napi_unref_threadsafe_function(raw_env, tsfn) };
    let outcome = commit(&env).and_then(|count| {
        // SAFETY: the JS thread's env.
        unsafe { u32::to_napi_value(raw_env, count) }
    });
    // SAFETY: `deferred` was made on this env by `begin` and is settled exactly once, here.
    unsafe {
        match outcome {
            Ok(value) => sys::napi_resolve_deferred(raw_env, deferred, value),
            Err(error) => {
                let reason = <napi::Error as ToNapiValue>::to_napi_value(raw_env, error).unwrap_or(ptr::null_mut());
                sys::napi_reject_deferred(raw_env, deferred, reason)
            }
        }
    };
}

fn check(status: sys::napi_status) -> napi::Result<()> {
    if status == sys::Status::napi_ok {
        Ok(())
    } else {
        Err(napi::Error::new(napi::Status::from(status), "Node-API call failed in the step thread's completions"))
    }
}
