//! Teams: what makes a private network verifiable without a server.
//!
//! A team is named by its **team key** (an ed25519 key made by `gpunode team create`):
//! the [`TeamId`] is the blake3 hash of its public key. The team key signs
//! **membership certificates** (peer id, role, expiry) directly, or an admin does, with
//! its own node key, showing its own admin certificate signed by the team key (one level
//! of delegation, no more). Admins also sign **revocation lists** and the **team policy**.
//! **Invite tokens** carry the team, the team's public key, addresses of reachable
//! members and a one-time secret, as one copy-pasteable string with a checksum.
//!
//! Everything here is checked against the team id alone, so a node needs no trust in
//! whoever handed it a certificate.
//!
//! `certificates` holds membership certificates, `revocations` revocation lists,
//! `policy` the team policy and `invites` invite tokens and joining; this module
//! holds the team id, roles, errors and the signing tags.

mod certificates;
mod invites;
mod policy;
mod revocations;

pub use certificates::{Certificate, SignedCertificate};
pub use invites::{InviteToken, JoinReply, JoinRequest, TeamSync, JOIN_SIGNING_TAG};
pub use policy::{window_covers, JobKind, Quota, SignedPolicy, TeamPolicy, Used, Window};
pub use revocations::{Revocations, SignedRevocations};

use libp2p_identity::{PeerId, PublicKey};
use serde::{Deserialize, Serialize};

use crate::signing::SignatureError;

/// Domain tag of membership certificates.
pub const CERT_SIGNING_TAG: &[u8] = b"gpunode/team-cert/v1\0";
/// Domain tag of revocation lists.
pub const REVOCATION_SIGNING_TAG: &[u8] = b"gpunode/team-revocations/v1\0";
/// Domain tag of team policies.
pub const POLICY_SIGNING_TAG: &[u8] = b"gpunode/team-policy/v1\0";
/// Version of team structures.
pub const TEAM_VERSION: u16 = 1;
/// Prefix of invite tokens.
pub const TOKEN_PREFIX: &str = "gpunode-invite-1:";
/// Largest encoded certificate, revocation list or token body.
pub const MAX_TEAM_MESSAGE_BYTES: usize = 64 * 1024;

/// A team, named by the hash of its team public key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TeamId(pub [u8; 32]);

impl TeamId {
    /// The id of the team whose public key (protobuf encoding) is `team_key`.
    pub fn of_key(team_key: &[u8]) -> TeamId {
        let mut h = blake3::Hasher::new();
        h.update(b"gpunode/team-id/v1\0");
        h.update(team_key);
        TeamId(*h.finalize().as_bytes())
    }

    /// Short form for protocol names and display (first 8 bytes, hex).
    pub fn short(&self) -> String {
        self.0[..8].iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl std::fmt::Display for TeamId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl std::str::FromStr for TeamId {
    type Err = TeamError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if s.len() != 64 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(TeamError::Malformed(format!(
                "'{s}' is not a team id (64 hex digits, as `gpunode team create` prints)"
            )));
        }
        let mut id = [0u8; 32];
        for (i, chunk) in s.as_bytes().chunks(2).enumerate() {
            let hex = std::str::from_utf8(chunk).unwrap_or("00");
            id[i] = u8::from_str_radix(hex, 16).unwrap_or(0);
        }
        Ok(TeamId(id))
    }
}

/// What a member may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Invite, add, revoke, set the policy.
    Admin,
    /// Use and lend within the team.
    Member,
}

impl std::str::FromStr for Role {
    type Err = TeamError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "admin" => Ok(Role::Admin),
            "member" => Ok(Role::Member),
            other => Err(TeamError::Malformed(format!(
                "unknown role '{other}': use member or admin"
            ))),
        }
    }
}

/// Why a team structure was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TeamError {
    /// Bytes or text that do not decode.
    #[error("{0}")]
    Malformed(String),
    /// For another team.
    #[error("this is for team {found}, not team {expected}")]
    WrongTeam {
        /// The team expected.
        expected: String,
        /// The team it names.
        found: String,
    },
    /// A signature that does not verify, or a signer without the right to sign.
    #[error("{0}")]
    BadSignature(String),
    /// Past its expiry.
    #[error("{0}")]
    Expired(String),
}

impl From<SignatureError> for TeamError {
    fn from(e: SignatureError) -> Self {
        TeamError::BadSignature(e.to_string())
    }
}

/// The team key's peer id (what `issuer` says when the team key signed).
pub fn team_key_peer(team_key: &[u8]) -> Result<PeerId, TeamError> {
    PublicKey::try_decode_protobuf(team_key)
        .map(|k| k.to_peer_id())
        .map_err(|_| TeamError::Malformed("the team public key does not decode".into()))
}

fn check_team(team: &TeamId, team_key: &[u8], found: &TeamId) -> Result<PublicKey, TeamError> {
    if TeamId::of_key(team_key) != *team {
        return Err(TeamError::BadSignature(
            "the team public key does not match the team id".into(),
        ));
    }
    if found != team {
        return Err(TeamError::WrongTeam {
            expected: team.to_string(),
            found: found.to_string(),
        });
    }
    PublicKey::try_decode_protobuf(team_key)
        .map_err(|_| TeamError::Malformed("the team public key does not decode".into()))
}

#[cfg(test)]
#[path = "team_tests.rs"]
mod tests;
