//! The replica's Prometheus metrics under vLLM's names, labels (`engine`, `model_name`) and
//! histogram buckets, rendered in the text exposition format.
//!
//! The engine task is the only writer; `/metrics` reads. Counters are atomics; histograms sit
//! behind a short mutex.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

/// vLLM's `time_to_first_token_seconds` buckets.
pub const TTFT_BUCKETS_S: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's buckets for `e2e_request_latency_seconds` and `request_queue_time_seconds`.
pub const REQUEST_LATENCY_BUCKETS_S: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// A cumulative histogram over fixed buckets.
#[derive(Debug)]
pub struct Histogram {
    buckets: &'static [f64],
    state: Mutex<(Vec<u64>, f64, u64)>,
}

impl Histogram {
    /// An empty histogram over `buckets` (upper bounds, ascending).
    pub fn new(buckets: &'static [f64]) -> Histogram {
        Histogram {
            buckets,
            state: Mutex::new((vec![0; buckets.len()], 0.0, 0)),
        }
    }

    /// Records one value.
    pub fn observe(&self, value: Duration) {
        let v = value.as_secs_f64();
        let mut state = self.state.lock();
        if let Some(i) = self.buckets.iter().position(|&b| v <= b) {
            state.0[i] += 1;
        }
        state.1 += v;
        state.2 += 1;
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.state.lock().2
    }

    /// Sum of observations, in seconds.
    pub fn sum_s(&self) -> f64 {
        self.state.lock().1
    }

    fn reset(&self) {
        let mut state = self.state.lock();
        state.0.iter_mut().for_each(|c| *c = 0);
        state.1 = 0.0;
        state.2 = 0;
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let (counts, sum, count) = self.state.lock().clone();
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, n) in self.buckets.iter().zip(counts) {
            cumulative += n;
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels},le=\"{bound:?}\"}} {cumulative}"
            );
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {count}");
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
        let _ = writeln!(out, "{name}_count{{{labels}}} {count}");
    }
}

/// Every metric a replica exposes.
#[derive(Debug)]
pub struct SimMetrics {
    /// Requests in the running batch.
    pub running: AtomicU64,
    /// Requests in the waiting queue (preempted ones included).
    pub waiting: AtomicU64,
    /// KV usage in [0, 1], as f64 bits.
    pub kv_usage_bits: AtomicU64,
    /// Prompt tokens looked up in the prefix cache (non-preempted lookups, as vLLM).
    pub prefix_cache_queries: AtomicU64,
    /// Of those, tokens found cached.
    pub prefix_cache_hits: AtomicU64,
    /// Prompt tokens after the GPU hit looked up in the CPU tier (vLLM's
    /// `external_prefix_cache_queries`).
    pub external_prefix_cache_queries: AtomicU64,
    /// Of those, tokens found there.
    pub external_prefix_cache_hits: AtomicU64,
    /// Bytes loaded from the CPU tier into GPU memory (`kv_offload_total_bytes`, `CPU_to_GPU`).
    pub offload_load_bytes: AtomicU64,
    /// Real time those loads took, ns (`kv_offload_total_time`, `CPU_to_GPU`).
    pub offload_load_ns: AtomicU64,
    /// Bytes stored to the CPU tier (`GPU_to_CPU`).
    pub offload_store_bytes: AtomicU64,
    /// Real time those stores would take at the tier's bandwidth, ns (`GPU_to_CPU`).
    pub offload_store_ns: AtomicU64,
    /// Prompt tokens of scheduled requests (counted at first scheduling).
    pub prompt_tokens: AtomicU64,
    /// Cached prompt tokens (counted at first scheduling).
    pub prompt_tokens_cached: AtomicU64,
    /// Generated tokens.
    pub generation_tokens: AtomicU64,
    /// Preemptions.
    pub preemptions: AtomicU64,
    /// Requests finished by reaching their length.
    pub finished_length: AtomicU64,
    /// Requests aborted (client gone, reset, restart).
    pub finished_abort: AtomicU64,
    /// LoRA adapters of running and of waiting requests, comma-separated.
    pub lora_names: Mutex<(String, String)>,
    /// Time to first token.
    pub ttft: Histogram,
    /// Arrival to last token.
    pub e2e: Histogram,
    /// Arrival to first scheduling.
    pub queue_time: Histogram,
}

