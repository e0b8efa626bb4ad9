//! Jobs on real nodes on 127.0.0.1: a task runs on a remote peer and its output comes
//! back byte for byte; the same module and input are not sent twice; a provider that
//! dies mid-task is replaced; a lease that ends stops its job; bad modules cost no
//! lease; a lease taken for one job ends with it, on providers old and new; a withheld
//! receipt does not hold up the result; hostile job requests are refused and the
//! provider keeps serving.

use std::time::Duration;

use futures::{AsyncReadExt, AsyncWriteExt};
use gpunode_node::jobs::table::Skip;
use gpunode_node::jobs::JobEvent;
use gpunode_node::{LeaseSpec, NodeConfig};
use gpunode_protocol::encoding;
use gpunode_protocol::job::{
    BlobRef, JobFile, JobOutcome, JobRefusal, JobSubmit, Program, ProviderMsg, RequesterMsg,
    JOB_VERSION,
};
use gpunode_protocol::lease::LeaseId;
use testnet::jobs::{outcome, request, run_to_end, stdout_of, task, until_end, until_started};
use testnet::TestNet;

const LONG: Duration = Duration::from_secs(60);

fn cheap_first(i: usize, c: &mut NodeConfig) {
    c.price_per_gpu_hour = if i == 0 { 0.5 } else { 2.0 };
    c.max_job_bytes = 64 << 20;
}

/// `providers` providers without GPUs, the first the cheapest, and `clients` clients
/// that already see every provider's offer.
async fn network(providers: usize, clients: usize) -> TestNet {
    TestNet::providers(providers)
        .tweak(cheap_first)
        .with_clients(clients)
        .clients_see_offers(LONG)
        .start()
        .await
        .expect("start")
}

/// Submits `spin.wat forever` and waits until it runs; returns the job and the event
/// position after its start.
async fn start_spinning_forever(
    client: &testnet::TestNode,
    dir: &std::path::Path,
) -> (gpunode_node::jobs::JobView, usize) {
    let req = request(task("spin.wat"), dir).args(["forever"]);
    let view = client.handle.submit_job(req);
    let mut from = 0;
    until_started(&client.handle, &view.job_id, &mut from)
        .await
        .expect("the job starts");
    (view, from)
}

