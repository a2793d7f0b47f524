//! The parts of the API objects the source reads (`v1` Pod, `inference.networking.k8s.io/v1`
//! InferencePool), and the rule turning pods into endpoints.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use serde::Deserialize;

use super::reflector::Object;
use crate::config::{PoolConfig, ResolvedEndpoint};

/// A pod annotation narrowing which of the pool's target ports a pod serves (a comma-separated
/// list), as the reference endpoint picker reads it.
pub const ACTIVE_PORTS_ANNOTATION: &str = "inference.networking.k8s.io/active-ports";

/// Object metadata.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct Meta {
    /// `metadata.name`.
    pub name: String,
    /// `metadata.annotations`.
    pub annotations: BTreeMap<String, String>,
    /// `metadata.labels`: become the endpoint's labels (over its pool's).
    pub labels: BTreeMap<String, String>,
    /// Set once the pod is terminating.
    pub deletion_timestamp: Option<String>,
}

/// A pod, as far as routing cares.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct Pod {
    /// Its metadata.
    pub metadata: Meta,
    /// Its status.
    pub status: PodStatus,
}

/// `status` of a pod.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct PodStatus {
    /// `Pending`, `Running`, `Succeeded`, `Failed`, `Unknown`.
    pub phase: String,
    /// The primary pod IP, once assigned.
    #[serde(rename = "podIP")]
    pub pod_ip: Option<String>,
    /// Conditions; `Ready` decides whether the pod takes new requests.
    pub conditions: Vec<Condition>,
}

/// One pod condition.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct Condition {
    /// e.g. `Ready`.
    #[serde(rename = "type")]
    pub kind: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
}

impl Object for Pod {
    fn name(&self) -> &str {
        &self.metadata.name
    }
}

/// Where a pod stands for routing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodRole {
    /// Ready and not terminating: takes new requests.
    Serving,
    /// Has an IP but is unready or terminating: no new requests; in-flight ones finish and its
    /// cache entries stay (a readiness blip does not cost its cache).
    Draining,
}

impl Pod {
    /// Its IP and role, or `None` while it has no IP or once it has finished.
    pub fn role(&self) -> Option<(IpAddr, PodRole)> {
        if matches!(self.status.phase.as_str(), "Succeeded" | "Failed") {
            return None;
        }
        let ip: IpAddr = self.status.pod_ip.as_deref()?.parse().ok()?;
        let ready = self
            .status
            .conditions
            .iter()
            .any(|c| c.kind == "Ready" && c.status == "True");
        let role = if ready && self.metadata.deletion_timestamp.is_none() {
            PodRole::Serving
        } else {
            PodRole::Draining
        };
        Some((ip, role))
    }

    /// The target ports this pod serves: all of `ports`, or those its active-ports annotation
    /// lists.
    pub fn active_ports(&self, ports: &[u16]) -> Vec<u16> {
        match self.metadata.annotations.get(ACTIVE_PORTS_ANNOTATION) {
            None => ports.to_vec(),
            Some(list) => {
                let listed: Vec<u16> = list
                    .split(',')
                    .filter_map(|p| p.trim().parse().ok())
                    .collect();
                ports
                    .iter()
                    .copied()
                    .filter(|p| listed.contains(p))
                    .collect()
            }
        }
    }
}

/// An InferencePool (`inference.networking.k8s.io/v1`), as far as endpoint discovery cares.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct InferencePool {
    /// Its metadata.
    pub metadata: Meta,
    /// Its spec.
    pub spec: PoolSpec,
}

impl Object for InferencePool {
    fn name(&self) -> &str {
        &self.metadata.name
    }
}

/// What the pool selects. `endpointPickerRef` and `appProtocol` concern the gateway only.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct PoolSpec {
    /// The pods' labels (v1 allows `matchLabels` only).
    pub selector: Selector,
    /// The ports each selected pod serves on (one endpoint per pod and port; several ports are
    /// data-parallel ranks of one pod).
    pub target_ports: Vec<PortNumber>,
}

/// `spec.selector`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct Selector {
    /// Labels a pod must all carry.
    pub match_labels: BTreeMap<String, String>,
}

/// `spec.targetPorts[]`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct PortNumber {
    /// The port.
    pub number: u16,
}

/// The pods to watch and the ports they serve on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    /// The label selector, in the API's syntax (`app=qwen3-8b`).
    pub label_selector: String,
    /// The serving ports.
    pub ports: Vec<u16>,
}

impl PoolSpec {
    /// The pods and ports this pool selects; an error for a pool that selects every pod or no
    /// port (the CRD forbids both, but an object may predate validation).
    pub fn selection(&self) -> Result<Selection, String> {
        if self.selector.match_labels.is_empty() {
            return Err("spec.selector.matchLabels is empty".into());
        }
        let ports: Vec<u16> = self
            .target_ports
            .iter()
            .map(|p| p.number)
            .filter(|&p| p != 0)
            .collect();
        if ports.is_empty() {
            return Err("spec.targetPorts lists no port".into());
        }
        let label_selector = self
            .selector
            .match_labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",");
        Ok(Selection {
            label_selector,
            ports,
        })
    }
}

