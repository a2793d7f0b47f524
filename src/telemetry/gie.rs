//! The same facts under the Gateway API Inference Extension's metric names (its endpoint
//! picker's `inference_objective_*`, `inference_pool_*` and `inference_extension_*`, with its
//! label names), so dashboards and alerts written for that picker work on kvrouter unchanged.
//!
//! Only names whose meaning matches are exported:
//!
//! | GIE metric | labels | here |
//! | --- | --- | --- |
//! | `inference_objective_request_total` | `model_name`, `target_model_name` | requests the router decided on (routed or rejected by routing) |
//! | `inference_objective_request_error_total` | + `error_code` | routing rejections: `BadRequest` (unknown model, tenant not allowed on any pool), `ServiceUnavailable` (no endpoint, none with the objective's labels) |
//! | `inference_objective_input_tokens` | `model_name`, `target_model_name` | prompt tokens of routed requests (the tokenizer's count, else the estimate) |
//! | `inference_extension_scheduler_e2e_duration_seconds` | | time to decide (parsed request to committed pick) |
//! | `inference_extension_scheduler_attempts_total` | `status` | `success` or `failure` per decision |
//! | `inference_pool_average_kv_cache_utilization` | `name` | mean scraped KV-cache usage (0..1) of the pool's endpoints |
//! | `inference_pool_average_queue_size` | `name` | mean scraped engine queue (waiting requests) |
//! | `inference_pool_per_pod_queue_size` | `name`, `model_server_pod` | each endpoint's engine queue (`model_server_pod` is its `ip:port`) |
//! | `inference_pool_ready_pods` | `name` | endpoints that may be picked now (healthy, not draining) |
//!
//! `name` is the kvrouter pool. kvrouter does not rewrite models, so `target_model_name` is the
//! requested model. Response-side metrics (`request_duration_seconds`, `output_tokens`...) are
//! not exported: the router sees responses only when Envoy's observer filter is on.
//!
//! Per-model handles are looked up by name under a read lock and created once per model, so
//! the request path does not allocate label sets.

use std::collections::HashMap;
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::config::{Config, HealthConfig};
use crate::discovery::EndpointSet;

/// `model_name`, `target_model_name`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLabels {
    model_name: String,
    target_model_name: String,
}

/// `model_name`, `target_model_name`, `error_code`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    model_name: String,
    target_model_name: String,
    error_code: String,
}

/// `status`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabels {
    status: String,
}

/// `name` (the pool).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabels {
    name: String,
}

/// `name`, `model_server_pod`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PodLabels {
    name: String,
    model_server_pod: String,
}

type FloatGauge = Gauge<f64, std::sync::atomic::AtomicU64>;

/// One model's handles, created on its first request.
#[derive(Debug, Clone)]
struct ModelHandles {
    requests: Counter,
    input_tokens: Histogram,
}

/// How a decision ended, as the GIE metrics count it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GieOutcome {
    /// Routed with this many prompt tokens.
    Routed {
        /// Prompt tokens (exact or estimated).
        prompt_tokens: u64,
    },
    /// Rejected by routing with this GIE error code (`BadRequest`, `ServiceUnavailable`).
    Rejected {
        /// The error code label.
        error_code: &'static str,
    },
}

/// The GIE-named metrics (no `kvrouter_` prefix).
#[derive(Debug)]
pub struct GieMetrics {
    registry: Registry,
    requests: Family<ModelLabels, Counter>,
    errors: Family<ErrorLabels, Counter>,
    input_tokens: Family<ModelLabels, Histogram>,
    scheduler_seconds: Histogram,
    attempts_ok: Counter,
    attempts_failed: Counter,
    pool_kv: Family<PoolLabels, FloatGauge>,
    pool_queue: Family<PoolLabels, FloatGauge>,
    pod_queue: Family<PodLabels, Gauge>,
    ready_pods: Family<PoolLabels, Gauge>,
    by_model: RwLock<HashMap<Box<str>, ModelHandles>>,
    health: Mutex<HealthConfig>,
}

