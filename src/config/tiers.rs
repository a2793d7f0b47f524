//! KV held outside GPU memory: how fast each slower tier loads it back (a pool's `kv_tiers`),
//! and how many bytes of KV a token of each model takes (a model's `kv_bytes_per_token` or
//! `kv_shape`), so the cost model can price a tier hit by its load time.
//!
//! ```yaml
//! models:
//!   - name: llama
//!     kv_shape: {layers: 32, kv_heads: 8, head_dim: 128, dtype_bytes: 2}   # 128 KiB a token
//! pools:
//!   - name: gpu
//!     models: [llama]
//!     kv_tiers:
//!       cpu: {bandwidth_gb_per_s: 20, latency_ms: 1}        # vLLM's OffloadingConnector
//!       other: {bandwidth_gb_per_s: 3, latency_ms: 5}       # local NVMe, a remote store
//!     endpoints: [{address: 10.0.0.5:8000}]
//! ```
//!
//! The defaults and where their numbers come from are in `docs/configuration.md` (*KV tiers*).

use serde::{Deserialize, Serialize};

use super::validate::Errors;
use super::{Config, ModelConfig};

/// KV bytes per token of a model with no `kv_bytes_per_token` or `kv_shape`: Llama-3.1-8B in
/// BF16 (32 layers x 8 KV heads x 128 dims x K and V x 2 bytes = 131072, 128 KiB), the
/// simulator's profiles' model.
pub const DEFAULT_KV_BYTES_PER_TOKEN: u64 = 131_072;

/// A model's KV-cache geometry, from which its bytes per token follow:
/// `2 (K and V) * layers * kv_heads * head_dim * dtype_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvShape {
    /// Transformer layers (`num_hidden_layers`). Required, > 0.
    pub layers: u32,
    /// Key-value heads (`num_key_value_heads`; grouped-query attention keeps fewer than the
    /// query heads). Per GPU under tensor parallelism (each GPU loads its own shard over its
    /// own link). Required, > 0.
    pub kv_heads: u32,
    /// Dimensions per head (`head_dim`, else `hidden_size / num_attention_heads`). Required,
    /// > 0.
    pub head_dim: u32,
    /// Bytes per KV element: 2 for BF16/FP16 (vLLM's `--kv-cache-dtype auto`), 1 for FP8.
    /// Default 2.
    #[serde(default = "two")]
    pub dtype_bytes: u32,
}

fn two() -> u32 {
    2
}

impl KvShape {
    /// Bytes of KV one token takes.
    pub fn bytes_per_token(&self) -> u64 {
        2 * u64::from(self.layers)
            * u64::from(self.kv_heads)
            * u64::from(self.head_dim)
            * u64::from(self.dtype_bytes)
    }
}

impl ModelConfig {
    /// Bytes of KV one token of this model takes: `kv_bytes_per_token`, else `kv_shape`'s,
    /// else [`DEFAULT_KV_BYTES_PER_TOKEN`].
    pub fn kv_bytes_per_token(&self) -> u64 {
        self.kv_bytes_per_token
            .or(self.kv_shape.map(|s| s.bytes_per_token()))
            .unwrap_or(DEFAULT_KV_BYTES_PER_TOKEN)
    }
}

/// How fast a pool's engines load KV back from each tier slower than GPU memory (a pool's
/// `kv_tiers`). The engines' KV events say which tier holds a block (`medium`: vLLM's `CPU`,
/// anything else but `GPU` is `other`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvTiersConfig {
    /// Host memory (vLLM's `OffloadingConnector`, LMCache's local CPU backend). Default 20
    /// GB/s, 1 ms.
    #[serde(deserialize_with = "cpu_tier")]
    pub cpu: KvTierConfig,
    /// Anything slower: local disk, a remote store (vLLM's `STORAGE`, LMCache's disk and
    /// remote backends). Default 3 GB/s, 5 ms.
    #[serde(deserialize_with = "other_tier")]
    pub other: KvTierConfig,
}

/// A tier as written: fields left out take that tier's own defaults (a partial `other` block
/// must not get the CPU tier's speed).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TierAsWritten {
    bandwidth_gb_per_s: Option<f64>,
    latency_ms: Option<f64>,
    capacity_tokens: Option<u64>,
}

impl TierAsWritten {
    fn over(self, d: KvTierConfig) -> KvTierConfig {
        KvTierConfig {
            bandwidth_gb_per_s: self.bandwidth_gb_per_s.unwrap_or(d.bandwidth_gb_per_s),
            latency_ms: self.latency_ms.unwrap_or(d.latency_ms),
            capacity_tokens: self.capacity_tokens.unwrap_or(d.capacity_tokens),
        }
    }
}

