//! The team's stream exchanges: serving joins, syncs and renewals as the router hands
//! them over, and the outgoing side (syncing with connected members, asking an admin
//! for a fresh certificate).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use futures::{AsyncReadExt, AsyncWriteExt};
use gpunode_protocol::team::{JoinReply, JoinRequest, Role, TeamSync};
use gpunode_protocol::time::now_ms;
use libp2p::{PeerId, Stream};

use super::Team;
use crate::loop_client::PeerLink;
use crate::router::framing;
use crate::team::team_protocol;

/// How long one exchange may take.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(10);
/// Most exchanges of each team protocol served at once.
const MAX_TEAM_STREAMS: usize = 32;

/// How team streams are bounded: each exchange as a whole, and how many at once.
pub const TEAM_STREAM_LIMITS: crate::router::StreamLimits = crate::router::StreamLimits {
    max_handlers: MAX_TEAM_STREAMS,
    first_message: EXCHANGE_TIMEOUT,
    exchange: Some(EXCHANGE_TIMEOUT),
};

/// The team's stream protocols, as the router serves them.
#[derive(Debug, Clone, Copy)]
pub enum TeamStream {
    /// A new machine joins with an invite.
    Join,
    /// Members exchange certificates, revocations and policy.
    Sync,
    /// A member renews its certificate with an admin.
    Renew,
}

impl TeamStream {
    /// Every team stream protocol.
    pub const ALL: [TeamStream; 3] = [TeamStream::Join, TeamStream::Sync, TeamStream::Renew];

    /// Its protocol name in `team`.
    pub fn protocol(self, team: &Team) -> libp2p::StreamProtocol {
        team_protocol(&team.lock().team, self.suffix())
    }

    fn suffix(self) -> &'static str {
        match self {
            TeamStream::Join => "join",
            TeamStream::Sync => "sync",
            TeamStream::Renew => "renew",
        }
    }

    /// Its label in metrics.
    pub fn metrics_name(self) -> &'static str {
        match self {
            TeamStream::Join => "team_join",
            TeamStream::Sync => "team_sync",
            TeamStream::Renew => "team_renew",
        }
    }
}

/// Serves one of the team's stream protocols.
pub struct TeamStreams {
    /// The team.
    pub team: Arc<Team>,
    /// The node's streams and loop.
    pub link: PeerLink,
    /// Which protocol.
    pub kind: TeamStream,
}

impl crate::router::StreamHandler for TeamStreams {
    fn handle(
        self: Arc<Self>,
        peer: PeerId,
        stream: Stream,
        _gate: crate::router::StreamGate,
    ) -> futures::future::BoxFuture<'static, ()> {
        Box::pin(async move {
            match self.kind {
                TeamStream::Join => serve_join(&self.team, &self.link, peer, stream).await,
                TeamStream::Sync => serve_sync(&self.team, &self.link, peer, stream).await,
                TeamStream::Renew => serve_renewal(&self.team, peer, stream).await,
            }
        })
    }
}

impl Team {
    /// As an admin: a fresh certificate for `peer`, who shows its current one.
    fn answer_renewal(
        &self,
        peer: PeerId,
        current: gpunode_protocol::team::SignedCertificate,
    ) -> Option<gpunode_protocol::team::SignedCertificate> {
        let now = now_ms();
        let mut s = self.lock();
        if current.cert.member != peer
            || s.is_revoked(&peer)
            || s.check_cert(&current, now).is_err()
        {
            return None;
        }
        let lifetime = current
            .cert
            .expires_ms
            .saturating_sub(current.cert.issued_ms);
        let cert = s
            .issue_for(
                peer,
                current.cert.role,
                &self.node_key,
                self.team_key.as_ref(),
                now,
                lifetime,
            )
            .ok()?;
        let _ = s.admit(cert.clone(), now);
        let state = s.clone();
        drop(s);
        let _ = self.changed(&state);
        Some(cert)
    }

