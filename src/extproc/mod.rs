//! The Envoy `ExternalProcessor` gRPC service: each stream is a [`stream::Stream`] driven by
//! tonic polling its replies. Errors become Envoy responses here and nowhere else.
//!
//! This module translates between Envoy's messages and the router: it asks the router for a
//! snapshot and a decision, parks the decision's ticket until the response shows up, and hands
//! the ticket the facts it reads off the response. It scores nothing and writes no table.
//!
//! A stream is served without a task or channel of its own: the reply stream tonic polls reads
//! Envoy's next message and runs the stream's state machine inline, so a message costs one
//! task wake-up (tonic's), not three.

mod codec;
mod divert;
pub mod envoy;
pub mod inflight;
mod lanes;
mod reject;
mod salt;
pub mod stream;
#[cfg(test)]
mod stream_tests;
#[cfg(test)]
mod window_tests;

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingResponse;
use futures::Stream as FuturesStream;
use tonic::{Request, Response, Status, Streaming};

use codec::{ExtProcServer, Inbound};

use crate::router::{Router, Ticket};
use crate::telemetry::Metrics;
use inflight::InflightTable;

/// How often parked tickets are checked against the observer grace and the request time limit.
const SWEEP_INTERVAL: Duration = Duration::from_millis(250);

/// HTTP/2 flow-control window of one ext_proc stream, bytes: what Envoy may send a stream
/// ahead of the router reading it (one full-duplex chunk at the shipped configs' 1 MiB read
/// size).
const STREAM_WINDOW_BYTES: u32 = 1 << 20;

/// HTTP/2 flow-control window of one connection, bytes: 64 streams' windows, so streams that
/// wait unread (a chunk in the heavy lane) leave room for the others' messages.
const CONNECTION_WINDOW_BYTES: u32 = 64 << 20;

/// The ext_proc service.
#[derive(Debug, Clone)]
pub struct ExtProc {
    router: Arc<Router>,
    table: Arc<InflightTable<Ticket>>,
    metrics: Arc<Metrics>,
}

impl ExtProc {
    /// A service routing with `router`, parking routed requests' tickets until their response
    /// ends, counting streams in `metrics`.
    pub fn new(router: Arc<Router>, metrics: Arc<Metrics>) -> ExtProc {
        ExtProc {
            router,
            table: Arc::new(InflightTable::default()),
            metrics,
        }
    }

    /// Drops, every 250 ms, parked tickets older than `max_age` (a response never seen to its
    /// end) and those whose picker stream ended more than [`inflight::OBSERVER_GRACE`] ago
    /// without the observer's report (a request that never got a response); and hands each
    /// unwatched ticket its predicted first byte when it is due. Until aborted.
    pub fn spawn_sweeper(&self, max_age: Duration) -> tokio::task::JoinHandle<()> {
        let table = Arc::clone(&self.table);
        let sweep = async move {
            let mut tick = tokio::time::interval(SWEEP_INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let released = table.sweep(max_age, inflight::OBSERVER_GRACE);
                if released > 0 {
                    tracing::debug!(
                        released,
                        "released in-flight records whose response was never reported"
                    );
                }
            }
        };
        let clock = first_byte_clock(Arc::clone(&self.table));
        tokio::spawn(async move {
            tokio::join!(sweep, clock);
        })
    }

    /// The tonic service, accepting messages up to `max_message_bytes` (a BUFFERED body arrives
    /// as one message).
    pub fn into_server(self, max_message_bytes: usize) -> ExtProcServer {
        ExtProcServer::new(self, max_message_bytes)
    }

    /// Messages longer than this are decoded off the async workers ([`codec`]): the bodies
    /// that are decided in the heavy lane; the byte rate they are read at together (and its
    /// burst), and how long one may wait for it before it is refused.
    fn long_body_settings(&self) -> (usize, (u64, u64), Duration) {
        let state = self.router.snapshot();
        let routing = &state.config.routing;
        (
            routing.heavy_body_bytes,
            (routing.heavy_rate(), routing.heavy_burst()),
            Duration::from_millis(routing.heavy_body_max_wait_ms),
        )
    }

