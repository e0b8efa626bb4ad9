//! Revocation lists: the peers an admin (or the team key) revoked, signed.

use libp2p_identity::{Keypair, PeerId};
use serde::{Deserialize, Serialize};

use super::certificates::verify_by_team_or_admin;
use super::{check_team, SignedCertificate, TeamError, TeamId, REVOCATION_SIGNING_TAG};
use crate::encoding;
use crate::signing;
use crate::time::UnixMillis;

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
