//! The `admin` section: who may use the admin APIs.
//!
//! ```yaml
//! admin:
//!   auth_token_file: /var/run/secrets/kvrouter/admin-token
//! ```
//!
//! One bearer token for every admin interface: the gRPC API (`kvrouter.v1.Admin`,
//! `kvrouter.v1.KvEvents`) and the HTTP `/debug/*` routes (`/healthz`, `/readyz` and `/metrics`
//! stay open). Without a token, explaining as a tenant is refused (it would be a cross-tenant
//! oracle). The file is read at start-up (a change takes a restart). See docs/observability.md.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::validate::Errors;

/// Admin API access.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdminConfig {
    /// A file holding the bearer token the admin APIs require (`authorization: Bearer
    /// <token>`); surrounding whitespace is ignored, the token must not be empty. Relative paths
    /// are resolved against the config file's directory. Default: none, no authentication
    /// (bind `server.admin_listen` to loopback then).
    pub auth_token_file: Option<PathBuf>,
}

impl AdminConfig {
    pub(super) fn validate(&self, errors: &mut Errors) {
        if self
            .auth_token_file
            .as_ref()
            .is_some_and(|p| p.as_os_str().is_empty() || p.file_name().is_none())
        {
            errors.push("admin.auth_token_file", "must name a file");
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    #[test]
    fn no_auth_by_default_and_an_empty_path_is_an_error() {
        assert_eq!(Config::default().admin.auth_token_file, None);
        let config = Config::from_yaml(
            "admin: {auth_token_file: ''}\npools: [{name: p, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
        )
        .unwrap();
        let errors: Vec<String> = config.validate().iter().map(|e| e.to_string()).collect();
        assert!(
            errors.contains(&"admin.auth_token_file: must name a file".to_string()),
            "{errors:?}"
        );
    }
}
