//! The `policy` section: which policy routes, and each policy's parameters.

use serde::{Deserialize, Serialize};

/// The routing policy and its parameters. Only the selected policy's section is used; the others
/// keep their defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyConfig {
    /// Policy name. Default `predicted-ttft`.
    pub name: PolicyName,
    /// When an endpoint counts as saturated (filtered out by the policies that filter, unless
    /// every candidate is saturated).
    pub saturation: SaturationConfig,
    /// Parameters of `least-loaded` (also the load figure other policies break ties with).
    pub least_loaded: LeastLoadedConfig,
    /// Parameters of `cache-load-score`.
    pub cache_load_score: CacheLoadScoreConfig,
    /// Parameters of `sglang-cache-aware` (its thresholds also serve `sglang-cache-aware-index`).
    pub sglang_cache_aware: SglangConfig,
    /// Parameters of `vllm-prefix-aware`.
    pub vllm_prefixaware: VllmPrefixAwareConfig,
    /// Parameters of `vllm-kv-aware`.
    pub vllm_kvaware: VllmKvAwareConfig,
    /// Parameters of `predicted-ttft`.
    pub predicted_ttft: PredictedTtftConfig,
    /// Parameters of `weighted-scorers`.
    pub weighted_scorers: WeightedScorersConfig,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            name: PolicyName::PredictedTtft,
            saturation: SaturationConfig::default(),
            least_loaded: LeastLoadedConfig::default(),
            cache_load_score: CacheLoadScoreConfig::default(),
            sglang_cache_aware: SglangConfig::default(),
            vllm_prefixaware: VllmPrefixAwareConfig::default(),
            vllm_kvaware: VllmKvAwareConfig::default(),
            predicted_ttft: PredictedTtftConfig::default(),
            weighted_scorers: WeightedScorersConfig::default(),
        }
    }
}

/// The routing policies that can be selected by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyName {
    /// Each request to the next candidate in turn; ignores load and cache.
    RoundRobin,
    /// Fewest in-flight requests (per unit of weight), then fewest in-flight prefill tokens.
    LeastLoaded,
    /// Longest cached prefix wins, ties to the least loaded; ignores load otherwise (the naive
    /// baseline that melts hot replicas).
    PrefixAffinity,
    /// vLLM production-stack: `matched/prompt - beta * (load - mean) / max(1, mean)`, argmax.
    CacheLoadScore,
    /// SGLang's gateway: least loaded when the fleet is imbalanced, else the best match in its
    /// own approximate tree of past decisions if above a threshold, else the smallest tree.
    SglangCacheAware,
    /// SGLang's thresholds over kvrouter's index (falls back to the least loaded): a variant,
    /// not what SGLang runs.
    SglangCacheAwareIndex,
    /// vLLM production stack's `prefixaware`: longest match in a trie of past decisions, random
    /// among the matched endpoints, no load term.
    VllmPrefixAware,
    /// vLLM production stack's `kvaware`: the LMCache holder if at most a threshold of tokens is
    /// left to compute, else the lowest request rate.
    VllmKvAware,
    /// Minimum predicted time to first token: queue wait plus prefill of the uncached tokens.
    PredictedTtft,
    /// GIE-style: filters, weighted scorers in `[0, 1]`, max-score picker.
    WeightedScorers,
}

impl PolicyName {
    /// Every policy, in a stable order.
    pub const ALL: [PolicyName; 10] = [
        PolicyName::RoundRobin,
        PolicyName::LeastLoaded,
        PolicyName::PrefixAffinity,
        PolicyName::CacheLoadScore,
        PolicyName::SglangCacheAware,
        PolicyName::SglangCacheAwareIndex,
        PolicyName::VllmPrefixAware,
        PolicyName::VllmKvAware,
        PolicyName::PredictedTtft,
        PolicyName::WeightedScorers,
    ];

    /// The name as written in config and in metrics labels.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyName::RoundRobin => "round-robin",
            PolicyName::LeastLoaded => "least-loaded",
            PolicyName::PrefixAffinity => "prefix-affinity",
            PolicyName::CacheLoadScore => "cache-load-score",
            PolicyName::SglangCacheAware => "sglang-cache-aware",
            PolicyName::SglangCacheAwareIndex => "sglang-cache-aware-index",
            PolicyName::VllmPrefixAware => "vllm-prefix-aware",
            PolicyName::VllmKvAware => "vllm-kv-aware",
            PolicyName::PredictedTtft => "predicted-ttft",
            PolicyName::WeightedScorers => "weighted-scorers",
        }
    }
}

/// When an endpoint is too busy to take more work while others can.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SaturationConfig {
    /// Saturated at this many requests waiting in the engine's queue (scraped
    /// `num_requests_waiting`; only when fresh). Default 5 (the GIE saturation detector's).
    pub max_waiting_requests: u64,
    /// Saturated at this KV-cache usage, 0..1 (scraped `kv_cache_usage_perc`; only when fresh).
    /// Default 0.8.
    pub max_kv_cache_usage: f64,
}

