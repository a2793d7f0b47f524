//! The YAML configuration: schema, defaults and validation.
//!
//! Every struct is `#[serde(default, deny_unknown_fields)]`, so a typo is an error that names the
//! field and its line, and an omitted field takes the default documented on it. [`Config::load`]
//! parses and validates; [`Config::validate`] returns every problem at once, each prefixed with the
//! path of the bad field (`pools[0].endpoints[2].address: ...`).
//!
//! This module never reaches the network: addresses are checked for form, not reachability.

mod admin;
mod discovery;
mod flow;
mod health;
mod kv_events;
mod load;
mod policy;
mod sharing;
mod tiers;
mod traces;
mod validate;
pub mod watch;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;

use serde::{Deserialize, Serialize};

pub use admin::AdminConfig;
pub use discovery::{DnsConfig, EngineKind, KubernetesConfig};
pub use flow::{
    BandConfig, FlowControlConfig, ObjectiveConfig, QueueOrdering, RoomConfig, RoomMode,
    UnmatchedLabels,
};
pub use health::{BreakerConfig, HealthConfig, ProbeConfig};
pub use kv_events::{
    check_zmq_endpoint, expand_template, EndpointKvEvents, KvEventsAttach, KvEventsConfig,
    KvEventsSubscription, MediumWeights, ResolvedKvEvents,
};
pub use load::{LearningConfig, LoadConfig, ScrapeConfig};
pub use policy::{
    CacheLoadScoreConfig, LeastLoadedConfig, OffloadPricing, PolicyConfig, PolicyName,
    PredictedTtftConfig, SaturationConfig, ScorerName, SglangConfig, TieBreakName,
    VllmKvAwareConfig, VllmPrefixAwareConfig, WeightedScorer, WeightedScorersConfig,
};
pub use sharing::SharingConfig;
pub use tiers::{KvShape, KvTierConfig, KvTiersConfig, DEFAULT_KV_BYTES_PER_TOKEN};
pub use traces::TracingConfig;
pub use validate::ConfigError;

/// The whole router configuration, as read from one YAML file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Listen addresses and server limits. Not hot-reloadable (a change is logged and ignored).
    pub server: ServerConfig,
    /// How decisions are written back to Envoy, and request limits.
    pub routing: RoutingConfig,
    /// Which routing policy picks endpoints, and its parameters.
    pub policy: PolicyConfig,
    /// Per-model settings (tokenizer, block size). A model served by an endpoint needs no entry
    /// here; it then uses the defaults.
    pub models: Vec<ModelConfig>,
    /// Groups of model replicas. At least one endpoint must be configured in total.
    pub pools: Vec<PoolConfig>,
    /// What kvrouter tells a standalone Envoy directly.
    pub envoy: EnvoyConfig,
    /// How tenants are identified and whose prefix caches they may share.
    pub tenancy: TenancyConfig,
    /// The cache-ownership index: per-endpoint capacity and prediction lifetime.
    pub cache_index: CacheIndexConfig,
    /// Debugging aids.
    pub debug: DebugConfig,
    /// Live load signals: engine metrics scraping and learned speeds.
    pub load: LoadConfig,
    /// Active probes, ejection and the circuit breaker.
    pub health: HealthConfig,
    /// How engines' KV events are trusted (where they come from is per pool: `pools[].kv_events`).
    pub kv_events: KvEventsConfig,
    /// The admission queue: holding, ordering and shedding requests while the fleet is
    /// saturated. Off by default.
    pub flow_control: FlowControlConfig,
    /// OpenTelemetry traces of routing decisions (off by default). Read at start-up.
    pub tracing: TracingConfig,
    /// Access to the admin APIs (default: no authentication). Read at start-up.
    pub admin: AdminConfig,
    /// Decision sharing with the other kvrouter instances of the fleet over Redis pub/sub
    /// (off by default). Read at start-up.
    pub sharing: SharingConfig,
}

/// Debugging aids (off by default).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DebugConfig {
    /// Keep the explanation of this many recent decisions, by request id (`x-request-id`), for
    /// `GET /debug/decisions/{id}` on the admin server. Default 0 (off).
    pub record_decisions: usize,
}

/// Outputs for a standalone Envoy (a gateway with its own endpoint discovery needs none).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EnvoyConfig {
    /// If set, kvrouter writes its endpoint set to this file as an EDS DiscoveryResponse (JSON)
    /// at start-up and on every change, atomically; point the replica cluster's
    /// `path_config_source` at it (see `kvrouter envoy-config --eds`). Default: not written.
    pub eds_path: Option<std::path::PathBuf>,
}

