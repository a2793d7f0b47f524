//! `kvbench`: the benchmark tool. Generates seeded workloads, runs every policy of a plan on
//! the identical trace through Envoy + kvrouter against simulated replicas, and writes
//! `results.json`, `summary.json`, `report.md` and SVG plots. See `docs/bench.md`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kvbench::plan::{SeedSet, Shape, TraceSpec};
use kvbench::{self, Plan, Report, SuiteOptions};
use testkit::Binaries;

/// Benchmark kvrouter's routing policies on simulated replicas.
#[derive(Debug, Parser)]
#[command(name = "kvbench", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a plan and write the report.
    Run(RunArgs),
    /// Re-render report.md, summary.json and the plots from a results.json.
    Report {
        /// The results.json of an earlier run.
        results: PathBuf,
        /// Output directory. Default: the results file's directory.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Replay a request trace in the Mooncake format (`timestamp`, `input_length`,
    /// `output_length`, `hash_ids` of 512-token blocks) through every policy of the `replay`
    /// preset, to see which policy your traffic wants.
    Replay(ReplayArgs),
    /// Serve a null endpoint picker (ext_proc) that routes to the replicas in turn and does
    /// nothing else: what the protocol alone costs (scripts/overhead.sh's third path).
    NullExtproc {
        /// gRPC listen address: host:port, or unix:PATH.
        #[arg(long)]
        listen: kvrouter::envoyconf::ExtprocAddress,
        /// A replica address to route to (repeatable; in turn).
        #[arg(long = "replica", required = true)]
        replicas: Vec<std::net::SocketAddr>,
    },
    /// Print a built-in plan (quick, full, smoke, validate, replay, flow, routers, offload) to start
    /// your own from.
    Plan {
        /// Preset name.
        #[arg(default_value = "quick")]
        name: String,
    },
}

#[derive(Debug, clap::Args)]
struct ReplayArgs {
    /// The trace (JSONL, Mooncake format).
    #[arg(long)]
    trace: String,
    /// Start of the replayed window, seconds of trace time.
    #[arg(long, default_value_t = 0.0)]
    start_s: f64,
    /// Length of the window, seconds of trace time.
    #[arg(long, default_value_t = 300.0)]
    duration_s: f64,
    /// Trace time runs this many times faster.
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// Replicas in the fleet (of the preset's profile unless --profile).
    #[arg(long)]
    replicas: Option<usize>,
    /// kvsim profile of the replicas (they need KV for the trace's inputs).
    #[arg(long)]
    profile: Option<String>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// A built-in plan (quick, full, smoke, validate, replay, flow, routers, offload) or a plan YAML
    /// file.
    #[arg(long, default_value = "quick")]
    plan: String,
    /// Output directory.
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
    /// Envoy 1.40 binary.
    #[arg(long, env = "KVROUTER_ENVOY", default_value = ".venv/bin/envoy")]
    envoy: PathBuf,
    /// Directory holding tokenizer directories (qwen3/, llama3/, ...).
    #[arg(
        long,
        env = "KVROUTER_TOKENIZERS_DIR",
        default_value = ".cache/tokenizers"
    )]
    tokenizers: PathBuf,
    /// Only this workload (repeatable).
    #[arg(long = "workload")]
    workloads: Vec<String>,
    /// Only this policy label (repeatable).
    #[arg(long = "policy")]
    policies: Vec<String>,
    /// Seeds per cell (overrides the plan's `seeds`).
    #[arg(long)]
    seeds: Option<usize>,
    /// `tuning` or `report` (overrides the plan's `seed_set`): tune on one, report on the
    /// other; the two seed ranges are disjoint.
    #[arg(long, value_parser = parse_seed_set)]
    seed_set: Option<SeedSet>,
    /// Skip the router overhead measurement.
    #[arg(long)]
    no_overhead: bool,
    /// No progress bars.
    #[arg(long)]
    quiet: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Plan { name } => match kvbench::plan::preset(&name) {
            Some(text) => print!("{text}"),
            None => {
                eprintln!(
                    "kvbench: no built-in plan {name:?} (quick, full, smoke, validate, replay, flow, routers, offload)"
                );
                return ExitCode::from(2);
            }
        },
        Command::Replay(args) => return replay(args),
        Command::NullExtproc { listen, replicas } => {
            let served = tokio::runtime::Runtime::new()
                .map_err(|e| e.to_string())
                .and_then(|rt| rt.block_on(kvbench::null_extproc::serve(listen, &replicas)));
            if let Err(e) = served {
                eprintln!("kvbench: null-extproc: {e}");
                return ExitCode::from(1);
            }
        }
        Command::Report { results, out } => {
            let dir =
                out.unwrap_or_else(|| results.parent().map(PathBuf::from).unwrap_or_default());
            let done = Report::read(&results).and_then(|mut r| r.finish(&dir));
            if let Err(e) = done {
                eprintln!("kvbench: {e}");
                return ExitCode::from(1);
            }
            println!("kvbench: report in {}", dir.join("report.md").display());
        }
        Command::Run(args) => return run(args),
    }
    ExitCode::SUCCESS
}

