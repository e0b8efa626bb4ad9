//! A job that no provider can take now waits (`--wait`) in the provider's queue with its
//! place and the reason, and starts as soon as one can; without `--wait` it fails at
//! once. When two users flood a provider, the one that used it less is served first.
//! When the GPU frees, the provider tells the waiting job at once; notices from anyone
//! else, or for tickets nobody waits under, move nothing.

use std::time::Duration;

use futures::AsyncWriteExt;
use gpunode_node::lease::turns::{encode_notice, encode_withdrawal, TURN_PROTOCOL};

use gpunode_node::jobs::{JobEvent, JobState};
use gpunode_node::LeaseSpec;
use testnet::jobs::{events_until, outcome, request, task, until_end};
use testnet::TestNet;

const LONG: Duration = Duration::from_secs(60);

/// One provider with one A100, and two clients that see its offer.
async fn one_gpu_and_two_clients() -> TestNet {
    TestNet::gpu_providers(&["1xA100-80GB"])
        .with_clients(2)
        .clients_see_offers(LONG)
        .start()
        .await
        .expect("start")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_job_says_why_and_is_told_when_the_gpu_frees() {
    let net = one_gpu_and_two_clients().await;
    let (holder, client) = (net.client(0), net.client(1));
    let provider = net.provider_id(0);
    let held = holder
        .handle
        .request_lease(LeaseSpec::new(1, 120_000).peer(&provider))
        .await
        .expect("the only GPU");

    let dir = tempfile::tempdir().expect("tempdir");
    // Without --wait: fails at once, naming the reason.
    let mut req = request(task("copy.wat"), &dir.path().join("a"))
        .gpus(1)
        .wait(false);
    let view = client.handle.submit_job(req.clone());
    let mut from = 0;
    let events = until_end(&client.handle, &view.job_id, &mut from)
        .await
        .expect("end");
    let error = outcome(&events).expect("ended").expect_err("no GPU now");
    assert!(error.contains("no GPU free"), "{error}");

    // With --wait: waits, says why, and runs once the GPU is free.
    req.wait = Some(true);
    req.output_dir = dir.path().join("b");
    let view = client.handle.submit_job(req);
    let mut from = 0;
    events_until(&client.handle, &view.job_id, &mut from, LONG, |e| {
        matches!(e, JobEvent::Waiting { .. })
    })
    .await
    .expect("waiting");
    let waiting = client.handle.get_job(&view.job_id).expect("job");
    assert_eq!(waiting.state, JobState::Waiting);
    let why = waiting.waiting.expect("why");
    assert!(
        why.reasons
            .iter()
            .any(|(_, r)| r.contains("queued: position 1 of 1")
                && r.contains("GPU 0 is leased until")),
        "{:?}",
        why.reasons
    );
    let (at, place) = why.queue.expect("a place in the provider's queue");
    assert_eq!(at, provider);
    assert!(
        place.estimated_start_ms.is_some_and(|t| t >= held.end_ms),
        "starts when the holder's lease ends: {place:?}"
    );
    // Forged notices, here from the provider itself (the one peer the client is
    // connected to): a guessed ticket, garbage, and an oversized one. Each is counted
    // and refused; the job keeps waiting. (A notice with the right ticket from a
    // provider not queueing it is refused too: `lease::turns`' unit tests.)
    for bytes in [
        encode_notice(0x5eed_f00d).to_vec(),
        vec![0xff; 5],
        vec![1; 64],
    ] {
        let mut stream = net
            .provider(0)
            .handle
            .link()
            .open_stream(client.handle.peer_id(), TURN_PROTOCOL)
            .await
            .expect("a turn stream");
        let _ = stream.write_all(&bytes).await;
        let _ = stream.close().await;
    }
    // The holder, connected to the provider, tries to withdraw a request it does not
    // own (it cannot know the ticket; it guesses): the provider refuses and counts it.
    let mut stream = holder
        .handle
        .link()
        .open_stream(net.provider(0).handle.peer_id(), TURN_PROTOCOL)
        .await
        .expect("a turn stream to the provider");
    let _ = stream.write_all(&encode_withdrawal(0x5eed_f00d)).await;
    let _ = stream.close().await;
    let provider_metrics = net.provider(0).handle.metrics();
    wait_for(|| provider_metrics.queue_turn_count("withdraw_not_queued") == 1).await;
    let metrics = client.handle.metrics();
    wait_for(|| metrics.queue_turn_count("unknown_ticket") == 1).await;
    wait_for(|| metrics.queue_turn_count("malformed") == 2).await;
    assert_eq!(
        client.handle.get_job(&view.job_id).expect("job").state,
        JobState::Waiting
    );
    assert_eq!(metrics.queue_turn_count("woke"), 0);

    holder
        .handle
        .cancel_lease(&held.lease_id)
        .await
        .expect("free the GPU");
    // The provider tells the waiting job its turn came, and the job acts on it.
    wait_for(|| net.provider(0).handle.metrics().queue_turn_count("sent") == 1).await;
    wait_for(|| metrics.queue_turn_count("woke") == 1).await;
    let events = until_end(&client.handle, &view.job_id, &mut from)
        .await
        .expect("end");
    let summary = outcome(&events)
        .expect("ended")
        .expect("it ran once the GPU was free");
    assert_eq!(summary.provider, provider);
    assert!(client
        .handle
        .get_job(&view.job_id)
        .expect("job")
        .waiting
        .is_none());
    net.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_user_with_less_recent_usage_is_served_first() {
    let net = one_gpu_and_two_clients().await;
    let (heavy, light) = (net.client(0), net.client(1));
    let provider = net.provider_id(0);
    // The heavy user holds the only GPU for a while: that is its recent usage (fair share
    // counts GPU time actually held, so this wait is what the test measures, not a guess
    // at how long something takes).
    let held = heavy
        .handle
        .request_lease(LeaseSpec::new(1, 120_000).peer(&provider))
        .await
        .expect("the only GPU");
    tokio::time::sleep(Duration::from_secs(2)).await;

    // Both flood the provider; the heavy user's jobs are queued first.
    let dir = tempfile::tempdir().expect("tempdir");
    let mut jobs = Vec::new();
    for (name, client) in [("heavy", heavy), ("light", light)] {
        for i in 0..2 {
            let req = request(task("copy.wat"), &dir.path().join(format!("{name}{i}")))
                .gpus(1)
                .wait(true);
            let view = client.handle.submit_job(req);
            let mut from = 0;
            events_until(&client.handle, &view.job_id, &mut from, LONG, |e| {
                matches!(e, JobEvent::Waiting { queue: Some(_), .. })
            })
            .await
            .expect("queued");
            jobs.push((name, client.handle.clone(), view.job_id, from));
        }
    }
    heavy
        .handle
        .cancel_lease(&held.lease_id)
        .await
        .expect("free the GPU");
    for (name, handle, id, from) in &mut jobs {
        let events = until_end(handle, id, from).await.expect("end");
        outcome(&events)
            .expect("ended")
            .unwrap_or_else(|e| panic!("{name}'s job failed: {e}"));
    }
    // The provider's leases in the order it granted them, after the holder's. With one
    // GPU a lease is granted only once the one before it ended, so the order they ended
    // in (each record's last change, on the provider's clock) is the order they were
    // granted in. Their starts are not: a lease the requester proposed starts a little
    // before the requester's clock said (`PROPOSAL_START_LEAD_MS`), so one granted
    // a few ms after another can start before it.
    let deadline = tokio::time::Instant::now() + LONG;
    let mut granted = loop {
        let records: Vec<_> = net
            .provider(0)
            .handle
            .list_lease_records()
            .await
            .expect("leases")
            .into_iter()
            .filter(|l| l.terms.lease_id.to_string() != held.lease_id)
            .collect();
        // A job's lease ends at the provider once its requester released it.
        if records.iter().all(|l| !l.state.holds_resources()) {
            break records;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "every job's lease ends: {records:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    granted.sort_by_key(|l| l.updated_ms);
    let light_peer = light.handle.peer_id();
    let order: Vec<bool> = granted
        .iter()
        .map(|l| l.terms.requester == light_peer)
        .collect();
    assert_eq!(order.len(), 4, "{granted:?}");
    assert!(
        order[0],
        "the light user's job goes first although the heavy user's were queued earlier: {order:?}"
    );
    net.shutdown().await;
}

/// Waits (up to a minute) until `cond` holds; panics otherwise.
async fn wait_for(cond: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + LONG;
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "condition not met in time"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
