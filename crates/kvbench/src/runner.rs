//! The load generator: sends a trace open loop (each request at its scheduled time, whatever
//! the earlier ones are doing), with a concurrency cap, conversation turns chained to the
//! previous turn's end, and a progress bar. Every trace request yields exactly one record;
//! requests still open at the drain deadline are cancelled and recorded as errors.

use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use tokio::sync::{mpsc, watch, Semaphore};

use super::client::{self, RequestRecord, SimClock};
use super::workload::{Start, Trace};

/// How to send a trace.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Base URL, e.g. `http://127.0.0.1:8080`.
    pub base_url: String,
    /// Model name in bodies.
    pub model: String,
    /// Most requests in flight.
    pub max_concurrency: usize,
    /// Real time allowed after the last timed arrival before open requests are cancelled.
    pub drain_timeout: Duration,
    /// Show a progress bar (stderr).
    pub progress: bool,
    /// Label of the progress bar.
    pub label: String,
    /// Replica base URLs for requests that bypass the router (round-robin by request id).
    pub direct_urls: Vec<String>,
    /// Prefix of the `x-request-id` each request carries (`<prefix><id>`), so the router's
    /// recorded decisions can be matched to trace requests. `None`: no header.
    pub request_id_prefix: Option<String>,
}

struct Shared {
    client: reqwest::Client,
    url: String,
    direct: Vec<String>,
    request_id_prefix: Option<String>,
    model: String,
    clock: SimClock,
    permits: Arc<Semaphore>,
    trace: Arc<Trace>,
    next_turns: Vec<Vec<usize>>,
    records: mpsc::UnboundedSender<RequestRecord>,
    cancel: watch::Receiver<bool>,
}

