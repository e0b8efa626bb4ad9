//! Simulated GPUs for test networks, scriptable by tests (owner processes, utilization).
//!
//! A spec such as `2xA100-80GB,1xT4-16GB` makes three GPUs; the memory is the last
//! `-NNGB` part of each model. Everything they report carries `simulated: true`.

use std::sync::{Arc, Mutex};

use gpunode_protocol::gpu::{GpuInfo, GpuProcess, GpuState};

use super::{GpuInventory, InventoryError, InventorySnapshot};

/// Why a simulated-GPU spec is invalid.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid simulated GPU spec '{spec}': {problem}; write e.g. 2xA100-80GB,1xT4-16GB")]
pub struct SpecError {
    spec: String,
    problem: String,
}

#[derive(Debug, Clone)]
struct SimGpu {
    info: GpuInfo,
}

/// A scripted set of GPUs. Clones share state, so a test can keep one and change what
/// the node sees.
#[derive(Debug, Clone)]
pub struct SimulatedGpus {
    gpus: Arc<Mutex<Vec<SimGpu>>>,
}

/// `3x2g.20gb` → (3, "2g.20gb", 20 GiB): MIG slices of one simulated GPU.
fn parse_mig(text: &str) -> Result<(u32, String, u64), String> {
    let bad = || format!("'{text}' is not a MIG split like 3x2g.20gb");
    let (n, profile) = text.split_once(['x', 'X']).ok_or_else(bad)?;
    let n: u32 = n.parse().map_err(|_| bad())?;
    let mem = profile
        .split_once('.')
        .and_then(|(_, m)| gpunode_protocol::units::parse_bytes(m).ok())
        .filter(|m| *m >= 1 << 30)
        .ok_or_else(bad)?;
    if n == 0 || n > 7 {
        return Err(format!("'{text}': a GPU has 1 to 7 MIG slices"));
    }
    Ok((n, profile.to_string(), mem))
}

impl SimulatedGpus {
    /// Parses a spec into (count, model, memory bytes) entries. A model may end in
    /// `@NxPROFILE` (`A100-80GB@3x2g.20gb`): that GPU runs in MIG mode, split into N
    /// slices of the profile, each a leasable unit of its own.
    pub fn parse_spec(spec: &str) -> Result<Vec<(u32, String, u64)>, SpecError> {
        let fail = |problem: String| SpecError {
            spec: spec.to_string(),
            problem,
        };
        let mut out = Vec::new();
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (count, model) = match part.split_once(['x', 'X']) {
                Some((n, m)) if !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()) => (
                    n.parse::<u32>()
                        .map_err(|_| fail(format!("bad count in '{part}'")))?,
                    m,
                ),
                _ => (1, part),
            };
            if count == 0 || count > 64 {
                return Err(fail(format!("count in '{part}' must be 1 to 64")));
            }
            let (whole, mig) = match model.split_once('@') {
                Some((w, m)) => (w, Some(m)),
                None => (model, None),
            };
            let mem = whole
                .rsplit_once('-')
                .and_then(|(_, m)| gpunode_protocol::units::parse_bytes(m).ok())
                .filter(|m| *m >= 1 << 30)
                .ok_or_else(|| fail(format!("'{whole}' has no memory size such as -80GB")))?;
            if let Some(mig) = mig {
                let (n, _, slice_mem) = parse_mig(mig).map_err(fail)?;
                if slice_mem.saturating_mul(n as u64) > mem {
                    return Err(fail(format!(
                        "{n} slices of {mig} need more memory than {whole} has"
                    )));
                }
            }
            out.push((count, model.to_string(), mem));
        }
        if out.is_empty() {
            return Err(fail("it lists no GPUs".to_string()));
        }
        Ok(out)
    }

    /// Builds simulated GPUs from a spec; `seed` makes their UUIDs unique per node.
    pub fn from_spec(spec: &str, seed: &str) -> Result<SimulatedGpus, SpecError> {
        let mut gpus = Vec::new();
        let short: String = seed.chars().rev().take(8).collect();
        let mut device = 0u32;
        for (count, model, mem) in SimulatedGpus::parse_spec(spec)? {
            for _ in 0..count {
                let index = device;
                device += 1;
                let (whole, slices) = match model.split_once('@') {
                    Some((w, m)) => {
                        let (n, profile, slice_mem) =
                            parse_mig(m).map_err(|problem| SpecError {
                                spec: spec.to_string(),
                                problem,
                            })?;
                        let units = (0..n)
                            .map(|i| {
                                (
                                    format!("MIG-sim-{short}-{index}-{i}"),
                                    format!("{w} MIG {profile}"),
                                    slice_mem,
                                )
                            })
                            .collect();
                        (w.to_string(), Some(units))
                    }
                    None => (model.clone(), None),
                };
                let units: Vec<(String, String, u64)> = slices.clone().unwrap_or_else(|| {
                    vec![(format!("GPU-sim-{short}-{index}"), whole.clone(), mem)]
                });
                for (uuid, name, memory) in units {
                    gpus.push(SimGpu {
                        info: GpuInfo {
                            index,
                            uuid,
                            name,
                            memory_total_bytes: memory,
                            memory_used_bytes: 0,
                            utilization_percent: 0,
                            mig_enabled: Some(slices.is_some()),
                            compute_capability: None,
                            temperature_c: Some(35),
                            power_w: None,
                            ecc_uncorrected: Some(0),
                            processes: Vec::new(),
                            state: GpuState::Idle,
                            simulated: true,
                        },
                    });
                }
            }
        }
        Ok(SimulatedGpus {
            gpus: Arc::new(Mutex::new(gpus)),
        })
    }

    fn with<R>(&self, f: impl FnOnce(&mut Vec<SimGpu>) -> R) -> R {
        let mut guard = self.gpus.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut guard)
    }

    /// Scripts an owner process (`Some(pid)`) on GPU `index`, or removes it (`None`).
    /// An owner process makes the GPU busy.
    pub fn set_owner_process(&self, index: u32, pid: Option<u32>, memory_bytes: u64) {
        self.with(|gpus| {
            if let Some(g) = gpus.get_mut(index as usize) {
                g.info.processes = pid
                    .map(|pid| {
                        vec![GpuProcess {
                            pid,
                            used_memory_bytes: Some(memory_bytes),
                            sm_util_percent: Some(100),
                        }]
                    })
                    .unwrap_or_default();
                g.info.memory_used_bytes = if pid.is_some() { memory_bytes } else { 0 };
                g.info.utilization_percent = if pid.is_some() { 100 } else { 0 };
                g.info.state = if pid.is_some() {
                    GpuState::OwnerBusy
                } else {
                    GpuState::Idle
                };
            }
        });
    }
}

