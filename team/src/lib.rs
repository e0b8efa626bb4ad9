//! Private teams: this node's membership, the members and revocations it knows, the
//! invites it issued, and who may connect.
//!
//! A node in a team only lets peers with a valid, unrevoked certificate of its team
//! connect (libp2p's allow-list drops anyone else right after the handshake, before any
//! protocol runs), runs Kademlia under the team's own protocol name, and admits the
//! *join identity* of each open invite so a joiner can reach it. State lives in
//! `DATA_DIR/team/` (mode 0700, files 0600): the team key (creator only) and the state
//! file. [`policy`] reads and applies the team policy (quotas, priorities, windows).
//!
//! This crate is the team's state and rules, without a network: it uses
//! `gpunode-protocol` and never the node. The node's `team` module serves joins, syncs
//! members and renews certificates on top of it.

pub mod policy;

use std::collections::HashSet;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use gpunode_protocol::encoding;
use gpunode_protocol::team::{
    Certificate, InviteToken, Revocations, Role, SignedCertificate, SignedRevocations, TeamId,
    TEAM_VERSION,
};
use gpunode_protocol::time::UnixMillis;
use libp2p::identity::Keypair;
use libp2p::{PeerId, StreamProtocol};
use serde::{Deserialize, Serialize};

/// How long certificates last; members renew them at half life.
pub const CERT_LIFETIME_MS: u64 = 30 * 24 * 3600 * 1000;
/// Largest state file read.
const MAX_STATE_BYTES: usize = 16 << 20;

/// Why a team operation failed.
#[derive(Debug, thiserror::Error)]
pub enum TeamOpError {
    /// Reading or writing the team files.
    #[error("team files in {path}: {message}")]
    Files {
        /// The directory.
        path: PathBuf,
        /// What failed.
        message: String,
    },
    /// This node is in no team.
    #[error("this node is in no team; create one (gpunode team create NAME) or join one (gpunode team join TOKEN)")]
    NoTeam,
    /// Already in a team.
    #[error("this node is already in team {0}; leave it first (gpunode team leave)")]
    AlreadyInTeam(String),
    /// Something only admins may do.
    #[error("only a team admin can do that")]
    NotAdmin,
    /// A team structure was refused.
    #[error(transparent)]
    Team(#[from] gpunode_protocol::team::TeamError),
    /// Anything else the user must fix.
    #[error("{0}")]
    Invalid(String),
}

/// An invite this node issued.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Invite {
    /// The join identity the token's secret stands for.
    pub join_peer: PeerId,
    /// The role joiners get.
    pub role: Role,
    /// Joins left.
    pub uses_left: u32,
    /// When it stops working.
    pub expires_ms: UnixMillis,
}

/// Everything this node knows about its team.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TeamState {
    /// Name given at creation (local only).
    pub name: String,
    /// The team.
    pub team: TeamId,
    /// The team's public key (protobuf).
    pub team_key: Vec<u8>,
    /// This node's certificate.
    pub own: SignedCertificate,
    /// The newest certificate of every member known (this node's included).
    pub members: Vec<SignedCertificate>,
    /// The newest revocation list of each issuer (the team key, admins); a peer is
    /// revoked when any of them names it.
    pub revocations: Vec<SignedRevocations>,
    /// Invites this node issued that may still be used.
    pub invites: Vec<Invite>,
    /// Members' addresses to dial at start (from the invite token).
    pub bootstrap: Vec<String>,
    /// The newest team policy known.
    pub policy: Option<gpunode_protocol::team::SignedPolicy>,
}

/// The most revocation lists kept (one per issuer: the team key and each admin).
pub const MAX_REVOCATION_LISTS: usize = 256;

/// [`TeamState`] as saved before revocation lists were kept per issuer.
#[derive(Deserialize)]
struct LegacyTeamState {
    name: String,
    team: TeamId,
    team_key: Vec<u8>,
    own: SignedCertificate,
    members: Vec<SignedCertificate>,
    revocations: Option<SignedRevocations>,
    invites: Vec<Invite>,
    bootstrap: Vec<String>,
    policy: Option<gpunode_protocol::team::SignedPolicy>,
}