/// Listen addresses and server-level limits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// Address of the ext_proc gRPC server. Default `127.0.0.1:9002`.
    pub grpc_listen: SocketAddr,
    /// Also serve the ext_proc gRPC server (and its health service) on this Unix socket, for
    /// an Envoy on the same host or in the same pod (`kvrouter envoy-config --extproc
    /// unix:PATH`): cheaper per message than loopback TCP. Plaintext; the file is mode 0660, so
    /// Envoy must run as kvrouter's user or group; keep it in a directory only they can write.
    /// A relative path is taken from the config file's directory (from the working directory
    /// with `--grpc-unix-socket`). A stale socket file is replaced at start, anything else at
    /// the path is an error. Default: none (TCP only).
    pub grpc_unix_socket: Option<std::path::PathBuf>,
    /// Address of the admin HTTP server (`/healthz`, `/readyz`, `/metrics`, `/debug/*`).
    /// Default `127.0.0.1:9090`.
    pub admin_listen: SocketAddr,
    /// Address of a gRPC server answering only the health service (`grpc.health.v1.Health`,
    /// names `""` and `inference-extension`), for probes (`--grpc-health-port`). The health
    /// service is also served on `grpc_listen`. Default: none.
    pub health_listen: Option<SocketAddr>,
    /// Serve the ext_proc port over TLS with this certificate and key (PEM files, re-read at
    /// start only). Default: none (plaintext HTTP/2).
    pub tls: Option<ServerTlsConfig>,
    /// How often the config file is checked for changes, in milliseconds. 0 disables hot reload.
    /// Default 1000.
    pub reload_interval_ms: u64,
    /// Largest gRPC message accepted from Envoy, in bytes. A BUFFERED body arrives as one message,
    /// so this bounds the body size in that mode. Default 64 MiB.
    pub max_grpc_message_bytes: usize,
    /// Log format: `text` or `json`. Default `text`.
    pub log_format: LogFormat,
    /// Longest a request may run before its in-flight accounting is released even if its
    /// response end was never seen (e.g. Envoy's observer filter is missing), in seconds.
    /// Default 900.
    pub max_request_duration_s: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            grpc_listen: SocketAddr::from(([127, 0, 0, 1], 9002)),
            grpc_unix_socket: None,
            admin_listen: SocketAddr::from(([127, 0, 0, 1], 9090)),
            health_listen: None,
            tls: None,
            reload_interval_ms: 1000,
            max_grpc_message_bytes: 64 << 20,
            log_format: LogFormat::Text,
            max_request_duration_s: 900,
        }
    }
}

