//! Kubernetes discovery: a pool's endpoints are the pods an InferencePool selects (its
//! `selector` and `targetPorts`, followed as they change), or the pods a label selector
//! matches on a fixed port, watched through the API server (`pools[].kubernetes`).
//!
//! Each source lists and watches ([`reflector`]) the pods, and in InferencePool mode the pool
//! object too; every change republishes the pool's endpoint list (unchanged lists are not
//! republished). Ready pods serve; unready or terminating pods are published draining (no new
//! requests, in-flight ones finish on their guards, cache entries stay); deleted pods leave the
//! list. A changed pool selector or port list restarts the pod watch with a fresh list; a
//! deleted pool empties the list. The API server is reached in-cluster with the pod's service
//! account or through a kubeconfig ([`kubeconfig`]), with a small hand-written client
//! ([`client`]) rather than the `kube` crate (README, dependency notes).
//!
//! Failures never empty the pool: the last list stays published while lists and watches are
//! retried with backoff.

pub mod client;
pub mod kubeconfig;
pub mod objects;
pub mod reflector;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;

use super::{Discovery, EndpointSink};
use crate::config::{Config, KubernetesConfig, PoolConfig, ResolvedEndpoint};
use client::ApiClient;
use kubeconfig::Endpoint;
use objects::{InferencePool, Pod, Selection};
use reflector::{encode, Reflector};

/// The InferencePool API this source reads.
pub const INFERENCE_POOL_API: &str = "/apis/inference.networking.k8s.io/v1";

/// Wait before retrying a source whose API server could not be set up (bad kubeconfig).
const SETUP_RETRY: Duration = Duration::from_secs(5);

/// Why talking to the API server failed.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    /// The credentials or the kubeconfig are unusable.
    #[error("Kubernetes client setup: {0}")]
    Config(String),
    /// The connection failed or broke.
    #[error("Kubernetes API unreachable: {0}")]
    Transport(String),
    /// The API answered with an error status.
    #[error("Kubernetes API answered {code}: {message}")]
    Status {
        /// The HTTP status (or the `Status` object's code in a watch).
        code: u16,
        /// The API's message.
        message: String,
    },
    /// The API's answer could not be read.
    #[error("unexpected Kubernetes API answer: {0}")]
    Protocol(String),
}

/// One Kubernetes pool.
#[derive(Debug)]
pub struct KubernetesDiscovery {
    pool: PoolConfig,
    k8s: KubernetesConfig,
}

impl KubernetesDiscovery {
    /// The source for `pool`, if it has a `kubernetes` section.
    pub fn new(pool: &PoolConfig) -> Option<KubernetesDiscovery> {
        Some(KubernetesDiscovery {
            k8s: pool.kubernetes.clone()?,
            pool: pool.clone(),
        })
    }

    /// Every Kubernetes pool of `config`.
    pub fn from_config(config: &Config) -> Vec<Arc<dyn Discovery>> {
        config
            .pools
            .iter()
            .filter_map(KubernetesDiscovery::new)
            .map(|d| Arc::new(d) as Arc<dyn Discovery>)
            .collect()
    }

    /// The source key of the pool named `pool`.
    pub fn key_of(pool: &str) -> String {
        format!("kubernetes:{pool}")
    }

    fn client(&self) -> Result<(ApiClient, String), KubeError> {
        let endpoint =
            Endpoint::discover(self.k8s.kubeconfig.as_deref(), self.k8s.context.as_deref())?;
        let client = ApiClient::new(endpoint)?;
        let namespace = self
            .k8s
            .namespace
            .clone()
            .or_else(|| client.default_namespace().map(str::to_string))
            .unwrap_or_else(|| "default".to_string());
        Ok((client, namespace))
    }

    /// Publishes the endpoints of `pods` when they differ from the last list published.
    fn publish(
        &self,
        sink: &dyn EndpointSink,
        last: &mut Option<Vec<ResolvedEndpoint>>,
        endpoints: Vec<ResolvedEndpoint>,
        why: &str,
    ) {
        if last.as_ref() == Some(&endpoints) {
            return;
        }
        let serving = endpoints.iter().filter(|e| !e.drain).count();
        let change = sink.publish(&self.key(), endpoints.clone());
        tracing::info!(
            source = %self.key(),
            endpoints = endpoints.len(),
            serving,
            added = ?change.added,
            removed = ?change.removed,
            "Kubernetes discovery updated the pool ({why})"
        );
        *last = Some(endpoints);
    }

