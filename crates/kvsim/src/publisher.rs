//! The KV-event publisher: a ZMQ PUB socket fed by the engine task, numbering messages from 0
//! and sending `[topic, sequence (8-byte big-endian), payload]` as vLLM's `ZmqEventPublisher`.
//! As in vLLM, the socket binds when the endpoint has a wildcard host and connects otherwise.

use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tokio::sync::mpsc;
use zeromq::{Socket, SocketSend, ZmqMessage};

use super::config::KvEventsConfig;
use super::kv_events::{encode_batch, KvEvent};
use super::replay::{self, ReplayBuffer};

/// How the PUB socket attaches to an endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attach {
    /// Bind this address (wildcard host rewritten to `0.0.0.0`).
    Bind(String),
    /// Connect to this endpoint (the subscriber binds).
    Connect(String),
}

/// vLLM's rule: bind when the endpoint has a wildcard host (`*`, `::`), connect otherwise;
/// `bind` forces a bind on the given host (loopback publishers in tests). Only
/// `tcp://host:port` endpoints are supported.
pub fn parse_endpoint(endpoint: &str, bind: bool) -> Result<Attach, String> {
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| format!("{endpoint:?}: only tcp://host:port endpoints are supported"))?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| format!("{endpoint:?}: missing :port"))?;
    port.parse::<u16>()
        .map_err(|_| format!("{endpoint:?}: {port:?} is not a port"))?;
    match host {
        "*" | "0.0.0.0" => Ok(Attach::Bind(format!("tcp://0.0.0.0:{port}"))),
        "[::]" | "::" | "[*]" => Ok(Attach::Bind(format!("tcp://[::]:{port}"))),
        "" => Err(format!("{endpoint:?}: missing host")),
        _ if bind => Ok(Attach::Bind(endpoint.to_string())),
        _ if port == "0" => Err(format!("{endpoint:?}: cannot connect to port 0")),
        _ => Ok(Attach::Connect(endpoint.to_string())),
    }
}

/// What the publisher task is told.
#[derive(Debug)]
pub enum PublisherMsg {
    /// Publish one batch (one engine step's events).
    Batch(Vec<KvEvent>),
    /// Simulated process restart: reopen the socket and restart the sequence at 0.
    Restart,
}

/// Why the publisher did not start.
#[derive(Debug, thiserror::Error)]
pub enum PublisherError {
    /// The endpoint is not one we support.
    #[error("kv_events.endpoint {0}")]
    Endpoint(String),
    /// The replay endpoint is not one we support.
    #[error("kv_events.replay_endpoint {0}")]
    ReplayEndpoint(String),
    /// The socket could not bind.
    #[error("cannot bind {endpoint}: {source}")]
    Bind {
        /// The endpoint.
        endpoint: String,
        /// What zeromq said.
        source: zeromq::ZmqError,
    },
}

/// A started publisher: where subscribers find it and how to feed it.
#[derive(Debug)]
pub struct Publisher {
    /// The endpoint a subscriber uses: `tcp://127.0.0.1:PORT` when bound (port resolved), the
    /// configured endpoint when connecting.
    pub endpoint: String,
    /// Where its replay socket listens (`tcp://127.0.0.1:PORT` for a wildcard or loopback
    /// bind), when it has one.
    pub replay: Option<String>,
    /// Feeds the publisher task.
    pub tx: mpsc::UnboundedSender<PublisherMsg>,
    /// The publisher task.
    pub task: tokio::task::JoinHandle<()>,
}

