//! Endpoint ids under churn: endpoints come and go through the discovery sink (as DNS and
//! Kubernetes sources publish), the ids of departed ones are reused, and nothing of a departed
//! endpoint (cache entries, in-flight requests) is ever attributed to the one reusing its id.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::ID_REUSE_GRACE_MS;
use crate::config::{Config, ResolvedEndpoint};
use crate::discovery::Endpoint;
use crate::index::EndpointId;
use crate::request::{self, ApiKind};
use crate::router::{ticket, Decision, RouteContext, Router};
use crate::telemetry::Metrics;

const STATIC: &str = r#"
policy: {name: prefix-affinity}
pools:
  - name: a
    models: [m]
    endpoints: [{address: 127.0.0.1:8001}]
"#;

/// A DNS pool whose endpoints push their KV events (no socket needed).
const PUSHED: &str = r#"
policy: {name: prefix-affinity}
pools:
  - name: d
    models: [m]
    dns: {name: localhost, port: 8000}
    kv_events: {push: true}
"#;

fn router() -> Router {
    router_with(STATIC)
}

fn router_with(yaml: &str) -> Router {
    Router::new(
        Config::parse_and_validate(yaml, "test").unwrap(),
        Arc::new(Metrics::new()),
        Path::new("."),
    )
    .unwrap()
}

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// Endpoints a discovery source found for the config's pool `a` (as DNS and Kubernetes sources publish
/// their pool's endpoints: a pool the config does not have admits no request).
fn discovered(ports: impl IntoIterator<Item = u16>) -> Vec<ResolvedEndpoint> {
    ports
        .into_iter()
        .map(|p| ResolvedEndpoint::new(addr(p), "a", &["m"]))
        .collect()
}

/// A chat request for `text`, repeated to span several blocks.
fn body(text: &str) -> Vec<u8> {
    let content = format!("{text}. ").repeat(10);
    serde_json::json!({"model": "m", "messages": [{"role": "user", "content": content}]})
        .to_string()
        .into_bytes()
}

/// Decides a request for `to` (alone in the subset), committing it as routing does.
fn decide_to(r: &Router, to: SocketAddr, text: &str) -> Decision {
    let body = body(text);
    let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
    let subset = [to];
    let ctx = RouteContext {
        subset: Some(&subset),
        ..RouteContext::default()
    };
    let d = r.decide(&r.snapshot(), &req, ctx).unwrap();
    assert_eq!(d.primary().address, to);
    d
}

fn endpoint(r: &Router, at: SocketAddr) -> Arc<Endpoint> {
    r.tables.registry.snapshot().get(&at).cloned().unwrap()
}

fn in_flight(ep: &Endpoint) -> u64 {
    ep.load.snapshot().in_flight_requests
}

/// Blocks of `hashes` the index credits to `id`.
fn held(r: &Router, hashes: &[u64], id: EndpointId) -> u32 {
    r.tables.index.lookup(hashes, &[id])[0].blocks
}

async fn pass(ms: u64) {
    tokio::time::advance(Duration::from_millis(ms)).await;
}

#[tokio::test(start_paused = true)]
async fn ten_thousand_addresses_through_discovery_take_few_ids_and_bounded_memory() {
    const ALIVE: u16 = 4;
    const ADDRESSES: u16 = 10_000;
    const STEP_MS: u64 = 1_000;
    let r = router();
    let sink = r.handles().discovery;
    let text = "the same question, asked of every replica in turn";
    let (mut highest, mut warm_heap, mut prompt_blocks) = (0, 0, 0);
    for n in 0..ADDRESSES {
        // A sliding window: one new address in, the oldest out.
        let first = 20_000 + n.saturating_sub(ALIVE - 1);
        sink.publish("dns:x", discovered(first..=20_000 + n));
        prompt_blocks = decide_to(&r, addr(20_000 + n), text)
            .plan
            .prefix
            .block_hashes
            .len();
        let set = r.tables.registry.snapshot();
        highest = set.all().iter().map(|e| e.id).max().unwrap().max(highest);
        pass(STEP_MS).await;
        if n == 1_000 {
            warm_heap = r.tables.index.stats().heap_bytes;
        }
    }
    // Alive: the static endpoint and ALIVE discovered; quarantined: those that left within
    // the grace period (one a step), plus the step's newcomer leased before the reclaim.
    let quarantined = (ID_REUSE_GRACE_MS / STEP_MS) as u32 + 1;
    let bound = 1 + u32::from(ALIVE) + quarantined;
    assert!(highest <= bound, "highest id {highest}, bound {bound}");
    let counts = r.tables.registry.interner().counts();
    assert_eq!(counts.in_use, 1 + usize::from(ALIVE));
    assert!(counts.quarantined <= quarantined as usize, "{counts:?}");
    let stats = r.tables.index.stats();
    assert!(
        stats.endpoints.len() <= bound as usize + 1,
        "{} endpoint states",
        stats.endpoints.len()
    );
    let departed = stats
        .endpoints
        .iter()
        .filter(|e| r.tables.registry.interner().address(e.endpoint).is_none())
        .count();
    assert_eq!(departed, 0, "no state for a freed id");
    // Only the discovered endpoints alive hold entries: each its own copy of the one prompt.
    assert!(prompt_blocks > 0);
    assert_eq!(stats.blocks, prompt_blocks);
    assert_eq!(stats.entries, prompt_blocks * usize::from(ALIVE));
    assert!(
        stats.heap_bytes <= warm_heap * 2,
        "heap {} after 10,000 addresses, {warm_heap} after 1,000",
        stats.heap_bytes
    );
    let metrics = r.handles().admin.metrics_text();
    assert!(
        metrics.contains("kvrouter_endpoint_ids{state=\"in_use\"} 5"),
        "{metrics}"
    );
    let reclaimed: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("kvrouter_endpoint_ids_reclaimed_total "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        reclaimed >= u64::from(ADDRESSES) - u64::from(bound),
        "{reclaimed}"
    );
}

