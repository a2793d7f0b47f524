//! Where slow decisions run: two lanes, so worst-case bodies never delay normal ones.
//!
//! A decision that may take long (tokenizing, a huge body) leaves the async workers. Bodies up
//! to `routing.heavy_body_bytes` take the **light** lane: tokio's blocking pool, at most twice
//! the cores at once (a permit each; a burst queues asynchronously rather than starting a thread
//! per request). Longer bodies take the **heavy** lane: half the cores' worth (at least one) of
//! dedicated threads at nice 19 (the lowest priority of the normal class). So a flood of
//! worst-case bodies (10k-message conversations, near-limit sizes) queues behind itself, and
//! runs on the CPU time that light decisions and the async workers leave: with kvrouter's short
//! scheduler slice ([`crate::sched`]) a heavy decision keeps a core at most ~0.1 ms after a
//! light one wakes (without it, Linux 6.6+ let the heavy thread finish its 1.4 ms slice first). With one shared semaphore
//! (before), 8 such bodies in flight took a normal chat's decision p99 from ~2 ms to ~0.7-1.3
//! s; numbers and command in docs/security.md (`cargo bench --bench flood`).
//!
//! Inside the heavy lane tenants take turns by body bytes (deficit round robin, [`Fair`]):
//! each tenant's bodies in arrival order, and a tenant flooding the lane with 30 MiB bodies
//! delays another tenant's long body by about the body in progress, not by its whole backlog
//! (arrival order, before). Requests without a tenant share one turn.
//!
//! The price: under a CPU-saturating load of light decisions, heavy ones wait (they still get
//! nice 19's share, 15/1024 of a nice-0 thread's); their prefix budget counts from when they
//! start, and Envoy's message timeout bounds the wait as for any decision.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, OnceLock};

use parking_lot::{Condvar, Mutex};
use tokio::sync::{oneshot, Semaphore};

type Job = Box<dyn FnOnce() + Send + 'static>;

/// Which lane a slow decision takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Lane {
    /// Bodies up to `routing.heavy_body_bytes`.
    Light,
    /// Longer ones: `bytes` long, of `tenant` (the trusted tenant, if any), which takes turns
    /// with other tenants by bytes.
    Heavy {
        tenant: Option<String>,
        bytes: usize,
    },
}

/// The lanes of the process (they size themselves to the cores once).
struct Lanes {
    light: Semaphore,
    heavy: Arc<HeavyQueue>,
}

/// Bytes a tenant's turn adds to its allowance: about one long body's worth of work.
const QUANTUM_BYTES: usize = 1 << 20;

/// Tenants' queued jobs taken in deficit round robin by bytes: a tenant at the front takes its
/// next job when its allowance covers the job's bytes, else its allowance grows by
/// [`QUANTUM_BYTES`] and the next tenant's turn comes. A tenant's queue is in arrival order; a
/// tenant that empties its queue leaves the turns and loses its allowance (no credit for
/// idling). Alone, a tenant takes its next job at once whatever its size.
pub(crate) struct Fair<T> {
    tenants: HashMap<Option<String>, Queued<T>>,
    /// Tenants with queued jobs, the one whose turn it is first.
    turns: VecDeque<Option<String>>,
}

impl<T> Default for Fair<T> {
    fn default() -> Self {
        Fair {
            tenants: HashMap::new(),
            turns: VecDeque::new(),
        }
    }
}

struct Queued<T> {
    jobs: VecDeque<(usize, T)>,
    allowance: usize,
}

impl<T> Fair<T> {
    pub(crate) fn push(&mut self, tenant: Option<String>, bytes: usize, job: T) {
        let queued = self.tenants.entry(tenant.clone()).or_insert_with(|| {
            self.turns.push_back(tenant);
            Queued {
                jobs: VecDeque::new(),
                allowance: 0,
            }
        });
        queued.jobs.push_back((bytes, job));
    }

