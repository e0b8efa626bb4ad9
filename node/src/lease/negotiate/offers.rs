//! Judging providers' offers: how they rank against each other (price, reputation,
//! latency), the reputation floor below which a provider is asked last, whether an
//! offer answers the request it claims to, and a queue place in words.

use gpunode_protocol::advert::OfferFilter;
use gpunode_protocol::lease::{
    LeaseRequest, LeaseTerms, QueuePlace, RejectCode, Rejection, Requirements,
    RESERVATION_MIN_LEAD_MS,
};
use gpunode_protocol::time::{UnixMillis, MAX_CLOCK_SKEW_MS};
use gpunode_protocol::PeerId;

use crate::ledger::reputation::NEUTRAL;

/// A queue place in words: "queued: position 2 of 3; estimated start at 12:04:05 UTC:
/// GPU 0 is leased until 12:04:05 UTC".
pub fn describe_place(q: &QueuePlace) -> String {
    let when = match q.estimated_start_ms {
        Some(t) => format!("estimated start {}", gpunode_protocol::time::format_utc(t)),
        None => "no start can be estimated".to_string(),
    };
    if q.reason.is_empty() {
        format!("queued: position {} of {}; {when}", q.position, q.of)
    } else {
        format!(
            "queued: position {} of {}; {when}: {}",
            q.position, q.of, q.reason
        )
    }
}

/// Providers scoring below this are only asked when no one else can serve.
pub const REPUTATION_FLOOR: f64 = 0.3;

/// Ranking of an offer, lower is better: price per GPU-hour × (1.5 − reputation) ×
/// (1 + round trip in seconds). A perfect reputation halves the price's weight, an
/// unknown one (0.5) leaves it, a bad one raises it by up to half; a 100 ms round trip
/// counts as 10% more expensive. Free offers rank by reputation and latency alone.
pub fn rank(o: &crate::OfferView) -> f64 {
    let reputation = o.reputation.unwrap_or(NEUTRAL);
    let latency = 1.0 + o.rtt_ms.unwrap_or(0.0) / 1000.0;
    (o.price_per_gpu_hour + 0.001) * (1.5 - reputation) * latency
}

/// Checks a provider's offer against the request it answers.
pub fn check_offer(
    req: &LeaseRequest,
    provider: &PeerId,
    terms: &LeaseTerms,
    provider_sig: &[u8],
    now: UnixMillis,
) -> Result<(), Rejection> {
    let bad = |m: String| Err(Rejection::new(RejectCode::TermsAltered, m));
    if terms.provider != *provider {
        return bad(format!(
            "offer names provider {} but came from {provider}",
            terms.provider
        ));
    }
    if terms.requester != req.requester || terms.request_nonce != req.nonce {
        return bad("offer answers another request".to_string());
    }
    terms.verify(provider, provider_sig)?;
    let r = &req.requirements;
    check_gpus(r, terms)?;
    if terms.cpus < r.cpus || terms.mem_bytes < r.mem_bytes || terms.backend != r.backend {
        return bad("offer gives less CPU, RAM or another backend than asked".to_string());
    }
    if terms.end_ms.saturating_sub(terms.start_ms) != req.duration_ms {
        return bad("offer's duration differs from the request".to_string());
    }
    if let Some(max) = req.max_price_per_gpu_hour_millicredits {
        if terms.price_per_gpu_hour_millicredits > max {
            return Err(Rejection::new(
                RejectCode::PriceTooHigh,
                "offer is above the maximum price",
            ));
        }
    }
    let reservation = req
        .start_at_ms
        .filter(|at| *at > req.sent_at_ms + RESERVATION_MIN_LEAD_MS);
    if let Some(at) = reservation {
        if terms.start_ms != at {
            return bad("offer's start differs from the reservation's".to_string());
        }
    } else if terms.start_ms > now + MAX_CLOCK_SKEW_MS
        || terms.start_ms.saturating_add(MAX_CLOCK_SKEW_MS) < req.sent_at_ms
    {
        return Err(Rejection::new(
            RejectCode::ClockSkew,
            "the provider's clock differs from ours by more than the tolerated skew",
        ));
    }
    if terms.offer_expires_ms.saturating_add(MAX_CLOCK_SKEW_MS) < now {
        return Err(Rejection::new(
            RejectCode::OfferExpired,
            "the offer arrived after its window",
        ));
    }
    Ok(())
}

