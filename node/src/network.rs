//! The libp2p side of a node: which protocols it speaks and how its swarm is built.
//!
//! QUIC (quinn) first, TCP + noise + yamux as fallback; identify and ping so any
//! standard libp2p peer can talk to us; Kademlia under gpunode's own protocol name (never
//! the public IPFS DHT) with inbound records filtered through the advert book; mDNS on
//! the LAN when enabled. For members behind NAT: AutoNAT v2 (client and server), circuit
//! relay v2 (a client on every node; a server for the team only, see [`RelaySettings`]),
//! DCUtR hole punching, and UPnP port mapping when enabled.

#![allow(missing_docs)] // the NetworkBehaviour derive generates an undocumented event enum

use std::num::NonZeroU32;
use std::time::Duration;

use gpunode_protocol::advert::MAX_SIGNED_ADVERT_BYTES;
use libp2p::identity::Keypair;
use libp2p::kad::store::MemoryStoreConfig;
use libp2p::swarm::behaviour::toggle::Toggle;
use libp2p::swarm::NetworkBehaviour;
use libp2p::{
    allow_block_list, autonat, dcutr, identify, kad, mdns, noise, ping, relay, request_response,
    tcp, upnp, yamux, PeerId, StreamProtocol, Swarm,
};
use std::collections::HashSet;

use crate::lease::codec::{lease_behaviour, LeaseCodec};

/// Kademlia protocol name of the public gpunode network.
pub const KAD_PROTOCOL: StreamProtocol = StreamProtocol::new("/gpunode/kad/1.0.0");
/// Identify protocol version string.
pub const IDENTIFY_PROTOCOL_VERSION: &str = "/gpunode/1.0.0";
/// How long one Kademlia query may run in all (walk and store).
const KAD_QUERY_TIMEOUT: Duration = Duration::from_secs(30);
/// Most providers one Kademlia answer names (libp2p's own is k = 20). An answer from a
/// node of this build naming fewer than this many named every provider it holds for
/// the key, or for every shard of a shared key (`crate::dht_store`): in a network of a
/// few dozen nodes one answer then covers the whole key. It is as many as a query asks
/// at most (`event_loop::finds::MAX_PROVIDERS_PER_FIND`). Each provider travels with at
/// most `dht_store::MAX_PROVIDER_ADDRESS_BYTES` of addresses, so a full answer stays
/// well under the 64 KiB packet limit set below.
pub(crate) const PROVIDER_ANSWER_LIMIT: usize = 64;
/// How often each connection is pinged (its first ping goes out on connect). The RTT
/// only ranks offers and shows in `status`; QUIC's own keep-alive keeps a connection up.
/// libp2p's default, 15 s, made pings the largest idle load of a 200-node test network
/// (about 5,300 ping streams a second over its 40,000 connections).
const PING_EVERY: Duration = Duration::from_secs(60);

/// Whether a request-response message failed because the peer does not serve its
/// protocol. For a protocol negotiated lazily (see [`negotiate_lazily`]) that shows as
/// an I/O error carrying multistream-select's negotiation error, not as
/// `UnsupportedProtocols`. Either way it is no failure of the connection, and sending
/// again would be refused again.
pub fn refused_protocol(error: &request_response::OutboundFailure) -> bool {
    match error {
        request_response::OutboundFailure::UnsupportedProtocols => true,
        request_response::OutboundFailure::Io(e) => e
            .get_ref()
            .is_some_and(|inner| inner.is::<multistream_select::NegotiationError>()),
        _ => false,
    }
}

/// Makes this process open streams of `protocol` lazily: the first message leaves right
/// behind the stream's protocol proposal instead of a round trip later, when the
/// listener has confirmed the protocol (multistream-select's `V1Lazy`, which every
/// listener understands; the vendored crate's change, see vendor/README.md). Closing
/// such a stream waits for the confirmation, so a message sent without an answer
/// (Kademlia's `ADD_PROVIDER`) is not lost. Used for Kademlia, the advert fetch and the
/// lease protocol: each opens a stream per message, and lookups and leases wait on them.
pub fn negotiate_lazily(protocol: &StreamProtocol) {
    multistream_select::negotiate_lazily(protocol.as_ref());
}

