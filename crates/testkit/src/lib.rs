//! The one process harness of kvrouter's tests and of its benchmark (`kvbench`): real
//! processes — simulated replicas (`kvsim`), `kvrouter serve` and Envoy 1.40 — on ephemeral
//! loopback ports, with readiness polled under deadlines (nothing sleeps a fixed time), logs in
//! files, and every process SIGKILLed and reaped when its handle drops.
//!
//! Two layers:
//! - a core whose functions return `Result<_, HarnessError>`, used by kvbench and by tests
//!   that want to handle a failure: [`Binaries::locate`], [`Replica::start`] /
//!   [`Replica::restart`], [`Router::start`], [`check_config`], [`Envoy::start`],
//!   [`Envoy::wait_for_hosts`], [`poll_until`], [`Metrics::fetch`];
//! - thin panicking conveniences for tests, which fail with the process's log in the message:
//!   [`start_replica`], [`start_router`], [`start_envoy`], [`eventually`], [`Stack`], the
//!   HTTP helpers and the waits on kvrouter's metrics. (`HarnessError`'s `Debug` is its
//!   message, so `.unwrap()` on a core call reads as well.)
//!
//! # Where the binaries come from
//!
//! `kvsim` and `kvrouter` are this workspace's binaries, found beside the running executable
//! (`target/<profile>/`, also when it is a test in `target/<profile>/deps/`): `cargo test
//! --workspace` and `cargo build [--release] --bins` provide them; `$KVSIM_BIN` /
//! `$KVROUTER_BIN` override. Envoy is `$KVROUTER_ENVOY`, else the `.venv/bin/envoy` that `make
//! envoy` installs (kvbench takes `--envoy`). A missing binary is an error that says how to get
//! it; tests fail on it, never skip.
//!
//! # Layout
//!
//! - [`error`]: the error type, [`HarnessError`].
//! - [`paths`]: the binaries, the repository, the shared vLLM capture.
//! - [`proc`]: [`Proc`], a child process with its log, ready lines, kill on drop, CPU seconds.
//! - [`poll`]: [`poll_until`] / [`eventually`] with deadlines.
//! - [`replica`]: kvsim replicas, restartable on the same ports.
//! - [`redis`]: a real `redis-server` for decision sharing, restartable on its port.
//! - [`router`]: kvrouter, its config, `check-config`, readiness.
//! - [`envoy`]: Envoy, its ports and its view of the replica cluster.
//! - [`http`]: request bodies and responses as tests read them.
//! - [`metrics`]: Prometheus expositions (kvrouter's, kvsim's) parsed with labels, histograms.
//! - [`stack`]: replicas + kvrouter + Envoy in one value.

use std::time::Duration;

pub mod envoy;
pub mod error;
pub mod http;
pub mod metrics;
pub mod paths;
pub mod poll;
pub mod proc;
pub mod redis;
pub mod replica;
pub mod router;
pub mod stack;

pub use envoy::{envoy_options, envoy_yaml, start_envoy, with_routers, Envoy, EXTPROC_CLUSTERS};
pub use error::HarnessError;
pub use http::{
    assert_complete_stream, chat_body, completion_body, post, reply, split_upload, sse_events,
    Reply,
};
pub use metrics::{
    assert_in_flight_drains, metric_sum, router_metrics, wait_for_decisions, wait_for_in_flight,
    Histogram, Metrics, Series,
};
pub use paths::{
    binaries, default_envoy, envoy_bin, kvrouter_bin, kvsim_bin, repo, shared_fixture,
    workspace_bin, Binaries,
};
pub use poll::{eventually, poll_until, wait_http};
pub use proc::{cpu_seconds_of, own_cpu_s, Proc};
pub use redis::Redis;
pub use replica::{start_replica, Replica, ReplicaSpec, KV_EVENTS_BIND};
pub use router::{
    check_config, router_config, router_config_with_pool, start_router, ConfigEndpoint, Router,
};
pub use stack::{candidate_row, Stack, StackOptions};

/// The model every test replica serves unless told otherwise.
pub const MODEL: &str = "demo-model";

/// How long any one process may take to come up (and Envoy to learn its hosts).
pub const STARTUP: Duration = Duration::from_secs(30);