    /// Serves one ext_proc stream.
    fn process(&self, request: Request<Streaming<Inbound>>) -> Response<ReplyStream> {
        let pace_flow = request.extensions().get::<divert::PaceFlow>().cloned();
        let session = Session {
            stream: stream::Stream::new(
                Arc::clone(&self.router),
                Arc::clone(&self.table),
                Arc::clone(&self.metrics),
            )
            .with_pace_flow(pace_flow),
            inbound: request.into_inner(),
            replies: VecDeque::new(),
            metrics: Arc::clone(&self.metrics),
        };
        self.metrics.stream_opened();
        Response::new(Box::pin(futures::stream::unfold(session, Session::next)))
    }
}

/// Applies unwatched tickets' predicted first bytes as they come due
/// ([`Ticket::on_first_byte_due`]), sleeping until the earliest; never returns.
async fn first_byte_clock(table: Arc<InflightTable<Ticket>>) {
    loop {
        match table.next_due() {
            Some(at) => {
                tokio::select! {
                    _ = tokio::time::sleep_until(tokio::time::Instant::from_std(at)) => {}
                    _ = table.scheduled_earlier() => {}
                }
            }
            None => table.scheduled_earlier().await,
        }
        for id in table.take_due(std::time::Instant::now()) {
            // Gone already (the request ended first): its guard released everything.
            table.with(id, Ticket::on_first_byte_due);
        }
    }
}

type ReplyStream = Pin<Box<dyn FuturesStream<Item = Result<ProcessingResponse, Status>> + Send>>;

/// One stream being served: Envoy's messages in, our replies out, driven by tonic polling the
/// reply stream. Envoy resetting the stream at the end of a request is normal and simply ends
/// it; dropping the session (stream ended, or Envoy gone) drops the stream state, which
/// releases anything still held, and counts the stream's end.
struct Session {
    stream: stream::Stream,
    inbound: Streaming<Inbound>,
    /// Replies produced but not yet taken (a full-duplex echo produces one per body chunk).
    replies: VecDeque<ProcessingResponse>,
    metrics: Arc<Metrics>,
}

