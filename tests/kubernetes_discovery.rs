//! The Kubernetes discovery source against RECORDED API responses (`tests/data/kubernetes/`)
//! replayed over real HTTP by `kube_api` (no kube-apiserver can run here): list + watch, readiness
//! flips, a pod added, terminating and deleted, bookmarks, a watch that ends and resumes from the
//! last version, `410 Gone` and the relist that follows, and an InferencePool whose selector and
//! ports change and which is then deleted.

mod kube_api;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kube_api::{key, list, watch, watch_text, ApiServer};
use kvrouter::config::{PoolConfig, ResolvedEndpoint};
use kvrouter::discovery::kubernetes::KubernetesDiscovery;
use kvrouter::discovery::{Discovery, EndpointSink, Published, Registry, SetChange};

const PODS: &str = "/api/v1/namespaces/llm/pods";
const POOLS: &str = "/apis/inference.networking.k8s.io/v1/namespaces/llm/inferencepools";
const WAIT: Duration = Duration::from_secs(20);

/// `(address, draining)` of every endpoint, sorted.
fn endpoints(reg: &Registry) -> Vec<(String, bool)> {
    let mut eps: Vec<(String, bool)> = reg
        .snapshot()
        .all()
        .iter()
        .map(|e| (e.address.to_string(), e.draining))
        .collect();
    eps.sort();
    eps
}

/// Waits until the registry holds exactly `want` (address, draining).
async fn until(reg: &Registry, want: &[(&str, bool)], what: &str) {
    let want: Vec<(String, bool)> = want.iter().map(|(a, d)| (a.to_string(), *d)).collect();
    let mut versions = reg.subscribe();
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if endpoints(reg) == want {
            return;
        }
        if tokio::time::timeout_at(deadline, versions.changed())
            .await
            .is_err()
        {
            panic!("{what}: want {want:?}, have {:?}", endpoints(reg));
        }
    }
}

