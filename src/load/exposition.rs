//! Reading an engine's load from its Prometheus text exposition (`GET /metrics`).
//!
//! Only the handful of metric families the router uses are parsed: lines are first selected by
//! metric name (a byte-prefix test per line), then handed to a real exposition-format parser
//! ([`prom_text_format_parser`]: quoting, escapes, `NaN`/`+Inf`, timestamps). A real vLLM
//! exposition is ~50 KB and ~600 lines, mostly histograms the router does not read, and is
//! scraped every 50 ms per endpoint, so parsing only what is needed keeps the scrape cheap.
//!
//! Names per engine:
//!
//! | signal | vLLM | SGLang |
//! | --- | --- | --- |
//! | queue | `vllm:num_requests_waiting` | `sglang:num_queue_reqs` |
//! | running batch | `vllm:num_requests_running` | `sglang:num_running_reqs` |
//! | KV usage 0..1 | `vllm:kv_cache_usage_perc` | `sglang:token_usage` |
//! | KV capacity | `vllm:cache_config_info` (`block_size` × `num_gpu_blocks` labels) | `sglang:max_total_num_tokens` |
//! | LoRA | `vllm:lora_requests_info` (labels) | - |
//! | CPU offload size | `vllm:cache_config_info` (`kv_offloading_size` label, GiB) | - |
//! | CPU offload loads | `vllm:kv_offload_total_bytes` / `vllm:kv_offload_total_time` (`transfer_type="CPU_to_GPU"`) | - |
//!
//! Counts are summed over the series of a family (one per engine core under data parallelism);
//! KV usage is the highest.

use prom_text_format_parser::{parse_scrape, Metric};
use tokio::time::Instant;

use super::engine::{EngineSample, LoraInfo};
use crate::config::EngineKind;

/// The metric families read for one engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetricNames {
    /// Requests waiting in the engine's queue (gauge).
    pub waiting: &'static str,
    /// Requests in the running batch (gauge).
    pub running: &'static str,
    /// KV-cache usage, 0..1 (gauge).
    pub kv_usage: &'static str,
    /// vLLM's `cache_config_info` (labels `block_size`, `num_gpu_blocks`).
    pub cache_config: Option<&'static str>,
    /// A gauge of the KV-cache capacity in tokens.
    pub capacity_tokens: Option<&'static str>,
    /// vLLM's `lora_requests_info` (labels `max_lora`, `running_lora_adapters`,
    /// `waiting_lora_adapters`).
    pub lora: Option<&'static str>,
    /// Bytes and seconds the offloading connector spent moving KV (counters, by
    /// `transfer_type`; vLLM's `kv_offload_total_bytes` and `kv_offload_total_time`).
    pub offload: Option<(&'static str, &'static str)>,
}

impl MetricNames {
    /// The names `kind` exposes; `None` for engines that are not scraped.
    pub fn of(kind: EngineKind) -> Option<MetricNames> {
        match kind {
            EngineKind::Vllm => Some(MetricNames {
                waiting: "vllm:num_requests_waiting",
                running: "vllm:num_requests_running",
                kv_usage: "vllm:kv_cache_usage_perc",
                cache_config: Some("vllm:cache_config_info"),
                capacity_tokens: None,
                lora: Some("vllm:lora_requests_info"),
                offload: Some((
                    "vllm:kv_offload_total_bytes_total",
                    "vllm:kv_offload_total_time_total",
                )),
            }),
            EngineKind::Sglang => Some(MetricNames {
                waiting: "sglang:num_queue_reqs",
                running: "sglang:num_running_reqs",
                kv_usage: "sglang:token_usage",
                cache_config: None,
                capacity_tokens: Some("sglang:max_total_num_tokens"),
                lora: None,
                offload: None,
            }),
            EngineKind::Other => None,
        }
    }

    fn all(&self) -> impl Iterator<Item = &'static str> {
        [self.waiting, self.running, self.kv_usage]
            .into_iter()
            .chain(self.cache_config)
            .chain(self.capacity_tokens)
            .chain(self.lora)
            .chain(self.offload.into_iter().flat_map(|(b, t)| [b, t]))
    }
}

