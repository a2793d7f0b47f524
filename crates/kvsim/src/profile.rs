//! Step-time profiles: how long one engine step (one forward pass over the scheduled batch)
//! takes on a given model and GPU.
//!
//! The model (continuous batching, one step = one forward pass):
//!
//! ```text
//! step_ms = fixed_ms
//!         + max(weight_read_ms, (prefill_tokens + decode_seqs) * per_token_ms)
//!         + attn_prefill_ms * Σ_prefill q_i * (ctx_i + q_i / 2)
//!         + kv_read_ms      * Σ_decode ctx_j
//! ```
//!
//! `q_i` is the number of new tokens a prefill chunk computes and `ctx_i` the tokens already in
//! KV before it, cached prefix included: a cached prefix skips its linear (MLP/projection) cost
//! but the new tokens still attend over it. `ctx_j` is a decoding sequence's context length.
//! The `max` is the memory-bound floor: a small batch still reads all the weights once.
//!
//! Constants are roofline-derived from datasheet peaks with explicit efficiency factors and
//! cross-checked against published measurements; treat them as ±30 %. Sources, for Llama-3.1-8B
//! in BF16 (16.06 GB of weights, ~16 GFLOP per token in the linear layers, ~0.52 MFLOP per
//! query×context token of attention, 128 KiB of KV per token):
//! - H100 SXM: 989 TFLOPS dense BF16, 3.35 TB/s (NVIDIA datasheet); 50 % MFU for prefill and
//!   75 % of peak bandwidth for weight/KV reads. Cross-check: llm-d's calibrated peak prefill
//!   throughput of 15.9k tok/s for Qwen3-32B TP=2 on 2×H100 (≈52 % MFU) and
//!   llm-d-inference-sim's 8B/H100 latency profile (ITL 10–15 ms at batch 1 incl. server
//!   overhead).
//! - A100-80GB SXM: 312 TFLOPS, 2.04 TB/s, same efficiency factors; vLLM's batch defaults for
//!   GPUs under 70 GiB or A100 (2048 batched tokens, 256 sequences).
//! - L4: 121 TFLOPS, 300 GB/s, 24 GB (40 % MFU); A10G: ~70 TFLOPS effective, 600 GB/s, 24 GB.
//!
//! KV capacity at `gpu_memory_utilization` 0.9: ~400k tokens (25,000 blocks of 16) on 80 GB
//! cards after 16 GB of weights and ~3 GB of activations/CUDA graphs; ~25k tokens on 24 GB
//! cards.

use std::time::Duration;

/// The profile used when a replica names none.
pub const DEFAULT_PROFILE: &str = "h100-llama3-8b";

/// Constants of the step-time model, plus the vLLM defaults that go with the GPU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepProfile {
    /// Profile name.
    pub name: &'static str,
    /// CPU scheduling plus kernel launch per step, in ms.
    pub fixed_ms: f64,
    /// Reading all weights once (the batch-1 decode floor), in ms.
    pub weight_read_ms: f64,
    /// Linear-layer cost per prefill token or decode sequence, in ms.
    pub per_token_ms: f64,
    /// Prefill attention per (new token × context token), in ms.
    pub attn_prefill_ms: f64,
    /// Decode KV read per context token per sequence, in ms.
    pub kv_read_ms: f64,
    /// Default KV blocks on the GPU (vLLM's null block included).
    pub num_gpu_blocks: u32,
    /// Default `max_num_seqs` (vLLM `get_batch_defaults` for this GPU class).
    pub max_num_seqs: u32,
    /// Default `max_num_batched_tokens` (vLLM API-server default for this GPU class).
    pub max_num_batched_tokens: u32,
}

const BUILTIN: [StepProfile; 4] = [
    StepProfile {
        name: "h100-llama3-8b",
        fixed_ms: 1.0,
        weight_read_ms: 6.4,
        per_token_ms: 0.032,
        attn_prefill_ms: 1.3e-6,
        kv_read_ms: 5.2e-5,
        num_gpu_blocks: 25_000,
        max_num_seqs: 1024,
        max_num_batched_tokens: 8192,
    },
    StepProfile {
        name: "a100-llama3-8b",
        fixed_ms: 1.0,
        weight_read_ms: 10.5,
        per_token_ms: 0.10,
        attn_prefill_ms: 4.2e-6,
        kv_read_ms: 8.6e-5,
        num_gpu_blocks: 25_000,
        max_num_seqs: 256,
        max_num_batched_tokens: 2048,
    },
    StepProfile {
        name: "l4-llama3-8b",
        fixed_ms: 1.5,
        weight_read_ms: 71.0,
        per_token_ms: 0.33,
        attn_prefill_ms: 1.1e-5,
        kv_read_ms: 5.8e-4,
        num_gpu_blocks: 1_563,
        max_num_seqs: 256,
        max_num_batched_tokens: 2048,
    },
    StepProfile {
        name: "a10g-llama3-8b",
        fixed_ms: 1.5,
        weight_read_ms: 36.0,
        per_token_ms: 0.45,
        attn_prefill_ms: 1.5e-5,
        kv_read_ms: 2.9e-4,
        num_gpu_blocks: 1_563,
        max_num_seqs: 256,
        max_num_batched_tokens: 2048,
    },
];

