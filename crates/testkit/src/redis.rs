//! A real `redis-server` for the decision-sharing tests and benchmark runs: on a free loopback
//! port, no persistence, its log in the run's directory, SIGKILLed when dropped, restartable on
//! the same port (an outage and its end).
//!
//! The binary is `$KVROUTER_REDIS`, else `redis-server` on `PATH` (Debian's `redis-server`,
//! installed by `make redis`, which `make test` runs). A missing binary is an error saying so:
//! tests fail on it, never skip.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::{HarnessError, Proc, STARTUP};

/// A running `redis-server`.
#[derive(Debug)]
pub struct Redis {
    /// Where it listens (`127.0.0.1`).
    pub addr: SocketAddr,
    bin: PathBuf,
    dir: PathBuf,
    proc: Option<Proc>,
}

/// The `redis-server` binary: `$KVROUTER_REDIS`, else the first `redis-server` on `PATH`.
pub fn redis_bin() -> Result<PathBuf, HarnessError> {
    if let Some(p) = std::env::var_os("KVROUTER_REDIS") {
        return Ok(PathBuf::from(p));
    }
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|dir| dir.join("redis-server"))
        .find(|p| p.is_file())
        .ok_or_else(|| HarnessError::NotFound {
            what: "redis-server".into(),
            path: PathBuf::from("redis-server (on PATH)"),
            hint: "run `make redis` (Debian's redis-server, apt) or set KVROUTER_REDIS".into(),
        })
}

impl Redis {
    /// Starts `redis-server` on a free `127.0.0.1` port, its log in `dir`, and waits (at most
    /// [`STARTUP`]) until it answers `PING`.
    pub fn start(dir: &Path) -> Result<Redis, HarnessError> {
        let bin = redis_bin()?;
        let mut last = None;
        // The port is free when picked and taken by redis a moment later; another process may
        // win it in between, so a start that fails is tried on another port.
        for _ in 0..3 {
            let port = TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map_err(HarnessError::io("pick a free port"))?
                .port();
            let mut r = Redis {
                addr: SocketAddr::from(([127, 0, 0, 1], port)),
                bin: bin.clone(),
                dir: dir.to_path_buf(),
                proc: None,
            };
            match r.restart() {
                Ok(()) => return Ok(r),
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("tried at least once"))
    }

    /// The URL kvrouter's `sharing.redis` takes.
    pub fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// SIGKILLs it (an outage); [`Redis::restart`] brings it back on the same port.
    pub fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }

    /// SIGSTOPs it: connections stay open and nothing answers (a Redis too slow to serve).
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// SIGCONTs it after [`Redis::pause`].
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        if let Some(pid) = self.proc.as_ref().and_then(Proc::pid) {
            let _ = Command::new("kill").arg(sig).arg(pid.to_string()).status();
        }
    }

    /// Starts it again on its port (empty: no persistence) and waits until it answers.
    pub fn restart(&mut self) -> Result<(), HarnessError> {
        self.kill();
        let mut cmd = Command::new(&self.bin);
        cmd.args(["--bind", "127.0.0.1", "--port"])
            .arg(self.addr.port().to_string())
            .args([
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "yes",
            ])
            .arg("--dir")
            .arg(&self.dir);
        let (mut proc, _) = Proc::spawn("redis", cmd, &self.dir, 0)?;
        let deadline = Instant::now() + STARTUP;
        loop {
            if ping(self.addr) {
                self.proc = Some(proc);
                return Ok(());
            }
            if !proc.alive() {
                return Err(proc.not_ready("exited"));
            }
            if Instant::now() >= deadline {
                return Err(proc.not_ready(format!("no PONG within {STARTUP:?}")));
            }
            std::thread::sleep(crate::poll::POLL_INTERVAL);
        }
    }
}

/// Whether a Redis server at `addr` answers `PING` with `+PONG`.
pub fn ping(addr: SocketAddr) -> bool {
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(1)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
    let mut buf = [0u8; 7];
    s.write_all(b"PING\r\n").is_ok() && s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
}
