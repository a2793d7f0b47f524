//! Renders Envoy 1.40 bootstrap configs that attach kvrouter: the files in `envoy/` are this
//! module's output (a test keeps them in sync), and `kvrouter envoy-config` prints one for any
//! ports.
//!
//! Two cluster styles:
//! - [`ClusterStyle::OverrideHost`] (default): one route to a cluster whose load balancer is
//!   `envoy.load_balancing_policies.override_host`. It reads the picker's comma-separated list from
//!   `envoy.lb` metadata, tries the first address, moves to the next one on each retry, and uses
//!   LEAST_REQUEST when there is no pick (router down: fail open). The endpoint picker protocol's
//!   fallback list only works this way.
//! - [`ClusterStyle::OriginalDst`]: a route that matches when the destination header is present
//!   and goes to an ORIGINAL_DST cluster (`use_http_header`), and a fallback route to a
//!   LEAST_REQUEST cluster. Envoy 1.40 parses the whole header as one address, so the router must
//!   send no fallbacks (`routing.fallback_endpoints: 0`), and a retry goes back to the same host.
//!
//! Replicas are listed statically or read from an EDS file that kvrouter keeps up to date
//! (`envoy.eds_path`), so replicas added to the router's config reach Envoy without a restart.
//!
//! Body modes: BUFFERED (default) fails open cleanly when the router is down. FULL_DUPLEX_STREAMED
//! streams the body through the router, but Envoy 1.40 fails *closed* (HTTP 500) when the router
//! is unreachable once a body chunk was sent, and arms no message timeout. STREAMED with
//! `send_body_without_waiting_for_header_response` sends the headers and the body at once, as
//! full duplex does (one round trip where BUFFERED takes two), while Envoy keeps the chunks and
//! its message timeout, so it fails open like BUFFERED.
//!
//! What crosses to the router per request is kept to what it uses (each ext_proc message costs
//! Envoy and the router tens of microseconds of CPU):
//! - the picker sees the request headers and the body; it needs no response messages (its stream
//!   lives as long as the request, which is how kvrouter learns the request's end).
//! - the observer sends the response headers and the body in STREAMED observability mode, and
//!   kvrouter closes its stream at the first body byte: Envoy then stops sending, so a
//!   1000-token stream costs two messages, not a thousand. The end of the response is the end of
//!   the picker's stream, which lives as long as the request.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;

/// How the picked endpoint is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ClusterStyle {
    /// override_host load balancing over the replica cluster (fallback lists, retries move on).
    OverrideHost,
    /// ORIGINAL_DST cluster keyed by the destination header, plus a fallback route.
    OriginalDst,
}

/// How Envoy hands the request body to the router.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BodyMode {
    /// Envoy buffers the body and sends it in one message; clean fail-open.
    Buffered,
    /// Envoy streams chunks and the router echoes them back after deciding.
    FullDuplex,
    /// Envoy streams chunks without waiting for the headers' reply (STREAMED with
    /// `send_body_without_waiting_for_header_response`) and keeps them; the router answers the
    /// headers with the pick once the body has ended. One round trip, clean fail-open.
    Streamed,
}

/// Where Envoy reaches kvrouter's ext_proc server: a TCP address, or a Unix socket
/// (`unix:PATH`; kvrouter's `server.grpc_unix_socket`) when the two run on one host or in one
/// pod, which costs both sides less per message than loopback TCP (docs/envoy.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExtprocAddress {
    /// `host:port`.
    Tcp(SocketAddr),
    /// A Unix socket's path.
    Unix(PathBuf),
}

impl From<SocketAddr> for ExtprocAddress {
    fn from(addr: SocketAddr) -> Self {
        ExtprocAddress::Tcp(addr)
    }
}

impl std::str::FromStr for ExtprocAddress {
    type Err = String;

    /// `unix:PATH` or `host:port`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.strip_prefix("unix:") {
            Some("") => Err("`unix:` needs a path (unix:/run/kvrouter/grpc.sock)".into()),
            // Envoy reads `@name` as Linux's abstract namespace; kvrouter binds files only.
            Some(path) if path.starts_with('@') => Err(format!(
                "{s:?}: abstract sockets are not supported; give the socket file's path (unix:/run/kvrouter/grpc.sock)"
            )),
            Some(path) => Ok(ExtprocAddress::Unix(PathBuf::from(path))),
            None => s
                .parse()
                .map(ExtprocAddress::Tcp)
                .map_err(|_| format!("{s:?} is neither host:port (an IP address) nor unix:PATH")),
        }
    }
}

