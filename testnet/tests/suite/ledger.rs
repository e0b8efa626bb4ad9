//! Credits between real nodes on 127.0.0.1: every lease ends with a receipt both ledgers
//! hold; a provider that bills more than it ran and one that returns wrong outputs are
//! caught and ranked down while honest providers get the work; hostile receipts are
//! refused with a reason and change nothing; a claim waits while its job's outputs are
//! checked; the debt limit refuses with a reason.

use std::time::Duration;

use futures::{AsyncReadExt, AsyncWriteExt};
use gpunode_node::lease::negotiate::REPUTATION_FLOOR;
use gpunode_node::ledger::reputation::NEUTRAL;
use gpunode_node::ledger::settle::SETTLE_PROTOCOL;
use gpunode_node::{Misbehaviour, NodeConfig, NodeHandle};
use gpunode_protocol::encoding;
use gpunode_protocol::lease::LeaseId;
use gpunode_protocol::receipt::{
    amount_for, job_output_digest, lease_output_digest, Claim, ClaimResult, ReceiptRefusal,
    SettleMsg, SettleReply, UsageReceipt, RECEIPT_VERSION,
};
use gpunode_protocol::time::now_ms;
use testnet::jobs::{request, run_to_end, task};
use testnet::ledger::{bare_lease, settled_leases};
use testnet::TestNet;

const LONG: Duration = Duration::from_secs(120);

/// Node 1 bills ten times what it ran, node 2 corrupts outputs; both are the cheapest.
fn prices(i: usize, c: &mut NodeConfig) {
    c.price_per_gpu_hour = match i {
        1 => 0.2,
        2 => 0.3,
        _ => 1.0,
    };
}

fn cheats(i: usize) -> Misbehaviour {
    match i {
        1 => Misbehaviour {
            inflate_billing: 10,
            ..Misbehaviour::default()
        },
        2 => Misbehaviour {
            corrupt_outputs: true,
            ..Misbehaviour::default()
        },
        _ => Misbehaviour::default(),
    }
}

