//! Settlement batches (claims with receipts) and their replies.
#![no_main]
use gpunode_protocol::encoding::decode;
use gpunode_protocol::receipt::{SettleReply, MAX_SETTLE_MESSAGE_BYTES};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(gpunode_protocol::receipt::SettleMsg::Claims(claims)) =
        gpunode_protocol::receipt::decode_settle_msg(data)
    {
        for c in &claims {
            let _ = c.receipt.verify(&c.receipt.provider, &c.provider_sig);
        }
    }
    let _ = decode::<SettleReply>(data, MAX_SETTLE_MESSAGE_BYTES);
});
