//! The requester's rules for a receipt: what it must match before we countersign.
//!
//! A receipt is refused, with a reason, when its signature is bad, its lease is unknown
//! (or not with this provider), it is inflated (amount or usage above the lease or above
//! what we observed, or an amount that does not follow from the usage), its times fall
//! outside the lease, or its output digest differs from what we received. Duplicates
//! are caught by the ledger's lease index.

use gpunode_protocol::lease::LeaseTerms;
use gpunode_protocol::receipt::{
    amount_for, Claim, ReceiptRefusal as Code, ReceiptRejection, UsageReceipt, HELD_TIME_VERSION,
    RECEIPT_VERSION,
};
use gpunode_protocol::time::MAX_CLOCK_SKEW_MS;
use libp2p::PeerId;

use super::meter::LeaseUsage;
use crate::lease::{LeaseRecord, LeaseRole, LeaseState};

/// How much more run time than we observed a provider may bill (its clock and ours
/// start and stop at slightly different moments; ours includes transfers, so honest
/// bills come in under what we saw).
pub const USAGE_TOLERANCE_MS: u64 = 2_000;

fn refuse(code: Code, message: impl Into<String>) -> ReceiptRejection {
    ReceiptRejection::new(code, message)
}

/// Checks a claim from `from` against our copy of its lease and what we observed.
pub fn check_claim(
    claim: &Claim,
    from: &PeerId,
    local: &PeerId,
    lease: Option<&LeaseRecord>,
    observed: &LeaseUsage,
) -> Result<(), ReceiptRejection> {
    check_claim_with(claim, from, local, lease, observed, false)
}

/// [`check_claim`], with the provider's signature already checked (in a batch) when
/// `signature_checked`.
pub fn check_claim_with(
    claim: &Claim,
    from: &PeerId,
    local: &PeerId,
    lease: Option<&LeaseRecord>,
    observed: &LeaseUsage,
    signature_checked: bool,
) -> Result<(), ReceiptRejection> {
    let r = &claim.receipt;
    check_parties(claim, from, local, signature_checked)?;
    let lease = lease
        .filter(|l| l.role == LeaseRole::Requester && l.terms.provider == *from)
        .ok_or_else(|| {
            refuse(
                Code::UnknownLease,
                format!("no lease {} with provider {from} here", r.lease_id),
            )
        })?;
    check_terms(r, &lease.terms)?;
    if r.version >= HELD_TIME_VERSION {
        check_held_time(r, lease, observed)?;
    } else {
        check_run_time(r, observed)?;
    }
    check_amounts(r, &lease.terms, observed)
}

/// The receipt's format is supported, it names `from` as provider and us as requester,
/// and (unless `signature_checked`) the provider's signature verifies.
fn check_parties(
    claim: &Claim,
    from: &PeerId,
    local: &PeerId,
    signature_checked: bool,
) -> Result<(), ReceiptRejection> {
    let r = &claim.receipt;
    // Format 1 claims may still wait at providers that upgraded.
    if r.version > RECEIPT_VERSION || r.version == 0 {
        return Err(refuse(
            Code::Invalid,
            format!("receipt version {} is not supported", r.version),
        ));
    }
    if r.provider != *from || r.requester != *local {
        return Err(refuse(
            Code::BadSignature,
            format!(
                "the receipt names provider {} and requester {}, but came from {from} to {local}",
                r.provider, r.requester
            ),
        ));
    }
    if !signature_checked {
        r.verify(from, &claim.provider_sig).map_err(|e| {
            refuse(
                Code::BadSignature,
                format!("the provider's signature on the receipt does not verify: {e}"),
            )
        })?;
    }
    Ok(())
}

/// The receipt's resources and price are the lease's, and its times fall within it.
fn check_terms(r: &UsageReceipt, t: &LeaseTerms) -> Result<(), ReceiptRejection> {
    if r.gpus as usize != t.gpus.len()
        || r.cpus != t.cpus
        || r.mem_bytes != t.mem_bytes
        || r.price_per_gpu_hour_millicredits != t.price_per_gpu_hour_millicredits
    {
        return Err(refuse(
            Code::Invalid,
            "the receipt's resources or price differ from the lease's",
        ));
    }
    if r.start_ms.saturating_add(MAX_CLOCK_SKEW_MS) < t.start_ms
        || r.end_ms > t.end_ms.saturating_add(MAX_CLOCK_SKEW_MS)
        || r.end_ms < r.start_ms
    {
        return Err(refuse(
            Code::TimesOutsideLease,
            format!(
                "the receipt runs from {} to {} but the lease ran from {} to {}",
                r.start_ms, r.end_ms, t.start_ms, t.end_ms
            ),
        ));
    }
    Ok(())
}

/// The receipt's peak GPU memory, amount and job count are no more than the lease and
/// what we observed allow, and its output digest is that of what we received.
fn check_amounts(
    r: &UsageReceipt,
    t: &LeaseTerms,
    observed: &LeaseUsage,
) -> Result<(), ReceiptRejection> {
    let leased_gpu_memory: u64 = t.gpus.iter().map(|g| g.memory_bytes).sum();
    // Format 1 has no peak: its signature does not cover one.
    if r.version == 1 && r.peak_gpu_memory_bytes != 0 {
        return Err(refuse(
            Code::Invalid,
            "a format-1 receipt cannot carry a peak GPU memory",
        ));
    }
    if r.peak_gpu_memory_bytes > leased_gpu_memory {
        return Err(refuse(
            Code::Inflated,
            format!(
                "the receipt's peak GPU memory ({} bytes) is more than the leased GPUs have ({leased_gpu_memory})",
                r.peak_gpu_memory_bytes
            ),
        ));
    }
    if r.amount_millicredits > t.max_amount_millicredits() {
        return Err(refuse(
            Code::Inflated,
            format!(
                "the amount {} is more than the lease's maximum {}",
                r.amount_millicredits,
                t.max_amount_millicredits()
            ),
        ));
    }
    if r.jobs > observed.jobs {
        return Err(refuse(
            Code::Inflated,
            format!(
                "the receipt counts {} jobs; {} were sent",
                r.jobs, observed.jobs
            ),
        ));
    }
    if r.output_digest != observed.output_digest() {
        return Err(refuse(
            Code::OutputMismatch,
            "the receipt's output digest differs from the outputs received here",
        ));
    }
    Ok(())
}

