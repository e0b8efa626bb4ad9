//! A model with more providers than libp2p's Kademlia answer carries (29 real nodes on
//! 127.0.0.1).
//! A test binary of its own: beside the suite's tests, which run in parallel, a network
//! this size on two cores starved them (a flood test's first stream timed out) and its
//! own late publications.

use std::collections::BTreeSet;
use std::time::Duration;

use gpunode_protocol::advert::OfferFilter;
use testnet::TestNet;

/// libp2p's Kademlia answers with at most 20 of a key's providers; gpunode's answers name
/// up to 64 (`network::PROVIDER_ANSWER_LIMIT`, as many as a query asks), so a model with
/// more providers than 20 is found whole, by one query. (With libp2p's 20 this took a
/// lookup that asked every node near the key; past 64 a query stops at 64 anyway.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_with_more_providers_than_libp2ps_answer_carries_is_found_whole() {
    const PROVIDERS: usize = 28;
    let net = TestNet::gpu_providers(&["1xA100-80GB"; PROVIDERS])
        .with_clients(1)
        .start()
        .await
        .expect("start");
    let a100 = OfferFilter {
        gpu_model: Some("A100".into()),
        ..OfferFilter::default()
    };
    let one_answer = TestNet::wait_for_offers(
        &net.client(0).handle,
        &a100,
        Duration::from_secs(180),
        |o| o.len() == PROVIDERS,
    );
    let all = one_answer.await.expect("every provider in one answer");
    let found: BTreeSet<String> = all.iter().map(|o| o.peer_id.clone()).collect();
    let started: BTreeSet<String> = (0..PROVIDERS).map(|i| net.provider_id(i)).collect();
    assert_eq!(found, started);
    net.shutdown().await;
}
