//! Lease wire types: what a requester asks for, the terms both parties sign, renewals,
//! cancellations, and the provider's answers.
//!
//! Both signatures on a lease cover the same canonical bytes of [`LeaseTerms`] behind
//! [`LEASE_SIGNING_TAG`]. Renewals and cancellations are signed messages of their own
//! with their own tags. Signatures are checked against the public key inside the
//! signer's peer id (ed25519 peer ids carry their key), so no key travels beside them.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::encoding::{self, DecodeError};
use crate::signing::{self, SignatureError};
use crate::time::UnixMillis;
use crate::{Keypair, PeerId};

/// Kept here for callers that know it as `lease::public_key_of`; it lives in [`signing`].
pub use crate::signing::public_key_of;

/// Domain tag of lease terms signatures.
pub const LEASE_SIGNING_TAG: &[u8] = b"gpunode/lease/v1\0";
/// Domain tag of renewal signatures.
pub const RENEW_SIGNING_TAG: &[u8] = b"gpunode/lease-renew/v1\0";
/// Domain tag of cancellation signatures.
pub const CANCEL_SIGNING_TAG: &[u8] = b"gpunode/lease-cancel/v1\0";
/// Version of the lease protocol messages.
pub const LEASE_VERSION: u16 = 1;
/// A lease asked to start later than this after the request is a reservation: it holds
/// its GPUs only from its start, and its offer must start exactly when asked. Longer
/// than a provider's offer window (10 s by default), so an offer for a reservation
/// never holds GPUs now.
pub const RESERVATION_MIN_LEAD_MS: u64 = 15_000;
/// Largest lease protocol message, either direction.
pub const MAX_LEASE_MESSAGE_BYTES: usize = 64 * 1024;
/// How far before the provider's now a proposed lease may start. A lease is billed from
/// its start, so an earlier start costs only the requester who proposed it; a start
/// after the provider's now is never granted (it would leave the time until then
/// unbilled).
pub const PROPOSAL_START_SLACK_MS: u64 = 5_000;
/// How long before its own now a requester starts the lease it proposes, so that a
/// provider whose clock is a little behind (synchronised clocks differ by a few ms)
/// still finds the start passed. The requester pays for it: 25 ms of lease time.
pub const PROPOSAL_START_LEAD_MS: u64 = 25;

/// Domain tag of a proposed lease's id ([`proposal_lease_id`]).
const PROPOSAL_ID_TAG: &[u8] = b"gpunode/lease-proposal-id/v1\0";

/// The id of a lease proposed with its request ([`LeaseMessage::Propose`]): derived from
/// the provider, the requester, the request's nonce and the proposed start, so that a
/// requester cannot choose it. A provider forgets ended leases after their retention
/// but its ledger never forgets their receipts: an id a requester could pick freely
/// might be one already settled, and the new lease could then never be billed. A
/// repeat needs the same nonce and start, and a provider refuses a nonce it has seen
/// for longer than it accepts a proposed start (see [`PROPOSAL_START_SLACK_MS`]).
pub fn proposal_lease_id(
    provider: &PeerId,
    requester: &PeerId,
    nonce: u64,
    start_ms: UnixMillis,
) -> LeaseId {
    let mut h = blake3::Hasher::new();
    h.update(PROPOSAL_ID_TAG);
    h.update(&provider.to_bytes());
    h.update(&requester.to_bytes());
    h.update(&nonce.to_le_bytes());
    h.update(&start_ms.to_le_bytes());
    let mut id = [0u8; 16];
    id.copy_from_slice(&h.finalize().as_bytes()[..16]);
    LeaseId(id)
}

/// A lease's identifier: 16 random bytes (or, for a proposed lease, derived: see
/// [`proposal_lease_id`]), shown as 32 hex digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LeaseId(pub [u8; 16]);

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl FromStr for LeaseId {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if s.len() != 32 || !s.chars().all(|c| c.is_ascii_hexdigit()) {
            return Err(format!(
                "'{s}' is not a lease id (32 hex digits, as `gpunode leases` shows)"
            ));
        }
        let mut out = [0u8; 16];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|e| e.to_string())?;
        }
        Ok(LeaseId(out))
    }
}

/// What a requester needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Requirements {
    /// Number of GPUs.
    pub gpus: u32,
    /// GPU model or family.
    pub gpu_model: Option<String>,
    /// A MIG slice profile (`1g.18gb`) instead of whole GPUs.
    pub gpu_slice: Option<String>,
    /// Least memory per GPU, bytes.
    pub min_gpu_mem_bytes: Option<u64>,
    /// CPU cores.
    pub cpus: u32,
    /// RAM, bytes.
    pub mem_bytes: u64,
    /// Executor (`wasm`, `container`).
    pub backend: String,
    /// Interactive or batch work (team policies may allow each only at some hours).
    pub kind: crate::team::JobKind,
}

