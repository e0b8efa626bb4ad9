//! Foreseeing a provider's offer, so the request can carry the terms already signed and
//! the lease is had in one round trip ([`LeaseMessage::Propose`]): the terms the
//! provider would offer follow from the request and its newest advert (its price and
//! its idle GPUs). When the advert is out of date, the provider offers what it has and
//! the negotiation takes its usual second round trip.
//!
//! [`LeaseMessage::Propose`]: gpunode_protocol::lease::LeaseMessage::Propose

use gpunode_protocol::advert::{AdvertGpu, OfferFilter};
use gpunode_protocol::gpu::GpuState;
use gpunode_protocol::lease::{
    proposal_lease_id, LeaseMessage, LeaseReply, LeaseRequest, LeaseTerms, LeasedGpu,
    LEASE_VERSION, PROPOSAL_START_LEAD_MS,
};
use gpunode_protocol::time::UnixMillis;
use gpunode_protocol::PeerId;

use crate::lease::{LeaseOpError, LeaseRecord};
use crate::loop_client::ProposalReply;

/// What a provider's newest verified advert says that a lease's terms depend on.
#[derive(Debug, Clone, PartialEq)]
pub struct ProviderAdvert {
    /// Price per GPU-hour, millicredits.
    pub price: u64,
    /// Its GPUs as they stood when it was signed.
    pub gpus: Vec<AdvertGpu>,
}

impl ProviderAdvert {
    /// What the verified offer `o` advertises.
    pub(super) fn of(o: &crate::OfferView) -> ProviderAdvert {
        ProviderAdvert {
            price: (o.price_per_gpu_hour * 1000.0).round() as u64,
            gpus: o.gpus.clone(),
        }
    }
}

/// The terms `provider` would offer for `req` now, if they can be foreseen from its
/// `advert`: not for a reservation (it starts when asked, and is held meanwhile), not
/// above the request's price limit, and only with as many idle GPUs in the advert that
/// match the request, clear of reservations, as were asked for, picked as the
/// provider's queue picks them (the lowest indices) and listed as its book lists them
/// (smallest first). The lease starts [`PROPOSAL_START_LEAD_MS`] before `now` (see the
/// constant), under the id derived from the proposal ([`proposal_lease_id`]).
pub(crate) fn foreseen_terms(
    req: &LeaseRequest,
    provider: PeerId,
    advert: &ProviderAdvert,
    now: UnixMillis,
) -> Option<LeaseTerms> {
    if req.start_at_ms.is_some_and(|at| at > now) {
        return None;
    }
    if req
        .max_price_per_gpu_hour_millicredits
        .is_some_and(|max| advert.price > max)
    {
        return None;
    }
    let start = now.saturating_sub(PROPOSAL_START_LEAD_MS);
    let end = start.saturating_add(req.duration_ms);
    let filter = OfferFilter::for_gpus_of(&req.requirements);
    let mut idle: Vec<&AdvertGpu> = advert
        .gpus
        .iter()
        .filter(|g| g.state == GpuState::Idle && filter.gpu_matches(&g.model, g.memory_bytes))
        .filter(|g| {
            g.reserved
                .iter()
                .all(|(from, to)| *to <= start || *from >= end)
        })
        .collect();
    let wanted = req.requirements.gpus as usize;
    if idle.len() < wanted {
        return None;
    }
    idle.sort_by_key(|g| g.index);
    idle.truncate(wanted);
    idle.sort_by_key(|g| (g.memory_bytes, g.index));
    Some(LeaseTerms {
        version: LEASE_VERSION,
        lease_id: proposal_lease_id(&provider, &req.requester, req.nonce, start),
        provider,
        requester: req.requester,
        gpus: idle
            .into_iter()
            .map(|g| LeasedGpu {
                index: g.index,
                uuid: g.uuid.clone(),
                model: g.model.clone(),
                memory_bytes: g.memory_bytes,
            })
            .collect(),
        cpus: req.requirements.cpus,
        mem_bytes: req.requirements.mem_bytes,
        backend: req.requirements.backend.clone(),
        start_ms: start,
        end_ms: end,
        price_per_gpu_hour_millicredits: advert.price,
        request_nonce: req.nonce,
        offer_expires_ms: req.expires_at_ms,
    })
}