fn cpu_tier<'de, D: serde::Deserializer<'de>>(d: D) -> Result<KvTierConfig, D::Error> {
    Ok(TierAsWritten::deserialize(d)?.over(KvTiersConfig::default().cpu))
}

fn other_tier<'de, D: serde::Deserializer<'de>>(d: D) -> Result<KvTierConfig, D::Error> {
    Ok(TierAsWritten::deserialize(d)?.over(KvTiersConfig::default().other))
}

impl Default for KvTiersConfig {
    fn default() -> Self {
        Self {
            cpu: KvTierConfig {
                bandwidth_gb_per_s: 20.0,
                latency_ms: 1.0,
                capacity_tokens: 0,
            },
            other: KvTierConfig {
                bandwidth_gb_per_s: 3.0,
                latency_ms: 5.0,
                capacity_tokens: 0,
            },
        }
    }
}

/// One tier's load speed.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvTierConfig {
    /// Bytes per second a load moves into GPU memory, in GB/s (10^9 bytes). Must be > 0.
    /// Default: see [`KvTiersConfig`].
    pub bandwidth_gb_per_s: f64,
    /// Fixed time a load adds whatever its size (setting up the transfer, finding the blocks,
    /// the engine noticing it finished), in ms. Must be >= 0. Default: see [`KvTiersConfig`].
    pub latency_ms: f64,
    /// Tokens of KV an endpoint holds in this tier (vLLM's `cpu_bytes_to_use` over the
    /// model's bytes per token): added to its GPU capacity, so the index remembers offloaded
    /// blocks the engine's events report beyond what fits on the GPU. Default 0.
    pub capacity_tokens: u64,
}

impl Default for KvTierConfig {
    /// The CPU tier's speed. Not used when parsing: a partial `cpu` or `other` block takes its
    /// own tier's defaults field by field (`cpu_tier`, `other_tier`).
    fn default() -> Self {
        KvTiersConfig::default().cpu
    }
}

impl KvTierConfig {
    /// Bytes per second.
    pub fn bytes_per_s(&self) -> f64 {
        self.bandwidth_gb_per_s * 1e9
    }
}

impl KvTiersConfig {
    /// Tokens held in the slower tiers of one endpoint, added to its index capacity.
    pub fn capacity_tokens(&self) -> u64 {
        self.cpu
            .capacity_tokens
            .saturating_add(self.other.capacity_tokens)
    }
}

