//! Peers that are not gpunode nodes, or that lie: a standard libp2p peer gets identify and
//! ping answers; forged, oversized and garbage records pushed into the DHT, or given in
//! answer to a direct advert fetch, are refused, counted in /metrics, and the node keeps
//! serving.

use std::time::Duration;

use futures::StreamExt;
use gpunode_node::adverts::fetch::{AdvertAnswer, AdvertCodec, AdvertQuery};
use gpunode_protocol::advert::{
    advert_record_key, model_key, Advert, AdvertGpu, OfferFilter, ADVERT_VERSION,
};
use gpunode_protocol::gpu::GpuState;
use gpunode_protocol::time::now_ms;
use libp2p::kad::{self, store::MemoryStore, Quorum, Record, RecordKey};
use libp2p::request_response;
use libp2p::swarm::{NetworkBehaviour, SwarmEvent};
use libp2p::{identify, identity, noise, ping, tcp, yamux, Multiaddr, PeerId, StreamProtocol};
use testnet::{TestNet, Transport};

#[derive(NetworkBehaviour)]
struct Plain {
    identify: identify::Behaviour,
    ping: ping::Behaviour,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standard_libp2p_peer_gets_identify_and_ping_over_tcp() {
    let net = TestNet::gpu_providers(&["1xT4-16GB"])
        .transport(Transport::Tcp)
        .start()
        .await
        .expect("start");
    let target: Multiaddr = net.provider(0).addr.parse().expect("addr");
    // A plain libp2p peer: TCP + noise + yamux, identify and ping, nothing of gpunode.
    let mut swarm = libp2p::SwarmBuilder::with_new_identity()
        .with_tokio()
        .with_tcp(
            tcp::Config::default(),
            noise::Config::new,
            yamux::Config::default,
        )
        .expect("tcp")
        .with_behaviour(|key| Plain {
            identify: identify::Behaviour::new(identify::Config::new(
                "/ipfs/0.1.0".into(),
                key.public(),
            )),
            ping: ping::Behaviour::default(),
        })
        .expect("behaviour")
        .build();
    swarm.dial(target).expect("dial");
    let mut agent = None;
    let mut pinged = false;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while agent.is_none() || !pinged {
        tokio::select! {
            ev = swarm.select_next_some() => match ev {
                SwarmEvent::Behaviour(PlainEvent::Identify(identify::Event::Received { info, .. })) => {
                    agent = Some(info.agent_version.clone());
                    assert!(info.protocols.iter().any(|p| p.as_ref() == "/gpunode/kad/1.0.0"));
                }
                SwarmEvent::Behaviour(PlainEvent::Ping(ping::Event { result: Ok(_), .. })) => pinged = true,
                _ => {}
            },
            _ = tokio::time::sleep_until(deadline) => panic!("no identify/ping answer within 20s"),
        }
    }
    assert!(agent.expect("agent").starts_with("gpunode/"));
    net.shutdown().await;
}

#[derive(NetworkBehaviour)]
struct Attacker {
    kad: kad::Behaviour<MemoryStore>,
}

fn forged_advert(claimed: PeerId, signer: &identity::Keypair) -> Vec<u8> {
    let now = now_ms();
    Advert {
        version: ADVERT_VERSION,
        publisher: claimed,
        seq: u64::MAX / 2,
        issued_at_ms: now,
        expires_at_ms: now + 60_000,
        gpus: vec![AdvertGpu {
            index: 0,
            uuid: "GPU-fake".into(),
            model: "B200-192GB".into(),
            memory_bytes: 192 << 30,
            state: GpuState::Idle,
            mig_enabled: false,
            compute_capability: None,
            reserved: Vec::new(),
        }],
        cpu_cores: 1024,
        ram_bytes: 1 << 40,
        backends: vec!["wasm".into()],
        price_per_gpu_hour_millicredits: 0,
        listen_addrs: vec![],
        simulated: false,
        withdrawn: false,
    }
    .sign(signer)
    .expect("sign")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_oversized_and_garbage_records_are_refused_and_counted() {
    let mut net = TestNet::gpu_providers(&["1xA100-80GB", "1xT4-16GB"])
        .start()
        .await
        .expect("start");
    let victim = net.provider(1).handle.peer_id();
    let target = net.provider(0);
    let target_addr: Multiaddr = target.addr.parse().expect("addr");

    let key = identity::Keypair::generate_ed25519();
    let me = key.public().to_peer_id();
    let mut swarm = libp2p::SwarmBuilder::with_existing_identity(key.clone())
        .with_tokio()
        .with_quic()
        .with_behaviour(|_| {
            let mut cfg = kad::Config::new(StreamProtocol::new("/gpunode/kad/1.0.0"));
            cfg.set_max_packet_size(256 * 1024);
            let mut kad = kad::Behaviour::with_config(me, MemoryStore::new(me), cfg);
            kad.set_mode(Some(kad::Mode::Client));
            Attacker { kad }
        })
        .expect("behaviour")
        .build();
    let mut plain_target = target_addr.clone();
    plain_target.pop();
    swarm
        .behaviour_mut()
        .kad
        .add_address(&target.handle.peer_id(), plain_target);
    let peers = vec![target.handle.peer_id()];
    let records = vec![
        // Signed by the attacker but claiming to be the victim.
        Record::new(
            RecordKey::new(&advert_record_key(&victim)),
            forged_advert(victim, &key),
        ),
        // Bigger than any advert may be.
        Record::new(
            RecordKey::new(&advert_record_key(&me)),
            vec![7u8; 40 * 1024],
        ),
        // Garbage.
        Record::new(
            RecordKey::new(&advert_record_key(&me)),
            b"not an advert".to_vec(),
        ),
        // A key that is not an advert key at all.
        Record::new(RecordKey::new(b"/something/else"), b"x".to_vec()),
    ];
    for r in records {
        swarm
            .behaviour_mut()
            .kad
            .put_record_to(r, peers.clone().into_iter(), Quorum::One);
    }
    let metrics = target.handle.metrics().clone();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let done = metrics.rejected_count("wrong_key") >= 1
            && metrics.rejected_count("oversized") >= 1
            && metrics.rejected_count("malformed") >= 1
            && metrics.rejected_count("unknown_key") >= 1;
        if done {
            break;
        }
        tokio::select! {
            _ = swarm.select_next_some() => {}
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "rejections not counted: {}",
            metrics.encode()
        );
    }
    let text = metrics.encode();
    assert!(
        text.contains("gpunode_adverts_rejected_total{reason=\"wrong_key\"}"),
        "{text}"
    );
    // The node still serves, and the victim's real advert is what clients see.
    let client = net.add_client().await.expect("client");
    let offers = TestNet::wait_for_offers(
        &client.handle,
        &OfferFilter::default(),
        Duration::from_secs(20),
        |o| o.len() == 2,
    )
    .await
    .expect("honest offers still served");
    let v = offers
        .iter()
        .find(|o| o.peer_id == victim.to_string())
        .expect("victim listed");
    assert_eq!(v.gpus[0].model, "T4-16GB");
    assert!(!offers
        .iter()
        .any(|o| o.gpus.iter().any(|g| g.model.starts_with("B200"))));
    net.shutdown().await;
}

#[derive(NetworkBehaviour)]
struct Liar {
    kad: kad::Behaviour<MemoryStore>,
    advert: request_response::Behaviour<AdvertCodec>,
}

/// A peer that provides the A100 key and answers every advert fetch with a lie, in turn:
/// an advert it signed that names the honest provider, garbage, and the honest provider's
/// real advert replayed as its own. Each lie is refused and counted, the liar is never
/// offered, and the honest provider always is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lies_told_in_answer_to_an_advert_fetch_are_refused_and_counted() {
    let net = TestNet::gpu_providers(&["1xA100-80GB"])
        .with_clients(1)
        .start()
        .await
        .expect("start");
    let honest = net.provider(0).handle.peer_id();
    let mut honest_addr: Multiaddr = net.provider(0).addr.parse().expect("addr");
    honest_addr.pop();
    let client = net.client(0).handle.clone();

