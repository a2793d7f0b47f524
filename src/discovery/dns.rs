//! DNS discovery: a pool's endpoints are the addresses a name resolves to (A and AAAA records, as
//! a Kubernetes headless service returns one per ready pod), re-resolved every `refresh_ms`.
//!
//! A failed lookup keeps the last list (a DNS hiccup must not empty the pool); an unchanged
//! answer publishes nothing. Addresses come in with the pool's models, adapters and settings.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;

use super::{Discovery, EndpointSink};
use crate::config::{Config, DnsConfig, PoolConfig, ResolvedEndpoint};

/// Turns a name and port into addresses.
pub trait Resolve: Send + Sync + fmt::Debug {
    /// Every address `name` resolves to, with `port`.
    fn resolve(&self, name: &str, port: u16) -> BoxFuture<'static, io::Result<Vec<SocketAddr>>>;
}

/// The system resolver (getaddrinfo on tokio's blocking pool).
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemResolver;

impl Resolve for SystemResolver {
    fn resolve(&self, name: &str, port: u16) -> BoxFuture<'static, io::Result<Vec<SocketAddr>>> {
        let name = name.to_string();
        Box::pin(async move {
            Ok(tokio::net::lookup_host((name.as_str(), port))
                .await?
                .collect())
        })
    }
}

/// One DNS pool.
#[derive(Debug)]
pub struct DnsDiscovery {
    pool: PoolConfig,
    dns: DnsConfig,
    resolver: Arc<dyn Resolve>,
}

impl DnsDiscovery {
    /// The source for `pool`, if it is a DNS pool.
    pub fn new(pool: &PoolConfig, resolver: Arc<dyn Resolve>) -> Option<DnsDiscovery> {
        Some(DnsDiscovery {
            dns: pool.dns.clone()?,
            pool: pool.clone(),
            resolver,
        })
    }

    /// Every DNS pool of `config`.
    pub fn from_config(config: &Config, resolver: Arc<dyn Resolve>) -> Vec<Arc<dyn Discovery>> {
        config
            .pools
            .iter()
            .filter_map(|p| DnsDiscovery::new(p, Arc::clone(&resolver)))
            .map(|d| Arc::new(d) as Arc<dyn Discovery>)
            .collect()
    }
}

impl Discovery for DnsDiscovery {
    fn key(&self) -> String {
        format!("dns:{}", self.pool.name)
    }

    fn run(self: Arc<Self>, sink: Arc<dyn EndpointSink>) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            let key = self.key();
            let refresh = Duration::from_millis(self.dns.refresh_ms.max(100));
            let mut last: Option<Vec<SocketAddr>> = None;
            loop {
                match self.resolver.resolve(&self.dns.name, self.dns.port).await {
                    Ok(mut addrs) => {
                        addrs.retain(|a| !a.ip().is_unspecified() && a.port() != 0);
                        addrs.sort_unstable();
                        addrs.dedup();
                        if last.as_ref() != Some(&addrs) {
                            let eps = addrs
                                .iter()
                                .map(|&a| ResolvedEndpoint::of_pool(a, &self.pool))
                                .collect();
                            let change = sink.publish(&key, eps);
                            tracing::info!(
                                source = %key,
                                name = %self.dns.name,
                                endpoints = addrs.len(),
                                added = ?change.added,
                                removed = ?change.removed,
                                "DNS discovery updated the pool"
                            );
                            last = Some(addrs);
                        }
                    }
                    Err(e) => tracing::warn!(
                        source = %key,
                        name = %self.dns.name,
                        "DNS lookup failed; keeping the last endpoint list: {e}"
                    ),
                }
                tokio::time::sleep(refresh).await;
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::Registry;
    use parking_lot::Mutex;

    /// Answers from a script the test edits; counts lookups.
    #[derive(Debug)]
    struct Scripted {
        answer: Mutex<io::Result<Vec<SocketAddr>>>,
        lookups: std::sync::atomic::AtomicUsize,
    }

    impl Default for Scripted {
        fn default() -> Self {
            Scripted {
                answer: Mutex::new(Ok(Vec::new())),
                lookups: Default::default(),
            }
        }
    }

    impl Scripted {
        fn set(&self, answer: io::Result<Vec<SocketAddr>>) {
            *self.answer.lock() = answer;
        }
    }

    impl Resolve for Scripted {
        fn resolve(&self, _: &str, port: u16) -> BoxFuture<'static, io::Result<Vec<SocketAddr>>> {
            self.lookups
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let answer = match &*self.answer.lock() {
                Ok(a) => Ok(a.iter().map(|a| SocketAddr::new(a.ip(), port)).collect()),
                Err(e) => Err(io::Error::new(e.kind(), e.to_string())),
            };
            Box::pin(async move { answer })
        }
    }

    fn ip(last: u8) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, last], 0))
    }

    fn ports(reg: &Registry) -> Vec<String> {
        reg.snapshot()
            .all()
            .iter()
            .map(|e| e.address.to_string())
            .collect()
    }

    #[tokio::test(start_paused = true)]
    async fn re_resolves_periodically_and_keeps_the_list_on_failure() {
        let pool: PoolConfig = serde_norway::from_str(
            "{name: gpu, models: [m], prefill_tokens_per_s: 5000, dns: {name: vllm.svc, port: 8000, refresh_ms: 1000}}",
        )
        .unwrap();
        let resolver = Arc::new(Scripted::default());
        resolver.set(Ok(vec![ip(2), ip(1), ip(2)]));
        let reg = Arc::new(Registry::new(&[]));
        let source = Arc::new(DnsDiscovery::new(&pool, resolver.clone()).unwrap());
        assert_eq!(source.key(), "dns:gpu");
        let task = tokio::spawn(source.run(reg.clone()));
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(ports(&reg), vec!["10.0.0.1:8000", "10.0.0.2:8000"]);
        let ep = reg.snapshot().all()[0].clone();
        assert_eq!(
            (ep.models.clone(), ep.prefill_tokens_per_s, &*ep.source),
            (vec!["m".to_string()], Some(5000.0), "dns:gpu"),
            "pool settings"
        );
        let version = reg.snapshot().version;

        // Same answer: nothing published.
        tokio::time::sleep(Duration::from_millis(1000)).await;
        assert_eq!(reg.snapshot().version, version);
        // Lookup failure: the list stays.
        resolver.set(Err(io::Error::other("SERVFAIL")));
        tokio::time::sleep(Duration::from_millis(1000)).await;
        assert_eq!(ports(&reg).len(), 2);
        // A pod went away, another came.
        resolver.set(Ok(vec![ip(2), ip(3)]));
        tokio::time::sleep(Duration::from_millis(1000)).await;
        assert_eq!(ports(&reg), vec!["10.0.0.2:8000", "10.0.0.3:8000"]);
        assert!(resolver.lookups.load(std::sync::atomic::Ordering::Relaxed) >= 4);
        task.abort();
    }

    #[tokio::test]
    async fn system_resolver_resolves_localhost_to_loopback() {
        let addrs = SystemResolver.resolve("localhost", 8000).await.unwrap();
        assert!(!addrs.is_empty());
        assert!(
            addrs
                .iter()
                .all(|a| a.ip().is_loopback() && a.port() == 8000),
            "{addrs:?}"
        );
    }
}
