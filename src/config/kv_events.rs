//! KV-event ingestion settings: the top-level `kv_events` section (how events are trusted), a
//! pool's `kv_events` subscription (where its engines publish), an endpoint's override, their
//! resolution per endpoint, and their validation.
//!
//! ```yaml
//! kv_events:
//!   trusted_prediction_ttl_ms: 10000
//!   silence_timeout_ms: 10000
//! pools:
//!   - name: gpu
//!     models: [llama]
//!     kv_events:
//!       connect: "tcp://{ip}:5557"   # every vLLM binds tcp://*:5557 (its default); we connect
//!       topic: "kv@{ip}"             # optional; vLLM's default topic is empty
//!     endpoints:
//!       - address: 10.0.0.5:8000
//!       - address: 10.0.0.6:8000
//!         kv_events: {enabled: false}
//!   - name: pushed
//!     models: [llama]
//!     kv_events: {push: true}        # engines push over gRPC (kvrouter.v1.KvEvents)
//!     endpoints:
//!       - address: 10.0.0.7:8000
//! ```

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

use serde::{Deserialize, Serialize};

use super::{Config, ConfigError};

/// How KV events are trusted, for every subscription (top-level `kv_events`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvEventsConfig {
    /// How long a block predicted from a routing decision counts, in milliseconds, on an
    /// endpoint whose events are trusted (they will confirm it once the engine schedules the
    /// request, or remove it). Other endpoints use `cache_index.prediction_ttl_ms`. Must be > 0.
    /// Default 10000 (covers queueing before the engine allocates the request's blocks).
    pub trusted_prediction_ttl_ms: u64,
    /// When the router has sent an endpoint a request that should store new blocks and no
    /// message arrives within this many milliseconds, its events are distrusted (confirmed
    /// blocks withdrawn) until one does. 0 disables. Default 10000.
    pub silence_timeout_ms: u64,
    /// Most engine blocks tracked per endpoint (about 40 bytes each, plus our blocks); past
    /// this the endpoint's table is reset as after a gap. Must be > 0. Default 4194304.
    pub max_engine_blocks: u64,
    /// Most (LoRA adapter, cache salt) namespaces tracked per endpoint; blocks of further ones
    /// are not mapped. 1..=65535. Default 1024.
    pub max_namespaces: u32,
    /// How much a matched block counts by where the engine holds it (GPU, CPU offload, slower),
    /// each in [0, 1]. Default gpu 1.0, cpu 0.8, other 0.5.
    pub medium_weights: MediumWeights,
    /// Largest message (all its frames) a publisher may announce, in bytes (to a bound socket,
    /// or to a connecting or replay socket, whose publisher's bytes are relayed through the
    /// same check); a connection announcing more is closed before anything is allocated for
    /// it. Must be > 0.
    /// Default 16777216 (16 MiB; a vLLM batch is a few KB, a long prefill's a few hundred KB).
    pub max_message_bytes: u64,
    /// IPs allowed to publish to bound sockets besides the IPs of the endpoints sharing the
    /// socket (an engine publishes from its own host; list others here, e.g. behind NAT).
    /// Connections from any other IP are closed on accept. Default empty.
    pub allowed_publishers: Vec<IpAddr>,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        Self {
            trusted_prediction_ttl_ms: 10_000,
            silence_timeout_ms: 10_000,
            max_engine_blocks: 1 << 22,
            max_namespaces: 1024,
            medium_weights: MediumWeights::default(),
            max_message_bytes: 16 << 20,
            allowed_publishers: Vec::new(),
        }
    }
}

/// Weight of a matched block by medium.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MediumWeights {
    /// Blocks on the GPU (and predicted blocks). Default 1.0.
    pub gpu: f64,
    /// Blocks only in CPU memory (offloaded; loading them back costs a transfer). Default 0.8.
    pub cpu: f64,
    /// Blocks only on slower media. Default 0.5.
    pub other: f64,
}

