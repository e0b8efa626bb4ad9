//! Prometheus metrics of a node (peers, routing table, adverts), encoded in the text
//! format for `/metrics`.

use std::sync::Arc;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// The node's metrics; shared by the event loop (writes) and the API (reads).
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Peers with an open connection.
    pub peers_connected: Gauge,
    /// Peers in the Kademlia routing table.
    pub routing_table_peers: Gauge,
    /// Adverts this node published.
    pub adverts_published: Counter,
    /// Valid adverts received from others.
    pub adverts_received: Counter,
    /// Adverts refused, by reason (`bad_signature`, `expired`, `stale`, ...).
    pub adverts_rejected: Family<Vec<(String, String)>, Counter>,
    /// Lease protocol messages received.
    pub lease_messages: Counter,
    /// Lease messages refused, by reason (`replay`, `bad_signature`, `no_capacity`, ...).
    pub leases_rejected: Family<Vec<(String, String)>, Counter>,
    /// Leases active on this node (either side).
    pub leases_active: Gauge,
    /// GPUs this node has lent or holds for an offer.
    pub leased_gpus: Gauge,
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Arc<Metrics> {
        let mut registry = Registry::with_prefix("gpunode");
        let peers_connected = Gauge::default();
        let routing_table_peers = Gauge::default();
        let adverts_published = Counter::default();
        let adverts_received = Counter::default();
        let adverts_rejected = Family::<Vec<(String, String)>, Counter>::default();
        registry.register(
            "peers_connected",
            "Peers with an open connection",
            peers_connected.clone(),
        );
        registry.register(
            "routing_table_peers",
            "Peers in the Kademlia routing table",
            routing_table_peers.clone(),
        );
        registry.register(
            "adverts_published",
            "Adverts this node published",
            adverts_published.clone(),
        );
        registry.register(
            "adverts_received",
            "Valid adverts received from peers",
            adverts_received.clone(),
        );
        registry.register(
            "adverts_rejected",
            "Adverts refused, by reason",
            adverts_rejected.clone(),
        );
        let lease_messages = Counter::default();
        let leases_rejected = Family::<Vec<(String, String)>, Counter>::default();
        let leases_active = Gauge::default();
        let leased_gpus = Gauge::default();
        registry.register(
            "lease_messages",
            "Lease protocol messages received",
            lease_messages.clone(),
        );
        registry.register(
            "leases_rejected",
            "Lease messages refused, by reason",
            leases_rejected.clone(),
        );
        registry.register(
            "leases_active",
            "Active leases on this node",
            leases_active.clone(),
        );
        registry.register(
            "leased_gpus",
            "GPUs lent or held for an offer",
            leased_gpus.clone(),
        );
        Arc::new(Metrics {
            registry,
            peers_connected,
            routing_table_peers,
            adverts_published,
            adverts_received,
            adverts_rejected,
            lease_messages,
            leases_rejected,
            leases_active,
            leased_gpus,
        })
    }

    /// Counts a refused advert under `reason`.
    pub fn advert_rejected(&self, reason: &str) {
        self.adverts_rejected
            .get_or_create(&vec![("reason".to_string(), reason.to_string())])
            .inc();
    }

    /// Counts a refused lease message under `reason`.
    pub fn lease_rejected(&self, reason: &str) {
        self.leases_rejected
            .get_or_create(&vec![("reason".to_string(), reason.to_string())])
            .inc();
    }

    /// How many lease messages were refused for `reason`.
    pub fn lease_rejected_count(&self, reason: &str) -> u64 {
        self.leases_rejected
            .get_or_create(&vec![("reason".to_string(), reason.to_string())])
            .get()
    }

    /// How many adverts were refused for `reason`.
    pub fn rejected_count(&self, reason: &str) -> u64 {
        self.adverts_rejected
            .get_or_create(&vec![("reason".to_string(), reason.to_string())])
            .get()
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}
