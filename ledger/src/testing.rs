//! Receipts for tests of this crate and of its users (feature `testing`).

use gpunode_protocol::lease::LeaseId;
use gpunode_protocol::receipt::{
    amount_for, lease_output_digest, SettledReceipt, UsageReceipt, RECEIPT_VERSION,
};
use libp2p::identity::Keypair;

/// A receipt for lease `[lease; 16]` in which `provider` served `requester` for
/// `billed_ms` at one credit a GPU-second, signed by both.
pub fn settled(
    provider: &Keypair,
    requester: &Keypair,
    lease: u8,
    billed_ms: u64,
) -> SettledReceipt {
    let receipt = UsageReceipt {
        version: RECEIPT_VERSION,
        lease_id: LeaseId([lease; 16]),
        provider: provider.public().to_peer_id(),
        requester: requester.public().to_peer_id(),
        gpus: 1,
        cpus: 1,
        mem_bytes: 0,
        start_ms: 1_000,
        end_ms: 1_000 + billed_ms,
        billed_ms,
        gpu_ms: billed_ms,
        cpu_ms: billed_ms,
        jobs: 1,
        exit_status: "exited 0".into(),
        output_digest: lease_output_digest(&[]),
        price_per_gpu_hour_millicredits: 3_600_000,
        amount_millicredits: amount_for(3_600_000, 1, billed_ms),
        issued_at_ms: 1_000 + billed_ms,
        peak_gpu_memory_bytes: 0,
    };
    SettledReceipt {
        provider_sig: receipt.sign(provider).expect("sign"),
        requester_sig: receipt.sign(requester).expect("sign"),
        receipt,
    }
}
