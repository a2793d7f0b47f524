//! The background watchers of every endpoint: one scrape loop and one probe loop per endpoint,
//! started and stopped as the endpoint set changes.
//!
//! The monitor knows nothing of the router. It is handed narrow [`Inputs`]: a view of the
//! endpoint set and its changes ([`EndpointSource`]), the config in force as a `watch` channel,
//! and two sinks for what it finds ([`HealthSink`]: health changes and scrape results;
//! [`CapacitySink`]: an engine reporting a new KV capacity). Health and engine samples
//! themselves live in each endpoint's shared state, which the loops write directly.
//!
//! Each loop reads the config on every iteration, so intervals, paths and on/off switches
//! hot-reload; `load.scrape.max_concurrent` is read once at start. Waits are jittered so the loops
//! of many endpoints spread out. Nothing here touches the request path except through the
//! atomically swapped engine sample and the health state.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{watch, Semaphore};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::config::Config;
use crate::discovery::{Endpoint, EndpointSet, Registry};
use crate::health::probe::probe;
use crate::health::{Cause, Change};
use crate::load::exposition::MetricNames;
use crate::load::scrape::scrape;

/// The endpoint set the monitor follows: read-only.
pub trait EndpointSource: Send + Sync {
    /// The current set. Never blocks.
    fn snapshot(&self) -> Arc<EndpointSet>;
    /// Notified with the set's version after every change.
    fn subscribe(&self) -> watch::Receiver<u64>;
}

impl EndpointSource for Registry {
    fn snapshot(&self) -> Arc<EndpointSet> {
        Registry::snapshot(self)
    }

    fn subscribe(&self) -> watch::Receiver<u64> {
        Registry::subscribe(self)
    }
}

/// Where the monitor reports what the probes and scrapes found.
pub trait HealthSink: Send + Sync {
    /// A view of `ep`'s health changed (already applied to its health state).
    fn health_changed(&self, ep: &Endpoint, change: Change);
    /// A scrape of `ep` took `took` and failed with `error` (a kind) if it did.
    fn scraped(&self, ep: &Endpoint, took: Duration, error: Option<&'static str>);
}

/// Told when an engine reports a (new) KV capacity, to size what the router keeps for it.
pub trait CapacitySink: Send + Sync {
    /// `ep`'s engine reported a KV capacity different from its previous sample's.
    fn engine_capacity_changed(&self, ep: &Endpoint);
}

/// What the monitor reads and where it writes.
#[derive(Clone)]
pub struct Inputs {
    /// The endpoints to watch.
    pub endpoints: Arc<dyn EndpointSource>,
    /// The config in force (intervals, paths, thresholds), following reloads.
    pub config: watch::Receiver<Arc<Config>>,
    /// Health changes and scrape results.
    pub health: Arc<dyn HealthSink>,
    /// Engine-reported KV capacities.
    pub capacity: Arc<dyn CapacitySink>,
}

impl Inputs {
    fn config(&self) -> Arc<Config> {
        Arc::clone(&self.config.borrow())
    }

    fn endpoint(&self, addr: &SocketAddr) -> Option<Arc<Endpoint>> {
        self.endpoints.snapshot().get(addr).cloned()
    }
}

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

/// Runs the watchers of `inputs`' endpoints until aborted (aborting it stops them all).
pub fn spawn(inputs: Inputs) -> JoinHandle<()> {
    tokio::spawn(async move {
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(2)
            .pool_idle_timeout(Duration::from_secs(30))
            .tcp_nodelay(true)
            .build()
            .unwrap_or_default();
        let permits = Arc::new(Semaphore::new(
            inputs.config().load.scrape.max_concurrent.max(1),
        ));
        let mut versions = inputs.endpoints.subscribe();
        let mut watchers: HashMap<SocketAddr, Watchers> = HashMap::new();
        loop {
            let set = inputs.endpoints.snapshot();
            watchers.retain(|addr, _| set.get(addr).is_some());
            for ep in set.all() {
                watchers.entry(ep.address).or_insert_with(|| Watchers {
                    scrape: tokio::spawn(scrape_loop(
                        inputs.clone(),
                        client.clone(),
                        Arc::clone(&permits),
                        ep.address,
                    )),
                    probe: tokio::spawn(probe_loop(inputs.clone(), client.clone(), ep.address)),
                });
            }
            if versions.changed().await.is_err() {
                return;
            }
        }
    })
}

async fn scrape_loop(
    inputs: Inputs,
    client: reqwest::Client,
    permits: Arc<Semaphore>,
    addr: SocketAddr,
) {
    let interval = |i: &Inputs| Duration::from_millis(i.config().load.scrape.interval_ms.max(10));
    tokio::time::sleep(first_wait(interval(&inputs))).await;
    let mut last_error: Option<&'static str> = None;
    loop {
        let config = inputs.config();
        let s = &config.load.scrape;
        let Some(ep) = inputs.endpoint(&addr) else {
            return;
        };
        let names = MetricNames::of(ep.engine).filter(|_| s.enabled);
        match names {
            None => {
                // Not scraped (off, or an `other` engine): its failures must not keep it out.
                if let Some(change) = ep.health.reset(Cause::Scrape) {
                    inputs.health.health_changed(&ep, change);
                }
            }
            Some(names) => {
                let timeout = Duration::from_millis(s.timeout_ms);
                let result = {
                    let _permit = permits.acquire().await;
                    let started = Instant::now();
                    let result = scrape(&client, addr, &s.path, &names, timeout).await;
                    let kind = result.as_ref().err().map(|e| e.kind());
                    inputs.health.scraped(&ep, started.elapsed(), kind);
                    result
                };
                let eject = config.health.eject_on_scrape_failures;
                match result {
                    Ok(sample) => {
                        let capacity = (sample.capacity_tokens, sample.cpu_offload_bytes);
                        let loaded = sample.cpu_loaded;
                        let previous = ep.load.engine.store(sample);
                        if let (Some((b0, t0)), Some((b1, t1))) =
                            (previous.as_ref().and_then(|p| p.cpu_loaded), loaded)
                        {
                            ep.load.learned.observe_cpu_load(
                                b1 - b0,
                                t1 - t0,
                                &config.load.learning,
                            );
                        }
                        if previous.map(|p| (p.capacity_tokens, p.cpu_offload_bytes))
                            != Some(capacity)
                        {
                            inputs.capacity.engine_capacity_changed(&ep);
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
                            inputs.health.health_changed(&ep, change);
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
                                inputs.health.health_changed(&ep, change);
                            }
                        }
                    }
                }
            }
        }
        tokio::time::sleep(jittered(interval(&inputs), s.jitter)).await;
    }
}

async fn probe_loop(inputs: Inputs, client: reqwest::Client, addr: SocketAddr) {
    let interval = |i: &Inputs| Duration::from_millis(i.config().health.probe.interval_ms.max(1));
    tokio::time::sleep(first_wait(interval(&inputs))).await;
    loop {
        let config = inputs.config();
        let p = &config.health.probe;
        let Some(ep) = inputs.endpoint(&addr) else {
            return;
        };
        if !config.health.breaker.enabled {
            if let Some(change) = ep.health.reset(Cause::Breaker) {
                inputs.health.health_changed(&ep, change);
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
            inputs.health.health_changed(&ep, change);
        }
        tokio::time::sleep(jittered(interval(&inputs), 0.1)).await;
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