/// A proposal as this node sends it: the request, the terms it foresaw and its own
/// signature over them ([`LeaseMessage::Propose`]).
///
/// [`LeaseMessage::Propose`]: gpunode_protocol::lease::LeaseMessage::Propose
#[derive(Debug, Clone)]
pub struct Proposal {
    /// The request.
    pub request: LeaseRequest,
    /// The terms foreseen.
    pub terms: LeaseTerms,
    /// This node's signature over `terms`.
    pub requester_sig: Vec<u8>,
}

impl Proposal {
    /// The message that carries it.
    pub fn message(&self) -> LeaseMessage {
        LeaseMessage::Propose {
            request: self.request.clone(),
            terms: self.terms.clone(),
            requester_sig: self.requester_sig.clone(),
        }
    }
}

/// What becomes of `proposal`, sent to `proposed_to`, when `answered_by` answers it
/// with `answer`: a grant of exactly the proposed terms, from the peer it went to, under
/// their id and signed by that peer over them, is recorded with `record` (the lease
/// with both signatures); any other answer is given back as it came, for the negotiator
/// to judge. The requester's event loop decides with this as the answer arrives.
pub(crate) fn proposal_outcome(
    proposed_to: &PeerId,
    answered_by: &PeerId,
    proposal: Proposal,
    answer: LeaseReply,
    record: impl FnOnce(LeaseTerms, Vec<u8>, Vec<u8>) -> Result<LeaseRecord, LeaseOpError>,
) -> ProposalReply {
    let from_the_provider = answered_by == proposed_to && proposal.terms.provider == *proposed_to;
    match granted_signature(proposed_to, &proposal.terms, &answer) {
        Some(provider_sig) if from_the_provider => {
            ProposalReply::Recorded(record(proposal.terms, provider_sig, proposal.requester_sig))
        }
        _ => ProposalReply::Answered(answer),
    }
}

