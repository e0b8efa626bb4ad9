//! Unit tests of the lease state machine: every transition and every rejection, driven
//! by messages and an explicit `now`, without a network.

use super::*;
use crate::lease::policy::GpuSlot;
use gpunode_protocol::lease::{LeaseId, LeasedGpu, Requirements};
use proptest::prelude::*;
use std::collections::HashSet;

const NOW: UnixMillis = 1_800_000_000_000;

struct Fixture {
    provider_key: Keypair,
    requester_key: Keypair,
    book: LeaseBook,
    next_id: u8,
}

fn slot(i: u32, model: &str, gib: u64) -> GpuSlot {
    GpuSlot {
        index: i,
        uuid: format!("GPU-{i}"),
        model: model.into(),
        memory_bytes: gib << 30,
        available: true,
    }
}

fn capacity() -> Capacity {
    Capacity {
        gpus: vec![
            slot(0, "A100-80GB", 80),
            slot(1, "A100-40GB", 40),
            slot(2, "T4-16GB", 16),
            slot(3, "L4-24GB", 24),
        ],
        cpus: 16,
        mem_bytes: 64 << 30,
    }
}

impl Fixture {
    fn new() -> Fixture {
        Fixture::with_policy(LeasePolicy {
            max_gpus_per_peer: 3,
            ..LeasePolicy::default()
        })
    }

    fn with_policy(policy: LeasePolicy) -> Fixture {
        let provider_key = Keypair::generate_ed25519();
        let book = LeaseBook::new(provider_key.public().to_peer_id(), policy, capacity());
        Fixture {
            provider_key,
            requester_key: Keypair::generate_ed25519(),
            book,
            next_id: 0,
        }
    }

    fn requester(&self) -> PeerId {
        self.requester_key.public().to_peer_id()
    }

    fn request(&self, gpus: u32, model: Option<&str>, nonce: u64) -> LeaseRequest {
        LeaseRequest {
            version: LEASE_VERSION,
            requester: self.requester(),
            requester_key: self.requester_key.public().encode_protobuf(),
            nonce,
            requirements: Requirements {
                gpus,
                gpu_model: model.map(str::to_string),
                gpu_slice: None,
                min_gpu_mem_bytes: None,
                cpus: 2,
                mem_bytes: 4 << 30,
                backend: "wasm".into(),
                kind: Default::default(),
            },
            duration_ms: 1_800_000,
            max_price_per_gpu_hour_millicredits: None,
            sent_at_ms: NOW,
            expires_at_ms: NOW + 30_000,
            ticket: None,
            start_at_ms: None,
        }
    }

    fn id(&mut self) -> LeaseId {
        self.next_id += 1;
        LeaseId([self.next_id; 16])
    }

    fn offer(
        &mut self,
        req: &LeaseRequest,
        now: UnixMillis,
    ) -> Result<(LeaseTerms, Vec<u8>), Rejection> {
        let id = self.id();
        let from = req.requester;
        self.book
            .on_request(&from, req, id, &self.provider_key, now)
    }

    fn accept(
        &mut self,
        terms: &LeaseTerms,
        psig: &[u8],
        now: UnixMillis,
    ) -> Result<LeaseId, Rejection> {
        let rsig = terms.sign(&self.requester_key).unwrap();
        let me = self.requester();
        self.book.on_accept(&me, terms, psig, &rsig, now)
    }

    fn active_lease(&mut self, nonce: u64) -> LeaseTerms {
        let req = self.request(1, Some("A100"), nonce);
        let (terms, psig) = self.offer(&req, NOW).unwrap();
        self.accept(&terms, &psig, NOW + 10).unwrap();
        terms
    }
}

fn code<T: std::fmt::Debug>(r: Result<T, Rejection>) -> RejectCode {
    r.expect_err("expected a rejection").code
}

#[test]
fn request_offer_accept_activates_with_both_signatures() {
    let mut f = Fixture::new();
    let req = f.request(2, Some("A100"), 1);
    let (terms, psig) = f.offer(&req, NOW).unwrap();
    assert_eq!(terms.gpus.len(), 2);
    assert!(terms.gpus.iter().all(|g| g.model.starts_with("A100")));
    // Smallest sufficient first: the 40 GB one is picked before the 80 GB one.
    assert_eq!(terms.gpus[0].uuid, "GPU-1");
    assert_eq!(terms.end_ms - terms.start_ms, 1_800_000);
    assert_eq!(
        f.book.get(&terms.lease_id).unwrap().state,
        LeaseState::Offered
    );
    assert_eq!(f.book.committed_gpus().len(), 2);
    let id = f.accept(&terms, &psig, NOW + 5).unwrap();
    let rec = f.book.get(&id).unwrap();
    assert_eq!(rec.state, LeaseState::Active);
    assert_eq!(rec.signatures_valid(), (true, true));
    assert!(f.book.take_changes().contains(&Change::Lease(id)));
    // Price: 1 credit/GPU-h, 2 GPUs, half an hour.
    assert_eq!(terms.max_amount_millicredits(), 1000);
}

