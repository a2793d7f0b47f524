//! Command-line interface: `kvrouter serve`, `kvrouter check-config`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::config::Config;

/// Cache-aware request router for LLM inference, as an Envoy external processor.
#[derive(Debug, Parser)]
#[command(name = "kvrouter", version, about, long_about = None)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the ext_proc gRPC server and the admin HTTP server.
    Serve(ServeArgs),
    /// Validate a config file and print a summary; exit status 1 if it is invalid.
    CheckConfig {
        /// The YAML config file.
        file: PathBuf,
    },
    /// Print an Envoy 1.40 bootstrap config that attaches kvrouter (see docs/envoy.md).
    EnvoyConfig(EnvoyArgs),
}

/// Arguments of `kvrouter envoy-config`.
#[derive(Debug, clap::Args)]
pub struct EnvoyArgs {
    /// Envoy's client-facing listener.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Envoy's admin address.
    #[arg(long, default_value = "127.0.0.1:9901")]
    pub admin: SocketAddr,
    /// kvrouter's ext_proc gRPC address.
    #[arg(long, default_value = "127.0.0.1:9002")]
    pub extproc: SocketAddr,
    /// A replica address for a static replica cluster (repeatable). Ignored with --eds.
    #[arg(long = "replica", default_values_t = ["127.0.0.1:8001".parse::<SocketAddr>().unwrap(), "127.0.0.1:8002".parse().unwrap(), "127.0.0.1:8003".parse().unwrap(), "127.0.0.1:8004".parse().unwrap()])]
    pub replicas: Vec<SocketAddr>,
    /// Read replicas from this EDS file, which kvrouter keeps current (`envoy.eds_path`).
    #[arg(long)]
    pub eds: Option<PathBuf>,
    /// How the picked replica is reached.
    #[arg(long, value_enum, default_value = "override-host")]
    pub cluster: crate::envoyconf::ClusterStyle,
    /// How Envoy hands the request body to kvrouter.
    #[arg(long, value_enum, default_value = "buffered")]
    pub body_mode: crate::envoyconf::BodyMode,
    /// The destination header (routing.destination_header).
    #[arg(long, default_value = "x-gateway-destination-endpoint")]
    pub destination_header: String,
    /// Largest request body, in bytes (match routing.max_body_bytes).
    #[arg(long, default_value_t = 32 << 20)]
    pub max_body_bytes: u64,
    /// Render Envoy alone (no kvrouter filters, plain least-request): the overhead baseline.
    #[arg(long)]
    pub without_kvrouter: bool,
    /// Leave out the response observer filter: less Envoy CPU per request, but kvrouter learns
    /// no first-byte times or usage from responses (see docs/envoy.md).
    #[arg(long)]
    pub no_observer: bool,
}

/// Arguments of `kvrouter serve`.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// The YAML config file (hot-reloaded on change).
    #[arg(long, short, env = "KVROUTER_CONFIG")]
    pub config: PathBuf,
    /// Overrides `server.grpc_listen` (use port 0 for any free port; the bound address is
    /// printed on stdout).
    #[arg(long)]
    pub grpc_listen: Option<SocketAddr>,
    /// Overrides `server.admin_listen`.
    #[arg(long)]
    pub admin_listen: Option<SocketAddr>,
}

/// Runs the parsed command line.
pub fn run(cli: Cli) -> ExitCode {
    match cli.command {
        Command::CheckConfig { file } => check_config(&file),
        Command::EnvoyConfig(a) => {
            let options = crate::envoyconf::EnvoyOptions {
                listen: a.listen,
                admin: a.admin,
                extproc: a.extproc,
                replicas: match a.eds {
                    Some(path) => crate::envoyconf::Replicas::EdsFile(path),
                    None => crate::envoyconf::Replicas::Static(a.replicas),
                },
                cluster: a.cluster,
                body_mode: a.body_mode,
                destination_header: a.destination_header,
                max_body_bytes: a.max_body_bytes,
                attach: !a.without_kvrouter,
                observe: !a.no_observer,
            };
            print!("{}", crate::envoyconf::render(&options));
            ExitCode::SUCCESS
        }
        Command::Serve(args) => {
            let runtime = match tokio::runtime::Runtime::new() {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("kvrouter: cannot start the async runtime: {e}");
                    return ExitCode::from(1);
                }
            };
            match runtime.block_on(crate::serve::serve(args)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("kvrouter: {e:#}");
                    ExitCode::from(1)
                }
            }
        }
    }
}

fn check_config(file: &std::path::Path) -> ExitCode {
    match Config::load(file) {
        Ok(config) => {
            let endpoints = config.resolved_endpoints();
            let mut models: Vec<&str> = endpoints
                .iter()
                .flat_map(|e| e.models.iter().chain(&e.adapters).map(String::as_str))
                .collect();
            models.sort_unstable();
            models.dedup();
            println!(
                "{}: ok ({} endpoints in {} pools; models: {}; policy: {})",
                file.display(),
                endpoints.len(),
                config.pools.len(),
                models.join(", "),
                config.policy.name.as_str()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(1)
        }
    }
}
