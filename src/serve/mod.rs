//! `kvrouter serve`: wires config, router, the ext_proc, health and admin servers, hot reload,
//! endpoint discovery, the scrape and probe monitor, and shutdown together.
//!
//! The router is built once, with its tables; every other part gets only the narrow handle it
//! needs from [`Router::handles`] (the ext_proc server gets the router itself: it decides).
//! [`picker`] maps the reference endpoint picker's flags onto the config; [`health`] is the gRPC
//! health service.

pub mod health;
pub mod picker;
#[cfg(unix)]
pub mod unix;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::admin::Admin;
use crate::config::{self, Config};
use crate::discovery::dns::{DnsDiscovery, Resolve, SystemResolver};
use crate::discovery::kubernetes::KubernetesDiscovery;
use crate::discovery::{Discovery, Published, Runner};
use crate::extproc::{ExtProc, ServerExtras};
use crate::monitor::{self, EndpointSource};
use crate::router::Router;
use crate::telemetry::Metrics;

/// Arguments of `kvrouter serve`.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// The YAML config file (hot-reloaded on change).
    #[arg(long, short, env = "KVROUTER_CONFIG")]
    pub config: PathBuf,
    /// Overrides `server.grpc_listen` (use port 0 for any free port; the bound address is
    /// printed on stdout).
    #[arg(long, conflicts_with = "grpc_port")]
    pub grpc_listen: Option<SocketAddr>,
    /// Overrides `server.grpc_unix_socket` (also serve ext_proc on this Unix socket).
    #[arg(long)]
    pub grpc_unix_socket: Option<PathBuf>,
    /// Overrides `server.admin_listen`.
    #[arg(long, conflicts_with = "metrics_port")]
    pub admin_listen: Option<SocketAddr>,
    /// Overrides `server.health_listen`.
    #[arg(long, conflicts_with = "grpc_health_port")]
    pub health_listen: Option<SocketAddr>,
    /// The scheduler slice kvrouter's threads ask for, microseconds (Linux 6.12+; 100 is the
    /// shortest it takes): a request's thread then runs as soon as it wakes instead of after a
    /// running lower-priority thread's slice (docs/security.md). 0 leaves the kernel's.
    #[arg(long, env = "KVROUTER_SCHED_SLICE_US", default_value_t = crate::sched::DEFAULT_SLICE_US)]
    pub sched_slice_us: u64,
    /// The reference endpoint picker's flags.
    #[command(flatten)]
    pub picker: picker::PickerFlags,
}

impl ServeArgs {
    /// Parses, adjusts with the flags and validates the config text (start and reloads alike).
    pub fn load(&self, text: &str, origin: &str) -> Result<Config, config::LoadError> {
        Config::parse_adjust_validate(text, origin, |c| {
            let errors = self.picker.apply(c);
            // The listen flags, on every load: a reload then compares like with like.
            if let Some(addr) = self.grpc_listen {
                c.server.grpc_listen = addr;
            }
            if let Some(path) = &self.grpc_unix_socket {
                // A flag's relative path is the working directory's (the file's, its own).
                let path = std::path::absolute(path).unwrap_or_else(|_| path.clone());
                c.server.grpc_unix_socket = Some(path);
            }
            if let Some(addr) = self.admin_listen {
                c.server.admin_listen = addr;
            }
            if let Some(addr) = self.health_listen {
                c.server.health_listen = Some(addr);
            }
            errors
        })
    }
}

/// Every endpoint source `config` asks for besides its own lists: DNS and Kubernetes pools.
fn sources(config: &Config, resolver: &Arc<dyn Resolve>) -> Vec<Arc<dyn Discovery>> {
    let mut all = DnsDiscovery::from_config(config, Arc::clone(resolver));
    all.extend(KubernetesDiscovery::from_config(config));
    all
}

/// TLS for the ext_proc port from `server.tls` (paths relative to `base_dir`).
fn tls_config(
    server: &config::ServerConfig,
    base_dir: &std::path::Path,
) -> anyhow::Result<Option<tonic::transport::ServerTlsConfig>> {
    let Some(tls) = &server.tls else {
        return Ok(None);
    };
    let read = |path: &std::path::Path, field: &str| {
        let path = base_dir.join(path);
        std::fs::read(&path)
            .with_context(|| format!("cannot read {} (server.tls.{field})", path.display()))
    };
    let identity = tonic::transport::Identity::from_pem(
        read(&tls.cert_path, "cert_path")?,
        read(&tls.key_path, "key_path")?,
    );
    Ok(Some(
        tonic::transport::ServerTlsConfig::new().identity(identity),
    ))
}

