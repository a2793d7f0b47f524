//! Prometheus text expositions as tests and the benchmark read them (kvrouter's and kvsim's
//! `/metrics`): every sample with its labels, parsed by [`prom_text_format_parser`], the same
//! parser the router reads engine metrics with (`kvrouter::load::exposition`, which selects a
//! few families by name first; here everything is kept). Also the waits on kvrouter's gauges
//! and counters that the end-to-end tests share.

use std::net::SocketAddr;
use std::time::Duration;

use prom_text_format_parser::{parse_scrape, Type, ValueType};
use serde::{Deserialize, Serialize};

use crate::{poll, HarnessError};

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// The sample's name as written, a histogram's `_bucket` / `_sum` / `_count` suffix
    /// included (e.g. `kvrouter_decisions_total`, `vllm:e2e_request_latency_seconds_bucket`).
    pub name: String,
    /// Its labels, in order.
    pub labels: Vec<(String, String)>,
    /// Its value (`NaN` and infinities as floats).
    pub value: f64,
}

impl Series {
    /// The value of label `key`.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// A parsed exposition: every sample.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Metrics {
    /// The samples, in the exposition's order.
    pub series: Vec<Series>,
}

impl Metrics {
    /// Parses exposition `text`; `origin` (a URL, a file) names it in the error.
    pub fn parse(text: &str, origin: &str) -> Result<Metrics, HarnessError> {
        let (families, error) = parse_scrape(text);
        if let Some(e) = error {
            return Err(HarnessError::Metrics {
                origin: origin.into(),
                message: format!("{e:?}"),
            });
        }
        let mut series = Vec::new();
        for family in families {
            for sample in family.samples {
                let suffix = match (family.kind, sample.value.value_type) {
                    (Type::Histogram, ValueType::Sample) => "_bucket",
                    (_, ValueType::Sum) => "_sum",
                    (_, ValueType::Count) => "_count",
                    _ => "",
                };
                series.push(Series {
                    name: format!("{}{suffix}", family.name),
                    labels: sample
                        .labels
                        .iter()
                        .map(|l| (l.key.clone(), l.value.clone()))
                        .collect(),
                    value: sample.value.value.as_f64(),
                });
            }
        }
        Ok(Metrics { series })
    }

    /// GETs `url` and parses the body; a transport error, a non-2xx status or invalid text is
    /// an error.
    pub async fn fetch(client: &reqwest::Client, url: &str) -> Result<Metrics, HarnessError> {
        let http = |e: reqwest::Error| HarnessError::Http {
            url: url.into(),
            message: e.to_string(),
        };
        let text = client
            .get(url)
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .map_err(http)?
            .text()
            .await
            .map_err(http)?;
        Metrics::parse(&text, url)
    }

    /// The series named exactly `name`.
    pub fn named<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Series> + 'a {
        self.series.iter().filter(move |s| s.name == name)
    }

    /// The sum of the series named `name` (0 when there are none).
    pub fn sum(&self, name: &str) -> f64 {
        self.named(name).map(|s| s.value).sum()
    }

    /// The sum of the series named `name` whose label `key` is `value`.
    pub fn sum_where(&self, name: &str, key: &str, value: &str) -> f64 {
        self.named(name)
            .filter(|s| s.label(key) == Some(value))
            .map(|s| s.value)
            .sum()
    }

    /// Histogram `name` (its `_bucket`, `_sum` and `_count` series), label sets summed
    /// bucket by bucket; empty when absent.
    pub fn histogram(&self, name: &str) -> Histogram {
        let (bucket, sum, count) = (
            format!("{name}_bucket"),
            format!("{name}_sum"),
            format!("{name}_count"),
        );
        let mut buckets: Vec<(f64, f64)> = Vec::new();
        for s in self.named(&bucket) {
            let Some(le) = s.label("le").and_then(parse_bound) else {
                continue;
            };
            match buckets.iter_mut().find(|(b, _)| *b == le) {
                Some(b) => b.1 += s.value,
                None => buckets.push((le, s.value)),
            }
        }
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        Histogram {
            buckets,
            sum: self.sum(&sum),
            count: self.sum(&count),
        }
    }
}

