//! The targets: what each feeds to the router's code and which invariants it checks.

use std::path::Path;
use std::time::{Duration, Instant};

use kvrouter::config::{EngineKind, ModelConfig};
use kvrouter::load::exposition::{self, MetricNames};
use kvrouter::prefix::{Namespace, TokenizerRegistry};
use kvrouter::request::{self, ApiKind, RequestLimits};

use super::Target;

/// Planted in the body seeds: no parser error may quote it.
pub const MARKER: &str = "MARKER";

/// Request bodies, parsed as chat, completion and embedding requests (with small shape limits,
/// so the over-limit paths run too), then identified through the real SmolLM2 tokenizer and
/// chat template within a 100 ms deadline. Invariants: no panic; no error message or `param`
/// contains [`MARKER`].
pub struct Body {
    registry: TokenizerRegistry,
    ns: Namespace,
}

impl Body {
    /// With the tokenizer (and chat template) in `tokenizer_dir`.
    pub fn new(tokenizer_dir: &Path) -> Body {
        let model = ModelConfig {
            name: "m".into(),
            tokenizer: Some(tokenizer_dir.display().to_string()),
            ..ModelConfig::default()
        };
        Body {
            registry: TokenizerRegistry::from_config(&[model], Path::new("/"))
                .expect("load the fuzzing tokenizer"),
            ns: Namespace::new("m", None, None),
        }
    }
}

impl Target for Body {
    fn name(&self) -> &'static str {
        "body"
    }

    fn dictionary(&self) -> &'static [&'static [u8]] {
        &[
            b"\"messages\":",
            b"\"prompt\":",
            b"\"input\":",
            b"\"content\":",
            b"{\"type\":\"image_url\",\"image_url\":{\"url\":\"u\"}}",
            b"{\"type\":\"text\",\"text\":\"MARKER\"}",
            b"{\"role\":\"user\",\"content\":\"MARKER\"}",
            b"\"role\":",
            b"null",
            b"true",
            b"-1e999",
            b"18446744073709551616",
            b"\\ud800",
            b"\\u0000",
            b"[[[[",
            b"\"MARKER\"",
        ]
    }

    fn run(&self, input: &[u8]) -> Result<(), String> {
        let limits = RequestLimits {
            max_messages: 64,
            max_content_parts: 128,
        };
        for api in [
            ApiKind::ChatCompletions,
            ApiKind::Completions,
            ApiKind::Embeddings,
        ] {
            match request::parse_with(api, input, limits) {
                Ok(parsed) => {
                    let deadline = Instant::now() + Duration::from_millis(100);
                    let id = self
                        .registry
                        .identify_until(&parsed, &self.ns, Some(deadline));
                    if id.block_hashes.len() as u64 * u64::from(id.block_size_tokens) > id.tokens {
                        return Err(format!(
                            "{api:?}: {} hashed blocks for {} tokens",
                            id.block_hashes.len(),
                            id.tokens
                        ));
                    }
                }
                Err(e) => {
                    let message = e.to_string();
                    if message.contains(MARKER) || e.param().is_some_and(|p| p.contains(MARKER)) {
                        return Err(format!("{api:?}: the error quotes the body: {message}"));
                    }
                }
            }
        }
        Ok(())
    }
}

/// KV-event messages through `kvrouter::events::wire::decode_message`. The input is split into
/// frames: byte 0 is the topic length, byte 1 picks 1..=4 frames, then the topic, an 8-byte
/// sequence and the msgpack payload. Invariant: no panic.
pub struct KvEvents;

/// A `[ts, events, dp_rank]` payload.
fn payload(events: Vec<rmpv::Value>, rank: i64) -> Vec<u8> {
    let v = rmpv::Value::Array(vec![
        rmpv::Value::F64(1.7e9),
        rmpv::Value::Array(events),
        rmpv::Value::from(rank),
    ]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &v).expect("encode");
    out
}

