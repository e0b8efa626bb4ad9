//! The joiner's side of `gpunode team join TOKEN`: connect to the inviter as the token's
//! join identity (the only stranger identity the inviter lets in), prove this node's own
//! key, and save the certificate, members and revocations the inviter hands back.

use std::path::Path;
use std::time::Duration;

use futures::{AsyncReadExt, AsyncWriteExt, StreamExt};
use gpunode_protocol::team::{InviteToken, JoinReply, JoinRequest};
use gpunode_protocol::time::now_ms;
use libp2p::identity::Keypair;
use libp2p::{Multiaddr, PeerId, StreamProtocol, Swarm};

use super::{team_protocol, TeamOpError, TeamState};
use crate::network::{build_swarm, NodeBehaviour, SwarmSettings};
use crate::router::framing;

/// How long joining may take.
const JOIN_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest a joiner waits for its connection to the inviter to close after the answer.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// Joins the team of `token` with this node's `node_key`; saves and returns the state.
pub async fn join(
    data_dir: &Path,
    node_key: &Keypair,
    token: &InviteToken,
) -> Result<TeamState, TeamOpError> {
    let addrs = inviter_addrs(data_dir, token)?;
    let join_key = token.join_keypair()?;
    let join_peer = join_key.public().to_peer_id();
    let swarm = dial_inviter(join_key, token, &addrs)?;
    let request = JoinRequest::new(token.team, node_key, &join_peer)?;
    let reply = ask_inviter(swarm, request, token).await?;
    let state = joined_state(reply, node_key, token)?;
    state.save(data_dir)?;
    Ok(state)
}

/// Where to reach the inviter, once this node is known to be in no team and the token
/// still fresh.
fn inviter_addrs(data_dir: &Path, token: &InviteToken) -> Result<Vec<Multiaddr>, TeamOpError> {
    if let Some(existing) = TeamState::load(data_dir)? {
        return Err(TeamOpError::AlreadyInTeam(existing.team.to_string()));
    }
    token.check_fresh(now_ms())?;
    let addrs: Vec<Multiaddr> = token
        .bootstrap
        .iter()
        .filter_map(|a| a.parse().ok())
        .collect();
    if addrs.is_empty() {
        return Err(TeamOpError::Invalid(
            "the invite token names no address to reach the team at".into(),
        ));
    }
    Ok(addrs)
}

/// A swarm under the token's join identity, which lets in the inviter alone, dialling
/// `addrs`.
fn dial_inviter(
    join_key: Keypair,
    token: &InviteToken,
    addrs: &[Multiaddr],
) -> Result<Swarm<NodeBehaviour>, TeamOpError> {
    let mut swarm = build_swarm(
        join_key,
        &SwarmSettings {
            mdns: false,
            idle_connection_timeout: Duration::from_secs(30),
            provider_record_ttl: Duration::from_secs(60),
            server: false,
            team: Some((token.team, [token.inviter].into_iter().collect())),
            tcp_psk: None,
            limits: Default::default(),
            relay: Default::default(),
            upnp: false,
        },
    )
    .map_err(|e| TeamOpError::Invalid(e.to_string()))?;
    for addr in addrs {
        let _ = swarm.dial(addr.clone());
    }
    Ok(swarm)
}

/// Sends `request` to the inviter and waits for its answer, driving `swarm` meanwhile,
/// for [`JOIN_TIMEOUT`] at most.
async fn ask_inviter(
    mut swarm: Swarm<NodeBehaviour>,
    request: JoinRequest,
    token: &InviteToken,
) -> Result<JoinReply, TeamOpError> {
    let control = swarm.behaviour().stream.new_control();
    let exchange = exchange(
        control,
        token.inviter,
        team_protocol(&token.team, "join"),
        request,
    );
    tokio::pin!(exchange);
    let deadline = tokio::time::sleep(JOIN_TIMEOUT);
    tokio::pin!(deadline);
    let reply = loop {
        tokio::select! {
            r = &mut exchange => break r,
            _ = swarm.select_next_some() => {}
            _ = &mut deadline => break Err(format!(
                "no answer from the inviter within {}s; is its node running and reachable at {}?",
                JOIN_TIMEOUT.as_secs(),
                token.bootstrap.join(", ")
            )),
        }
    }
    .map_err(TeamOpError::Invalid)?;
    close_gracefully(&mut swarm, token.inviter).await;
    Ok(reply)
}

/// Closes the connections to `peer` and drives `swarm` until they are closed (for
/// [`CLOSE_GRACE`] at most), so that the end of the exchange and the close reach the
/// peer before this process exits. The inviter lets a new member in once the joiner's
/// side has closed; without this it would wait for its own timeout, and a node started
/// right after joining would be turned away meanwhile.
async fn close_gracefully(swarm: &mut Swarm<NodeBehaviour>, peer: PeerId) {
    if swarm.disconnect_peer_id(peer).is_err() {
        return;
    }
    let _ = tokio::time::timeout(CLOSE_GRACE, async {
        while swarm.is_connected(&peer) {
            swarm.select_next_some().await;
        }
    })
    .await;
}

/// One join exchange with `inviter` over `protocol`: the request out, the reply in.
async fn exchange(
    mut control: libp2p_stream::Control,
    inviter: PeerId,
    protocol: StreamProtocol,
    request: JoinRequest,
) -> Result<JoinReply, String> {
    let stream = control.open_stream(inviter, protocol).await.map_err(|e| {
        format!(
            "cannot reach the inviter {inviter}: {e}. If its node is running, this \
                 invite is used up or expired (its identity is no longer let in); ask an \
                 admin for a new one"
        )
    })?;
    let (mut r, mut w) = AsyncReadExt::split(stream);
    framing::write_message(&mut w, &request)
        .await
        .map_err(|e| e.to_string())?;
    w.flush().await.map_err(|e| e.to_string())?;
    let reply = framing::read_message::<_, JoinReply>(&mut r)
        .await
        .map_err(|e| {
            format!(
                "the inviter did not answer: {e}. The invite may be used up or expired; \
                 ask an admin for a new one"
            )
        })?;
    let _ = w.close().await;
    Ok(reply)
}

/// The state of a member just admitted by `reply`, checked against the token: the
/// certificate is the team's and this node's; the members, revocations and policy it
/// brings are taken as a sync would take them.
fn joined_state(
    reply: JoinReply,
    node_key: &Keypair,
    token: &InviteToken,
) -> Result<TeamState, TeamOpError> {
    let (cert, members, revocations, policy) = match reply {
        JoinReply::Admitted {
            cert,
            members,
            revocations,
            policy,
        } => (cert, members, revocations, policy),
        JoinReply::Refused(why) => {
            return Err(TeamOpError::Invalid(format!("the team refused: {why}")))
        }
    };
    let now = now_ms();
    cert.verify(&token.team, &token.team_key, now)?;
    if cert.cert.member != node_key.public().to_peer_id() {
        return Err(TeamOpError::Invalid(
            "the inviter returned a certificate for another peer".into(),
        ));
    }
    let mut state = TeamState {
        name: format!("team {}", token.team.short()),
        team: token.team,
        team_key: token.team_key.clone(),
        own: cert.clone(),
        members: vec![cert],
        revocations: Vec::new(),
        invites: Vec::new(),
        bootstrap: token.bootstrap.clone(),
        policy: None,
    };
    // Revocations first, so nothing signed by a revoked admin is taken.
    for list in revocations {
        let _ = state.apply_revocations(list, now);
    }
    if let Some(p) = policy {
        let _ = state.apply_policy(p, now);
    }
    for m in members {
        let _ = state.admit(m, now);
    }
    Ok(state)
}
