//! Unit tests of the lease desk: every admission path and what follows from it, driven
//! by messages and an explicit `now`, with the requester's standing from a table.

use std::collections::{HashMap, HashSet};

use gpunode_protocol::lease::{LeaseRequest, Requirements, LEASE_VERSION};
use gpunode_protocol::time::UnixMillis;

use super::*;
use crate::lease::policy::GpuSlot;
use crate::lease::{Capacity, LeasePolicy, LeaseState};

/// 2027-01-15 08:00 UTC, a Friday.
const NOW: UnixMillis = 1_800_000_000_000;
const HOUR: u64 = 3_600_000;

/// What the tests' node knows of its peers.
#[derive(Default)]
struct Table {
    /// `Some`: the node is in a team of these members.
    members: Option<HashSet<PeerId>>,
    /// The team policy refuses with this reason.
    policy_says_no: Option<String>,
    /// The accounts refuse credit.
    no_credit: bool,
    priorities: HashMap<PeerId, i32>,
    preempts: bool,
}

impl Standings for Table {
    fn may_lease(&self, peer: &PeerId) -> bool {
        self.members.as_ref().is_none_or(|m| m.contains(peer))
    }
    fn team_policy(&self, _: &PeerId, _: JobKind, _: u32, _: u64, _: u64) -> Result<(), String> {
        self.policy_says_no.clone().map_or(Ok(()), Err)
    }
    fn admit_credit(&self, _: &PeerId, _: u64, _: u64) -> Result<(), Rejection> {
        if self.no_credit {
            return Err(Rejection::new(RejectCode::DebtLimit, "in debt"));
        }
        Ok(())
    }
    fn standing(&self, peer: &PeerId) -> Standing {
        Standing {
            priority: self.priorities.get(peer).copied().unwrap_or(0),
            credit_millicredits: 0,
            reputation: 1.0,
        }
    }
    fn preempts(&self) -> bool {
        self.preempts
    }
}

struct Peer {
    key: Keypair,
    nonce: u64,
}

impl Peer {
    fn new() -> Peer {
        Peer {
            key: Keypair::generate_ed25519(),
            nonce: 0,
        }
    }

    fn id(&self) -> PeerId {
        self.key.public().to_peer_id()
    }

    /// A request for `gpus` GPUs for an hour, queued under `ticket` when given.
    fn request(&mut self, gpus: u32, ticket: Option<u128>, now: UnixMillis) -> InboundLease {
        self.nonce += 1;
        InboundLease::Message(LeaseMessage::Request(LeaseRequest {
            version: LEASE_VERSION,
            requester: self.id(),
            requester_key: self.key.public().encode_protobuf(),
            nonce: self.nonce,
            requirements: Requirements {
                gpus,
                gpu_model: None,
                gpu_slice: None,
                min_gpu_mem_bytes: None,
                cpus: 1,
                mem_bytes: 1 << 30,
                backend: "wasm".into(),
                kind: Default::default(),
            },
            duration_ms: HOUR,
            max_price_per_gpu_hour_millicredits: None,
            sent_at_ms: now,
            expires_at_ms: now + 30_000,
            ticket,
            start_at_ms: None,
        }))
    }

    fn accept(&self, reply: &LeaseReply) -> InboundLease {
        let LeaseReply::Offer {
            terms,
            provider_sig,
        } = reply
        else {
            panic!("expected an offer, got {reply:?}");
        };
        InboundLease::Message(LeaseMessage::Accept {
            terms: terms.clone(),
            provider_sig: provider_sig.clone(),
            requester_sig: terms.sign(&self.key).expect("sign"),
        })
    }
}

fn desk_with(gpus: u32, lend: &[&str], owner: OwnerPolicy) -> LeaseDesk {
    let keypair = Keypair::generate_ed25519();
    let capacity = Capacity {
        gpus: (0..gpus)
            .map(|i| GpuSlot {
                index: i,
                uuid: format!("GPU-{i}"),
                model: "A100-80GB".into(),
                memory_bytes: 80 << 30,
                available: true,
            })
            .collect(),
        cpus: 16,
        mem_bytes: 64 << 30,
    };
    let policy = LeasePolicy {
        max_gpus_per_peer: gpus,
        ..LeasePolicy::default()
    };
    let lend: Vec<String> = lend.iter().map(|s| s.to_string()).collect();
    LeaseDesk::new(DeskParts {
        book: LeaseBook::new(keypair.public().to_peer_id(), policy, capacity),
        keypair,
        order: Order::Fair,
        fair_share: Vec::new(),
        lending: LendingHours::parse(&lend, "+00:00").expect("lend"),
        owner: (owner, 60_000),
        fixed_lease_id: None,
    })
}

