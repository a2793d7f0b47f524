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
}

impl Default for DnsConfig {
    fn default() -> Self {
        Self {
            name: String::new(),
            port: 0,
            refresh_ms: 5000,
        }
    }
}