/// Starts a publisher per `kv` (endpoint, topic, `bind`: see [`parse_endpoint`]; replay
/// socket). Binding happens before this returns (so the ports are known); connecting happens
/// in the background (the subscriber may start later).
pub async fn start(kv: &KvEventsConfig) -> Result<Publisher, PublisherError> {
    let (endpoint, topic) = (kv.endpoint.as_str(), kv.topic.as_str());
    let attach = parse_endpoint(endpoint, kv.bind).map_err(PublisherError::Endpoint)?;
    let replay = match &kv.replay_endpoint {
        Some(r) => {
            let Attach::Bind(addr) =
                parse_endpoint(r, true).map_err(PublisherError::ReplayEndpoint)?
            else {
                unreachable!("a forced bind")
            };
            let (socket, bound) =
                replay::bind(&addr)
                    .await
                    .map_err(|source| PublisherError::Bind {
                        endpoint: addr.clone(),
                        source,
                    })?;
            Some((socket, loopback(&bound)))
        }
        None => None,
    };
    let (socket, shown) = open(&attach).await?;
    let attach = match (&attach, &shown) {
        // A restart rebinds the same port, not a new random one.
        (Attach::Bind(_), Some(resolved)) => Attach::Bind(resolved.clone()),
        _ => attach,
    };
    let endpoint = match &shown {
        Some(resolved) => loopback(resolved),
        None => endpoint.to_string(),
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let topic = Bytes::copy_from_slice(topic.as_bytes());
    let replay_endpoint = replay.as_ref().map(|(_, e)| e.clone());
    let replay = replay.map(|(socket, _)| (socket, ReplayBuffer::new(kv.buffer_steps)));
    let task = tokio::spawn(run(socket, attach, topic, rx, replay));
    Ok(Publisher {
        endpoint,
        replay: replay_endpoint,
        tx,
        task,
    })
}

/// A bound wildcard endpoint as a local subscriber reaches it.
fn loopback(resolved: &str) -> String {
    resolved
        .replace("0.0.0.0", "127.0.0.1")
        .replace("[::]", "[::1]")
}

/// Opens a PUB socket; returns the resolved endpoint when it bound.
async fn open(attach: &Attach) -> Result<(zeromq::PubSocket, Option<String>), PublisherError> {
    let mut socket = zeromq::PubSocket::new();
    match attach {
        Attach::Bind(addr) => {
            let bound = socket
                .bind(addr)
                .await
                .map_err(|source| PublisherError::Bind {
                    endpoint: addr.clone(),
                    source,
                })?;
            Ok((socket, Some(bound.to_string())))
        }
        // zeromq's connect waits for the peer; the publisher task connects in the background so
        // a subscriber that starts later still gets events (libzmq connects asynchronously too).
        Attach::Connect(_) => Ok((socket, None)),
    }
}

async fn run(
    mut socket: zeromq::PubSocket,
    attach: Attach,
    topic: Bytes,
    mut rx: mpsc::UnboundedReceiver<PublisherMsg>,
    mut replay: Option<(zeromq::RouterSocket, ReplayBuffer)>,
) {
    let mut seq: u64 = 0;
    if let Attach::Connect(addr) = &attach {
        connect(&mut socket, addr).await;
    }
    loop {
        let msg = tokio::select! {
            msg = rx.recv() => match msg {
                Some(msg) => msg,
                None => return,
            },
            request = next_replay(&mut replay) => {
                if let (Ok((identity, start)), Some((router, buffer))) = (request, replay.as_mut()) {
                    match replay::answer(router, buffer, &topic, identity, start).await {
                        Ok(n) => tracing::debug!(start, batches = n, "kv events: replay served"),
                        Err(e) => tracing::warn!("kv events: replay answer failed: {e}"),
                    }
                }
                continue;
            }
        };
        match msg {
            PublisherMsg::Batch(events) => {
                let ts = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_secs_f64())
                    .unwrap_or(0.0);
                let payload = Bytes::from(encode_batch(ts, &events, 0));
                if let Some((_, buffer)) = replay.as_mut() {
                    buffer.push(seq, payload.clone());
                }
                let mut message = ZmqMessage::from(topic.clone());
                message.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
                message.push_back(payload);
                if let Err(e) = socket.send(message).await {
                    tracing::warn!("kv events: send failed: {e}");
                }
                seq += 1;
            }
            PublisherMsg::Restart => {
                drop(socket);
                seq = 0;
                // The restarted process remembers nothing (its replay socket stays bound here).
                if let Some((_, buffer)) = replay.as_mut() {
                    buffer.clear();
                }
                socket = match reopen(&attach).await {
                    Some(s) => s,
                    None => return,
                };
            }
        }
    }
}

/// The next replay request, or never without a replay socket.
async fn next_replay(
    replay: &mut Option<(zeromq::RouterSocket, ReplayBuffer)>,
) -> Result<(Bytes, u64), zeromq::ZmqError> {
    match replay {
        Some((router, _)) => replay::next_request(router).await,
        None => std::future::pending().await,
    }
}

async fn connect(socket: &mut zeromq::PubSocket, addr: &str) {
    if let Err(e) = socket.connect(addr).await {
        tracing::warn!("kv events: cannot connect to {addr}: {e}");
    }
}

async fn reopen(attach: &Attach) -> Option<zeromq::PubSocket> {
    // The old listener may take a moment to release its port.
    for _ in 0..50 {
        match open(attach).await {
            Ok((mut socket, _)) => {
                if let Attach::Connect(addr) = attach {
                    connect(&mut socket, addr).await;
                }
                return Some(socket);
            }
            Err(e) => {
                tracing::debug!("kv events: reopen: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        }
    }
    tracing::error!("kv events: could not reopen the publisher after a restart");
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_rule_table() {
        let cases = [
            (
                "tcp://*:5557",
                Ok(Attach::Bind("tcp://0.0.0.0:5557".into())),
            ),
            ("tcp://*:0", Ok(Attach::Bind("tcp://0.0.0.0:0".into()))),
            (
                "tcp://[::]:5557",
                Ok(Attach::Bind("tcp://[::]:5557".into())),
            ),
            (
                "tcp://127.0.0.1:5557",
                Ok(Attach::Connect("tcp://127.0.0.1:5557".into())),
            ),
        ];
        for (endpoint, expected) in cases {
            assert_eq!(parse_endpoint(endpoint, false), expected, "{endpoint}");
        }
        // Forced binds keep their host (a loopback-only publisher), port 0 included.
        for endpoint in ["tcp://127.0.0.1:0", "tcp://127.0.0.1:5557", "tcp://*:1"] {
            let host = endpoint.replace('*', "0.0.0.0");
            assert_eq!(parse_endpoint(endpoint, true), Ok(Attach::Bind(host)));
        }
        for bad in [
            "ipc:///tmp/x",
            "tcp://h",
            "tcp://h:x",
            "tcp://:1",
            "tcp://127.0.0.1:0",
        ] {
            assert!(parse_endpoint(bad, false).is_err(), "{bad}");
        }
    }
}