    /// The next job in turn, if any is queued.
    pub(crate) fn pop(&mut self) -> Option<T> {
        loop {
            let tenant = self.turns.front()?;
            let queued = self
                .tenants
                .get_mut(tenant)
                .expect("a tenant in turn has jobs");
            let &(bytes, _) = queued.jobs.front().expect("a tenant in turn has jobs");
            // Alone in the lane, a tenant waits for nobody.
            if bytes <= queued.allowance || self.turns.len() == 1 {
                queued.allowance = queued.allowance.saturating_sub(bytes);
                let (_, job) = queued.jobs.pop_front().expect("checked");
                if queued.jobs.is_empty() {
                    let tenant = self.turns.pop_front().expect("checked");
                    self.tenants.remove(&tenant);
                }
                return Some(job);
            }
            queued.allowance = queued.allowance.saturating_add(QUANTUM_BYTES);
            self.turns.rotate_left(1);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.tenants.values().map(|q| q.jobs.len()).sum()
    }
}

/// The heavy lane's queue, shared by its threads.
#[derive(Default)]
struct HeavyQueue {
    jobs: Mutex<Fair<Job>>,
    ready: Condvar,
}

impl HeavyQueue {
    fn push(&self, tenant: Option<String>, bytes: usize, job: Job) {
        self.jobs.lock().push(tenant, bytes, job);
        self.ready.notify_one();
    }

    fn next(&self) -> Job {
        let mut jobs = self.jobs.lock();
        loop {
            if let Some(job) = jobs.pop() {
                return job;
            }
            self.ready.wait(&mut jobs);
        }
    }
}

fn lanes() -> &'static Lanes {
    static LANES: OnceLock<Lanes> = OnceLock::new();
    LANES.get_or_init(|| {
        let cores = crate::budget::cores();
        Lanes {
            light: Semaphore::new(cores * 2),
            heavy: heavy_threads((cores / 2).max(1)),
        }
    })
}

/// `n` threads at the lowest CPU priority running jobs from one queue, tenants in turn.
fn heavy_threads(n: usize) -> Arc<HeavyQueue> {
    let queue = Arc::new(HeavyQueue::default());
    for i in 0..n {
        let queue = Arc::clone(&queue);
        let spawned = std::thread::Builder::new()
            .name(format!("kvrouter-heavy-{i}"))
            .spawn(move || {
                if !lower_priority() {
                    tracing::warn!("heavy decisions run at normal CPU priority");
                }
                loop {
                    let job = queue.next();
                    // A panic is the job's to report (decisions catch their own); the thread
                    // lives on.
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                }
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "could not start a heavy-decision thread");
        }
    }
    queue
}

/// Moves the calling thread to nice 19 with kvrouter's short slice ([`crate::sched`]).
/// Whether it worked.
///
/// Not Linux's idle class (`SCHED_IDLE`, used until 2026-12-02): its CFS weight is 3 against
/// nice 19's 15, so on a host saturated by other work (a loaded CI machine, a busy node) the
/// heavy lane got 5x less CPU, and its bodies outlived Envoy's and clients' timeouts sooner.
/// Nice 19 alone did not make the lane yield at once (the scheduler lets a running thread
/// finish its slice): the short slice, asked by this lane and by the request-path threads
/// alike, is what does (docs/security.md).
fn lower_priority() -> bool {
    crate::sched::lowest_priority_thread()
}

/// Runs `job` in `lane`; `None` if it could not run to the end (it panicked, or the runtime
/// is gone).
pub(crate) async fn run<T: Send + 'static>(
    lane: Lane,
    job: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let lanes = lanes();
    match lane {
        Lane::Heavy { tenant, bytes } => {
            let (tx, rx) = oneshot::channel();
            let job: Job = Box::new(move || {
                // Whoever queued it is gone (its stream dropped while it waited): skip the
                // work.
                if !tx.is_closed() {
                    let _ = tx.send(job());
                }
            });
            lanes.heavy.push(tenant, bytes, job);
            rx.await.ok()
        }
        Lane::Light => {
            let _permit = lanes.light.acquire().await.ok()?;
            tokio::task::spawn_blocking(job).await.ok()
        }
    }
}

