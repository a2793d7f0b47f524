//! Flow-control metrics: outcomes per model and priority, wait times per model and priority
//! (histogram) and per flow (sum and count), and the live depths rendered at scrape time.
//!
//! Flow ids are client-chosen (fairness header) or tenant names: the per-flow series are capped
//! at [`MAX_FLOW_SERIES`]; flows beyond it are counted under `flow="other"`.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::Duration;

use parking_lot::Mutex;

use super::queue::FlowDepth;

/// Distinct (model, flow) wait series kept before new flows are pooled as `other`.
const MAX_FLOW_SERIES: usize = 256;

/// Upper bounds of the wait histogram's buckets, in seconds.
const WAIT_BUCKETS_S: [f64; 12] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

#[derive(Debug, Default)]
struct Histogram {
    buckets: [u64; WAIT_BUCKETS_S.len()],
    sum_s: f64,
    count: u64,
}

#[derive(Debug, Default)]
struct Inner {
    /// (model, priority, outcome) -> requests.
    outcomes: HashMap<(String, i32, &'static str), u64>,
    /// (model, priority) -> wait of admitted requests.
    waits: HashMap<(String, i32), Histogram>,
    /// (model, flow) -> (wait sum s, admitted count).
    flow_waits: HashMap<(String, String), (f64, u64)>,
}

/// The controller's metrics. Updated under their own short lock, off the queue's lock.
#[derive(Debug, Default)]
pub(crate) struct FlowMetrics {
    inner: Mutex<Inner>,
}

impl FlowMetrics {
    /// Counts a request of `model`/`priority` that ended its stay with `outcome`
    /// (`admitted`, `full`, `displaced`, `expired`, `cancelled`, `closed`).
    pub(crate) fn outcome(&self, model: &str, priority: i32, outcome: &'static str) {
        let mut inner = self.inner.lock();
        *inner
            .outcomes
            .entry((model.to_string(), priority, outcome))
            .or_default() += 1;
    }

    /// Records an admitted request's wait.
    pub(crate) fn admitted(&self, model: &str, priority: i32, flow: &str, waited: Duration) {
        let s = waited.as_secs_f64();
        let mut inner = self.inner.lock();
        *inner
            .outcomes
            .entry((model.to_string(), priority, "admitted"))
            .or_default() += 1;
        let h = inner
            .waits
            .entry((model.to_string(), priority))
            .or_default();
        for (bucket, &le) in h.buckets.iter_mut().zip(&WAIT_BUCKETS_S) {
            if s <= le {
                *bucket += 1;
            }
        }
        h.sum_s += s;
        h.count += 1;
        let key = (model.to_string(), flow.to_string());
        let key = if inner.flow_waits.contains_key(&key) || inner.flow_waits.len() < MAX_FLOW_SERIES
        {
            key
        } else {
            (model.to_string(), "other".to_string())
        };
        let w = inner.flow_waits.entry(key).or_default();
        w.0 += s;
        w.1 += 1;
    }