fn desk(gpus: u32) -> LeaseDesk {
    desk_with(gpus, &[], OwnerPolicy::Yield)
}

fn rejected(reply: &LeaseReply) -> RejectCode {
    match reply {
        LeaseReply::Rejected(r) => r.code,
        other => panic!("expected a rejection, got {other:?}"),
    }
}

/// Leases `gpus` GPUs to `peer` at `now`; returns the lease id.
fn lease(desk: &mut LeaseDesk, peer: &mut Peer, gpus: u32, t: &Table, now: u64) -> LeaseId {
    let (offer, effects) = desk.on_message(&peer.id(), peer.request(gpus, None, now), t, now);
    assert!(
        effects.republish,
        "the offered GPUs are held, and advertised as such"
    );
    let (reply, _) = desk.on_message(&peer.id(), peer.accept(&offer), t, now + 1);
    let LeaseReply::Activated { lease_id } = reply else {
        panic!("expected activation, got {reply:?}");
    };
    lease_id
}

#[test]
fn a_stranger_to_the_team_is_refused_before_anything_else() {
    let mut desk = desk(2);
    let mut member = Peer::new();
    let mut stranger = Peer::new();
    let t = Table {
        members: Some([member.id()].into()),
        ..Table::default()
    };
    let (reply, effects) = desk.on_message(&stranger.id(), stranger.request(1, None, NOW), &t, NOW);
    assert_eq!(rejected(&reply), RejectCode::PeerNotAllowed);
    assert_eq!(
        effects,
        Effects::default(),
        "nothing changes, not even a nonce"
    );
    let (reply, _) = desk.on_message(&member.id(), member.request(1, None, NOW), &t, NOW);
    assert!(matches!(reply, LeaseReply::Offer { .. }), "{reply:?}");
}

#[test]
fn outside_lending_hours_is_refused_with_the_hours() {
    let mut desk = desk_with(2, &["sat-sun"], OwnerPolicy::Yield);
    let mut p = Peer::new();
    let (reply, _) = desk.on_message(&p.id(), p.request(1, None, NOW), &Table::default(), NOW);
    let LeaseReply::Rejected(r) = reply else {
        panic!("{reply:?}")
    };
    assert_eq!(r.code, RejectCode::LendingHours);
    assert!(r.message.contains("sat,sun"), "{}", r.message);
}

#[test]
fn team_policy_and_credit_refusals_say_why_and_hold_nothing() {
    let mut desk = desk(2);
    let mut p = Peer::new();
    let t = Table {
        policy_says_no: Some("quota of 4 GPU-hours a day used".into()),
        ..Table::default()
    };
    let (reply, _) = desk.on_message(&p.id(), p.request(1, None, NOW), &t, NOW);
    let LeaseReply::Rejected(r) = reply else {
        panic!("{reply:?}")
    };
    assert_eq!(
        (r.code, r.message.as_str()),
        (RejectCode::TeamPolicy, "quota of 4 GPU-hours a day used")
    );
    let t = Table {
        no_credit: true,
        ..Table::default()
    };
    let (reply, _) = desk.on_message(&p.id(), p.request(1, None, NOW), &t, NOW);
    assert_eq!(rejected(&reply), RejectCode::DebtLimit);
    assert_eq!(desk.book().committed_totals().0, 0);
}

#[test]
fn the_books_own_checks_still_apply() {
    let mut desk = desk(2);
    let mut p = Peer::new();
    let (reply, _) = desk.on_message(&p.id(), p.request(3, None, NOW), &Table::default(), NOW);
    assert_eq!(rejected(&reply), RejectCode::PeerGpuLimit);
}