impl Default for MediumWeights {
    fn default() -> Self {
        Self {
            gpu: 1.0,
            cpu: 0.8,
            other: 0.5,
        }
    }
}

/// Where a pool's engines publish KV events (a pool's `kv_events`). Set exactly one of
/// `connect`, `bind` and `push`. In `connect` and `bind`, `{ip}` is the endpoint's IP
/// (bracketed when IPv6), `{port}` its HTTP port and `{address}` its `ip:port`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvEventsSubscription {
    /// One SUB socket per endpoint connecting to its publisher, which binds (vLLM binds when
    /// its endpoint has a wildcard host, e.g. its default `tcp://*:5557`). A template, e.g.
    /// `tcp://{ip}:5557`.
    pub connect: Option<String>,
    /// One SUB socket bound here that the publishers connect to (vLLM connects when its
    /// endpoint names a host, e.g. `tcp://<router ip>:5557`), shared by every endpoint whose
    /// `bind` is the same address; their topics tell them apart. The host is where it listens:
    /// `tcp://:5557` (no host) is loopback only, `tcp://10.0.0.2:5557` one interface,
    /// `tcp://*:5557` or `tcp://0.0.0.0:5557` every interface. Only the endpoints' own IPs
    /// (and `kv_events.allowed_publishers`) may publish to it.
    pub bind: Option<String>,
    /// No socket: the engines (or sidecars beside them) push their events over gRPC
    /// (`kvrouter.v1.KvEvents/PushKvEvents` on the admin port), into the same state machine.
    /// Default false.
    pub push: bool,
    /// The topic each endpoint's publisher sends (vLLM's `topic`), a template; a message
    /// belongs to the endpoint whose topic equals its topic or is followed in it by `@` (so
    /// `kv@{ip}` matches llm-d's `kv@10.0.0.5@model`). Default empty (vLLM's default).
    pub topic: String,
    /// Only events of this KV-cache group count (hybrid models publish one per group).
    /// Default 0.
    pub group_idx: u32,
    /// The publisher's replay socket (vLLM's `replay_endpoint`, a ROUTER socket that serves the
    /// last `buffer_steps` batches), a template, e.g. `tcp://{ip}:5558`. With it, each time the
    /// SUB socket connects (a router that starts or restarts, a reconnect after a drop) the
    /// router fetches the buffered batches before the live ones, so it learns in seconds what
    /// the engine cached before it listened instead of waiting for the cache to turn over.
    /// Only with `connect`. Default none.
    pub replay: Option<String>,
}

/// An endpoint's own KV-event settings (its `kv_events`), overriding its pool's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EndpointKvEvents {
    /// False: no subscription for this endpoint (predictions only). Default true.
    pub enabled: bool,
    /// As the pool's `connect`, for this endpoint.
    pub connect: Option<String>,
    /// As the pool's `bind`, for this endpoint.
    pub bind: Option<String>,
    /// As the pool's `push`, for this endpoint. Default false.
    pub push: bool,
    /// As the pool's `topic`, for this endpoint.
    pub topic: Option<String>,
    /// As the pool's `replay`, for this endpoint.
    pub replay: Option<String>,
}

impl Default for EndpointKvEvents {
    fn default() -> Self {
        Self {
            enabled: true,
            connect: None,
            bind: None,
            push: false,
            topic: None,
            replay: None,
        }
    }
}

/// How a subscription's socket attaches.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum KvEventsAttach {
    /// Connect to this ZMQ endpoint (`tcp://host:port`).
    Connect(String),
    /// Bind this ZMQ endpoint (`tcp://host:port`, shared by endpoints naming the same one).
    Bind(String),
    /// No socket: events are pushed over gRPC.
    Push,
}

impl KvEventsAttach {
    /// `connect`, `bind` or `push`.
    pub fn kind(&self) -> &'static str {
        match self {
            KvEventsAttach::Connect(_) => "connect",
            KvEventsAttach::Bind(_) => "bind",
            KvEventsAttach::Push => "push",
        }
    }
}

