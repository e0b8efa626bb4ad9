//! GPU inventory: what GPUs this machine has and what state they are in.
//!
//! One small interface, [`GpuInventory`], with two implementations: [`NvmlInventory`]
//! reads real NVIDIA GPUs through NVML, and [`SimulatedGpus`] serves scripted GPUs for
//! test networks (always marked simulated). Policies that care about GPU state (owner
//! presence, idle detection) read snapshots through the interface and so work on both.

mod nvml;
mod simulated;

pub use nvml::NvmlInventory;
pub use simulated::{SimulatedGpus, SpecError};

use gpunode_protocol::gpu::GpuInfo;

/// A point-in-time view of the local GPUs.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct InventorySnapshot {
    /// The GPUs, by index.
    pub gpus: Vec<GpuInfo>,
    /// Driver version, when a real driver answered.
    pub driver_version: Option<String>,
    /// Where the data came from: `nvml`, `simulated` or `none`.
    pub source: String,
}

impl InventorySnapshot {
    /// True when the GPUs are simulated.
    pub fn simulated(&self) -> bool {
        self.source == "simulated"
    }
}

/// Why the inventory could not be read.
#[derive(Debug, thiserror::Error)]
#[error("GPU inventory: {0}")]
pub struct InventoryError(pub String);

/// Anything that can report the local GPUs.
pub trait GpuInventory: Send + Sync + 'static {
    /// Reads the current state of every GPU.
    fn snapshot(&self) -> Result<InventorySnapshot, InventoryError>;
}

/// An inventory for machines without NVIDIA GPUs: reports none.
#[derive(Debug, Default)]
pub struct NoGpus;

impl GpuInventory for NoGpus {
    fn snapshot(&self) -> Result<InventorySnapshot, InventoryError> {
        Ok(InventorySnapshot {
            gpus: Vec::new(),
            driver_version: None,
            source: "none".to_string(),
        })
    }
}

/// Picks the inventory for a node: simulated when a spec is given, NVML when a driver
/// answers, otherwise none (said once, plainly, in the log).
pub fn detect(simulate: Option<&str>, seed: &str) -> Result<Box<dyn GpuInventory>, SpecError> {
    if let Some(spec) = simulate {
        return Ok(Box::new(SimulatedGpus::from_spec(spec, seed)?));
    }
    match NvmlInventory::init() {
        Ok(inv) => Ok(Box::new(inv)),
        Err(reason) => {
            tracing::info!("found no NVIDIA GPUs ({reason}); serving CPU-only");
            Ok(Box::new(NoGpus))
        }
    }
}