const HOUR: u64 = 3_600_000;

/// A request for the one T4 (GPU 2) from `start` for `hours`.
fn t4_request(
    f: &Fixture,
    nonce: u64,
    start: Option<UnixMillis>,
    duration_ms: u64,
) -> LeaseRequest {
    let mut req = f.request(1, Some("T4"), nonce);
    req.start_at_ms = start;
    req.duration_ms = duration_ms;
    req
}

#[test]
fn a_reservation_holds_its_gpu_only_from_its_start() {
    let mut f = Fixture::new();
    let req = t4_request(&f, 1, Some(NOW + HOUR), HOUR);
    let (terms, psig) = f.offer(&req, NOW).unwrap();
    assert_eq!((terms.start_ms, terms.end_ms), (NOW + HOUR, NOW + 2 * HOUR));
    assert_eq!(f.book.committed_totals(), (0, 0, 0), "nothing held now");
    let id = f.accept(&terms, &psig, NOW + 5).unwrap();
    assert_eq!(f.book.get(&id).unwrap().state, LeaseState::Reserved);
    assert_eq!(f.book.committed_totals(), (0, 0, 0));
    // At its start it becomes active and holds the GPU.
    assert_eq!(f.book.next_lease_deadline(), Some(NOW + HOUR));
    f.book.tick(NOW + HOUR);
    assert_eq!(f.book.get(&id).unwrap().state, LeaseState::Active);
    assert_eq!(f.book.committed_totals().0, 1);
    f.book.tick(NOW + 2 * HOUR);
    assert_eq!(f.book.get(&id).unwrap().state, LeaseState::Completed);
}

#[test]
fn overlapping_reservations_conflict_and_adjacent_ones_do_not() {
    let mut f = Fixture::new();
    let (terms, psig) = f
        .offer(&t4_request(&f, 1, Some(NOW + HOUR), 2 * HOUR), NOW)
        .unwrap();
    f.accept(&terms, &psig, NOW + 5).unwrap();
    // Overlaps the end: refused, naming the reservation in the way.
    let err = f
        .offer(&t4_request(&f, 2, Some(NOW + 2 * HOUR), HOUR), NOW)
        .unwrap_err();
    assert_eq!(err.code, RejectCode::NoCapacity);
    assert!(err.message.contains("GPU 2 is reserved"), "{}", err.message);
    // Starts where the first ends: fine.
    let (second, _) = f
        .offer(&t4_request(&f, 3, Some(NOW + 3 * HOUR), HOUR), NOW)
        .unwrap();
    assert_eq!(second.gpus[0].index, 2);
    // A reservation whose window a present lease runs into is refused too.
    let mut g = Fixture::new();
    let (now_lease, psig) = g.offer(&t4_request(&g, 1, None, 2 * HOUR), NOW).unwrap();
    g.accept(&now_lease, &psig, NOW + 5).unwrap();
    assert_eq!(
        code(g.offer(&t4_request(&g, 2, Some(NOW + HOUR), HOUR), NOW)),
        RejectCode::NoCapacity
    );
    // Too far ahead: refused as invalid.
    assert_eq!(
        code(g.offer(&t4_request(&g, 3, Some(NOW + 100 * 24 * HOUR), HOUR), NOW)),
        RejectCode::InvalidRequest
    );
}

#[test]
fn backfill_lends_a_reserved_gpu_only_until_its_reservation() {
    let mut f = Fixture::new();
    let (terms, psig) = f
        .offer(&t4_request(&f, 1, Some(NOW + HOUR), HOUR), NOW)
        .unwrap();
    let reservation = f.accept(&terms, &psig, NOW + 5).unwrap();
    // Two hours from now would run into the reservation: refused.
    assert_eq!(
        code(f.offer(&t4_request(&f, 2, None, 2 * HOUR), NOW)),
        RejectCode::NoCapacity
    );
    // Forty minutes ends before it: lent.
    let (short, psig) = f.offer(&t4_request(&f, 3, None, 40 * 60_000), NOW).unwrap();
    let short_id = f.accept(&short, &psig, NOW + 5).unwrap();
    // It may not be renewed into the reservation.
    let renewal = Renewal {
        lease_id: short_id,
        new_end_ms: NOW + 90 * 60_000,
        nonce: 77,
    };
    let rsig = renewal.sign(&f.requester_key).unwrap();
    let me = f.requester();
    let err = f
        .book
        .on_renew(&me, &renewal, &rsig, &f.provider_key, NOW + 60_000)
        .unwrap_err();
    assert!(err.message.contains("reserved"), "{}", err.message);
    // The reservation starts on time, on its GPU.
    f.book.tick(NOW + 40 * 60_000);
    f.book.tick(NOW + HOUR);
    assert_eq!(f.book.get(&reservation).unwrap().state, LeaseState::Active);
    // And the timeline shows it to the queue's plan.
    let mut g = Fixture::new();
    let (terms, psig) = g
        .offer(&t4_request(&g, 1, Some(NOW + HOUR), HOUR), NOW)
        .unwrap();
    g.accept(&terms, &psig, NOW + 5).unwrap();
    let t4 = g
        .book
        .timelines(NOW)
        .into_iter()
        .find(|t| t.index == 2)
        .unwrap();
    assert_eq!(t4.reserved, vec![(NOW + HOUR, NOW + 2 * HOUR)]);
    assert_eq!(t4.free_at, Some(NOW));
}