impl Session {
    /// The next reply, reading and handling Envoy's messages until there is one; `None` ends
    /// the stream from our side (nothing more expected, or Envoy ended it).
    async fn next(mut self) -> Option<(Result<ProcessingResponse, Status>, Session)> {
        loop {
            if let Some(reply) = self.replies.pop_front() {
                return Some((Ok(reply), self));
            }
            if self.stream.is_finished() {
                return None;
            }
            // Early STREAMED: a body that pauses is let go before Envoy's message timeout cuts it.
            let read = match self.stream.pause_deadline() {
                Some(deadline) => {
                    match tokio::time::timeout_at(deadline, self.inbound.message()).await {
                        Ok(read) => read,
                        Err(_) => {
                            // Not if the pace began holding a message meanwhile (the read is
                            // cancel-safe: what it had read stays in the stream).
                            if self
                                .stream
                                .pause_deadline()
                                .is_some_and(|d| d <= tokio::time::Instant::now())
                            {
                                self.replies.extend(self.stream.release_paused_body());
                            }
                            continue;
                        }
                    }
                }
                None => self.inbound.message().await,
            };
            if matches!(read, Ok(Some(_))) {
                self.stream.message_arrived();
            }
            let msg = match read {
                Ok(Some(Inbound::Decoded(msg))) => Ok(msg),
                // A long message that waited past `routing.heavy_body_max_wait_ms` for its turn
                // to be read (`divert`): refused, so Envoy does not fail it open past its
                // message timeout and hand the engine a body the router never checked.
                Ok(Some(Inbound::Refused)) => {
                    self.replies.extend(self.stream.refuse_held_body());
                    continue;
                }
                // A long message (a big body): decoded in the heavy lane, so its copy does not
                // hold an async worker (`codec`). It is charged to the body budget first: under
                // load it may wait for the lane a while, held all that time.
                Ok(Some(raw)) => {
                    if let Err(refused) = self.stream.prepay(raw.raw_len()) {
                        self.replies.extend(refused);
                        continue;
                    }
                    // The tenant is known when the headers came in a message of their own.
                    let lane = lanes::Lane::Heavy {
                        tenant: self.stream.tenant().map(str::to_string),
                        bytes: raw.raw_len(),
                    };
                    lanes::run(lane, move || raw.decode())
                        .await
                        .unwrap_or_else(|| Err(Status::unavailable("shutting down")))
                }
                Ok(None) => return None,
                Err(status) => Err(status),
            };
            match msg {
                Ok(msg) => self.replies.extend(self.stream.on_message(msg).await),
                Err(status) => {
                    tracing::trace!(%status, "ext_proc stream ended by Envoy");
                    return None;
                }
            }
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.metrics.stream_closed(self.stream.outcome().as_str());
    }
}

/// Connections accepted on a Unix socket (`serve::unix::bind` makes one).
#[cfg(unix)]
pub type UnixIncoming = std::pin::Pin<
    Box<dyn futures::Stream<Item = std::io::Result<tokio::net::UnixStream>> + Send + 'static>,
>;

/// What the caller serves beside the ext_proc service on its port: other gRPC services (the
/// health service), TLS and a Unix socket. Kept apart so this module stays about ext_proc.
#[derive(Default)]
pub struct ServerExtras {
    /// Other gRPC services on the same port.
    pub routes: tonic::service::Routes,
    /// Serve TLS (HTTP/2 over TLS, ALPN `h2`) instead of plaintext, when set.
    pub tls: Option<tonic::transport::ServerTlsConfig>,
    /// Serve the same services on these Unix socket connections too (plaintext: the socket
    /// file's mode guards it).
    #[cfg(unix)]
    pub unix: Option<UnixIncoming>,
}

/// Serves `service` (and `extras`) on `listener` until `shutdown` resolves, sweeping tickets
/// parked longer than `max_request` meanwhile.
pub async fn serve(
    service: ExtProc,
    listener: tokio::net::TcpListener,
    max_message_bytes: usize,
    max_request: std::time::Duration,
    extras: ServerExtras,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let mut builder = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(std::time::Duration::from_secs(30)))
        // A stream whose long chunk waits for the heavy lane is not read meanwhile, and what
        // Envoy sends it in the meantime counts against the connection's window too (Envoy
        // carries every stream of a worker on one connection). With the connection's window
        // no larger than a stream's (hyper's default, 1 MiB each), a few such streams closed
        // the connection to every other request: `window_tests`. Now each takes at most its
        // own 1 MiB of the connection's 64 MiB; 64 of them waiting at once on one connection
        // would close it again (reading ahead of the heavy lane would lift that; not done).
        .initial_stream_window_size(STREAM_WINDOW_BYTES)
        .initial_connection_window_size(CONNECTION_WINDOW_BYTES);
    let sweeper = service.spawn_sweeper(max_request);
    // One server value for both transports: the long bodies' byte pace is the process's.
    let ext_proc = service.into_server(max_message_bytes);
    #[cfg(unix)]
    let unix = extras.unix.map(|incoming| {
        // Before TLS: the Unix socket is plaintext.
        let server = builder
            .clone()
            .add_routes(extras.routes.clone())
            .add_service(ext_proc.clone());
        (server, incoming)
    });
    if let Some(tls) = extras.tls {
        builder = builder.tls_config(tls)?;
    }
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let shutdown = futures::FutureExt::shared(shutdown);
    let tcp = builder
        .add_routes(extras.routes)
        .add_service(ext_proc)
        .serve_with_incoming_shutdown(incoming, shutdown.clone());
    #[cfg(unix)]
    let served = match unix {
        Some((server, incoming)) => {
            let unix = server.serve_with_incoming_shutdown(incoming, shutdown);
            let (tcp, unix) = tokio::join!(tcp, unix);
            tcp.and(unix)
        }
        None => tcp.await,
    };
    #[cfg(not(unix))]
    let served = tcp.await;
    sweeper.abort();
    served
}
