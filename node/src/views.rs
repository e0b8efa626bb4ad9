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
    /// Last measured round trip to the provider (ping), ms, when connected.
    #[serde(default)]
    pub rtt_ms: Option<f64>,
    /// Its reputation with us (0 to 1; 0.5 when unknown).
    #[serde(default)]
    pub reputation: Option<f64>,
}

/// A provider as the dashboard's network view lists it: its offer, how this node
/// reaches it, and whether it is in this node's team.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProviderView {
    /// The provider's newest verified advert, with RTT and reputation.
    #[serde(flatten)]
    pub offer: OfferView,
    /// How data travels to it now (`None`: not connected).
    pub link: Option<LinkPath>,
    /// A member of this node's team.
    pub in_team: bool,
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
            rtt_ms: None,
            reputation: None,
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
    /// A publication round is under way or due (the advert or its provider records are
    /// being stored, or stored too few copies and will be again shortly, or the network
    /// has grown enough since the last round for one more once it stops growing).
    #[serde(default)]
    pub publishing: bool,
    /// Publication rounds run since the node started.
    #[serde(default)]
    pub rounds: u64,
    /// Whether a walk of the last round ran past its deadline and was cut short, so
    /// that part of the round stored at the closest peers that had answered by then,
    /// which on a busy network may fall short of the closest there are.
    #[serde(default)]
    pub last_round_cut_short: bool,
    /// The network's size, by this node's estimate, that its last round published
    /// for: the next round comes when the network has doubled since, or grown by 30%
    /// and stopped growing (below 20 peers, on any growth).
    #[serde(default)]
    pub network_size_at_last_round: f64,
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
    /// The network's size as estimated from the distance to the 20th closest peer
    /// this node knows (the count itself below 20).
    #[serde(default)]
    pub network_size_estimate: f64,
    /// Own advert.
    pub advert: AdvertStatus,
    /// Local GPUs.
    pub inventory: InventorySnapshot,
    /// Addresses peers can reach it at (concrete interface addresses), with `/p2p/ID`.
    #[serde(default)]
    pub external_addrs: Vec<String>,
    /// The team it belongs to, if any.
    #[serde(default)]
    pub team: Option<String>,
    /// Jobs running here for peers, with their GPU use.
    #[serde(default)]
    pub running_jobs: Vec<crate::jobs::RunningJobView>,
    /// Addresses gpunode peers report seeing this node at (identify's observed
    /// address), newest first, at most 8: behind NAT they differ from `listen_addrs`.
    #[serde(default)]
    pub observed_addrs: Vec<String>,
    /// Each connected peer's link: its address, direct or relayed, and ping's RTT.
    #[serde(default)]
    pub connections: Vec<ConnectionView>,
    /// How peers outside the LAN reach this node: public, behind NAT, or relayed via
    /// team relays (see `crate::nat`).
    #[serde(default)]
    pub reachability: String,
    /// Where the web dashboard answers (`None`: it is off or could not listen).
    #[serde(default)]
    pub dashboard_url: Option<String>,
}

/// How data travels to a connected peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LinkPath {
    /// Over a connection of its own (possibly after a hole punch).
    Direct,
    /// Only through another peer's relay.
    Relayed,
}

impl std::fmt::Display for LinkPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LinkPath::Direct => "direct",
            LinkPath::Relayed => "relayed",
        })
    }
}

/// How this node is connected to one peer now.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConnectionView {
    /// The peer.
    pub peer_id: String,
    /// The peer's address on the newest connection.
    pub address: String,
    /// `direct`, or `relayed` (through another peer: a `/p2p-circuit` address).
    pub path: String,
    /// The last ping round trip, ms (none yet right after connecting).
    pub rtt_ms: Option<f64>,
}

/// A lease as people and scripts see it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LeaseView {
    /// Identifier, 32 hex digits.
    pub lease_id: String,
    /// `provider` or `requester`: our side.
    pub role: crate::lease::LeaseRole,
    /// Where it stands.
    pub state: crate::lease::LeaseState,
    /// Who lends.
    pub provider: String,
    /// Who uses.
    pub requester: String,
    /// The exact GPUs.
    pub gpus: Vec<gpunode_protocol::lease::LeasedGpu>,
    /// CPU cores.
    pub cpus: u32,
    /// RAM, bytes.
    pub mem_bytes: u64,
    /// Executor.
    pub backend: String,
    /// Start, unix ms.
    pub start_ms: UnixMillis,
    /// End (after renewals), unix ms.
    pub end_ms: UnixMillis,
    /// Credits per GPU-hour.
    pub price_per_gpu_hour: f64,
    /// Most it can cost, credits.
    pub max_amount: f64,
    /// Renewals so far.
    pub renewals: usize,
    /// `valid` or `invalid`.
    pub provider_signature: String,
    /// `valid`, `invalid` or `missing` (offer not accepted).
    pub requester_signature: String,
}

impl From<&crate::lease::LeaseRecord> for LeaseView {
    fn from(r: &crate::lease::LeaseRecord) -> Self {
        LeaseView::with_signatures(r, r.signatures_valid())
    }
}

