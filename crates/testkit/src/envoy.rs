//! Envoy 1.40: started on a rendered config whose listener and admin are on port 0 (one worker,
//! hot restart off), its ports read back through the admin interface, and its view of the
//! replica cluster awaited.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;

use kvrouter::envoyconf::{self, BodyMode, ClusterStyle, EnvoyOptions, Replicas};

use crate::{poll, HarnessError, Proc, Router, STARTUP};

/// The cluster kvrouter's rendered configs route to.
const REPLICA_CLUSTER: &str = "llm_replicas";

/// A running Envoy, SIGKILLed when dropped.
#[derive(Debug)]
pub struct Envoy {
    /// The client-facing listener.
    pub addr: SocketAddr,
    /// The admin interface.
    pub admin: SocketAddr,
    /// The process.
    pub proc: Proc,
}

impl Envoy {
    /// Starts `bin` on `yaml` (written to `dir/envoy.yaml`; Envoy runs in `dir`) with
    /// `--disable-hot-restart` (several Envoys on one machine must not share a hot-restart
    /// domain) and one worker, and waits (at most [`STARTUP`]) until its admin and listener
    /// answer. The listener and admin in `yaml` must be on port 0 of a loopback address.
    pub async fn start(bin: &Path, dir: &Path, yaml: &str) -> Result<Envoy, HarnessError> {
        Self::start_with_args(bin, dir, yaml, &[]).await
    }

    /// [`Envoy::start`] with `extra` command-line arguments (e.g. `--drain-time-s`).
    pub async fn start_with_args(
        bin: &Path,
        dir: &Path,
        yaml: &str,
        extra: &[&str],
    ) -> Result<Envoy, HarnessError> {
        let dir = &std::path::absolute(dir).map_err(HarnessError::io(format!(
            "absolute path of {}",
            dir.display()
        )))?;
        let config = dir.join("envoy.yaml");
        std::fs::write(&config, yaml)
            .map_err(HarnessError::io(format!("write {}", config.display())))?;
        let admin_path = dir.join("envoy-admin.txt");
        let _ = std::fs::remove_file(&admin_path);
        let mut cmd = Command::new(bin);
        cmd.arg("-c")
            .arg(&config)
            .arg("--admin-address-path")
            .arg(&admin_path)
            .args([
                "--disable-hot-restart",
                "--concurrency",
                "1",
                "-l",
                "warning",
            ])
            .args(extra)
            .current_dir(dir);
        let (mut proc, _) = Proc::spawn("envoy", cmd, dir, 0)?;
        let admin = poll::poll_until("Envoy's admin address", STARTUP, || {
            let exited = !proc.alive();
            let text = std::fs::read_to_string(&admin_path).ok();
            async move {
                match text.and_then(|t| t.trim().parse::<SocketAddr>().ok()) {
                    Some(a) => Some(Ok(a)),
                    None if exited => Some(Err(())),
                    None => None,
                }
            }
        })
        .await
        .map_err(|e| proc.not_ready(e.to_string()))?
        .map_err(|()| proc.not_ready("exited during start-up"))?;
        let client = reqwest::Client::new();
        let addr = poll::poll_until("Envoy's listener", STARTUP, || {
            let client = client.clone();
            async move {
                let v: serde_json::Value = client
                    .get(format!("http://{admin}/listeners?format=json"))
                    .send()
                    .await
                    .ok()?
                    .json()
                    .await
                    .ok()?;
                let sa = &v["listener_statuses"][0]["local_address"]["socket_address"];
                let ip = sa["address"].as_str()?.parse().ok()?;
                let port = sa["port_value"].as_u64().filter(|&p| p > 0)?;
                Some(SocketAddr::new(ip, u16::try_from(port).ok()?))
            }
        })
        .await
        .map_err(|e| proc.not_ready(e.to_string()))?;
        Ok(Envoy { addr, admin, proc })
    }

    /// The hosts of the replica cluster, sorted, as Envoy's admin lists them now.
    pub async fn hosts(&self, client: &reqwest::Client) -> Result<Vec<String>, HarnessError> {
        let url = format!("http://{}/clusters", self.admin);
        let http = |e: reqwest::Error| HarnessError::Http {
            url: url.clone(),
            message: e.to_string(),
        };
        let text = client
            .get(&url)
            .send()
            .await
            .map_err(http)?
            .text()
            .await
            .map_err(http)?;
        let mut hosts: Vec<String> = text
            .lines()
            .filter_map(|l| l.strip_prefix(REPLICA_CLUSTER)?.strip_prefix("::"))
            .filter_map(|l| l.split("::").next())
            .filter(|h| h.contains(':'))
            .map(str::to_string)
            .collect();
        hosts.sort();
        hosts.dedup();
        Ok(hosts)
    }

    /// Waits (at most [`STARTUP`]) until the replica cluster has exactly the hosts `expected`.
    pub async fn wait_for_hosts(&self, expected: &[SocketAddr]) -> Result<(), HarnessError> {
        let client = reqwest::Client::new();
        let mut want: Vec<String> = expected.iter().map(ToString::to_string).collect();
        want.sort();
        let what = format!("Envoy's {REPLICA_CLUSTER} to hold exactly {want:?}");
        poll::poll_until(&what, STARTUP, || async {
            (self.hosts(&client).await.ok()? == want).then_some(())
        })
        .await
    }
}