    /// Follows the pods of `selection` until dropped.
    async fn follow_pods(
        &self,
        client: &ApiClient,
        namespace: &str,
        selection: &Selection,
        sink: &dyn EndpointSink,
        last: &mut Option<Vec<ResolvedEndpoint>>,
    ) {
        let pods = Reflector::new(
            client.clone(),
            format!("/api/v1/namespaces/{namespace}/pods"),
            format!("labelSelector={}", encode(&selection.label_selector)),
        );
        pods.run(|pods: &BTreeMap<String, Pod>| {
            let eps = objects::endpoints(pods, &selection.ports, &self.pool);
            self.publish(sink, last, eps, "pods changed");
        })
        .await;
    }

    /// Follows the InferencePool `name` and, while it exists, the pods it selects.
    async fn follow_pool(
        &self,
        client: &ApiClient,
        namespace: &str,
        name: &str,
        sink: &dyn EndpointSink,
    ) {
        // None: not listed yet; Some(None): absent; Some(Some(spec)): present.
        let (tx, mut rx) =
            tokio::sync::watch::channel::<Option<Option<Result<Selection, String>>>>(None);
        let pools = Reflector::new(
            client.clone(),
            format!("{INFERENCE_POOL_API}/namespaces/{namespace}/inferencepools"),
            format!("fieldSelector={}", encode(&format!("metadata.name={name}"))),
        );
        let watch_pool = pools.run(|pools: &BTreeMap<String, InferencePool>| {
            let now = Some(pools.get(name).map(|p| p.spec.selection()));
            tx.send_if_modified(|seen| {
                let changed = *seen != now;
                *seen = now.clone();
                changed
            });
        });
        let follow = async {
            let mut last: Option<Vec<ResolvedEndpoint>> = None;
            loop {
                if rx.wait_for(Option::is_some).await.is_err() {
                    return;
                }
                let state = rx.borrow_and_update().clone().flatten();
                match state {
                    Some(Ok(selection)) => {
                        tracing::info!(source = %self.key(), pool = name, selector = %selection.label_selector, ports = ?selection.ports, "following the InferencePool's pods");
                        tokio::select! {
                            _ = self.follow_pods(client, namespace, &selection, sink, &mut last) => {}
                            _ = rx.changed() => {}
                        }
                    }
                    Some(Err(why)) => {
                        tracing::error!(source = %self.key(), pool = name, "the InferencePool selects nothing usable ({why}); its endpoints are withdrawn");
                        if last.is_some() {
                            self.publish(sink, &mut last, Vec::new(), "pool unusable");
                        }
                        let _ = rx.changed().await;
                    }
                    None => {
                        tracing::error!(source = %self.key(), pool = name, %namespace, "InferencePool not found; its endpoints are withdrawn");
                        if last.is_some() {
                            self.publish(sink, &mut last, Vec::new(), "pool deleted");
                        }
                        let _ = rx.changed().await;
                    }
                }
            }
        };
        tokio::select! {
            _ = watch_pool => {}
            _ = follow => {}
        }
    }
}

impl Discovery for KubernetesDiscovery {
    fn key(&self) -> String {
        KubernetesDiscovery::key_of(&self.pool.name)
    }

    fn run(self: Arc<Self>, sink: Arc<dyn EndpointSink>) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            let (client, namespace) = loop {
                match self.client() {
                    Ok(c) => break c,
                    Err(e) => {
                        tracing::error!(source = %self.key(), "{e}; retrying in {SETUP_RETRY:?}");
                        tokio::time::sleep(SETUP_RETRY).await;
                    }
                }
            };
            tracing::info!(source = %self.key(), api = client.origin(), %namespace, "watching Kubernetes");
            match (
                &self.k8s.inference_pool,
                &self.k8s.label_selector,
                self.k8s.port,
            ) {
                (Some(pool), _, _) => {
                    self.follow_pool(&client, &namespace, pool, sink.as_ref())
                        .await
                }
                (None, Some(selector), Some(port)) => {
                    let selection = Selection {
                        label_selector: selector.clone(),
                        ports: vec![port],
                    };
                    let mut last = None;
                    self.follow_pods(&client, &namespace, &selection, sink.as_ref(), &mut last)
                        .await
                }
                // Rejected by validation; idle rather than spin.
                _ => std::future::pending::<()>().await,
            }
        })
    }
}
