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

/// Runs `f` on this thread while every other thread of the current pool polls for its
/// tasks (`rayon::yield_now`, yielding the CPU to the OS when there are none) until `f`
/// returns. A thread busy with other work joins when it finishes it, or not at all if
/// `f` is done by then; nothing waits for the pollers.
pub(crate) fn polling<R>(f: impl FnOnce() -> R) -> R {
    if rayon::current_num_threads() < 2 {
        return f();
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
