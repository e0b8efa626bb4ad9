//! The gpunode daemon as a library.
//!
//! [`Node::start`] makes (or loads) the identity in the data directory, opens the store,
//! picks the GPU inventory, builds the libp2p swarm, binds the listen addresses and the
//! local API socket, and spawns the event loop. A [`NodeHandle`] talks to the running
//! loop. The CLI, the testnet crate and tests all start nodes this way.
//!
//! This crate owns networking, adverts, GPU inventory, policies and the local API; it
//! uses `gpunode-protocol` for everything on the wire and never imports the CLI.

pub mod adverts;
pub mod alerts;
pub mod allocator;
pub mod api;
pub mod config;
pub mod data_dir;
pub mod dht_store;
mod error;
mod event_loop;
mod handle;
pub mod heap;
pub mod history;
pub mod inbound;
pub mod inventory;
pub mod jobs;
pub mod lease;
pub mod ledger;
pub mod loop_client;
pub mod metrics;
pub mod nat;
pub mod network;
pub mod overview;
pub mod owner;
mod poller;
pub mod router;
pub mod standings;
mod start;
pub use gpunode_store as store;
pub mod team;
pub mod views;

use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use config::NodeConfig;
pub use data_dir::DataDir;
pub use error::NodeError;
pub use handle::NodeHandle;
use inventory::GpuInventory;
pub use lease::negotiate::LeaseError;
pub use ledger::accounts::{Accounts, Misbehaviour};
pub use loop_client::LoopClient;
pub use metrics::Metrics;
pub use views::{CancelOutcome, LeaseSpec, LeaseView, NodeStatus, OfferSearch, OfferView};

/// Whether a node lends resources or only looks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Advertises its GPUs and serves the DHT (`gpunode serve`).
    Provider,
    /// A short-lived node that queries the network and advertises nothing.
    Client,
}

/// How to start a node.
pub struct NodeOptions {
    /// Configuration (file plus flags).
    pub config: NodeConfig,
    /// Where identity, store and socket live.
    pub data_dir: DataDir,
    /// Provider or client.
    pub role: Role,
    /// Use this inventory instead of detecting one (tests script simulated GPUs).
    pub inventory: Option<Arc<dyn GpuInventory>>,
    /// Serve the local API on the data dir's socket.
    pub serve_api: bool,
    /// Keep the store in memory only (large in-process test networks).
    pub ephemeral_store: bool,
    /// Run each wasm guest in a worker process started from this binary (which must
    /// answer `gpunode_sandbox::wasm::worker::WORKER_ARG`); `None` runs guests on
    /// threads of this process with epoch interruption.
    pub wasm_worker: Option<std::path::PathBuf>,
    /// Cheating switches, for test networks that check cheats are caught.
    pub misbehaviour: Misbehaviour,
}

impl NodeOptions {
    /// Options with defaults for everything but config and data dir.
    pub fn new(config: NodeConfig, data_dir: DataDir, role: Role) -> NodeOptions {
        NodeOptions {
            config,
            data_dir,
            role,
            inventory: None,
            serve_api: role == Role::Provider,
            ephemeral_store: false,
            wasm_worker: None,
            misbehaviour: Misbehaviour::default(),
        }
    }
}

/// A running node: its handle and its tasks.
pub struct Node {
    handle: NodeHandle,
    event_loop: JoinHandle<()>,
    stop_tasks: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    lease_jobs: jobs::LeaseJobs,
}

impl Node {
    /// A handle to the node.
    pub fn handle(&self) -> NodeHandle {
        self.handle.clone()
    }

    /// Graceful stop: withdraw the advert, flush the store, close the API.
    pub async fn shutdown(self) {
        self.lease_jobs.end_all();
        let _ = self.handle.shutdown().await;
        let _ = self.event_loop.await;
        let _ = self.stop_tasks.send(true);
        for t in self.tasks {
            let _ = t.await;
        }
    }

    /// Stops the node abruptly, as a crash would: nothing is withdrawn.
    pub fn abort(self) {
        self.lease_jobs.end_all();
        self.event_loop.abort();
        for t in &self.tasks {
            t.abort();
        }
    }
}
