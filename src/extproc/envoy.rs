//! Building and reading Envoy ext_proc messages. Everything protobuf-shaped lives here, so the
//! stream state machine reads as protocol steps, not struct literals.

use std::collections::HashMap;
use std::net::SocketAddr;

use envoy_types::pb::envoy::config::core::v3::{
    header_value_option::HeaderAppendAction, HeaderMap, HeaderValue, HeaderValueOption, Metadata,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_response, BodyMutation, BodyResponse, CommonResponse, HeaderMutation,
    HeadersResponse, ImmediateResponse, ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};

/// Metadata namespace the endpoint picker protocol writes the destination into.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// Metadata namespace a gateway uses for the subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// Key of the subset hint inside [`SUBSET_NAMESPACE`].
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// Key a gateway reports the endpoint it actually used under, in [`LB_NAMESPACE`].
pub const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";
/// Our own metadata namespace: carries the pick id from the picker to the observer stream.
pub const KVROUTER_NAMESPACE: &str = "kvrouter";
/// Key of the pick id inside [`KVROUTER_NAMESPACE`].
pub const PICK_KEY: &str = "pick";

/// Which response slot of the protocol a reply fills.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// Reply to request headers.
    RequestHeaders,
    /// Reply to a request body chunk.
    RequestBody,
    /// Reply to request trailers.
    RequestTrailers,
    /// Reply to response headers.
    ResponseHeaders,
    /// Reply to a response body chunk.
    ResponseBody,
    /// Reply to response trailers.
    ResponseTrailers,
}

fn wrap(slot: Slot, common: CommonResponse) -> processing_response::Response {
    use processing_response::Response as R;
    let headers = HeadersResponse {
        response: Some(common),
    };
    match slot {
        Slot::RequestHeaders => R::RequestHeaders(headers),
        Slot::ResponseHeaders => R::ResponseHeaders(headers),
        Slot::RequestBody => R::RequestBody(BodyResponse {
            response: headers.response,
        }),
        Slot::ResponseBody => R::ResponseBody(BodyResponse {
            response: headers.response,
        }),
        Slot::RequestTrailers => R::RequestTrailers(TrailersResponse::default()),
        Slot::ResponseTrailers => R::ResponseTrailers(TrailersResponse::default()),
    }
}

/// "Carry on unchanged" for `slot`.
pub fn continue_(slot: Slot) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(wrap(slot, CommonResponse::default())),
        ..Default::default()
    }
}

/// Routes the request: sets `header` to `destination` (overwriting whatever the client sent),
/// writes the same value into `envoy.lb` metadata, and clears the route cache so the route is
/// picked again with the header present. `slot` is `RequestHeaders` (no body, or full-duplex
/// streaming) or `RequestBody` (buffered). `pick` goes into `kvrouter` metadata for the observer.
pub fn route(slot: Slot, header: &str, destination: &str, pick: u64) -> ProcessingResponse {
    let common = CommonResponse {
        header_mutation: Some(HeaderMutation {
            set_headers: vec![header_option(header, destination)],
            remove_headers: Vec::new(),
        }),
        clear_route_cache: true,
        ..Default::default()
    };
    let lb = Struct {
        fields: HashMap::from([(header.to_string(), string_value(destination))]),
    };
    let ours = Struct {
        fields: HashMap::from([(PICK_KEY.to_string(), string_value(&pick.to_string()))]),
    };
    ProcessingResponse {
        response: Some(wrap(slot, common)),
        dynamic_metadata: Some(Struct {
            fields: HashMap::from([
                (
                    LB_NAMESPACE.to_string(),
                    Value {
                        kind: Some(Kind::StructValue(lb)),
                    },
                ),
                (
                    KVROUTER_NAMESPACE.to_string(),
                    Value {
                        kind: Some(Kind::StructValue(ours)),
                    },
                ),
            ]),
        }),
        ..Default::default()
    }
}

/// Marks the request of a `route` reply for Envoy's observer filter (it runs only on requests
/// carrying [`crate::envoyconf::OBSERVE_HEADER`]).
pub fn watch(reply: &mut ProcessingResponse) {
    if let Some(common) = common_mut(reply) {
        common
            .header_mutation
            .get_or_insert_with(Default::default)
            .set_headers
            .push(header_option(crate::envoyconf::OBSERVE_HEADER, "1"));
    }
}

