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