fn pseudo_random(len: usize) -> Vec<u8> {
    let mut x = 0x9e3779b97f4a7c15u64;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outputs_come_back_byte_for_byte_and_nothing_is_sent_twice() {
    let net = network(2, 1).await;
    let client = net.client(0);
    let dir = tempfile::tempdir().unwrap();
    let data = pseudo_random(3 * 1024 * 1024 + 12345);
    std::fs::write(dir.path().join("data.bin"), &data).unwrap();
    let mut req =
        request(task("copy.wat"), &dir.path().join("out1")).input(dir.path().join("data.bin"));

    let (events, end) = run_to_end(&client.handle, req.clone(), LONG).await.unwrap();
    let summary = end.expect("job finished");
    assert_eq!(summary.outcome, JobOutcome::Exited(0));
    assert_eq!(summary.exit_code, 0);
    assert_eq!(stdout_of(&events), b"copied\n");
    assert_eq!(summary.outputs, vec!["copy.bin".to_string()]);
    assert_eq!(
        std::fs::read(dir.path().join("out1/copy.bin")).unwrap(),
        data
    );
    let provider = net
        .nodes
        .iter()
        .find(|n| n.handle.peer_id().to_string() == summary.provider)
        .expect("the provider is one of ours");
    let received = provider.handle.metrics().job_bytes_received.get();
    assert!(received >= data.len() as u64, "received {received}");
    assert!(!summary.module_cached);

    // Same module, same input, same provider: nothing crosses the network again and
    // the compiled module comes from the cache.
    req.output_dir = dir.path().join("out2");
    req.peer = Some(summary.provider.clone());
    let (_, end) = run_to_end(&client.handle, req, LONG).await.unwrap();
    let again = end.expect("second run finished");
    assert_eq!(
        std::fs::read(dir.path().join("out2/copy.bin")).unwrap(),
        data
    );
    assert_eq!(provider.handle.metrics().job_bytes_received.get(), received);
    assert!(provider.handle.metrics().job_bytes_cached.get() >= data.len() as u64);
    assert!(again.module_cached);
    // Each finished job gave its lease back (the requester cancels it right after).
    let deadline = tokio::time::Instant::now() + LONG;
    loop {
        let leases = provider.handle.list_leases().await.unwrap();
        if leases
            .iter()
            .all(|l| l.state != gpunode_node::lease::LeaseState::Active)
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "leases still active: {leases:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    net.shutdown().await;
}

/// In one process a "crash" aborts the node's tasks, but its connections outlive the
/// abort, so the provider's job handler reports the job stopped (as a provider that
/// shuts down would). `tests/tests/run.rs` kills a real provider process with SIGKILL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_that_dies_mid_task_is_replaced() {
    let mut net = network(3, 1).await;
    let dir = tempfile::tempdir().unwrap();
    let client = net.client(0).handle.clone();
    let view = client.submit_job(request(task("spin.wat"), dir.path()));
    let mut from = 0;
    let first = until_started(&client, &view.job_id, &mut from)
        .await
        .unwrap();
    let Some(JobEvent::Started { provider }) = first.last() else {
        panic!("job never started: {first:?}");
    };
    let victim = net
        .nodes
        .iter_mut()
        .find(|n| n.handle.peer_id().to_string() == *provider)
        .expect("provider is ours");
    victim.crash();
    let rest = until_end(&client, &view.job_id, &mut from).await.unwrap();
    let summary = outcome(&rest).expect("ended").expect("finished elsewhere");
    assert_ne!(&summary.provider, provider);
    assert_eq!(summary.attempts, 2);
    assert_eq!(summary.outcome, JobOutcome::Exited(7));
    assert!(rest
        .iter()
        .any(|e| matches!(e, JobEvent::Retrying { provider: p, .. } if p == provider)));
    // The second provider ran the task from the start, and its whole output came back.
    let retry = rest
        .iter()
        .position(|e| matches!(e, JobEvent::Retrying { .. }))
        .expect("retry announced");
    assert_eq!(stdout_of(&rest[retry..]), b"started\ndone\n");
    net.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_job_stops_when_its_lease_ends() {
    let net = network(1, 1).await;
    let client = net.client(0);
    let dir = tempfile::tempdir().unwrap();
    let (view, mut from) = start_spinning_forever(client, dir.path()).await;
    let provider = net.provider(0);
    assert_eq!(provider.handle.metrics().jobs_running.get(), 1);
    let jobs_dir = provider.data_dir().jobs_dir();
    let names = |dir: &std::path::Path| -> Vec<std::ffi::OsString> {
        std::fs::read_dir(dir)
            .map(|d| d.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default()
    };
    let while_running = names(&jobs_dir);
    assert_eq!(while_running.len(), 1, "the running job's directory");
    let lease = client
        .handle
        .get_job(&view.job_id)
        .unwrap()
        .lease_id
        .unwrap();
    // The provider ends the lease: the job is killed there, and the requester, which
    // did not ask for that, looks for another provider (there is none here).
    provider.handle.cancel_lease(&lease).await.unwrap();
    let rest = until_end(&client.handle, &view.job_id, &mut from)
        .await
        .unwrap();
    let error = outcome(&rest)
        .expect("ended")
        .expect_err("no other provider");
    assert!(
        error.contains("stopped the job") || error.contains("no other is available"),
        "{error}"
    );
    assert!(rest.iter().any(|e| matches!(e, JobEvent::Retrying { .. })));
    assert_eq!(provider.handle.metrics().jobs_running.get(), 0);
    assert!(provider
        .handle
        .metrics()
        .encode()
        .contains("gpunode_jobs_run_total{outcome=\"cancelled\"} 1"));
    // Removed on a blocking thread after the exchange; what stays is the one fresh
    // directory made there for the next job.
    let deadline = tokio::time::Instant::now() + LONG;
    while names(&jobs_dir).iter().any(|n| while_running.contains(n)) || names(&jobs_dir).len() > 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "job directory not cleaned up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // A user's cancel works the same way.
    let (view, mut from) = start_spinning_forever(client, dir.path()).await;
    client.handle.cancel_job(&view.job_id[..6]).unwrap();
    let rest = until_end(&client.handle, &view.job_id, &mut from)
        .await
        .unwrap();
    assert_eq!(
        outcome(&rest).expect("ended").expect("reported").outcome,
        JobOutcome::Cancelled
    );
    assert_eq!(
        client.handle.get_job(&view.job_id).unwrap().state,
        gpunode_node::jobs::JobState::Cancelled
    );
    net.shutdown().await;
}

/// A provider that never sends its receipt does not hold up the result for a follower
/// that asks for `done` (what `gpunode run --quiet` returns on): the result and its
/// output files come as soon as they are in, while the job itself waits for the receipt
/// and ends with it pending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_that_withholds_its_receipt_does_not_hold_up_the_result() {
    fn withholds(_: usize) -> gpunode_node::Misbehaviour {
        gpunode_node::Misbehaviour {
            withhold_receipts: true,
            ..Default::default()
        }
    }
    let net = TestNet::providers(1)
        .tweak(cheap_first)
        .misbehaviour(withholds)
        .with_clients(1)
        .clients_see_offers(LONG)
        .start()
        .await
        .expect("start");
    let client = &net.client(0).handle;
    let dir = tempfile::tempdir().unwrap();
    let hello = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/wat/hello.wat");
    let view = client.submit_job(request(hello, dir.path()).peer(net.provider_id(0)));
    let with_done = Skip::none().with("done");
    let mut from = 0;
    let deadline = tokio::time::Instant::now() + LONG;
    let done = loop {
        let page = client
            .job_events_skipping(&view.job_id, from, Duration::from_millis(500), &with_done)
            .await
            .expect("events");
        from = page.next;
        let found = page.events.into_iter().find_map(|e| match e {
            JobEvent::Done { summary } => Some(summary),
            _ => None,
        });
        if let Some(summary) = found {
            break summary;
        }
        assert!(!page.done, "the job ended before its result was done");
        assert!(
            tokio::time::Instant::now() < deadline,
            "no result within {LONG:?}"
        );
    };
    // The result and its outputs are in while the job still waits for the receipt.
    assert!(!client.get_job(&view.job_id).expect("job").state.is_final());
    assert_eq!((done.exit_code, done.receipt.as_str()), (0, "pending"));
    assert_eq!(done.outputs, ["hello.txt"]);
    let written = std::fs::read_to_string(done.output_dir.join("hello.txt")).expect("output");
    assert_eq!(written, "hello from a gpunode sandbox\n");
    // The job then ends without a settled receipt.
    let events = until_end(client, &view.job_id, &mut from)
        .await
        .expect("end");
    let end = outcome(&events).expect("an end").expect("finished");
    assert_eq!((end.exit_code, end.receipt.as_str()), (0, "pending"));
    net.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_module_costs_no_lease() {
    let net = network(1, 1).await;
    let client = net.client(0);
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&str, &[u8], &str); 3] = [
        ("garbage.wasm", b"\0asm garbage", "not a runnable task"),
        (
            "imports.wat",
            b"(module (import \"env\" \"launch_missiles\" (func)) (func (export \"_start\")))",
            "env::launch_missiles",
        ),
        ("nostart.wat", b"(module (memory 1))", "_start"),
    ];
    for (name, bytes, expect) in cases {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        let (_, end) = run_to_end(&client.handle, request(path, dir.path()), LONG)
            .await
            .unwrap();
        let err = end.expect_err("must fail");
        assert!(err.contains(expect), "{name}: {err}");
    }
    let missing = dir.path().join("absent.wasm");
    let (_, end) = run_to_end(&client.handle, request(missing, dir.path()), LONG)
        .await
        .unwrap();
    assert!(end.unwrap_err().contains("cannot read task file"));
    // A description too large for one message is refused before any lease, too.
    let huge = request(task("spin.wat"), dir.path()).args(["x".repeat(300_000)]);
    let (_, end) = run_to_end(&client.handle, huge, LONG).await.unwrap();
    assert!(end.unwrap_err().contains("pack the inputs"));
    assert!(client.handle.list_leases().await.unwrap().is_empty());
    net.shutdown().await;
}

/// A job the provider refuses after granting its lease (an input over its
/// `max_job_bytes`) ends with the lease already given back: a requester that exits on the
/// failure, as `gpunode run` without a daemon does, must not leave the provider's
/// resources held until the lease's end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_job_has_given_its_lease_back_when_it_returns() {
    let net = network(1, 1).await;
    let (client, provider) = (net.client(0), net.provider(0));
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("big.bin");
    let file = std::fs::File::create(&big).unwrap();
    file.set_len((64 << 20) + 1).unwrap();
    let req = request(task("copy.wat"), dir.path())
        .input(&big)
        .peer(net.provider_id(0))
        .retries(0);
    let (_, end) = run_to_end(&client.handle, req, LONG).await.unwrap();
    let err = end.expect_err("over the provider's limit");
    assert!(err.contains("takes at most"), "{err}");
    // Asked at once, with nothing waited for: the lease is over on both sides.
    let held = provider.handle.list_leases().await.unwrap();
    assert_eq!(held.len(), 1, "{held:?}");
    assert_eq!(
        held[0].state,
        gpunode_node::lease::LeaseState::Cancelled,
        "{held:?}"
    );
    net.shutdown().await;
}

