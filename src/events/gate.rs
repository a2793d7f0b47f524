//! The gate in front of a bound KV-event socket: whoever may connect, and how big a message
//! they may announce, is checked here before the `zeromq` crate sees a byte.
//!
//! Why a gate and not a socket option: `zeromq` 0.7's decoder (`codec/zmq_codec.rs`) reads a
//! frame's 8-byte length and reserves that many bytes (plus a read chunk) for the body before
//! any of it arrives; it only refuses lengths that overflow `isize`. A peer announcing 2^62
//! bytes makes that reservation fail, which aborts the process, and the crate has no maximum
//! message size to set. So the public listener is ours: a peer whose IP is not allowed is
//! closed on accept, and every other connection is relayed to the real SUB socket (bound on
//! 127.0.0.1, ephemeral port) through [`FrameCheck`], which follows ZMTP 3 framing and closes
//! the connection at the first header announcing more than `kv_events.max_message_bytes` for
//! one message (or more than [`MAX_FRAMES_PER_MESSAGE`] frames), before forwarding that header.
//!
//! Allowed publishers: the IPs of the endpoints that share the socket (their HTTP address's
//! IP; an engine publishes from its own host) and `kv_events.allowed_publishers`.
//!
//! Connecting sockets (`connect:`, and the replay socket) go through the same check the other
//! way round ([`connect_checked`]): kvrouter connects to the publisher itself and relays its
//! bytes through [`FrameCheck`] to the `zeromq` socket, which connects to a loopback port.
//!
//! Known limits: a local process can still reach the inner socket directly (it listens on
//! loopback only; the host is inside the trust boundary).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use arc_swap::ArcSwap;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use super::endpoint::Shared;
use super::state::Reason;
use super::subscriber::{Routes, RETRY};

/// Most frames in one message (a KV-event message has 3: topic, sequence, payload); more and
/// the connection is closed. Bounds the per-frame bookkeeping a message of empty frames costs.
pub(crate) const MAX_FRAMES_PER_MESSAGE: u32 = 16;

/// Most connections at once from one IP (a data-parallel engine opens one per rank); more are
/// closed on accept.
pub(crate) const MAX_CONNECTIONS_PER_IP: u32 = 64;

/// ZMTP 3 greeting length, bytes (signature, version, mechanism, as-server, filler).
const GREETING_BYTES: u8 = 64;

/// The gate's settings, from the top-level `kv_events` section.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct GateLimits {
    /// `kv_events.max_message_bytes`.
    pub(crate) max_message_bytes: u64,
    /// `kv_events.allowed_publishers`.
    pub(crate) extra_publishers: Vec<IpAddr>,
}

impl GateLimits {
    pub(crate) fn of(config: &crate::config::Config) -> GateLimits {
        GateLimits {
            max_message_bytes: config.kv_events.max_message_bytes,
            extra_publishers: config.kv_events.allowed_publishers.clone(),
        }
    }
}

/// Why a connection was closed by [`FrameCheck`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Refused {
    /// The stream does not start with a ZMTP 3 greeting.
    #[error("not a ZMTP greeting")]
    Greeting,
    /// A frame header announced a message (or command) larger than the limit.
    #[error("a message of {announced} bytes announced, over the limit of {limit}")]
    TooLarge {
        /// Bytes announced so far for the message, headers excluded.
        announced: u64,
        /// `kv_events.max_message_bytes`.
        limit: u64,
    },
    /// More than [`MAX_FRAMES_PER_MESSAGE`] frames in one message.
    #[error("more than {MAX_FRAMES_PER_MESSAGE} frames in one message")]
    TooManyFrames,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Greeting { seen: u8 },
    Flags,
    ShortLen { flags: u8 },
    LongLen { flags: u8, have: u8, len: u64 },
    Body { left: u64, flags: u8 },
}

/// Follows the ZMTP 3 framing of one peer-to-us byte stream, chunk by chunk as it arrives,
/// and refuses it at the first header over the limits. Costs O(1) memory and O(headers) work.
#[derive(Debug)]
pub(crate) struct FrameCheck {
    state: State,
    max_message_bytes: u64,
    /// Body bytes announced for the message being received.
    message_bytes: u64,
    /// Frames of the message being received.
    frames: u32,
}

const FLAG_MORE: u8 = 0b001;
const FLAG_LONG: u8 = 0b010;
const FLAG_COMMAND: u8 = 0b100;

impl FrameCheck {
    /// A check for a new connection, allowing messages of at most `max_message_bytes`.
    pub(crate) fn new(max_message_bytes: u64) -> FrameCheck {
        FrameCheck {
            state: State::Greeting { seen: 0 },
            max_message_bytes,
            message_bytes: 0,
            frames: 0,
        }
    }