/// A request routed to an endpoint that then leaves (its ticket held, and a decision planned
/// before the removal but committed after it) keeps the endpoint's id from reuse; once the last
/// of them ends and the grace period passes, a new address gets the id with nothing of the old
/// endpoint: no cache entries, no in-flight count.
#[tokio::test(start_paused = true)]
async fn nothing_of_a_departed_endpoint_reaches_the_one_that_reuses_its_id() {
    let r = router();
    let sink = r.handles().discovery;
    let old = addr(9001);
    sink.publish("dns:x", discovered([9001]));
    let old_ep = endpoint(&r, old);
    let old_id = old_ep.id;
    let held_ticket = decide_to(&r, old, "the first question");
    let hashes = held_ticket.plan.prefix.block_hashes.clone();
    assert!(held(&r, &hashes, old_id) > 0);
    // Planned before the removal, committed after: its prediction lands on the departed id.
    let late_text = "a question decided as the endpoint left";
    let late_body = body(late_text);
    let late_req = request::parse(ApiKind::ChatCompletions, &late_body).unwrap();
    let state = r.snapshot();
    let subset = [old];
    let ctx = RouteContext {
        subset: Some(&subset),
        ..RouteContext::default()
    };
    let late_plan = r.plan(&state, &late_req, ctx).unwrap();
    let late_hashes = late_plan.prefix.block_hashes.clone();

    let change = sink.publish("dns:x", Vec::new());
    assert_eq!(change.removed, vec![old]);
    assert_eq!(held(&r, &hashes, old_id), 0, "cleared as it left");
    let late = ticket::commit(&r.tables, &state, late_plan, Instant::now(), "");
    drop(state);
    assert!(
        held(&r, &late_hashes, old_id) > 0,
        "written after the clear"
    );
    assert_eq!(in_flight(&old_ep), 2);

    // Long past the grace period, while the requests run, new endpoints come and go: none
    // gets the departed id.
    for port in 9100..9110 {
        pass(ID_REUSE_GRACE_MS * 2).await;
        sink.publish("dns:x", discovered([port]));
        let ep = endpoint(&r, addr(port));
        assert_ne!(
            ep.id, old_id,
            "{port} got the id of a departed endpoint still held"
        );
        assert_eq!(in_flight(&ep), 0);
    }
    assert_eq!(r.tables.registry.interner().address(old_id), Some(old));

    // The requests end: their counts go back to the departed endpoint's own load.
    drop(held_ticket);
    drop(late);
    assert_eq!(in_flight(&old_ep), 0);
    drop(old_ep);
    let interner = Arc::clone(r.tables.registry.interner());
    // The next change of the set starts its quarantine; it ends a grace period later.
    sink.publish("dns:x", discovered([9200]));
    assert_ne!(endpoint(&r, addr(9200)).id, old_id);
    pass(ID_REUSE_GRACE_MS - 1).await;
    sink.publish("dns:x", discovered([9200]));
    assert_eq!(
        interner.get(&old),
        Some(old_id),
        "still in its grace period"
    );
    pass(1).await;
    sink.publish("dns:x", discovered([9200]));
    assert_eq!(interner.get(&old), None, "freed and unmapped");
    sink.publish("dns:x", discovered([9200, 9201]));
    let new_ep = endpoint(&r, addr(9201));
    assert_eq!(new_ep.id, old_id, "the lowest free id is reused");
    assert_eq!(held(&r, &hashes, new_ep.id), 0);
    assert_eq!(
        held(&r, &late_hashes, new_ep.id),
        0,
        "the late write went too"
    );
    assert_eq!(in_flight(&new_ep), 0);
    let mine = decide_to(&r, addr(9201), "a question for the newcomer");
    assert_eq!(in_flight(&new_ep), 1);
    drop(mine);
    assert_eq!(in_flight(&new_ep), 0);
    // The departed address, back now, is a new endpoint with a new id.
    sink.publish("dns:x", discovered([9200, 9201, 9001]));
    assert_ne!(endpoint(&r, old).id, old_id);
}

