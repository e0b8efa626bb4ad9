use super::*;
use crate::lease::LeaseState;
use gpunode_protocol::lease::{LeaseId, LeasedGpu, LEASE_VERSION};
use gpunode_protocol::receipt::{lease_output_digest, UsageReceipt};
use libp2p::identity::Keypair;

struct Setup {
    provider: Keypair,
    requester: Keypair,
    lease: LeaseRecord,
    observed: LeaseUsage,
}

fn setup() -> Setup {
    let provider = Keypair::generate_ed25519();
    let requester = Keypair::generate_ed25519();
    let terms = LeaseTerms {
        version: LEASE_VERSION,
        lease_id: LeaseId([3; 16]),
        provider: provider.public().to_peer_id(),
        requester: requester.public().to_peer_id(),
        gpus: vec![LeasedGpu {
            index: 0,
            uuid: "GPU-0".into(),
            model: "A100".into(),
            memory_bytes: 1,
        }],
        cpus: 2,
        mem_bytes: 1 << 30,
        backend: "wasm".into(),
        start_ms: 100_000,
        end_ms: 700_000,
        price_per_gpu_hour_millicredits: 3_600_000,
        request_nonce: 1,
        offer_expires_ms: 110_000,
    };
    let lease = LeaseRecord {
        signed_end_ms: terms.end_ms,
        provider_sig: Vec::new(),
        requester_sig: None,
        renewals: Vec::new(),
        role: LeaseRole::Requester,
        state: LeaseState::Cancelled,
        updated_ms: 200_000,
        terms,
    };
    let observed = LeaseUsage {
        billed_ms: 10_500,
        jobs: 1,
        last_status: "exited 0".into(),
        digests: vec![[9; 32]],
        measured_gpu_ms: None,
        peak_gpu_memory_bytes: 0,
        paused_ms: 0,
    };
    Setup {
        provider,
        requester,
        lease,
        observed,
    }
}

fn honest(s: &Setup) -> UsageReceipt {
    let t = &s.lease.terms;
    UsageReceipt {
        version: RECEIPT_VERSION,
        lease_id: t.lease_id,
        provider: t.provider,
        requester: t.requester,
        gpus: 1,
        cpus: 2,
        mem_bytes: t.mem_bytes,
        start_ms: t.start_ms,
        end_ms: 200_000,
        // Held from the start until we cancelled it; its job ran 10 s of that.
        billed_ms: 100_000,
        gpu_ms: 10_000,
        cpu_ms: 20_000,
        jobs: 1,
        exit_status: "exited 0".into(),
        output_digest: lease_output_digest(&[[9; 32]]),
        price_per_gpu_hour_millicredits: t.price_per_gpu_hour_millicredits,
        amount_millicredits: amount_for(t.price_per_gpu_hour_millicredits, 1, 100_000),
        issued_at_ms: 200_000,
        peak_gpu_memory_bytes: 0,
    }
}

fn signed(s: &Setup, receipt: UsageReceipt) -> Claim {
    Claim {
        provider_sig: receipt.sign(&s.provider).expect("sign"),
        receipt,
    }
}

/// Checks `claim` as the setup's requester, against `lease`.
fn check_against(s: &Setup, claim: &Claim, lease: Option<&LeaseRecord>) -> Result<(), Code> {
    check_claim(
        claim,
        &s.provider.public().to_peer_id(),
        &s.requester.public().to_peer_id(),
        lease,
        &s.observed,
    )
    .map_err(|r| {
        assert!(!r.message.is_empty());
        r.code
    })
}

fn check(s: &Setup, receipt: UsageReceipt) -> Result<(), Code> {
    check_against(s, &signed(s, receipt), Some(&s.lease))
}

#[test]
fn an_honest_receipt_passes() {
    let s = setup();
    assert_eq!(check(&s, honest(&s)), Ok(()));
}

#[test]
fn a_bad_signature_is_refused() {
    let s = setup();
    let mut claim = signed(&s, honest(&s));
    claim.provider_sig[10] ^= 1;
    assert_eq!(
        check_against(&s, &claim, Some(&s.lease)),
        Err(Code::BadSignature)
    );
    // Signed by someone else than the provider it names.
    let receipt = honest(&s);
    let claim = Claim {
        provider_sig: receipt.sign(&Keypair::generate_ed25519()).expect("sign"),
        receipt,
    };
    assert_eq!(
        check_against(&s, &claim, Some(&s.lease)),
        Err(Code::BadSignature)
    );
}

