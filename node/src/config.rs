//! Node configuration: the TOML file, its defaults, and the checks that turn it into
//! settings the node can start with.
//!
//! Every option has a default, so `gpunode serve` runs with no file at all. An unknown
//! key or a value of the wrong type is an error that names the key and its line (the
//! TOML parser reports the span). Command-line flags are applied on top by the CLI.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gpunode_protocol::units::{parse_bytes, parse_duration};
use libp2p::{Multiaddr, PeerId};
use serde::{Deserialize, Deserializer};

/// Default port for TCP and QUIC.
pub const DEFAULT_PORT: u16 = 4170;
/// Port of the web dashboard on 127.0.0.1.
pub const DEFAULT_DASHBOARD_PORT: u16 = 4171;

/// Why configuration could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The config file is not valid (unknown key, wrong type, bad value).
    #[error("invalid config file {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message, naming key and line.
        message: String,
    },
    /// A value given on the command line or in the file is invalid.
    #[error("{0}")]
    Invalid(String),
}

/// Everything a node can be configured with. Field names are the TOML keys.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct NodeConfig {
    /// Addresses to listen on (QUIC and TCP multiaddrs).
    #[serde(deserialize_with = "de_multiaddrs")]
    pub listen: Vec<Multiaddr>,
    /// Peers to connect to at start, and again every 10 s while the node has no
    /// connection, as multiaddrs (with `/p2p/PEER_ID` where known).
    #[serde(deserialize_with = "de_multiaddrs")]
    pub bootstrap: Vec<Multiaddr>,
    /// Find peers on the local network by mDNS.
    pub mdns: bool,
    /// Serve simulated GPUs instead of real ones, e.g. `2xA100-80GB,1xT4-16GB`.
    pub simulate_gpus: Option<String>,
    /// Executors offered to peers.
    pub backends: Vec<String>,
    /// Price per GPU-hour in credits.
    pub price_per_gpu_hour: f64,
    /// CPU cores offered (default: all of this machine's).
    pub cpu_cores: Option<u32>,
    /// RAM offered, e.g. `16G` (default: all of this machine's).
    #[serde(deserialize_with = "de_opt_bytes")]
    pub ram: Option<u64>,
    /// How long an advert is valid; it is re-published at half this.
    #[serde(deserialize_with = "de_duration")]
    pub advert_ttl: Duration,
    /// How often the GPU inventory is polled for changes.
    #[serde(deserialize_with = "de_duration")]
    pub inventory_poll: Duration,
    /// Idle connections are closed after this long.
    #[serde(deserialize_with = "de_duration")]
    pub idle_connection_timeout: Duration,
    /// Also serve `/metrics` (Prometheus) on this localhost TCP address.
    pub metrics_addr: Option<SocketAddr>,
    /// Serve the read-only web dashboard (`gpunode dashboard` prints its URL).
    pub dashboard: bool,
    /// Where the dashboard listens: a loopback address (it has no login). Port 0 picks
    /// a free port.
    pub dashboard_addr: SocketAddr,
    /// How often the GPU history the dashboard plots takes a sample (1 s to 60 s).
    #[serde(deserialize_with = "de_duration")]
    pub history_step: Duration,
    /// Log filter (`info`, `debug`, `gpunode_node=debug`, ...).
    pub log: String,
    /// Longest lease this node grants, renewals included.
    #[serde(deserialize_with = "de_duration")]
    pub max_lease_duration: Duration,
    /// How long an offer holds resources waiting for the requester's accept.
    #[serde(deserialize_with = "de_duration")]
    pub offer_window: Duration,
    /// Most GPUs one peer may hold at once (default: half of this machine's GPUs, at
    /// least one, outside a team; no cap inside a team, whose quotas apply).
    pub max_gpus_per_peer: Option<u32>,
    /// When not empty, only these peer ids may lease.
    #[serde(deserialize_with = "de_peers")]
    pub allow_peers: Vec<PeerId>,
    /// These peer ids may never lease.
    #[serde(deserialize_with = "de_peers")]
    pub deny_peers: Vec<PeerId>,
    /// Disk kept for cached task modules and input files, e.g. `10G`.
    #[serde(deserialize_with = "de_bytes")]
    pub blob_cache: u64,
    /// Largest module plus inputs, and largest outputs, of one job, e.g. `4G`.
    #[serde(deserialize_with = "de_bytes")]
    pub max_job_bytes: u64,
    /// Credits a peer may use here before it has given anything back (mutual credit).
    pub allowance: f64,
    /// How far past its allowance a peer may go into debt here before it is refused.
    pub debt_limit: f64,
    /// Peers whose reputation here is below this (0 to 1; unknown peers are 0.5) are
    /// refused leases.
    pub min_reputation: f64,
    /// Whether container jobs may run on this machine's own system software, read-only
    /// (`gpunode run --host-env`): for teams whose machines already carry CUDA and
    /// PyTorch. Off by default; image jobs are always allowed on `container`.
    pub allow_host_env: bool,
    /// Largest unpacked container image, e.g. `32G`.
    #[serde(deserialize_with = "de_bytes")]
    pub max_image_bytes: u64,
    /// What happens to jobs on a GPU its owner starts using: `yield` (stop them after
    /// `owner_grace`, charge the time used, the requester retries elsewhere), `share`
    /// (keep running) or `suspend` (pause until the owner leaves).
    pub owner_policy: crate::owner::OwnerPolicy,
    /// How this provider orders lease requests waiting for GPUs: `fair` (team priority,
    /// fair share, short jobs first, with backfill; see docs/scheduling.md), `fcfs`
    /// (first come, first served, nobody passes) or `easy` (first come, first served with
    /// EASY backfill: the benchmarks' baseline).
    pub queue_order: QueueOrder,
    /// How long jobs may go on beside the owner before `yield` stops them.
    #[serde(deserialize_with = "de_duration")]
    pub owner_grace: Duration,
    /// When the GPUs are lent, e.g. `["mon-fri 19:00-08:00", "sat-sun"]`; empty means
    /// always. Outside them nothing is advertised and no lease runs past their end.
    pub lend: Vec<String>,
    /// The time zone of `lend`, as an offset from UTC like `+01:00`.
    pub lend_utc_offset: String,
    /// How much of each GPU's memory may be lent: `50%` or `40G` (default: all).
    pub lend_gpu_memory: Option<String>,
    /// Alert when a GPU reaches this temperature, °C (0: never).
    pub alert_temperature_c: u32,
    /// Alert when a GPU has this share of its memory in use, percent (0: never).
    pub alert_memory_percent: u32,
    /// Alert when a leased GPU stays at 0% use this long (0s: never).
    #[serde(deserialize_with = "de_duration")]
    pub alert_idle_leased_after: Duration,
    /// Alert on new uncorrected ECC errors.
    pub alert_ecc: bool,
    /// Command run (`sh -c`) for each alert, with `GPUNODE_ALERT_KIND`,
    /// `GPUNODE_ALERT_GPU` and `GPUNODE_ALERT_MESSAGE` set.
    pub alert_hook: Option<String>,
    /// Pre-shared key (64 hex digits) for TCP connections (libp2p pnet): nodes without
    /// it cannot even complete a TCP handshake. QUIC cannot use it.
    pub team_psk: Option<String>,
    /// Outside a team, how many new peer ids a day may draw on `allowance` here; each
    /// next one gets a smaller share, so ids made by the thousand draw at most about
    /// `allowance × this / 2` a day (0: no limit).
    pub new_peers_on_credit_per_day: u32,
    /// How long ended leases are kept in the store (offers that expired unsigned: an
    /// hour at most).
    #[serde(deserialize_with = "de_duration")]
    pub lease_retention: Duration,
    /// Most connections open at once, all peers together.
    pub max_connections: u32,
    /// Most connections one peer may have open.
    pub max_connections_per_peer: u32,
    /// Most inbound connections from one IP address (0: no limit; a test network on
    /// one machine needs that).
    pub max_connections_per_ip: u32,
    /// Most inbound connections still in their handshake.
    pub max_pending_connections: u32,
    /// In a team: relay for members even before AutoNAT confirms a public address (set
    /// it on a box whose port is forwarded). Members with a confirmed public address
    /// relay anyway; outsiders never get a reservation or a circuit.
    pub relay: bool,
    /// Longest one relayed connection lasts on this relay.
    #[serde(deserialize_with = "de_duration")]
    pub relay_circuit_duration: Duration,
    /// Most bytes one relayed connection carries on this relay (each way), e.g. `1G`.
    #[serde(deserialize_with = "de_bytes")]
    pub relay_circuit_bytes: u64,
    /// Most relayed connections through this node at once.
    pub relay_max_circuits: u32,
    /// Most members holding a reservation on this node at once.
    pub relay_max_reservations: u32,
    /// Send job inputs and outputs through a team relay when hole punching fails (off:
    /// such providers are refused with the reason, and directly reached ones preferred).
    pub allow_relayed_data: bool,
    /// Ask the router to forward the listening port (UPnP IGD) where it offers that. On by
    /// default, except in a team that asks for TCP only and a pre-shared key (it wants
    /// to stay invisible); set it to say either way.
    pub upnp: Option<bool>,
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            listen: vec![
                format!("/ip4/0.0.0.0/udp/{DEFAULT_PORT}/quic-v1")
                    .parse()
                    .expect("valid default"),
                format!("/ip4/0.0.0.0/tcp/{DEFAULT_PORT}")
                    .parse()
                    .expect("valid default"),
            ],
            bootstrap: Vec::new(),
            mdns: true,
            simulate_gpus: None,
            backends: vec!["wasm".to_string()],
            allow_host_env: false,
            max_image_bytes: 32 << 30,
            owner_policy: crate::owner::OwnerPolicy::Yield,
            queue_order: QueueOrder::Fair,
            owner_grace: Duration::from_secs(10),
            lend: Vec::new(),
            lend_utc_offset: "+00:00".to_string(),
            lend_gpu_memory: None,
            alert_temperature_c: 85,
            alert_memory_percent: 95,
            alert_idle_leased_after: Duration::from_secs(600),
            alert_ecc: true,
            alert_hook: None,
            price_per_gpu_hour: 1.0,
            cpu_cores: None,
            ram: None,
            advert_ttl: Duration::from_secs(600),
            inventory_poll: Duration::from_secs(2),
            idle_connection_timeout: Duration::from_secs(120),
            metrics_addr: None,
            dashboard: true,
            dashboard_addr: SocketAddr::from(([127, 0, 0, 1], DEFAULT_DASHBOARD_PORT)),
            history_step: Duration::from_secs(10),
            log: "info".to_string(),
            max_lease_duration: Duration::from_secs(24 * 3600),
            offer_window: Duration::from_secs(10),
            max_gpus_per_peer: None,
            allow_peers: Vec::new(),
            deny_peers: Vec::new(),
            blob_cache: 10 << 30,
            max_job_bytes: 4 << 30,
            allowance: 100.0,
            debt_limit: 0.0,
            min_reputation: 0.2,
            team_psk: None,
            new_peers_on_credit_per_day: crate::ledger::newcomers::DEFAULT_NEW_PEERS_PER_DAY,
            lease_retention: Duration::from_secs(30 * 86_400),
            max_connections: 1024,
            max_connections_per_peer: 8,
            max_connections_per_ip: 64,
            max_pending_connections: 128,
            relay: false,
            relay_circuit_duration: Duration::from_secs(3600),
            relay_circuit_bytes: 1 << 30,
            relay_max_circuits: 16,
            relay_max_reservations: 32,
            allow_relayed_data: false,
            upnp: None,
        }
    }
}