impl From<LegacyTeamState> for TeamState {
    fn from(l: LegacyTeamState) -> Self {
        TeamState {
            name: l.name,
            team: l.team,
            team_key: l.team_key,
            own: l.own,
            members: l.members,
            revocations: l.revocations.into_iter().collect(),
            invites: l.invites,
            bootstrap: l.bootstrap,
            policy: l.policy,
        }
    }
}

/// The team's directory in a data dir.
pub fn team_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("team")
}

fn files_error(dir: &Path, e: impl std::fmt::Display) -> TeamOpError {
    TeamOpError::Files {
        path: dir.to_path_buf(),
        message: e.to_string(),
    }
}

/// Writes `bytes` to `path` atomically with mode 0600.
fn write_private(dir: &Path, path: &Path, bytes: &[u8]) -> Result<(), TeamOpError> {
    std::fs::create_dir_all(dir).map_err(|e| files_error(dir, e))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| files_error(dir, e))?;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| files_error(dir, e))?;
    f.write_all(bytes).map_err(|e| files_error(dir, e))?;
    f.sync_all().map_err(|e| files_error(dir, e))?;
    std::fs::rename(&tmp, path).map_err(|e| files_error(dir, e))
}

impl TeamState {
    /// Creates a team: a new team key (saved 0600) and an admin certificate for this node.
    pub fn create(
        data_dir: &Path,
        name: &str,
        node_key: &Keypair,
        now: UnixMillis,
    ) -> Result<TeamState, TeamOpError> {
        let dir = team_dir(data_dir);
        if let Some(existing) = TeamState::load(data_dir)? {
            return Err(TeamOpError::AlreadyInTeam(existing.team.to_string()));
        }
        if name.trim().is_empty() || name.len() > 64 {
            return Err(TeamOpError::Invalid(
                "a team name must be 1 to 64 characters".into(),
            ));
        }
        let team_key = Keypair::generate_ed25519();
        let public = team_key.public().encode_protobuf();
        let team = TeamId::of_key(&public);
        let own = SignedCertificate::by_team(
            Certificate {
                version: TEAM_VERSION,
                team,
                member: node_key.public().to_peer_id(),
                role: Role::Admin,
                issuer: team_key.public().to_peer_id(),
                serial: rand::random(),
                issued_ms: now,
                expires_ms: now + CERT_LIFETIME_MS,
            },
            &team_key,
        )?;
        let secret = team_key
            .to_protobuf_encoding()
            .map_err(|e| TeamOpError::Invalid(e.to_string()))?;
        write_private(&dir, &dir.join("team.key"), &secret)?;
        let state = TeamState {
            name: name.trim().to_string(),
            team,
            team_key: public,
            members: vec![own.clone()],
            own,
            revocations: Vec::new(),
            invites: Vec::new(),
            bootstrap: Vec::new(),
            policy: None,
        };
        state.save(data_dir)?;
        Ok(state)
    }

