//! Ledger scenarios and benchmarks: a requester process that settles leases as fast as
//! it can (the crash test kills it at random moments), receipts settled per second
//! between two nodes, and the time to verify a ledger of a million entries.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use gpunode_node::ledger::Ledger;
use gpunode_node::store::Store;
use gpunode_node::{DataDir, LeaseSpec, Node, NodeConfig, NodeHandle, NodeOptions, Role};
use gpunode_protocol::lease::LeaseId;
use gpunode_protocol::receipt::{
    amount_for, lease_output_digest, SettledReceipt, UsageReceipt, RECEIPT_VERSION,
};
use gpunode_protocol::Keypair;
use serde::Serialize;

use crate::bench::percentile;
use crate::{TestNet, TestNetConfig, Transport};

/// A lease of nothing but the provider's attention, for settlement tests.
pub fn bare_lease(provider: &str, duration_ms: u64) -> LeaseSpec {
    LeaseSpec::new(0, duration_ms).peer(provider)
}

/// Starts a requester node with its data in `data_dir`, bootstrapped to `provider_addr`
/// (`.../p2p/PEER`), and leases and cancels leases of that provider with `workers`
/// loops until killed; each cancelled lease is settled by the provider.
pub async fn churn_requester(data_dir: &Path, provider_addr: &str, workers: usize) -> Result<()> {
    let provider = provider_addr
        .rsplit('/')
        .next()
        .context("the provider address must end with /p2p/PEER_ID")?
        .to_string();
    let config = NodeConfig {
        mdns: false,
        bootstrap: vec![provider_addr.parse()?],
        ..NodeConfig::default()
    };
    let mut opts = NodeOptions::new(config, DataDir::new(data_dir), Role::Client);
    opts.serve_api = false;
    let node = Node::start(opts).await?;
    let handle = node.handle();
    handle
        .wait_for_routing(1, Duration::from_secs(30))
        .await
        .context("no route to the provider")?;
    let mut tasks = Vec::new();
    for _ in 0..workers.max(1) {
        let (h, p) = (handle.clone(), provider.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                match h.request_lease(bare_lease(&p, 60_000)).await {
                    Ok(l) => {
                        let _ = h.cancel_lease(&l.lease_id).await;
                    }
                    Err(e) => {
                        eprintln!("lease failed: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await?;
    }
    Ok(())
}

/// Result of the `ledger` benchmark.
#[derive(Debug, Clone, Serialize)]
pub struct LedgerReport {
    /// Leases settled in the timed run.
    pub receipts: usize,
    /// Receipts settled per second, both sides durable, from the moment the leases end.
    pub receipts_per_s: f64,
    /// Entries in the verified ledger.
    pub verify_entries: u64,
    /// Signatures checked per verification.
    pub verify_signatures: u64,
    /// Median time of `ledger verify` over the runs, seconds.
    pub verify_median_s: f64,
    /// Verification runs.
    pub verify_runs: usize,
}

/// Settles `receipts` leases between two in-process nodes (durable stores) and times a
/// full verification of a ledger of `verify_entries` entries.
pub async fn bench(
    receipts: usize,
    verify_entries: u64,
    verify_runs: usize,
) -> Result<LedgerReport> {
    fn generous(_: usize, c: &mut NodeConfig) {
        c.allowance = 1e9;
        c.cpu_cores = Some(1_000_000);
    }
    let mut config = TestNetConfig::new(vec![None]);
    config.tweak = Some(generous);
    config.transport = Transport::Quic;
    let net = TestNet::start(config).await?;
    let provider = net.nodes[0].handle.clone();
    let mut client = net.new_client_with_store().await?;
    let requester = client.handle.clone();
    let provider_id = provider.peer_id().to_string();

    // Untimed: the leases, all set to end at the same moment (leases take about a
    // millisecond each to negotiate; two extra seconds of slack).
    let end_at = gpunode_protocol::time::now_ms() + 2_000 + receipts as u64;
    for chunk in (0..receipts).collect::<Vec<_>>().chunks(64) {
        let mut tasks = Vec::new();
        for _ in chunk {
            let (h, p) = (requester.clone(), provider_id.clone());
            tasks.push(tokio::spawn(async move {
                let left = end_at.saturating_sub(gpunode_protocol::time::now_ms());
                h.request_lease(bare_lease(&p, left.max(1_000))).await
            }));
        }
        for t in tasks {
            t.await??;
        }
    }
    let before = (
        provider.accounts().ledger.head().seq,
        requester.accounts().ledger.head().seq,
    );
    anyhow::ensure!(
        gpunode_protocol::time::now_ms() < end_at,
        "negotiating {receipts} leases took longer than planned; use fewer receipts"
    );
    // Timed: from the moment they all end until both ledgers hold every receipt.
    tokio::time::sleep(Duration::from_millis(
        end_at.saturating_sub(gpunode_protocol::time::now_ms()),
    ))
    .await;
    let started = Instant::now();
    let want = (before.0 + receipts as u64, before.1 + receipts as u64);
    let deadline = Instant::now() + Duration::from_secs(120);
    while (
        provider.accounts().ledger.head().seq,
        requester.accounts().ledger.head().seq,
    ) < want
    {
        if Instant::now() > deadline {
            anyhow::bail!(
                "only {}/{} receipts settled on the provider and {}/{} on the requester",
                provider.accounts().ledger.head().seq - before.0,
                receipts,
                requester.accounts().ledger.head().seq - before.1,
                receipts
            );
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let elapsed = started.elapsed().as_secs_f64();
    client.shutdown().await;
    net.shutdown().await;

    let (verify_signatures, times) = verify_big_ledger(verify_entries, verify_runs).await?;
    Ok(LedgerReport {
        receipts,
        receipts_per_s: receipts as f64 / elapsed,
        verify_entries,
        verify_signatures,
        verify_median_s: percentile(&times, 0.5),
        verify_runs,
    })
}

/// Builds a ledger of `entries` receipts (signed by this node and 16 peers) on disk and
/// verifies it `runs` times; returns the signatures checked and each run's seconds.
async fn verify_big_ledger(entries: u64, runs: usize) -> Result<(u64, Vec<f64>)> {
    let dir = tempfile::Builder::new()
        .prefix("gpunode-ledger")
        .tempdir()?;
    let store = Store::open(dir.path())?;
    let me = Keypair::generate_ed25519();
    let (ledger, writer) = Ledger::open(store, me.clone())?;
    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    let writer = tokio::spawn(writer.run(stop_rx));
    fill_ledger(&ledger, &me, entries).await?;
    let mut times = Vec::new();
    let mut signatures = 0;
    for _ in 0..runs.max(1) {
        let l = ledger.clone();
        let t = Instant::now();
        let report = tokio::task::spawn_blocking(move || l.verify()).await??;
        times.push(t.elapsed().as_secs_f64());
        anyhow::ensure!(
            report.first_bad.is_none(),
            "verification failed: {report:?}"
        );
        signatures = report.signatures;
    }
    times.sort_by(f64::total_cmp);
    drop(stop);
    writer.await?;
    Ok((signatures, times))
}

/// Appends `entries` settled receipts between `me` and 16 other identities to `ledger`,
/// each signed by both sides (half earned, half spent).
pub async fn fill_ledger(ledger: &Ledger, me: &Keypair, entries: u64) -> Result<()> {
    let peers: Arc<Vec<Keypair>> = Arc::new((0..16).map(|_| Keypair::generate_ed25519()).collect());
    let mut made = 0u64;
    let started = Instant::now();
    while made < entries {
        let n = (entries - made).min(8192);
        let chunk: Vec<u64> = (made..made + n).collect();
        let (me2, peers2) = (me.clone(), peers.clone());
        let receipts = tokio::task::spawn_blocking(move || {
            let half = chunk.len().div_ceil(2);
            std::thread::scope(|s| {
                let parts: Vec<_> = chunk
                    .chunks(half.max(1))
                    .map(|part| {
                        s.spawn(|| {
                            part.iter()
                                .map(|i| receipt(&me2, &peers2, *i))
                                .collect::<Vec<_>>()
                        })
                    })
                    .collect();
                parts
                    .into_iter()
                    .flat_map(|p| p.join().unwrap_or_default())
                    .collect::<Vec<_>>()
            })
        })
        .await?;
        for r in ledger.record(receipts).await {
            r?;
        }
        made += n;
    }
    eprintln!(
        "built a ledger of {entries} entries in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Receipt number `i`: this node provided to a peer, or used one, in turn.
fn receipt(me: &Keypair, peers: &[Keypair], i: u64) -> SettledReceipt {
    let peer = &peers[(i % peers.len() as u64) as usize];
    let (provider, requester) = if i.is_multiple_of(2) {
        (me, peer)
    } else {
        (peer, me)
    };
    let mut id = [0u8; 16];
    id[..8].copy_from_slice(&i.to_le_bytes());
    id[8..].copy_from_slice(b"benchmrk");
    let billed_ms = 1_000 + i % 60_000;
    let receipt = UsageReceipt {
        version: RECEIPT_VERSION,
        lease_id: LeaseId(id),
        provider: provider.public().to_peer_id(),
        requester: requester.public().to_peer_id(),
        gpus: 1,
        cpus: 4,
        mem_bytes: 8 << 30,
        start_ms: 1_700_000_000_000 + i * 100,
        end_ms: 1_700_000_000_000 + i * 100 + billed_ms,
        billed_ms,
        gpu_ms: billed_ms,
        cpu_ms: billed_ms * 4,
        jobs: 1,
        exit_status: "exited 0".into(),
        output_digest: lease_output_digest(&[]),
        price_per_gpu_hour_millicredits: 1_000,
        amount_millicredits: amount_for(1_000, 1, billed_ms),
        issued_at_ms: 1_700_000_000_000 + i * 100 + billed_ms,
        peak_gpu_memory_bytes: 0,
    };
    SettledReceipt {
        provider_sig: receipt.sign(provider).unwrap_or_default(),
        requester_sig: receipt.sign(requester).unwrap_or_default(),
        receipt,
    }
}

/// For tests: every lease in `handle`'s ledger.
pub fn settled_leases(handle: &NodeHandle) -> Result<Vec<LeaseId>> {
    let mut out = Vec::new();
    handle.accounts().ledger.for_each_entry(|e| {
        if let Ok(id) = e.lease_id.parse() {
            out.push(id);
        }
        Ok(())
    })?;
    Ok(out)
}
