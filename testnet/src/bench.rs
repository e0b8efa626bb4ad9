//! Benchmarks over in-process networks. Figures go to docs/benchmarks.md together with
//! the command that reproduced them; tests never assert timings.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use gpunode_node::NodeHandle;
use gpunode_protocol::advert::OfferFilter;
use serde::Serialize;

use crate::{cpu_seconds, roomy, TestNet, TestNetConfig, TestNode, Transport};

/// GPU models spread over benchmark networks, so no capability key has more than
/// Kademlia's 20 providers at 200 nodes (a response carries at most k = 20 providers).
pub const BENCH_MODELS: [&str; 12] = [
    "A100-80GB",
    "H100-80GB",
    "T4-16GB",
    "V100-32GB",
    "L4-24GB",
    "A10-24GB",
    "L40S-48GB",
    "RTX4090-24GB",
    "P100-16GB",
    "A6000-48GB",
    "H200-141GB",
    "A40-48GB",
];

/// Result of one `discovery` run.
#[derive(Debug, Clone, Serialize)]
pub struct DiscoveryReport {
    /// Nodes in the network.
    pub nodes: usize,
    /// Lookups measured.
    pub lookups: usize,
    /// Median time to find all providers of one GPU model, ms.
    pub median_ms: f64,
    /// 95th percentile, ms.
    pub p95_ms: f64,
    /// Median Kademlia requests per lookup (provider lookup plus advert fetches).
    pub median_dht_requests: u32,
    /// Fraction of lookups that found every provider of the model.
    pub complete_fraction: f64,
    /// Lookups of a shared key measured after them: `gpu` (a GPU, any model) and `any`
    /// (every provider) in turn, each of which looks up every shard of its key.
    pub shared_key_lookups: usize,
    /// Their median, ms.
    pub shared_key_median_ms: f64,
    /// Their 95th percentile, ms.
    pub shared_key_p95_ms: f64,
    /// The fewest offers one of them returned: every provider has a GPU, so each should
    /// return as many as a query asks for (`MAX_PROVIDERS_PER_FIND`, 64, at most).
    pub shared_key_offers_min: usize,
    /// Their median Kademlia requests (provider lookups of every shard, advert fetches).
    pub shared_key_median_dht_requests: u32,
    /// Resident memory added per node once every advert is visible, MiB.
    pub rss_per_node_mib: f64,
    /// Open connections per node (mean) once every advert is visible.
    pub connections_per_node: f64,
    /// Resident memory added per node after the lookups and then one idle-connection
    /// timeout with nothing asked, MiB: the figure for an idle node (`None` when the
    /// idle phase was skipped).
    pub idle_rss_per_node_mib: Option<f64>,
    /// Open connections per node (mean) at that point.
    pub idle_connections_per_node: Option<f64>,
    /// Seconds it took to start every node (each one has a peer in its routing table).
    pub nodes_started_s: f64,
    /// Seconds from start until every model's providers were all visible to the client.
    pub startup_s: f64,
    /// Seconds from start until no node had a publication round running or due: the
    /// network is formed, and the lookups are measured from then on.
    pub formed_s: f64,
    /// CPU seconds (user and system) the whole process had used by then: what forming
    /// the network cost, less sensitive to the machine's other load than `formed_s`.
    pub cpu_s_at_formed: f64,
    /// Cores the process kept busy over the [`CONNECTED_IDLE_WINDOW`] after the lookups,
    /// every connection still open and nothing asked: the load of a formed network's
    /// keep-alive traffic, which lookups share the cores with.
    pub connected_idle_cores: Option<f64>,
    /// Once formed: of the 20 nodes closest to its model's key, how many hold a
    /// provider's record, for the provider with the fewest (a lookup that stops before
    /// reaching them can miss it).
    pub closest_holding_min: usize,
    /// The same for the median provider.
    pub closest_holding_median: usize,
    /// Providers whose record fewer than half of those 20 nodes hold.
    pub closest_holding_under_half: usize,
    /// Publication rounds all nodes together ran until the network was formed.
    pub rounds_at_formed: u64,
    /// Publication rounds run while the lookups were timed (rounds a node runs once the
    /// network stops growing come then, and share the cores with the lookups).
    pub rounds_during_lookups: u64,
}

