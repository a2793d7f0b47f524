//! Per-pool endpoint sources other than a static list, and the engine a pool runs.

use std::collections::HashSet;
use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use super::{Config, EndpointKvEvents, KvEventsAttach, ResolvedKvEvents};

/// The serving engine of a pool: which metric names are scraped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EngineKind {
    /// vLLM: `vllm:num_requests_waiting`, `vllm:num_requests_running`,
    /// `vllm:kv_cache_usage_perc`, `vllm:cache_config_info`, `vllm:lora_requests_info`.
    #[default]
    Vllm,
    /// SGLang: `sglang:num_queue_reqs`, `sglang:num_running_reqs`, `sglang:token_usage`,
    /// `sglang:max_total_num_tokens`.
    Sglang,
    /// Anything else: not scraped (probes still run).
    Other,
}

impl EngineKind {
    /// The name as written in config.
    pub fn as_str(self) -> &'static str {
        match self {
            EngineKind::Vllm => "vllm",
            EngineKind::Sglang => "sglang",
            EngineKind::Other => "other",
        }
    }
}

/// A pool whose endpoints are the addresses a DNS name resolves to (A and AAAA records), e.g. a
/// Kubernetes headless service. Re-resolved periodically; a failed lookup keeps the last list.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DnsConfig {
    /// The name to resolve, e.g. `vllm.inference.svc.cluster.local`. Required.
    pub name: String,
    /// The replicas' port. Required.
    pub port: u16,
    /// Re-resolve every this many ms. Default 5000; must be >= 100.
    pub refresh_ms: u64,
    /// At most this many addresses of one answer become endpoints (the lowest, after sorting,
    /// so the choice is stable); the rest are dropped with a warning. A DNS answer is data from
    /// the network: without a cap one answer could add thousands of endpoints, each scraped and
    /// probed. 1..=4096. Default 256.
    pub max_addresses: usize,
    /// Accept loopback addresses (127.0.0.0/8, ::1) in answers. Default false: a DNS name of a
    /// pool of replicas should not resolve to the router's own host, and accepting it would let
    /// whoever controls the answer point scrapes and traffic at local services (the router's
    /// admin port, a sidecar). Names under `localhost` (RFC 6761) always may resolve to
    /// loopback. Link-local (169.254.0.0/16 with cloud metadata services, fe80::/10),
    /// unspecified, multicast and broadcast addresses are never accepted.
    pub allow_loopback: bool,
}

impl Default for DnsConfig {
    fn default() -> Self {
        Self {
            name: String::new(),
            port: 0,
            refresh_ms: 5000,
            max_addresses: 256,
            allow_loopback: false,
        }
    }
}

/// A pool whose endpoints are Kubernetes pods, watched through the API server: the pods an
/// `InferencePool` (`inference.networking.k8s.io/v1`) selects, on its `targetPorts`, or the pods a
/// label selector matches, on `port`. Ready pods receive traffic; a pod that turns unready or
/// starts terminating drains (no new requests, in-flight ones finish, its cache entries stay);
/// a deleted pod leaves the pool. Set exactly one of `inference_pool` and `label_selector`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KubernetesConfig {
    /// The InferencePool whose `selector` and `targetPorts` define the pool (followed as they
    /// change). `kvrouter serve --pool-name` sets it. Default: none.
    pub inference_pool: Option<String>,
    /// A label selector in the API's syntax, e.g. `app=vllm,tier in (gpu)`. Needs `port`.
    /// Default: none.
    pub label_selector: Option<String>,
    /// The pods' serving port, with `label_selector`. Default: none.
    pub port: Option<u16>,
    /// The namespace of the pool and its pods. `--pool-namespace` sets it. Default: the service
    /// account's namespace in a pod, else the kubeconfig context's namespace, else `default`.
    pub namespace: Option<String>,
    /// A kubeconfig file to reach the API server with. Default: the pod's service account when
    /// `KUBERNETES_SERVICE_HOST` is set, else `$KUBECONFIG`, else `~/.kube/config`.
    pub kubeconfig: Option<std::path::PathBuf>,
    /// The kubeconfig context to use. Default: the kubeconfig's `current-context`.
    pub context: Option<String>,
}

impl KubernetesConfig {
    /// Checks the section of the pool at `at` (`pools[N].kubernetes`), pushing `(path, message)`.
    pub(super) fn check(&self, at: &str, mut push: impl FnMut(String, String)) {
        match (&self.inference_pool, &self.label_selector) {
            (Some(_), Some(_)) | (None, None) => push(
                at.to_string(),
                "set exactly one of inference_pool or label_selector".into(),
            ),
            _ => {}
        }
        if let Some(name) = &self.inference_pool {
            if !is_dns_subdomain(name) {
                push(
                    format!("{at}.inference_pool"),
                    format!(
                        "{name:?} is not a Kubernetes object name (lowercase RFC 1123 subdomain)"
                    ),
                );
            }
            if self.port.is_some() {
                push(
                    format!("{at}.port"),
                    "comes from the InferencePool's targetPorts; set it only with label_selector"
                        .into(),
                );
            }
        }
        if let Some(selector) = &self.label_selector {
            if selector.trim().is_empty() {
                push(format!("{at}.label_selector"), "must not be empty".into());
            }
            if matches!(self.port, None | Some(0)) {
                push(
                    format!("{at}.port"),
                    "is required (not 0) with label_selector".into(),
                );
            }
        }
        if let Some(ns) = &self.namespace {
            if !is_dns_label(ns) {
                push(
                    format!("{at}.namespace"),
                    format!("{ns:?} is not a namespace name (lowercase RFC 1123 label)"),
                );
            }
        }
        if self
            .kubeconfig
            .as_ref()
            .is_some_and(|p| p.as_os_str().is_empty())
        {
            push(format!("{at}.kubeconfig"), "must name a file".into());
        }
        if self.context.as_deref().is_some_and(|c| c.trim().is_empty()) {
            push(format!("{at}.context"), "must not be empty when set".into());
        }
    }
}

