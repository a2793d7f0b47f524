//! The simulator's YAML schema: one replica, or a fleet of them, with validation that names the
//! bad field (`replicas[1].block_size must be > 0`).

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::profile::StepProfile;

/// One simulated replica (a vLLM server with one engine).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReplicaConfig {
    /// Name reported in the `x-kvsim-replica` header and in logs. Default `replica`.
    pub name: String,
    /// Listen address; port 0 picks a free one. Default `127.0.0.1:0`.
    pub listen: SocketAddr,
    /// Served model names; the first is the one `/metrics` labels `model_name` with (as vLLM's
    /// `--served-model-name`). Default `[demo-model]`.
    pub models: Vec<String>,
    /// LoRA adapter names this replica serves (a request naming one is served with that adapter:
    /// its blocks are hashed apart from the base model's). Default none.
    pub adapters: Vec<String>,
    /// Step-time profile name, see [`StepProfile::builtin`]. Default `h100-llama3-8b`.
    pub profile: String,
    /// Tokens per KV block. Default 16 (vLLM's default on CUDA).
    pub block_size: u32,
    /// KV blocks on the GPU, including vLLM's reserved null block. Default: the profile's.
    pub num_gpu_blocks: Option<u32>,
    /// Most requests running at once (vLLM `--max-num-seqs`). Default: the profile's.
    pub max_num_seqs: Option<u32>,
    /// Token budget per engine step (vLLM `--max-num-batched-tokens`). Default: the profile's.
    pub max_num_batched_tokens: Option<u32>,
    /// Longest prompt + output in tokens (vLLM `--max-model-len`). Default: the KV capacity,
    /// capped at 32768.
    pub max_model_len: Option<u32>,
    /// Simulated time runs this many times faster than real time (durations are divided by
    /// it). Default 1.
    pub time_scale: f64,
    /// Seed of the block-hash chain (vLLM's `NONE_HASH`). Fixed by default so hashes are equal
    /// across runs and processes. Default 0.
    pub hash_seed: u64,
    /// KV-event publishing (vLLM `--kv-events-config`). Default off.
    pub kv_events: Option<KvEventsConfig>,
    /// A real tokenizer for this replica's prompts. Default: the word-piece fallback.
    pub tokenizer: Option<TokenizerPaths>,
    /// Output length of requests that give no `max_tokens`. Default fixed 16.
    pub output_length: OutputLength,
    /// A CPU offload tier (vLLM's `OffloadingConnector` with the CPU backend,
    /// [`crate::offload`]). Default none.
    pub cpu_offload: Option<CpuOffloadConfig>,
}

/// The CPU offload tier's size and speed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CpuOffloadConfig {
    /// Blocks (of `block_size` tokens) the tier holds (vLLM: `cpu_bytes_to_use` over the bytes
    /// of a block). Must be > 0. Default 100000.
    pub num_blocks: u32,
    /// Load bandwidth from CPU memory into the GPU, in GB/s (10^9 bytes) of simulated time.
    /// Must be > 0. Default 20 (PCIe 4.0 x16 as vLLM's DMA copies achieve).
    pub bandwidth_gb_per_s: f64,
    /// Fixed time a load adds, in simulated ms. Must be >= 0. Default 1.
    pub latency_ms: f64,
    /// Bytes of KV per token. Must be > 0. Default 131072 (Llama-3.1-8B in BF16, the built-in
    /// profiles' model).
    pub kv_bytes_per_token: u64,
    /// Send the full payload in the tier's `BlockStored` events (vLLM's
    /// `self_describing_kv_events`) instead of placeholders. Default false (vLLM's default).
    pub self_describing_events: bool,
}

impl Default for CpuOffloadConfig {
    fn default() -> Self {
        Self {
            num_blocks: 100_000,
            bandwidth_gb_per_s: 20.0,
            latency_ms: 1.0,
            kv_bytes_per_token: 131_072,
            self_describing_events: false,
        }
    }
}

