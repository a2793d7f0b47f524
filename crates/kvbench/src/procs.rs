//! The processes a run needs, started and stopped by the bench itself on loopback: one `kvsim`
//! process per replica (so one can be killed and restarted), `kvrouter serve`, and Envoy
//! (`--disable-hot-restart`). Every process is SIGKILLed when its handle drops; readiness is
//! polled with deadlines.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::BenchError;
use kvsim::ReplicaConfig;

/// How long any process may take to come up.
pub const STARTUP: Duration = Duration::from_secs(30);

/// Where the binaries are.
#[derive(Debug, Clone)]
pub struct Binaries {
    /// `kvsim`.
    pub kvsim: PathBuf,
    /// `kvrouter`.
    pub kvrouter: PathBuf,
    /// Envoy 1.40.
    pub envoy: PathBuf,
}

impl Binaries {
    /// `kvsim` and `kvrouter` beside the running executable, Envoy at `envoy`. Errors name
    /// what is missing.
    pub fn beside_current_exe(envoy: PathBuf) -> Result<Binaries, BenchError> {
        let exe = std::env::current_exe().map_err(|e| BenchError::Process(e.to_string()))?;
        let dir = exe.parent().unwrap_or(Path::new("."));
        let bins = Binaries {
            kvsim: dir.join("kvsim"),
            kvrouter: dir.join("kvrouter"),
            envoy,
        };
        for p in [&bins.kvsim, &bins.kvrouter, &bins.envoy] {
            if !p.is_file() {
                return Err(BenchError::Process(format!(
                    "{} not found (build with `cargo build --release --bins`; Envoy: `make envoy` \
                     or --envoy PATH)",
                    p.display()
                )));
            }
        }
        Ok(bins)
    }
}

/// A child process, SIGKILLed and reaped on drop; its output goes to a log file.
#[derive(Debug)]
pub struct Proc {
    /// A name for messages.
    pub name: String,
    child: Option<Child>,
    /// The log file.
    pub log: PathBuf,
}