#[test]
fn no_capacity_names_what_is_free() {
    let mut f = Fixture::new();
    let mut req = f.request(1, None, 1);
    req.requirements.min_gpu_mem_bytes = Some(100 << 30);
    let err = f.offer(&req, NOW).unwrap_err();
    assert_eq!(err.code, RejectCode::NoCapacity);
    assert!(
        err.message.contains("largest free is 80G"),
        "{}",
        err.message
    );
    let err = f.offer(&f.request(1, Some("H100"), 2), NOW).unwrap_err();
    assert!(err.message.contains("no H100 GPU free"), "{}", err.message);
    let mut req = f.request(0, None, 3);
    req.requirements.cpus = 17;
    assert!(f
        .offer(&req, NOW)
        .unwrap_err()
        .message
        .contains("16 are free"));
    let mut req = f.request(0, None, 4);
    req.requirements.mem_bytes = 65 << 30;
    assert_eq!(code(f.offer(&req, NOW)), RejectCode::NoCapacity);
    // Nothing was reserved by any of these.
    assert!(f.book.committed_gpus().is_empty());
    assert_eq!(f.book.committed_totals(), (0, 0, 0));
}

#[test]
fn owner_busy_gpus_are_not_lent() {
    let mut f = Fixture::new();
    let mut cap = capacity();
    cap.gpus
        .iter_mut()
        .for_each(|g| g.available = g.model.starts_with('T'));
    f.book.set_capacity(cap);
    assert_eq!(
        code(f.offer(&f.request(1, Some("A100"), 1), NOW)),
        RejectCode::NoCapacity
    );
    assert!(f.offer(&f.request(1, Some("T4"), 2), NOW).is_ok());
}

#[test]
fn request_rejections() {
    let mut f = Fixture::new();
    // Requester field names someone else than the connection's peer.
    let req = f.request(1, None, 1);
    let other = Keypair::generate_ed25519().public().to_peer_id();
    let id = f.id();
    assert_eq!(
        code(f.book.on_request(&other, &req, id, &f.provider_key, NOW)),
        RejectCode::WrongKey
    );
    // Key that does not belong to the requester.
    let mut req = f.request(1, None, 2);
    req.requester_key = Keypair::generate_ed25519().public().encode_protobuf();
    assert_eq!(code(f.offer(&req, NOW)), RejectCode::WrongKey);
    // Clock skew beyond tolerance, and an expired request.
    let mut req = f.request(1, None, 3);
    req.sent_at_ms = NOW + MAX_CLOCK_SKEW_MS + 1;
    req.expires_at_ms = req.sent_at_ms + 30_000;
    assert_eq!(code(f.offer(&req, NOW)), RejectCode::ClockSkew);
    let mut req = f.request(1, None, 4);
    req.sent_at_ms = NOW + MAX_CLOCK_SKEW_MS;
    req.expires_at_ms = req.sent_at_ms + 30_000;
    assert!(
        f.offer(&req, NOW).is_ok(),
        "skew within tolerance is accepted"
    );
    let req = f.request(1, None, 5);
    assert_eq!(code(f.offer(&req, NOW + 30_000)), RejectCode::ClockSkew);
    // Replay of a nonce.
    let req = f.request(1, None, 6);
    f.offer(&req, NOW).unwrap();
    assert_eq!(code(f.offer(&req, NOW + 1)), RejectCode::Replay);
    // Unsupported version.
    let mut req = f.request(1, None, 7);
    req.version = 99;
    assert_eq!(code(f.offer(&req, NOW)), RejectCode::InvalidRequest);
}

