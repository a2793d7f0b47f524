//! Tenancy end to end: real Envoy with a real `jwt_authn` filter (a local JWKS generated here,
//! real HS256 tokens), kvrouter, and kvsim replicas that key their cache by `cache_salt` as
//! vLLM does.
//!
//! What is proven: the tenant kvrouter acts on comes only from a verified token (a client's own
//! tenant header is stripped by the generated Envoy config), the router writes the tenant's
//! salt into the body in both body modes, so two tenants never share KV blocks inside the
//! engine even on one replica while one tenant does, and the engine's KV events for a tenant's
//! blocks land in the namespace the router hashes that tenant's prompts in.

use std::path::Path;
use std::time::Duration;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use kvrouter::envoyconf::{BodyMode, JwtOptions};
use testkit::*;

const TENANT_HEADER: &str = "x-tenant-id";
const ISSUER: &str = "https://issuer.kvrouter.test";

/// A signing key and the JWKS that publishes it.
struct Issuer {
    key: Vec<u8>,
}

impl Issuer {
    fn new() -> Issuer {
        Issuer {
            key: rand::random::<[u8; 32]>().to_vec(),
        }
    }

    /// Writes the JWKS Envoy verifies with; returns its path.
    fn write_jwks(&self, dir: &Path) -> std::path::PathBuf {
        let jwks = serde_json::json!({"keys": [{
            "kty": "oct", "alg": "HS256", "kid": "k1", "k": URL_SAFE_NO_PAD.encode(&self.key),
        }]});
        let path = dir.join("jwks.json");
        std::fs::write(&path, jwks.to_string()).unwrap();
        path
    }

    /// An HS256 token from [`ISSUER`] whose `tenant` claim is `tenant`.
    fn token(&self, tenant: &str) -> String {
        sign(&self.key, tenant)
    }
}

fn sign(key: &[u8], tenant: &str) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let header = URL_SAFE_NO_PAD.encode(r#"{"alg":"HS256","typ":"JWT","kid":"k1"}"#);
    let claims = serde_json::json!({
        "iss": ISSUER, "sub": "someone", "tenant": tenant, "iat": now, "exp": now + 3600,
    });
    let payload = URL_SAFE_NO_PAD.encode(claims.to_string());
    let signing_input = format!("{header}.{payload}");
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key);
    let tag = ring::hmac::sign(&key, signing_input.as_bytes());
    format!("{signing_input}.{}", URL_SAFE_NO_PAD.encode(tag.as_ref()))
}

fn fixture() -> String {
    shared_fixture().display().to_string()
}

/// A prompt long enough for several full blocks of the fixture's tokenizer.
fn body(question: &str) -> String {
    let system = "You answer questions about the quarterly logistics report in detail. ".repeat(20);
    serde_json::json!({
        "model": MODEL, "max_tokens": 2, "stream": false,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
    })
    .to_string()
}

async fn stack(replicas: usize, body_mode: BodyMode, jwks: &Path, extra: &str) -> Stack {
    let router_extra = format!(
        "models: [{{name: {MODEL}, tokenizer: \"{}\"}}]\n\
         tenancy: {{header: {TENANT_HEADER}}}\n{extra}",
        fixture()
    );
    let tokenizer = fixture();
    Stack::start(StackOptions {
        replicas,
        body_mode,
        router_extra: &router_extra,
        replica_flags: &["--tokenizer", &tokenizer],
        tenant_header: Some(TENANT_HEADER),
        jwt: Some(JwtOptions {
            issuer: ISSUER.into(),
            audiences: Vec::new(),
            jwks_file: jwks.to_path_buf(),
            tenant_claim: "tenant".into(),
            required: false,
        }),
        ..StackOptions::default()
    })
    .await
}

