//! Usage receipts and the settlement protocol (`/gpunode/settle/1.0.0`).
//!
//! When a lease ends, its provider writes a [`UsageReceipt`]: what was leased, when,
//! the metered usage, how the last job ended, a digest of everything it delivered, the
//! price and the amount owed. The provider signs it and sends it to the requester, who
//! checks it against the lease and against what it observed, countersigns it, stores it
//! and only then answers with the countersignature. Both keep the receipt with both
//! signatures ([`SettledReceipt`]) in their ledgers.
//!
//! ```text
//! provider                                    requester
//!   Claims([receipt + provider sig, ...]) ───▶ checks each, stores the good ones durably
//!                      ◀──────────────────── Results([Countersigned(sig) | Rejected, ...])
//! ```
//!
//! Both signatures cover `RECEIPT_SIGNING_TAG || canonical bytes of the receipt`.

use libp2p_identity::{Keypair, PeerId};
use serde::{Deserialize, Serialize};

use crate::encoding;
use crate::job::JobFile;
use crate::lease::LeaseId;
use crate::signing::{self, SignatureError};
use crate::time::UnixMillis;

/// Domain tag of receipt signatures (provider's and requester's).
pub const RECEIPT_SIGNING_TAG: &[u8] = b"gpunode/receipt/v1\0";
/// Version of the receipt format: 2 added `peak_gpu_memory_bytes`; 3 bills the time
/// the lease held its resources (`billed_ms` is `end_ms - start_ms`, as Slurm bills
/// allocated time), with what its jobs ran recorded beside it (`cpu_ms`, `gpu_ms`);
/// before 3 only the jobs' run time was billed. Receipts of version 1 stay readable and
/// verifiable (see [`UsageReceiptV1`]); version 3 has the layout of version 2.
pub const RECEIPT_VERSION: u16 = 3;

/// The first receipt version that bills held time.
pub const HELD_TIME_VERSION: u16 = 3;
/// Most claims in one settlement message.
pub const MAX_CLAIMS_PER_MESSAGE: usize = 256;
/// Largest settlement message.
pub const MAX_SETTLE_MESSAGE_BYTES: usize = 256 * 1024;

/// blake3 digest.
pub type Digest = [u8; 32];

/// What a lease used and cost, as its provider metered it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageReceipt {
    /// Format version.
    pub version: u16,
    /// The lease.
    pub lease_id: LeaseId,
    /// Who lent.
    pub provider: PeerId,
    /// Who used.
    pub requester: PeerId,
    /// GPUs leased.
    pub gpus: u32,
    /// CPU cores leased.
    pub cpus: u32,
    /// RAM leased, bytes.
    pub mem_bytes: u64,
    /// When the lease started.
    pub start_ms: UnixMillis,
    /// When it ended (its end, or when it was cancelled).
    pub end_ms: UnixMillis,
    /// What is billed, ms: from version 3 the time the lease held its resources
    /// (`end_ms - start_ms`); before, the time its jobs ran.
    pub billed_ms: u64,
    /// GPU-milliseconds the jobs used: measured from the driver, at most their run
    /// time x GPUs.
    pub gpu_ms: u64,
    /// CPU-milliseconds of the jobs: their run time x CPU cores (from version 3; before,
    /// `billed_ms` x CPU cores).
    pub cpu_ms: u64,
    /// Jobs run under the lease.
    pub jobs: u32,
    /// How the last job ended ("exited 0", "timed_out", ...; "none" without jobs).
    pub exit_status: String,
    /// Digest of every output delivered (see [`lease_output_digest`]).
    pub output_digest: Digest,
    /// Price per GPU-hour, thousandths of a credit (from the lease).
    pub price_per_gpu_hour_millicredits: u64,
    /// Amount owed, thousandths of a credit: [`amount_for`] of the above.
    pub amount_millicredits: u64,
    /// When the provider wrote it.
    pub issued_at_ms: UnixMillis,
    /// Most GPU memory the lease's jobs held at once, bytes, as the provider measured it
    /// (0 when nothing was measured).
    pub peak_gpu_memory_bytes: u64,
}