#[test]
fn policy_rejections() {
    let requester = Keypair::generate_ed25519();
    let mut f = Fixture::with_policy(LeasePolicy {
        max_duration_ms: 3_600_000,
        price_per_gpu_hour_millicredits: 2000,
        max_gpus_per_peer: 2,
        deny_peers: vec![requester.public().to_peer_id()],
        ..LeasePolicy::default()
    });
    let mut req = f.request(1, None, 1);
    req.duration_ms = 3_600_001;
    assert_eq!(code(f.offer(&req, NOW)), RejectCode::DurationOutOfPolicy);
    let mut req = f.request(1, None, 2);
    req.duration_ms = 0;
    assert_eq!(code(f.offer(&req, NOW)), RejectCode::DurationOutOfPolicy);
    let mut req = f.request(1, None, 3);
    req.max_price_per_gpu_hour_millicredits = Some(1999);
    assert_eq!(code(f.offer(&req, NOW)), RejectCode::PriceTooHigh);
    let mut req = f.request(1, None, 4);
    req.requirements.backend = "container".into();
    assert_eq!(code(f.offer(&req, NOW)), RejectCode::BackendUnsupported);
    // Per-peer GPU limit counts holds too.
    f.offer(&f.request(2, None, 5), NOW).unwrap();
    let err = f.offer(&f.request(1, None, 6), NOW).unwrap_err();
    assert_eq!(err.code, RejectCode::PeerGpuLimit);
    assert!(err.message.contains("hold 2 GPUs"), "{}", err.message);
    let mut one = Fixture::with_policy(LeasePolicy {
        max_gpus_per_peer: 1,
        ..LeasePolicy::default()
    });
    one.offer(&one.request(1, None, 1), NOW).unwrap();
    let err = one.offer(&one.request(1, None, 2), NOW).unwrap_err();
    assert!(
        err.message.contains("you hold 1 GPU here"),
        "{}",
        err.message
    );
    // Deny list.
    f.requester_key = requester;
    assert_eq!(
        code(f.offer(&f.request(1, None, 7), NOW)),
        RejectCode::PeerNotAllowed
    );
    // Allow list that does not name the peer.
    let mut g = Fixture::with_policy(LeasePolicy {
        allow_peers: vec![Keypair::generate_ed25519().public().to_peer_id()],
        ..LeasePolicy::default()
    });
    assert_eq!(
        code(g.offer(&g.request(1, None, 1), NOW)),
        RejectCode::PeerNotAllowed
    );
}

#[test]
fn accept_rejections_reserve_nothing_more() {
    let mut f = Fixture::new();
    let req = f.request(1, Some("T4"), 1);
    let (terms, psig) = f.offer(&req, NOW).unwrap();
    let me = f.requester();
    // Countersigned by a key that is not the requester's.
    let forged = terms.sign(&Keypair::generate_ed25519()).unwrap();
    assert_eq!(
        code(f.book.on_accept(&me, &terms, &psig, &forged, NOW)),
        RejectCode::BadSignature
    );
    // Missing (empty) provider signature.
    let rsig = terms.sign(&f.requester_key).unwrap();
    assert_eq!(
        code(f.book.on_accept(&me, &terms, &[], &rsig, NOW)),
        RejectCode::BadSignature
    );
    // Terms altered after signing (longer lease), signed by the requester.
    let mut altered = terms.clone();
    altered.end_ms += 3_600_000;
    let asig = altered.sign(&f.requester_key).unwrap();
    assert_eq!(
        code(f.book.on_accept(&me, &altered, &psig, &asig, NOW)),
        RejectCode::TermsAltered
    );
    // Someone else accepting the offer.
    let other = Keypair::generate_ed25519();
    let osig = terms.sign(&other).unwrap();
    assert_eq!(
        code(
            f.book
                .on_accept(&other.public().to_peer_id(), &terms, &psig, &osig, NOW)
        ),
        RejectCode::UnknownLease
    );
    // Unknown lease.
    let mut unknown = terms.clone();
    unknown.lease_id = LeaseId([0xee; 16]);
    assert_eq!(
        code(f.book.on_accept(&me, &unknown, &psig, &rsig, NOW)),
        RejectCode::UnknownLease
    );
    assert_eq!(
        f.book.get(&terms.lease_id).unwrap().state,
        LeaseState::Offered
    );
    assert_eq!(f.book.committed_gpus().len(), 1);
    // Too late: the hold is released.
    let late = terms.offer_expires_ms + 1;
    assert_eq!(
        code(f.book.on_accept(&me, &terms, &psig, &rsig, late)),
        RejectCode::OfferExpired
    );
    assert_eq!(
        f.book.get(&terms.lease_id).unwrap().state,
        LeaseState::Expired
    );
    assert!(f.book.committed_gpus().is_empty());
    // And cannot be accepted again.
    assert_eq!(
        code(f.book.on_accept(&me, &terms, &psig, &rsig, NOW)),
        RejectCode::WrongState
    );
}