impl Default for SaturationConfig {
    fn default() -> Self {
        Self {
            max_waiting_requests: 5,
            max_kv_cache_usage: 0.8,
        }
    }
}

/// Parameters of `least-loaded`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LeastLoadedConfig {
    /// How many in-flight prefill tokens weigh as much as one in-flight request when the two are
    /// combined into one load figure. Default 2048.
    pub tokens_per_request: f64,
}

impl Default for LeastLoadedConfig {
    fn default() -> Self {
        Self {
            tokens_per_request: 2048.0,
        }
    }
}

/// Parameters of `cache-load-score`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CacheLoadScoreConfig {
    /// Weight of the load term against the matched fraction, >= 0. Default 1.0 (the
    /// production-stack router's default).
    pub beta: f64,
}

impl Default for CacheLoadScoreConfig {
    fn default() -> Self {
        Self { beta: 1.0 }
    }
}

/// Parameters of `sglang-cache-aware` (defaults are SGLang router's command-line defaults).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SglangConfig {
    /// Route to the best match only if it covers more than this fraction of the prompt, 0..1.
    /// Default 0.3.
    pub cache_threshold: f64,
    /// The fleet is imbalanced when max - min in-flight requests exceeds this... Default 64.
    pub balance_abs_threshold: u64,
    /// ...and max exceeds min times this. Default 1.5.
    pub balance_rel_threshold: f64,
    /// How often each endpoint's part of the approximate tree is cut back to `max_tree_tokens`
    /// (least recently used first), in ms. Default 120000 (`--eviction-interval-secs 120`).
    pub eviction_interval_ms: u64,
    /// Bound on each endpoint's part of the approximate tree, in tokens. Default 2^24 (SGLang's
    /// `--max-tree-size` of 2^26 characters at ~4 characters per token).
    pub max_tree_tokens: u64,
}

impl Default for SglangConfig {
    fn default() -> Self {
        Self {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            eviction_interval_ms: 120_000,
            max_tree_tokens: 1 << 24,
        }
    }
}

/// Parameters of `vllm-prefix-aware` (defaults are the production stack router's).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct VllmPrefixAwareConfig {
    /// A match shorter than this many tokens falls back to the lowest request rate
    /// (`--prefix-min-match-length`, there in characters). Default 0: any match, even empty,
    /// is a random pick among the matched endpoints.
    pub min_match_tokens: u64,
    /// Safety bound the original lacks: the trie is cleared when it would exceed this many
    /// blocks. Default 4 Mi (about 160 MiB).
    pub max_blocks: usize,
}

impl Default for VllmPrefixAwareConfig {
    fn default() -> Self {
        Self {
            min_match_tokens: 0,
            max_blocks: 4 << 20,
        }
    }
}

/// Parameters of `vllm-kv-aware` (defaults are the production stack router's and LMCache's).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct VllmKvAwareConfig {
    /// The holder gets the request if at most this many prompt tokens are left unmatched there
    /// (`--kv-aware-threshold`). Default 2000.
    pub threshold_tokens: u64,
    /// LMCache's chunk, in tokens: matches count in whole chunks. Default 256.
    pub chunk_tokens: u64,
    /// Window of the request-rate fallback, in ms (`--request-stats-window 60`). Default 60000.
    pub qps_window_ms: u64,
}

impl Default for VllmKvAwareConfig {
    fn default() -> Self {
        Self {
            threshold_tokens: 2000,
            chunk_tokens: 256,
            qps_window_ms: 60_000,
        }
    }
}