/// The provider's signature when `reply` grants the proposed `terms` as they are: under
/// their id, signed by `provider` over exactly those terms. Nothing for any other reply
/// (an offer, a refusal, or a grant that must not be taken).
fn granted_signature(provider: &PeerId, terms: &LeaseTerms, reply: &LeaseReply) -> Option<Vec<u8>> {
    match reply {
        LeaseReply::Granted {
            lease_id,
            provider_sig,
        } if *lease_id == terms.lease_id && terms.verify(provider, provider_sig).is_ok() => {
            Some(provider_sig.clone())
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::book::{proposal_fits, LeaseBook};
    use crate::lease::policy::{Capacity, GpuSlot, LeasePolicy};
    use gpunode_protocol::lease::{LeaseId, Requirements};
    use gpunode_protocol::Keypair;

    const NOW: UnixMillis = 1_800_000_000_000;

    fn gpu(index: u32, model: &str, gib: u64, state: GpuState) -> AdvertGpu {
        AdvertGpu {
            index,
            uuid: format!("GPU-{index}"),
            model: model.into(),
            memory_bytes: gib << 30,
            state,
            mig_enabled: false,
            compute_capability: None,
            reserved: Vec::new(),
        }
    }

    fn request(requester: &Keypair, gpus: u32, model: Option<&str>) -> LeaseRequest {
        LeaseRequest {
            version: LEASE_VERSION,
            requester: requester.public().to_peer_id(),
            requester_key: requester.public().encode_protobuf(),
            nonce: 11,
            requirements: Requirements {
                gpus,
                gpu_model: model.map(str::to_string),
                gpu_slice: None,
                min_gpu_mem_bytes: None,
                cpus: 2,
                mem_bytes: 1 << 30,
                backend: "wasm".into(),
                kind: Default::default(),
            },
            duration_ms: 600_000,
            max_price_per_gpu_hour_millicredits: Some(2_000),
            sent_at_ms: NOW,
            expires_at_ms: NOW + 30_000,
            ticket: None,
            start_at_ms: None,
        }
    }

    /// The provider's book with these GPUs (index, model, GiB, lendable).
    fn provider_book(key: &Keypair, price: u64, gpus: &[(u32, &str, u64, bool)]) -> LeaseBook {
        LeaseBook::new(
            key.public().to_peer_id(),
            LeasePolicy {
                price_per_gpu_hour_millicredits: price,
                ..LeasePolicy::default()
            },
            Capacity {
                gpus: gpus
                    .iter()
                    .map(|(i, model, gib, available)| GpuSlot {
                        index: *i,
                        uuid: format!("GPU-{i}"),
                        model: model.to_string(),
                        memory_bytes: gib << 30,
                        available: *available,
                    })
                    .collect(),
                cpus: 8,
                mem_bytes: 32 << 30,
            },
        )
    }

    /// What the provider's book itself would offer for `req`, under `id`.
    fn offered(book: &mut LeaseBook, key: &Keypair, req: &LeaseRequest, id: LeaseId) -> LeaseTerms {
        book.on_request(&req.requester, req, id, key, NOW)
            .unwrap()
            .0
    }

    /// Nothing is proposed where the provider's terms cannot be foreseen: a
    /// reservation, a price above the request's limit, too few idle matching GPUs (the
    /// advert's leased or reserved ones do not count).
    #[test]
    fn nothing_is_proposed_where_the_terms_cannot_be_foreseen() {
        let (provider, requester) = (Keypair::generate_ed25519(), Keypair::generate_ed25519());
        let pid = provider.public().to_peer_id();
        let mut reserved = gpu(1, "A100-40GB", 40, GpuState::Idle);
        reserved.reserved = vec![(NOW + 60_000, NOW + 120_000)];
        let advert = ProviderAdvert {
            price: 1_500,
            gpus: vec![gpu(0, "A100-80GB", 80, GpuState::Leased), reserved],
        };
        assert!(foreseen_terms(&request(&requester, 1, Some("A100")), pid, &advert, NOW).is_none());
        assert!(foreseen_terms(&request(&requester, 1, Some("T4")), pid, &advert, NOW).is_none());
        let mut later = request(&requester, 0, None);
        later.start_at_ms = Some(NOW + 3_600_000);
        assert!(foreseen_terms(&later, pid, &advert, NOW).is_none());
        let mut cheap = request(&requester, 0, None);
        cheap.max_price_per_gpu_hour_millicredits = Some(1_000);
        assert!(foreseen_terms(&cheap, pid, &advert, NOW).is_none());
        assert!(foreseen_terms(&request(&requester, 0, None), pid, &advert, NOW).is_some());
    }

    /// An advert out of date (its idle GPU since taken by the owner, or a new price)
    /// foresees terms the provider does not offer: the proposal does not fit, and the
    /// provider's offer is what the requester then judges. (Proposals that do fit, on
    /// GPUs of several sizes, go through a provider's desk in its tests.)
    #[test]
    fn terms_foreseen_from_an_old_advert_do_not_fit() {
        let (provider, requester) = (Keypair::generate_ed25519(), Keypair::generate_ed25519());
        let pid = provider.public().to_peer_id();
        let advert = ProviderAdvert {
            price: 1_500,
            gpus: vec![
                gpu(0, "A100-80GB", 80, GpuState::Idle),
                gpu(1, "A100-40GB", 40, GpuState::Idle),
            ],
        };
        let req = request(&requester, 1, Some("A100"));
        let proposed = foreseen_terms(&req, pid, &advert, NOW).unwrap();
        assert_eq!(
            proposed.gpus[0].index, 0,
            "the lowest index, as the queue picks"
        );
        let mut taken = provider_book(
            &provider,
            1_500,
            &[(0, "A100-80GB", 80, false), (1, "A100-40GB", 40, true)],
        );
        let terms = offered(&mut taken, &provider, &req, proposed.lease_id);
        assert_eq!(terms.gpus[0].index, 1);
        assert!(!proposal_fits(&terms, &proposed, NOW));
        // Without GPUs only the price can differ.
        let req = request(&requester, 0, None);
        let proposed = foreseen_terms(&req, pid, &advert, NOW).unwrap();
        let mut same = provider_book(&provider, 1_500, &[]);
        let terms = offered(&mut same, &provider, &req, proposed.lease_id);
        assert!(proposal_fits(&terms, &proposed, NOW));
        let mut dearer = provider_book(&provider, 1_800, &[]);
        let terms = offered(&mut dearer, &provider, &req, proposed.lease_id);
        assert!(!proposal_fits(&terms, &proposed, NOW));
    }

    /// Only a grant of the proposed terms, under their id and signed by the provider
    /// over exactly those terms, is taken (the requester's loop records it as it
    /// arrives); every other answer goes back to the negotiator to judge.
    #[test]
    fn only_the_providers_grant_of_the_proposed_terms_is_taken() {
        let (provider, requester) = (Keypair::generate_ed25519(), Keypair::generate_ed25519());
        let pid = provider.public().to_peer_id();
        let advert = ProviderAdvert {
            price: 1_500,
            gpus: Vec::new(),
        };
        let terms = foreseen_terms(&request(&requester, 0, None), pid, &advert, NOW).unwrap();
        let grant = |lease_id: LeaseId, provider_sig: Vec<u8>| LeaseReply::Granted {
            lease_id,
            provider_sig,
        };
        let signed = terms.sign(&provider).unwrap();
        assert_eq!(
            granted_signature(&pid, &terms, &grant(terms.lease_id, signed.clone())),
            Some(signed.clone())
        );
        // Signed by someone else (the requester itself, say).
        let forged = grant(terms.lease_id, terms.sign(&requester).unwrap());
        assert_eq!(granted_signature(&pid, &terms, &forged), None);
        // The provider's signature, but over other terms.
        let mut other = terms.clone();
        other.end_ms += 1;
        let elsewhere = grant(terms.lease_id, other.sign(&provider).unwrap());
        assert_eq!(granted_signature(&pid, &terms, &elsewhere), None);
        // Another lease's id.
        let renamed = grant(LeaseId([9; 16]), signed.clone());
        assert_eq!(granted_signature(&pid, &terms, &renamed), None);
        // Granted by a peer it was not proposed to.
        let stranger = Keypair::generate_ed25519().public().to_peer_id();
        assert_eq!(
            granted_signature(&stranger, &terms, &grant(terms.lease_id, signed)),
            None
        );
        // Not a grant at all.
        let offer = LeaseReply::Offer {
            terms: terms.clone(),
            provider_sig: terms.sign(&provider).unwrap(),
        };
        assert_eq!(granted_signature(&pid, &terms, &offer), None);

        // The loop's decision: only the peer the proposal went to can have it recorded.
        let proposal = Proposal {
            request: request(&requester, 0, None),
            terms: terms.clone(),
            requester_sig: terms.sign(&requester).unwrap(),
        };
        let granted = grant(terms.lease_id, terms.sign(&provider).unwrap());
        let outcome = |answered_by: &PeerId| {
            let mut recorded = None;
            let reply = proposal_outcome(
                &pid,
                answered_by,
                proposal.clone(),
                granted.clone(),
                |t, p, r| {
                    recorded = Some((t, p, r));
                    Err(LeaseOpError::Store("not kept in this test".into()))
                },
            );
            (reply, recorded)
        };
        let (reply, recorded) = outcome(&pid);
        assert!(
            matches!(reply, ProposalReply::Recorded(Err(_))),
            "{reply:?}"
        );
        let (t, p, r) = recorded.expect("recorded");
        assert_eq!(t, terms);
        t.verify(&pid, &p).expect("the provider's signature");
        t.verify(&requester.public().to_peer_id(), &r)
            .expect("the requester's signature");
        let (reply, recorded) = outcome(&stranger);
        assert!(recorded.is_none());
        assert!(
            matches!(&reply, ProposalReply::Answered(a) if *a == granted),
            "{reply:?}"
        );
    }
}
