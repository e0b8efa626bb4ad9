//! What this host has for container jobs: per-job uids no process uses, how many
//! threads a user runs (what `RLIMIT_NPROC` counts), programs on PATH and the NVIDIA
//! user-space driver files.

use std::path::PathBuf;
use std::sync::atomic::Ordering;

use super::NEXT_JOB;
use crate::container::procs::effective_uid;

/// First uid of the per-job uids used when running as root.
const JOB_UID_BASE: u32 = 200_000;
/// How many per-job uids there are before they are reused.
const JOB_UIDS: u32 = 50_000;

/// Each running process: its uid and how many threads it has.
fn processes() -> Vec<(u32, usize)> {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.parse::<u32>().is_ok())
        })
        .filter_map(|e| {
            let uid = e.metadata().ok()?.uid();
            let threads = std::fs::read_dir(e.path().join("task")).map_or(1, |t| t.count());
            Some((uid, threads))
        })
        .collect()
}

/// The uids of the processes running now.
fn process_uids() -> Vec<u32> {
    processes().into_iter().map(|(uid, _)| uid).collect()
}

/// Threads of this uid now (what `RLIMIT_NPROC` counts), for the fallback without a
/// per-job uid.
pub(super) fn processes_of_this_user() -> usize {
    let uid = effective_uid();
    processes()
        .into_iter()
        .filter(|(u, _)| *u == uid)
        .map(|(_, threads)| threads)
        .sum()
}

/// Per-job uids handed out by this process and not yet released (a job between picking
/// its uid and starting its first process shows no process yet).
static HELD_UIDS: std::sync::Mutex<Vec<u32>> = std::sync::Mutex::new(Vec::new());

/// Releases a held per-job uid when the job ends.
pub(super) struct UidHold(pub(super) u32);

impl Drop for UidHold {
    fn drop(&mut self) {
        HELD_UIDS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|u| *u != self.0);
    }
}

/// A per-job uid no process runs as now and no other job of this process holds (so
/// `RLIMIT_NPROC` counts this job alone), starting from a point that differs between
/// jobs and between processes.
pub(super) fn free_job_uid() -> u32 {
    let mut held = HELD_UIDS.lock().unwrap_or_else(|p| p.into_inner());
    let mut busy: std::collections::HashSet<u32> = process_uids().into_iter().collect();
    busy.extend(held.iter().copied());
    let start = NEXT_JOB.fetch_add(1, Ordering::Relaxed) ^ (std::process::id() << 8);
    let uid = (0..JOB_UIDS)
        .map(|i| JOB_UID_BASE + start.wrapping_add(i) % JOB_UIDS)
        .find(|uid| !busy.contains(uid))
        .unwrap_or(JOB_UID_BASE);
    held.push(uid);
    uid
}

pub(super) fn find_in_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// The NVIDIA user-space driver on this host: `libcuda`, `libnvidia-*` and `nvidia-smi`,
/// as the dynamic loader's cache and the usual directories list them.
pub fn nvidia_driver_files() -> Vec<PathBuf> {
    let mut files = Vec::new();
    let dirs = [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/local/nvidia/lib64",
    ];
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let wanted = name.starts_with("libcuda.so")
                || name.starts_with("libnvidia-ml.so")
                || name.starts_with("libnvidia-ptxjitcompiler.so")
                || name.starts_with("libnvidia-nvvm.so")
                || name.starts_with("libcudadebugger.so");
            if wanted {
                files.push(entry.path());
            }
        }
    }
    if let Some(smi) = find_in_path("nvidia-smi") {
        files.push(smi);
    }
    files.sort();
    files.dedup();
    files
}