impl Default for GieMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl GieMetrics {
    /// Registers every GIE-named metric in a registry of its own.
    pub fn new() -> GieMetrics {
        let mut registry = Registry::default();
        let requests = Family::<ModelLabels, Counter>::default();
        let errors = Family::<ErrorLabels, Counter>::default();
        let input_tokens = Family::<ModelLabels, Histogram>::new_with_constructor(|| {
            // GIE's buckets for input tokens.
            Histogram::new([
                1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0,
                16384.0, 32778.0, 65536.0, 131072.0, 262144.0, 524288.0, 1048576.0,
            ])
        });
        {
            let objective = registry.sub_registry_with_prefix("inference_objective");
            objective.register(
                "request",
                "Counter of inference objective requests broken out for each model and target model",
                requests.clone(),
            );
            objective.register(
                "request_error",
                "Counter of inference objective requests errors broken out for each model and target model",
                errors.clone(),
            );
            objective.register(
                "input_tokens",
                "Inference objective input token count distribution for requests in each model",
                input_tokens.clone(),
            );
        }
        // GIE's buckets for the scheduler's latency: 100 us .. 100 ms.
        let scheduler_seconds = Histogram::new([
            0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1,
        ]);
        let attempts = Family::<StatusLabels, Counter>::default();
        {
            let extension = registry.sub_registry_with_prefix("inference_extension");
            extension.register(
                "scheduler_e2e_duration_seconds",
                "End-to-end scheduling latency distribution in seconds",
                scheduler_seconds.clone(),
            );
            extension.register(
                "scheduler_attempts",
                "Total number of scheduling attempts",
                attempts.clone(),
            );
        }
        let status = |s: &str| {
            attempts
                .get_or_create(&StatusLabels { status: s.into() })
                .clone()
        };
        let (attempts_ok, attempts_failed) = (status("success"), status("failure"));
        let pool_kv = Family::<PoolLabels, FloatGauge>::default();
        let pool_queue = Family::<PoolLabels, FloatGauge>::default();
        let pod_queue = Family::<PodLabels, Gauge>::default();
        let ready_pods = Family::<PoolLabels, Gauge>::default();
        {
            let pool = registry.sub_registry_with_prefix("inference_pool");
            pool.register(
                "average_kv_cache_utilization",
                "The average kv cache utilization for an inference server pool",
                pool_kv.clone(),
            );
            pool.register(
                "average_queue_size",
                "The average number of requests pending in the model server queue",
                pool_queue.clone(),
            );
            pool.register(
                "per_pod_queue_size",
                "The total number of requests pending in the model server queue for each underlying pod",
                pod_queue.clone(),
            );
            pool.register(
                "ready_pods",
                "The number of ready pods in the inference server pool",
                ready_pods.clone(),
            );
        }
        GieMetrics {
            registry,
            requests,
            errors,
            input_tokens,
            scheduler_seconds,
            attempts_ok,
            attempts_failed,
            pool_kv,
            pool_queue,
            pod_queue,
            ready_pods,
            by_model: RwLock::new(HashMap::new()),
            health: Mutex::new(HealthConfig::default()),
        }
    }

    /// Keeps the health settings `ready_pods` is judged by.
    pub fn configure(&self, config: &Config) {
        *self.health.lock() = config.health.clone();
    }

    fn model(&self, model: &str) -> ModelHandles {
        if let Some(h) = self.by_model.read().get(model) {
            return h.clone();
        }
        let labels = ModelLabels {
            model_name: model.to_string(),
            target_model_name: model.to_string(),
        };
        let handles = ModelHandles {
            requests: self.requests.get_or_create(&labels).clone(),
            input_tokens: self.input_tokens.get_or_create(&labels).clone(),
        };
        self.by_model
            .write()
            .entry(model.into())
            .or_insert(handles)
            .clone()
    }