    /// Answers a join over the join identity `peer`.
    fn answer_join(&self, peer: PeerId, req: JoinRequest) -> (JoinReply, Option<HashSet<PeerId>>) {
        let now = now_ms();
        let mut s = self.lock();
        if req.team != s.team {
            return (
                JoinReply::Refused("this invite is for another team".into()),
                None,
            );
        }
        if let Err(e) = req.verify(&peer) {
            return (JoinReply::Refused(e.to_string()), None);
        }
        let role = match s.use_invite(&peer, now) {
            Ok(r) => r,
            Err(m) => return (JoinReply::Refused(m), None),
        };
        let cert = match s.issue(
            req.member,
            role,
            &self.node_key,
            self.team_key.as_ref(),
            now,
        ) {
            Ok(c) => c,
            Err(e) => return (JoinReply::Refused(e.to_string()), None),
        };
        if let Err(e) = s.admit(cert.clone(), now) {
            return (JoinReply::Refused(e.to_string()), None);
        }
        tracing::info!(member = %req.member, ?role, "a new member joined the team");
        let reply = JoinReply::Admitted {
            cert,
            members: s.members.clone(),
            revocations: s.revocations.clone(),
            policy: s.policy.clone(),
        };
        let state = s.clone();
        drop(s);
        (reply, self.changed(&state))
    }
}

async fn serve_join(team: &Team, link: &PeerLink, peer: PeerId, stream: Stream) {
    let (mut r, mut w) = AsyncReadExt::split(stream);
    // Whatever else changes the allowed set meanwhile (an invite made, a sync) must not
    // drop this joiner before it has read its answer.
    let answering = team.answering(peer);
    let (reply, allowed) = match framing::read_message::<_, JoinRequest>(&mut r).await {
        Ok(req) => team.answer_join(peer, req),
        Err(e) => (
            JoinReply::Refused(format!("malformed join request: {e}")),
            None,
        ),
    };
    let _ = framing::write_message(&mut w, &reply).await;
    let _ = w.flush().await;
    let _ = w.close().await;
    // Dropping a spent invite's join identity closes its connection, and a closed QUIC
    // connection discards what the peer has not yet acknowledged: the joiner would be
    // admitted here without knowing it, its invite used up. So wait (bounded) until it
    // closes its side, which it does once it has read the answer.
    let _ = tokio::time::timeout(EXCHANGE_TIMEOUT, until_closed(&mut r)).await;
    // Only now: a spent invite's join identity is dropped with this, after its answer.
    drop(answering);
    // Also when the set did not change here: one published meanwhile kept this peer in.
    if allowed.is_some() || !team.allowed().contains(&peer) {
        team.publish_allowed(link).await;
    }
    if matches!(reply, JoinReply::Admitted { .. }) {
        sync_with_members(team, link).await;
    }
}

/// Reads `r` until the peer closes it (or it fails), discarding at most a few KiB.
async fn until_closed<R: futures::AsyncRead + Unpin>(r: &mut R) {
    let mut buf = [0u8; 256];
    let mut left = 4096usize;
    while left > 0 {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => left = left.saturating_sub(n),
        }
    }
}

async fn serve_renewal(team: &Team, peer: PeerId, stream: Stream) {
    let (mut r, mut w) = AsyncReadExt::split(stream);
    let reply =
        match framing::read_message::<_, gpunode_protocol::team::SignedCertificate>(&mut r).await {
            Ok(current) => team.answer_renewal(peer, current),
            Err(_) => None,
        };
    let _ = framing::write_message(&mut w, &reply).await;
    let _ = w.flush().await;
    let _ = w.close().await;
}

