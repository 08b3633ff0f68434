//! A client that takes no bytes of its response must not hold its slots for as long as it
//! likes: after `timeouts.send` its HTTP/1 connection is closed, or its HTTP/2 stream's
//! response dropped, and the slots it held are free for others.

use std::time::Duration;

use crate::common::*;
use http::StatusCode;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

const HELD: &str =
    "timeouts: { send: 1s }\nrules:\n  - name: two\n    key: []\n    limit: { concurrency: 2 }\n";

/// Waits (bounded) until the proxy has given up `n` responses for their clients' stall.
async fn timed_out(sc: &spillway::Sidecar, n: f64) -> f64 {
    let mut seen = 0.0;
    for _ in 0..300 {
        let text = admin(sc, "/metrics").await.1;
        seen = metric(&text, "spillway_client_send_timeouts_total").unwrap_or(0.0);
        if seen >= n {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http1_clients_that_never_read_are_dropped_and_their_slots_freed() {
    let (sc, _up) = sidecar(HELD).await;
    // Two clients ask for a response larger than the socket buffers and never read it.
    let mut readers_of_nothing = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(sc.addr()).await.unwrap();
        s.write_all(b"GET /big HTTP/1.1\r\nHost: app\r\n\r\n")
            .await
            .unwrap();
        readers_of_nothing.push(s);
    }
    // Both slots are held meanwhile (the third client is refused once both are in flight).
    let mut refused = false;
    for _ in 0..100 {
        if get(sc.addr(), "/", &[]).await.0 == StatusCode::TOO_MANY_REQUESTS {
            refused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(refused, "the two stalled responses never held both slots");
    assert!(timed_out(&sc, 2.0).await >= 2.0, "no send timeout fired");
    let (status, _, _) = get(sc.addr(), "/", &[]).await;
    assert_eq!(status, StatusCode::OK, "the slots are free again");
    drop(readers_of_nothing);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_streams_whose_window_stays_shut_are_dropped_and_their_slots_freed() {
    let (sc, _up) = sidecar(HELD).await;
    // Each client's connection reads frames but the test never reads the bodies: the
    // stream's flow-control window shuts and stays shut.
    let mut held = Vec::new();
    for _ in 0..2 {
        let c = h2_client();
        let req = http::Request::get(format!("http://{}/big", sc.addr()))
            .body(empty())
            .unwrap();
        let resp = c.request(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        held.push((c, resp));
    }
    assert_eq!(
        get(sc.addr(), "/", &[]).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert!(timed_out(&sc, 2.0).await >= 2.0, "no send timeout fired");
    let (status, _, _) = get(sc.addr(), "/", &[]).await;
    assert_eq!(status, StatusCode::OK, "the slots are free again");
    drop(held);
}