impl LeaseView {
    /// The view of `r` whose signatures were already checked: (provider ok, requester ok).
    pub fn with_signatures(r: &crate::lease::LeaseRecord, (p_ok, r_ok): (bool, bool)) -> Self {
        let t = &r.terms;
        LeaseView {
            lease_id: t.lease_id.to_string(),
            role: r.role,
            state: r.state,
            provider: t.provider.to_string(),
            requester: t.requester.to_string(),
            gpus: t.gpus.clone(),
            cpus: t.cpus,
            mem_bytes: t.mem_bytes,
            backend: t.backend.clone(),
            start_ms: t.start_ms,
            end_ms: t.end_ms,
            price_per_gpu_hour: t.price_per_gpu_hour_millicredits as f64 / 1000.0,
            max_amount: t.max_amount_millicredits() as f64 / 1000.0,
            renewals: r.renewals.len(),
            provider_signature: if p_ok { "valid" } else { "invalid" }.to_string(),
            requester_signature: match (&r.requester_sig, r_ok) {
                (None, _) => "missing",
                (Some(_), true) => "valid",
                (Some(_), false) => "invalid",
            }
            .to_string(),
        }
    }
}

/// What `gpunode lease request` asks for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LeaseSpec {
    /// Ask this provider only (peer id).
    pub peer: Option<String>,
    /// Number of GPUs.
    pub gpus: u32,
    /// GPU model or family.
    pub gpu_model: Option<String>,
    /// A MIG slice profile (`1g.18gb`) instead of whole GPUs.
    #[serde(default)]
    pub gpu_slice: Option<String>,
    /// Least memory per GPU, bytes.
    pub min_gpu_mem_bytes: Option<u64>,
    /// CPU cores.
    pub cpus: u32,
    /// RAM, bytes.
    pub mem_bytes: u64,
    /// Executor.
    pub backend: String,
    /// Length, ms.
    pub duration_ms: u64,
    /// Highest acceptable credits per GPU-hour.
    pub max_price: Option<f64>,
    /// Providers not to ask (peer ids), e.g. ones that just failed a job.
    #[serde(default)]
    pub exclude: Vec<String>,
    /// Interactive (default) or batch work.
    #[serde(default)]
    pub kind: gpunode_protocol::team::JobKind,
    /// Wait in providers' queues under this ticket when they cannot grant now.
    #[serde(default)]
    pub ticket: Option<u128>,
    /// Start at this later time (a reservation); `None`: now.
    #[serde(default)]
    pub start_at_ms: Option<u64>,
}

impl LeaseSpec {
    /// `gpus` whole GPUs for `duration_ms` from any provider, with no CPU or memory of
    /// its own, on the wasm executor; the setters below ask for more.
    pub fn new(gpus: u32, duration_ms: u64) -> LeaseSpec {
        LeaseSpec {
            peer: None,
            gpus,
            gpu_model: None,
            gpu_slice: None,
            min_gpu_mem_bytes: None,
            cpus: 0,
            mem_bytes: 0,
            backend: "wasm".into(),
            duration_ms,
            max_price: None,
            exclude: Vec::new(),
            kind: Default::default(),
            ticket: None,
            start_at_ms: None,
        }
    }

    /// Asks this provider (peer id) only.
    pub fn peer(mut self, peer: impl Into<String>) -> LeaseSpec {
        self.peer = Some(peer.into());
        self
    }

    /// GPUs of this model or family.
    pub fn gpu_model(mut self, model: impl Into<String>) -> LeaseSpec {
        self.gpu_model = Some(model.into());
        self
    }

    /// A MIG slice of this profile instead of whole GPUs.
    pub fn gpu_slice(mut self, profile: impl Into<String>) -> LeaseSpec {
        self.gpu_slice = Some(profile.into());
        self
    }

    /// CPU cores.
    pub fn cpus(mut self, cpus: u32) -> LeaseSpec {
        self.cpus = cpus;
        self
    }

    /// RAM, bytes.
    pub fn mem_bytes(mut self, bytes: u64) -> LeaseSpec {
        self.mem_bytes = bytes;
        self
    }

    /// Highest acceptable credits per GPU-hour.
    pub fn max_price(mut self, price: f64) -> LeaseSpec {
        self.max_price = Some(price);
        self
    }

    /// Waits in providers' queues under this ticket.
    pub fn ticket(mut self, ticket: u128) -> LeaseSpec {
        self.ticket = Some(ticket);
        self
    }

    /// Starts at this later time (a reservation).
    pub fn start_at_ms(mut self, at_ms: u64) -> LeaseSpec {
        self.start_at_ms = Some(at_ms);
        self
    }
}

/// The outcome of a cancellation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CancelOutcome {
    /// The lease, now cancelled.
    pub lease: LeaseView,
    /// Whether the other party acknowledged it.
    pub peer_notified: bool,
    /// Why not, if it did not.
    pub peer_error: Option<String>,
}