/// A lease taken for one job ends with it. A provider of the job protocol that ends
/// leases ends it itself as the exchange ends (the requester sends no cancellation) and
/// its receipt settles before the run returns; against a provider of the first job
/// protocol only (an older version) the requester falls back to it and cancels, as
/// before. Neither protocol lets a peer end someone else's lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_for_one_job_ends_with_it_on_new_and_old_providers() {
    fn older_second(i: usize) -> gpunode_node::Misbehaviour {
        gpunode_node::Misbehaviour {
            first_job_protocol_only: i == 1,
            ..Default::default()
        }
    }
    let net = TestNet::providers(2)
        .tweak(cheap_first)
        .misbehaviour(older_second)
        .with_clients(2)
        .clients_see_offers(LONG)
        .start()
        .await
        .expect("start");
    let (client, mallory) = (net.client(0), net.client(1));
    for (i, ends_itself) in [(0, true), (1, false)] {
        let provider = &net.provider(i).handle;
        let messages_before = provider.metrics().lease_messages.get();
        let granted_before = provider.metrics().lease_proposal_count("granted");
        let dir = tempfile::tempdir().unwrap();
        let req = request(task("spin.wat"), dir.path()).peer(net.provider_id(i));
        let (_, end) = run_to_end(&client.handle, req, LONG).await.unwrap();
        let summary = end.expect("ran");
        assert_eq!(summary.outcome, JobOutcome::Exited(7));
        // The job went on the stream opened while the lease's acceptance travelled
        // (on an older provider, its first job protocol).
        let ahead = client.handle.metrics().job_streams_ahead_used.get();
        assert_eq!(ahead, i as u64 + 1, "provider {i}");
        assert_eq!(summary.receipt, "settled", "provider {i}");
        // A follower that asks for `done` had the result before the receipt settled
        // (what `gpunode run --quiet` waits for); one that does not never sees it.
        let job = client
            .handle
            .list_jobs()
            .into_iter()
            .next()
            .expect("the job");
        let with_done = Skip::none().with("done");
        let page = client
            .handle
            .job_events_skipping(&job.job_id, 0, Duration::ZERO, &with_done)
            .await
            .expect("events");
        let kinds: Vec<&str> = page.events.iter().map(JobEvent::kind).collect();
        assert_eq!(
            kinds[kinds.len() - 2..],
            ["done", "finished"],
            "provider {i}"
        );
        let JobEvent::Done { summary: early } = &page.events[kinds.len() - 2] else {
            unreachable!("the kind says done")
        };
        assert_eq!(early.receipt, "pending", "provider {i}");
        let known_then = (early.exit_code, &early.outputs, &early.output_digest);
        assert_eq!(known_then, (7, &summary.outputs, &summary.output_digest));
        let page = client
            .handle
            .job_events(&job.job_id, 0, Duration::ZERO)
            .await
            .expect("events");
        assert!(page.events.iter().all(|e| e.kind() != "done"));
        assert_eq!(
            provider.metrics().leases_ended_with_job.get(),
            u64::from(ends_itself),
            "provider {i}"
        );
        // Its claim went on a settlement stream opened while the lease was ending.
        assert_eq!(
            provider.metrics().settle_streams_ahead_used.get(),
            u64::from(ends_itself),
            "provider {i}"
        );
        let id: LeaseId = summary.lease_id.parse().unwrap();
        let deadline = tokio::time::Instant::now() + LONG;
        loop {
            let provider_side = provider.leases_by_id(vec![id]).await.unwrap();
            let client_side = client.handle.leases_by_id(vec![id]).await.unwrap();
            let ended = [provider_side, client_side].iter().all(|r| {
                r[0].as_ref()
                    .is_some_and(|l| l.state == gpunode_node::lease::LeaseState::Cancelled)
            });
            if ended {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "lease {id} of provider {i} not ended on both sides"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The proposal, granted at once (the client holds the provider's advert and a
        // lease without GPUs is foreseen exactly); and a cancellation only where the
        // provider does not end the lease itself.
        let messages = provider.metrics().lease_messages.get() - messages_before;
        let granted = provider.metrics().lease_proposal_count("granted") - granted_before;
        assert_eq!(granted, 1, "provider {i}");
        assert_eq!(messages, if ends_itself { 1 } else { 2 }, "provider {i}");
    }

    // Someone else's lease named on the protocol that ends leases: refused, and the
    // lease stays active.
    let provider = net.provider(0).handle.peer_id();
    let lease = client
        .handle
        .request_lease(
            LeaseSpec::new(0, 600_000)
                .peer(provider.to_string())
                .cpus(1),
        )
        .await
        .expect("lease");
    let lease_id: LeaseId = lease.lease_id.parse().unwrap();
    let submit = RequesterMsg::Submit(JobSubmit {
        version: JOB_VERSION,
        lease_id,
        program: Program::Wasm {
            module: BlobRef {
                hash: [1; 32],
                size: 10,
            },
            fuel: None,
        },
        inputs: vec![],
        args: vec![],
        env: vec![],
        timeout_ms: 1000,
    });
    let protocol = gpunode_node::jobs::JOB_ENDS_LEASE_PROTOCOL;
    match raw_submit_on(&mallory.handle, provider, protocol.clone(), frame(&submit)).await {
        Some(ProviderMsg::Rejected(r)) => assert_eq!(r.code, JobRefusal::NotYourLease),
        other => panic!("expected a refusal, got {other:?}"),
    }
    let held = net
        .provider(0)
        .handle
        .leases_by_id(vec![lease_id])
        .await
        .unwrap();
    let state = held[0].as_ref().expect("the provider has the lease").state;
    assert_eq!(state, gpunode_node::lease::LeaseState::Active);

    // A stream opened ahead for an offer that did not become a lease carries only a
    // Cancel: the provider closes it without an answer and counts no bad request.
    let only_cancel = frame(&RequesterMsg::Cancel);
    let answer = raw_submit_on(&client.handle, provider, protocol, only_cancel).await;
    assert!(
        answer.is_none(),
        "no answer to a stream that brings no job: {answer:?}"
    );
    let metrics = net.provider(0).handle.metrics();
    assert_eq!(
        metrics.job_rejected_count(JobRefusal::BadRequest.label()),
        0
    );
    assert_eq!(metrics.stream_refused_count("job", "silent"), 0);
    net.shutdown().await;
}

/// Sends one raw job request and returns the provider's first answer.
async fn raw_submit(
    from: &gpunode_node::NodeHandle,
    to: libp2p::PeerId,
    bytes: Vec<u8>,
) -> Option<ProviderMsg> {
    raw_submit_on(from, to, gpunode_node::jobs::JOB_PROTOCOL, bytes).await
}

/// Sends one raw job request on `protocol` and returns the provider's first answer.
async fn raw_submit_on(
    from: &gpunode_node::NodeHandle,
    to: libp2p::PeerId,
    protocol: libp2p::StreamProtocol,
    bytes: Vec<u8>,
) -> Option<ProviderMsg> {
    let stream = from.open_stream(to, protocol).await.expect("stream");
    let (mut r, mut w) = stream.split();
    w.write_all(&bytes).await.ok()?;
    w.flush().await.ok()?;
    let mut header = [0u8; 5];
    r.read_exact(&mut header).await.ok()?;
    let len = u32::from_le_bytes(header[1..].try_into().ok()?) as usize;
    let mut body = vec![0; len];
    r.read_exact(&mut body).await.ok()?;
    encoding::decode(&body, 1 << 20).ok()
}

fn frame(msg: &RequesterMsg) -> Vec<u8> {
    let body = encoding::encode(msg);
    let mut out = vec![0u8];
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_job_requests_are_refused_and_the_provider_keeps_serving() {
    let net = network(1, 2).await;
    let (alice, mallory) = (net.client(0), net.client(1));
    let provider = net.provider(0).handle.peer_id();
    let lease = alice
        .handle
        .request_lease(
            LeaseSpec::new(0, 600_000)
                .peer(provider.to_string())
                .cpus(1)
                .mem_bytes(1 << 20),
        )
        .await
        .expect("lease");
    let lease_id: LeaseId = lease.lease_id.parse().unwrap();
    let blob = BlobRef {
        hash: [1; 32],
        size: 10,
    };
    let submit = |lease_id, inputs: Vec<JobFile>| {
        RequesterMsg::Submit(JobSubmit {
            version: JOB_VERSION,
            lease_id,
            program: Program::Wasm {
                module: blob,
                fuel: None,
            },
            inputs,
            args: vec![],
            env: vec![],
            timeout_ms: 1000,
        })
    };
    let file = |path: &str, size| JobFile {
        path: path.into(),
        blob: BlobRef {
            hash: [2; 32],
            size,
        },
    };
    let cases: Vec<(&str, &gpunode_node::NodeHandle, Vec<u8>, JobRefusal)> = vec![
        (
            "unknown lease",
            &alice.handle,
            frame(&submit(LeaseId([9; 16]), vec![])),
            JobRefusal::UnknownLease,
        ),
        (
            "someone else's lease",
            &mallory.handle,
            frame(&submit(lease_id, vec![])),
            JobRefusal::NotYourLease,
        ),
        (
            "path escape",
            &alice.handle,
            frame(&submit(lease_id, vec![file("../../etc/passwd", 1)])),
            JobRefusal::BadRequest,
        ),
        (
            "absolute path",
            &alice.handle,
            frame(&submit(lease_id, vec![file("/etc/passwd", 1)])),
            JobRefusal::BadRequest,
        ),
        (
            "too large",
            &alice.handle,
            frame(&submit(lease_id, vec![file("big", 1 << 40)])),
            JobRefusal::TooLarge,
        ),
        (
            "garbage",
            &mallory.handle,
            vec![0, 4, 0, 0, 0, 0xff, 0xff, 0xff, 0xff],
            JobRefusal::BadRequest,
        ),
        (
            "truncated",
            &mallory.handle,
            frame(&submit(lease_id, vec![]))[..20].to_vec(),
            JobRefusal::BadRequest,
        ),
    ];
    for (name, from, bytes, code) in cases {
        // Truncated input only shows once the writer closes; the others answer at once.
        let answer = if name == "truncated" {
            let stream = from.open_job_stream(provider).await.unwrap();
            let (mut r, mut w) = stream.split();
            w.write_all(&bytes).await.unwrap();
            w.close().await.unwrap();
            let mut buf = Vec::new();
            let _ = r.read_to_end(&mut buf).await;
            encoding::decode::<ProviderMsg>(&buf[5..], 1 << 20).ok()
        } else {
            raw_submit(from, provider, bytes).await
        };
        match answer {
            Some(ProviderMsg::Rejected(r)) => {
                assert_eq!(r.code, code, "{name}: {}", r.message);
                assert!(!r.message.is_empty());
            }
            other => panic!("{name}: expected a refusal, got {other:?}"),
        }
    }
    let metrics = net.provider(0).handle.metrics();
    assert_eq!(metrics.job_rejected_count("bad_request"), 4);
    assert_eq!(metrics.job_rejected_count("unknown_lease"), 1);
    assert_eq!(metrics.job_rejected_count("not_your_lease"), 1);
    assert_eq!(metrics.job_rejected_count("too_large"), 1);

    // A blob that does not match its hash is refused and not cached.
    let data = b"0123456789".to_vec();
    let msg = submit(lease_id, vec![]);
    let stream = alice.handle.open_job_stream(provider).await.unwrap();
    let (mut r, mut w) = stream.split();
    w.write_all(&frame(&msg)).await.unwrap();
    let mut chunk = vec![1u8];
    chunk.extend_from_slice(&(data.len() as u32).to_le_bytes());
    chunk.extend_from_slice(&data);
    w.write_all(&chunk).await.unwrap();
    w.flush().await.unwrap();
    let mut buf = Vec::new();
    let _ = r.read_to_end(&mut buf).await;
    assert!(
        String::from_utf8_lossy(&buf).contains("does not match its hash"),
        "corrupt blob must be named"
    );
    assert_eq!(metrics.job_rejected_count("corrupt"), 1);

    // Still serving: a real job runs.
    let dir = tempfile::tempdir().unwrap();
    let (_, end) = run_to_end(&alice.handle, request(task("spin.wat"), dir.path()), LONG)
        .await
        .unwrap();
    assert_eq!(end.expect("ran").outcome, JobOutcome::Exited(7));
    net.shutdown().await;
}