impl NodeConfig {
    /// The alert thresholds and hook.
    pub fn alert_rules(&self) -> crate::alerts::AlertRules {
        crate::alerts::AlertRules {
            temperature_c: Some(self.alert_temperature_c).filter(|t| *t > 0),
            memory_percent: Some(self.alert_memory_percent).filter(|p| *p > 0),
            idle_leased_after: Some(self.alert_idle_leased_after).filter(|d| !d.is_zero()),
            ecc: self.alert_ecc,
            hook: self.alert_hook.clone().filter(|h| !h.trim().is_empty()),
        }
    }

    /// The owner's lending hours and memory cap, from `lend`, `lend_utc_offset` and
    /// `lend_gpu_memory`.
    pub fn owner_rules(&self) -> Result<crate::owner::OwnerRules, String> {
        Ok(crate::owner::OwnerRules {
            hours: crate::owner::LendingHours::parse(&self.lend, &self.lend_utc_offset)?,
            memory_cap: self
                .lend_gpu_memory
                .as_deref()
                .map(crate::owner::MemoryCap::parse)
                .transpose()?,
        })
    }

    /// Reads a config file. A missing file at the default location is not an error
    /// (`required = false`); a missing file the user named is.
    pub fn load(path: &Path, required: bool) -> Result<NodeConfig, ConfigError> {
        match std::fs::read_to_string(path) {
            Ok(text) => NodeConfig::parse(&text).map_err(|message| ConfigError::Parse {
                path: path.to_path_buf(),
                message,
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !required => {
                Ok(NodeConfig::default())
            }
            Err(source) => Err(ConfigError::Read {
                path: path.to_path_buf(),
                source,
            }),
        }
    }

    /// Parses config text; the error names the key and line.
    pub fn parse(text: &str) -> Result<NodeConfig, String> {
        let config: NodeConfig = toml::from_str(text).map_err(|e| e.to_string())?;
        config.validate().map_err(|e| e.to_string())?;
        Ok(config)
    }

    /// The TCP pre-shared key, if set.
    pub fn tcp_psk(&self) -> Result<Option<[u8; 32]>, ConfigError> {
        let Some(text) = &self.team_psk else {
            return Ok(None);
        };
        let t = text.trim();
        if t.len() != 64 || !t.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(ConfigError::Invalid(
                "team_psk must be 64 hex digits (32 random bytes, e.g. from `openssl rand -hex 32`)"
                    .into(),
            ));
        }
        let mut key = [0u8; 32];
        for (i, pair) in t.as_bytes().chunks(2).enumerate() {
            let hex = std::str::from_utf8(pair).unwrap_or("00");
            key[i] = u8::from_str_radix(hex, 16).unwrap_or(0);
        }
        Ok(Some(key))
    }

    /// Checks values that the types alone do not.
    ///
    /// Long as one flat list on purpose: one independent check per key, in the order of
    /// the keys, each with its own message; splitting it would only scatter them.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.tcp_psk()?;
        if !(self.price_per_gpu_hour.is_finite() && self.price_per_gpu_hour >= 0.0) {
            return Err(ConfigError::Invalid(format!(
                "price_per_gpu_hour must be a non-negative number of credits, not {}",
                self.price_per_gpu_hour
            )));
        }
        if self.advert_ttl < Duration::from_secs(1) || self.advert_ttl > Duration::from_secs(86_400)
        {
            return Err(ConfigError::Invalid(
                "advert_ttl must be between 1s and 24h".to_string(),
            ));
        }
        if self.offer_window < Duration::from_millis(100)
            || self.offer_window > Duration::from_secs(600)
        {
            return Err(ConfigError::Invalid(
                "offer_window must be between 100ms and 10m".to_string(),
            ));
        }
        if self.max_lease_duration < Duration::from_secs(1) {
            return Err(ConfigError::Invalid(
                "max_lease_duration must be at least 1s".to_string(),
            ));
        }
        if self.inventory_poll < Duration::from_millis(10) {
            return Err(ConfigError::Invalid(
                "inventory_poll must be at least 10ms".to_string(),
            ));
        }
        if self.max_job_bytes < 1 << 20 {
            return Err(ConfigError::Invalid(
                "max_job_bytes must be at least 1M (module plus inputs of one job)".to_string(),
            ));
        }
        if self.blob_cache < self.max_job_bytes {
            return Err(ConfigError::Invalid(format!(
                "blob_cache ({} bytes) must be at least max_job_bytes ({} bytes): a job's inputs are kept there while it runs",
                self.blob_cache, self.max_job_bytes
            )));
        }
        for (name, v) in [
            ("allowance", self.allowance),
            ("debt_limit", self.debt_limit),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(ConfigError::Invalid(format!(
                    "{name} must be a non-negative number of credits, not {v}"
                )));
            }
        }
        if !(0.0..=1.0).contains(&self.min_reputation) {
            return Err(ConfigError::Invalid(format!(
                "min_reputation must be between 0 and 1 (unknown peers score 0.5), not {}",
                self.min_reputation
            )));
        }
        if let Some(spec) = &self.simulate_gpus {
            crate::inventory::SimulatedGpus::parse_spec(spec)
                .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        }
        self.owner_rules().map_err(ConfigError::Invalid)?;
        if self.alert_memory_percent > 100 {
            return Err(ConfigError::Invalid(format!(
                "alert_memory_percent must be 0 (off) to 100, not {}",
                self.alert_memory_percent
            )));
        }
        for b in &self.backends {
            if !KNOWN_BACKENDS.contains(&b.as_str()) {
                return Err(ConfigError::Invalid(format!(
                    "unknown backend '{b}': choose from {}",
                    KNOWN_BACKENDS.join(", ")
                )));
            }
        }
        self.validate_relay()?;
        if !self.dashboard_addr.ip().is_loopback() {
            return Err(ConfigError::Invalid(format!(
                "dashboard_addr {} is not a loopback address: the dashboard has no login, so it \
                 only listens on this machine; use 127.0.0.1:PORT (and an SSH tunnel to see it \
                 from elsewhere)",
                self.dashboard_addr
            )));
        }
        if self.history_step < Duration::from_secs(1) || self.history_step > Duration::from_secs(60)
        {
            return Err(ConfigError::Invalid(format!(
                "history_step {:?} is out of range: use 1s to 60s",
                self.history_step
            )));
        }
        if let Some(addr) = self.metrics_addr {
            if !addr.ip().is_loopback() {
                return Err(ConfigError::Invalid(format!(
                    "metrics_addr {addr} is not a loopback address; use 127.0.0.1:PORT"
                )));
            }
        }
        Ok(())
    }
}

