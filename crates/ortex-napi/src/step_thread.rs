//! [`StepThread`]: the one thread that executes a model engine's transactions.
//!
//! A model step is milliseconds of ONNX Runtime work. On the libuv thread pool each `run` lands on
//! whichever of its threads is free (they take turns), so every step starts on a thread whose
//! caches and ONNX Runtime's per-thread buffers are cold, and a long step holds a pool thread that
//! file system and DNS calls need. An engine over a model therefore owns one thread that executes
//! its transactions one after another (measured: about 3% less time in the session run than on the
//! pool at concurrency 1, docs/performance.md). The simulated model's steps are microseconds and
//! stay on the pool.
//!
//! The thread waits on a channel; dropping the [`StepThread`] (its engine was collected) closes
//! the channel, and the thread ends after the job it is on, without being joined (joining would
//! block the JS thread for up to a step).

use std::io;
use std::sync::mpsc::{channel, Sender};
use std::thread;

/// A job: execute one transaction and hand it back to the JS thread.
pub type Job = Box<dyn FnOnce() + Send + 'static>;

/// ONNX Runtime's kernels run on the caller's stack: as much as a libuv pool thread has.
const STACK_BYTES: usize = 8 << 20;

pub struct StepThread {
    jobs: Sender<Job>,
}

impl StepThread {
    pub fn spawn() -> io::Result<StepThread> {
        let (jobs, receiver) = channel::<Job>();
        thread::Builder::new().name("ortex-step".into()).stack_size(STACK_BYTES).spawn(move || {
            while let Ok(job) = receiver.recv() {
                job();
            }
        })?;
        Ok(StepThread { jobs })
    }

    /// Queues `job`; gives it back when the thread is gone (it can only end by panicking, which
    /// the jobs prevent by catching their own).
    pub fn submit(&self, job: Job) -> Result<(), Job> {
        self.jobs.send(job).map_err(|failed| failed.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn jobs_run_in_order_on_one_named_thread() {
        let steps = StepThread::spawn().unwrap();
        let (done, results) = mpsc::channel();
        for i in 0..5 {
            let done = done.clone();
            steps
                .submit(Box::new(move || {
                    let current = thread::current();
                    done.send((i, current.id(), current.name().map(str::to_string))).unwrap();
                }))
                .map_err(|_| "submit")
                .unwrap();
        }
        let seen: Vec<_> = (0..5).map(|_| results.recv().unwrap()).collect();
        assert_eq!(seen.iter().map(|s| s.0).collect::<Vec<_>>(), vec![0, 1, 2, 3, 4]);
        assert!(seen.iter().all(|s| s.1 == seen[0].1 && s.1 != thread::current().id()));
        assert_eq!(seen[0].2.as_deref(), Some("ortex-step"));
    }

    #[test]
    fn dropping_it_ends_the_thread_after_its_queued_jobs() {
        let steps = StepThread::spawn().unwrap();
        let (done, results) = mpsc::channel::<u32>();
        let (go, wait) = mpsc::channel::<()>();
        steps
            .submit(Box::new(move || {
                wait.recv().unwrap();
                done.send(1).unwrap();
            }))
            .map_err(|_| "submit")
            .unwrap();
        drop(steps);
        go.send(()).unwrap();
        assert_eq!(results.recv().unwrap(), 1);
        // The job (and with it the last sender) is gone once the thread has ended.
        assert!(results.recv().is_err());
    }
}
