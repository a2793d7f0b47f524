//! The admin bearer token (`admin.auth_token_file`), shared by every admin interface, and the
//! tonic interceptor that checks it on the gRPC API.

use std::path::Path;
use std::sync::Arc;

use tonic::{Request, Status};

use crate::config::AdminConfig;

/// Why the token could not be loaded, or a caller was refused.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// The token file could not be read.
    #[error("admin.auth_token_file: cannot read {path}: {source}")]
    Read {
        /// The resolved path.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The token file holds only whitespace.
    #[error("admin.auth_token_file: {path} is empty")]
    Empty {
        /// The resolved path.
        path: String,
    },
    /// No `authorization: Bearer ...` was sent.
    #[error("missing admin bearer token (authorization: Bearer <token>)")]
    Missing,
    /// The token sent is not the configured one.
    #[error("wrong admin bearer token")]
    Wrong,
}

/// The admin token, if one is configured. Cheap to clone.
#[derive(Clone, Default)]
pub struct AdminAuth {
    token: Option<Arc<str>>,
}

impl std::fmt::Debug for AdminAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the token.
        f.debug_struct("AdminAuth")
            .field("required", &self.token.is_some())
            .finish()
    }
}

impl AdminAuth {
    /// No authentication.
    pub fn none() -> AdminAuth {
        AdminAuth::default()
    }

    /// A fixed token (tests, embedding).
    pub fn with_token(token: &str) -> AdminAuth {
        AdminAuth {
            token: Some(token.into()),
        }
    }

    /// Loads the token `config` names (relative paths against `base_dir`, the config file's
    /// directory); no file configured means no authentication.
    pub fn load(config: &AdminConfig, base_dir: &Path) -> Result<AdminAuth, AuthError> {
        let Some(file) = &config.auth_token_file else {
            return Ok(AdminAuth::none());
        };
        let path = base_dir.join(file);
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(&path).map_err(|source| AuthError::Read {
            path: shown.clone(),
            source,
        })?;
        let token = text.trim();
        if token.is_empty() {
            return Err(AuthError::Empty { path: shown });
        }
        Ok(AdminAuth::with_token(token))
    }

    /// Whether callers must present a token.
    pub fn required(&self) -> bool {
        self.token.is_some()
    }

    /// Checks an `authorization` header value (`Bearer <token>`, scheme case-insensitive).
    pub fn check(&self, authorization: Option<&str>) -> Result<(), AuthError> {
        let Some(expected) = &self.token else {
            return Ok(());
        };
        let presented = authorization
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim())
            .ok_or(AuthError::Missing)?;
        if constant_time_eq(presented.as_bytes(), expected.as_bytes()) {
            Ok(())
        } else {
            Err(AuthError::Wrong)
        }
    }
}

/// Compares without returning early at the first differing byte, so the time taken does not
/// tell how much of a guess was right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl tonic::service::Interceptor for AdminAuth {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let header = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok());
        match self.check(header) {
            Ok(()) => Ok(request),
            Err(e) => Err(Status::unauthenticated(e.to_string())),
        }
    }
}

/// The HTTP side: `/debug/*` needs the token (401 with `www-authenticate: Bearer` otherwise);
/// the other HTTP routes pass, and the gRPC services check it in [`AdminAuth`]'s interceptor.
pub(super) async fn guard_debug(
    axum::extract::State(auth): axum::extract::State<AdminAuth>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    if !request.uri().path().starts_with("/debug") {
        return next.run(request).await;
    }
    let header = request
        .headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    match auth.check(header) {
        Ok(()) => next.run(request).await,
        Err(e) => (
            http::StatusCode::UNAUTHORIZED,
            [(http::header::WWW_AUTHENTICATE, "Bearer")],
            axum::Json(serde_json::json!({"error": e.to_string()})),
        )
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_checked_and_never_printed() {
        let auth = AdminAuth::with_token("s3cret");
        assert!(auth.check(Some("Bearer s3cret")).is_ok());
        assert!(auth.check(Some("bearer s3cret")).is_ok());
        assert!(matches!(auth.check(None), Err(AuthError::Missing)));
        assert!(matches!(
            auth.check(Some("s3cret")),
            Err(AuthError::Missing)
        ));
        assert!(matches!(
            auth.check(Some("Basic s3cret")),
            Err(AuthError::Missing)
        ));
        assert!(matches!(
            auth.check(Some("Bearer s3cre")),
            Err(AuthError::Wrong)
        ));
        assert!(matches!(
            auth.check(Some("Bearer s3cretX")),
            Err(AuthError::Wrong)
        ));
        assert!(!format!("{auth:?}").contains("s3cret"));
        assert!(AdminAuth::none().check(None).is_ok());
    }

    #[test]
    fn the_token_file_is_read_relative_to_the_config_and_trimmed() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("token"), "  abc\n").unwrap();
        let config = |f: &str| AdminConfig {
            auth_token_file: Some(f.into()),
        };
        let auth = AdminAuth::load(&config("token"), dir.path()).unwrap();
        assert!(auth.required());
        assert!(auth.check(Some("Bearer abc")).is_ok());
        std::fs::write(dir.path().join("blank"), " \n").unwrap();
        assert!(matches!(
            AdminAuth::load(&config("blank"), dir.path()),
            Err(AuthError::Empty { .. })
        ));
        assert!(matches!(
            AdminAuth::load(&config("missing"), dir.path()),
            Err(AuthError::Read { .. })
        ));
        assert!(!AdminAuth::load(&AdminConfig::default(), dir.path())
            .unwrap()
            .required());
    }
}