    let key = identity::Keypair::generate_ed25519();
    let me = key.public().to_peer_id();
    let mut swarm = libp2p::SwarmBuilder::with_existing_identity(key.clone())
        .with_tokio()
        .with_quic()
        .with_behaviour(|_| {
            let cfg = kad::Config::new(StreamProtocol::new("/gpunode/kad/1.0.0"));
            let mut kad = kad::Behaviour::with_config(me, MemoryStore::new(me), cfg);
            kad.set_mode(Some(kad::Mode::Server));
            Liar {
                kad,
                advert: gpunode_node::adverts::fetch::behaviour(),
            }
        })
        .expect("behaviour")
        .build();
    swarm
        .listen_on("/ip4/127.0.0.1/udp/0/quic-v1".parse().expect("addr"))
        .expect("listen");
    swarm.behaviour_mut().kad.add_address(&honest, honest_addr);
    // The honest provider serves its own advert to anyone who asks: the liar keeps it.
    swarm
        .behaviour_mut()
        .advert
        .send_request(&honest, AdvertQuery);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let real = loop {
        let event = tokio::time::timeout_at(deadline, swarm.select_next_some())
            .await
            .expect("the honest provider answers an advert fetch");
        match event {
            SwarmEvent::NewListenAddr { address, .. } => swarm.add_external_address(address),
            SwarmEvent::Behaviour(LiarEvent::Advert(request_response::Event::Message {
                message: request_response::Message::Response { response, .. },
                ..
            })) => match response.0 {
                Some(advert) => break advert,
                // Not signed yet: ask again.
                None => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    swarm
                        .behaviour_mut()
                        .advert
                        .send_request(&honest, AdvertQuery);
                }
            },
            _ => {}
        }
    };
    let a100 = OfferFilter {
        gpu_model: Some("A100-80GB".into()),
        ..OfferFilter::default()
    };
    swarm
        .behaviour_mut()
        .kad
        .start_providing(RecordKey::new(&model_key(
            a100.gpu_model.as_deref().unwrap_or_default(),
        )))
        .expect("provide");
    let lies = [forged_advert(honest, &key), b"not an advert".to_vec(), real];
    let told = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = told.clone();
    let liar = tokio::spawn(async move {
        loop {
            if let SwarmEvent::Behaviour(LiarEvent::Advert(request_response::Event::Message {
                message: request_response::Message::Request { channel, .. },
                ..
            })) = swarm.select_next_some().await
            {
                let n = counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let lie = AdvertAnswer(Some(lies[n % lies.len()].clone()));
                let _ = swarm.behaviour_mut().advert.send_response(channel, lie);
            }
        }
    });

    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while told.load(std::sync::atomic::Ordering::SeqCst) < 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the liar was never asked three times"
        );
        let search = client.search_offers(a100.clone()).await.expect("search");
        let peers: Vec<&str> = search.offers.iter().map(|o| o.peer_id.as_str()).collect();
        assert!(
            !peers.contains(&me.to_string().as_str()),
            "liar offered: {peers:?}"
        );
        if search.providers >= 2 {
            assert_eq!(
                peers,
                vec![honest.to_string()],
                "the honest provider is offered"
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let metrics = client.metrics();
    assert!(
        metrics.rejected_count("wrong_key") >= 2,
        "{}",
        metrics.encode()
    );
    assert!(
        metrics.rejected_count("malformed") >= 1,
        "{}",
        metrics.encode()
    );
    liar.abort();
    net.shutdown().await;
}

#[derive(NetworkBehaviour)]
struct Chatty {
    identify: identify::Behaviour,
    kad: kad::Behaviour<MemoryStore>,
}

#[derive(NetworkBehaviour)]
struct Asker {
    kad: kad::Behaviour<MemoryStore>,
}

/// Drives `swarm` until one of its behaviour's events satisfies `until`, by `deadline`.
async fn drive_until(
    swarm: &mut libp2p::Swarm<Chatty>,
    deadline: tokio::time::Instant,
    mut until: impl FnMut(&ChattyEvent) -> bool,
) {
    loop {
        let event = tokio::time::timeout_at(deadline, swarm.select_next_some())
            .await
            .expect("the node answers in time");
        if let SwarmEvent::Behaviour(e) = &event {
            if until(e) {
                return;
            }
        }
    }
}

/// Kademlia for `me` in `mode`, taking answers up to 256 KiB (so that only the node's
/// bound, not the packet size, limits what it can hear).
fn kad_behaviour(me: PeerId, mode: kad::Mode) -> kad::Behaviour<MemoryStore> {
    let mut cfg = kad::Config::new(gpunode_node::network::KAD_PROTOCOL);
    cfg.set_max_packet_size(256 * 1024);
    let mut kad = kad::Behaviour::with_config(me, MemoryStore::new(me), cfg);
    kad.set_mode(Some(mode));
    kad
}

/// A peer that pushes identify again and again, each push naming 20 addresses it never
/// named before (600 in all): the node keeps at most libp2p-kad's bound of them for the
/// peer (the first it heard and the newest), so its `FIND_NODE` answers naming the peer
/// stay small. Without the bound the answer named 601 addresses, 31 KB: twice libp2p's
/// default packet size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_naming_ever_new_addresses_is_kept_within_the_bound() {
    let net = TestNet::gpu_providers(&["1xT4-16GB"])
        .start()
        .await
        .expect("start");
    let node = net.provider(0).handle.peer_id();
    let mut node_addr: Multiaddr = net.provider(0).addr.parse().expect("addr");
    node_addr.pop();

    let key = identity::Keypair::generate_ed25519();
    let me = key.public().to_peer_id();
    let mut chatty = libp2p::SwarmBuilder::with_existing_identity(key.clone())
        .with_tokio()
        .with_quic()
        .with_behaviour(|key| Chatty {
            identify: identify::Behaviour::new(
                identify::Config::new(
                    gpunode_node::network::IDENTIFY_PROTOCOL_VERSION.to_string(),
                    key.public(),
                )
                .with_hide_listen_addrs(true),
            ),
            kad: kad_behaviour(me, kad::Mode::Server),
        })
        .expect("behaviour")
        .build();
    chatty
        .listen_on("/ip4/127.0.0.1/udp/0/quic-v1".parse().expect("addr"))
        .expect("listen");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    // Its real address first: the one the node keeps whatever comes after it.
    let real = loop {
        let event = tokio::time::timeout_at(deadline, chatty.select_next_some())
            .await
            .expect("listening");
        if let SwarmEvent::NewListenAddr { address, .. } = event {
            chatty.add_external_address(address.clone());
            break address.with_p2p(me).expect("p2p");
        }
    };
    chatty.dial(node_addr.clone()).expect("dial");
    // Both identify exchanges done: the node has heard of the real address alone.
    let (mut heard, mut answered) = (false, false);
    let exchanged = |e: &ChattyEvent| {
        match e {
            ChattyEvent::Identify(identify::Event::Received { peer_id, .. })
                if *peer_id == node =>
            {
                heard = true
            }
            ChattyEvent::Identify(identify::Event::Sent { peer_id, .. }) if *peer_id == node => {
                answered = true
            }
            _ => {}
        }
        heard && answered
    };
    drive_until(&mut chatty, deadline, exchanged).await;
    // The node has taken the real address once the peer is in its routing table (empty
    // before: the node is alone, and a peer that dialled it is added on its identify).
    let handle = net.provider(0).handle.clone();
    let mut check = tokio::time::interval(Duration::from_millis(20));
    loop {
        tokio::select! {
            _ = chatty.select_next_some() => {}
            _ = check.tick() => {
                if handle.status().await.expect("status").routing_table_size >= 1 {
                    break;
                }
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the node never took the peer into its routing table"
        );
    }
    // 30 pushes of 20 new addresses each (libp2p keeps the newest 20 of our external
    // addresses, and identify sends them all).
    let address = |n: u16| -> Multiaddr {
        format!("/ip4/127.0.0.1/udp/{}/quic-v1", 20_000 + n)
            .parse()
            .expect("addr")
    };
    const PUSHES: u16 = 30;
    for push in 0..PUSHES {
        for i in 0..20 {
            chatty.add_external_address(address(push * 20 + i));
        }
        chatty.behaviour_mut().identify.push([node]);
        let pushed = |e: &ChattyEvent| matches!(e, ChattyEvent::Identify(identify::Event::Pushed { peer_id, .. }) if *peer_id == node);
        drive_until(&mut chatty, deadline, pushed).await;
    }
    // Identify sends a push's addresses in no set order: the newest the node keeps are
    // some of the last push's.
    let last_push: Vec<Multiaddr> = (0..20)
        .map(|i| address((PUSHES - 1) * 20 + i).with_p2p(me).expect("p2p"))
        .collect();
    let chatty = tokio::spawn(async move {
        loop {
            chatty.select_next_some().await;
        }
    });

    // Someone else asks the node for the peers closest to the chatty one.
    let mut asker = libp2p::SwarmBuilder::with_new_identity()
        .with_tokio()
        .with_quic()
        .with_behaviour(|key| Asker {
            kad: kad_behaviour(key.public().to_peer_id(), kad::Mode::Client),
        })
        .expect("behaviour")
        .build();
    asker.behaviour_mut().kad.add_address(&node, node_addr);
    let told = loop {
        let query = asker.behaviour_mut().kad.get_closest_peers(me);
        let told = loop {
            let event = tokio::time::timeout_at(deadline, asker.select_next_some())
                .await
                .expect("the node answers FIND_NODE in time");
            if let SwarmEvent::Behaviour(AskerEvent::Kad(kad::Event::OutboundQueryProgressed {
                id,
                result: kad::QueryResult::GetClosestPeers(result),
                ..
            })) = event
            {
                if id == query {
                    let peers = match result {
                        Ok(ok) => ok.peers,
                        Err(kad::GetClosestPeersError::Timeout { peers, .. }) => peers,
                    };
                    break peers.into_iter().find(|p| p.peer_id == me).map(|p| p.addrs);
                }
            }
        };
        // The node handles the last push on its own loop: ask until it shows.
        match told {
            // Past the bound already: no use waiting.
            Some(addrs) if addrs.len() > kad::MAX_PEER_ADDRESSES => break addrs,
            Some(addrs) if addrs.len() > 1 && addrs[1..].iter().all(|a| last_push.contains(a)) => {
                break addrs
            }
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    chatty.abort();
    let bytes: usize = told.iter().map(|a| a.as_ref().len()).sum();
    assert!(
        told.len() <= kad::MAX_PEER_ADDRESSES && bytes <= kad::MAX_PEER_ADDRESS_BYTES,
        "the node names the chatty peer with {} addresses, {bytes} bytes",
        told.len()
    );
    assert_eq!(
        told[0], real,
        "the first address heard is kept first: {told:?}"
    );
    // The node still serves its own peers.
    let mut net = net;
    let client = net.add_client().await.expect("client");
    TestNet::wait_for_offers(
        &client.handle,
        &OfferFilter::default(),
        Duration::from_secs(20),
        |o| o.len() == 1,
    )
    .await
    .expect("the node's offer is still found");
    net.shutdown().await;
}

/// The kit's attacks on real nodes: each one is refused, nothing is lost, and the honest
/// peer beside it is still served.
mod attacks {
    use std::time::Duration;

    use gpunode_node::LeaseSpec;
    use gpunode_node::Misbehaviour;
    use gpunode_node::{LeaseError, NodeConfig};
    use testnet::jobs::{request, run_to_end, task};
    use testnet::TestNet;

    const LONG: Duration = Duration::from_secs(120);

    async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
        crate::eventually(what, LONG, async || f()).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_flood_of_idle_job_streams_does_not_stop_an_honest_job() {
        let mut net = TestNet::providers(1)
            .with_clients(1)
            .start()
            .await
            .expect("start");
        let provider = net.provider(0).handle.clone();
        let attacker = net.client(0).handle.clone();
        // Open job streams and never say anything on them. The first open may have to dial
        // (slow on a loaded machine), so it gets the long deadline; after it, a stream that
        // takes over 10 s to open means the provider has stopped accepting them.
        let first = tokio::time::timeout(LONG, attacker.open_job_stream(provider.peer_id()))
            .await
            .expect("the first job stream opens in time")
            .expect("the first job stream opens");
        let mut held = vec![first];
        let mut stopped_by = String::from("nothing");
        for _ in 1..400 {
            match tokio::time::timeout(
                Duration::from_secs(10),
                attacker.open_job_stream(provider.peer_id()),
            )
            .await
            {
                Ok(Ok(s)) => held.push(s),
                Ok(Err(e)) => {
                    stopped_by = e.to_string();
                    break;
                }
                Err(_) => {
                    stopped_by = "a 10 s timeout".into();
                    break;
                }
            }
        }
        assert!(
            held.len() >= 100,
            "the attacker opened {} streams (stopped by {stopped_by})",
            held.len()
        );
        // An honest requester beside it still gets its job done.
        let client = net.add_client().await.expect("client").handle.clone();
        let input = tempfile::tempdir().expect("tmp");
        std::fs::write(input.path().join("data.bin"), b"honest bytes").expect("write");
        let out = tempfile::tempdir().expect("tmp");
        let req =
            request(task("copy.wat"), &out.path().join("out")).input(input.path().join("data.bin"));
        let (_, end) = run_to_end(&client, req, LONG).await.expect("run");
        let summary = end.expect("the honest job runs during the flood");
        assert_eq!(
            std::fs::read(summary.output_dir.join("copy.bin")).expect("output"),
            b"honest bytes"
        );
        // The idle streams were turned away (past the handler limit, or silent past the
        // first-message deadline), and counted.
        let metrics = provider.metrics().clone();
        eventually("the idle streams are dropped", || {
            metrics.stream_refused_count("job", "busy")
                + metrics.stream_refused_count("job", "silent")
                > 0
        })
        .await;
        drop(held);
        net.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_silent_settlement_stream_is_dropped_at_the_first_message_deadline() {
        let net = TestNet::providers(1)
            .with_clients(1)
            .start()
            .await
            .expect("start");
        // A peer opens a settlement stream (as a provider does ahead of a claim) and
        // never sends anything on it.
        let answering = net.provider(0).handle.clone();
        let silent = net.client(0).handle.clone();
        let protocol = gpunode_node::ledger::settle::SETTLE_PROTOCOL;
        let mut stream = silent
            .open_stream(answering.peer_id(), protocol)
            .await
            .expect("stream");
        // The node answering claims closes it at the first-message deadline (10 s), not
        // at the end of a whole exchange's time (20 s), and counts it.
        let mut byte = [0u8; 1];
        let closed = tokio::time::timeout(
            Duration::from_secs(15),
            futures::AsyncReadExt::read(&mut stream, &mut byte),
        )
        .await;
        assert!(
            matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
            "the silent stream is closed within 15 s: {closed:?}"
        );
        let metrics = answering.metrics();
        assert_eq!(metrics.stream_refused_count("settle", "silent"), 1);
        assert_eq!(metrics.receipt_rejected_count("malformed"), 0);
        net.shutdown().await;
    }

    fn evil_first(i: usize) -> Misbehaviour {
        match i {
            0 => Misbehaviour {
                evil_output_name: Some("../escape.bin"),
                ..Misbehaviour::default()
            },
            _ => Misbehaviour::default(),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_provider_naming_outputs_outside_the_job_writes_nothing_there() {
        let net = TestNet::providers(2)
            .misbehaviour(evil_first)
            .with_clients(1)
            .clients_see_offers(LONG)
            .start()
            .await
            .expect("start");
        let evil = net.provider_id(0);
        let client = net.client(0);
        let input = tempfile::tempdir().expect("tmp");
        std::fs::write(input.path().join("data.bin"), b"the bytes").expect("write");
        let work = tempfile::tempdir().expect("tmp");
        let mut req = request(task("copy.wat"), &work.path().join("out"))
            .input(input.path().join("data.bin"))
            .peer(evil)
            .retries(0);
        let (_, end) = run_to_end(&client.handle, req.clone(), LONG)
            .await
            .expect("run");
        let err = end.expect_err("the evil provider's outputs are refused");
        assert!(err.contains("refused"), "{err}");
        // Nothing escaped, and nothing of the job was left behind.
        assert!(!work.path().join("escape.bin").exists());
        assert_eq!(std::fs::read_dir(work.path()).expect("dir").count(), 0);
        // The honest provider serves the same job.
        req.peer = None;
        req.retries = 2;
        req.replicas = 0;
        let (_, end) = run_to_end(&client.handle, req, LONG).await.expect("run");
        let summary = end.expect("an honest provider runs it");
        assert_eq!(
            std::fs::read(summary.output_dir.join("copy.bin")).expect("output"),
            b"the bytes"
        );
        net.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn holding_a_gpu_without_running_anything_is_billed() {
        // A credit a second, so that two seconds show in whole millicredits.
        let net = TestNet::gpu_providers(&["1xT4-16GB"])
            .tweak(|_, c: &mut NodeConfig| c.price_per_gpu_hour = 3600.0)
            .with_clients(1)
            .start()
            .await
            .expect("start");
        let provider = net.provider_id(0);
        let client = net.client(0);
        // A hoarder leases the GPU, runs nothing, and lets go after two seconds.
        let spec = LeaseSpec::new(1, 60_000).peer(&provider);
        let lease = client.handle.request_lease(spec).await.expect("lease");
        tokio::time::sleep(Duration::from_secs(2)).await;
        client
            .handle
            .cancel_lease(&lease.lease_id)
            .await
            .expect("cancel");
        // Both sides settle a receipt for the time it held the GPU, not zero.
        let ledger = &net.provider(0).handle.accounts().ledger;
        let mut entry = None;
        eventually("the receipt settles", || {
            entry = ledger.recent(1).expect("ledger").into_iter().next();
            entry.is_some()
        })
        .await;
        let entry = entry.expect("entry");
        assert_eq!(entry.jobs, 0);
        assert!(
            entry.billed_seconds >= 2.0 && entry.billed_seconds < 60.0,
            "{entry:?}"
        );
        assert!(entry.amount >= 2.0, "holding is not free: {entry:?}");
        net.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn outputs_larger_than_the_requester_accepts_are_refused_before_a_byte() {
        let net = TestNet::providers(1)
            .with_clients(1)
            .clients_see_offers(LONG)
            .start()
            .await
            .expect("start");
        let client = net.client(0);
        let input = tempfile::tempdir().expect("tmp");
        std::fs::write(input.path().join("data.bin"), vec![7u8; 4096]).expect("write");
        let work = tempfile::tempdir().expect("tmp");
        let req = request(task("copy.wat"), &work.path().join("out"))
            .input(input.path().join("data.bin"))
            .retries(0)
            .max_output_bytes(1000);
        let (_, end) = run_to_end(&client.handle, req, LONG).await.expect("run");
        let err = end.expect_err("4096 bytes of outputs, 1000 accepted");
        assert!(err.contains("--max-output"), "{err}");
        assert_eq!(std::fs::read_dir(work.path()).expect("dir").count(), 0);
        net.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_request_that_expires_far_ahead_is_refused_and_pins_nothing() {
        use gpunode_protocol::lease::{
            LeaseMessage, LeaseReply, LeaseRequest, RejectCode, Requirements, LEASE_VERSION,
        };
        let net = TestNet::gpu_providers(&["1xT4-16GB"])
            .with_clients(1)
            .start()
            .await
            .expect("start");
        let provider = net.provider(0).handle.peer_id();
        let client = net.client(0);
        let key = client
            .data_dir()
            .load_or_create_identity()
            .expect("the client's own key");
        let now = gpunode_protocol::time::now_ms();
        let req = LeaseRequest {
            version: LEASE_VERSION,
            requester: client.handle.peer_id(),
            requester_key: key.public().encode_protobuf(),
            nonce: 99,
            requirements: Requirements {
                gpus: 1,
                gpu_model: None,
                gpu_slice: None,
                min_gpu_mem_bytes: None,
                cpus: 1,
                mem_bytes: 1 << 20,
                backend: "wasm".into(),
                kind: Default::default(),
            },
            duration_ms: 60_000,
            max_price_per_gpu_hour_millicredits: None,
            sent_at_ms: now,
            expires_at_ms: u64::MAX,
            ticket: None,
            start_at_ms: None,
        };
        let reply = client
            .handle
            .send_lease(provider, Vec::new(), LeaseMessage::Request(req))
            .await
            .expect("sent")
            .expect("answered");
        match reply {
            LeaseReply::Rejected(r) => assert_eq!(r.code, RejectCode::InvalidRequest, "{r:?}"),
            other => panic!("expected a refusal, got {other:?}"),
        }
        // The provider still serves an honest lease at once.
        client
            .handle
            .request_lease(LeaseSpec::new(1, 60_000).peer(provider.to_string()))
            .await
            .expect("honest lease");
        // What peers fill is visible against its bound: the honest lease's record and
        // nonce, nothing of the refused request.
        let metrics = net.provider(0).handle.metrics().clone();
        let gauge = |name: &str| -> Option<i64> {
            let text = metrics.encode();
            let key = format!("gpunode_peer_state{{structure=\"{name}\"}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(key.as_str()))
                .and_then(|v| v.trim().parse().ok())
        };
        eventually("the peer-state gauges", || {
            gauge("lease_records") == Some(1) && gauge("spent_nonces") == Some(1)
        })
        .await;
        net.shutdown().await;
    }

    fn same_lease_id(_: usize) -> Misbehaviour {
        Misbehaviour {
            fixed_lease_id: Some([0x5a; 16]),
            ..Misbehaviour::default()
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_provider_reusing_a_lease_id_cannot_overwrite_a_record() {
        let net = TestNet::gpu_providers(&["1xT4-16GB"; 2])
            .misbehaviour(same_lease_id)
            .with_clients(1)
            .start()
            .await
            .expect("start");
        let (first, second) = (net.provider_id(0), net.provider_id(1));
        let client = net.client(0);
        let mut spec = LeaseSpec::new(1, 60_000).peer(&first);
        let lease = client
            .handle
            .request_lease(spec.clone())
            .await
            .expect("lease");
        assert_eq!(lease.provider, first);
        // The second provider offers under the same id: refused, the first record kept.
        spec.peer = Some(second);
        let err = client
            .handle
            .request_lease(spec)
            .await
            .expect_err("a colliding id is refused");
        assert!(err.to_string().contains("already holds"), "{err}");
        let kept = client.handle.list_leases().await.expect("leases");
        assert_eq!(kept.len(), 1);
        assert_eq!(kept[0].provider, first);
        net.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_peer_cannot_open_more_than_its_share_of_connections() {
        use futures::StreamExt;
        use libp2p::swarm::dial_opts::{DialOpts, PeerCondition};
        use libp2p::swarm::SwarmEvent;
        let mut net = TestNet::providers(1).start().await.expect("start");
        let provider = net.provider(0).handle.peer_id();
        let addr: libp2p::Multiaddr = net.provider(0).addr.parse().expect("addr");
        // One identity dials the provider fifty times and keeps every connection.
        let mut swarm = libp2p::SwarmBuilder::with_new_identity()
            .with_tokio()
            .with_quic()
            .with_behaviour(|_| libp2p::swarm::dummy::Behaviour)
            .expect("behaviour")
            .with_swarm_config(|c| c.with_idle_connection_timeout(Duration::from_secs(60)))
            .build();
        for _ in 0..50 {
            let opts = DialOpts::peer_id(provider)
                .addresses(vec![addr.clone()])
                .condition(PeerCondition::Always)
                .build();
            swarm.dial(opts).expect("dial");
        }
        // Count until every dial has been answered, at most 8 are up and nothing has
        // happened for 2 s (the provider closes what it refuses right after the
        // handshake; on a loaded machine the closes may come late, so the count waits
        // for them up to the deadline).
        let (mut up, mut answered) = (0i32, 0);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while tokio::time::Instant::now() < deadline {
            match tokio::time::timeout(Duration::from_secs(2), swarm.select_next_some()).await {
                Ok(SwarmEvent::ConnectionEstablished { .. }) => {
                    up += 1;
                    answered += 1;
                }
                Ok(SwarmEvent::OutgoingConnectionError { .. }) => answered += 1,
                Ok(SwarmEvent::ConnectionClosed { .. }) => up -= 1,
                Ok(_) => {}
                Err(_) if answered >= 50 && up <= 8 => break,
                Err(_) => {}
            }
        }
        assert_eq!(answered, 50, "every dial was answered");
        // The provider kept at most its per-peer limit (8) of them.
        let status = net.provider(0).handle.status().await.expect("status");
        assert!(up <= 8, "{up} connections stayed up");
        // And an honest requester is served meanwhile.
        let client = net.add_client().await.expect("client");
        client
            .handle
            .request_lease(LeaseSpec::new(0, 60_000).peer(provider.to_string()))
            .await
            .expect("honest lease");
        assert!(status.connected_peers.len() <= 8);
        net.shutdown().await;
    }

    fn overcharge_first(i: usize) -> Misbehaviour {
        match i {
            0 => Misbehaviour {
                overcharge: 5,
                ..Misbehaviour::default()
            },
            _ => Misbehaviour::default(),
        }
    }

    fn cheapest_first(i: usize, c: &mut NodeConfig) {
        c.price_per_gpu_hour = if i == 0 { 0.5 } else { 1.0 };
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_offer_above_the_advertised_price_is_refused() {
        let net = TestNet::gpu_providers(&["1xT4-16GB"; 2])
            .misbehaviour(overcharge_first)
            .tweak(cheapest_first)
            .with_clients(1)
            .clients_see_offers(LONG)
            .start()
            .await
            .expect("start");
        let (liar, honest) = (net.provider_id(0), net.provider_id(1));
        let client = net.client(0);
        // No --max-price: the advertised price is the most a lease may cost.
        let mut spec = LeaseSpec::new(1, 60_000).peer(&liar);
        let err = client
            .handle
            .request_lease(spec.clone())
            .await
            .expect_err("the liar's price is refused");
        match err {
            LeaseError::AllRefused(list) => {
                assert!(list[0].1.contains("price"), "{list:?}")
            }
            other => panic!("expected a price refusal, got {other:?}"),
        }
        // Without --peer the lease goes to the provider that charges what it advertises.
        spec.peer = None;
        let lease = client.handle.request_lease(spec).await.expect("a lease");
        assert_eq!(lease.provider, honest);
        assert_eq!(lease.price_per_gpu_hour, 1.0);
        net.shutdown().await;
    }
}
