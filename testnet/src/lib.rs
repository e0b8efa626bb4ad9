//! Many real gpunode nodes on one machine, for tests, demos and benchmarks.
//!
//! [`TestNet`] starts N nodes in this process on 127.0.0.1 (real swarms, real QUIC or
//! TCP, each with its own temporary data dir and simulated GPUs) and waits until they
//! see each other. [`process`] starts real `gpunode serve` processes instead. The
//! `testnet` binary uses both for `up` (a demo network) and `bench` (benchmarks).

pub mod bench;
pub mod bench_container;
pub mod bench_dashboard;
pub mod bench_hostile;
pub mod bench_jobs;
pub mod bench_nat;
pub mod bench_quinn;
mod fixture;
pub mod jobs;
pub mod ledger;
pub mod trace_network;
pub mod trace_replay;

pub use gpunode_procs::{images, netlab, process};

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use gpunode_node::inventory::SimulatedGpus;
use gpunode_node::{
    DataDir, Misbehaviour, Node, NodeConfig, NodeHandle, NodeOptions, OfferView, Role,
};
use gpunode_protocol::advert::OfferFilter;
use tempfile::TempDir;

pub use fixture::TestNetBuilder;

/// Which transport the nodes of a test network listen on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// QUIC over UDP.
    Quic,
    /// TCP + noise + yamux.
    Tcp,
}

impl Transport {
    fn listen_addr(self) -> String {
        match self {
            Transport::Quic => "/ip4/127.0.0.1/udp/0/quic-v1".to_string(),
            Transport::Tcp => "/ip4/127.0.0.1/tcp/0".to_string(),
        }
    }
}

/// How to build a test network.
#[derive(Debug, Clone)]
pub struct TestNetConfig {
    /// One entry per node: its simulated GPU spec (`None`: no GPUs).
    pub gpus: Vec<Option<String>>,
    /// Transport to listen on.
    pub transport: Transport,
    /// Advert lifetime.
    pub advert_ttl: Duration,
    /// Inventory poll interval.
    pub inventory_poll: Duration,
    /// Keep stores in memory (large networks).
    pub ephemeral_store: bool,
    /// Nodes started (and bootstrapped) at a time; bootstrapping all at once is CPU-heavy.
    pub batch: usize,
    /// Adjusts node `i`'s config before it starts (price, policy, ...).
    pub tweak: Option<fn(usize, &mut NodeConfig)>,
    /// Makes node `i` cheat (lie about usage, corrupt outputs), to test that it is caught.
    pub misbehaviour: Option<fn(usize) -> Misbehaviour>,
    /// Runs node 0 (every task it spawns, its blocking work too) on this runtime instead
    /// of the caller's, so a benchmark can count that node's CPU time apart from the
    /// rest of the network's ([`cpu_seconds`]).
    pub first_node_runtime: Option<tokio::runtime::Handle>,
}

impl TestNetConfig {
    /// A network with one node per spec, QUIC, 30 s adverts, 100 ms inventory polling.
    pub fn new(gpus: Vec<Option<String>>) -> TestNetConfig {
        TestNetConfig {
            gpus,
            transport: Transport::Quic,
            advert_ttl: Duration::from_secs(30),
            inventory_poll: Duration::from_millis(100),
            ephemeral_store: false,
            batch: 20,
            tweak: None,
            misbehaviour: None,
            first_node_runtime: None,
        }
    }
}

/// One node of a test network.
pub struct TestNode {
    node: Option<Node>,
    /// Handle to talk to it.
    pub handle: NodeHandle,
    /// Its simulated GPUs, to script owner processes.
    pub gpus: Option<SimulatedGpus>,
    /// An address it listens on, with `/p2p/PEER_ID`.
    pub addr: String,
    dir: TempDir,
    _job_root: JobRootCleanup,
}

/// Removes a node's job root under `/var/lib/gpunode` (where a root provider of
/// container jobs keeps them) when the test node goes, so test runs leave nothing there.
struct JobRootCleanup(std::path::PathBuf);

impl JobRootCleanup {
    fn of(dir: &TempDir) -> JobRootCleanup {
        JobRootCleanup(DataDir::new(dir.path()).job_root())
    }
}

