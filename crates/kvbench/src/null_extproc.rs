//! A null endpoint picker: the floor under any ext_proc service's hop cost.
//!
//! It speaks exactly the protocol shape kvrouter does with the shipped Envoy configs (picker:
//! CONTINUE to the request headers, the destination header and `envoy.lb` metadata in the reply
//! to the buffered body; observer: silent, and done at the first response body chunk), and does
//! nothing else: no parsing, no decision (destinations in turn); it marks requests for the
//! observer as kvrouter does by default (one per destination per `routing.observe_interval_ms`),
//! so the observer streams Envoy opens are the same in number. What Envoy + this costs over
//! Envoy alone is what the ext_proc protocol itself costs on the machine (Envoy's gRPC client and
//! tonic's server); what Envoy + kvrouter costs over Envoy + this is kvrouter's own share.
//! `scripts/overhead.sh` runs it as its third path.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request, ProcessingRequest, ProcessingResponse,
};
use futures::Stream;
use kvrouter::config::RoutingConfig;
use kvrouter::envoyconf::ExtprocAddress;
use kvrouter::extproc::envoy::{continue_, route, watch, Slot};
use kvrouter::load::EndpointLoad;
use tonic::{Response, Status, Streaming};

/// The destination header the shipped configs route on.
const HEADER: &str = "x-gateway-destination-endpoint";

/// Picks `destinations` in turn.
#[derive(Debug)]
pub struct NullPicker {
    destinations: Vec<String>,
    next: AtomicUsize,
    /// Per destination, when a request there was last marked for the observer.
    watched: Vec<EndpointLoad>,
    watch_interval: Duration,
}

impl NullPicker {
    /// A picker over `destinations` (at least one).
    pub fn new(destinations: &[SocketAddr]) -> NullPicker {
        assert!(
            !destinations.is_empty(),
            "a null picker needs a destination"
        );
        NullPicker {
            destinations: destinations.iter().map(SocketAddr::to_string).collect(),
            next: AtomicUsize::new(0),
            watched: destinations
                .iter()
                .map(|_| EndpointLoad::default())
                .collect(),
            watch_interval: Duration::from_millis(RoutingConfig::default().observe_interval_ms),
        }
    }

    /// The reply to `msg`, if it wants one; `Err(())` once the stream is done (an observer
    /// at its first body chunk).
    fn reply(&self, msg: &ProcessingRequest) -> Result<Option<ProcessingResponse>, ()> {
        let observer = msg.observability_mode;
        Ok(match &msg.request {
            Some(Request::RequestHeaders(h)) if h.end_of_stream => {
                Some(self.route(Slot::RequestHeaders))
            }
            Some(Request::RequestHeaders(_)) => Some(continue_(Slot::RequestHeaders)),
            Some(Request::RequestBody(b)) if b.end_of_stream => Some(self.route(Slot::RequestBody)),
            Some(Request::RequestBody(_)) => Some(continue_(Slot::RequestBody)),
            Some(Request::RequestTrailers(_)) => Some(continue_(Slot::RequestTrailers)),
            Some(Request::ResponseBody(_)) if observer => return Err(()),
            _ if observer => None,
            Some(Request::ResponseHeaders(_)) => Some(continue_(Slot::ResponseHeaders)),
            Some(Request::ResponseBody(_)) => Some(continue_(Slot::ResponseBody)),
            Some(Request::ResponseTrailers(_)) => Some(continue_(Slot::ResponseTrailers)),
            None => None,
        })
    }

    fn route(&self, slot: Slot) -> ProcessingResponse {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.destinations.len();
        let mut reply = route(slot, HEADER, &self.destinations[i], i as u64);
        if self.watched[i].claim_watch(Instant::now(), self.watch_interval) {
            watch(&mut reply);
        }
        reply
    }
}

type Replies = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

/// One stream's state: Envoy's messages and the picker.
struct Session {
    inbound: Streaming<ProcessingRequest>,
    picker: Arc<NullPicker>,
}

/// The tonic service around a shared [`NullPicker`].
struct Service(Arc<NullPicker>);

#[tonic::async_trait]
impl ExternalProcessor for Service {
    type ProcessStream = Replies;

    async fn process(
        &self,
        request: tonic::Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Replies>, Status> {
        let session = Session {
            inbound: request.into_inner(),
            picker: Arc::clone(&self.0),
        };
        Ok(Response::new(Box::pin(futures::stream::unfold(
            session,
            |mut s| async move {
                loop {
                    let msg = match s.inbound.message().await {
                        Ok(Some(msg)) => msg,
                        _ => return None,
                    };
                    match s.picker.reply(&msg) {
                        Ok(Some(reply)) => return Some((Ok(reply), s)),
                        Ok(None) => continue,
                        Err(()) => return None,
                    }
                }
            },
        ))))
    }
}

/// Serves the null picker on `listen` (a TCP address or a Unix socket, which it replaces if
/// stale and removes on Ctrl-C, not when killed) until the process ends.
pub async fn serve(listen: ExtprocAddress, destinations: &[SocketAddr]) -> Result<(), String> {
    let picker = Arc::new(NullPicker::new(destinations));
    let server = tonic::transport::Server::builder()
        .add_service(ExternalProcessorServer::new(Service(picker)));
    match listen {
        ExtprocAddress::Tcp(addr) => server.serve(addr).await.map_err(|e| e.to_string()),
        #[cfg(not(unix))]
        ExtprocAddress::Unix(_) => Err("a Unix socket needs a Unix host".into()),
        #[cfg(unix)]
        ExtprocAddress::Unix(path) => {
            let (incoming, _file) = kvrouter::serve::unix::bind(&path)
                .await
                .map_err(|e| format!("{e:#}"))?;
            server
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = tokio::signal::ctrl_c().await;
                })
                .await
                .map_err(|e| e.to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::service::ext_proc::v3::{
        processing_response::Response as R, HttpBody, HttpHeaders,
    };

    fn msg(request: Request, observability_mode: bool) -> ProcessingRequest {
        ProcessingRequest {
            request: Some(request),
            observability_mode,
            ..Default::default()
        }
    }

    #[test]
    fn routes_buffered_bodies_in_turn_and_observers_end_at_the_first_chunk() {
        let a: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let b: SocketAddr = "127.0.0.1:2".parse().unwrap();
        let p = NullPicker::new(&[a, b]);
        let headers = msg(Request::RequestHeaders(HttpHeaders::default()), false);
        assert!(matches!(
            p.reply(&headers).unwrap().unwrap().response,
            Some(R::RequestHeaders(_))
        ));
        let body = msg(
            Request::RequestBody(HttpBody {
                end_of_stream: true,
                ..Default::default()
            }),
            false,
        );
        let picks: Vec<String> = (0..3)
            .map(|_| {
                let reply = p.reply(&body).unwrap().unwrap();
                let lb = &reply.dynamic_metadata.unwrap().fields["envoy.lb"];
                format!("{lb:?}")
            })
            .collect();
        assert!(picks[0].contains("127.0.0.1:1") && picks[1].contains("127.0.0.1:2"));
        assert!(picks[2].contains("127.0.0.1:1"), "in turn: {picks:?}");
        let observed = msg(Request::ResponseHeaders(HttpHeaders::default()), true);
        assert!(
            p.reply(&observed).unwrap().is_none(),
            "observers get no reply"
        );
        let chunk = msg(Request::ResponseBody(HttpBody::default()), true);
        assert!(
            p.reply(&chunk).is_err(),
            "an observer is done at the first chunk"
        );
    }
}
