//! ZMQ SUB sockets and the tasks that feed their messages to endpoints.
//!
//! - **Connect** (the publisher binds, vLLM's default `tcp://*:5557`): one socket per endpoint,
//!   subscribed to its topic, connecting (and reconnecting by itself, zeromq's reconnect task)
//!   to the publisher. A dropped connection withdraws the endpoint's confirmed blocks until its
//!   next batch says whether anything was lost.
//! - **Bind** (publishers connect, vLLM endpoint `tcp://<router>:port`): one socket per bound
//!   address, shared by every endpoint configured with it and subscribed to everything; a
//!   message goes to the endpoint whose topic matches (see [`Routes::find`]). A peer's
//!   disconnection withdraws the blocks of the endpoints on that peer's IP, or of the only
//!   endpoint when there is one.
//!
//! Messages are decoded outside any lock, then applied under the endpoint's lock; the request
//! path never takes that lock.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use futures::StreamExt;
use zeromq::util::PeerIdentity;
use zeromq::{Endpoint, Host, Socket, SocketEvent, SocketRecv, SubSocket, ZmqMessage};

use super::apply::{apply_and_publish, decode};
use super::endpoint::{EndpointEvents, Shared};
use super::replay::{self, Overlap};
use super::state::Reason;

/// The endpoints a socket feeds, with their topics.
#[derive(Debug, Default)]
pub(crate) struct Routes {
    pub(crate) endpoints: Vec<(Box<[u8]>, Arc<EndpointEvents>)>,
}

impl Routes {
    /// The endpoint a message with `topic` belongs to: the one whose topic equals it or is
    /// followed in it by `@`, the longest such; on a socket with one endpoint, that one.
    pub(crate) fn find(&self, topic: &[u8]) -> Option<&Arc<EndpointEvents>> {
        if let [(_, only)] = &self.endpoints[..] {
            return Some(only);
        }
        self.endpoints
            .iter()
            .filter(|(t, _)| {
                topic == &t[..] || (topic.starts_with(t) && topic.get(t.len()) == Some(&b'@'))
            })
            .max_by_key(|(t, _)| t.len())
            .map(|(_, e)| e)
    }
}

/// How long to wait before retrying a failed connect or after a receive error.
const RETRY: Duration = Duration::from_millis(200);

/// Runs a connecting socket until the task is aborted. With `replay` (the publisher's replay
/// socket), each connect first fetches and applies the publisher's buffered batches (see
/// [`replay`]).
pub(crate) async fn run_connect(
    endpoint: String,
    topic: String,
    replay: Option<String>,
    routes: Arc<ArcSwap<Routes>>,
    shared: Arc<Shared>,
) {
    loop {
        let mut socket = SubSocket::new();
        let mut monitor = socket.monitor();
        if let Err(e) = socket.subscribe(&topic).await {
            tracing::warn!(%endpoint, "kv events: subscribe failed: {e}");
        }
        // zeromq's connect waits for the publisher (up to its connect timeout) and reconnects by
        // itself after it succeeded once; until then, retry here.
        if let Err(e) = socket.connect(&endpoint).await {
            tracing::debug!(%endpoint, "kv events: connect failed, retrying: {e}");
            tokio::time::sleep(RETRY).await;
            continue;
        }
        tracing::info!(%endpoint, "kv events: connected");
        for (_, ep) in &routes.load().endpoints {
            ep.connected(&shared);
        }
        // Subscribed first, then replayed: a batch published in between is in both, and the
        // overlap filter drops its live copy.
        let mut overlap = Overlap::default();
        if let Some(replay_endpoint) = &replay {
            overlap = Overlap::after(replay_into(replay_endpoint, &topic, &routes, &shared).await);
        }
        receive(
            &mut socket,
            &mut monitor,
            &routes,
            &shared,
            None,
            &mut overlap,
        )
        .await;
    }
}

/// Fetches the publisher's buffered batches and applies them in order; returns the last
/// sequence applied.
async fn replay_into(
    endpoint: &str,
    topic: &str,
    routes: &ArcSwap<Routes>,
    shared: &Shared,
) -> Option<u64> {
    let started = std::time::Instant::now();
    match replay::fetch(endpoint, 0).await {
        Ok(batches) => {
            let last = batches.last().map(|(seq, _)| *seq);
            let count = batches.len();
            let topic = Bytes::copy_from_slice(topic.as_bytes());
            for (seq, payload) in batches {
                let message = ZmqMessage::try_from(vec![
                    topic.clone(),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    payload,
                ])
                .expect("three frames");
                deliver(message, routes, shared, &mut Overlap::default());
            }
            tracing::info!(
                %endpoint,
                batches = count,
                first_seq = ?last.map(|l| l + 1 - count as u64),
                elapsed_ms = started.elapsed().as_millis() as u64,
                "kv events: replayed the publisher's buffer"
            );
            last
        }
        Err(e) => {
            tracing::warn!(%endpoint, "kv events: replay failed, live events only: {e}");
            None
        }
    }
}