/// A receipt of format version 1, as ledgers written before version 2 hold it: the same
/// fields without `peak_gpu_memory_bytes`. Its signatures cover these bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageReceiptV1 {
    version: u16,
    lease_id: LeaseId,
    provider: PeerId,
    requester: PeerId,
    gpus: u32,
    cpus: u32,
    mem_bytes: u64,
    start_ms: UnixMillis,
    end_ms: UnixMillis,
    billed_ms: u64,
    gpu_ms: u64,
    cpu_ms: u64,
    jobs: u32,
    exit_status: String,
    output_digest: Digest,
    price_per_gpu_hour_millicredits: u64,
    amount_millicredits: u64,
    issued_at_ms: UnixMillis,
}

impl From<UsageReceiptV1> for UsageReceipt {
    fn from(r: UsageReceiptV1) -> UsageReceipt {
        UsageReceipt {
            version: r.version,
            lease_id: r.lease_id,
            provider: r.provider,
            requester: r.requester,
            gpus: r.gpus,
            cpus: r.cpus,
            mem_bytes: r.mem_bytes,
            start_ms: r.start_ms,
            end_ms: r.end_ms,
            billed_ms: r.billed_ms,
            gpu_ms: r.gpu_ms,
            cpu_ms: r.cpu_ms,
            jobs: r.jobs,
            exit_status: r.exit_status,
            output_digest: r.output_digest,
            price_per_gpu_hour_millicredits: r.price_per_gpu_hour_millicredits,
            amount_millicredits: r.amount_millicredits,
            issued_at_ms: r.issued_at_ms,
            peak_gpu_memory_bytes: 0,
        }
    }
}

impl From<&UsageReceipt> for UsageReceiptV1 {
    fn from(r: &UsageReceipt) -> UsageReceiptV1 {
        UsageReceiptV1 {
            version: r.version,
            lease_id: r.lease_id,
            provider: r.provider,
            requester: r.requester,
            gpus: r.gpus,
            cpus: r.cpus,
            mem_bytes: r.mem_bytes,
            start_ms: r.start_ms,
            end_ms: r.end_ms,
            billed_ms: r.billed_ms,
            gpu_ms: r.gpu_ms,
            cpu_ms: r.cpu_ms,
            jobs: r.jobs,
            exit_status: r.exit_status.clone(),
            output_digest: r.output_digest,
            price_per_gpu_hour_millicredits: r.price_per_gpu_hour_millicredits,
            amount_millicredits: r.amount_millicredits,
            issued_at_ms: r.issued_at_ms,
        }
    }
}

/// A settled receipt of format version 1, as stored by ledgers before version 2.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SettledReceiptV1 {
    /// The receipt.
    pub receipt: UsageReceiptV1,
    /// The provider's signature.
    pub provider_sig: Vec<u8>,
    /// The requester's countersignature.
    pub requester_sig: Vec<u8>,
}

impl From<SettledReceiptV1> for SettledReceipt {
    fn from(s: SettledReceiptV1) -> SettledReceipt {
        SettledReceipt {
            receipt: s.receipt.into(),
            provider_sig: s.provider_sig,
            requester_sig: s.requester_sig,
        }
    }
}

/// The amount for `billed_ms` at `price` per GPU-hour for `gpus` GPUs (a lease without
/// GPUs is priced as one GPU, like the lease's maximum).
pub fn amount_for(price_per_gpu_hour_millicredits: u64, gpus: u32, billed_ms: u64) -> u64 {
    let units = gpus.max(1) as u128;
    let amount = (price_per_gpu_hour_millicredits as u128)
        .saturating_mul(units)
        .saturating_mul(billed_ms as u128)
        / 3_600_000;
    amount.min(u64::MAX as u128) as u64
}

