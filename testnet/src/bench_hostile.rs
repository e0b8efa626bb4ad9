//! Benchmarks of a node under attack: an honest job's dispatch time while one peer
//! floods the provider with idle streams and connection attempts, and the provider's
//! memory and disk over many refused requests from rotating Sybil identities.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::StreamExt;
use std::path::{Path, PathBuf};

use gpunode_node::{DataDir, LeaseSpec, Node, NodeConfig, NodeHandle, NodeOptions, Role};
use libp2p::swarm::dial_opts::{DialOpts, PeerCondition};
use libp2p::swarm::SwarmEvent;
use libp2p::{Multiaddr, PeerId};
use serde::Serialize;

use crate::bench::{percentile, rss_of};
use crate::jobs::{request, run_to_end, task};
use crate::{TestNet, TestNetConfig};

/// Dispatch time of an honest job, quiet and under a flood.
#[derive(Debug, Serialize)]
pub struct FloodReport {
    /// Jobs timed each way.
    pub runs: usize,
    /// Median job time with nobody attacking, ms.
    pub quiet_median_ms: f64,
    /// Median job time during the flood, ms.
    pub flood_median_ms: f64,
    /// Flood over quiet.
    pub ratio: f64,
    /// Idle job streams the attacker held open (or had refused) during the runs.
    pub streams_opened: usize,
    /// Connection attempts the attacker made during the runs.
    pub connection_attempts: u64,
    /// Connection attempts per second.
    pub attempts_per_s: f64,
    /// Streams the provider turned away (busy or silent).
    pub streams_refused: u64,
}

/// Times `runs` honest jobs on a one-provider network, then again while an attacker
/// holds up to `streams` idle job streams and makes `attempts_per_s` connection
/// attempts a second (each a new connection to the provider, past its per-peer limit).
pub async fn flood(runs: usize, streams: usize, attempts_per_s: u32) -> Result<FloodReport> {
    let net = TestNet::start(TestNetConfig::new(vec![None])).await?;
    let provider = net.nodes[0].handle.clone();
    let provider_id = provider.peer_id();
    let provider_addr: Multiaddr = net.nodes[0].addr.parse()?;
    let mut client = net.new_client().await?;
    TestNet::wait_for_offers(
        &client.handle,
        &gpunode_protocol::advert::OfferFilter::default(),
        Duration::from_secs(60),
        |o| !o.is_empty(),
    )
    .await?;
    let input = tempfile::tempdir()?;
    std::fs::write(input.path().join("data.bin"), b"honest bytes")?;
    let out = tempfile::tempdir()?;
    let jobs = HonestJobs {
        client: client.handle.clone(),
        input: input.path().join("data.bin"),
        out: out.path().to_path_buf(),
        runs,
    };
    // Warm up, then the quiet figure.
    jobs.time("warm").await?;
    let quiet = jobs.time("quiet").await?;
    eprintln!("flood: quiet median {:.1} ms", percentile(&quiet, 0.5));

    // The attacker: idle job streams from one node, connection attempts from a raw
    // swarm of its own.
    let mut attacker = net.new_client().await?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let opener = tokio::spawn(hold_idle_streams(
        attacker.handle.clone(),
        provider_id,
        streams,
        stop_rx.clone(),
    ));
    let dialer = tokio::spawn(connection_flood(
        provider_id,
        provider_addr,
        attempts_per_s,
        stop_rx,
    ));
    // Let the flood build up, then time the honest jobs inside it.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let started = Instant::now();
    eprintln!("flood: attacking; timing honest jobs");
    let flood = jobs.time("flood").await?;
    eprintln!("flood: flood median {:.1} ms", percentile(&flood, 0.5));
    let flood_secs = started.elapsed().as_secs_f64();
    let _ = stop_tx.send(true);
    let streams_opened = opener.await.context("stream opener")?;
    let connection_attempts = dialer.await.context("dialer")??;
    let metrics = provider.metrics();
    let streams_refused =
        metrics.stream_refused_count("job", "busy") + metrics.stream_refused_count("job", "silent");
    let (q, f) = (percentile(&quiet, 0.5), percentile(&flood, 0.5));
    attacker.shutdown().await;
    client.shutdown().await;
    net.shutdown().await;
    Ok(FloodReport {
        runs,
        quiet_median_ms: q,
        flood_median_ms: f,
        ratio: f / q.max(f64::MIN_POSITIVE),
        streams_opened,
        connection_attempts,
        attempts_per_s: connection_attempts as f64 / (flood_secs + 2.0),
        streams_refused,
    })
}

/// The honest requester's jobs of the flood benchmark: copy `input` to a directory
/// of `out`, `runs` times.
struct HonestJobs {
    client: NodeHandle,
    input: PathBuf,
    out: PathBuf,
    runs: usize,
}

