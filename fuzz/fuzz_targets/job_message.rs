//! Job stream messages (the body of a message frame), both directions.
#![no_main]
use gpunode_protocol::encoding::decode;
use gpunode_protocol::job::{ProviderMsg, RequesterMsg, MAX_MESSAGE_BYTES};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = decode::<RequesterMsg>(data, MAX_MESSAGE_BYTES);
    if let Ok(ProviderMsg::Finished(report)) = decode::<ProviderMsg>(data, MAX_MESSAGE_BYTES) {
        for f in &report.outputs {
            let _ = gpunode_protocol::job::check_relative_path(&f.path);
        }
    }
});
