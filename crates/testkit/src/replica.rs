//! One simulated vLLM replica: a `kvsim` process started from command-line flags on an
//! ephemeral loopback port, restartable on the same ports with a cold cache.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{HarnessError, Proc, MODEL};

/// Where a replica that publishes KV events binds its ZMQ socket on its first start: loopback,
/// an ephemeral port. (kvsim follows vLLM's rule, binding only wildcard hosts, unless told
/// `--kv-events-bind`, which the harness always passes.)
pub const KV_EVENTS_BIND: &str = "tcp://127.0.0.1:0";

/// How to start one kvsim replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaSpec {
    /// Its name (`--name`; the `x-kvsim-replica` response header).
    pub name: String,
    /// Served models (`--model`, repeated). Default `[MODEL]`.
    pub models: Vec<String>,
    /// Publish KV events on an ephemeral port ([`KV_EVENTS_BIND`]). Default false.
    pub kv_events: bool,
    /// Further kvsim flags (`--time-scale`, `--tokenizer`, ...). Not `--name`, `--listen`,
    /// `--model`, `--kv-events` or `--fleet`: the harness sets those.
    pub flags: Vec<String>,
    /// `RUST_LOG` of the process; `None` (default) inherits the caller's.
    pub log_filter: Option<String>,
}

impl ReplicaSpec {
    /// A replica named `name` serving [`MODEL`], with kvsim's defaults otherwise.
    pub fn new(name: impl Into<String>) -> ReplicaSpec {
        ReplicaSpec {
            name: name.into(),
            models: vec![MODEL.into()],
            kv_events: false,
            flags: Vec::new(),
            log_filter: None,
        }
    }

    /// Adds the flag `--<flag> <value>` (e.g. `.flag("time-scale", 100)`).
    pub fn flag(mut self, flag: &str, value: impl ToString) -> ReplicaSpec {
        self.flags.push(format!("--{flag}"));
        self.flags.push(value.to_string());
        self
    }

    /// Publishes KV events (see [`KV_EVENTS_BIND`]).
    pub fn with_kv_events(mut self) -> ReplicaSpec {
        self.kv_events = true;
        self
    }
}

/// A running (or killed) kvsim replica. The process is SIGKILLed when this is dropped.
#[derive(Debug)]
pub struct Replica {
    /// Its name.
    pub name: String,
    /// Its HTTP address (the same after a restart).
    pub addr: SocketAddr,
    /// Where subscribers connect for its KV events (`tcp://127.0.0.1:PORT`), when publishing.
    pub kv_events: Option<String>,
    spec: ReplicaSpec,
    bin: PathBuf,
    dir: PathBuf,
    proc: Option<Proc>,
    cpu_before_s: f64,
}

impl Replica {
    /// Starts `bin` (kvsim) per `spec` on `127.0.0.1:0`, its log in `dir`, and waits for its
    /// "listening" line.
    pub fn start(bin: &Path, dir: &Path, spec: ReplicaSpec) -> Result<Replica, HarnessError> {
        let listen = SocketAddr::from(([127, 0, 0, 1], 0));
        let kv = spec.kv_events.then_some(KV_EVENTS_BIND);
        let (proc, addr, kv_events) = spawn(bin, dir, &spec, listen, kv)?;
        if spec.kv_events && kv_events.is_none() {
            return Err(proc.not_ready("no kv_events endpoint in its listening line"));
        }
        Ok(Replica {
            name: spec.name.clone(),
            addr,
            kv_events,
            spec,
            bin: bin.to_path_buf(),
            dir: dir.to_path_buf(),
            proc: Some(proc),
            cpu_before_s: 0.0,
        })
    }

    /// SIGKILLs it (no clean shutdown, as a crash). Idempotent.
    pub fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            self.cpu_before_s += p.cpu_s();
            p.kill();
        }
    }

    /// Kills it if running and starts it again on the same HTTP and KV-event ports, with an
    /// empty cache. Its log continues in the same file.
    pub fn restart(&mut self) -> Result<(), HarnessError> {
        self.kill();
        // Rebind the port the first start got, on loopback.
        let kv = self
            .kv_events
            .as_deref()
            .and_then(|e| e.rsplit_once(':'))
            .map(|(_, port)| format!("tcp://127.0.0.1:{port}"));
        let (proc, addr, kv_events) =
            spawn(&self.bin, &self.dir, &self.spec, self.addr, kv.as_deref())?;
        if addr != self.addr || kv_events != self.kv_events {
            return Err(proc.not_ready(format!(
                "came back on {addr} / {kv_events:?}, not {} / {:?}",
                self.addr, self.kv_events
            )));
        }
        self.proc = Some(proc);
        Ok(())
    }

    /// Whether its process is running (false once killed, until restarted).
    pub fn is_running(&mut self) -> bool {
        self.proc.as_mut().is_some_and(Proc::alive)
    }

    /// The current process, until killed.
    pub fn proc(&self) -> Option<&Proc> {
        self.proc.as_ref()
    }

    /// User + system CPU seconds of every incarnation so far.
    pub fn cpu_s(&self) -> f64 {
        self.cpu_before_s + self.proc.as_ref().map_or(0.0, Proc::cpu_s)
    }
}

fn spawn(
    bin: &Path,
    dir: &Path,
    spec: &ReplicaSpec,
    listen: SocketAddr,
    kv_events: Option<&str>,
) -> Result<(Proc, SocketAddr, Option<String>), HarnessError> {
    let mut cmd = Command::new(bin);
    cmd.args(["--name", &spec.name, "--listen", &listen.to_string()]);
    for m in &spec.models {
        cmd.args(["--model", m]);
    }
    if let Some(endpoint) = kv_events {
        cmd.args(["--kv-events", endpoint, "--kv-events-bind"]);
    }
    cmd.args(&spec.flags);
    if let Some(filter) = &spec.log_filter {
        cmd.env("RUST_LOG", filter);
    }
    let (proc, lines) = Proc::spawn(&spec.name, cmd, dir, 1)?;
    let line = &lines[0];
    let Some(addr) = line["addr"].as_str().and_then(|a| a.parse().ok()) else {
        return Err(proc.not_ready(format!("no addr in its listening line {line}")));
    };
    let kv = line["kv_events"].as_str().map(str::to_string);
    Ok((proc, addr, kv))
}

/// [`Replica::start`] with the workspace's kvsim, for tests: panics with the log on failure.
pub fn start_replica(dir: &Path, spec: ReplicaSpec) -> Replica {
    Replica::start(&crate::kvsim_bin(), dir, spec).unwrap_or_else(|e| panic!("{e}"))
}
