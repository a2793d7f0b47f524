//! Observability end to end, through real Envoy: decision spans exported over OTLP/gRPC to a
//! receiver this test serves (the OTLP protos on tonic), continuing the client's `traceparent`;
//! kvrouter's own gRPC API (`kvrouter.v1`) behind the admin token, with `PushKvEvents` moving a
//! decision as a ZMQ event does; the admin HTTP `/debug/*` routes behind the same token; and the
//! Grafana dashboard in `deploy/` naming only metrics a running router exports.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvrouter::api::pb;
use kvrouter::envoyconf::{self, BodyMode, ClusterStyle};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use testkit::*;
use tonic::{Code, Request, Response, Status};

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT_SPAN_ID: &str = "00f067aa0ba902b7";
/// Text that must never leave the router in a span.
const PROMPT_MARKER: &str = "zebra-marker-5521";
const TENANT: &str = "tenant-secret-7";
const TOKEN: &str = "admin-token-for-the-test";

/// An OTLP/gRPC trace collector keeping every span it receives, with its service name.
#[derive(Clone, Default)]
struct Receiver {
    spans: Arc<parking_lot::Mutex<Vec<(String, Span)>>>,
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        let mut spans = self.spans.lock();
        for rs in request.into_inner().resource_spans {
            let service = rs
                .resource
                .as_ref()
                .and_then(|r| attr(&r.attributes, "service.name"))
                .map(|v| v.to_string())
                .unwrap_or_default();
            for ss in rs.scope_spans {
                spans.extend(ss.spans.into_iter().map(|s| (service.clone(), s)));
            }
        }
        Ok(Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

impl Receiver {
    /// Serves on an ephemeral loopback port; returns the receiver and its address.
    async fn start() -> (Receiver, SocketAddr) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let receiver = Receiver::default();
        let service = TraceServiceServer::new(receiver.clone());
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
        );
        (receiver, addr)
    }
}