/// Asks a connected admin for a fresh certificate.
pub(super) async fn renew_from_admin(team: &Team, link: &PeerLink) {
    let connected = link.connected_peers().await;
    let (team_id, own, admins) = {
        let s = team.lock();
        let admins: HashSet<PeerId> = s
            .members
            .iter()
            .filter(|c| c.cert.role == Role::Admin && c.issuer_cert.is_none())
            .map(|c| c.cert.member)
            .collect();
        (s.team, s.own.clone(), admins)
    };
    for admin in connected.into_iter().filter(|p| admins.contains(p)) {
        let own = own.clone();
        let exchange = async {
            let stream = link
                .open_stream(admin, team_protocol(&team_id, "renew"))
                .await
                .ok()?;
            let (mut r, mut w) = AsyncReadExt::split(stream);
            framing::write_message(&mut w, &own).await.ok()?;
            w.flush().await.ok()?;
            let reply =
                framing::read_message::<_, Option<gpunode_protocol::team::SignedCertificate>>(
                    &mut r,
                )
                .await
                .ok()?;
            let _ = w.close().await;
            reply
        };
        if let Ok(Some(cert)) = tokio::time::timeout(EXCHANGE_TIMEOUT, exchange).await {
            let allowed = {
                let now = now_ms();
                let mut s = team.lock();
                if cert.cert.member == s.own.cert.member && s.admit(cert, now).unwrap_or(false) {
                    let state = s.clone();
                    drop(s);
                    tracing::info!("team certificate renewed by {admin}");
                    team.changed(&state)
                } else {
                    None
                }
            };
            if allowed.is_some() {
                team.publish_allowed(link).await;
            }
            return;
        }
    }
}

async fn serve_sync(team: &Team, link: &PeerLink, peer: PeerId, stream: Stream) {
    let (mut r, mut w) = AsyncReadExt::split(stream);
    if !team.is_member(&peer) {
        tracing::debug!(%peer, "team sync from a non-member refused");
        let _ = w.close().await;
        return;
    }
    match framing::read_message::<_, TeamSync>(&mut r).await {
        Ok(sync) => {
            if team.merge(sync).is_some() {
                team.publish_allowed(link).await;
            }
            let _ = framing::write_message(&mut w, &team.sync_msg()).await;
            let _ = w.flush().await;
        }
        Err(e) => tracing::debug!(%peer, "bad team sync: {e}"),
    }
    let _ = w.close().await;
}

/// Tells every connected member what we know and takes what they know.
pub(crate) async fn sync_with_members(team: &Team, link: &PeerLink) -> usize {
    let connected = link.connected_peers().await;
    let team_id = team.lock().team;
    let members: HashSet<PeerId> = team.lock().members.iter().map(|c| c.cert.member).collect();
    let allowed = team.allowed();
    let mut answered = 0;
    for peer in connected
        .into_iter()
        .filter(|p| members.contains(p) && allowed.contains(p))
    {
        let msg = team.sync_msg();
        let exchange = async {
            let stream = link
                .open_stream(peer, team_protocol(&team_id, "sync"))
                .await
                .ok()?;
            let (mut r, mut w) = AsyncReadExt::split(stream);
            framing::write_message(&mut w, &msg).await.ok()?;
            w.flush().await.ok()?;
            let reply = framing::read_message::<_, TeamSync>(&mut r).await.ok()?;
            let _ = w.close().await;
            Some(reply)
        };
        if let Ok(Some(reply)) = tokio::time::timeout(EXCHANGE_TIMEOUT, exchange).await {
            answered += 1;
            if team.merge(reply).is_some() {
                team.publish_allowed(link).await;
            }
        }
    }
    answered
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn waiting_for_a_joiner_to_close_ends_at_its_close_and_reads_a_bounded_amount() {
        let mut closed = futures::io::Cursor::new(vec![1u8; 10]);
        until_closed(&mut closed).await;
        assert_eq!(closed.position(), 10);
        // A peer that never closes and sends without end is read no further than the
        // bound (the caller's timeout covers one that sends nothing).
        let mut endless = futures::io::repeat(7).take(1 << 20);
        until_closed(&mut endless).await;
        assert!(endless.limit() >= (1 << 20) - 4096 - 256);
    }
}
