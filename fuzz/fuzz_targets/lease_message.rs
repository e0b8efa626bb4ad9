//! Lease protocol requests and replies as a peer sends them.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = gpunode_protocol::lease::decode_message(data);
    let _ = gpunode_protocol::lease::decode_reply(data);
});
