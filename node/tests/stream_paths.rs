//! Which connection a stream takes (our copy of libp2p-stream, vendor/README.md): while a
//! peer is connected both through a relay and directly (a hole punch made the direct
//! connection and the relayed one is still open), every new stream must take the direct
//! one. Job data goes through a relay only where allowed, and a relayed connection closes
//! soon after a direct one exists, taking its streams with it. Real swarms on 127.0.0.1:
//! a relay, a peer reserved on it and listening directly, and a dialer connected both ways.

mod common;
use common::listen;

use std::time::Duration;

use futures::{AsyncReadExt, AsyncWriteExt, StreamExt};
use libp2p::multiaddr::Protocol;
use libp2p::swarm::{ConnectionId, NetworkBehaviour, SwarmEvent};
use libp2p::{noise, relay, yamux, Multiaddr, PeerId, Stream, StreamProtocol, Swarm};
use tokio::sync::{mpsc, oneshot};

const ECHO: StreamProtocol = StreamProtocol::new("/gpunode-test/echo/1");
/// Streams opened while both connections exist: with a random pick, about half would
/// take the relayed one (all 16 on the direct one by chance: 1 in 65,536).
const STREAMS: usize = 16;

#[derive(NetworkBehaviour)]
struct RelayServer {
    relay: relay::Behaviour,
}

#[derive(NetworkBehaviour)]
struct Peer {
    relay_client: relay::client::Behaviour,
    stream: libp2p_stream::Behaviour,
}

fn relay_server() -> Swarm<RelayServer> {
    libp2p::SwarmBuilder::with_new_identity()
        .with_tokio()
        .with_quic()
        .with_behaviour(|key| RelayServer {
            relay: relay::Behaviour::new(key.public().to_peer_id(), Default::default()),
        })
        .expect("behaviour")
        .with_swarm_config(|c| c.with_idle_connection_timeout(Duration::from_secs(60)))
        .build()
}

fn peer() -> Swarm<Peer> {
    libp2p::SwarmBuilder::with_new_identity()
        .with_tokio()
        .with_quic()
        .with_relay_client(noise::Config::new, yamux::Config::default)
        .expect("relay client")
        .with_behaviour(|_, relay_client| Peer {
            relay_client,
            stream: libp2p_stream::Behaviour::new(),
        })
        .expect("behaviour")
        .with_swarm_config(|c| c.with_idle_connection_timeout(Duration::from_secs(60)))
        .build()
}

/// Drives `swarm` until `done` says so, answering nothing.
fn drive<B: NetworkBehaviour + Send + 'static>(mut swarm: Swarm<B>) -> oneshot::Sender<()>
where
    B::ToSwarm: Send,
{
    let (stop, mut stopped) = oneshot::channel::<()>();
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = &mut stopped => return,
                _ = swarm.select_next_some() => {}
            }
        }
    });
    stop
}

/// Writes one byte on `stream` and reads it back.
async fn echoes(stream: &mut Stream) -> bool {
    let round = async {
        stream.write_all(b"x").await?;
        stream.flush().await?;
        let mut back = [0u8; 1];
        stream.read_exact(&mut back).await?;
        Ok::<_, std::io::Error>(back == *b"x")
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(5), round).await,
        Ok(Ok(true))
    )
}

/// What the dialer's swarm task is asked to do.
enum Ask {
    Dial(Multiaddr, oneshot::Sender<(ConnectionId, bool)>),
    Close(ConnectionId, oneshot::Sender<()>),
}