/// Why an exposition gave no load.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExpositionError {
    /// The selected lines are not valid exposition text.
    #[error("invalid Prometheus text: {0}")]
    Invalid(String),
    /// A required metric family is absent (wrong `engine` for the pool?).
    #[error("metric {0} is missing (is the pool's `engine` right?)")]
    Missing(&'static str),
}

/// Whether `line` belongs to one of `names`' families: its sample lines or its `# TYPE` line
/// (`# HELP` and other comments are not needed to parse the values).
fn wanted(line: &str, names: &MetricNames) -> bool {
    let rest = if line.starts_with('#') {
        match line.strip_prefix("# TYPE ") {
            Some(rest) => rest,
            None => return false,
        }
    } else {
        line
    };
    names.all().any(|name| {
        rest.strip_prefix(name)
            .is_some_and(|after| matches!(after.as_bytes().first(), Some(b'{' | b' ' | b'\t')))
    })
}

/// Parses the load out of `text`, as scraped at `scraped_at`.
pub fn parse(
    names: &MetricNames,
    text: &str,
    scraped_at: Instant,
) -> Result<EngineSample, ExpositionError> {
    let mut selected = String::with_capacity(1024);
    for line in text.lines() {
        if wanted(line, names) {
            selected.push_str(line);
            selected.push('\n');
        }
    }
    if selected.is_empty() {
        return Err(ExpositionError::Missing(names.waiting));
    }
    let (metrics, error) = parse_scrape(&selected);
    if let Some(e) = error {
        return Err(ExpositionError::Invalid(format!("{e:?}")));
    }
    let family = |name: &str| metrics.iter().find(|m| m.name == name);
    let values = |m: &Metric| {
        m.samples
            .iter()
            .map(|s| s.value.value.as_f64())
            .filter(|v| v.is_finite())
            .collect::<Vec<f64>>()
    };
    let sum = |name: &'static str| -> Result<u64, ExpositionError> {
        let m = family(name).ok_or(ExpositionError::Missing(name))?;
        Ok(values(m).iter().map(|v| v.max(0.0)).sum::<f64>().round() as u64)
    };
    let kv = family(names.kv_usage).ok_or(ExpositionError::Missing(names.kv_usage))?;
    let kv_cache_usage = values(kv)
        .into_iter()
        .fold(0.0f64, f64::max)
        .clamp(0.0, 1.0);

    let label = |m: &Metric, key: &str| -> Option<String> {
        m.samples
            .first()?
            .labels
            .iter()
            .find(|l| l.key == key)
            .map(|l| l.value.clone())
    };
    let mut block_size_tokens = None;
    let mut capacity_tokens = None;
    let mut cpu_offload_bytes = None;
    if let Some(m) = names.cache_config.and_then(family) {
        // vLLM's `--kv-offloading-size`, GiB ("None" without offloading).
        cpu_offload_bytes = label(m, "kv_offloading_size")
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|g| g.is_finite() && *g > 0.0)
            .map(|g| (g * f64::from(1u32 << 30)).min(u64::MAX as f64) as u64);
        let block: Option<u32> = label(m, "block_size").and_then(|v| v.parse().ok());
        let blocks: Option<u64> = label(m, "num_gpu_blocks").and_then(|v| v.parse().ok());
        block_size_tokens = block;
        // Saturating: the labels are the endpoint's text; the router clamps the capacity later
        // (`cache_index.max_engine_capacity_tokens`).
        capacity_tokens = block
            .zip(blocks)
            .map(|(b, n)| u64::from(b).saturating_mul(n));
    }
    if let Some(m) = names.capacity_tokens.and_then(family) {
        capacity_tokens = values(m).first().filter(|v| **v >= 1.0).map(|v| *v as u64);
    }
    let lora = names.lora.and_then(family).and_then(lora_info);
    // Loads into GPU memory only: stores run beside compute and price nothing here.
    let loads = |name: &str| {
        family(name).map(|m| {
            m.samples
                .iter()
                .filter(|s| {
                    s.labels
                        .iter()
                        .any(|l| l.key == "transfer_type" && l.value == "CPU_to_GPU")
                })
                .map(|s| s.value.value.as_f64())
                .filter(|v| v.is_finite() && *v >= 0.0)
                .sum::<f64>()
        })
    };
    let cpu_loaded = names
        .offload
        .and_then(|(bytes, time)| loads(bytes).zip(loads(time)));
    Ok(EngineSample {
        waiting_requests: sum(names.waiting)?,
        running_requests: sum(names.running)?,
        kv_cache_usage,
        capacity_tokens,
        block_size_tokens,
        lora,
        cpu_offload_bytes,
        cpu_loaded,
        scraped_at,
    })
}