impl Drop for JobRootCleanup {
    fn drop(&mut self) {
        if self.0.starts_with(gpunode_node::data_dir::SYSTEM_JOB_ROOT) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

impl TestNode {
    /// The node's data directory.
    pub fn data_dir(&self) -> DataDir {
        DataDir::new(self.dir.path())
    }

    /// Graceful stop (advert withdrawn).
    pub async fn shutdown(&mut self) {
        if let Some(node) = self.node.take() {
            node.shutdown().await;
        }
    }

    /// Abrupt stop, as a crash: nothing withdrawn, the advert stays until it expires.
    pub fn crash(&mut self) {
        if let Some(node) = self.node.take() {
            node.abort();
        }
    }

    /// Stops the node and hands back its data directory, to start it again later.
    pub async fn stop_keeping_data(mut self) -> TempDir {
        self.shutdown().await;
        self.dir
    }
}

fn node_config(
    cfg: &TestNetConfig,
    spec: Option<&String>,
    bootstrap: &[String],
) -> Result<NodeConfig> {
    let mut config = NodeConfig {
        mdns: false,
        advert_ttl: cfg.advert_ttl,
        inventory_poll: cfg.inventory_poll,
        simulate_gpus: spec.cloned(),
        cpu_cores: Some(8),
        ram: Some(64 << 30),
        // Every node of a test network is on 127.0.0.1.
        max_connections_per_ip: 0,
        // Scenarios lend whole machines to one requester, and start many requesters.
        max_gpus_per_peer: Some(u32::MAX),
        new_peers_on_credit_per_day: 0,
        ..NodeConfig::default()
    };
    config.listen = vec![cfg.transport.listen_addr().parse()?];
    config.bootstrap = bootstrap
        .iter()
        .map(|a| a.parse())
        .collect::<Result<_, _>>()?;
    Ok(config)
}

/// Starts provider node number `index` bootstrapped to `bootstrap`.
pub async fn start_node(
    cfg: &TestNetConfig,
    index: usize,
    spec: Option<&String>,
    bootstrap: &[String],
) -> Result<TestNode> {
    let dir = tempfile::Builder::new()
        .prefix("gpunode-testnet")
        .tempdir()?;
    start_node_in(cfg, index, spec, bootstrap, dir).await
}

/// Starts provider node number `index` with its data in `dir` (reused across restarts).
pub async fn start_node_in(
    cfg: &TestNetConfig,
    index: usize,
    spec: Option<&String>,
    bootstrap: &[String],
    dir: TempDir,
) -> Result<TestNode> {
    let data_dir = DataDir::new(dir.path());
    let mut config = node_config(cfg, spec, bootstrap)?;
    if let Some(tweak) = cfg.tweak {
        tweak(index, &mut config);
    }
    let peer = data_dir.load_or_create_identity()?.public().to_peer_id();
    let gpus = match spec {
        Some(s) => Some(SimulatedGpus::from_spec(s, &peer.to_string())?),
        None => None,
    };
    let mut opts = NodeOptions::new(config, data_dir, Role::Provider);
    opts.serve_api = false;
    opts.ephemeral_store = cfg.ephemeral_store;
    if let Some(m) = cfg.misbehaviour {
        opts.misbehaviour = m(index);
    }
    opts.inventory = Some(match &gpus {
        Some(g) => Arc::new(g.clone()),
        None => Arc::new(gpunode_node::inventory::NoGpus),
    });
    let node = Node::start(opts).await?;
    let handle = node.handle();
    let addr = wait_for_listen_addr(&handle).await?;
    Ok(TestNode {
        node: Some(node),
        handle,
        gpus,
        addr,
        _job_root: JobRootCleanup::of(&dir),
        dir,
    })
}

async fn wait_for_listen_addr(handle: &NodeHandle) -> Result<String> {
    for _ in 0..200 {
        let status = handle.status().await?;
        if let Some(a) = status.listen_addrs.first() {
            return Ok(format!("{a}/p2p/{}", status.peer_id));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    bail!("node did not start listening within 2s")
}

/// A node config tweak ([`TestNetConfig::tweak`]): room for as many CPU-only leases as
/// a run asks for (a million cores, 1 PiB of memory, a billion credits of allowance).
pub fn roomy(_: usize, c: &mut NodeConfig) {
    c.cpu_cores = Some(1_000_000);
    c.ram = Some(1 << 50);
    c.allowance = 1e9;
}

/// CPU time (user and system, seconds) used so far by this whole process (`None`, its
/// exited threads included), or by its live threads whose name starts with `prefix` (a
/// runtime's `thread_name`), from `/proc/self`. 0 where `/proc` cannot be read.
pub fn cpu_seconds(prefix: Option<&str>) -> f64 {
    let Some(prefix) = prefix else {
        return std::fs::read_to_string("/proc/self/stat")
            .map(|stat| stat_cpu_seconds(&stat, None))
            .unwrap_or(0.0);
    };
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("stat")).ok())
        .map(|stat| stat_cpu_seconds(&stat, Some(prefix)))
        .sum()
}

/// utime + stime of one `/proc/.../stat` line, in seconds; 0 when its name does not start
/// with `prefix` or the line does not parse.
fn stat_cpu_seconds(stat: &str, prefix: Option<&str>) -> f64 {
    // USER_HZ, the unit of these fields, is 100 on Linux whatever the kernel's tick.
    const TICKS_PER_S: f64 = 100.0;
    // "pid (name) state ppid ...": the name may hold spaces or parentheses, so split at
    // the last ')'; utime and stime are fields 14 and 15.
    let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
        return 0.0;
    };
    if prefix.is_some_and(|p| !stat[open + 1..close].starts_with(p)) {
        return 0.0;
    }
    let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3).and_then(|f| f.parse::<u64>().ok());
    (field(14).unwrap_or(0) + field(15).unwrap_or(0)) as f64 / TICKS_PER_S
}