/// Why the swarm could not be built.
#[derive(Debug, thiserror::Error)]
#[error("cannot set up networking: {0}")]
pub struct NetworkSetupError(String);

/// All protocols a node runs.
#[derive(NetworkBehaviour)]
pub struct NodeBehaviour {
    /// Totals, pending and per-peer connection limits.
    pub limits: libp2p::connection_limits::Behaviour,
    /// Inbound connections per remote IP address.
    pub per_ip: crate::inbound::IpLimit,
    /// In a team: only members (and open invites' join identities) may connect; anyone
    /// else is dropped right after the handshake, before any other protocol runs.
    pub allow: Toggle<allow_block_list::Behaviour<allow_block_list::AllowedPeers>>,
    /// Peer and record routing.
    pub kad: kad::Behaviour<crate::dht_store::DhtStore>,
    /// Exchange of listen addresses and protocols.
    pub identify: identify::Behaviour,
    /// Liveness.
    pub ping: ping::Behaviour,
    /// LAN discovery, when enabled.
    pub mdns: Toggle<mdns::tokio::Behaviour>,
    /// Lease negotiation.
    pub lease: request_response::Behaviour<LeaseCodec>,
    /// Direct advert fetches (answering ours, asking others').
    pub advert: request_response::Behaviour<crate::adverts::fetch::AdvertCodec>,
    /// Raw streams (the job protocol), driven from outside the event loop.
    pub stream: libp2p_stream::Behaviour,
    /// Reservations on and circuits through other members' relays.
    pub relay_client: relay::client::Behaviour,
    /// In a team: relaying for members (the allow-list keeps strangers out before this
    /// sees them).
    pub relay: Toggle<relay::Behaviour>,
    /// Hole punching over a relayed connection.
    pub dcutr: dcutr::Behaviour,
    /// Asks peers to dial our candidate addresses back (is this node reachable?).
    pub autonat: autonat::v2::client::Behaviour,
    /// Dials other peers' candidate addresses back for them.
    pub autonat_server: autonat::v2::server::Behaviour,
    /// Port mapping on a UPnP router, when enabled.
    pub upnp: Toggle<upnp::tokio::Behaviour>,
}

/// How a node relays for its team, and within which budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelaySettings {
    /// Relay even before AutoNAT confirms a public address (a port-forwarded box).
    pub always: bool,
    /// Longest one relayed connection lasts.
    pub circuit_duration: Duration,
    /// Most bytes one relayed connection carries (each way).
    pub circuit_bytes: u64,
    /// Most relayed connections at once.
    pub max_circuits: u32,
    /// Most members holding a reservation at once.
    pub max_reservations: u32,
}

impl Default for RelaySettings {
    fn default() -> Self {
        RelaySettings {
            always: false,
            circuit_duration: Duration::from_secs(3600),
            circuit_bytes: 1 << 30,
            max_circuits: 16,
            max_reservations: 32,
        }
    }
}

/// Settings the swarm is built from.
#[derive(Debug, Clone)]
pub struct SwarmSettings {
    /// Enable mDNS.
    pub mdns: bool,
    /// Close idle connections after this long.
    pub idle_connection_timeout: Duration,
    /// Lifetime of provider records we store for others.
    pub provider_record_ttl: Duration,
    /// Kademlia server mode (answers queries, stores records) or client only.
    pub server: bool,
    /// A private team: its id (names its Kademlia protocol) and the peers allowed now.
    pub team: Option<(gpunode_protocol::team::TeamId, HashSet<PeerId>)>,
    /// Pre-shared key for TCP (libp2p pnet), when set.
    pub tcp_psk: Option<[u8; 32]>,
    /// Connection limits.
    pub limits: ConnectionCaps,
    /// Relaying for the team (used only in a team).
    pub relay: RelaySettings,
    /// Map ports on a UPnP router.
    pub upnp: bool,
}

/// How many connections a node holds open, so that no peer or host can exhaust it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionCaps {
    /// All peers together.
    pub total: u32,
    /// One peer.
    pub per_peer: u32,
    /// Inbound from one IP address (0: no limit).
    pub per_ip: u32,
    /// Inbound connections still in their handshake.
    pub pending_incoming: u32,
}

