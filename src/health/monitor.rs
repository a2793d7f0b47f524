//! The background watchers of every endpoint: one scrape loop and one probe loop per endpoint,
//! started and stopped as the endpoint set changes.
//!
//! Each loop re-reads the config on every iteration, so intervals, paths and on/off switches
//! hot-reload; `load.scrape.max_concurrent` is read once at start. Waits are jittered so the loops
//! of many endpoints spread out. Nothing here touches the request path except through the
//! atomically swapped engine sample and the health state.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::probe::probe;
use super::Cause;
use crate::load::exposition::MetricNames;
use crate::load::scrape::scrape;
use crate::router::Router;

/// `interval × (1 + u)`, `u` uniform in `[-jitter, +jitter]`.
fn jittered(interval: Duration, jitter: f64) -> Duration {
    let u: f64 = rand::random::<f64>() * 2.0 - 1.0;
    interval.mul_f64((1.0 + u * jitter.clamp(0.0, 1.0)).max(0.0))
}

/// A random point in the first interval, so loops started together do not run together.
fn first_wait(interval: Duration) -> Duration {
    interval.mul_f64(rand::random::<f64>())
}

struct Watchers {
    scrape: JoinHandle<()>,
    probe: JoinHandle<()>,
}

impl Drop for Watchers {
    fn drop(&mut self) {
        self.scrape.abort();
        self.probe.abort();
    }
}

/// Runs the watchers of `router`'s endpoints until aborted (aborting it stops them all).
pub fn spawn(router: Arc<Router>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(2)
            .pool_idle_timeout(Duration::from_secs(30))
            .tcp_nodelay(true)
            .build()
            .unwrap_or_default();
        let permits = Arc::new(Semaphore::new(
            router.config().load.scrape.max_concurrent.max(1),
        ));
        let mut versions = router.subscribe_endpoints();
        let mut watchers: HashMap<SocketAddr, Watchers> = HashMap::new();
        loop {
            let set = router.endpoints();
            watchers.retain(|addr, _| set.get(addr).is_some());
            for ep in set.all() {
                watchers.entry(ep.address).or_insert_with(|| Watchers {
                    scrape: tokio::spawn(scrape_loop(
                        Arc::clone(&router),
                        client.clone(),
                        Arc::clone(&permits),
                        ep.address,
                    )),
                    probe: tokio::spawn(probe_loop(
                        Arc::clone(&router),
                        client.clone(),
                        ep.address,
                    )),
                });
            }
            if versions.changed().await.is_err() {
                return;
            }
        }
    })
}

async fn scrape_loop(
    router: Arc<Router>,
    client: reqwest::Client,
    permits: Arc<Semaphore>,
    addr: SocketAddr,
) {
    let interval = |r: &Router| Duration::from_millis(r.config().load.scrape.interval_ms.max(10));
    tokio::time::sleep(first_wait(interval(&router))).await;
    let mut last_error: Option<&'static str> = None;
    loop {
        let config = router.config();
        let s = &config.load.scrape;
        let Some(ep) = router.endpoints().get(&addr).cloned() else {
            return;
        };
        let names = MetricNames::of(ep.engine).filter(|_| s.enabled);
        match names {
            None => {
                // Not scraped (off, or an `other` engine): its failures must not keep it out.
                if let Some(change) = ep.health.reset(Cause::Scrape) {
                    router.report_health(&ep, change);
                }
            }
            Some(names) => {
                let timeout = Duration::from_millis(s.timeout_ms);
                let result = {
                    let _permit = permits.acquire().await;
                    let started = Instant::now();
                    let result = scrape(&client, addr, &s.path, &names, timeout).await;
                    let kind = result.as_ref().err().map(|e| e.kind());
                    router
                        .metrics()
                        .signals
                        .record_scrape(&ep, started.elapsed(), kind);
                    result
                };
                let eject = config.health.eject_on_scrape_failures;
                match result {
                    Ok(sample) => {
                        let capacity = sample.capacity_tokens;
                        let previous = ep.load.engine.store(sample);
                        if previous.and_then(|p| p.capacity_tokens) != capacity {
                            router.apply_engine_capacity(&ep);
                        }
                        if last_error.take().is_some() {
                            tracing::info!(endpoint = %ep.address_str, "metrics scrape recovered");
                        }
                        let change = if eject {
                            ep.health.record_scrape(true, &config.health)
                        } else {
                            ep.health.reset(Cause::Scrape)
                        };
                        if let Some(change) = change {
                            router.report_health(&ep, change);
                        }
                    }
                    Err(e) => {
                        if last_error != Some(e.kind()) {
                            // Logged once per kind of failure, not every 50 ms.
                            tracing::warn!(endpoint = %ep.address_str, engine = ep.engine.as_str(), "metrics scrape failed: {e}");
                            last_error = Some(e.kind());
                        }
                        if eject && e.endpoint_down() {
                            if let Some(change) = ep.health.record_scrape(false, &config.health) {
                                router.report_health(&ep, change);
                            }
                        }
                    }
                }
            }
        }
        tokio::time::sleep(jittered(interval(&router), s.jitter)).await;
    }
}

async fn probe_loop(router: Arc<Router>, client: reqwest::Client, addr: SocketAddr) {
    let interval = |r: &Router| Duration::from_millis(r.config().health.probe.interval_ms.max(1));
    tokio::time::sleep(first_wait(interval(&router))).await;
    loop {
        let config = router.config();
        let p = &config.health.probe;
        let Some(ep) = router.endpoints().get(&addr).cloned() else {
            return;
        };
        if !config.health.breaker.enabled {
            if let Some(change) = ep.health.reset(Cause::Breaker) {
                router.report_health(&ep, change);
            }
        }
        let change = if p.enabled {
            let result = probe(&client, addr, &p.path, Duration::from_millis(p.timeout_ms)).await;
            if let Err(e) = &result {
                tracing::debug!(endpoint = %ep.address_str, "health probe failed: {e}");
            }
            ep.health.record_probe(result.is_ok(), &config.health)
        } else {
            ep.health.reset(Cause::Probe)
        };
        if let Some(change) = change {
            router.report_health(&ep, change);
        }
        tokio::time::sleep(jittered(interval(&router), 0.1)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_within_bounds() {
        let base = Duration::from_millis(100);
        for _ in 0..1000 {
            let d = jittered(base, 0.1);
            assert!(
                d >= Duration::from_millis(90) && d <= Duration::from_millis(110),
                "{d:?}"
            );
            assert!(first_wait(base) <= base);
        }
        assert_eq!(jittered(base, 0.0), base);
    }
}