impl CpuOffloadConfig {
    /// The engine's view: real-time durations at `time_scale`, blocks of `block_size`.
    pub fn engine(&self, block_size: u32, time_scale: f64) -> crate::offload::OffloadConfig {
        let block_bytes = u64::from(block_size) * self.kv_bytes_per_token;
        let real = |sim_s: f64| std::time::Duration::from_secs_f64(sim_s / time_scale);
        crate::offload::OffloadConfig {
            num_blocks: self.num_blocks,
            block_load: real(block_bytes as f64 / (self.bandwidth_gb_per_s * 1e9)),
            latency: real(self.latency_ms / 1e3),
            block_bytes,
            self_describing: self.self_describing_events,
        }
    }
}

impl Default for ReplicaConfig {
    fn default() -> Self {
        Self {
            name: "replica".into(),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            models: vec!["demo-model".into()],
            adapters: Vec::new(),
            profile: super::profile::DEFAULT_PROFILE.into(),
            block_size: 16,
            num_gpu_blocks: None,
            max_num_seqs: None,
            max_num_batched_tokens: None,
            max_model_len: None,
            time_scale: 1.0,
            hash_seed: 0,
            kv_events: None,
            tokenizer: None,
            output_length: OutputLength::default(),
            cpu_offload: None,
        }
    }
}

/// Where KV events go.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvEventsConfig {
    /// ZMQ endpoint. As in vLLM, the PUB socket binds when the endpoint has a wildcard host
    /// (`tcp://*:5557`, port 0 allowed) and connects otherwise (the subscriber binds). Default
    /// `tcp://*:5557`.
    pub endpoint: String,
    /// Topic frame of every message. Default empty (vLLM's default).
    pub topic: String,
    /// Bind `endpoint` even though its host is not a wildcard (e.g. `tcp://127.0.0.1:0`, so a
    /// test's publisher listens on loopback only). vLLM has no such switch. Default false.
    pub bind: bool,
    /// vLLM's `replay_endpoint`: a ROUTER socket bound here serves the last `buffer_steps`
    /// batches to a subscriber that asks (one that started late or reconnected). Bound as
    /// given (port 0 allowed). Default none.
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay (vLLM's `buffer_steps`). Default 10,000.
    pub buffer_steps: usize,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        Self {
            endpoint: "tcp://*:5557".into(),
            topic: String::new(),
            bind: false,
            replay_endpoint: None,
            buffer_steps: 10_000,
        }
    }
}

/// The files of a Hugging Face tokenizer (see [`crate::hf_tokenizer`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizerPaths {
    /// `tokenizer.json`.
    pub tokenizer_json: PathBuf,
    /// `tokenizer_config.json` (chat template, special tokens), if any.
    #[serde(default)]
    pub tokenizer_config: Option<PathBuf>,
    /// A separate `chat_template.jinja`, if any.
    #[serde(default)]
    pub chat_template: Option<PathBuf>,
}

impl TokenizerPaths {
    /// A `tokenizer.json` file, or a directory holding `tokenizer.json` and, when present,
    /// `tokenizer_config.json` and `chat_template.jinja`.
    pub fn from_path(path: &std::path::Path) -> TokenizerPaths {
        if path.is_dir() {
            let opt = |name: &str| Some(path.join(name)).filter(|p| p.exists());
            TokenizerPaths {
                tokenizer_json: path.join("tokenizer.json"),
                tokenizer_config: opt("tokenizer_config.json"),
                chat_template: opt("chat_template.jinja"),
            }
        } else {
            TokenizerPaths {
                tokenizer_json: path.to_path_buf(),
                tokenizer_config: None,
                chat_template: None,
            }
        }
    }
}

/// How many tokens a request without `max_tokens` generates.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, tag = "kind", rename_all = "snake_case")]
pub enum OutputLength {
    /// Always `tokens`.
    Fixed {
        /// Output tokens.
        tokens: u32,
    },
    /// Uniform in `[min, max]`, drawn from a generator seeded with `seed` (deterministic).
    Uniform {
        /// Fewest output tokens.
        min: u32,
        /// Most output tokens.
        max: u32,
        /// Generator seed. Default 0.
        #[serde(default)]
        seed: u64,
    },
}

