//! A job that no provider can take now waits (`--wait`) with the reason each provider
//! gave, and starts as soon as one can; without `--wait` it fails at once.

use std::time::Duration;

use gpunode_node::jobs::{JobEvent, JobState};
use gpunode_protocol::advert::OfferFilter;
use testnet::jobs::{events_until, outcome, request, task, until_end};
use testnet::ledger::bare_lease;
use testnet::{TestNet, TestNetConfig};

const LONG: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_job_says_why_and_starts_when_the_gpu_frees() {
    let net = TestNet::start(TestNetConfig::new(vec![Some("1xA100-80GB".into())]))
        .await
        .expect("start");
    let mut holder = net.client().await.expect("holder");
    let mut client = net.client().await.expect("client");
    for c in [&holder, &client] {
        TestNet::wait_for_offers(&c.handle, &OfferFilter::default(), LONG, |o| o.len() == 1)
            .await
            .expect("offers");
    }
    let provider = net.nodes[0].handle.peer_id().to_string();
    let mut spec = bare_lease(&provider, 120_000);
    spec.gpus = 1;
    let held = holder
        .handle
        .request_lease(spec)
        .await
        .expect("the only GPU");

    let dir = tempfile::tempdir().expect("tempdir");
    // Without --wait: fails at once, naming the reason.
    let mut req = request(task("copy.wat"), &dir.path().join("a"));
    req.gpus = 1;
    req.wait = Some(false);
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
    let reasons = waiting.waiting.expect("why").reasons;
    assert!(
        reasons.iter().any(|(_, r)| r.contains("no GPU free")),
        "{reasons:?}"
    );
    holder
        .handle
        .cancel_lease(&held.lease_id)
        .await
        .expect("free the GPU");
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
    holder.shutdown().await;
    client.shutdown().await;
    net.shutdown().await;
}