#[test]
fn offer_window_passing_releases_the_hold() {
    let mut f = Fixture::new();
    let (terms, _) = f.offer(&f.request(1, None, 1), NOW).unwrap();
    assert_eq!(f.book.committed_totals().0, 1);
    assert!(f.book.tick(terms.offer_expires_ms).is_empty());
    assert_eq!(
        f.book.tick(terms.offer_expires_ms + 1),
        vec![terms.lease_id]
    );
    assert_eq!(
        f.book.get(&terms.lease_id).unwrap().state,
        LeaseState::Expired
    );
    assert_eq!(f.book.committed_totals(), (0, 0, 0));
}

#[test]
fn active_lease_completes_at_its_end() {
    let mut f = Fixture::new();
    let terms = f.active_lease(1);
    f.book.tick(terms.end_ms - 1);
    assert_eq!(
        f.book.get(&terms.lease_id).unwrap().state,
        LeaseState::Active
    );
    f.book.tick(terms.end_ms);
    assert_eq!(
        f.book.get(&terms.lease_id).unwrap().state,
        LeaseState::Completed
    );
    assert!(f.book.committed_gpus().is_empty());
}

#[test]
fn renewals_within_policy_only() {
    let mut f = Fixture::with_policy(LeasePolicy {
        max_duration_ms: 3_600_000,
        ..LeasePolicy::default()
    });
    let terms = f.active_lease(1);
    let me = f.requester();
    let renewal = Renewal {
        lease_id: terms.lease_id,
        new_end_ms: terms.end_ms + 600_000,
        nonce: 77,
    };
    let rsig = renewal.sign(&f.requester_key).unwrap();
    let psig = f
        .book
        .on_renew(&me, &renewal, &rsig, &f.provider_key, NOW + 100)
        .unwrap();
    assert!(renewal.verify(&f.book.local, &psig).is_ok());
    let rec = f.book.get(&terms.lease_id).unwrap();
    assert_eq!(rec.terms.end_ms, terms.end_ms + 600_000);
    assert_eq!(rec.signatures_valid(), (true, true));
    // Replay of the same renewal.
    assert_eq!(
        code(
            f.book
                .on_renew(&me, &renewal, &rsig, &f.provider_key, NOW + 200)
        ),
        RejectCode::Replay
    );
    // Beyond the longest lease allowed.
    let too_long = Renewal {
        lease_id: terms.lease_id,
        new_end_ms: terms.start_ms + 3_600_001,
        nonce: 78,
    };
    let s = too_long.sign(&f.requester_key).unwrap();
    assert_eq!(
        code(f.book.on_renew(&me, &too_long, &s, &f.provider_key, NOW)),
        RejectCode::DurationOutOfPolicy
    );
    // Signed by someone else.
    let r2 = Renewal {
        nonce: 79,
        new_end_ms: terms.end_ms + 900_000,
        ..renewal.clone()
    };
    let bad = r2.sign(&Keypair::generate_ed25519()).unwrap();
    assert_eq!(
        code(f.book.on_renew(&me, &r2, &bad, &f.provider_key, NOW)),
        RejectCode::BadSignature
    );
    // Not active any more.
    f.book.tick(terms.end_ms + 700_000);
    let s = r2.sign(&f.requester_key).unwrap();
    assert_eq!(
        code(f.book.on_renew(&me, &r2, &s, &f.provider_key, NOW)),
        RejectCode::WrongState
    );
}

#[test]
fn cancel_releases_at_once_and_only_by_a_party() {
    let mut f = Fixture::new();
    let terms = f.active_lease(1);
    let outsider = Keypair::generate_ed25519();
    let c = Cancellation {
        lease_id: terms.lease_id,
        by: outsider.public().to_peer_id(),
        at_ms: NOW,
    };
    let s = c.sign(&outsider).unwrap();
    assert_eq!(
        code(f.book.on_cancel(&c.by, &c, &s, NOW)),
        RejectCode::UnknownLease
    );
    let me = f.requester();
    assert_eq!(f.book.exposure(&me), terms.max_amount_millicredits());
    assert_eq!(f.book.exposure(&outsider.public().to_peer_id()), 0);
    let c = Cancellation { by: me, ..c };
    let forged = c.sign(&outsider).unwrap();
    assert_eq!(
        code(f.book.on_cancel(&me, &c, &forged, NOW)),
        RejectCode::BadSignature
    );
    assert_eq!(f.book.committed_gpus().len(), 1);
    let s = c.sign(&f.requester_key).unwrap();
    f.book.on_cancel(&me, &c, &s, NOW).unwrap();
    assert_eq!(
        f.book.get(&terms.lease_id).unwrap().state,
        LeaseState::Cancelled
    );
    assert!(f.book.committed_gpus().is_empty());
    assert_eq!(
        f.book.exposure(&me),
        0,
        "a cancelled lease can cost nothing more"
    );
    assert_eq!(
        code(f.book.on_cancel(&me, &c, &s, NOW)),
        RejectCode::WrongState
    );
}

