//! ZMQ SUB sockets and the tasks that feed their messages to endpoints.
//!
//! - **Connect** (the publisher binds, vLLM's default `tcp://*:5557`): one socket per endpoint,
//!   subscribed to its topic, connecting (and reconnecting by itself, zeromq's reconnect task)
//!   to the publisher. A dropped connection withdraws the endpoint's confirmed blocks until its
//!   next batch says whether anything was lost.
//! - **Bind** (publishers connect, vLLM endpoint `tcp://<router>:port`): one socket per bound
//!   address, shared by every endpoint configured with it and subscribed to everything; a
//!   message goes to the endpoint whose topic matches (see [`Routes::find`]). The address is
//!   held by [`super::gate`], which admits only the endpoints' own IPs (and
//!   `kv_events.allowed_publishers`), bounds message sizes before the `zeromq` crate reserves
//!   memory for them, and relays to the SUB socket on loopback. A publisher's disconnection
//!   withdraws the blocks of the endpoints on its IP, or of the only endpoint when there is one.
//!
//! Messages are decoded outside any lock, then applied under the endpoint's lock; the request
//! path never takes that lock.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use futures::StreamExt;
use zeromq::{Endpoint, Host, Socket, SocketEvent, SocketRecv, SubSocket, ZmqMessage};

use super::apply::{apply_and_publish, decode};
use super::endpoint::{EndpointEvents, Shared};
use super::replay::{self, Overlap};
use super::state::Reason;

/// The endpoints a socket feeds, with their topics.
#[derive(Debug, Default)]
pub(crate) struct Routes {
    pub(crate) endpoints: Vec<(Box<[u8]>, Arc<EndpointEvents>)>,
    /// A bound socket: any allowed publisher may be connected to it, not only the engine of
    /// its one endpoint.
    pub(crate) bound: bool,
}