    /// The team state saved in `data_dir`, if this node is in a team.
    pub fn load(data_dir: &Path) -> Result<Option<TeamState>, TeamOpError> {
        let dir = team_dir(data_dir);
        let path = dir.join("state");
        match std::fs::read(&path) {
            Ok(bytes) => encoding::decode(&bytes, MAX_STATE_BYTES)
                .or_else(|e| {
                    // A state saved before revocation lists were merged.
                    encoding::decode::<LegacyTeamState>(&bytes, MAX_STATE_BYTES)
                        .map(TeamState::from)
                        .map_err(|_| e)
                })
                .map(Some)
                .map_err(|e| files_error(&dir, format!("{} does not decode: {e}", path.display()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(files_error(&dir, e)),
        }
    }

    /// Saves the state (0600, atomically).
    pub fn save(&self, data_dir: &Path) -> Result<(), TeamOpError> {
        let dir = team_dir(data_dir);
        write_private(&dir, &dir.join("state"), &encoding::encode(self))
    }

    /// The team key, on the node that created the team.
    pub fn team_keypair(data_dir: &Path) -> Result<Option<Keypair>, TeamOpError> {
        let dir = team_dir(data_dir);
        match std::fs::read(dir.join("team.key")) {
            Ok(bytes) => Keypair::from_protobuf_encoding(&bytes)
                .map(Some)
                .map_err(|e| files_error(&dir, format!("team.key does not decode: {e}"))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(files_error(&dir, e)),
        }
    }

    /// Leaves the team: removes the team files.
    pub fn leave(data_dir: &Path) -> Result<(), TeamOpError> {
        let dir = team_dir(data_dir);
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(TeamOpError::NoTeam),
            Err(e) => Err(files_error(&dir, e)),
        }
    }

    /// Protocol name of the team's Kademlia.
    pub fn kad_protocol(&self) -> StreamProtocol {
        team_protocol(&self.team, "kad")
    }

    /// Whether `peer` is revoked (by any issuer's list).
    pub fn is_revoked(&self, peer: &PeerId) -> bool {
        self.revocations.iter().any(|r| r.contains(peer))
    }

    /// Checks a certificate as [`SignedCertificate::verify`] does, and that the admin
    /// who signed it (if not the team key) is not revoked: a revoked admin's
    /// signatures stop counting at once.
    pub fn check_cert(&self, cert: &SignedCertificate, now: UnixMillis) -> Result<(), TeamOpError> {
        cert.verify(&self.team, &self.team_key, now)?;
        self.check_issuer(&cert.cert.issuer, cert.issuer_cert.is_some())
    }

    /// Refuses a document signed by an admin who is revoked.
    fn check_issuer(&self, issuer: &PeerId, by_admin: bool) -> Result<(), TeamOpError> {
        if by_admin && self.is_revoked(issuer) {
            return Err(TeamOpError::Invalid(format!(
                "it is signed by {issuer}, an admin whose membership is revoked"
            )));
        }
        Ok(())
    }

    /// Whether `peer` is a member now: a valid certificate whose issuer is not revoked,
    /// and not revoked itself. What every team handler asks before serving a peer.
    pub fn is_member(&self, peer: &PeerId, now: UnixMillis) -> bool {
        !self.is_revoked(peer)
            && self
                .members
                .iter()
                .any(|c| c.cert.member == *peer && self.check_cert(c, now).is_ok())
    }

    /// The members now: [`TeamState::is_member`] of every peer with a certificate.
    pub fn members_now(&self, now: UnixMillis) -> HashSet<PeerId> {
        self.members
            .iter()
            .filter(|c| self.check_cert(c, now).is_ok())
            .map(|c| c.cert.member)
            .filter(|p| !self.is_revoked(p))
            .collect()
    }

    /// Peers that may connect now: members with a valid, unrevoked certificate, and the
    /// join identities of invites that still have uses and have not expired.
    pub fn allowed(&self, now: UnixMillis) -> HashSet<PeerId> {
        let mut allowed = self.members_now(now);
        allowed.extend(
            self.invites
                .iter()
                .filter(|i| i.expires_ms >= now && i.uses_left > 0)
                .map(|i| i.join_peer),
        );
        allowed
    }

    /// Adds or refreshes a member's certificate if it is valid and newer than the one
    /// known. Returns whether anything changed.
    pub fn admit(&mut self, cert: SignedCertificate, now: UnixMillis) -> Result<bool, TeamOpError> {
        self.check_cert(&cert, now)?;
        let member = cert.cert.member;
        match self.members.iter_mut().find(|c| c.cert.member == member) {
            Some(known) if known.cert.issued_ms >= cert.cert.issued_ms => Ok(false),
            Some(known) => {
                *known = cert.clone();
                if member == self.own.cert.member {
                    self.own = cert;
                }
                Ok(true)
            }
            None => {
                self.members.push(cert);
                Ok(true)
            }
        }
    }

    /// Takes a revocation list if it is valid, its issuer is not revoked, and it is
    /// newer than the one known from the same issuer. Lists of different issuers are
    /// all kept (merged), so two admins revoking at once lose nothing; the lists of an
    /// admin revoked later stay as they were (what it revoked before stays revoked) but
    /// it can sign no new one. Returns whether it was taken.
    pub fn apply_revocations(
        &mut self,
        list: SignedRevocations,
        now: UnixMillis,
    ) -> Result<bool, TeamOpError> {
        list.verify(&self.team, &self.team_key, now)?;
        self.check_issuer(&list.list.issuer, list.issuer_cert.is_some())?;
        let full = self.revocations.len() >= MAX_REVOCATION_LISTS;
        match self
            .revocations
            .iter_mut()
            .find(|r| r.list.issuer == list.list.issuer)
        {
            Some(known) if known.list.seq >= list.list.seq => Ok(false),
            Some(known) => {
                *known = list;
                Ok(true)
            }
            None if full => Err(TeamOpError::Invalid(format!(
                "more than {MAX_REVOCATION_LISTS} admins' revocation lists"
            ))),
            None => {
                self.revocations.push(list);
                Ok(true)
            }
        }
    }

    /// Takes a policy if it is valid and newer. Returns whether it was taken.
    pub fn apply_policy(
        &mut self,
        policy: gpunode_protocol::team::SignedPolicy,
        now: UnixMillis,
    ) -> Result<bool, TeamOpError> {
        policy.verify(&self.team, &self.team_key, now)?;
        self.check_issuer(&policy.policy.issuer, policy.issuer_cert.is_some())?;
        // A policy signed by an admin revoked since is replaced by any valid one.
        if self.policy.as_ref().is_some_and(|p| {
            p.policy.seq >= policy.policy.seq
                && !(p.issuer_cert.is_some() && self.is_revoked(&p.policy.issuer))
        }) {
            return Ok(false);
        }
        self.policy = Some(policy);
        Ok(true)
    }

    /// Signs a certificate for `member`: with the team key when this node holds it,
    /// otherwise as an admin.
    pub fn issue(
        &self,
        member: PeerId,
        role: Role,
        node_key: &Keypair,
        team_key: Option<&Keypair>,
        now: UnixMillis,
    ) -> Result<SignedCertificate, TeamOpError> {
        self.issue_for(member, role, node_key, team_key, now, CERT_LIFETIME_MS)
    }

    /// [`TeamState::issue`] with a chosen lifetime.
    pub fn issue_for(
        &self,
        member: PeerId,
        role: Role,
        node_key: &Keypair,
        team_key: Option<&Keypair>,
        now: UnixMillis,
        lifetime_ms: u64,
    ) -> Result<SignedCertificate, TeamOpError> {
        if self.is_revoked(&member) {
            return Err(TeamOpError::Invalid(format!(
                "{member} is revoked from this team"
            )));
        }
        let mut cert = Certificate {
            version: TEAM_VERSION,
            team: self.team,
            member,
            role,
            issuer: node_key.public().to_peer_id(),
            serial: rand::random(),
            issued_ms: now,
            expires_ms: now + lifetime_ms,
        };
        if let Some(tk) = team_key {
            cert.issuer = tk.public().to_peer_id();
            return Ok(SignedCertificate::by_team(cert, tk)?);
        }
        if self.own.cert.role != Role::Admin
            || self.own.issuer_cert.is_some()
            || self.is_revoked(&self.own.cert.member)
        {
            return Err(TeamOpError::NotAdmin);
        }
        Ok(SignedCertificate::by_admin(
            cert,
            node_key,
            self.own.clone(),
        )?)
    }

    /// Makes an invite token (admins only) and remembers its join identity.
    pub fn invite(
        &mut self,
        role: Role,
        uses: u32,
        expires_ms: UnixMillis,
        bootstrap: Vec<String>,
        node_key: &Keypair,
        holds_team_key: bool,
    ) -> Result<InviteToken, TeamOpError> {
        if self.own.cert.role != Role::Admin {
            return Err(TeamOpError::NotAdmin);
        }
        if role == Role::Admin && !holds_team_key {
            return Err(TeamOpError::Invalid(
                "only the node holding the team key can invite admins".into(),
            ));
        }
        if uses == 0 {
            return Err(TeamOpError::Invalid("--uses must be at least 1".into()));
        }
        let token = InviteToken {
            version: TEAM_VERSION,
            team: self.team,
            team_key: self.team_key.clone(),
            bootstrap,
            secret: InviteToken::fresh_secret(),
            inviter: node_key.public().to_peer_id(),
            role,
            expires_ms,
        };
        self.invites.push(Invite {
            join_peer: token.join_keypair()?.public().to_peer_id(),
            role,
            uses_left: uses,
            expires_ms,
        });
        Ok(token)
    }

    /// Spends one use of the invite whose join identity is `join_peer`.
    pub fn use_invite(&mut self, join_peer: &PeerId, now: UnixMillis) -> Result<Role, String> {
        let invite = self
            .invites
            .iter_mut()
            .find(|i| i.join_peer == *join_peer)
            .ok_or("this invite is unknown here (already used up, or issued by another member)")?;
        if invite.expires_ms < now {
            return Err("this invite has expired; ask an admin for a new one".into());
        }
        if invite.uses_left == 0 {
            return Err("this invite is used up; ask an admin for a new one".into());
        }
        invite.uses_left -= 1;
        let role = invite.role;
        // A spent invite's join identity stops being let in at once.
        self.invites
            .retain(|i| i.expires_ms >= now && i.uses_left > 0);
        Ok(role)
    }

    /// Revokes `peer` (admins only): a new signed list with a higher sequence number.
    pub fn revoke(
        &mut self,
        peer: PeerId,
        node_key: &Keypair,
        team_key: Option<&Keypair>,
        now: UnixMillis,
    ) -> Result<SignedRevocations, TeamOpError> {
        if self.own.cert.role != Role::Admin || self.is_revoked(&self.own.cert.member) {
            return Err(TeamOpError::NotAdmin);
        }
        if peer == self.own.cert.member {
            return Err(TeamOpError::Invalid(
                "a node cannot revoke itself; use gpunode team leave".into(),
            ));
        }
        // This issuer's new list carries every revocation known, so it stands alone.
        let mut revoked: Vec<(PeerId, UnixMillis)> = Vec::new();
        for (p, at) in self.revocations.iter().flat_map(|r| r.list.revoked.iter()) {
            if !revoked.iter().any(|(q, _)| q == p) {
                revoked.push((*p, *at));
            }
        }
        if !revoked.iter().any(|(p, _)| *p == peer) {
            revoked.push((peer, now));
        }
        let (issuer, key, issuer_cert) = match team_key {
            Some(tk) => (tk.public().to_peer_id(), tk, None),
            None => (
                node_key.public().to_peer_id(),
                node_key,
                Some(self.own.clone()),
            ),
        };
        let seq = self
            .revocations
            .iter()
            .find(|r| r.list.issuer == issuer)
            .map_or(1, |r| r.list.seq + 1);
        let signed = SignedRevocations::sign(
            Revocations {
                team: self.team,
                seq,
                revoked,
                issuer,
            },
            key,
            issuer_cert,
        )?;
        match self
            .revocations
            .iter_mut()
            .find(|r| r.list.issuer == issuer)
        {
            Some(known) => *known = signed.clone(),
            None => self.revocations.push(signed.clone()),
        }
        Ok(signed)
    }
}

/// A team-scoped protocol name.
pub fn team_protocol(team: &TeamId, what: &str) -> StreamProtocol {
    StreamProtocol::try_from_owned(format!("/gpunode/team/{}/{what}/1.0.0", team.short()))
        .unwrap_or(StreamProtocol::new("/gpunode/team/invalid/1.0.0"))
}

#[cfg(test)]
#[path = "team_tests.rs"]
mod tests;