#[test]
fn restart_forgets_holds_keeps_leases_and_nonces() {
    let mut f = Fixture::new();
    let active = f.active_lease(1);
    let held_req = f.request(1, Some("T4"), 2);
    let (held, _) = f.offer(&held_req, NOW).unwrap();
    let leases: Vec<LeaseRecord> = f.book.all().into_iter().cloned().collect();
    let nonces = vec![
        (f.requester(), 1, NOW + 60_000),
        (f.requester(), 2, NOW + 60_000),
    ];
    let mut restored = LeaseBook::restore(
        f.book.local,
        f.book.policy.clone(),
        capacity(),
        leases,
        nonces,
        NOW + 20,
    );
    assert_eq!(
        restored.get(&active.lease_id).unwrap().state,
        LeaseState::Active
    );
    assert_eq!(
        restored.get(&held.lease_id).unwrap().state,
        LeaseState::Expired
    );
    assert_eq!(restored.committed_gpus().len(), 1);
    // The old request cannot be replayed after the restart.
    let id = LeaseId([0x55; 16]);
    let from = f.requester();
    assert_eq!(
        code(restored.on_request(&from, &held_req, id, &f.provider_key, NOW + 30)),
        RejectCode::Replay
    );
    // A lease whose end passed while the node was down is completed.
    let later = LeaseBook::restore(
        f.book.local,
        f.book.policy.clone(),
        capacity(),
        restored.all().into_iter().cloned().collect(),
        vec![],
        active.end_ms + 1,
    );
    assert_eq!(
        later.get(&active.lease_id).unwrap().state,
        LeaseState::Completed
    );
}

#[test]
fn canonical_encoding_and_signature_are_stable() {
    let key = Keypair::ed25519_from_bytes([7u8; 32]).unwrap();
    let requester = Keypair::ed25519_from_bytes([9u8; 32]).unwrap();
    let terms = LeaseTerms {
        version: 1,
        lease_id: LeaseId([1; 16]),
        provider: key.public().to_peer_id(),
        requester: requester.public().to_peer_id(),
        gpus: vec![LeasedGpu {
            index: 0,
            uuid: "GPU-0".into(),
            model: "A100-80GB".into(),
            memory_bytes: 80 << 30,
        }],
        cpus: 4,
        mem_bytes: 16 << 30,
        backend: "wasm".into(),
        start_ms: 1_800_000_000_000,
        end_ms: 1_800_001_800_000,
        price_per_gpu_hour_millicredits: 1500,
        request_nonce: 42,
        offer_expires_ms: 1_800_000_010_000,
    };
    let bytes = terms.canonical_bytes();
    let sig = terms.sign(&key).unwrap();
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    assert_eq!(
        hex(&bytes),
        TEST_VECTOR_BYTES,
        "canonical bytes changed: a wire-format break"
    );
    assert_eq!(
        hex(&sig),
        TEST_VECTOR_SIGNATURE,
        "signature changed: a wire-format break"
    );
    assert!(terms.verify(&key.public().to_peer_id(), &sig).is_ok());
}

const TEST_VECTOR_BYTES: &str = "0100010101010101010101010101010101012600000000000000002408011220ea4a6c63e29c520abef5507b132ec5f9954776aebebe7b92421eea691446d22c2600000000000000002408011220fd1724385aa0c75b64fb78cd602fa1d991fdebf76b13c58ed702eac835e9f61801000000000000000000000005000000000000004750552d300900000000000000413130302d38304742000000001400000004000000000000000400000004000000000000007761736d00505c18a301000040c77718a3010000dc050000000000002a0000000000000010775c18a3010000";
const TEST_VECTOR_SIGNATURE: &str = "bd9b82ba52a4d545685b9687ad8f8958ea81c3f10d4787e17ca1d6e3a1c561890bcb7c9e8198fb91a67572ba5a038518d12c4b77e4c9d82533c95ea032099b03";

