//! A child process of the harness: started with its output in a log file, ready once it has
//! printed its JSON "listening" lines, SIGKILLed and reaped when dropped, and its CPU time read
//! from `/proc`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Instant;

use crate::{HarnessError, STARTUP};

/// Lines of a log shown in errors and, when a test panics, on stderr.
const LOG_TAIL_LINES: usize = 60;

/// A child process, SIGKILLed and reaped on drop. Its stderr (and its stdout, when it reports
/// nothing there) is appended to `<dir>/<name>.log`; if the dropping thread is panicking (a
/// failed test), the log's tail is printed first.
#[derive(Debug)]
pub struct Proc {
    /// The name used in messages and for the log file.
    pub name: String,
    child: Option<Child>,
    log: PathBuf,
}

impl Proc {
    /// Spawns `cmd` in the harness's way and waits (at most [`STARTUP`]) until it has printed
    /// `ready_lines` JSON lines on stdout (kvsim's and kvrouter's "listening" lines); returns
    /// them. Non-JSON stdout lines are ignored. With `ready_lines == 0` nothing is awaited.
    pub fn spawn(
        name: &str,
        mut cmd: Command,
        dir: &Path,
        ready_lines: usize,
    ) -> Result<(Proc, Vec<serde_json::Value>), HarnessError> {
        let log = dir.join(format!("{name}.log"));
        let open = || {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log)
                .map_err(HarnessError::io(format!("open {}", log.display())))
        };
        let stdout = if ready_lines > 0 {
            Stdio::piped()
        } else {
            Stdio::from(open()?)
        };
        cmd.stdout(stdout).stderr(open()?).stdin(Stdio::null());
        let mut child = cmd.spawn().map_err(|source| HarnessError::Spawn {
            name: name.into(),
            source,
        })?;
        let stdout = child.stdout.take();
        let mut proc = Proc {
            name: name.into(),
            child: Some(child),
            log,
        };
        let mut got = Vec::new();
        let Some(stdout) = stdout else {
            return Ok((proc, got));
        };
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
        while got.len() < ready_lines {
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(v) => got.push(v),
                Err(e) => {
                    let why = match (e, proc.exit_status()) {
                        (_, Some(status)) => format!("exited with {status}"),
                        (mpsc::RecvTimeoutError::Timeout, None) => {
                            format!("no ready line within {STARTUP:?}")
                        }
                        (mpsc::RecvTimeoutError::Disconnected, None) => "closed its stdout".into(),
                    };
                    return Err(proc.not_ready(why));
                }
            }
        }
        Ok((proc, got))
    }

    /// A [`HarnessError::NotReady`] for this process, with its log's tail.
    pub fn not_ready(&self, why: impl Into<String>) -> HarnessError {
        HarnessError::NotReady {
            name: self.name.clone(),
            why: why.into(),
            log: self.log.clone(),
            tail: self.log_tail(),
        }
    }

    /// The log file.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The last lines of the log.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
    }

    /// The OS process id, until killed.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILLs the process now and reaps it (no zombie is left). Idempotent.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Whether it still runs.
    pub fn alive(&mut self) -> bool {
        self.child.is_some() && self.exit_status().is_none()
    }

    /// Its exit status, once it has exited by itself.
    fn exit_status(&mut self) -> Option<std::process::ExitStatus> {
        self.child.as_mut()?.try_wait().ok().flatten()
    }

    /// User + system CPU seconds it has used so far (Linux `/proc`; 0 elsewhere or once
    /// killed).
    pub fn cpu_s(&self) -> f64 {
        self.pid().map_or(0.0, cpu_seconds_of)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "---- {} log ({}) ----\n{}",
                self.name,
                self.log.display(),
                self.log_tail()
            );
        }
        self.kill();
    }
}

/// User + system CPU seconds of process `pid` (Linux `/proc/<pid>/stat`), 0 if unknown.
pub fn cpu_seconds_of(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // The command name is parenthesised and may hold spaces: count fields after its `)`.
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return 0.0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / CLOCK_TICKS_PER_S
}

/// CPU seconds this process has used so far.
pub fn own_cpu_s() -> f64 {
    cpu_seconds_of(std::process::id())
}

/// `sysconf(_SC_CLK_TCK)`: 100 on every Linux this runs on (it has been for all mainstream
/// architectures for decades), so no libc call for it.
const CLOCK_TICKS_PER_S: f64 = 100.0;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_that_exits_before_its_ready_line_is_an_error_with_its_log() {
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo not json; echo boom >&2; exit 3"]);
        let err = Proc::spawn("quitter", cmd, dir.path(), 1).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("quitter did not come up"), "{text}");
        assert!(text.contains("boom"), "the log's tail: {text}");
    }

    #[test]
    fn ready_lines_are_returned_and_the_process_is_killed_and_reaped_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = Command::new("sh");
        cmd.args(["-c", r#"echo '{"addr":"127.0.0.1:1"}'; exec sleep 600"#]);
        let (mut proc, lines) = Proc::spawn("sleeper", cmd, dir.path(), 1).unwrap();
        assert_eq!(lines, [serde_json::json!({"addr": "127.0.0.1:1"})]);
        assert!(proc.alive());
        let pid = proc.pid().unwrap();
        assert!(Path::new(&format!("/proc/{pid}")).exists());
        drop(proc);
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "killed and reaped: no zombie left in /proc"
        );
    }

    #[test]
    fn cpu_seconds_are_read_from_proc() {
        // Spin until the kernel has accounted at least one clock tick to this process.
        let start = Instant::now();
        let mut x = 0u64;
        while own_cpu_s() == 0.0 {
            assert!(start.elapsed() < STARTUP, "no CPU time accounted");
            for _ in 0..100_000 {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
            }
        }
        assert_eq!(cpu_seconds_of(u32::MAX), 0.0, "no such process");
    }
}