impl NodeConfig {
    /// Whether to ask the router for a port mapping: as set, else on unless the team
    /// listens on TCP only behind a pre-shared key.
    pub fn upnp_wanted(&self) -> bool {
        self.upnp.unwrap_or_else(|| {
            let tcp_only = self.listen.iter().all(|a| {
                !a.iter().any(|p| {
                    matches!(
                        p,
                        libp2p::multiaddr::Protocol::QuicV1 | libp2p::multiaddr::Protocol::Udp(_)
                    )
                })
            });
            !(self.team_psk.is_some() && tcp_only)
        })
    }

    /// The team relay's budget: circuits that last and carry job data, within bounds.
    fn validate_relay(&self) -> Result<(), ConfigError> {
        let d = self.relay_circuit_duration;
        if d < Duration::from_secs(60) || d > Duration::from_secs(7 * 86_400) {
            return Err(ConfigError::Invalid(format!(
                "relay_circuit_duration must be between 1m and 7d, not {}s",
                d.as_secs()
            )));
        }
        if self.relay_circuit_bytes < 1 << 20 {
            return Err(ConfigError::Invalid(
                "relay_circuit_bytes must be at least 1M (a job's data goes through it)"
                    .to_string(),
            ));
        }
        for (name, v, max) in [
            ("relay_max_circuits", self.relay_max_circuits, 1024),
            ("relay_max_reservations", self.relay_max_reservations, 4096),
        ] {
            if v == 0 || v > max {
                return Err(ConfigError::Invalid(format!(
                    "{name} must be between 1 and {max}, not {v}"
                )));
            }
        }
        Ok(())
    }
}