/// Sends `trace` starting at `clock.t0` and returns one record per request, in id order.
pub async fn run(trace: Arc<Trace>, clock: SimClock, o: &RunOptions) -> Vec<RequestRecord> {
    let n = trace.requests.len();
    let mut next_turns = vec![Vec::new(); n];
    let mut timed: Vec<(f64, usize)> = Vec::new();
    for r in &trace.requests {
        match r.start {
            Start::At(ms) => timed.push((ms, r.id)),
            Start::After { prev, .. } if prev < n => next_turns[prev].push(r.id),
            Start::After { .. } => timed.push((0.0, r.id)),
        }
    }
    timed.sort_by(|a, b| a.0.total_cmp(&b.0));
    let last_arrival_ms = timed.last().map_or(0.0, |t| t.0);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let (cancel_tx, cancel_rx) = watch::channel(false);
    let shared = Arc::new(Shared {
        client: reqwest::Client::builder()
            .pool_max_idle_per_host(o.max_concurrency)
            .tcp_nodelay(true)
            .build()
            .unwrap_or_default(),
        url: format!("{}/v1/chat/completions", o.base_url.trim_end_matches('/')),
        direct: o
            .direct_urls
            .iter()
            .map(|u| format!("{}/v1/chat/completions", u.trim_end_matches('/')))
            .collect(),
        request_id_prefix: o.request_id_prefix.clone(),
        model: o.model.clone(),
        clock,
        permits: Arc::new(Semaphore::new(o.max_concurrency.max(1))),
        trace: Arc::clone(&trace),
        next_turns,
        records: tx,
        cancel: cancel_rx,
    });
    let bar = if o.progress {
        let bar = ProgressBar::new(n as u64);
        bar.set_style(
            ProgressStyle::with_template(
                "{prefix:>32} [{bar:30}] {pos}/{len} {elapsed_precise} {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        bar.set_prefix(o.label.clone());
        bar
    } else {
        ProgressBar::hidden()
    };

    let dispatcher = {
        let shared = Arc::clone(&shared);
        tokio::spawn(async move {
            for (ms, id) in timed {
                tokio::time::sleep_until(shared.clock.instant(ms).into()).await;
                if *shared.cancel.borrow() {
                    break;
                }
                spawn_request(&shared, id, ms);
            }
        })
    };
    drop(shared);

    let deadline = clock.instant(last_arrival_ms) + o.drain_timeout;
    let mut records: Vec<Option<RequestRecord>> = vec![None; n];
    let mut got = 0;
    let mut errors = 0;
    let mut cancelled = false;
    while got < n {
        let wait = if cancelled {
            // Cancelled requests report at once; follow-ups of cancelled turns too.
            Duration::from_secs(5)
        } else {
            deadline.saturating_duration_since(Instant::now())
        };
        match tokio::time::timeout(wait, rx.recv()).await {
            Ok(Some(r)) => {
                if !r.ok() {
                    errors += 1;
                    bar.set_message(format!("errors {errors}"));
                }
                let id = r.id;
                if id < n && records[id].is_none() {
                    records[id] = Some(r);
                    got += 1;
                    bar.inc(1);
                }
            }
            Ok(None) => break,
            Err(_) if !cancelled => {
                cancelled = true;
                let _ = cancel_tx.send(true);
            }
            Err(_) => break,
        }
    }
    dispatcher.abort();
    bar.finish_and_clear();
    let now = clock.now_ms();
    records
        .into_iter()
        .enumerate()
        .map(|(id, r)| {
            r.unwrap_or_else(|| {
                let t = &trace.requests[id];
                RequestRecord {
                    id,
                    group: t.group,
                    tenant: t.tenant.clone(),
                    scheduled_ms: now,
                    sent_ms: now,
                    headers_ms: None,
                    first_token_ms: None,
                    end_ms: now,
                    status: 0,
                    error: Some("never sent: the run was cancelled at the drain deadline".into()),
                    replica: None,
                    prompt_tokens: None,
                    cached_tokens: None,
                    completion_tokens: None,
                    bypassed: false,
                    objective: t.objective.clone(),
                    retry_after: None,
                }
            })
        })
        .collect()
}

/// Sends request `id` (scheduled at simulated `scheduled_ms`) in its own task; when it ends,
/// schedules the conversation's next turn.
fn spawn_request(shared: &Arc<Shared>, id: usize, scheduled_ms: f64) {
    let shared = Arc::clone(shared);
    tokio::spawn(async move {
        let req = &shared.trace.requests[id];
        let mut cancel = shared.cancel.clone();
        let record = |sent_ms: f64, end_ms: f64, o: client::Outcome| RequestRecord {
            id,
            group: req.group,
            tenant: req.tenant.clone(),
            scheduled_ms,
            sent_ms,
            headers_ms: o.headers.map(|t| shared.clock.ms(t)),
            first_token_ms: o.first_token.map(|t| shared.clock.ms(t)),
            end_ms,
            status: o.status,
            error: o.error,
            replica: o.replica,
            prompt_tokens: o.prompt_tokens,
            cached_tokens: o.cached_tokens,
            completion_tokens: o.completion_tokens,
            bypassed: req.bypass && !shared.direct.is_empty(),
            objective: req.objective.clone(),
            retry_after: o.retry_after,
        };
        let cancelled = |at: f64| {
            let o = client::Outcome {
                error: Some("cancelled at the drain deadline".into()),
                ..client::Outcome::default()
            };
            record(at, at, o)
        };
        let permit = tokio::select! {
            p = Arc::clone(&shared.permits).acquire_owned() => p.ok(),
            _ = cancel.wait_for(|c| *c) => None,
        };
        let result = match permit {
            None => cancelled(shared.clock.now_ms()),
            Some(_permit) => {
                let sent_ms = shared.clock.now_ms();
                let body = serde_json::to_vec(&req.body(&shared.model)).unwrap_or_default();
                let tenant_header = shared.trace.tenant_header.as_deref();
                let mut headers: Vec<(&str, &str)> = match (tenant_header, req.tenant.as_deref()) {
                    (Some(h), Some(t)) => vec![(h, t)],
                    _ => Vec::new(),
                };
                let request_id = shared
                    .request_id_prefix
                    .as_ref()
                    .map(|p| format!("{p}{id}"));
                if let Some(rid) = &request_id {
                    headers.push(("x-request-id", rid));
                }
                if let (Some(h), Some(o)) = (
                    shared.trace.objective_header.as_deref(),
                    req.objective.as_deref(),
                ) {
                    headers.push((h, o));
                }
                let url = if req.bypass && !shared.direct.is_empty() {
                    &shared.direct[id % shared.direct.len()]
                } else {
                    &shared.url
                };
                tokio::select! {
                    o = client::send(&shared.client, url, &headers, body) => {
                        record(sent_ms, shared.clock.now_ms(), o)
                    }
                    _ = cancel.wait_for(|c| *c) => cancelled(sent_ms),
                }
            }
        };
        let end_ms = result.end_ms;
        let _ = shared.records.send(result);
        for &next in &shared.next_turns[id] {
            let think_ms = match shared.trace.requests[next].start {
                Start::After { think_ms, .. } => think_ms,
                Start::At(_) => 0.0,
            };
            let at = end_ms + think_ms;
            let follow = Arc::clone(&shared);
            tokio::spawn(async move {
                let mut cancel = follow.cancel.clone();
                tokio::select! {
                    _ = tokio::time::sleep_until(follow.clock.instant(at).into()) => {}
                    _ = cancel.wait_for(|c| *c) => {}
                }
                spawn_request(&follow, next, at);
            });
        }
    });
}