#[test]
fn an_unknown_lease_is_refused() {
    let mut s = setup();
    let claim = signed(&s, honest(&s));
    assert_eq!(check_against(&s, &claim, None), Err(Code::UnknownLease));
    // A lease we provide (not one we hold) is no basis for a bill either.
    s.lease.role = LeaseRole::Provider;
    assert_eq!(check(&s, honest(&s)), Err(Code::UnknownLease));
}

#[test]
fn inflated_receipts_are_refused() {
    let s = setup();
    // Amount that does not follow from the usage.
    let mut r = honest(&s);
    r.amount_millicredits += 1;
    assert_eq!(check(&s, r), Err(Code::Inflated));
    // Run time beyond what we observed.
    let mut r = honest(&s);
    r.gpu_ms = 60_000;
    r.cpu_ms = 120_000;
    assert_eq!(check(&s, r), Err(Code::Inflated));
    // CPU-seconds that are no whole run time on the leased CPUs.
    let mut r = honest(&s);
    r.cpu_ms += 1;
    assert_eq!(check(&s, r), Err(Code::Inflated));
    // More GPU time than the leased GPUs had while the jobs ran.
    let mut r = honest(&s);
    r.gpu_ms = 10_000 * r.gpus as u64 + 1;
    assert_eq!(check(&s, r), Err(Code::Inflated));
    // Less measured GPU time (the job used its GPU part of the time) is fine.
    let mut r = honest(&s);
    r.gpu_ms /= 2;
    assert_eq!(check(&s, r), Ok(()));
    // More jobs than were sent.
    let mut r = honest(&s);
    r.jobs = 2;
    assert_eq!(check(&s, r), Err(Code::Inflated));
}

#[test]
fn an_amount_above_the_lease_maximum_is_refused() {
    let mut s = setup();
    // We observed a long run (say our clock is off), but the lease caps the bill.
    s.observed.billed_ms = 10_000_000;
    let mut r = honest(&s);
    r.end_ms = s.lease.terms.end_ms + 20_000;
    r.billed_ms = 620_000;
    r.gpu_ms = 620_000;
    r.cpu_ms = 1_240_000;
    r.amount_millicredits = amount_for(r.price_per_gpu_hour_millicredits, 1, 620_000);
    assert!(r.amount_millicredits > s.lease.terms.max_amount_millicredits());
    assert_eq!(check(&s, r), Err(Code::Inflated));
}

#[test]
fn times_outside_the_lease_are_refused() {
    let s = setup();
    let mut r = honest(&s);
    r.start_ms = s.lease.terms.start_ms - 60_000;
    assert_eq!(check(&s, r), Err(Code::TimesOutsideLease));
    let mut r = honest(&s);
    r.end_ms = s.lease.terms.end_ms + 60_000;
    assert_eq!(check(&s, r), Err(Code::TimesOutsideLease));
    let mut r = honest(&s);
    r.end_ms = r.start_ms - 1;
    assert_eq!(check(&s, r), Err(Code::TimesOutsideLease));
}

#[test]
fn holding_a_lease_is_billed_even_when_nothing_ran() {
    let mut s = setup();
    s.observed = LeaseUsage::default();
    let mut r = honest(&s);
    r.gpu_ms = 0;
    r.cpu_ms = 0;
    r.jobs = 0;
    r.exit_status = "none".into();
    r.output_digest = lease_output_digest(&[]);
    assert!(r.amount_millicredits > 0);
    assert_eq!(check(&s, r), Ok(()));
}

