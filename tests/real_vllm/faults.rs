//! The fault checks of issue 14 against the real engine: Y killed under traffic, then restarted.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use testkit::eventually;

use crate::checks::{CHAT, EVENTS_LAG, SHARED_PREFIX_TOKENS};
use crate::fleet::{chat, long_system, Fleet};

/// Check 5 of issue 14: Y is killed (SIGKILL, its whole process group) while requests flow: every
/// client request still gets a 200 (Envoy retries on the fallback the router sent).
pub async fn a_killed_replica_costs_no_request(f: Arc<Fleet>) -> String {
    const TOTAL: usize = 40;
    const WORKERS: usize = 4;
    let y = f.addrs[1];
    // Y holds this prefix (check 2), so the router sends it traffic until it dies.
    let system = long_system("bypass");
    let next = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let killed_at: Arc<Mutex<Option<Instant>>> = Arc::new(Mutex::new(None));
    type Row = (usize, u16, Option<String>, bool, String);
    let rows: Arc<Mutex<Vec<Row>>> = Arc::new(Mutex::new(Vec::new()));
    let workers: Vec<_> = (0..WORKERS)
        .map(|_| {
            let (f, next, done, killed_at, rows, system) = (
                f.clone(),
                next.clone(),
                done.clone(),
                killed_at.clone(),
                rows.clone(),
                system.clone(),
            );
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= TOTAL {
                        return;
                    }
                    let body = chat(&system, &format!("Kill test, question {i}."), 16);
                    let a = f.via_envoy(CHAT, &body, None).await;
                    let after_kill = killed_at.lock().unwrap().is_some();
                    rows.lock()
                        .unwrap()
                        .push((i, a.status, a.upstream, after_kill, a.body));
                    done.fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .collect();
    let in_flight = eventually(
        "a request in flight on Y after 8 completed",
        Duration::from_secs(120),
        || {
            let (f, done) = (f.clone(), done.clone());
            async move {
                if done.load(Ordering::SeqCst) < 8 {
                    return None;
                }
                let n = f.endpoint(y).await["load"]["in_flight_requests"].as_u64()?;
                (n >= 1).then_some(n)
            }
        },
    )
    .await;
    let done_at_kill = done.load(Ordering::SeqCst);
    f.replicas[1].kill();
    *killed_at.lock().unwrap() = Some(Instant::now());
    for w in workers {
        w.await.expect("worker");
    }
    let retries = f.envoy_counter(".upstream_rq_retry").await;
    let rows = std::mem::take(&mut *rows.lock().unwrap());
    assert_eq!(rows.len(), TOTAL, "every request answered");
    let failed: Vec<String> = rows
        .iter()
        .filter(|r| r.1 != 200)
        .map(|r| format!("#{} {}: {}", r.0, r.1, r.4))
        .collect();
    let by = |who: SocketAddr, after: bool| {
        rows.iter()
            .filter(|r| r.3 == after && r.2.as_deref() == Some(&who.to_string()))
            .count()
    };
    let summary = format!(
        "{TOTAL} requests, {WORKERS} at a time; Y SIGKILLed with {in_flight} in flight on it after \
         {done_at_kill} had completed; served before the kill X {} / Y {}, finished after it X {} / Y {}; \
         Envoy retries {retries}",
        by(f.addrs[0], false),
        by(y, false),
        by(f.addrs[0], true),
        by(y, true),
    );
    assert!(failed.is_empty(), "{summary}; failed: {failed:?}");
    assert!(
        by(y, false) >= 1,
        "Y served traffic before the kill: {summary}"
    );
    assert_eq!(by(y, true), 0, "a dead replica served nothing: {summary}");
    format!("{summary}; {TOTAL}/{TOTAL} got 200")
}

/// Check 3 of issue 14: Y, killed, is distrusted at once (its entries dropped), and once restarted
/// stays distrusted (no stale hit) until it publishes from sequence 0, which makes it trusted
/// again.
pub async fn a_restarted_replica_is_distrusted_then_trusted(f: &Fleet) -> String {
    let y = f.addrs[1];
    // Killed by check 5 (killed here if that check stopped before).
    f.replicas[1].kill();
    let reason = f.wait_events_state(y, "distrusted", EVENTS_LAG).await;
    eventually(
        "Y's engine-block table to be dropped",
        EVENTS_LAG,
        || async { (f.endpoint(y).await["kv_events"]["engine_blocks"] == 0).then_some(()) },
    )
    .await;
    // When kvrouter's subscriber gets back to Y's publisher (a new "connected" line naming its
    // endpoint: zeromq's own reconnection or kvrouter's), for the report.
    let endpoint = f.replicas[1].events_connect();
    let log = f.dir.join("kvrouter.log");
    let connects = move || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .filter(|l| {
                l.contains(&endpoint) && l.contains("connected") && !l.contains("disconnected")
            })
            .count()
    };
    let before = connects();
    let restarted = Instant::now();
    f.replicas[1].restart();
    let watcher = tokio::spawn(async move {
        poll_until(Duration::from_secs(300), || {
            let n = connects();
            async move { (n > before).then(|| restarted.elapsed()) }
        })
        .await
    });
    let ready = f.replicas[1].wait_ready(&f.client).await;
    eventually("Y routable again", Duration::from_secs(60), || async {
        (f.endpoint(y).await["health"]["routable"] == true).then_some(())
    })
    .await;
    let routable = restarted.elapsed();
    let (state, reason_back) = f.events_state(y).await;
    assert_eq!(
        state, "distrusted",
        "a restarted engine that has published nothing yet is not trusted"
    );
    // Routable again, Y is a candidate: what it held before the kill must not match.
    let stale = f
        .explain(&chat(&long_system("bypass"), "After the restart.", 4))
        .await;
    assert_eq!(
        Fleet::row(&stale, y)["matched_tokens"],
        0,
        "stale hit: {stale}"
    );
    // Its first stored blocks go out with sequence 0: a fresh start, so trusted again.
    let system = long_system("restart");
    let a = f
        .direct(
            y,
            CHAT,
            &chat(&system, "The first question after the restart.", 4),
        )
        .await;
    let first_sent = restarted.elapsed();
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(a.cached_tokens, 0, "the restarted engine's cache is empty");
    let trusted = poll_until(EVENTS_LAG, || async {
        (f.events_state(y).await.0 == "trusted").then(|| restarted.elapsed())
    })
    .await;
    let Some(trusted) = trusted else {
        // Is anything arriving at all? A second stored prefix tells.
        let messages = f.endpoint(y).await["kv_events"]["messages"].clone();
        let b = f
            .direct(
                y,
                CHAT,
                &chat(&long_system("restart-2"), "A second question.", 4),
            )
            .await;
        assert_eq!(b.status, 200, "{}", b.body);
        let later = poll_until(EVENTS_LAG, || async {
            let e = f.endpoint(y).await;
            (e["kv_events"]["messages"] != messages).then_some(e["kv_events"].clone())
        })
        .await;
        let reconnected = finished(watcher).await;
        panic!(
            "Y never became trusted again: it answered /health {:.1} s after its restart, was \
             routable at {:.1} s, got its first prefix (the publisher's sequence 0) at {:.1} s; \
             kvrouter's subscriber reconnected to its publisher at {}; after a second prefix \
             Y's stream is {}",
            ready.as_secs_f64(),
            routable.as_secs_f64(),
            first_sent.as_secs_f64(),
            reconnected.map_or("(never, within 300 s)".to_string(), |d| format!(
                "{:.1} s",
                d.as_secs_f64()
            )),
            later.map_or(format!("still silent ({messages} messages)"), |s| s
                .to_string()),
        );
    };
    let reconnected = finished(watcher).await;
    let e = f
        .explain(&chat(&system, "Where did the first one go?", 4))
        .await;
    let confirmed = Fleet::row(&e, y)["confirmed_tokens"].clone();
    assert!(confirmed.as_u64() >= Some(SHARED_PREFIX_TOKENS), "{e}");
    format!(
        "killed, Y's kv events read distrusted({reason}) and its engine-block table was \
         emptied; restarted, it answered /health after {:.0} s and was routable at {:.0} s, \
         still distrusted({reason_back}) with no stale match; kvrouter's subscriber was back \
         at {}; its first stored prefix ({} tokens, sent at {:.1} s) made it trusted at \
         {:.1} s, {confirmed} tokens confirmed",
        ready.as_secs_f64(),
        routable.as_secs_f64(),
        reconnected.map_or("?".to_string(), |d| format!("{:.1} s", d.as_secs_f64())),
        a.prompt_tokens,
        first_sent.as_secs_f64(),
        trusted.as_secs_f64(),
    )
}

/// A watcher's result if it has one by now (it is stopped otherwise).
async fn finished(watcher: tokio::task::JoinHandle<Option<Duration>>) -> Option<Duration> {
    if watcher.is_finished() {
        watcher.await.ok().flatten()
    } else {
        watcher.abort();
        None
    }
}

/// Polls `check` every 100 ms until it returns `Some`, or `None` after `timeout`.
async fn poll_until<T, F, Fut>(timeout: Duration, mut check: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