impl std::fmt::Display for ExtprocAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExtprocAddress::Tcp(addr) => write!(f, "{addr}"),
            ExtprocAddress::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

/// Where Envoy learns the replica addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Replicas {
    /// A fixed list.
    Static(Vec<SocketAddr>),
    /// An EDS file (JSON DiscoveryResponse) that kvrouter rewrites on every endpoint change.
    EdsFile(PathBuf),
}

/// Everything a rendered config depends on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvoyOptions {
    /// The client-facing listener.
    pub listen: SocketAddr,
    /// Envoy's admin interface (port 0: any).
    pub admin: SocketAddr,
    /// kvrouter's ext_proc gRPC address.
    pub extproc: ExtprocAddress,
    /// The replicas.
    pub replicas: Replicas,
    /// Cluster style.
    pub cluster: ClusterStyle,
    /// Body mode of the picker filter.
    pub body_mode: BodyMode,
    /// The destination header name.
    pub destination_header: String,
    /// Largest request body Envoy accepts and can retry, in bytes.
    pub max_body_bytes: u64,
    /// Attach kvrouter (default). `false` renders the same Envoy without the ext_proc filters and
    /// with plain LEAST_REQUEST balancing: the baseline for measuring the router's overhead.
    pub attach: bool,
    /// Add the observer filter (default): kvrouter then sees each response's status, served
    /// endpoint and first-byte time without delaying it. Without it kvrouter still tracks each
    /// request until it ends (the picker stream lives as long as the request), but learns no
    /// first-byte times and gets no passive health signal from responses.
    pub observe: bool,
    /// The tenancy header kvrouter trusts (`tenancy.header`). Envoy removes it from every
    /// client request before any filter runs, so only Envoy itself can set it: the `jwt`
    /// filter below, or one the operator adds. Default: none (nothing stripped; then
    /// `tenancy.header` must not be set either).
    pub tenant_header: Option<String>,
    /// Verify the client's JWT and copy a claim into `tenant_header` (needs `tenant_header`).
    /// Default: none.
    pub jwt: Option<JwtOptions>,
    /// The picker filter's ext_proc `message_timeout`, in ms: how long Envoy waits for one
    /// reply before failing open. With flow control on it must exceed
    /// `flow_control.max_wait_ms` (see [`message_timeout_for_wait`]), or a queued BUFFERED
    /// request bypasses the queue when Envoy gives up on it. Default 2000.
    pub message_timeout_ms: u64,
}

/// The ext_proc `message_timeout` that lets a request wait `max_wait_ms` in kvrouter's queue
/// and still get its decision (one second of slack for parsing and routing), in ms.
pub fn message_timeout_for_wait(max_wait_ms: u64) -> u64 {
    max_wait_ms + 1000
}

/// An Envoy duration for `ms` milliseconds.
fn duration(ms: u64) -> String {
    if ms % 1000 == 0 {
        format!("{}s", ms / 1000)
    } else {
        format!("{}.{:03}s", ms / 1000, ms % 1000)
    }
}

/// Envoy's `jwt_authn` filter, as the source of the tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JwtOptions {
    /// The `iss` a token must carry.
    pub issuer: String,
    /// Accepted `aud` values; empty: any.
    pub audiences: Vec<String>,
    /// A local JWKS file (Envoy reads it at start).
    pub jwks_file: PathBuf,
    /// The claim holding the tenant id.
    pub tenant_claim: String,
    /// Reject requests without a token (401). `false`: a request without a token passes with
    /// no tenant (a token that is present must still verify).
    pub required: bool,
}

impl Default for EnvoyOptions {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            admin: SocketAddr::from(([127, 0, 0, 1], 9901)),
            extproc: SocketAddr::from(([127, 0, 0, 1], 9002)).into(),
            replicas: Replicas::Static(
                (8001..=8004)
                    .map(|p| SocketAddr::from(([127, 0, 0, 1], p)))
                    .collect(),
            ),
            cluster: ClusterStyle::OverrideHost,
            body_mode: BodyMode::Buffered,
            destination_header: "x-gateway-destination-endpoint".into(),
            max_body_bytes: 32 << 20,
            attach: true,
            observe: true,
            tenant_header: None,
            jwt: None,
            message_timeout_ms: 2000,
        }
    }
}