impl Routes {
    /// The endpoint a message with `topic` belongs to: the one whose topic equals it or is
    /// followed in it by `@`, the longest such; on a connecting socket (one publisher, its
    /// endpoint's engine) or a bound one whose one endpoint has no topic, that one. A bound
    /// socket left with one endpoint by a reload or DNS still tells a removed engine's
    /// publisher, connected before, by its topic.
    pub(crate) fn find(&self, topic: &[u8]) -> Option<&Arc<EndpointEvents>> {
        if let [(t, only)] = &self.endpoints[..] {
            if !self.bound || t.is_empty() {
                return Some(only);
            }
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
pub(crate) const RETRY: Duration = Duration::from_millis(200);

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
        // The publisher's bytes reach zeromq through the gate's frame check (a discovered
        // address is not trusted); connected means connected to the publisher.
        let (target, _relay) = match super::gate::connect_checked(&endpoint, &shared).await {
            Ok(gated) => gated,
            Err(e) => {
                tracing::debug!(%endpoint, "kv events: connect failed, retrying: {e}");
                tokio::time::sleep(RETRY).await;
                continue;
            }
        };
        // zeromq's connect waits for the publisher (up to its connect timeout) and reconnects by
        // itself after it succeeded once; until then, retry here.
        if let Err(e) = socket.connect(&target).await {
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
            false,
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
    shared: &Arc<Shared>,
) -> Option<u64> {
    let started = std::time::Instant::now();
    match replay::fetch(endpoint, 0, shared).await {
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
/// the socket's task: the [`super::gate`] on `endpoint`, relaying to a SUB socket on an
/// ephemeral loopback port. A wildcard host (`*`) is every interface; an empty one
/// (`tcp://:5557`) is loopback. Returns the task and the bound endpoint (`tcp://ip:port`).
pub(crate) async fn start_bind(
    endpoint: &str,
    routes: Arc<ArcSwap<Routes>>,
    shared: Arc<Shared>,
) -> Result<(tokio::task::JoinHandle<()>, String), std::io::Error> {
    let public = bind_address(endpoint)?;
    let listener = tokio::net::TcpListener::bind(public.as_str()).await?;
    let shown = format!("tcp://{}", listener.local_addr()?);
    let mut socket = SubSocket::new();
    let mut monitor = socket.monitor();
    let inner = match socket.bind("tcp://127.0.0.1:0").await {
        Ok(Endpoint::Tcp(Host::Ipv4(ip), port)) => SocketAddr::from((ip, port)),
        Ok(other) => {
            return Err(std::io::Error::other(format!(
                "the inner socket bound {other}, not an IPv4 loopback address"
            )))
        }
        Err(e) => return Err(std::io::Error::other(e.to_string())),
    };
    socket
        .subscribe("")
        .await
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    tracing::info!(endpoint = %shown, "kv events: bound");
    let task = tokio::spawn(async move {
        let gate = super::gate::run(listener, inner, Arc::clone(&routes), Arc::clone(&shared));
        let mut overlap = Overlap::default();
        tokio::select! {
            () = receive(&mut socket, &mut monitor, &routes, &shared, true, &mut overlap) => {}
            () = gate => {}
        }
    });
    Ok((task, shown))
}

/// The `host:port` a bind endpoint (`tcp://host:port`) listens on.
fn bind_address(endpoint: &str) -> Result<String, std::io::Error> {
    let invalid = || std::io::Error::new(std::io::ErrorKind::InvalidInput, "not tcp://host:port");
    let rest = endpoint.strip_prefix("tcp://").ok_or_else(invalid)?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(invalid)?;
    let host = match host {
        "" => "127.0.0.1",
        "*" => "0.0.0.0",
        "[*]" => "[::]",
        h => h,
    };
    Ok(format!("{host}:{port}"))
}

/// Receives until the socket is gone. A bound socket's peers are the gate's relays: its
/// [`super::gate`] reports publishers that go away, so their socket events are ignored here.
async fn receive(
    socket: &mut SubSocket,
    monitor: &mut futures::channel::mpsc::Receiver<SocketEvent>,
    routes: &ArcSwap<Routes>,
    shared: &Shared,
    bound: bool,
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
                Some(_) if bound => {}
                Some(event) => {
                    // A connecting socket whose publisher went away: reconnect on our own
                    // cadence (`RETRY`). The zeromq crate's own reconnect backs off to 30 s, so
                    // an engine that took a minute to restart had published its first batch
                    // before we were back, and that loss left it partial for good.
                    let lost = matches!(event, SocketEvent::Disconnected(_));
                    on_socket_event(event, routes, shared);
                    if lost {
                        return;
                    }
                }
                None => return,
            },
        }
    }
}

/// A connecting socket's events.
fn on_socket_event(event: SocketEvent, routes: &ArcSwap<Routes>, shared: &Shared) {
    let routes = routes.load();
    match event {
        SocketEvent::Disconnected(_) => {
            for (_, ep) in &routes.endpoints {
                ep.link_lost(Reason::Disconnected, shared);
            }
        }
        SocketEvent::Connected(..) => {
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
            bound: true,
        };
        let port = |topic: &[u8]| routes.find(topic).map(|e| e.address().port());
        assert_eq!(port(b"kv@10.0.0.1"), Some(1));
        assert_eq!(port(b"kv@10.0.0.1@other"), Some(1));
        assert_eq!(port(b"kv@10.0.0.12@m"), Some(2));
        assert_eq!(port(b"kv@10.0.0.1@m"), Some(3), "the longest topic wins");
        assert_eq!(port(b"kv@10.0.0.123"), None, "no match inside an address");
        assert_eq!(port(b""), None);
        let single = Routes {
            endpoints: vec![(b"kv@10.0.0.1"[..].into(), a)],
            bound: false,
        };
        assert!(
            single.find(b"anything").is_some(),
            "a connecting socket with one endpoint"
        );
        // A bound socket left with one endpoint: another engine's publisher, connected while
        // its endpoint was in the set, is not taken for it.
        let left = Routes {
            bound: true,
            ..single
        };
        assert_eq!(left.find(b"kv@10.0.0.7").map(|e| e.address().port()), None);
        assert_eq!(
            left.find(b"kv@10.0.0.1@rank1").map(|e| e.address().port()),
            Some(1)
        );
        let topicless = Routes {
            endpoints: vec![(b""[..].into(), c)],
            bound: true,
        };
        assert!(topicless.find(b"anything").is_some(), "no topic: that one");
    }
}