    /// Counts one decision on `model` that took `took`.
    pub fn record(&self, model: &str, took: Duration, outcome: GieOutcome) {
        self.scheduler_seconds.observe(took.as_secs_f64());
        let handles = self.model(model);
        handles.requests.inc();
        match outcome {
            GieOutcome::Routed { prompt_tokens } => {
                self.attempts_ok.inc();
                handles.input_tokens.observe(prompt_tokens as f64);
            }
            GieOutcome::Rejected { error_code } => {
                self.attempts_failed.inc();
                // Rare: the label set is built each time.
                self.errors
                    .get_or_create(&ErrorLabels {
                        model_name: model.to_string(),
                        target_model_name: model.to_string(),
                        error_code: error_code.to_string(),
                    })
                    .inc();
            }
        }
    }

    /// Recomputes the pool gauges from `endpoints` and appends every GIE-named metric to
    /// `out` in the Prometheus text format.
    pub fn render(&self, endpoints: &EndpointSet, out: &mut String) {
        self.refresh(endpoints);
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::prometheus_text::encode(out, &self.registry);
    }

    fn refresh(&self, endpoints: &EndpointSet) {
        let health = self.health.lock().clone();
        let now = tokio::time::Instant::now();
        self.pool_kv.clear();
        self.pool_queue.clear();
        self.pod_queue.clear();
        self.ready_pods.clear();
        // Per pool: (kv usage sum, queue sum, scraped endpoints, ready endpoints).
        let mut pools: HashMap<&str, (f64, f64, u32, i64)> = HashMap::new();
        for ep in endpoints.all() {
            let pool = pools.entry(ep.pool.as_ref()).or_default();
            if let Some(s) = ep.load.engine.last() {
                pool.0 += s.kv_cache_usage;
                pool.1 += s.waiting_requests as f64;
                pool.2 += 1;
                self.pod_queue
                    .get_or_create(&PodLabels {
                        name: ep.pool.to_string(),
                        model_server_pod: ep.address_str.to_string(),
                    })
                    .set(s.waiting_requests as i64);
            }
            if !ep.draining && ep.health.snapshot(now, &health).routable {
                pool.3 += 1;
            }
        }
        for (name, (kv, queue, scraped, ready)) in pools {
            let labels = PoolLabels { name: name.into() };
            self.ready_pods.get_or_create(&labels).set(ready);
            if scraped > 0 {
                self.pool_kv
                    .get_or_create(&labels)
                    .set(kv / f64::from(scraped));
                self.pool_queue
                    .get_or_create(&labels)
                    .set(queue / f64::from(scraped));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ResolvedEndpoint;
    use crate::discovery::Registry as Endpoints;

    #[test]
    fn decisions_and_pools_render_under_gie_names_and_labels() {
        let m = GieMetrics::new();
        m.record(
            "llama",
            Duration::from_micros(40),
            GieOutcome::Routed { prompt_tokens: 300 },
        );
        m.record(
            "nope",
            Duration::from_micros(5),
            GieOutcome::Rejected {
                error_code: "BadRequest",
            },
        );
        let endpoints = Endpoints::new(&[
            ResolvedEndpoint::new("127.0.0.1:1".parse().unwrap(), "gpu", &["llama"]),
            ResolvedEndpoint::new("127.0.0.1:2".parse().unwrap(), "gpu", &["llama"]),
        ]);
        let mut text = String::new();
        m.render(&endpoints.snapshot(), &mut text);
        for needle in [
            "inference_objective_request_total{model_name=\"llama\",target_model_name=\"llama\"} 1",
            "inference_objective_request_total{model_name=\"nope\",target_model_name=\"nope\"} 1",
            "inference_objective_request_error_total{model_name=\"nope\",target_model_name=\"nope\",error_code=\"BadRequest\"} 1",
            "inference_objective_input_tokens_sum{model_name=\"llama\",target_model_name=\"llama\"} 300",
            "inference_extension_scheduler_attempts_total{status=\"success\"} 1",
            "inference_extension_scheduler_attempts_total{status=\"failure\"} 1",
            "inference_extension_scheduler_e2e_duration_seconds_count 2",
            "inference_pool_ready_pods{name=\"gpu\"} 2",
        ] {
            assert!(text.contains(needle), "missing {needle} in\n{text}");
        }
        assert!(
            !text.contains("inference_pool_average_kv_cache_utilization{"),
            "no scraped endpoint, no average:\n{text}"
        );
    }
}