/// How long the discovery bench reads its process's CPU time for
/// [`DiscoveryReport::connected_idle_cores`].
const CONNECTED_IDLE_WINDOW: Duration = Duration::from_secs(10);

/// Shared-key lookups timed by the discovery bench.
struct SharedKeyLookups {
    count: usize,
    median_ms: f64,
    p95_ms: f64,
    offers_min: usize,
    median_dht_requests: u32,
}

/// Times `count` queries of the shared keys, `gpu` and `any` in turn.
async fn shared_key_lookups(client: &TestNode, count: usize) -> Result<SharedKeyLookups> {
    let any_gpu = OfferFilter {
        gpus: Some(1),
        ..OfferFilter::default()
    };
    let mut times = Vec::with_capacity(count);
    let mut requests = Vec::with_capacity(count);
    let mut offers_min = usize::MAX;
    for j in 0..count {
        let filter = if j % 2 == 0 {
            any_gpu.clone()
        } else {
            OfferFilter::default()
        };
        let t = Instant::now();
        let search = client.handle.search_offers(filter).await?;
        times.push(t.elapsed().as_secs_f64() * 1000.0);
        requests.push(search.dht_requests);
        offers_min = offers_min.min(search.offers.len());
    }
    times.sort_by(f64::total_cmp);
    requests.sort();
    Ok(SharedKeyLookups {
        count,
        median_ms: percentile(&times, 0.5),
        p95_ms: percentile(&times, 0.95),
        offers_min: if count == 0 { 0 } else { offers_min },
        median_dht_requests: requests.get(count / 2).copied().unwrap_or(0),
    })
}

/// Mean number of peers each node of `net` has a connection open to.
async fn mean_connections(net: &TestNet) -> Result<f64> {
    let mut total = 0usize;
    for node in &net.nodes {
        total += node.handle.status().await?.connected_peers.len();
    }
    Ok(total as f64 / net.nodes.len().max(1) as f64)
}

/// Publication rounds the nodes of `net` have run, all together.
async fn publication_rounds(net: &TestNet) -> Result<u64> {
    let mut total = 0;
    for node in &net.nodes {
        total += node.handle.status().await?.advert.rounds;
    }
    Ok(total)
}

/// Resident set size of this process in bytes.
pub fn rss_bytes() -> u64 {
    rss_of("self")
}

/// Resident set size of process `pid` (a number, or `self`) in bytes; 0 if unknown.
pub fn rss_of(pid: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

/// The `p` quantile (0..=1) of sorted values.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[idx]
}