/// TLS on the ext_proc port.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerTlsConfig {
    /// The server certificate chain, PEM. Relative to the config file's directory. Required.
    pub cert_path: std::path::PathBuf,
    /// Its private key (PKCS#8, PKCS#1 or SEC1), PEM. Relative to the config file's
    /// directory. Required.
    pub key_path: std::path::PathBuf,
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// How a decision is handed back to Envoy, and request limits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RoutingConfig {
    /// Header (and `envoy.lb` metadata key) carrying the picked `ip:port`.
    /// Default `x-gateway-destination-endpoint` (the endpoint picker protocol's name).
    pub destination_header: String,
    /// Fallback endpoints appended after the pick, comma-separated, for gateways that retry on
    /// the next host. Default 2. 0 sends the pick alone.
    pub fallback_endpoints: usize,
    /// Largest request body accepted, in bytes; a larger one gets 413. Default 32 MiB.
    pub max_body_bytes: usize,
    /// Request body bytes all streams together may hold while their bodies arrive and are
    /// decided on; a request whose next chunk would pass it gets 503 with `retry-after`, so a
    /// flood of large bodies costs at most this much memory instead of exhausting it. At least
    /// `max_body_bytes`. Default 1 GiB.
    pub max_buffered_body_bytes: usize,
    /// Seconds in the `retry-after` header of a 503 (no healthy endpoint). Default 1.
    pub retry_after_s: u32,
    /// Most entries in a chat request's `messages`; more gets 413 (counted while parsing, so
    /// the rest of such a body is never built). Must be > 0. Default 10000.
    pub max_messages: usize,
    /// Most content parts over all messages of one request (a string `content` counts as one);
    /// more gets 413. Must be > 0. Default 20000.
    pub max_content_parts: usize,
    /// Time budget for a request's prefix identity (render + tokenize), in ms, counted from when
    /// its decision starts (so it bounds how long one request holds a tokenizing slot). Past it
    /// before rendering, the request is identified by the byte estimate; past it while
    /// tokenizing, by the exact prefix tokenized so far (decision prefix source `bytes` /
    /// `tokens-partial`), cut between two messages or two chunks of a long one
    /// (`models[].chunk_bytes`). The rest is then tokenized after the decision and predicted on
    /// the pick, as deferred text is (`models[].defer_tokenizing_after`), so the next request
    /// sharing the prompt still finds all of it there. Routing never waits longer for a better
    /// identity and never fails for lack of one. 0 disables the deadline. Default 100.
    pub prefix_budget_ms: u64,
    /// Bodies longer than this, in bytes, are decided in the heavy lane: half the cores' worth of
    /// threads at the lowest CPU priority, queued apart from the light lane (twice the cores, at
    /// normal priority) that every shorter body uses. So worst-case bodies (tens of thousands of
    /// messages, near-limit sizes) queue behind each other, never in front of a normal chat, and
    /// use only the CPU the rest leaves; a light body is bounded in work by its size (a 64 KiB
    /// body holds at most a few thousand messages). Default 64 KiB.
    pub heavy_body_bytes: usize,
    /// Bytes per second at which the bodies longer than `heavy_body_bytes` are read off the
    /// ext_proc connections, all together (after a burst: [`Self::heavy_burst`]). Receiving
    /// bytes costs the async workers that every request's messages need (the kernel's copy out
    /// of the socket), so a
    /// flood of near-limit bodies read at full speed delays normal requests' decisions; held
    /// back, a long body's HTTP/2 window stays closed and Envoy keeps the rest of it meanwhile.
    /// A long body then takes up to its size over this rate to arrive (its tenant's share of
    /// it when several tenants send long bodies; longer when many arrive at once), and one that
    /// would wait more than `heavy_body_max_wait_ms` is answered 503. It is also the
    /// most body bytes of long requests one kvrouter takes in a second: raise it where long
    /// bodies (images inlined as base64) are the normal traffic. 0 reads at full speed. Unset
    /// (the default): 8 MiB/s per core kvrouter may use ([`Self::heavy_rate`]; 16 MiB/s on 2
    /// cores, docs/security.md: the flood bench at 16, 32 and 64 MiB/s).
    pub heavy_body_bytes_per_s: Option<u64>,
    /// The longest, in ms, a long body (see `heavy_body_bytes_per_s`) waits in all for its turn
    /// to be read; one that would wait longer is answered 503 with `retry-after` at once. Keep
    /// it under the gateway's ext_proc `message_timeout` (2 s in the shipped sidecar configs):
    /// past that Envoy fails the request open and the engine gets a body the router never
    /// checked (its message and part limits). 0: never refused. Default 1000.
    pub heavy_body_max_wait_ms: u64,
    /// Early STREAMED bodies only (`envoy-config --body-mode streamed`): how long, in ms, the
    /// router waits for the next message of a body that has not ended before it lets the
    /// request go unrouted (Envoy's fallback serves it, the rest of the body following as it
    /// comes; with tenancy configured, 408: unsalted and unconfined it must not go). While the
    /// long-body pace holds one of its chunks back the wait is not counted. Envoy re-arms its
    /// ext_proc `message_timeout` with every chunk, and past it Envoy gives up on the router
    /// and forwards only the part of the body it holds: keep this under that timeout. 0: wait
    /// for Envoy's timeout. Default 1000.
    pub streamed_body_pause_ms: u64,
    /// How often, per endpoint, a routed request is marked for Envoy's observer filter, in ms:
    /// at most one request per endpoint in each such interval is watched to its first byte
    /// (status, served endpoint, time to first token: passive health and the learned speed).
    /// Every request is watched where a failure was counted since the last good response (so
    /// a failing endpoint's breaker opens at most one interval later than if every request
    /// were watched), every half-open trial, and every
    /// request while `flow_control` is on (its room needs real first bytes). The others open
    /// no observer stream: their in-flight count ends with the request, their prefill with the
    /// first byte the decision predicted. The observer's stream per request cost about a third
    /// of Envoy's requests per second at 8 concurrent clients on 2 cores (docs/envoy.md); one
    /// in 100 ms still gives each endpoint 10 samples a second. 0 marks every request.
    /// Default 100.
    pub observe_interval_ms: u64,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        Self {
            destination_header: "x-gateway-destination-endpoint".to_string(),
            fallback_endpoints: 2,
            max_body_bytes: 32 << 20,
            max_buffered_body_bytes: 1 << 30,
            retry_after_s: 1,
            max_messages: crate::request::DEFAULT_MAX_MESSAGES,
            max_content_parts: crate::request::DEFAULT_MAX_CONTENT_PARTS,
            prefix_budget_ms: 100,
            heavy_body_bytes: 64 << 10,
            heavy_body_bytes_per_s: None,
            heavy_body_max_wait_ms: 1000,
            streamed_body_pause_ms: 1000,
            observe_interval_ms: 100,
        }
    }
}