/// Waits until `server` has seen `n` requests containing `needle`.
async fn requested(server: &ApiServer, needle: &str, n: usize) -> Vec<String> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let seen = server.requests_with(needle);
        if seen.len() >= n {
            return seen;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{n} requests with {needle:?} expected; all requests: {:#?}",
            server.requests()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The discovery source of the pods labelled `app=qwen3-8b` (port 8000) on `server`, its
/// registry and what it publishes to (the kubeconfig lives in `dir`).
fn pods_source(
    server: &ApiServer,
    dir: &std::path::Path,
) -> (Arc<Registry>, Arc<Published>, Arc<KubernetesDiscovery>) {
    let pool = pool(
        "label_selector: app=qwen3-8b, port: 8000",
        &server.kubeconfig(dir),
    );
    let reg = Arc::new(Registry::new(&[]));
    let published = Arc::new(Published::new(reg.clone()));
    let source = Arc::new(KubernetesDiscovery::new(&pool).unwrap());
    (reg, published, source)
}

fn pool(yaml_kubernetes: &str, kubeconfig: &std::path::Path) -> PoolConfig {
    serde_norway::from_str(&format!(
        "{{name: qwen3-8b, models: [qwen3-8b], kubernetes: {{kubeconfig: {}, {yaml_kubernetes}}}}}",
        kubeconfig.display()
    ))
    .unwrap()
}

/// Counts publishes, to show an unchanged list is not republished.
struct Counting {
    inner: Arc<Registry>,
    publishes: std::sync::atomic::AtomicUsize,
}

impl EndpointSink for Counting {
    fn publish(&self, source: &str, endpoints: Vec<ResolvedEndpoint>) -> SetChange {
        self.publishes
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.publish_source(source, endpoints)
    }
    fn remove(&self, source: &str) -> SetChange {
        self.inner.remove_source(source)
    }
}

#[tokio::test]
async fn pods_of_a_label_selector_follow_readiness_deletion_bookmarks_and_410_relists() {
    let server = ApiServer::start().await;
    let selector = "labelSelector=app%3Dqwen3-8b";
    server.script(
        key("list", PODS, selector),
        vec![list("pods-list-1.json"), list("pods-list-2.json")],
    );
    server.script(
        key("watch", PODS, selector),
        vec![
            watch("pods-watch-1.jsonl", true),
            // Held back until stage 3, so the state before the relist can be seen.
            kube_api::watch_text(
                &format!("# stage 3\n{}", kube_api::recording("pods-watch-2.jsonl")),
                false,
            ),
        ],
    );
    let dir = tempfile::tempdir().unwrap();
    let (reg, published, source) = pods_source(&server, dir.path());
    assert_eq!(source.key(), "kubernetes:qwen3-8b");
    let key = vec![source.key()];
    assert!(!published.all_published(&key), "nothing listed yet");
    let task = tokio::spawn(source.run(published.clone()));

    // The list, then the watch's first event: pod b turns ready.
    until(
        &reg,
        &[("10.244.1.5:8000", false), ("10.244.2.7:8000", false)],
        "listed, then b ready",
    )
    .await;
    assert!(
        published.all_published(&key),
        "the first list counts as synced"
    );
    let first = requested(&server, "watch=true", 1).await;
    assert!(
        first[0].contains("resourceVersion=1000"),
        "watch from the list's version: {first:?}"
    );
    let a: SocketAddr = "10.244.1.5:8000".parse().unwrap();
    let ep = reg.snapshot().get(&a).cloned().unwrap();
    assert_eq!(&*ep.source, "kubernetes:qwen3-8b");
    assert_eq!(ep.models, vec!["qwen3-8b"]);
    let in_flight = ep.load.begin(100);

    // a's readiness probe fails: it drains, keeping its in-flight request; c is added without
    // an IP (nothing), gets one unready (draining), then turns ready.
    server.stage(1);
    until(
        &reg,
        &[
            ("10.244.1.5:8000", true),
            ("10.244.2.7:8000", false),
            ("10.244.3.9:8000", false),
        ],
        "a unready, c ready",
    )
    .await;
    let drained = reg.snapshot().get(&a).cloned().unwrap();
    assert!(
        Arc::ptr_eq(&drained.load, &ep.load),
        "the drained endpoint keeps its load state"
    );
    assert_eq!(drained.load.snapshot().in_flight_requests, 1);

    // a terminates (still draining), then is deleted: it leaves the pool and its in-flight
    // request still finishes on its guard. A bookmark advances the version; the server ends the
    // watch; the next one resumes from the bookmark's version.
    server.stage(2);
    until(
        &reg,
        &[("10.244.2.7:8000", false), ("10.244.3.9:8000", false)],
        "a deleted",
    )
    .await;
    drop(in_flight);
    assert_eq!(
        ep.load.snapshot().in_flight_requests,
        0,
        "released after removal"
    );
    let watches = requested(&server, "watch=true", 2).await;
    assert!(
        watches[1].contains("resourceVersion=1100"),
        "resumed from the bookmark: {watches:?}"
    );
    assert_eq!(server.requests_with("limit=500").len(), 1, "no relist yet");

    // That watch gets 410 Gone (version too old): a fresh list (b, c and a new d), then a watch
    // from the new list's version.
    server.stage(3);
    until(
        &reg,
        &[
            ("10.244.1.11:8000", false),
            ("10.244.2.7:8000", false),
            ("10.244.3.9:8000", false),
        ],
        "relisted after 410",
    )
    .await;
    assert_eq!(server.requests_with("limit=500").len(), 2, "one relist");
    let watches = requested(&server, "watch=true", 3).await;
    assert!(watches[2].contains("resourceVersion=1200"), "{watches:?}");
    for r in server.requests() {
        assert!(r.contains("labelSelector=app%3Dqwen3-8b"), "{r}");
    }
    task.abort();
}

#[tokio::test]
async fn an_inference_pool_defines_the_pods_and_ports_and_its_changes_are_followed() {
    let server = ApiServer::start().await;
    let by_name = "fieldSelector=metadata.name%3Dqwen3-8b";
    let v1 = "labelSelector=app%3Dqwen3-8b";
    let v2 = "labelSelector=app%3Dqwen3-8b%2Cversion%3Dv2";
    server.script(key("list", POOLS, by_name), vec![list("pool-list.json")]);
    server.script(
        key("watch", POOLS, by_name),
        vec![watch("pool-watch.jsonl", false)],
    );
    server.script(key("list", PODS, v1), vec![list("pool-pods-list-1.json")]);
    server.script(key("list", PODS, v2), vec![list("pool-pods-list-2.json")]);
    let dir = tempfile::tempdir().unwrap();
    let pool = pool(
        "inference_pool: qwen3-8b, namespace: llm",
        &server.kubeconfig(dir.path()),
    );
    let reg = Arc::new(Registry::new(&[]));
    let counting = Arc::new(Counting {
        inner: reg.clone(),
        publishes: Default::default(),
    });
    let source = Arc::new(KubernetesDiscovery::new(&pool).unwrap());
    let task = tokio::spawn(source.run(counting.clone()));

    until(
        &reg,
        &[("10.244.1.5:8000", false), ("10.244.2.7:8000", false)],
        "the pool's pods",
    )
    .await;
    // The gateway writing the pool's status and a bookmark change nothing: no relist of pods,
    // no republish.
    requested(
        &server,
        "watch=true&allowWatchBookmarks=true&timeoutSeconds=290&resourceVersion=2001",
        1,
    )
    .await;
    assert_eq!(
        server
            .requests_with(v1)
            .iter()
            .filter(|r| !r.contains("watch=true"))
            .count(),
        1
    );
    assert_eq!(
        counting.publishes.load(std::sync::atomic::Ordering::SeqCst),
        1
    );

    // The selector gains `version: v2` and the ports become [8000, 8001]: the pods are listed
    // again with the new selector; e serves both ports, f only 8001 (its active-ports
    // annotation); the v1 pods leave.
    server.stage(1);
    until(
        &reg,
        &[
            ("10.244.4.3:8000", false),
            ("10.244.4.3:8001", false),
            ("10.244.5.8:8001", false),
        ],
        "the new selector's pods",
    )
    .await;
    assert_eq!(
        server
            .requests_with(v2)
            .iter()
            .filter(|r| !r.contains("watch=true"))
            .count(),
        1
    );

    // The pool is deleted: its endpoints are withdrawn.
    server.stage(2);
    until(&reg, &[], "pool deleted").await;
    assert_eq!(
        server
            .requests_with(by_name)
            .iter()
            .filter(|r| !r.contains("watch=true"))
            .count(),
        1,
        "the pool was listed once and then watched"
    );
    task.abort();
}

#[tokio::test]
async fn a_wrong_token_is_retried_and_nothing_is_published() {
    let server = ApiServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = server.kubeconfig(dir.path());
    let text = std::fs::read_to_string(&kubeconfig).unwrap();
    std::fs::write(&kubeconfig, text.replace(kube_api::TOKEN, "wrong")).unwrap();
    server.script(
        key("list", PODS, "labelSelector=app%3Dqwen3-8b"),
        vec![list("pods-list-1.json")],
    );
    let pool = pool("label_selector: app=qwen3-8b, port: 8000", &kubeconfig);
    let reg = Arc::new(Registry::new(&[]));
    let published = Arc::new(Published::new(reg.clone()));
    let source = Arc::new(KubernetesDiscovery::new(&pool).unwrap());
    let key = vec![source.key()];
    let task = tokio::spawn(source.run(published.clone()));
    // Two attempts (the second after the backoff), both refused.
    requested(&server, "labelSelector", 2).await;
    assert!(!published.all_published(&key));
    assert!(reg.snapshot().all().is_empty());
    task.abort();
}

#[tokio::test]
async fn a_watch_that_ends_at_once_is_resumed_after_a_growing_backoff() {
    // A proxy that answers a watch and closes it at once: without a backoff the reflector would
    // turn this into a request loop against the API server (client-go backs off too).
    let server = ApiServer::start().await;
    let selector = "labelSelector=app%3Dqwen3-8b";
    server.script(key("list", PODS, selector), vec![list("pods-list-1.json")]);
    server.script(
        key("watch", PODS, selector),
        (0..100).map(|_| watch_text("", true)).collect(),
    );
    let dir = tempfile::tempdir().unwrap();
    let (reg, published, source) = pods_source(&server, dir.path());
    let task = tokio::spawn(source.run(published.clone()));
    requested(&server, "watch=true", 3).await;
    // The second watch waits the first backoff (200 ms), the third the doubled one (400 ms):
    // timed where the server received them.
    let at = server.arrivals_with("watch=true");
    let waited = at[2] - at[0];
    assert!(
        waited >= Duration::from_millis(600),
        "three watches within {waited:?}"
    );
    assert!(
        server.requests_with("watch=true").len() < 10,
        "{:#?}",
        server.requests()
    );
    // The pods listed are still published meanwhile.
    assert!(!reg.snapshot().all().is_empty());
    task.abort();
}