#[test]
fn a_grant_is_charged_to_fair_share_and_counted_for_team_quotas() {
    let mut desk = desk(2);
    let mut p = Peer::new();
    let t = Table::default();
    let (offer, effects) = desk.on_message(&p.id(), p.request(2, None, NOW), &t, NOW);
    assert!(matches!(offer, LeaseReply::Offer { .. }));
    assert_eq!(
        effects.fair_share,
        vec![(p.id().to_string(), Some((2.0 * HOUR as f64, NOW)))]
    );
    assert!(
        !effects.writes.is_empty(),
        "the offer and its nonce are stored"
    );
    let (reply, effects) = desk.on_message(&p.id(), p.accept(&offer), &t, NOW + 1);
    assert!(matches!(reply, LeaseReply::Activated { .. }), "{reply:?}");
    assert_eq!(effects.quota, vec![(p.id(), NOW + 1, 2, HOUR)]);
}

#[test]
fn busy_gpus_queue_a_waiting_request_and_refuse_one_that_will_not_wait() {
    let mut desk = desk(1);
    let t = Table::default();
    let mut holder = Peer::new();
    lease(&mut desk, &mut holder, 1, &t, NOW);
    let mut waiter = Peer::new();
    let (reply, _) = desk.on_message(&waiter.id(), waiter.request(1, Some(7), NOW), &t, NOW + 5);
    let LeaseReply::Queued(place) = reply else {
        panic!("{reply:?}")
    };
    assert_eq!((place.position, place.of), (1, 1));
    assert_eq!(place.estimated_start_ms, Some(NOW + HOUR));
    let mut impatient = Peer::new();
    let (reply, _) = desk.on_message(
        &impatient.id(),
        impatient.request(1, None, NOW),
        &t,
        NOW + 6,
    );
    assert_eq!(rejected(&reply), RejectCode::NoCapacity);
}

#[test]
fn a_freed_gpu_goes_to_the_higher_priority_request_even_if_it_came_later() {
    let mut desk = desk(1);
    let (mut holder, mut low, mut high) = (Peer::new(), Peer::new(), Peer::new());
    let t = Table {
        priorities: [(high.id(), 10)].into(),
        ..Table::default()
    };
    let id = lease(&mut desk, &mut holder, 1, &t, NOW);
    let (r, _) = desk.on_message(&low.id(), low.request(1, Some(1), NOW + 10), &t, NOW + 10);
    assert!(matches!(r, LeaseReply::Queued(_)));
    let (r, _) = desk.on_message(&high.id(), high.request(1, Some(2), NOW + 20), &t, NOW + 20);
    let LeaseReply::Queued(place) = r else {
        panic!("{r:?}")
    };
    assert_eq!(place.position, 1, "the higher priority goes ahead");
    // The holder gives the GPU back: the low-priority requester asks first and waits.
    let (_, effects) = desk.cancel_local(&id.to_string(), NOW + 30);
    assert_eq!(effects.ended, vec![id]);
    assert_eq!(
        effects.turns,
        vec![(high.id(), 2)],
        "only the request the freed GPU goes to is told its turn came"
    );
    let (r, _) = desk.on_message(&low.id(), low.request(1, Some(1), NOW + 40), &t, NOW + 40);
    assert!(matches!(r, LeaseReply::Queued(_)), "{r:?}");
    let (r, _) = desk.on_message(&high.id(), high.request(1, Some(2), NOW + 50), &t, NOW + 50);
    assert!(matches!(r, LeaseReply::Offer { .. }), "{r:?}");
}

#[test]
fn a_freed_gpu_tells_nobody_when_nobody_waits_or_the_waiter_went_quiet() {
    let mut desk = desk(1);
    let (mut holder, mut waiter) = (Peer::new(), Peer::new());
    let t = Table::default();
    let id = lease(&mut desk, &mut holder, 1, &t, NOW);
    let (_, effects) = desk.cancel_local(&id.to_string(), NOW + 10);
    assert!(effects.turns.is_empty(), "nobody waits");

    let id = lease(&mut desk, &mut holder, 1, &t, NOW + 20);
    let (r, _) = desk.on_message(
        &waiter.id(),
        waiter.request(1, Some(7), NOW + 30),
        &t,
        NOW + 30,
    );
    assert!(matches!(r, LeaseReply::Queued(_)), "{r:?}");
    // The waiter stops asking (it took another offer): its place goes stale.
    let later = NOW + 30 + QUEUE_STALE_MS + 1;
    let (_, effects) = desk.cancel_local(&id.to_string(), later);
    assert!(effects.turns.is_empty(), "a stale place is not told");
}

