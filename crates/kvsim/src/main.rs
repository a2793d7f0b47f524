//! `kvsim`: simulated vLLM replicas. One replica from flags, or a fleet from a YAML file.
//! Prints one JSON line per replica on stdout once it listens:
//! `{"event":"listening","name":"r1","addr":"127.0.0.1:8001","kv_events":"tcp://127.0.0.1:5557"}`
//! (`kv_events` only when publishing). Logs go to stderr. Exits cleanly on SIGINT and SIGTERM.

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use kvsim::config::TokenizerPaths;
use kvsim::{CpuOffloadConfig, Fleet, FleetConfig, KvEventsConfig, ReplicaConfig};

/// Simulated vLLM-compatible model replicas.
#[derive(Debug, Parser)]
#[command(
    name = "kvsim",
    version,
    about = "Simulated vLLM-compatible model replicas (KV cache, continuous batching, metrics, KV events)."
)]
struct Args {
    /// A YAML fleet file (`replicas: [...]`); the single-replica flags are ignored when given.
    #[arg(long)]
    fleet: Option<PathBuf>,
    /// Replica name (response header `x-kvsim-replica`).
    #[arg(long, default_value = "replica")]
    name: String,
    /// Listen address (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Served model name (repeatable).
    #[arg(long = "model", default_values_t = vec!["demo-model".to_string()])]
    models: Vec<String>,
    /// LoRA adapter name (repeatable).
    #[arg(long = "adapter")]
    adapters: Vec<String>,
    /// Step-time profile (h100-llama3-8b, a100-llama3-8b, l4-llama3-8b, a10g-llama3-8b).
    #[arg(long, default_value = "h100-llama3-8b")]
    profile: String,
    /// Simulated time runs this many times faster than real time.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// KV blocks (default: the profile's).
    #[arg(long)]
    num_gpu_blocks: Option<u32>,
    /// Most running requests (default: the profile's).
    #[arg(long)]
    max_num_seqs: Option<u32>,
    /// Token budget per step (default: the profile's).
    #[arg(long)]
    max_num_batched_tokens: Option<u32>,
    /// Longest prompt plus output accepted, in tokens (default: the config's default).
    #[arg(long)]
    max_model_len: Option<u32>,
    /// Publish KV events on this ZMQ endpoint (`tcp://*:PORT` binds, `tcp://HOST:PORT` connects).
    #[arg(long)]
    kv_events: Option<String>,
    /// Topic frame of KV-event messages.
    #[arg(long, default_value = "")]
    kv_topic: String,
    /// Bind the `--kv-events` endpoint even when its host is not a wildcard (e.g.
    /// `tcp://127.0.0.1:0`: a publisher that listens on loopback only).
    #[arg(long)]
    kv_events_bind: bool,
    /// Serve the last batches on a replay socket bound here (vLLM's `replay_endpoint`, e.g.
    /// `tcp://*:5558` or `tcp://127.0.0.1:0`).
    #[arg(long)]
    kv_events_replay: Option<String>,
    /// A CPU offload tier of this many blocks (vLLM's `OffloadingConnector`). Default none.
    #[arg(long)]
    cpu_offload_blocks: Option<u32>,
    /// The CPU tier's load bandwidth into the GPU, GB/s of simulated time.
    #[arg(long, default_value_t = 20.0)]
    cpu_offload_gb_per_s: f64,
    /// Fixed time a load from the CPU tier adds, simulated ms.
    #[arg(long, default_value_t = 1.0)]
    cpu_offload_latency_ms: f64,
    /// KV bytes per token (for the CPU tier's transfer times).
    #[arg(long, default_value_t = 131_072)]
    kv_bytes_per_token: u64,
    /// The CPU tier's `BlockStored` events carry the full payload (vLLM's
    /// `self_describing_kv_events`) instead of placeholders.
    #[arg(long)]
    self_describing_kv_events: bool,
    /// A Hugging Face tokenizer: a `tokenizer.json`, or a directory holding it and (optionally)
    /// `tokenizer_config.json` with the chat template. Default: the word-piece fallback.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
}

