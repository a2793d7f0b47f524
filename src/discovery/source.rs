//! Endpoint sources: the [`Discovery`] contract (DNS here, Kubernetes later), the
//! [`EndpointSink`] they publish into, and the [`Runner`] that keeps one task per source.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use futures::future::BoxFuture;
use parking_lot::Mutex;

use super::{Registry, SetChange};
use crate::config::ResolvedEndpoint;

/// Where sources publish. The router's implementation also drops removed endpoints' cache
/// entries; [`Registry`]'s only publishes.
pub trait EndpointSink: Send + Sync {
    /// Replaces `source`'s endpoints. Never blocks requests.
    fn publish(&self, source: &str, endpoints: Vec<ResolvedEndpoint>) -> SetChange;
    /// Drops `source` and its endpoints.
    fn remove(&self, source: &str) -> SetChange;
}

impl EndpointSink for Registry {
    fn publish(&self, source: &str, endpoints: Vec<ResolvedEndpoint>) -> SetChange {
        self.publish_source(source, endpoints)
    }

    fn remove(&self, source: &str) -> SetChange {
        self.remove_source(source)
    }
}

/// A source of endpoints that runs on its own (polling DNS, watching Kubernetes).
///
/// `Debug` must show the source's whole configuration: [`Runner::reconcile`] restarts a source
/// whose `Debug` text changed.
pub trait Discovery: Send + Sync + fmt::Debug + 'static {
    /// The slot it publishes into, unique among sources, e.g. `dns:<pool>`.
    fn key(&self) -> String;
    /// Runs until aborted, publishing each new endpoint list with `sink.publish(self.key(), ..)`.
    /// A transient failure keeps the last published list.
    fn run(self: Arc<Self>, sink: Arc<dyn EndpointSink>) -> BoxFuture<'static, ()>;
}

struct Running {
    fingerprint: String,
    task: tokio::task::JoinHandle<()>,
}

/// Keeps one task per configured source.
pub struct Runner {
    sink: Arc<dyn EndpointSink>,
    running: Mutex<HashMap<String, Running>>,
}

impl fmt::Debug for Runner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Runner")
            .field("sources", &self.keys())
            .finish()
    }
}

impl Runner {
    /// A runner publishing into `sink`.
    pub fn new(sink: Arc<dyn EndpointSink>) -> Runner {
        Runner {
            sink,
            running: Mutex::new(HashMap::new()),
        }
    }

    /// Runs exactly `desired`: starts new sources, restarts changed ones (their last list stays
    /// published until the new task publishes), stops and unpublishes removed ones. Call from
    /// within a tokio runtime.
    pub fn reconcile(&self, desired: Vec<Arc<dyn Discovery>>) {
        let mut running = self.running.lock();
        let mut keep = Vec::with_capacity(desired.len());
        for source in desired {
            let key = source.key();
            let fingerprint = format!("{source:?}");
            keep.push(key.clone());
            if running
                .get(&key)
                .is_some_and(|r| r.fingerprint == fingerprint)
            {
                continue;
            }
            if let Some(old) = running.remove(&key) {
                old.task.abort();
            }
            tracing::info!(source = %key, "starting endpoint discovery");
            let task = tokio::spawn(source.run(Arc::clone(&self.sink)));
            running.insert(key, Running { fingerprint, task });
        }
        let gone: Vec<String> = running
            .keys()
            .filter(|k| !keep.contains(k))
            .cloned()
            .collect();
        for key in gone {
            if let Some(r) = running.remove(&key) {
                r.task.abort();
            }
            let change = self.sink.remove(&key);
            tracing::info!(source = %key, removed = ?change.removed, "stopped endpoint discovery");
        }
    }

    /// The running sources' keys, sorted.
    pub fn keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.running.lock().keys().cloned().collect();
        keys.sort();
        keys
    }
}

impl Drop for Runner {
    fn drop(&mut self) {
        for (_, r) in self.running.lock().drain() {
            r.task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;

    /// Publishes one fixed list once, then idles.
    #[derive(Debug)]
    struct Fixed {
        key: &'static str,
        ports: Vec<u16>,
    }

    impl Discovery for Fixed {
        fn key(&self) -> String {
            self.key.to_string()
        }

        fn run(self: Arc<Self>, sink: Arc<dyn EndpointSink>) -> BoxFuture<'static, ()> {
            Box::pin(async move {
                let eps = self
                    .ports
                    .iter()
                    .map(|&p| {
                        ResolvedEndpoint::new(SocketAddr::from(([127, 0, 0, 1], p)), "p", &["m"])
                    })
                    .collect();
                sink.publish(self.key, eps);
                std::future::pending::<()>().await;
            })
        }
    }

    /// Waits (10 s at most, then fails) until the registry holds exactly `ports`.
    async fn until(reg: &Registry, ports: &[u16]) {
        let mut versions = reg.subscribe();
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let mut got: Vec<u16> = reg
                .snapshot()
                .all()
                .iter()
                .map(|e| e.address.port())
                .collect();
            got.sort_unstable();
            if got == ports {
                return;
            }
            tokio::time::timeout_at(deadline, versions.changed())
                .await
                .unwrap_or_else(|_| panic!("registry never held {ports:?} (last {got:?})"))
                .unwrap();
        }
    }

    #[tokio::test]
    async fn reconcile_starts_restarts_and_stops_sources() {
        let reg = Arc::new(Registry::new(&[]));
        let runner = Runner::new(reg.clone());
        let a = |ports: Vec<u16>| -> Arc<dyn Discovery> { Arc::new(Fixed { key: "a", ports }) };
        let b = |ports: Vec<u16>| -> Arc<dyn Discovery> { Arc::new(Fixed { key: "b", ports }) };
        runner.reconcile(vec![a(vec![1]), b(vec![2])]);
        until(&reg, &[1, 2]).await;
        assert_eq!(runner.keys(), vec!["a", "b"]);
        runner.reconcile(vec![a(vec![1]), b(vec![3])]);
        until(&reg, &[1, 3]).await;
        runner.reconcile(vec![b(vec![3])]);
        until(&reg, &[3]).await;
        assert_eq!(runner.keys(), vec!["b"]);
    }
}
