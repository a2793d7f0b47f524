//! A small API-server client: GET a JSON document, or GET a watch and read its events line by
//! line as they arrive. HTTP/1.1 over rustls (ring) with the cluster's CA, or plaintext for an
//! `http://` server; a bearer token re-read per request when it comes from a file.

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Empty};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use super::kubeconfig::{Auth, Endpoint};
use super::KubeError;

/// Longest a plain GET (a list page, the pool) may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest a TCP connect may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest one watch line may be: a pod object is a few KiB; a runaway line is an error.
const MAX_LINE_BYTES: usize = 16 << 20;

/// A client for one API server.
#[derive(Clone)]
pub struct ApiClient {
    endpoint: Arc<Endpoint>,
    http: Client<HttpsConnector<HttpConnector>, Empty<Bytes>>,
}

impl std::fmt::Debug for ApiClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiClient")
            .field("server", &self.endpoint.server)
            .finish()
    }
}

/// An open watch: its body, read line by line.
pub struct LineStream {
    body: hyper::body::Incoming,
    buf: BytesMut,
}

impl LineStream {
    /// The next complete line (without its `\n`); `None` when the server ended the stream.
    pub async fn next_line(&mut self) -> Result<Option<Bytes>, KubeError> {
        loop {
            if let Some(i) = self.buf.iter().position(|&b| b == b'\n') {
                let line = self.buf.split_to(i + 1).freeze();
                return Ok(Some(line.slice(..i)));
            }
            if self.buf.len() > MAX_LINE_BYTES {
                return Err(KubeError::Protocol(format!(
                    "a watch line exceeds {MAX_LINE_BYTES} bytes"
                )));
            }
            match self.body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
                Some(Err(e)) => return Err(KubeError::Transport(e.to_string())),
                None if self.buf.iter().all(u8::is_ascii_whitespace) => return Ok(None),
                // A last line without its newline.
                None => return Ok(Some(std::mem::take(&mut self.buf).freeze())),
            }
        }
    }
}

impl ApiClient {
    /// A client for `endpoint` (its CA and client certificate loaded now).
    pub fn new(endpoint: Endpoint) -> Result<ApiClient, KubeError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        if let Some(pem) = &endpoint.ca_pem {
            let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(pem)
                .collect::<Result<_, _>>()
                .map_err(|e| {
                    KubeError::Config(format!("{}: the CA is not PEM: {e}", endpoint.origin))
                })?;
            let (added, _) = roots.add_parsable_certificates(certs);
            if added == 0 {
                return Err(KubeError::Config(format!(
                    "{}: no usable certificate in the CA",
                    endpoint.origin
                )));
            }
        }
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| KubeError::Config(e.to_string()))?
            .with_root_certificates(roots);
        let tls = match &endpoint.client_identity {
            Some((cert, key)) => {
                let chain = CertificateDer::pem_slice_iter(cert)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| {
                        KubeError::Config(format!("{}: client certificate: {e}", endpoint.origin))
                    })?;
                let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| {
                    KubeError::Config(format!("{}: client key: {e}", endpoint.origin))
                })?;
                builder.with_client_auth_cert(chain, key).map_err(|e| {
                    KubeError::Config(format!("{}: client certificate: {e}", endpoint.origin))
                })?
            }
            None => builder.with_no_client_auth(),
        };
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(CONNECT_TIMEOUT));
        http.set_nodelay(true);
        // A watch is idle between events: without keepalive a peer gone without a reset (its
        // node dead, a stale conntrack entry) is noticed only when the watch's own timer runs
        // out (~5 min). Probes after 30 s idle, every 10 s, 3 missed: about a minute.
        http.set_keepalive(Some(Duration::from_secs(30)));
        http.set_keepalive_interval(Some(Duration::from_secs(10)));
        http.set_keepalive_retries(Some(3));
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http();
        let connector = match &endpoint.tls_server_name {
            Some(name) => {
                let name = rustls::pki_types::ServerName::try_from(name.clone()).map_err(|e| {
                    KubeError::Config(format!(
                        "{}: tls-server-name {name:?}: {e}",
                        endpoint.origin
                    ))
                })?;
                connector
                    .with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(name))
            }
            None => connector,
        };
        let connector = connector.enable_http1().wrap_connector(http);
        Ok(ApiClient {
            endpoint: Arc::new(endpoint),
            http: Client::builder(TokioExecutor::new()).build(connector),
        })
    }

    /// The namespace the credentials default to, if any.
    pub fn default_namespace(&self) -> Option<&str> {
        self.endpoint.namespace.as_deref()
    }

    /// Where the endpoint came from, for messages.
    pub fn origin(&self) -> &str {
        &self.endpoint.origin
    }

    async fn send(
        &self,
        path_and_query: &str,
    ) -> Result<hyper::Response<hyper::body::Incoming>, KubeError> {
        let uri = format!("{}{path_and_query}", self.endpoint.server);
        let mut req = hyper::Request::get(&uri).header("accept", "application/json");
        let token = match &self.endpoint.auth {
            Auth::None => None,
            Auth::Token(t) => Some(t.clone()),
            Auth::TokenFile(path) => Some(
                std::fs::read_to_string(path)
                    .map_err(|e| {
                        KubeError::Config(format!("cannot read the token {}: {e}", path.display()))
                    })?
                    .trim()
                    .to_string(),
            ),
        };
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let req = req
            .body(Empty::new())
            .map_err(|e| KubeError::Config(format!("{uri}: {e}")))?;
        self.http
            .request(req)
            .await
            .map_err(|e| KubeError::Transport(format!("{}: {e:?}", self.endpoint.server)))
    }

    /// GETs `path_and_query` and returns the body of a 2xx answer; any other status is a
    /// [`KubeError::Status`] with the API's message.
    pub async fn get(&self, path_and_query: &str) -> Result<Bytes, KubeError> {
        tokio::time::timeout(REQUEST_TIMEOUT, async {
            let resp = self.send(path_and_query).await?;
            let status = resp.status();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| KubeError::Transport(e.to_string()))?
                .to_bytes();
            if status.is_success() {
                Ok(body)
            } else {
                Err(status_error(status.as_u16(), &body))
            }
        })
        .await
        .map_err(|_| {
            KubeError::Transport(format!(
                "GET {path_and_query}: no answer in {REQUEST_TIMEOUT:?}"
            ))
        })?
    }

    /// Opens a watch at `path_and_query`: its events are read with [`LineStream::next_line`].
    pub async fn watch(&self, path_and_query: &str) -> Result<LineStream, KubeError> {
        let resp = tokio::time::timeout(REQUEST_TIMEOUT, self.send(path_and_query))
            .await
            .map_err(|_| {
                KubeError::Transport(format!(
                    "watch {path_and_query}: no answer in {REQUEST_TIMEOUT:?}"
                ))
            })??;
        let status = resp.status();
        if !status.is_success() {
            let body = resp
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            return Err(status_error(status.as_u16(), &body));
        }
        Ok(LineStream {
            body: resp.into_body(),
            buf: BytesMut::new(),
        })
    }
}

/// A non-2xx answer: its code and the `metav1.Status` message when the body is one.
fn status_error(code: u16, body: &[u8]) -> KubeError {
    let message = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned());
    KubeError::Status { code, message }
}
