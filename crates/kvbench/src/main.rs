//! `kvbench`: the benchmark tool. Generates seeded workloads, runs every policy of a plan on
//! the identical trace through Envoy + kvrouter against simulated replicas, and writes
//! `results.json`, `summary.json`, `report.md` and SVG plots. See `docs/bench.md`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
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
    /// Print a built-in plan (quick, full, smoke) to start your own from.
    Plan {
        /// Preset name.
        #[arg(default_value = "quick")]
        name: String,
    },
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// A built-in plan (quick, full, smoke) or a plan YAML file.
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
        Command::Plan { name } => match name.as_str() {
            "quick" => print!("{}", kvbench::plan::QUICK),
            "full" => print!("{}", kvbench::plan::FULL),
            "smoke" => print!("{}", kvbench::plan::SMOKE),
            other => {
                eprintln!("kvbench: no built-in plan {other:?} (quick, full, smoke)");
                return ExitCode::from(2);
            }
        },
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

fn run(mut args: RunArgs) -> ExitCode {
    // Processes run in their own directories: every path they get must be absolute.
    for p in [&mut args.out, &mut args.envoy, &mut args.tokenizers] {
        if let Ok(abs) = std::path::absolute(&*p) {
            *p = abs;
        }
    }
    let plan = match Plan::load(&args.plan) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("kvbench: {e}");
            return ExitCode::from(2);
        }
    };
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