/// One scheduled request's share of a step, as the cost model sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepWork {
    /// A prefill chunk of `new_tokens` on top of `context_tokens` already in KV.
    Prefill {
        /// Tokens computed this step.
        new_tokens: u32,
        /// Tokens already in KV (cached prefix and earlier chunks).
        context_tokens: u32,
    },
    /// One decode token for a sequence with `context_tokens` in KV.
    Decode {
        /// Context length.
        context_tokens: u32,
    },
}

impl StepProfile {
    /// A built-in profile by name.
    pub fn builtin(name: &str) -> Option<StepProfile> {
        BUILTIN.iter().find(|p| p.name == name).copied()
    }

    /// Names of the built-in profiles.
    pub fn builtin_names() -> Vec<&'static str> {
        BUILTIN.iter().map(|p| p.name).collect()
    }

    /// Simulated duration of one step doing `work`, in ms.
    pub fn step_ms(&self, work: impl IntoIterator<Item = StepWork>) -> f64 {
        let mut linear_tokens = 0u64;
        let mut attention_ms = 0.0;
        for w in work {
            match w {
                StepWork::Prefill {
                    new_tokens,
                    context_tokens,
                } => {
                    let q = f64::from(new_tokens);
                    linear_tokens += u64::from(new_tokens);
                    attention_ms +=
                        self.attn_prefill_ms * q * (f64::from(context_tokens) + q / 2.0);
                }
                StepWork::Decode { context_tokens } => {
                    linear_tokens += 1;
                    attention_ms += self.kv_read_ms * f64::from(context_tokens);
                }
            }
        }
        let linear_ms = (linear_tokens as f64 * self.per_token_ms).max(self.weight_read_ms);
        self.fixed_ms + linear_ms + attention_ms
    }

    /// Simulated ms of prefilling `new_tokens` on `cached_tokens` of context in steps of at most
    /// `chunk_tokens` (chunked prefill, nothing else in the batch).
    pub fn prefill_ms(&self, cached_tokens: u32, new_tokens: u32, chunk_tokens: u32) -> f64 {
        let mut done = 0;
        let mut total = 0.0;
        while done < new_tokens {
            let q = (new_tokens - done).min(chunk_tokens.max(1));
            total += self.step_ms([StepWork::Prefill {
                new_tokens: q,
                context_tokens: cached_tokens + done,
            }]);
            done += q;
        }
        total
    }
}

/// `ms` of simulated time as a real duration under `time_scale` (simulated time runs
/// `time_scale` times faster). Rounded to the nanosecond.
pub fn scaled(ms: f64, time_scale: f64) -> Duration {
    let nanos = (ms * 1e6 / time_scale).round();
    if nanos.is_finite() && nanos > 0.0 {
        Duration::from_nanos(nanos as u64)
    } else {
        Duration::ZERO
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h100() -> StepProfile {
        StepProfile::builtin("h100-llama3-8b").unwrap()
    }

    #[test]
    fn worked_examples_from_the_research_notes() {
        // 8192-token prefill, empty cache: 1 + 262.1 + 1.3e-6*8192*4096 (43.6) ≈ 306.8 ms.
        let cold = h100().step_ms([StepWork::Prefill {
            new_tokens: 8192,
            context_tokens: 0,
        }]);
        assert!((cold - 306.8).abs() < 0.5, "{cold}");
        // Batch-1 decode is the weight-read floor: 1 + 6.4 ms (+ KV read).
        let decode = h100().step_ms([StepWork::Decode { context_tokens: 0 }]);
        assert!((decode - 7.4).abs() < 1e-9, "{decode}");
        // 64 sequences × 2k context: 7.4 + 64*2048*5.2e-5 ≈ 14.2 ms.
        let batch = h100().step_ms((0..64).map(|_| StepWork::Decode {
            context_tokens: 2048,
        }));
        assert!((batch - 14.2).abs() < 0.1, "{batch}");
    }

    #[test]
    fn cached_context_is_cheaper_but_not_free() {
        for profile in BUILTIN {
            let cold = profile.prefill_ms(0, 4096, profile.max_num_batched_tokens);
            let warm = profile.prefill_ms(3072, 1024, profile.max_num_batched_tokens);
            let no_context = profile.prefill_ms(0, 1024, profile.max_num_batched_tokens);
            assert!(warm < cold, "{}", profile.name);
            assert!(
                warm > no_context,
                "{}: attention over the cached prefix costs",
                profile.name
            );
        }
    }

    #[test]
    fn scaled_divides_and_rounds() {
        assert_eq!(scaled(10.0, 1.0), Duration::from_millis(10));
        assert_eq!(scaled(10.0, 4.0), Duration::from_micros(2500));
        assert_eq!(scaled(1e-7, 1.0), Duration::ZERO);
        assert_eq!(scaled(f64::NAN, 1.0), Duration::ZERO);
    }

    #[test]
    fn builtin_names_resolve() {
        let names = StepProfile::builtin_names();
        assert!(names.contains(&"a100-llama3-8b"), "{names:?}");
        for name in names {
            assert_eq!(StepProfile::builtin(name).unwrap().name, name);
        }
        assert!(StepProfile::builtin("nope").is_none());
    }
}
