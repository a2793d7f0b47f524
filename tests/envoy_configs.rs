//! The configs shipped in `envoy/` are what `kvrouter envoy-config` renders, and real Envoy 1.40
//! accepts each of them (`envoy --mode validate`).

use std::path::Path;
use std::process::Command;

use kvrouter::envoyconf::{
    message_timeout_for_wait, render, BodyMode, ClusterStyle, EnvoyOptions, Replicas,
};
use testkit::{envoy_bin, repo};

fn shipped() -> Vec<(&'static str, EnvoyOptions)> {
    let eds = || Replicas::EdsFile(".run/eds.json".into());
    vec![
        (
            "local-stack.yaml",
            EnvoyOptions {
                replicas: eds(),
                // examples/kvrouter.yaml queues requests for up to 5 s.
                message_timeout_ms: message_timeout_for_wait(5000),
                ..EnvoyOptions::default()
            },
        ),
        (
            "local-stack-full-duplex.yaml",
            EnvoyOptions {
                replicas: eds(),
                body_mode: BodyMode::FullDuplex,
                message_timeout_ms: message_timeout_for_wait(5000),
                ..EnvoyOptions::default()
            },
        ),
        (
            "original-dst.yaml",
            EnvoyOptions {
                cluster: ClusterStyle::OriginalDst,
                ..EnvoyOptions::default()
            },
        ),
    ]
}

#[test]
fn shipped_configs_match_the_generator() {
    for (file, options) in shipped() {
        let on_disk = std::fs::read_to_string(repo().join("envoy").join(file)).unwrap();
        assert!(
            on_disk == render(&options),
            "envoy/{file} is out of date: regenerate it with `kvrouter envoy-config` (see docs/envoy.md)"
        );
    }
}

fn validate(config: &Path, cwd: &Path) {
    let out = Command::new(envoy_bin())
        .args(["--mode", "validate", "-c"])
        .arg(config)
        .current_dir(cwd)
        .output()
        .expect("run envoy");
    assert!(
        out.status.success(),
        "{} rejected by Envoy:\n{}",
        config.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn every_config_in_envoy_dir_validates() {
    // The EDS-based configs read `.run/eds.json` relative to Envoy's working directory.
    let cwd = tempfile::tempdir().unwrap();
    kvrouter::envoyconf::write_eds(
        &cwd.path().join(".run/eds.json"),
        1,
        &["127.0.0.1:8001".parse().unwrap()],
    )
    .unwrap();
    let mut checked = 0;
    for entry in std::fs::read_dir(repo().join("envoy")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            validate(&path, cwd.path());
            checked += 1;
        }
    }
    assert!(checked >= 3, "found {checked} configs");
}

#[test]
fn every_generator_variant_validates() {
    let cwd = tempfile::tempdir().unwrap();
    kvrouter::envoyconf::write_eds(&cwd.path().join("eds.json"), 1, &[]).unwrap();
    for cluster in [ClusterStyle::OverrideHost, ClusterStyle::OriginalDst] {
        for body_mode in [BodyMode::Buffered, BodyMode::FullDuplex] {
            for replicas in [
                Replicas::EdsFile("eds.json".into()),
                Replicas::Static(vec!["[::1]:8001".parse().unwrap()]),
            ] {
                let options = EnvoyOptions {
                    cluster,
                    body_mode,
                    replicas,
                    destination_header: "x-my.dest+header".into(),
                    ..EnvoyOptions::default()
                };
                let file = cwd.path().join("variant.yaml");
                std::fs::write(&file, render(&options)).unwrap();
                validate(&file, cwd.path());
                let bare = EnvoyOptions {
                    attach: false,
                    ..options
                };
                let y = render(&bare);
                assert!(!y.contains("envoy.filters.http.ext_proc"));
                std::fs::write(&file, y).unwrap();
                validate(&file, cwd.path());
            }
        }
    }
}