impl Default for OutputLength {
    fn default() -> Self {
        OutputLength::Fixed { tokens: 16 }
    }
}

/// Several replicas, as a YAML fleet file lists them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FleetConfig {
    /// The replicas.
    pub replicas: Vec<ReplicaConfig>,
}

/// One invalid value: where it is and what is wrong with it; shown as
/// `replicas[0].block_size: must be in 1..=1024 (got 0)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// Path of the field, e.g. `replicas[1].kv_events.endpoint`.
    pub path: String,
    /// What is wrong with its value.
    pub message: String,
}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

impl std::error::Error for FieldError {}

/// Why a fleet file was not loaded.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Not valid YAML for the schema (the message names the field, e.g. an unknown one).
    #[error("{path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// What serde said, with the field path.
        message: String,
    },
    /// Parsed, but some values are invalid.
    #[error("{path}: {}", .errors.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Invalid {
        /// The file.
        path: String,
        /// Every invalid value.
        errors: Vec<FieldError>,
    },
}

impl FleetConfig {
    /// Reads, parses and validates a fleet file.
    pub fn load(path: &Path) -> Result<FleetConfig, FleetError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| FleetError::Read {
            path: shown.clone(),
            source,
        })?;
        Self::parse(&text, &shown)
    }

    /// Parses and validates YAML text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<FleetConfig, FleetError> {
        let de = serde_norway::Deserializer::from_str(text);
        let fleet: FleetConfig =
            serde_path_to_error::deserialize(de).map_err(|e| FleetError::Parse {
                path: origin.to_string(),
                message: e.inner().to_string(),
            })?;
        let errors = fleet.validate();
        if errors.is_empty() {
            Ok(fleet)
        } else {
            Err(FleetError::Invalid {
                path: origin.to_string(),
                errors,
            })
        }
    }

    /// Every invalid value; empty means the fleet can start.
    pub fn validate(&self) -> Vec<FieldError> {
        let mut errors = Vec::new();
        if self.replicas.is_empty() {
            errors.push(FieldError {
                path: "replicas".into(),
                message: "must list at least one replica".into(),
            });
        }
        let mut names = HashSet::new();
        for (i, replica) in self.replicas.iter().enumerate() {
            let prefix = format!("replicas[{i}]");
            if !names.insert(replica.name.as_str()) {
                errors.push(FieldError {
                    path: format!("{prefix}.name"),
                    message: format!("duplicate replica name {:?}", replica.name),
                });
            }
            errors.extend(replica.validate(&prefix));
        }
        errors
    }
}

/// Largest default `max_model_len`, in tokens.
const MAX_DEFAULT_MODEL_LEN: u32 = 32_768;

