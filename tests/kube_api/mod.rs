//! A stand-in for the Kubernetes API server that replays recorded responses over real HTTP on
//! loopback: no kube-apiserver can run on these machines. Lists answer with recorded JSON
//! documents; watches answer `200` with a chunked body of JSON lines, one event per chunk, as
//! the API server streams them. The recordings (`tests/data/kubernetes/`) are real API objects
//! (a Deployment's pods, an InferencePool with the status a gateway writes), not a live server.
//!
//! A watch recording may hold `# stage N` lines: the events after one are sent only once the test
//! has called [`ApiServer::stage`] with `N` or more, so a test can observe each step. After its
//! last event a watch either ends (the server's timeout) or stays open. A request the script has
//! no answer left for gets an empty watch that stays open, or a 500 for a list.

#![allow(dead_code)]

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::StreamExt;

/// The bearer token the server expects (401 without it).
pub const TOKEN: &str = "recorded-test-token";

/// One recorded answer.
#[derive(Debug, Clone)]
pub enum Reply {
    /// A plain JSON answer (a list, or an error status).
    Json { status: u16, body: String },
    /// A watch: `(stage, line)` pairs; then end the stream (`end`) or keep it open.
    Watch {
        lines: Vec<(u32, String)>,
        end: bool,
    },
    /// `reply`, once the test has reached `stage` (the request waits until then).
    Later { stage: u32, reply: Box<Reply> },
}

