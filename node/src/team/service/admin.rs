//! What admins and members ask of their team through the node: the signed changes
//! only admins make (invites, members, policy, revocations), [`TeamService`] which
//! makes them and tells the members, and the team view.

use std::collections::HashSet;
use std::sync::Arc;

use gpunode_protocol::team::{InviteToken, Role};
use gpunode_protocol::time::now_ms;
use libp2p::PeerId;

use super::streams::sync_with_members;
use super::Team;
use crate::loop_client::PeerLink;
use crate::team::{TeamOpError, TeamState};

impl Team {
    /// Issues an invite token (admins only).
    pub fn invite(
        &self,
        role: Role,
        uses: u32,
        expires_ms: u64,
        bootstrap: Vec<String>,
    ) -> Result<(InviteToken, Option<HashSet<PeerId>>), TeamOpError> {
        let mut s = self.lock();
        let token = s.invite(
            role,
            uses,
            expires_ms,
            bootstrap,
            &self.node_key,
            self.team_key.is_some(),
        )?;
        let state = s.clone();
        drop(s);
        Ok((token, self.changed(&state)))
    }

    /// Admits a known peer id without a token (admins only).
    pub fn add(&self, peer: PeerId, role: Role) -> Result<Option<HashSet<PeerId>>, TeamOpError> {
        let mut s = self.lock();
        let cert = s.issue(peer, role, &self.node_key, self.team_key.as_ref(), now_ms())?;
        s.admit(cert, now_ms())?;
        let state = s.clone();
        drop(s);
        Ok(self.changed(&state))
    }

    /// Revokes a member (admins only).
    pub fn revoke(&self, peer: PeerId) -> Result<Option<HashSet<PeerId>>, TeamOpError> {
        let mut s = self.lock();
        s.revoke(peer, &self.node_key, self.team_key.as_ref(), now_ms())?;
        let state = s.clone();
        drop(s);
        Ok(self.changed(&state))
    }

    /// Signs and adopts a new policy from its file text (admins only); returns the new
    /// allowed set if it changed (it does not) and the policy's version.
    pub fn set_policy(&self, text: &str) -> Result<u64, TeamOpError> {
        let now = now_ms();
        let mut s = self.lock();
        if s.own.cert.role != Role::Admin {
            return Err(TeamOpError::NotAdmin);
        }
        let seq = s.policy.as_ref().map_or(1, |p| p.policy.seq + 1);
        let (issuer, key, cert) = match &self.team_key {
            Some(tk) => (tk.public().to_peer_id(), tk, None),
            None => (
                self.node_key.public().to_peer_id(),
                &self.node_key,
                Some(s.own.clone()),
            ),
        };
        let policy =
            crate::team::policy::parse(text, s.team, issuer, seq).map_err(TeamOpError::Invalid)?;
        let signed = gpunode_protocol::team::SignedPolicy::sign(policy, key, cert)?;
        s.apply_policy(signed, now)?;
        let state = s.clone();
        drop(s);
        let _ = self.changed(&state);
        Ok(seq)
    }
}

/// What admins and members ask of their team through the node: invites, members,
/// policy, revocations, the team view.
#[derive(Debug, Clone)]
pub struct TeamService {
    team: Arc<Team>,
    link: PeerLink,
}

impl TeamService {
    /// The service of `team` over `link`.
    pub fn new(team: Arc<Team>, link: PeerLink) -> TeamService {
        TeamService { team, link }
    }

    /// Issues an invite token (admins only).
    pub async fn invite(
        &self,
        role: Role,
        uses: u32,
        expires_ms: u64,
        bootstrap: Vec<String>,
    ) -> Result<InviteToken, TeamOpError> {
        let (token, allowed) = self.team.invite(role, uses, expires_ms, bootstrap)?;
        if allowed.is_some() {
            self.team.publish_allowed(&self.link).await;
        }
        Ok(token)
    }

    /// Admits a known peer id without a token (admins only) and tells the members.
    pub async fn add(&self, peer: PeerId, role: Role) -> Result<(), TeamOpError> {
        let team = self.team.clone();
        if team.add(peer, role)?.is_some() {
            self.team.publish_allowed(&self.link).await;
        }
        sync_with_members(&team, &self.link).await;
        Ok(())
    }