#[test]
fn a_withdrawn_request_frees_its_place_at_once_and_only_its_owner_can_withdraw_it() {
    let mut desk = desk(1);
    let (mut holder, mut a, mut b) = (Peer::new(), Peer::new(), Peer::new());
    let t = Table::default();
    let id = lease(&mut desk, &mut holder, 1, &t, NOW);
    let (r, _) = desk.on_message(&a.id(), a.request(1, Some(1), NOW + 10), &t, NOW + 10);
    assert!(matches!(r, LeaseReply::Queued(_)), "{r:?}");
    let (r, _) = desk.on_message(&b.id(), b.request(1, Some(2), NOW + 20), &t, NOW + 20);
    assert!(matches!(r, LeaseReply::Queued(_)), "{r:?}");
    let (_, effects) = desk.cancel_local(&id.to_string(), NOW + 30);
    assert_eq!(effects.turns, vec![(a.id(), 1)], "the head is told");
    // `a` took another provider's offer. Nobody else can withdraw its request.
    let stranger = Peer::new();
    assert!(!desk.withdraw(&stranger.id(), 1, NOW + 40).0);
    assert!(!desk.withdraw(&b.id(), 1, NOW + 40).0);
    assert!(!desk.withdraw(&a.id(), 99, NOW + 40).0, "no such ticket");
    let (withdrawn, effects) = desk.withdraw(&a.id(), 1, NOW + 40);
    assert!(withdrawn);
    assert_eq!(
        effects.turns,
        vec![(b.id(), 2)],
        "the next one is told at once"
    );
    let (r, _) = desk.on_message(&b.id(), b.request(1, Some(2), NOW + 50), &t, NOW + 50);
    assert!(matches!(r, LeaseReply::Offer { .. }), "{r:?}");
}

#[test]
fn preemption_stops_the_lower_priority_lease_where_the_team_allows_it() {
    for preempts in [false, true] {
        let mut desk = desk(1);
        let (mut low, mut admin) = (Peer::new(), Peer::new());
        let t = Table {
            priorities: [(admin.id(), 10)].into(),
            preempts,
            ..Table::default()
        };
        let victim = lease(&mut desk, &mut low, 1, &t, NOW);
        let (r, effects) =
            desk.on_message(&admin.id(), admin.request(1, Some(9), NOW + 5), &t, NOW + 5);
        if !preempts {
            assert!(matches!(r, LeaseReply::Queued(_)), "{r:?}");
            assert!(effects.preempt.is_empty());
            continue;
        }
        assert!(matches!(r, LeaseReply::Offer { .. }), "{r:?}");
        assert_eq!(effects.preempt, vec![victim]);
        assert_eq!(effects.ended, vec![victim]);
        assert_eq!(effects.settle.len(), 1, "the preempted lease is settled");
        assert_eq!(
            desk.book().get(&victim).expect("kept").state,
            LeaseState::Cancelled
        );
        // Its user gets back the GPU time it did not use.
        let low_share = effects
            .fair_share
            .iter()
            .find(|(u, _)| *u == low.id().to_string());
        assert!(low_share.is_some_and(|(_, e)| e.is_some_and(|(usage, _)| usage < 1_000.0)));
    }
}

#[test]
fn a_renewal_counts_against_team_quotas_like_new_time() {
    let mut desk = desk(1);
    let mut p = Peer::new();
    let id = lease(&mut desk, &mut p, 1, &Table::default(), NOW);
    let renewal = Renewal {
        lease_id: id,
        new_end_ms: NOW + 2 * HOUR,
        nonce: 99,
    };
    let renew = || {
        InboundLease::Message(LeaseMessage::Renew {
            renewal: renewal.clone(),
            signature: renewal.sign(&p.key).expect("sign"),
        })
    };
    let no = Table {
        policy_says_no: Some("weekly quota used".into()),
        ..Table::default()
    };
    let (r, _) = desk.on_message(&p.id(), renew(), &no, NOW + 10);
    assert_eq!(rejected(&r), RejectCode::TeamPolicy);
    let (r, effects) = desk.on_message(&p.id(), renew(), &Table::default(), NOW + 10);
    assert!(matches!(r, LeaseReply::Renewed { .. }), "{r:?}");
    assert_eq!(effects.quota, vec![(p.id(), NOW + 10, 1, HOUR)]);
}

