//! The router on two real swarms over QUIC on 127.0.0.1: a protocol's handler bound
//! refuses the stream past it, and stopping the router stops new streams, gives
//! running handlers their grace period and then aborts them.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use libp2p::swarm::SwarmEvent;
use libp2p::{Multiaddr, PeerId, Stream, StreamProtocol, Swarm};

use super::*;
use crate::network::{build_swarm, ConnectionCaps, NodeBehaviour, SwarmSettings};

const TEST_PROTOCOL: StreamProtocol = StreamProtocol::new("/gpunode/router-test/1");

/// Holds every stream it is given until it is dropped (aborted), counting both.
#[derive(Default)]
struct Holder {
    started: AtomicUsize,
    dropped: Arc<AtomicUsize>,
}

struct CountDrop(Arc<AtomicUsize>);

impl Drop for CountDrop {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

impl StreamHandler for Holder {
    fn handle(self: Arc<Self>, _: PeerId, stream: Stream, _: StreamGate) -> BoxFuture<'static, ()> {
        self.started.fetch_add(1, Ordering::SeqCst);
        let guard = CountDrop(self.dropped.clone());
        Box::pin(async move {
            let _held = (stream, guard);
            futures::future::pending::<()>().await
        })
    }
}

fn swarm() -> Swarm<NodeBehaviour> {
    let settings = SwarmSettings {
        mdns: false,
        idle_connection_timeout: Duration::from_secs(30),
        provider_record_ttl: Duration::from_secs(60),
        server: true,
        team: None,
        tcp_psk: None,
        limits: ConnectionCaps::default(),
        relay: Default::default(),
        upnp: false,
    };
    build_swarm(libp2p::identity::Keypair::generate_ed25519(), &settings).expect("swarm")
}

/// Polls `swarm` forever in a task; returns its listen address first.
async fn run(mut swarm: Swarm<NodeBehaviour>, listen: bool) -> Option<Multiaddr> {
    let mut addr = None;
    if listen {
        swarm
            .listen_on("/ip4/127.0.0.1/udp/0/quic-v1".parse().expect("addr"))
            .expect("listen");
        while addr.is_none() {
            if let SwarmEvent::NewListenAddr { address, .. } = swarm.select_next_some().await {
                addr = Some(address);
            }
        }
    }
    tokio::spawn(async move {
        loop {
            swarm.select_next_some().await;
        }
    });
    addr
}

/// Two streams at once, ten seconds for the first message.
const LIMITS: StreamLimits = StreamLimits {
    max_handlers: 2,
    first_message: Duration::from_secs(10),
    exchange: None,
};

/// A router serving what `routes` registers on one swarm, and a client swarm connected
/// to it: the server's id, its metrics, the client's stream control, the router's stop
/// switch and its task.
type Served = (
    PeerId,
    Arc<Metrics>,
    libp2p_stream::Control,
    tokio::sync::watch::Sender<bool>,
    tokio::task::JoinHandle<()>,
);

async fn serve(routes: impl FnOnce(&mut Router) -> Result<(), RouteError>) -> Served {
    let (server, mut client) = (swarm(), swarm());
    let server_id = *server.local_peer_id();
    let metrics = Metrics::new();
    let mut router = Router::new(server.behaviour().stream.new_control(), metrics.clone());
    routes(&mut router).expect("route");
    let addr = run(server, true).await.expect("listening");
    client
        .dial(addr.with(libp2p::multiaddr::Protocol::P2p(server_id)))
        .expect("dial");
    let control = client.behaviour().stream.new_control();
    run(client, false).await;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let serving = tokio::spawn(router.serve(stop_rx));
    (server_id, metrics, control, stop_tx, serving)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_past_the_bound_are_refused_and_stopping_aborts_after_the_grace() {
    let holder = Arc::new(Holder::default());
    let served = serve(|router| router.route(TEST_PROTOCOL, "test", LIMITS, holder.clone())).await;
    let (server_id, metrics, mut control, stop_tx, serving) = served;

    // Two streams are handled; the third is dropped unread and counted as busy.
    let mut open = Vec::new();
    for _ in 0..3 {
        open.push(
            control
                .open_stream(server_id, TEST_PROTOCOL)
                .await
                .expect("open"),
        );
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while metrics.stream_refused_count("test", "busy") < 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the third stream was not refused"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(holder.started.load(Ordering::SeqCst), 2);

    // Stopping: the handlers that never end get the grace period, then are aborted.
    let stopping = tokio::time::Instant::now();
    stop_tx.send(true).expect("stop");
    tokio::time::timeout(SHUTDOWN_GRACE * 3, serving)
        .await
        .expect("the router stops within its grace")
        .expect("router task");
    assert!(
        stopping.elapsed() >= SHUTDOWN_GRACE,
        "handlers were given their grace"
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while holder.dropped.load(Ordering::SeqCst) < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "handlers not aborted"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // And the protocol is no longer served.
    let refused = tokio::time::timeout(
        Duration::from_secs(10),
        control.open_stream(server_id, TEST_PROTOCOL),
    )
    .await
    .expect("an answer");
    assert!(refused.is_err(), "a stopped router accepted a stream");
}

const TEST_VARIANT: StreamProtocol = StreamProtocol::new("/gpunode/router-test-variant/1");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn variants_of_a_route_reach_their_own_handler_and_share_its_bound() {
    let (first, second) = (Arc::new(Holder::default()), Arc::new(Holder::default()));
    let served = serve(|router| {
        let variants: Vec<(StreamProtocol, Arc<dyn StreamHandler>)> = vec![
            (TEST_PROTOCOL, first.clone()),
            (TEST_VARIANT, second.clone()),
        ];
        router.route_variants("test", LIMITS, variants)
    })
    .await;
    let (server_id, metrics, mut control, stop_tx, serving) = served;

    // One stream of each variant reaches that variant's handler ...
    let mut open = Vec::new();
    for protocol in [TEST_PROTOCOL, TEST_VARIANT] {
        open.push(
            control
                .open_stream(server_id, protocol)
                .await
                .expect("open"),
        );
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while first.started.load(Ordering::SeqCst) + second.started.load(Ordering::SeqCst) < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "streams not handled"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(first.started.load(Ordering::SeqCst), 1);
    assert_eq!(second.started.load(Ordering::SeqCst), 1);
    // ... and a third, of either variant, is past the bound they share.
    open.push(
        control
            .open_stream(server_id, TEST_VARIANT)
            .await
            .expect("open"),
    );
    while metrics.stream_refused_count("test", "busy") < 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the third stream was not refused"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(second.started.load(Ordering::SeqCst), 1);
    stop_tx.send(true).expect("stop");
    let _ = tokio::time::timeout(SHUTDOWN_GRACE * 3, serving).await;
}