/// POSTs `body` through Envoy with extra headers; returns the reply and its `cached_tokens`.
async fn send(stack: &Stack, body: String, headers: &[(&str, String)]) -> (Reply, u64) {
    let mut req = stack
        .client
        .post(format!("http://{}/v1/chat/completions", stack.envoy.addr))
        .header("content-type", "application/json")
        .body(body);
    for (k, v) in headers {
        req = req.header(*k, v);
    }
    let r = reply(req.send().await.expect("POST through Envoy")).await;
    let cached = if r.status == 200 {
        serde_json::from_str::<serde_json::Value>(&r.body).expect("json")["usage"]
            ["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .expect("cached_tokens")
    } else {
        0
    };
    (r, cached)
}

fn bearer(token: &str) -> (&'static str, String) {
    ("authorization", format!("Bearer {token}"))
}

/// One replica: whatever the router picks, only the salt can keep tenants apart. `extra` is
/// more router config.
async fn tenants_share_nothing_in_one_engine(mode: BodyMode, extra: &str) {
    let dir = tempfile::tempdir().unwrap();
    let issuer = Issuer::new();
    let jwks = issuer.write_jwks(dir.path());
    let stack = stack(1, mode, &jwks, extra).await;
    let acme = bearer(&issuer.token("acme"));
    let globex = bearer(&issuer.token("globex"));

    let (first, cached) = send(&stack, body("Q1?"), std::slice::from_ref(&acme)).await;
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(cached, 0, "cold engine");
    let (again, cached) = send(&stack, body("Q2?"), std::slice::from_ref(&acme)).await;
    assert_eq!(again.status, 200, "{}", again.body);
    assert!(
        cached > 0,
        "one tenant shares its own prefix: {}",
        again.body
    );

    let (other, cached) = send(&stack, body("Q3?"), std::slice::from_ref(&globex)).await;
    assert_eq!(other.status, 200, "{}", other.body);
    assert_eq!(cached, 0, "another tenant never hits acme's blocks");

    // A client claiming to be acme without a token: the header is stripped before the router,
    // so no salt is written and the engine's unsalted namespace (cold) serves it.
    let forged = [(TENANT_HEADER, "acme".to_string())];
    let (f, cached) = send(&stack, body("Q4?"), &forged).await;
    assert_eq!(f.status, 200, "{}", f.body);
    assert_eq!(
        cached, 0,
        "a forged tenant header reaches nothing of acme's"
    );
    // Its own cache_salt does not get it there either: the router's salt is a keyed hash.
    let mut spoof: serde_json::Value = serde_json::from_str(&body("Q5?")).unwrap();
    spoof["cache_salt"] = "acme".into();
    let (s, cached) = send(&stack, spoof.to_string(), &forged).await;
    assert_eq!(s.status, 200, "{}", s.body);
    assert_eq!(cached, 0, "a client-chosen cache_salt is its own namespace");
    // The unsalted namespace is now warm: a second tenant-less request hits it (the check above
    // could have failed).
    let (plain, cached) = send(&stack, body("Q6?"), &[]).await;
    assert_eq!(plain.status, 200, "{}", plain.body);
    assert!(cached > 0, "tenant-less requests share among themselves");

    // A token carrying acme's tenant but a client-sent cache_salt: still inside acme's
    // isolation (a different salt from acme's plain one, so cold), and repeatable.
    let mut own: serde_json::Value = serde_json::from_str(&body("Q7?")).unwrap();
    own["cache_salt"] = "user-7".into();
    let (o1, cached) = send(&stack, own.to_string(), std::slice::from_ref(&acme)).await;
    assert_eq!(o1.status, 200, "{}", o1.body);
    assert_eq!(cached, 0, "the client's own salt splits within its tenant");
    own["messages"][1]["content"] = "Q8?".into();
    let (o2, cached) = send(&stack, own.to_string(), std::slice::from_ref(&acme)).await;
    assert_eq!(o2.status, 200, "{}", o2.body);
    assert!(cached > 0, "and is honoured consistently");

    // A chunked body (no content-length from the client) is salted the same way.
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> = body("Q10?")
        .into_bytes()
        .chunks(100)
        .map(|c| Ok(c.to_vec()))
        .collect();
    let streamed = stack
        .client
        .post(format!("http://{}/v1/chat/completions", stack.envoy.addr))
        .header("content-type", "application/json")
        .header(acme.0, &acme.1)
        .body(reqwest::Body::wrap_stream(futures::stream::iter(chunks)))
        .send()
        .await
        .expect("chunked POST");
    let streamed = reply(streamed).await;
    assert_eq!(streamed.status, 200, "{}", streamed.body);
    let cached = serde_json::from_str::<serde_json::Value>(&streamed.body).unwrap()["usage"]
        ["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > 0, "acme's own prefix, from a chunked body");

    // A token signed with another key is refused by Envoy before the router.
    let forged_token = bearer(&sign(b"not-the-issuers-key-0123456789ab", "acme"));
    let (bad, _) = send(&stack, body("Q9?"), &[forged_token]).await;
    assert_eq!(bad.status, 401, "{}", bad.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_share_nothing_in_one_engine_buffered() {
    tenants_share_nothing_in_one_engine(BodyMode::Buffered, "").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_share_nothing_in_one_engine_full_duplex() {
    tenants_share_nothing_in_one_engine(BodyMode::FullDuplex, "").await;
}

/// STREAMED with the body sent before the headers' reply: each chunk's reply carries its salted
/// bytes, and Envoy sends them upstream chunk-encoded (it drops the content-length itself).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_share_nothing_in_one_engine_early_streamed() {
    tenants_share_nothing_in_one_engine(BodyMode::Streamed, "").await;
}

/// Early STREAMED with tenancy: a body that pauses past `routing.streamed_body_pause_ms` is not
/// let go unrouted (it would reach the engine unsalted and unconfined), a tenant's or not: the
/// client gets kvrouter's 408 and no replica sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_paused_early_streamed_body_is_refused_not_sent_unsalted() {
    let dir = tempfile::tempdir().unwrap();
    let issuer = Issuer::new();
    let jwks = issuer.write_jwks(dir.path());
    let stack = stack(
        1,
        BodyMode::Streamed,
        &jwks,
        "routing: {streamed_body_pause_ms: 50}\n",
    )
    .await;
    let acme = bearer(&issuer.token("acme"));
    for headers in [vec![acme], Vec::new()] {
        let body = body("Paused?").into_bytes();
        // The pause is the stimulus: eight of the router's pause limits.
        let pause = async { tokio::time::sleep(Duration::from_millis(400)).await };
        let mut req = stack
            .client
            .post(format!("http://{}/v1/chat/completions", stack.envoy.addr))
            .header("content-type", "application/json")
            .body(split_upload(body, pause));
        for (k, v) in &headers {
            req = req.header(*k, v);
        }
        let r = reply(req.send().await.expect("POST through Envoy")).await;
        assert_eq!(r.status, 408, "{}", r.body);
        assert!(r.body.contains("paused"), "kvrouter's answer: {}", r.body);
        assert!(r.replica.is_none(), "{r:?}");
    }
    let decisions = metric_sum(stack.router.admin, "kvrouter_decisions_total").await;
    assert_eq!(decisions, 0.0, "neither was decided");
}

/// Every body here (~1.5 KiB) over the heavy threshold: Envoy's body message is decoded in the
/// heavy lane, not by the gRPC codec, and decided and salted there (what a near-limit body gets).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_share_nothing_in_one_engine_heavy_lane() {
    tenants_share_nothing_in_one_engine(BodyMode::Buffered, "routing: {heavy_body_bytes: 1024}\n")
        .await;
}

/// The engine's KV events for a tenant's blocks confirm the router's own view of that tenant:
/// with predictions expiring at once, the router still sees the tenant's prefix on the replica
/// that holds it (so both hash in the same namespace), and sees none of it for another tenant
/// or for no tenant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_confirm_the_tenants_namespace() {
    let dir = tempfile::tempdir().unwrap();
    let issuer = Issuer::new();
    let jwks = issuer.write_jwks(dir.path());
    // Explaining as a tenant needs the admin token (a cross-tenant oracle otherwise).
    let admin_token = dir.path().join("admin-token");
    std::fs::write(&admin_token, "tenancy-test-admin-token\n").unwrap();
    let router_extra = format!(
        "models: [{{name: {MODEL}, tokenizer: \"{}\"}}]\n\
         tenancy: {{header: {TENANT_HEADER}}}\n\
         cache_index: {{prediction_ttl_ms: 1}}\n\
         admin: {{auth_token_file: \"{}\"}}\n",
        fixture(),
        admin_token.display()
    );
    let tokenizer = fixture();
    let stack = Stack::start(StackOptions {
        replicas: 2,
        router_extra: &router_extra,
        replica_flags: &["--tokenizer", &tokenizer],
        kv_events: true,
        tenant_header: Some(TENANT_HEADER),
        jwt: Some(JwtOptions {
            issuer: ISSUER.into(),
            audiences: Vec::new(),
            jwks_file: jwks.clone(),
            tenant_claim: "tenant".into(),
            required: true,
        }),
        ..StackOptions::default()
    })
    .await;
    let acme = bearer(&issuer.token("acme"));
    let (first, _) = send(&stack, body("Q1?"), &[acme]).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let holder: std::net::SocketAddr = first.upstream.expect("upstream").parse().unwrap();

    let explain = |tenant: Option<&'static str>| {
        let client = stack.client.clone();
        let url = match tenant {
            Some(t) => format!("http://{}/debug/explain?tenant={t}", stack.router.admin),
            None => format!("http://{}/debug/explain", stack.router.admin),
        };
        async move {
            let v: serde_json::Value = client
                .post(url)
                .bearer_auth("tenancy-test-admin-token")
                .body(body("Q2?"))
                .send()
                .await
                .expect("explain")
                .json()
                .await
                .expect("explain json");
            candidate_row(&v, holder)["matched_tokens"]
                .as_u64()
                .expect("matched_tokens")
        }
    };
    let matched = eventually(
        "the engine's events to confirm acme's blocks",
        Duration::from_secs(10),
        || async { Some(explain(Some("acme")).await).filter(|&m| m > 0) },
    )
    .await;
    assert!(matched >= 16, "at least a block: {matched}");
    assert_eq!(explain(Some("globex")).await, 0, "another tenant");
    assert_eq!(explain(None).await, 0, "no tenant");

    // Required tokens: a request without one never reaches the router.
    let (none, _) = send(&stack, body("Q3?"), &[]).await;
    assert_eq!(none.status, 401, "{}", none.body);
}