/// One endpoint's resolved KV-event subscription.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ResolvedKvEvents {
    /// The endpoint (its HTTP address, as routing knows it).
    pub address: SocketAddr,
    /// The model its blocks are hashed under: the endpoint's first model (an engine serves
    /// one base model; adapters come from the events).
    pub model: String,
    /// The socket.
    pub attach: KvEventsAttach,
    /// The topic its publisher sends (expanded).
    pub topic: String,
    /// The KV-cache group whose events count.
    pub group_idx: u32,
    /// The publisher's replay socket (expanded), asked for its buffered batches at each
    /// connect. Only for `Connect`.
    pub replay: Option<String>,
}

/// Expands `{ip}`, `{port}`, `{address}` for `address`; `zmq` brackets an IPv6 `{ip}`.
/// Unknown placeholders are an error naming them.
pub fn expand_template(template: &str, address: SocketAddr, zmq: bool) -> Result<String, String> {
    let ip = match (address.ip(), zmq) {
        (std::net::IpAddr::V6(v6), true) => format!("[{v6}]"),
        (ip, _) => ip.to_string(),
    };
    let mut out = String::with_capacity(template.len() + 16);
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        let close = after
            .find('}')
            .ok_or_else(|| format!("{template:?}: unclosed {{"))?;
        match &after[..close] {
            "ip" => out.push_str(&ip),
            "port" => out.push_str(&address.port().to_string()),
            "address" => out.push_str(&address.to_string()),
            other => {
                return Err(format!(
                "{template:?}: unknown placeholder {{{other}}} (use {{ip}}, {{port}}, {{address}})"
            ))
            }
        }
        rest = &after[close + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// Checks a `tcp://host:port` ZMQ endpoint: `bind` allows wildcard hosts, no host (loopback)
/// and port 0.
pub fn check_zmq_endpoint(endpoint: &str, bind: bool) -> Result<(), String> {
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| format!("{endpoint:?}: only tcp://host:port endpoints are supported"))?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| format!("{endpoint:?}: missing :port"))?;
    let port: u16 = port
        .parse()
        .map_err(|_| format!("{endpoint:?}: {port:?} is not a port"))?;
    let wildcard = matches!(host, "*" | "0.0.0.0" | "[::]" | "::" | "[*]");
    // A bound socket without a host listens on loopback only.
    if host.is_empty() && !bind {
        return Err(format!("{endpoint:?}: missing host"));
    }
    if !bind && wildcard {
        return Err(format!(
            "{endpoint:?}: cannot connect to a wildcard address; name the publisher's host"
        ));
    }
    if !bind && port == 0 {
        return Err(format!("{endpoint:?}: cannot connect to port 0"));
    }
    Ok(())
}

impl Config {
    /// Every endpoint's KV-event subscription, in config order (endpoints without one are left
    /// out). Endpoints whose settings do not resolve are left out too (`validate` reports them).
    pub fn kv_event_subscriptions(&self) -> Vec<ResolvedKvEvents> {
        self.resolve_kv_events()
            .into_iter()
            .filter_map(|(_, r)| r.ok().flatten())
            .collect()
    }

    /// Per endpoint (with its config path): its subscription, none, or why it is invalid
    /// (the path of the bad field and the message).
    fn resolve_kv_events(&self) -> Vec<(String, Resolution)> {
        let mut out = Vec::new();
        for (p, pool) in self.pools.iter().enumerate() {
            for (e, ep) in pool.endpoints.iter().enumerate() {
                let at = format!("pools[{p}].endpoints[{e}]");
                let Ok(address) = ep.address.parse::<SocketAddr>() else {
                    continue; // reported by the address check
                };
                let own = ep.kv_events.clone().unwrap_or_default();
                let resolved = resolve_one(&at, p, pool, &own, address, ep.models.first());
                out.push((at, resolved));
            }
        }
        out
    }

