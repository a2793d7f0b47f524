//! Command-line interface: `kvrouter serve`, `check-config`, `envoy-config`, `explain`. The
//! serve command's arguments and wiring live in [`crate::serve`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::config::Config;
use crate::serve::ServeArgs;

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
    /// Validate a config file and print a summary; exit status 1 if it is invalid. The endpoint
    /// picker's flags (`--pool-name`, ...) are applied first, as `serve` applies them.
    CheckConfig {
        /// The YAML config file.
        file: PathBuf,
        /// The reference endpoint picker's flags.
        #[command(flatten)]
        picker: crate::serve::picker::PickerFlags,
    },
    /// Print an Envoy 1.40 bootstrap config that attaches kvrouter (see docs/envoy.md).
    EnvoyConfig(EnvoyArgs),
    /// Show how a request would be routed: candidates, matched tokens, load, predicted TTFT and
    /// score per endpoint, and the pick. Never prints the prompt.
    Explain(ExplainArgs),
}

/// Arguments of `kvrouter explain`.
#[derive(Debug, clap::Args)]
pub struct ExplainArgs {
    /// A config file: explain against it with empty tables (no load, nothing cached).
    #[arg(long, conflicts_with = "admin", required_unless_present = "admin")]
    pub config: Option<PathBuf>,
    /// A running router's admin URL (e.g. http://127.0.0.1:9090): explain against its live
    /// tables, over its gRPC API (`kvrouter.v1.Admin/Explain`).
    #[arg(long)]
    pub admin: Option<String>,
    /// A file holding the router's admin bearer token (its `admin.auth_token_file`), for
    /// `--admin`.
    #[arg(long, env = "KVROUTER_ADMIN_TOKEN_FILE", requires = "admin")]
    pub admin_token_file: Option<PathBuf>,
    /// The request body (OpenAI JSON).
    #[arg(long)]
    pub body: PathBuf,
    /// The request path.
    #[arg(long, default_value = "/v1/chat/completions")]
    pub path: String,
    /// The tenant, as the tenancy header would carry it.
    #[arg(long)]
    pub tenant: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
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
    /// kvrouter's ext_proc gRPC address: host:port, or unix:PATH for kvrouter's
    /// `server.grpc_unix_socket` (Envoy and kvrouter on one host or in one pod).
    #[arg(long, default_value = "127.0.0.1:9002")]
    pub extproc: crate::envoyconf::ExtprocAddress,
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
    /// no first-byte times and gets no passive health signal from responses (see docs/envoy.md).
    #[arg(long)]
    pub no_observer: bool,
    /// The tenancy header kvrouter trusts (tenancy.header): removed from every client request,
    /// so only Envoy can set it (see --jwt-issuer).
    #[arg(long)]
    pub tenant_header: Option<String>,
    /// Verify JWTs from this issuer (Envoy's jwt_authn) and copy the tenant claim into
    /// --tenant-header. Needs --tenant-header and --jwt-jwks-file.
    #[arg(long, requires_all = ["tenant_header", "jwt_jwks_file"])]
    pub jwt_issuer: Option<String>,
    /// The local JWKS file Envoy verifies tokens with.
    #[arg(long, requires = "jwt_issuer")]
    pub jwt_jwks_file: Option<PathBuf>,
    /// The JWT claim holding the tenant id.
    #[arg(long, default_value = "tenant")]
    pub jwt_tenant_claim: String,
    /// An accepted `aud` (repeat for several; none: any).
    #[arg(long, requires = "jwt_issuer")]
    pub jwt_audience: Vec<String>,
    /// Reject requests without a token (else they pass with no tenant).
    #[arg(long, requires = "jwt_issuer")]
    pub jwt_required: bool,
    /// The picker's ext_proc message timeout, in ms; with flow control on, give
    /// `flow_control.max_wait_ms` + 1000 so a queued request keeps its place.
    #[arg(long, default_value_t = 2000)]
    pub message_timeout_ms: u64,
}

