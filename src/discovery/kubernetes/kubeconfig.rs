//! Where the API server is and how to authenticate to it: a pod's service account (in-cluster)
//! or a kubeconfig file.
//!
//! Supported from a kubeconfig: `server` (https or http), the CA (`certificate-authority` or
//! `-data`), `tls-server-name`, bearer tokens (`token`, `tokenFile`) and client certificates
//! (`client-certificate`/`client-key`, or their `-data`). Exec plugins, auth providers, basic
//! auth and `insecure-skip-tls-verify` are refused with a message naming them: a picker runs
//! in-cluster, and a developer's kubeconfig can hold a token or certificate instead.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use base64::Engine;
use serde::Deserialize;

use super::KubeError;

/// The service account's files in a pod.
const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// How requests authenticate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Auth {
    /// No credentials (a client certificate, if any, is in [`Endpoint::client_identity`]).
    None,
    /// A fixed bearer token.
    Token(String),
    /// A bearer token re-read from this file before every request: projected service-account
    /// tokens rotate (about hourly) while the process runs.
    TokenFile(PathBuf),
}

/// Everything needed to reach the API server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// `https://host:port` (or `http://` for a plaintext server), without a trailing `/`.
    pub server: String,
    /// PEM CA bundle to trust (https). None: the server must be plaintext.
    pub ca_pem: Option<Vec<u8>>,
    /// The name expected in the server's certificate, if not the URL's host.
    pub tls_server_name: Option<String>,
    /// Client certificate chain and key, PEM.
    pub client_identity: Option<(Vec<u8>, Vec<u8>)>,
    /// Bearer token source.
    pub auth: Auth,
    /// The namespace the credentials default to (the service account's, or the context's).
    pub namespace: Option<String>,
    /// Where this came from, for messages (`in-cluster` or the kubeconfig path and context).
    pub origin: String,
}

impl Endpoint {
    /// The API server for a source: `kubeconfig` if given, else in-cluster when
    /// `KUBERNETES_SERVICE_HOST` is set, else `$KUBECONFIG` (its first file), else
    /// `~/.kube/config`.
    pub fn discover(
        kubeconfig: Option<&Path>,
        context: Option<&str>,
    ) -> Result<Endpoint, KubeError> {
        if let Some(path) = kubeconfig {
            return Endpoint::from_kubeconfig(path, context);
        }
        if let Ok(host) = std::env::var("KUBERNETES_SERVICE_HOST") {
            let port = std::env::var("KUBERNETES_SERVICE_PORT").unwrap_or_else(|_| "443".into());
            return Endpoint::in_cluster(&host, &port, Path::new(SERVICE_ACCOUNT_DIR));
        }
        let path = match std::env::var_os("KUBECONFIG").filter(|v| !v.is_empty()) {
            Some(list) => std::env::split_paths(&list).next().unwrap_or_default(),
            None => match std::env::var_os("HOME") {
                Some(home) => PathBuf::from(home).join(".kube/config"),
                None => {
                    return Err(KubeError::Config(
                        "no API server: not in a pod (KUBERNETES_SERVICE_HOST unset), and no \
                         kubeconfig (kubernetes.kubeconfig, $KUBECONFIG, ~/.kube/config)"
                            .into(),
                    ))
                }
            },
        };
        Endpoint::from_kubeconfig(&path, context)
    }

    /// The pod's own service account: `https://host:port`, its CA, token and namespace from `dir`.
    pub fn in_cluster(host: &str, port: &str, dir: &Path) -> Result<Endpoint, KubeError> {
        let host = if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]") // an IPv6 service IP
        } else {
            host.to_string()
        };
        let ca = dir.join("ca.crt");
        let token = dir.join("token");
        if !token.exists() {
            return Err(KubeError::Config(format!(
                "in-cluster: {} is missing (automountServiceAccountToken: true?)",
                token.display()
            )));
        }
        Ok(Endpoint {
            server: format!("https://{host}:{port}"),
            ca_pem: Some(read(&ca)?),
            tls_server_name: None,
            client_identity: None,
            auth: Auth::TokenFile(token),
            namespace: std::fs::read_to_string(dir.join("namespace"))
                .ok()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty()),
            origin: "in-cluster service account".into(),
        })
    }

    /// The cluster and user of `context` (default: the current context) in the kubeconfig at
    /// `path`; relative file names in it are relative to its directory.
    pub fn from_kubeconfig(path: &Path, context: Option<&str>) -> Result<Endpoint, KubeError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| KubeError::Config(format!("cannot read {}: {e}", path.display())))?;
        let file: Kubeconfig = serde_norway::from_str(&text)
            .map_err(|e| KubeError::Config(format!("{}: {e}", path.display())))?;
        let base = path.parent().unwrap_or(Path::new("."));
        file.resolve(context, base, &path.display().to_string())
    }
}

