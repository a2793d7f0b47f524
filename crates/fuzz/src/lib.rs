//! Mutation fuzzing of kvrouter's untrusted-input parsers on stable Rust (no nightly, no
//! libFuzzer): each target starts from a seed corpus (`corpus/<target>/`, plus seeds built in
//! code where the input is binary), mutates a seed per execution (bit flips, interesting bytes,
//! dictionary tokens, deletions, duplications, splices with another seed, truncation) and runs
//! the input through the router's own code, checking the target's invariants.
//!
//! A crash is a panic (caught per execution and counted, with the first input kept); a
//! violation is a broken invariant (e.g. an error message quoting the body).
//!
//! # Layout
//! - this file: [`Rng`], [`mutate`], [`Target`], [`fuzz`] and its [`Report`];
//! - `targets`: the four targets and their invariants.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::time::{Duration, Instant};

mod targets;

pub use targets::{Body, Config, Exposition, KvEvents, MARKER};

/// xorshift64*: a small deterministic generator, so a run is reproducible from its seed.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed` (0 is replaced: xorshift must not start at 0).
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A value in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }
}

/// Bytes that often matter to parsers.
const INTERESTING: &[u8] = &[
    0, 0x7f, 0x80, 0xff, b'"', b'\\', b'[', b']', b'{', b'}', b',', b':',
];

/// One to eight mutations of `input` (`other` is another seed to splice from; `dict` holds
/// tokens of the target's format).
pub fn mutate(rng: &mut Rng, input: &[u8], other: &[u8], dict: &[&[u8]]) -> Vec<u8> {
    let mut out = input.to_vec();
    for _ in 0..1 + rng.below(8) {
        let at = rng.below(out.len() + 1);
        match rng.below(8) {
            0 if !out.is_empty() => {
                let i = rng.below(out.len());
                out[i] ^= 1 << rng.below(8);
            }
            1 if !out.is_empty() => {
                let i = rng.below(out.len());
                out[i] = INTERESTING[rng.below(INTERESTING.len())];
            }
            2 if !dict.is_empty() => {
                let token = dict[rng.below(dict.len())];
                out.splice(at..at, token.iter().copied());
            }
            3 if !out.is_empty() => {
                let start = rng.below(out.len());
                let len = 1 + rng.below((out.len() - start).min(16));
                out.drain(start..start + len);
            }
            4 if !out.is_empty() => {
                // Duplicate a range (grows repetition: nesting, long arrays).
                let start = rng.below(out.len());
                let len = 1 + rng.below((out.len() - start).min(64));
                let copy = out[start..start + len].to_vec();
                for _ in 0..1 + rng.below(4) {
                    out.splice(at..at, copy.iter().copied());
                }
            }
            5 if !other.is_empty() => {
                let start = rng.below(other.len());
                let len = 1 + rng.below(other.len() - start);
                out.splice(at..at, other[start..start + len].iter().copied());
            }
            6 => out.truncate(at),
            _ => {
                let digits = rng.next_u64().to_string();
                out.splice(at..at, digits.bytes());
            }
        }
    }
    out
}

/// A fuzzing target: seeds, format tokens and one execution.
pub trait Target {
    /// Its name on the command line and in `corpus/`.
    fn name(&self) -> &'static str;
    /// Seeds built in code (binary formats), added to the corpus files.
    fn built_seeds(&self) -> Vec<Vec<u8>> {
        Vec::new()
    }
    /// Tokens of the format, inserted by [`mutate`].
    fn dictionary(&self) -> &'static [&'static [u8]];
    /// Runs one input; `Err` is a broken invariant.
    fn run(&self, input: &[u8]) -> Result<(), String>;
}

/// What a run of one target did.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// The target.
    pub target: &'static str,
    /// Executions.
    pub execs: u64,
    /// Wall time, seconds.
    pub seconds: f64,
    /// Executions that panicked.
    pub crashes: u64,
    /// Executions that broke an invariant.
    pub violations: u64,
    /// The first failing input and what failed, if any.
    pub first_failure: Option<(Vec<u8>, String)>,
    /// Seeds the run started from.
    pub seeds: usize,
}

/// The seeds of `target`: the files under `corpus/<name>/` in `corpus_root`, then its built ones.
pub fn seeds(target: &dyn Target, corpus_root: &Path) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    if let Ok(dir) = std::fs::read_dir(corpus_root.join(target.name())) {
        let mut paths: Vec<_> = dir.flatten().map(|e| e.path()).collect();
        paths.sort();
        out.extend(paths.iter().filter_map(|p| std::fs::read(p).ok()));
    }
    out.extend(target.built_seeds());
    out
}

/// Runs `target` for `execs` executions or until `time_limit`, from `seeds`, with `rng_seed`.
/// Seeds themselves run first, unmutated. Panics are caught (the default hook is silenced for
/// the run and restored after).
pub fn fuzz(
    target: &dyn Target,
    seeds: &[Vec<u8>],
    execs: u64,
    time_limit: Option<Duration>,
    rng_seed: u64,
) -> Report {
    assert!(!seeds.is_empty(), "{}: no seeds", target.name());
    let mut rng = Rng::new(rng_seed);
    let mut report = Report {
        target: target.name(),
        seeds: seeds.len(),
        ..Report::default()
    };
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let started = Instant::now();
    let dict = target.dictionary();
    while report.execs < execs {
        if time_limit.is_some_and(|t| started.elapsed() >= t) {
            break;
        }
        let i = report.execs as usize;
        let input = if i < seeds.len() {
            seeds[i].clone()
        } else {
            let base = &seeds[rng.below(seeds.len())];
            let other = &seeds[rng.below(seeds.len())];
            mutate(&mut rng, base, other, dict)
        };
        let outcome = catch_unwind(AssertUnwindSafe(|| target.run(&input)));
        report.execs += 1;
        let failure = match outcome {
            Ok(Ok(())) => None,
            Ok(Err(e)) => {
                report.violations += 1;
                Some(e)
            }
            Err(panic) => {
                report.crashes += 1;
                let message = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                Some(format!("panic: {message}"))
            }
        };
        if let (Some(e), None) = (failure, &report.first_failure) {
            report.first_failure = Some((input, e));
        }
    }
    report.seconds = started.elapsed().as_secs_f64();
    std::panic::set_hook(hook);
    report
}

#[cfg(test)]
mod tests;