/// The lane for a body of `bytes` from `tenant` under `routing.heavy_body_bytes`.
pub(crate) fn lane_for(bytes: usize, heavy_body_bytes: usize, tenant: Option<&str>) -> Lane {
    if bytes > heavy_body_bytes {
        Lane::Heavy {
            tenant: tenant.map(str::to_string),
            bytes,
        }
    } else {
        Lane::Light
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn heavy() -> Lane {
        Lane::Heavy {
            tenant: None,
            bytes: 1,
        }
    }

    #[tokio::test]
    async fn both_lanes_run_jobs_and_return_their_results() {
        assert_eq!(run(Lane::Light, || 2 + 2).await, Some(4));
        assert_eq!(run(heavy(), || "heavy".len()).await, Some(5));
        // A panicking heavy job reports nothing, and the lane still runs the next one.
        assert_eq!(run(heavy(), || -> u8 { panic!("boom") }).await, None);
        let name = run(heavy(), || {
            std::thread::current().name().map(str::to_string)
        })
        .await;
        assert!(name.unwrap().unwrap().starts_with("kvrouter-heavy-"));
        assert_eq!(lane_for(10, 10, Some("t")), Lane::Light);
        assert_eq!(
            lane_for(11, 10, Some("t")),
            Lane::Heavy {
                tenant: Some("t".into()),
                bytes: 11
            }
        );
    }

    /// A tenant flooding the lane with 30 MiB bodies, queued first, and another's two 1 MiB
    /// bodies: the light tenant's go before the flood's backlog (a turn lets a tenant take
    /// about 1 MiB of work, so one 30 MiB body takes the flood 30 turns); each tenant's own
    /// bodies keep their order; a tenant alone goes in order whatever its bodies' sizes.
    #[test]
    fn tenants_take_turns_by_bytes_in_the_heavy_lane() {
        let mut fair = Fair::default();
        let flood = Some("flood".to_string());
        for i in 0..5 {
            fair.push(flood.clone(), 30 << 20, format!("flood-{i}"));
        }
        fair.push(Some("light".into()), 1 << 20, "light-0".to_string());
        fair.push(Some("light".into()), 1 << 20, "light-1".to_string());
        fair.push(None, 2 << 20, "none-0".to_string());
        assert_eq!(fair.len(), 8);
        let order: Vec<String> = std::iter::from_fn(|| fair.pop()).collect();
        assert_eq!(
            order,
            [
                "light-0", "light-1", "none-0", "flood-0", "flood-1", "flood-2", "flood-3",
                "flood-4"
            ]
        );
        assert_eq!(fair.len(), 0);
        // Two floods of equal bodies alternate.
        for i in 0..3 {
            fair.push(Some("a".into()), 4 << 20, format!("a-{i}"));
            fair.push(Some("b".into()), 4 << 20, format!("b-{i}"));
        }
        let order: Vec<String> = std::iter::from_fn(|| fair.pop()).collect();
        assert_eq!(order, ["a-0", "b-0", "a-1", "b-1", "a-2", "b-2"]);
        // Alone: in order, at once.
        fair.push(None, 64 << 20, "big".to_string());
        fair.push(None, 1, "small".to_string());
        assert_eq!(fair.pop().as_deref(), Some("big"));
        assert_eq!(fair.pop().as_deref(), Some("small"));
        assert_eq!(fair.pop(), None);
    }

    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn heavy_threads_run_at_the_lowest_priority() {
        let (policy, nice, slice) = run(heavy(), || {
            // SAFETY: pid 0 is the calling thread; getpriority on its own id as in
            // `lower_priority`.
            let (policy, nice) = unsafe {
                let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
                (
                    libc::sched_getscheduler(0),
                    libc::getpriority(libc::PRIO_PROCESS, tid),
                )
            };
            (policy, nice, crate::sched::thread_slice_ns())
        })
        .await
        .unwrap();
        // The normal class at nice 19: not the idle class, whose share starves under load.
        assert_eq!((policy, nice), (libc::SCHED_OTHER, 19));
        // With the short slice (Linux 6.12+, where the kernel shows it).
        if let (true, Some(slice)) = (crate::sched::custom_slices(), slice) {
            assert_eq!(slice, crate::sched::slice_us() * 1000);
        }
    }
}