/// What an ext_proc message carrying a body adds to the body's own bytes, at most (the body
/// field's tag and length, Envoy's attributes and metadata), for sizing by body bytes.
const MESSAGE_ENVELOPE_BYTES: u64 = 64 << 10;

/// Bytes of long bodies read at full speed before the read rate holds a stream back, at least
/// ([`RoutingConfig::heavy_burst`]): one such body that fits is read at once, however low the
/// rate.
pub const MIN_HEAVY_BURST_BYTES: u64 = 4 << 20;

impl RoutingConfig {
    /// Bytes per second of long bodies read (`heavy_body_bytes_per_s`, else 8 MiB/s per core
    /// this process may use); 0 is no limit.
    pub fn heavy_rate(&self) -> u64 {
        self.heavy_body_bytes_per_s
            .unwrap_or_else(|| crate::budget::cores() as u64 * (8 << 20))
    }

    /// Bytes of long bodies read at full speed before the rate holds them back: 4 MiB, or more
    /// where needed for one body of `max_body_bytes` (and its message's envelope) to be read
    /// within `heavy_body_max_wait_ms` when nothing else is being read. Without that, a body
    /// the router accepts by size would be answered 503 on every try, the rate alone making it
    /// wait past the bound (on 2 cores 8 MiB/s each, a 1 s bound: anything over 20 MiB).
    pub fn heavy_burst(&self) -> u64 {
        let rate = self.heavy_rate();
        if rate == 0 || self.heavy_body_max_wait_ms == 0 {
            return MIN_HEAVY_BURST_BYTES;
        }
        let in_time = rate.saturating_mul(self.heavy_body_max_wait_ms) / 1000;
        let largest = self.max_body_bytes as u64 + MESSAGE_ENVELOPE_BYTES;
        largest.saturating_sub(in_time).max(MIN_HEAVY_BURST_BYTES)
    }

    /// The body-shape limits to parse requests with (`max_messages`, `max_content_parts`).
    pub fn request_limits(&self) -> crate::request::RequestLimits {
        crate::request::RequestLimits {
            max_messages: self.max_messages,
            max_content_parts: self.max_content_parts,
        }
    }

    /// The deadline of a prefix identity whose work starts at `started`
    /// (`started + prefix_budget_ms`), or none when the budget is 0.
    pub fn prefix_deadline(&self, started: std::time::Instant) -> Option<std::time::Instant> {
        (self.prefix_budget_ms > 0)
            .then(|| started + std::time::Duration::from_millis(self.prefix_budget_ms))
    }
}