impl Default for ConnectionCaps {
    fn default() -> Self {
        ConnectionCaps {
            total: 1024,
            per_peer: 8,
            per_ip: 64,
            pending_incoming: 128,
        }
    }
}

/// Builds the swarm for `key` with every protocol configured.
pub fn build_swarm(
    key: Keypair,
    settings: &SwarmSettings,
) -> Result<Swarm<NodeBehaviour>, NetworkSetupError> {
    let err = |e: &dyn std::fmt::Display| NetworkSetupError(e.to_string());
    let idle = settings.idle_connection_timeout;
    let swarm = match settings.tcp_psk {
        None => libp2p::SwarmBuilder::with_existing_identity(key)
            .with_tokio()
            .with_tcp(
                tcp::Config::default().nodelay(true),
                noise::Config::new,
                yamux::Config::default,
            )
            .map_err(|e| err(&e))?
            .with_quic()
            .with_relay_client(noise::Config::new, yamux::Config::default)
            .map_err(|e| err(&e))?
            .with_behaviour(|key, relay_client| behaviour(key, relay_client, settings))
            .map_err(|e| err(&e))?
            .with_swarm_config(|c| c.with_idle_connection_timeout(idle))
            .build(),
        // TCP behind a pre-shared key (pnet): a port scanner without the key sees only
        // noise. QUIC cannot carry pnet; it stays, guarded by the team allow-list.
        Some(psk) => libp2p::SwarmBuilder::with_existing_identity(key)
            .with_tokio()
            .with_quic()
            .with_other_transport(|key| {
                use libp2p::core::transport::Transport as _;
                let noise = noise::Config::new(key)?;
                let psk = libp2p::pnet::PreSharedKey::new(psk);
                Ok(
                    tcp::tokio::Transport::new(tcp::Config::default().nodelay(true))
                        .and_then(move |socket, _| {
                            libp2p::pnet::PnetConfig::new(psk).handshake(socket)
                        })
                        .upgrade(libp2p::core::upgrade::Version::V1Lazy)
                        .authenticate(noise)
                        .multiplex(yamux::Config::default())
                        .timeout(Duration::from_secs(20)),
                )
            })
            .map_err(|e| err(&e))?
            .with_relay_client(noise::Config::new, yamux::Config::default)
            .map_err(|e| err(&e))?
            .with_behaviour(|key, relay_client| behaviour(key, relay_client, settings))
            .map_err(|e| err(&e))?
            .with_swarm_config(|c| c.with_idle_connection_timeout(idle))
            .build(),
    };
    Ok(swarm)
}