/// Starts `n` nodes (QUIC), waits until every model's providers are all visible to a
/// client, then times `lookups` lookups of one model's providers each.
pub async fn discovery(n: usize, lookups: usize, idle_phase: bool) -> Result<DiscoveryReport> {
    let specs: Vec<Option<String>> = (0..n)
        .map(|i| {
            Some(format!(
                "{}x{}",
                1 + i % 2,
                BENCH_MODELS[i % BENCH_MODELS.len()]
            ))
        })
        .collect();
    let mut expected = [0usize; BENCH_MODELS.len()];
    for i in 0..n {
        expected[i % BENCH_MODELS.len()] += 1;
    }
    let rss_before = rss_bytes();
    let started = Instant::now();
    let mut config = TestNetConfig::new(specs);
    config.transport = Transport::Quic;
    config.ephemeral_store = true;
    config.advert_ttl = Duration::from_secs(600);
    config.inventory_poll = Duration::from_secs(5);
    config.batch = 10;
    let net = TestNet::start(config).await?;
    let nodes_started_s = started.elapsed().as_secs_f64();
    let client = net.new_client().await?;
    for (m, want) in expected.iter().enumerate() {
        wait_until_visible(&net, &client, m, *want).await?;
        eprintln!(
            "{} visible after {:.1} s",
            BENCH_MODELS[m],
            started.elapsed().as_secs_f64()
        );
    }
    let startup_s = started.elapsed().as_secs_f64();
    let rss_per_node = (rss_bytes().saturating_sub(rss_before)) as f64 / n as f64;
    let connections_per_node = mean_connections(&net).await?;

    let formed_s = wait_until_quiet(&net, started).await?;
    let cpu_s_at_formed = cpu_seconds(None);
    let rounds_at_formed = publication_rounds(&net).await?;
    eprintln!("no publication round running or due after {formed_s:.1} s");
    let placed = placements(&net).await?;
    eprintln!("of the {CLOSEST} nodes closest to its model's key, how many hold each provider's record: {placed:?}");
    let cut_short = last_rounds_cut_short(&net).await?;
    eprintln!("nodes whose last publication round had a walk cut short: {cut_short:?}");
    let mut times = Vec::with_capacity(lookups);
    let mut requests = Vec::with_capacity(lookups);
    let mut complete = 0usize;
    for j in 0..lookups {
        let m = j % BENCH_MODELS.len();
        let t = Instant::now();
        let search = client.handle.search_offers(model_filter(m)).await?;
        times.push(t.elapsed().as_secs_f64() * 1000.0);
        requests.push(search.dht_requests);
        if search.offers.len() == expected[m] {
            complete += 1;
        } else {
            eprintln!(
                "lookup {j} incomplete: {} of {} {} offers, {} provider records, {} DHT requests",
                search.offers.len(),
                expected[m],
                BENCH_MODELS[m],
                search.providers,
                search.dht_requests
            );
            explain_miss(&net, m, &search).await?;
        }
    }
    if times.is_empty() {
        bail!("no lookups measured");
    }
    let rounds_during_lookups = publication_rounds(&net).await? - rounds_at_formed;
    eprintln!("{rounds_at_formed} publication rounds until formed, {rounds_during_lookups} during the lookups");
    times.sort_by(f64::total_cmp);
    requests.sort();
    let shared = shared_key_lookups(&client, (lookups / 10).max(10)).await?;
    let mut connected_idle_cores = None;
    let (mut idle_rss_per_node_mib, mut idle_connections_per_node) = (None, None);
    if idle_phase {
        let cpu_before = cpu_seconds(None);
        tokio::time::sleep(CONNECTED_IDLE_WINDOW).await;
        connected_idle_cores =
            Some((cpu_seconds(None) - cpu_before) / CONNECTED_IDLE_WINDOW.as_secs_f64());
        // Idle: nothing asked since the last lookup for one idle-connection timeout (the
        // window above counts), then one look of the process's heap trimmer
        // (`gpunode_node::heap`), and a margin.
        let idle = gpunode_node::NodeConfig::default().idle_connection_timeout;
        let rest = (idle + gpunode_node::heap::CHECK_EVERY + Duration::from_secs(5))
            .saturating_sub(CONNECTED_IDLE_WINDOW);
        tokio::time::sleep(rest).await;
        let idle_rss = rss_bytes().saturating_sub(rss_before) as f64 / n as f64;
        idle_rss_per_node_mib = Some(idle_rss / (1024.0 * 1024.0));
        idle_connections_per_node = Some(mean_connections(&net).await?);
    }
    let report = DiscoveryReport {
        nodes: n,
        lookups,
        median_ms: percentile(&times, 0.5),
        p95_ms: percentile(&times, 0.95),
        median_dht_requests: requests[requests.len() / 2],
        complete_fraction: complete as f64 / lookups as f64,
        rss_per_node_mib: rss_per_node / (1024.0 * 1024.0),
        connections_per_node,
        idle_rss_per_node_mib,
        idle_connections_per_node,
        nodes_started_s,
        startup_s,
        formed_s,
        cpu_s_at_formed,
        connected_idle_cores,
        shared_key_lookups: shared.count,
        shared_key_median_ms: shared.median_ms,
        shared_key_p95_ms: shared.p95_ms,
        shared_key_offers_min: shared.offers_min,
        shared_key_median_dht_requests: shared.median_dht_requests,
        closest_holding_min: placed.first().copied().unwrap_or(0),
        closest_holding_median: placed.get(placed.len() / 2).copied().unwrap_or(0),
        closest_holding_under_half: placed.iter().filter(|c| **c < CLOSEST / 2).count(),
        rounds_at_formed,
        rounds_during_lookups,
    };
    net.shutdown().await;
    Ok(report)
}