/// A bucket bound: a float, or `+Inf`.
fn parse_bound(le: &str) -> Option<f64> {
    match le {
        "+Inf" => Some(f64::INFINITY),
        _ => le.parse().ok().filter(|v: &f64| !v.is_nan()),
    }
}

/// A Prometheus histogram read from an exposition.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Histogram {
    /// `(upper bound, cumulative count)`, ascending; `+Inf` last (written as `null` in JSON,
    /// which has no infinity).
    #[serde(deserialize_with = "buckets_from_json")]
    pub buckets: Vec<(f64, f64)>,
    /// Sum of observations.
    pub sum: f64,
    /// Observations.
    pub count: f64,
}

fn buckets_from_json<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<(f64, f64)>, D::Error> {
    let raw: Vec<(Option<f64>, f64)> = Deserialize::deserialize(d)?;
    Ok(raw
        .into_iter()
        .map(|(le, c)| (le.unwrap_or(f64::INFINITY), c))
        .collect())
}

impl Histogram {
    /// The `q` quantile (0..1), linearly interpolated within its bucket (Prometheus'
    /// `histogram_quantile`); `None` without observations.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.buckets.last()?.1;
        if total <= 0.0 {
            return None;
        }
        let rank = q * total;
        let mut prev = (0.0, 0.0);
        for &(le, c) in &self.buckets {
            if c >= rank {
                if le.is_infinite() {
                    return Some(prev.0);
                }
                let within = if c > prev.1 {
                    (rank - prev.1) / (c - prev.1)
                } else {
                    1.0
                };
                return Some(prev.0 + (le - prev.0) * within);
            }
            prev = (le, c);
        }
        Some(prev.0)
    }

    /// `self - before`, bucket by bucket: the observations made between two reads.
    pub fn since(&self, before: &Histogram) -> Histogram {
        Histogram {
            buckets: self
                .buckets
                .iter()
                .map(|&(le, c)| {
                    let b = before
                        .buckets
                        .iter()
                        .find(|x| x.0 == le)
                        .map_or(0.0, |x| x.1);
                    (le, c - b)
                })
                .collect(),
            sum: self.sum - before.sum,
            count: self.count - before.count,
        }
    }
}