/// How long NOT_SERVING is announced before the listeners close at shutdown.
const SHUTDOWN_ANNOUNCE: Duration = Duration::from_millis(300);

/// Runs until SIGINT or SIGTERM, then drains: in-flight streams get a grace period to finish.
pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&args.config)
        .with_context(|| format!("cannot read {}", args.config.display()))?;
    let config = args.load(&text, &args.config.display().to_string())?;
    // Logs, and the decision spans' exporter when `tracing.enabled` (needs the runtime).
    let otel = crate::otel::init_subscriber(config.server.log_format, &config.tracing)?;
    if crate::sched::refused() {
        tracing::warn!(
            slice_us = crate::sched::slice_us(),
            "the kernel refused a short scheduler slice for kvrouter's threads (sched_setattr): \
             heavy work may delay decisions by up to the kernel's slice"
        );
    }
    let base_dir = args
        .config
        .parent()
        .map(|p| p.to_path_buf())
        .unwrap_or_default();
    let tls = tls_config(&config.server, &base_dir)?;

    // The health service answers NOT_SERVING from the start, before anything else is up, so a
    // probe sees a starting picker rather than a refused connection.
    let health = health::Health::new().await;
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let health_addr = match config.server.health_listen {
        Some(addr) => {
            let listener = TcpListener::bind(addr).await.with_context(|| {
                format!("cannot listen on {addr} (server.health_listen, --grpc-health-port)")
            })?;
            let bound = listener.local_addr()?;
            let served = health.clone().serve(listener, stopped(stop_rx.clone()));
            tokio::spawn(async move {
                if let Err(e) = served.await {
                    tracing::error!("gRPC health server failed: {e}");
                }
            });
            Some(bound)
        }
        None => None,
    };

    let grpc = TcpListener::bind(config.server.grpc_listen)
        .await
        .with_context(|| {
            format!(
                "cannot listen on {} (server.grpc_listen)",
                config.server.grpc_listen
            )
        })?;
    let admin = TcpListener::bind(config.server.admin_listen)
        .await
        .with_context(|| {
            format!(
                "cannot listen on {} (server.admin_listen)",
                config.server.admin_listen
            )
        })?;
    // The Unix socket's file stays until this function returns (then it is removed).
    let unix_path = config
        .server
        .grpc_unix_socket
        .as_ref()
        .map(|p| base_dir.join(p));
    #[cfg(unix)]
    let (unix_incoming, _unix_file) = match &unix_path {
        Some(path) => {
            let (incoming, file) = unix::bind(path).await?;
            (Some(incoming), Some(file))
        }
        None => (None, None),
    };
    #[cfg(not(unix))]
    if unix_path.is_some() {
        anyhow::bail!("server.grpc_unix_socket needs a Unix host");
    }
    let grpc_addr = grpc.local_addr()?;
    let admin_addr = admin.local_addr()?;

    let server_section = config.server.clone();
    let metrics = Arc::new(Metrics::new());
    let auth = crate::api::AdminAuth::load(&config.admin, &base_dir)?;
    let router = Arc::new(
        Router::new(config, Arc::clone(&metrics), &base_dir).context("cannot load the config")?,
    );
    router
        .sync_events()
        .await
        .context("cannot start the KV-event subscriptions (kv_events)")?;
    let handles = router.handles();
    // Decision sharing with peer instances (off unless `sharing.redis`): its tasks never sit on
    // the request path; an unreachable Redis is retried in the background, not fatal.
    if let Some(outbox) = crate::sharing::start(
        &handles.config.borrow().sharing,
        Arc::clone(&handles.peers),
        metrics.sharing.clone(),
    )? {
        router.share_decisions(outbox);
    }
    let ready = Arc::new(AtomicBool::new(false));

    if handles.config.borrow().envoy.eds_path.is_some() {
        // Subscribed before the first write, so a set published in between (a discovery source
        // finishing its first lookup) is written too. Written before we report ready, so an
        // Envoy started after us finds the file.
        let endpoints = Arc::clone(&handles.endpoints);
        let config = handles.config.clone();
        let mut versions = endpoints.subscribe();
        write_eds(endpoints.as_ref(), &config);
        tokio::spawn(async move {
            while versions.changed().await.is_ok() {
                write_eds(endpoints.as_ref(), &config);
            }
        });
    }
    // Endpoint sources other than the config file's lists (DNS and Kubernetes pools),
    // restarted on reload; `published` tells when each has listed its endpoints.
    let resolver: Arc<dyn Resolve> = Arc::new(SystemResolver);
    let published = Arc::new(Published::new(Arc::clone(&handles.discovery)));
    let discovery = Arc::new(Runner::new(Arc::clone(&published) as _));
    let initial_sources = sources(&handles.config.borrow(), &resolver);
    let kubernetes_keys: Vec<String> = initial_sources
        .iter()
        .map(|s| s.key())
        .filter(|k| k.starts_with("kubernetes:"))
        .collect();
    discovery.reconcile(initial_sources);
    // Discovered endpoints subscribe to their KV events (pool templates) as they come and go.
    let events_follow = {
        let router = Arc::clone(&router);
        let mut versions = handles.endpoints.subscribe();
        tokio::spawn(async move {
            while versions.changed().await.is_ok() {
                if let Err(e) = router.sync_events().await {
                    tracing::error!("KV-event subscriptions of discovered endpoints: {e}");
                }
            }
        })
    };
    // Scrapes and probes every endpoint, following the endpoint set.
    let monitor = monitor::spawn(monitor::Inputs {
        endpoints: Arc::clone(&handles.endpoints),
        config: handles.config.clone(),
        health: Arc::clone(&handles.health),
        capacity: Arc::clone(&handles.capacity),
    });

    let reload = (server_section.reload_interval_ms > 0).then(|| {
        let load_args = ServeArgs {
            config: args.config.clone(),
            grpc_listen: args.grpc_listen,
            grpc_unix_socket: args.grpc_unix_socket.clone(),
            admin_listen: args.admin_listen,
            health_listen: args.health_listen,
            sched_slice_us: args.sched_slice_us,
            picker: args.picker.clone(),
        };
        let router = Arc::clone(&router);
        let metrics = Arc::clone(&metrics);
        let discovery = Arc::clone(&discovery);
        let resolver = Arc::clone(&resolver);
        // What a reload is compared with: the section as loaded (port 0 stays 0); what it
        // keeps: the running one (the bound port).
        let loaded_server = server_section.clone();
        let mut server_section = server_section.clone();
        server_section.grpc_listen = grpc_addr;
        let sharing_section = handles.config.borrow().sharing.clone();
        let admin_section = handles.config.borrow().admin.clone();
        let tracing_section = handles.config.borrow().tracing.clone();
        config::watch::spawn_poller_with(
            args.config.clone(),
            Duration::from_millis(server_section.reload_interval_ms),
            &text,
            move |text, origin| load_args.load(text, origin),
            move |result| match result {
                Ok(mut new) => {
                    if new.server != loaded_server {
                        tracing::warn!("config reload: the `server` section cannot change at runtime; restart to apply it");
                    }
                    new.server = server_section.clone();
                    if new.sharing != sharing_section {
                        tracing::warn!("config reload: the `sharing` section cannot change at runtime; restart to apply it");
                    }
                    if new.admin != admin_section {
                        // The token is read at start-up: a reload that adds or rotates it
                        // must not look applied while the old one (or none) still guards.
                        tracing::warn!("config reload: the `admin` section (its token) cannot change at runtime; restart to apply it");
                    }
                    if new.tracing != tracing_section {
                        // The subscriber and exporter are built once, at start-up.
                        tracing::warn!("config reload: the `tracing` section cannot change at runtime; restart to apply it");
                    }
                    let sources = sources(&new, &resolver);
                    match router.apply(new) {
                        Ok(change) => {
                            metrics.record_reload(true);
                            tracing::info!(added = ?change.added, removed = ?change.removed, "config reloaded");
                            discovery.reconcile(sources);
                            // The new endpoint set wakes `events_follow`, which brings the
                            // KV-event subscriptions in line (one task, so syncs never overlap).
                            true
                        }
                        Err(e) => {
                            // A file it names may appear later (a Secret after its ConfigMap):
                            // the same version is tried again.
                            metrics.record_reload(false);
                            tracing::error!("config reload rejected, keeping the previous config (trying again in {:?}): {e}", config::watch::RETRY_FAILED_APPLY);
                            false
                        }
                    }
                }
                Err(e) => {
                    metrics.record_reload(false);
                    tracing::error!("config reload rejected, keeping the previous config: {e}");
                    true
                }
            },
        )
    });

    let grpc_task = tokio::spawn(crate::extproc::serve(
        ExtProc::new(Arc::clone(&router), Arc::clone(&metrics)),
        grpc,
        server_section.max_grpc_message_bytes,
        Duration::from_secs(server_section.max_request_duration_s),
        ServerExtras {
            routes: health.routes(),
            tls,
            #[cfg(unix)]
            unix: unix_incoming,
        },
        stopped(stop_rx.clone()),
    ));
    // The admin port serves the HTTP routes and the gRPC API (kvrouter.v1) alike.
    let api = crate::api::routes(
        handles.admin.clone(),
        handles.kv_push.clone(),
        auth.clone(),
        server_section.max_grpc_message_bytes,
    );
    let admin_task = tokio::spawn(crate::api::serve_admin(
        Admin::new(handles.admin, Arc::clone(&ready)),
        api,
        auth,
        admin,
        stopped(stop_rx.clone()),
    ));
    // Ready (admin /readyz, gRPC health SERVING) once every Kubernetes pool has listed its
    // pods, as the reference picker waits for its pool; at once without Kubernetes pools.
    let became_ready = {
        let ready = Arc::clone(&ready);
        let health = health.clone();
        let mut keys = published.subscribe();
        let published = Arc::clone(&published);
        tokio::spawn(async move {
            if !kubernetes_keys.is_empty() {
                tracing::info!(sources = ?kubernetes_keys, "not ready until the Kubernetes pools are listed");
            }
            while !published.all_published(&kubernetes_keys) {
                if keys.changed().await.is_err() {
                    return;
                }
            }
            ready.store(true, Ordering::Release);
            health.set(true).await;
            tracing::info!("ready");
        })
    };
    // One machine-readable line on stdout so scripts and tests learn the bound ports.
    let health_field = health_addr.map_or(String::new(), |a| format!(r#","health":"{a}""#));
    let unix_field = unix_path.as_ref().map_or(String::new(), |p| {
        format!(
            r#","grpc_unix":{}"#,
            serde_json::Value::from(p.to_string_lossy().as_ref())
        )
    });
    println!(
        r#"{{"event":"listening","grpc":"{grpc_addr}","admin":"{admin_addr}"{health_field}{unix_field}}}"#
    );
    tracing::info!(%grpc_addr, %admin_addr, health = ?health_addr, grpc_unix = ?unix_path, "kvrouter serving");

    shutdown_signal().await;
    tracing::info!("shutting down");
    became_ready.abort();
    ready.store(false, Ordering::Release);
    health.set(false).await;
    // Health watchers (a gateway's or a probe's gRPC Watch stream) get NOT_SERVING from their
    // connection's own task; closing the listeners at once raced it on a busy machine (the
    // watcher saw the connection reset instead). A short pause lets it go out first.
    tokio::time::sleep(SHUTDOWN_ANNOUNCE).await;
    events_follow.abort();
    if let Some(task) = reload {
        task.abort();
    }
    monitor.abort();
    drop(discovery);
    let _ = stop_tx.send(true);
    let drain = async {
        let _ = grpc_task.await;
        let _ = admin_task.await;
    };
    if tokio::time::timeout(Duration::from_secs(10), drain)
        .await
        .is_err()
    {
        tracing::warn!("streams still open after 10 s; exiting");
    }
    if let Some(otel) = otel {
        otel.shutdown(Duration::from_secs(5)).await;
    }
    Ok(())
}

/// Writes the current endpoint set to the EDS file the config names (if it still names one).
fn write_eds(endpoints: &dyn EndpointSource, config: &watch::Receiver<Arc<Config>>) {
    let Some(path) = config.borrow().envoy.eds_path.clone() else {
        return;
    };
    let set = endpoints.snapshot();
    let addrs: Vec<_> = set.all().iter().map(|e| (e.address, e.draining)).collect();
    match crate::envoyconf::write_eds(&path, set.version, &addrs) {
        Ok(()) => {
            tracing::info!(path = %path.display(), endpoints = addrs.len(), "wrote Envoy EDS file")
        }
        Err(e) => tracing::error!(path = %path.display(), "cannot write Envoy EDS file: {e}"),
    }
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    const CONFIG: &str =
        "pools: [{name: p, models: [m], endpoints: [{address: \"127.0.0.1:8001\"}]}]\n";

    #[test]
    fn the_listen_flags_apply_on_every_load_and_a_relative_socket_is_the_working_directorys() {
        use clap::Parser as _;
        let cli = Cli::try_parse_from([
            "kvrouter",
            "--config",
            "conf/kvrouter.yaml",
            "--grpc-listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--grpc-unix-socket",
            "run/grpc.sock",
        ])
        .unwrap();
        let first = cli.serve.load(CONFIG, "test").unwrap();
        let socket = std::env::current_dir().unwrap().join("run/grpc.sock");
        assert_eq!(first.server.grpc_unix_socket, Some(socket));
        assert_eq!(first.server.grpc_listen, "127.0.0.1:0".parse().unwrap());
        assert_eq!(first.server.admin_listen, "127.0.0.1:0".parse().unwrap());
        // A reload of the same file compares equal: nothing to warn about.
        assert_eq!(cli.serve.load(CONFIG, "test").unwrap().server, first.server);
    }
}