#[test]
fn a_lease_that_ends_is_settled_and_its_unused_time_given_back() {
    let mut desk = desk(1);
    let mut p = Peer::new();
    let t = Table::default();
    let id = lease(&mut desk, &mut p, 1, &t, NOW);
    let cancel = Cancellation {
        lease_id: id,
        by: p.id(),
        at_ms: NOW + HOUR / 2,
    };
    let msg = InboundLease::Message(LeaseMessage::Cancel {
        signature: cancel.sign(&p.key).expect("sign"),
        cancellation: cancel,
    });
    let (r, effects) = desk.on_message(&p.id(), msg, &t, NOW + HOUR / 2);
    assert!(matches!(r, LeaseReply::Cancelled { .. }), "{r:?}");
    assert_eq!(effects.ended, vec![id]);
    assert_eq!(effects.settle[0].terms.lease_id, id);
    assert!(effects.republish);
    // Half the hour was charged back (what is left decays with a day's half-life).
    let (_, entry) = &effects.fair_share[0];
    let usage = entry.expect("still some usage").0;
    assert!(
        (usage - HOUR as f64 / 2.0).abs() < HOUR as f64 * 0.05,
        "{usage}"
    );
}

#[test]
fn time_expires_offers_and_ends_leases() {
    let mut desk = desk(2);
    let mut p = Peer::new();
    let t = Table::default();
    let (offer, _) = desk.on_message(&p.id(), p.request(1, None, NOW), &t, NOW);
    let LeaseReply::Offer { terms, .. } = offer else {
        panic!()
    };
    let effects = desk.tick(NOW + 60_000);
    assert!(effects.flush_now && effects.republish);
    assert_eq!(
        desk.book().get(&terms.lease_id).expect("kept").state,
        LeaseState::Expired
    );
    let id = lease(&mut desk, &mut p, 1, &t, NOW + 70_000);
    let effects = desk.tick(NOW + 70_000 + HOUR + 1);
    assert_eq!(effects.ended, vec![id]);
    assert_eq!(effects.settle.len(), 1);
    assert_eq!(desk.tick(NOW + 2 * HOUR).ended, Vec::<LeaseId>::new());
}

#[test]
fn the_owner_policy_yields_after_its_grace_suspends_or_shares() {
    let busy: HashSet<&str> = ["GPU-0"].into();
    let t = Table::default();
    // Yield: nothing during the grace period, then the lease is preempted and cancelled.
    let mut d = desk_with(1, &[], OwnerPolicy::Yield);
    let id = lease(&mut d, &mut Peer::new(), 1, &t, NOW);
    assert_eq!(d.enforce_owner_policy(&busy, NOW + 10).preempt, vec![]);
    let effects = d.enforce_owner_policy(&busy, NOW + 10 + 60_000);
    assert_eq!((effects.preempt, effects.ended), (vec![id], vec![id]));
    assert!(effects.flush_now);
    // Suspend: paused while the owner is there, resumed after, once each.
    let mut d = desk_with(1, &[], OwnerPolicy::Suspend);
    let id = lease(&mut d, &mut Peer::new(), 1, &t, NOW);
    assert_eq!(
        d.enforce_owner_policy(&busy, NOW + 10).pause,
        vec![(id, true)]
    );
    assert_eq!(d.enforce_owner_policy(&busy, NOW + 20).pause, vec![]);
    assert_eq!(
        d.enforce_owner_policy(&HashSet::new(), NOW + 30).pause,
        vec![(id, false)]
    );
    // Share: nothing.
    let mut d = desk_with(1, &[], OwnerPolicy::Share);
    lease(&mut d, &mut Peer::new(), 1, &t, NOW);
    assert_eq!(
        d.enforce_owner_policy(&busy, NOW + HOUR / 2),
        Effects::default()
    );
}

#[test]
fn a_former_member_loses_its_leases_and_others_keep_theirs() {
    let mut desk = desk(2);
    let (mut gone, mut stays) = (Peer::new(), Peer::new());
    let t = Table::default();
    let a = lease(&mut desk, &mut gone, 1, &t, NOW);
    let b = lease(&mut desk, &mut stays, 1, &t, NOW);
    let effects = desk.cancel_peer(&gone.id(), NOW + 10);
    assert_eq!(effects.ended, vec![a]);
    assert!(effects.flush_now);
    assert_eq!(desk.book().get(&b).expect("kept").state, LeaseState::Active);
}

