//! Requests the router answers itself, as OpenAI-style JSON errors.

use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingResponse;
use serde_json::json;

use super::envoy;
use crate::flow::Shed;
use crate::request::RequestError;
use crate::router::RouteError;

/// An error answered to the client instead of routing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// HTTP status.
    pub status: u16,
    /// Human-readable message (never contains prompt text).
    pub message: String,
    /// OpenAI error `type`.
    pub kind: &'static str,
    /// The offending request field, if any.
    pub param: Option<String>,
}

impl Rejection {
    /// 413: the body exceeds `limit` bytes.
    pub fn too_large(limit: usize) -> Rejection {
        Rejection {
            status: 413,
            message: format!("Request body exceeds the router's limit of {limit} bytes."),
            kind: "invalid_request_error",
            param: None,
        }
    }

    /// 400: a tenant's request whose body is not a JSON object with a string `cache_salt` (or
    /// none): it cannot be given the tenant's salt, and must not reach the engine without it.
    pub fn unsaltable() -> Rejection {
        Rejection {
            status: 400,
            message:
                "Request body must be a JSON object whose cache_salt, if present, is a string."
                    .into(),
            kind: "invalid_request_error",
            param: Some("cache_salt".into()),
        }
    }

    /// 503: taking this body would pass `routing.max_buffered_body_bytes` (all streams' bodies
    /// together); the client may retry after `retry-after`.
    pub fn bodies_busy() -> Rejection {
        Rejection {
            status: 503,
            message: "The router is holding too many request bodies; retry later.".into(),
            kind: "server_overloaded",
            param: None,
        }
    }

    /// 503: the body is long, and long bodies arrive faster than `routing.heavy_body_bytes_per_s`
    /// lets the router read them: it waited `routing.heavy_body_max_wait_ms` for its turn.
    pub fn long_bodies_busy() -> Rejection {
        Rejection {
            status: 503,
            message: "The router is receiving too many long request bodies; retry later.".into(),
            kind: "server_overloaded",
            param: None,
        }
    }

    /// 408: a tenant's early-STREAMED body paused longer than `routing.streamed_body_pause_ms`;
    /// it cannot be let through unrouted (it would go unsalted).
    pub fn body_paused() -> Rejection {
        Rejection {
            status: 408,
            message: "The request body paused for longer than the router waits for it.".into(),
            kind: "invalid_request_error",
            param: None,
        }
    }

    /// 500: the router could not finish its own work (shutting down).
    pub fn internal() -> Rejection {
        Rejection {
            status: 500,
            message: "The router failed to process the request.".into(),
            kind: "internal_error",
            param: None,
        }
    }

    /// The ext_proc reply; 503s and 429s carry `retry-after: retry_after_s`.
    pub fn into_response(self, retry_after_s: u32) -> ProcessingResponse {
        let body = json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status,
            }
        });
        let extra: Vec<(&str, String)> = if matches!(self.status, 429 | 503) {
            vec![("retry-after", retry_after_s.to_string())]
        } else {
            Vec::new()
        };
        let details = format!("kvrouter_{}", self.status);
        envoy::immediate(self.status, body.to_string().into_bytes(), &extra, &details)
    }
}

impl From<RequestError> for Rejection {
    fn from(e: RequestError) -> Rejection {
        Rejection {
            // 413 for a body over the router's shape limits, 400 for the rest.
            status: e.http_status(),
            param: e.param().map(str::to_string),
            message: e.to_string(),
            kind: "invalid_request_error",
        }
    }
}

impl From<Shed> for Rejection {
    fn from(e: Shed) -> Rejection {
        let status = e.status();
        Rejection {
            status,
            message: e.to_string(),
            kind: if status == 429 {
                "rate_limit_error"
            } else {
                "service_unavailable"
            },
            param: None,
        }
    }
}

impl From<RouteError> for Rejection {
    fn from(e: RouteError) -> Rejection {
        match &e {
            RouteError::UnknownModel { .. } => Rejection {
                status: 404,
                message: e.to_string(),
                kind: "not_found_error",
                param: Some("model".into()),
            },
            RouteError::NoEndpoint { .. } | RouteError::NoLabeledEndpoint { .. } => Rejection {
                status: 503,
                message: e.to_string(),
                kind: "service_unavailable",
                param: None,
            },
            RouteError::TenantNotAllowed { .. } => Rejection {
                status: 403,
                message: e.to_string(),
                kind: "permission_error",
                param: None,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flow::ShedReason;
    use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;

    #[test]
    fn errors_map_to_statuses_and_openai_bodies() {
        let cases = [
            (
                Rejection::from(RequestError::Missing("model")),
                400,
                Some("model"),
            ),
            (
                Rejection::from(RouteError::UnknownModel { model: "x".into() }),
                404,
                Some("model"),
            ),
            (
                Rejection::from(RouteError::NoEndpoint {
                    model: "x".into(),
                    reason: "r",
                }),
                503,
                None,
            ),
            (
                Rejection::from(RouteError::TenantNotAllowed { model: "x".into() }),
                403,
                None,
            ),
            (
                Rejection::from(RouteError::NoLabeledEndpoint {
                    model: "x".into(),
                    objective: "o".into(),
                }),
                503,
                None,
            ),
            (Rejection::too_large(10), 413, None),
            (
                Rejection::from(Shed {
                    reason: ShedReason::Expired,
                    priority: -1,
                    retry_after_s: 7,
                }),
                429,
                None,
            ),
            (
                Rejection::from(Shed {
                    reason: ShedReason::QueueFull,
                    priority: 0,
                    retry_after_s: 7,
                }),
                503,
                None,
            ),
            (
                Rejection::from(RequestError::TooLarge {
                    field: "messages",
                    limit: 3,
                }),
                413,
                Some("messages"),
            ),
        ];
        for (rejection, status, param) in cases {
            assert_eq!(rejection.status, status);
            let Some(Response::ImmediateResponse(ir)) = rejection.into_response(7).response else {
                panic!()
            };
            assert_eq!(ir.status.unwrap().code, i32::from(status));
            let body: serde_json::Value = serde_json::from_slice(&ir.body).unwrap();
            assert_eq!(body["error"]["code"], status);
            assert_eq!(body["error"]["param"].as_str(), param);
            assert!(body["error"]["message"].as_str().unwrap().len() > 5);
            let headers = ir.headers.unwrap().set_headers;
            let retry = headers
                .iter()
                .find(|h| h.header.as_ref().unwrap().key == "retry-after");
            assert_eq!(retry.is_some(), status == 503 || status == 429);
            if let Some(h) = retry {
                assert_eq!(h.header.as_ref().unwrap().raw_value, b"7");
            }
        }
    }
}
