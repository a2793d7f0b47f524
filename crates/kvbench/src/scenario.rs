//! Scenario events during a run: kill, restart, add a replica, make one fail or stall. They run
//! on their own task against the run's fleet, at simulated times on the run's clock.

use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use super::client::SimClock;
use super::plan::{Action, EventSpec, ReplicaGroup};
use super::routercfg::EndpointInfo;
use super::scrape::Targets;
use super::BenchError;
use testkit::{Replica, ReplicaSpec, Router};

/// What happened, and when (simulated ms on the run's clock).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventRecord {
    /// When it was done.
    pub at_ms: f64,
    /// The action.
    pub action: Action,
    /// The replica's name.
    pub replica: String,
    /// The outcome (`ok` or an error message).
    pub outcome: String,
}

/// Builds a replica's kvsim flags from its group and name.
pub type MakeSpec = Box<dyn Fn(&ReplicaGroup, String) -> ReplicaSpec + Send + Sync>;
/// Renders kvrouter's config for a replica list.
pub type RenderRouter = Box<dyn Fn(&[EndpointInfo]) -> String + Send + Sync>;

/// The run's mutable fleet.
pub struct Fleet {
    /// Every replica started in this run (added ones at the end).
    pub replicas: Vec<Replica>,
    /// kvsim binary.
    pub kvsim: PathBuf,
    /// Run directory (logs, fleet files).
    pub dir: PathBuf,
    /// Builds a replica's kvsim flags from a group and a name.
    pub make_spec: MakeSpec,
    /// Renders the router config for a replica list.
    pub render_router: RenderRouter,
    /// The first group (default settings of an added replica).
    pub default_group: ReplicaGroup,
}

impl Fleet {
    /// The router's view of the replicas.
    pub fn endpoints(&self) -> Vec<EndpointInfo> {
        self.replicas
            .iter()
            .map(|r| EndpointInfo {
                name: r.name.clone(),
                address: r.addr,
                kv_events: r.kv_events.clone(),
            })
            .collect()
    }
}

/// Runs `events` at their times; returns what was done.
pub async fn run_events(
    events: Vec<EventSpec>,
    fleet: Arc<Mutex<Fleet>>,
    routers: Arc<Vec<Router>>,
    targets: Targets,
    clock: SimClock,
) -> Vec<EventRecord> {
    let mut events = events;
    events.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
    // Admin calls are bounded, so the run's wait for its events is too.
    let client = reqwest::Client::builder()
        .timeout(testkit::STARTUP)
        .build()
        .unwrap_or_default();
    let mut out = Vec::new();
    for e in events {
        tokio::time::sleep_until(clock.instant(e.at_s * 1000.0).into()).await;
        let at_ms = clock.now_ms();
        let real_ms = (e.duration_s * 1000.0 / clock.scale).round() as u64;
        let (replica, result) = match e.action {
            Action::Kill | Action::Restart | Action::Add => {
                let fleet = Arc::clone(&fleet);
                let routers = Arc::clone(&routers);
                let targets = Arc::clone(&targets);
                let e2 = e.clone();
                tokio::task::spawn_blocking(move || process_event(&e2, &fleet, &routers, &targets))
                    .await
                    .unwrap_or_else(|j| (String::new(), Err(BenchError::Process(j.to_string()))))
            }
            Action::Fail | Action::Stall => {
                let (name, addr) = {
                    let f = fleet.lock();
                    match f.replicas.get(e.replica) {
                        Some(r) => (r.name.clone(), r.addr),
                        None => (
                            format!("r{}", e.replica),
                            "0.0.0.0:0".parse().expect("addr"),
                        ),
                    }
                };
                let (path, body) = if e.action == Action::Fail {
                    (
                        "fail",
                        serde_json::json!({"status": 500, "duration_ms": real_ms}),
                    )
                } else {
                    ("stall", serde_json::json!({"duration_ms": real_ms}))
                };
                let r = client
                    .post(format!("http://{addr}/admin/{path}"))
                    .json(&body)
                    .send()
                    .await
                    .map_err(|e| BenchError::Process(e.to_string()))
                    .and_then(|r| {
                        r.error_for_status()
                            .map(|_| ())
                            .map_err(|e| BenchError::Process(e.to_string()))
                    });
                (name, r)
            }
        };
        out.push(EventRecord {
            at_ms,
            action: e.action,
            replica,
            outcome: match result {
                Ok(()) => "ok".into(),
                Err(err) => err.to_string(),
            },
        });
    }
    out
}

fn process_event(
    e: &EventSpec,
    fleet: &Mutex<Fleet>,
    routers: &[Router],
    targets: &Targets,
) -> (String, Result<(), BenchError>) {
    let mut f = fleet.lock();
    match e.action {
        Action::Kill => match f.replicas.get_mut(e.replica) {
            Some(r) => {
                r.kill();
                (r.name.clone(), Ok(()))
            }
            None => (
                format!("r{}", e.replica),
                Err(BenchError::Process("no such replica".into())),
            ),
        },
        Action::Restart => match f.replicas.get_mut(e.replica) {
            Some(r) => (r.name.clone(), r.restart().map_err(BenchError::from)),
            None => (
                format!("r{}", e.replica),
                Err(BenchError::Process("no such replica".into())),
            ),
        },
        Action::Add => {
            let name = format!("r{}", f.replicas.len());
            let group = e.group.clone().unwrap_or_else(|| f.default_group.clone());
            let spec = (f.make_spec)(&group, name.clone());
            let result = Replica::start(&f.kvsim, &f.dir, spec).and_then(|r| {
                targets.write().push((r.name.clone(), r.addr));
                f.replicas.push(r);
                let yaml = (f.render_router)(&f.endpoints());
                routers.iter().try_for_each(|r| r.rewrite_config(&yaml))
            });
            let result = result.map_err(BenchError::from);
            (name, result)
        }
        Action::Fail | Action::Stall => (String::new(), Ok(())),
    }
}