    /// Sets the team policy from its file text (admins only) and tells the members.
    pub async fn set_policy(&self, text: &str) -> Result<u64, TeamOpError> {
        let team = self.team.clone();
        let seq = team.set_policy(text)?;
        sync_with_members(&team, &self.link).await;
        Ok(seq)
    }

    /// Revokes a member (admins only): it is dropped here at once and by the other
    /// members as the revocation reaches them.
    pub async fn revoke(&self, peer: PeerId) -> Result<(), TeamOpError> {
        let team = self.team.clone();
        if team.revoke(peer)?.is_some() {
            self.team.publish_allowed(&self.link).await;
        }
        sync_with_members(&team, &self.link).await;
        Ok(())
    }

    /// The team as `gpunode team members` shows it.
    pub async fn view(&self) -> TeamView {
        let connected: HashSet<PeerId> = self.link.connected_peers().await.into_iter().collect();
        let mut view = TeamView::of(&self.team.state(), &connected);
        let now = now_ms();
        for m in &mut view.members {
            if let Ok(peer) = m.peer_id.parse() {
                m.quota = self.team.quota_use(&peer, now);
            }
        }
        view
    }

    /// An invite token whose bootstrap addresses are this node's reachable addresses.
    pub async fn invite_here(
        &self,
        role: Role,
        uses: u32,
        expires_ms: u64,
    ) -> Result<InviteToken, TeamOpError> {
        let status = self
            .link
            .client()
            .status()
            .await
            .map_err(|e| TeamOpError::Invalid(e.to_string()))?;
        let mut bootstrap = status.external_addrs;
        if bootstrap.is_empty() {
            return Err(TeamOpError::Invalid(
                "this node has no reachable address yet to put in the invite; check --listen"
                    .into(),
            ));
        }
        bootstrap.truncate(8);
        self.invite(role, uses, expires_ms, bootstrap).await
    }
}

/// A member as `gpunode team members` shows it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MemberView {
    /// The member.
    pub peer_id: String,
    /// Its role.
    pub role: Role,
    /// When its certificate expires, unix ms.
    pub expires_ms: u64,
    /// Who signed its certificate.
    pub issuer: String,
    /// Whether it is revoked.
    pub revoked: bool,
    /// Whether this node is connected to it now.
    pub connected: bool,
    /// What this node (as a provider) granted it today and this week, against the team
    /// policy's quota.
    #[serde(default)]
    pub quota: QuotaUse,
}

/// GPU-hours one member was granted by this provider, and its quota (`None`: no limit).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct QuotaUse {
    /// Granted since the start of today (team time).
    pub today_gpu_hours: f64,
    /// Granted since the start of this week (Monday, team time).
    pub week_gpu_hours: f64,
    /// The policy's daily quota.
    pub per_day: Option<f64>,
    /// The policy's weekly quota.
    pub per_week: Option<f64>,
}

/// The team as `gpunode team members` shows it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TeamView {
    /// The team id.
    pub team_id: String,
    /// Its local name.
    pub name: String,
    /// This node's role.
    pub role: Role,
    /// When this node's certificate expires, unix ms.
    pub expires_ms: u64,
    /// Members known, this node included.
    pub members: Vec<MemberView>,
    /// Invites of this node still open.
    pub open_invites: usize,
}

impl TeamView {
    /// The view of `state`; `connected` peers are marked.
    pub fn of(state: &TeamState, connected: &HashSet<PeerId>) -> TeamView {
        let now = now_ms();
        let mut members: Vec<MemberView> = state
            .members
            .iter()
            .map(|c| MemberView {
                peer_id: c.cert.member.to_string(),
                role: c.cert.role,
                expires_ms: c.cert.expires_ms,
                issuer: c.cert.issuer.to_string(),
                revoked: state.is_revoked(&c.cert.member),
                connected: connected.contains(&c.cert.member),
                quota: QuotaUse::default(),
            })
            .collect();
        members.sort_by(|a, b| a.peer_id.cmp(&b.peer_id));
        TeamView {
            team_id: state.team.to_string(),
            name: state.name.clone(),
            role: state.own.cert.role,
            expires_ms: state.own.cert.expires_ms,
            members,
            open_invites: state
                .invites
                .iter()
                .filter(|i| i.uses_left > 0 && i.expires_ms >= now)
                .count(),
        }
    }
}
