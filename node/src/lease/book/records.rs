//! What the book records about a lease: its terms and signatures ([`LeaseRecord`],
//! [`SignedRenewal`]), which side we are on ([`LeaseRole`]), where it stands
//! ([`LeaseState`]), and the [`Change`]s the caller must persist.

use gpunode_protocol::lease::{LeaseId, LeaseTerms, Renewal};
use gpunode_protocol::time::UnixMillis;
use gpunode_protocol::PeerId;
use serde::{Deserialize, Serialize};

/// Which side of a lease this node is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LeaseRole {
    /// We lend.
    Provider,
    /// We use.
    Requester,
}

/// Where a lease stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LeaseState {
    /// Offered and holding resources until the offer window closes.
    Offered,
    /// Signed by both and running.
    Active,
    /// Ran to its end.
    Completed,
    /// The offer was not accepted in time.
    Expired,
    /// Ended early by either party.
    Cancelled,
    /// Could not be set up or broke.
    Failed,
    /// Signed by both, starting later (a reservation); becomes active at its start.
    Reserved,
}

impl LeaseState {
    /// Whether the lease holds resources.
    pub fn holds_resources(self) -> bool {
        matches!(
            self,
            LeaseState::Offered | LeaseState::Active | LeaseState::Reserved
        )
    }

    /// A word for tables.
    pub fn label(self) -> &'static str {
        match self {
            LeaseState::Offered => "offered",
            LeaseState::Active => "active",
            LeaseState::Completed => "completed",
            LeaseState::Expired => "expired",
            LeaseState::Cancelled => "cancelled",
            LeaseState::Failed => "failed",
            LeaseState::Reserved => "reserved",
        }
    }
}

/// A lease and everything signed about it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRecord {
    /// The terms (with the current end after renewals).
    pub terms: LeaseTerms,
    /// Provider's signature over the original terms.
    pub provider_sig: Vec<u8>,
    /// Requester's countersignature, once accepted.
    pub requester_sig: Option<Vec<u8>>,
    /// The original end, before renewals (the signed terms carry this end).
    pub signed_end_ms: UnixMillis,
    /// Renewals with both signatures.
    pub renewals: Vec<SignedRenewal>,
    /// Our side.
    pub role: LeaseRole,
    /// Where it stands.
    pub state: LeaseState,
    /// When it last changed (our clock).
    pub updated_ms: UnixMillis,
}

/// A renewal signed by both parties.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignedRenewal {
    /// The renewal.
    pub renewal: Renewal,
    /// Requester's signature.
    pub requester_sig: Vec<u8>,
    /// Provider's signature.
    pub provider_sig: Vec<u8>,
}

impl LeaseRecord {
    /// The terms as both parties signed them (before renewals).
    pub fn signed_terms(&self) -> LeaseTerms {
        LeaseTerms {
            end_ms: self.signed_end_ms,
            ..self.terms.clone()
        }
    }

    /// Whether both signatures over the terms, and both on every renewal, verify.
    pub fn signatures_valid(&self) -> (bool, bool) {
        let terms = self.signed_terms();
        let mut provider_ok = terms.verify(&terms.provider, &self.provider_sig).is_ok();
        let mut requester_ok = self
            .requester_sig
            .as_ref()
            .is_some_and(|s| terms.verify(&terms.requester, s).is_ok());
        for r in &self.renewals {
            provider_ok &= r.renewal.verify(&terms.provider, &r.provider_sig).is_ok();
            requester_ok &= r.renewal.verify(&terms.requester, &r.requester_sig).is_ok();
        }
        (provider_ok, requester_ok)
    }

    /// The other party.
    pub fn peer(&self) -> PeerId {
        match self.role {
            LeaseRole::Provider => self.terms.requester,
            LeaseRole::Requester => self.terms.provider,
        }
    }
}

/// Something the caller must write to the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Write this lease record.
    Lease(LeaseId),
    /// Remember this nonce of this peer until the given time.
    Nonce(PeerId, u64, UnixMillis),
    /// Forget this nonce (its request can no longer be valid).
    ForgetNonce(PeerId, u64),
    /// Forget this lease record (ended longer ago than the retention).
    ForgetLease(LeaseId),
}
