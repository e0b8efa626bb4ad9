//! The requester's side of a lease negotiation: ask candidates in order, check each
//! offer against what was asked, countersign the first firm one, and record the lease.

use crate::ledger::reputation::NEUTRAL;
use std::time::Duration;

use gpunode_protocol::advert::OfferFilter;
use gpunode_protocol::lease::{
    LeaseMessage, LeaseReply, LeaseRequest, LeaseTerms, QueuePlace, RejectCode, Rejection, Renewal,
    Requirements, LEASE_VERSION, RESERVATION_MIN_LEAD_MS,
};
use gpunode_protocol::time::{now_ms, UnixMillis, MAX_CLOCK_SKEW_MS};
use gpunode_protocol::PeerId;
use libp2p::Multiaddr;

use crate::lease::book::{LeaseRole, LeaseState, SignedRenewal};
use crate::loop_client::LoopClient;
use crate::views::{CancelOutcome, LeaseSpec, LeaseView};
use crate::NodeError;
use libp2p::identity::Keypair;

/// Why one provider did not grant a lease.
enum NotGranted {
    /// Refused, with the reason.
    Refused(String),
    /// Waits in its queue.
    Queued(QueuePlace),
}

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

/// How long a lease request stays valid.
const REQUEST_TTL_MS: u64 = 30_000;

/// Why a lease could not be had, renewed or cancelled.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// The request itself is not usable.
    #[error("{0}")]
    Invalid(String),
    /// No provider offers what was asked.
    #[error("no provider offers {0}; see `gpunode offers` for what is available")]
    NoProviders(String),
    /// Every candidate refused or failed.
    #[error("no provider granted the lease:{}", .0.iter().map(|(p, m)| format!("\n  {p}: {m}")).collect::<String>())]
    AllRefused(Vec<(String, String)>),
    /// Nobody can grant it now; it waits in these providers' queues (the others refused).
    #[error("queued at {} provider(s):{}", .queued.len(), .queued.iter().map(|(p, q)| format!("\n  {p}: {}", describe_place(q))).chain(.refused.iter().map(|(p, m)| format!("\n  {p}: {m}"))).collect::<String>())]
    Queued {
        /// Provider and place.
        queued: Vec<(String, QueuePlace)>,
        /// Provider and why it refused.
        refused: Vec<(String, String)>,
    },
    /// The other party refused.
    #[error("{0}")]
    Refused(Rejection),
    /// No such lease, or not in a state for this.
    #[error("{0}")]
    NotFound(String),
    /// The node failed.
    #[error(transparent)]
    Node(#[from] NodeError),
}

/// The requester's side of lease negotiation: finds providers, negotiates, renews and
/// cancels, through the loop client and with this node's key.
#[derive(Debug, Clone)]
pub struct Negotiator {
    client: LoopClient,
    keypair: Keypair,
    peer_id: PeerId,
}

impl Negotiator {
    /// A negotiator for the node with `keypair`, reaching its loop through `client`.
    pub fn new(client: LoopClient, keypair: Keypair) -> Negotiator {
        Negotiator {
            peer_id: keypair.public().to_peer_id(),
            client,
            keypair,
        }
    }

