//! The `kvsim` binary's logs: human-readable lines on stderr (stdout carries the
//! `{"event":"listening",...}` lines a harness reads), filtered by `RUST_LOG`, default `info`.

use tracing_subscriber::EnvFilter;

/// Installs the process-wide subscriber; a second call (or one after another subscriber was
/// installed, as in tests) changes nothing.
pub fn init_logging() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}