    /// Every invalid KV-event setting, with its path.
    pub(super) fn validate_kv_events(&self) -> Vec<ConfigError> {
        let mut errors = Vec::new();
        let mut push = |path: String, message: String| errors.push(ConfigError { path, message });
        let k = &self.kv_events;
        if k.trusted_prediction_ttl_ms == 0 {
            push(
                "kv_events.trusted_prediction_ttl_ms".into(),
                "must be > 0".into(),
            );
        }
        if k.max_engine_blocks == 0 {
            push("kv_events.max_engine_blocks".into(), "must be > 0".into());
        }
        if k.max_message_bytes == 0 {
            push("kv_events.max_message_bytes".into(), "must be > 0".into());
        }
        if !(1..=65_535).contains(&k.max_namespaces) {
            push(
                "kv_events.max_namespaces".into(),
                format!("must be in 1..=65535 (got {})", k.max_namespaces),
            );
        }
        for (name, w) in [
            ("gpu", k.medium_weights.gpu),
            ("cpu", k.medium_weights.cpu),
            ("other", k.medium_weights.other),
        ] {
            if !(w.is_finite() && (0.0..=1.0).contains(&w)) {
                push(
                    format!("kv_events.medium_weights.{name}"),
                    format!("must be in [0, 1] (got {w})"),
                );
            }
        }
        for (p, pool) in self.pools.iter().enumerate() {
            if let Some(s) = &pool.kv_events {
                let ways = usize::from(s.connect.is_some())
                    + usize::from(s.bind.is_some())
                    + usize::from(s.push);
                if ways != 1 {
                    push(
                        format!("pools[{p}].kv_events"),
                        "set exactly one of connect, bind or push".into(),
                    );
                }
            }
        }
        let mut connects: HashMap<String, String> = HashMap::new();
        let mut topics: HashMap<(String, String), String> = HashMap::new();
        for (at, resolved) in self.resolve_kv_events() {
            let r = match resolved {
                Ok(Some(r)) => r,
                Ok(None) => continue,
                Err((path, message)) => {
                    push(path, message);
                    continue;
                }
            };
            match &r.attach {
                KvEventsAttach::Connect(c) => {
                    if let Some(first) = connects.insert(c.clone(), at.clone()) {
                        push(
                            format!("{at}.kv_events"),
                            format!("connects to {c}, as {first} does: each publisher once"),
                        );
                    }
                }
                KvEventsAttach::Push => {}
                KvEventsAttach::Bind(b) => {
                    if let Some(first) = topics.insert((b.clone(), r.topic.clone()), at.clone()) {
                        push(
                            format!("{at}.kv_events.topic"),
                            format!(
                                "{:?} on {b} is {first}'s topic too: endpoints sharing a bound \
                                 socket need distinct topics (e.g. topic: \"kv@{{ip}}\")",
                                r.topic
                            ),
                        );
                    }
                }
            }
        }
        errors
    }
}

/// An endpoint's subscription, none, or (path of the bad field, message).
type Resolution = Result<Option<ResolvedKvEvents>, (String, String)>;