/// The common part of a request headers or body reply.
fn common_mut(reply: &mut ProcessingResponse) -> Option<&mut CommonResponse> {
    use processing_response::Response as R;
    match &mut reply.response {
        Some(R::RequestHeaders(h)) => Some(h.response.get_or_insert_with(Default::default)),
        Some(R::RequestBody(b)) => Some(b.response.get_or_insert_with(Default::default)),
        _ => None,
    }
}

/// Replaces the BUFFERED request body of a `route` reply with `body`, and its `content-length`
/// to match. (In the streamed modes Envoy removes the content-length when the headers come and
/// skips setting one; the new bytes go out in the chunks' replies instead.)
pub fn body_changed(reply: &mut ProcessingResponse, body: Vec<u8>) {
    let Some(common) = common_mut(reply) else {
        return;
    };
    common
        .header_mutation
        .get_or_insert_with(Default::default)
        .set_headers
        .push(header_option("content-length", &body.len().to_string()));
    common.body_mutation = Some(BodyMutation {
        mutation: Some(body_mutation::Mutation::Body(body)),
    });
}

/// The pick id the picker wrote, as forwarded to an observer stream.
pub fn pick_id(metadata: Option<&Metadata>) -> Option<u64> {
    let value = metadata?
        .filter_metadata
        .get(KVROUTER_NAMESPACE)?
        .fields
        .get(PICK_KEY)?;
    match &value.kind {
        Some(Kind::StringValue(s)) => s.parse().ok(),
        Some(Kind::NumberValue(n)) => Some(*n as u64),
        _ => None,
    }
}

/// Echoes one request body chunk in full-duplex streamed mode (moved, not copied).
pub fn streamed_request_body(chunk: Vec<u8>, end_of_stream: bool) -> ProcessingResponse {
    streamed_body(Slot::RequestBody, chunk, end_of_stream)
}

/// Replaces one request body chunk in STREAMED mode with `body` (a chunk of the salted body).
pub fn replaced_request_chunk(body: Vec<u8>) -> ProcessingResponse {
    let common = CommonResponse {
        body_mutation: Some(BodyMutation {
            mutation: Some(body_mutation::Mutation::Body(body)),
        }),
        ..Default::default()
    };
    ProcessingResponse {
        response: Some(wrap(Slot::RequestBody, common)),
        ..Default::default()
    }
}

/// Echoes one response body chunk in full-duplex streamed mode (moved, not copied).
pub fn streamed_response_body(chunk: Vec<u8>, end_of_stream: bool) -> ProcessingResponse {
    streamed_body(Slot::ResponseBody, chunk, end_of_stream)
}

fn streamed_body(slot: Slot, body: Vec<u8>, end_of_stream: bool) -> ProcessingResponse {
    let common = CommonResponse {
        body_mutation: Some(BodyMutation {
            mutation: Some(body_mutation::Mutation::StreamedResponse(
                StreamedBodyResponse {
                    body,
                    end_of_stream,
                    ..Default::default()
                },
            )),
        }),
        ..Default::default()
    };
    ProcessingResponse {
        response: Some(wrap(slot, common)),
        ..Default::default()
    }
}

/// Answers the client directly: `status`, a JSON `body`, and extra headers.
pub fn immediate(
    status: u16,
    body: Vec<u8>,
    extra_headers: &[(&str, String)],
    details: &str,
) -> ProcessingResponse {
    let mut set_headers = vec![header_option("content-type", "application/json")];
    set_headers.extend(extra_headers.iter().map(|(k, v)| header_option(k, v)));
    ProcessingResponse {
        response: Some(processing_response::Response::ImmediateResponse(
            ImmediateResponse {
                status: Some(HttpStatus {
                    code: i32::from(status),
                }),
                headers: Some(HeaderMutation {
                    set_headers,
                    remove_headers: Vec::new(),
                }),
                body,
                grpc_status: None,
                details: details.to_string(),
            },
        )),
        ..Default::default()
    }
}