    /// The Prometheus text of every flow metric, with `depths` (model, its queue's depths) as
    /// the queue gauges.
    pub(crate) fn render(&self, depths: &[(String, Vec<FlowDepth>)]) -> String {
        let mut out = String::new();
        let (mut requests, mut bytes) = (String::new(), String::new());
        for (model, flows) in depths {
            for d in flows {
                let labels = format!(
                    "model=\"{}\",priority=\"{}\",flow=\"{}\"",
                    escape(model),
                    d.priority,
                    escape(&d.flow)
                );
                let _ = writeln!(
                    requests,
                    "kvrouter_flow_queue_requests{{{labels}}} {}",
                    d.requests
                );
                let _ = writeln!(bytes, "kvrouter_flow_queue_bytes{{{labels}}} {}", d.bytes);
            }
        }
        family(
            &mut out,
            "kvrouter_flow_queue_requests",
            "gauge",
            "Requests waiting in the router's queue.",
            &requests,
        );
        family(
            &mut out,
            "kvrouter_flow_queue_bytes",
            "gauge",
            "Body bytes waiting in the router's queue.",
            &bytes,
        );
        let inner = self.inner.lock();
        let mut samples = String::new();
        let mut outcomes: Vec<_> = inner.outcomes.iter().collect();
        outcomes.sort();
        for ((model, priority, outcome), n) in outcomes {
            let _ = writeln!(
                samples,
                "kvrouter_flow_requests_total{{model=\"{}\",priority=\"{priority}\",outcome=\"{outcome}\"}} {n}",
                escape(model)
            );
        }
        family(&mut out, "kvrouter_flow_requests_total", "counter", "Requests through flow control by outcome: admitted, full (turned away), displaced, expired, cancelled, closed.", &samples);
        let mut samples = String::new();
        let mut waits: Vec<_> = inner.waits.iter().collect();
        waits.sort_by(|a, b| a.0.cmp(b.0));
        for ((model, priority), h) in waits {
            let labels = format!("model=\"{}\",priority=\"{priority}\"", escape(model));
            for (n, le) in h.buckets.iter().zip(WAIT_BUCKETS_S) {
                let _ = writeln!(
                    samples,
                    "kvrouter_flow_wait_seconds_bucket{{{labels},le=\"{le}\"}} {n}"
                );
            }
            let _ = writeln!(
                samples,
                "kvrouter_flow_wait_seconds_bucket{{{labels},le=\"+Inf\"}} {}",
                h.count
            );
            let _ = writeln!(
                samples,
                "kvrouter_flow_wait_seconds_sum{{{labels}}} {}",
                h.sum_s
            );
            let _ = writeln!(
                samples,
                "kvrouter_flow_wait_seconds_count{{{labels}}} {}",
                h.count
            );
        }
        family(
            &mut out,
            "kvrouter_flow_wait_seconds",
            "histogram",
            "Time admitted requests waited in the queue.",
            &samples,
        );
        let mut samples = String::new();
        let mut flows: Vec<_> = inner.flow_waits.iter().collect();
        flows.sort_by(|a, b| a.0.cmp(b.0));
        for ((model, flow), (sum, count)) in flows {
            let labels = format!("model=\"{}\",flow=\"{}\"", escape(model), escape(flow));
            let _ = writeln!(
                samples,
                "kvrouter_flow_flow_wait_seconds_sum{{{labels}}} {sum}"
            );
            let _ = writeln!(
                samples,
                "kvrouter_flow_flow_wait_seconds_count{{{labels}}} {count}"
            );
        }
        family(
            &mut out,
            "kvrouter_flow_flow_wait_seconds",
            "summary",
            "Time admitted requests waited, per flow.",
            &samples,
        );
        out
    }
}

/// Appends one metric family (its HELP and TYPE, then `samples`), if it has samples.
fn family(out: &mut String, name: &str, kind: &str, help: &str, samples: &str) {
    if !samples.is_empty() {
        let _ = write!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{samples}");
    }
}

/// A Prometheus label value: backslash, quote and newline escaped.
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_outcomes_waits_and_depths() {
        let m = FlowMetrics::default();
        m.admitted("m", 1, "a", Duration::from_millis(20));
        m.outcome("m", -1, "full");
        let depths = vec![(
            "m".to_string(),
            vec![FlowDepth {
                priority: -1,
                flow: "q\"x".into(),
                requests: 3,
                bytes: 30,
                virtual_tokens: 0,
                owed_tokens: 0,
            }],
        )];
        let text = m.render(&depths);
        for want in [
            "kvrouter_flow_queue_requests{model=\"m\",priority=\"-1\",flow=\"q\\\"x\"} 3",
            "kvrouter_flow_requests_total{model=\"m\",priority=\"-1\",outcome=\"full\"} 1",
            "kvrouter_flow_requests_total{model=\"m\",priority=\"1\",outcome=\"admitted\"} 1",
            "kvrouter_flow_wait_seconds_bucket{model=\"m\",priority=\"1\",le=\"0.025\"} 1",
            "kvrouter_flow_wait_seconds_bucket{model=\"m\",priority=\"1\",le=\"0.01\"} 0",
            "kvrouter_flow_flow_wait_seconds_count{model=\"m\",flow=\"a\"} 1",
        ] {
            assert!(text.contains(want), "missing {want} in\n{text}");
        }
    }
}
