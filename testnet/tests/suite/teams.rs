//! Private teams on real nodes on 127.0.0.1: five members and three outsiders with valid
//! libp2p identities. Outsiders are dropped, find no team adverts and cannot lease;
//! members see everything; a joiner with an invite gets in, a second use of the invite is
//! refused; a revoked member loses access and its leases within the bound.

use std::time::Duration;

use gpunode_node::team::{service::SYNC_EVERY, TeamState};
use gpunode_node::{DataDir, LeaseSpec, NodeHandle};
use gpunode_protocol::advert::OfferFilter;
use gpunode_protocol::team::Role;
use gpunode_protocol::time::now_ms;
use libp2p::PeerId;
use testnet::{start_node_in, TestNetConfig, TestNode};

use crate::eventually;

const LONG: Duration = Duration::from_secs(60);
/// Revocations must take effect within this.
const REVOCATION_BOUND: Duration = Duration::from_secs(30);

/// One GPU and one CPU of `provider` for ten minutes.
fn lease_of(provider: &PeerId) -> LeaseSpec {
    LeaseSpec::new(1, 600_000)
        .peer(provider.to_string())
        .cpus(1)
}

async fn offers_seen(h: &NodeHandle) -> Vec<String> {
    h.find_offers(OfferFilter::default())
        .await
        .map(|o| o.into_iter().map(|o| o.peer_id).collect())
        .unwrap_or_default()
}

