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
    /// Proposed leases, by answer (`granted` at once; `offered`: other terms, as the
    /// requester's view of this node's advert was out of date; `queued`, `refused`).
    pub lease_proposals: Family<Vec<(String, String)>, Counter>,
    /// Leases active on this node (either side).
    pub leases_active: Gauge,
    /// GPUs this node has lent or holds for an offer.
    pub leased_gpus: Gauge,
    /// Jobs this node ran for peers, by outcome (`exited`, `timed_out`, ...).
    pub jobs_run: Family<Vec<(String, String)>, Counter>,
    /// Jobs refused before running, by reason (`unknown_lease`, `too_large`, ...).
    pub jobs_rejected: Family<Vec<(String, String)>, Counter>,
    /// Jobs running here now.
    pub jobs_running: Gauge,
    /// Leases ended because the GPU's owner came back (policy `yield`).
    pub leases_preempted: Counter,
    /// Leases this provider ended as their only job's exchange ended (the requester
    /// asked for that by the protocol it opened the job on).
    pub leases_ended_with_job: Counter,
    /// Claim exchanges sent on a settlement stream opened ahead (while a lease was
    /// ending).
    pub settle_streams_ahead_used: Counter,
    /// Jobs this requester sent on a stream opened while their lease's acceptance
    /// travelled.
    pub job_streams_ahead_used: Counter,
    /// Per-GPU and per-job GPU readings, and alerts.
    pub gpus: GpuGauges,
    /// Blob bytes received from requesters (modules and inputs not already cached).
    pub job_bytes_received: Counter,
    /// Blob bytes found in the cache instead of being sent again.
    pub job_bytes_cached: Counter,
    /// Receipts settled (written to the ledger with both signatures).
    pub receipts_settled: Counter,
    /// Receipts refused, by reason (`inflated`, `duplicate`, `bad_signature`, ...).
    pub receipts_rejected: Family<Vec<(String, String)>, Counter>,
    /// Inbound streams dropped, by protocol and reason (`busy`: the protocol's handlers
    /// are all taken; `silent`: nothing useful arrived before the deadline).
    pub streams_refused: Family<Vec<(String, String)>, Counter>,
    /// Inbound connections refused by the per-IP limit.
    pub connections_refused: Counter,
    /// Queue-turn notices, by result (sent, send_failed, woke, unknown_ticket,
    /// not_queued_there, malformed).
    pub queue_turns: Family<Vec<(String, String)>, Counter>,
    /// Size of each bounded structure fed by peers (`lease_records`, `spent_nonces`,
    /// `adverts`, `reputation_records`, `refused_receipts`), to watch against its bound.
    pub peer_state: Family<Vec<(String, String)>, Gauge>,
    /// Hole punches over relayed connections, by result (`success`, `failure`).
    pub hole_punches: Family<Vec<(String, String)>, Counter>,
    /// This node's Kademlia bootstrap walks, by walk: the lookup of its own key, and the
    /// far-bucket walks libp2p adds, which a joining node in Kademlia server mode ends
    /// before they send anything.
    pub dht_bootstrap_walks: Family<Vec<(String, String)>, Counter>,
    /// The Kademlia requests those walks sent, by walk.
    pub dht_bootstrap_requests: Family<Vec<(String, String)>, Counter>,
    /// Team relays holding a reservation for this node.
    pub relay_reservations: Gauge,
}

