use clap::Parser;

fn main() -> std::process::ExitCode {
    kvrouter::cli::run(kvrouter::cli::Cli::parse())
}