#[test]
fn fair_share_restored_from_the_store_orders_the_queue() {
    let (mut heavy, mut light, mut holder) = (Peer::new(), Peer::new(), Peer::new());
    let mut desk = desk(1);
    desk.waiting = WaitQueue::new(
        Order::Fair,
        vec![(heavy.id().to_string(), (100.0 * HOUR as f64, NOW))],
    );
    let t = Table::default();
    lease(&mut desk, &mut holder, 1, &t, NOW);
    desk.on_message(&heavy.id(), heavy.request(1, Some(1), NOW + 1), &t, NOW + 1);
    let (r, _) = desk.on_message(&light.id(), light.request(1, Some(2), NOW + 2), &t, NOW + 2);
    let LeaseReply::Queued(place) = r else {
        panic!("{r:?}")
    };
    assert_eq!(
        place.position, 1,
        "the light user goes ahead of the heavy one"
    );
    assert!(desk.waiting.usage_gpu_ms(&heavy.id().to_string(), NOW) > 99.0 * HOUR as f64);
}

impl Peer {
    /// A request for `gpus` GPUs with the terms `desk` would offer for it (its GPUs from
    /// index 0 on, its price, a start a second before `now`, the derived id), signed.
    fn propose(&mut self, desk: &LeaseDesk, gpus: u32, now: UnixMillis) -> InboundLease {
        let InboundLease::Message(LeaseMessage::Request(request)) = self.request(gpus, None, now)
        else {
            unreachable!("a request")
        };
        let start = now - 1_000;
        let terms = LeaseTerms {
            version: LEASE_VERSION,
            lease_id: proposal_lease_id(&desk.local, &self.id(), request.nonce, start),
            provider: desk.local,
            requester: self.id(),
            gpus: (0..gpus)
                .map(|i| gpunode_protocol::lease::LeasedGpu {
                    index: i,
                    uuid: format!("GPU-{i}"),
                    model: "A100-80GB".into(),
                    memory_bytes: 80 << 30,
                })
                .collect(),
            cpus: 1,
            mem_bytes: 1 << 30,
            backend: "wasm".into(),
            start_ms: start,
            end_ms: start + HOUR,
            price_per_gpu_hour_millicredits: desk.book.policy().price_per_gpu_hour_millicredits,
            request_nonce: request.nonce,
            offer_expires_ms: request.expires_at_ms,
        };
        self.signed_proposal(request, terms)
    }

    /// `request` with `terms`, signed by this peer.
    fn signed_proposal(&self, request: LeaseRequest, terms: LeaseTerms) -> InboundLease {
        InboundLease::Message(LeaseMessage::Propose {
            requester_sig: terms.sign(&self.key).expect("sign"),
            request,
            terms,
        })
    }

    /// Its signed cancellation of `lease_id`.
    fn cancel(&self, lease_id: LeaseId, now: UnixMillis) -> InboundLease {
        let cancellation = Cancellation {
            lease_id,
            by: self.id(),
            at_ms: now,
        };
        InboundLease::Message(LeaseMessage::Cancel {
            signature: cancellation.sign(&self.key).expect("sign"),
            cancellation,
        })
    }
}

/// The request and terms inside a proposal.
fn parts(message: InboundLease) -> (LeaseRequest, LeaseTerms) {
    match message {
        InboundLease::Message(LeaseMessage::Propose { request, terms, .. }) => (request, terms),
        other => panic!("not a proposal: {other:?}"),
    }
}