/// Where the provider records under one model's key are held, once: every node of the
/// network by distance to the key, and what each holds. (The client runs Kademlia in
/// client mode: nobody stores records at it or asks it, so it is left out.)
struct Placement {
    /// Node indices from closest to the key to farthest.
    by_distance: Vec<usize>,
    /// The providers each node holds records of under the key, by node index.
    held: Vec<Vec<libp2p::PeerId>>,
}

impl Placement {
    /// The placement of model `m`'s key now.
    async fn of(net: &TestNet, m: usize) -> Result<Placement> {
        use libp2p::kad::{KBucketKey, RecordKey};
        let key_bytes = gpunode_protocol::advert::model_key(BENCH_MODELS[m]);
        let key = KBucketKey::new(RecordKey::new(&key_bytes));
        let mut by_distance: Vec<usize> = (0..net.nodes.len()).collect();
        by_distance
            .sort_by_key(|i| key.distance(&KBucketKey::from(net.nodes[*i].handle.peer_id())));
        let mut held = Vec::with_capacity(net.nodes.len());
        for n in &net.nodes {
            held.push(n.handle.providers_held(key_bytes.clone()).await?);
        }
        Ok(Placement { by_distance, held })
    }

    /// The places (1 = closest to the key) of the nodes holding `provider`'s record.
    fn places(&self, provider: &libp2p::PeerId) -> Vec<usize> {
        self.by_distance
            .iter()
            .enumerate()
            .filter(|(_, n)| self.held[**n].contains(provider))
            .map(|(place, _)| place + 1)
            .collect()
    }

    /// How many of the [`CLOSEST`] nodes closest to the key hold `provider`'s record:
    /// where a lookup looks first (the provider itself among them, when it is one of
    /// them: it holds its own record and answers with it).
    fn closest_holding(&self, provider: &libp2p::PeerId) -> usize {
        self.places(provider)
            .iter()
            .filter(|p| **p <= CLOSEST)
            .count()
    }
}

/// Kademlia's k: the nodes closest to a key that should hold its records.
const CLOSEST: usize = 20;

/// For every provider of every model: how many of the 20 nodes closest to its model's
/// key hold its record, sorted.
async fn placements(net: &TestNet) -> Result<Vec<usize>> {
    let mut counts = Vec::with_capacity(net.nodes.len());
    let mut under_half = Vec::new();
    for m in 0..BENCH_MODELS.len() {
        let placement = Placement::of(net, m).await?;
        for i in (m..net.nodes.len()).step_by(BENCH_MODELS.len()) {
            let count = placement.closest_holding(&net.nodes[i].handle.peer_id());
            if count < CLOSEST / 2 {
                under_half.push(i);
            }
            counts.push(count);
        }
    }
    under_half.sort();
    eprintln!("providers whose record fewer than half of the {CLOSEST} nodes closest to the key hold: {under_half:?}");
    for i in under_half {
        eprintln!("  node {i}: {}", publication_history(&net.nodes[i]).await?);
    }
    counts.sort();
    Ok(counts)
}

/// How `node` last published: its rounds, whether the last had a walk cut short, and
/// the network's size by its estimate then and now.
async fn publication_history(node: &TestNode) -> Result<String> {
    let status = node.handle.status().await?;
    let advert = &status.advert;
    Ok(format!(
        "{} publication rounds, the last {} for a network of {:.0} by its estimate (now {:.0})",
        advert.rounds,
        if advert.last_round_cut_short {
            "with a walk cut short"
        } else {
            "with every walk to its end"
        },
        advert.network_size_at_last_round,
        status.network_size_estimate,
    ))
}

