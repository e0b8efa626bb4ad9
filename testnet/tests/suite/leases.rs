//! Lease negotiation between real nodes on 127.0.0.1: races for the last GPU, and hostile
//! lease messages that must be refused without harming the provider.

use std::time::Duration;

use futures::{AsyncReadExt, AsyncWriteExt, StreamExt};
use gpunode_node::lease::{LeaseRole, LeaseState};
use gpunode_node::{LeaseError, LeaseSpec, NodeConfig};
use gpunode_protocol::advert::OfferFilter;
use gpunode_protocol::encoding;
use gpunode_protocol::lease::{
    decode_reply, LeaseMessage, LeaseReply, LeaseRequest, RejectCode, Requirements, LEASE_VERSION,
    MAX_LEASE_MESSAGE_BYTES,
};
use gpunode_protocol::time::now_ms;
use libp2p::request_response::{self, Codec, ProtocolSupport};
use libp2p::swarm::SwarmEvent;
use libp2p::{identity, Multiaddr, PeerId, StreamProtocol};
use testnet::TestNet;

/// One A100, a CPU and 1 GiB for ten minutes, from any provider.
fn spec() -> LeaseSpec {
    LeaseSpec::new(1, 600_000)
        .gpu_model("A100")
        .cpus(1)
        .mem_bytes(1 << 30)
}

fn cheap_first(i: usize, c: &mut NodeConfig) {
    c.price_per_gpu_hour = if i == 0 { 0.5 } else { 2.0 };
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_requesters_race_for_the_last_gpu() {
    let net = TestNet::gpu_providers(&["1xA100-80GB", "1xA100-40GB"])
        .tweak(cheap_first)
        .with_clients(2)
        .start()
        .await
        .expect("start");
    let (alice, bob) = (net.client(0), net.client(1));
    let a100 = OfferFilter {
        gpu_model: Some("A100".into()),
        gpu_slice: None,
        ..OfferFilter::default()
    };
    TestNet::wait_for_offers(&alice.handle, &a100, Duration::from_secs(20), |o| {
        o.len() == 2
    })
    .await
    .expect("both providers visible");
    TestNet::wait_for_offers(&bob.handle, &a100, Duration::from_secs(20), |o| {
        o.len() == 2
    })
    .await
    .expect("both providers visible");
    let cheap = net.provider_id(0);
    // Both ask the cheap provider for its only GPU at the same moment.
    let (ra, rb) = tokio::join!(
        alice.handle.request_lease(spec().peer(cheap.clone())),
        bob.handle.request_lease(spec().peer(cheap.clone()))
    );
    let (winner, loser, refusal) = match (ra, rb) {
        (Ok(l), Err(e)) => (l, bob, e),
        (Err(e), Ok(l)) => (l, alice, e),
        other => panic!("exactly one must win: {other:?}"),
    };
    assert_eq!(winner.provider, cheap);
    assert_eq!(winner.state, LeaseState::Active);
    assert_eq!(
        (
            winner.provider_signature.as_str(),
            winner.requester_signature.as_str()
        ),
        ("valid", "valid")
    );
    match refusal {
        LeaseError::AllRefused(list) => {
            assert_eq!(list.len(), 1);
            assert!(list[0].1.contains("no A100 GPU free"), "{list:?}");
        }
        other => panic!("expected a refusal, got {other}"),
    }
    // The loser asks the network at large and gets the other provider.
    let second = loser
        .handle
        .request_lease(spec())
        .await
        .expect("second provider");
    assert_eq!(second.provider, net.provider_id(1));
    // The cheap provider lent exactly one GPU, and both sides agree on the lease.
    let provider_view = net.provider(0).handle.list_leases().await.expect("list");
    let active: Vec<_> = provider_view
        .iter()
        .filter(|l| l.state == LeaseState::Active)
        .collect();
    assert_eq!(active.len(), 1);
    assert_eq!(active[0].lease_id, winner.lease_id);
    assert_eq!(active[0].role, LeaseRole::Provider);
    assert!(
        net.provider(0)
            .handle
            .metrics()
            .lease_rejected_count("no_capacity")
            >= 1
    );
    // The lent GPU is advertised as leased.
    let offers = TestNet::wait_for_offers(&loser.handle, &a100, Duration::from_secs(20), |o| {
        o.len() == 2
            && o.iter().all(|x| {
                x.gpus
                    .iter()
                    .all(|g| g.state == gpunode_protocol::gpu::GpuState::Leased)
            })
    })
    .await
    .expect("leased state advertised");
    assert_eq!(offers.len(), 2);
    net.shutdown().await;
}

/// A requester that holds the provider's current advert proposes the terms with its
/// request and gets the lease in one round trip; the second lease, proposed from
/// whatever advert the requester holds by then (current, or one that still shows the
/// first GPU idle), is granted or offered on the other GPU. Both are active, signed by
/// both, on different GPUs, and the provider counted each proposal's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_proposed_from_the_providers_advert_is_granted_in_one_round_trip() {
    let net = TestNet::gpu_providers(&["2xA100-80GB"])
        .with_clients(1)
        .start()
        .await
        .expect("start");
    let client = net.client(0);
    let a100 = OfferFilter {
        gpu_model: Some("A100".into()),
        ..OfferFilter::default()
    };
    TestNet::wait_for_offers(&client.handle, &a100, Duration::from_secs(20), |o| {
        o.len() == 1 && o[0].gpus.len() == 2
    })
    .await
    .expect("provider visible");
    let provider = net.provider_id(0);
    let metrics = net.provider(0).handle.metrics().clone();
    let first = client
        .handle
        .request_lease(spec().peer(provider.clone()))
        .await
        .expect("first lease");
    assert_eq!(metrics.lease_proposal_count("granted"), 1);
    assert_eq!(metrics.lease_messages.get(), 1, "one message: the proposal");
    let second = client
        .handle
        .request_lease(spec().peer(provider.clone()))
        .await
        .expect("second lease");
    assert_eq!(
        metrics.lease_proposal_count("granted") + metrics.lease_proposal_count("offered"),
        2
    );
    for lease in [&first, &second] {
        assert_eq!(lease.state, LeaseState::Active);
        assert_eq!(
            (
                lease.provider_signature.as_str(),
                lease.requester_signature.as_str()
            ),
            ("valid", "valid")
        );
    }
    assert_ne!(first.gpus[0].uuid, second.gpus[0].uuid);
    let on_provider = net.provider(0).handle.list_leases().await.expect("list");
    for lease in [&first, &second] {
        let there = on_provider
            .iter()
            .find(|l| l.lease_id == lease.lease_id)
            .expect("the provider holds the lease");
        assert_eq!(there.state, LeaseState::Active);
        assert_eq!(there.requester_signature, "valid");
    }
    net.shutdown().await;
}

