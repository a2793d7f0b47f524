//! The Envoy `ExternalProcessor` gRPC service: one task per stream drives a [`stream::Stream`]
//! and forwards its replies. Errors become Envoy responses here and nowhere else.
//!
//! This module translates between Envoy's messages and the router: it asks the router for a
//! snapshot and a decision, parks the decision's ticket until the response shows up, and hands
//! the ticket the facts it reads off the response. It scores nothing and writes no table.

mod budget;
mod envoy;
pub mod inflight;
mod observe;
mod reject;
mod salt;
pub mod stream;
#[cfg(test)]
mod stream_tests;

use std::pin::Pin;
use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures::Stream as FuturesStream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

pub use observe::Usage;

use crate::router::{Router, Ticket};
use crate::telemetry::Metrics;
use inflight::InflightTable;

/// How often parked tickets are checked against the request time limit.
const SWEEP_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);

/// Replies buffered per stream before the stream task waits for Envoy to read them. A full
/// duplex body echo sends one reply per received chunk, so this only bounds memory.
const REPLY_BUFFER: usize = 32;

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

    /// Drops, every 10 s, parked tickets older than `max_age` (a response never
    /// seen: no observer filter, or one that lost the stream), until aborted.
    pub fn spawn_sweeper(&self, max_age: std::time::Duration) -> tokio::task::JoinHandle<()> {
        let table = Arc::clone(&self.table);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(SWEEP_INTERVAL);
            loop {
                tick.tick().await;
                let released = table.sweep(max_age);
                if released > 0 {
                    tracing::warn!(
                        released,
                        "released in-flight records whose response was never seen"
                    );
                }
            }
        })
    }

    /// The tonic service, accepting messages up to `max_message_bytes` (a BUFFERED body arrives
    /// as one message).
    pub fn into_server(self, max_message_bytes: usize) -> ExternalProcessorServer<ExtProc> {
        ExternalProcessorServer::new(self)
            .max_decoding_message_size(max_message_bytes)
            .max_encoding_message_size(max_message_bytes)
    }
}

type ReplyStream = Pin<Box<dyn FuturesStream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for ExtProc {
    type ProcessStream = ReplyStream;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(REPLY_BUFFER);
        let stream = stream::Stream::new(
            Arc::clone(&self.router),
            Arc::clone(&self.table),
            Arc::clone(&self.metrics),
        );
        tokio::spawn(drive(Arc::clone(&self.metrics), stream, inbound, tx));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// Runs one stream to its end. Envoy resetting the stream at the end of a request is normal and
/// simply ends the loop; the stream state's drop releases anything still held.
async fn drive(
    metrics: Arc<Metrics>,
    mut stream: stream::Stream,
    mut inbound: Streaming<ProcessingRequest>,
    tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
) {
    metrics.stream_opened();
    'messages: loop {
        let msg = tokio::select! {
            msg = inbound.message() => msg,
            // Envoy stopped reading our replies: the HTTP stream is gone.
            _ = tx.closed() => break,
        };
        match msg {
            Ok(Some(msg)) => {
                for reply in stream.on_message(msg).await {
                    if tx.send(Ok(reply)).await.is_err() {
                        break 'messages;
                    }
                }
                if stream.is_finished() {
                    break;
                }
            }
            Ok(None) => break,
            Err(status) => {
                tracing::trace!(%status, "ext_proc stream ended by Envoy");
                break;
            }
        }
    }
    metrics.stream_closed(stream.outcome().as_str());
}

/// What the caller serves beside the ext_proc service on its port: other gRPC services (the
/// health service) and TLS. Kept apart so this module stays about ext_proc.
#[derive(Debug, Default)]
pub struct ServerExtras {
    /// Other gRPC services on the same port.
    pub routes: tonic::service::Routes,
    /// Serve TLS (HTTP/2 over TLS, ALPN `h2`) instead of plaintext, when set.
    pub tls: Option<tonic::transport::ServerTlsConfig>,
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
        .http2_keepalive_interval(Some(std::time::Duration::from_secs(30)));
    if let Some(tls) = extras.tls {
        builder = builder.tls_config(tls)?;
    }
    let sweeper = service.spawn_sweeper(max_request);
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let served = builder
        .add_routes(extras.routes)
        .add_service(service.into_server(max_message_bytes))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await;
    sweeper.abort();
    served
}
