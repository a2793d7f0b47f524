//! The gRPC health service (`grpc.health.v1.Health`) that gateways and kubelet probes ask, as
//! the reference endpoint picker answers it: served on the ext_proc port and on the health port
//! (`server.health_listen`, `--grpc-health-port`), NOT_SERVING while kvrouter starts (until every
//! Kubernetes pool has listed its pods) and while it drains at shutdown, SERVING in between.

use tonic::service::Routes;
use tonic_health::pb::health_server::HealthServer;
use tonic_health::server::{HealthReporter, HealthService};
use tonic_health::ServingStatus;

/// The service names answered: the whole server (`""`), the reference picker's probe name, and
/// the ext_proc service's own name (what a gateway health-checking the service asks).
pub const SERVICE_NAMES: [&str; 3] = [
    "",
    "inference-extension",
    "envoy.service.ext_proc.v3.ExternalProcessor",
];

/// The liveness probe's name: SERVING while the process serves, whatever the pools' state (as
/// the reference picker's `liveness` service), so a pool that is missing or slow to list makes
/// kvrouter unready, never restarted in a loop.
pub const LIVENESS: &str = "liveness";

/// One status for every name, shared by every port it is served on.
#[derive(Debug, Clone)]
pub struct Health {
    reporter: HealthReporter,
}

impl Health {
    /// All of [`SERVICE_NAMES`] NOT_SERVING; [`LIVENESS`] SERVING.
    pub async fn new() -> Health {
        let health = Health {
            reporter: HealthReporter::new(),
        };
        health.set(false).await;
        health
            .reporter
            .set_service_status(LIVENESS, ServingStatus::Serving)
            .await;
        health
    }

    /// Sets every name of [`SERVICE_NAMES`] SERVING (`true`) or NOT_SERVING; watchers are
    /// notified.
    pub async fn set(&self, serving: bool) {
        let status = if serving {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        for name in SERVICE_NAMES {
            self.reporter.set_service_status(name, status).await;
        }
    }

    /// The service, to add to a gRPC server.
    pub fn service(&self) -> HealthServer<HealthService> {
        HealthServer::new(HealthService::from_health_reporter(self.reporter.clone()))
    }

    /// The service as routes (for the ext_proc server's extras).
    pub fn routes(&self) -> Routes {
        Routes::new(self.service())
    }

    /// Serves only the health service on `listener` (plaintext, as kubelet gRPC probes dial)
    /// until `shutdown` resolves.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> Result<(), tonic::transport::Error> {
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        tonic::transport::Server::builder()
            .add_service(self.service())
            .serve_with_incoming_shutdown(incoming, shutdown)
            .await
    }
}
