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
        &[
            ("127.0.0.1:8001".parse().unwrap(), false),
            ("127.0.0.1:8002".parse().unwrap(), true),
        ],
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
        for body_mode in [BodyMode::Buffered, BodyMode::FullDuplex, BodyMode::Streamed] {
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

#[test]
fn tenant_header_stripping_and_jwt_variants_validate() {
    let cwd = tempfile::tempdir().unwrap();
    std::fs::write(
        cwd.path().join("jwks.json"),
        r#"{"keys":[{"kty":"oct","alg":"HS256","kid":"k","k":"c2VjcmV0LXNlY3JldC1zZWNyZXQtc2VjcmV0"}]}"#,
    )
    .unwrap();
    let jwt = |required: bool, audiences: Vec<String>| kvrouter::envoyconf::JwtOptions {
        issuer: "https://issuer.example".into(),
        audiences,
        jwks_file: cwd.path().join("jwks.json"),
        tenant_claim: "org".into(),
        required,
    };
    let variants = [
        (None, false),
        (Some(jwt(false, Vec::new())), true),
        (Some(jwt(true, vec!["kvrouter".into(), "llm".into()])), true),
    ];
    for (jwt, has_filter) in variants {
        let options = EnvoyOptions {
            tenant_header: Some("x-tenant-id".into()),
            jwt,
            ..EnvoyOptions::default()
        };
        let y = render(&options);
        // The client's tenant header goes in the early mutation, before any filter.
        let early = y.find("early_header_mutation_extensions").unwrap();
        let strip = y.find("- remove: x-tenant-id").expect("stripped");
        let filters = y.find("http_filters:").unwrap();
        assert!(early < strip && strip < filters, "{y}");
        assert_eq!(y.contains("envoy.filters.http.jwt_authn"), has_filter);
        if has_filter {
            let jwt_at = y.find("envoy.filters.http.jwt_authn").unwrap();
            let picker = y.find("envoy.filters.http.ext_proc").unwrap();
            assert!(
                jwt_at < picker,
                "the tenant is set before the picker reads it"
            );
            assert!(y.contains("claim_to_headers: [{header_name: x-tenant-id, claim_name: org}]"));
        }
        // The picker fails closed (a request it did not salt never reaches an engine); the
        // observer, which changes nothing, still fails open.
        let picker = y.find("stat_prefix: kvrouter\n").expect("picker");
        let observer = y.find("stat_prefix: kvrouter_observe").expect("observer");
        let after = |at: usize| {
            y[at..]
                .find("failure_mode_allow: ")
                .map(|i| &y[at + i..at + i + 24])
        };
        assert_eq!(after(picker), Some("failure_mode_allow: fals"), "{y}");
        assert_eq!(after(observer), Some("failure_mode_allow: true"), "{y}");
        let file = cwd.path().join("tenant.yaml");
        std::fs::write(&file, &y).unwrap();
        validate(&file, cwd.path());
    }
    // Without a tenant header nothing is stripped and no JWT filter is rendered.
    let plain = render(&EnvoyOptions {
        jwt: Some(jwt(true, Vec::new())),
        ..EnvoyOptions::default()
    });
    assert!(!plain.contains("jwt_authn"));
    assert!(
        !plain.contains("failure_mode_allow: false"),
        "no tenancy: fails open"
    );
}