impl ReplicaConfig {
    /// Every invalid value, with paths under `prefix` (e.g. `replicas[0]`).
    pub fn validate(&self, prefix: &str) -> Vec<FieldError> {
        let mut errors = Vec::new();
        let mut push = |field: &str, message: String| {
            errors.push(FieldError {
                path: if prefix.is_empty() {
                    field.to_string()
                } else {
                    format!("{prefix}.{field}")
                },
                message,
            })
        };
        if self.name.is_empty() || http::HeaderValue::from_str(&self.name).is_err() {
            push(
                "name",
                format!("{:?} must be non-empty printable ASCII", self.name),
            );
        }
        if self.models.is_empty() {
            push("models", "must list at least one model".into());
        }
        let mut served = HashSet::new();
        for (i, model) in self.models.iter().enumerate() {
            if model.trim().is_empty() {
                push(&format!("models[{i}]"), "must not be empty".into());
            } else if !served.insert(model.as_str()) {
                push(&format!("models[{i}]"), format!("duplicate name {model:?}"));
            }
        }
        for (i, adapter) in self.adapters.iter().enumerate() {
            if adapter.trim().is_empty() {
                push(&format!("adapters[{i}]"), "must not be empty".into());
            } else if !served.insert(adapter.as_str()) {
                push(
                    &format!("adapters[{i}]"),
                    format!("{adapter:?} is already a model or adapter name"),
                );
            }
        }
        let profile = StepProfile::builtin(&self.profile);
        if profile.is_none() {
            push(
                "profile",
                format!(
                    "unknown profile {:?} (known: {})",
                    self.profile,
                    StepProfile::builtin_names().join(", ")
                ),
            );
        }
        if self.block_size == 0 || self.block_size > 1024 {
            push(
                "block_size",
                format!("must be in 1..=1024 (got {})", self.block_size),
            );
        }
        if self.num_gpu_blocks.is_some_and(|n| n < 2) {
            push(
                "num_gpu_blocks",
                "must be at least 2 (one is vLLM's null block)".into(),
            );
        }
        if self.max_num_seqs == Some(0) {
            push("max_num_seqs", "must be > 0".into());
        }
        if self.max_num_batched_tokens == Some(0) {
            push("max_num_batched_tokens", "must be > 0".into());
        }
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            push(
                "time_scale",
                format!("must be a finite number > 0 (got {})", self.time_scale),
            );
        }
        if let (Some(profile), true) = (profile, self.block_size > 0) {
            let capacity = self.capacity_tokens(&profile);
            match self.max_model_len {
                Some(0) => push("max_model_len", "must be > 0".into()),
                Some(len) if u64::from(len) > capacity => push(
                    "max_model_len",
                    format!(
                        "{len} tokens do not fit in the KV cache ({capacity} tokens: \
                         (num_gpu_blocks - 1) * block_size)"
                    ),
                ),
                _ => {}
            }
        }
        if let Some(kv) = &self.kv_events {
            if let Err(message) = super::publisher::parse_endpoint(&kv.endpoint, kv.bind) {
                push("kv_events.endpoint", message);
            }
            if let Some(replay) = &kv.replay_endpoint {
                if let Err(message) = super::publisher::parse_endpoint(replay, true) {
                    push("kv_events.replay_endpoint", message);
                }
            }
            if kv.buffer_steps == 0 {
                push("kv_events.buffer_steps", "must be > 0".into());
            }
        }
        if let Some(o) = &self.cpu_offload {
            if o.num_blocks == 0 {
                push("cpu_offload.num_blocks", "must be > 0".into());
            }
            if !(o.bandwidth_gb_per_s.is_finite() && o.bandwidth_gb_per_s > 0.0) {
                push(
                    "cpu_offload.bandwidth_gb_per_s",
                    format!("must be a finite number > 0 (got {})", o.bandwidth_gb_per_s),
                );
            }
            if !(o.latency_ms.is_finite() && o.latency_ms >= 0.0) {
                push(
                    "cpu_offload.latency_ms",
                    format!("must be a finite number >= 0 (got {})", o.latency_ms),
                );
            }
            if o.kv_bytes_per_token == 0 {
                push("cpu_offload.kv_bytes_per_token", "must be > 0".into());
            }
        }
        match &self.output_length {
            OutputLength::Fixed { tokens: 0 } => push("output_length.tokens", "must be > 0".into()),
            OutputLength::Uniform { min, max, .. } if *min == 0 || min > max => push(
                "output_length",
                format!("needs 0 < min <= max (got min {min}, max {max})"),
            ),
            _ => {}
        }
        errors
    }

    /// Tokens the KV cache holds: `(num_gpu_blocks - 1) * block_size` (one block is vLLM's
    /// null block).
    pub fn capacity_tokens(&self, profile: &StepProfile) -> u64 {
        let blocks = self.num_gpu_blocks.unwrap_or(profile.num_gpu_blocks);
        u64::from(blocks.saturating_sub(1)) * u64::from(self.block_size)
    }

    /// `max_model_len`, or its default: the KV capacity capped at 32768.
    pub fn effective_max_model_len(&self, profile: &StepProfile) -> u32 {
        self.max_model_len.unwrap_or_else(|| {
            self.capacity_tokens(profile)
                .min(u64::from(MAX_DEFAULT_MODEL_LEN)) as u32
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errors_of(yaml: &str) -> String {
        match FleetConfig::parse(yaml, "f.yaml") {
            Ok(_) => String::new(),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn table_of_invalid_fleets_names_the_field() {
        let cases = [
            ("replicas: []", "replicas: must list"),
            ("replicas: [{name: a, bogus: 1}]", "unknown field `bogus`"),
            (
                "replicas: [{name: a, block_size: 0}]",
                "replicas[0].block_size",
            ),
            (
                "replicas: [{name: a}, {name: a}]",
                "replicas[1].name: duplicate",
            ),
            (
                "replicas: [{name: a, profile: tpu}]",
                "replicas[0].profile: unknown profile",
            ),
            (
                "replicas: [{name: a, time_scale: 0}]",
                "replicas[0].time_scale",
            ),
            (
                "replicas: [{name: a, num_gpu_blocks: 10, block_size: 16, max_model_len: 1000}]",
                "replicas[0].max_model_len",
            ),
            (
                "replicas: [{name: a, models: [m], adapters: [m]}]",
                "replicas[0].adapters[0]",
            ),
            (
                "replicas: [{name: a, kv_events: {endpoint: 'udp://x:1'}}]",
                "replicas[0].kv_events.endpoint",
            ),
            (
                "replicas: [{name: a, output_length: {kind: uniform, min: 5, max: 2}}]",
                "replicas[0].output_length",
            ),
            (
                "replicas: [{name: a, output_length: {kind: fixed, tokens: 3, x: 1}}]",
                "unknown field `x`",
            ),
            (
                "replicas: [{name: a, cpu_offload: {bandwidth_gb_per_s: 0}}]",
                "replicas[0].cpu_offload.bandwidth_gb_per_s: must be a finite number > 0 (got 0)",
            ),
            (
                "replicas: [{name: a, cpu_offload: {num_blocks: 0, latency_ms: -2}}]",
                "replicas[0].cpu_offload.num_blocks: must be > 0; replicas[0].cpu_offload.latency_ms",
            ),
        ];
        for (yaml, expected) in cases {
            let got = errors_of(yaml);
            assert!(got.contains(expected), "{yaml}: {got:?} lacks {expected:?}");
        }
    }

    #[test]
    fn a_full_replica_parses() {
        let yaml = r#"
replicas:
  - name: r1
    listen: 127.0.0.1:0
    models: [llama]
    adapters: [sql-lora]
    profile: a100-llama3-8b
    block_size: 16
    num_gpu_blocks: 1000
    max_num_seqs: 8
    max_num_batched_tokens: 512
    time_scale: 10
    kv_events: {endpoint: "tcp://*:0", topic: kv}
    output_length: {kind: uniform, min: 4, max: 8, seed: 3}
    cpu_offload: {num_blocks: 5000, bandwidth_gb_per_s: 10}
"#;
        let fleet = FleetConfig::parse(yaml, "f").unwrap();
        let r = &fleet.replicas[0];
        assert_eq!(r.adapters, vec!["sql-lora".to_string()]);
        assert_eq!(r.num_gpu_blocks, Some(1000));
        assert_eq!(
            r.output_length,
            OutputLength::Uniform {
                min: 4,
                max: 8,
                seed: 3
            }
        );
        let profile = StepProfile::builtin(&r.profile).unwrap();
        assert_eq!(r.capacity_tokens(&profile), 999 * 16);
        // 16 tokens of 128 KiB at 10 GB/s: 0.21 ms simulated, 21 us real at time scale 10.
        let o = r
            .cpu_offload
            .as_ref()
            .unwrap()
            .engine(r.block_size, r.time_scale);
        assert_eq!((o.num_blocks, o.block_bytes), (5000, 16 << 17));
        assert_eq!(o.block_load.as_micros(), 20);
        assert_eq!(o.latency, std::time::Duration::from_micros(100));
        assert_eq!(r.effective_max_model_len(&profile), 999 * 16);
    }
}