/// vLLM keeps one `lora_requests_info` series per label combination ever seen, with the time it
/// was last set as the value: the newest series is the current state.
fn lora_info(m: &Metric) -> Option<LoraInfo> {
    let newest = m
        .samples
        .iter()
        .max_by(|a, b| a.value.value.as_f64().total_cmp(&b.value.value.as_f64()))?;
    let get = |key: &str| {
        newest
            .labels
            .iter()
            .find(|l| l.key == key)
            .map(|l| l.value.as_str())
    };
    let list = |key: &str| -> Vec<String> {
        get(key)
            .unwrap_or("")
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect()
    };
    Some(LoraInfo {
        max_loras: get("max_lora").and_then(|v| v.parse().ok()).unwrap_or(0),
        running: list("running_lora_adapters"),
        waiting: list("waiting_lora_adapters"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vllm() -> MetricNames {
        MetricNames::of(EngineKind::Vllm).unwrap()
    }

    #[test]
    fn parses_a_real_vllm_capture() {
        let path = crate::prefix::tests::fixture_dir().join("metrics.txt");
        let Ok(text) = std::fs::read_to_string(&path) else {
            panic!("shared fixture {} missing", path.display());
        };
        let s = parse(&vllm(), &text, Instant::now()).expect("parses");
        assert_eq!((s.waiting_requests, s.running_requests), (0, 0));
        assert_eq!(s.kv_cache_usage, 0.0);
        assert_eq!(s.block_size_tokens, Some(128));
        assert_eq!(s.capacity_tokens, Some(24 * 128), "num_gpu_blocks=24");
        assert_eq!(s.lora, None, "the capture serves no adapters");
        assert_eq!(s.cpu_offload_bytes, None, "kv_offloading_size=\"None\"");
        assert_eq!(s.cpu_loaded, None);
    }

    #[test]
    fn parses_the_simulators_exposition_with_loras_and_several_engines() {
        let text = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 99.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",kv_offloading_backend="native",kv_offloading_size="1.5",num_gpu_blocks="2000"} 1.0
# TYPE vllm:kv_offload_total_bytes_total counter
vllm:kv_offload_total_bytes_total{engine="0",model_name="m",transfer_type="CPU_to_GPU"} 4.0e9
vllm:kv_offload_total_bytes_total{engine="0",model_name="m",transfer_type="GPU_to_CPU"} 9.0e9
# TYPE vllm:kv_offload_total_time_total counter
vllm:kv_offload_total_time_total{engine="0",model_name="m",transfer_type="CPU_to_GPU"} 0.25
vllm:kv_offload_total_time_total{engine="0",model_name="m",transfer_type="GPU_to_CPU"} 3.0
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="4",running_lora_adapters="old",waiting_lora_adapters=""} 1.6e9
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",model_name="m",le="0.001"} 0
"#;
        let s = parse(&vllm(), text, Instant::now()).unwrap();
        assert_eq!(s.running_requests, 5, "summed over engines");
        assert_eq!(
            s.waiting_requests, 8,
            "the by-reason family is not the queue"
        );
        assert_eq!(s.kv_cache_usage, 0.5, "the fullest engine");
        assert_eq!(s.capacity_tokens, Some(32_000));
        assert_eq!(s.cpu_offload_bytes, Some(3 << 29), "1.5 GiB");
        assert_eq!(s.cpu_loaded, Some((4.0e9, 0.25)), "loads only");
        assert_eq!(
            s.lora,
            Some(LoraInfo {
                max_loras: 4,
                running: vec!["a".into(), "b".into()],
                waiting: vec![]
            }),
            "the newest series"
        );
    }

    /// kvsim's own exposition with a CPU offload tier, as rendered: the tier's size and its
    /// load counters come through.
    #[test]
    fn parses_the_simulators_offload_series() {
        use kvsim::metrics::{add, MetricsInfo, SimMetrics};
        let m = SimMetrics::default();
        add(&m.offload_load_bytes, 3_000_000);
        add(&m.offload_load_ns, 150_000);
        add(&m.offload_store_bytes, 9_000_000);
        let text = m.render(&MetricsInfo {
            model_name: "m".into(),
            block_size: 16,
            num_gpu_blocks: 64,
            max_loras: 0,
            offload_bytes: Some(2 << 30),
        });
        let s = parse(&vllm(), &text, Instant::now()).unwrap();
        assert_eq!(s.capacity_tokens, Some(64 * 16));
        assert_eq!(s.cpu_offload_bytes, Some(2 << 30));
        assert_eq!(s.cpu_loaded, Some((3e6, 150e-6)));
    }

    #[test]
    fn parses_sglang_names() {
        let text = "# TYPE sglang:num_queue_reqs gauge\n\
                    sglang:num_queue_reqs{model_name=\"q\"} 4\n\
                    sglang:num_running_reqs{model_name=\"q\"} 8\n\
                    sglang:token_usage{model_name=\"q\"} 0.52\n\
                    sglang:max_total_num_tokens{model_name=\"q\"} 161721.0\n\
                    sglang:cache_hit_rate{model_name=\"q\"} 0.28\n";
        let names = MetricNames::of(EngineKind::Sglang).unwrap();
        let s = parse(&names, text, Instant::now()).unwrap();
        assert_eq!((s.waiting_requests, s.running_requests), (4, 8));
        assert_eq!(s.kv_cache_usage, 0.52);
        assert_eq!(s.capacity_tokens, Some(161_721));
        assert_eq!(MetricNames::of(EngineKind::Other), None);
    }

    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        let cases: &[(&str, ExpositionError)] = &[
            ("", ExpositionError::Missing("vllm:num_requests_waiting")),
            (
                "sglang:num_queue_reqs 3\n",
                ExpositionError::Missing("vllm:num_requests_waiting"),
            ),
            (
                "vllm:num_requests_waiting 1\nvllm:kv_cache_usage_perc 0.1\n",
                ExpositionError::Missing("vllm:num_requests_running"),
            ),
        ];
        for (text, expected) in cases {
            assert_eq!(
                parse(&vllm(), text, Instant::now()).unwrap_err(),
                *expected,
                "{text:?}"
            );
        }
        let garbage = "vllm:num_requests_waiting{engine=\"0} 1\n";
        assert!(matches!(
            parse(&vllm(), garbage, Instant::now()),
            Err(ExpositionError::Invalid(_))
        ));
        let huge = "vllm:num_requests_waiting 1e300\nvllm:num_requests_running -5\nvllm:kv_cache_usage_perc 7\n\
                    vllm:cache_config_info{block_size=\"4294967295\",num_gpu_blocks=\"18446744073709551615\"} 1\n";
        let s = parse(&vllm(), huge, Instant::now()).unwrap();
        assert_eq!(
            s.capacity_tokens,
            Some(u64::MAX),
            "saturates, never overflows"
        );
        assert_eq!((s.running_requests, s.kv_cache_usage), (0, 1.0));
        let nan = "vllm:num_requests_waiting NaN\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc NaN\n";
        let s = parse(&vllm(), nan, Instant::now()).unwrap();
        assert_eq!((s.waiting_requests, s.kv_cache_usage), (0, 0.0));
    }
}
