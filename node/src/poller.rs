//! The inventory poller: reads the GPUs (NVML or simulated) off the event loop, applies
//! the owner's rules and meters jobs' GPU use, and sends snapshots that changed.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};

use crate::inventory::{GpuInventory, InventorySnapshot};

/// Reads the inventory and applies the owner's rules: which GPU processes are jobs',
/// lending hours, the memory cap.
pub(crate) struct InventoryReader {
    inventory: Arc<dyn GpuInventory>,
    pub(crate) rules: crate::owner::OwnerRules,
    lease_jobs: crate::jobs::LeaseJobs,
    /// When the last snapshot was read: each one meters the time since.
    last_read: std::sync::Mutex<Option<std::time::Instant>>,
}

impl InventoryReader {
    /// A reader of `inventory` under the owner's `rules`; jobs' GPU processes come
    /// from `lease_jobs`.
    pub(crate) fn new(
        inventory: Arc<dyn GpuInventory>,
        rules: crate::owner::OwnerRules,
        lease_jobs: crate::jobs::LeaseJobs,
    ) -> InventoryReader {
        InventoryReader {
            inventory,
            rules,
            lease_jobs,
            last_read: std::sync::Mutex::new(None),
        }
    }

    /// One snapshot with the owner's rules applied.
    pub(crate) async fn read(&self) -> InventorySnapshot {
        let inv = self.inventory.clone();
        let mut snap = match tokio::task::spawn_blocking(move || inv.snapshot()).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                tracing::warn!("{e}");
                InventorySnapshot {
                    gpus: Vec::new(),
                    driver_version: None,
                    source: "none".into(),
                }
            }
            Err(_) => InventorySnapshot {
                gpus: Vec::new(),
                driver_version: None,
                source: "none".into(),
            },
        };
        let now = std::time::Instant::now();
        let since = self
            .last_read
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .replace(now)
            .map_or(0, |t| now.duration_since(t).as_millis() as u64);
        let job_pids = self.lease_jobs.meter(&snap, since);
        self.rules
            .apply(&mut snap, &job_pids, gpunode_protocol::time::now_ms());
        snap
    }
}

/// Reads the inventory every `every` and sends each snapshot that changed.
pub(crate) async fn poll_inventory(
    reader: Arc<InventoryReader>,
    every: Duration,
    out: mpsc::Sender<InventorySnapshot>,
    mut stop: watch::Receiver<bool>,
) {
    let mut last: Option<InventorySnapshot> = None;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.changed() => return,
        }
        let snap = reader.read().await;
        if last.as_ref() != Some(&snap) {
            last = Some(snap.clone());
            if out.send(snap).await.is_err() {
                return;
            }
        }
    }
}

/// CPU cores of this machine.
pub(crate) fn host_cpu_cores() -> u32 {
    std::thread::available_parallelism()
        .map(|n| n.get() as u32)
        .unwrap_or(1)
}

/// RAM of this machine, bytes (0 when unknown).
pub(crate) fn host_ram_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}
