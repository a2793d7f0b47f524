//! One real vLLM server (CPU build) as a process group: started with its own session so that
//! killing it takes its engine-core child along, restartable on the same ports, killed on drop.
//!
//! vLLM's KV-event PUB socket binds when its endpoint has a wildcard host (`tcp://*:PORT`) and
//! kvrouter connects to it on 127.0.0.1; its HTTP server listens on 127.0.0.1 only.

use std::net::{SocketAddr, TcpListener};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long one vLLM may take to answer `/health` (measured here: 65-120 s; two start at once
/// on two cores).
pub const STARTUP: Duration = Duration::from_secs(600);

/// KV-cache blocks of each replica (128 tokens each).
pub const NUM_BLOCKS: u32 = 64;

/// The model name clients send.
pub const MODEL: &str = "smollm2";

/// The vLLM executable and the model directory, from the environment `make test-vllm` sets.
#[derive(Debug, Clone)]
pub struct Setup {
    pub vllm: PathBuf,
    pub model_dir: PathBuf,
    /// vLLM's own cache (`VLLM_CACHE_ROOT`), kept in the repository's `.cache/`, not `~/.cache`.
    pub cache_root: PathBuf,
}

impl Setup {
    /// Reads `KVROUTER_VLLM` (the `vllm` executable) and `KVROUTER_VLLM_MODEL` (an HF model
    /// dir); panics naming what to run when either is missing.
    pub fn from_env() -> Setup {
        let get = |var: &str, what: &str| -> PathBuf {
            let p = std::env::var_os(var).map(PathBuf::from).unwrap_or_else(|| {
                panic!("{var} is not set: run `make test-vllm` (it sets up {what} with scripts/setup-vllm.sh)")
            });
            assert!(
                p.exists(),
                "{var}={} does not exist: run scripts/setup-vllm.sh",
                p.display()
            );
            p
        };
        Setup {
            vllm: get("KVROUTER_VLLM", "the vLLM venv"),
            model_dir: get("KVROUTER_VLLM_MODEL", "the model dir"),
            cache_root: testkit::repo().join(".cache/vllm-runtime"),
        }
    }
}

/// `n` distinct free ports on 127.0.0.1 (bound together, then released).
pub fn free_ports(n: usize) -> Vec<u16> {
    let held: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port"))
        .collect();
    held.iter()
        .map(|l| l.local_addr().expect("local addr").port())
        .collect()
}

/// A vLLM server on fixed loopback ports. Shared by the checks (`&self` everywhere): the
/// process handle sits behind a mutex held only for non-blocking calls.
pub struct Vllm {
    pub name: String,
    /// The OpenAI HTTP server.
    pub addr: SocketAddr,
    /// The port its KV-event publisher binds (on every interface; kvrouter uses 127.0.0.1).
    pub events_port: u16,
    /// The port its KV-event replay socket (`replay_endpoint`) binds.
    pub replay_port: u16,
    cpu: usize,
    setup: Setup,
    log: PathBuf,
    child: Mutex<Option<Child>>,
}

impl Vllm {
    /// Starts `name` on `http_port` / `events_port`, its OpenMP threads bound to core `cpu`.
    /// Does not wait: see [`Vllm::wait_ready`].
    pub fn start(
        setup: &Setup,
        dir: &Path,
        name: &str,
        cpu: usize,
        http_port: u16,
        events_port: u16,
        replay_port: u16,
    ) -> Vllm {
        let v = Vllm {
            name: name.to_string(),
            addr: SocketAddr::from(([127, 0, 0, 1], http_port)),
            events_port,
            replay_port,
            cpu,
            setup: setup.clone(),
            log: dir.join(format!("{name}.log")),
            child: Mutex::new(None),
        };
        v.spawn();
        v
    }

    /// kvrouter's `kv_events.connect` for this server.
    pub fn events_connect(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.events_port)
    }

    /// kvrouter's `kv_events.replay` for this server.
    pub fn events_replay(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.replay_port)
    }

    fn spawn(&self) {
        let mut slot = self.child.lock().expect("child lock");
        assert!(slot.is_none(), "{} is already running", self.name);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("vllm log file");
        let events = serde_json::json!({
            "enable_kv_cache_events": true,
            "publisher": "zmq",
            "endpoint": format!("tcp://*:{}", self.events_port),
            "replay_endpoint": format!("tcp://*:{}", self.replay_port),
        });
        let mut cmd = Command::new(&self.setup.vllm);
        cmd.arg("serve")
            .arg(&self.setup.model_dir)
            .args(["--served-model-name", MODEL, "--host", "127.0.0.1"])
            .args(["--port", &self.addr.port().to_string()])
            .args(["--max-model-len", "2048", "--enforce-eager"])
            // 64 blocks (8,192 tokens of KV), so that evicting takes few requests.
            .args(["--num-gpu-blocks-override", &NUM_BLOCKS.to_string()])
            .args(["--enable-prefix-caching", "--enable-prompt-tokens-details"])
            .arg("--kv-events-config")
            .arg(events.to_string())
            // No hub, no usage reports: this machine reaches nothing but loopback.
            .env("HF_HUB_OFFLINE", "1")
            .env("TRANSFORMERS_OFFLINE", "1")
            .env("VLLM_NO_USAGE_STATS", "1")
            .env("DO_NOT_TRACK", "1")
            .env("VLLM_CACHE_ROOT", &self.setup.cache_root)
            // The KV space in GiB (1 GiB holds 364 blocks of this model; 64 are used).
            .env("VLLM_CPU_KVCACHE_SPACE", "1")
            .env("VLLM_CPU_OMP_THREADS_BIND", self.cpu.to_string())
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup log"))
            .stderr(log)
            // Its own process group, so that a kill reaches the engine-core child too.
            .process_group(0);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.setup.vllm.display()));
        // For scripts/test-vllm.sh, which kills what is left if this test is itself killed.
        std::fs::write(self.log.with_extension("pgid"), child.id().to_string())
            .expect("write pgid file");
        *slot = Some(child);
    }

    /// Waits until `/health` answers 200; panics with its log if it exits or times out.
    pub async fn wait_ready(&self, client: &reqwest::Client) -> Duration {
        let started = Instant::now();
        loop {
            let ok = client
                .get(format!("http://{}/health", self.addr))
                .timeout(Duration::from_secs(2))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ok {
                return started.elapsed();
            }
            let exited = {
                let mut slot = self.child.lock().expect("child lock");
                slot.as_mut().and_then(|c| c.try_wait().ok().flatten())
            };
            if let Some(status) = exited {
                panic!(
                    "{} exited during start-up ({status}); log:\n{}",
                    self.name,
                    self.log_tail()
                );
            }
            assert!(
                started.elapsed() < STARTUP,
                "{} not ready after {STARTUP:?}; log:\n{}",
                self.name,
                self.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// SIGKILLs the whole process group (a crash: no shutdown, no goodbye on its sockets) and
    /// reaps it. Idempotent.
    pub fn kill(&self) {
        let Some(mut child) = self.child.lock().expect("child lock").take() else {
            return;
        };
        let group = format!("-{}", child.id());
        let _ = Command::new("kill")
            .args(["-KILL", "--", &group])
            .stderr(Stdio::null())
            .status();
        let _ = child.kill();
        let _ = child.wait();
        // The engine core dies with its group; wait until nothing of the group is left, so a
        // restart can bind the same ports.
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline && group_alive(&group) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = std::fs::remove_file(self.log.with_extension("pgid"));
    }

    /// Starts it again on the same ports (after [`Vllm::kill`]).
    pub fn restart(&self) {
        self.kill();
        self.spawn();
    }

    /// The last 40 lines of its log.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

/// Whether any process of the group `-PGID` is alive (`kill -0`).
fn group_alive(group: &str) -> bool {
    Command::new("kill")
        .args(["-0", "--", group])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

impl Drop for Vllm {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("---- {} log ----\n{}", self.name, self.log_tail());
        }
        self.kill();
    }
}