/// kvrouter's metrics now, for tests: panics if they cannot be read or parsed.
pub async fn router_metrics(admin: SocketAddr) -> Metrics {
    Metrics::fetch(&reqwest::Client::new(), &format!("http://{admin}/metrics"))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// The sum of kvrouter's series named `name` (e.g. in-flight requests over every endpoint).
pub async fn metric_sum(admin: SocketAddr, name: &str) -> f64 {
    router_metrics(admin).await.sum(name)
}

/// How long the waits on kvrouter's metrics below poll.
const METRIC_WAIT: Duration = Duration::from_secs(10);

/// Waits until kvrouter counts at least `n` requests in flight over all endpoints.
pub async fn wait_for_in_flight(admin: SocketAddr, n: u64) {
    poll::eventually("requests in flight", METRIC_WAIT, || async move {
        (metric_sum(admin, "kvrouter_endpoint_in_flight_requests").await >= n as f64).then_some(())
    })
    .await;
}

/// Waits until kvrouter has made at least `n` routing decisions (so a test's next request sees
/// the previous ones in flight).
pub async fn wait_for_decisions(admin: SocketAddr, n: u64) {
    poll::eventually("decisions counted", METRIC_WAIT, || async move {
        (metric_sum(admin, "kvrouter_decisions_total").await >= n as f64).then_some(())
    })
    .await;
}

/// Waits until every endpoint's in-flight gauges (requests and prefill tokens) are back to 0.
pub async fn assert_in_flight_drains(admin: SocketAddr) {
    poll::eventually(
        "in-flight gauges to return to 0",
        METRIC_WAIT,
        || async move {
            let m = router_metrics(admin).await;
            let gauges: Vec<f64> = [
                "kvrouter_endpoint_in_flight_requests",
                "kvrouter_endpoint_in_flight_prefill_tokens",
            ]
            .iter()
            .flat_map(|name| m.named(name).map(|s| s.value))
            .collect();
            (!gauges.is_empty() && gauges.iter().all(|v| *v == 0.0)).then_some(())
        },
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// As kvsim renders it: vLLM names, an untyped-free exposition with a labelled histogram.
    const VLLM: &str = "# HELP vllm:num_requests_waiting Waiting.\n\
        # TYPE vllm:num_requests_waiting gauge\n\
        vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 3\n\
        vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 2\n\
        # TYPE vllm:kv_cache_usage_perc gauge\n\
        vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"a b\"} 0.5\n\
        # TYPE d histogram\n\
        d_bucket{engine=\"0\",le=\"0.001\"} 2\nd_bucket{engine=\"0\",le=\"0.01\"} 8\n\
        d_bucket{engine=\"0\",le=\"+Inf\"} 10\nd_sum{engine=\"0\"} 0.05\nd_count{engine=\"0\"} 10\n";

    /// As prometheus-client renders kvrouter's: counters' TYPE lines carry `_total`.
    const ROUTER: &str = "# HELP kvrouter_decisions_total Decisions.\n\
        # TYPE kvrouter_decisions_total counter\n\
        kvrouter_decisions_total{policy=\"p\",endpoint=\"127.0.0.1:1\"} 4\n\
        kvrouter_decisions_total{policy=\"p\",endpoint=\"127.0.0.1:2\"} 1\n\
        # HELP kvrouter_streams_active Open.\n\
        # TYPE kvrouter_streams_active gauge\n\
        kvrouter_streams_active 0\n\
        # EOF\n";

    #[test]
    fn every_series_keeps_its_name_and_labels() {
        let m = Metrics::parse(VLLM, "test").unwrap();
        assert_eq!(m.series.len(), 2 + 1 + 5);
        assert_eq!(m.sum("vllm:num_requests_waiting"), 5.0);
        assert_eq!(m.sum_where("vllm:num_requests_waiting", "engine", "1"), 2.0);
        let kv = m.named("vllm:kv_cache_usage_perc").next().unwrap();
        assert_eq!(kv.label("model_name"), Some("a b"), "quoted label values");
        assert_eq!(m.named("d_count").count(), 1);
        assert_eq!(m.sum("absent"), 0.0);

        let r = Metrics::parse(ROUTER, "test").unwrap();
        assert_eq!(r.sum("kvrouter_decisions_total"), 5.0);
        assert_eq!(
            r.sum_where("kvrouter_decisions_total", "endpoint", "127.0.0.1:1"),
            4.0
        );
        assert_eq!(r.named("kvrouter_streams_active").count(), 1);
    }

    #[test]
    fn invalid_text_is_an_error_naming_its_origin() {
        let err = Metrics::parse("x{a=\"1} 2\n", "http://h/metrics").unwrap_err();
        assert!(err.to_string().contains("http://h/metrics"), "{err}");
    }

    #[test]
    fn histograms_and_their_quantiles() {
        let m = Metrics::parse(VLLM, "test").unwrap();
        let h = m.histogram("d");
        assert_eq!((h.count, h.sum), (10.0, 0.05));
        assert_eq!(h.buckets.len(), 3);
        // Median: rank 5 is 3/6 into (0.001, 0.01].
        let p50 = h.quantile(0.5).unwrap();
        assert!((p50 - 0.0055).abs() < 1e-9, "{p50}");
        assert_eq!(
            h.quantile(0.99),
            Some(0.01),
            "the +Inf bucket answers its lower bound"
        );
        assert_eq!(Histogram::default().quantile(0.5), None);
        assert_eq!(m.histogram("absent"), Histogram::default());
        let json = serde_json::to_string(&h).unwrap();
        let back: Histogram = serde_json::from_str(&json).unwrap();
        assert_eq!(back, h, "+Inf survives JSON as null");

        let later = Histogram {
            buckets: vec![(0.001, 3.0), (0.01, 10.0), (f64::INFINITY, 13.0)],
            sum: 0.08,
            count: 13.0,
        };
        let d = later.since(&h);
        assert_eq!(d.buckets, [(0.001, 1.0), (0.01, 2.0), (f64::INFINITY, 3.0)]);
        assert_eq!(d.count, 3.0);
    }
}
