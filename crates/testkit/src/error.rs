//! The harness's one error type. Every `Result` API of the crate returns it; the panicking
//! conveniences panic with its message.

use std::path::PathBuf;
use std::time::Duration;

/// Why a process could not be started, did not come up, or could not be read.
///
/// `Debug` prints the same text as `Display` (message, log path and log tail), so a test's
/// `.unwrap()` or `.expect()` shows a readable failure rather than a struct dump.
#[derive(thiserror::Error)]
pub enum HarnessError {
    /// A binary is missing.
    #[error("{what} not found at {path}: {hint}")]
    NotFound {
        /// Which binary (`kvsim`, `kvrouter`, `Envoy`).
        what: String,
        /// Where it was looked for.
        path: PathBuf,
        /// How to provide it.
        hint: String,
    },
    /// The OS could not start the process.
    #[error("cannot start {name}: {source}")]
    Spawn {
        /// The process's name in the harness.
        name: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The process exited, or did not report ready within its deadline.
    #[error("{name} did not come up ({why}); log {}:\n{tail}", log.display())]
    NotReady {
        /// The process's name in the harness.
        name: String,
        /// What was missing: a ready line, an exit status, an address.
        why: String,
        /// Its log file.
        log: PathBuf,
        /// The last lines of its log.
        tail: String,
    },
    /// A polled condition did not hold before its deadline.
    #[error("timed out after {timeout:?} waiting for {what}")]
    Timeout {
        /// The condition, in words.
        what: String,
        /// How long it was polled.
        timeout: Duration,
    },
    /// A rendered config could not be rewritten.
    #[error("config: {message}")]
    Config {
        /// What was wrong.
        message: String,
    },
    /// kvrouter's `check-config` rejected a config; `message` is its stderr.
    #[error("kvrouter rejected the config: {message}")]
    ConfigRejected {
        /// What `kvrouter check-config` said.
        message: String,
    },
    /// A metrics text that is not valid Prometheus exposition.
    #[error("invalid Prometheus text from {origin}: {message}")]
    Metrics {
        /// Where the text came from (a URL, or `text`).
        origin: String,
        /// The parser's message.
        message: String,
    },
    /// An HTTP request of the harness failed.
    #[error("{url}: {message}")]
    Http {
        /// The URL.
        url: String,
        /// The client's error or the unexpected status.
        message: String,
    },
    /// Reading or writing a file of the harness (configs, logs).
    #[error("{what}: {source}")]
    Io {
        /// The file and the operation.
        what: String,
        /// The OS error.
        source: std::io::Error,
    },
}

impl std::fmt::Debug for HarnessError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

impl HarnessError {
    /// An [`HarnessError::Io`] for `what` (e.g. `"write /tmp/x/kvrouter.yaml"`).
    pub fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> HarnessError {
        let what = what.into();
        move |source| HarnessError::Io { what, source }
    }
}
