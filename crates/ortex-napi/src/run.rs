//! The plumbing of `CoreEngine.run`: where a transaction executes off the JS thread (a model
//! engine's [`StepThread`], through [`OffThread`]; the libuv pool for the simulated model, as a
//! [`RunTask`]), and its commit back on the JS thread, which writes the events into the caller's
//! buffer. A panic while executing fails the transaction instead of unwinding.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

use napi::bindgen_prelude::*;
use ortex_boundary as boundary;
use ortex_core::{Engine, Transaction};

use crate::completions::Completions;
use crate::step_thread::{Job, StepThread};
use crate::{coded_js, guarded, lock, CoreEngine};

/// What `run` returns: a pool task (simulated model), or a promise: already settled (a drain, or a
/// step executed here) or settled when the step thread's transaction commits.
pub(crate) type RunPromise<'env> = Either<AsyncTask<RunTask>, PromiseRaw<'env, u32>>;

/// A model engine's step thread and its way back to the JS thread. The thread goes with
/// `close()` (after the step it is on); the way back stays until the engine is collected, since a
/// step in flight still settles its promise through it.
pub(crate) struct OffThread {
    pub(crate) thread: Mutex<Option<StepThread>>,
    pub(crate) completions: Completions,
}

impl CoreEngine {
    /// Executes `transaction` on the step thread; the promise settles on the JS thread with the
    /// commit.
    pub(crate) fn execute_on<'env>(
        &self,
        steps: &OffThread,
        env: &'env Env,
        transaction: Transaction,
        events: Int32Array,
        capacity: u32,
    ) -> napi::Result<RunPromise<'env>> {
        // A transaction that never commits would keep the executor away from the engine for good:
        // without a way back to this thread, execute it here (blocking, but nothing is lost).
        let Ok((pending, promise)) = steps.completions.begin(env) else {
            let mut transaction = transaction;
            execute(&mut transaction);
            let settled = match commit(env, &self.engine, transaction, events, capacity) {
                Ok(count) => PromiseRaw::resolve(env, count),
                Err(error) => PromiseRaw::reject(env, error),
            };
            return settled.map(Either::B);
        };
        let engine = Arc::clone(&self.engine);
        let job: Job = Box::new(move || {
            let mut transaction = transaction;
            execute(&mut transaction);
            pending.settle(Box::new(move |env: &Env| commit(env, &engine, transaction, events, capacity)));
        });
        // The thread is gone only if a job panicked past its own guard (or the engine closed, which
        // refuses runs before they get here): run the job here instead.
        let refused = match &*lock(&steps.thread) {
            Some(thread) => thread.submit(job).err(),
            None => Some(job),
        };
        if let Some(job) = refused {
            job();
        }
        Ok(Either::B(promise))
    }
}

/// Off the JS thread: the model step and its draws. A step with constrained rows computes their
/// masks on a second thread while the model runs. A panic (on either thread) fails the
/// transaction (the commit rolls the step back and publishes a fatal Failed event) instead of
/// unwinding.
fn execute(transaction: &mut Transaction) {
    let overlapped = || {
        transaction.execute_with(|model, masks| {
            std::thread::scope(|scope| {
                scope.spawn(masks);
                model();
            })
        })
    };
    if let Err(payload) = catch_unwind(AssertUnwindSafe(overlapped)) {
        transaction.fail(format!("panic in the executor: {}", boundary::panic_message(payload.as_ref())));
    }
}

/// On the JS thread: commits `transaction` and writes its events into the caller's buffer.
fn commit(
    env: &Env,
    engine: &Mutex<Engine>,
    transaction: Transaction,
    events: Int32Array,
    capacity: u32,
) -> napi::Result<u32> {
    // Look the buffer up again instead of trusting the pointer taken before the hop: JS may have
    // detached (transferred) it meanwhile, and then it reads as empty and the events stay
    // retained in the engine.
    // SAFETY: `env` is the JS thread's; the reference is turned back into its value once.
    let value = unsafe { Int32Array::to_napi_value(env.raw(), events)? };
    let buffer = unsafe { <&mut [i32]>::from_napi_value(env.raw(), value)? };
    let mut engine = lock(engine);
    guarded(&mut engine, |engine| Ok(engine.run_commit(transaction, buffer, capacity as usize) as u32))
        .map_err(|error| coded_js(env, error))
}

/// One `run` transaction of the simulated model on the libuv thread pool. It holds the
/// `Int32Array` (a napi reference, so the buffer stays alive) but touches it only in `resolve`,
/// on the JS thread.
pub struct RunTask {
    pub(crate) engine: Arc<Mutex<Engine>>,
    pub(crate) transaction: Option<Transaction>,
    pub(crate) events: Option<Int32Array>,
    pub(crate) capacity: u32,
}

impl Task for RunTask {
    type Output = ();
    type JsValue = u32;

    fn compute(&mut self) -> napi::Result<()> {
        execute(self.transaction.as_mut().expect("a run task executes its transaction once"));
        Ok(())
    }

    fn resolve(&mut self, env: Env, _: ()) -> napi::Result<u32> {
        let transaction = self.transaction.take().expect("a run task commits its transaction once");
        let events = self.events.take().expect("a run task holds its event buffer until it commits");
        commit(&env, &self.engine, transaction, events, self.capacity)
    }
}
