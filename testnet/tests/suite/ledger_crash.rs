//! Crash safety of the ledger: a requester process settles hundreds of receipts with a
//! provider and is killed with SIGKILL at random moments, then restarted on the same
//! data. Every receipt the requester acknowledged (the provider holds its
//! countersignature) must be in the requester's ledger afterwards, and the requester's
//! chain must verify.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gpunode_node::ledger::Ledger;
use gpunode_node::store::Store;
use gpunode_node::DataDir;
use testnet::ledger::settled_leases;
use testnet::{TestNet, Transport};

/// Kill rounds before the last run.
const ROUNDS: usize = 6;
/// Receipts the provider must hold by the end.
const AT_LEAST: usize = 300;
/// Receipts the restarted requester must settle in the last run.
const LAST_RUN: usize = 100;

fn spawn_requester(dir: &std::path::Path, provider: &str) -> Child {
    Command::new(env!("CARGO_BIN_EXE_testnet"))
        .args(["ledger-requester", "--workers", "8", "--provider", provider])
        .arg("--data-dir")
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the requester process")
}

/// Kills the child with SIGKILL (no chance to flush anything) and reaps it.
fn kill_9(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// Deterministic pseudo-random delays between 200 and 1200 ms.
fn delays(seed: u64) -> impl Iterator<Item = Duration> {
    let mut x = seed | 1;
    std::iter::repeat_with(move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        Duration::from_millis(200 + x % 1000)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_requester_keeps_every_acknowledged_receipt_and_a_valid_chain() {
    fn generous(_: usize, c: &mut gpunode_node::NodeConfig) {
        c.allowance = 1e9;
    }
    let net = TestNet::providers(1)
        .transport(Transport::Tcp)
        .tweak(generous)
        .start()
        .await
        .expect("start");
    let provider = net.provider(0).handle.clone();
    let dir = tempfile::tempdir().expect("tempdir");
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(7);
    eprintln!("kill delays seeded with {seed}");
    let mut waits = delays(seed);
    let acked = || provider.accounts().ledger.head().seq as usize;

    for round in 0..ROUNDS {
        let mut child = spawn_requester(dir.path(), &net.provider(0).addr);
        // Let it reach the provider and settle some, then kill it mid-stream.
        let before = acked();
        let deadline = Instant::now() + Duration::from_secs(60);
        while acked() == before && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(waits.next().unwrap_or_default()).await;
        kill_9(&mut child);
        eprintln!(
            "round {round}: killed with {} receipts acknowledged",
            acked()
        );
    }
    // A last run: the restarted requester settles more (claims left from before the
    // kills are resent, and answered with the countersignatures already on disk).
    let mut child = spawn_requester(dir.path(), &net.provider(0).addr);
    let want = (acked() + LAST_RUN).max(AT_LEAST);
    let deadline = Instant::now() + Duration::from_secs(180);
    while acked() < want && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    kill_9(&mut child);
    let acknowledged = settled_leases(&provider).expect("provider ledger");
    assert!(
        acknowledged.len() >= AT_LEAST,
        "only {} receipts settled",
        acknowledged.len()
    );

    // The requester's data, as the killed process left it.
    let data = DataDir::new(dir.path());
    let key = data.load_identity().expect("identity").expect("exists");
    let store = Store::open(&data.store_dir()).expect("the store opens after kill -9");
    let (ledger, _writer) = Ledger::open(store, key).expect("the ledger opens");
    let report = ledger.verify().expect("verify");
    assert_eq!(report.first_bad, None, "{report:?}");
    let mut missing = Vec::new();
    for id in &acknowledged {
        let ours = ledger.settled(id).expect("read");
        match ours {
            Some((_, r)) => {
                let (_, theirs) = provider
                    .accounts()
                    .ledger
                    .settled(id)
                    .expect("read")
                    .expect("settled");
                assert_eq!(r, theirs, "both sides hold the same receipt");
            }
            None => missing.push(*id),
        }
    }
    assert!(
        missing.is_empty(),
        "{} acknowledged receipts are missing after kill -9: {:?}",
        missing.len(),
        &missing[..missing.len().min(5)]
    );
    eprintln!(
        "{} receipts acknowledged, all present; requester chain of {} entries verifies",
        acknowledged.len(),
        report.entries
    );
    net.shutdown().await;
}
