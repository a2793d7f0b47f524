//! The `kvrouter.v1.Admin` service over the router's read-only [`AdminView`].

use std::pin::Pin;

use futures::Stream;
use tonic::{Request, Response, Status};

use super::convert::{endpoints_to_pb, explanation_to_pb, record_to_pb};
use super::pb;
use crate::router::{AdminView, RouteContext, RouteError};

/// `Admin`: explain, watch decisions, list endpoints.
#[derive(Debug, Clone)]
pub(super) struct AdminService {
    view: AdminView,
    /// Whether `tenant` may be set (only behind a token: see [`super::TENANT_EXPLAIN_REFUSED`]).
    tenant_explain: bool,
}

impl AdminService {
    pub(super) fn new(view: AdminView, tenant_explain: bool) -> AdminService {
        AdminService {
            view,
            tenant_explain,
        }
    }
}

type RecordStream = Pin<Box<dyn Stream<Item = Result<pb::DecisionRecord, Status>> + Send>>;

#[tonic::async_trait]
impl pb::admin_server::Admin for AdminService {
    async fn explain(
        &self,
        request: Request<pb::ExplainRequest>,
    ) -> Result<Response<pb::Explanation>, Status> {
        let req = request.into_inner();
        if req.tenant.is_some() && !self.tenant_explain {
            return Err(Status::permission_denied(super::TENANT_EXPLAIN_REFUSED));
        }
        let view = self.view.clone();
        // Tokenizing a long prompt is CPU work: off the async threads, as /debug/explain does.
        let explained = tokio::task::spawn_blocking(move || {
            let path = match req.path.as_str() {
                "" => "/v1/chat/completions",
                p => p,
            };
            let api = crate::request::ApiKind::from_path(path);
            let parsed = crate::request::parse(api, &req.body)
                .map_err(|e| Status::invalid_argument(e.to_string()))?;
            let ctx = RouteContext {
                tenant: req.tenant.as_deref(),
                ..RouteContext::default()
            };
            view.explain(&parsed, ctx).map_err(|e| match e {
                RouteError::UnknownModel { .. } => Status::not_found(e.to_string()),
                RouteError::NoEndpoint { .. } | RouteError::NoLabeledEndpoint { .. } => {
                    Status::failed_precondition(e.to_string())
                }
                RouteError::TenantNotAllowed { .. } => Status::permission_denied(e.to_string()),
            })
        })
        .await
        .map_err(|_| Status::internal("explain did not finish (shutting down?)"))??;
        Ok(Response::new(explanation_to_pb(&explained)))
    }

    type WatchDecisionsStream = RecordStream;

    async fn watch_decisions(
        &self,
        request: Request<pb::WatchDecisionsRequest>,
    ) -> Result<Response<Self::WatchDecisionsStream>, Status> {
        let model = request.into_inner().model;
        // Subscribed before answering: every decision made after the response headers is seen.
        let watch = self.view.watch_decisions();
        let stream = futures::stream::unfold((watch, 0u64), move |(mut watch, mut lost)| {
            let model = model.clone();
            async move {
                loop {
                    let (record, dropped) = watch.next().await?;
                    lost += dropped;
                    if model.is_empty() || record.model == model {
                        let out = record_to_pb(&record, lost);
                        return Some((Ok(out), (watch, 0)));
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_endpoints(
        &self,
        _request: Request<pb::GetEndpointsRequest>,
    ) -> Result<Response<pb::GetEndpointsResponse>, Status> {
        Ok(Response::new(endpoints_to_pb(&self.view)))
    }
}