#[tokio::test(start_paused = true)]
async fn an_endpoint_back_within_its_grace_period_keeps_its_id() {
    let r = router();
    let sink = r.handles().discovery;
    sink.publish("dns:x", discovered([9001, 9002]));
    let id = endpoint(&r, addr(9001)).id;
    sink.publish("dns:x", discovered([9002]));
    pass(ID_REUSE_GRACE_MS / 2).await;
    sink.publish("dns:x", discovered([9002, 9003]));
    assert_ne!(endpoint(&r, addr(9003)).id, id, "quarantined, not free");
    sink.publish("dns:x", discovered([9001, 9002, 9003]));
    assert_eq!(
        endpoint(&r, addr(9001)).id,
        id,
        "the same endpoint, the same id"
    );
    // Its quarantine starts over when it leaves again.
    sink.publish("dns:x", discovered([9002, 9003]));
    pass(ID_REUSE_GRACE_MS - 1).await;
    sink.publish("dns:x", discovered([9002, 9003]));
    assert_eq!(r.tables.registry.interner().get(&addr(9001)), Some(id));
    pass(1).await;
    sink.publish("dns:x", discovered([9002, 9003]));
    assert_eq!(r.tables.registry.interner().get(&addr(9001)), None);
}

/// A KV-event stream holds its endpoint's id as well: an endpoint gone from the set keeps its
/// id until its stream goes too (the next `sync_events`), and a batch pushed for the departed
/// address never reaches the endpoint that reuses the id.
#[tokio::test(start_paused = true)]
async fn a_kv_event_stream_holds_its_endpoints_id_until_it_goes() {
    use crate::events::wire::Batch;
    use crate::events::PushError;
    let r = router_with(PUSHED);
    let sink = r.handles().discovery;
    let push = r.handles().kv_push;
    let pool = |ports: &[u16]| {
        ports
            .iter()
            .map(|&p| ResolvedEndpoint::new(addr(p), "d", &["m"]))
            .collect::<Vec<_>>()
    };
    let batch = || Batch {
        ts_s: 0.0,
        events: Vec::new(),
        dp_rank: None,
    };
    let messages = |r: &Router, at: SocketAddr| {
        r.tables
            .events
            .status()
            .iter()
            .find(|s| s.address == at)
            .map(|s| s.counters.messages)
    };
    let old = addr(9001);
    sink.publish("dns:d", pool(&[9001]));
    r.sync_events().await.unwrap();
    let old_id = endpoint(&r, old).id;
    push.apply(old, 0, batch()).unwrap();
    assert_eq!(messages(&r, old), Some(1));

    sink.publish("dns:d", Vec::new());
    pass(ID_REUSE_GRACE_MS * 2).await;
    sink.publish("dns:d", pool(&[9002]));
    assert_ne!(
        endpoint(&r, addr(9002)).id,
        old_id,
        "its stream still holds it"
    );
    // The stream follows the set; the id's quarantine starts with it gone.
    r.sync_events().await.unwrap();
    assert_eq!(messages(&r, old), None);
    pass(ID_REUSE_GRACE_MS).await;
    sink.publish("dns:d", pool(&[9002]));
    sink.publish("dns:d", pool(&[9002, 9003]));
    assert_eq!(
        endpoint(&r, addr(9003)).id,
        old_id,
        "reused once the stream went"
    );
    r.sync_events().await.unwrap();
    assert_eq!(messages(&r, addr(9003)), Some(0), "a fresh stream");
    assert_eq!(
        push.apply(old, 1, batch()),
        Err(PushError::UnknownEndpoint(old))
    );
    assert_eq!(messages(&r, addr(9003)), Some(0));
}