/// Step 1: the requester asks a provider.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRequest {
    /// Protocol version.
    pub version: u16,
    /// Who asks; must be the peer on the connection.
    pub requester: PeerId,
    /// The requester's public key (protobuf); must belong to `requester`.
    pub requester_key: Vec<u8>,
    /// Fresh random number; a provider refuses one it has seen before.
    pub nonce: u64,
    /// What is needed.
    pub requirements: Requirements,
    /// For how long.
    pub duration_ms: u64,
    /// Highest acceptable price per GPU-hour, thousandths of a credit.
    pub max_price_per_gpu_hour_millicredits: Option<u64>,
    /// When the request was sent (requester's clock).
    pub sent_at_ms: UnixMillis,
    /// After this the request must not be answered.
    pub expires_at_ms: UnixMillis,
    /// The requester's place in the provider's queue, kept across asks: a request that
    /// cannot be granted now waits in the queue under this ticket (`None`: do not queue).
    pub ticket: Option<u128>,
    /// Start later than now (a reservation), provider's clock; `None`: now.
    pub start_at_ms: Option<UnixMillis>,
}

/// A GPU named in a lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeasedGpu {
    /// Index on the provider.
    pub index: u32,
    /// Stable identifier.
    pub uuid: String,
    /// Product name.
    pub model: String,
    /// Memory, bytes.
    pub memory_bytes: u64,
}

/// The contract both parties sign.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseTerms {
    /// Protocol version.
    pub version: u16,
    /// Identifier.
    pub lease_id: LeaseId,
    /// Who lends.
    pub provider: PeerId,
    /// Who uses.
    pub requester: PeerId,
    /// The exact GPUs.
    pub gpus: Vec<LeasedGpu>,
    /// CPU cores.
    pub cpus: u32,
    /// RAM, bytes.
    pub mem_bytes: u64,
    /// Executor.
    pub backend: String,
    /// Start (provider's clock).
    pub start_ms: UnixMillis,
    /// End.
    pub end_ms: UnixMillis,
    /// Price per GPU-hour, thousandths of a credit.
    pub price_per_gpu_hour_millicredits: u64,
    /// Nonce of the request this answers.
    pub request_nonce: u64,
    /// The requester must accept before this.
    pub offer_expires_ms: UnixMillis,
}

impl LeaseTerms {
    /// The canonical bytes both parties sign.
    pub fn canonical_bytes(&self) -> Vec<u8> {
        encoding::encode(self)
    }

    /// Signs the terms.
    pub fn sign(&self, key: &Keypair) -> Result<Vec<u8>, SignatureError> {
        signing::sign(key, LEASE_SIGNING_TAG, &self.canonical_bytes())
    }

    /// Checks `signature` by `signer` over these terms.
    pub fn verify(&self, signer: &PeerId, signature: &[u8]) -> Result<(), SignatureError> {
        signing::verify_by(
            signer,
            LEASE_SIGNING_TAG,
            &self.canonical_bytes(),
            signature,
        )
    }

    /// Most the lease can cost, thousandths of a credit: price x GPUs x hours (a lease
    /// without GPUs is priced as one GPU).
    pub fn max_amount_millicredits(&self) -> u64 {
        let units = self.gpus.len().max(1) as u128;
        let ms = self.end_ms.saturating_sub(self.start_ms) as u128;
        let amount = self.price_per_gpu_hour_millicredits as u128 * units * ms / 3_600_000;
        amount.min(u64::MAX as u128) as u64
    }
}

/// A signed extension of an active lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Renewal {
    /// The lease.
    pub lease_id: LeaseId,
    /// Its new end.
    pub new_end_ms: UnixMillis,
    /// Fresh random number.
    pub nonce: u64,
}

impl Renewal {
    /// Signs the renewal.
    pub fn sign(&self, key: &Keypair) -> Result<Vec<u8>, SignatureError> {
        signing::sign(key, RENEW_SIGNING_TAG, &encoding::encode(self))
    }

    /// Checks a signature by `signer`.
    pub fn verify(&self, signer: &PeerId, signature: &[u8]) -> Result<(), SignatureError> {
        signing::verify_by(
            signer,
            RENEW_SIGNING_TAG,
            &encoding::encode(self),
            signature,
        )
    }
}