#[derive(Debug, Clone)]
enum Op {
    Request { peer: usize, gpus: u32, cpus: u32 },
    Accept { which: usize, late: bool },
    Renew { which: usize, extra_s: u64 },
    Cancel { which: usize },
    Tick { ms: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0usize..4, 0u32..4, 0u32..10).prop_map(|(peer, gpus, cpus)| Op::Request {
            peer,
            gpus,
            cpus
        }),
        (0usize..64, any::<bool>()).prop_map(|(which, late)| Op::Accept { which, late }),
        (0usize..64, 1u64..7200).prop_map(|(which, extra_s)| Op::Renew { which, extra_s }),
        (0usize..64).prop_map(|which| Op::Cancel { which }),
        (1u64..120_000).prop_map(|ms| Op::Tick { ms }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]
    #[test]
    fn never_over_commits_and_never_leaves_a_hold(ops in proptest::collection::vec(op(), 1..120)) {
        let provider = Keypair::generate_ed25519();
        let peers: Vec<Keypair> = (0..4).map(|_| Keypair::generate_ed25519()).collect();
        let cap = capacity();
        let mut book = LeaseBook::new(provider.public().to_peer_id(), LeasePolicy::default(), cap.clone());
        let mut offers: Vec<(usize, LeaseTerms, Vec<u8>)> = Vec::new();
        let mut now = NOW;
        let mut nonce = 0u64;
        for op in ops {
            match op {
                Op::Request { peer, gpus, cpus } => {
                    nonce += 1;
                    let k = &peers[peer];
                    let req = LeaseRequest {
                        version: LEASE_VERSION,
                        requester: k.public().to_peer_id(),
                        requester_key: k.public().encode_protobuf(),
                        nonce,
                        requirements: Requirements { gpus, gpu_model: None, gpu_slice: None, min_gpu_mem_bytes: None, cpus, mem_bytes: (cpus as u64) << 30, backend: "wasm".into(), kind: Default::default() },
                        duration_ms: 60_000,
                        max_price_per_gpu_hour_millicredits: None,
                        sent_at_ms: now,
                        expires_at_ms: now + 30_000,
                        ticket: None,
                        start_at_ms: None,
                    };
                    let mut id = [0u8; 16];
                    id[..8].copy_from_slice(&nonce.to_le_bytes());
                    if let Ok((t, s)) = book.on_request(&k.public().to_peer_id(), &req, LeaseId(id), &provider, now) {
                        offers.push((peer, t, s));
                    }
                }
                Op::Accept { which, late } if !offers.is_empty() => {
                    let (peer, t, s) = &offers[which % offers.len()];
                    let k = &peers[*peer];
                    let at = if late { t.offer_expires_ms + 1 } else { now };
                    let at = at.max(now);
                    let _ = book.on_accept(&k.public().to_peer_id(), t, s, &t.sign(k).unwrap(), at);
                    now = at;
                }
                Op::Renew { which, extra_s } if !offers.is_empty() => {
                    let (peer, t, _) = &offers[which % offers.len()];
                    let k = &peers[*peer];
                    nonce += 1;
                    let end = book.get(&t.lease_id).map(|l| l.terms.end_ms).unwrap_or(t.end_ms);
                    let r = Renewal { lease_id: t.lease_id, new_end_ms: end + extra_s * 1000, nonce };
                    let _ = book.on_renew(&k.public().to_peer_id(), &r, &r.sign(k).unwrap(), &provider, now);
                }
                Op::Cancel { which } if !offers.is_empty() => {
                    let (peer, t, _) = &offers[which % offers.len()];
                    let k = &peers[*peer];
                    let c = Cancellation { lease_id: t.lease_id, by: k.public().to_peer_id(), at_ms: now };
                    let _ = book.on_cancel(&k.public().to_peer_id(), &c, &c.sign(k).unwrap(), now);
                }
                Op::Tick { ms } => {
                    now += ms;
                    book.tick(now);
                }
                _ => {}
            }
            // Invariants after every step.
            let holding: Vec<&LeaseRecord> = book.all().into_iter().filter(|l| l.state.holds_resources() && l.role == LeaseRole::Provider).collect();
            let mut uuids = HashSet::new();
            for l in &holding {
                for g in &l.terms.gpus {
                    prop_assert!(uuids.insert(g.uuid.clone()), "GPU {} committed twice", g.uuid);
                }
            }
            prop_assert!(uuids.len() <= cap.gpus.len());
            let (gpus, cpus, mem) = book.committed_totals();
            prop_assert!(cpus <= cap.cpus);
            prop_assert!(mem <= cap.mem_bytes);
            // The running totals agree with a recount from the records.
            prop_assert_eq!(gpus, uuids.len());
            prop_assert_eq!(book.committed_gpus(), uuids);
            prop_assert_eq!(cpus, holding.iter().map(|l| l.terms.cpus).sum::<u32>());
            prop_assert_eq!(mem, holding.iter().map(|l| l.terms.mem_bytes).sum::<u64>());
            let active = book.all().iter().filter(|l| l.state == LeaseState::Active).count();
            prop_assert_eq!(book.active_count(), active);
            // The live view is exactly the records that hold resources, in `all`'s order.
            let live: Vec<LeaseId> = book.live().iter().map(|l| l.terms.lease_id).collect();
            let want: Vec<LeaseId> = book.all().iter().filter(|l| l.state.holds_resources()).map(|l| l.terms.lease_id).collect();
            prop_assert_eq!(live, want);
        }
        // Once every window and lease end has passed, nothing is held.
        book.tick(now + 365 * 24 * 3_600_000);
        prop_assert_eq!(book.committed_totals(), (0, 0, 0));
        prop_assert!(book.all().iter().all(|l| l.state != LeaseState::Offered));
    }
}