/// The request header kvrouter sets on the requests it wants watched: the observer filter runs
/// only where it is `1` (Envoy removes a client's copy before any filter runs).
pub const OBSERVE_HEADER: &str = "x-kvrouter-observe";

/// The observer filter (see [`EnvoyOptions::observe`]), wrapped in a matcher so it runs only on
/// the requests kvrouter marked with [`OBSERVE_HEADER`] (the picker's reply sets it; its
/// headers reach this filter only after that reply, in both body modes). An unmarked request
/// opens no observer stream at all: at 8 concurrent clients on 2 cores the observer's stream
/// per request cost about a third of Envoy's requests per second (docs/envoy.md).
const OBSERVER_FILTER: &str = "\
\x20         # The observer: sees the response's headers and first body bytes without ever
\x20         # holding them up, so kvrouter learns the status, the endpoint that served and the
\x20         # time to first byte. kvrouter closes the stream at the first byte: the rest of
\x20         # the body is not sent. It runs only on the requests kvrouter marks with
\x20         # x-kvrouter-observe: 1 (a sample; the others open no stream).
\x20         - name: kvrouter_observe
\x20           typed_config:
\x20             \"@type\": type.googleapis.com/envoy.extensions.common.matching.v3.ExtensionWithMatcher
\x20             xds_matcher:
\x20               matcher_list:
\x20                 matchers:
\x20                 - predicate:
\x20                     not_matcher:
\x20                       single_predicate:
\x20                         input:
\x20                           name: observe
\x20                           typed_config:
\x20                             \"@type\": type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput
\x20                             header_name: x-kvrouter-observe
\x20                         value_match: {exact: \"1\"}
\x20                   on_match:
\x20                     action:
\x20                       name: skip
\x20                       typed_config:
\x20                         \"@type\": type.googleapis.com/envoy.extensions.filters.common.matcher.action.v3.SkipFilter
\x20             extension_config:
\x20               name: kvrouter_observe
\x20               typed_config:
\x20                 \"@type\": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
\x20                 grpc_service:
\x20                   envoy_grpc: {cluster_name: kvrouter_observe}
\x20                 stat_prefix: kvrouter_observe
\x20                 failure_mode_allow: true
\x20                 observability_mode: true
\x20                 deferred_close_timeout: 1s
\x20                 processing_mode:
\x20                   request_header_mode: SKIP
\x20                   request_body_mode: NONE
\x20                   response_header_mode: SEND
\x20                   response_body_mode: STREAMED
\x20                   response_trailer_mode: SKIP
\x20                 response_attributes: [\"upstream.address\", \"upstream.request_attempt_count\"]
\x20                 metadata_options:
\x20                   forwarding_namespaces: {untyped: [\"kvrouter\", \"envoy.lb\"]}
";

/// The name of the replica cluster (also the EDS cluster name kvrouter writes).
pub const REPLICA_CLUSTER: &str = "llm_replicas";

/// Circuit-breaker limits of the replica clusters. Envoy's defaults (1024 connections, pending
/// and active requests, and only 3 retries in flight per cluster) are made for short RPCs: a
/// fleet of LLM replicas holds thousands of long streams over HTTP/1.1 connections, and when a
/// replica dies under load every request it held is retried at once. With the default, all but
/// three of those retries overflow and reach the client as 503s (measured: 619 overflows and 477
/// failed requests in the kill test while the dead replica was still being picked). The
/// replicas' own queues do the admission control; each request still retries at most
/// `num_retries` times.
const REPLICA_CIRCUIT_BREAKERS: &str = "\x20   circuit_breakers:\n\
     \x20     thresholds:\n\
     \x20     - {max_connections: 1000000, max_pending_requests: 1000000, max_requests: 1000000, max_retries: 1000000}\n";

fn socket(addr: &SocketAddr) -> String {
    format!(
        "{{socket_address: {{address: \"{}\", port_value: {}}}}}",
        addr.ip(),
        addr.port()
    )
}

/// An Envoy `Address` for kvrouter's ext_proc server (a `pipe` for a Unix socket; the path
/// quoted as a JSON string, which YAML reads as the same double-quoted string).
fn extproc_address(addr: &ExtprocAddress) -> String {
    match addr {
        ExtprocAddress::Tcp(addr) => socket(addr),
        ExtprocAddress::Unix(path) => format!(
            "{{pipe: {{path: {}}}}}",
            serde_json::Value::from(path.to_string_lossy().as_ref())
        ),
    }
}

/// The `jwt_authn` filter that sets the tenant header from a verified claim (empty without
/// [`EnvoyOptions::jwt`] or [`EnvoyOptions::tenant_header`]).
fn jwt_filter(o: &EnvoyOptions) -> String {
    let (Some(jwt), Some(header)) = (&o.jwt, &o.tenant_header) else {
        return String::new();
    };
    let audiences = if jwt.audiences.is_empty() {
        String::new()
    } else {
        let list: Vec<String> = jwt.audiences.iter().map(|a| format!("{a:?}")).collect();
        format!("\x20                 audiences: [{}]\n", list.join(", "))
    };
    let requires = if jwt.required {
        "{provider_name: tenant}"
    } else {
        "{requires_any: {requirements: [{provider_name: tenant}, {allow_missing: {}}]}}"
    };
    format!(
        "\x20         # The tenant: a claim of a verified JWT, copied into the header kvrouter trusts\n\
         \x20         # (the client's own copy was removed above). An invalid token is a 401.\n\
         \x20         - name: envoy.filters.http.jwt_authn\n\
         \x20           typed_config:\n\
         \x20             \"@type\": type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication\n\
         \x20             providers:\n\
         \x20               tenant:\n\
         \x20                 issuer: {issuer:?}\n{audiences}\
         \x20                 local_jwks: {{filename: {jwks:?}}}\n\
         \x20                 claim_to_headers: [{{header_name: {header}, claim_name: {claim}}}]\n\
         \x20             rules:\n\
         \x20             - match: {{prefix: \"/\"}}\n\
         \x20               requires: {requires}\n",
        issuer = jwt.issuer,
        jwks = jwt.jwks_file.display().to_string(),
        claim = jwt.tenant_claim,
    )
}

/// Renders the bootstrap YAML.
pub fn render(o: &EnvoyOptions) -> String {
    let header = &o.destination_header;
    let full_duplex = o.body_mode == BodyMode::FullDuplex;
    let streamed = o.body_mode == BodyMode::Streamed;
    let mut y = String::new();
    let _ = writeln!(
        y,
        "# Envoy 1.40 bootstrap {what} (generated by `kvrouter envoy-config`; see\n\
         # docs/envoy.md). Cluster style: {cluster:?}; request body mode: {mode:?}.\n\
         node: {{id: kvrouter-envoy, cluster: kvrouter}}\n\
         admin:\n  address: {admin}\n\
         static_resources:\n  listeners:\n  - name: kvrouter_ingress\n    address: {listen}\n\
         \x20   # Small on purpose: it is also the socket read size (the ext_proc chunk size); the\n\
         \x20   # per-request body limit is raised on the virtual host instead.\n\
         \x20   per_connection_buffer_limit_bytes: 1048576\n\
         \x20   filter_chains:\n    - filters:\n      - name: envoy.filters.network.http_connection_manager\n\
         \x20       typed_config:\n\
         \x20         \"@type\": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager\n\
         \x20         stat_prefix: kvrouter\n\
         \x20         codec_type: AUTO\n\
         \x20         stream_idle_timeout: 300s\n\
         \x20         request_timeout: 0s\n\
         \x20         # Drop a client-sent destination before the route is picked: only kvrouter chooses.\n\
         \x20         early_header_mutation_extensions:\n\
         \x20         - name: envoy.http.early_header_mutation.header_mutation\n\
         \x20           typed_config:\n\
         \x20             \"@type\": type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation\n\
         \x20             mutations:\n\
         \x20             - remove: {header}\n{strip_observe}{strip_tenant}\
         \x20         http2_protocol_options:\n\
         \x20           initial_stream_window_size: 65536\n\
         \x20           initial_connection_window_size: 1048576\n\
         \x20         route_config:\n\
         \x20           name: kvrouter_routes\n\
         \x20           # Where each request went (after retries), for users and tests.\n\
         \x20           response_headers_to_add:\n\
         \x20           - header: {{key: x-kvrouter-upstream, value: \"%UPSTREAM_HOST%\"}}\n\
         \x20             append_action: OVERWRITE_IF_EXISTS_OR_ADD\n\
         {unobserve}\
         \x20           virtual_hosts:\n\
         \x20           - name: llm\n\
         \x20             domains: [\"*\"]\n\
         \x20             # Largest body Envoy buffers (BUFFERED mode) and keeps for retries.\n\
         \x20             request_body_buffer_limit: {max_body}\n\
         \x20             routes:",
        what = if o.attach { "attaching kvrouter" } else { "WITHOUT kvrouter (overhead baseline)" },
        cluster = o.cluster,
        mode = o.body_mode,
        admin = socket(&o.admin),
        listen = socket(&o.listen),
        max_body = o.max_body_bytes,
        unobserve = if o.attach && o.observe {
            format!(
                "\x20           # kvrouter's mark for the observer is not the engine's business.\n\
                 \x20           request_headers_to_remove: [{OBSERVE_HEADER}]\n"
            )
        } else {
            String::new()
        },
        strip_observe = if o.attach && o.observe {
            format!(
                "\x20             # Only kvrouter asks for a request to be watched.\n\
                 \x20             - remove: {OBSERVE_HEADER}\n"
            )
        } else {
            String::new()
        },
        strip_tenant = match &o.tenant_header {
            Some(t) => format!(
                "\x20             # The tenant kvrouter trusts: never the client's, only Envoy's own.\n\
                 \x20             - remove: {t}\n"
            ),
            None => String::new(),
        },
    );
    let retry = "\x20                 timeout: 0s\n\
         \x20                 retry_policy:\n\
         \x20                   retry_on: connect-failure,reset,refused-stream,retriable-status-codes\n\
         \x20                   retriable_status_codes: [503]\n\
         \x20                   num_retries: 2\n\
         \x20                   retry_host_predicate:\n\
         \x20                   - name: envoy.retry_host_predicates.previous_hosts\n\
         \x20                     typed_config:\n\
         \x20                       \"@type\": type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate\n\
         \x20                   host_selection_retry_max_attempts: 5\n";
    match (o.attach, o.cluster) {
        (false, _) | (true, ClusterStyle::OverrideHost) => {
            let _ = write!(
                y,
                "\n\x20             - name: llm\n\
                 \x20               match: {{prefix: \"/\"}}\n\
                 \x20               route:\n\
                 \x20                 cluster: {REPLICA_CLUSTER}\n{retry}"
            );
        }
        (true, ClusterStyle::OriginalDst) => {
            let _ = write!(
                y,
                "\n\x20             - name: picked\n\
                 \x20               match:\n\
                 \x20                 prefix: \"/\"\n\
                 \x20                 headers: [{{name: {header}, present_match: true}}]\n\
                 \x20               route:\n\
                 \x20                 cluster: llm_picked\n{retry}\
                 \x20             # No destination header (router down, fail-open): plain least-request.\n\
                 \x20             - name: fallback\n\
                 \x20               match: {{prefix: \"/\"}}\n\
                 \x20               route:\n\
                 \x20                 cluster: {REPLICA_CLUSTER}\n{retry}"
            );
        }
    }
    let (req_body, req_trailer, timeout_note) = if full_duplex {
        (
            "FULL_DUPLEX_STREAMED",
            "SEND",
            "not armed in FULL_DUPLEX_STREAMED; bodyless requests only",
        )
    } else if streamed {
        (
            "STREAMED",
            "SEND",
            "per message, re-armed by each body chunk; on expiry mid-body Envoy forwards what it holds (docs/envoy.md)",
        )
    } else {
        (
            "BUFFERED",
            "SKIP",
            "per message; on expiry the request fails open",
        )
    };
    // With tenancy the picker fails closed: a request kvrouter did not decide has no tenant
    // salt in its body, and must not reach an engine whose cache other tenants share.
    let (fail_open, fail_note, timeout_note) = if o.tenant_header.is_some() {
        (
            "false",
            "Tenancy: router down or slow fails the request (never sent unsalted).",
            if full_duplex {
                timeout_note
            } else {
                "per message; on expiry the request fails (tenancy: fail closed)"
            },
        )
    } else {
        (
            "true",
            "Router down or slow: serve the request anyway (LEAST_REQUEST).",
            timeout_note,
        )
    };
    let route_cache = match o.cluster {
        ClusterStyle::OverrideHost => "RETAIN     # the route never depends on the pick",
        ClusterStyle::OriginalDst => "DEFAULT    # re-match routes after the header is set",
    };
    if !o.attach {
        y.push_str(
            "\x20         http_filters:\n\
             \x20         - name: envoy.filters.http.router\n\
             \x20           typed_config:\n\
             \x20             \"@type\": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router\n\
             \x20 clusters:\n",
        );
    } else {
        let _ = write!(
        y,
        "\x20         http_filters:\n\
         {jwt}\
         \x20         # The picker: parses the request, answers with the destination.\n\
         \x20         - name: envoy.filters.http.ext_proc\n\
         \x20           typed_config:\n\
         \x20             \"@type\": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor\n\
         \x20             grpc_service:\n\
         \x20               envoy_grpc:\n\
         \x20                 cluster_name: kvrouter_extproc\n\
         \x20                 max_receive_message_length: {grpc_max}\n\
         \x20             stat_prefix: kvrouter\n\
         \x20             # {fail_note}\n\
         \x20             failure_mode_allow: {fail_open}\n\
         \x20             processing_mode:\n\
         \x20               request_header_mode: SEND\n\
         \x20               request_body_mode: {req_body}\n\
         \x20               request_trailer_mode: {req_trailer}\n\
         \x20               response_header_mode: SKIP\n\
         \x20               response_body_mode: NONE\n\
         \x20               response_trailer_mode: SKIP\n\
         {early_body}\
         \x20             message_timeout: {message_timeout}          # {timeout_note}\n\
         \x20             route_cache_action: {route_cache}\n\
         \x20             mutation_rules:\n\
         \x20               disallow_all: true\n\
         \x20               # Our own headers, those of the errors kvrouter answers with, and the\n\
         \x20               # length of a body it rewrote (a tenant's cache_salt).\n\
         \x20               allow_expression: {{regex: \"^({header_re}|x-kvrouter-.*|content-type|content-length|retry-after)$\"}}\n\
         \x20             metadata_options:\n\
         \x20               receiving_namespaces: {{untyped: [\"envoy.lb\", \"kvrouter\"]}}\n\
         \x20               forwarding_namespaces: {{untyped: [\"envoy.lb.subset_hint\"]}}\n\
         {observer}\
         \x20         - name: envoy.filters.http.router\n\
         \x20           typed_config:\n\
         \x20             \"@type\": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router\n\
         \x20 clusters:\n",
        grpc_max = o.max_body_bytes + (1 << 20),
        message_timeout = duration(o.message_timeout_ms),
        header_re = regex_escape(header),
        observer = if o.observe { OBSERVER_FILTER } else { "" },
        jwt = jwt_filter(o),
        early_body = if streamed {
            "\x20             # The body goes out with the headers; kvrouter answers the headers\n\
             \x20             # once it has the body, so the host is picked after the decision.\n\
             \x20             send_body_without_waiting_for_header_response: true\n"
        } else {
            ""
        },
    );
    }
    // The replica cluster.
    let _ = write!(
        y,
        "\x20 - name: {REPLICA_CLUSTER}\n\
         \x20   connect_timeout: 1s\n{REPLICA_CIRCUIT_BREAKERS}"
    );
    match &o.replicas {
        Replicas::Static(_) => y.push_str("    type: STATIC\n"),
        Replicas::EdsFile(path) => {
            let dir = path
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .map(|p| p.display().to_string())
                .unwrap_or_else(|| ".".into());
            let _ = write!(
                y,
                "\x20   type: EDS\n\
                 \x20   # kvrouter rewrites this file (atomically) whenever its endpoint set changes.\n\
                 \x20   eds_cluster_config:\n\
                 \x20     service_name: {REPLICA_CLUSTER}\n\
                 \x20     eds_config:\n\
                 \x20       resource_api_version: V3\n\
                 \x20       path_config_source:\n\
                 \x20         path: \"{}\"\n\
                 \x20         watched_directory: {{path: \"{dir}\"}}\n",
                path.display()
            );
        }
    }
    match (o.attach, o.cluster) {
        (true, ClusterStyle::OverrideHost) => {
            let _ = write!(
                y,
                "\x20   load_balancing_policy:\n\
                 \x20     policies:\n\
                 \x20     - typed_extension_config:\n\
                 \x20         name: envoy.load_balancing_policies.override_host\n\
                 \x20         typed_config:\n\
                 \x20           \"@type\": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost\n\
                 \x20           # Only the metadata: the header carries the same list, and reading both\n\
                 \x20           # would list every address twice.\n\
                 \x20           override_host_sources:\n\
                 \x20           - metadata: {{key: envoy.lb, path: [{{key: {header}}}]}}\n\
                 \x20           selected_host_key: {{key: envoy.lb, path: [{{key: x-gateway-destination-endpoint-served}}]}}\n\
                 \x20           fallback_policy:\n\
                 \x20             policies:\n\
                 \x20             - typed_extension_config:\n\
                 \x20                 name: envoy.load_balancing_policies.least_request\n\
                 \x20                 typed_config:\n\
                 \x20                   \"@type\": type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest\n"
            );
        }
        _ => y.push_str("    lb_policy: LEAST_REQUEST\n"),
    }
    if let Replicas::Static(addrs) = &o.replicas {
        let _ = write!(
            y,
            "\x20   load_assignment:\n\
             \x20     cluster_name: {REPLICA_CLUSTER}\n\
             \x20     endpoints:\n\
             \x20     - lb_endpoints:\n"
        );
        for a in addrs {
            let _ = writeln!(y, "        - endpoint: {{address: {}}}", socket(a));
        }
    }
    if !o.attach {
        return y;
    }
    if o.cluster == ClusterStyle::OriginalDst {
        let _ = write!(
            y,
            "\x20 # The picked replica, dialled at the address in the destination header.\n\
             \x20 - name: llm_picked\n\
             \x20   type: ORIGINAL_DST\n\
             \x20   lb_policy: CLUSTER_PROVIDED\n\
             \x20   connect_timeout: 1s\n{REPLICA_CIRCUIT_BREAKERS}\
             \x20   cleanup_interval: 60s\n\
             \x20   original_dst_lb_config:\n\
             \x20     use_http_header: true\n\
             \x20     http_header_name: {header}\n"
        );
    }
    // Two clusters to the same server: observer streams (one per response, possibly many at
    // once) can never crowd out picker streams. Circuit-breaker limits are raised because each
    // in-flight HTTP request holds a gRPC stream, and Envoy's default of 1024 concurrent requests
    // per cluster would otherwise make requests fail open under load.
    for (name, what) in [
        ("kvrouter_extproc", "picker"),
        ("kvrouter_observe", "observer"),
    ] {
        let _ = write!(
            y,
            "\x20 # kvrouter's ext_proc server, {what} streams (gRPC needs HTTP/2).\n\
             \x20 - name: {name}\n\
             \x20   type: STATIC\n\
             \x20   connect_timeout: 0.25s\n\
             \x20   circuit_breakers:\n\
             \x20     thresholds:\n\
             \x20     - {{max_connections: 1024, max_pending_requests: 65536, max_requests: 1000000}}\n\
             \x20   typed_extension_protocol_options:\n\
             \x20     envoy.extensions.upstreams.http.v3.HttpProtocolOptions:\n\
             \x20       \"@type\": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions\n\
             \x20       explicit_http_config:\n\
             \x20         http2_protocol_options:\n\
             \x20           initial_stream_window_size: 16777216\n\
             \x20           initial_connection_window_size: 33554432\n\
             \x20   load_assignment:\n\
             \x20     cluster_name: {name}\n\
             \x20     endpoints:\n\
             \x20     - lb_endpoints:\n\
             \x20       - endpoint: {{address: {}}}\n",
            extproc_address(&o.extproc)
        );
    }
    y
}

/// Escapes RE2 metacharacters (header names may contain `.`, `*`, `+`, `|`, `^`, `$`), doubled
/// for a YAML double-quoted string.
fn regex_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if "\\.+*?()|[]{}^$".contains(c) {
            out.push_str("\\\\");
        }
        out.push(c);
    }
    out
}

/// The EDS file content (a JSON DiscoveryResponse) listing `hosts` (address, draining) for
/// [`REPLICA_CLUSTER`]. A draining endpoint (config `drain`, a terminating or unready pod) is
/// listed with `health_status: DRAINING`: kvrouter never picks it, and Envoy's own fallback
/// (kvrouter down or failing open) leaves it out too, while requests already there finish.
pub fn eds_json(version: u64, hosts: &[(SocketAddr, bool)]) -> String {
    let endpoints: Vec<serde_json::Value> = hosts
        .iter()
        .map(|(a, draining)| {
            let mut host = serde_json::json!({"endpoint": {"address": {"socket_address": {
                "address": a.ip().to_string(), "port_value": a.port()}}}});
            if *draining {
                host["health_status"] = "DRAINING".into();
            }
            host
        })
        .collect();
    serde_json::json!({
        "version_info": version.to_string(),
        "resources": [{
            "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
            "cluster_name": REPLICA_CLUSTER,
            "endpoints": [{"lb_endpoints": endpoints}],
        }]
    })
    .to_string()
}

/// Writes [`eds_json`] to `path` atomically (temporary file in the same directory, then rename),
/// creating the directory if needed, so Envoy never reads a half-written file.
pub fn write_eds(
    path: &std::path::Path,
    version: u64,
    hosts: &[(SocketAddr, bool)],
) -> std::io::Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty());
    if let Some(dir) = dir {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    std::fs::write(&tmp, eds_json(version, hosts))?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ext_proc_address_is_host_port_or_a_unix_socket() {
        let tcp: ExtprocAddress = "127.0.0.1:9002".parse().unwrap();
        assert_eq!(tcp, ExtprocAddress::Tcp("127.0.0.1:9002".parse().unwrap()));
        let unix: ExtprocAddress = "unix:/run/kvrouter/grpc.sock".parse().unwrap();
        assert_eq!(unix, ExtprocAddress::Unix("/run/kvrouter/grpc.sock".into()));
        assert_eq!(unix.to_string(), "unix:/run/kvrouter/grpc.sock");
        assert_eq!(tcp.to_string(), "127.0.0.1:9002");
        for bad in ["unix:", "unix:@kvrouter", "kvrouter:9002", "9002"] {
            let e = bad.parse::<ExtprocAddress>().unwrap_err();
            assert!(e.contains("unix:"), "{bad}: {e}");
        }
        // Both ext_proc clusters reach the socket, whatever its path holds.
        let path = "/tmp/a dir/with \"quotes\"/grpc.sock";
        let y = render(&EnvoyOptions {
            extproc: ExtprocAddress::Unix(path.into()),
            ..EnvoyOptions::default()
        });
        let root: serde_norway::Value = serde_norway::from_str(&y).unwrap();
        let clusters = root["static_resources"]["clusters"].as_sequence().unwrap();
        let pipes: Vec<&str> = clusters
            .iter()
            .filter(|c| c["name"].as_str().unwrap().starts_with("kvrouter_"))
            .map(|c| {
                let endpoint = &c["load_assignment"]["endpoints"][0]["lb_endpoints"][0];
                endpoint["endpoint"]["address"]["pipe"]["path"]
                    .as_str()
                    .unwrap()
            })
            .collect();
        assert_eq!(pipes, [path, path]);
    }

    #[test]
    fn every_variant_renders_the_parts_it_needs() {
        for cluster in [ClusterStyle::OverrideHost, ClusterStyle::OriginalDst] {
            for body_mode in [BodyMode::Buffered, BodyMode::FullDuplex, BodyMode::Streamed] {
                let o = EnvoyOptions {
                    cluster,
                    body_mode,
                    ..EnvoyOptions::default()
                };
                let y = render(&o);
                assert!(y.contains("failure_mode_allow: true"));
                assert!(y.contains("x-kvrouter-upstream"));
                assert!(y.contains("port_value: 8004"));
                assert_eq!(
                    y.contains("FULL_DUPLEX_STREAMED"),
                    body_mode == BodyMode::FullDuplex
                );
                assert_eq!(
                    y.contains("request_body_mode: STREAMED\n"),
                    body_mode == BodyMode::Streamed
                );
                assert_eq!(
                    y.contains("send_body_without_waiting_for_header_response: true"),
                    body_mode == BodyMode::Streamed
                );
                assert_eq!(
                    y.contains("ORIGINAL_DST"),
                    cluster == ClusterStyle::OriginalDst
                );
                assert_eq!(
                    y.contains("override_host"),
                    cluster == ClusterStyle::OverrideHost
                );
                // Parses as YAML.
                let _: serde_json::Value = serde_norway::from_str(&y).expect("valid YAML");
            }
        }
    }

    #[test]
    fn eds_file_is_written_atomically_and_lists_addresses() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/eds.json");
        let a: SocketAddr = "127.0.0.1:8001".parse().unwrap();
        let b: SocketAddr = "[::1]:8002".parse().unwrap();
        write_eds(&path, 3, &[(a, false), (b, true)]).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(v["version_info"], "3");
        let eps = &v["resources"][0]["endpoints"][0]["lb_endpoints"];
        assert_eq!(
            eps[1]["endpoint"]["address"]["socket_address"]["address"],
            "::1"
        );
        assert_eq!(
            eps[1]["endpoint"]["address"]["socket_address"]["port_value"],
            8002
        );
        assert_eq!(eps[1]["health_status"], "DRAINING", "{eps}");
        assert!(eps[0].get("health_status").is_none(), "{eps}");
        assert_eq!(
            std::fs::read_dir(path.parent().unwrap()).unwrap().count(),
            1,
            "no temp file left"
        );
    }
}
