//! Clients that hang up before the first response byte, through the real Envoy 1.40: kvrouter
//! must give back the load it counted for them within seconds (the picker stream's end releases
//! the ticket), not when a request time limit sweeps it minutes later.

use std::time::Duration;

use testkit::*;

/// How many clients hang up.
const ABANDONED: usize = 150;

/// How long the in-flight gauges may take to return to 0 once the clients are gone: the
/// observer's grace (1 s) plus a sweep tick (250 ms), with room for a loaded machine.
const RELEASE_DEADLINE: Duration = Duration::from_secs(5);

async fn in_flight_gauges(admin: std::net::SocketAddr) -> Vec<f64> {
    let m = router_metrics(admin).await;
    [
        "kvrouter_endpoint_in_flight_requests",
        "kvrouter_endpoint_in_flight_prefill_tokens",
    ]
    .iter()
    .flat_map(|name| m.named(name).map(|s| s.value))
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_hanging_up_before_the_first_byte_release_their_load_within_seconds() {
    let stack = Stack::start(StackOptions {
        replicas: 2,
        ..StackOptions::default()
    })
    .await;
    let admin = stack.router.admin;
    // One answered request first: the observer filter has reported, so a picker stream that
    // ends leaves its ticket for the observer (the path with the grace period).
    let r = stack
        .post("/v1/chat/completions", chat_body(MODEL, "warm", false, 2))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_in_flight_drains(admin).await;

    // Replicas that accept requests but produce nothing: no response byte ever comes.
    for replica in &stack.replicas {
        let resp = stack
            .client
            .post(format!("http://{}/admin/stall", replica.addr))
            .header("content-type", "application/json")
            .body("{}")
            .send()
            .await
            .expect("stall sent");
        assert!(resp.status().is_success(), "stall {}", resp.status());
    }
    let mut clients = Vec::with_capacity(ABANDONED);
    for i in 0..ABANDONED {
        let client = stack.client.clone();
        let addr = stack.envoy.addr;
        clients.push(tokio::spawn(async move {
            post(
                &client,
                addr,
                "/v1/chat/completions",
                chat_body(MODEL, &format!("abandoned {i}"), false, 50),
            )
            .await
        }));
    }
    wait_for_in_flight(admin, ABANDONED as u64).await;
    // Every client hangs up (its connection closes) before any response byte.
    for client in &clients {
        client.abort();
    }
    for client in clients {
        let joined = client.await;
        assert!(
            joined.as_ref().is_err_and(|e| e.is_cancelled()),
            "a client got an answer from a stalled replica: {:?}",
            joined.map(|r| r.status)
        );
    }
    eventually(
        "in-flight gauges back to 0 after the clients hung up",
        RELEASE_DEADLINE,
        || async move {
            let gauges = in_flight_gauges(admin).await;
            (!gauges.is_empty() && gauges.iter().all(|v| *v == 0.0)).then_some(())
        },
    )
    .await;
}
