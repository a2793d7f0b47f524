//! Scheduler hints for kvrouter's own threads: a short time slice for the threads that serve
//! requests, so they run as soon as they wake even while lower-priority work holds the CPU.
//!
//! Linux's EEVDF scheduler (6.6 and later) does not preempt a running task the moment a task of
//! higher priority wakes: the running one keeps the CPU until its slice (1.4 ms on the 2-core
//! host here) is used up or its deadline is later. So a nice-19 thread (kvrouter's heavy lane,
//! or a busy neighbour) could hold a core for milliseconds while a normal decision's thread
//! waited: traced with `perf sched` under the flood bench, the request-path threads waited 1-5
//! ms to run while the CPUs ran nice-19 work (docs/security.md). Since 6.12 a thread may ask
//! for a shorter slice (`sched_setattr`'s `sched_runtime` in the normal class), and a waking
//! thread with a shorter slice than the running one preempts it. kvrouter asks for
//! [`DEFAULT_SLICE_US`] on its async workers, its blocking pool and its heavy lane; a kernel
//! without custom slices accepts the call and changes nothing.
//!
//! `kvrouter serve --sched-slice-us N` (env `KVROUTER_SCHED_SLICE_US`) sets it; 0 leaves the
//! kernel's slice alone.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// The slice asked for by default, microseconds: the shortest Linux accepts (0.1 ms).
pub const DEFAULT_SLICE_US: u64 = 100;

/// The slice in force for threads started from now on, microseconds (0: none asked).
static SLICE_US: AtomicU64 = AtomicU64::new(DEFAULT_SLICE_US);

/// Whether the kernel refused a thread's slice (logged once at start).
static REFUSED: AtomicBool = AtomicBool::new(false);

/// Whether the kernel refused the slice for some thread so far.
pub fn refused() -> bool {
    REFUSED.load(Ordering::Relaxed)
}

/// Sets the slice that threads started from now on ask for (0: the kernel's own).
pub fn set_slice_us(us: u64) {
    SLICE_US.store(us, Ordering::Relaxed);
}

/// The slice threads ask for, microseconds (0: none).
pub fn slice_us() -> u64 {
    SLICE_US.load(Ordering::Relaxed)
}

/// Asks for the configured slice for the calling thread, keeping its nice value. Whether the
/// kernel took the call (true also when no slice is configured).
pub fn request_thread() -> bool {
    if slice_us() == 0 || !cfg!(target_os = "linux") {
        return true;
    }
    // Only a thread in the normal or batch class, whose nice value could be read: a thread
    // started real-time, idle or deadline (`chrt`, systemd's `CPUSchedulingPolicy=`) is left
    // in its class.
    let ok = match (current_policy(), current_nice()) {
        (Some(policy), Some(nice)) => set_thread(policy, nice, slice_us()),
        _ => true,
    };
    if !ok {
        REFUSED.store(true, Ordering::Relaxed);
    }
    ok
}

/// Moves the calling thread to nice 19 with the configured slice (the heavy lane). Whether
/// the nice value was taken.
pub fn lowest_priority_thread() -> bool {
    match (slice_us(), current_policy()) {
        // One call for both; if the kernel refuses `sched_setattr` (a seccomp filter), nice 19
        // alone still keeps heavy work behind normal decisions.
        (us, Some(policy)) if us > 0 => set_thread(policy, 19, us) || set_nice(19),
        _ => set_nice(19),
    }
}

/// The calling thread's nice value, if it can be read.
#[cfg(target_os = "linux")]
fn current_nice() -> Option<i32> {
    // SAFETY: on Linux `who` 0 is the calling thread (nice values are per thread there);
    // its -1 is a valid nice value, so errno is cleared first and checked after.
    unsafe {
        *libc::__errno_location() = 0;
        let nice = libc::getpriority(libc::PRIO_PROCESS, 0);
        (nice != -1 || *libc::__errno_location() == 0).then_some(nice)
    }
}

/// The calling thread's class when it is the normal or the batch one (with its reset-on-fork
/// bit), else `None`: real-time, deadline and idle threads are not given a slice.
#[cfg(target_os = "linux")]
fn current_policy() -> Option<i32> {
    // SAFETY: pid 0 is the calling thread.
    let policy = unsafe { libc::sched_getscheduler(0) };
    let class = policy & !libc::SCHED_RESET_ON_FORK;
    (policy >= 0 && (class == libc::SCHED_OTHER || class == libc::SCHED_BATCH)).then_some(policy)
}

#[cfg(target_os = "linux")]
fn set_nice(nice: i32) -> bool {
    // SAFETY: on Linux `who` 0 is the calling thread; raising its own nice value needs no
    // privilege.
    unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, nice) == 0 }
}

/// `sched_setattr(2)`'s argument, as far as the normal class reads it (`SCHED_ATTR_SIZE_VER0`).
#[cfg(target_os = "linux")]
#[repr(C)]
struct SchedAttr {
    size: u32,
    policy: u32,
    flags: u64,
    nice: i32,
    priority: u32,
    /// In the normal class since Linux 6.12: the slice, ns (clamped to 0.1-100 ms).
    runtime_ns: u64,
    deadline_ns: u64,
    period_ns: u64,
}