/// Backends a node may offer.
pub const KNOWN_BACKENDS: &[&str] = &["wasm", "container"];

/// Parses a multiaddr given by a user, with an error that says what a good one looks like.
pub fn parse_multiaddr(what: &str, text: &str) -> Result<Multiaddr, ConfigError> {
    let addr: Multiaddr = text.trim().parse().map_err(|e| {
        ConfigError::Invalid(format!(
            "invalid {what} address '{text}': {e}; expected a multiaddr such as \
             /ip4/127.0.0.1/udp/{DEFAULT_PORT}/quic-v1 or /ip4/127.0.0.1/tcp/{DEFAULT_PORT}/p2p/12D3KooW..."
        ))
    })?;
    if addr.is_empty() {
        return Err(ConfigError::Invalid(format!(
            "invalid {what} address '{text}': it is empty"
        )));
    }
    Ok(addr)
}

fn de_multiaddrs<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Multiaddr>, D::Error> {
    let texts = Vec::<String>::deserialize(d)?;
    texts
        .iter()
        .map(|t| parse_multiaddr("", t).map_err(serde::de::Error::custom))
        .collect()
}

fn de_peers<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<PeerId>, D::Error> {
    let texts = Vec::<String>::deserialize(d)?;
    texts
        .iter()
        .map(|t| {
            t.trim().parse::<PeerId>().map_err(|_| {
                serde::de::Error::custom(format!(
                    "'{t}' is not a peer id (as `gpunode id` prints, 12D3KooW...)"
                ))
            })
        })
        .collect()
}