/// A header to set, replacing any existing value. Envoy 1.40 only applies `raw_value`.
fn header_option(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_string(),
            value: String::new(),
            raw_value: value.as_bytes().to_vec(),
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

fn string_value(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_string())),
    }
}

/// The value of header `name` (lowercase) in `map`, from `raw_value` or `value`.
pub fn header<'a>(map: Option<&'a HeaderMap>, name: &str) -> Option<&'a [u8]> {
    map?.headers.iter().find(|h| h.key == name).map(|h| {
        if h.raw_value.is_empty() {
            h.value.as_bytes()
        } else {
            h.raw_value.as_slice()
        }
    })
}

/// [`header`] as UTF-8 text, if it is.
pub fn header_str<'a>(map: Option<&'a HeaderMap>, name: &str) -> Option<&'a str> {
    header(map, name).and_then(|v| std::str::from_utf8(v).ok())
}

/// A string attribute Envoy attached (`request_attributes` / `response_attributes`), whatever
/// filter name it is grouped under.
pub fn attribute_str<'a>(attributes: &'a HashMap<String, Struct>, key: &str) -> Option<&'a str> {
    attributes
        .values()
        .filter_map(|s| s.fields.get(key))
        .find_map(|v| match &v.kind {
            Some(Kind::StringValue(s)) => Some(s.as_str()),
            _ => None,
        })
}

/// A numeric attribute Envoy attached (a CEL `int`/`uint` arrives as a number; a string holding
/// one is accepted too), whatever filter name it is grouped under.
pub fn attribute_u64(attributes: &HashMap<String, Struct>, key: &str) -> Option<u64> {
    attributes
        .values()
        .filter_map(|s| s.fields.get(key))
        .find_map(|v| match &v.kind {
            Some(Kind::NumberValue(n)) if n.is_finite() && *n >= 0.0 => Some(*n as u64),
            Some(Kind::StringValue(s)) => s.trim().parse().ok(),
            _ => None,
        })
}

/// The value of request header `name` (lowercase), sent as the request attribute
/// `request.headers['<name>']` by an Envoy configured to skip the request headers
/// (`request_attributes: ["request.headers['<name>']"]`); `None` when it was not sent.
pub fn header_attribute<'a>(
    attributes: &'a HashMap<String, Struct>,
    name: &str,
) -> Option<&'a str> {
    attributes
        .values()
        .flat_map(|s| s.fields.iter())
        .find(|(key, _)| attribute_names_header(key, name))
        .and_then(|(_, v)| match &v.kind {
            Some(Kind::StringValue(s)) => Some(s.as_str()),
            _ => None,
        })
}

/// Whether attribute key `key` is `request.headers['<name>']`, without building it.
fn attribute_names_header(key: &str, name: &str) -> bool {
    key.strip_prefix("request.headers['")
        .and_then(|rest| rest.strip_suffix("']"))
        .is_some_and(|header| header == name)
}

/// How many upstream attempts Envoy made for the request (`upstream.request_attempt_count`,
/// forwarded as a response attribute by the observer filter; Envoy 1.33+).
pub fn attempt_count(attributes: &HashMap<String, Struct>) -> Option<u64> {
    attribute_u64(attributes, "upstream.request_attempt_count").filter(|&n| n > 0)
}

/// Addresses listed as a string (comma-separated) or a list of strings.
fn addresses(value: &Value) -> Vec<SocketAddr> {
    match &value.kind {
        Some(Kind::StringValue(s)) => s.split(',').filter_map(|a| a.trim().parse().ok()).collect(),
        Some(Kind::ListValue(ListValue { values })) => values.iter().flat_map(addresses).collect(),
        _ => Vec::new(),
    }
}

/// The gateway's subset hint, if its metadata carries one: the only endpoints we may pick.
pub fn subset_hint(metadata: Option<&Metadata>) -> Option<Vec<SocketAddr>> {
    let value = metadata?
        .filter_metadata
        .get(SUBSET_NAMESPACE)?
        .fields
        .get(SUBSET_KEY)?;
    Some(addresses(value))
}

