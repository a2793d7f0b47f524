//! DNS discovery: a pool's endpoints are the addresses a name resolves to (A and AAAA records, as
//! a Kubernetes headless service returns one per ready pod), re-resolved every `refresh_ms`.
//!
//! A failed lookup keeps the last list (a DNS hiccup must not empty the pool); an unchanged
//! answer publishes nothing. Addresses come in with the pool's models, adapters and settings.
//!
//! An answer is data from the network, so it is filtered before it becomes endpoints
//! ([`accept_answer`]): addresses that cannot be a replica or that point at the router's own
//! host or at link-local services (cloud metadata at 169.254.169.254) are dropped, and at most
//! `dns.max_addresses` are kept.

use std::fmt;
use std::io;
use std::net::{IpAddr, SocketAddr};
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
                    Ok(addrs) => {
                        let (addrs, dropped) = accept_answer(addrs, &self.dns);
                        if dropped.any() && last.as_ref() != Some(&addrs) {
                            tracing::warn!(
                                source = %key,
                                name = %self.dns.name,
                                refused = dropped.refused,
                                over_cap = dropped.over_cap,
                                max_addresses = self.dns.max_addresses,
                                "DNS answer had addresses that are not accepted as endpoints"
                            );
                        }
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

/// Addresses of an answer that were not taken.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Dropped {
    /// Not a replica address: unspecified, multicast, broadcast, link-local, port 0, or
    /// loopback when the pool does not allow it.
    pub refused: usize,
    /// Acceptable, but past `max_addresses`.
    pub over_cap: usize,
}

impl Dropped {
    /// Whether anything was dropped.
    pub fn any(&self) -> bool {
        self.refused + self.over_cap > 0
    }
}

/// The endpoints an answer for `dns` yields: acceptable addresses, sorted, deduplicated, at
/// most `dns.max_addresses` (the lowest, so the choice does not flap with answer order).
/// Loopback is acceptable when `dns.allow_loopback` is set or the name is `localhost` or under
/// it (RFC 6761 reserves those names for loopback).
pub fn accept_answer(mut addrs: Vec<SocketAddr>, dns: &DnsConfig) -> (Vec<SocketAddr>, Dropped) {
    let loopback_ok = dns.allow_loopback || is_localhost_name(&dns.name);
    let before = addrs.len();
    addrs.retain(|a| a.port() != 0 && acceptable(a.ip(), loopback_ok));
    let refused = before - addrs.len();
    addrs.sort_unstable();
    addrs.dedup();
    let over_cap = addrs.len().saturating_sub(dns.max_addresses);
    addrs.truncate(dns.max_addresses);
    (addrs, Dropped { refused, over_cap })
}

fn is_localhost_name(name: &str) -> bool {
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    name == "localhost" || name.ends_with(".localhost")
}

/// Whether `ip` may be a replica's address.
fn acceptable(ip: IpAddr, loopback_ok: bool) -> bool {
    match ip.to_canonical() {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            !(v4.is_unspecified()
                || o[0] == 0 // "this network", 0.0.0.0/8
                || v4.is_multicast()
                || v4.is_broadcast()
                || v4.is_link_local()
                || (v4.is_loopback() && !loopback_ok))
        }
        IpAddr::V6(v6) => {
            !(v6.is_unspecified()
                || v6.is_multicast()
                || v6.is_unicast_link_local()
                || (v6.is_loopback() && !loopback_ok))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::Registry;

    #[test]
    fn answers_are_filtered_and_capped() {
        let dns = |name: &str, allow_loopback: bool, max_addresses: usize| DnsConfig {
            name: name.into(),
            port: 8000,
            allow_loopback,
            max_addresses,
            ..DnsConfig::default()
        };
        let a = |s: &str| s.parse::<SocketAddr>().unwrap();
        let answer = vec![
            a("10.0.0.2:8000"),
            a("10.0.0.1:8000"),
            a("10.0.0.1:8000"),
            a("127.0.0.1:8000"),
            a("[::1]:8000"),
            a("[::ffff:127.0.0.1]:8000"),
            a("169.254.169.254:8000"),
            a("[fe80::1]:8000"),
            a("0.0.0.0:8000"),
            a("0.1.2.3:8000"),
            a("224.0.0.1:8000"),
            a("255.255.255.255:8000"),
            a("[::]:8000"),
            a("[ff02::1]:8000"),
            a("10.0.0.3:0"),
            a("[2001:db8::1]:8000"),
        ];
        let (kept, dropped) = accept_answer(answer.clone(), &dns("vllm.svc", false, 256));
        assert_eq!(
            kept,
            vec![
                a("10.0.0.1:8000"),
                a("10.0.0.2:8000"),
                a("[2001:db8::1]:8000")
            ]
        );
        assert_eq!(
            dropped,
            Dropped {
                refused: 12,
                over_cap: 0
            }
        );
        let (kept, _) = accept_answer(answer.clone(), &dns("vllm.svc", true, 256));
        assert_eq!(kept.len(), 6, "loopback allowed: {kept:?}");
        for name in ["localhost", "LOCALHOST.", "vllm.localhost"] {
            let (kept, _) = accept_answer(answer.clone(), &dns(name, false, 256));
            assert_eq!(kept.len(), 6, "{name} may resolve to loopback");
        }
        let (kept, dropped) = accept_answer(answer, &dns("vllm.svc", false, 2));
        assert_eq!(kept, vec![a("10.0.0.1:8000"), a("10.0.0.2:8000")]);
        assert_eq!(
            dropped,
            Dropped {
                refused: 12,
                over_cap: 1
            }
        );
    }
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