/// A proposal of the terms the provider would offer is the lease at once: granted with
/// the provider's signature over the proposed terms, active, stored with both
/// signatures, its GPUs held and its quota counted. The same proposal again (its
/// answer lost) gets the same grant and changes nothing.
#[test]
fn a_proposal_of_the_offered_terms_is_granted_in_one_round_trip() {
    let mut desk = desk(2);
    let mut peer = Peer::new();
    let t = Table::default();
    let proposal = peer.propose(&desk, 1, NOW);
    let (reply, effects) = desk.on_message(&peer.id(), proposal.clone(), &t, NOW);
    let LeaseReply::Granted {
        lease_id,
        provider_sig,
    } = reply.clone()
    else {
        panic!("expected a grant, got {reply:?}");
    };
    let record = desk.book().get(&lease_id).expect("stored").clone();
    assert_eq!(record.state, LeaseState::Active);
    assert_eq!(
        record.terms.start_ms,
        NOW - 1_000,
        "the proposed terms, as signed"
    );
    record
        .terms
        .verify(&desk.local, &provider_sig)
        .expect("the provider signed the proposed terms");
    record
        .terms
        .verify(
            &peer.id(),
            record.requester_sig.as_deref().expect("countersigned"),
        )
        .expect("the requester's signature is kept");
    assert_eq!(effects.quota, vec![(peer.id(), NOW, 1, HOUR)]);
    assert!(effects.republish, "its GPU is now lent");
    assert!(effects.writes.contains(&Change::Lease(lease_id)));

    let (again, effects) = desk.on_message(&peer.id(), proposal.clone(), &t, NOW + 50);
    assert_eq!(again, reply, "a repeated proposal gets the same grant");
    assert_eq!(effects, Effects::default(), "and changes nothing");
    // Someone else sending it is not granted it (nor can it be: the nonce is spent).
    let mallory = Peer::new();
    let (reply, _) = desk.on_message(&mallory.id(), proposal.clone(), &t, NOW + 50);
    assert_eq!(rejected(&reply), RejectCode::WrongKey);
    // Once the lease has ended, the same proposal is a replay.
    desk.on_message(&peer.id(), peer.cancel(lease_id, NOW + 60), &t, NOW + 60);
    let (reply, _) = desk.on_message(&peer.id(), proposal, &t, NOW + 70);
    assert_eq!(rejected(&reply), RejectCode::Replay);

    // A proposal of a GPU lent meanwhile does not fit: the provider offers the free one
    // instead, held as any offer, and the requester judges that offer as usual.
    desk.on_message(&peer.id(), peer.propose(&desk, 1, NOW), &t, NOW);
    let (reply, _) = desk.on_message(&peer.id(), peer.propose(&desk, 1, NOW), &t, NOW);
    let LeaseReply::Offer { terms, .. } = &reply else {
        panic!("expected an offer of the other GPU, got {reply:?}");
    };
    assert_eq!(terms.gpus[0].uuid, "GPU-1");
    assert_eq!(
        desk.book().get(&terms.lease_id).unwrap().state,
        LeaseState::Offered
    );
    let (reply, _) = desk.on_message(&peer.id(), peer.accept(&reply), &t, NOW + 1);
    assert!(matches!(reply, LeaseReply::Activated { .. }), "{reply:?}");
}

/// On GPUs of several models and sizes, the terms a requester foresees from the
/// provider's advert are the ones its desk (queue and book) offers, so they are granted
/// at once: whole GPUs of a model, several of any, none.
#[test]
fn terms_foreseen_from_a_current_advert_are_granted_on_mixed_gpus() {
    let cases: [(u32, Option<&str>); 5] = [
        (0, None),
        (1, Some("A100")),
        (1, Some("T4")),
        (2, None),
        (3, None),
    ];
    for (gpus, model) in cases {
        let mut desk = desk(3);
        let models = [("A100-80GB", 80), ("A100-40GB", 40), ("T4-16GB", 16)];
        let mut capacity = desk.book.capacity().clone();
        for (slot, (model, gib)) in capacity.gpus.iter_mut().zip(models) {
            slot.model = model.into();
            slot.memory_bytes = gib << 30;
        }
        desk.book.set_capacity(capacity.clone());
        let advert = crate::lease::negotiate::ProviderAdvert {
            price: desk.book.policy().price_per_gpu_hour_millicredits,
            gpus: capacity
                .gpus
                .iter()
                .map(|g| idle_gpu(g.index, &g.model, g.memory_bytes))
                .collect(),
        };
        let mut peer = Peer::new();
        let InboundLease::Message(LeaseMessage::Request(mut request)) =
            peer.request(gpus, None, NOW)
        else {
            unreachable!()
        };
        request.requirements.gpu_model = model.map(str::to_string);
        let terms = crate::lease::negotiate::foreseen_terms(&request, desk.local, &advert, NOW)
            .expect("foreseeable");
        let message = peer.signed_proposal(request, terms);
        let (reply, _) = desk.on_message(&peer.id(), message, &Table::default(), NOW);
        assert!(
            matches!(reply, LeaseReply::Granted { .. }),
            "{gpus} GPU(s) of {model:?}: {reply:?}"
        );
    }
}