#[test]
fn far_future_nonces_and_old_records_do_not_pile_up() {
    let mut f = Fixture::new();
    // A request that says it expires in a century would pin its nonce that long.
    let mut forever = f.request(1, Some("T4"), 900);
    forever.expires_at_ms = u64::MAX;
    let err = f.offer(&forever, NOW).expect_err("far future");
    assert_eq!(err.code, RejectCode::InvalidRequest);
    assert_eq!(f.book.nonce_count(), 0, "nothing remembered for it");

    // Offers that expire unsigned, and a lease that ran to its end.
    for n in 0..20 {
        let req = f.request(1, Some("T4"), 1000 + n);
        f.offer(&req, NOW).expect("offer");
        f.book.tick(NOW + 20_000);
    }
    let done = f.active_lease(5000);
    f.book.tick(done.end_ms + 1);
    assert_eq!(f.book.record_count(), 21);
    let _ = f.book.take_changes();
    // An hour later the expired offers are gone; the ended lease stays for its
    // retention (settlement may still need it).
    let later = done.end_ms + EXPIRED_OFFER_RETENTION_MS + PRUNE_EVERY_MS + 1;
    f.book.tick(later);
    assert_eq!(f.book.record_count(), 1);
    let forgotten = f
        .book
        .take_changes()
        .iter()
        .filter(|c| matches!(c, Change::ForgetLease(_)))
        .count();
    assert_eq!(forgotten, 20, "each is removed from the store too");
    assert!(f.book.get(&done.lease_id).is_some());
    let after_retention = later + LeasePolicy::default().retention_ms + PRUNE_EVERY_MS;
    f.book.tick(after_retention);
    assert_eq!(f.book.record_count(), 0);
    // Every spent nonce is gone by then too.
    assert_eq!(f.book.nonce_count(), 0);
}

#[test]
fn mig_slices_of_one_card_go_to_one_peer_at_a_time() {
    let mig = |i: u32| GpuSlot {
        index: 0,
        uuid: format!("MIG-sim-card0-{i}"),
        model: "A100-80GB MIG 2g.20gb".into(),
        memory_bytes: 20 << 30,
        available: true,
    };
    let provider_key = Keypair::generate_ed25519();
    let mut book = LeaseBook::new(
        provider_key.public().to_peer_id(),
        LeasePolicy::default(),
        Capacity {
            gpus: vec![mig(0), mig(1), mig(2)],
            cpus: 16,
            mem_bytes: 64 << 30,
        },
    );
    let alice = Fixture::new();
    let bob = Fixture::new();
    let slice = |f: &Fixture, nonce| {
        let mut r = f.request(1, None, nonce);
        r.requirements.gpu_slice = Some("2g.20gb".into());
        r
    };
    let lease = |f: &Fixture, nonce, id: u8, book: &mut LeaseBook| {
        let req = slice(f, nonce);
        book.on_request(&f.requester(), &req, LeaseId([id; 16]), &provider_key, NOW)
            .map(|(terms, psig)| {
                let rsig = terms.sign(&f.requester_key).expect("sign");
                book.on_accept(&f.requester(), &terms, &psig, &rsig, NOW + 1)
                    .expect("accept");
                terms
            })
    };
    let first = lease(&alice, 1, 1, &mut book).expect("alice gets a slice");
    // Bob may not share the card with Alice, however many slices are free.
    let err = lease(&bob, 2, 2, &mut book).expect_err("bob refused");
    assert_eq!(err.code, RejectCode::NoCapacity, "{}", err.message);
    // Alice may take more of her card.
    lease(&alice, 3, 3, &mut book).expect("alice's second slice");
    // Once Alice's leases end, Bob gets the card.
    book.tick(first.end_ms + 1);
    lease(&bob, 4, 4, &mut book).expect("bob after alice");
}

#[test]
fn a_book_without_leases_still_forgets_the_nonces_it_refused() {
    let mut f = Fixture::new();
    assert_eq!(f.book.next_deadline(), None, "nothing to do");
    // Refused (no such GPU), but its nonce is spent.
    let req = f.request(1, Some("H100"), 5);
    assert!(f.offer(&req, NOW).is_err());
    assert_eq!(f.book.nonce_count(), 1);
    assert_eq!(f.book.record_count(), 0);
    let due = f
        .book
        .next_deadline()
        .expect("the nonce's expiry is a deadline");
    assert!(
        due > NOW && due <= req.expires_at_ms + MAX_CLOCK_SKEW_MS + 1000,
        "{due}"
    );
    f.book.tick(due);
    assert_eq!(f.book.nonce_count(), 0);
    assert_eq!(f.book.next_deadline(), None);
}