/// A network of in-process nodes: providers, and the clients the test added to it.
pub struct TestNet {
    /// The nodes, in start order; node 0 is everyone's bootstrap peer.
    pub nodes: Vec<TestNode>,
    clients: Vec<TestNode>,
    config: TestNetConfig,
}

impl TestNet {
    /// Starts the network and waits until every node has peers in its routing table.
    pub async fn start(config: TestNetConfig) -> Result<TestNet> {
        let mut nodes: Vec<TestNode> = Vec::with_capacity(config.gpus.len());
        let specs = config.gpus.clone();
        let mut iter = specs.iter();
        if let Some(first) = iter.next() {
            let node = match &config.first_node_runtime {
                Some(runtime) => {
                    let (config, first) = (config.clone(), first.clone());
                    runtime
                        .spawn(async move { start_node(&config, 0, first.as_ref(), &[]).await })
                        .await??
                }
                None => start_node(&config, 0, first.as_ref(), &[]).await?,
            };
            nodes.push(node);
        }
        let bootstrap = nodes
            .first()
            .map(|n| vec![n.addr.clone()])
            .unwrap_or_default();
        let rest: Vec<&Option<String>> = iter.collect();
        for batch in rest.chunks(config.batch.max(1)) {
            for spec in batch {
                let index = nodes.len();
                nodes.push(start_node(&config, index, spec.as_ref(), &bootstrap).await?);
            }
            let want = nodes.len().saturating_sub(1).min(1);
            for n in nodes.iter().rev().take(batch.len()) {
                n.handle
                    .wait_for_routing(want, Duration::from_secs(30))
                    .await
                    .context("a node found no peers within 30s")?;
            }
        }
        Ok(TestNet {
            nodes,
            clients: Vec::new(),
            config,
        })
    }

    /// The network's configuration.
    pub fn config(&self) -> &TestNetConfig {
        &self.config
    }

    /// A client node (advertises nothing) bootstrapped to node 0, its store in memory;
    /// the caller owns it (see [`TestNet::add_client`] for one the network stops).
    pub async fn new_client(&self) -> Result<TestNode> {
        self.client_node(true).await
    }

    /// A client node whose store is on disk (durable writes, as in production).
    pub async fn new_client_with_store(&self) -> Result<TestNode> {
        self.client_node(false).await
    }

    /// Starts one more client, kept with the network (stopped by
    /// [`TestNet::shutdown`]), and returns it; it is `client(clients().len() - 1)`.
    pub async fn add_client(&mut self) -> Result<&TestNode> {
        let client = self.new_client().await?;
        self.clients.push(client);
        Ok(&self.clients[self.clients.len() - 1])
    }

    /// Like [`TestNet::add_client`], with the client's store on disk (durable writes, as
    /// in production).
    pub async fn add_client_with_store(&mut self) -> Result<&TestNode> {
        let client = self.new_client_with_store().await?;
        self.clients.push(client);
        Ok(&self.clients[self.clients.len() - 1])
    }

    /// Provider `i`.
    pub fn provider(&self, i: usize) -> &TestNode {
        &self.nodes[i]
    }