/// The calling thread in `policy` (as [`current_policy`] read it: its class and its
/// reset-on-fork bit, both kept) at `nice` with a `us` slice.
#[cfg(target_os = "linux")]
fn set_thread(policy: i32, nice: i32, us: u64) -> bool {
    /// `SCHED_FLAG_RESET_ON_FORK` of `sched_setattr(2)`.
    const RESET_ON_FORK: u64 = 0x01;
    let attr = SchedAttr {
        size: std::mem::size_of::<SchedAttr>() as u32,
        policy: (policy & !libc::SCHED_RESET_ON_FORK) as u32,
        flags: if policy & libc::SCHED_RESET_ON_FORK != 0 {
            RESET_ON_FORK
        } else {
            0
        },
        nice,
        priority: 0,
        runtime_ns: us.saturating_mul(1000),
        deadline_ns: 0,
        period_ns: 0,
    };
    // SAFETY: pid 0 is the calling thread; `attr` is a valid, initialised `sched_attr` of the
    // size it states, alive for the call.
    unsafe {
        libc::syscall(
            libc::SYS_sched_setattr,
            0 as libc::pid_t,
            &attr as *const SchedAttr,
            0 as libc::c_uint,
        ) == 0
    }
}

#[cfg(not(target_os = "linux"))]
fn current_nice() -> Option<i32> {
    None
}

#[cfg(not(target_os = "linux"))]
fn current_policy() -> Option<i32> {
    None
}

#[cfg(not(target_os = "linux"))]
fn set_nice(_nice: i32) -> bool {
    false
}

#[cfg(not(target_os = "linux"))]
fn set_thread(_policy: i32, _nice: i32, _us: u64) -> bool {
    false
}

/// The calling thread's slice as the kernel reports it, ns (kernels that show it).
#[cfg(all(test, target_os = "linux"))]
pub(crate) fn thread_slice_ns() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/thread-self/sched").ok()?;
    let line = text.lines().find(|l| l.starts_with("se.slice"))?;
    line.split(':').nth(1)?.trim().parse().ok()
}

/// Whether the running kernel takes custom slices (6.12 and later).
#[cfg(all(test, target_os = "linux"))]
pub(crate) fn custom_slices() -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let mut parts = release.trim().split(['.', '-']);
    let mut next = || {
        parts
            .next()
            .and_then(|p| p.parse::<u32>().ok())
            .unwrap_or(0)
    };
    (next(), next()) >= (6, 12)
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn a_request_thread_asks_for_the_short_slice_and_keeps_its_nice_value() {
        std::thread::spawn(|| {
            // One above what the test runs at: raising a thread's own nice value is allowed.
            let nice = (current_nice().unwrap() + 1).min(19);
            assert!(set_nice(nice));
            let before = thread_slice_ns();
            assert!(set_thread(current_policy().unwrap(), nice, 250));
            assert_eq!(current_nice(), Some(nice), "the nice value is kept");
            // Linux 6.12+ takes the slice asked for; older kernels accept the call and keep
            // theirs.
            if let Some(before) = before {
                let after = thread_slice_ns().expect("still reported");
                let want = if custom_slices() { 250_000 } else { before };
                assert_eq!(after, want, "slice before {before} ns");
            }
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_batch_thread_stays_batch_and_an_idle_one_is_left_alone() {
        std::thread::spawn(|| {
            let param = libc::sched_param { sched_priority: 0 };
            // SAFETY: pid 0 is the calling thread; `param` is valid for the call.
            assert_eq!(
                unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) },
                0
            );
            assert!(request_thread());
            // SAFETY: reads the calling thread's own policy.
            assert_eq!(unsafe { libc::sched_getscheduler(0) }, libc::SCHED_BATCH);
            // SAFETY: as above; moving to the idle class needs no privilege.
            assert_eq!(
                unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) },
                0
            );
            assert_eq!(current_policy(), None);
            assert!(request_thread(), "nothing asked, nothing refused");
            // SAFETY: reads the calling thread's own policy.
            assert_eq!(unsafe { libc::sched_getscheduler(0) }, libc::SCHED_IDLE);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn the_heavy_lane_gets_nice_19_with_the_slice() {
        std::thread::spawn(|| {
            assert!(lowest_priority_thread());
            assert_eq!(current_nice(), Some(19));
            // Where the kernel shows the slice (6.12+ with its scheduler debug output).
            if let (true, Some(slice)) = (custom_slices(), thread_slice_ns()) {
                assert_eq!(slice, DEFAULT_SLICE_US * 1000);
            }
            // SAFETY: reads the calling thread's own policy.
            assert_eq!(unsafe { libc::sched_getscheduler(0) }, libc::SCHED_OTHER);
        })
        .join()
        .unwrap();
    }
}