/// The nodes whose last publication round had a walk cut short at its deadline.
async fn last_rounds_cut_short(net: &TestNet) -> Result<Vec<usize>> {
    let mut nodes = Vec::new();
    for (i, node) in net.nodes.iter().enumerate() {
        if node.handle.status().await?.advert.last_round_cut_short {
            nodes.push(i);
        }
    }
    Ok(nodes)
}

/// Prints where the records of the providers a lookup of model `m` missed are held: by
/// how many nodes, at which places by distance to the key.
async fn explain_miss(
    net: &TestNet,
    m: usize,
    search: &gpunode_node::views::OfferSearch,
) -> Result<()> {
    let placement = Placement::of(net, m).await?;
    let found: std::collections::HashSet<&str> =
        search.offers.iter().map(|o| o.peer_id.as_str()).collect();
    for (i, node) in net.nodes.iter().enumerate() {
        let peer = node.handle.peer_id();
        if i % BENCH_MODELS.len() != m || found.contains(peer.to_string().as_str()) {
            continue;
        }
        let places = placement.places(&peer);
        eprintln!(
            "  missed node {i}: its record held by {} nodes, at places {places:?} of {} by distance to the key; {}",
            places.len(),
            placement.by_distance.len(),
            publication_history(node).await?,
        );
    }
    Ok(())
}

/// Offers of GPU model `BENCH_MODELS[m]`.
fn model_filter(m: usize) -> OfferFilter {
    OfferFilter {
        gpu_model: Some(BENCH_MODELS[m].to_string()),
        gpu_slice: None,
        ..OfferFilter::default()
    }
}