impl Default for SimMetrics {
    fn default() -> Self {
        Self {
            running: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            kv_usage_bits: AtomicU64::new(0f64.to_bits()),
            prefix_cache_queries: AtomicU64::new(0),
            prefix_cache_hits: AtomicU64::new(0),
            external_prefix_cache_queries: AtomicU64::new(0),
            external_prefix_cache_hits: AtomicU64::new(0),
            offload_load_bytes: AtomicU64::new(0),
            offload_load_ns: AtomicU64::new(0),
            offload_store_bytes: AtomicU64::new(0),
            offload_store_ns: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            prompt_tokens_cached: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            preemptions: AtomicU64::new(0),
            finished_length: AtomicU64::new(0),
            finished_abort: AtomicU64::new(0),
            lora_names: Mutex::new((String::new(), String::new())),
            ttft: Histogram::new(TTFT_BUCKETS_S),
            e2e: Histogram::new(REQUEST_LATENCY_BUCKETS_S),
            queue_time: Histogram::new(REQUEST_LATENCY_BUCKETS_S),
        }
    }
}

/// Adds `n` to a counter.
pub fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

/// What `/metrics` labels and `cache_config_info` report.
#[derive(Debug, Clone)]
pub struct MetricsInfo {
    /// `model_name` label: the first served model.
    pub model_name: String,
    /// Tokens per block.
    pub block_size: u32,
    /// KV blocks.
    pub num_gpu_blocks: u32,
    /// `max_lora` of `lora_requests_info`.
    pub max_loras: usize,
    /// The CPU offload tier's size in bytes, when there is one (then `cache_config_info` says
    /// `kv_offloading_backend="native"`, `kv_offloading_size` in GiB, and the `kv_offload_*`
    /// series are rendered).
    pub offload_bytes: Option<u64>,
}

impl SimMetrics {
    /// KV usage in [0, 1].
    pub fn kv_usage(&self) -> f64 {
        f64::from_bits(self.kv_usage_bits.load(Ordering::Relaxed))
    }

    /// Zeroes every counter and histogram (gauges follow the engine).
    pub fn reset(&self) {
        for c in [
            &self.prefix_cache_queries,
            &self.prefix_cache_hits,
            &self.external_prefix_cache_queries,
            &self.external_prefix_cache_hits,
            &self.offload_load_bytes,
            &self.offload_load_ns,
            &self.offload_store_bytes,
            &self.offload_store_ns,
            &self.prompt_tokens,
            &self.prompt_tokens_cached,
            &self.generation_tokens,
            &self.preemptions,
            &self.finished_length,
            &self.finished_abort,
        ] {
            c.store(0, Ordering::Relaxed);
        }
        self.ttft.reset();
        self.e2e.reset();
        self.queue_time.reset();
    }

