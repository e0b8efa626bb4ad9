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

use libp2p_identity::{Keypair, PeerId, PublicKey};
use serde::{Deserialize, Serialize};

use crate::encoding;
use crate::signing::{self, SignatureError};
use crate::time::{UnixMillis, MAX_CLOCK_SKEW_MS};

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

/// A membership certificate.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Certificate {
    /// Format version.
    pub version: u16,
    /// The team.
    pub team: TeamId,
    /// The member.
    pub member: PeerId,
    /// Its role.
    pub role: Role,
    /// Who signed it: the team key's peer id, or an admin's.
    pub issuer: PeerId,
    /// Issue number, per issuer (renewals get a new one).
    pub serial: u64,
    /// When it was issued.
    pub issued_ms: UnixMillis,
    /// When it stops being valid.
    pub expires_ms: UnixMillis,
}

/// A certificate with its signature, and the issuer's own admin certificate when the
/// issuer is not the team key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignedCertificate {
    /// The certificate.
    pub cert: Certificate,
    /// The issuer's signature.
    pub signature: Vec<u8>,
    /// The issuer's admin certificate, signed by the team key (absent when the team key
    /// signed).
    pub issuer_cert: Option<Box<SignedCertificate>>,
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

impl SignedCertificate {
    /// Signs `cert` with the team key (issuer must be the team key's peer id).
    pub fn by_team(cert: Certificate, team_key: &Keypair) -> Result<SignedCertificate, TeamError> {
        let signature = signing::sign(team_key, CERT_SIGNING_TAG, &encoding::encode(&cert))?;
        Ok(SignedCertificate {
            cert,
            signature,
            issuer_cert: None,
        })
    }

    /// Signs `cert` as an admin, whose own certificate is `admin_cert`.
    pub fn by_admin(
        cert: Certificate,
        admin_key: &Keypair,
        admin_cert: SignedCertificate,
    ) -> Result<SignedCertificate, TeamError> {
        let signature = signing::sign(admin_key, CERT_SIGNING_TAG, &encoding::encode(&cert))?;
        Ok(SignedCertificate {
            cert,
            signature,
            issuer_cert: Some(Box::new(admin_cert)),
        })
    }

    /// Checks the certificate for `team` (whose public key is `team_key`) at `now`:
    /// the team key signed it, or an admin whose certificate the team key signed did,
    /// and neither has expired.
    pub fn verify(&self, team: &TeamId, team_key: &[u8], now: UnixMillis) -> Result<(), TeamError> {
        let key = check_team(team, team_key, &self.cert.team)?;
        let c = &self.cert;
        if c.version != TEAM_VERSION {
            return Err(TeamError::Malformed(format!(
                "certificate version {} is not supported",
                c.version
            )));
        }
        if c.issued_ms > now.saturating_add(MAX_CLOCK_SKEW_MS) {
            return Err(TeamError::BadSignature(format!(
                "the certificate of {} is dated {} ms in the future, more than the {MAX_CLOCK_SKEW_MS} ms clock skew tolerated",
                c.member,
                c.issued_ms - now
            )));
        }
        if c.expires_ms.saturating_add(MAX_CLOCK_SKEW_MS) < now {
            return Err(TeamError::Expired(format!(
                "the certificate of {} expired at {} (unix ms); it must be renewed by an admin",
                c.member, c.expires_ms
            )));
        }
        let body = encoding::encode(c);
        let team_peer = key.to_peer_id();
        if c.issuer == team_peer {
            if self.issuer_cert.is_some() {
                return Err(TeamError::Malformed(
                    "a certificate signed by the team key carries no issuer certificate".into(),
                ));
            }
            return signing::verify(&key, CERT_SIGNING_TAG, &body, &self.signature).map_err(|_| {
                TeamError::BadSignature("the team key's signature does not verify".into())
            });
        }
        let Some(admin) = &self.issuer_cert else {
            return Err(TeamError::BadSignature(format!(
                "issuer {} is not the team key and shows no admin certificate",
                c.issuer
            )));
        };
        if admin.issuer_cert.is_some() || admin.cert.issuer != team_peer {
            return Err(TeamError::BadSignature(
                "an admin certificate must be signed by the team key itself".into(),
            ));
        }
        if admin.cert.member != c.issuer || admin.cert.role != Role::Admin {
            return Err(TeamError::BadSignature(format!(
                "{} is not an admin of this team",
                c.issuer
            )));
        }
        admin.verify(team, team_key, now)?;
        let issuer_key = signing::public_key_of(&c.issuer)?;
        signing::verify(&issuer_key, CERT_SIGNING_TAG, &body, &self.signature)
            .map_err(|_| TeamError::BadSignature("the admin's signature does not verify".into()))
    }