/// The endpoints of `pods` on `ports` with `pool`'s settings, sorted by address: one per pod
/// and active port, draining unless the pod is serving. An address claimed twice (host-network
/// pods) is kept once, serving if any claim is.
pub fn endpoints(
    pods: &BTreeMap<String, Pod>,
    ports: &[u16],
    pool: &PoolConfig,
) -> Vec<ResolvedEndpoint> {
    // Per address: draining, and the labels of the first pod (by name) claiming it.
    let mut by_address: BTreeMap<SocketAddr, (bool, &BTreeMap<String, String>)> = BTreeMap::new();
    for pod in pods.values() {
        let Some((ip, role)) = pod.role() else {
            continue;
        };
        for port in pod.active_ports(ports) {
            let (draining, _) = by_address
                .entry(SocketAddr::new(ip, port))
                .or_insert((true, &pod.metadata.labels));
            *draining &= role == PodRole::Draining;
        }
    }
    by_address
        .into_iter()
        .map(|(address, (draining, labels))| {
            let mut ep = ResolvedEndpoint::of_pool(address, pool);
            ep.drain = draining;
            ep.labels = crate::config::merged_labels(&pool.labels, labels);
            ep
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, ip: Option<&str>, ready: bool) -> Pod {
        Pod {
            metadata: Meta {
                name: name.into(),
                ..Meta::default()
            },
            status: PodStatus {
                phase: "Running".into(),
                pod_ip: ip.map(str::to_string),
                conditions: vec![Condition {
                    kind: "Ready".into(),
                    status: if ready { "True" } else { "False" }.into(),
                }],
            },
        }
    }

    #[test]
    fn pods_become_serving_draining_or_nothing() {
        let pool = PoolConfig {
            name: "p".into(),
            models: vec!["m".into()],
            ..PoolConfig::default()
        };
        let mut terminating = pod("c", Some("10.0.0.3"), true);
        terminating.metadata.deletion_timestamp = Some("2026-01-01T00:00:00Z".into());
        let mut finished = pod("d", Some("10.0.0.4"), false);
        finished.status.phase = "Succeeded".into();
        let mut one_rank = pod("e", Some("10.0.0.5"), true);
        one_rank
            .metadata
            .annotations
            .insert(ACTIVE_PORTS_ANNOTATION.into(), "8001, 9".into());
        let pods: BTreeMap<String, Pod> = [
            pod("a", Some("10.0.0.1"), true),
            pod("b", Some("10.0.0.2"), false),
            terminating,
            finished,
            one_rank,
            pod("f", None, false),
        ]
        .into_iter()
        .map(|p| (p.metadata.name.clone(), p))
        .collect();
        let eps = endpoints(&pods, &[8000, 8001], &pool);
        let got: Vec<(String, bool)> = eps
            .iter()
            .map(|e| (e.address.to_string(), e.drain))
            .collect();
        let want = [
            ("10.0.0.1:8000", false),
            ("10.0.0.1:8001", false),
            ("10.0.0.2:8000", true),
            ("10.0.0.2:8001", true),
            ("10.0.0.3:8000", true),
            ("10.0.0.3:8001", true),
            ("10.0.0.5:8001", false),
        ];
        assert_eq!(got.len(), want.len(), "{got:?}");
        for ((addr, drain), (want_addr, want_drain)) in got.iter().zip(want) {
            assert_eq!((addr.as_str(), *drain), (want_addr, want_drain));
        }
        assert!(eps.iter().all(|e| e.models == ["m"] && e.pool == "p"));
    }

    #[test]
    fn pod_labels_become_endpoint_labels_over_the_pools() {
        let pool = PoolConfig {
            name: "p".into(),
            models: vec!["m".into()],
            labels: [("hardware", "h100"), ("revision", "a")]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..PoolConfig::default()
        };
        // As the API server sends a pod: labels under metadata.
        let labelled: Pod = serde_json::from_str(
            r#"{"metadata":{"name":"a","labels":{"revision":"b","app":"vllm"}},
                "status":{"phase":"Running","podIP":"10.0.0.1",
                          "conditions":[{"type":"Ready","status":"True"}]}}"#,
        )
        .unwrap();
        let pods: BTreeMap<String, Pod> = [labelled, pod("b", Some("10.0.0.2"), true)]
            .into_iter()
            .map(|p| (p.metadata.name.clone(), p))
            .collect();
        let eps = endpoints(&pods, &[8000], &pool);
        let labels = |i: usize| -> Vec<(&str, &str)> {
            eps[i]
                .labels
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect()
        };
        assert_eq!(
            labels(0),
            [("app", "vllm"), ("hardware", "h100"), ("revision", "b")]
        );
        assert_eq!(labels(1), [("hardware", "h100"), ("revision", "a")]);
    }

    #[test]
    fn a_pool_spec_becomes_a_selection() {
        let spec: PoolSpec = serde_json::from_str(
            r#"{"selector":{"matchLabels":{"tier":"gpu","app":"qwen3-8b"}},"targetPorts":[{"number":8000}],"endpointPickerRef":{"name":"x"}}"#,
        )
        .unwrap();
        assert_eq!(
            spec.selection().unwrap(),
            Selection {
                label_selector: "app=qwen3-8b,tier=gpu".into(),
                ports: vec![8000]
            }
        );
        assert!(PoolSpec::default().selection().is_err());
    }
}
