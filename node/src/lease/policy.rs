//! What a provider has to lend and the rules under which it lends it.

use gpunode_protocol::PeerId;

/// One GPU a provider could lend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuSlot {
    /// Index on this machine.
    pub index: u32,
    /// Stable identifier.
    pub uuid: String,
    /// Product name.
    pub model: String,
    /// Memory, bytes.
    pub memory_bytes: u64,
    /// False while the owner uses it.
    pub available: bool,
}

/// Everything a provider has to lend, before leases.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Capacity {
    /// The GPUs.
    pub gpus: Vec<GpuSlot>,
    /// CPU cores.
    pub cpus: u32,
    /// RAM, bytes.
    pub mem_bytes: u64,
}

/// A provider's rules for what it accepts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeasePolicy {
    /// Longest lease, including renewals, ms.
    pub max_duration_ms: u64,
    /// Price per GPU-hour, thousandths of a credit.
    pub price_per_gpu_hour_millicredits: u64,
    /// Executors offered.
    pub backends: Vec<String>,
    /// Most GPUs one peer may hold at once.
    pub max_gpus_per_peer: u32,
    /// When not empty, only these peers may lease.
    pub allow_peers: Vec<PeerId>,
    /// These peers may never lease.
    pub deny_peers: Vec<PeerId>,
    /// How long an offer holds resources waiting for the accept, ms.
    pub offer_window_ms: u64,
    /// How long ended leases (completed, cancelled, failed) are kept, ms; offers that
    /// expired unsigned are kept at most an hour.
    pub retention_ms: u64,
}

impl Default for LeasePolicy {
    fn default() -> Self {
        LeasePolicy {
            max_duration_ms: 24 * 3600 * 1000,
            price_per_gpu_hour_millicredits: 1000,
            backends: vec!["wasm".to_string()],
            max_gpus_per_peer: u32::MAX,
            allow_peers: Vec::new(),
            deny_peers: Vec::new(),
            offer_window_ms: 10_000,
            retention_ms: 30 * 86_400_000,
        }
    }
}

/// Most GPUs one peer may hold at once when the config does not say: outside a team,
/// half of this machine's GPUs (at least one), so that no stranger can hold the whole
/// machine; inside a team no per-peer cap (the team policy's quotas apply).
pub fn default_max_gpus_per_peer(gpus: usize, in_team: bool) -> u32 {
    if in_team {
        return u32::MAX;
    }
    u32::try_from(gpus / 2).unwrap_or(u32::MAX).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stranger_never_holds_the_whole_machine_by_default() {
        assert_eq!(default_max_gpus_per_peer(0, false), 1);
        assert_eq!(default_max_gpus_per_peer(1, false), 1);
        assert_eq!(default_max_gpus_per_peer(2, false), 1);
        assert_eq!(default_max_gpus_per_peer(8, false), 4);
        assert_eq!(default_max_gpus_per_peer(8, true), u32::MAX);
    }
}