    /// Decodes a certificate from bytes.
    pub fn decode(bytes: &[u8]) -> Result<SignedCertificate, TeamError> {
        encoding::decode(bytes, MAX_TEAM_MESSAGE_BYTES)
            .map_err(|e| TeamError::Malformed(format!("certificate: {e}")))
    }
}

/// Peers whose membership an admin revoked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Revocations {
    /// The team.
    pub team: TeamId,
    /// Grows with every new list of the same issuer; a node keeps each issuer's
    /// highest and merges the lists of all issuers.
    pub seq: u64,
    /// Revoked peers, with when.
    pub revoked: Vec<(PeerId, UnixMillis)>,
    /// Who signed: the team key's peer id or an admin's.
    pub issuer: PeerId,
}

/// A revocation list with its signature (and the issuer's admin certificate).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignedRevocations {
    /// The list.
    pub list: Revocations,
    /// The issuer's signature.
    pub signature: Vec<u8>,
    /// The issuer's admin certificate when it is not the team key.
    pub issuer_cert: Option<SignedCertificate>,
}

impl SignedRevocations {
    /// Signs `list` with `key`, an admin's (with `issuer_cert`) or the team key (without).
    pub fn sign(
        list: Revocations,
        key: &Keypair,
        issuer_cert: Option<SignedCertificate>,
    ) -> Result<SignedRevocations, TeamError> {
        let signature = signing::sign(key, REVOCATION_SIGNING_TAG, &encoding::encode(&list))?;
        Ok(SignedRevocations {
            list,
            signature,
            issuer_cert,
        })
    }

    /// Checks that the team key or an admin of `team` signed the list.
    pub fn verify(&self, team: &TeamId, team_key: &[u8], now: UnixMillis) -> Result<(), TeamError> {
        let key = check_team(team, team_key, &self.list.team)?;
        let body = encoding::encode(&self.list);
        verify_by_team_or_admin(
            &key,
            &self.list.issuer,
            self.issuer_cert.as_ref(),
            (team, team_key, now),
            REVOCATION_SIGNING_TAG,
            &body,
            &self.signature,
        )
    }

    /// Whether `peer` is on the list.
    pub fn contains(&self, peer: &PeerId) -> bool {
        self.list.revoked.iter().any(|(p, _)| p == peer)
    }
}

fn verify_by_team_or_admin(
    team_pub: &PublicKey,
    issuer: &PeerId,
    issuer_cert: Option<&SignedCertificate>,
    (team, team_key, now): (&TeamId, &[u8], UnixMillis),
    tag: &[u8],
    body: &[u8],
    signature: &[u8],
) -> Result<(), TeamError> {
    if *issuer == team_pub.to_peer_id() {
        return signing::verify(team_pub, tag, body, signature).map_err(|_| {
            TeamError::BadSignature("the team key's signature does not verify".into())
        });
    }
    let Some(cert) = issuer_cert else {
        return Err(TeamError::BadSignature(format!(
            "{issuer} is not the team key and shows no admin certificate"
        )));
    };
    if cert.cert.member != *issuer || cert.cert.role != Role::Admin {
        return Err(TeamError::BadSignature(format!(
            "{issuer} is not an admin of this team"
        )));
    }
    cert.verify(team, team_key, now)?;
    let key = signing::public_key_of(issuer)?;
    signing::verify(&key, tag, body, signature)
        .map_err(|_| TeamError::BadSignature("the admin's signature does not verify".into()))
}

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

