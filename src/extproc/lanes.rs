//! Where slow decisions run: two lanes, so worst-case bodies never delay normal ones.
//!
//! A decision that may take long (tokenizing, a huge body) leaves the async workers. Bodies up
//! to `routing.heavy_body_bytes` take the **light** lane: tokio's blocking pool, at most twice
//! the cores at once (a permit each; a burst queues asynchronously rather than starting a thread
//! per request). Longer bodies take the **heavy** lane: half the cores' worth (at least one) of
//! dedicated threads at nice 19 (the lowest priority of the normal class), fed in
//! arrival order. So a flood of worst-case bodies (10k-message conversations, near-limit sizes)
//! queues behind itself, and runs on the CPU time that light decisions and the async workers
//! leave: the scheduler preempts a heavy decision as soon as a light one is runnable. With one
//! shared semaphore (before), 8 such bodies in flight took a normal chat's decision p99 from
//! ~2 ms to ~0.7-1.3 s; numbers and command in docs/security.md (`cargo bench --bench flood`).
//!
//! The price: under a CPU-saturating load of light decisions, heavy ones wait (they still get
//! nice 19's share, 15/1024 of a nice-0 thread's); their prefix budget counts from when they
//! start, and Envoy's message timeout bounds the wait as for any decision.

use std::sync::mpsc;
use std::sync::{Arc, OnceLock};

use tokio::sync::{oneshot, Semaphore};

type Job = Box<dyn FnOnce() + Send + 'static>;

/// The lanes of the process (they size themselves to the cores once).
struct Lanes {
    light: Semaphore,
    heavy: mpsc::Sender<Job>,
}

fn lanes() -> &'static Lanes {
    static LANES: OnceLock<Lanes> = OnceLock::new();
    LANES.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        Lanes {
            light: Semaphore::new(cores * 2),
            heavy: heavy_threads((cores / 2).max(1)),
        }
    })
}

/// `n` threads at the lowest CPU priority running jobs from one queue, in order.
fn heavy_threads(n: usize) -> mpsc::Sender<Job> {
    let (tx, rx) = mpsc::channel::<Job>();
    let rx = Arc::new(parking_lot::Mutex::new(rx));
    for i in 0..n {
        let rx = Arc::clone(&rx);
        let spawned = std::thread::Builder::new()
            .name(format!("kvrouter-heavy-{i}"))
            .spawn(move || {
                if !lower_priority() {
                    tracing::warn!("heavy decisions run at normal CPU priority");
                }
                loop {
                    // The lock is held only while waiting for the next job.
                    let job = rx.lock().recv();
                    match job {
                        // A panic is the job's to report (decisions catch their own); the
                        // thread lives on.
                        Ok(job) => {
                            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                        }
                        Err(_) => return,
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "could not start a heavy-decision thread");
        }
    }
    tx
}

/// Moves the calling thread to nice 19. Whether it worked.
///
/// Not Linux's idle class (`SCHED_IDLE`, used until 2026-12-02): its CFS weight is 3 against
/// nice 19's 15, so on a host saturated by other work (a loaded CI machine, a busy node) the
/// heavy lane got 5x less CPU, and its bodies outlived Envoy's and clients' timeouts sooner.
/// Nice 19 protects normal decisions as well: on the flood bench a tie or better (3.54x [2.18,
/// 4.66] flooded / unloaded p99 against 5.40x [4.28, 6.20], docs/security.md).
#[cfg(target_os = "linux")]
fn lower_priority() -> bool {
    // SAFETY: gettid takes no arguments; setpriority on the calling thread's own id only
    // raises its nice value, which any thread may do.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, 19) == 0
    }
}

#[cfg(not(target_os = "linux"))]
fn lower_priority() -> bool {
    false
}

/// Runs `job` in the heavy lane when `heavy`, else in the light lane; `None` if it could not run
/// to the end (the runtime or the heavy threads are gone).
pub(crate) async fn run<T: Send + 'static>(
    heavy: bool,
    job: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let lanes = lanes();
    if heavy {
        let (tx, rx) = oneshot::channel();
        let job: Job = Box::new(move || {
            // Whoever queued it is gone (its stream dropped while it waited): skip the work.
            if !tx.is_closed() {
                let _ = tx.send(job());
            }
        });
        lanes.heavy.send(job).ok()?;
        rx.await.ok()
    } else {
        let _permit = lanes.light.acquire().await.ok()?;
        tokio::task::spawn_blocking(job).await.ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn both_lanes_run_jobs_and_return_their_results() {
        assert_eq!(run(false, || 2 + 2).await, Some(4));
        assert_eq!(run(true, || "heavy".len()).await, Some(5));
        // A panicking heavy job reports nothing, and the lane still runs the next one.
        assert_eq!(run(true, || -> u8 { panic!("boom") }).await, None);
        let name = run(true, || std::thread::current().name().map(str::to_string)).await;
        assert!(name.unwrap().unwrap().starts_with("kvrouter-heavy-"));
    }

    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn heavy_threads_run_at_the_lowest_priority() {
        let (policy, nice) = run(true, || {
            // SAFETY: pid 0 is the calling thread; getpriority on its own id as in
            // `lower_priority`.
            unsafe {
                let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
                (
                    libc::sched_getscheduler(0),
                    libc::getpriority(libc::PRIO_PROCESS, tid),
                )
            }
        })
        .await
        .unwrap();
        // The normal class at nice 19: not the idle class, whose share starves under load.
        assert_eq!((policy, nice), (libc::SCHED_OTHER, 19));
    }
}
