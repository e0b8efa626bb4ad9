//! Every wire type a peer can send, under mutation: starting from a valid message,
//! bytes are flipped, inserted, cut; decoding never panics, and whatever still decodes
//! encodes back to bytes that decode to the same value (the encoding is canonical, so a
//! peer cannot make two encodings of one message mean different things).

use gpunode_protocol::advert::{Advert, AdvertGpu, ADVERT_VERSION, MAX_SIGNED_ADVERT_BYTES};
use gpunode_protocol::encoding::{decode, encode};
use gpunode_protocol::gpu::GpuState;
use gpunode_protocol::job::{
    BlobRef, JobFile, JobOutcome, JobReport, JobSubmit, Program, ProviderMsg, RequesterMsg,
    JOB_VERSION, MAX_MESSAGE_BYTES,
};
use gpunode_protocol::lease::{
    LeaseId, LeaseMessage, LeaseReply, LeaseRequest, QueuePlace, RejectCode, Rejection,
    Requirements, LEASE_VERSION,
};
use gpunode_protocol::receipt::{
    Claim, SettleMsg, SettleReply, UsageReceipt, MAX_SETTLE_MESSAGE_BYTES, RECEIPT_VERSION,
};
use gpunode_protocol::team::{
    Certificate, InviteToken, Role, SignedCertificate, TeamId, TeamSync, MAX_TEAM_MESSAGE_BYTES,
    TEAM_VERSION,
};
use libp2p_identity::Keypair;
use proptest::prelude::*;
use serde::{de::DeserializeOwned, Serialize};

/// A change to an encoded message.
#[derive(Debug, Clone)]
enum Mutation {
    Flip(usize, u8),
    Insert(usize, u8),
    Cut(usize),
    Truncate(usize),
}

fn mutations() -> impl Strategy<Value = Vec<Mutation>> {
    prop::collection::vec(
        prop_oneof![
            (any::<usize>(), 1..=255u8).prop_map(|(i, b)| Mutation::Flip(i, b)),
            (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Insert(i, b)),
            any::<usize>().prop_map(Mutation::Cut),
            any::<usize>().prop_map(Mutation::Truncate),
        ],
        1..6,
    )
}

fn mutate(mut bytes: Vec<u8>, changes: &[Mutation]) -> Vec<u8> {
    for m in changes {
        let n = bytes.len().max(1);
        match *m {
            Mutation::Flip(i, b) if !bytes.is_empty() => bytes[i % n] ^= b,
            Mutation::Insert(i, b) => bytes.insert(i % (bytes.len() + 1), b),
            Mutation::Cut(i) if !bytes.is_empty() => {
                bytes.remove(i % n);
            }
            Mutation::Truncate(i) => bytes.truncate(i % n),
            _ => {}
        }
    }
    bytes
}

/// The property for one type: the valid value round-trips; mutated bytes never panic,
/// and what decodes re-encodes canonically.
fn check<T>(valid: &T, limit: usize, changes: &[Mutation])
where
    T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug,
{
    let bytes = encode(valid);
    assert_eq!(&decode::<T>(&bytes, limit).expect("valid decodes"), valid);
    if let Ok(v) = decode::<T>(&mutate(bytes, changes), limit) {
        let again = encode(&v);
        assert_eq!(decode::<T>(&again, limit).expect("re-encoded decodes"), v);
        assert_eq!(encode(&decode::<T>(&again, limit).expect("decodes")), again);
    }
}

fn key() -> Keypair {
    Keypair::ed25519_from_bytes([7u8; 32]).expect("key")
}

fn blob(n: u8) -> BlobRef {
    BlobRef {
        hash: [n; 32],
        size: n as u64 * 100,
    }
}

fn lease_request() -> LeaseMessage {
    let k = key();
    LeaseMessage::Request(LeaseRequest {
        version: LEASE_VERSION,
        requester: k.public().to_peer_id(),
        requester_key: k.public().encode_protobuf(),
        nonce: 42,
        requirements: Requirements {
            gpus: 1,
            gpu_model: Some("A100".into()),
            gpu_slice: None,
            min_gpu_mem_bytes: Some(40 << 30),
            cpus: 2,
            mem_bytes: 4 << 30,
            backend: "wasm".into(),
            kind: Default::default(),
        },
        duration_ms: 60_000,
        max_price_per_gpu_hour_millicredits: Some(1000),
        sent_at_ms: 1_800_000_000_000,
        expires_at_ms: 1_800_000_030_000,
        ticket: Some(7),
        start_at_ms: None,
    })
}

fn lease_reply() -> LeaseReply {
    LeaseReply::Queued(QueuePlace {
        position: 2,
        of: 5,
        estimated_start_ms: Some(1_800_000_100_000),
        reason: "GPU 0 is leased until 10:00:00 UTC".into(),
    })
}

fn submit() -> RequesterMsg {
    RequesterMsg::Submit(JobSubmit {
        version: JOB_VERSION,
        lease_id: LeaseId([3; 16]),
        program: Program::Wasm {
            module: blob(1),
            fuel: Some(1000),
        },
        inputs: vec![JobFile {
            path: "photos/a.jpg".into(),
            blob: blob(2),
        }],
        args: vec!["--fast".into()],
        env: vec![("K".into(), "V".into())],
        timeout_ms: 60_000,
    })
}