fn de_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(d)?;
    parse_duration(&text).map_err(serde::de::Error::custom)
}

fn de_opt_bytes<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    let text = String::deserialize(d)?;
    parse_bytes(&text)
        .map(Some)
        .map_err(serde::de::Error::custom)
}

fn de_bytes<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    let text = String::deserialize(d)?;
    parse_bytes(&text).map_err(serde::de::Error::custom)
}

/// The order a provider serves waiting lease requests in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum QueueOrder {
    /// Policy order with backfill (the default).
    #[default]
    Fair,
    /// First come, first served.
    Fcfs,
    /// First come, first served with EASY backfill (the benchmarks' baseline).
    Easy,
}

impl From<QueueOrder> for gpunode_sched::Order {
    fn from(o: QueueOrder) -> gpunode_sched::Order {
        match o {
            QueueOrder::Fair => gpunode_sched::Order::Fair,
            QueueOrder::Fcfs => gpunode_sched::Order::Fcfs,
            QueueOrder::Easy => gpunode_sched::Order::Easy,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_gives_defaults() {
        assert_eq!(NodeConfig::parse(""), Ok(NodeConfig::default()));
    }

    #[test]
    fn example_config_parses_and_matches_documented_values() {
        let text = include_str!("../../example.config.toml");
        let config = NodeConfig::parse(text).expect("example.config.toml must parse");
        assert_eq!(config.advert_ttl, Duration::from_secs(600));
        assert!(config.mdns);
        assert_eq!(config.relay_circuit_bytes, 1 << 30);
        assert_eq!(config.relay_circuit_duration, Duration::from_secs(3600));
    }

    #[test]
    fn upnp_is_on_unless_a_psk_team_listens_on_tcp_only() {
        assert!(NodeConfig::default().upnp_wanted());
        let psk = format!("team_psk = \"{}\"\n", "ab".repeat(32));
        let tcp_only = "listen = [\"/ip4/0.0.0.0/tcp/4170\"]\n";
        let hidden = NodeConfig::parse(&format!("{psk}{tcp_only}")).expect("parse");
        assert!(!hidden.upnp_wanted());
        // A PSK with QUIC still listening, or TCP only without a PSK: the default holds.
        assert!(NodeConfig::parse(&psk).expect("parse").upnp_wanted());
        assert!(NodeConfig::parse(tcp_only).expect("parse").upnp_wanted());
        // Set, it is obeyed either way.
        let forced = NodeConfig::parse(&format!("{psk}{tcp_only}upnp = true\n")).expect("parse");
        assert!(forced.upnp_wanted());
        assert!(!NodeConfig::parse("upnp = false\n")
            .expect("parse")
            .upnp_wanted());
    }

    #[test]
    fn unknown_key_names_key_and_line() {
        let err = NodeConfig::parse("mdns = true\nfrobnicate = 3\n").unwrap_err();
        assert!(err.contains("frobnicate"), "{err}");
        assert!(err.contains("line 2"), "{err}");
    }

    #[test]
    fn wrong_type_names_key_and_line() {
        let err = NodeConfig::parse("\n\nmdns = \"yes\"\n").unwrap_err();
        assert!(err.contains("line 3"), "{err}");
        assert!(err.contains("mdns") || err.contains("boolean"), "{err}");
        let err = NodeConfig::parse("advert_ttl = \"ten minutes\"\n").unwrap_err();
        assert!(err.contains("line 1") && err.contains("duration"), "{err}");
    }

    #[test]
    fn bad_values_are_refused() {
        assert!(NodeConfig::parse("bootstrap = [\"not-an-addr\"]")
            .unwrap_err()
            .contains("multiaddr"));
        assert!(NodeConfig::parse("simulate_gpus = \"2xA100\"")
            .unwrap_err()
            .contains("memory"));
        for (bad, says) in [
            ("lend = [\"weekends\"]", "lend entry 'weekends'"),
            ("lend_utc_offset = \"CET\"", "utc_offset 'CET'"),
            ("lend_gpu_memory = \"120%\"", "lend_gpu_memory"),
            ("owner_policy = \"ignore\"", "owner_policy"),
            ("queue_order = \"random\"", "queue_order"),
            (
                "dashboard_addr = \"0.0.0.0:4171\"",
                "not a loopback address",
            ),
            ("dashboard_addr = \"localhost\"", "dashboard_addr"),
            ("dashboard = \"off\"", "dashboard"),
            ("history_step = \"100ms\"", "history_step"),
            ("history_step = \"1h\"", "history_step"),
        ] {
            let err = NodeConfig::parse(bad).expect_err(bad).to_string();
            assert!(err.contains(says), "{bad}: {err}");
        }
        assert!(NodeConfig::parse("backends = [\"docker\"]")
            .unwrap_err()
            .contains("unknown backend"));
        assert!(NodeConfig::parse("price_per_gpu_hour = -1.0").is_err());
        assert!(NodeConfig::parse("metrics_addr = \"0.0.0.0:9000\"").is_err());
        assert!(NodeConfig::parse("deny_peers = [\"bob\"]")
            .unwrap_err()
            .contains("peer id"));
        assert!(NodeConfig::parse("offer_window = \"1h\"").is_err());
        assert!(NodeConfig::parse("allowance = -5.0")
            .unwrap_err()
            .contains("allowance"));
        assert!(NodeConfig::parse("debt_limit = nan")
            .unwrap_err()
            .contains("debt_limit"));
        assert!(NodeConfig::parse("team_psk = \"abc\"")
            .unwrap_err()
            .contains("64 hex"));
        assert!(NodeConfig::parse("min_reputation = 2.0")
            .unwrap_err()
            .contains("min_reputation"));
        assert!(NodeConfig::parse("max_job_bytes = \"10\"")
            .unwrap_err()
            .contains("max_job_bytes"));
        assert!(NodeConfig::parse("blob_cache = \"lots\"")
            .unwrap_err()
            .contains("blob_cache"));
        assert!(
            NodeConfig::parse("blob_cache = \"1M\"\nmax_job_bytes = \"2M\"")
                .unwrap_err()
                .contains("blob_cache")
        );
    }

    #[test]
    fn missing_optional_file_is_default_but_named_file_is_required() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("nope.toml");
        assert!(NodeConfig::load(&path, false).is_ok());
        assert!(matches!(
            NodeConfig::load(&path, true),
            Err(ConfigError::Read { .. })
        ));
    }
}