/// Checks the GPUs an offer names against what was asked: as many, each matching, none
/// twice.
fn check_gpus(r: &Requirements, terms: &LeaseTerms) -> Result<(), Rejection> {
    let bad = |m: String| Err(Rejection::new(RejectCode::TermsAltered, m));
    if terms.gpus.len() != r.gpus as usize {
        return bad(format!(
            "offer has {} GPUs, {} were asked for",
            terms.gpus.len(),
            r.gpus
        ));
    }
    let filter = OfferFilter::for_gpus_of(r);
    if let Some(g) = terms
        .gpus
        .iter()
        .find(|g| !filter.gpu_matches(&g.model, g.memory_bytes))
    {
        return bad(format!(
            "offered GPU {} ({}) does not match the request",
            g.uuid, g.model
        ));
    }
    let mut uuids: Vec<&str> = terms.gpus.iter().map(|g| g.uuid.as_str()).collect();
    uuids.sort();
    uuids.dedup();
    if uuids.len() != terms.gpus.len() {
        return bad("offer names the same GPU twice".to_string());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::book::LeaseBook;
    use crate::lease::policy::{Capacity, GpuSlot, LeasePolicy};
    use gpunode_protocol::lease::{LeaseId, Requirements, LEASE_VERSION};
    use gpunode_protocol::Keypair;

    const NOW: UnixMillis = 1_800_000_000_000;

    fn setup() -> (Keypair, Keypair, LeaseRequest, LeaseTerms, Vec<u8>) {
        let provider = Keypair::generate_ed25519();
        let requester = Keypair::generate_ed25519();
        let mut book = LeaseBook::new(
            provider.public().to_peer_id(),
            LeasePolicy::default(),
            Capacity {
                gpus: vec![GpuSlot {
                    index: 0,
                    uuid: "GPU-0".into(),
                    model: "A100-80GB".into(),
                    memory_bytes: 80 << 30,
                    available: true,
                }],
                cpus: 8,
                mem_bytes: 32 << 30,
            },
        );
        let req = LeaseRequest {
            version: LEASE_VERSION,
            requester: requester.public().to_peer_id(),
            requester_key: requester.public().encode_protobuf(),
            nonce: 9,
            requirements: Requirements {
                gpus: 1,
                gpu_model: Some("A100".into()),
                gpu_slice: None,
                min_gpu_mem_bytes: Some(40 << 30),
                cpus: 2,
                mem_bytes: 1 << 30,
                backend: "wasm".into(),
                kind: Default::default(),
            },
            duration_ms: 60_000,
            max_price_per_gpu_hour_millicredits: Some(1000),
            sent_at_ms: NOW,
            expires_at_ms: NOW + 30_000,
            ticket: None,
            start_at_ms: None,
        };
        let (terms, sig) = book
            .on_request(&req.requester, &req, LeaseId([3; 16]), &provider, NOW)
            .unwrap();
        (provider, requester, req, terms, sig)
    }

    #[test]
    fn honest_offer_passes() {
        let (p, _, req, terms, sig) = setup();
        assert!(check_offer(&req, &p.public().to_peer_id(), &terms, &sig, NOW + 5).is_ok());
    }

    #[test]
    fn altered_or_foreign_offers_fail() {
        let (p, _, req, terms, sig) = setup();
        let pid = p.public().to_peer_id();
        let other = Keypair::generate_ed25519().public().to_peer_id();
        assert!(check_offer(&req, &other, &terms, &sig, NOW).is_err());
        let mut t = terms.clone();
        t.price_per_gpu_hour_millicredits = 5000;
        let s = t.sign(&p).unwrap();
        assert_eq!(
            check_offer(&req, &pid, &t, &s, NOW).unwrap_err().code,
            RejectCode::PriceTooHigh
        );
        let mut t = terms.clone();
        t.end_ms += 1;
        assert_eq!(
            check_offer(&req, &pid, &t, &sig, NOW).unwrap_err().code,
            RejectCode::BadSignature
        );
        let s = t.sign(&p).unwrap();
        assert_eq!(
            check_offer(&req, &pid, &t, &s, NOW).unwrap_err().code,
            RejectCode::TermsAltered
        );
        let mut t = terms.clone();
        t.gpus[0].memory_bytes = 16 << 30;
        let s = t.sign(&p).unwrap();
        assert!(check_offer(&req, &pid, &t, &s, NOW).is_err());
        assert_eq!(
            check_offer(
                &req,
                &pid,
                &terms,
                &sig,
                terms.offer_expires_ms + MAX_CLOCK_SKEW_MS + 1
            )
            .unwrap_err()
            .code,
            RejectCode::OfferExpired
        );
    }
}