fn finished() -> ProviderMsg {
    ProviderMsg::Finished(JobReport {
        outcome: JobOutcome::Exited(0),
        run_ms: 1234,
        module_cached: true,
        outputs: vec![JobFile {
            path: "out/result.txt".into(),
            blob: blob(3),
        }],
        gpu: None,
    })
}

fn claims() -> SettleMsg {
    let k = key();
    let receipt = UsageReceipt {
        version: RECEIPT_VERSION,
        lease_id: LeaseId([5; 16]),
        provider: k.public().to_peer_id(),
        requester: Keypair::ed25519_from_bytes([8u8; 32])
            .expect("key")
            .public()
            .to_peer_id(),
        gpus: 1,
        cpus: 2,
        mem_bytes: 1 << 30,
        start_ms: 1_800_000_000_000,
        end_ms: 1_800_000_060_000,
        billed_ms: 60_000,
        gpu_ms: 10_000,
        cpu_ms: 20_000,
        jobs: 1,
        exit_status: "exited 0".into(),
        output_digest: [9; 32],
        price_per_gpu_hour_millicredits: 1000,
        amount_millicredits: 16,
        issued_at_ms: 1_800_000_060_000,
        peak_gpu_memory_bytes: 0,
    };
    SettleMsg::Claims(vec![Claim {
        provider_sig: receipt.sign(&k).expect("sign"),
        receipt,
    }])
}

fn sync() -> TeamSync {
    let team_key = key();
    let public = team_key.public().encode_protobuf();
    let team = TeamId::of_key(&public);
    let cert = SignedCertificate::by_team(
        Certificate {
            version: TEAM_VERSION,
            team,
            member: Keypair::ed25519_from_bytes([9u8; 32])
                .expect("key")
                .public()
                .to_peer_id(),
            role: Role::Member,
            issuer: team_key.public().to_peer_id(),
            serial: 1,
            issued_ms: 1_800_000_000_000,
            expires_ms: 1_800_100_000_000,
        },
        &team_key,
    )
    .expect("sign");
    TeamSync {
        team,
        certs: vec![cert],
        revocations: Vec::new(),
        policy: None,
    }
}

fn advert() -> Advert {
    Advert {
        version: ADVERT_VERSION,
        publisher: key().public().to_peer_id(),
        seq: 3,
        issued_at_ms: 1_800_000_000_000,
        expires_at_ms: 1_800_000_600_000,
        gpus: vec![AdvertGpu {
            index: 0,
            uuid: "GPU-0".into(),
            model: "A100-80GB".into(),
            memory_bytes: 80 << 30,
            state: GpuState::Idle,
            mig_enabled: false,
            compute_capability: Some((8, 0)),
            reserved: Vec::new(),
        }],
        cpu_cores: 8,
        ram_bytes: 64 << 30,
        backends: vec!["wasm".into()],
        price_per_gpu_hour_millicredits: 1000,
        listen_addrs: vec!["/ip4/127.0.0.1/udp/4170/quic-v1".into()],
        simulated: true,
        withdrawn: false,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn lease_messages(changes in mutations()) {
        check(&lease_request(), 64 * 1024, &changes);
        check(&lease_reply(), 64 * 1024, &changes);
        check(
            &LeaseReply::Rejected(Rejection::new(RejectCode::Replay, "used")),
            64 * 1024,
            &changes,
        );
    }

    #[test]
    fn job_messages(changes in mutations()) {
        check(&submit(), MAX_MESSAGE_BYTES, &changes);
        check(&finished(), MAX_MESSAGE_BYTES, &changes);
    }

    #[test]
    fn settlement_messages(changes in mutations()) {
        check(&claims(), MAX_SETTLE_MESSAGE_BYTES, &changes);
        check(&SettleReply::Results(Vec::new()), MAX_SETTLE_MESSAGE_BYTES, &changes);
    }

    #[test]
    fn team_documents(changes in mutations()) {
        check(&sync(), MAX_TEAM_MESSAGE_BYTES, &changes);
    }

    #[test]
    fn adverts(changes in mutations()) {
        check(&advert(), MAX_SIGNED_ADVERT_BYTES, &changes);
    }

    #[test]
    fn invite_tokens(changes in mutations()) {
        let token = InviteToken {
            version: TEAM_VERSION,
            team: sync().team,
            team_key: key().public().encode_protobuf(),
            bootstrap: vec!["/ip4/127.0.0.1/udp/4170/quic-v1".into()],
            secret: [4; 32],
            inviter: key().public().to_peer_id(),
            role: Role::Member,
            expires_ms: 1_800_000_000_000,
        };
        let text = token.encode();
        prop_assert_eq!(InviteToken::decode(&text).expect("valid"), token);
        let mutated = mutate(text.into_bytes(), &changes);
        if let Ok(s) = String::from_utf8(mutated) {
            if let Ok(t) = InviteToken::decode(&s) {
                prop_assert_eq!(InviteToken::decode(&t.encode()).expect("again"), t);
            }
        }
    }
}