/// A recorded file under `tests/data/kubernetes/`.
pub fn recording(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/kubernetes")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A list answer from a recorded file.
pub fn list(name: &str) -> Reply {
    Reply::Json {
        status: 200,
        body: recording(name),
    }
}

/// A watch answer from a recorded `.jsonl` file (with its `# stage N` markers).
pub fn watch(name: &str, end: bool) -> Reply {
    watch_text(&recording(name), end)
}

/// A watch answer from recorded text.
pub fn watch_text(text: &str, end: bool) -> Reply {
    let mut stage = 0;
    let mut lines = Vec::new();
    for line in text.lines() {
        if let Some(n) = line.strip_prefix("# stage ") {
            stage = n.trim().parse().expect("stage number");
        } else if !line.trim().is_empty() {
            lines.push((stage, line.to_string()));
        }
    }
    Reply::Watch { lines, end }
}

#[derive(Default)]
struct Shared {
    scripts: Mutex<HashMap<String, VecDeque<Reply>>>,
    log: Mutex<Vec<String>>,
    /// When each logged request arrived.
    arrived: Mutex<Vec<tokio::time::Instant>>,
    stage: Option<tokio::sync::watch::Sender<u32>>,
}

/// The recording server.
pub struct ApiServer {
    /// Where it listens (`http://ADDR`).
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The script key of a request: `list` or `watch`, the path, and its selector parameter as sent
/// (percent-encoded), e.g. `watch /api/v1/namespaces/llm/pods labelSelector=app%3Dqwen3-8b`.
pub fn key(kind: &str, path: &str, selector: &str) -> String {
    format!("{kind} {path} {selector}")
}

fn key_of(path: &str, query: &str) -> String {
    let params: Vec<&str> = query.split('&').collect();
    let kind = if params.contains(&"watch=true") {
        "watch"
    } else {
        "list"
    };
    let selector = params
        .iter()
        .find(|p| p.starts_with("labelSelector=") || p.starts_with("fieldSelector="))
        .copied()
        .unwrap_or("");
    key(kind, path, selector)
}

async fn handle(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    shared.log.lock().unwrap().push(format!("{path}?{query}"));
    shared
        .arrived
        .lock()
        .unwrap()
        .push(tokio::time::Instant::now());
    let authorized = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        == Some(&format!("Bearer {TOKEN}"));
    if !authorized {
        return (
            axum::http::StatusCode::UNAUTHORIZED,
            r#"{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"Unauthorized","reason":"Unauthorized","code":401}"#,
        )
            .into_response();
    }
    let key = key_of(&path, &query);
    let mut reply = shared
        .scripts
        .lock()
        .unwrap()
        .get_mut(&key)
        .and_then(VecDeque::pop_front);
    while let Some(Reply::Later {
        stage,
        reply: later,
    }) = reply
    {
        let mut stages = shared.stage.as_ref().unwrap().subscribe();
        let _ = stages.wait_for(|s| *s >= stage).await;
        reply = Some(*later);
    }
    let json = |status: u16, body: String| {
        Response::builder()
            .status(status)
            .header("content-type", "application/json")
            .body(Body::from(body))
            .unwrap()
    };
    match reply {
        Some(Reply::Json { status, body }) => json(status, body),
        Some(Reply::Watch { lines, end }) => {
            let stage = shared.stage.as_ref().unwrap().subscribe();
            let events = futures::stream::iter(lines).then(move |(at, line)| {
                let mut stage = stage.clone();
                async move {
                    let _ = stage.wait_for(|s| *s >= at).await;
                    Ok::<Bytes, std::io::Error>(Bytes::from(format!("{line}\n")))
                }
            });
            let body = if end {
                Body::from_stream(events)
            } else {
                Body::from_stream(events.chain(futures::stream::pending()))
            };
            Response::builder()
                .status(200)
                .header("content-type", "application/json;stream=watch")
                .body(body)
                .unwrap()
        }
        Some(Reply::Later { .. }) => unreachable!("unwrapped above"),
        None if key.starts_with("watch") => Response::builder()
            .status(200)
            .header("content-type", "application/json;stream=watch")
            .body(Body::from_stream(futures::stream::pending::<
                Result<Bytes, std::io::Error>,
            >()))
            .unwrap(),
        None => json(
            500,
            format!(
                r#"{{"kind":"Status","apiVersion":"v1","status":"Failure","message":"no recording for {key}","code":500}}"#
            ),
        ),
    }
}

impl ApiServer {
    /// Starts on `127.0.0.1:0` with an empty script.
    pub async fn start() -> ApiServer {
        let shared = Arc::new(Shared {
            stage: Some(tokio::sync::watch::Sender::new(0)),
            ..Shared::default()
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = axum::Router::new()
            .fallback(handle)
            .with_state(Arc::clone(&shared));
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        ApiServer { addr, shared, task }
    }

    /// Queues `replies` for requests with script key `key` (see [`key`]), answered in order.
    pub fn script(&self, key: String, replies: Vec<Reply>) {
        self.shared
            .scripts
            .lock()
            .unwrap()
            .entry(key)
            .or_default()
            .extend(replies);
    }

    /// Releases the watch events recorded after `# stage N` lines up to `n`.
    pub fn stage(&self, n: u32) {
        self.shared.stage.as_ref().unwrap().send_replace(n);
    }

    /// Every request so far, as `path?query`.
    pub fn requests(&self) -> Vec<String> {
        self.shared.log.lock().unwrap().clone()
    }

    /// When each request containing `needle` arrived, in order.
    pub fn arrivals_with(&self, needle: &str) -> Vec<tokio::time::Instant> {
        let log = self.shared.log.lock().unwrap();
        let arrived = self.shared.arrived.lock().unwrap();
        log.iter()
            .zip(arrived.iter())
            .filter(|(r, _)| r.contains(needle))
            .map(|(_, t)| *t)
            .collect()
    }

    /// The requests whose path and query contain `needle`.
    pub fn requests_with(&self, needle: &str) -> Vec<String> {
        self.requests()
            .into_iter()
            .filter(|r| r.contains(needle))
            .collect()
    }

    /// Writes a kubeconfig for this server (plaintext, the test token, namespace `llm`) into
    /// `dir` and returns its path.
    pub fn kubeconfig(&self, dir: &Path) -> PathBuf {
        let path = dir.join("kubeconfig");
        let text = format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: recordings\n\
             clusters:\n- name: recordings\n  cluster:\n    server: http://{addr}\n\
             users:\n- name: test\n  user:\n    token: {TOKEN}\n\
             contexts:\n- name: recordings\n  context:\n    cluster: recordings\n    user: test\n    namespace: llm\n",
            addr = self.addr
        );
        std::fs::write(&path, text).unwrap();
        path
    }
}
