//! Keeping the rayon pool awake through a run of short parallel passes.
//!
//! A batched decode step makes ~5 parallel passes per layer (150 for SmolLM2-135M) with a
//! few µs of serial work between them. Rayon parks a thread that finds no work after a few
//! rounds of `sched_yield`, and a parked thread wakes tens of µs late on this 2-core VM (a
//! futex wake, then the scheduler): the pool's wake-ups were ~15 % of a B = 16 step. While
//! [`polling`] runs, the other threads poll for tasks instead of parking.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a poller keeps polling without finding a task before it lets its thread park.
/// It bounds the stall when a poller runs on top of a task of the polled work (a thread
/// waiting in a join picks it up, or steals such a task while it polls): the work waits for
/// that task, which waits for the poller to return. The gaps between a decode step's
/// passes are tens of µs, so the pool stays awake through a step.
const IDLE_LIMIT: Duration = Duration::from_micros(500);

thread_local! {
    /// Whether this thread is polling already (a poller below on its stack).
    static POLLING: Cell<bool> = const { Cell::new(false) };
}

/// Sets the flag when dropped (also when the work panics, so no poller spins forever).
struct Done(Arc<AtomicBool>);

impl Drop for Done {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Clears [`POLLING`] when the poller ends (also by a panic in a task it ran).
struct PollingGuard;

impl Drop for PollingGuard {
    fn drop(&mut self) {
        POLLING.with(|p| p.set(false));
    }
}

/// Runs `f` on a thread of the current pool (this one when it is a pool thread) while the
/// pool's other threads poll for its tasks (`rayon::yield_now`, yielding the CPU to the OS
/// when there are none) until `f` returns or they have found nothing for [`IDLE_LIMIT`]. A
/// thread busy with other work joins when it finishes it, or not at all if `f` is done by
/// then; nothing waits for the pollers.
pub(crate) fn polling<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_num_threads() < 2 {
        return f();
    }
    if rayon::current_thread_index().is_none() {
        // From outside the pool every parallel pass would park this thread on a latch and
        // wake it after (the server's engine thread): hand all of `f` to the pool once.
        return rayon::scope(|_| polling(f));
    }
    let done = Arc::new(AtomicBool::new(false));
    let me = rayon::current_thread_index();
    let flag = Arc::clone(&done);
    rayon::spawn_broadcast(move |ctx| {
        // One poller per thread at a time: one that started inside another's task would sit
        // on top of that task until its own work ended.
        if Some(ctx.index()) == me || POLLING.with(|p| p.replace(true)) {
            return; // this thread runs `f`, or polls already
        }
        let _guard = PollingGuard;
        let mut idle_since = Instant::now();
        while !flag.load(Ordering::Acquire) {
            if rayon::yield_now() == Some(rayon::Yield::Executed) {
                idle_since = Instant::now();
            } else if idle_since.elapsed() > IDLE_LIMIT {
                return;
            } else {
                std::thread::yield_now();
            }
        }
    });
    let _done = Done(done);
    f()
}

#[cfg(test)]
mod tests {
    use super::polling;
    use rayon::prelude::*;

    /// The work's parallel passes run and return the same from inside and outside a pool,
    /// and the pollers let go: later jobs on the pool still run.
    #[test]
    fn polling_runs_parallel_passes_and_releases_the_pool() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let want: u64 = (0..10_000u64).sum();
        let work = || (0..100).map(|_| (0..10_000u64).into_par_iter().sum::<u64>()).max();
        assert_eq!(pool.install(|| polling(work)), Some(want));
        assert_eq!(pool.install(|| rayon::broadcast(|_| 1).len()), 2);
        assert_eq!(polling(work), Some(want)); // the global pool, from a test thread
        let caught =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| pool.install(|| polling(|| panic!("inside")))));
        assert!(caught.is_err());
        assert_eq!(pool.install(|| rayon::broadcast(|_| 1).len()), 2);
    }

    /// Many short polled runs of nested parallel passes, called from outside the pool as a
    /// decode loop does, all finish: a poller that a waiting thread picks up while a job of
    /// the polled work sits below it on its stack must not spin forever (it once did: the
    /// work waited for that job, the job for the poller, the poller for the work).
    #[test]
    fn polled_runs_back_to_back_never_deadlock() {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut total = 0u64;
            for _ in 0..50_000 {
                // From outside the pool (the global one), as `forward_batch` is called.
                total += polling(|| {
                    (0..8)
                        .map(|_| {
                            (0..16u64)
                                .into_par_iter()
                                .map(|i| (0..64u64).into_par_iter().map(|j| i * j).sum::<u64>())
                                .sum::<u64>()
                        })
                        .sum::<u64>()
                });
            }
            tx.send(total).unwrap();
        });
        let want = 50_000 * 8 * (0..16u64).map(|i| i * (0..64u64).sum::<u64>()).sum::<u64>();
        let got = rx.recv_timeout(std::time::Duration::from_secs(120)).expect("polled runs deadlocked");
        assert_eq!(got, want);
    }
}