/// Drives the dialer: dials and closes connections as asked, telling when done.
fn drive_dialer(mut swarm: Swarm<Peer>, target: PeerId) -> mpsc::Sender<Ask> {
    let (ask, mut asks) = mpsc::channel::<Ask>(4);
    tokio::spawn(async move {
        let mut dialled: Option<oneshot::Sender<(ConnectionId, bool)>> = None;
        let mut closing: Option<(ConnectionId, oneshot::Sender<()>)> = None;
        loop {
            tokio::select! {
                asked = asks.recv() => match asked {
                    Some(Ask::Dial(addr, reply)) => {
                        swarm.dial(addr).expect("dial");
                        dialled = Some(reply);
                    }
                    Some(Ask::Close(id, reply)) => {
                        assert!(swarm.close_connection(id), "connection {id} is not open");
                        closing = Some((id, reply));
                    }
                    None => return,
                },
                event = swarm.select_next_some() => match event {
                    SwarmEvent::ConnectionEstablished { peer_id, connection_id, endpoint, .. }
                        if peer_id == target =>
                    {
                        if let Some(reply) = dialled.take() {
                            let _ = reply.send((connection_id, endpoint.is_relayed()));
                        }
                    }
                    SwarmEvent::ConnectionClosed { connection_id, .. }
                        if closing.as_ref().is_some_and(|(id, _)| *id == connection_id) =>
                    {
                        let _ = closing.take().expect("closing").1.send(());
                    }
                    _ => {}
                },
            }
        }
    });
    ask
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_streams_take_the_direct_connection_over_a_relayed_one() {
    tokio::time::timeout(Duration::from_secs(60), streams_prefer_direct())
        .await
        .expect("the test ran over 60 s");
}

async fn streams_prefer_direct() {
    // The relay.
    let mut relay = relay_server();
    let relay_id = *relay.local_peer_id();
    let relay_addr = listen(&mut relay).await;
    relay.add_external_address(relay_addr.clone());
    let _relay = drive(relay);

    // The target: listening directly, and reserved on the relay.
    let mut target = peer();
    let target_id = *target.local_peer_id();
    let direct_addr = listen(&mut target).await;
    let circuit = relay_addr
        .clone()
        .with(Protocol::P2p(relay_id))
        .with(Protocol::P2pCircuit);
    target
        .listen_on(circuit.clone())
        .expect("listen on the relay");
    loop {
        if let SwarmEvent::Behaviour(PeerEvent::RelayClient(
            relay::client::Event::ReservationReqAccepted { .. },
        )) = target.select_next_some().await
        {
            break;
        }
    }
    let mut incoming = target
        .behaviour()
        .stream
        .new_control()
        .accept(ECHO)
        .expect("accept");
    tokio::spawn(async move {
        while let Some((_, mut stream)) = incoming.next().await {
            tokio::spawn(async move {
                let mut byte = [0u8; 1];
                while stream.read_exact(&mut byte).await.is_ok() {
                    if stream.write_all(&byte).await.is_err() || stream.flush().await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    let _target = drive(target);

    // The dialer: through the relay first, as two peers behind NATs meet.
    let dialer = peer();
    let mut control = dialer.behaviour().stream.new_control();
    let ask = drive_dialer(dialer, target_id);
    let via_relay = circuit.with(Protocol::P2p(target_id));
    let (tx, rx) = oneshot::channel();
    ask.send(Ask::Dial(via_relay, tx)).await.expect("dialer");
    let (relayed_id, relayed) = rx.await.expect("relayed connection");
    assert!(
        relayed,
        "the connection through the relay counts as relayed"
    );

    // A stream opened now can only take the relay, and works there.
    let mut over_relay = control.open_stream(target_id, ECHO).await.expect("open");
    assert!(
        echoes(&mut over_relay).await,
        "a stream through the relay echoes"
    );

    // Then directly, as a hole punch would connect them.
    let (tx, rx) = oneshot::channel();
    let direct = direct_addr.with(Protocol::P2p(target_id));
    ask.send(Ask::Dial(direct, tx)).await.expect("dialer");
    let (_, relayed) = rx.await.expect("direct connection");
    assert!(!relayed, "the direct connection counts as direct");

    let mut streams = Vec::with_capacity(STREAMS);
    for _ in 0..STREAMS {
        streams.push(control.open_stream(target_id, ECHO).await.expect("open"));
    }

    // The relayed connection closes: streams on it die, those on the direct one live.
    let (tx, rx) = oneshot::channel();
    ask.send(Ask::Close(relayed_id, tx)).await.expect("dialer");
    rx.await.expect("relayed connection closed");
    assert!(
        !echoes(&mut over_relay).await,
        "a stream on the closed relayed connection is gone (else this test sees nothing)"
    );
    let mut on_direct = 0;
    for stream in &mut streams {
        if echoes(stream).await {
            on_direct += 1;
        }
    }
    assert_eq!(
        on_direct, STREAMS,
        "every stream opened while a direct connection existed took it"
    );
}