/// Per-model settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// The model name as clients send it in `model`. Required.
    pub name: String,
    /// The model's Hugging Face tokenizer: a `tokenizer.json` file, or a directory holding
    /// `tokenizer.json` and optionally `tokenizer_config.json` and `chat_template.jinja` (each
    /// used when present and not given below). Relative paths are relative to the config file's
    /// directory. Default: none, and prompt lengths and block hashes use the byte estimate
    /// (4 bytes per token, hashes over byte chunks).
    pub tokenizer: Option<String>,
    /// The model's `tokenizer_config.json` (special tokens, and the chat template unless
    /// `chat_template` is set). Default: the one in the `tokenizer` directory, if any.
    pub tokenizer_config: Option<String>,
    /// A Jinja chat template file overriding the one in `tokenizer_config.json`. Default: the
    /// `chat_template.jinja` in the `tokenizer` directory, if any.
    pub chat_template: Option<String>,
    /// Tokens per prefix block hashed by the router, 1..=4096. The engine's own block size may
    /// differ (its KV events are re-chunked). Default 16.
    pub block_size_tokens: u32,
    /// At most this many prompt tokens are tokenized and hashed per request (the rest of a long
    /// prompt is counted by estimate), bounding the work a huge body costs. Must be at least
    /// `block_size_tokens`. Default 32768.
    pub max_prefix_tokens: u32,
    /// Token ids kept in the token cache (segments of rendered prompts: messages, and chunks of
    /// long ones, e.g. shared system prompts and earlier turns), about 4 bytes each plus a small
    /// per-segment overhead. To help follow-up turns it must hold the traffic of the time
    /// between two turns, about as long as the engines keep a prefix (their KV capacity). 0
    /// disables the cache. Default 4194304 (16 MiB of ids).
    pub token_cache_tokens: u64,
    /// A message longer than this many bytes (a pasted document, a whole conversation sent as
    /// one message) is tokenized and cached in chunks of about this size, cut where the
    /// tokenizer splits words anyway (checked when the tokenizer loads; a tokenizer that fails
    /// the check is not chunked): a request repeating the start of an earlier one takes that
    /// start from the token cache, and `routing.prefix_budget_ms` can stop tokenizing between
    /// two chunks (keeping the prefix so far) instead of only between messages. 0 turns it off.
    /// Default 4096 (~1,000 tokens).
    pub chunk_bytes: u64,
    /// Work one chat-template render may do, in minijinja fuel (about one unit per template
    /// instruction and per 64 bytes of data it handles). A render that runs out (a pathological
    /// template on a huge conversation) is abandoned and the request is identified by the byte
    /// estimate (prefix source `bytes`, fallback `work-budget`). Must be > 0. Default 10000000:
    /// about a second of rendering at most; a 10,000-message chat with Qwen3's template uses
    /// 0.6M, a 32 MiB conversation 2.6M (Qwen3) to 2.8M (Llama 3).
    pub template_fuel: u64,
    /// Most bytes a rendered chat prompt may have; a larger one is abandoned for the byte
    /// estimate, as for `template_fuel`. Must be > 0. Default 67108864 (64 MiB, twice the
    /// default `routing.max_body_bytes`).
    pub max_rendered_prompt_bytes: u64,
    /// Decide before the whole chat is tokenized, 0..=1: once this fraction of the rendered
    /// prompt's bytes is tokenized (from the token cache, or just now), tokenizing stops at the
    /// next segment (message, or chunk of a long one) the cache does not hold. The decision
    /// counts the rest by estimate; the rest is tokenized right after the reply (filling the
    /// cache and the pick's predicted blocks), off the request's path. New text can match an engine's cache only
    /// after a matching prefix, so the pick rarely changes, and a new user turn (~2 us a word
    /// to tokenize) no longer delays the decision. Not for chats with media. 1 turns it off
    /// (a prefix cut by `routing.prefix_budget_ms` still has its rest finished this way).
    /// Default 0.5.
    pub defer_tokenizing_after: f64,
    /// Bytes of KV cache one token of this model takes (all layers, keys and values), for
    /// pricing a load from a slower tier (`pools[].kv_tiers`). Set this or `kv_shape`, not
    /// both. Must be > 0. Default: from `kv_shape`, else 131072 (Llama-3.1-8B in BF16).
    pub kv_bytes_per_token: Option<u64>,
    /// The model's KV geometry (`layers`, `kv_heads`, `head_dim`, `dtype_bytes`, from its
    /// `config.json`), from which `kv_bytes_per_token` follows. Default: none.
    pub kv_shape: Option<KvShape>,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            name: String::new(),
            tokenizer: None,
            tokenizer_config: None,
            chat_template: None,
            block_size_tokens: 16,
            max_prefix_tokens: 32_768,
            token_cache_tokens: 1 << 22,
            chunk_bytes: crate::prefix::CHUNK_BYTES as u64,
            template_fuel: crate::prefix::template::DEFAULT_TEMPLATE_FUEL,
            max_rendered_prompt_bytes: crate::prefix::template::DEFAULT_MAX_RENDERED_PROMPT_BYTES
                as u64,
            defer_tokenizing_after: 0.5,
            kv_bytes_per_token: None,
            kv_shape: None,
        }
    }
}

/// How a request's tenant is found, and which tenants share prefix caches.
///
/// Each tenant's prompts hash in their own namespace, so one tenant's cached blocks never
/// attract (or reveal timing of) another's requests, and the router writes a per-tenant
/// `cache_salt` into each request so the engine's own cache is split the same way (see
/// `docs/security.md`). Tenants listed together in a share group use one namespace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TenancyConfig {
    /// The request header naming the tenant. Only trusted when Envoy sets it from a verified
    /// source (a `jwt_authn` claim, or the gateway) and strips what clients send: the configs
    /// `kvrouter envoy-config --tenant-header` renders do both. Lowercase. Default: none, and
    /// all requests share one namespace.
    pub header: Option<String>,
    /// Groups of tenants that share one prefix-cache namespace. A tenant may be in at most one
    /// group. Default: none (every tenant is isolated).
    pub share_groups: Vec<ShareGroupConfig>,
    /// Write the tenant's `cache_salt` (a keyed hash of its namespace, never the tenant id)
    /// into every routed request body that has a tenant, replacing one the client sent (the
    /// client's value is mixed in, so its own isolation still holds inside the tenant). vLLM
    /// honours the field; turn this off for engines that reject unknown fields. Default true
    /// (no effect without `header`).
    pub inject_cache_salt: bool,
    /// A file holding the secret key of the `cache_salt` hash (any bytes, at least 16; trailing
    /// newline ignored). Routers sharing one engine fleet need the same key, or the same tenant
    /// gets a different salt per router and misses the engine's cache. Default: none, and a
    /// random key per process (kept across config reloads, not restarts).
    pub cache_salt_key_file: Option<std::path::PathBuf>,
}

