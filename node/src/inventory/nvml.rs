//! Real GPUs through NVML (nvml-wrapper loads the driver library at run time).

use gpunode_protocol::gpu::{GpuInfo, GpuProcess, GpuState};
use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError, TemperatureSensor};
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};

use super::{GpuInventory, InventoryError, InventorySnapshot};

/// Reads GPUs from the NVIDIA driver.
pub struct NvmlInventory {
    nvml: Nvml,
}

impl std::fmt::Debug for NvmlInventory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NvmlInventory")
    }
}

impl NvmlInventory {
    /// Loads NVML; fails when there is no driver or no GPU.
    pub fn init() -> Result<NvmlInventory, String> {
        let nvml = Nvml::init().map_err(|e| e.to_string())?;
        let count = nvml.device_count().map_err(|e| e.to_string())?;
        if count == 0 {
            return Err("the NVIDIA driver reports no devices".to_string());
        }
        Ok(NvmlInventory { nvml })
    }
}

impl GpuInventory for NvmlInventory {
    fn snapshot(&self) -> Result<InventorySnapshot, InventoryError> {
        let err = |e: NvmlError| InventoryError(e.to_string());
        let count = self.nvml.device_count().map_err(err)?;
        let mut gpus = Vec::with_capacity(count as usize);
        for index in 0..count {
            let dev = self.nvml.device_by_index(index).map_err(err)?;
            let mig_on = dev.mig_mode().is_ok_and(|m| m.current == 1);
            let minor = dev.minor_number().ok();
            if mig_on {
                // A GPU in MIG mode lends its instances, each a unit of its own (named
                // `... MIG 1g.18gb`), behind the parent's device node.
                let slots = dev.mig_device_count().unwrap_or(0);
                for slot in 0..slots {
                    if let Ok(mig) = dev.mig_device_by_index(slot) {
                        gpus.push(info_of(&mig, index, minor, Some(true)).map_err(err)?);
                    }
                }
            } else {
                let mig = dev.mig_mode().ok().map(|m| m.current == 1);
                gpus.push(info_of(&dev, index, minor, mig).map_err(err)?);
            }
        }
        Ok(InventorySnapshot {
            gpus,
            driver_version: self.nvml.sys_driver_version().ok(),
            source: "nvml".to_string(),
        })
    }
}

/// One GPU, or one MIG instance of GPU `index`, as the driver reports it.
fn info_of(
    dev: &Device,
    index: u32,
    parent_minor: Option<u32>,
    mig_enabled: Option<bool>,
) -> Result<GpuInfo, NvmlError> {
    let memory = dev.memory_info()?;
    // Per-process compute use over the driver's recent samples (the newest sample of
    // each process).
    let mut sm_util = std::collections::HashMap::new();
    for sample in dev.process_utilization_stats(None).unwrap_or_default() {
        let newest = sm_util.entry(sample.pid).or_insert((0u64, 0u32));
        if sample.timestamp >= newest.0 {
            *newest = (sample.timestamp, sample.sm_util);
        }
    }
    let mut processes: Vec<GpuProcess> = dev
        .running_compute_processes()
        .unwrap_or_default()
        .into_iter()
        .chain(dev.running_graphics_processes().unwrap_or_default())
        .map(|p| GpuProcess {
            pid: p.pid,
            used_memory_bytes: match p.used_gpu_memory {
                UsedGpuMemory::Used(b) => Some(b),
                UsedGpuMemory::Unavailable => None,
            },
            sm_util_percent: sm_util.get(&p.pid).map(|(_, u)| *u),
        })
        .collect();
    processes.sort_by_key(|p| p.pid);
    processes.dedup_by_key(|p| p.pid);
    let state = if processes.is_empty() {
        GpuState::Idle
    } else {
        GpuState::OwnerBusy
    };
    Ok(GpuInfo {
        // The device node (`/dev/nvidiaN`) a job is given is named by the minor number,
        // which NVML's enumeration order need not match.
        index: parent_minor.unwrap_or(index),
        uuid: dev.uuid()?,
        name: dev.name()?,
        memory_total_bytes: memory.total,
        memory_used_bytes: memory.used,
        utilization_percent: dev.utilization_rates().map(|u| u.gpu).unwrap_or(0),
        mig_enabled,
        compute_capability: dev
            .cuda_compute_capability()
            .ok()
            .map(|c| (c.major.max(0) as u32, c.minor.max(0) as u32)),
        temperature_c: dev.temperature(TemperatureSensor::Gpu).ok(),
        power_w: dev.power_usage().ok().map(|mw| mw / 1000),
        ecc_uncorrected: dev
            .total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
            .ok(),
        processes,
        state,
        simulated: false,
    })
}