/// The usage rules of a receipt that bills held time (version 3): the billed time is at
/// most the window (less the time the provider's owner held the jobs paused), the
/// window ends no later than the lease ended here (its end, or when we cancelled it;
/// never in the future), the run time (`cpu_ms` / CPUs) is no more than we observed,
/// GPU time no more than the GPUs over the run time, and the amount follows.
fn check_held_time(
    r: &UsageReceipt,
    lease: &LeaseRecord,
    observed: &LeaseUsage,
) -> Result<(), ReceiptRejection> {
    let t = &lease.terms;
    // At most the window (less where the provider's owner held the jobs paused).
    let held = r.end_ms - r.start_ms;
    if r.billed_ms > held {
        return Err(refuse(
            Code::Inflated,
            format!(
                "the receipt bills {} ms but covers only {held} ms",
                r.billed_ms
            ),
        ));
    }
    // A lease ends here when we cancelled it, or at its end; never in the future.
    let ended_here = match lease.state {
        LeaseState::Cancelled | LeaseState::Failed | LeaseState::Expired => {
            lease.updated_ms.clamp(t.start_ms, t.end_ms)
        }
        _ => t.end_ms.min(gpunode_protocol::time::now_ms()),
    };
    if r.end_ms > ended_here.saturating_add(MAX_CLOCK_SKEW_MS) {
        return Err(refuse(
            Code::Inflated,
            format!(
                "the provider bills the lease until {} (unix ms) but it ended here at {ended_here}",
                r.end_ms
            ),
        ));
    }
    let cpus = u64::from(r.cpus);
    let run_ms = r.cpu_ms.checked_div(cpus).unwrap_or(0);
    if cpus > 0 && (!r.cpu_ms.is_multiple_of(cpus) || run_ms > r.billed_ms) {
        return Err(refuse(
            Code::Inflated,
            "the CPU-seconds do not follow from a run time within the lease and its CPUs",
        ));
    }
    if run_ms > observed.billed_ms.saturating_add(USAGE_TOLERANCE_MS) {
        return Err(refuse(
            Code::Inflated,
            format!(
                "the provider bills {:.1} s of run time but its jobs took at most {:.1} s as seen here",
                run_ms as f64 / 1000.0,
                observed.billed_ms as f64 / 1000.0
            ),
        ));
    }
    // GPU time is measured by the provider (or the leased GPUs while jobs ran), so it
    // is at most the leased GPUs over the run time (or the window, without CPUs).
    let gpu_cap = if cpus > 0 { run_ms } else { r.billed_ms };
    if r.gpu_ms > gpu_cap.saturating_mul(u64::from(r.gpus)) {
        return Err(refuse(
            Code::Inflated,
            "the GPU-seconds are more than the leased GPUs over the run time",
        ));
    }
    check_amount(r)
}

/// The usage rules of a receipt that bills run time (versions 1 and 2, still waiting at
/// providers that upgraded).
fn check_run_time(r: &UsageReceipt, observed: &LeaseUsage) -> Result<(), ReceiptRejection> {
    let window = r.end_ms - r.start_ms;
    if r.billed_ms > window + USAGE_TOLERANCE_MS {
        return Err(refuse(
            Code::TimesOutsideLease,
            format!(
                "the receipt bills {} ms, more than the {window} ms it covers",
                r.billed_ms
            ),
        ));
    }
    // GPU time is measured by the provider (or the leased GPU time when it measured
    // nothing), so it is at most the leased GPUs over the billed time.
    if r.gpu_ms > r.billed_ms.saturating_mul(r.gpus as u64)
        || r.cpu_ms != r.billed_ms.saturating_mul(r.cpus as u64)
    {
        return Err(refuse(
            Code::Inflated,
            "GPU- or CPU-seconds do not follow from the billed time and the leased resources",
        ));
    }
    if r.billed_ms > observed.billed_ms.saturating_add(USAGE_TOLERANCE_MS) {
        return Err(refuse(
            Code::Inflated,
            format!(
                "the provider bills {:.1} s of run time but its jobs took at most {:.1} s as seen here",
                r.billed_ms as f64 / 1000.0,
                observed.billed_ms as f64 / 1000.0
            ),
        ));
    }
    check_amount(r)
}

/// The amount must follow from the billed time at the lease's price.
fn check_amount(r: &UsageReceipt) -> Result<(), ReceiptRejection> {
    let due = amount_for(r.price_per_gpu_hour_millicredits, r.gpus, r.billed_ms);
    if r.amount_millicredits != due {
        return Err(refuse(
            Code::Inflated,
            format!(
                "the amount {} does not follow from the usage ({} ms at the lease's price is {due})",
                r.amount_millicredits, r.billed_ms
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
#[path = "checks_tests.rs"]
mod tests;
