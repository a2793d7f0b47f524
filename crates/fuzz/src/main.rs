//! `kvfuzz`: runs the targets (all, or `--target NAME`) and prints executions, time,
//! executions per second, crashes and invariant violations; exits 1 if any.
//!
//! `cargo run --release -p kvfuzz -- --execs 1000000 [--target body] [--seconds 60]
//! [--seed 1] [--tokenizer DIR]`. `--execs` is per target; the body target tokenizes with the
//! shared vLLM capture's SmolLM2 tokenizer unless `--tokenizer` names another directory.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kvfuzz::{fuzz, seeds, Body, Config, Exposition, KvEvents, Target};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let execs: u64 = value("--execs").map_or(100_000, |v| v.parse().expect("--execs N"));
    let seconds = value("--seconds").map(|v| Duration::from_secs(v.parse().expect("--seconds N")));
    let seed: u64 = value("--seed").map_or(1, |v| v.parse().expect("--seed N"));
    let only = value("--target");
    let tokenizer = value("--tokenizer")
        .map(PathBuf::from)
        .unwrap_or_else(testkit::shared_fixture);
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");

    let body = Body::new(&tokenizer);
    let targets: [&dyn Target; 4] = [&body, &KvEvents, &Exposition, &Config];
    let mut failed = false;
    let mut total = 0;
    println!("target        execs      seconds  execs/s   seeds  crashes  violations");
    for target in targets {
        if only.as_deref().is_some_and(|o| o != target.name()) {
            continue;
        }
        let seeds = seeds(target, &corpus);
        let r = fuzz(target, &seeds, execs, seconds, seed);
        total += r.execs;
        println!(
            "{:<12} {:>9} {:>10.1} {:>8.0} {:>7} {:>8} {:>11}",
            r.target,
            r.execs,
            r.seconds,
            r.execs as f64 / r.seconds.max(1e-9),
            r.seeds,
            r.crashes,
            r.violations
        );
        if let Some((input, what)) = &r.first_failure {
            failed = true;
            println!("  first failure: {what}");
            println!(
                "  input ({} bytes): {:?}",
                input.len(),
                String::from_utf8_lossy(input)
            );
        }
    }
    println!("total executions: {total}");
    if failed {
        std::process::exit(1);
    }
}