/// Envoy options for a test's ports: listener and admin on `127.0.0.1:0`, ext_proc to
/// `router`, replicas from `static_replicas` or else from the router's EDS file `dir/eds.json`.
pub fn envoy_options(
    router: &Router,
    dir: &Path,
    cluster: ClusterStyle,
    body_mode: BodyMode,
    static_replicas: Option<Vec<SocketAddr>>,
) -> EnvoyOptions {
    EnvoyOptions {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        admin: SocketAddr::from(([127, 0, 0, 1], 0)),
        extproc: router.grpc.into(),
        replicas: match static_replicas {
            Some(list) => Replicas::Static(list),
            None => Replicas::EdsFile(dir.join("eds.json")),
        },
        cluster,
        body_mode,
        ..EnvoyOptions::default()
    }
}

/// [`envoy_options`], rendered.
pub fn envoy_yaml(
    router: &Router,
    dir: &Path,
    cluster: ClusterStyle,
    body_mode: BodyMode,
    static_replicas: Option<Vec<SocketAddr>>,
) -> String {
    envoyconf::render(&envoy_options(
        router,
        dir,
        cluster,
        body_mode,
        static_replicas,
    ))
}

/// The clusters of a rendered config that carry ext_proc streams to kvrouter (the picker's and
/// the observer's).
pub const EXTPROC_CLUSTERS: [&str; 2] = ["kvrouter_extproc", "kvrouter_observe"];

/// Rewrites an Envoy config rendered by `kvrouter::envoyconf` so that both ext_proc clusters
/// ([`EXTPROC_CLUSTERS`]) hold every address of `routers`, balanced with `lb_policy` (Envoy's
/// cluster `lb_policy`: `ROUND_ROBIN`, `LEAST_REQUEST`, ...). Envoy picks an instance per gRPC
/// stream, so a request's picker and observer streams may reach different instances.
pub fn with_routers(
    yaml: &str,
    routers: &[SocketAddr],
    lb_policy: &str,
) -> Result<String, HarnessError> {
    use serde_norway::Value;
    let bad = |message: String| HarnessError::Config { message };
    let mut root: Value =
        serde_norway::from_str(yaml).map_err(|e| bad(format!("Envoy config: {e}")))?;
    let endpoints: Vec<Value> = routers
        .iter()
        .map(|a| {
            serde_norway::from_str(&format!(
                "{{endpoint: {{address: {{socket_address: {{address: \"{}\", port_value: {}}}}}}}}}",
                a.ip(),
                a.port()
            ))
            .unwrap_or(Value::Null)
        })
        .collect();
    let clusters = root
        .get_mut("static_resources")
        .and_then(|s| s.get_mut("clusters"))
        .and_then(Value::as_sequence_mut)
        .ok_or_else(|| bad("no static_resources.clusters".into()))?;
    let mut found = 0;
    for c in clusters.iter_mut() {
        let name = c
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        if !EXTPROC_CLUSTERS.contains(&name.as_str()) {
            continue;
        }
        let m = c
            .as_mapping_mut()
            .ok_or_else(|| bad(format!("cluster {name} is not a mapping")))?;
        m.insert("lb_policy".into(), Value::String(lb_policy.into()));
        let la = m
            .get_mut("load_assignment")
            .and_then(|l| l.get_mut("endpoints"))
            .and_then(Value::as_sequence_mut)
            .and_then(|e| e.first_mut())
            .and_then(Value::as_mapping_mut)
            .ok_or_else(|| bad(format!("cluster {name} has no load_assignment endpoints")))?;
        la.insert("lb_endpoints".into(), Value::Sequence(endpoints.clone()));
        found += 1;
    }
    if found == 0 {
        return Err(bad("no ext_proc cluster found".into()));
    }
    serde_norway::to_string(&root).map_err(|e| bad(e.to_string()))
}

/// [`Envoy::start`] with the tests' Envoy; panics with its log on failure.
pub async fn start_envoy(dir: &Path, yaml: &str) -> Envoy {
    Envoy::start(&crate::envoy_bin(), dir, yaml)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn several_routers_share_both_extproc_clusters() {
        let yaml = envoyconf::render(&EnvoyOptions::default());
        let routers: Vec<SocketAddr> = vec![
            "127.0.0.1:7001".parse().unwrap(),
            "127.0.0.1:7002".parse().unwrap(),
        ];
        let out = with_routers(&yaml, &routers, "LEAST_REQUEST").unwrap();
        let v: serde_norway::Value = serde_norway::from_str(&out).unwrap();
        let clusters = v["static_resources"]["clusters"].as_sequence().unwrap();
        let ext: Vec<_> = clusters
            .iter()
            .filter(|c| EXTPROC_CLUSTERS.contains(&c["name"].as_str().unwrap_or("")))
            .collect();
        assert_eq!(ext.len(), 2);
        for c in ext {
            assert_eq!(c["lb_policy"].as_str(), Some("LEAST_REQUEST"));
            let eps = c["load_assignment"]["endpoints"][0]["lb_endpoints"]
                .as_sequence()
                .unwrap();
            assert_eq!(eps.len(), 2);
            assert_eq!(
                eps[1]["endpoint"]["address"]["socket_address"]["port_value"].as_u64(),
                Some(7002)
            );
        }
        assert!(with_routers("a: 1", &routers, "ROUND_ROBIN").is_err());
    }
}
