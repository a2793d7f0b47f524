use super::*;

fn corpus() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus")
}

/// A short run of every target: the seeds and a few thousand mutants, no crash, no violation.
#[test]
fn every_target_survives_a_short_run() {
    let body = Body::new(&testkit::shared_fixture());
    let targets: [(&dyn Target, u64); 4] = [
        (&body, 300),
        (&KvEvents, 20_000),
        (&Exposition, 5_000),
        (&Config, 2_000),
    ];
    for (target, execs) in targets {
        let seeds = seeds(target, &corpus());
        assert!(!seeds.is_empty(), "{}: no seeds", target.name());
        let r = fuzz(target, &seeds, execs, None, 7);
        assert_eq!(r.execs, execs, "{}", target.name());
        assert_eq!(
            (r.crashes, r.violations),
            (0, 0),
            "{}: {:?}",
            target.name(),
            r.first_failure
                .as_ref()
                .map(|(i, e)| (e, String::from_utf8_lossy(i).into_owned()))
        );
    }
}

#[test]
fn the_seeds_are_valid_inputs() {
    let body = Body::new(&testkit::shared_fixture());
    let bodies = seeds(&body, &corpus());
    assert_eq!(bodies.len(), 4);
    for b in &bodies {
        let api = if b.windows(11).any(|w| w == b"\"messages\":") {
            kvrouter::request::ApiKind::ChatCompletions
        } else {
            kvrouter::request::ApiKind::Completions
        };
        kvrouter::request::parse(api, b).unwrap_or_else(|e| panic!("{e}"));
    }
    let kv = KvEvents.built_seeds();
    assert_eq!(kv.len(), 4);
    for input in &kv {
        let topic_len = usize::from(input[0]);
        let frames = [
            &input[2..2 + topic_len],
            &input[2 + topic_len..10 + topic_len],
            &input[10 + topic_len..],
        ];
        kvrouter::events::wire::decode_message(&frames).unwrap_or_else(|e| panic!("{e}"));
    }
    let config = seeds(&Config, &corpus());
    assert_eq!(config.len(), 1);
    kvrouter::config::Config::parse_and_validate(std::str::from_utf8(&config[0]).unwrap(), "t")
        .unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn mutation_is_deterministic_per_seed() {
    let run = |seed| {
        let mut rng = Rng::new(seed);
        (0..50)
            .map(|_| mutate(&mut rng, b"{\"a\":[1,2]}", b"xyz", &[b"null"]))
            .collect::<Vec<_>>()
    };
    assert_eq!(run(3), run(3));
    assert_ne!(run(3), run(4));
}