impl UsageReceipt {
    /// The bytes both parties sign (a version 1 receipt's own format for version 1).
    pub fn canonical_bytes(&self) -> Vec<u8> {
        if self.version == 1 {
            encoding::encode(&UsageReceiptV1::from(self))
        } else {
            encoding::encode(self)
        }
    }

    /// Signs the receipt with `key` (provider or requester).
    pub fn sign(&self, key: &Keypair) -> Result<Vec<u8>, SignatureError> {
        signing::sign(key, RECEIPT_SIGNING_TAG, &self.canonical_bytes())
    }

    /// Checks `signature` by `signer` over this receipt.
    pub fn verify(&self, signer: &PeerId, signature: &[u8]) -> Result<(), SignatureError> {
        signing::verify_by(
            signer,
            RECEIPT_SIGNING_TAG,
            &self.canonical_bytes(),
            signature,
        )
    }
}

/// A receipt with both signatures: what both ledgers keep.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SettledReceipt {
    /// The receipt.
    pub receipt: UsageReceipt,
    /// The provider's signature.
    pub provider_sig: Vec<u8>,
    /// The requester's countersignature.
    pub requester_sig: Vec<u8>,
}

/// A receipt the provider signed and asks the requester to countersign.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claim {
    /// The receipt.
    pub receipt: UsageReceipt,
    /// The provider's signature.
    pub provider_sig: Vec<u8>,
}

/// Why a requester refused to countersign.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ReceiptRefusal {
    /// The provider's signature does not verify, or is not the provider's.
    BadSignature,
    /// No such lease with this provider.
    UnknownLease,
    /// The amount or usage is more than the lease allows or than was observed.
    Inflated,
    /// The lease was settled before with a different receipt.
    Duplicate,
    /// Start or end outside the lease.
    TimesOutsideLease,
    /// The output digest differs from what was delivered.
    OutputMismatch,
    /// Fields that do not fit together (version, parties, resources, price).
    Invalid,
    /// The requester could not store it (try again later).
    RequesterError,
}

impl ReceiptRefusal {
    /// A short, stable label for metrics.
    pub fn label(self) -> &'static str {
        match self {
            ReceiptRefusal::BadSignature => "bad_signature",
            ReceiptRefusal::UnknownLease => "unknown_lease",
            ReceiptRefusal::Inflated => "inflated",
            ReceiptRefusal::Duplicate => "duplicate",
            ReceiptRefusal::TimesOutsideLease => "times_outside_lease",
            ReceiptRefusal::OutputMismatch => "output_mismatch",
            ReceiptRefusal::Invalid => "invalid",
            ReceiptRefusal::RequesterError => "requester_error",
        }
    }
}

/// A refusal with its reason.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct ReceiptRejection {
    /// What kind.
    pub code: ReceiptRefusal,
    /// What was wrong, for a person.
    pub message: String,
}

impl ReceiptRejection {
    /// A refusal with `code` and `message`.
    pub fn new(code: ReceiptRefusal, message: impl Into<String>) -> ReceiptRejection {
        ReceiptRejection {
            code,
            message: message.into(),
        }
    }
}

/// Provider to requester.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum SettleMsg {
    /// Receipts to countersign (at most [`MAX_CLAIMS_PER_MESSAGE`]).
    Claims(Vec<Claim>),
}

/// The answer to one claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClaimResult {
    /// Countersigned and durably stored by the requester.
    Countersigned(Vec<u8>),
    /// Refused.
    Rejected(ReceiptRejection),
}

/// Requester to provider: one result per claim, in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum SettleReply {
    /// The results.
    Results(Vec<ClaimResult>),
    /// The whole message was refused.
    Refused(ReceiptRejection),
}

/// Digest of one job's outputs: every file's path, size and hash, in path order.
pub fn job_output_digest(outputs: &[JobFile]) -> Digest {
    let mut files: Vec<&JobFile> = outputs.iter().collect();
    files.sort_by(|a, b| a.path.cmp(&b.path));
    let mut h = blake3::Hasher::new();
    h.update(b"gpunode/outputs/v1\0");
    for f in files {
        h.update(&(f.path.len() as u64).to_le_bytes());
        h.update(f.path.as_bytes());
        h.update(&f.blob.size.to_le_bytes());
        h.update(&f.blob.hash);
    }
    *h.finalize().as_bytes()
}