impl Config {
    /// Every invalid `models[].kv_*` and `pools[].kv_tiers` value, with its path.
    pub(super) fn validate_kv_tiers(&self, errors: &mut Errors) {
        for (i, model) in self.models.iter().enumerate() {
            let at = format!("models[{i}]");
            if model.kv_bytes_per_token.is_some() && model.kv_shape.is_some() {
                errors.push(
                    format!("{at}.kv_shape"),
                    "set kv_bytes_per_token or kv_shape, not both",
                );
            }
            if model.kv_bytes_per_token == Some(0) {
                errors.push(format!("{at}.kv_bytes_per_token"), "must be > 0");
            }
            if let Some(shape) = &model.kv_shape {
                for (field, value) in [
                    ("layers", shape.layers),
                    ("kv_heads", shape.kv_heads),
                    ("head_dim", shape.head_dim),
                    ("dtype_bytes", shape.dtype_bytes),
                ] {
                    if value == 0 {
                        errors.push(format!("{at}.kv_shape.{field}"), "must be > 0");
                    }
                }
            }
        }
        for (p, pool) in self.pools.iter().enumerate() {
            let tiers = &pool.kv_tiers;
            for (name, tier) in [("cpu", &tiers.cpu), ("other", &tiers.other)] {
                let at = format!("pools[{p}].kv_tiers.{name}");
                let bw = tier.bandwidth_gb_per_s;
                if !(bw.is_finite() && bw > 0.0) {
                    errors.push(
                        format!("{at}.bandwidth_gb_per_s"),
                        format!("must be a finite number > 0 (got {bw})"),
                    );
                }
                if !(tier.latency_ms.is_finite() && tier.latency_ms >= 0.0) {
                    errors.push(
                        format!("{at}.latency_ms"),
                        format!("must be a finite number >= 0 (got {})", tier.latency_ms),
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errors_of(yaml: &str) -> Vec<String> {
        Config::from_yaml(yaml)
            .expect("parses")
            .validate()
            .into_iter()
            .map(|e| e.to_string())
            .collect()
    }

    const POOL: &str = "endpoints: [{address: '127.0.0.1:1'}]";

    #[test]
    fn bytes_per_token_come_from_the_shape_or_the_default() {
        let c = Config::from_yaml(
            "models: [{name: a, kv_shape: {layers: 32, kv_heads: 8, head_dim: 128}}, \
             {name: b, kv_bytes_per_token: 1000}, {name: c}, \
             {name: d, kv_shape: {layers: 80, kv_heads: 8, head_dim: 128, dtype_bytes: 1}}]",
        )
        .unwrap();
        let bytes: Vec<u64> = c.models.iter().map(|m| m.kv_bytes_per_token()).collect();
        // Llama-3.1-8B in BF16; as configured; the default; Llama-3.1-70B with an FP8 cache.
        assert_eq!(
            bytes,
            vec![131_072, 1000, DEFAULT_KV_BYTES_PER_TOKEN, 163_840]
        );
        let t = KvTiersConfig::default();
        assert_eq!((t.cpu.bytes_per_s(), t.other.bytes_per_s()), (20e9, 3e9));
        assert_eq!(t.capacity_tokens(), 0);
    }

    #[test]
    fn bad_tier_and_shape_values_name_their_fields() {
        let cases: &[(String, &[&str])] = &[
            (
                format!(
                    "pools: [{{name: a, models: [m], kv_tiers: {{cpu: {{bandwidth_gb_per_s: 0}}}}, {POOL}}}]"
                ),
                &["pools[0].kv_tiers.cpu.bandwidth_gb_per_s: must be a finite number > 0 (got 0)"],
            ),
            (
                format!(
                    "pools: [{{name: a, models: [m], kv_tiers: {{other: {{bandwidth_gb_per_s: .nan, latency_ms: -1}}}}, {POOL}}}]"
                ),
                &[
                    "pools[0].kv_tiers.other.bandwidth_gb_per_s: must be a finite number > 0 (got NaN)",
                    "pools[0].kv_tiers.other.latency_ms: must be a finite number >= 0 (got -1)",
                ],
            ),
            (
                format!(
                    "models: [{{name: m, kv_bytes_per_token: 0}}, {{name: n, kv_bytes_per_token: 5, kv_shape: {{layers: 0, kv_heads: 1, head_dim: 1}}}}]\npools: [{{name: a, models: [m], {POOL}}}]"
                ),
                &[
                    "models[0].kv_bytes_per_token: must be > 0",
                    "models[1].kv_shape: set kv_bytes_per_token or kv_shape, not both",
                    "models[1].kv_shape.layers: must be > 0",
                ],
            ),
        ];
        for (yaml, expected) in cases {
            assert_eq!(&errors_of(yaml), expected, "{yaml}");
        }
        let good = format!(
            "pools: [{{name: a, models: [m], kv_tiers: {{cpu: {{bandwidth_gb_per_s: 25, latency_ms: 0, capacity_tokens: 1000}}}}, {POOL}}}]"
        );
        assert_eq!(errors_of(&good), Vec::<String>::new());
        let c = Config::from_yaml(&good).unwrap();
        let tiers = c.pools[0].kv_tiers;
        assert_eq!(tiers.cpu.capacity_tokens, 1000);
        assert_eq!(tiers.other, KvTiersConfig::default().other, "defaults kept");
        // A partial block keeps its own tier's defaults, not the CPU tier's.
        let partial = Config::from_yaml(&format!(
            "pools: [{{name: a, models: [m], kv_tiers: {{other: {{capacity_tokens: 7}}, cpu: {{latency_ms: 2}}}}, {POOL}}}]"
        ))
        .unwrap()
        .pools[0]
            .kv_tiers;
        let d = KvTiersConfig::default();
        assert_eq!(partial.other.capacity_tokens, 7);
        assert_eq!(partial.other.bandwidth_gb_per_s, d.other.bandwidth_gb_per_s);
        assert_eq!(partial.other.latency_ms, d.other.latency_ms);
        assert_eq!(partial.cpu.latency_ms, 2.0);
        assert_eq!(partial.cpu.bandwidth_gb_per_s, d.cpu.bandwidth_gb_per_s);
        assert!(Config::from_yaml("pools: [{name: a, kv_tiers: {cpu: {gbps: 3}}}]").is_err());
    }
}
