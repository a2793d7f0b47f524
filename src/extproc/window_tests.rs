//! One stream waiting mid-body must not hold up the others on its HTTP/2 connection. Envoy
//! multiplexes every ext_proc stream of a worker on one connection, and HTTP/2 flow control has
//! a window per stream and one per connection: bytes a stream has received but the router has
//! not read yet count against both. A full-duplex body whose long chunk waits for the heavy
//! lane is not read meanwhile, while Envoy keeps sending its next chunks; with the connection's
//! window no larger than a stream's (hyper's default), a few such streams' chunks closed the
//! connection to every other request until the heavy lane came round (this test, before the
//! windows in `serve`: B timed out).

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

use super::stream_tests::{request_body, request_headers};
use super::{lanes, serve, ExtProc, ServerExtras};
use crate::config::Config;
use crate::router::Router;
use crate::telemetry::Metrics;

/// One full-duplex chunk: longer than `routing.heavy_body_bytes` (64 KiB), so the heavy lane.
const CHUNK: usize = 128 << 10;

/// Full-duplex streams waiting for the heavy lane at once.
const WAITING: usize = 4;

const PATH: &str = "/v1/completions";

const CONFIG: &str = "pools: [{name: p, models: [m], endpoints: [{address: '127.0.0.1:8001'}]}]";

/// A loopback proxy for one connection to `to`, counting the bytes the client sends.
async fn counting_proxy(to: SocketAddr, sent: Arc<AtomicUsize>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (client, _) = listener.accept().await.unwrap();
        let server = tokio::net::TcpStream::connect(to).await.unwrap();
        let (mut from_client, mut to_client) = client.into_split();
        let (mut from_server, mut to_server) = server.into_split();
        tokio::spawn(async move {
            let _ = tokio::io::copy(&mut from_server, &mut to_client).await;
        });
        let mut buf = vec![0u8; 64 << 10];
        loop {
            match from_client.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if to_server.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                    sent.fetch_add(n, Ordering::Relaxed);
                }
            }
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_waiting_for_the_heavy_lane_does_not_close_its_connection_to_others() {
    let metrics = Arc::new(Metrics::new());
    let router = Router::new(
        Config::parse_and_validate(CONFIG, "test").unwrap(),
        Arc::clone(&metrics),
        Path::new("."),
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(serve(
        ExtProc::new(Arc::new(router), metrics),
        listener,
        64 << 20,
        Duration::from_secs(60),
        ServerExtras::default(),
        // Aborted at the end: a graceful stop would wait for the A streams.
        std::future::pending(),
    ));

    // The heavy lane is busy (as under a flood): every heavy thread waits until released, and
    // the A streams' chunks queue behind. At least one holder must be running before A starts.
    let cores = crate::budget::cores();
    let (started_tx, started) = std::sync::mpsc::channel::<()>();
    let (releases, holders): (Vec<_>, Vec<_>) = (0..cores)
        .map(|_| {
            let (release, released) = std::sync::mpsc::channel::<()>();
            let started_tx = started_tx.clone();
            let lane = lanes::Lane::Heavy {
                tenant: None,
                bytes: 1,
            };
            let holder = tokio::spawn(lanes::run(lane, move || {
                let _ = started_tx.send(());
                let _ = released.recv();
            }));
            (release, holder)
        })
        .unzip();
    tokio::task::spawn_blocking(move || started.recv_timeout(Duration::from_secs(10)))
        .await
        .unwrap()
        .expect("a heavy thread took a holder");

    // One connection, as Envoy keeps one per worker, through a proxy that counts its bytes.
    let wire = Arc::new(AtomicUsize::new(0));
    let proxy = counting_proxy(addr, Arc::clone(&wire)).await;
    let channel = Channel::from_shared(format!("http://{proxy}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let client = ExternalProcessorClient::new(channel).max_encoding_message_size(64 << 20);

    // A1..A4: full duplex; each one's first chunk is long (heavy lane, held), then more
    // follow and stay unread until the lane runs it: each holds up to its stream's window.
    let mut waiting = Vec::new();
    for _ in 0..WAITING {
        let (a_tx, a_rx) = tokio::sync::mpsc::channel(1);
        a_tx.send(request_headers(
            BodySendMode::FullDuplexStreamed,
            PATH,
            false,
        ))
        .await
        .unwrap();
        let mut a_client = client.clone();
        let a = tokio::spawn(async move { a_client.process(ReceiverStream::new(a_rx)).await });
        let feeder = tokio::spawn(async move {
            for _ in 0..24 {
                if a_tx
                    .send(request_body(&[b' '; CHUNK], false))
                    .await
                    .is_err()
                {
                    break;
                }
            }
        });
        waiting.push((a, feeder));
    }
    // Wait until the A streams put more on the wire than a 1 MiB connection window and what
    // the router read of them (their first chunks, a frame past each) could ever let through.
    // With the bug they never do: the connection is closed and this wait fails after 10 s.
    let saturated = (1 << 20) + WAITING * (CHUNK + (32 << 10));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while wire.load(Ordering::Relaxed) < saturated {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the A streams never filled the connection: {} of {saturated} bytes on the wire",
            wire.load(Ordering::Relaxed)
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }

    // B, on the same connection: a small BUFFERED request is answered meanwhile.
    let (b_tx, b_rx) = tokio::sync::mpsc::channel(4);
    b_tx.send(request_headers(BodySendMode::Buffered, PATH, false))
        .await
        .unwrap();
    let completion = br#"{"model":"m","prompt":"hello","max_tokens":1}"#;
    b_tx.send(request_body(completion, true)).await.unwrap();
    let mut b_client = client.clone();
    let answered = tokio::time::timeout(Duration::from_secs(10), async move {
        let mut replies = b_client
            .process(ReceiverStream::new(b_rx))
            .await
            .expect("B's stream")
            .into_inner();
        let mut last = None;
        for _ in 0..2 {
            last = replies.message().await.expect("B's reply");
        }
        last
    })
    .await;
    drop(releases);
    for h in holders {
        h.await.unwrap();
    }
    let reply = answered
        .expect("B was answered while the A streams' chunks waited for the heavy lane")
        .expect("a routing reply");
    assert!(
        matches!(reply.response, Some(Response::RequestBody(_))),
        "{reply:?}"
    );
    for (a, feeder) in waiting {
        a.abort();
        feeder.abort();
    }
    server.abort();
}