impl HonestJobs {
    /// Runs the jobs one after another; their times, sorted, ms.
    async fn time(&self, label: &str) -> Result<Vec<f64>> {
        let mut times = Vec::with_capacity(self.runs);
        for i in 0..self.runs {
            let req = request(task("copy.wat"), &self.out.join(format!("{label}-{i}")))
                .input(&self.input);
            let t = Instant::now();
            let (_, end) = run_to_end(&self.client, req, Duration::from_secs(120)).await?;
            end.map_err(|e| anyhow::anyhow!("{label} job failed: {e}"))?;
            times.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        times.sort_by(f64::total_cmp);
        Ok(times)
    }
}

/// Opens up to `streams` job streams to `provider` from `attacker` and says nothing on
/// them, holding them until `stop`; returns how many opened.
async fn hold_idle_streams(
    attacker: NodeHandle,
    provider: PeerId,
    streams: usize,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> usize {
    let mut held = Vec::new();
    while held.len() < streams && !*stop.borrow() {
        tokio::select! {
            s = tokio::time::timeout(Duration::from_millis(500), attacker.open_job_stream(provider)) => {
                if let Ok(Ok(s)) = s { held.push(s) }
            }
            _ = stop.changed() => break,
        }
    }
    let opened = held.len();
    // Held until the runs are over.
    while !*stop.borrow() {
        if stop.changed().await.is_err() {
            break;
        }
    }
    drop(held);
    opened
}

/// Dials `peer` at `addr` `per_s` times a second, each a new connection, until `stop`;
/// returns the attempts made.
async fn connection_flood(
    peer: PeerId,
    addr: Multiaddr,
    per_s: u32,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<u64> {
    let mut swarm = libp2p::SwarmBuilder::with_new_identity()
        .with_tokio()
        .with_quic()
        .with_behaviour(|_| libp2p::swarm::dummy::Behaviour)
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .with_swarm_config(|c| c.with_idle_connection_timeout(Duration::from_secs(1)))
        .build();
    let mut tick = tokio::time::interval(Duration::from_secs(1) / per_s.max(1));
    let mut attempts = 0u64;
    loop {
        tokio::select! {
            _ = tick.tick() => {
                let opts = DialOpts::peer_id(peer)
                    .addresses(vec![addr.clone()])
                    .condition(PeerCondition::Always)
                    .build();
                if swarm.dial(opts).is_ok() {
                    attempts += 1;
                }
            }
            event = swarm.select_next_some() => {
                if let SwarmEvent::ConnectionEstablished { connection_id, .. } = event {
                    // Hang up at once: the next attempt is a new connection.
                    swarm.close_connection(connection_id);
                }
            }
            _ = stop.changed() => return Ok(attempts),
        }
    }
}

/// A provider's memory and disk over many refused requests from fresh identities.
#[derive(Debug, Serialize)]
pub struct SybilReport {
    /// Requests sent, each from a new identity every `per_identity`, each refused.
    pub requests: usize,
    /// Requests per identity.
    pub per_identity: usize,
    /// The provider process's resident memory after the first tenth, bytes.
    pub rss_after_warmup: u64,
    /// Its resident memory at the end, bytes.
    pub rss_at_end: u64,
    /// End over warm-up.
    pub rss_ratio: f64,
    /// Its store on disk after the warm-up, bytes.
    pub disk_after_warmup: u64,
    /// The same at the end.
    pub disk_at_end: u64,
    /// End over warm-up.
    pub disk_ratio: f64,
    /// Requests per second the provider refused.
    pub refused_per_s: f64,
}

/// Sends `requests` lease requests to a `gpunode serve` process, from a fresh identity
/// every `per_identity` requests, each refused (8 GPUs asked of a 1-GPU provider), and
/// reads the provider's memory and store size after a tenth of them and at the end.
pub async fn sybil(binary: &Path, requests: usize, per_identity: usize) -> Result<SybilReport> {
    let work = tempfile::tempdir()?;
    let provider = crate::process::ServeProcess::start(
        binary,
        &work.path().join("provider"),
        &["--simulate-gpus".into(), "1xT4-16GB".into()],
    )?;
    let store_dir = provider.data_dir.join("store");
    let started = Instant::now();
    let mut sent = 0usize;
    let mut warm: Option<(u64, u64)> = None;
    let mut identity = 0usize;
    while sent < requests {
        // A new identity: a fresh requester node with a data dir of its own.
        identity += 1;
        let dir = work.path().join(format!("sybil-{identity}"));
        let config = NodeConfig {
            mdns: false,
            bootstrap: vec![provider.addr.parse()?],
            ..NodeConfig::default()
        };
        let mut opts = NodeOptions::new(config, DataDir::new(&dir), Role::Client);
        opts.serve_api = false;
        let node = Node::start(opts).await?;
        let handle = node.handle();
        for _ in 0..per_identity.min(requests - sent) {
            let spec = LeaseSpec::new(8, 60_000).peer(&provider.peer_id);
            let refused = handle.request_lease(spec).await.is_err();
            anyhow::ensure!(refused, "8 GPUs of a 1-GPU provider were granted");
            sent += 1;
        }
        node.shutdown().await;
        let _ = std::fs::remove_dir_all(&dir);
        if warm.is_none() && sent >= requests / 10 {
            warm = Some((rss_of(&provider.pid().to_string()), dir_bytes(&store_dir)));
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let (rss_warm, disk_warm) = warm.unwrap_or((1, 1));
    let (rss_end, disk_end) = (rss_of(&provider.pid().to_string()), dir_bytes(&store_dir));
    drop(provider);
    Ok(SybilReport {
        requests,
        per_identity,
        rss_after_warmup: rss_warm,
        rss_at_end: rss_end,
        rss_ratio: rss_end as f64 / rss_warm.max(1) as f64,
        disk_after_warmup: disk_warm,
        disk_at_end: disk_end,
        disk_ratio: disk_end as f64 / disk_warm.max(1) as f64,
        refused_per_s: requests as f64 / secs,
    })
}

/// Bytes of the files under `dir`.
fn dir_bytes(dir: &std::path::Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() => stack.push(e.path()),
                Ok(m) => total += m.len(),
                Err(_) => {}
            }
        }
    }
    total
}
