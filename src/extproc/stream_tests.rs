//! Phase transitions of [`Stream`], driven message by message as Envoy would, without Envoy.

use std::collections::HashMap;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation::Mutation, processing_request::Request, processing_response::Response, HttpBody,
    HttpHeaders, HttpTrailers, ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use proptest::prelude::*;

use super::envoy::{KVROUTER_NAMESPACE, LB_NAMESPACE, PICK_KEY, SERVED_KEY};
use super::inflight::InflightTable;
use super::stream::{Outcome, Stream};
use crate::config::Config;
use crate::discovery::EndpointSet;
use crate::router::{AdminView, Router, Ticket};
use crate::telemetry::Metrics;

/// Every request is marked for the observer (these tests play an observer for each), except
/// where a test says otherwise.
const CONFIG: &str = r#"
routing: {max_body_bytes: 4096, fallback_endpoints: 1, observe_interval_ms: 0}
load: {learning: {ttft_residual: true}}
pools:
  - name: p
    models: [m]
    endpoints:
      - address: 127.0.0.1:8001
      - address: 127.0.0.1:8002
"#;

struct Fixture {
    router: Arc<Router>,
    table: Arc<InflightTable<Ticket>>,
    metrics: Arc<Metrics>,
    /// What the tests look at: the endpoint set (load, health), the config, the metrics.
    view: AdminView,
}

impl Fixture {
    fn new() -> Fixture {
        Fixture::with(CONFIG)
    }

    fn with(config: &str) -> Fixture {
        let metrics = Arc::new(Metrics::new());
        let router = Router::new(
            Config::parse_and_validate(config, "test").unwrap(),
            Arc::clone(&metrics),
            std::path::Path::new("."),
        )
        .unwrap();
        Fixture {
            view: router.handles().admin,
            router: Arc::new(router),
            table: Arc::new(InflightTable::default()),
            metrics,
        }
    }

    fn stream(&self) -> Stream {
        Stream::new(
            Arc::clone(&self.router),
            Arc::clone(&self.table),
            Arc::clone(&self.metrics),
        )
    }

    fn endpoints(&self) -> Arc<EndpointSet> {
        self.view.endpoints()
    }

    fn config(&self) -> Arc<Config> {
        Arc::clone(&self.view.snapshot().config)
    }

    /// Marks observer streams as in use (as they are once traffic flows with the observer
    /// filter): a picker that ends first then leaves its ticket for the observer.
    fn observers_in_use(&self) {
        assert!(self.table.update(0, |_| ()).is_none());
        assert!(self.table.observers_active());
    }

    fn in_flight(&self) -> u64 {
        self.endpoints()
            .all()
            .iter()
            .map(|e| e.load.snapshot().in_flight_requests)
            .sum()
    }
}

fn headers(pairs: &[(&str, &str)]) -> Option<HeaderMap> {
    Some(HeaderMap {
        headers: pairs
            .iter()
            .map(|(k, v)| HeaderValue {
                key: k.to_string(),
                raw_value: v.as_bytes().to_vec(),
                ..Default::default()
            })
            .collect(),
    })
}

