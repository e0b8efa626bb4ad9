//! A signed advert record as it arrives from the DHT, for any claimed publisher.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let publisher = libp2p_identity::PeerId::from_bytes(&[0, 2, 8, 1])
        .unwrap_or_else(|_| libp2p_identity::PeerId::random());
    let _ = gpunode_protocol::advert::verify_advert(data, &publisher, 1_800_000_000_000);
});