impl Default for TenancyConfig {
    fn default() -> Self {
        Self {
            header: None,
            share_groups: Vec::new(),
            inject_cache_salt: true,
            cache_salt_key_file: None,
        }
    }
}

/// Tenants that share a prefix-cache namespace.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ShareGroupConfig {
    /// Group name, unique. Required.
    pub name: String,
    /// Tenant ids (values of the tenancy header). At least one.
    pub tenants: Vec<String>,
}

/// The cache-ownership index.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CacheIndexConfig {
    /// Blocks (of the model's `block_size_tokens`) remembered per endpoint before the least
    /// recently used are evicted, when the endpoint's own capacity is not known (from its
    /// `vllm:cache_config_info`). Must be > 0. Default 31250 (16-token blocks: 500k tokens, an
    /// 8B model's KV cache on an 80 GB GPU).
    pub default_capacity_blocks: u64,
    /// How long a block predicted from our own routing decision counts as cached, in
    /// milliseconds, unless the engine's KV events confirm it. Must be > 0. Default 120000.
    pub prediction_ttl_ms: u64,
    /// The largest KV capacity an engine's own report (`vllm:cache_config_info`
    /// `block_size × num_gpu_blocks`, `sglang:max_total_num_tokens`) may give its endpoint, in
    /// tokens; a larger report is clamped to it, so a wrong or hostile report cannot make the
    /// index hold unbounded entries for one endpoint (about 80 bytes per block). Capacities set
    /// in the config (`cache_capacity_tokens`) are not clamped. Must be > 0. Default 8388608
    /// (8 Mi tokens: 10x an 8B model's KV cache on a 141 GB GPU; 512k 16-token blocks, ~40 MB).
    pub max_engine_capacity_tokens: u64,
}

impl Default for CacheIndexConfig {
    fn default() -> Self {
        Self {
            default_capacity_blocks: 31_250,
            prediction_ttl_ms: 120_000,
            max_engine_capacity_tokens: 8 << 20,
        }
    }
}

impl CacheIndexConfig {
    /// An engine-reported KV capacity, in tokens, clamped to `max_engine_capacity_tokens`.
    pub fn clamp_engine_capacity(&self, reported_tokens: u64) -> u64 {
        reported_tokens.min(self.max_engine_capacity_tokens)
    }
}

/// A group of endpoints. Pool-level `models` / `adapters` apply to endpoints that list none.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PoolConfig {
    /// Pool name, unique; used in logs and metrics. Required.
    pub name: String,
    /// Models served by every endpoint of the pool that lists none of its own.
    pub models: Vec<String>,
    /// LoRA adapters served by every endpoint of the pool that lists none of its own.
    pub adapters: Vec<String>,
    /// Prefill speed of the pool's endpoints that set none, in tokens per second.
    pub prefill_tokens_per_s: Option<f64>,
    /// KV-cache capacity of the pool's endpoints that set none, in tokens.
    pub cache_capacity_tokens: Option<u64>,
    /// The replicas.
    pub endpoints: Vec<EndpointConfig>,
    /// The serving engine (`vllm`, `sglang` or `other`): which metric names are scraped.
    /// Default `vllm`.
    pub engine: EngineKind,
    /// Discover the pool's endpoints from DNS instead of listing them: every address the name
    /// resolves to, re-resolved periodically. A pool has `endpoints` or `dns`, not both; DNS
    /// endpoints take the pool's models, adapters and settings. Default: none.
    pub dns: Option<DnsConfig>,
    /// Where the pool's engines publish KV events. Default: none (ownership from predictions).
    pub kv_events: Option<KvEventsSubscription>,
    /// Discover the pool's endpoints from the Kubernetes API: the pods an InferencePool
    /// selects, or a label selector's (see [`KubernetesConfig`]). A pool lists `endpoints`, or
    /// has `dns`, or `kubernetes`. Default: none.
    pub kubernetes: Option<KubernetesConfig>,
    /// The tenants (values of the trusted `tenancy.header`) whose requests may go to this pool's
    /// endpoints; a request without a tenant, or of another tenant, never does. Needs
    /// `tenancy.header`. Default: empty, the pool is open to every request.
    pub tenants: Vec<String>,
    /// Labels of every endpoint of the pool (e.g. `hardware: h100`, `revision: "2025-06"`),
    /// which an objective's `required_labels` select on. An endpoint's own labels, and a
    /// Kubernetes pod's labels, add to and override these. Default: none.
    pub labels: BTreeMap<String, String>,
    /// How fast the pool's engines load KV back from CPU memory and slower tiers, which
    /// `predicted-ttft` charges for a prefix its KV events place there. Default: CPU 20 GB/s
    /// and 1 ms, other tiers 3 GB/s and 5 ms.
    pub kv_tiers: KvTiersConfig,
}