    /// The text exposition.
    pub fn render(&self, info: &MetricsInfo) -> String {
        let (running_loras, waiting_loras) = self.lora_names.lock().clone();
        let labels = format!("engine=\"0\",model_name=\"{}\"", escape(&info.model_name));
        let mut out = String::with_capacity(8192);
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let gauges: [(&str, &str, String); 3] = [
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                load(&self.running).to_string(),
            ),
            (
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed.",
                load(&self.waiting).to_string(),
            ),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                format!("{:?}", self.kv_usage()),
            ),
        ];
        for (name, help, value) in gauges {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{labels}}} {value}"
            );
        }
        let counters = [
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                &self.prefix_cache_queries,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                &self.prefix_cache_hits,
            ),
            (
                "vllm:external_prefix_cache_queries",
                "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.",
                &self.external_prefix_cache_queries,
            ),
            (
                "vllm:external_prefix_cache_hits",
                "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.",
                &self.external_prefix_cache_hits,
            ),
            (
                "vllm:num_preemptions",
                "Cumulative number of preemption from the engine.",
                &self.preemptions,
            ),
            (
                "vllm:prompt_tokens",
                "Number of prefill tokens processed.",
                &self.prompt_tokens,
            ),
            (
                "vllm:prompt_tokens_cached",
                "Number of cached prompt tokens (local + external).",
                &self.prompt_tokens_cached,
            ),
            (
                "vllm:generation_tokens",
                "Number of generation tokens processed.",
                &self.generation_tokens,
            ),
        ];
        for (name, help, c) in counters {
            let _ = writeln!(out, "# HELP {name}_total {help}\n# TYPE {name}_total counter\n{name}_total{{{labels}}} {}", load(c));
        }
        if info.offload_bytes.is_some() {
            let transfers = [
                (
                    "CPU_to_GPU",
                    &self.offload_load_bytes,
                    &self.offload_load_ns,
                ),
                (
                    "GPU_to_CPU",
                    &self.offload_store_bytes,
                    &self.offload_store_ns,
                ),
            ];
            // One family after the other: a family's samples must be contiguous.
            let name = "vllm:kv_offload_total_bytes_total";
            let _ = writeln!(
                out,
                "# HELP {name} Number of bytes offloaded by KV connector.\n# TYPE {name} counter"
            );
            for (kind, bytes, _) in transfers {
                let _ = writeln!(
                    out,
                    "{name}{{{labels},transfer_type=\"{kind}\"}} {}",
                    load(bytes)
                );
            }
            let name = "vllm:kv_offload_total_time_total";
            let _ = writeln!(
                out,
                "# HELP {name} Total time measured by all KV offloading operations.\n# TYPE {name} counter"
            );
            for (kind, _, ns) in transfers {
                let _ = writeln!(
                    out,
                    "{name}{{{labels},transfer_type=\"{kind}\"}} {:?}",
                    load(ns) as f64 / 1e9
                );
            }
        }
        let name = "vllm:request_success_total";
        let _ = writeln!(
            out,
            "# HELP {name} Count of successfully processed requests.\n# TYPE {name} counter"
        );
        for (reason, c) in [
            ("stop", None),
            ("length", Some(&self.finished_length)),
            ("abort", Some(&self.finished_abort)),
        ] {
            let _ = writeln!(
                out,
                "{name}{{{labels},finished_reason=\"{reason}\"}} {}",
                c.map_or(0, load)
            );
        }
        let name = "vllm:cache_config_info";
        let _ = writeln!(
            out,
            "# HELP {name} Information of the LLMEngine CacheConfig\n# TYPE {name} gauge\n\
             {name}{{block_size=\"{}\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\",\
             kv_offloading_backend=\"{}\",kv_offloading_size=\"{}\",\
             num_gpu_blocks=\"{}\",prefix_caching_hash_algo=\"xxhash\"}} 1.0",
            info.block_size,
            if info.offload_bytes.is_some() { "native" } else { "None" },
            info.offload_bytes
                .map_or("None".to_string(), |b| format!("{:?}", b as f64 / f64::from(1u32 << 30))),
            info.num_gpu_blocks
        );
        let name = "vllm:lora_requests_info";
        let _ = writeln!(
            out,
            "# HELP {name} Running stats on lora requests.\n# TYPE {name} gauge\n\
             {name}{{max_lora=\"{}\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\"}} 1.0",
            info.max_loras,
            escape(&running_loras),
            escape(&waiting_loras)
        );
        self.ttft.render(
            &mut out,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &labels,
        );
        self.e2e.render(
            &mut out,
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            &labels,
        );
        self.queue_time.render(
            &mut out,
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            &labels,
        );
        out
    }
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(text: &str, series: &str) -> f64 {
        text.lines()
            .find(|l| l.starts_with(series))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{series} not in\n{text}"))
    }

    #[test]
    fn renders_vllm_names_labels_and_buckets() {
        let m = SimMetrics::default();
        add(&m.prefix_cache_hits, 32);
        m.running.store(3, Ordering::Relaxed);
        m.ttft.observe(Duration::from_millis(30));
        m.ttft.observe(Duration::from_millis(300));
        let info = MetricsInfo {
            model_name: "m".into(),
            block_size: 16,
            num_gpu_blocks: 100,
            max_loras: 2,
            offload_bytes: Some(3 << 29),
        };
        add(&m.offload_load_bytes, 1 << 30);
        add(&m.offload_load_ns, 50_000_000);
        *m.lora_names.lock() = ("a".into(), String::new());
        let text = m.render(&info);
        let l = "{engine=\"0\",model_name=\"m\"}";
        assert_eq!(value(&text, &format!("vllm:num_requests_running{l}")), 3.0);
        assert_eq!(
            value(&text, &format!("vllm:prefix_cache_hits_total{l}")),
            32.0
        );
        assert_eq!(value(&text, "vllm:time_to_first_token_seconds_bucket{engine=\"0\",model_name=\"m\",le=\"0.04\"}"), 1.0);
        assert_eq!(value(&text, "vllm:time_to_first_token_seconds_bucket{engine=\"0\",model_name=\"m\",le=\"+Inf\"}"), 2.0);
        assert!(text.contains("block_size=\"16\""));
        assert!(text.contains("num_gpu_blocks=\"100\""));
        assert!(text.contains("running_lora_adapters=\"a\""));
        assert!(text.contains("kv_offloading_size=\"1.5\""), "GiB");
        let t = "{engine=\"0\",model_name=\"m\",transfer_type=\"CPU_to_GPU\"}";
        assert_eq!(
            value(&text, &format!("vllm:kv_offload_total_bytes_total{t}")),
            1073741824.0
        );
        assert_eq!(
            value(&text, &format!("vllm:kv_offload_total_time_total{t}")),
            0.05
        );
        m.reset();
        let text = m.render(&info);
        assert_eq!(
            value(&text, &format!("vllm:prefix_cache_hits_total{l}")),
            0.0
        );
        assert_eq!(
            value(&text, &format!("vllm:time_to_first_token_seconds_count{l}")),
            0.0
        );
    }
}