#[derive(Clone, Default)]
struct RawCodec;

impl Codec for RawCodec {
    type Protocol = StreamProtocol;
    type Request = Vec<u8>;
    type Response = Vec<u8>;
    async fn read_request<T: futures::AsyncRead + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
    ) -> std::io::Result<Vec<u8>> {
        let mut b = Vec::new();
        io.read_to_end(&mut b).await?;
        Ok(b)
    }
    async fn read_response<T: futures::AsyncRead + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
    ) -> std::io::Result<Vec<u8>> {
        let mut b = Vec::new();
        io.take(1 << 20).read_to_end(&mut b).await?;
        Ok(b)
    }
    async fn write_request<T: futures::AsyncWrite + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        req: Vec<u8>,
    ) -> std::io::Result<()> {
        io.write_all(&req).await?;
        io.close().await
    }
    async fn write_response<T: futures::AsyncWrite + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        res: Vec<u8>,
    ) -> std::io::Result<()> {
        io.write_all(&res).await?;
        io.close().await
    }
}

/// Sends raw bytes on the lease protocol and returns the decoded reply.
async fn raw_exchange(
    swarm: &mut libp2p::Swarm<request_response::Behaviour<RawCodec>>,
    peer: PeerId,
    addr: &Multiaddr,
    bytes: Vec<u8>,
) -> LeaseReply {
    let id = swarm
        .behaviour_mut()
        .send_request_with_addresses(&peer, bytes, vec![addr.clone()]);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        tokio::select! {
            ev = swarm.select_next_some() => match ev {
                SwarmEvent::Behaviour(request_response::Event::Message {
                    message: request_response::Message::Response { request_id, response }, ..
                }) if request_id == id => return decode_reply(&response).expect("provider reply decodes"),
                SwarmEvent::Behaviour(request_response::Event::OutboundFailure { request_id, error, .. }) if request_id == id => {
                    panic!("request failed: {error}")
                }
                _ => {}
            },
            _ = tokio::time::sleep_until(deadline) => panic!("no reply within 20s"),
        }
    }
}

