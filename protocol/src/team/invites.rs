//! Joining a team: the invite token (team, key, addresses, one-time secret, as one
//! string with a checksum), the join request proving the secret, the inviter's reply,
//! and the sync message members exchange.

use libp2p_identity::{Keypair, PeerId};
use serde::{Deserialize, Serialize};

use super::{
    Role, SignedCertificate, SignedPolicy, SignedRevocations, TeamError, TeamId,
    MAX_TEAM_MESSAGE_BYTES, TEAM_VERSION, TOKEN_PREFIX,
};
use crate::encoding;
use crate::signing;
use crate::time::UnixMillis;

/// An invitation to join a team.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InviteToken {
    /// Format version.
    pub version: u16,
    /// The team.
    pub team: TeamId,
    /// The team's public key (protobuf), so the joiner can check what it is given.
    pub team_key: Vec<u8>,
    /// Members to contact, as multiaddrs with `/p2p/PEER_ID`.
    pub bootstrap: Vec<String>,
    /// The one-time secret: the seed of the ed25519 *join identity*. The inviter lets that
    /// identity (and nobody else without a certificate) connect; the joiner connects as
    /// it, proves its own node key, and gets a certificate for its own peer id.
    pub secret: [u8; 32],
    /// The member that issued it (and will check the secret).
    pub inviter: PeerId,
    /// The role the joiner gets.
    pub role: Role,
    /// When it stops working.
    pub expires_ms: UnixMillis,
}

impl InviteToken {
    /// The token as one string: prefix, then base64url of the bytes and a 4-byte checksum.
    pub fn encode(&self) -> String {
        use base64::Engine;
        let mut bytes = encoding::encode(self);
        let sum = blake3::hash(&bytes);
        bytes.extend_from_slice(&sum.as_bytes()[..4]);
        format!(
            "{TOKEN_PREFIX}{}",
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
        )
    }

    /// Reads a token pasted by a user; the error says what is wrong with it.
    pub fn decode(text: &str) -> Result<InviteToken, TeamError> {
        use base64::Engine;
        let text = text.trim();
        let body = text.strip_prefix(TOKEN_PREFIX).ok_or_else(|| {
            TeamError::Malformed(format!(
                "not a gpunode invite token: it should start with '{TOKEN_PREFIX}' (as `gpunode team invite` prints)"
            ))
        })?;
        let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(body)
            .map_err(|_| {
                TeamError::Malformed(
                    "the invite token is damaged (not base64url); copy it again, whole".into(),
                )
            })?;
        if bytes.len() < 5 {
            return Err(TeamError::Malformed(
                "the invite token is truncated; copy it again, whole".into(),
            ));
        }
        let (payload, sum) = bytes.split_at(bytes.len() - 4);
        if blake3::hash(payload).as_bytes()[..4] != *sum {
            return Err(TeamError::Malformed(
                "the invite token is truncated or altered (checksum mismatch); copy it again, whole"
                    .into(),
            ));
        }
        let token: InviteToken = encoding::decode(payload, MAX_TEAM_MESSAGE_BYTES)
            .map_err(|e| TeamError::Malformed(format!("the invite token does not decode: {e}")))?;
        if token.version != TEAM_VERSION {
            return Err(TeamError::Malformed(format!(
                "invite token version {} is not supported by this gpunode",
                token.version
            )));
        }
        if TeamId::of_key(&token.team_key) != token.team {
            return Err(TeamError::BadSignature(
                "the invite token's team key does not match its team id (forged token)".into(),
            ));
        }
        Ok(token)
    }

    /// Checks expiry at `now`.
    pub fn check_fresh(&self, now: UnixMillis) -> Result<(), TeamError> {
        if self.expires_ms < now {
            return Err(TeamError::Expired(format!(
                "the invite token expired at {} (unix ms); ask an admin for a new one",
                self.expires_ms
            )));
        }
        Ok(())
    }

    /// The join identity the secret stands for.
    pub fn join_keypair(&self) -> Result<Keypair, TeamError> {
        let mut seed = self.secret;
        Keypair::ed25519_from_bytes(&mut seed)
            .map_err(|_| TeamError::Malformed("the invite secret is not a valid key seed".into()))
    }

    /// A fresh invite: a new random join identity.
    pub fn fresh_secret() -> [u8; 32] {
        rand::random()
    }
}

/// Domain tag of a joiner's proof of its node key.
pub const JOIN_SIGNING_TAG: &[u8] = b"gpunode/team-join/v1\0";

/// What a joiner sends over its join identity's connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinRequest {
    /// The team.
    pub team: TeamId,
    /// The joiner's own peer id (what the certificate will name).
    pub member: PeerId,
    /// Signature by the joiner's node key over the team and the join identity's peer id,
    /// so nobody can have a certificate issued to a peer id it does not hold.
    pub proof: Vec<u8>,
}

impl JoinRequest {
    fn proof_body(team: &TeamId, join_peer: &PeerId) -> Vec<u8> {
        let mut b = team.0.to_vec();
        b.extend_from_slice(&join_peer.to_bytes());
        b
    }

    /// A request for `node_key`'s peer id, made over `join_peer`'s connection.
    pub fn new(
        team: TeamId,
        node_key: &Keypair,
        join_peer: &PeerId,
    ) -> Result<JoinRequest, TeamError> {
        Ok(JoinRequest {
            team,
            member: node_key.public().to_peer_id(),
            proof: signing::sign(
                node_key,
                JOIN_SIGNING_TAG,
                &Self::proof_body(&team, join_peer),
            )?,
        })
    }

    /// Checks the proof, for a request that arrived from `join_peer`.
    pub fn verify(&self, join_peer: &PeerId) -> Result<(), TeamError> {
        let key = signing::public_key_of(&self.member)?;
        signing::verify(
            &key,
            JOIN_SIGNING_TAG,
            &Self::proof_body(&self.team, join_peer),
            &self.proof,
        )
        .map_err(|_| {
            TeamError::BadSignature("the joiner's proof of its node key does not verify".into())
        })
    }
}

/// The inviter's answer.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum JoinReply {
    /// Welcome: the certificate, the members known to the inviter and the revocations.
    Admitted {
        /// The joiner's certificate.
        cert: SignedCertificate,
        /// Everyone's certificates.
        members: Vec<SignedCertificate>,
        /// The newest revocation list of each issuer (they are merged).
        revocations: Vec<SignedRevocations>,
        /// The current team policy, if any.
        policy: Option<SignedPolicy>,
    },
    /// Refused, with the reason.
    Refused(String),
}

/// What members tell each other: the certificates, revocations and policy they know.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TeamSync {
    /// The team.
    pub team: TeamId,
    /// Certificates known to the sender.
    pub certs: Vec<SignedCertificate>,
    /// The newest revocation list of each issuer known to the sender.
    pub revocations: Vec<SignedRevocations>,
    /// The newest policy known to the sender.
    pub policy: Option<SignedPolicy>,
}