impl Proc {
    /// Spawns `cmd` and waits until it printed `lines` JSON lines on stdout; returns them.
    pub fn spawn(
        name: &str,
        mut cmd: Command,
        dir: &Path,
        lines: usize,
    ) -> Result<(Proc, Vec<serde_json::Value>), BenchError> {
        let log = dir.join(format!("{name}.log"));
        let stderr = std::fs::File::create(&log).map_err(|e| BenchError::Process(e.to_string()))?;
        cmd.stdout(if lines > 0 {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stderr(stderr)
        .stdin(Stdio::null());
        let mut child = cmd
            .spawn()
            .map_err(|e| BenchError::Process(format!("cannot start {name}: {e}")))?;
        let mut proc = Proc {
            name: name.to_string(),
            child: None,
            log,
        };
        let stdout = child.stdout.take();
        proc.child = Some(child);
        let mut got = Vec::new();
        if let Some(stdout) = stdout {
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
            let deadline = Instant::now() + STARTUP;
            while got.len() < lines {
                match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                    Ok(v) => got.push(v),
                    Err(_) => {
                        return Err(BenchError::Process(format!(
                            "{name} did not report ready; log {}:\n{}",
                            proc.log.display(),
                            proc.log_tail()
                        )))
                    }
                }
            }
        }
        Ok((proc, got))
    }

    /// The OS process id, while running.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The last 30 lines of the log.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// SIGKILLs and reaps the process.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Whether it still runs.
    pub fn alive(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// User + system CPU seconds used so far (Linux `/proc`; 0 elsewhere or once exited).
    pub fn cpu_s(&self) -> f64 {
        self.pid().map_or(0.0, cpu_seconds_of)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// User + system CPU seconds of process `pid` (Linux `/proc/<pid>/stat`), 0 if unknown.
pub fn cpu_seconds_of(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return 0.0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / clock_ticks_per_s()
}

/// CPU seconds used by this process so far.
pub fn own_cpu_s() -> f64 {
    cpu_seconds_of(std::process::id())
}

fn clock_ticks_per_s() -> f64 {
    // sysconf(_SC_CLK_TCK) is 100 on every Linux this runs on.
    100.0
}

/// One replica process.
#[derive(Debug)]
pub struct ReplicaProc {
    /// Its config (listen address and KV-event endpoint pinned after the first start, so a
    /// restart comes back on the same ports).
    pub config: ReplicaConfig,
    /// The HTTP address.
    pub addr: SocketAddr,
    /// The ZMQ endpoint subscribers connect to, when publishing.
    pub kv_events: Option<String>,
    /// The process; `None` while killed.
    pub proc: Option<Proc>,
    /// CPU seconds of earlier incarnations.
    pub cpu_before_s: f64,
}

impl ReplicaProc {
    /// Starts `kvsim` with a one-replica fleet file for `config`.
    pub fn start(bin: &Path, dir: &Path, config: ReplicaConfig) -> Result<ReplicaProc, BenchError> {
        let (proc, addr, kv_events) = spawn_kvsim(bin, dir, &config)?;
        let mut config = config;
        config.listen = addr;
        if let (Some(kv), Some(bound)) = (&mut config.kv_events, &kv_events) {
            // Rebind the same port on restart.
            kv.endpoint = bound.replacen("127.0.0.1", "*", 1);
        }
        Ok(ReplicaProc {
            config,
            addr,
            kv_events,
            proc: Some(proc),
            cpu_before_s: 0.0,
        })
    }

    /// The replica's name.
    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// SIGKILLs it.
    pub fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            self.cpu_before_s += p.cpu_s();
            p.kill();
        }
    }

    /// Starts it again on the same ports (cold cache).
    pub fn restart(&mut self, bin: &Path, dir: &Path) -> Result<(), BenchError> {
        self.kill();
        let (proc, _, _) = spawn_kvsim(bin, dir, &self.config)?;
        self.proc = Some(proc);
        Ok(())
    }

    /// CPU seconds of every incarnation.
    pub fn cpu_s(&self) -> f64 {
        self.cpu_before_s + self.proc.as_ref().map_or(0.0, Proc::cpu_s)
    }
}

fn spawn_kvsim(
    bin: &Path,
    dir: &Path,
    config: &ReplicaConfig,
) -> Result<(Proc, SocketAddr, Option<String>), BenchError> {
    let fleet = kvsim::FleetConfig {
        replicas: vec![config.clone()],
    };
    let file = dir.join(format!("{}.fleet.yaml", config.name));
    let yaml = serde_norway::to_string(&fleet).map_err(|e| BenchError::Process(e.to_string()))?;
    std::fs::write(&file, yaml).map_err(|e| BenchError::Process(e.to_string()))?;
    let mut cmd = Command::new(bin);
    cmd.arg("--fleet").arg(&file).env("RUST_LOG", "warn");
    let (proc, lines) = Proc::spawn(&config.name, cmd, dir, 1)?;
    let addr = lines[0]["addr"]
        .as_str()
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| BenchError::Process(format!("kvsim printed no address: {}", lines[0])))?;
    let kv = lines[0]["kv_events"].as_str().map(str::to_string);
    Ok((proc, addr, kv))
}

/// A running kvrouter.
#[derive(Debug)]
pub struct RouterProc {
    /// ext_proc gRPC address.
    pub grpc: SocketAddr,
    /// Admin address (`/metrics`).
    pub admin: SocketAddr,
    /// Its config file (rewritten to hot-reload).
    pub config: PathBuf,
    /// The process.
    pub proc: Proc,
}

/// Validates a router config with `kvrouter check-config`; the error is its message.
pub fn check_config(bin: &Path, config: &Path) -> Result<(), String> {
    let out = Command::new(bin)
        .arg("check-config")
        .arg(config)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

impl RouterProc {
    /// Starts `kvrouter serve` on ephemeral ports with the config file `config`.
    pub fn start(bin: &Path, dir: &Path, config: &Path) -> Result<RouterProc, BenchError> {
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
            .env("RUST_LOG", "warn");
        let (proc, lines) = Proc::spawn("kvrouter", cmd, dir, 1)?;
        let get = |k: &str| -> Result<SocketAddr, BenchError> {
            lines[0][k]
                .as_str()
                .and_then(|a| a.parse().ok())
                .ok_or_else(|| {
                    BenchError::Process(format!("kvrouter printed no {k}: {}", lines[0]))
                })
        };
        Ok(RouterProc {
            grpc: get("grpc")?,
            admin: get("admin")?,
            config: config.to_path_buf(),
            proc,
        })
    }

    /// Replaces the config file atomically (kvrouter hot-reloads it).
    pub fn rewrite_config(&self, yaml: &str) -> Result<(), BenchError> {
        let tmp = self.config.with_extension("tmp");
        std::fs::write(&tmp, yaml).map_err(|e| BenchError::Process(e.to_string()))?;
        std::fs::rename(&tmp, &self.config).map_err(|e| BenchError::Process(e.to_string()))
    }
}

/// A running Envoy.
#[derive(Debug)]
pub struct EnvoyProc {
    /// Client-facing listener.
    pub addr: SocketAddr,
    /// Admin interface.
    pub admin: SocketAddr,
    /// The process.
    pub proc: Proc,
}

impl EnvoyProc {
    /// Starts Envoy (one worker thread, hot restart off) with `yaml`, whose listener and admin
    /// must be on port 0, and waits for both.
    pub async fn start(bin: &Path, dir: &Path, yaml: &str) -> Result<EnvoyProc, BenchError> {
        // Envoy runs in `dir`: give it absolute paths.
        let dir = &std::path::absolute(dir).map_err(|e| BenchError::Process(e.to_string()))?;
        let config = dir.join("envoy.yaml");
        std::fs::write(&config, yaml).map_err(|e| BenchError::Process(e.to_string()))?;
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
            .current_dir(dir);
        let (mut proc, _) = Proc::spawn("envoy", cmd, dir, 0)?;
        let deadline = Instant::now() + STARTUP;
        let admin: SocketAddr = loop {
            if let Some(a) = std::fs::read_to_string(&admin_path)
                .ok()
                .and_then(|t| t.trim().parse().ok())
            {
                break a;
            }
            if !proc.alive() || Instant::now() > deadline {
                return Err(BenchError::Process(format!(
                    "Envoy did not start:\n{}",
                    proc.log_tail()
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let client = reqwest::Client::new();
        let addr = loop {
            let got: Option<serde_json::Value> = async {
                client
                    .get(format!("http://{admin}/listeners?format=json"))
                    .send()
                    .await
                    .ok()?
                    .json()
                    .await
                    .ok()
            }
            .await;
            let port = got.as_ref().and_then(|v| {
                v["listener_statuses"][0]["local_address"]["socket_address"]["port_value"].as_u64()
            });
            if let Some(port) = port.filter(|&p| p > 0) {
                break SocketAddr::from(([127, 0, 0, 1], port as u16));
            }
            if Instant::now() > deadline {
                return Err(BenchError::Process(format!(
                    "Envoy's listener did not come up:\n{}",
                    proc.log_tail()
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        Ok(EnvoyProc { addr, admin, proc })
    }

    /// Waits until the replica cluster has exactly `expected` hosts.
    pub async fn wait_for_hosts(&self, expected: &[SocketAddr]) -> Result<(), BenchError> {
        let client = reqwest::Client::new();
        let mut want: Vec<String> = expected.iter().map(ToString::to_string).collect();
        want.sort();
        let deadline = Instant::now() + STARTUP;
        loop {
            let text = async {
                client
                    .get(format!("http://{}/clusters", self.admin))
                    .send()
                    .await
                    .ok()?
                    .text()
                    .await
                    .ok()
            }
            .await
            .unwrap_or_default();
            let mut hosts: Vec<String> = text
                .lines()
                .filter_map(|l| l.strip_prefix("llm_replicas::"))
                .filter_map(|l| l.split("::").next())
                .filter(|h| h.contains(':'))
                .map(str::to_string)
                .collect();
            hosts.sort();
            hosts.dedup();
            if hosts == want {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(BenchError::Process(format!(
                    "Envoy has hosts {hosts:?}, expected {want:?}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Waits until `url` answers 2xx.
pub async fn wait_http(url: &str) -> Result<(), BenchError> {
    let client = reqwest::Client::new();
    let deadline = Instant::now() + STARTUP;
    loop {
        if let Ok(r) = client.get(url).send().await {
            if r.status().is_success() {
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            return Err(BenchError::Process(format!("{url} did not answer")));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