/// Binds `endpoint` (before returning, so errors and the resolved port are known) and spawns
/// the socket's task. Returns the task and the bound endpoint.
pub(crate) async fn start_bind(
    endpoint: &str,
    routes: Arc<ArcSwap<Routes>>,
    shared: Arc<Shared>,
) -> Result<(tokio::task::JoinHandle<()>, String), zeromq::ZmqError> {
    let mut socket = SubSocket::new();
    let mut monitor = socket.monitor();
    let zmq_endpoint = endpoint.replacen("tcp://*:", "tcp://0.0.0.0:", 1);
    let bound = socket.bind(&zmq_endpoint).await?;
    socket.subscribe("").await?;
    let shown = bound.to_string();
    tracing::info!(endpoint = %shown, "kv events: bound");
    let task = tokio::spawn(async move {
        let mut peers = HashMap::new();
        receive(
            &mut socket,
            &mut monitor,
            &routes,
            &shared,
            Some(&mut peers),
            &mut Overlap::default(),
        )
        .await;
    });
    Ok((task, shown))
}

/// Receives until the socket is gone. `peers` (bound sockets) maps peer ids to their IPs.
async fn receive(
    socket: &mut SubSocket,
    monitor: &mut futures::channel::mpsc::Receiver<SocketEvent>,
    routes: &ArcSwap<Routes>,
    shared: &Shared,
    mut peers: Option<&mut HashMap<PeerIdentity, IpAddr>>,
    overlap: &mut Overlap,
) {
    loop {
        tokio::select! {
            received = socket.recv() => match received {
                Ok(message) => deliver(message, routes, shared, overlap),
                Err(e) => {
                    tracing::debug!("kv events: receive error: {e}");
                    tokio::time::sleep(RETRY).await;
                }
            },
            event = monitor.next() => match event {
                Some(event) => {
                    // A connecting socket whose publisher went away: reconnect on our own
                    // cadence (`RETRY`). The zeromq crate's own reconnect backs off to 30 s, so
                    // an engine that took a minute to restart had published its first batch
                    // before we were back, and that loss left it partial for good.
                    let lost = peers.is_none() && matches!(event, SocketEvent::Disconnected(_));
                    on_socket_event(event, routes, shared, peers.as_deref_mut());
                    if lost {
                        return;
                    }
                }
                None => return,
            },
        }
    }
}

fn on_socket_event(
    event: SocketEvent,
    routes: &ArcSwap<Routes>,
    shared: &Shared,
    peers: Option<&mut HashMap<PeerIdentity, IpAddr>>,
) {
    let routes = routes.load();
    match (event, peers) {
        (SocketEvent::Accepted(Endpoint::Tcp(host, _), peer), Some(peers)) => {
            match host {
                Host::Ipv4(ip) => peers.insert(peer, IpAddr::V4(ip)),
                Host::Ipv6(ip) => peers.insert(peer, IpAddr::V6(ip)),
                Host::Domain(_) => None,
            };
        }
        (SocketEvent::Disconnected(peer), Some(peers)) => {
            let ip = peers.remove(&peer);
            let only = routes.endpoints.len() == 1;
            for (_, ep) in &routes.endpoints {
                if only || ip.is_some_and(|ip| ep.address().ip() == ip) {
                    ep.link_lost(Reason::Disconnected, shared);
                }
            }
        }
        (SocketEvent::Disconnected(_), None) => {
            for (_, ep) in &routes.endpoints {
                ep.link_lost(Reason::Disconnected, shared);
            }
        }
        (SocketEvent::Connected(..), None) => {
            for (_, ep) in &routes.endpoints {
                ep.connected(shared);
            }
        }
        _ => {}
    }
}

/// Decodes a message and applies it to its endpoint (unless a replay already did).
fn deliver(message: ZmqMessage, routes: &ArcSwap<Routes>, shared: &Shared, overlap: &mut Overlap) {
    let frames: Vec<Bytes> = message.into_vec();
    if !overlap.is_new(frames.get(1).map(|f| &f[..])) {
        return;
    }
    let routes = routes.load();
    let topic = frames.first().map_or(&[][..], |t| &t[..]);
    let Some(ep) = routes.find(topic) else {
        shared.count_unrouted();
        return;
    };
    let decoded = decode(&frames);
    if let Err((e, _)) = &decoded {
        tracing::debug!(endpoint = %ep.address(), "kv events: undecodable message: {e}");
    }
    let now = shared.clock.now_ms();
    let mut applier = ep.applier.lock();
    apply_and_publish(&mut applier, &ep.published, decoded, &shared.index, now);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topics_match_exactly_or_up_to_an_at_sign_longest_first() {
        let shared = Shared::for_tests();
        let ep = |port: u16| EndpointEvents::for_tests(&shared, port);
        let (a, b, c) = (ep(1), ep(2), ep(3));
        let routes = Routes {
            endpoints: vec![
                (b"kv@10.0.0.1"[..].into(), Arc::clone(&a)),
                (b"kv@10.0.0.12"[..].into(), Arc::clone(&b)),
                (b"kv@10.0.0.1@m"[..].into(), Arc::clone(&c)),
            ],
        };
        let port = |topic: &[u8]| routes.find(topic).map(|e| e.address().port());
        assert_eq!(port(b"kv@10.0.0.1"), Some(1));
        assert_eq!(port(b"kv@10.0.0.1@other"), Some(1));
        assert_eq!(port(b"kv@10.0.0.12@m"), Some(2));
        assert_eq!(port(b"kv@10.0.0.1@m"), Some(3), "the longest topic wins");
        assert_eq!(port(b"kv@10.0.0.123"), None, "no match inside an address");
        assert_eq!(port(b""), None);
        let single = Routes {
            endpoints: vec![(b"kv"[..].into(), a)],
        };
        assert!(
            single.find(b"anything").is_some(),
            "a socket with one endpoint"
        );
    }
}