fn kv_input(topic: &[u8], seq: u64, payload: &[u8]) -> Vec<u8> {
    let mut out = vec![topic.len() as u8, 2];
    out.extend_from_slice(topic);
    out.extend_from_slice(&seq.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

impl Target for KvEvents {
    fn name(&self) -> &'static str {
        "kv-events"
    }

    fn built_seeds(&self) -> Vec<Vec<u8>> {
        use rmpv::Value as V;
        let ints = |xs: &[u64]| V::Array(xs.iter().map(|&x| V::from(x)).collect());
        let stored = V::Array(vec![
            V::from("BlockStored"),
            ints(&[11, 12]),
            V::Nil,
            ints(&(0..32).collect::<Vec<_>>()),
            V::from(16),
            V::Nil,
            V::from("GPU"),
            V::Nil,
        ]);
        let removed = V::Array(vec![V::from("BlockRemoved"), ints(&[11]), V::from("GPU")]);
        let cleared = V::Array(vec![V::from("AllBlocksCleared")]);
        let as_map = V::Map(vec![
            (V::from("ts"), V::F64(1.0)),
            (V::from("events"), V::Array(vec![cleared.clone()])),
            (V::from("data_parallel_rank"), V::from(1)),
        ]);
        let mut map_payload = Vec::new();
        rmpv::encode::write_value(&mut map_payload, &as_map).expect("encode");
        vec![
            kv_input(b"", 0, &payload(vec![stored.clone()], 0)),
            kv_input(b"kv@10.0.0.1", 7, &payload(vec![removed, stored], 3)),
            kv_input(b"kv", 1, &payload(vec![cleared], 0)),
            kv_input(b"", 2, &map_payload),
        ]
    }

    fn dictionary(&self) -> &'static [&'static [u8]] {
        &[
            b"\xdd\xff\xff\xff\xff",
            b"\xdc\xff\xff",
            b"\xdf\xff\xff\xff\xff",
            b"\xc4\xff",
            b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff",
            b"\xabBlockStored",
            b"\xacBlockRemoved",
            b"\xb0AllBlocksCleared",
            b"\x91\x91\x91\x91",
            b"\xc0",
        ]
    }

    fn run(&self, input: &[u8]) -> Result<(), String> {
        let (head, rest) = input.split_at(input.len().min(2));
        let topic_len = head.first().map_or(0, |&b| usize::from(b)).min(rest.len());
        let n = 1 + head.get(1).map_or(2, |&b| usize::from(b % 4));
        let (topic, rest) = rest.split_at(topic_len);
        let (seq, payload) = rest.split_at(rest.len().min(8));
        let frames: Vec<&[u8]> = [topic, seq, payload, &[]][..n].to_vec();
        let _ = kvrouter::events::wire::decode_message(&frames);
        Ok(())
    }
}

/// Prometheus expositions through the scrape parser, for vLLM's and SGLang's metric names.
/// Invariant: no panic.
pub struct Exposition;

impl Target for Exposition {
    fn name(&self) -> &'static str {
        "exposition"
    }

    fn dictionary(&self) -> &'static [&'static [u8]] {
        &[
            b"vllm:num_requests_waiting",
            b"vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"99999999999999999999\"} 1\n",
            b"sglang:max_total_num_tokens",
            b"{a=\"\\\"\"}",
            b" NaN\n",
            b" +Inf\n",
            b" -1e308\n",
            b"# TYPE x gauge\n",
            b"\n",
        ]
    }

    fn run(&self, input: &[u8]) -> Result<(), String> {
        let text = String::from_utf8_lossy(input);
        for kind in [EngineKind::Vllm, EngineKind::Sglang] {
            if let Some(names) = MetricNames::of(kind) {
                let _ = exposition::parse(&names, &text, tokio::time::Instant::now());
            }
        }
        Ok(())
    }
}

/// Config files through `Config::parse_and_validate`. Invariant: no panic.
pub struct Config;

impl Target for Config {
    fn name(&self) -> &'static str {
        "config"
    }

    fn dictionary(&self) -> &'static [&'static [u8]] {
        &[
            b"pools:\n",
            b"  - name: x\n",
            b"{bind: \"tcp://*:0\"}",
            b"{connect: \"tcp://{ip}:{port}\"}",
            b"'{address}'",
            b"[::1]:0",
            b"max_message_bytes: 0",
            b"&a [*a]",
            b"!!binary aGk=",
            b": -1",
            b": 1e400",
        ]
    }

    fn run(&self, input: &[u8]) -> Result<(), String> {
        let text = String::from_utf8_lossy(input);
        let _ = kvrouter::config::Config::parse_and_validate(&text, "fuzz");
        Ok(())
    }
}
