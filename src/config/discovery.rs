//! Per-pool endpoint sources other than a static list, and the engine a pool runs.

use serde::{Deserialize, Serialize};

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