/// The endpoint the gateway reports having used, from `envoy.lb` metadata or the
/// `upstream.address` attribute.
pub fn served_endpoint(
    metadata: Option<&Metadata>,
    attributes: &HashMap<String, Struct>,
) -> Option<SocketAddr> {
    let from_metadata = metadata
        .and_then(|m| m.filter_metadata.get(LB_NAMESPACE))
        .and_then(|s| s.fields.get(SERVED_KEY))
        .and_then(|v| addresses(v).into_iter().next());
    from_metadata.or_else(|| {
        attributes
            .values()
            .filter_map(|s| s.fields.get("upstream.address"))
            .flat_map(addresses)
            .next()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_sets_raw_value_overwrite_metadata_and_clears_cache() {
        let r = route(Slot::RequestBody, "x-dest", "10.0.0.1:80,10.0.0.2:80", 42);
        let Some(processing_response::Response::RequestBody(body)) = &r.response else {
            panic!("wrong slot: {r:?}")
        };
        let common = body.response.as_ref().unwrap();
        assert!(common.clear_route_cache);
        let set = &common.header_mutation.as_ref().unwrap().set_headers[0];
        assert_eq!(
            set.append_action,
            HeaderAppendAction::OverwriteIfExistsOrAdd as i32
        );
        let hv = set.header.as_ref().unwrap();
        assert_eq!(hv.key, "x-dest");
        assert_eq!(hv.raw_value, b"10.0.0.1:80,10.0.0.2:80");
        assert!(hv.value.is_empty(), "Envoy drops `value` mutations");
        let md = r.dynamic_metadata.as_ref().unwrap();
        let Some(Kind::StructValue(lb)) = &md.fields[LB_NAMESPACE].kind else {
            panic!()
        };
        assert_eq!(
            lb.fields["x-dest"].kind,
            Some(Kind::StringValue("10.0.0.1:80,10.0.0.2:80".into()))
        );
        // The observer reads the pick id back from forwarded metadata.
        let forwarded = Metadata {
            filter_metadata: md
                .fields
                .iter()
                .filter_map(|(k, v)| match &v.kind {
                    Some(Kind::StructValue(s)) => Some((k.clone(), s.clone())),
                    _ => None,
                })
                .collect(),
            ..Default::default()
        };
        assert_eq!(pick_id(Some(&forwarded)), Some(42));
        assert_eq!(pick_id(None), None);
    }

    #[test]
    fn subset_hint_accepts_list_and_string_forms() {
        let mk = |v: Value| Metadata {
            filter_metadata: HashMap::from([(
                SUBSET_NAMESPACE.to_string(),
                Struct {
                    fields: HashMap::from([(SUBSET_KEY.to_string(), v)]),
                },
            )]),
            ..Default::default()
        };
        let list = Value {
            kind: Some(Kind::ListValue(ListValue {
                values: vec![string_value("10.0.0.1:80"), string_value("10.0.0.2:80")],
            })),
        };
        assert_eq!(subset_hint(Some(&mk(list))).unwrap().len(), 2);
        let s = string_value("10.0.0.1:80, [::1]:8");
        assert_eq!(
            subset_hint(Some(&mk(s))).unwrap(),
            vec![
                "10.0.0.1:80".parse::<SocketAddr>().unwrap(),
                "[::1]:8".parse().unwrap()
            ]
        );
        assert_eq!(subset_hint(None), None);
        assert_eq!(subset_hint(Some(&Metadata::default())), None);
    }

    #[test]
    fn immediate_response_carries_status_headers_and_body() {
        let r = immediate(
            503,
            b"{}".to_vec(),
            &[("retry-after", "1".into())],
            "no_endpoint",
        );
        let Some(processing_response::Response::ImmediateResponse(ir)) = r.response else {
            panic!()
        };
        assert_eq!(ir.status.unwrap().code, 503);
        let keys: Vec<_> = ir
            .headers
            .unwrap()
            .set_headers
            .into_iter()
            .map(|h| h.header.unwrap().key)
            .collect();
        assert_eq!(keys, vec!["content-type", "retry-after"]);
        assert_eq!(ir.body, b"{}");
    }
}
