//! One replica's state: its engine task, its KV-event publisher, its tokenizer, metrics and
//! faults. The HTTP side ([`crate::http`], with the handlers of [`crate::server`] and
//! [`crate::admin`]) is built over it; nothing here knows about routes.

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use ahash::AHashMap;
use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};

use super::config::{FieldError, OutputLength, ReplicaConfig};
use super::driver::{self, AdminCommand, Command, EngineState};
use super::engine::{Engine, EngineConfig, Lora};
use super::faults::Faults;
use super::hf_tokenizer::{HfTokenizer, LoadError};
use super::metrics::{MetricsInfo, SimMetrics};
use super::profile::StepProfile;
use super::publisher::{self, PublisherError};
use super::tokenize::{PromptTokenizer, WordPieceTokenizer};

/// Why a replica did not start.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// Invalid configuration.
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Config(Vec<FieldError>),
    /// The tokenizer could not be loaded.
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] LoadError),
    /// The KV-event publisher did not start.
    #[error(transparent)]
    Publisher(#[from] PublisherError),
    /// The HTTP listener could not bind.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// The error.
        source: std::io::Error,
    },
}

/// A running replica's shared state (engine handle, metrics, faults).
pub struct Replica {
    pub(super) config: ReplicaConfig,
    pub(super) engine_cfg: EngineConfig,
    pub(super) tx: mpsc::UnboundedSender<Command>,
    pub(super) metrics: Arc<SimMetrics>,
    pub(super) info: MetricsInfo,
    pub(super) tokenizer: Arc<dyn PromptTokenizer>,
    pub(super) loras: AHashMap<String, Lora>,
    pub(super) faults: Mutex<Faults>,
    pub(super) request_count: AtomicU64,
    pub(super) started_unix_s: u64,
    kv_events_endpoint: Option<String>,
    kv_events_replay: Option<String>,
}

impl std::fmt::Debug for Replica {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replica")
            .field("name", &self.config.name)
            .field("engine", &self.engine_cfg)
            .finish_non_exhaustive()
    }
}

impl Replica {
    /// Validates `config`, loads its tokenizer (the word-piece fallback when it names none),
    /// starts the engine task (and the KV-event publisher when configured). The engine stops
    /// when the last clone of the returned `Arc` is dropped.
    pub async fn start(config: ReplicaConfig) -> Result<Arc<Replica>, SimError> {
        let errors = config.validate("");
        if !errors.is_empty() {
            return Err(SimError::Config(errors));
        }
        let profile = StepProfile::builtin(&config.profile).ok_or_else(|| {
            SimError::Config(vec![FieldError {
                path: "profile".into(),
                message: format!("unknown profile {:?}", config.profile),
            }])
        })?;
        let tokenizer: Arc<dyn PromptTokenizer> = match &config.tokenizer {
            Some(paths) => Arc::new(HfTokenizer::load(paths)?),
            None => Arc::new(WordPieceTokenizer::default()),
        };
        let publisher = match &config.kv_events {
            Some(kv) => Some(publisher::start(kv).await?),
            None => None,
        };
        let engine_cfg = EngineConfig {
            block_size: config.block_size,
            num_gpu_blocks: config.num_gpu_blocks.unwrap_or(profile.num_gpu_blocks),
            max_num_seqs: config.max_num_seqs.unwrap_or(profile.max_num_seqs),
            max_num_batched_tokens: config
                .max_num_batched_tokens
                .unwrap_or(profile.max_num_batched_tokens),
            max_model_len: config.effective_max_model_len(&profile),
            hash_seed: config.hash_seed,
            record_events: publisher.is_some(),
            track_loras: !config.adapters.is_empty(),
            offload: config
                .cpu_offload
                .as_ref()
                .map(|o| o.engine(config.block_size, config.time_scale)),
        };
        let metrics = Arc::new(SimMetrics::default());
        let engine = Engine::new(engine_cfg, Arc::clone(&tokenizer), Arc::clone(&metrics));
        let (tx, rx) = mpsc::unbounded_channel();
        let kv_events_endpoint = publisher.as_ref().map(|p| p.endpoint.clone());
        let kv_events_replay = publisher.as_ref().and_then(|p| p.replay.clone());
        tokio::spawn(driver::run(
            engine,
            profile,
            config.time_scale,
            rx,
            publisher.map(|p| p.tx),
            Arc::clone(&metrics),
        ));
        let loras = config
            .adapters
            .iter()
            .enumerate()
            .map(|(i, name)| {
                (
                    name.clone(),
                    Lora {
                        name: name.as_str().into(),
                        id: i as u32 + 1,
                    },
                )
            })
            .collect();
        let info = MetricsInfo {
            model_name: config.models[0].clone(),
            block_size: engine_cfg.block_size,
            num_gpu_blocks: engine_cfg.num_gpu_blocks,
            max_loras: config.adapters.len(),
            offload_bytes: engine_cfg
                .offload
                .map(|o| u64::from(o.num_blocks) * o.block_bytes),
        };
        let started_unix_s = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Ok(Arc::new(Replica {
            config,
            engine_cfg,
            tx,
            metrics,
            info,
            tokenizer,
            loras,
            faults: Mutex::new(Faults::default()),
            request_count: AtomicU64::new(0),
            started_unix_s,
            kv_events_endpoint,
            kv_events_replay,
        }))
    }

    /// The replica's name.
    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// The endpoint a KV-event subscriber uses, when publishing.
    pub fn kv_events_endpoint(&self) -> Option<&str> {
        self.kv_events_endpoint.as_deref()
    }

    /// Where its replay socket listens (`tcp://127.0.0.1:PORT`), when it has one.
    pub fn kv_events_replay(&self) -> Option<&str> {
        self.kv_events_replay.as_deref()
    }

    /// The engine's sizes and limits (profile defaults resolved).
    pub fn engine_config(&self) -> &EngineConfig {
        &self.engine_cfg
    }

    /// The replica's metrics.
    pub fn metrics(&self) -> &SimMetrics {
        &self.metrics
    }

    /// Sends an admin command to the engine; `None` if the engine task is gone.
    pub async fn admin(&self, cmd: AdminCommand) -> Option<EngineState> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Command::Admin(cmd, reply)).ok()?;
        rx.await.ok()
    }

    /// Output tokens for a request without `max_tokens` (deterministic in arrival order).
    pub(super) fn default_output_tokens(&self, request_number: u64) -> u32 {
        match self.config.output_length {
            OutputLength::Fixed { tokens } => tokens,
            OutputLength::Uniform { min, max, seed } => {
                let span = u64::from(max - min) + 1;
                min + (splitmix64(seed ^ request_number) % span) as u32
            }
        }
    }
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}
