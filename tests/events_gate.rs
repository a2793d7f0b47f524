//! Bound KV-event sockets against hostile peers (issue 12), with real ZMQ sockets on
//! 127.0.0.1: a frame header announcing 2^62 bytes (which aborted the process inside the
//! `zeromq` crate) is refused and the socket keeps serving its publisher; a publisher whose IP
//! is not an endpoint's is refused until the config allows it.

use std::sync::Arc;
use std::time::Duration;

use kvrouter::config::Config;
use kvrouter::events::KvEvents;
use kvrouter::index::{Clock, EndpointInterner, IndexOptions, OwnershipIndex, TokioClock};
use kvrouter::prefix::TokenizerRegistry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

const DEADLINE: Duration = Duration::from_secs(20);

fn config(endpoint: &str, allowed: &str) -> Config {
    Config::parse_and_validate(
        &format!(
            r#"
kv_events: {{max_message_bytes: 65536, allowed_publishers: [{allowed}]}}
pools:
  - name: p
    models: [m]
    kv_events: {{bind: "tcp://127.0.0.1:0"}}
    endpoints:
      - address: {endpoint}
"#
        ),
        "test",
    )
    .unwrap()
}

async fn hub(config: &Config) -> KvEvents {
    let clock: Arc<dyn Clock> = Arc::new(TokioClock::new());
    let index = Arc::new(OwnershipIndex::new(
        IndexOptions::from(&config.cache_index),
        Arc::clone(&clock),
    ));
    KvEvents::start(
        config,
        &TokenizerRegistry::empty(),
        index,
        Arc::new(EndpointInterner::new()),
        clock,
    )
    .await
    .unwrap()
}

async fn bound(events: &KvEvents) -> String {
    let bound = events.bound_endpoints().await;
    assert_eq!(bound.len(), 1, "{bound:?}");
    bound[0].1.clone()
}

/// A vLLM-shaped message with sequence `seq` and no events: `[topic, seq, [ts, [], 0]]`.
fn message(seq: u64) -> ZmqMessage {
    let payload = rmpv::Value::Array(vec![
        rmpv::Value::F64(1.7e9),
        rmpv::Value::Array(vec![]),
        rmpv::Value::from(0),
    ]);
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, &payload).unwrap();
    let mut m = ZmqMessage::from(Vec::<u8>::new());
    m.push_back(seq.to_be_bytes().to_vec().into());
    m.push_back(bytes.into());
    m
}

fn messages(events: &KvEvents) -> u64 {
    let status = events.status();
    assert_eq!(status.len(), 1, "one endpoint");
    status[0].counters.messages
}

