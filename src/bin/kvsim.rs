//! `kvsim`: simulated vLLM replicas. One replica from flags, or a fleet from a YAML file.
//! Prints one JSON line per replica on stdout once it listens:
//! `{"event":"listening","name":"r1","addr":"127.0.0.1:8001"}`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use kvrouter::sim::{server, FleetConfig, ReplicaConfig};

/// Simulated vLLM-compatible model replicas.
#[derive(Debug, Parser)]
#[command(name = "kvsim", version, about)]
struct Args {
    /// A YAML fleet file (`replicas: [...]`); the other flags are ignored when given.
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
}

fn main() -> ExitCode {
    let args = Args::parse();
    kvrouter::telemetry::init_logging(kvrouter::config::LogFormat::Text);
    let fleet = match &args.fleet {
        Some(path) => {
            let text = match std::fs::read_to_string(path) {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("kvsim: cannot read {}: {e}", path.display());
                    return ExitCode::from(1);
                }
            };
            match serde_norway::from_str::<FleetConfig>(&text) {
                Ok(f) if !f.replicas.is_empty() => f,
                Ok(_) => {
                    eprintln!("kvsim: {}: replicas: no replicas listed", path.display());
                    return ExitCode::from(1);
                }
                Err(e) => {
                    eprintln!("kvsim: {}: {e}", path.display());
                    return ExitCode::from(1);
                }
            }
        }
        None => FleetConfig {
            replicas: vec![ReplicaConfig {
                name: args.name.clone(),
                listen: args.listen,
                models: args.models.clone(),
                ..ReplicaConfig::default()
            }],
        },
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvsim: {e}");
            return ExitCode::from(1);
        }
    };
    runtime.block_on(async move {
        let mut tasks = Vec::new();
        for replica in fleet.replicas {
            let name = replica.name.clone();
            match server::run(replica).await {
                Ok((addr, task)) => {
                    println!(r#"{{"event":"listening","name":"{name}","addr":"{addr}"}}"#);
                    tasks.push(task);
                }
                Err(e) => {
                    eprintln!("kvsim: replica {name}: cannot listen: {e}");
                    return ExitCode::from(1);
                }
            }
        }
        let _ = tokio::signal::ctrl_c().await;
        ExitCode::SUCCESS
    })
}
