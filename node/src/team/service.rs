//! The team side of a running node: answers joins on the join identity of an open
//! invite, keeps certificates and revocations in sync with connected members, and tells
//! the event loop who may connect (members with valid, unrevoked certificates and open
//! invites' join identities; everyone else is dropped, their leases cancelled).

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{AsyncReadExt, AsyncWriteExt};
use gpunode_protocol::team::{InviteToken, JoinReply, JoinRequest, Role, TeamSync};
use gpunode_protocol::time::now_ms;
use libp2p::identity::Keypair;
use libp2p::{PeerId, Stream};
use tokio::sync::watch;

use super::{team_protocol, TeamOpError, TeamState};
use crate::loop_client::PeerLink;
use crate::router::framing;

/// How often members compare what they know (revocations reach everyone within about
/// twice this).
pub const SYNC_EVERY: Duration = Duration::from_secs(5);
/// How long one exchange may take.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(10);
/// Most exchanges of each team protocol served at once.
const MAX_TEAM_STREAMS: usize = 32;

/// A node's team membership at run time.
pub struct Team {
    state: Mutex<TeamState>,
    data_dir: PathBuf,
    node_key: Keypair,
    team_key: Option<Keypair>,
    allowed: Mutex<HashSet<PeerId>>,
    /// The members, recomputed with `allowed` (on every change and sync tick), so the
    /// handlers' membership check verifies no signature per message.
    members: Mutex<HashSet<PeerId>>,
    grants: super::policy::Grants,
}

impl std::fmt::Debug for Team {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Team").finish_non_exhaustive()
    }
}

