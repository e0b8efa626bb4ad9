//! Team documents a member or an inviter sends: certificates, syncs (revocation lists,
//! policies), join requests and replies; each decoded one is verified against a team.
#![no_main]
use gpunode_protocol::encoding::decode;
use gpunode_protocol::team::{
    JoinReply, JoinRequest, SignedCertificate, SignedPolicy, SignedRevocations, TeamId, TeamSync,
    MAX_TEAM_MESSAGE_BYTES,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let key = [8u8, 1, 18, 32, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18,
        19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32];
    let team = TeamId::of_key(&key);
    let now = 1_800_000_000_000;
    if let Ok(c) = SignedCertificate::decode(data) {
        let _ = c.verify(&team, &key, now);
    }
    if let Ok(sync) = decode::<TeamSync>(data, MAX_TEAM_MESSAGE_BYTES) {
        for r in &sync.revocations {
            let _ = r.verify(&team, &key, now);
        }
        if let Some(p) = &sync.policy {
            let _ = p.verify(&team, &key, now);
        }
    }
    let _ = decode::<SignedRevocations>(data, MAX_TEAM_MESSAGE_BYTES);
    let _ = decode::<SignedPolicy>(data, MAX_TEAM_MESSAGE_BYTES);
    if let Ok(j) = decode::<JoinRequest>(data, MAX_TEAM_MESSAGE_BYTES) {
        let _ = j.verify(&j.member);
    }
    let _ = decode::<JoinReply>(data, MAX_TEAM_MESSAGE_BYTES);
});