impl Config {
    /// The KV-event subscriptions of discovered endpoints (DNS or Kubernetes), each given as its
    /// address and pool name, from its pool's `kv_events` template (`{ip}`, `{port}`). Endpoints
    /// that already have a subscription among `taken` (the config's own, see
    /// [`Config::kv_event_subscriptions`]), or whose socket and topic an earlier endpoint already
    /// uses (several target ports of one pod with a per-pod template), get none; so do those
    /// whose pool has no `kv_events` or whose template does not resolve (logged).
    pub fn discovered_kv_event_subscriptions(
        &self,
        endpoints: &[(SocketAddr, &str)],
        taken: &[ResolvedKvEvents],
    ) -> Vec<ResolvedKvEvents> {
        let mut addresses: HashSet<SocketAddr> = taken.iter().map(|s| s.address).collect();
        let mut sockets: HashSet<(KvEventsAttach, String)> = taken
            .iter()
            .map(|s| (s.attach.clone(), s.topic.clone()))
            .collect();
        let mut out = Vec::new();
        for &(address, pool_name) in endpoints {
            let Some((p, pool)) = self
                .pools
                .iter()
                .enumerate()
                .find(|(_, pool)| pool.name == pool_name && pool.kv_events.is_some())
            else {
                continue;
            };
            let at = format!("pools[{p}] (discovered {address})");
            match super::kv_events::resolve_one(
                &at,
                p,
                pool,
                &EndpointKvEvents::default(),
                address,
                None,
            ) {
                Ok(Some(sub)) => {
                    // Pushed streams have no socket to share: each endpoint pushes its own.
                    if addresses.insert(address)
                        && (sub.attach == KvEventsAttach::Push
                            || sockets.insert((sub.attach.clone(), sub.topic.clone())))
                    {
                        out.push(sub);
                    }
                }
                Ok(None) => {}
                Err((path, message)) => tracing::warn!(
                    endpoint = %address,
                    "no KV-event subscription for a discovered endpoint: {path}: {message}"
                ),
            }
        }
        out
    }
}

/// An RFC 1123 label: at most 63 lowercase alphanumerics or `-`, alphanumeric at both ends.
fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// An RFC 1123 subdomain: dot-separated labels, at most 253 characters.
fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_dns_label)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discovered_endpoints_subscribe_through_their_pool_template_once_per_socket() {
        let config = Config::from_yaml(
            "pools:\n\
             - {name: k, models: [m], kv_events: {connect: 'tcp://{ip}:5557'}, kubernetes: {inference_pool: k}}\n\
             - {name: quiet, models: [m], kubernetes: {inference_pool: q}}\n\
             - {name: s, models: [m], endpoints: [{address: '10.0.0.9:8000', kv_events: {connect: 'tcp://10.0.0.9:5557'}}]}\n",
        )
        .unwrap();
        let addr = |s: &str| -> SocketAddr { s.parse().unwrap() };
        let own = config.kv_event_subscriptions();
        assert_eq!(own.len(), 1);
        let discovered = [
            (addr("10.0.0.1:8000"), "k"),
            (addr("10.0.0.1:8001"), "k"), // a second target port: same socket and topic
            (addr("10.0.0.2:8000"), "k"),
            (addr("10.0.0.3:8000"), "quiet"),
            (addr("10.0.0.9:8000"), "k"), // already subscribed by the config
        ];
        let subs = config.discovered_kv_event_subscriptions(&discovered, &own);
        let got: Vec<(SocketAddr, String)> = subs
            .iter()
            .map(|s| match &s.attach {
                KvEventsAttach::Connect(c) => (s.address, c.clone()),
                KvEventsAttach::Bind(b) => (s.address, b.clone()),
                KvEventsAttach::Push => (s.address, "push".to_string()),
            })
            .collect();
        assert_eq!(
            got,
            vec![
                (addr("10.0.0.1:8000"), "tcp://10.0.0.1:5557".to_string()),
                (addr("10.0.0.2:8000"), "tcp://10.0.0.2:5557".to_string()),
            ]
        );
        assert!(subs.iter().all(|s| s.model == "m"));
    }

    #[test]
    fn kubernetes_names_follow_rfc_1123() {
        for ok in ["qwen3-8b", "a", "pool.v1"] {
            assert!(is_dns_subdomain(ok), "{ok}");
        }
        for bad in ["", "Qwen", "-a", "a-", "a_b", "a..b"] {
            assert!(!is_dns_subdomain(bad), "{bad}");
        }
        assert!(!is_dns_label("a.b"));
        assert!(!is_dns_label(&"x".repeat(64)));
    }
}