/// Interactive work (someone waits for it) or batch work (runs unattended).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobKind {
    /// Someone waits for it.
    #[default]
    Interactive,
    /// Runs unattended.
    Batch,
}

impl std::fmt::Display for JobKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            JobKind::Interactive => "interactive",
            JobKind::Batch => "batch",
        })
    }
}

/// GPU-hour limits.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Quota {
    /// GPU-hours per day (team time), at each provider.
    pub gpu_hours_per_day: Option<f64>,
    /// GPU-hours per week (Monday to Sunday, team time), at each provider.
    pub gpu_hours_per_week: Option<f64>,
}

/// When work of one kind may run: days (0 = Monday .. 6 = Sunday) and minutes of the
/// day, team time; a window whose end is before its start runs past midnight.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Window {
    /// Which work.
    pub kind: JobKind,
    /// Days it starts on.
    pub days: Vec<u8>,
    /// First minute.
    pub start_min: u16,
    /// Minute it ends (exclusive; 1440 = midnight).
    pub end_min: u16,
}

/// The rules an admin sets for the whole team; every member's node enforces them on
/// team requests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TeamPolicy {
    /// The team.
    pub team: TeamId,
    /// Grows with every new policy; nodes keep the highest.
    pub seq: u64,
    /// Who signed it.
    pub issuer: PeerId,
    /// Credits a member may use at each provider before giving back.
    pub allowance: f64,
    /// Serving priority of admins' work.
    pub priority_admin: i32,
    /// Serving priority of members' work.
    pub priority_member: i32,
    /// Whether a waiting request may stop running leases of a lower priority to start
    /// (they are charged only for the time they used).
    pub preempt_lower: bool,
    /// Limits for every member.
    pub quota: Quota,
    /// Limits for named members, instead of `quota`.
    pub member_quotas: Vec<(PeerId, Quota)>,
    /// When each kind of work may run (a kind without windows may run any time).
    pub windows: Vec<Window>,
    /// Team time: minutes east of UTC.
    pub utc_offset_min: i32,
}

/// A policy with its signature (and the issuer's admin certificate).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SignedPolicy {
    /// The policy.
    pub policy: TeamPolicy,
    /// The issuer's signature.
    pub signature: Vec<u8>,
    /// The issuer's admin certificate when it is not the team key.
    pub issuer_cert: Option<SignedCertificate>,
}

impl SignedPolicy {
    /// Signs `policy` with `key`, an admin's (with `issuer_cert`) or the team key (without).
    pub fn sign(
        policy: TeamPolicy,
        key: &Keypair,
        issuer_cert: Option<SignedCertificate>,
    ) -> Result<SignedPolicy, TeamError> {
        let signature = signing::sign(key, POLICY_SIGNING_TAG, &encoding::encode(&policy))?;
        Ok(SignedPolicy {
            policy,
            signature,
            issuer_cert,
        })
    }

    /// Checks that the team key or an admin of `team` signed it.
    pub fn verify(&self, team: &TeamId, team_key: &[u8], now: UnixMillis) -> Result<(), TeamError> {
        let key = check_team(team, team_key, &self.policy.team)?;
        verify_by_team_or_admin(
            &key,
            &self.policy.issuer,
            self.issuer_cert.as_ref(),
            (team, team_key, now),
            POLICY_SIGNING_TAG,
            &encoding::encode(&self.policy),
            &self.signature,
        )
    }
}

/// What a member already used at this provider, GPU-milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Used {
    /// Today (team time).
    pub today_gpu_ms: u64,
    /// This week (team time).
    pub week_gpu_ms: u64,
}

const DAY_MS: i64 = 86_400_000;
const DAY_NAMES: [&str; 7] = ["mon", "tue", "wed", "thu", "fri", "sat", "sun"];

