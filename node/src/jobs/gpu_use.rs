//! GPU use of running jobs, from inventory snapshots: for each job the time a process of
//! it was on each leased GPU (GPU-milliseconds), its peak GPU memory and its latest
//! compute use. The numbers come from the driver's process lists (NVML), which name host
//! pids; a job's processes are its sandbox's process tree.

use std::collections::HashSet;

use gpunode_protocol::job::GpuUse;

use crate::inventory::InventorySnapshot;

/// Adds one sample covering `dt_ms` to `usage`: what the processes `pids` do on the
/// GPUs `leased` (by uuid) in `snap`.
pub fn sample(
    usage: &mut GpuUse,
    snap: &InventorySnapshot,
    leased: &[String],
    pids: &HashSet<u32>,
    dt_ms: u64,
) {
    usage.samples = usage.samples.saturating_add(1);
    let (mut memory, mut util) = (0u64, 0u32);
    for gpu in snap.gpus.iter().filter(|g| leased.contains(&g.uuid)) {
        let mine: Vec<_> = gpu
            .processes
            .iter()
            .filter(|p| pids.contains(&p.pid))
            .collect();
        if mine.is_empty() {
            continue;
        }
        usage.gpu_ms = usage.gpu_ms.saturating_add(dt_ms);
        memory += mine.iter().filter_map(|p| p.used_memory_bytes).sum::<u64>();
        let reported: Vec<u32> = mine.iter().filter_map(|p| p.sm_util_percent).collect();
        util += if reported.is_empty() {
            // Only the leased GPUs are visible to the job: the GPU's use is the job's.
            gpu.utilization_percent
        } else {
            reported.iter().sum::<u32>()
        }
        .min(100);
    }
    usage.peak_memory_bytes = usage.peak_memory_bytes.max(memory);
    usage.utilization_percent = util / (leased.len().max(1) as u32);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::{GpuInventory, SimulatedGpus};

    #[test]
    fn only_the_jobs_processes_on_its_gpus_count() {
        let sim = SimulatedGpus::from_spec("3xA100-80GB", "peer").expect("spec");
        // The job (pids 10, 11) on GPU 0, a process of another job (20) on GPU 1, the
        // job again on GPU 2, which it did not lease.
        sim.set_job_process(0, 10, Some((4 << 30, 60)));
        sim.set_job_process(0, 11, Some((1 << 30, 20)));
        sim.set_job_process(1, 20, Some((8 << 30, 90)));
        sim.set_job_process(2, 10, Some((2 << 30, 50)));
        let snap = sim.snapshot().expect("snapshot");
        let uuids: Vec<String> = snap.gpus.iter().map(|g| g.uuid.clone()).collect();
        let leased = vec![uuids[0].clone(), uuids[1].clone()];
        let pids: HashSet<u32> = [10, 11].into_iter().collect();
        let mut usage = GpuUse::default();
        sample(&mut usage, &snap, &leased, &pids, 2000);
        sample(&mut usage, &snap, &leased, &pids, 2000);
        assert_eq!(
            usage.gpu_ms, 4000,
            "present on one leased GPU for two samples"
        );
        assert_eq!(usage.peak_memory_bytes, 5 << 30);
        assert_eq!(
            usage.utilization_percent, 40,
            "80% on one of two leased GPUs"
        );
        assert_eq!(usage.samples, 2);

        sim.set_job_process(0, 10, None);
        sim.set_job_process(0, 11, None);
        let idle = sim.snapshot().expect("snapshot");
        sample(&mut usage, &idle, &leased, &pids, 2000);
        assert_eq!(usage.gpu_ms, 4000, "no process, no GPU time");
        assert_eq!(usage.peak_memory_bytes, 5 << 30, "the peak stays");
        assert_eq!(usage.utilization_percent, 0);
    }
}