fn read(path: &Path) -> Result<Vec<u8>, KubeError> {
    std::fs::read(path)
        .map_err(|e| KubeError::Config(format!("cannot read {}: {e}", path.display())))
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "kebab-case")]
struct Kubeconfig {
    clusters: Vec<Named<Cluster>>,
    users: Vec<Named<User>>,
    contexts: Vec<Named<Context>>,
    current_context: Option<String>,
}

#[derive(Debug, Deserialize)]
struct Named<T> {
    name: String,
    #[serde(alias = "cluster", alias = "user", alias = "context")]
    value: Option<T>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "kebab-case")]
struct Cluster {
    server: String,
    certificate_authority: Option<PathBuf>,
    certificate_authority_data: Option<String>,
    insecure_skip_tls_verify: bool,
    tls_server_name: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "kebab-case")]
struct User {
    token: Option<String>,
    #[serde(rename = "tokenFile")]
    token_file: Option<PathBuf>,
    client_certificate: Option<PathBuf>,
    client_certificate_data: Option<String>,
    client_key: Option<PathBuf>,
    client_key_data: Option<String>,
    exec: Option<serde_norway::Value>,
    auth_provider: Option<serde_norway::Value>,
    username: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Context {
    cluster: String,
    user: String,
    namespace: Option<String>,
}

/// A file given inline (base64 `-data`) or by path (relative to the kubeconfig).
fn file_or_data(
    data: &Option<String>,
    path: &Option<PathBuf>,
    base: &Path,
    what: &str,
) -> Result<Option<Vec<u8>>, KubeError> {
    if let Some(d) = data {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(d.trim())
            .map_err(|e| KubeError::Config(format!("{what}-data is not base64: {e}")))?;
        return Ok(Some(bytes));
    }
    path.as_ref().map(|p| read(&base.join(p))).transpose()
}

impl Kubeconfig {
    fn resolve(
        self,
        context: Option<&str>,
        base: &Path,
        shown: &str,
    ) -> Result<Endpoint, KubeError> {
        let err = |m: String| KubeError::Config(format!("{shown}: {m}"));
        let wanted = context
            .map(str::to_string)
            .or(self.current_context.clone())
            .ok_or_else(|| err("no context given and no current-context".into()))?;
        let find = |kind: &str, name: &str, names: Vec<&str>| {
            err(format!(
                "{kind} {name:?} not found (have: {})",
                names.join(", ")
            ))
        };
        let ctx = self
            .contexts
            .iter()
            .find(|c| c.name == wanted)
            .and_then(|c| c.value.as_ref())
            .ok_or_else(|| {
                find(
                    "context",
                    &wanted,
                    self.contexts.iter().map(|c| c.name.as_str()).collect(),
                )
            })?;
        let clusters: BTreeMap<&str, &Option<Cluster>> = self
            .clusters
            .iter()
            .map(|c| (c.name.as_str(), &c.value))
            .collect();
        let cluster = clusters
            .get(ctx.cluster.as_str())
            .and_then(|c| c.as_ref())
            .ok_or_else(|| find("cluster", &ctx.cluster, clusters.keys().copied().collect()))?;
        let default_user = User::default();
        let user = match self.users.iter().find(|u| u.name == ctx.user) {
            Some(u) => u.value.as_ref().unwrap_or(&default_user),
            None if ctx.user.is_empty() => &default_user,
            None => {
                return Err(find(
                    "user",
                    &ctx.user,
                    self.users.iter().map(|u| u.name.as_str()).collect(),
                ))
            }
        };
        if cluster.insecure_skip_tls_verify {
            return Err(err(format!(
                "cluster {:?}: insecure-skip-tls-verify is not supported; give its CA \
                 (certificate-authority or certificate-authority-data)",
                ctx.cluster
            )));
        }
        for (set, what) in [
            (user.exec.is_some(), "exec credential plugins"),
            (user.auth_provider.is_some(), "auth providers"),
            (user.username.is_some(), "basic auth"),
        ] {
            if set {
                return Err(err(format!(
                    "user {:?}: {what} are not supported; use a token, a tokenFile or a client \
                     certificate (e.g. a service account's token)",
                    ctx.user
                )));
            }
        }
        let server = cluster.server.trim_end_matches('/').to_string();
        if !(server.starts_with("https://") || server.starts_with("http://")) {
            return Err(err(format!(
                "cluster {:?}: server {server:?} is not an http(s) URL",
                ctx.cluster
            )));
        }
        let ca_pem = file_or_data(
            &cluster.certificate_authority_data,
            &cluster.certificate_authority,
            base,
            "certificate-authority",
        )?;
        if server.starts_with("https://") && ca_pem.is_none() {
            return Err(err(format!(
                "cluster {:?}: an https server needs its CA (certificate-authority or -data)",
                ctx.cluster
            )));
        }
        let cert = file_or_data(
            &user.client_certificate_data,
            &user.client_certificate,
            base,
            "client-certificate",
        )?;
        let key = file_or_data(&user.client_key_data, &user.client_key, base, "client-key")?;
        let client_identity = match (cert, key) {
            (Some(c), Some(k)) => Some((c, k)),
            (None, None) => None,
            _ => {
                return Err(err(format!(
                    "user {:?}: a client certificate needs its key and vice versa",
                    ctx.user
                )))
            }
        };
        let auth = match (&user.token, &user.token_file) {
            (Some(t), _) => Auth::Token(t.trim().to_string()),
            (None, Some(f)) => Auth::TokenFile(base.join(f)),
            (None, None) => Auth::None,
        };
        Ok(Endpoint {
            server,
            ca_pem,
            tls_server_name: cluster.tls_server_name.clone(),
            client_identity,
            auth,
            namespace: ctx.namespace.clone().filter(|n| !n.is_empty()),
            origin: format!("{shown} (context {wanted})"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KUBECONFIG: &str = r#"
apiVersion: v1
kind: Config
current-context: dev
clusters:
- name: local
  cluster:
    server: http://127.0.0.1:6443/
- name: prod
  cluster:
    server: https://10.0.0.1:6443
    certificate-authority-data: LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCg==
users:
- name: dev
  user:
    token: abc
- name: robot
  user:
    tokenFile: token.txt
- name: sso
  user:
    exec:
      apiVersion: client.authentication.k8s.io/v1
      command: gke-gcloud-auth-plugin
contexts:
- name: dev
  context: {cluster: local, user: dev, namespace: llm}
- name: prod
  context: {cluster: prod, user: robot}
- name: sso
  context: {cluster: prod, user: sso}
"#;

    fn resolve(context: Option<&str>) -> Result<Endpoint, KubeError> {
        let file: Kubeconfig = serde_norway::from_str(KUBECONFIG).unwrap();
        file.resolve(context, Path::new("/etc/kube"), "kubeconfig")
    }

    #[test]
    fn contexts_pick_cluster_user_and_namespace() {
        let dev = resolve(None).unwrap();
        assert_eq!(dev.server, "http://127.0.0.1:6443");
        assert_eq!(dev.auth, Auth::Token("abc".into()));
        assert_eq!(dev.namespace.as_deref(), Some("llm"));
        assert_eq!(dev.ca_pem, None);
        let prod = resolve(Some("prod")).unwrap();
        assert_eq!(prod.auth, Auth::TokenFile("/etc/kube/token.txt".into()));
        assert_eq!(
            prod.ca_pem.as_deref(),
            Some(&b"-----BEGIN CERTIFICATE-----\n"[..])
        );
        assert_eq!(prod.namespace, None);
    }

    #[test]
    fn unsupported_credentials_and_missing_names_are_clear_errors() {
        let e = resolve(Some("sso")).unwrap_err().to_string();
        assert!(
            e.contains("exec credential plugins are not supported"),
            "{e}"
        );
        let e = resolve(Some("nope")).unwrap_err().to_string();
        assert!(
            e.contains("context \"nope\" not found (have: dev, prod, sso)"),
            "{e}"
        );
    }

    #[test]
    fn in_cluster_reads_the_service_account() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("ca.crt"), "CA").unwrap();
        std::fs::write(dir.path().join("token"), "t").unwrap();
        std::fs::write(dir.path().join("namespace"), "llm\n").unwrap();
        let ep = Endpoint::in_cluster("fd00::1", "443", dir.path()).unwrap();
        assert_eq!(ep.server, "https://[fd00::1]:443");
        assert_eq!(ep.namespace.as_deref(), Some("llm"));
        assert_eq!(ep.auth, Auth::TokenFile(dir.path().join("token")));
        std::fs::remove_file(dir.path().join("token")).unwrap();
        let e = Endpoint::in_cluster("10.0.0.1", "443", dir.path()).unwrap_err();
        assert!(
            e.to_string().contains("automountServiceAccountToken"),
            "{e}"
        );
    }
}
