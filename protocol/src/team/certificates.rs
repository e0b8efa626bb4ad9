//! Membership certificates: a peer's role in the team until an expiry, signed by the
//! team key or by an admin showing its own certificate from the team key, and the check
//! that a revocation list or policy was signed by the team key or an admin.

use libp2p_identity::{Keypair, PeerId, PublicKey};
use serde::{Deserialize, Serialize};

use super::{
    check_team, Role, TeamError, TeamId, CERT_SIGNING_TAG, MAX_TEAM_MESSAGE_BYTES, TEAM_VERSION,
};
use crate::encoding;
use crate::signing;
use crate::time::{UnixMillis, MAX_CLOCK_SKEW_MS};

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

pub(super) fn verify_by_team_or_admin(
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