impl Team {
    /// Loads the team of `data_dir`, if the node is in one.
    pub fn load(data_dir: PathBuf, node_key: Keypair) -> Result<Option<Arc<Team>>, TeamOpError> {
        let Some(state) = TeamState::load(&data_dir)? else {
            return Ok(None);
        };
        if state.own.cert.member != node_key.public().to_peer_id() {
            return Err(TeamOpError::Invalid(
                "the team certificate in this data dir belongs to another identity".into(),
            ));
        }
        let team_key = TeamState::team_keypair(&data_dir)?;
        let allowed = state.allowed(now_ms());
        let members = state.members_now(now_ms());
        Ok(Some(Arc::new(Team {
            state: Mutex::new(state),
            node_key,
            team_key,
            allowed: Mutex::new(allowed),
            members: Mutex::new(members),
            grants: super::policy::Grants::load(&grants_file(&data_dir)),
            data_dir,
        })))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, TeamState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A copy of the state.
    pub fn state(&self) -> TeamState {
        self.lock().clone()
    }

    /// Whether `peer` is a member now (valid certificate, nobody revoked it or its
    /// issuer). Join identities are let in to join, and nothing else: every handler
    /// asks this rather than rely on the connection allow-list.
    pub fn is_member(&self, peer: &PeerId) -> bool {
        self.members
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(peer)
    }

    /// Peers allowed to connect now.
    pub fn allowed(&self) -> HashSet<PeerId> {
        self.allowed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Saves the state and recomputes who may connect; returns the new set if it changed.
    fn changed(&self, state: &TeamState) -> Option<HashSet<PeerId>> {
        if let Err(e) = state.save(&self.data_dir) {
            tracing::error!("cannot save the team state: {e}");
        }
        self.recompute(state)
    }

    fn recompute(&self, state: &TeamState) -> Option<HashSet<PeerId>> {
        let now = now_ms();
        *self.members.lock().unwrap_or_else(|p| p.into_inner()) = state.members_now(now);
        let now_allowed = state.allowed(now);
        let mut allowed = self.allowed.lock().unwrap_or_else(|p| p.into_inner());
        if *allowed == now_allowed {
            return None;
        }
        *allowed = now_allowed.clone();
        Some(now_allowed)
    }

    /// What this node knows, for a sync.
    fn sync_msg(&self) -> TeamSync {
        let s = self.lock();
        TeamSync {
            team: s.team,
            certs: s.members.clone(),
            revocations: s.revocations.clone(),
            policy: s.policy.clone(),
        }
    }

    /// Takes what a member told us; returns the new allowed set if it changed.
    fn merge(&self, sync: TeamSync) -> Option<HashSet<PeerId>> {
        let now = now_ms();
        let mut s = self.lock();
        if sync.team != s.team {
            return None;
        }
        let mut changed = false;
        for list in sync.revocations {
            changed |= s.apply_revocations(list, now).unwrap_or(false);
        }
        if let Some(policy) = sync.policy {
            changed |= s.apply_policy(policy, now).unwrap_or(false);
        }
        for cert in sync.certs {
            if !s.is_revoked(&cert.cert.member) {
                changed |= s.admit(cert, now).unwrap_or(false);
            }
        }
        if changed {
            let state = s.clone();
            drop(s);
            self.changed(&state)
        } else {
            None
        }
    }

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
            super::policy::parse(text, s.team, issuer, seq).map_err(TeamOpError::Invalid)?;
        let signed = gpunode_protocol::team::SignedPolicy::sign(policy, key, cert)?;
        s.apply_policy(signed, now)?;
        let state = s.clone();
        drop(s);
        let _ = self.changed(&state);
        Ok(seq)
    }

    /// The policy as an editable file, if one is set.
    pub fn policy_text(&self) -> Option<String> {
        self.lock()
            .policy
            .as_ref()
            .map(|p| super::policy::to_toml(&p.policy))
    }

    /// Whether the team policy lets `peer` have a lease of `gpus` for `duration_ms` of
    /// `kind` work now; the error names the rule broken.
    pub fn check_lease(
        &self,
        peer: &PeerId,
        kind: gpunode_protocol::team::JobKind,
        gpus: u32,
        duration_ms: u64,
        now: u64,
    ) -> Result<(), String> {
        let s = self.lock();
        let Some(policy) = &s.policy else {
            return Ok(());
        };
        let (_, _, today, week) = policy.policy.team_time(now);
        let used = self.grants.used(peer, today, week);
        policy
            .policy
            .check(peer, kind, gpus, duration_ms, used, now)
    }

    /// Saves the quota usage if it changed (at every sync tick and when the node stops).
    pub fn save_grants(&self) {
        if let Err(e) = self.grants.save(&grants_file(&self.data_dir)) {
            tracing::warn!("cannot save the team quota usage: {e}");
        }
    }

    /// Counts a lease granted to `peer` against its quotas.
    pub fn record_grant(&self, peer: PeerId, at: u64, gpus: u32, duration_ms: u64) {
        self.grants
            .record(peer, at, (gpus as u64).saturating_mul(duration_ms));
    }

    /// The credit allowance the team policy gives members, millicredits.
    pub fn allowance_millicredits(&self) -> Option<u64> {
        self.lock()
            .policy
            .as_ref()
            .map(|p| (p.policy.allowance * 1000.0).round() as u64)
    }

    /// Whether the policy lets higher-priority work preempt lower-priority leases.
    pub fn preempts(&self) -> bool {
        self.lock()
            .policy
            .as_ref()
            .is_some_and(|p| p.policy.preempt_lower)
    }

    /// Serving priority of `peer`'s work under the policy (its role's).
    pub fn priority_of(&self, peer: &PeerId) -> i32 {
        let s = self.lock();
        let Some(policy) = &s.policy else { return 0 };
        s.members
            .iter()
            .find(|c| c.cert.member == *peer)
            .map_or(0, |c| policy.policy.priority(c.cert.role))
    }

    /// Whether this node's certificate is past half its life.
    fn needs_renewal(&self, now: u64) -> bool {
        let s = self.lock();
        let c = &s.own.cert;
        now >= c.issued_ms + (c.expires_ms.saturating_sub(c.issued_ms)) / 2
    }

    /// Renews this node's certificate itself (it holds the team key). Returns whether it
    /// did.
    fn renew_self(&self, now: u64) -> bool {
        let Some(tk) = &self.team_key else {
            return false;
        };
        let mut s = self.lock();
        let (member, role) = (s.own.cert.member, s.own.cert.role);
        match s.issue(member, role, &self.node_key, Some(tk), now) {
            Ok(cert) => {
                let _ = s.admit(cert, now);
                let state = s.clone();
                drop(s);
                let _ = self.changed(&state);
                true
            }
            Err(_) => false,
        }
    }

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

    /// Recomputes who may connect (certificates and invites expire).
    fn tick(&self) -> Option<HashSet<PeerId>> {
        let s = self.lock().clone();
        self.recompute(&s)
    }
}

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

/// Runs the team's upkeep until `stop`: who may connect as certificates and invites
/// expire, renewal of this member's certificate, sync with members, quota use saved.
pub async fn run(team: Arc<Team>, link: PeerLink, mut stop: watch::Receiver<bool>) {
    link.client().set_team_allowed(team.allowed()).await;
    let mut every = tokio::time::interval(SYNC_EVERY);
    loop {
        tokio::select! {
            _ = every.tick() => {
                team.save_grants();
                if let Some(allowed) = team.tick() {
                    link.client().set_team_allowed(allowed).await;
                }
                if team.needs_renewal(now_ms()) && !team.renew_self(now_ms()) {
                    let (t, n) = (team.clone(), link.clone());
                    tokio::spawn(async move { renew_from_admin(&t, &n).await });
                }
                let (t, n) = (team.clone(), link.clone());
                tokio::spawn(async move { sync_with_members(&t, &n).await });
            }
            _ = stop.changed() => {
                team.save_grants();
                return;
            }
        }
    }
}

/// Where the team quota usage is saved.
fn grants_file(data_dir: &std::path::Path) -> PathBuf {
    super::team_dir(data_dir).join("grants")
}

async fn serve_join(team: &Team, link: &PeerLink, peer: PeerId, stream: Stream) {
    let (mut r, mut w) = AsyncReadExt::split(stream);
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
    // Only now: a spent invite's join identity is dropped with this, after its answer.
    if let Some(a) = allowed {
        link.client().set_team_allowed(a).await;
    }
    if matches!(reply, JoinReply::Admitted { .. }) {
        sync_with_members(team, link).await;
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
async fn renew_from_admin(team: &Team, link: &PeerLink) {
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
            if let Some(a) = allowed {
                link.client().set_team_allowed(a).await;
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
            if let Some(a) = team.merge(sync) {
                link.client().set_team_allowed(a).await;
            }
            let _ = framing::write_message(&mut w, &team.sync_msg()).await;
            let _ = w.flush().await;
        }
        Err(e) => tracing::debug!(%peer, "bad team sync: {e}"),
    }
    let _ = w.close().await;
}

/// Tells every connected member what we know and takes what they know.
pub(crate) async fn sync_with_members(team: &Team, link: &PeerLink) {
    let connected = link.connected_peers().await;
    let team_id = team.lock().team;
    let members: HashSet<PeerId> = team.lock().members.iter().map(|c| c.cert.member).collect();
    let allowed = team.allowed();
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
            if let Some(a) = team.merge(reply) {
                link.client().set_team_allowed(a).await;
            }
        }
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
        if let Some(a) = allowed {
            self.link.client().set_team_allowed(a).await;
        }
        Ok(token)
    }

    /// Admits a known peer id without a token (admins only) and tells the members.
    pub async fn add(&self, peer: PeerId, role: Role) -> Result<(), TeamOpError> {
        let team = self.team.clone();
        if let Some(a) = team.add(peer, role)? {
            self.link.client().set_team_allowed(a).await;
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
        if let Some(a) = team.revoke(peer)? {
            self.link.client().set_team_allowed(a).await;
        }
        sync_with_members(&team, &self.link).await;
        Ok(())
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

impl TeamService {
    /// The team as `gpunode team members` shows it.
    pub async fn view(&self) -> TeamView {
        let connected: HashSet<PeerId> = self.link.connected_peers().await.into_iter().collect();
        TeamView::of(&self.team.state(), &connected)
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
