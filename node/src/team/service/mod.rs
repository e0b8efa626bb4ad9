//! The team side of a running node: answers joins on the join identity of an open
//! invite, keeps certificates and revocations in sync with connected members, and tells
//! the event loop who may connect (members with valid, unrevoked certificates and open
//! invites' join identities; everyone else is dropped, their leases cancelled).
//!
//! This module holds [`Team`], the shared team state of a running node, and [`run`], its
//! upkeep; `streams` serves and makes the team's exchanges (join, sync, renewal) and
//! `admin` holds what admins and members ask through the node ([`TeamService`]).

mod admin;
mod streams;

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpunode_protocol::team::TeamSync;
use gpunode_protocol::time::now_ms;
use libp2p::identity::Keypair;
use libp2p::PeerId;
use tokio::sync::watch;

use super::{TeamOpError, TeamState};
use crate::loop_client::PeerLink;
use streams::{renew_from_admin, sync_with_members};

pub use admin::{MemberView, QuotaUse, TeamService, TeamView};
pub use streams::{TeamStream, TeamStreams, TEAM_STREAM_LIMITS};

/// How often members compare what they know (revocations reach everyone within about
/// twice this).
pub const SYNC_EVERY: Duration = Duration::from_secs(5);
/// Right after start, how often a member tries its first sync until another member
/// answers (for at most [`SYNC_EVERY`] times six).
const FIRST_SYNC_RETRY: Duration = Duration::from_millis(200);

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
    /// Held while the allowed set is sent to the event loop (see [`Team::publish_allowed`]).
    publishing: tokio::sync::Mutex<()>,
    /// Join identities whose answer is on its way: still let in until the joiner has
    /// read it, whatever is published meanwhile (at most one per live invite, as only
    /// those identities can connect to join).
    answering: Mutex<HashSet<PeerId>>,
}

/// Keeps a join identity let in while its answer is on its way; see [`Team::answering`].
pub(crate) struct Answering<'a> {
    team: &'a Team,
    peer: PeerId,
}

impl Drop for Answering<'_> {
    fn drop(&mut self) {
        self.team
            .answering
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.peer);
    }
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
            publishing: tokio::sync::Mutex::new(()),
            answering: Mutex::default(),
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

    /// Tells the event loop who may connect: the set as it is when sent, one sender at a
    /// time, so an older set never lands after a newer one. (A join's answer waits for
    /// the joiner before its spent identity is dropped; an invite made meanwhile must
    /// not be undone by the set computed before it.)
    pub(crate) async fn publish_allowed(&self, link: &PeerLink) {
        let _one_at_a_time = self.publishing.lock().await;
        let mut peers = self.allowed();
        peers.extend(
            self.answering
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .copied(),
        );
        link.client().set_team_allowed(peers).await;
    }

    /// Lets the join identity `peer` in, whatever is published, until the guard drops:
    /// its answer is on its way.
    pub(crate) fn answering(&self, peer: PeerId) -> Answering<'_> {
        self.answering
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(peer);
        Answering { team: self, peer }
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

    /// What this provider granted `peer` today and this week, and its quota.
    pub fn quota_use(&self, peer: &PeerId, now: u64) -> admin::QuotaUse {
        let s = self.lock();
        let Some(policy) = &s.policy else {
            // No policy: days and weeks in UTC, no limits.
            let days = now / 86_400_000;
            let (today, week) = (days * 86_400_000, (days - (days + 3) % 7) * 86_400_000);
            let used = self.grants.used(peer, today, week);
            return admin::QuotaUse {
                today_gpu_hours: used.today_gpu_ms as f64 / 3_600_000.0,
                week_gpu_hours: used.week_gpu_ms as f64 / 3_600_000.0,
                ..admin::QuotaUse::default()
            };
        };
        let (_, _, today, week) = policy.policy.team_time(now);
        let used = self.grants.used(peer, today, week);
        let quota = policy.policy.quota_of(peer);
        admin::QuotaUse {
            today_gpu_hours: used.today_gpu_ms as f64 / 3_600_000.0,
            week_gpu_hours: used.week_gpu_ms as f64 / 3_600_000.0,
            per_day: quota.gpu_hours_per_day,
            per_week: quota.gpu_hours_per_week,
        }
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

    /// Recomputes who may connect (certificates and invites expire).
    fn tick(&self) -> Option<HashSet<PeerId>> {
        let s = self.lock().clone();
        self.recompute(&s)
    }
}

/// Runs the team's upkeep until `stop`: who may connect as certificates and invites
/// expire, renewal of this member's certificate, sync with members, quota use saved.
pub async fn run(team: Arc<Team>, link: PeerLink, mut stop: watch::Receiver<bool>) {
    team.publish_allowed(&link).await;
    // A member that has just started learns what changed while it was away (members
    // who joined since, above all: until then it turns them away) as soon as it reaches
    // another member, not a round later.
    let (t, n, mut s) = (team.clone(), link.clone(), stop.clone());
    tokio::spawn(async move {
        let give_up = tokio::time::Instant::now() + SYNC_EVERY * 6;
        while !*s.borrow() && tokio::time::Instant::now() < give_up {
            if sync_with_members(&t, &n).await > 0 {
                return;
            }
            tokio::select! {
                _ = tokio::time::sleep(FIRST_SYNC_RETRY) => {}
                _ = s.changed() => return,
            }
        }
    });
    let mut every = tokio::time::interval(SYNC_EVERY);
    loop {
        tokio::select! {
            _ = every.tick() => {
                team.save_grants();
                if team.tick().is_some() {
                    team.publish_allowed(&link).await;
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