/// An idle GPU as an advert lists it.
fn idle_gpu(index: u32, model: &str, memory_bytes: u64) -> gpunode_protocol::advert::AdvertGpu {
    gpunode_protocol::advert::AdvertGpu {
        index,
        uuid: format!("GPU-{index}"),
        model: model.into(),
        memory_bytes,
        state: gpunode_protocol::gpu::GpuState::Idle,
        mig_enabled: false,
        compute_capability: None,
        reserved: Vec::new(),
    }
}

/// What an attacker might put in a proposal: terms signed by someone else, an id of
/// its own choosing (that of a lease the provider holds, or any), a start the provider
/// has not reached or long past, a price below the provider's, a longer lease; and a
/// proposal to a provider whose test-network cheat gives every lease one id. None
/// becomes a lease as proposed: a bad signature is refused and holds nothing; the rest
/// get the provider's own offer, and a lease already there is untouched.
#[test]
fn a_proposal_that_is_not_the_offered_terms_never_becomes_a_lease_as_proposed() {
    let mut desk = desk(1);
    let mut peer = Peer::new();
    let mallory = Peer::new();
    let t = Table::default();
    let (request, terms) = parts(peer.propose(&desk, 1, NOW));
    let forged = InboundLease::Message(LeaseMessage::Propose {
        requester_sig: terms.sign(&mallory.key).unwrap(),
        request,
        terms: terms.clone(),
    });
    let (reply, effects) = desk.on_message(&peer.id(), forged, &t, NOW);
    assert_eq!(rejected(&reply), RejectCode::BadSignature);
    assert!(desk.book().get(&terms.lease_id).is_none());
    assert!(!effects.republish, "nothing is held");

    let (reply, _) = desk.on_message(&peer.id(), peer.propose(&desk, 0, NOW), &t, NOW);
    let LeaseReply::Granted { lease_id: held, .. } = reply else {
        panic!("expected a grant, got {reply:?}");
    };
    let before = desk.book().get(&held).unwrap().clone();

    type Alter = fn(&mut LeaseTerms, LeaseId);
    let altered: [(&str, Alter); 6] = [
        ("the id of a lease held here", |t, held| t.lease_id = held),
        ("an id of its choosing", |t, _| {
            t.lease_id = LeaseId([7; 16])
        }),
        ("a start the provider has not reached", |t, _| {
            t.start_ms = NOW + 10;
            t.end_ms = NOW + 10 + HOUR;
        }),
        ("a start long past", |t, _| {
            t.start_ms = NOW - 6_000;
            t.end_ms = NOW - 6_000 + HOUR;
        }),
        ("a lower price", |t, _| {
            t.price_per_gpu_hour_millicredits /= 2
        }),
        ("a longer lease", |t, _| t.end_ms += 1),
    ];
    for (what, alter) in altered {
        let (request, mut terms) = parts(peer.propose(&desk, 1, NOW));
        alter(&mut terms, held);
        let (reply, _) = desk.on_message(
            &peer.id(),
            peer.signed_proposal(request, terms.clone()),
            &t,
            NOW,
        );
        let LeaseReply::Offer { terms: offered, .. } = &reply else {
            panic!("{what}: expected the provider's own offer, got {reply:?}");
        };
        assert_ne!(offered, &terms, "{what}");
        assert_ne!(offered.lease_id, held, "{what}");
        assert_eq!(offered.start_ms, NOW, "{what}");
        assert_eq!(
            desk.book().get(&held),
            Some(&before),
            "{what}: the lease there is untouched"
        );
        // Released, so the next case finds the GPU free.
        let (reply, _) = desk.on_message(&peer.id(), peer.cancel(offered.lease_id, NOW), &t, NOW);
        assert!(
            matches!(reply, LeaseReply::Cancelled { .. }),
            "{what}: {reply:?}"
        );
    }

    // A test network's cheat gives every lease one id: a proposal never fits there.
    desk.fixed_lease_id = Some([3; 16]);
    let (reply, _) = desk.on_message(&peer.id(), peer.propose(&desk, 1, NOW), &t, NOW);
    assert!(matches!(reply, LeaseReply::Offer { .. }), "{reply:?}");
}