async fn connected(h: &NodeHandle) -> Vec<PeerId> {
    h.status()
        .await
        .map(|s| {
            s.connected_peers
                .iter()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// A fresh identity invited by `inviter` (one use) and joined through `boot`: its data
/// dir, key, saved team state, and the used-up token.
async fn invited_joiner(
    inviter: &NodeHandle,
    boot: Vec<String>,
) -> (
    tempfile::TempDir,
    libp2p::identity::Keypair,
    TeamState,
    gpunode_protocol::team::InviteToken,
) {
    let token = inviter
        .team_invite(Role::Member, 1, now_ms() + 3_600_000, boot)
        .await
        .expect("invite");
    let dir = tempfile::tempdir().expect("dir");
    let key = DataDir::new(dir.path())
        .load_or_create_identity()
        .expect("identity");
    let joined = gpunode_node::team::join::join(dir.path(), &key, &token)
        .await
        .expect("join");
    (dir, key, joined, token)
}

/// Starts `n` members of a new team: node 0 creates it and certifies the others up front
/// (as `gpunode team add` does).
async fn team_of(
    cfg: &TestNetConfig,
    n: usize,
    spec: &Option<String>,
) -> (Vec<TestNode>, Vec<PeerId>) {
    team_with_lifetimes(cfg, n, spec, gpunode_node::team::CERT_LIFETIME_MS).await
}

/// Like [`team_of`], the members' certificates lasting `lifetime_ms`.
async fn team_with_lifetimes(
    cfg: &TestNetConfig,
    n: usize,
    spec: &Option<String>,
    lifetime_ms: u64,
) -> (Vec<TestNode>, Vec<PeerId>) {
    let dirs: Vec<tempfile::TempDir> = (0..n).map(|_| tempfile::tempdir().expect("dir")).collect();
    let keys: Vec<_> = dirs
        .iter()
        .map(|d| {
            DataDir::new(d.path())
                .load_or_create_identity()
                .expect("identity")
        })
        .collect();
    let ids: Vec<PeerId> = keys.iter().map(|k| k.public().to_peer_id()).collect();
    let mut root = TeamState::create(dirs[0].path(), "lab", &keys[0], now_ms()).expect("create");
    let team_key = TeamState::team_keypair(dirs[0].path())
        .expect("key")
        .expect("exists");
    let mut certs = Vec::new();
    for id in &ids[1..] {
        let c = root
            .issue_for(
                *id,
                Role::Member,
                &keys[0],
                Some(&team_key),
                now_ms(),
                lifetime_ms,
            )
            .expect("issue");
        root.admit(c.clone(), now_ms()).expect("admit");
        certs.push(c);
    }
    root.save(dirs[0].path()).expect("save");
    for (i, cert) in certs.into_iter().enumerate() {
        let member = TeamState {
            own: cert,
            invites: Vec::new(),
            ..root.clone()
        };
        member.save(dirs[i + 1].path()).expect("save");
    }
    let mut dirs = dirs.into_iter();
    let mut members: Vec<TestNode> = Vec::new();
    members.push(
        start_node_in(cfg, 0, spec.as_ref(), &[], dirs.next().expect("dir"))
            .await
            .expect("node 0"),
    );
    let boot = vec![members[0].addr.clone()];
    for (i, dir) in dirs.enumerate() {
        members.push(
            start_node_in(cfg, i + 1, spec.as_ref(), &boot, dir)
                .await
                .expect("member"),
        );
    }
    (members, ids)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_team_policy_spreads_and_a_quota_refuses_with_its_name() {
    let cfg = TestNetConfig::new(vec![]);
    let spec = Some("4xA100-80GB".to_string());
    let (members, ids) = team_of(&cfg, 2, &spec).await;
    eventually("the members connect", LONG, async || {
        connected(&members[1].handle).await.contains(&ids[0])
    })
    .await;
    let seq = members[0]
        .handle
        .team_set_policy("[quota]\ngpu_hours_per_day = 1.0\n[priority]\nadmin = 5\n")
        .await
        .expect("an admin sets the policy");
    assert_eq!(seq, 1);
    assert!(
        members[1]
            .handle
            .team_set_policy("[quota]\ngpu_hours_per_day = 100.0\n")
            .await
            .is_err(),
        "members cannot set the policy"
    );
    let member_team = members[1].handle.team().expect("in a team").clone();
    eventually("the policy reaches the member", LONG, async || {
        member_team
            .policy_text()
            .is_some_and(|t| t.contains("gpu_hours_per_day = 1"))
    })
    .await;
    // 40 minutes on one GPU fits the 1 GPU-hour; another 40 does not.
    let mut spec = lease_of(&ids[0]);
    spec.duration_ms = 40 * 60_000;
    members[1]
        .handle
        .request_lease(spec.clone())
        .await
        .expect("within the quota");
    let err = members[1]
        .handle
        .request_lease(spec)
        .await
        .expect_err("over the quota");
    assert!(err.to_string().contains("gpu_hours_per_day = 1"), "{err}");
    assert_eq!(
        members[0]
            .handle
            .metrics()
            .lease_rejected_count("team_policy"),
        1
    );
    for mut n in members {
        n.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outsiders_see_and_use_nothing_members_everything_and_revocation_bites() {
    let cfg = TestNetConfig::new(vec![]);
    let spec = Some("1xA100-80GB".to_string());
    let (members, ids) = team_of(&cfg, 5, &spec).await;
    let boot = vec![members[0].addr.clone()];
    // Three outsiders: real nodes that know a member's address.
    let mut outsiders = Vec::new();
    for i in 0..3 {
        outsiders.push(
            testnet::start_node(&cfg, 10 + i, spec.as_ref(), &boot)
                .await
                .expect("outsider"),
        );
    }

    // Members see every other member's advert.
    for m in &members {
        eventually(
            "a member sees every other member's advert",
            LONG,
            async || {
                let seen = offers_seen(&m.handle).await;
                ids.iter()
                    .filter(|id| **id != m.handle.peer_id())
                    .all(|id| seen.contains(&id.to_string()))
            },
        )
        .await;
    }
    // Outsiders see none of them, hold no connection to any member, cannot lease.
    for o in &outsiders {
        let seen = offers_seen(&o.handle).await;
        assert!(
            seen.iter()
                .all(|p| !ids.iter().any(|id| id.to_string() == *p)),
            "an outsider saw a team advert: {seen:?}"
        );
        // QUIC cannot refuse a stranger before its handshake (no pre-shared key, see
        // `network.rs`): a member's allow-list closes the connection as soon as it is
        // established, so no member ever counts it, and the outsider sees it end (its
        // search just dialled the member once for each of its lookups).
        for m in &members {
            let conns = connected(&m.handle).await;
            assert!(!conns.contains(&o.handle.peer_id()), "{conns:?}");
        }
        eventually(
            "the members close an outsider's connections",
            LONG,
            async || {
                let conns = connected(&o.handle).await;
                conns.iter().all(|p| !ids.contains(p))
            },
        )
        .await;
        let err = o
            .handle
            .request_lease(lease_of(&ids[1]))
            .await
            .expect_err("an outsider cannot lease");
        assert!(!err.to_string().is_empty());
    }

    // A joiner with an invite gets in; the invite is then used up.
    let (joiner_dir, _, joined, token) = invited_joiner(&members[0].handle, boot.clone()).await;
    assert_eq!(joined.own.cert.role, Role::Member);
    let other_dir = tempfile::tempdir().expect("dir");
    let other_key = DataDir::new(other_dir.path())
        .load_or_create_identity()
        .expect("identity");
    let err = gpunode_node::team::join::join(other_dir.path(), &other_key, &token)
        .await
        .expect_err("used up");
    assert!(err.to_string().contains("used up"), "{err}");
    let joiner = start_node_in(&cfg, 20, spec.as_ref(), &[], joiner_dir)
        .await
        .expect("joiner starts");
    eventually("the joiner sees the team", LONG, async || {
        let seen = offers_seen(&joiner.handle).await;
        ids.iter().all(|id| seen.contains(&id.to_string()))
    })
    .await;

    // Member 4 holds a lease from member 1; then node 0 revokes member 4.
    let lease = members[4]
        .handle
        .request_lease(lease_of(&ids[1]))
        .await
        .expect("a member leases");
    members[0].handle.team_revoke(ids[4]).await.expect("revoke");
    for (i, m) in members.iter().enumerate().take(4) {
        eventually(
            &format!("member {i} drops the revoked member"),
            REVOCATION_BOUND + SYNC_EVERY,
            async || !connected(&m.handle).await.contains(&ids[4]),
        )
        .await;
    }
    let provider_side = members[1]
        .handle
        .lease(&lease.lease_id.parse().expect("id"))
        .await
        .expect("ask")
        .expect("known");
    assert!(
        !provider_side.state.holds_resources(),
        "{:?}",
        provider_side.state
    );
    assert!(members[4]
        .handle
        .request_lease(lease_of(&ids[2]))
        .await
        .is_err());

    for mut n in members.into_iter().chain(outsiders).chain([joiner]) {
        n.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_are_renewed_while_an_admin_is_around_and_expire_without() {
    let cfg = TestNetConfig::new(vec![]);
    let spec = Some("1xA100-80GB".to_string());
    let lifetime = 8_000;
    let (mut members, ids) = team_with_lifetimes(&cfg, 3, &spec, lifetime).await;
    let first = members[1]
        .handle
        .team()
        .expect("team")
        .state()
        .own
        .cert
        .clone();
    eventually(
        "member 1 renews its certificate with the admin",
        LONG,
        async || {
            members[1]
                .handle
                .team()
                .expect("team")
                .state()
                .own
                .cert
                .issued_ms
                > first.issued_ms
        },
    )
    .await;
    eventually("members 1 and 2 meet", LONG, async || {
        connected(&members[1].handle).await.contains(&ids[2])
    })
    .await;
    // Without an admin nobody renews: once the certificates expire (plus the tolerated
    // clock skew) the members drop each other.
    members[0].shutdown().await;
    let bound = Duration::from_millis(2 * lifetime + gpunode_protocol::time::MAX_CLOCK_SKEW_MS)
        + 2 * SYNC_EVERY;
    eventually("expired members drop each other", bound, async || {
        !connected(&members[1].handle).await.contains(&ids[2])
    })
    .await;
    assert!(members[1]
        .handle
        .request_lease(lease_of(&ids[2]))
        .await
        .is_err());
    for mut n in members {
        n.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_with_a_pre_shared_key_admits_only_holders_of_the_key() {
    fn psk(i: usize, c: &mut gpunode_node::NodeConfig) {
        c.team_psk = Some(if i < 2 { "11" } else { "22" }.repeat(32));
    }
    let mut cfg = TestNetConfig::new(vec![]);
    cfg.transport = testnet::Transport::Tcp;
    cfg.tweak = Some(psk);
    let mut a = testnet::start_node(&cfg, 0, None, &[]).await.expect("a");
    let boot = vec![a.addr.clone()];
    let mut b = testnet::start_node(&cfg, 1, None, &boot).await.expect("b");
    let mut c = testnet::start_node(&cfg, 2, None, &boot).await.expect("c");
    let a_id = a.handle.peer_id();
    eventually("the key holder connects", LONG, async || {
        connected(&b.handle).await.contains(&a_id)
    })
    .await;
    // The other key never completes a handshake, however hard it tries.
    let mut spec = lease_of(&a_id);
    spec.gpus = 0;
    assert!(c.handle.request_lease(spec).await.is_err());
    assert!(!connected(&c.handle).await.contains(&a_id));
    for n in [&mut a, &mut b, &mut c] {
        n.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn higher_priority_work_preempts_only_where_the_policy_allows() {
    let cfg = TestNetConfig::new(vec![]);
    let spec = Some("1xA100-80GB".to_string());
    // Node 0 is the admin (priority 10), node 1 a member (0), node 2 the provider.
    let (members, ids) = team_of(&cfg, 3, &spec).await;
    eventually("the members connect", LONG, async || {
        let (a, b) = (connected(&members[2].handle).await, ids[..2].to_vec());
        b.iter().all(|p| a.contains(p))
    })
    .await;
    let set = async |text: &str| {
        members[0]
            .handle
            .team_set_policy(text)
            .await
            .expect("policy");
        let provider_team = members[2].handle.team().expect("in a team").clone();
        let wanted = text.lines().last().unwrap_or_default().to_string();
        eventually("the policy reaches the provider", LONG, async || {
            provider_team
                .policy_text()
                .is_some_and(|t| t.contains(&wanted))
        })
        .await;
    };
    set("[priority]\nadmin = 10\nmember = 0\npreempt = false").await;
    let held = members[1]
        .handle
        .request_lease(lease_of(&ids[2]))
        .await
        .expect("the member takes the only GPU");
    let urgent = lease_of(&ids[2]).ticket(7);
    let err = members[0]
        .handle
        .request_lease(urgent.clone())
        .await
        .expect_err("no preemption without the policy");
    assert!(err.to_string().contains("queued: position 1 of 1"), "{err}");

    set("[priority]\nadmin = 10\nmember = 0\npreempt = true").await;
    let granted = members[0]
        .handle
        .request_lease(urgent)
        .await
        .expect("the admin's work preempts the member's lease");
    assert_eq!(granted.gpus.len(), 1);
    let leases = members[2].handle.list_leases().await.expect("leases");
    let old = leases
        .iter()
        .find(|l| l.lease_id == held.lease_id)
        .expect("the member's lease");
    assert_eq!(old.state, gpunode_node::lease::LeaseState::Cancelled);
    assert_eq!(members[2].handle.metrics().leases_preempted.get(), 1);
    for mut n in members {
        n.shutdown().await;
    }
}

/// Drives `swarm` until `done` accepts an event or `bound` passes; returns what was seen.
async fn drive_until(
    swarm: &mut libp2p::Swarm<gpunode_node::network::NodeBehaviour>,
    bound: Duration,
    mut done: impl FnMut(&libp2p::swarm::SwarmEvent<gpunode_node::network::NodeBehaviourEvent>) -> bool,
) -> bool {
    use futures::StreamExt;
    let deadline = tokio::time::Instant::now() + bound;
    loop {
        match tokio::time::timeout_at(deadline, swarm.select_next_some()).await {
            Ok(event) if done(&event) => return true,
            Ok(_) => {}
            Err(_) => return false,
        }
    }
}

/// A raw libp2p swarm built the way nodes build theirs, for `key`, in `team` if given.
fn raw_swarm(
    key: libp2p::identity::Keypair,
    team: Option<(
        gpunode_protocol::team::TeamId,
        std::collections::HashSet<PeerId>,
    )>,
) -> libp2p::Swarm<gpunode_node::network::NodeBehaviour> {
    gpunode_node::network::build_swarm(
        key,
        &gpunode_node::network::SwarmSettings {
            mdns: false,
            idle_connection_timeout: Duration::from_secs(30),
            provider_record_ttl: Duration::from_secs(60),
            server: false,
            team,
            tcp_psk: None,
            limits: Default::default(),
            relay: Default::default(),
            upnp: false,
        },
    )
    .expect("swarm")
}

/// Whether `swarm` gets a reservation on the relay at `circuit` within 15 s.
async fn reserves(
    swarm: &mut libp2p::Swarm<gpunode_node::network::NodeBehaviour>,
    circuit: libp2p::Multiaddr,
) -> bool {
    use gpunode_node::network::NodeBehaviourEvent;
    use libp2p::swarm::SwarmEvent;
    let listener = swarm.listen_on(circuit).expect("listen on the circuit");
    let mut accepted = false;
    drive_until(swarm, Duration::from_secs(15), |e| match e {
        SwarmEvent::Behaviour(NodeBehaviourEvent::RelayClient(
            libp2p::relay::client::Event::ReservationReqAccepted { .. },
        )) => {
            accepted = true;
            true
        }
        SwarmEvent::ListenerClosed { listener_id, .. } => *listener_id == listener,
        _ => false,
    })
    .await;
    accepted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_team_relay_reserves_for_members_and_refuses_outsiders() {
    use libp2p::multiaddr::Protocol;
    let mut cfg = TestNetConfig::new(vec![]);
    cfg.tweak = Some(|_, c| c.relay = true);
    let (members, ids) = team_of(&cfg, 2, &None).await;
    eventually("the members connect", LONG, async || {
        connected(&members[1].handle).await.contains(&ids[0])
    })
    .await;
    let relay_addr: libp2p::Multiaddr = members[0].addr.parse().expect("addr");
    let circuit = relay_addr.clone().with(Protocol::P2pCircuit);

    // An outsider with a valid identity: no reservation, no circuit to a member.
    let mut outsider = raw_swarm(libp2p::identity::Keypair::generate_ed25519(), None);
    assert!(
        !reserves(&mut outsider, circuit.clone()).await,
        "an outsider got a reservation on a team relay"
    );
    let through = circuit.clone().with(Protocol::P2p(ids[1]));
    outsider.dial(through).expect("dial starts");
    let mut reached = false;
    drive_until(&mut outsider, Duration::from_secs(15), |e| match e {
        libp2p::swarm::SwarmEvent::ConnectionEstablished { peer_id, .. } if *peer_id == ids[1] => {
            reached = true;
            true
        }
        libp2p::swarm::SwarmEvent::OutgoingConnectionError { .. } => true,
        _ => false,
    })
    .await;
    assert!(
        !reached,
        "an outsider reached a member through the team relay"
    );

    // The same steps from a member (joined with an invite) get a reservation.
    let (_joiner_dir, joiner_key, joined, _) =
        invited_joiner(&members[0].handle, vec![members[0].addr.clone()]).await;
    let mut allowed: std::collections::HashSet<PeerId> = ids.iter().copied().collect();
    allowed.insert(joiner_key.public().to_peer_id());
    let mut member = raw_swarm(joiner_key, Some((joined.team, allowed)));
    assert!(
        reserves(&mut member, circuit).await,
        "a member got no reservation on the team relay"
    );
    for mut n in members {
        n.shutdown().await;
    }
}