/// A signed cancellation, by either party.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cancellation {
    /// The lease.
    pub lease_id: LeaseId,
    /// Who cancels.
    pub by: PeerId,
    /// When (canceller's clock).
    pub at_ms: UnixMillis,
}

impl Cancellation {
    /// Signs the cancellation.
    pub fn sign(&self, key: &Keypair) -> Result<Vec<u8>, SignatureError> {
        signing::sign(key, CANCEL_SIGNING_TAG, &encoding::encode(self))
    }

    /// Checks a signature by `self.by`.
    pub fn verify(&self, signature: &[u8]) -> Result<(), SignatureError> {
        signing::verify_by(
            &self.by,
            CANCEL_SIGNING_TAG,
            &encoding::encode(self),
            signature,
        )
    }
}

/// Messages a peer sends on the lease protocol.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum LeaseMessage {
    /// Step 1: ask for a lease.
    Request(LeaseRequest),
    /// Step 3: accept an offer, countersigned.
    Accept {
        /// The offered terms, unchanged.
        terms: LeaseTerms,
        /// The provider's signature from the offer.
        provider_sig: Vec<u8>,
        /// The requester's countersignature.
        requester_sig: Vec<u8>,
    },
    /// Extend an active lease.
    Renew {
        /// The renewal.
        renewal: Renewal,
        /// The requester's signature.
        signature: Vec<u8>,
    },
    /// End a lease now.
    Cancel {
        /// The cancellation.
        cancellation: Cancellation,
        /// Its signature.
        signature: Vec<u8>,
    },
    /// Steps 1 and 3 at once: a request with the terms the requester expects to be
    /// offered, already countersigned. A provider that would offer exactly these terms
    /// (save a start up to [`PROPOSAL_START_SLACK_MS`] before its own now) signs them and
    /// activates the lease at once ([`LeaseReply::Granted`]); otherwise it answers as it
    /// answers the request alone (an offer, a queue place or a refusal). Appended last,
    /// so a provider that predates it refuses it as `malformed` and the requester asks
    /// with the request alone.
    Propose {
        /// The request, as [`LeaseMessage::Request`] would carry it.
        request: LeaseRequest,
        /// The terms the requester signs.
        terms: LeaseTerms,
        /// The requester's signature over `terms`.
        requester_sig: Vec<u8>,
    },
}

/// Why a provider (or requester) refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RejectCode {
    /// Not enough free GPUs, CPU or RAM.
    NoCapacity,
    /// The peer is not allowed by the provider's allow/deny list.
    PeerNotAllowed,
    /// Duration outside the provider's policy.
    DurationOutOfPolicy,
    /// The provider's price is above the requester's maximum.
    PriceTooHigh,
    /// The backend is not offered.
    BackendUnsupported,
    /// The peer would hold more GPUs than the provider allows one peer.
    PeerGpuLimit,
    /// A signature does not verify.
    BadSignature,
    /// A key does not belong to the sending peer.
    WrongKey,
    /// No such lease (or not one of the sender's).
    UnknownLease,
    /// The offer's window has passed.
    OfferExpired,
    /// The accepted terms differ from the offered ones.
    TermsAltered,
    /// The nonce was used before.
    Replay,
    /// The sender's clock is too far off, or the request has expired.
    ClockSkew,
    /// The message could not be decoded.
    Malformed,
    /// The message is larger than allowed.
    Oversized,
    /// The lease is not in a state that allows this.
    WrongState,
    /// The request itself is invalid (zero duration, unsupported version, ...).
    InvalidRequest,
    /// The requester owes this provider more than its allowance and debt limit allow.
    DebtLimit,
    /// The requester's reputation with this provider is too low.
    LowReputation,
    /// The team policy forbids it (quota, time window); the message names the rule.
    TeamPolicy,
    /// Outside the provider's lending hours, or past their end; the message says when.
    LendingHours,
}

impl RejectCode {
    /// A short, stable label for metrics.
    pub fn label(self) -> &'static str {
        match self {
            RejectCode::NoCapacity => "no_capacity",
            RejectCode::PeerNotAllowed => "peer_not_allowed",
            RejectCode::DurationOutOfPolicy => "duration_out_of_policy",
            RejectCode::PriceTooHigh => "price_too_high",
            RejectCode::BackendUnsupported => "backend_unsupported",
            RejectCode::PeerGpuLimit => "peer_gpu_limit",
            RejectCode::BadSignature => "bad_signature",
            RejectCode::WrongKey => "wrong_key",
            RejectCode::UnknownLease => "unknown_lease",
            RejectCode::OfferExpired => "offer_expired",
            RejectCode::TermsAltered => "terms_altered",
            RejectCode::Replay => "replay",
            RejectCode::ClockSkew => "clock_skew",
            RejectCode::Malformed => "malformed",
            RejectCode::Oversized => "oversized",
            RejectCode::WrongState => "wrong_state",
            RejectCode::InvalidRequest => "invalid_request",
            RejectCode::DebtLimit => "debt_limit",
            RejectCode::LowReputation => "low_reputation",
            RejectCode::TeamPolicy => "team_policy",
            RejectCode::LendingHours => "lending_hours",
        }
    }
}