impl Args {
    fn fleet(&self) -> Result<FleetConfig, String> {
        if let Some(path) = &self.fleet {
            return FleetConfig::load(path).map_err(|e| e.to_string());
        }
        Ok(FleetConfig {
            replicas: vec![ReplicaConfig {
                name: self.name.clone(),
                listen: self.listen,
                models: self.models.clone(),
                adapters: self.adapters.clone(),
                profile: self.profile.clone(),
                time_scale: self.time_scale,
                block_size: self.block_size,
                num_gpu_blocks: self.num_gpu_blocks,
                max_num_seqs: self.max_num_seqs,
                max_num_batched_tokens: self.max_num_batched_tokens,
                max_model_len: self.max_model_len,
                kv_events: self.kv_events.as_ref().map(|endpoint| KvEventsConfig {
                    endpoint: endpoint.clone(),
                    topic: self.kv_topic.clone(),
                    bind: self.kv_events_bind,
                    replay_endpoint: self.kv_events_replay.clone(),
                    ..KvEventsConfig::default()
                }),
                tokenizer: self.tokenizer.as_deref().map(TokenizerPaths::from_path),
                cpu_offload: self.cpu_offload_blocks.map(|num_blocks| CpuOffloadConfig {
                    num_blocks,
                    bandwidth_gb_per_s: self.cpu_offload_gb_per_s,
                    latency_ms: self.cpu_offload_latency_ms,
                    kv_bytes_per_token: self.kv_bytes_per_token,
                    self_describing_events: self.self_describing_kv_events,
                }),
                ..ReplicaConfig::default()
            }],
        })
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    kvsim::logging::init_logging();
    let fleet = match args.fleet() {
        Ok(f) => f,
        Err(e) => {
            eprintln!("kvsim: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvsim: {e}");
            return ExitCode::from(1);
        }
    };
    runtime.block_on(async move {
        // Handlers first: a harness may signal as soon as it reads the listening lines, and a
        // signal that arrives before them kills the process instead of stopping it cleanly.
        let signals = match Signals::install() {
            Ok(s) => s,
            Err(e) => {
                eprintln!("kvsim: cannot install signal handlers: {e}");
                return ExitCode::from(1);
            }
        };
        let fleet = match Fleet::start(fleet).await {
            Ok(f) => f,
            Err((name, e)) => {
                eprintln!("kvsim: replica {name}: {e}");
                return ExitCode::from(1);
            }
        };
        {
            let mut out = std::io::stdout().lock();
            for r in &fleet.replicas {
                let _ = writeln!(out, "{}", r.listening_line());
            }
            let _ = out.flush();
        }
        let signal = signals.wait().await;
        tracing::info!("kvsim: {signal}, shutting down");
        // Open streams get a moment to finish; then the process exits regardless.
        let _ = tokio::time::timeout(Duration::from_secs(5), fleet.shutdown()).await;
        ExitCode::SUCCESS
    })
}

/// SIGINT and SIGTERM, listened for from creation on.
#[cfg(unix)]
struct Signals {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
}

#[cfg(unix)]
impl Signals {
    fn install() -> std::io::Result<Signals> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals {
            interrupt: signal(SignalKind::interrupt())?,
            terminate: signal(SignalKind::terminate())?,
        })
    }

    async fn wait(mut self) -> &'static str {
        tokio::select! {
            _ = self.interrupt.recv() => "SIGINT",
            _ = self.terminate.recv() => "SIGTERM",
        }
    }
}

/// Ctrl-C where Unix signals do not exist.
#[cfg(not(unix))]
struct Signals;

#[cfg(not(unix))]
impl Signals {
    fn install() -> std::io::Result<Signals> {
        Ok(Signals)
    }

    async fn wait(self) -> &'static str {
        let _ = tokio::signal::ctrl_c().await;
        "SIGINT"
    }
}
