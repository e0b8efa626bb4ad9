//! Where a command's calls go: to the daemon over this data dir's API socket when one
//! answers, else to a node started inside this process (a client on the network, or
//! the store alone). This is the one place that asks whether a daemon runs and starts
//! the in-process node when none does.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use gpunode_node::api::ApiClient;
use gpunode_node::config::{parse_multiaddr, ConfigError};
use gpunode_node::{DataDir, Node, NodeConfig, NodeHandle, NodeOptions, Role};

use crate::args::NetworkArgs;
use crate::helpers::{init_logging, parse_time, wasm_worker};

/// Why `jobs`, `logs`, `cancel` and `why` fail without a daemon.
pub const JOBS_NEED_DAEMON: &str = "no gpunode daemon is running with this data dir: jobs live in the daemon (start it with `gpunode serve`, submit with `gpunode run --detach`)";

/// What answers a command: the daemon, or a node in this process.
pub enum Target {
    /// A daemon answers on the data dir's API socket.
    Daemon(ApiClient),
    /// No daemon answers: a node in this process, on the same identity and store (the
    /// store lock keeps one owner). Stop it with [`Target::close`] or [`LocalNode::once`].
    Local(Box<LocalNode>),
}

impl Target {
    /// The daemon of `data_dir`, if one answers.
    pub async fn daemon(data_dir: &DataDir) -> Option<ApiClient> {
        let api = ApiClient::new(&data_dir.api_socket());
        api.is_running().await.then_some(api)
    }

    /// The daemon of `data_dir`, or the error `why_needed` when none answers.
    pub async fn require_daemon(data_dir: &DataDir, why_needed: &str) -> Result<ApiClient> {
        match Target::daemon(data_dir).await {
            Some(api) => Ok(api),
            None => anyhow::bail!("{why_needed}"),
        }
    }

    /// The daemon, else a client node that first looks for peers as `net` says.
    pub async fn daemon_or_network(
        data_dir: DataDir,
        config: NodeConfig,
        net: &NetworkArgs,
    ) -> Result<Target> {
        Ok(match Target::daemon(&data_dir).await {
            Some(api) => Target::Daemon(api),
            None => Target::Local(Box::new(LocalNode::network(data_dir, config, net).await?)),
        })
    }

    /// The daemon, else this node's store without any network, for commands that only
    /// read local state.
    pub async fn daemon_or_store(data_dir: DataDir, config: NodeConfig) -> Result<Target> {
        Ok(match Target::daemon(&data_dir).await {
            Some(api) => Target::Daemon(api),
            None => Target::Local(Box::new(LocalNode::store(data_dir, config).await?)),
        })
    }

    /// Stops the in-process node, if there is one.
    pub async fn close(self) {
        if let Target::Local(node) = self {
            node.stop().await;
        }
    }
}

/// A short-lived node for a command run without a daemon; it advertises nothing and
/// serves no API.
pub struct LocalNode {
    node: Node,
    /// The node's handle, for calls.
    pub handle: NodeHandle,
}

impl LocalNode {
    /// A client node on the network: it waits until it has found a peer (or
    /// `--discover-for` is up) before it returns.
    async fn network(
        data_dir: DataDir,
        mut config: NodeConfig,
        net: &NetworkArgs,
    ) -> Result<LocalNode> {
        apply_network_args(&mut config, net)?;
        let discover_for = parse_time("discover-for", &net.discover_for)?;
        init_logging("warn");
        if config.bootstrap.is_empty() && !config.mdns {
            anyhow::bail!(
                "no daemon is running and there is no way to find peers: pass --bootstrap MULTIADDR or enable mDNS"
            );
        }
        let mut opts = NodeOptions::new(config, data_dir, Role::Client);
        opts.serve_api = false;
        opts.wasm_worker = wasm_worker();
        opts.inventory = Some(Arc::new(gpunode_node::inventory::NoGpus));
        let node = Node::start(opts)
            .await
            .context("cannot start a client node")?;
        let handle = node.handle();
        // Wait until a peer is in the routing table (or the discovery time is up), then
        // give the routing table a moment to fill from the first peers' answers.
        if handle.wait_for_routing(1, discover_for).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(300)).await;
        } else {
            eprintln!("warning: found no peers within {discover_for:?}; is any gpunode reachable?");
        }
        Ok(LocalNode { node, handle })
    }

    /// This node's identity and store without any network (no bootstrap, no mDNS).
    async fn store(data_dir: DataDir, mut config: NodeConfig) -> Result<LocalNode> {
        config.bootstrap.clear();
        config.mdns = false;
        let mut opts = NodeOptions::new(config, data_dir, Role::Client);
        opts.serve_api = false;
        opts.inventory = Some(Arc::new(gpunode_node::inventory::NoGpus));
        let node = Node::start(opts)
            .await
            .context("cannot open this node's store")?;
        let handle = node.handle();
        Ok(LocalNode { node, handle })
    }

    /// Runs `call` on the node, then stops it, whatever `call` returned.
    pub async fn once<R>(self, call: impl AsyncFnOnce(&NodeHandle) -> R) -> R {
        let r = call(&self.handle).await;
        self.stop().await;
        r
    }

    /// Stops the node.
    pub async fn stop(self) {
        self.node.shutdown().await;
    }
}

/// Folds `--bootstrap` and `--no-mdns` over the config.
pub fn apply_network_args(config: &mut NodeConfig, net: &NetworkArgs) -> Result<(), ConfigError> {
    for b in &net.bootstrap {
        config.bootstrap.push(parse_multiaddr("bootstrap", b)?);
    }
    if net.no_mdns {
        config.mdns = false;
    }
    Ok(())
}