#[test]
fn billing_past_the_end_we_saw_or_another_window_is_refused() {
    let s = setup();
    // We cancelled at 200 s; the provider bills until 400 s (consistently priced).
    let mut r = honest(&s);
    r.end_ms = 400_000;
    r.billed_ms = r.end_ms - r.start_ms;
    r.amount_millicredits = amount_for(r.price_per_gpu_hour_millicredits, 1, r.billed_ms);
    assert_eq!(check(&s, r), Err(Code::Inflated));
    // Within the clock-skew tolerance it passes (the provider heard the cancel later).
    let mut r = honest(&s);
    r.end_ms = 210_000;
    r.billed_ms = r.end_ms - r.start_ms;
    r.amount_millicredits = amount_for(r.price_per_gpu_hour_millicredits, 1, r.billed_ms);
    assert_eq!(check(&s, r), Ok(()));
    // A billed time longer than the window.
    let mut r = honest(&s);
    r.billed_ms += 50_000;
    r.amount_millicredits = amount_for(r.price_per_gpu_hour_millicredits, 1, r.billed_ms);
    assert_eq!(check(&s, r), Err(Code::Inflated));
    // Shorter (time the owner held the job paused is not billed) is fine.
    let mut r = honest(&s);
    r.billed_ms -= 50_000;
    r.amount_millicredits = amount_for(r.price_per_gpu_hour_millicredits, 1, r.billed_ms);
    assert_eq!(check(&s, r), Ok(()));
    // But never shorter than the run time it records.
    let mut r = honest(&s);
    r.billed_ms = 5_000;
    r.amount_millicredits = amount_for(r.price_per_gpu_hour_millicredits, 1, r.billed_ms);
    assert_eq!(check(&s, r), Err(Code::Inflated));
    // A lease still active here may be billed to its term's end once that has passed,
    // never into the future.
    let mut s2 = setup();
    s2.lease.state = LeaseState::Active;
    let mut r = honest(&s2);
    r.end_ms = s2.lease.terms.end_ms;
    r.billed_ms = r.end_ms - r.start_ms;
    r.amount_millicredits = amount_for(r.price_per_gpu_hour_millicredits, 1, r.billed_ms);
    assert_eq!(check(&s2, r), Ok(()));
    let now = gpunode_protocol::time::now_ms();
    s2.lease.terms.start_ms = now - 100_000;
    s2.lease.terms.end_ms = now + 3_600_000;
    let mut r = honest(&s2);
    r.start_ms = s2.lease.terms.start_ms;
    r.end_ms = s2.lease.terms.end_ms;
    r.billed_ms = r.end_ms - r.start_ms;
    r.amount_millicredits = amount_for(r.price_per_gpu_hour_millicredits, 1, r.billed_ms);
    assert_eq!(
        check_against(&s2, &signed(&s2, r), Some(&s2.lease)),
        Err(Code::Inflated)
    );
}

#[test]
fn a_version_2_receipt_is_still_checked_by_run_time() {
    let s = setup();
    let mut r = honest(&s);
    r.version = 2;
    r.billed_ms = 10_000;
    r.amount_millicredits = amount_for(r.price_per_gpu_hour_millicredits, 1, 10_000);
    assert_eq!(check(&s, r.clone()), Ok(()));
    r.billed_ms = 60_000;
    r.gpu_ms = 60_000;
    r.cpu_ms = 120_000;
    r.amount_millicredits = amount_for(r.price_per_gpu_hour_millicredits, 1, 60_000);
    assert_eq!(check(&s, r), Err(Code::Inflated));
}

#[test]
fn other_outputs_and_altered_terms_are_refused() {
    let s = setup();
    let mut r = honest(&s);
    r.output_digest = lease_output_digest(&[[8u8; 32]]);
    assert_eq!(check(&s, r), Err(Code::OutputMismatch));
    let mut r = honest(&s);
    r.price_per_gpu_hour_millicredits *= 2;
    r.amount_millicredits = amount_for(r.price_per_gpu_hour_millicredits, 1, r.billed_ms);
    assert_eq!(check(&s, r), Err(Code::Invalid));
    let mut r = honest(&s);
    r.version = 9;
    assert_eq!(check(&s, r), Err(Code::Invalid));
}

#[test]
fn times_at_the_edge_of_u64_are_refused_not_overflowed() {
    let s = setup();
    for (start, end) in [
        (u64::MAX - 5, u64::MAX),
        (u64::MAX, u64::MAX),
        (0, u64::MAX),
    ] {
        let mut r = honest(&s);
        r.start_ms = start;
        r.end_ms = end;
        r.billed_ms = end - start;
        assert!(check(&s, r).is_err(), "{start} {end}");
    }
}