/// Parameters of `predicted-ttft`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PredictedTtftConfig {
    /// Prefill speed assumed for an endpoint that has no `prefill_tokens_per_s` of its own and
    /// none learned yet, in tokens per second. Default 10000 (an 8B model on an A100-class GPU).
    pub default_prefill_tokens_per_s: f64,
    /// Fixed time every request pays before prefill (scheduling, the first decode step), in ms.
    /// Default 0.
    pub base_ms: f64,
    /// Extra time per request already running on the endpoint (decode steps share the GPU with
    /// prefill), in ms. Default 0.5.
    pub running_request_ms: f64,
    /// Extra time per request waiting in the endpoint's engine queue (scraped
    /// `num_requests_waiting`, only when fresh) beyond the requests the router itself has
    /// routed there and not yet seen a first byte of (those are already counted by their
    /// prefill tokens): traffic that bypassed the router, in ms. Default 100.
    pub waiting_request_ms: f64,
    /// Weight of the delay this request's own prefill imposes on the requests that will queue
    /// behind it on the endpoint (estimated by the queue there now). The ranking cost is
    /// `predicted TTFT + externality_weight * prefill_ms * queue length`: 0 ranks by this
    /// request's predicted TTFT alone (greedy; under high load it spills cached prefixes to cold
    /// replicas and wastes capacity on recomputation), 1 charges the full delay. Default 1.
    pub externality_weight: f64,
    /// Weight of the cached tokens this request's prefill evicts. A warm engine's KV cache is
    /// full (LRU): every uncached token it computes evicts a cached one, which a later request
    /// recomputes if it would have hit it. The ranking cost adds `eviction_weight * prefill_ms`
    /// (the chance an evicted token is reused, times its recompute at this speed), so a copy of
    /// a prefix on a cold replica pays for the prefixes it pushes out there, which the TTFT
    /// prediction and the queue externality do not see. 0 leaves evictions unpriced.
    pub eviction_weight: f64,
    /// Weight of a prefix's home: the endpoint the router last sent the prompt's prefix to,
    /// remembered after the engine evicted it. When that endpoint has lost part of the prefix,
    /// every other candidate that does not hold those tokens either is charged
    /// `recall_weight * prefill_ms` of them: a group sent elsewhere each time its home evicts it
    /// wanders over the fleet and leaves partial copies behind, while one that goes home keeps
    /// one copy. Matters with KV events (they report evictions at once; predictions outlive
    /// them). Default 16 (a home is left only when staying costs more than sixteen recomputes:
    /// docs/policies.md, "A prefix's home"); 0 leaves homes unpriced.
    pub recall_weight: f64,
    /// Also exclude endpoints that the scraped engine signals call saturated
    /// (`policy.saturation`'s queue and KV-usage thresholds). Default false: the cost already
    /// charges every queue, and a hard cut at a threshold moves cached prefixes to cold replicas
    /// exactly when every replica is busy. Configured `max_in_flight` limits always apply.
    pub engine_saturation: bool,
    /// Predictions within this fraction of the best count as a tie, broken towards the lighter
    /// endpoint. Default 0.02.
    pub tie_tolerance: f64,
    /// How prefix tokens the engine holds only in CPU memory or a slower tier (its KV events
    /// say so) are priced: `load-time` charges the time the engine takes to load them back
    /// (the tier's bytes over its bandwidth, `pools[].kv_tiers`); `medium-weights` counts each
    /// as `kv_events.medium_weights` of a cached token (a flat discount, the earlier model).
    /// Default `load-time`.
    pub offload_pricing: OffloadPricing,
    /// Count the prompt in prefill at the head of an endpoint's queue as partly done: its queue
    /// wait is the prefill of the prompts routed there without a first byte at the endpoint's
    /// speed, less how long the head has been prefilling (never below 0). Without it that
    /// prompt counts in full until its first byte, so two endpoints each prefilling one prompt
    /// look alike however far along they are. The flow controller's room keeps counting it in
    /// full (its `dispatch_lead_ms` is the knob for that). Default false: docs/flow-control.md,
    /// "A TTFT target for critical requests".
    pub prefill_progress: bool,
}

/// How `predicted-ttft` prices prefix tokens held outside GPU memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OffloadPricing {
    /// Their load time: bytes over the tier's bandwidth, plus its latency.
    #[default]
    LoadTime,
    /// A flat weight per medium (`kv_events.medium_weights`) of a cached token.
    MediumWeights,
}

impl Default for PredictedTtftConfig {
    fn default() -> Self {
        Self {
            default_prefill_tokens_per_s: 10_000.0,
            base_ms: 0.0,
            running_request_ms: 0.5,
            waiting_request_ms: 100.0,
            externality_weight: 1.0,
            eviction_weight: 0.0,
            recall_weight: 16.0,
            engine_saturation: false,
            tie_tolerance: 0.02,
            offload_pricing: OffloadPricing::LoadTime,
            prefill_progress: false,
        }
    }
}

/// Parameters of `weighted-scorers`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WeightedScorersConfig {
    /// The scorers and their weights (>= 0, at least one > 0). Default: prefix 3, queue 2,
    /// kv-cache 2 (the GIE endpoint picker's default profile).
    pub scorers: Vec<WeightedScorer>,
    /// How equal top scores are broken. Default `random` (GIE's max-score picker).
    pub tie_break: TieBreakName,
}

impl Default for WeightedScorersConfig {
    fn default() -> Self {
        Self {
            scorers: vec![
                WeightedScorer {
                    name: ScorerName::Prefix,
                    weight: 3.0,
                },
                WeightedScorer {
                    name: ScorerName::Queue,
                    weight: 2.0,
                },
                WeightedScorer {
                    name: ScorerName::KvCache,
                    weight: 2.0,
                },
            ],
            tie_break: TieBreakName::Random,
        }
    }
}

/// One scorer with its weight.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WeightedScorer {
    /// Which scorer.
    pub name: ScorerName,
    /// Its weight, >= 0.
    pub weight: f64,
}

/// The scorers `weighted-scorers` can combine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ScorerName {
    /// Fraction of the prompt cached on the endpoint.
    Prefix,
    /// Fewest queued requests (scraped waiting when fresh, else router in-flight), min-max
    /// normalised.
    Queue,
    /// Free KV cache (1 - usage; scraped, else neutral).
    KvCache,
    /// The router's own in-flight load (requests and prefill tokens), min-max normalised.
    Load,
}

/// Tie-break of the max-score picker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TieBreakName {
    /// A rotating offset (deterministic).
    Rotate,
    /// Uniformly at random.
    Random,
}