fn rejected(reply: LeaseReply) -> RejectCode {
    match reply {
        LeaseReply::Rejected(r) => r.code,
        other => panic!("expected a rejection, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_lease_messages_are_rejected_with_reasons_and_reserve_nothing() {
    let net = TestNet::gpu_providers(&["1xA100-80GB"])
        .start()
        .await
        .expect("start");
    let provider = net.provider(0);
    let addr: Multiaddr = provider.addr.parse().expect("addr");
    let peer = provider.handle.peer_id();
    let key = identity::Keypair::generate_ed25519();
    let me = key.public().to_peer_id();
    let mut swarm = libp2p::SwarmBuilder::with_existing_identity(key.clone())
        .with_tokio()
        .with_quic()
        .with_behaviour(|_| {
            request_response::Behaviour::with_codec(
                RawCodec,
                [(
                    StreamProtocol::new("/gpunode/lease/1.0.0"),
                    ProtocolSupport::Outbound,
                )],
                request_response::Config::default(),
            )
        })
        .expect("behaviour")
        .build();

    // Garbage bytes and an oversized message: refused with a reason, connection kept.
    assert_eq!(
        rejected(raw_exchange(&mut swarm, peer, &addr, b"\xff\x00garbage".to_vec()).await),
        RejectCode::Malformed
    );
    let big = vec![0u8; MAX_LEASE_MESSAGE_BYTES + 10];
    assert_eq!(
        rejected(raw_exchange(&mut swarm, peer, &addr, big).await),
        RejectCode::Oversized
    );

    let request = |requester: PeerId, nonce: u64| {
        let now = now_ms();
        LeaseRequest {
            version: LEASE_VERSION,
            requester,
            requester_key: key.public().encode_protobuf(),
            nonce,
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
            expires_at_ms: now + 30_000,
            ticket: None,
            start_at_ms: None,
        }
    };
    let send = |m: LeaseMessage| encoding::encode(&m);
    // A request naming another peer than the one on the connection.
    let other = identity::Keypair::generate_ed25519().public().to_peer_id();
    let r = raw_exchange(
        &mut swarm,
        peer,
        &addr,
        send(LeaseMessage::Request(request(other, 1))),
    )
    .await;
    assert_eq!(rejected(r), RejectCode::WrongKey);
    // A request whose clock is far ahead.
    let mut skewed = request(me, 2);
    skewed.sent_at_ms += 3_600_000;
    skewed.expires_at_ms += 3_600_000;
    assert_eq!(
        rejected(raw_exchange(&mut swarm, peer, &addr, send(LeaseMessage::Request(skewed))).await),
        RejectCode::ClockSkew
    );
    // A valid request gets an offer; the same request again is a replay.
    let good = request(me, 3);
    let offer = raw_exchange(
        &mut swarm,
        peer,
        &addr,
        send(LeaseMessage::Request(good.clone())),
    )
    .await;
    let LeaseReply::Offer {
        terms,
        provider_sig,
    } = offer
    else {
        panic!("expected an offer, got {offer:?}");
    };
    assert_eq!(
        rejected(raw_exchange(&mut swarm, peer, &addr, send(LeaseMessage::Request(good))).await),
        RejectCode::Replay
    );
    // Accept with a forged countersignature, then with altered terms: both refused.
    let forged = terms
        .sign(&identity::Keypair::generate_ed25519())
        .expect("sign");
    let m = LeaseMessage::Accept {
        terms: terms.clone(),
        provider_sig: provider_sig.clone(),
        requester_sig: forged,
    };
    assert_eq!(
        rejected(raw_exchange(&mut swarm, peer, &addr, send(m)).await),
        RejectCode::BadSignature
    );
    let mut altered = terms.clone();
    altered.price_per_gpu_hour_millicredits = 0;
    let sig = altered.sign(&key).expect("sign");
    let m = LeaseMessage::Accept {
        terms: altered,
        provider_sig: provider_sig.clone(),
        requester_sig: sig,
    };
    assert_eq!(
        rejected(raw_exchange(&mut swarm, peer, &addr, send(m)).await),
        RejectCode::TermsAltered
    );
    // Nothing became active; the only GPU is merely held for the offer window.
    let leases = provider.handle.list_leases().await.expect("list");
    assert!(leases.iter().all(|l| l.state != LeaseState::Active));
    // The honest accept still works: the node and the connection are healthy.
    let sig = terms.sign(&key).expect("sign");
    let m = LeaseMessage::Accept {
        terms: terms.clone(),
        provider_sig,
        requester_sig: sig,
    };
    assert_eq!(
        raw_exchange(&mut swarm, peer, &addr, send(m)).await,
        LeaseReply::Activated {
            lease_id: terms.lease_id
        }
    );
    // Every refusal was counted.
    let metrics = provider.handle.metrics();
    for reason in [
        "malformed",
        "oversized",
        "wrong_key",
        "clock_skew",
        "replay",
        "bad_signature",
        "terms_altered",
    ] {
        assert_eq!(
            metrics.lease_rejected_count(reason),
            1,
            "{reason}: {}",
            metrics.encode()
        );
    }
    net.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provider_restart_keeps_leases_and_their_gpus() {
    let mut net = TestNet::gpu_providers(&["1xA100-80GB", "2xT4-16GB"])
        .with_clients(1)
        .start()
        .await
        .expect("start");
    let client = net.client(0).handle.clone();
    let t4 = OfferFilter {
        gpu_model: Some("T4".into()),
        gpu_slice: None,
        ..OfferFilter::default()
    };
    TestNet::wait_for_offers(&client, &t4, Duration::from_secs(20), |o| o.len() == 1)
        .await
        .expect("provider visible");
    let mut s = spec().gpu_model("T4");
    let lease = client.request_lease(s.clone()).await.expect("lease");
    // Restart the provider on the same data dir.
    let provider = net.nodes.remove(1);
    let cfg = net.config().clone();
    let dir = provider.stop_keeping_data().await;
    let restarted = testnet::start_node_in(
        &cfg,
        1,
        Some(&"2xT4-16GB".to_string()),
        &[net.nodes[0].addr.clone()],
        dir,
    )
    .await
    .expect("restart");
    // The client learns the restarted node's new address from its new advert.
    let new_addr = restarted
        .addr
        .trim_end_matches(&format!("/p2p/{}", restarted.handle.peer_id()))
        .to_string();
    TestNet::wait_for_offers(&client, &t4, Duration::from_secs(30), |o| {
        o.len() == 1 && o[0].listen_addrs.contains(&new_addr)
    })
    .await
    .expect("new advert visible");
    let after = restarted.handle.list_leases().await.expect("list");
    assert_eq!(after.len(), 1);
    assert_eq!(after[0].lease_id, lease.lease_id);
    assert_eq!(after[0].state, LeaseState::Active);
    assert_eq!(after[0].requester_signature, "valid");
    // One T4 is still lent after the restart: asking for two fails, one succeeds.
    let mut two = s.clone();
    two.gpus = 2;
    two.peer = Some(restarted.handle.peer_id().to_string());
    match client.request_lease(two).await {
        Err(LeaseError::AllRefused(list)) => {
            assert!(list[0].1.contains("needs 2 x T4"), "{list:?}")
        }
        other => panic!("expected a capacity refusal, got {other:?}"),
    }
    s.peer = Some(restarted.handle.peer_id().to_string());
    client.request_lease(s).await.expect("the second T4");
    net.shutdown().await;
}

/// The lease bench counts the provider's CPU time apart by running it on a runtime of
/// its own (`--provider-threads`): such a node grants leases like any other, and its
/// work shows on that runtime's threads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_on_a_runtime_of_its_own_grants_leases_on_its_own_threads() {
    const NAME: &str = "own-rt-lessor";
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(NAME)
        .enable_all()
        .build()
        .expect("runtime");
    let mut config = testnet::TestNetConfig::new(vec![Some("1xA100-80GB".to_string())]);
    config.tweak = Some(testnet::roomy);
    config.first_node_runtime = Some(runtime.handle().clone());
    let net = TestNet::configured(config)
        .with_clients(1)
        .start()
        .await
        .expect("start");
    let spec = LeaseSpec::new(0, 1_000)
        .peer(net.provider_id(0))
        .cpus(1)
        .mem_bytes(1 << 20);
    // Twenty leases, and more until the provider's threads have used 50 ms of CPU more
    // than its start took (USER_HZ steps of 10 ms): a provider whose work ran elsewhere
    // never gets there.
    let started = testnet::cpu_seconds(Some(NAME));
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let mut granted = 0;
    while granted < 20 || testnet::cpu_seconds(Some(NAME)) - started < 0.05 {
        assert!(
            std::time::Instant::now() < deadline,
            "{granted} leases granted, provider threads counted {} s after {started} s",
            testnet::cpu_seconds(Some(NAME))
        );
        let lease = net
            .client(0)
            .handle
            .request_lease(spec.clone())
            .await
            .expect("lease granted");
        assert_eq!(lease.state, LeaseState::Active);
        granted += 1;
    }
    assert!(testnet::cpu_seconds(None) > testnet::cpu_seconds(Some(NAME)));
    net.shutdown().await;
    runtime.shutdown_background();
}