/// Waits (up to 120 s) until no node of `net` has a publication round running or due;
/// the seconds since `net` started, or an error naming the nodes still publishing.
async fn wait_until_quiet(net: &TestNet, started: Instant) -> Result<f64> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let mut publishing = Vec::new();
        for (i, node) in net.nodes.iter().enumerate() {
            if node.handle.status().await?.advert.publishing {
                publishing.push(i);
            }
        }
        if publishing.is_empty() {
            return Ok(started.elapsed().as_secs_f64());
        }
        if Instant::now() > deadline {
            bail!("nodes {publishing:?} still publishing 120 s after every advert was visible");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Waits up to 120 s until `client` finds `want` providers of model `m`; if it does
/// not, prints what each of them reports and fails.
async fn wait_until_visible(net: &TestNet, client: &TestNode, m: usize, want: usize) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut report_at = Instant::now() + Duration::from_secs(10);
    loop {
        let s = client.handle.search_offers(model_filter(m)).await?;
        if s.offers.len() >= want {
            return Ok(());
        }
        if Instant::now() > report_at {
            report_at = Instant::now() + Duration::from_secs(10);
            eprintln!(
                "{}: {} of {want} visible, {} provider records found",
                BENCH_MODELS[m],
                s.offers.len(),
                s.providers
            );
        }
        if Instant::now() > deadline {
            for (i, node) in net.nodes.iter().enumerate() {
                if i % BENCH_MODELS.len() == m {
                    let st = node.handle.status().await?;
                    let seen = s.offers.iter().any(|o| o.peer_id == st.peer_id);
                    eprintln!(
                        "node {i} seen={seen} table={} connected={} advert={:?}",
                        st.routing_table_size,
                        st.connected_peers.len(),
                        st.advert
                    );
                }
            }
            for line in client.handle.metrics().encode().lines() {
                if line.starts_with("gpunode_advert") || line.starts_with("gpunode_stream_refused")
                {
                    eprintln!("client {line}");
                }
            }
            explain_miss(net, m, &s).await?;
            bail!(
                "{}: {} of {want} providers visible after 120s ({} provider records found)",
                BENCH_MODELS[m],
                s.offers.len(),
                s.providers
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Result of one `lease` run.
#[derive(Debug, Clone, Serialize)]
pub struct LeaseReport {
    /// Sequential negotiations measured (request to active, one requester).
    pub round_trips: usize,
    /// Median negotiation time, ms.
    pub median_ms: f64,
    /// 99th percentile, ms.
    pub p99_ms: f64,
    /// Concurrent requesters in the throughput run.
    pub requesters: usize,
    /// Leases activated per second by one provider under that load.
    pub leases_per_s: f64,
    /// Leases that failed during the throughput run.
    pub failures: usize,
    /// Receipts the provider settled per second during the throughput run (each lease
    /// that ends is settled: claimed, countersigned and written on both sides).
    pub receipts_settled_per_s: f64,
    /// Whether the requesters' stores were on disk too (else in memory).
    pub durable_requesters: bool,
    /// Seconds into the throughput run after which every lease that ends has had time to
    /// settle (the lease's length and a second), so settlement runs as in a long run:
    /// the `steady_` figures count from here. `None` when the run is not longer.
    pub steady_from_s: Option<f64>,
    /// Leases granted per second after `steady_from_s`.
    pub steady_leases_per_s: Option<f64>,
    /// Receipts settled per second after `steady_from_s`.
    pub steady_receipts_settled_per_s: Option<f64>,
    /// CPU time the whole process (provider, requesters, their connections) spent per
    /// lease granted, µs: after `steady_from_s` where the run has it, else the whole run.
    pub cpu_us_per_lease: f64,
    /// Worker threads of the provider's own runtime (`--provider-threads`); 0: it
    /// shared the requesters' runtime.
    pub provider_threads: usize,
    /// With a runtime of its own: the provider's CPU time per lease granted (its event
    /// loop, connections, store writes and flushes, settlement; not the requesters'),
    /// µs, over the same window as `cpu_us_per_lease`. Threads the process shares (sled's
    /// log flusher and I/O pool, libp2p's timer thread) count in neither part.
    pub provider_cpu_us_per_lease: Option<f64>,
}

/// Lease negotiation between nodes on loopback over QUIC, the provider's store on disk
/// (the requesters' too with `durable_requesters`, else in memory): the round trip of
/// one requester, then the rate one provider sustains with `requesters` at once.
pub async fn lease(
    round_trips: usize,
    requesters: usize,
    seconds: u64,
    lease_ms: u64,
    durable_requesters: bool,
    provider_threads: usize,
) -> Result<LeaseReport> {
    let mut config = TestNetConfig::new(vec![Some("1xA100-80GB".to_string())]);
    config.tweak = Some(roomy);
    config.inventory_poll = Duration::from_secs(5);
    config.ephemeral_store = std::env::var("BENCH_EPHEMERAL").is_ok();
    let provider_runtime = (provider_threads > 0)
        .then(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(provider_threads)
                .thread_name(PROVIDER_THREADS)
                // Idle blocking threads stay, so none leaves with its CPU time uncounted.
                .thread_keep_alive(Duration::from_secs(3600))
                .enable_all()
                .build()
                .map(|r| OwnRuntime(Some(r)))
        })
        .transpose()?;
    config.first_node_runtime = provider_runtime
        .as_ref()
        .and_then(|r| r.0.as_ref())
        .map(|r| r.handle().clone());
    let mut net = TestNet::configured(config)
        .with_clients(if durable_requesters {
            0
        } else {
            requesters.max(1)
        })
        .start()
        .await?;
    if durable_requesters {
        for _ in 0..requesters.max(1) {
            net.add_client_with_store().await?;
        }
    }
    let spec = gpunode_node::LeaseSpec::new(0, lease_ms)
        .peer(net.provider_id(0))
        .cpus(1)
        .mem_bytes(1 << 20);
    let clients: Vec<NodeHandle> = net.clients().iter().map(|c| c.handle.clone()).collect();
    // Warm up the connection and code paths.
    for _ in 0..20 {
        clients[0].request_lease(spec.clone()).await?;
    }
    let mut times = Vec::with_capacity(round_trips);
    for _ in 0..round_trips {
        let t = Instant::now();
        clients[0].request_lease(spec.clone()).await?;
        times.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    times.sort_by(f64::total_cmp);
    let accounts = net.provider(0).handle.accounts();
    let steady_from = Duration::from_millis(lease_ms) + Duration::from_secs(1);
    let steady = (steady_from < Duration::from_secs(seconds)).then_some(steady_from);
    // Leases granted so far, read with the ledger and the CPU times at each sample, so a
    // window's leases, receipts and CPU time are all counted from one moment.
    let granted = Arc::new(AtomicUsize::new(0));
    let sample = || Sample {
        at: Instant::now(),
        granted: granted.load(Ordering::Relaxed),
        settled: accounts.ledger.head().seq,
        cpu: cpu_seconds(None),
        provider_cpu: cpu_seconds(Some(PROVIDER_THREADS)),
    };
    let start = sample();
    let at_steady = async {
        match steady {
            Some(after) => {
                tokio::time::sleep_until((start.at + after).into()).await;
                Some(sample())
            }
            None => None,
        }
    };
    let (failed, at_steady) = tokio::join!(
        lease_flood(&clients, &spec, seconds, granted.clone()),
        at_steady
    );
    let failed = failed?;
    let end = sample();
    let rate = |from: &Sample| {
        let secs = (end.at - from.at).as_secs_f64();
        (
            (end.granted - from.granted) as f64 / secs,
            (end.settled - from.settled) as f64 / secs,
        )
    };
    let (whole, whole_settled) = rate(&start);
    let steady_rates = at_steady.as_ref().map(rate);
    let from = at_steady.as_ref().unwrap_or(&start);
    let leases = end.granted - from.granted;
    let per_lease = |seconds: f64| seconds * 1e6 / leases.max(1) as f64;
    let report = LeaseReport {
        round_trips,
        median_ms: percentile(&times, 0.5),
        p99_ms: percentile(&times, 0.99),
        requesters: clients.len(),
        leases_per_s: whole,
        failures: failed,
        receipts_settled_per_s: whole_settled,
        durable_requesters,
        steady_from_s: steady.map(|d| d.as_secs_f64()),
        steady_leases_per_s: steady_rates.map(|r| r.0),
        steady_receipts_settled_per_s: steady_rates.map(|r| r.1),
        cpu_us_per_lease: per_lease(end.cpu - from.cpu),
        provider_threads,
        provider_cpu_us_per_lease: provider_runtime
            .as_ref()
            .map(|_| per_lease(end.provider_cpu - from.provider_cpu)),
    };
    net.shutdown().await;
    drop(provider_runtime);
    Ok(report)
}

/// A runtime started from inside another one's task, where dropping it the usual way
/// would panic (it waits for its threads): it is let go without waiting, on every path
/// out, errors included.
struct OwnRuntime(Option<tokio::runtime::Runtime>);

impl Drop for OwnRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

/// Thread name of the lease bench provider's own runtime (`--provider-threads`).
const PROVIDER_THREADS: &str = "provider-node";

/// Leases granted, the ledger's length and the CPU time used, at one moment of a lease
/// run.
struct Sample {
    at: Instant,
    granted: usize,
    settled: u64,
    cpu: f64,
    provider_cpu: f64,
}

/// Every client asks for `spec` again and again for `seconds`, adding each lease granted
/// to `granted`; the requests refused or failed.
async fn lease_flood(
    clients: &[NodeHandle],
    spec: &gpunode_node::LeaseSpec,
    seconds: u64,
    granted: Arc<AtomicUsize>,
) -> Result<usize> {
    let stop = Instant::now() + Duration::from_secs(seconds);
    let mut tasks = Vec::new();
    for handle in clients {
        let (handle, spec, granted) = (handle.clone(), spec.clone(), granted.clone());
        tasks.push(tokio::spawn(async move {
            let mut failed = 0usize;
            while Instant::now() < stop {
                match handle.request_lease(spec.clone()).await {
                    Ok(_) => {
                        granted.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) => failed += 1,
                }
            }
            failed
        }));
    }
    let mut failed = 0;
    for t in tasks {
        failed += t.await?;
    }
    Ok(failed)
}