/// Digest of a lease's outputs: its jobs' digests, sorted (jobs may run concurrently).
pub fn lease_output_digest(job_digests: &[Digest]) -> Digest {
    let mut sorted = job_digests.to_vec();
    sorted.sort();
    let mut h = blake3::Hasher::new();
    h.update(b"gpunode/lease-outputs/v1\0");
    for d in sorted {
        h.update(&d);
    }
    *h.finalize().as_bytes()
}

/// Decodes a settlement message from a peer.
pub fn decode_settle_msg(bytes: &[u8]) -> Result<SettleMsg, encoding::DecodeError> {
    encoding::decode(bytes, MAX_SETTLE_MESSAGE_BYTES)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn receipt(provider: &Keypair, requester: &Keypair) -> UsageReceipt {
        UsageReceipt {
            version: RECEIPT_VERSION,
            lease_id: LeaseId([7; 16]),
            provider: provider.public().to_peer_id(),
            requester: requester.public().to_peer_id(),
            gpus: 1,
            cpus: 2,
            mem_bytes: 1 << 30,
            start_ms: 1_000,
            end_ms: 61_000,
            billed_ms: 30_000,
            gpu_ms: 30_000,
            cpu_ms: 60_000,
            jobs: 1,
            exit_status: "exited 0".into(),
            output_digest: lease_output_digest(&[]),
            price_per_gpu_hour_millicredits: 3_600,
            amount_millicredits: amount_for(3_600, 1, 30_000),
            issued_at_ms: 61_000,
            peak_gpu_memory_bytes: 0,
        }
    }

    #[test]
    fn amount_is_price_times_gpus_times_hours() {
        assert_eq!(amount_for(3_600, 1, 30_000), 30);
        assert_eq!(amount_for(3_600, 0, 30_000), 30, "no GPUs is priced as one");
        assert_eq!(amount_for(3_600, 4, 3_600_000), 14_400);
        assert_eq!(amount_for(u64::MAX, u32::MAX, u64::MAX), u64::MAX);
    }

    #[test]
    fn both_signatures_bind_the_receipt() {
        let (p, r) = (Keypair::generate_ed25519(), Keypair::generate_ed25519());
        let rec = receipt(&p, &r);
        let psig = rec.sign(&p).expect("sign");
        let rsig = rec.sign(&r).expect("sign");
        assert_eq!(rec.verify(&rec.provider, &psig), Ok(()));
        assert_eq!(rec.verify(&rec.requester, &rsig), Ok(()));
        assert!(rec.verify(&rec.requester, &psig).is_err());
        let mut inflated = rec.clone();
        inflated.amount_millicredits += 1;
        assert!(inflated.verify(&rec.provider, &psig).is_err());
    }

    #[test]
    fn digests_ignore_order_but_not_content() {
        let f = |p: &str, b: u8| JobFile {
            path: p.into(),
            blob: crate::job::BlobRef {
                hash: [b; 32],
                size: 1,
            },
        };
        let a = job_output_digest(&[f("a", 1), f("b", 2)]);
        assert_eq!(a, job_output_digest(&[f("b", 2), f("a", 1)]));
        assert_ne!(a, job_output_digest(&[f("a", 1), f("b", 3)]));
        assert_ne!(a, job_output_digest(&[f("a", 1)]));
        let (x, y) = (
            lease_output_digest(&[a, [0; 32]]),
            lease_output_digest(&[[0; 32], a]),
        );
        assert_eq!(x, y);
    }

    #[test]
    fn oversized_or_garbage_messages_are_refused() {
        assert!(decode_settle_msg(&[0xff; 16]).is_err());
        assert!(decode_settle_msg(&vec![0; MAX_SETTLE_MESSAGE_BYTES + 1]).is_err());
    }
}