/// Publishes to `endpoint` (reconnecting with a new socket when the connection is refused)
/// until `done` holds, at most [`DEADLINE`].
async fn publish_until(endpoint: &str, what: &str, mut done: impl FnMut() -> bool) {
    let start = tokio::time::Instant::now();
    let mut seq = 0;
    while !done() {
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        let mut socket = PubSocket::new();
        let connected =
            tokio::time::timeout(Duration::from_secs(2), socket.connect(endpoint)).await;
        if !matches!(connected, Ok(Ok(()))) {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        for _ in 0..40 {
            if done() {
                return;
            }
            let _ = socket.send(message(seq)).await;
            seq += 1;
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

#[tokio::test]
async fn a_header_announcing_2_pow_62_bytes_is_refused_and_the_socket_keeps_serving() {
    let events = hub(&config("127.0.0.1:18300", "")).await;
    let endpoint = bound(&events).await;
    let addr = endpoint.strip_prefix("tcp://").unwrap();

    // A hostile peer: a ZMTP greeting, then a long frame header claiming 2^62 bytes.
    let mut hostile = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut greeting = [0u8; 64];
    greeting[0] = 0xff;
    greeting[9] = 0x7f;
    greeting[10] = 3;
    greeting[12..16].copy_from_slice(b"NULL");
    hostile.write_all(&greeting).await.unwrap();
    hostile.write_all(&[0x02]).await.unwrap();
    hostile
        .write_all(&(1u64 << 62).to_be_bytes())
        .await
        .unwrap();
    // The router closes the connection (whatever it answered before that).
    let closed = tokio::time::timeout(DEADLINE, async {
        let mut buf = [0u8; 256];
        loop {
            match hostile.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "the hostile connection was not closed");
    assert_eq!(events.refused_publishers(), 1);

    // The process is up and the socket still takes its real publisher's messages.
    publish_until(&endpoint, "the publisher's messages", || {
        messages(&events) >= 3
    })
    .await;
    assert_eq!(
        events.refused_publishers(),
        1,
        "the publisher was not refused"
    );
}

#[tokio::test]
async fn a_publisher_whose_ip_is_no_endpoints_is_refused_until_allowed() {
    // The only endpoint is on 127.0.0.2 (never contacted here); the publisher is on 127.0.0.1.
    let cfg = config("127.0.0.2:18301", "");
    let events = hub(&cfg).await;
    let endpoint = bound(&events).await;
    publish_until(&endpoint, "a refusal", || events.refused_publishers() >= 2).await;
    assert_eq!(messages(&events), 0, "nothing from a refused peer arrived");

    events
        .reload(
            &config("127.0.0.2:18301", "127.0.0.1"),
            &TokenizerRegistry::empty(),
        )
        .await
        .unwrap();
    assert_eq!(
        bound(&events).await,
        endpoint,
        "the same socket, not rebound"
    );
    publish_until(&endpoint, "messages once allowed", || {
        messages(&events) >= 3
    })
    .await;
}

/// A pool whose engines bind (`connect:`): the publisher at `publisher` (a discovered address
/// is no more trusted than its DNS answer).
fn connecting(publisher: &str) -> Config {
    Config::parse_and_validate(
        &format!(
            r#"
kv_events: {{max_message_bytes: 65536}}
pools:
  - name: p
    models: [m]
    kv_events: {{connect: "tcp://{publisher}"}}
    endpoints:
      - address: 127.0.0.1:18302
"#
        ),
        "test",
    )
    .unwrap()
}

#[tokio::test]
async fn a_connecting_socket_refuses_a_publisher_announcing_2_pow_62_bytes() {
    // A hostile "publisher": whoever connects gets a ZMTP greeting, then a long frame header
    // claiming 2^62 bytes, which the `zeromq` crate would try to reserve (aborting the
    // process). The router's own connection through the gate is closed instead.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let publisher = listener.local_addr().unwrap();
    let hostile = tokio::spawn(async move {
        let mut closed = 0;
        // The router reconnects after each refusal: serve a few of them.
        while closed < 2 {
            let (mut peer, _) = listener.accept().await.unwrap();
            let mut greeting = [0u8; 64];
            greeting[0] = 0xff;
            greeting[9] = 0x7f;
            greeting[10] = 3;
            greeting[12..16].copy_from_slice(b"NULL");
            let _ = peer.write_all(&greeting).await;
            let _ = peer.write_all(&[0x02]).await;
            let _ = peer.write_all(&(1u64 << 62).to_be_bytes()).await;
            let _ = peer.write_all(&[0u8]).await;
            let mut buf = [0u8; 256];
            loop {
                match peer.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
            }
            closed += 1;
        }
    });
    let events = hub(&connecting(&publisher.to_string())).await;
    tokio::time::timeout(DEADLINE, hostile)
        .await
        .expect("the router closed the hostile publisher's connections")
        .unwrap();
    assert!(events.refused_publishers() >= 2, "counted as refused");
    assert_eq!(messages(&events), 0, "nothing reached the endpoint");
}

#[tokio::test]
async fn a_connecting_socket_takes_a_real_publishers_messages_through_the_check() {
    let mut publisher = PubSocket::new();
    let bound = publisher.bind("tcp://127.0.0.1:0").await.unwrap();
    let address = bound.to_string();
    let address = address.strip_prefix("tcp://").unwrap().to_string();
    let events = hub(&connecting(&address)).await;
    let start = tokio::time::Instant::now();
    let mut seq = 0;
    while messages(&events) < 3 {
        assert!(start.elapsed() < DEADLINE, "no message through the gate");
        let _ = publisher.send(message(seq)).await;
        seq += 1;
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(events.refused_publishers(), 0);
}