/// A refusal: a code for programs and a sentence a person can act on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct Rejection {
    /// What kind of refusal.
    pub code: RejectCode,
    /// What happened and what would help.
    pub message: String,
}

impl Rejection {
    /// A refusal with `code` and `message`.
    pub fn new(code: RejectCode, message: impl Into<String>) -> Rejection {
        Rejection {
            code,
            message: message.into(),
        }
    }
}

impl From<SignatureError> for Rejection {
    fn from(e: SignatureError) -> Self {
        let code = match e {
            SignatureError::WrongKey { .. } | SignatureError::BadPublicKey => RejectCode::WrongKey,
            _ => RejectCode::BadSignature,
        };
        Rejection::new(code, e.to_string())
    }
}

/// Where a request waits in a provider's queue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueuePlace {
    /// 1 = served next.
    pub position: u32,
    /// Requests waiting in all.
    pub of: u32,
    /// When it would start if nothing changed (provider's clock), if foreseeable.
    pub estimated_start_ms: Option<UnixMillis>,
    /// Why it does not start now, in plain words.
    pub reason: String,
}

/// Answers on the lease protocol.
// Replies are built once and moved straight to the codec; boxing would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum LeaseReply {
    /// Step 2: terms signed by the provider, held until `offer_expires_ms`.
    Offer {
        /// The terms.
        terms: LeaseTerms,
        /// The provider's signature.
        provider_sig: Vec<u8>,
    },
    /// Refused.
    Rejected(Rejection),
    /// Step 4: the lease is active (and durably stored by the provider).
    Activated {
        /// The lease.
        lease_id: LeaseId,
    },
    /// The renewal is accepted; the provider signed it too.
    Renewed {
        /// The lease.
        lease_id: LeaseId,
        /// Its new end.
        new_end_ms: UnixMillis,
        /// The provider's signature over the renewal.
        provider_sig: Vec<u8>,
    },
    /// The lease is cancelled.
    Cancelled {
        /// The lease.
        lease_id: LeaseId,
    },
    /// Not now: the request waits in the provider's queue; ask again (with the same
    /// ticket) within a few seconds to keep the place.
    Queued(QueuePlace),
    /// The proposed terms are the lease: signed by the provider too, active and durably
    /// stored by it.
    Granted {
        /// The lease.
        lease_id: LeaseId,
        /// The provider's signature over the proposed terms.
        provider_sig: Vec<u8>,
    },
}

/// Decodes a lease message, mapping failures to the rejection a peer is sent.
pub fn decode_message(bytes: &[u8]) -> Result<LeaseMessage, Rejection> {
    encoding::decode(bytes, MAX_LEASE_MESSAGE_BYTES).map_err(decode_rejection)
}

/// Decodes a lease reply.
pub fn decode_reply(bytes: &[u8]) -> Result<LeaseReply, Rejection> {
    encoding::decode(bytes, MAX_LEASE_MESSAGE_BYTES).map_err(decode_rejection)
}

fn decode_rejection(e: DecodeError) -> Rejection {
    match e {
        DecodeError::TooLarge { .. } => Rejection::new(RejectCode::Oversized, e.to_string()),
        _ => Rejection::new(RejectCode::Malformed, e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A proposed lease's id is the same for the same proposal, on both sides, and
    /// differs when any of what it is derived from differs.
    #[test]
    fn a_proposed_id_follows_from_the_proposal_alone() {
        let (p, r) = (PeerId::random(), PeerId::random());
        let id = proposal_lease_id(&p, &r, 7, 1_000);
        assert_eq!(id, proposal_lease_id(&p, &r, 7, 1_000));
        let others = [
            proposal_lease_id(&r, &p, 7, 1_000),
            proposal_lease_id(&p, &PeerId::random(), 7, 1_000),
            proposal_lease_id(&p, &r, 8, 1_000),
            proposal_lease_id(&p, &r, 7, 1_001),
        ];
        assert!(others.iter().all(|o| *o != id));
    }
}