pub(super) fn resolve_one(
    at: &str,
    p: usize,
    pool: &super::PoolConfig,
    own: &EndpointKvEvents,
    address: SocketAddr,
    own_model: Option<&String>,
) -> Resolution {
    if !own.enabled {
        return Ok(None);
    }
    let pool_sub = pool.kv_events.as_ref();
    let own_ways = usize::from(own.connect.is_some())
        + usize::from(own.bind.is_some())
        + usize::from(own.push);
    if own_ways > 1 {
        return Err((
            format!("{at}.kv_events"),
            "set at most one of connect, bind or push".into(),
        ));
    }
    let model = || {
        own_model
            .or(pool.models.first())
            .cloned()
            .unwrap_or_default()
    };
    let pushed = own.push
        || (own_ways == 0
            && pool_sub.is_some_and(|s| s.push && s.connect.is_none() && s.bind.is_none()));
    if pushed {
        return Ok(Some(ResolvedKvEvents {
            address,
            model: model(),
            attach: KvEventsAttach::Push,
            topic: String::new(),
            group_idx: pool_sub.map_or(0, |s| s.group_idx),
            replay: None,
        }));
    }
    let (field, template, bind) = match (&own.connect, &own.bind, pool_sub) {
        (Some(c), _, _) => (format!("{at}.kv_events.connect"), c, false),
        (_, Some(b), _) => (format!("{at}.kv_events.bind"), b, true),
        (None, None, Some(s)) => match (&s.connect, &s.bind) {
            (Some(c), None) => (format!("pools[{p}].kv_events.connect"), c, false),
            (None, Some(b)) => (format!("pools[{p}].kv_events.bind"), b, true),
            _ => return Ok(None), // reported on the pool
        },
        (None, None, None) if own.topic.is_some() => {
            return Err((
                format!("{at}.kv_events"),
                "no socket: set connect, bind or push here or on the pool".into(),
            ))
        }
        (None, None, None) => return Ok(None),
    };
    let zmq = expand_template(template, address, true)
        .and_then(|z| check_zmq_endpoint(&z, bind).map(|()| z))
        .map_err(|m| (field, m))?;
    let (topic_field, topic_template) = match (&own.topic, pool_sub) {
        (Some(t), _) => (format!("{at}.kv_events.topic"), t.as_str()),
        (None, Some(s)) => (format!("pools[{p}].kv_events.topic"), s.topic.as_str()),
        (None, None) => (String::new(), ""),
    };
    let topic = expand_template(topic_template, address, false).map_err(|m| (topic_field, m))?;
    let (replay_field, replay_template) = match (&own.replay, pool_sub) {
        (Some(r), _) => (format!("{at}.kv_events.replay"), Some(r)),
        // An endpoint that binds its own socket does not inherit its pool's replay socket.
        (None, Some(s)) if !bind || s.bind.is_some() => {
            (format!("pools[{p}].kv_events.replay"), s.replay.as_ref())
        }
        _ => (String::new(), None),
    };
    let replay = match replay_template {
        None => None,
        Some(_) if bind => {
            return Err((
                replay_field,
                "replay needs connect: a bound socket's publishers are not known in advance".into(),
            ))
        }
        Some(t) => Some(
            expand_template(t, address, true)
                .and_then(|z| check_zmq_endpoint(&z, false).map(|()| z))
                .map_err(|m| (replay_field, m))?,
        ),
    };
    Ok(Some(ResolvedKvEvents {
        address,
        model: model(),
        attach: if bind {
            KvEventsAttach::Bind(zmq)
        } else {
            KvEventsAttach::Connect(zmq)
        },
        topic,
        group_idx: pool_sub.map_or(0, |s| s.group_idx),
        replay,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errors_of(yaml: &str) -> Vec<String> {
        Config::from_yaml(yaml)
            .expect("parses")
            .validate()
            .into_iter()
            .map(|e| e.to_string())
            .collect()
    }

    #[test]
    fn templates_expand_per_endpoint_and_bracket_ipv6_in_zmq_endpoints() {
        let v4: SocketAddr = "10.0.0.5:8000".parse().unwrap();
        let v6: SocketAddr = "[fd00::5]:8000".parse().unwrap();
        let cases = [
            ("tcp://{ip}:5557", v4, true, "tcp://10.0.0.5:5557"),
            ("tcp://{ip}:5557", v6, true, "tcp://[fd00::5]:5557"),
            ("kv@{ip}", v6, false, "kv@fd00::5"),
            ("kv@{address}/{port}", v4, false, "kv@10.0.0.5:8000/8000"),
            ("", v4, false, ""),
        ];
        for (template, addr, zmq, expected) in cases {
            assert_eq!(expand_template(template, addr, zmq).unwrap(), expected);
        }
        assert!(expand_template("kv@{pod}", v4, false)
            .unwrap_err()
            .contains("unknown placeholder {pod}"));
        assert!(expand_template("kv@{ip", v4, false).is_err());
    }

    #[test]
    fn subscriptions_resolve_with_pool_defaults_and_endpoint_overrides() {
        let config = Config::from_yaml(
            r#"
pools:
  - name: a
    models: [m1]
    kv_events: {connect: "tcp://{ip}:5557", topic: "kv@{ip}", group_idx: 1, replay: "tcp://{ip}:5558"}
    endpoints:
      - address: 10.0.0.1:8000
      - address: 10.0.0.2:8000
        kv_events: {enabled: false}
      - address: 10.0.0.3:8000
        models: [m2]
        kv_events: {bind: "tcp://0.0.0.0:6000", topic: "x"}
  - name: b
    models: [m3]
    endpoints:
      - address: 10.0.0.4:8000
"#,
        )
        .unwrap();
        assert_eq!(config.validate(), vec![]);
        let subs = config.kv_event_subscriptions();
        assert_eq!(subs.len(), 2);
        assert_eq!(
            subs[0],
            ResolvedKvEvents {
                address: "10.0.0.1:8000".parse().unwrap(),
                model: "m1".into(),
                attach: KvEventsAttach::Connect("tcp://10.0.0.1:5557".into()),
                topic: "kv@10.0.0.1".into(),
                group_idx: 1,
                replay: Some("tcp://10.0.0.1:5558".into()),
            }
        );
        assert_eq!(subs[1].model, "m2");
        assert_eq!(
            subs[1].attach,
            KvEventsAttach::Bind("tcp://0.0.0.0:6000".into())
        );
        assert_eq!(subs[1].topic, "x");
        assert_eq!(
            subs[1].replay, None,
            "a bound endpoint does not inherit replay"
        );
        assert_eq!(Config::default().kv_events.silence_timeout_ms, 10_000);
    }

    #[test]
    fn bad_kv_event_settings_are_reported_with_their_paths() {
        let pool = |kv: &str, eps: &str| {
            format!("pools: [{{name: a, models: [m], {kv} endpoints: [{eps}]}}]")
        };
        let one = "{address: '10.0.0.1:80'}";
        let two = "{address: '10.0.0.1:80'}, {address: '10.0.0.2:80'}";
        let cases: Vec<(String, &str)> = vec![
            (
                pool("kv_events: {topic: x},", one),
                "pools[0].kv_events: set exactly one of connect, bind or push",
            ),
            (
                pool("kv_events: {connect: 'tcp://{ip}:1', bind: 'tcp://*:1'},", one),
                "pools[0].kv_events: set exactly one of connect, bind or push",
            ),
            (
                pool("kv_events: {connect: 'tcp://*:5557'},", one),
                "pools[0].kv_events.connect: \"tcp://*:5557\": cannot connect to a wildcard",
            ),
            (
                pool("kv_events: {connect: 'udp://{ip}:1'},", one),
                "pools[0].kv_events.connect: \"udp://10.0.0.1:1\": only tcp://host:port",
            ),
            (
                pool("kv_events: {connect: 'tcp://{host}:1'},", one),
                "pools[0].kv_events.connect: \"tcp://{host}:1\": unknown placeholder {host}",
            ),
            (
                pool("kv_events: {connect: 'tcp://10.0.0.9:1'},", two),
                "pools[0].endpoints[1].kv_events: connects to tcp://10.0.0.9:1, as pools[0].endpoints[0] does",
            ),
            (
                pool("kv_events: {bind: 'tcp://*:5557'},", two),
                "pools[0].endpoints[1].kv_events.topic: \"\" on tcp://*:5557 is pools[0].endpoints[0]'s topic too",
            ),
            (
                pool("kv_events: {bind: 'tcp://*:5557', replay: 'tcp://{ip}:5558'},", one),
                "pools[0].kv_events.replay: replay needs connect",
            ),
            (
                pool("kv_events: {connect: 'tcp://{ip}:1', replay: 'tcp://*:5558'},", one),
                "pools[0].kv_events.replay: \"tcp://*:5558\": cannot connect to a wildcard",
            ),
            (
                pool("kv_events: {bind: 'tcp://*:5557', topic: 'kv@{bad}'},", one),
                "pools[0].kv_events.topic: \"kv@{bad}\": unknown placeholder",
            ),
            (
                pool("", "{address: '10.0.0.1:80', kv_events: {topic: t}}"),
                "pools[0].endpoints[0].kv_events: no socket",
            ),
            (
                pool(
                    "",
                    "{address: '10.0.0.1:80', kv_events: {connect: 'tcp://{ip}:1', bind: 'tcp://*:2'}}",
                ),
                "pools[0].endpoints[0].kv_events: set at most one of connect, bind or push",
            ),
            (
                format!(
                    "kv_events: {{trusted_prediction_ttl_ms: 0, max_engine_blocks: 0, max_namespaces: 0, medium_weights: {{cpu: 1.5}}}}\n{}",
                    pool("", one)
                ),
                "kv_events.trusted_prediction_ttl_ms: must be > 0",
            ),
            (
                format!("kv_events: {{max_engine_blocks: 0}}\n{}", pool("", one)),
                "kv_events.max_engine_blocks: must be > 0",
            ),
            (
                format!("kv_events: {{max_namespaces: 0}}\n{}", pool("", one)),
                "kv_events.max_namespaces: must be in 1..=65535 (got 0)",
            ),
            (
                format!("kv_events: {{medium_weights: {{cpu: 1.5}}}}\n{}", pool("", one)),
                "kv_events.medium_weights.cpu: must be in [0, 1] (got 1.5)",
            ),
        ];
        for (yaml, expected) in &cases {
            let errors = errors_of(yaml);
            assert!(
                errors.iter().any(|e| e.starts_with(expected)),
                "for {yaml}\nexpected an error starting with {expected:?}\ngot {errors:#?}"
            );
        }
        // Distinct topics make a shared bound socket valid.
        assert_eq!(
            errors_of(&pool(
                "kv_events: {bind: 'tcp://*:5557', topic: 'kv@{ip}'},",
                two
            )),
            Vec::<String>::new()
        );
    }

    #[test]
    fn pushed_streams_resolve_without_a_socket() {
        let config = Config::from_yaml(
            r#"
pools:
  - name: a
    models: [m1]
    kv_events: {push: true, group_idx: 2}
    endpoints:
      - address: 10.0.0.1:8000
      - address: 10.0.0.2:8000
        kv_events: {enabled: false}
  - name: b
    models: [m2]
    kv_events: {connect: "tcp://{ip}:5557"}
    endpoints:
      - address: 10.0.0.3:8000
        kv_events: {push: true}
"#,
        )
        .unwrap();
        assert_eq!(config.validate(), vec![]);
        let subs = config.kv_event_subscriptions();
        assert_eq!(subs.len(), 2, "{subs:?}");
        assert_eq!(subs[0].attach, KvEventsAttach::Push);
        assert_eq!((subs[0].model.as_str(), subs[0].group_idx), ("m1", 2));
        assert_eq!(
            subs[1].attach,
            KvEventsAttach::Push,
            "the endpoint's own push wins"
        );
        assert_eq!(subs[1].address, "10.0.0.3:8000".parse().unwrap());
        let errors = errors_of(
            "pools: [{name: a, models: [m], kv_events: {push: true, bind: 'tcp://*:1'}, endpoints: [{address: '10.0.0.1:80'}]}]",
        );
        assert!(
            errors
                .iter()
                .any(|e| e
                    .starts_with("pools[0].kv_events: set exactly one of connect, bind or push")),
            "{errors:?}"
        );
    }
}