/// Every protocol of a node, configured.
fn behaviour(
    key: &Keypair,
    relay_client: relay::client::Behaviour,
    settings: &SwarmSettings,
) -> Result<NodeBehaviour, Box<dyn std::error::Error + Send + Sync>> {
    let peer_id = key.public().to_peer_id();
    let store = crate::dht_store::DhtStore::new(
        peer_id,
        MemoryStoreConfig {
            max_records: 20_000,
            max_value_bytes: MAX_SIGNED_ADVERT_BYTES,
            max_providers_per_key: 256,
            max_provided_keys: 256,
        },
    );
    let kad_protocol = match &settings.team {
        Some((team, _)) => crate::team::team_protocol(team, "kad"),
        None => KAD_PROTOCOL,
    };
    negotiate_lazily(&kad_protocol);
    let mut kad_config = kad::Config::new(kad_protocol);
    kad_config
        .set_record_filtering(kad::StoreInserts::FilterBoth)
        // Kademlia gives up on an unanswering peer after 10 s, and a walk waits for
        // it; a whole query limited to those same 10 s ends at the first stuck peer,
        // which on a loaded, forming network left provider records unstored. Lookups
        // keep their own, shorter deadline (`event_loop::FIND_TIMEOUT`).
        .set_query_timeout(KAD_QUERY_TIMEOUT)
        .set_caching(kad::Caching::Disabled)
        // The node re-publishes its advert and provider records itself.
        .set_publication_interval(None)
        .set_provider_publication_interval(None)
        .set_provider_record_ttl(Some(settings.provider_record_ttl))
        .set_max_packet_size(64 * 1024)
        .set_provider_answer_limit(
            std::num::NonZeroUsize::new(PROVIDER_ANSWER_LIMIT).expect("nonzero"),
        );
    // A provider lookup stops once the peers nearest the key have answered
    // (`event_loop::finds`): once stalled, it asks no more of them at once than that
    // (`docs/benchmarks.md`, "Where a lookup's time goes now").
    kad_config.set_provider_lookup_burst(
        std::num::NonZeroUsize::new(crate::event_loop::CLOSEST_ANSWERED).expect("nonzero"),
    );
    let mut kad = kad::Behaviour::with_config(peer_id, store, kad_config);
    kad.set_mode(Some(if settings.server {
        kad::Mode::Server
    } else {
        kad::Mode::Client
    }));
    // Peers learn only the addresses the node chooses to advertise (see `crate::nat`),
    // never every local interface.
    let identify = identify::Behaviour::new(
        identify::Config::new(IDENTIFY_PROTOCOL_VERSION.to_string(), key.public())
            .with_agent_version(format!("gpunode/{}", env!("CARGO_PKG_VERSION")))
            .with_hide_listen_addrs(true),
    );
    let mdns = if settings.mdns {
        Some(mdns::tokio::Behaviour::new(
            mdns::Config::default(),
            peer_id,
        )?)
    } else {
        None
    };
    let lease = lease_behaviour();
    let allow = settings.team.as_ref().map(|(_, peers)| {
        let mut allow = allow_block_list::Behaviour::<allow_block_list::AllowedPeers>::default();
        for p in peers {
            allow.allow_peer(*p);
        }
        allow
    });
    let caps = settings.limits;
    let limits = libp2p::connection_limits::Behaviour::new(
        libp2p::connection_limits::ConnectionLimits::default()
            .with_max_established(Some(caps.total))
            .with_max_established_per_peer(Some(caps.per_peer))
            .with_max_pending_incoming(Some(caps.pending_incoming)),
    );
    Ok(NodeBehaviour {
        limits,
        per_ip: crate::inbound::IpLimit::new(caps.per_ip, None),
        allow: Toggle::from(allow),
        kad,
        identify,
        ping: ping::Behaviour::new(ping::Config::new().with_interval(PING_EVERY)),
        mdns: Toggle::from(mdns),
        lease,
        advert: crate::adverts::fetch::behaviour(),
        stream: libp2p_stream::Behaviour::new(),
        relay_client,
        relay: Toggle::from(
            settings
                .team
                .as_ref()
                .map(|_| team_relay(peer_id, &settings.relay)),
        ),
        dcutr: dcutr::Behaviour::new(peer_id),
        autonat: autonat::v2::client::Behaviour::default(),
        autonat_server: autonat::v2::server::Behaviour::default(),
        upnp: Toggle::from(settings.upnp.then(upnp::tokio::Behaviour::default)),
    })
}

/// A relay for team members: limits sized for job data, not only for a hole punch
/// (libp2p's defaults: 2 minutes and 128 KiB per circuit).
fn team_relay(peer_id: PeerId, s: &RelaySettings) -> relay::Behaviour {
    // Only members reach the relay (the allow-list drops everyone else), so the rate
    // limits bound a buggy member, not strangers: libp2p's defaults (30 circuits, then
    // one every 2 minutes) lock a member out for minutes after a burst of dials.
    let per_second = |n: u32| NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN);
    let config = relay::Config {
        max_reservations: s.max_reservations as usize,
        max_reservations_per_peer: 2,
        reservation_duration: Duration::from_secs(3600),
        reservation_rate_limiters: Vec::new(),
        max_circuits: s.max_circuits as usize,
        max_circuits_per_peer: 4,
        max_circuit_duration: s.circuit_duration,
        max_circuit_bytes: s.circuit_bytes,
        circuit_src_rate_limiters: Vec::new(),
    }
    .reservation_rate_per_peer(per_second(30), Duration::from_secs(2))
    .circuit_src_per_peer(per_second(120), Duration::from_millis(500))
    .circuit_src_per_ip(per_second(480), Duration::from_millis(125));
    let mut relay = relay::Behaviour::new(peer_id, config);
    if s.always {
        relay.set_status(Some(relay::Status::Enable));
    }
    relay
}