impl TeamPolicy {
    /// Day of the week (0 = Monday), minute of the day, start of today and of this week
    /// (unix ms), all in team time.
    pub fn team_time(&self, now: UnixMillis) -> (u8, u16, UnixMillis, UnixMillis) {
        let local = now as i64 + self.utc_offset_min as i64 * 60_000;
        let days = local.div_euclid(DAY_MS);
        // 1970-01-01 was a Thursday (3).
        let weekday = (days + 3).rem_euclid(7) as u8;
        let minute = (local.rem_euclid(DAY_MS) / 60_000) as u16;
        let offset = self.utc_offset_min as i64 * 60_000;
        let today = (days * DAY_MS - offset).max(0) as u64;
        let week = ((days - weekday as i64) * DAY_MS - offset).max(0) as u64;
        (weekday, minute, today, week)
    }

    /// The quota of `member`.
    pub fn quota_of(&self, member: &PeerId) -> Quota {
        self.member_quotas
            .iter()
            .find(|(p, _)| p == member)
            .map(|(_, q)| *q)
            .unwrap_or(self.quota)
    }

    /// Whether a lease of `gpus` for `duration_ms` of `kind` work by `member` breaks the
    /// policy at `now`; the error names the rule.
    pub fn check(
        &self,
        member: &PeerId,
        kind: JobKind,
        gpus: u32,
        duration_ms: u64,
        used: Used,
        now: UnixMillis,
    ) -> Result<(), String> {
        let (weekday, minute, _, _) = self.team_time(now);
        let windows: Vec<&Window> = self.windows.iter().filter(|w| w.kind == kind).collect();
        if !windows.is_empty() && !windows.iter().any(|w| w.contains(weekday, minute)) {
            let allowed: Vec<String> = windows.iter().map(|w| w.describe()).collect();
            return Err(format!(
                "team policy: {kind} work may run only {} (team time); it is {} {:02}:{:02} now (rule: window)",
                allowed.join(", "),
                DAY_NAMES[weekday as usize % 7],
                minute / 60,
                minute % 60
            ));
        }
        let asked = gpus as f64 * duration_ms as f64 / 3_600_000.0;
        let q = self.quota_of(member);
        for (limit, used_ms, rule) in [
            (q.gpu_hours_per_day, used.today_gpu_ms, "gpu_hours_per_day"),
            (q.gpu_hours_per_week, used.week_gpu_ms, "gpu_hours_per_week"),
        ] {
            if let Some(limit) = limit {
                let used_h = used_ms as f64 / 3_600_000.0;
                if used_h + asked > limit + 1e-9 {
                    return Err(format!(
                        "team policy quota {rule} = {limit}: you have {used_h:.2} GPU-hours at this provider already and this lease asks {asked:.2} (rule: quota.{rule})"
                    ));
                }
            }
        }
        Ok(())
    }

    /// Serving priority of a role.
    pub fn priority(&self, role: Role) -> i32 {
        match role {
            Role::Admin => self.priority_admin,
            Role::Member => self.priority_member,
        }
    }
}

/// Whether a weekly window that starts on `days` at `start_min` and ends at `end_min`
/// (exclusive; an end before the start runs past midnight) covers `minute` of `weekday`
/// (0 = Monday).
pub fn window_covers(days: &[u8], start_min: u16, end_min: u16, weekday: u8, minute: u16) -> bool {
    if start_min < end_min {
        days.contains(&weekday) && minute >= start_min && minute < end_min
    } else {
        let yesterday = (weekday + 6) % 7;
        (days.contains(&weekday) && minute >= start_min)
            || (days.contains(&yesterday) && minute < end_min)
    }
}

impl Window {
    /// Whether the window covers `minute` of `weekday`.
    pub fn contains(&self, weekday: u8, minute: u16) -> bool {
        window_covers(&self.days, self.start_min, self.end_min, weekday, minute)
    }

    /// Like "mon-fri 18:00-09:00".
    pub fn describe(&self) -> String {
        let days: Vec<&str> = self
            .days
            .iter()
            .map(|d| DAY_NAMES[*d as usize % 7])
            .collect();
        format!(
            "{} {:02}:{:02}-{:02}:{:02}",
            days.join(","),
            self.start_min / 60,
            self.start_min % 60,
            self.end_min / 60,
            self.end_min % 60
        )
    }
}

#[cfg(test)]
#[path = "team_tests.rs"]
mod tests;