/// One model replica.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EndpointConfig {
    /// `ip:port` of the replica's OpenAI-compatible HTTP server, as Envoy's ORIGINAL_DST cluster
    /// will dial it. Required; must be unique across pools.
    pub address: String,
    /// Models (served model names) this replica serves. Empty: the pool's list.
    pub models: Vec<String>,
    /// LoRA adapters this replica serves (clients select one as `model` or `adapter`).
    /// Empty: the pool's list.
    pub adapters: Vec<String>,
    /// Relative capacity for load balancing; an endpoint of weight 2 takes twice the load of one
    /// of weight 1 before looking equally busy. Must be > 0. Default 1.
    pub weight: f64,
    /// Most concurrent requests the router sends it; at the limit it counts as saturated.
    /// Default: no limit.
    pub max_in_flight: Option<u32>,
    /// Take the endpoint out of rotation: no new requests, in-flight ones finish (for
    /// maintenance). Default false.
    pub drain: bool,
    /// The endpoint's prefill speed for `predicted-ttft`, in prompt tokens per second, until
    /// one is learned from its responses. Default: the pool's, else
    /// `policy.predicted_ttft.default_prefill_tokens_per_s`.
    pub prefill_tokens_per_s: Option<f64>,
    /// KV-cache capacity in tokens, which bounds how many prefix blocks the router remembers
    /// for it. Default: the pool's, else `cache_index.default_capacity_blocks` blocks (until the
    /// replica's `vllm:cache_config_info` says).
    pub cache_capacity_tokens: Option<u64>,
    /// This replica's own KV-event settings, overriding its pool's. Default: the pool's.
    pub kv_events: Option<EndpointKvEvents>,
    /// This replica's labels, added to (and overriding) its pool's `labels`. Default: none.
    pub labels: BTreeMap<String, String>,
}

impl Default for EndpointConfig {
    fn default() -> Self {
        Self {
            address: String::new(),
            models: Vec::new(),
            adapters: Vec::new(),
            weight: 1.0,
            max_in_flight: None,
            drain: false,
            prefill_tokens_per_s: None,
            cache_capacity_tokens: None,
            kv_events: None,
            labels: BTreeMap::new(),
        }
    }
}

/// Why a config could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The YAML does not match the schema (the message names the field and its line).
    #[error("{path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// The parser's message, with the field path and location.
        message: String,
    },
    /// The YAML parsed but values are invalid.
    #[error("{path}: invalid configuration:\n{}", format_errors(.errors))]
    Invalid {
        /// The file.
        path: String,
        /// Every problem found.
        errors: Vec<ConfigError>,
    },
}

fn format_errors(errors: &[ConfigError]) -> String {
    errors
        .iter()
        .map(|e| format!("  - {e}"))
        .collect::<Vec<_>>()
        .join("\n")
}

impl Config {
    /// Parses YAML text (no validation).
    pub fn from_yaml(text: &str) -> Result<Config, String> {
        serde_norway::from_str(text).map_err(|e| e.to_string())
    }

