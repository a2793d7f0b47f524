//! kvrouter: `kvrouter serve` on ephemeral loopback ports, its config (written, validated,
//! hot-reloaded), and readiness.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{poll, HarnessError, Proc, Replica, MODEL, STARTUP};

/// `RUST_LOG` of a router started by a test: its debug lines are what tests read in its log.
pub const TEST_LOG_FILTER: &str = "info,kvrouter=debug";

/// A running kvrouter, SIGKILLed when dropped.
#[derive(Debug)]
pub struct Router {
    /// The ext_proc gRPC address.
    pub grpc: SocketAddr,
    /// The admin address (`/metrics`, `/debug/...`, `/readyz`).
    pub admin: SocketAddr,
    /// The ext_proc server's Unix socket, when it serves one (`server.grpc_unix_socket`).
    pub grpc_unix: Option<PathBuf>,
    /// Its config file; [`Router::rewrite_config`] replaces it (kvrouter hot-reloads it).
    pub config: PathBuf,
    /// The process.
    pub proc: Proc,
}

impl Router {
    /// Starts `bin serve --config config` on `127.0.0.1:0` (gRPC and admin), its log in `dir`,
    /// with `RUST_LOG=log_filter`, and waits for its "listening" line. Not for `/readyz`: see
    /// [`Router::wait_ready`].
    pub fn start(
        bin: &Path,
        dir: &Path,
        config: &Path,
        log_filter: &str,
    ) -> Result<Router, HarnessError> {
        let mut cmd = Command::new(bin);
        cmd.arg("serve")
            .arg("--config")
            .arg(config)
            .args([
                "--grpc-listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
            ])
            .env("RUST_LOG", log_filter);
        let (proc, lines) = Proc::spawn("kvrouter", cmd, dir, 1)?;
        let line = &lines[0];
        let addr = |key: &str| -> Result<SocketAddr, HarnessError> {
            line[key]
                .as_str()
                .and_then(|a| a.parse().ok())
                .ok_or_else(|| proc.not_ready(format!("no {key} address in {line}")))
        };
        Ok(Router {
            grpc: addr("grpc")?,
            admin: addr("admin")?,
            grpc_unix: line["grpc_unix"].as_str().map(PathBuf::from),
            config: config.to_path_buf(),
            proc,
        })
    }

    /// Waits (at most [`STARTUP`]) until `/readyz` answers 200.
    pub async fn wait_ready(&self) -> Result<(), HarnessError> {
        let client = reqwest::Client::new();
        let url = format!("http://{}/readyz", self.admin);
        poll::wait_http(&client, &url, STARTUP).await
    }

    /// Replaces the config file atomically (write beside it, then rename), so the reloader never
    /// reads half a file.
    pub fn rewrite_config(&self, yaml: &str) -> Result<(), HarnessError> {
        let tmp = self.config.with_extension("tmp");
        std::fs::write(&tmp, yaml).map_err(HarnessError::io(format!("write {}", tmp.display())))?;
        std::fs::rename(&tmp, &self.config).map_err(HarnessError::io(format!(
            "rename to {}",
            self.config.display()
        )))
    }
}

/// Validates a config file with `bin check-config`; a rejection carries kvrouter's message.
pub fn check_config(bin: &Path, config: &Path) -> Result<(), HarnessError> {
    let out = Command::new(bin)
        .arg("check-config")
        .arg(config)
        .output()
        .map_err(|source| HarnessError::Spawn {
            name: format!("{} check-config", bin.display()),
            source,
        })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(HarnessError::ConfigRejected {
            message: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

/// Something a test's router config lists as an endpoint.
pub trait ConfigEndpoint {
    /// Its entry under `endpoints:`, indented for [`router_config`]'s pool.
    fn endpoint_yaml(&self) -> String;
}

impl ConfigEndpoint for SocketAddr {
    fn endpoint_yaml(&self) -> String {
        format!("      - address: \"{self}\"\n")
    }
}

/// A replica's address and, when it publishes, its KV events (the router connects).
impl ConfigEndpoint for Replica {
    fn endpoint_yaml(&self) -> String {
        let mut yaml = self.addr.endpoint_yaml();
        if let Some(kv) = &self.kv_events {
            yaml.push_str(&format!("        kv_events: {{connect: \"{kv}\"}}\n"));
        }
        yaml
    }
}

/// A test's router config: one pool `test` serving [`MODEL`] on `endpoints`, a 50 ms reload
/// interval, the EDS file at `dir/eds.json`, plus `extra` YAML (top-level sections other than
/// `pools`, `server` and `envoy`).
pub fn router_config<E: ConfigEndpoint>(dir: &Path, endpoints: &[E], extra: &str) -> String {
    router_config_with_pool(dir, endpoints, extra, "")
}

/// [`router_config`] with `pool_extra` YAML in the pool's mapping (fields of `pools[0]` other
/// than `name`, `models` and `endpoints`, one per line at the pool's indentation, e.g.
/// `kv_tiers: {cpu: {bandwidth_gb_per_s: 5}}`).
pub fn router_config_with_pool<E: ConfigEndpoint>(
    dir: &Path,
    endpoints: &[E],
    extra: &str,
    pool_extra: &str,
) -> String {
    let endpoints: String = endpoints.iter().map(E::endpoint_yaml).collect();
    let pool_extra: String = pool_extra
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| format!("    {l}\n"))
        .collect();
    format!(
        "server:\n  reload_interval_ms: 50\n\
         envoy:\n  eds_path: {eds}\n\
         {extra}\n\
         pools:\n  - name: test\n    models: [{MODEL}]\n{pool_extra}    endpoints:\n{endpoints}",
        eds = dir.join("eds.json").display()
    )
}

/// Writes `yaml` to `dir/kvrouter.yaml` and starts the workspace's kvrouter on it with
/// [`TEST_LOG_FILTER`]; for tests: panics with the log on failure.
pub fn start_router(dir: &Path, yaml: &str) -> Router {
    let config = dir.join("kvrouter.yaml");
    std::fs::write(&config, yaml).expect("write the router config");
    Router::start(&crate::kvrouter_bin(), dir, &config, TEST_LOG_FILTER)
        .unwrap_or_else(|e| panic!("{e}"))
}
