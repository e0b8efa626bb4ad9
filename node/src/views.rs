//! What the node reports to people and scripts: the status and offer views returned by
//! the local API and printed by the CLI (as tables or JSON).

use gpunode_protocol::advert::{Advert, AdvertGpu};
use gpunode_protocol::time::UnixMillis;
use serde::{Deserialize, Serialize};

use crate::inventory::InventorySnapshot;

/// One provider's current offer, as found in the DHT and verified.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OfferView {
    /// The provider.
    pub peer_id: String,
    /// Its GPUs with state.
    pub gpus: Vec<AdvertGpu>,
    /// CPU cores offered.
    pub cpu_cores: u32,
    /// RAM offered in bytes.
    pub ram_bytes: u64,
    /// Executors.
    pub backends: Vec<String>,
    /// Credits per GPU-hour.
    pub price_per_gpu_hour: f64,
    /// Simulated GPUs (test network).
    pub simulated: bool,
    /// Sequence number of the advert.
    pub seq: u64,
    /// When the advert was signed.
    pub issued_at_ms: UnixMillis,
    /// When it expires.
    pub expires_at_ms: UnixMillis,
    /// Where the provider listens.
    pub listen_addrs: Vec<String>,
}

impl From<&Advert> for OfferView {
    fn from(a: &Advert) -> Self {
        OfferView {
            peer_id: a.publisher.to_string(),
            gpus: a.gpus.clone(),
            cpu_cores: a.cpu_cores,
            ram_bytes: a.ram_bytes,
            backends: a.backends.clone(),
            price_per_gpu_hour: a.price_per_gpu_hour_millicredits as f64 / 1000.0,
            simulated: a.simulated,
            seq: a.seq,
            issued_at_ms: a.issued_at_ms,
            expires_at_ms: a.expires_at_ms,
            listen_addrs: a.listen_addrs.clone(),
        }
    }
}

/// The answer to an offer query, with what it cost.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OfferSearch {
    /// Matching offers, cheapest first.
    pub offers: Vec<OfferView>,
    /// Providers registered under the capability key that was looked up.
    pub providers: usize,
    /// Kademlia requests sent to answer it (provider lookup plus advert fetches).
    pub dht_requests: u32,
}

/// The state of this node's own advert.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AdvertStatus {
    /// Whether the node advertises at all (a short-lived client does not).
    pub enabled: bool,
    /// Sequence number of the last advert, 0 before the first.
    pub seq: u64,
    /// When it was signed.
    pub issued_at_ms: UnixMillis,
    /// When it expires.
    pub expires_at_ms: UnixMillis,
    /// Peers that stored it at the last publication.
    pub stored_at_peers: usize,
    /// Capability keys the node provides under.
    pub capability_keys: Vec<String>,
}

/// Everything `gpunode status` shows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeStatus {
    /// This node's peer id.
    pub peer_id: String,
    /// gpunode version.
    pub version: String,
    /// Addresses it listens on.
    pub listen_addrs: Vec<String>,
    /// Peers with an open connection.
    pub connected_peers: Vec<String>,
    /// Peers in the Kademlia routing table.
    pub routing_table_size: usize,
    /// Own advert.
    pub advert: AdvertStatus,
    /// Local GPUs.
    pub inventory: InventorySnapshot,
}
