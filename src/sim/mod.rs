//! A vLLM-compatible model replica for tests, demos and benchmarks (the `kvsim` binary).
//!
//! This is the minimal replica: vLLM's HTTP API shapes (completions and chat, SSE streaming and
//! JSON), `/v1/models`, `/health`, `/metrics` with vLLM's metric names, and a response header
//! naming the replica. Timing is a fixed time to first token plus a per-prompt-token cost and a
//! fixed inter-token latency; there is no KV cache model yet.

pub mod server;

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

/// Response header naming the replica that served a request.
pub const REPLICA_HEADER: &str = "x-kvsim-replica";

/// One simulated replica.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReplicaConfig {
    /// Name reported in the replica header and metrics. Default `replica`.
    pub name: String,
    /// Listen address; port 0 picks a free one. Default `127.0.0.1:0`.
    pub listen: SocketAddr,
    /// Served model names (the first is the primary one). Default `[demo-model]`.
    pub models: Vec<String>,
    /// Time to first token before prompt costs, in ms. Default 10.
    pub ttft_base_ms: f64,
    /// Prefill cost per prompt token, in ms. Default 0.01.
    pub prefill_ms_per_token: f64,
    /// Time between output tokens, in ms. Default 2.
    pub inter_token_ms: f64,
    /// Output tokens when a request gives no `max_tokens`. Default 16.
    pub default_max_tokens: u32,
}

impl Default for ReplicaConfig {
    fn default() -> Self {
        Self {
            name: "replica".into(),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            models: vec!["demo-model".into()],
            ttft_base_ms: 10.0,
            prefill_ms_per_token: 0.01,
            inter_token_ms: 2.0,
            default_max_tokens: 16,
        }
    }
}

/// Several replicas, as a YAML fleet file lists them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FleetConfig {
    /// The replicas.
    pub replicas: Vec<ReplicaConfig>,
}
