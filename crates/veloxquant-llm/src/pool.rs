//! Keeping the rayon pool awake through a run of short parallel passes.
//!
//! A batched decode step makes ~5 parallel passes per layer (150 for SmolLM2-135M) with a
//! few µs of serial work between them. Rayon parks a thread that finds no work after a few
//! rounds of `sched_yield`, and a parked thread wakes tens of µs late on this 2-core VM (a
//! futex wake, then the scheduler): the pool's wake-ups were ~15 % of a B = 16 step. While
//! [`polling`] runs, the other threads poll for tasks instead of parking.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Sets the flag when dropped (also when the work panics, so no poller spins forever).
struct Done(Arc<AtomicBool>);

impl Drop for Done {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Runs `f` on a thread of the current pool (this one when it is a pool thread) while the
/// pool's other threads poll for its tasks (`rayon::yield_now`, yielding the CPU to the OS
/// when there are none) until `f` returns. A thread busy with other work joins when it
/// finishes it, or not at all if `f` is done by then; nothing waits for the pollers.
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
        if Some(ctx.index()) == me {
            return; // this thread runs `f`
        }
        while !flag.load(Ordering::Acquire) {
            if rayon::yield_now() != Some(rayon::Yield::Executed) {
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
}
