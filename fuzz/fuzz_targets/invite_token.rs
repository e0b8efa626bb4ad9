//! Invite tokens as a user pastes them.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(token) = gpunode_protocol::team::InviteToken::decode(text) {
            let _ = token.check_fresh(1_800_000_000_000);
            let _ = token.join_keypair();
        }
    }
});