/// Runs the parsed command line.
pub fn run(cli: Cli) -> ExitCode {
    match cli.command {
        Command::CheckConfig { file, picker } => check_config(&file, &picker),
        Command::Explain(a) => explain(a),
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
                jwt: a
                    .jwt_issuer
                    .zip(a.jwt_jwks_file)
                    .map(|(issuer, jwks_file)| crate::envoyconf::JwtOptions {
                        issuer,
                        audiences: a.jwt_audience,
                        jwks_file,
                        tenant_claim: a.jwt_tenant_claim,
                        required: a.jwt_required,
                    }),
                tenant_header: a.tenant_header,
                message_timeout_ms: a.message_timeout_ms,
            };
            print!("{}", crate::envoyconf::render(&options));
            ExitCode::SUCCESS
        }
        Command::Serve(args) => {
            // Every thread of the runtime (async workers, the blocking pool that tokenizes)
            // asks for the short slice as it starts (`sched`).
            crate::sched::set_slice_us(args.sched_slice_us);
            let runtime = match tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .on_thread_start(|| {
                    crate::sched::request_thread();
                })
                .build()
            {
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

fn explain(a: ExplainArgs) -> ExitCode {
    let body = match std::fs::read(&a.body) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("kvrouter: cannot read {}: {e}", a.body.display());
            return ExitCode::from(1);
        }
    };
    let result = match (&a.config, &a.admin) {
        (Some(config), _) => explain_offline(config, &body, &a),
        (None, Some(admin)) => explain_live(admin, body, &a),
        (None, None) => Err("give --config or --admin".to_string()),
    };
    match result {
        Ok(e) if a.json => {
            println!("{}", serde_json::to_string_pretty(&e).unwrap_or_default());
            ExitCode::SUCCESS
        }
        Ok(e) => {
            print!("{}", explanation_text(&e));
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("kvrouter: {message}");
            ExitCode::from(1)
        }
    }
}

fn explain_offline(
    config_path: &std::path::Path,
    body: &[u8],
    a: &ExplainArgs,
) -> Result<serde_json::Value, String> {
    let config = Config::load(config_path).map_err(|e| e.to_string())?;
    let base = config_path.parent().unwrap_or(std::path::Path::new("."));
    let router = crate::router::Router::new(
        config,
        std::sync::Arc::new(crate::telemetry::Metrics::new()),
        base,
    )
    .map_err(|e| e.to_string())?;
    let api = crate::request::ApiKind::from_path(&a.path);
    let parsed = crate::request::parse(api, body).map_err(|e| format!("bad request: {e}"))?;
    let ctx = crate::router::RouteContext {
        tenant: a.tenant.as_deref(),
        ..Default::default()
    };
    let plan = router
        .plan(&router.snapshot(), &parsed, ctx)
        .map_err(|e| e.to_string())?;
    serde_json::to_value(plan.explain()).map_err(|e| e.to_string())
}

fn explain_live(admin: &str, body: Vec<u8>, a: &ExplainArgs) -> Result<serde_json::Value, String> {
    let token = match &a.admin_token_file {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read {}: {e}", path.display()))?
                .trim()
                .to_string(),
        ),
        None => None,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let explanation = runtime.block_on(crate::api::client::explain(
        admin,
        token.as_deref(),
        body,
        &a.path,
        a.tenant.as_deref(),
    ))?;
    serde_json::to_value(explanation).map_err(|e| e.to_string())
}

/// The table form of an explanation's JSON.
fn explanation_text(v: &serde_json::Value) -> String {
    match serde_json::from_value::<crate::router::Explanation>(v.clone()) {
        Ok(e) => e.to_text(),
        Err(_) => v.to_string(),
    }
}

fn check_config(file: &std::path::Path, picker: &crate::serve::picker::PickerFlags) -> ExitCode {
    let loaded = std::fs::read_to_string(file)
        .map_err(|e| format!("cannot read {}: {e}", file.display()))
        .and_then(|text| {
            Config::parse_adjust_validate(&text, &file.display().to_string(), |c| picker.apply(c))
                .map_err(|e| e.to_string())
        })
        .and_then(|config| {
            // Tokenizer files named by the config must load too (errors name the field).
            let base = file.parent().unwrap_or(std::path::Path::new("."));
            crate::prefix::TokenizerRegistry::from_config(&config.models, base)
                .map(|_| config)
                .map_err(|e| format!("{}: {e}", file.display()))
        });
    match loaded {
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
            for pool in &config.pools {
                if let Some(k) = &pool.kubernetes {
                    let pods = match (&k.inference_pool, &k.label_selector) {
                        (Some(p), _) => format!("the pods of InferencePool {p}"),
                        (None, Some(s)) => {
                            format!("the pods matching {s:?} on port {}", k.port.unwrap_or(0))
                        }
                        _ => "nothing".into(),
                    };
                    println!(
                        "pool {}: {pods} in namespace {}, models: {}",
                        pool.name,
                        k.namespace.as_deref().unwrap_or("(the pod's own)"),
                        pool.models.join(", ")
                    );
                }
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(1)
        }
    }
}