    /// Sends one lease message to `peer` and waits for the answer.
    pub async fn send_lease(
        &self,
        peer: PeerId,
        addrs: Vec<Multiaddr>,
        message: LeaseMessage,
    ) -> Result<Result<LeaseReply, String>, NodeError> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let answer = self
                .client
                .send_lease(peer, addrs.clone(), message.clone())
                .await?;
            match answer {
                // A dial already under way to an address the peer no longer uses, or a
                // connection that died with the peer (a crash and restart), fails an
                // attempt; the next one opens a fresh connection.
                Err(e) if attempt < 3 && is_transport_failure(&e) => {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
                other => return Ok(other),
            }
        }
    }

    /// Current adverts of known peers (for their addresses and offers).
    pub async fn find_adverts(
        &self,
        peers: Vec<PeerId>,
    ) -> Result<Vec<crate::OfferView>, NodeError> {
        Ok(self.client.find_adverts(peers).await?.offers)
    }

    async fn addresses_of(&self, peer: PeerId) -> Vec<Multiaddr> {
        if let Ok(true) = self.client.is_connected(peer).await {
            return Vec::new();
        }
        self.find_adverts(vec![peer])
            .await
            .ok()
            .and_then(|v| v.into_iter().next())
            .map(|o| listen_multiaddrs(&o))
            .unwrap_or_default()
    }

    /// Where to reach `peer` (nothing when connected) and the price it advertises
    /// (millicredits per GPU-hour), when its advert is known. A connected peer whose
    /// advert this node already verified costs no DHT request.
    async fn target_of(&self, peer: PeerId) -> (Vec<Multiaddr>, Option<u64>) {
        let connected = matches!(self.client.is_connected(peer).await, Ok(true));
        let known = self.client.known_price(peer).await.ok().flatten();
        if connected && known.is_some() {
            return (Vec::new(), known);
        }
        let advert = self
            .find_adverts(vec![peer])
            .await
            .ok()
            .and_then(|v| v.into_iter().next());
        let price = advert
            .as_ref()
            .map(|o| (o.price_per_gpu_hour * 1000.0).round() as u64)
            .or(known);
        let addrs = match advert {
            Some(o) if !connected => listen_multiaddrs(&o),
            _ => Vec::new(),
        };
        (addrs, price)
    }

    /// Finds a provider (or asks the named one), negotiates and records a lease.
    pub async fn request_lease(&self, spec: LeaseSpec) -> Result<LeaseView, LeaseError> {
        if spec.duration_ms == 0 {
            return Err(LeaseError::Invalid(
                "a lease needs a duration, e.g. --duration 30m".into(),
            ));
        }
        let max_price = match spec.max_price {
            Some(p) if !(p.is_finite() && p >= 0.0) => {
                return Err(LeaseError::Invalid(format!("invalid maximum price {p}")))
            }
            Some(p) => Some((p * 1000.0).round() as u64),
            None => None,
        };
        // Each candidate with the price it advertised, when known: an offer above the
        // advertised price is refused even without --max-price.
        let candidates: Vec<(PeerId, Vec<Multiaddr>, Option<u64>)> = match &spec.peer {
            Some(p) => {
                let peer: PeerId = p.parse().map_err(|_| {
                    LeaseError::Invalid(format!("'{p}' is not a peer id (12D3KooW...)"))
                })?;
                let (addrs, advertised) = self.target_of(peer).await;
                vec![(peer, addrs, advertised)]
            }
            None => {
                let filter = OfferFilter {
                    gpu_model: spec.gpu_model.clone(),
                    gpu_slice: spec.gpu_slice.clone(),
                    min_gpu_mem_bytes: spec.min_gpu_mem_bytes,
                    gpus: Some(spec.gpus),
                    backend: Some(spec.backend.clone()),
                };
                let mut offers = self.client.search_offers(filter.clone()).await?.offers;
                offers.retain(|o| {
                    max_price.is_none_or(|m| (o.price_per_gpu_hour * 1000.0).round() as u64 <= m)
                });
                // Providers that advertise enough idle matching GPUs first (cheapest
                // first within each group); the rest may have freed some meanwhile.
                let idle_enough = |o: &crate::OfferView| {
                    o.gpus
                        .iter()
                        .filter(|g| {
                            g.state == gpunode_protocol::gpu::GpuState::Idle
                                && filter.gpu_matches(&g.model, g.memory_bytes)
                        })
                        .count()
                        >= spec.gpus as usize
                };
                // Providers whose reputation fell below the floor go last; then those
                // with enough idle matching GPUs; then by price weighted by reputation
                // and latency (see `rank`).
                offers.sort_by(|a, b| {
                    let key = |o: &crate::OfferView| {
                        (
                            o.reputation.unwrap_or(NEUTRAL) < REPUTATION_FLOOR,
                            !idle_enough(o),
                        )
                    };
                    key(a)
                        .cmp(&key(b))
                        .then_with(|| rank(a).total_cmp(&rank(b)))
                });
                offers
                    .iter()
                    .filter_map(|o| {
                        let peer = o.peer_id.parse().ok()?;
                        Some((
                            peer,
                            listen_multiaddrs(o),
                            Some((o.price_per_gpu_hour * 1000.0).round() as u64),
                        ))
                    })
                    .collect()
            }
        };
        let candidates: Vec<_> = candidates
            .into_iter()
            .filter(|(p, _, _)| !spec.exclude.contains(&p.to_string()))
            .collect();
        if candidates.is_empty() {
            return Err(LeaseError::NoProviders(describe(&spec)));
        }
        let mut refusals = Vec::new();
        let mut queued = Vec::new();
        for (peer, addrs, advertised) in candidates {
            let max_price = match (max_price, advertised) {
                (Some(m), Some(a)) => Some(m.min(a)),
                (m, a) => m.or(a),
            };
            match self.negotiate_with(peer, addrs, &spec, max_price).await? {
                Ok(view) => return Ok(view),
                Err(NotGranted::Refused(why)) => refusals.push((peer.to_string(), why)),
                Err(NotGranted::Queued(place)) => queued.push((peer.to_string(), place)),
            }
        }
        if queued.is_empty() {
            return Err(LeaseError::AllRefused(refusals));
        }
        // Soonest start first.
        queued.sort_by_key(|(_, q)| (q.estimated_start_ms.unwrap_or(u64::MAX), q.position));
        Err(LeaseError::Queued {
            queued,
            refused: refusals,
        })
    }

    async fn negotiate_with(
        &self,
        peer: PeerId,
        addrs: Vec<Multiaddr>,
        spec: &LeaseSpec,
        max_price: Option<u64>,
    ) -> Result<Result<LeaseView, NotGranted>, NodeError> {
        let now = now_ms();
        let req = LeaseRequest {
            version: LEASE_VERSION,
            requester: self.peer_id,
            requester_key: self.keypair.public().encode_protobuf(),
            nonce: rand::random(),
            requirements: Requirements {
                gpus: spec.gpus,
                gpu_model: spec.gpu_model.clone(),
                gpu_slice: spec.gpu_slice.clone(),
                min_gpu_mem_bytes: spec.min_gpu_mem_bytes,
                cpus: spec.cpus,
                mem_bytes: spec.mem_bytes,
                backend: spec.backend.clone(),
                kind: spec.kind,
            },
            duration_ms: spec.duration_ms,
            max_price_per_gpu_hour_millicredits: max_price,
            sent_at_ms: now,
            expires_at_ms: now + REQUEST_TTL_MS,
            ticket: spec.ticket,
            start_at_ms: spec.start_at_ms,
        };
        let (terms, provider_sig) = match self
            .send_lease(peer, addrs.clone(), LeaseMessage::Request(req.clone()))
            .await?
        {
            Ok(LeaseReply::Offer {
                terms,
                provider_sig,
            }) => (terms, provider_sig),
            Ok(LeaseReply::Queued(place)) => return Ok(Err(NotGranted::Queued(place))),
            Ok(LeaseReply::Rejected(r)) => return Ok(Err(NotGranted::Refused(r.message))),
            Ok(other) => {
                return Ok(Err(NotGranted::Refused(format!(
                    "unexpected answer {other:?}"
                ))))
            }
            Err(e) => return Ok(Err(NotGranted::Refused(e))),
        };
        if let Err(r) = check_offer(&req, &peer, &terms, &provider_sig, now_ms()) {
            return Ok(Err(NotGranted::Refused(format!(
                "offer refused: {}",
                r.message
            ))));
        }
        let requester_sig = match terms.sign(&self.keypair) {
            Ok(s) => s,
            Err(e) => return Ok(Err(NotGranted::Refused(e.to_string()))),
        };
        let accept = LeaseMessage::Accept {
            terms: terms.clone(),
            provider_sig: provider_sig.clone(),
            requester_sig: requester_sig.clone(),
        };
        match self.send_lease(peer, addrs, accept).await? {
            Ok(LeaseReply::Activated { lease_id }) if lease_id == terms.lease_id => {}
            Ok(LeaseReply::Rejected(r)) => return Ok(Err(NotGranted::Refused(r.message))),
            Ok(other) => {
                return Ok(Err(NotGranted::Refused(format!(
                    "unexpected answer {other:?}"
                ))))
            }
            Err(e) => return Ok(Err(NotGranted::Refused(e))),
        }
        let record = self
            .client
            .record_lease(terms, provider_sig, requester_sig)
            .await?;
        // Both signatures were just checked (the provider's in check_offer, ours made here).
        Ok(record
            .map(|r| LeaseView::with_signatures(&r, (true, true)))
            .map_err(NotGranted::Refused))
    }

    /// Every lease on this node, either side, newest first.
    pub async fn list_leases(&self) -> Result<Vec<LeaseView>, NodeError> {
        let records = self.client.list_leases().await?;
        Ok(records.iter().map(LeaseView::from).collect())
    }

    /// Extends an active lease we hold as requester by `extend`.
    pub async fn renew_lease(
        &self,
        prefix: &str,
        extend: Duration,
    ) -> Result<LeaseView, LeaseError> {
        let prefix = prefix.to_string();
        let record = self
            .client
            .resolve_lease(prefix)
            .await?
            .map_err(LeaseError::NotFound)?;
        if record.role != LeaseRole::Requester {
            return Err(LeaseError::Invalid(
                "only the requester renews a lease; this node is its provider".into(),
            ));
        }
        if record.state != LeaseState::Active {
            return Err(LeaseError::NotFound(format!(
                "lease {} is {}, not active",
                record.terms.lease_id,
                record.state.label()
            )));
        }
        let renewal = Renewal {
            lease_id: record.terms.lease_id,
            new_end_ms: record.terms.end_ms + extend.as_millis() as u64,
            nonce: rand::random(),
        };
        let signature = renewal
            .sign(&self.keypair)
            .map_err(|e| LeaseError::Invalid(e.to_string()))?;
        let provider = record.terms.provider;
        let addrs = self.addresses_of(provider).await;
        let message = LeaseMessage::Renew {
            renewal: renewal.clone(),
            signature: signature.clone(),
        };
        match self.send_lease(provider, addrs, message).await? {
            Ok(LeaseReply::Renewed {
                provider_sig,
                new_end_ms,
                ..
            }) if new_end_ms == renewal.new_end_ms => {
                let signed = SignedRenewal {
                    renewal,
                    requester_sig: signature,
                    provider_sig,
                };
                let record = self
                    .client
                    .apply_renewal(signed)
                    .await?
                    .map_err(LeaseError::Invalid)?;
                Ok(LeaseView::from(&record))
            }
            Ok(LeaseReply::Rejected(r)) => Err(LeaseError::Refused(r)),
            Ok(other) => Err(LeaseError::Invalid(format!("unexpected answer {other:?}"))),
            Err(e) => Err(LeaseError::Invalid(e)),
        }
    }

    /// Cancels a lease (either side): released here at once, then the other party is told.
    pub async fn cancel_lease(&self, prefix: &str) -> Result<CancelOutcome, LeaseError> {
        let prefix = prefix.to_string();
        let (record, cancellation, signature) =
            self.client
                .cancel_local(prefix)
                .await?
                .map_err(|r| match r.code {
                    RejectCode::UnknownLease | RejectCode::WrongState => {
                        LeaseError::NotFound(r.message)
                    }
                    _ => LeaseError::Refused(r),
                })?;
        let peer = record.peer();
        let addrs = self.addresses_of(peer).await;
        let answer = self
            .send_lease(
                peer,
                addrs,
                LeaseMessage::Cancel {
                    cancellation,
                    signature,
                },
            )
            .await?;
        let (peer_notified, peer_error) = match answer {
            Ok(LeaseReply::Cancelled { .. }) => (true, None),
            // Already over on the other side too (e.g. our first attempt got through).
            Ok(LeaseReply::Rejected(r)) if r.code == RejectCode::WrongState => (true, None),
            Ok(LeaseReply::Rejected(r)) => (false, Some(r.message)),
            Ok(other) => (false, Some(format!("unexpected answer {other:?}"))),
            Err(e) => (false, Some(e)),
        };
        Ok(CancelOutcome {
            lease: LeaseView::from(&record),
            peer_notified,
            peer_error,
        })
    }
}

/// The addresses an offer lists, parsed (unparsable ones left out).
fn listen_multiaddrs(o: &crate::OfferView) -> Vec<Multiaddr> {
    o.listen_addrs
        .iter()
        .filter_map(|a| a.parse().ok())
        .collect()
}

/// Failures of the connection rather than refusals by the peer: worth one more try.
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

fn is_transport_failure(error: &str) -> bool {
    let e = error.to_ascii_lowercase();
    e.contains("dial")
        || e.contains("connection")
        || e.contains("timeout")
        || e.contains("timed out")
}

fn describe(spec: &LeaseSpec) -> String {
    let mut s = format!("{} GPU(s)", spec.gpus);
    if let Some(m) = &spec.gpu_model {
        s.push_str(&format!(" of model {m}"));
    }
    if let Some(slice) = &spec.gpu_slice {
        s.push_str(&format!(" as MIG slice {slice}"));
    }
    if let Some(mem) = spec.min_gpu_mem_bytes {
        s.push_str(&format!(
            " with {}",
            gpunode_protocol::units::format_bytes(mem)
        ));
    }
    s.push_str(&format!(" on backend {}", spec.backend));
    s
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