    /// Checks the next `bytes` of the stream; once it refused, the connection must be closed
    /// (the chunk that held the bad header is not to be forwarded).
    pub(crate) fn feed(&mut self, mut bytes: &[u8]) -> Result<(), Refused> {
        while let Some((&first, rest)) = bytes.split_first() {
            match self.state {
                State::Greeting { seen } => {
                    if seen == 0 && first != 0xff {
                        return Err(Refused::Greeting);
                    }
                    let take = usize::from(GREETING_BYTES - seen).min(bytes.len());
                    bytes = &bytes[take..];
                    let seen = seen + take as u8;
                    self.state = if seen == GREETING_BYTES {
                        State::Flags
                    } else {
                        State::Greeting { seen }
                    };
                }
                State::Flags => {
                    bytes = rest;
                    self.state = if first & FLAG_LONG != 0 {
                        State::LongLen {
                            flags: first,
                            have: 0,
                            len: 0,
                        }
                    } else {
                        State::ShortLen { flags: first }
                    };
                }
                State::ShortLen { flags } => {
                    bytes = rest;
                    self.begin_frame(flags, u64::from(first))?;
                }
                State::LongLen { flags, have, len } => {
                    bytes = rest;
                    let len = (len << 8) | u64::from(first);
                    if have == 7 {
                        self.begin_frame(flags, len)?;
                    } else {
                        self.state = State::LongLen {
                            flags,
                            have: have + 1,
                            len,
                        };
                    }
                }
                State::Body { left, flags } => {
                    let take = left.min(bytes.len() as u64);
                    bytes = &bytes[take as usize..];
                    if take == left {
                        self.end_frame(flags);
                    } else {
                        self.state = State::Body {
                            left: left - take,
                            flags,
                        };
                    }
                }
            }
        }
        Ok(())
    }

    fn begin_frame(&mut self, flags: u8, len: u64) -> Result<(), Refused> {
        let limit = self.max_message_bytes;
        if flags & FLAG_COMMAND != 0 {
            // Commands (READY, SUBSCRIBE, PING) are not parts of a message.
            if len > limit {
                return Err(Refused::TooLarge {
                    announced: len,
                    limit,
                });
            }
        } else {
            self.frames += 1;
            if self.frames > MAX_FRAMES_PER_MESSAGE {
                return Err(Refused::TooManyFrames);
            }
            self.message_bytes = self.message_bytes.saturating_add(len);
            if self.message_bytes > limit {
                return Err(Refused::TooLarge {
                    announced: self.message_bytes,
                    limit,
                });
            }
        }
        if len == 0 {
            self.end_frame(flags);
        } else {
            self.state = State::Body { left: len, flags };
        }
        Ok(())
    }

    fn end_frame(&mut self, flags: u8) {
        if flags & FLAG_COMMAND == 0 && flags & FLAG_MORE == 0 {
            self.message_bytes = 0;
            self.frames = 0;
        }
        self.state = State::Flags;
    }
}

/// Whether `ip` may publish to the socket feeding `routes`.
fn allowed(ip: IpAddr, routes: &Routes, limits: &GateLimits) -> bool {
    limits
        .extra_publishers
        .iter()
        .any(|a| a.to_canonical() == ip)
        || routes
            .endpoints
            .iter()
            .any(|(_, ep)| ep.address().ip().to_canonical() == ip)
}

/// Accepts publishers on `listener` and relays the allowed ones to the SUB socket at `inner`
/// until the task is aborted (which closes every relayed connection too). When a publisher's
/// connection ends, the endpoints on its IP (or the socket's only endpoint) lose their link,
/// as a ZMQ disconnection did before the gate.
pub(crate) async fn run(
    listener: TcpListener,
    inner: SocketAddr,
    routes: Arc<ArcSwap<Routes>>,
    shared: Arc<Shared>,
) {
    let mut relays: JoinSet<(IpAddr, Result<(), String>)> = JoinSet::new();
    let mut per_ip: HashMap<IpAddr, u32> = HashMap::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, from) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::debug!("kv events: accept failed: {e}");
                        tokio::time::sleep(RETRY).await;
                        continue;
                    }
                };
                let ip = from.ip().to_canonical();
                let limits = shared.gate.load_full();
                let count = per_ip.entry(ip).or_default();
                if !allowed(ip, &routes.load(), &limits) || *count >= MAX_CONNECTIONS_PER_IP {
                    shared.refused.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(peer = %ip, "kv events: publisher refused (not allowed or too many connections)");
                    if *count == 0 {
                        per_ip.remove(&ip);
                    }
                    continue;
                }
                *count += 1;
                let max = limits.max_message_bytes;
                let shared = Arc::clone(&shared);
                relays.spawn(async move { (ip, relay(stream, inner, max, &shared).await) });
            }
            Some(done) = relays.join_next() => {
                let Ok((ip, result)) = done else { continue };
                if let Some(count) = per_ip.get_mut(&ip) {
                    *count -= 1;
                    if *count == 0 {
                        per_ip.remove(&ip);
                    }
                }
                if let Err(e) = result {
                    tracing::debug!(peer = %ip, "kv events: publisher connection closed: {e}");
                }
                peer_lost(ip, &routes.load(), &shared);
            }
        }
    }
}