fn parse_seed_set(s: &str) -> Result<SeedSet, String> {
    match s {
        "tuning" => Ok(SeedSet::Tuning),
        "report" => Ok(SeedSet::Report),
        other => Err(format!("{other:?}: expected tuning or report")),
    }
}

fn replay(mut args: ReplayArgs) -> ExitCode {
    if args.run.plan == "quick" {
        args.run.plan = "replay".into();
    }
    let mut plan = match Plan::load(&args.run.plan) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("kvbench: {e}");
            return ExitCode::from(2);
        }
    };
    // An existing file is made absolute; another name is looked up as shared/traces/<name>.
    let trace = if std::path::Path::new(&args.trace).is_file() {
        std::path::absolute(&args.trace)
            .map(|p| p.display().to_string())
            .unwrap_or(args.trace.clone())
    } else {
        args.trace.clone()
    };
    let Some(w) = plan.workloads.first_mut() else {
        eprintln!("kvbench: the plan has no workload to replay into");
        return ExitCode::from(2);
    };
    let old = match &w.shape {
        Shape::Trace(t) => t.clone(),
        _ => TraceSpec::default(),
    };
    w.shape = Shape::Trace(TraceSpec {
        path: trace,
        start_s: args.start_s,
        duration_s: args.duration_s,
        speedup: args.speedup,
        ..old
    });
    plan.workloads.truncate(1);
    for g in &mut plan.fleet {
        if let Some(p) = &args.profile {
            g.profile = p.clone();
            g.num_gpu_blocks = None;
        }
    }
    if let (Some(n), Some(g)) = (args.replicas, plan.fleet.first_mut()) {
        g.count = n;
        plan.fleet.truncate(1);
    }
    let errors = plan.validate();
    if !errors.is_empty() {
        eprintln!("kvbench: {}", errors.join("; "));
        return ExitCode::from(2);
    }
    run_plan_with(plan, args.run)
}

fn run(args: RunArgs) -> ExitCode {
    let plan = match Plan::load(&args.plan) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("kvbench: {e}");
            return ExitCode::from(2);
        }
    };
    run_plan_with(plan, args)
}

fn run_plan_with(mut plan: Plan, mut args: RunArgs) -> ExitCode {
    // Processes run in their own directories: every path they get must be absolute.
    for p in [&mut args.out, &mut args.envoy, &mut args.tokenizers] {
        if let Ok(abs) = std::path::absolute(&*p) {
            *p = abs;
        }
    }
    if let Some(n) = args.seeds {
        plan.seeds = n;
    }
    if let Some(set) = args.seed_set {
        plan.seed_set = set;
    }
    let errors = plan.validate();
    if !errors.is_empty() {
        eprintln!("kvbench: {}", errors.join("; "));
        return ExitCode::from(2);
    }
    let binaries = match Binaries::locate(args.envoy.clone()) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("kvbench: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvbench: {e}");
            return ExitCode::from(1);
        }
    };
    let options = SuiteOptions {
        binaries: binaries.clone(),
        tokenizers_dir: args.tokenizers,
        out_dir: args.out.clone(),
        progress: !args.quiet,
        workloads: args.workloads,
        policies: args.policies,
    };
    let result = runtime.block_on(async {
        let mut report = kvbench::run_plan(&plan, &options).await?;
        if let (Some(spec), false) = (&plan.overhead, args.no_overhead) {
            eprintln!("kvbench: router overhead");
            match kvbench::overhead::measure(
                spec,
                &binaries,
                &args.out.join("runs/overhead"),
                &plan.model,
            )
            .await
            {
                Ok(o) => report.overhead = Some(o),
                Err(e) => eprintln!("kvbench: router overhead not measured: {e}"),
            }
        }
        report.finish(&args.out)?;
        Ok::<_, kvbench::BenchError>(report)
    });
    match result {
        Ok(r) => {
            let failed = r.runs.iter().filter(|x| x.failed.is_some()).count();
            println!(
                "kvbench: {} runs ({} failed); report in {}",
                r.runs.len(),
                failed,
                args.out.join("report.md").display()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kvbench: {e}");
            ExitCode::from(1)
        }
    }
}
