//! Reservations on real nodes: a signed lease that starts later holds its GPU from its
//! start only, an overlapping one is refused, and a job submitted with its id waits for
//! the start and runs inside it.

use std::time::Duration;

use gpunode_node::jobs::{JobEvent, JobState};
use gpunode_node::lease::LeaseState;
use gpunode_node::LeaseSpec;
use gpunode_protocol::advert::OfferFilter;
use gpunode_protocol::time::now_ms;
use testnet::jobs::{events_until, outcome, request, task, until_end};
use testnet::TestNet;

const LONG: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_runs_inside_its_reservation_and_overlaps_are_refused() {
    let net = TestNet::gpu_providers(&["1xA100-80GB"])
        .with_clients(2)
        .clients_see_offers(LONG)
        .start()
        .await
        .expect("start");
    let (client, other) = (net.client(0), net.client(1));
    let provider = net.provider_id(0);
    let start = now_ms() + 25_000;
    let mut spec = LeaseSpec::new(1, 180_000)
        .peer(&provider)
        .start_at_ms(start);
    let reservation = client
        .handle
        .request_lease(spec.clone())
        .await
        .expect("reserved");
    assert_eq!(reservation.state, LeaseState::Reserved);
    assert_eq!(reservation.start_ms, start);

    // The provider publishes the window, so others see when the GPU is free.
    TestNet::wait_for_offers(&other.handle, &OfferFilter::default(), LONG, |o| {
        o.len() == 1 && o[0].gpus[0].reserved == vec![(start, start + 180_000)]
    })
    .await
    .expect("the reserved window in the provider's advert");

    // Another reservation of the only GPU that overlaps is refused, naming the one in
    // the way; a lease from now that would run into it is refused too.
    spec.start_at_ms = Some(start + 60_000);
    let err = other
        .handle
        .request_lease(spec.clone())
        .await
        .expect_err("overlaps");
    assert!(err.to_string().contains("GPU 0 is reserved"), "{err}");
    spec.start_at_ms = None;
    let err = other
        .handle
        .request_lease(spec)
        .await
        .expect_err("runs into it");
    assert!(err.to_string().contains("no GPU free"), "{err}");

    // A job in the reservation waits for its start, then runs on it.
    let dir = tempfile::tempdir().expect("tempdir");
    let req = request(task("copy.wat"), dir.path())
        .gpus(1)
        .reservation(&reservation.lease_id[..8]);
    let view = client.handle.submit_job(req);
    let mut from = 0;
    events_until(&client.handle, &view.job_id, &mut from, LONG, |e| {
        matches!(e, JobEvent::Waiting { .. })
    })
    .await
    .expect("waiting for the start");
    let waiting = client.handle.get_job(&view.job_id).expect("job");
    assert_eq!(waiting.state, JobState::Waiting);
    let reasons = waiting.waiting.expect("why").reasons;
    assert!(reasons[0].1.contains("which starts at"), "{reasons:?}");
    let events = until_end(&client.handle, &view.job_id, &mut from)
        .await
        .expect("end");
    let summary = outcome(&events)
        .expect("ended")
        .expect("ran in the reservation");
    assert!(now_ms() >= start, "not before the start");
    assert_eq!(summary.lease_id, reservation.lease_id);
    // The reservation is still there for the next job.
    let after = client
        .handle
        .list_leases()
        .await
        .expect("leases")
        .into_iter()
        .find(|l| l.lease_id == reservation.lease_id)
        .expect("the reservation");
    assert_eq!(after.state, LeaseState::Active);
    net.shutdown().await;
}