    /// Provider `i`'s peer id, as leases and offers name it.
    pub fn provider_id(&self, i: usize) -> String {
        self.nodes[i].handle.peer_id().to_string()
    }

    /// Client `i`, in the order they were added.
    pub fn client(&self, i: usize) -> &TestNode {
        &self.clients[i]
    }

    /// Every client, in the order they were added.
    pub fn clients(&self) -> &[TestNode] {
        &self.clients
    }

    async fn client_node(&self, ephemeral: bool) -> Result<TestNode> {
        let dir = tempfile::Builder::new()
            .prefix("gpunode-client")
            .tempdir()?;
        let bootstrap: Vec<String> = self
            .nodes
            .first()
            .map(|n| vec![n.addr.clone()])
            .unwrap_or_default();
        let config = node_config(&self.config, None, &bootstrap)?;
        let mut opts = NodeOptions::new(config, DataDir::new(dir.path()), Role::Client);
        opts.serve_api = false;
        opts.ephemeral_store = ephemeral;
        let node = Node::start(opts).await?;
        let handle = node.handle();
        handle
            .wait_for_routing(1, Duration::from_secs(30))
            .await
            .context("client found no peers")?;
        let addr = wait_for_listen_addr(&handle).await?;
        Ok(TestNode {
            node: Some(node),
            handle,
            gpus: None,
            addr,
            _job_root: JobRootCleanup::of(&dir),
            dir,
        })
    }

    /// Asks `from` for offers until `check` accepts the answer or `timeout` passes.
    pub async fn wait_for_offers(
        from: &NodeHandle,
        filter: &OfferFilter,
        timeout: Duration,
        check: impl Fn(&[OfferView]) -> bool,
    ) -> Result<Vec<OfferView>> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let offers = from.find_offers(filter.clone()).await?;
            if check(&offers) {
                return Ok(offers);
            }
            if tokio::time::Instant::now() >= deadline {
                bail!(
                    "condition not met within {timeout:?}; last answer had {} offers: {:?}",
                    offers.len(),
                    offers.iter().map(|o| &o.peer_id).collect::<Vec<_>>()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops every client, then every provider, gracefully. Each group stops at once:
    /// a node's withdrawal waits (at most 2 s) for peers to store it, and peers stopped
    /// before it cannot, so one after another a network of N took about 2 s × N.
    pub async fn shutdown(mut self) {
        futures::future::join_all(self.clients.iter_mut().map(TestNode::shutdown)).await;
        futures::future::join_all(self.nodes.iter_mut().map(TestNode::shutdown)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_time_is_read_past_a_name_with_spaces_and_parentheses() {
        // Fields after the name: state(3) ppid pgrp session tty tpgid flags minflt
        // cminflt majflt cmajflt utime(14) stime(15) cutime ...
        let stat = "4242 (a (b) c) S 1 1 1 0 -1 4194560 10 0 0 0 250 50 7 9 20 0";
        assert_eq!(stat_cpu_seconds(stat, None), 3.0);
        assert_eq!(stat_cpu_seconds(stat, Some("a (b")), 3.0);
        assert_eq!(stat_cpu_seconds(stat, Some("provider")), 0.0);
        assert_eq!(stat_cpu_seconds("garbage", None), 0.0);
        assert_eq!(stat_cpu_seconds("1 (x) S 1", None), 0.0);
    }

    #[test]
    fn a_runtime_of_its_own_counts_its_threads_cpu_time_apart() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("cpu-test-rt")
            .build()
            .expect("runtime");
        // Spin on the runtime's thread until its counted CPU time passes 0.2 s; a count
        // that misses the thread never gets there and the deadline fails the test.
        let spin = runtime.spawn(async {
            let deadline = std::time::Instant::now() + Duration::from_secs(60);
            let mut x = 0u64;
            loop {
                let counted = cpu_seconds(Some("cpu-test-rt"));
                if counted >= 0.2 {
                    return counted;
                }
                assert!(std::time::Instant::now() < deadline, "counted {counted} s");
                for _ in 0..1_000_000 {
                    x = std::hint::black_box(x.wrapping_add(1));
                }
            }
        });
        let own = runtime.block_on(spin).expect("spin");
        // The kernel rounds a thread's and the process's times down apart: a tick or
        // two of slack.
        assert!(cpu_seconds(None) + 0.02 >= own);
        assert!(cpu_seconds(Some("cpu-test-rt")) >= own);
        assert_eq!(cpu_seconds(Some("no-such-thread-name")), 0.0);
    }
}