pub(super) fn request_headers(
    mode: BodySendMode,
    path: &str,
    end_of_stream: bool,
) -> ProcessingRequest {
    ProcessingRequest {
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: mode as i32,
            response_body_mode: BodySendMode::None as i32,
            ..Default::default()
        }),
        request: Some(Request::RequestHeaders(HttpHeaders {
            headers: headers(&[(":path", path), (":method", "POST"), ("x-request-id", "r1")]),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

pub(super) fn request_body(body: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::RequestBody(HttpBody {
            body: body.to_vec(),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn response_headers(status: &str, metadata: Option<Metadata>, eos: bool) -> ProcessingRequest {
    ProcessingRequest {
        metadata_context: metadata,
        request: Some(Request::ResponseHeaders(HttpHeaders {
            headers: headers(&[(":status", status), ("content-type", "text/event-stream")]),
            end_of_stream: eos,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn response_body(body: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::ResponseBody(HttpBody {
            body: body.to_vec(),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// A streamed chat (as clients stream: its first byte is its first token).
const CHAT: &str = r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hello"}]}"#;

/// The destination a routing reply sets, and its pick id.
fn destination(r: &ProcessingResponse) -> Option<(String, u64)> {
    let common = match r.response.as_ref()? {
        Response::RequestHeaders(h) => h.response.as_ref()?,
        Response::RequestBody(b) => b.response.as_ref()?,
        _ => return None,
    };
    let set = &common.header_mutation.as_ref()?.set_headers[0];
    let md = r.dynamic_metadata.as_ref()?;
    let Some(Kind::StructValue(ours)) = &md.fields[KVROUTER_NAMESPACE].kind else {
        return None;
    };
    let Some(Kind::StringValue(pick)) = &ours.fields[PICK_KEY].kind else {
        return None;
    };
    Some((
        String::from_utf8(set.header.as_ref()?.raw_value.clone()).ok()?,
        pick.parse().ok()?,
    ))
}

/// Metadata as Envoy forwards it to the observer stream.
fn forwarded(pick: u64, served: Option<&str>) -> Metadata {
    let s = |v: &str| Value {
        kind: Some(Kind::StringValue(v.to_string())),
    };
    let mut filter_metadata = HashMap::from([(
        KVROUTER_NAMESPACE.to_string(),
        Struct {
            fields: HashMap::from([(PICK_KEY.to_string(), s(&pick.to_string()))]),
        },
    )]);
    if let Some(served) = served {
        filter_metadata.insert(
            LB_NAMESPACE.to_string(),
            Struct {
                fields: HashMap::from([(SERVED_KEY.to_string(), s(served))]),
            },
        );
    }
    Metadata {
        filter_metadata,
        ..Default::default()
    }
}

fn is_continue(r: &ProcessingResponse) -> bool {
    match r.response.as_ref() {
        Some(Response::RequestHeaders(h)) | Some(Response::ResponseHeaders(h)) => h
            .response
            .as_ref()
            .is_some_and(|c| c.header_mutation.is_none()),
        Some(Response::RequestBody(b)) | Some(Response::ResponseBody(b)) => b
            .response
            .as_ref()
            .is_some_and(|c| c.header_mutation.is_none() && c.body_mutation.is_none()),
        Some(Response::RequestTrailers(_)) | Some(Response::ResponseTrailers(_)) => true,
        _ => false,
    }
}

fn immediate_status(r: &ProcessingResponse) -> Option<i32> {
    match r.response.as_ref()? {
        Response::ImmediateResponse(ir) => Some(ir.status.as_ref()?.code),
        _ => None,
    }
}

#[tokio::test]
async fn buffered_routes_in_the_body_response() {
    let f = Fixture::new();
    let mut s = f.stream();
    let r = s
        .on_message(request_headers(
            BodySendMode::Buffered,
            "/v1/chat/completions",
            false,
        ))
        .await;
    assert_eq!(r.len(), 1);
    assert!(is_continue(&r[0]), "headers continue at once: {r:?}");
    let r = s.on_message(request_body(CHAT.as_bytes(), true)).await;
    assert_eq!(r.len(), 1);
    assert!(matches!(r[0].response, Some(Response::RequestBody(_))));
    let (dest, _) = destination(&r[0]).expect("routed");
    assert_eq!(dest.split(',').count(), 2, "pick + 1 fallback: {dest}");
    assert_eq!(f.in_flight(), 1);
    assert_eq!(s.outcome(), Outcome::Routed);
    drop(s);
    assert_eq!(
        f.in_flight(),
        0,
        "no observer seen yet: the picker releases at its end"
    );
}

#[tokio::test]
async fn a_buffered_body_followed_by_trailers_is_routed_not_refused() {
    // Envoy's ext_proc sends a BUFFERED body without end of stream when the request has
    // trailers (its `decodeTrailers` hands over the buffered body then).
    let f = Fixture::new();
    let mut s = f.stream();
    s.on_message(request_headers(
        BodySendMode::Buffered,
        "/v1/chat/completions",
        false,
    ))
    .await;
    let r = s.on_message(request_body(CHAT.as_bytes(), false)).await;
    assert_eq!(r.len(), 1);
    assert_eq!(immediate_status(&r[0]), None, "not refused: {r:?}");
    assert!(destination(&r[0]).is_some(), "routed: {r:?}");
    let r = s
        .on_message(ProcessingRequest {
            request: Some(Request::RequestTrailers(HttpTrailers::default())),
            ..Default::default()
        })
        .await;
    assert!(
        matches!(
            r[..],
            [ProcessingResponse {
                response: Some(Response::RequestTrailers(_)),
                ..
            }]
        ),
        "{r:?}"
    );
    assert_eq!(s.outcome(), Outcome::Routed);
}

/// Whether a routing reply marks its request for the observer filter.
fn marks_for_observer(r: &ProcessingResponse) -> bool {
    let common = match r.response.as_ref() {
        Some(Response::RequestHeaders(h)) => h.response.as_ref(),
        Some(Response::RequestBody(b)) => b.response.as_ref(),
        _ => None,
    };
    common
        .and_then(|c| c.header_mutation.as_ref())
        .is_some_and(|m| {
            m.set_headers.iter().any(|h| {
                h.header.as_ref().is_some_and(|h| {
                    h.key == crate::envoyconf::OBSERVE_HEADER && h.raw_value == b"1"
                })
            })
        })
}

/// With observers in use, a request marked for the observer keeps its ticket for it after the
/// picker's end; an unmarked one is released at its picker's end, and its predicted first
/// byte is scheduled instead.
#[tokio::test]
async fn only_marked_requests_wait_for_an_observer() {
    let f =
        Fixture::with(&CONFIG.replace("observe_interval_ms: 0", "observe_interval_ms: 3600000"));
    f.observers_in_use();
    let route = || async {
        let mut s = f.stream();
        s.on_message(request_headers(
            BodySendMode::Buffered,
            "/v1/chat/completions",
            false,
        ))
        .await;
        let r = s.on_message(request_body(CHAT.as_bytes(), true)).await;
        let (dest, pick) = destination(&r[0]).expect("routed");
        (s, dest, pick, marks_for_observer(&r[0]))
    };
    // Each endpoint's first request in the interval is marked.
    let (first, dest_a, pick_a, marked_a) = route().await;
    let (second, dest_b, _, marked_b) = route().await;
    assert_ne!(dest_a[..14], dest_b[..14], "least-loaded spreads them");
    assert!(marked_a && marked_b);
    assert!(
        f.table.next_due().is_none(),
        "nothing to predict for marked requests"
    );
    let (third, _, pick_c, marked_c) = route().await;
    assert!(!marked_c, "the interval's second request at its endpoint");
    assert!(f.table.next_due().is_some(), "its first byte is scheduled");
    assert_eq!(f.in_flight(), 3);
    drop(third);
    assert_eq!(f.in_flight(), 2, "released at its picker's end");
    assert!(f.table.with(pick_c, |_| ()).is_none());
    drop(first);
    assert_eq!(f.in_flight(), 2, "kept for its observer");
    assert!(f.table.with(pick_a, |_| ()).is_some());
    drop(second);
}

#[tokio::test]
async fn full_duplex_holds_headers_then_echoes_every_chunk_in_order() {
    let f = Fixture::new();
    let mut s = f.stream();
    assert!(s
        .on_message(request_headers(
            BodySendMode::FullDuplexStreamed,
            "/v1/chat/completions",
            false
        ))
        .await
        .is_empty());
    let (a, b) = CHAT.as_bytes().split_at(20);
    assert!(
        s.on_message(request_body(a, false)).await.is_empty(),
        "held until the body ends"
    );
    let r = s.on_message(request_body(b, false)).await;
    assert!(r.is_empty());
    let r = s.on_message(request_body(b"", true)).await;
    assert_eq!(r.len(), 4, "route + 3 echoed chunks: {r:?}");
    assert!(matches!(r[0].response, Some(Response::RequestHeaders(_))));
    assert!(destination(&r[0]).is_some());
    let mut echoed = Vec::new();
    for (i, reply) in r[1..].iter().enumerate() {
        let Some(Response::RequestBody(body)) = &reply.response else {
            panic!()
        };
        let Some(Mutation::StreamedResponse(sb)) = body
            .response
            .as_ref()
            .unwrap()
            .body_mutation
            .as_ref()
            .unwrap()
            .mutation
            .as_ref()
        else {
            panic!()
        };
        echoed.extend_from_slice(&sb.body);
        assert_eq!(sb.end_of_stream, i == 2);
    }
    assert_eq!(echoed, CHAT.as_bytes());
}

#[tokio::test]
async fn full_duplex_with_trailers_ends_the_echo_before_the_trailers_reply() {
    let f = Fixture::new();
    let mut s = f.stream();
    s.on_message(request_headers(
        BodySendMode::FullDuplexStreamed,
        "/v1/chat/completions",
        false,
    ))
    .await;
    s.on_message(request_body(CHAT.as_bytes(), false)).await;
    let r = s
        .on_message(ProcessingRequest {
            request: Some(Request::RequestTrailers(HttpTrailers::default())),
            ..Default::default()
        })
        .await;
    assert_eq!(r.len(), 3);
    let Some(Response::RequestBody(body)) = &r[1].response else {
        panic!()
    };
    let Some(Mutation::StreamedResponse(sb)) = body
        .response
        .as_ref()
        .unwrap()
        .body_mutation
        .as_ref()
        .unwrap()
        .mutation
        .as_ref()
    else {
        panic!()
    };
    assert!(!sb.end_of_stream, "trailers follow");
    assert!(matches!(r[2].response, Some(Response::RequestTrailers(_))));
}

#[tokio::test]
async fn buffered_without_headers_takes_the_path_from_attributes() {
    let f = Fixture::new();
    let mut s = f.stream();
    let attributes = |path: &str| {
        HashMap::from([(
            "envoy.filters.http.ext_proc".to_string(),
            Struct {
                fields: HashMap::from([(
                    "request.path".to_string(),
                    Value {
                        kind: Some(Kind::StringValue(path.to_string())),
                    },
                )]),
            },
        )])
    };
    let first = ProcessingRequest {
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: BodySendMode::Buffered as i32,
            ..Default::default()
        }),
        attributes: attributes("/v1/chat/completions"),
        ..request_body(CHAT.as_bytes(), true)
    };
    let r = s.on_message(first).await;
    assert!(matches!(r[0].response, Some(Response::RequestBody(_))));
    assert!(destination(&r[0]).is_some(), "{r:?}");
    // The path decides the API: the same body to /v1/completions lacks `prompt`.
    let mut s = f.stream();
    let first = ProcessingRequest {
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: BodySendMode::Buffered as i32,
            ..Default::default()
        }),
        attributes: attributes("/v1/completions"),
        ..request_body(CHAT.as_bytes(), true)
    };
    assert_eq!(immediate_status(&s.on_message(first).await[0]), Some(400));
}

#[tokio::test]
async fn bodyless_requests_route_in_the_headers_response() {
    let f = Fixture::new();
    let mut s = f.stream();
    let r = s
        .on_message(request_headers(BodySendMode::Buffered, "/v1/models", true))
        .await;
    assert!(matches!(r[0].response, Some(Response::RequestHeaders(_))));
    assert!(destination(&r[0]).is_some());
}

#[tokio::test]
async fn streamed_mode_is_passed_through_unrouted() {
    let f = Fixture::new();
    let mut s = f.stream();
    let r = s
        .on_message(request_headers(
            BodySendMode::Streamed,
            "/v1/chat/completions",
            false,
        ))
        .await;
    assert!(is_continue(&r[0]));
    let r = s.on_message(request_body(CHAT.as_bytes(), true)).await;
    assert!(is_continue(&r[0]));
    assert_eq!(f.in_flight(), 0);
    assert_eq!(s.outcome(), Outcome::Unrouted);
}

#[tokio::test]
async fn bad_requests_get_immediate_responses() {
    let cases: &[(&str, &[u8], i32)] = &[
        ("/v1/chat/completions", b"{not json", 400),
        (
            "/v1/chat/completions",
            br#"{"model":"zzz","messages":[{"role":"user","content":"x"}]}"#,
            404,
        ),
        ("/v1/completions", &[b'x'; 5000], 413),
    ];
    for (path, body, status) in cases {
        for mode in [BodySendMode::Buffered, BodySendMode::FullDuplexStreamed] {
            let f = Fixture::new();
            let mut s = f.stream();
            s.on_message(request_headers(mode, path, false)).await;
            let r = s.on_message(request_body(body, true)).await;
            assert_eq!(
                immediate_status(&r[0]),
                Some(*status),
                "{path} {mode:?}: {r:?}"
            );
            assert_eq!(s.outcome(), Outcome::Immediate);
            assert_eq!(f.in_flight(), 0);
        }
    }
}

#[tokio::test]
async fn full_duplex_body_over_the_limit_is_rejected_before_it_ends() {
    let f = Fixture::new();
    let mut s = f.stream();
    s.on_message(request_headers(
        BodySendMode::FullDuplexStreamed,
        "/v1/completions",
        false,
    ))
    .await;
    assert!(s
        .on_message(request_body(&[b' '; 4000], false))
        .await
        .is_empty());
    let r = s.on_message(request_body(&[b' '; 200], false)).await;
    assert_eq!(immediate_status(&r[0]), Some(413));
}

/// A long message is charged to the body budget as it comes off the wire, before it waits for
/// the heavy lane: one that cannot fit is refused at once (503 + retry-after), undecoded.
#[tokio::test]
async fn a_long_message_past_the_body_budget_is_refused_before_it_is_decoded() {
    let f = Fixture::with(&CONFIG.replace(
        "routing: {max_body_bytes: 4096,",
        "routing: {max_body_bytes: 4096, max_buffered_body_bytes: 8192,",
    ));
    let mut s = f.stream();
    s.on_message(request_headers(
        BodySendMode::FullDuplexStreamed,
        "/v1/completions",
        false,
    ))
    .await;
    let refused = s.prepay(9000).expect_err("past the whole budget");
    assert_eq!(immediate_status(&refused[0]), Some(503));
    assert!(s.is_finished());
    assert_eq!(s.outcome(), Outcome::Immediate);
    // After the pick, a long message is a response body the picker watches, not held: never
    // charged, never refused.
    let mut picked = f.stream();
    let r = picked
        .on_message(request_headers(BodySendMode::Buffered, "/v1/models", true))
        .await;
    assert!(destination(&r[0]).is_some(), "routed");
    assert!(picked.prepay(usize::MAX).is_ok());
    assert!(!picked.is_finished());
}

#[tokio::test]
async fn the_observer_reports_to_the_first_byte_and_the_pickers_end_releases() {
    let f = Fixture::new();
    f.observers_in_use();
    let mut picker = f.stream();
    picker
        .on_message(request_headers(
            BodySendMode::Buffered,
            "/v1/chat/completions",
            false,
        ))
        .await;
    let r = picker.on_message(request_body(CHAT.as_bytes(), true)).await;
    let (_, pick) = destination(&r[0]).unwrap();
    assert_eq!(f.in_flight(), 1);

    let mut observer = f.stream();
    let r = observer
        .on_message(ProcessingRequest {
            observability_mode: true,
            ..response_headers("200", Some(forwarded(pick, None)), false)
        })
        .await;
    assert!(r.is_empty(), "observability mode: no replies");
    assert!(!observer.is_finished());
    assert!(observer
        .on_message(response_body(b"data: {}\n\n", false))
        .await
        .is_empty());
    let prefill: u64 = f
        .endpoints()
        .all()
        .iter()
        .map(|e| e.load.snapshot().in_flight_prefill_tokens)
        .sum();
    assert_eq!(prefill, 0, "first byte: prefill done");
    assert!(
        observer.is_finished(),
        "done at the first byte: the stream closes and Envoy sends no more of the body"
    );
    assert_eq!(observer.outcome(), Outcome::Complete);
    drop(observer);
    assert_eq!(
        f.in_flight(),
        1,
        "the request still runs while its picker stream lives"
    );
    drop(picker);
    assert_eq!(f.in_flight(), 0, "the picker's end is the request's end");
}

#[tokio::test]
async fn a_request_abandoned_before_its_response_is_released_after_the_grace() {
    let f = Fixture::new();
    f.observers_in_use();
    let (_, _pick) = route_one(&f).await;
    assert_eq!(f.in_flight(), 1, "kept for the observer for a while");
    let hour = std::time::Duration::from_secs(3600);
    assert_eq!(f.table.sweep(hour, hour), 0);
    assert_eq!(f.table.sweep(hour, std::time::Duration::ZERO), 1);
    assert_eq!(f.in_flight(), 0);
}

/// A request routed by a picker that then ended, and the observer stream watching its response
/// after the response headers: one request in flight, held for the observer.
async fn observed_after_its_picker(f: &Fixture) -> Stream {
    f.observers_in_use();
    let mut picker = f.stream();
    picker
        .on_message(request_headers(
            BodySendMode::Buffered,
            "/v1/chat/completions",
            false,
        ))
        .await;
    let (_, pick) =
        destination(&picker.on_message(request_body(CHAT.as_bytes(), true)).await[0]).unwrap();
    drop(picker);
    let mut observer = f.stream();
    observer
        .on_message(response_headers("200", Some(forwarded(pick, None)), false))
        .await;
    assert_eq!(f.in_flight(), 1);
    observer
}

#[tokio::test]
async fn observer_stream_cancelled_mid_response_releases() {
    let f = Fixture::new();
    let observer = observed_after_its_picker(&f).await;
    assert_eq!(observer.outcome(), Outcome::Cancelled);
    drop(observer); // the client went away
    assert_eq!(f.in_flight(), 0);
}

#[tokio::test]
async fn a_rejection_while_the_response_is_watched_releases_it() {
    // Whatever ends a watched response early (here a held long message refused, which the
    // pace no longer does once the request is read) reports to the ticket: the in-flight
    // count does not wait for the sweeper.
    let f = Fixture::new();
    let mut observer = observed_after_its_picker(&f).await;
    observer.refuse_held_body();
    assert_eq!(f.in_flight(), 0, "released, not left to the sweeper");
}

#[tokio::test]
async fn single_filter_picker_sees_its_own_response() {
    let f = Fixture::new();
    let mut s = f.stream();
    s.on_message(request_headers(
        BodySendMode::Buffered,
        "/v1/chat/completions",
        false,
    ))
    .await;
    s.on_message(request_body(CHAT.as_bytes(), true)).await;
    let r = s.on_message(response_headers("200", None, false)).await;
    assert!(is_continue(&r[0]));
    assert_eq!(f.in_flight(), 1);
    let r = s.on_message(response_body(b"{}", true)).await;
    assert!(is_continue(&r[0]));
    assert_eq!(f.in_flight(), 0);
    assert_eq!(s.outcome(), Outcome::Complete);
}

#[tokio::test]
async fn a_retry_to_a_fallback_moves_the_accounting() {
    let f = Fixture::new();
    f.observers_in_use();
    let mut picker = f.stream();
    picker
        .on_message(request_headers(
            BodySendMode::Buffered,
            "/v1/chat/completions",
            false,
        ))
        .await;
    let (dest, pick) =
        destination(&picker.on_message(request_body(CHAT.as_bytes(), true)).await[0]).unwrap();
    drop(picker);
    let fallback = dest.split(',').nth(1).unwrap().to_string();
    let mut observer = f.stream();
    observer
        .on_message(response_headers(
            "200",
            Some(forwarded(pick, Some(&fallback))),
            false,
        ))
        .await;
    let set = f.endpoints();
    let on = |a: &str| {
        set.get(&a.parse().unwrap())
            .unwrap()
            .load
            .snapshot()
            .in_flight_requests
    };
    assert_eq!(on(&fallback), 1, "counted where it was served");
    assert_eq!(f.in_flight(), 1);
    drop(observer);
    assert_eq!(f.in_flight(), 0);
}

/// The header a routing reply sets.
fn header_name(r: &ProcessingResponse) -> Option<String> {
    let common = match r.response.as_ref()? {
        Response::RequestHeaders(h) => h.response.as_ref()?,
        Response::RequestBody(b) => b.response.as_ref()?,
        _ => return None,
    };
    Some(
        common.header_mutation.as_ref()?.set_headers[0]
            .header
            .as_ref()?
            .key
            .clone(),
    )
}

#[tokio::test]
async fn a_reload_mid_request_applies_from_the_next_request_on() {
    let f = Fixture::new();
    let mut s = f.stream();
    s.on_message(request_headers(
        BodySendMode::Buffered,
        "/v1/chat/completions",
        false,
    ))
    .await;
    // The config changes while the body is on its way: a smaller body limit and another
    // destination header.
    let reloaded = CONFIG.replace(
        "routing: {max_body_bytes: 4096, fallback_endpoints: 1,",
        "routing: {max_body_bytes: 16, fallback_endpoints: 0, destination_header: x-other,",
    );
    f.router
        .apply(Config::parse_and_validate(&reloaded, "test").unwrap())
        .unwrap();
    let r = s.on_message(request_body(CHAT.as_bytes(), true)).await;
    let (dest, _) = destination(&r[0]).expect("routed under the config it started with");
    assert_eq!(dest.split(',').count(), 2, "its fallback count: {dest}");
    assert_eq!(
        header_name(&r[0]).as_deref(),
        Some("x-gateway-destination-endpoint")
    );
    // The next request sees the new config.
    let mut s = f.stream();
    s.on_message(request_headers(
        BodySendMode::Buffered,
        "/v1/chat/completions",
        false,
    ))
    .await;
    let r = s.on_message(request_body(CHAT.as_bytes(), true)).await;
    assert_eq!(immediate_status(&r[0]), Some(413), "{r:?}");
}

/// Routes one request through a picker stream and returns (destination list, pick id).
async fn route_one(f: &Fixture) -> (Vec<String>, u64) {
    let mut picker = f.stream();
    picker
        .on_message(request_headers(
            BodySendMode::Buffered,
            "/v1/chat/completions",
            false,
        ))
        .await;
    let (dest, pick) =
        destination(&picker.on_message(request_body(CHAT.as_bytes(), true)).await[0]).unwrap();
    drop(picker);
    (dest.split(',').map(str::to_string).collect(), pick)
}

fn breaker_state(f: &Fixture, addr: &str) -> crate::health::BreakerState {
    let ep = f.endpoints().get(&addr.parse().unwrap()).cloned().unwrap();
    ep.health
        .snapshot(tokio::time::Instant::now(), &f.config().health)
        .breaker
}

#[tokio::test]
async fn retries_and_5xx_feed_the_breaker_and_successes_do_not() {
    let f = Fixture::new();
    f.observers_in_use();
    let threshold = f.config().health.breaker.failure_threshold;
    // Envoy had to retry the pick on the fallback, `threshold` times: the pick is ejected.
    let (dest, pick) = route_one(&f).await;
    let victim = dest[0].clone();
    f.stream()
        .on_message(response_headers(
            "200",
            Some(forwarded(pick, Some(&victim))),
            true,
        ))
        .await;
    let mut failures = 0;
    for _ in 0..50 {
        if failures == threshold {
            break;
        }
        let (dest, pick) = route_one(&f).await;
        // The victim fails over to the fallback; the other serves its own requests.
        let served = if dest[0] == victim {
            failures += 1;
            &dest[1]
        } else {
            &dest[0]
        };
        f.stream()
            .on_message(response_headers(
                "200",
                Some(forwarded(pick, Some(served))),
                true,
            ))
            .await;
    }
    assert_eq!(failures, threshold);
    let victim = victim.as_str();
    assert_eq!(breaker_state(&f, victim), crate::health::BreakerState::Open);
    let (dest, pick) = route_one(&f).await;
    assert_ne!(dest[0], victim, "an open breaker is not picked");
    drop(f.table.take(pick));
    let other = dest[0].clone();

    // A 200 leaves the breaker closed; 5xx responses open it.
    let (_, pick) = route_one(&f).await;
    f.stream()
        .on_message(response_headers(
            "200",
            Some(forwarded(pick, Some(&other))),
            true,
        ))
        .await;
    assert_eq!(
        breaker_state(&f, &other),
        crate::health::BreakerState::Closed
    );
    for _ in 0..threshold {
        let (_, pick) = route_one(&f).await;
        f.stream()
            .on_message(response_headers(
                "500",
                Some(forwarded(pick, Some(&other))),
                true,
            ))
            .await;
    }
    assert_eq!(breaker_state(&f, &other), crate::health::BreakerState::Open);
    let text = f.view.metrics_text();
    assert!(
        text.contains(&format!(
            "kvrouter_ejections_total{{endpoint=\"{other}\",cause=\"breaker\"}} 1"
        )),
        "{text}"
    );
    assert_eq!(f.in_flight(), 0);
}

#[tokio::test]
async fn a_pick_envoy_skipped_without_an_attempt_is_not_a_failure() {
    let f = Fixture::new();
    f.observers_in_use();
    let cfg = f.config().health.clone();
    let failures_to_open = cfg.breaker.failure_threshold;
    // The pick is not in Envoy's cluster yet (EDS lag): override_host skips it and the fallback
    // serves on the first attempt. However often that happens, the pick stays closed.
    let mut skipped = None;
    for _ in 0..(failures_to_open * 4) {
        let (dest, pick) = route_one(&f).await;
        let mut msg = response_headers("200", Some(forwarded(pick, Some(&dest[1]))), true);
        let Some(Request::ResponseHeaders(h)) = &mut msg.request else {
            unreachable!()
        };
        h.attributes.insert(
            "envoy.filters.http.ext_proc".into(),
            Struct {
                fields: HashMap::from([(
                    "upstream.request_attempt_count".to_string(),
                    Value {
                        kind: Some(Kind::NumberValue(1.0)),
                    },
                )]),
            },
        );
        f.stream().on_message(msg).await;
        skipped = Some(dest[0].clone());
    }
    let skipped = skipped.unwrap();
    assert_eq!(
        breaker_state(&f, &skipped),
        crate::health::BreakerState::Closed
    );
    // Two attempts: the pick was tried and failed.
    for _ in 0..50 {
        let (dest, pick) = route_one(&f).await;
        let (served, attempts) = if dest[0] == skipped {
            (&dest[1], 2.0)
        } else {
            (&dest[0], 1.0)
        };
        let mut msg = response_headers("200", Some(forwarded(pick, Some(served))), true);
        let Some(Request::ResponseHeaders(h)) = &mut msg.request else {
            unreachable!()
        };
        h.attributes.insert(
            "envoy.filters.http.ext_proc".into(),
            Struct {
                fields: HashMap::from([(
                    "upstream.request_attempt_count".to_string(),
                    Value {
                        kind: Some(Kind::NumberValue(attempts)),
                    },
                )]),
            },
        );
        f.stream().on_message(msg).await;
        if breaker_state(&f, &skipped) == crate::health::BreakerState::Open {
            return;
        }
    }
    panic!("a pick that Envoy tried and retried elsewhere never opened its breaker");
}

#[tokio::test]
async fn the_first_byte_teaches_the_picks_residual_but_not_after_a_retry() {
    let f = Fixture::new();
    f.observers_in_use();
    let cfg = f.config().load.learning.clone();
    let samples = |addr: &str| {
        let ep = f.endpoints().get(&addr.parse().unwrap()).cloned().unwrap();
        ep.load
            .learned
            .snapshot(&cfg, tokio::time::Instant::now())
            .residual_samples
    };
    let (dest, pick) = route_one(&f).await;
    let mut observer = f.stream();
    observer
        .on_message(response_headers(
            "200",
            Some(forwarded(pick, Some(&dest[0]))),
            false,
        ))
        .await;
    observer
        .on_message(response_body(b"data: {}\n\n", false))
        .await;
    observer
        .on_message(response_body(b"data: [DONE]\n\n", true))
        .await;
    assert_eq!(samples(&dest[0]), 1, "one first byte, one sample");

    let (dest, pick) = route_one(&f).await;
    let before = samples(&dest[1]);
    let mut observer = f.stream();
    observer
        .on_message(response_headers(
            "200",
            Some(forwarded(pick, Some(&dest[1]))),
            false,
        ))
        .await;
    observer.on_message(response_body(b"x", true)).await;
    assert_eq!(
        samples(&dest[1]),
        before,
        "the prediction was for the pick, not for the endpoint that served"
    );
}

fn arb_message() -> impl Strategy<Value = ProcessingRequest> {
    let mode = prop_oneof![
        Just(BodySendMode::Buffered),
        Just(BodySendMode::FullDuplexStreamed),
        Just(BodySendMode::Streamed),
        Just(BodySendMode::None),
    ];
    let body = prop_oneof![
        Just(CHAT.as_bytes().to_vec()),
        proptest::collection::vec(any::<u8>(), 0..64),
        Just(vec![b'x'; 5000]),
    ];
    prop_oneof![
        (mode, any::<bool>(), any::<bool>()).prop_map(|(m, eos, early)| {
            let mut msg = request_headers(m, "/v1/chat/completions", eos);
            if let Some(pc) = msg.protocol_config.as_mut() {
                pc.send_body_without_waiting_for_header_response = early;
            }
            msg
        }),
        (body, any::<bool>()).prop_map(|(b, eos)| request_body(&b, eos)),
        Just(ProcessingRequest {
            request: Some(Request::RequestTrailers(HttpTrailers::default())),
            ..Default::default()
        }),
        (any::<bool>(), any::<u64>()).prop_map(|(eos, pick)| response_headers(
            "200",
            Some(forwarded(pick, None)),
            eos
        )),
        any::<bool>().prop_map(|eos| response_body(b"data: x\n\n", eos)),
        Just(ProcessingRequest::default()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, .. ProptestConfig::default() })]

    /// Any message sequence, in any order, never panics, and once the streams are gone and the
    /// table swept, nothing is left in flight.
    #[test]
    fn any_message_sequence_is_safe_and_leaks_nothing(msgs in proptest::collection::vec(arb_message(), 0..12)) {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let f = Fixture::new();
        rt.block_on(async {
            let mut s = f.stream();
            for m in msgs {
                let _ = s.on_message(m).await;
            }
        });
        f.table.sweep(std::time::Duration::ZERO, std::time::Duration::ZERO);
        prop_assert_eq!(f.in_flight(), 0);
    }
}

/// The first message of an early STREAMED stream: Envoy sends the body without waiting for the
/// headers' reply (`send_body_without_waiting_for_header_response`).
fn early_streamed_headers() -> ProcessingRequest {
    let mut msg = request_headers(BodySendMode::Streamed, "/v1/chat/completions", false);
    if let Some(pc) = msg.protocol_config.as_mut() {
        pc.send_body_without_waiting_for_header_response = true;
    }
    msg
}

/// Every reply after the first is a body reply that lets its chunk through unchanged.
fn assert_body_continues(replies: &[ProcessingResponse]) {
    for reply in replies {
        let Some(Response::RequestBody(body)) = &reply.response else {
            panic!("not a body reply: {reply:?}")
        };
        let common = body.response.as_ref();
        assert!(
            common.is_none_or(|c| c.body_mutation.is_none() && c.header_mutation.is_none()),
            "{reply:?}"
        );
    }
}

#[tokio::test]
async fn early_streamed_holds_headers_then_lets_every_chunk_through() {
    let f = Fixture::new();
    let mut s = f.stream();
    assert!(
        s.on_message(early_streamed_headers()).await.is_empty(),
        "the headers' reply waits for the body"
    );
    let (a, b) = CHAT.as_bytes().split_at(20);
    assert!(s.on_message(request_body(a, false)).await.is_empty());
    assert!(s.on_message(request_body(b, false)).await.is_empty());
    let r = s.on_message(request_body(b"", true)).await;
    assert_eq!(r.len(), 4, "route + one reply per body message: {r:?}");
    assert!(matches!(r[0].response, Some(Response::RequestHeaders(_))));
    assert!(destination(&r[0]).is_some(), "{r:?}");
    assert_body_continues(&r[1..]);
    assert_eq!(s.outcome(), Outcome::Routed);
    assert_eq!(f.in_flight(), 1);
}

/// Early STREAMED with trailers, in the order Envoy 1.40 sends them: it holds the trailers until
/// every body message is answered, so the last chunk comes without end of stream and the body
/// ends at its declared content-length; the trailers come after the replies.
#[tokio::test]
async fn early_streamed_with_trailers_ends_the_body_at_its_content_length() {
    let f = Fixture::new();
    let mut s = f.stream();
    let mut first = early_streamed_headers();
    let Some(Request::RequestHeaders(h)) = first.request.as_mut() else {
        unreachable!()
    };
    h.headers.as_mut().unwrap().headers.push(HeaderValue {
        key: "content-length".into(),
        raw_value: CHAT.len().to_string().into_bytes(),
        ..Default::default()
    });
    assert!(s.on_message(first).await.is_empty());
    let (a, b) = CHAT.as_bytes().split_at(30);
    assert!(
        s.on_message(request_body(a, false)).await.is_empty(),
        "short of the declared length"
    );
    let r = s.on_message(request_body(b, false)).await;
    assert_eq!(r.len(), 3, "route + a reply per body message: {r:?}");
    assert!(destination(&r[0]).is_some(), "{r:?}");
    assert_body_continues(&r[1..]);
    let r = s
        .on_message(ProcessingRequest {
            request: Some(Request::RequestTrailers(HttpTrailers::default())),
            ..Default::default()
        })
        .await;
    assert_eq!(r.len(), 1, "{r:?}");
    assert!(matches!(r[0].response, Some(Response::RequestTrailers(_))));
    assert_eq!(s.outcome(), Outcome::Routed);
}

#[tokio::test]
async fn early_streamed_refuses_a_bad_body_with_the_error_not_a_pick() {
    let f = Fixture::new();
    let mut s = f.stream();
    s.on_message(early_streamed_headers()).await;
    let r = s.on_message(request_body(b"{\"model\":", true)).await;
    assert_eq!(r.len(), 1, "{r:?}");
    assert_eq!(immediate_status(&r[0]), Some(400));
    assert_eq!(f.in_flight(), 0);
}

#[tokio::test]
async fn a_paused_early_streamed_body_is_let_go_unrouted() {
    let f = Fixture::new();
    let flow = super::divert::PaceFlow::default();
    let mut s = f.stream().with_pace_flow(Some(flow.clone()));
    assert!(s.pause_deadline().is_none(), "nothing to wait for yet");
    s.on_message(early_streamed_headers()).await;
    let (a, b) = CHAT.as_bytes().split_at(20);
    assert!(s.on_message(request_body(a, false)).await.is_empty());
    let deadline = s.pause_deadline().expect("a body that has not ended");
    assert!(deadline > tokio::time::Instant::now());
    let r = s.release_paused_body();
    assert_eq!(r.len(), 2, "headers + the one body message: {r:?}");
    assert!(matches!(r[0].response, Some(Response::RequestHeaders(_))));
    assert!(destination(&r[0]).is_none(), "not routed: {r:?}");
    assert_body_continues(&r[1..]);
    assert!(s.pause_deadline().is_none());
    assert!(flow.is_request_read(), "the rest of the body is not paced");
    // The rest of the body passes as it comes.
    let r = s.on_message(request_body(b, true)).await;
    assert_eq!(r.len(), 1);
    assert_body_continues(&r);
    assert_eq!(s.outcome(), Outcome::Unrouted);
    assert_eq!(f.in_flight(), 0);
}

#[tokio::test]
async fn only_early_streamed_bodies_have_a_pause_deadline() {
    let f = Fixture::new();
    for mode in [
        BodySendMode::Buffered,
        BodySendMode::FullDuplexStreamed,
        BodySendMode::Streamed,
    ] {
        let mut s = f.stream();
        s.on_message(request_headers(mode, "/v1/chat/completions", false))
            .await;
        assert!(s.pause_deadline().is_none(), "{mode:?}");
    }
    let mut s = f.stream();
    s.on_message(early_streamed_headers()).await;
    assert!(s.pause_deadline().is_some(), "the control");
    let f = Fixture::with(&CONFIG.replace("observe_interval_ms: 0}", "streamed_body_pause_ms: 0}"));
    let mut s = f.stream();
    s.on_message(early_streamed_headers()).await;
    assert!(s.pause_deadline().is_none(), "0 waits for Envoy's timeout");
}

/// While the long-body pace holds a message of the stream back, the wait is the router's: no
/// pause deadline runs (the pace refuses the request itself past its own bound).
#[tokio::test]
async fn no_pause_deadline_while_the_pace_holds_the_stream() {
    let f = Fixture::new();
    let flow = super::divert::PaceFlow::default();
    let mut s = f.stream().with_pace_flow(Some(flow.clone()));
    s.on_message(early_streamed_headers()).await;
    assert!(s.pause_deadline().is_some());
    flow.set_holding(true);
    assert!(s.pause_deadline().is_none());
    flow.set_holding(false);
    assert!(s.pause_deadline().is_some());
}