/// The endpoints a lost publisher connection from `ip` fed lose their link.
fn peer_lost(ip: IpAddr, routes: &Routes, shared: &Shared) {
    let only = routes.endpoints.len() == 1;
    for (_, ep) in &routes.endpoints {
        if only || ep.address().ip().to_canonical() == ip {
            ep.link_lost(Reason::Disconnected, shared);
        }
    }
}

/// The relay task of [`connect_checked`] (none for other transports), aborted when dropped:
/// keep it as long as the socket it feeds.
pub(crate) struct Relay(Option<tokio::task::JoinHandle<()>>);

impl Drop for Relay {
    fn drop(&mut self) {
        if let Some(task) = &self.0 {
            task.abort();
        }
    }
}

/// The way a connecting socket reaches its publisher at `endpoint` through a [`FrameCheck`]:
/// for `tcp://host:port`, connects there itself, and returns a loopback endpoint for the local
/// `zeromq` socket to connect to instead, with the relay. The first connection accepted there is relayed to the publisher, whose bytes go
/// through the check; the relay ends, closing both, when either side closes or the check
/// refuses. Other transports (`ipc://`) are returned as they are, with no task.
///
/// Why: a discovered pool's `connect:` template reaches whatever listens at an address DNS or
/// Kubernetes gave, which the threat model does not trust, and `zeromq` aborts the process on
/// a frame header announcing 2^62 bytes (see the module doc).
pub(crate) async fn connect_checked(
    endpoint: &str,
    shared: &Arc<Shared>,
) -> std::io::Result<(String, Relay)> {
    let Some(remote) = endpoint.strip_prefix("tcp://") else {
        return Ok((endpoint.to_string(), Relay(None)));
    };
    let upstream = TcpStream::connect(remote).await?;
    let listener = TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0)).await?;
    let local = listener.local_addr()?;
    let max = shared.gate.load().max_message_bytes;
    let shared = Arc::clone(shared);
    let task = tokio::spawn(async move {
        let Ok((inner, _)) = listener.accept().await else {
            return;
        };
        drop(listener);
        if let Err(e) = relay_streams(upstream, inner, max, &shared).await {
            tracing::debug!("kv events: publisher connection closed: {e}");
        }
    });
    Ok((format!("tcp://{local}"), Relay(Some(task))))
}

/// Relays one publisher connection: its bytes through a [`FrameCheck`] to `inner`, the SUB
/// socket's bytes back unchecked (ours). Ends when either side closes or the check refuses.
async fn relay(
    peer: TcpStream,
    inner: SocketAddr,
    max_message_bytes: u64,
    shared: &Shared,
) -> Result<(), String> {
    let socket = TcpStream::connect(inner)
        .await
        .map_err(|e| format!("inner socket: {e}"))?;
    relay_streams(peer, socket, max_message_bytes, shared).await
}

/// [`relay`] between two connected streams: `peer` the publisher's, `socket` our SUB's.
async fn relay_streams(
    peer: TcpStream,
    socket: TcpStream,
    max_message_bytes: u64,
    shared: &Shared,
) -> Result<(), String> {
    let _ = peer.set_nodelay(true);
    let _ = socket.set_nodelay(true);
    let (mut peer_read, mut peer_write) = peer.into_split();
    let (mut inner_read, mut inner_write) = socket.into_split();
    let up = async {
        let mut check = FrameCheck::new(max_message_bytes);
        let mut buf = vec![0u8; 16 << 10];
        loop {
            let n = peer_read.read(&mut buf).await.map_err(|e| e.to_string())?;
            if n == 0 {
                return Ok(());
            }
            check.feed(&buf[..n]).map_err(|e| {
                shared.refused.fetch_add(1, Ordering::Relaxed);
                e.to_string()
            })?;
            inner_write
                .write_all(&buf[..n])
                .await
                .map_err(|e| e.to_string())?;
        }
    };
    let down = tokio::io::copy(&mut inner_read, &mut peer_write);
    tokio::select! {
        r = up => r,
        _ = down => Ok(()),
    }
}

#[cfg(test)]
mod tests;