/// Pools confined to tenants (`pools[].tenants`), through real Envoy: the tenant comes only
/// from a verified token, each tenant's requests reach only its own pool's replicas (even with a
/// forged tenant header), and a request whose tenant may use no pool serving the model gets a
/// 403 with an OpenAI-style error that does not carry the prompt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_confined_to_pools_reach_only_their_replicas() {
    const MARKER: &str = "Zq7xPOOLxSECRETx12";
    let dir = tempfile::tempdir().unwrap();
    let issuer = Issuer::new();
    let jwks = issuer.write_jwks(dir.path());
    let stack = stack(3, BodyMode::Buffered, &jwks, "").await;
    let [r0, r1, r2] = [0, 1, 2].map(|i| stack.replicas[i].addr);
    // r0 and r1 serve acme only, r2 globex only; no pool is open to everyone.
    let pools = format!(
        "server:\n  reload_interval_ms: 50\n\
         envoy:\n  eds_path: {eds}\n\
         models: [{{name: {MODEL}, tokenizer: \"{tokenizer}\"}}]\n\
         tenancy: {{header: {TENANT_HEADER}}}\n\
         pools:\n\
         \x20 - name: acme-pool\n    models: [{MODEL}]\n    tenants: [acme]\n\
         \x20   endpoints: [{{address: \"{r0}\"}}, {{address: \"{r1}\"}}]\n\
         \x20 - name: globex-pool\n    models: [{MODEL}]\n    tenants: [globex]\n\
         \x20   endpoints: [{{address: \"{r2}\"}}]\n",
        eds = stack.dir.path().join("eds.json").display(),
        tokenizer = fixture(),
    );
    let file = dir.path().join("pools.yaml");
    std::fs::write(&file, &pools).unwrap();
    check_config(&kvrouter_bin(), &file).unwrap();
    stack.reload(&pools).await;

    let acme = bearer(&issuer.token("acme"));
    let globex = bearer(&issuer.token("globex"));
    let served_by = |r: &Reply| -> std::net::SocketAddr {
        assert_eq!(r.status, 200, "{}", r.body);
        r.upstream.as_deref().expect("upstream").parse().unwrap()
    };
    // Distinct prompts, so a policy free to choose would spread them over all three replicas.
    let prompt = |i: usize| {
        serde_json::json!({
            "model": MODEL, "max_tokens": 2,
            "messages": [{"role": "user", "content": format!("{MARKER} distinct question {i} ").repeat(30)}],
        })
        .to_string()
    };
    let mut acme_upstreams = std::collections::BTreeSet::new();
    for i in 0..8 {
        let (r, _) = send(&stack, prompt(i), std::slice::from_ref(&acme)).await;
        acme_upstreams.insert(served_by(&r));
        // globex's token with acme's name in the tenant header: the header is Envoy's to set.
        let forged = [globex.clone(), (TENANT_HEADER, "acme".to_string())];
        let (r, _) = send(&stack, prompt(100 + i), &forged).await;
        assert_eq!(served_by(&r), r2, "globex stays on its pool");
    }
    assert!(
        acme_upstreams.iter().all(|a| [r0, r1].contains(a)),
        "acme only on its pool: {acme_upstreams:?}"
    );

    // No pool for these: a token of another tenant, no token with a forged header, no token.
    let initech = bearer(&issuer.token("initech"));
    let forged_only = (TENANT_HEADER, "acme".to_string());
    for headers in [vec![initech], vec![forged_only], vec![]] {
        let (r, _) = send(&stack, prompt(200), &headers).await;
        assert_eq!(r.status, 403, "{headers:?}: {}", r.body);
        let v: serde_json::Value = serde_json::from_str(&r.body).expect("JSON error body");
        assert_eq!(v["error"]["type"], "permission_error", "{}", r.body);
        assert!(!r.body.contains(MARKER), "the prompt leaked: {}", r.body);
    }
}