async fn until<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = tokio::time::Instant::now() + LONG;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Both sides hold the same receipt for every lease the requester settled.
async fn books_agree(client: &NodeHandle, providers: &[&NodeHandle]) -> usize {
    let leases = settled_leases(client).expect("client ledger");
    for id in &leases {
        let (_, ours) = client
            .accounts()
            .ledger
            .settled(id)
            .expect("read")
            .expect("settled");
        let provider = providers
            .iter()
            .find(|p| p.peer_id() == ours.receipt.provider)
            .expect("a provider of the network");
        let theirs = until("the provider records the countersigned receipt", || {
            provider.accounts().ledger.settled(id).ok().flatten()
        })
        .await;
        assert_eq!(theirs.1, ours, "both ledgers hold the same receipt");
    }
    assert_eq!(
        client.accounts().ledger.verify().expect("verify").first_bad,
        None
    );
    for p in providers {
        assert_eq!(
            p.accounts().ledger.verify().expect("verify").first_bad,
            None
        );
    }
    leases.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cheats_are_caught_and_ranked_down_while_honest_providers_get_the_work() {
    let net = TestNet::providers(4)
        .tweak(prices)
        .misbehaviour(cheats)
        .with_clients(1)
        .clients_see_offers(LONG)
        .start()
        .await
        .expect("start");
    let client = net.client(0);
    let (liar, corrupter) = (net.provider_id(1), net.provider_id(2));
    let honest = [net.provider_id(0), net.provider_id(3)];

    let input = tempfile::tempdir().expect("tempdir");
    std::fs::write(
        input.path().join("data.bin"),
        b"the same bytes for everyone",
    )
    .expect("write");
    let run = |replicas: u32| {
        let out = tempfile::tempdir().expect("tempdir");
        let req = request(task("copy.wat"), out.path())
            .input(input.path().join("data.bin"))
            .replicas(replicas);
        (req, out)
    };

    // First job: the two cheapest are the cheats. The liar runs replica 1 and bills ten
    // times its run time: refused. The corrupter runs replica 2 and disagrees: a third
    // run on an honest provider breaks the tie.
    let (req, out) = run(2);
    let (_, end) = run_to_end(&client.handle, req, LONG).await.expect("job");
    let summary = end.expect("the job succeeds");
    assert_eq!(summary.exit_code, 0);
    assert_eq!(
        std::fs::read(summary.output_dir.join("copy.bin")).expect("output kept"),
        b"the same bytes for everyone",
        "the majority's (correct) outputs are kept"
    );
    let replicas: Vec<(&str, bool)> = summary
        .replicas
        .iter()
        .map(|r| (r.provider.as_str(), r.agrees))
        .collect();
    assert_eq!(replicas.len(), 3, "{replicas:?}");
    assert_eq!(replicas[0], (liar.as_str(), true));
    assert_eq!(replicas[1], (corrupter.as_str(), false));
    assert!(honest.contains(&replicas[2].0.to_string()) && replicas[2].1);
    assert!(
        summary.receipt.starts_with("refused") && summary.receipt.contains("bills"),
        "the liar's receipt is refused: {}",
        summary.receipt
    );
    // `out` existed, so the job got a new directory in it; no replica's is left.
    assert_eq!(summary.output_dir.parent(), Some(out.path()));
    let left: Vec<_> = std::fs::read_dir(out.path())
        .expect("out")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(left.len(), 1, "{left:?}");
    assert_eq!(
        client.handle.metrics().receipt_rejected_count("inflated"),
        1
    );

    let rep = |p: &str| {
        client
            .handle
            .accounts()
            .reputation
            .score(&p.parse().expect("peer"))
    };
    assert!(rep(&liar) < REPUTATION_FLOOR, "liar {}", rep(&liar));
    assert!(
        rep(&corrupter) < REPUTATION_FLOOR,
        "corrupter {}",
        rep(&corrupter)
    );
    let peers = client.handle.peers_view();
    let view = |p: &str| {
        peers
            .iter()
            .find(|v| v.peer_id == p)
            .expect("listed")
            .clone()
    };
    assert_eq!(view(&liar).disputes, 1);
    assert_eq!(view(&corrupter).mismatches, 1);

    // The liar keeps its claim, disputed, and thinks less of the client.
    let liar_node = &net.provider(1).handle;
    let claim = until("the liar learns its claim was refused", || {
        liar_node
            .accounts()
            .unsettled()
            .into_iter()
            .find(|u| u.disputed.is_some())
    })
    .await;
    assert_eq!(claim.peer, client.handle.peer_id().to_string());
    assert!(
        liar_node
            .accounts()
            .reputation
            .score(&client.handle.peer_id())
            < NEUTRAL
    );

    // From now on the honest providers get the work, however cheap the cheats are.
    for _ in 0..2 {
        let (req, _out) = run(2);
        let (_, end) = run_to_end(&client.handle, req, LONG).await.expect("job");
        let summary = end.expect("the job succeeds");
        assert_eq!(summary.replicas.len(), 2, "{:?}", summary.replicas);
        for r in &summary.replicas {
            assert!(honest.contains(&r.provider), "{} got work", r.provider);
            assert!(r.agrees);
        }
        assert_eq!(summary.receipt, "settled");
    }
    for h in &honest {
        assert!(rep(h) > NEUTRAL);
    }

    // Every settled lease is in both books, the liar's is in neither.
    let providers: Vec<&NodeHandle> = net.nodes.iter().map(|n| &n.handle).collect();
    let settled = books_agree(&client.handle, &providers).await;
    assert_eq!(
        settled, 6,
        "corrupter 1 + honest 1 + 2 jobs x 2 honest replicas"
    );
    assert!(settled_leases(liar_node).expect("ledger").is_empty());
    let view = client.handle.ledger_view(10).expect("view");
    assert!(view.balance <= 0.0 && (view.balance + view.spent).abs() < 1e-9);
    net.shutdown().await;
}

/// Writes `msg` as one message frame of the settle protocol and reads the reply.
async fn exchange(stream: libp2p::Stream, msg: &SettleMsg) -> SettleReply {
    let (mut r, mut w) = stream.split();
    let body = encoding::encode(msg);
    let mut frame = vec![0u8];
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(&body);
    w.write_all(&frame).await.expect("write");
    w.flush().await.expect("flush");
    let mut header = [0u8; 5];
    r.read_exact(&mut header).await.expect("reply header");
    let len = u32::from_le_bytes([header[1], header[2], header[3], header[4]]) as usize;
    let mut body = vec![0; len];
    r.read_exact(&mut body).await.expect("reply body");
    encoding::decode(&body, 1 << 20).expect("reply decodes")
}

/// One provider and one client, and the provider's signing key (to forge its claims).
async fn provider_and_client() -> (TestNet, libp2p::identity::Keypair) {
    let net = TestNet::providers(1)
        .with_clients(1)
        .start()
        .await
        .expect("start");
    let key = net
        .provider(0)
        .data_dir()
        .load_identity()
        .expect("identity")
        .expect("exists");
    (net, key)
}

/// The receipt of a lease under `terms` that ran no job, ending now.
fn idle_receipt(id: LeaseId, terms: &gpunode_protocol::lease::LeaseTerms) -> UsageReceipt {
    UsageReceipt {
        version: RECEIPT_VERSION,
        lease_id: id,
        provider: terms.provider,
        requester: terms.requester,
        gpus: 0,
        cpus: terms.cpus,
        mem_bytes: terms.mem_bytes,
        start_ms: terms.start_ms,
        end_ms: now_ms(),
        billed_ms: 0,
        gpu_ms: 0,
        cpu_ms: 0,
        jobs: 0,
        exit_status: "none".into(),
        output_digest: lease_output_digest(&[]),
        price_per_gpu_hour_millicredits: terms.price_per_gpu_hour_millicredits,
        amount_millicredits: 0,
        issued_at_ms: now_ms(),
        peak_gpu_memory_bytes: 0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_receipts_are_refused_with_a_reason_and_change_nothing() {
    let (net, key) = provider_and_client().await;
    let provider = net.provider(0);
    let c = &net.client(0).handle;
    let spec = bare_lease(&net.provider_id(0), 60_000);
    let first = c.request_lease(spec.clone()).await.expect("lease 1");
    let second = c.request_lease(spec).await.expect("lease 2");
    let first_id: LeaseId = first.lease_id.parse().expect("id");
    let second_id: LeaseId = second.lease_id.parse().expect("id");

    // An honest settlement first: cancelling lease 1 makes the provider claim it.
    c.cancel_lease(&first.lease_id).await.expect("cancel");
    let settled = c
        .accounts()
        .ledger
        .wait_settled(&first_id, LONG)
        .await
        .expect("lease 1 settles");
    assert_eq!(settled.receipt.amount_millicredits, 0, "no job ran");
    let balance = c.accounts().ledger.balance();

    let terms = c
        .lease(&second_id)
        .await
        .expect("ask")
        .expect("known")
        .terms;
    let base = idle_receipt(second_id, &terms);
    let claim = |r: UsageReceipt| Claim {
        provider_sig: r.sign(&key).expect("sign"),
        receipt: r,
    };
    let mut bad_sig = claim(base.clone());
    bad_sig.provider_sig[7] ^= 1;
    let unknown = claim(UsageReceipt {
        lease_id: LeaseId([0xab; 16]),
        ..base.clone()
    });
    let billed = 60_000;
    let inflated = claim(UsageReceipt {
        end_ms: terms.end_ms,
        billed_ms: billed,
        cpu_ms: billed * terms.cpus as u64,
        amount_millicredits: amount_for(terms.price_per_gpu_hour_millicredits, 0, billed),
        ..base.clone()
    });
    let outside = claim(UsageReceipt {
        start_ms: terms.start_ms - 3_600_000,
        ..base.clone()
    });
    let duplicate = claim(UsageReceipt {
        exit_status: "exited 0".into(),
        ..settled.receipt.clone()
    });
    let replay_of_settled = Claim {
        receipt: settled.receipt.clone(),
        provider_sig: settled.provider_sig.clone(),
    };
    let stream = provider
        .handle
        .open_stream(c.peer_id(), SETTLE_PROTOCOL)
        .await
        .expect("stream");
    let reply = exchange(
        stream,
        &SettleMsg::Claims(vec![
            bad_sig,
            unknown,
            inflated,
            outside,
            duplicate,
            replay_of_settled,
        ]),
    )
    .await;
    let SettleReply::Results(results) = reply else {
        panic!("expected results, got {reply:?}")
    };
    let codes: Vec<Option<ReceiptRefusal>> = results
        .iter()
        .map(|r| match r {
            ClaimResult::Rejected(rej) => {
                assert!(rej.message.len() > 10, "a reason is given: {rej:?}");
                Some(rej.code)
            }
            ClaimResult::Countersigned(_) => None,
        })
        .collect();
    assert_eq!(
        codes,
        vec![
            Some(ReceiptRefusal::BadSignature),
            Some(ReceiptRefusal::UnknownLease),
            Some(ReceiptRefusal::Inflated),
            Some(ReceiptRefusal::TimesOutsideLease),
            Some(ReceiptRefusal::Duplicate),
            None,
        ]
    );
    assert_eq!(
        results[5],
        ClaimResult::Countersigned(settled.requester_sig.clone()),
        "a resent settled receipt gets the same countersignature"
    );
    assert_eq!(c.accounts().ledger.balance(), balance, "no balance changed");
    assert_eq!(c.accounts().ledger.head().seq, 1);
    assert!(c.accounts().reputation.score(&provider.handle.peer_id()) < NEUTRAL);
    for reason in [
        "bad_signature",
        "unknown_lease",
        "inflated",
        "times_outside_lease",
        "duplicate",
    ] {
        assert_eq!(c.metrics().receipt_rejected_count(reason), 1, "{reason}");
    }

    // Garbage on the settle protocol is refused and the node keeps settling.
    let stream = provider
        .handle
        .open_stream(c.peer_id(), SETTLE_PROTOCOL)
        .await
        .expect("stream");
    let (mut r, mut w) = stream.split();
    w.write_all(&[0, 4, 0, 0, 0, 0xff, 0xff, 0xff, 0xff])
        .await
        .expect("write");
    w.flush().await.expect("flush");
    let mut answer = Vec::new();
    let _ = r.read_to_end(&mut answer).await;
    assert!(!answer.is_empty(), "a refusal comes back");
    c.cancel_lease(&second.lease_id).await.expect("cancel 2");
    c.accounts()
        .ledger
        .wait_settled(&second_id, LONG)
        .await
        .expect("lease 2 settles honestly");
    let providers = [&provider.handle];
    assert_eq!(books_agree(c, &providers).await, 2);
    net.shutdown().await;
}

/// A claim that comes while its lease's job is still delivering outputs here (its
/// provider ended the lease with the job) waits until they are checked, and is then
/// checked against them; one whose job goes on past the wait is answered "ask again",
/// which is no dispute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_waits_for_its_jobs_outputs_to_be_checked() {
    let (net, key) = provider_and_client().await;
    let provider = net.provider(0);
    let c = &net.client(0).handle;
    let spec = bare_lease(&net.provider_id(0), 60_000);
    let mut claims = Vec::new();
    for _ in 0..2 {
        let lease = c.request_lease(spec.clone()).await.expect("lease");
        let id: LeaseId = lease.lease_id.parse().expect("id");
        let terms = c.lease(&id).await.expect("ask").expect("known").terms;
        // What an honest provider claims for one job that sent no outputs.
        let receipt = UsageReceipt {
            jobs: 1,
            exit_status: "exited 0".into(),
            output_digest: lease_output_digest(&[job_output_digest(&[])]),
            ..idle_receipt(id, &terms)
        };
        claims.push(Claim {
            provider_sig: receipt.sign(&key).expect("sign"),
            receipt,
        });
        // Its job is under way here, as during a download.
        c.accounts().observed.job_started(id);
    }
    let score = c.accounts().reputation.score(&provider.handle.peer_id());
    let settle = |claim: Claim| {
        let provider = provider.handle.clone();
        let client = c.peer_id();
        tokio::spawn(async move {
            let stream = provider
                .open_stream(client, SETTLE_PROTOCOL)
                .await
                .expect("stream");
            exchange(stream, &SettleMsg::Claims(vec![claim])).await
        })
    };

    // The first job's outputs are checked 300 ms after its claim came.
    let first = claims[0].receipt.lease_id;
    let answer = settle(claims[0].clone());
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!answer.is_finished(), "the claim waits for the outputs");
    let observed = &c.accounts().observed;
    observed.add_job(first, 40, "exited 0".into(), Some(job_output_digest(&[])));
    observed.job_ended(first);
    match answer.await.expect("exchange") {
        SettleReply::Results(r) => {
            assert!(matches!(r[..], [ClaimResult::Countersigned(_)]), "{r:?}")
        }
        other => panic!("expected results, got {other:?}"),
    }

    // The second job never finishes here: "ask again", and no dispute.
    match settle(claims[1].clone()).await.expect("exchange") {
        SettleReply::Results(r) => match &r[..] {
            [ClaimResult::Rejected(rej)] => {
                assert_eq!(rej.code, ReceiptRefusal::RequesterError, "{rej:?}");
            }
            other => panic!("expected a refusal, got {other:?}"),
        },
        other => panic!("expected results, got {other:?}"),
    }
    assert_eq!(
        c.accounts().reputation.score(&provider.handle.peer_id()),
        score,
        "asking again costs the provider nothing"
    );
    net.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_debt_limit_refuses_with_a_reason() {
    fn small_allowance(_: usize, c: &mut NodeConfig) {
        c.allowance = 0.5;
        c.debt_limit = 0.0;
    }
    let net = TestNet::providers(1)
        .tweak(small_allowance)
        .with_clients(1)
        .start()
        .await
        .expect("start");
    let client = net.client(0);
    let provider = net.provider_id(0);
    // An hour at 1 credit could cost 1 credit: more than the allowance.
    let err = client
        .handle
        .request_lease(bare_lease(&provider, 3_600_000))
        .await
        .expect_err("refused");
    assert!(err.to_string().contains("debt limit"), "{err}");
    // 20 minutes (a third of a credit) fits; a second one on top does not.
    client
        .handle
        .request_lease(bare_lease(&provider, 1_200_000))
        .await
        .expect("fits the allowance");
    let err = client
        .handle
        .request_lease(bare_lease(&provider, 1_200_000))
        .await
        .expect_err("open leases count");
    assert!(err.to_string().contains("debt limit"), "{err}");
    assert_eq!(
        net.provider(0)
            .handle
            .metrics()
            .lease_rejected_count("debt_limit"),
        2
    );
    net.shutdown().await;
}