    /// Reads, parses and validates a config file.
    pub fn load(path: &Path) -> Result<Config, LoadError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| LoadError::Read {
            path: shown.clone(),
            source,
        })?;
        Self::parse_and_validate(&text, &shown)
    }

    /// Parses and validates YAML text; `origin` names it in errors.
    pub fn parse_and_validate(text: &str, origin: &str) -> Result<Config, LoadError> {
        Self::parse_adjust_validate(text, origin, |_| Vec::new())
    }

    /// Parses YAML text, lets `adjust` change it (command-line overrides, which report their
    /// own problems), then validates; `origin` names the text in errors.
    pub fn parse_adjust_validate(
        text: &str,
        origin: &str,
        adjust: impl FnOnce(&mut Config) -> Vec<ConfigError>,
    ) -> Result<Config, LoadError> {
        let mut config = Self::from_yaml(text).map_err(|message| LoadError::Parse {
            path: origin.to_string(),
            message,
        })?;
        let mut errors = adjust(&mut config);
        errors.extend(config.validate());
        if errors.is_empty() {
            Ok(config)
        } else {
            Err(LoadError::Invalid {
                path: origin.to_string(),
                errors,
            })
        }
    }

    /// Every endpoint with the pool defaults applied, in config order.
    pub fn resolved_endpoints(&self) -> Vec<ResolvedEndpoint> {
        let mut out = Vec::new();
        for pool in &self.pools {
            for ep in &pool.endpoints {
                let Ok(address) = ep.address.parse::<SocketAddr>() else {
                    continue; // rejected by validate(); never reached for a loaded config
                };
                let models = if ep.models.is_empty() {
                    pool.models.clone()
                } else {
                    ep.models.clone()
                };
                let adapters = if ep.adapters.is_empty() {
                    pool.adapters.clone()
                } else {
                    ep.adapters.clone()
                };
                out.push(ResolvedEndpoint {
                    address,
                    pool: pool.name.clone(),
                    models,
                    adapters,
                    weight: ep.weight,
                    max_in_flight: ep.max_in_flight,
                    drain: ep.drain,
                    prefill_tokens_per_s: ep.prefill_tokens_per_s.or(pool.prefill_tokens_per_s),
                    cache_capacity_tokens: ep.cache_capacity_tokens.or(pool.cache_capacity_tokens),
                    engine: pool.engine,
                    labels: merged_labels(&pool.labels, &ep.labels),
                });
            }
        }
        out
    }
}

impl ResolvedEndpoint {
    /// An endpoint at `address` serving `models`, everything else at its default (tests and
    /// discovery sources that know only addresses).
    pub fn new(address: SocketAddr, pool: &str, models: &[&str]) -> ResolvedEndpoint {
        ResolvedEndpoint {
            address,
            pool: pool.to_string(),
            models: models.iter().map(|m| m.to_string()).collect(),
            adapters: Vec::new(),
            weight: 1.0,
            max_in_flight: None,
            drain: false,
            prefill_tokens_per_s: None,
            cache_capacity_tokens: None,
            engine: EngineKind::default(),
            labels: BTreeMap::new(),
        }
    }

    /// An endpoint of `pool` at `address` (a discovered address), with the pool's settings.
    pub fn of_pool(address: SocketAddr, pool: &PoolConfig) -> ResolvedEndpoint {
        ResolvedEndpoint {
            address,
            pool: pool.name.clone(),
            models: pool.models.clone(),
            adapters: pool.adapters.clone(),
            weight: 1.0,
            max_in_flight: None,
            drain: false,
            prefill_tokens_per_s: pool.prefill_tokens_per_s,
            cache_capacity_tokens: pool.cache_capacity_tokens,
            engine: pool.engine,
            labels: pool.labels.clone(),
        }
    }
}

/// `pool`'s labels with `own` added over them.
pub fn merged_labels(
    pool: &BTreeMap<String, String>,
    own: &BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    let mut labels = pool.clone();
    labels.extend(own.iter().map(|(k, v)| (k.clone(), v.clone())));
    labels
}

/// An endpoint with its pool's defaults applied and its address parsed.
#[derive(Debug, Clone, PartialEq)]
pub struct ResolvedEndpoint {
    /// The replica's address.
    pub address: SocketAddr,
    /// The pool it belongs to.
    pub pool: String,
    /// Models it serves.
    pub models: Vec<String>,
    /// LoRA adapters it serves.
    pub adapters: Vec<String>,
    /// Relative capacity (> 0).
    pub weight: f64,
    /// Concurrency limit, if any.
    pub max_in_flight: Option<u32>,
    /// Out of rotation for new requests.
    pub drain: bool,
    /// Configured prefill speed, tokens per second.
    pub prefill_tokens_per_s: Option<f64>,
    /// Configured KV-cache capacity, tokens.
    pub cache_capacity_tokens: Option<u64>,
    /// The serving engine (which metric names are scraped).
    pub engine: EngineKind,
    /// Its labels: the pool's, with the endpoint's (or pod's) own over them.
    pub labels: BTreeMap<String, String>,
}