impl Metrics {
    /// Creates and registers every metric.
    ///
    /// Long as one flat list on purpose: each metric is created and registered with its
    /// name and help text in one place, in the order they are exported.
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
        let lease_proposals = Family::<Vec<(String, String)>, Counter>::default();
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
            "lease_proposals",
            "Leases proposed with their request, by answer (granted at once, offered other terms, queued, refused)",
            lease_proposals.clone(),
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
        let jobs_run = Family::<Vec<(String, String)>, Counter>::default();
        let jobs_rejected = Family::<Vec<(String, String)>, Counter>::default();
        let jobs_running = Gauge::default();
        let leases_preempted = Counter::default();
        let leases_ended_with_job = Counter::default();
        let settle_streams_ahead_used = Counter::default();
        let job_streams_ahead_used = Counter::default();
        let job_bytes_received = Counter::default();
        let job_bytes_cached = Counter::default();
        registry.register(
            "jobs_run",
            "Jobs run for peers, by outcome",
            jobs_run.clone(),
        );
        registry.register(
            "jobs_rejected",
            "Jobs refused before running, by reason",
            jobs_rejected.clone(),
        );
        registry.register("jobs_running", "Jobs running now", jobs_running.clone());
        registry.register(
            "leases_preempted",
            "Leases ended because the GPU's owner came back",
            leases_preempted.clone(),
        );
        registry.register(
            "leases_ended_with_job",
            "Leases ended by this provider as their only job's exchange ended",
            leases_ended_with_job.clone(),
        );
        registry.register(
            "settle_streams_ahead_used",
            "Claim exchanges sent on a settlement stream opened while a lease was ending",
            settle_streams_ahead_used.clone(),
        );
        registry.register(
            "job_streams_ahead_used",
            "Jobs sent on a stream opened while their lease's acceptance travelled",
            job_streams_ahead_used.clone(),
        );
        registry.register(
            "job_bytes_received",
            "Module and input bytes received from requesters",
            job_bytes_received.clone(),
        );
        registry.register(
            "job_bytes_cached",
            "Module and input bytes found in the blob cache instead of sent again",
            job_bytes_cached.clone(),
        );
        let receipts_settled = Counter::default();
        let receipts_rejected = Family::<Vec<(String, String)>, Counter>::default();
        registry.register(
            "receipts_settled",
            "Usage receipts settled into the ledger",
            receipts_settled.clone(),
        );
        registry.register(
            "receipts_rejected",
            "Usage receipts refused, by reason",
            receipts_rejected.clone(),
        );
        let streams_refused = Family::<Vec<(String, String)>, Counter>::default();
        let connections_refused = Counter::default();
        registry.register(
            "streams_refused",
            "Inbound streams dropped, by protocol and reason (busy, silent)",
            streams_refused.clone(),
        );
        registry.register(
            "connections_refused",
            "Inbound connections refused by the per-IP limit",
            connections_refused.clone(),
        );
        let queue_turns = Family::<Vec<(String, String)>, Counter>::default();
        registry.register(
            "queue_turns",
            "Notices that a queued request's GPUs freed, sent and received, by result",
            queue_turns.clone(),
        );
        let peer_state = Family::<Vec<(String, String)>, Gauge>::default();
        registry.register(
            "peer_state",
            "Entries of each bounded structure fed by peers",
            peer_state.clone(),
        );
        let hole_punches = Family::<Vec<(String, String)>, Counter>::default();
        registry.register(
            "hole_punches",
            "Hole punches (DCUtR) over relayed connections, by result",
            hole_punches.clone(),
        );
        let dht_bootstrap_walks = Family::<Vec<(String, String)>, Counter>::default();
        registry.register(
            "dht_bootstrap_walks",
            "Kademlia bootstrap walks, by walk (own_key; far_bucket, ended unsent by a joining server)",
            dht_bootstrap_walks.clone(),
        );
        let dht_bootstrap_requests = Family::<Vec<(String, String)>, Counter>::default();
        registry.register(
            "dht_bootstrap_requests",
            "Kademlia requests of bootstrap walks, by walk (own_key, far_bucket)",
            dht_bootstrap_requests.clone(),
        );
        let relay_reservations = Gauge::default();
        registry.register(
            "relay_reservations",
            "Team relays holding a reservation for this node",
            relay_reservations.clone(),
        );
        let gpus = GpuGauges::register(&mut registry);
        Arc::new(Metrics {
            hole_punches,
            dht_bootstrap_walks,
            dht_bootstrap_requests,
            relay_reservations,
            peer_state,
            streams_refused,
            connections_refused,
            queue_turns,
            gpus,
            receipts_settled,
            receipts_rejected,
            jobs_run,
            jobs_rejected,
            jobs_running,
            leases_preempted,
            leases_ended_with_job,
            settle_streams_ahead_used,
            job_streams_ahead_used,
            job_bytes_received,
            job_bytes_cached,
            registry,
            peers_connected,
            routing_table_peers,
            adverts_published,
            adverts_received,
            adverts_rejected,
            lease_messages,
            leases_rejected,
            lease_proposals,
            leases_active,
            leased_gpus,
        })
    }

    /// Counts a hole punch that ended with `result` (`success`, `failure`).
    pub fn hole_punch(&self, result: &str) {
        self.hole_punches
            .get_or_create(&vec![("result".to_string(), result.to_string())])
            .inc();
    }

    /// How many hole punches ended with `result`.
    pub fn hole_punch_count(&self, result: &str) -> u64 {
        self.hole_punches
            .get_or_create(&vec![("result".to_string(), result.to_string())])
            .get()
    }

    /// Counts one bootstrap walk of kind `walk` (`own_key`, `far_bucket`) that sent
    /// `requests`.
    pub fn dht_bootstrap_walk(&self, walk: &str, requests: u32) {
        let labels = vec![("walk".to_string(), walk.to_string())];
        self.dht_bootstrap_walks.get_or_create(&labels).inc();
        self.dht_bootstrap_requests
            .get_or_create(&labels)
            .inc_by(u64::from(requests));
    }

    /// This node's bootstrap walks of kind `walk`, and the requests they sent.
    pub fn dht_bootstrap_counts(&self, walk: &str) -> (u64, u64) {
        let labels = vec![("walk".to_string(), walk.to_string())];
        (
            self.dht_bootstrap_walks.get_or_create(&labels).get(),
            self.dht_bootstrap_requests.get_or_create(&labels).get(),
        )
    }

    /// Counts a queue-turn notice under `result`.
    pub fn queue_turn(&self, result: &str) {
        self.queue_turns
            .get_or_create(&vec![("result".to_string(), result.to_string())])
            .inc();
    }

    /// How many queue-turn notices ended with `result`.
    pub fn queue_turn_count(&self, result: &str) -> u64 {
        self.queue_turns
            .get_or_create(&vec![("result".to_string(), result.to_string())])
            .get()
    }

    /// Counts a refused advert under `reason`.
    pub fn advert_rejected(&self, reason: &str) {
        self.adverts_rejected
            .get_or_create(&vec![("reason".to_string(), reason.to_string())])
            .inc();
    }

    /// Sets the size of the bounded structure `name`.
    pub fn set_peer_state(&self, name: &str, entries: usize) {
        self.peer_state
            .get_or_create(&vec![("structure".to_string(), name.to_string())])
            .set(i64::try_from(entries).unwrap_or(i64::MAX));
    }

    /// Counts an inbound stream of `protocol` dropped for `reason`.
    pub fn stream_refused(&self, protocol: &str, reason: &str) {
        self.streams_refused
            .get_or_create(&vec![
                ("protocol".to_string(), protocol.to_string()),
                ("reason".to_string(), reason.to_string()),
            ])
            .inc();
    }

    /// How many inbound streams of `protocol` were dropped for `reason`.
    pub fn stream_refused_count(&self, protocol: &str, reason: &str) -> u64 {
        self.streams_refused
            .get_or_create(&vec![
                ("protocol".to_string(), protocol.to_string()),
                ("reason".to_string(), reason.to_string()),
            ])
            .get()
    }

    /// Counts a job that ran, under its outcome.
    pub fn job_run(&self, outcome: &str) {
        self.jobs_run
            .get_or_create(&vec![("outcome".to_string(), outcome.to_string())])
            .inc();
    }

    /// Counts a refused job under `reason`.
    pub fn job_rejected(&self, reason: &str) {
        self.jobs_rejected
            .get_or_create(&vec![("reason".to_string(), reason.to_string())])
            .inc();
    }

    /// How many jobs were refused for `reason`.
    pub fn job_rejected_count(&self, reason: &str) -> u64 {
        self.jobs_rejected
            .get_or_create(&vec![("reason".to_string(), reason.to_string())])
            .get()
    }

    /// Counts a refused receipt under `reason`.
    pub fn receipt_rejected(&self, reason: &str) {
        self.receipts_rejected
            .get_or_create(&vec![("reason".to_string(), reason.to_string())])
            .inc();
    }

    /// How many receipts were refused for `reason`.
    pub fn receipt_rejected_count(&self, reason: &str) -> u64 {
        self.receipts_rejected
            .get_or_create(&vec![("reason".to_string(), reason.to_string())])
            .get()
    }

    /// Counts a refused lease message under `reason`.
    pub fn lease_rejected(&self, reason: &str) {
        self.leases_rejected
            .get_or_create(&vec![("reason".to_string(), reason.to_string())])
            .inc();
    }

    /// Counts a proposed lease answered with `answer` (`granted`, `offered`, ...).
    pub fn lease_proposal(&self, answer: &str) {
        self.lease_proposals
            .get_or_create(&vec![("answer".to_string(), answer.to_string())])
            .inc();
    }

    /// How many proposed leases were answered with `answer`.
    pub fn lease_proposal_count(&self, answer: &str) -> u64 {
        self.lease_proposals
            .get_or_create(&vec![("answer".to_string(), answer.to_string())])
            .get()
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

type Labels = Vec<(String, String)>;

/// Per-GPU readings (from each inventory snapshot), per-job GPU use (running jobs), and
/// alerts raised.
#[derive(Debug, Clone, Default)]
pub struct GpuGauges {
    utilization: Family<Labels, Gauge>,
    memory_used: Family<Labels, Gauge>,
    temperature: Family<Labels, Gauge>,
    job_utilization: Family<Labels, Gauge>,
    job_memory_peak: Family<Labels, Gauge>,
    job_gpu_seconds: Family<Labels, Gauge>,
    /// Alerts raised, by kind.
    pub alerts: Family<Labels, Counter>,
}

impl GpuGauges {
    fn register(registry: &mut Registry) -> GpuGauges {
        let g = GpuGauges::default();
        for (name, help, family) in [
            (
                "gpu_utilization_percent",
                "Compute use of each GPU",
                &g.utilization,
            ),
            (
                "gpu_memory_used_bytes",
                "Memory in use on each GPU",
                &g.memory_used,
            ),
            (
                "gpu_temperature_celsius",
                "Core temperature of each GPU",
                &g.temperature,
            ),
            (
                "job_gpu_utilization_percent",
                "Compute use of each running job's GPUs",
                &g.job_utilization,
            ),
            (
                "job_gpu_memory_peak_bytes",
                "Most GPU memory each running job held",
                &g.job_memory_peak,
            ),
            (
                "job_gpu_seconds",
                "GPU time each running job has had so far",
                &g.job_gpu_seconds,
            ),
        ] {
            registry.register(name, help, family.clone());
        }
        registry.register("alerts", "GPU alerts raised, by kind", g.alerts.clone());
        g
    }

    /// Sets the per-GPU gauges from a snapshot.
    pub fn observe_gpus(&self, snap: &crate::inventory::InventorySnapshot) {
        for f in [&self.utilization, &self.memory_used, &self.temperature] {
            f.clear();
        }
        for gpu in &snap.gpus {
            let labels = vec![
                ("gpu".to_string(), gpu.uuid.clone()),
                ("model".to_string(), gpu.name.clone()),
            ];
            self.utilization
                .get_or_create(&labels)
                .set(gpu.utilization_percent as i64);
            self.memory_used
                .get_or_create(&labels)
                .set(gpu.memory_used_bytes as i64);
            if let Some(t) = gpu.temperature_c {
                self.temperature.get_or_create(&labels).set(t as i64);
            }
        }
    }

    /// Sets the per-job gauges from the running jobs (ended jobs disappear).
    pub fn observe_jobs(&self, jobs: &[crate::jobs::RunningJobView]) {
        for f in [
            &self.job_utilization,
            &self.job_memory_peak,
            &self.job_gpu_seconds,
        ] {
            f.clear();
        }
        for job in jobs {
            let Some(gpu) = job.gpu else { continue };
            let labels = vec![
                ("lease".to_string(), job.lease_id.clone()),
                ("job".to_string(), job.job.clone()),
            ];
            self.job_utilization
                .get_or_create(&labels)
                .set(gpu.utilization_percent as i64);
            self.job_memory_peak
                .get_or_create(&labels)
                .set(gpu.peak_memory_bytes as i64);
            self.job_gpu_seconds
                .get_or_create(&labels)
                .set((gpu.gpu_ms / 1000) as i64);
        }
    }
}