/// An attribute's value, as text.
fn attr(attributes: &[KeyValue], key: &str) -> Option<String> {
    let kv = attributes.iter().find(|kv| kv.key == key)?;
    Some(match kv.value.as_ref()?.value.as_ref()? {
        Value::StringValue(s) => s.clone(),
        Value::IntValue(i) => i.to_string(),
        Value::DoubleValue(d) => d.to_string(),
        Value::BoolValue(b) => b.to_string(),
        other => format!("{other:?}"),
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn chat(model: &str, question: &str) -> String {
    serde_json::json!({
        "model": model, "max_tokens": 2,
        "messages": [
            {"role": "system", "content": format!("You answer questions about {PROMPT_MARKER}. ").repeat(20)},
            {"role": "user", "content": question},
        ],
    })
    .to_string()
}

/// Starts two replicas, a router on `router_config(endpoints, extra)` and Envoy in front, as
/// [`Stack::start`] does, for endpoint lists the stack does not build (pushed KV events, an
/// endpoint that is down).
async fn start_stack<E: ConfigEndpoint>(
    endpoints: impl FnOnce(&[Replica]) -> Vec<E>,
    extra: &str,
) -> Stack {
    let dir = tempfile::tempdir().expect("tempdir");
    let replicas: Vec<Replica> = (0..2)
        .map(|i| start_replica(dir.path(), ReplicaSpec::new(format!("r{i}"))))
        .collect();
    let addrs: Vec<SocketAddr> = replicas.iter().map(|r| r.addr).collect();
    let router = start_router(
        dir.path(),
        &router_config(dir.path(), &endpoints(&replicas), extra),
    );
    let options = envoy_options(
        &router,
        dir.path(),
        ClusterStyle::OverrideHost,
        BodyMode::Buffered,
        None,
    );
    let envoy = start_envoy(dir.path(), &envoyconf::render(&options)).await;
    // At least the replicas: an endpoint that is down may be listed or already withdrawn.
    let client = reqwest::Client::new();
    eventually("Envoy to know every replica", STARTUP, || async {
        let hosts = envoy.hosts(&client).await.ok()?;
        addrs
            .iter()
            .all(|a| hosts.contains(&a.to_string()))
            .then_some(())
    })
    .await;
    Stack {
        dir,
        replicas,
        router,
        envoy,
        client: reqwest::Client::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decision_spans_continue_the_gateway_trace_and_carry_no_prompt_or_tenant() {
    let (receiver, otlp) = Receiver::start().await;
    let extra = format!(
        "tenancy: {{header: x-tenant}}\n\
         tracing: {{enabled: true, otlp_endpoint: \"http://{otlp}\", sampling_ratio: 1.0, \
         export_interval_ms: 100, service_name: kvrouter-under-test}}"
    );
    let stack = Stack::start(StackOptions {
        replicas: 2,
        router_extra: &extra,
        ..StackOptions::default()
    })
    .await;
    let url = format!("http://{}/v1/chat/completions", stack.envoy.addr);
    let send = |body: String, traceparent: Option<String>| {
        let mut req = stack
            .client
            .post(&url)
            .header("content-type", "application/json")
            .header("x-tenant", TENANT)
            .body(body);
        if let Some(tp) = traceparent {
            req = req.header("traceparent", tp);
        }
        async move { reply(req.send().await.expect("POST through Envoy")).await }
    };
    // Routed, inside the client's trace.
    let routed = send(
        chat(MODEL, "first"),
        Some(format!("00-{TRACE_ID}-{PARENT_SPAN_ID}-01")),
    )
    .await;
    assert_eq!(routed.status, 200, "{}", routed.body);
    let upstream = routed.upstream.clone().expect("x-kvrouter-upstream");
    // Routed, no trace context: a trace of its own.
    let alone = send(chat(MODEL, "second"), None).await;
    assert_eq!(alone.status, 200, "{}", alone.body);
    // Rejected by the router (unknown model), inside another client trace.
    let other_trace = "0af7651916cd43dd8448eb211c80319c";
    let rejected = send(
        chat("no-such-model", "third"),
        Some(format!("00-{other_trace}-b7ad6b7169203331-01")),
    )
    .await;
    assert_eq!(rejected.status, 404, "{}", rejected.body);

    let spans = eventually(
        "three decision spans at the receiver",
        Duration::from_secs(20),
        || async {
            let spans = receiver.spans.lock().clone();
            (spans.len() >= 3).then_some(spans)
        },
    )
    .await;
    assert_eq!(spans.len(), 3, "one span per decision: {spans:#?}");
    for (service, s) in &spans {
        assert_eq!(service, "kvrouter-under-test");
        assert_eq!(s.name, "kvrouter.decision");
        for kv in &s.attributes {
            let v = format!("{:?}", kv.value);
            assert!(
                !v.contains(PROMPT_MARKER) && !v.contains(TENANT),
                "{}: {v}",
                kv.key
            );
        }
        for e in &s.events {
            let v = format!("{e:?}");
            assert!(!v.contains(PROMPT_MARKER) && !v.contains(TENANT), "{v}");
        }
    }
    let by_trace = |t: &str| {
        spans
            .iter()
            .map(|(_, s)| s)
            .find(|s| hex(&s.trace_id) == t)
            .unwrap_or_else(|| panic!("no span in trace {t}: {spans:#?}"))
    };

    // The routed span is the child of the client's span, with the decision's facts.
    let s = by_trace(TRACE_ID);
    assert_eq!(hex(&s.parent_span_id), PARENT_SPAN_ID);
    let a = |k: &str| attr(&s.attributes, k).unwrap_or_else(|| panic!("no {k}: {s:#?}"));
    assert_eq!(a("kvrouter.outcome"), "routed");
    assert_eq!(a("kvrouter.policy"), "predicted-ttft");
    assert_eq!(a("kvrouter.model"), MODEL);
    assert_eq!(a("gen_ai.request.model"), MODEL);
    assert_eq!(a("kvrouter.candidates"), "2");
    assert_eq!(a("kvrouter.endpoint"), upstream);
    let other = stack
        .replicas
        .iter()
        .map(|r| r.addr.to_string())
        .find(|r| *r != upstream)
        .unwrap();
    assert_eq!(
        a("kvrouter.fallbacks"),
        other,
        "the other replica falls back"
    );
    assert!(a("kvrouter.prompt_tokens").parse::<u64>().unwrap() > 100);
    assert_eq!(a("kvrouter.matched_tokens"), "0", "nothing cached yet");
    assert!(a("kvrouter.predicted_ttft_ms").parse::<f64>().unwrap() > 0.0);
    assert_eq!(a("kvrouter.cache_source"), "predictions");
    assert!(["fresh", "missing", "stale"].contains(&a("kvrouter.engine_signal").as_str()));
    assert!(["true", "false"].contains(&a("kvrouter.stale_signals").as_str()));
    assert!(s.events.is_empty(), "{:?}", s.events);

    // No traceparent: a root span in a trace of its own.
    let root = spans
        .iter()
        .map(|(_, s)| s)
        .find(|s| ![TRACE_ID, other_trace].contains(&hex(&s.trace_id).as_str()))
        .expect("the untraced request's span");
    assert!(root.parent_span_id.is_empty(), "{root:#?}");
    assert_eq!(
        attr(&root.attributes, "kvrouter.outcome").as_deref(),
        Some("routed")
    );

    // The rejection: in its client's trace, a `rejected` event with the status and class.
    let r = by_trace(other_trace);
    assert_eq!(hex(&r.parent_span_id), "b7ad6b7169203331");
    assert_eq!(
        attr(&r.attributes, "kvrouter.outcome").as_deref(),
        Some("rejected")
    );
    assert_eq!(r.events.len(), 1, "{:?}", r.events);
    let event = &r.events[0];
    assert_eq!(event.name, "rejected");
    assert_eq!(
        attr(&event.attributes, "http.response.status_code").as_deref(),
        Some("404")
    );
    assert_eq!(
        attr(&event.attributes, "kvrouter.reason").as_deref(),
        Some("unknown_model")
    );
    assert_in_flight_drains(stack.router.admin).await;
}

/// An endpoint whose engine pushes its KV events over gRPC.
struct Pushed(SocketAddr);

impl ConfigEndpoint for Pushed {
    fn endpoint_yaml(&self) -> String {
        format!(
            "      - address: \"{}\"\n        kv_events: {{push: true}}\n",
            self.0
        )
    }
}

/// A router whose replicas push their KV events, its admin API behind [`TOKEN`].
async fn pushed_stack(token_dir: &tempfile::TempDir) -> Stack {
    let token_file = token_dir.path().join("admin-token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let extra = format!(
        "admin: {{auth_token_file: \"{}\"}}\ntenancy: {{header: x-tenant}}",
        token_file.display()
    );
    start_stack(
        |replicas| replicas.iter().map(|r| Pushed(r.addr)).collect(),
        &extra,
    )
    .await
}

fn with_token<T>(message: T, token: Option<&str>) -> Request<T> {
    let mut request = Request::new(message);
    if let Some(t) = token {
        request
            .metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    request
}

/// A completions request whose prompt is 80 token ids (five blocks of 16).
fn token_prompt() -> (Vec<u32>, String) {
    let ids: Vec<u32> = (1000..1080).collect();
    let body = serde_json::json!({"model": MODEL, "max_tokens": 2, "prompt": ids}).to_string();
    (ids, body)
}

fn stored(ids: &[u32]) -> pb::KvEvent {
    pb::KvEvent {
        event: Some(pb::kv_event::Event::BlockStored(pb::BlockStored {
            block_hashes: (0..ids.len() as u64 / 16).map(|i| 7000 + i).collect(),
            parent_block_hash: None,
            token_ids: ids.to_vec(),
            block_size: 16,
            ..Default::default()
        })),
    }
}

fn cleared() -> pb::KvEvent {
    pb::KvEvent {
        event: Some(pb::kv_event::Event::AllBlocksCleared(
            pb::AllBlocksCleared { medium: None },
        )),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grpc_api_explains_watches_and_takes_pushed_events_behind_the_admin_token() {
    let token_dir = tempfile::tempdir().unwrap();
    let stack = pushed_stack(&token_dir).await;
    let admin = stack.router.admin;
    let r1 = stack.replicas[1].addr;
    let channel = tonic::transport::Channel::from_shared(format!("http://{admin}"))
        .unwrap()
        .connect()
        .await
        .expect("connect to the admin port over HTTP/2");
    let mut api = pb::admin_client::AdminClient::new(channel.clone());
    let mut push = pb::kv_events_client::KvEventsClient::new(channel);

    // No token, or the wrong one: refused on every service, and on /debug/* over HTTP.
    for token in [None, Some("not-the-token")] {
        let err = api
            .get_endpoints(with_token(pb::GetEndpointsRequest {}, token))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
        let err = api
            .watch_decisions(with_token(pb::WatchDecisionsRequest::default(), token))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
        let batch = pb::KvEventBatch {
            endpoint: r1.to_string(),
            events: vec![cleared()],
            ..Default::default()
        };
        let err = push
            .push_kv_events(with_token(futures::stream::iter(vec![batch]), token))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
        for path in ["/debug/endpoints", "/debug/decisions"] {
            let mut req = stack.client.get(format!("http://{admin}{path}"));
            if let Some(t) = token {
                req = req.bearer_auth(t);
            }
            let resp = req.send().await.unwrap();
            assert_eq!(resp.status(), 401, "{path}");
            let body = resp.text().await.unwrap();
            assert!(!body.contains(TOKEN), "{body}");
        }
    }
    // Probes and scrapers need no token.
    for path in ["/metrics", "/healthz", "/readyz"] {
        let resp = stack
            .client
            .get(format!("http://{admin}{path}"))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{path}");
    }
    let debug = stack
        .client
        .get(format!("http://{admin}/debug/endpoints"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(debug.status(), 200);
    let debug: serde_json::Value = debug.json().await.unwrap();
    let listed = debug["endpoints"].as_array().expect("an endpoint list");
    assert_eq!(listed.len(), 2, "{debug}");
    for ep in listed {
        assert_eq!(ep["kv_events"]["attach"], "push", "{ep}");
    }

    // The endpoints, both taking pushed events.
    let endpoints = api
        .get_endpoints(with_token(pb::GetEndpointsRequest {}, Some(TOKEN)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(endpoints.policy, "predicted-ttft");
    assert_eq!(endpoints.endpoints.len(), 2, "{endpoints:?}");
    for ep in &endpoints.endpoints {
        let kv = ep.kv_events.as_ref().expect("a KV-event stream");
        assert_eq!(kv.attach, "push", "{ep:?}");
    }

    let (ids, body) = token_prompt();
    let explain_api = api.clone();
    let explain = |tenant: Option<&str>| {
        let mut api = explain_api.clone();
        let request = pb::ExplainRequest {
            body: body.clone().into_bytes(),
            path: "/v1/completions".into(),
            tenant: tenant.map(str::to_string),
        };
        async move { api.explain(with_token(request, Some(TOKEN))).await }
    };
    let row = |e: &pb::Explanation, addr: SocketAddr| {
        e.candidates
            .iter()
            .find(|c| c.endpoint == addr.to_string())
            .unwrap_or_else(|| panic!("no row for {addr}: {e:?}"))
            .clone()
    };
    let before = explain(None).await.unwrap().into_inner();
    assert_eq!(before.candidates.len(), 2);
    assert_eq!(row(&before, r1).confirmed_tokens, 0);

    // r1's engine pushes that it stored the prompt's first four blocks.
    let batch = |seq: u64, events: Vec<pb::KvEvent>| pb::KvEventBatch {
        endpoint: r1.to_string(),
        seq,
        ts: 1.0,
        data_parallel_rank: None,
        events,
    };
    let pushed = push
        .push_kv_events(with_token(
            futures::stream::iter(vec![batch(0, vec![stored(&ids[..64])])]),
            Some(TOKEN),
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((pushed.batches, pushed.events), (1, 1));
    // Applied as a ZMQ message is: confirmed by events, and the pick moves to r1.
    let after = explain(None).await.unwrap().into_inner();
    let held = row(&after, r1);
    assert_eq!(held.confirmed_tokens, 64, "{after:?}");
    assert_eq!(held.cache_source, "events", "{after:?}");
    assert_eq!(after.pick, r1.to_string(), "{after:?}");

    // AllBlocksCleared takes it back, as on the ZMQ path.
    push.push_kv_events(with_token(
        futures::stream::iter(vec![batch(1, vec![cleared()])]),
        Some(TOKEN),
    ))
    .await
    .unwrap();
    let cleared_view = explain(None).await.unwrap().into_inner();
    assert_eq!(
        row(&cleared_view, r1).confirmed_tokens,
        0,
        "{cleared_view:?}"
    );

    // Stored again, then routed through Envoy while a watcher streams the decisions.
    push.push_kv_events(with_token(
        futures::stream::iter(vec![batch(2, vec![stored(&ids[..64])])]),
        Some(TOKEN),
    ))
    .await
    .unwrap();
    let mut watch = api
        .watch_decisions(with_token(
            pb::WatchDecisionsRequest {
                model: MODEL.into(),
            },
            Some(TOKEN),
        ))
        .await
        .unwrap()
        .into_inner();
    let routed = stack.post("/v1/completions", body.clone()).await;
    assert_eq!(routed.status, 200, "{}", routed.body);
    assert_eq!(routed.upstream.as_deref(), Some(r1.to_string().as_str()));
    let record = tokio::time::timeout(Duration::from_secs(10), watch.message())
        .await
        .expect("a decision record within 10 s")
        .unwrap()
        .expect("the stream is open");
    assert_eq!(record.outcome, "routed");
    assert_eq!(record.model, MODEL);
    let e = record.explanation.expect("a routed record's breakdown");
    assert_eq!(e.pick, r1.to_string());
    assert_eq!(row(&e, r1).cache_source, "events");

    // A stream for an endpoint that does not push, or is not ours, is refused.
    let err = push
        .push_kv_events(with_token(
            futures::stream::iter(vec![pb::KvEventBatch {
                endpoint: "127.0.0.1:1".into(),
                events: vec![cleared()],
                ..Default::default()
            }]),
            Some(TOKEN),
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");

    // Explaining as a tenant is allowed behind the token.
    assert!(explain(Some("t1")).await.is_ok());

    // `kvrouter explain --admin` goes through the gRPC API with the token file, and is refused
    // without it.
    let req = stack.dir.path().join("explain-body.json");
    std::fs::write(&req, &body).unwrap();
    let cli = |token: bool| {
        let mut cmd = std::process::Command::new(kvrouter_bin());
        cmd.args(["explain", "--admin", &format!("http://{admin}")])
            .args(["--path", "/v1/completions", "--body"])
            .arg(&req)
            .env_remove("KVROUTER_ADMIN_TOKEN_FILE");
        if token {
            cmd.arg("--admin-token-file")
                .arg(token_dir.path().join("admin-token"));
        }
        cmd.output().unwrap()
    };
    let out = cli(true);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains(&format!("pick {r1}")), "{text}");
    let out = cli(false);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("missing admin bearer token"), "{err}");
    assert_in_flight_drains(admin).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_explaining_as_a_tenant_is_refused() {
    let stack = Stack::start(StackOptions {
        replicas: 1,
        router_extra: "tenancy: {header: x-tenant}",
        ..StackOptions::default()
    })
    .await;
    let admin = stack.router.admin;
    let body = chat(MODEL, "q");
    // No tenant: open, as before (no token configured).
    let open = stack
        .client
        .post(format!("http://{admin}/debug/explain"))
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(open.status(), 200);
    let refused = stack
        .client
        .post(format!("http://{admin}/debug/explain?tenant=someone-else"))
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 403);
    let text = refused.text().await.unwrap();
    assert!(text.contains("admin.auth_token_file"), "{text}");
    let mut api = pb::admin_client::AdminClient::connect(format!("http://{admin}"))
        .await
        .unwrap();
    let err = api
        .explain(pb::ExplainRequest {
            body: body.into_bytes(),
            path: String::new(),
            tenant: Some("someone-else".into()),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
}

/// Every metric name a PromQL query selects: identifiers followed by a `{` label matcher, and
/// the metric of `label_values(metric, label)`.
fn metric_names(expr: &str) -> Vec<String> {
    let bytes = expr.as_bytes();
    let mut names = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        if c.is_ascii_alphabetic() || c == b'_' || c == b':' {
            let start = i;
            while i < bytes.len()
                && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_' || bytes[i] == b':')
            {
                i += 1;
            }
            let ident = &expr[start..i];
            let rest = expr[i..].trim_start();
            if rest.starts_with('{') {
                names.push(ident.to_string());
            } else if ident == "label_values" && rest.starts_with('(') {
                let arg = rest[1..].split([',', ')']).next().unwrap_or("").trim();
                names.push(arg.to_string());
            }
            // Skip a label matcher's quoted value (`"$job"`), which is not a name.
        } else if c == b'"' {
            i += 1;
            while i < bytes.len() && bytes[i] != b'"' {
                i += 1;
            }
            i += 1;
        } else {
            i += 1;
        }
    }
    names
}

/// The series names a Prometheus exposition offers: its samples, and for every `# TYPE`d
/// family the names its samples take (so families without samples yet count too).
fn exported_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split_whitespace();
            let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
                continue;
            };
            names.insert(name.to_string());
            match kind {
                "histogram" => {
                    for suffix in ["_bucket", "_sum", "_count"] {
                        names.insert(format!("{name}{suffix}"));
                    }
                }
                "counter" if !name.ends_with("_total") => {
                    names.insert(format!("{name}_total"));
                }
                _ => {}
            }
        } else if !line.starts_with('#') && !line.is_empty() {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            names.insert(line[..end].to_string());
        }
    }
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grafana_dashboard_queries_only_metrics_the_router_exports() {
    let path = repo().join("deploy/grafana/kvrouter-dashboard.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    // The fields Grafana's dashboard model requires to import it.
    assert!(dashboard["title"].is_string() && dashboard["uid"].is_string());
    assert!(dashboard["schemaVersion"].as_u64() >= Some(30));
    let panels = dashboard["panels"].as_array().expect("panels");
    assert!(panels.len() >= 10, "{}", panels.len());
    let mut ids = BTreeSet::new();
    let mut queries: Vec<String> = Vec::new();
    for p in panels {
        let id = p["id"].as_u64().expect("panel id");
        assert!(ids.insert(id), "panel id {id} twice");
        for key in ["h", "w", "x", "y"] {
            assert!(p["gridPos"][key].is_u64(), "panel {id} gridPos.{key}");
        }
        assert!(p["gridPos"]["x"].as_u64().unwrap() + p["gridPos"]["w"].as_u64().unwrap() <= 24);
        assert!(
            p["type"].is_string() && p["title"].is_string(),
            "panel {id}"
        );
        if p["type"] == "row" {
            continue;
        }
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "panel {id} has no query");
        let mut refs = BTreeSet::new();
        for t in targets {
            assert!(
                refs.insert(t["refId"].as_str().expect("refId")),
                "panel {id}"
            );
            queries.push(t["expr"].as_str().expect("expr").to_string());
        }
    }
    for v in dashboard["templating"]["list"]
        .as_array()
        .expect("templating")
    {
        if let Some(q) = v["query"]["query"].as_str() {
            queries.push(q.to_string());
        }
    }
    assert!(queries.len() >= 20, "{}", queries.len());

    // A running router whose families all have series: KV-event streams (pushed), an endpoint
    // that is down (ejected), engine signals that are always stale (1 ms), a rejection.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let stack = start_stack(
        |replicas| {
            let mut eps: Vec<Pushed> = replicas.iter().map(|r| Pushed(r.addr)).collect();
            eps.push(Pushed(dead));
            eps
        },
        "load: {scrape: {staleness_ms: 1}}\nhealth: {probe: {interval_ms: 100, failure_threshold: 1}}",
    )
    .await;
    let admin = stack.router.admin;
    eventually(
        "the dead endpoint's ejection",
        Duration::from_secs(15),
        || async { (metric_sum(admin, "kvrouter_ejections_total").await >= 1.0).then_some(()) },
    )
    .await;
    let r = stack
        .post("/v1/chat/completions", chat("no-such-model", "q"))
        .await;
    assert_eq!(r.status, 404, "{}", r.body);
    eventually(
        "a decision on stale signals",
        Duration::from_secs(15),
        || async {
            let r = stack.post("/v1/chat/completions", chat(MODEL, "q")).await;
            assert_eq!(r.status, 200, "{}", r.body);
            (metric_sum(admin, "kvrouter_decisions_on_stale_signals_total").await >= 1.0)
                .then_some(())
        },
    )
    .await;
    let exposition = stack
        .client
        .get(format!("http://{admin}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let exported = exported_names(&exposition);
    let mut named = BTreeSet::new();
    for q in &queries {
        let names = metric_names(q);
        assert!(!names.is_empty(), "a query that names no metric: {q}");
        for n in names {
            assert!(
                exported.contains(&n),
                "{n} (in {q}) is not exported; exported: {exported:?}"
            );
            named.insert(n);
        }
    }
    // The list: each is on the dashboard.
    for required in [
        "kvrouter_decisions_total",
        "kvrouter_decision_duration_seconds_bucket",
        "kvrouter_decision_matched_tokens_total",
        "kvrouter_decisions_by_cache_source_total",
        "kvrouter_decisions_by_prefix_source_total",
        "kvrouter_deferred_tokenizings_total",
        "kvrouter_decisions_on_stale_signals_total",
        "kvrouter_ejections_total",
        "kvrouter_endpoint_in_flight_requests",
        "kvrouter_endpoint_engine_waiting_requests",
        "kvrouter_endpoint_engine_kv_cache_usage",
    ] {
        assert!(
            named.contains(required),
            "{required} is not on the dashboard"
        );
    }
}

#[test]
fn metric_names_are_read_from_selectors_only() {
    assert_eq!(
        metric_names(
            "sum by (le) (rate(a_bucket{job=~\"$job\", x=\"b{c\"}[5m])) / clamp_min(b_total{}, 1)"
        ),
        vec!["a_bucket", "b_total"]
    );
    assert_eq!(metric_names("label_values(m_count, job)"), vec!["m_count"]);
    assert!(metric_names("sum(rate(x[5m]))").is_empty());
}