impl SimulatedGpus {
    /// Scripts the readings of GPU `index`: temperature (°C), uncorrected ECC errors
    /// and utilization (percent).
    pub fn set_readings(&self, index: u32, temperature_c: u32, ecc_uncorrected: u64, util: u32) {
        self.with(|gpus| {
            if let Some(g) = gpus.get_mut(index as usize) {
                g.info.temperature_c = Some(temperature_c);
                g.info.ecc_uncorrected = Some(ecc_uncorrected);
                g.info.utilization_percent = util;
            }
        });
    }

    /// Scripts a process of a gpunode job (`pid`) on GPU `index` using `memory_bytes`
    /// and `util` percent of it, as NVML would list it; `None` removes the job's
    /// processes. The owner's processes stay.
    pub fn set_job_process(&self, index: u32, pid: u32, use_: Option<(u64, u32)>) {
        self.with(|gpus| {
            if let Some(g) = gpus.get_mut(index as usize) {
                g.info.processes.retain(|p| p.pid != pid);
                if let Some((memory_bytes, util)) = use_ {
                    g.info.processes.push(GpuProcess {
                        pid,
                        used_memory_bytes: Some(memory_bytes),
                        sm_util_percent: Some(util),
                    });
                }
                g.info.memory_used_bytes = g
                    .info
                    .processes
                    .iter()
                    .filter_map(|p| p.used_memory_bytes)
                    .sum();
                g.info.utilization_percent = g
                    .info
                    .processes
                    .iter()
                    .filter_map(|p| p.sm_util_percent)
                    .sum::<u32>()
                    .min(100);
            }
        });
    }
}

impl GpuInventory for SimulatedGpus {
    fn snapshot(&self) -> Result<InventorySnapshot, InventoryError> {
        Ok(InventorySnapshot {
            gpus: self.with(|g| g.iter().map(|s| s.info.clone()).collect()),
            driver_version: None,
            source: "simulated".to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_parses_counts_models_and_memory() {
        let s = SimulatedGpus::parse_spec("2xA100-80GB, 1xT4-16GB").expect("parse");
        assert_eq!(
            s,
            vec![
                (2, "A100-80GB".into(), 80 << 30),
                (1, "T4-16GB".into(), 16 << 30)
            ]
        );
        assert_eq!(
            SimulatedGpus::parse_spec("H100-80G").expect("parse")[0].0,
            1
        );
        for bad in ["", "2xA100", "0xA100-80GB", "2xA100-1K", "99xA100-80GB"] {
            assert!(SimulatedGpus::parse_spec(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_mig_gpu_is_split_into_slices_behind_its_device() {
        let sim =
            SimulatedGpus::from_spec("1xA100-80GB@3x2g.20gb,1xT4-16GB", "peer").expect("spec");
        let snap = sim.snapshot().expect("snapshot");
        let units: Vec<(u32, &str, u64)> = snap
            .gpus
            .iter()
            .map(|g| (g.index, g.name.as_str(), g.memory_total_bytes))
            .collect();
        assert_eq!(
            units,
            vec![
                (0, "A100-80GB MIG 2g.20gb", 20 << 30),
                (0, "A100-80GB MIG 2g.20gb", 20 << 30),
                (0, "A100-80GB MIG 2g.20gb", 20 << 30),
                (1, "T4-16GB", 16 << 30),
            ]
        );
        assert!(snap.gpus[0].uuid.starts_with("MIG-sim-"));
        assert_eq!(snap.gpus[0].mig_enabled, Some(true));
        for bad in [
            "1xA100-80GB@5x2g.20gb",
            "1xA100-80GB@2g.20gb",
            "1xA100-80GB@9x1g.5gb",
        ] {
            let err = SimulatedGpus::parse_spec(bad).expect_err(bad).to_string();
            assert!(
                err.contains("MIG") || err.contains("memory"),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn owner_process_makes_gpu_busy_and_everything_is_simulated() {
        let sim = SimulatedGpus::from_spec("2xA100-80GB", "peer").expect("spec");
        sim.set_owner_process(1, Some(42), 1 << 30);
        let snap = sim.snapshot().expect("snap");
        assert!(snap.simulated());
        assert!(snap.gpus.iter().all(|g| g.simulated));
        assert_eq!(snap.gpus[0].state, GpuState::Idle);
        assert_eq!(snap.gpus[1].state, GpuState::OwnerBusy);
        assert_ne!(snap.gpus[0].uuid, snap.gpus[1].uuid);
        sim.set_owner_process(1, None, 0);
        assert_eq!(sim.snapshot().expect("snap").gpus[1].state, GpuState::Idle);
    }
}
